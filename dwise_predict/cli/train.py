"""Typer commands `train` and `compare-regressors` (thin: validate, call the library, print)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, SeedOption, TracesArgument, console, log
from dwise_predict.cli.progress import ProgressLines
from dwise_predict.errors import ConfigError
from dwise_predict.evaluation.document import fmt, fmt_interval
from dwise_predict.text import terminal
from dwise_predict.training import TrainConfig

_DEFAULT = TrainConfig()


def train_command(
    traces: TracesArgument,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory to create (must not exist unless --overwrite).")],
    seed: SeedOption = _DEFAULT.seed,
    max_epochs: Annotated[int, typer.Option(help="Most epochs per ensemble member (early stopping usually ends sooner).")] = _DEFAULT.max_epochs,
    patience: Annotated[int, typer.Option(help="Epochs without a better validation loss before a member stops.")] = _DEFAULT.patience,
    members: Annotated[int, typer.Option(help="Survival MLPs in the seed ensemble.")] = _DEFAULT.members,
    width: Annotated[int, typer.Option(help="Hidden units of each survival MLP.")] = _DEFAULT.width,
    lr: Annotated[float, typer.Option(help="Adam learning rate of the survival MLPs.")] = _DEFAULT.lr,
    batch_size: Annotated[int, typer.Option(help="Requests per optimisation step.")] = _DEFAULT.batch_size,
    val_fraction: Annotated[float, typer.Option(help="Share of the train split held out for early stopping.")] = _DEFAULT.val_fraction,
    refine: Annotated[str, typer.Option(help="Refinement predictor to ship: auto (pick by grouped K-fold CV on the train split: overall rho of the calibrated out-of-fold estimates, within-category rho breaking near-ties), survival (the paper's ensemble), ridge, survival+ridge, survival-pca, ridge-within or ridge-within+signals (see docs/training.md).")] = _DEFAULT.refine,
    cv_folds: Annotated[int, typer.Option(help="Folds of the cross-validation that --refine auto uses.")] = _DEFAULT.cv_folds,
    cv_members: Annotated[int, typer.Option(help="Members of the network candidates' fold fits in that cross-validation (0: all --members). 2 of 3 cut train's CPU time by about a quarter, and changed the choice on 4 of 18 synthetic sets (docs/training.md).")] = _DEFAULT.cv_members,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="Leave this category out of training (both predictors and calibration); repeatable. The eval split keeps it (reported as held out).")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads for torch and LightGBM (fixed for reproducible bytes; 1 is fastest on shared cores).")] = _DEFAULT.num_threads,
    jobs: Annotated[Optional[int], typer.Option(help="Threads for the refinement candidates' cross-validation (1 or 2; more adds nothing; default: 2 when the cores hold two of --threads). The run does not depend on it.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="JSON file of training options (e.g. a run's config.json) instead of the flags above.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run directory (only once the new run is complete).")] = False,
    json_out: JsonOption = False,
) -> None:
    """Train the admission (LightGBM) and refinement (calibrated, one of several candidates) predictors.

    Fits on the traces' train split, reports on their eval split, and writes the run directory
    (config.json, metrics.json, admission.txt/.json, refine.safetensors/.json, calibration.json,
    candidates.json, curves.json/.png). With --refine auto (default) the refinement predictor is the
    candidate whose grouped K-fold CV estimates on the train split rank all requests best (overall rho,
    calibrated as the scheduler sees them; within 0.01 of the best, the best within-category rho): the paper's
    survival ensemble, a ridge head, both, the ensemble on principal components, or a two-stage
    ridge, alone or blended with random-feature ridges on the early signals; every one exports
    under the same bundle contract. The directory appears only when complete; after an
    interruption, rerun the same command.

    Examples:

        dwise-predict train traces/ --out run/

        dwise-predict train traces/ --out run/ --seed 1 --max-epochs 50 --json

        dwise-predict train traces/ --out run/ --config other_run/config.json --overwrite

        dwise-predict train traces/ --out run-no-mcq/ --exclude mcq --exclude hard_mcq
    """
    from dwise_predict.training import train_run

    flags = {"--seed": ("seed", seed), "--max-epochs": ("max_epochs", max_epochs), "--patience": ("patience", patience),
             "--members": ("members", members), "--width": ("width", width), "--lr": ("lr", lr),
             "--batch-size": ("batch_size", batch_size), "--val-fraction": ("val_fraction", val_fraction),
             "--threads": ("num_threads", threads), "--refine": ("refine", refine), "--cv-folds": ("cv_folds", cv_folds),
             "--cv-members": ("cv_members", cv_members), "--exclude": ("exclude", tuple(exclude or ()))}
    problems = []
    if config is not None and not config.is_file():
        problems.append(f"--config {config} is not a file")
    changed = [flag for flag, (name, value) in flags.items() if value != getattr(_DEFAULT, name)]
    if config is not None and changed:
        problems.append(f"--config sets every option: drop {', '.join(changed)} or edit the file")
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out} is a file: give a directory")
    if jobs is not None and jobs < 1:
        problems.append(f"--jobs must be at least 1, got {jobs}")
    if problems:
        raise ConfigError("; ".join(problems))
    if config is not None:
        train_config = TrainConfig.from_file(config)
    else:
        train_config = TrainConfig(**dict(flags.values()))
    train_config.check()

    with _EpochProgress(train_config) as progress:
        metrics = train_run(traces, out, train_config, overwrite=overwrite, progress=progress.update, jobs=jobs,
                            log=progress.lines.stage)
    log(f"wrote run directory {out} (refinement predictor: {metrics.get('refine_candidate')})")
    if json_out:
        typer.echo(json.dumps(metrics, indent=2))
    else:
        _print_summary(metrics)


class _EpochProgress:
    """Training progress on stderr: a rich bar over members x epochs on a terminal; off one, a line per
    stage, per member started and every so often within a member (:class:`ProgressLines`)."""

    def __init__(self, config):
        self.config = config
        self.bar = None
        self.lines = ProgressLines("train")

    def __enter__(self) -> "_EpochProgress":
        if self.lines.on:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[loss]}"), TimeElapsedColumn(),
            console=Console(stderr=True), transient=True,
        )
        self.bar.start()
        self.tasks = [
            self.bar.add_task(f"member {m} (seed {s})", total=self.config.max_epochs, loss="")
            for m, s in enumerate(self.config.seeds)
        ]
        return self

    def update(self, member: int, epoch: int, train_loss: float, val_loss: float) -> None:
        loss = f"train {train_loss:.3f} val {val_loss:.3f}"
        if self.bar is not None:
            self.bar.update(self.tasks[member], completed=epoch + 1, loss=loss)
            return
        where = f"member {member + 1} of {len(self.config.seeds)} (seed {self.config.seeds[member]})"
        if epoch == 0:
            self.lines.stage(f"{where}: epoch 1, {loss}")
        else:
            self.lines.tick(f"{where}: epoch {epoch + 1} of at most {self.config.max_epochs}, {loss}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False


def _print_summary(metrics: dict) -> None:
    from rich.table import Table

    table = Table(title=f"Eval split: {metrics['n_eval']} requests (trained on {metrics['n_train']})")
    table.add_column("predictor")
    table.add_column("ρ overall", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_column("ρ within category", justify="right")
    table.add_column("Kendall τ", justify="right")
    table.add_column("median pred/actual", justify="right")
    cal = metrics["calibration"]
    for label, key, ratio in (
        ("admission (prompt features)", "admission", cal["median_ratio_admission"]),
        ("refined, raw", "refined_raw", cal["median_ratio_raw"]),
        (f"refined ({metrics.get('refine_candidate', 'survival')}), calibrated", "refined", cal["median_ratio_calibrated"]),
    ):
        block = metrics[key]
        ci = block.get("spearman_ci")
        table.add_row(
            label, fmt(block["spearman"]), fmt_interval(ci),
            fmt(block["within_category_mean"]), fmt(block.get("kendall")) if "kendall" in block else "", fmt(ratio, 2),
        )
    out = console()
    out.print(table)
    per = Table(title="ρ within category (eval split)")
    per.add_column("category")
    per.add_column("admission", justify="right")
    per.add_column("refined", justify="right")
    for cat, rho in metrics["admission"]["per_category"].items():
        per.add_row(terminal(cat), fmt(rho), fmt(metrics["refined"]["per_category"].get(cat)))
    out.print(per)
    refined = metrics["refined"]
    out.print(
        f"time-dependent concordance {fmt(refined['concordance_td'])}, "
        f"integrated Brier score {fmt(refined['integrated_brier'], 4)}"
    )


def compare_regressors_command(
    traces: TracesArgument,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Directory for regressors.csv and regressors.md (default: print only).")] = None,
    folds: Annotated[int, typer.Option(help="Cross-validation folds on the train split.")] = 5,
    seed: SeedOption = _DEFAULT.seed,
    repeats: Annotated[int, typer.Option(help="Single-request timings per model (median reported).")] = 300,
    json_out: JsonOption = False,
) -> None:
    """Compare admission regressors (the DWISE paper, Table 9): K-fold CV ρ and single-request time.

    Ridge, MLP (256-256), XGBoost (100, depth 6), LightGBM (500, 31), LightGBM (1,000, 63),
    ExtraTrees (100) and LightGBM (100, 15) on words, newlines and prompt tokens; time per request
    from raw prompt text (tokenisation with the traces' model tokenizer when available locally,
    whitespace words otherwise) and model-only, one thread.

    Examples:

        dwise-predict compare-regressors traces/

        dwise-predict compare-regressors traces/ --out compare/ --folds 5 --json
    """

    from contextlib import nullcontext

    from dwise_predict.admission.compare import check_folds, claim_comparison_out, compare_regressors, write_comparison
    from dwise_predict.features.prompt import PromptFeaturizer, load_tokenizer
    from dwise_predict.traces import load_traces

    problems = []
    if folds < 2:
        problems.append(f"--folds must be at least 2, got {folds}")
    if repeats < 1:
        problems.append(f"--repeats must be at least 1, got {repeats}")
    if out is not None and out.exists() and not out.is_dir():
        problems.append(f"--out {out} is a file: give a directory")
    if problems:
        raise ConfigError("; ".join(problems))

    with claim_comparison_out(out, traces) if out is not None else nullcontext():
        ds = load_traces(traces)
        train = ds.split("train")
        check_folds(len(train), folds)  # before the first line on stderr: a refusal is the only line
        model = ds.model_fingerprint
        tokenizer = load_tokenizer(model)
        note = (
            f"tokenizer of {model.get('name', 'the traces model')} with its chat template"
            if tokenizer is not None
            else f"whitespace words (no local tokenizer for model {model.get('name', '?')!r})"
        )
        log(f"comparing 7 regressors on {len(train)} training requests, {folds}-fold CV; tokenisation: {note}")
        rows = compare_regressors(train, folds, seed, PromptFeaturizer(tokenizer), repeats,
                                  progress=lambda n: log(f"  {n}"))
        if out is not None:
            csv_path, md_path = write_comparison(rows, out, folds, note)
            log(f"wrote {csv_path} and {md_path}")
    if json_out:
        typer.echo(json.dumps({"tokenisation": note, "folds": folds, "rows": rows}, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"Admission regressors ({len(train)} train requests, {folds}-fold CV)", caption=f"tokenisation: {note}")
    for col, justify in (("predictor", "left"), ("ρ", "right"), ("± sd", "right"), ("from text (ms)", "right"), ("model only (µs)", "right")):
        table.add_column(col, justify=justify)
    for r in rows:
        table.add_row(r["name"], fmt(r["rho"]), fmt(r["rho_std"]), f"{r['ms_from_text']:.3f}", f"{r['us_model_only']:.1f}")
    console().print(table)
