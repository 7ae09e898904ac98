"""Typer commands `evaluate` and `characterize` (thin: validate, call the library, print)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, console, log
from dwise_predict.cli.options import ManyTracesArgument as TracesArgument
from dwise_predict.errors import ConfigError
from dwise_predict.evaluation.document import fmt
from dwise_predict.text import terminal


def evaluate_command(
    traces: TracesArgument,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the report, JSON files and plots.")],
    run: Annotated[Optional[Path], typer.Option(help="Run directory from `dwise-predict train` (must be trained on TRACES); default: train here on the train split.")] = None,
    loco: Annotated[bool, typer.Option("--loco", help="Leave each category out in turn and retrain (the DWISE paper, Tables 7 and 17).")] = False,
    hold_out: Annotated[Optional[str], typer.Option(help="Category whose all-request ρ with it held out is reported (default: mcq when present); alone, retrains only for it.")] = None,
    jobs: Annotated[Optional[int], typer.Option(help="Parallel retrainings (one core each; default: one per core).")] = None,
    min_requests: Annotated[int, typer.Option(help="Fewest train and eval requests of a category evaluated in LOCO.")] = 10,
    config: Annotated[Optional[Path], typer.Option(help="JSON file of training options (e.g. a run's config.json; default: the run's, else the defaults).")] = None,
    ablate: Annotated[Optional[list[str]], typer.Option("--ablate", help="Ablation to run, repeatable: inputs, train-size, seeds, layers or pooling (the last two need traces from `collect --layers`; tables in ablations.md/.html and ablation_*.json).")] = None,
    across: Annotated[bool, typer.Option("--across", help="Treat each TRACES set separately (different models allowed): train and score on each, one Table-8-style table with mean ± sd over the sets (across.json, across.md/.html); with --loco each set's mean held-out-category ρ too. Interrupted, a rerun evaluates only the sets not yet done.")] = False,
    json_out: JsonOption = False,
) -> None:
    """Evaluate both predictors: main split, calibration, baselines, LOCO, output length vs work.

    Writes metrics.json, calibration.json, baselines.json, loco.json, output_vs_work.json,
    characterization.json, evaluation.json (all of them), predictions.parquet, and a self-contained
    report.html with report.md and plots/ into --out.

    Examples:

        dwise-predict evaluate traces/ --loco --out eval/

        dwise-predict evaluate traces/ --run run/ --hold-out mcq --out eval/ --jobs 4

        dwise-predict evaluate traces_a/ traces_b/ --out eval/ --json

        dwise-predict evaluate traces/ --run run/ --ablate inputs --ablate seeds --out eval/

        dwise-predict evaluate traces_with_layers/ --ablate layers --ablate pooling --out eval/

        dwise-predict evaluate traces_model_a/ traces_model_b/ --across --out table8/

        dwise-predict evaluate draw0/ draw1/ draw2/ --across --loco --out draws/   # spread over trace draws
    """
    from dwise_predict.evaluation.evaluate import claim_evaluation_out, evaluate, write_evaluation
    from dwise_predict.training import TrainConfig

    problems = []
    if jobs is not None and jobs < 1:
        problems.append(f"--jobs must be at least 1, got {jobs}")
    if min_requests < 2:
        problems.append(f"--min-requests must be at least 2 (a rank correlation needs two requests), got {min_requests}")
    if config is not None and not config.is_file():
        problems.append(f"--config {config} is not a file")
    from dwise_predict.evaluation.ablate import KINDS

    bad = [k for k in ablate or () if k not in KINDS]
    if bad:
        problems.append(f"--ablate {', '.join(bad)}: unknown ablation; choose from {', '.join(KINDS)}")
    if across:
        clash = [flag for flag, used in (("--run", run is not None), ("--hold-out", hold_out is not None),
                                         ("--ablate", bool(ablate))) if used]
        if clash:
            problems.append(f"--across trains on each trace set itself: drop {', '.join(clash)}")
    if problems:
        raise ConfigError("; ".join(problems))
    train_config = TrainConfig.from_file(config) if config is not None else None
    if across:
        _across(traces, out, train_config or TrainConfig(), json_out, loco, jobs, min_requests)
        return

    from dwise_predict.evaluation.pool import kept_results_dir

    with claim_evaluation_out(out, traces, run):
        if kept_results_dir(out).is_dir():  # it goes once the output is written: only an interrupted run leaves it
            log(f"resuming an interrupted evaluation: reusing what it finished, kept in {kept_results_dir(out)}")
        evaluation = evaluate(traces, run=run, loco=loco, hold_out=hold_out, jobs=jobs, min_requests=min_requests,
                              config=train_config, log=log, ablate=tuple(ablate or ()), kept=kept_results_dir(out))
        written = write_evaluation(evaluation, out)
    log(f"wrote {written['report_html']} and {len(written) - 1} more files in {out}")
    if json_out:
        typer.echo(json.dumps(evaluation.result, indent=2, default=str))
    else:
        _print_evaluation(evaluation.result)


def _across(traces, out: Path, config, json_out: bool, loco: bool, jobs: int | None, min_requests: int) -> None:
    from dwise_predict.evaluation.across import across_document, across_sets, claim_across_out, write_across
    from dwise_predict.evaluation.document import to_markdown
    from dwise_predict.evaluation.pool import kept_results_dir

    with claim_across_out(out, traces):
        result = across_sets(traces, config, log=log, loco=loco, jobs=jobs, min_requests=min_requests,
                             finished=kept_results_dir(out))
        html_path = write_across(result, out)
    log(f"wrote {html_path}, across.md and across.json in {out}")
    if json_out:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        typer.echo(to_markdown(across_document(result)))


def _print_evaluation(result: dict) -> None:
    from rich.table import Table

    screen = console(160)
    metrics = result["metrics"]
    main = Table(title=f"Evaluation split ({result['traces']['n_eval']} requests)")
    for col in ("predictor", "ρ", "τ", "within-category ρ", "median pred/actual"):
        main.add_column(col, justify="left" if col == "predictor" else "right")
    for row, key in zip(result["calibration"], ("admission", "refined_raw", "refined")):
        block = metrics[key]
        # "-": not computed for this row (metrics.json has no τ for the raw estimate); "n/a": undefined
        main.add_row(row["predictor"], fmt(block["spearman"]), fmt(block["kendall"]) if "kendall" in block else "-",
                     fmt(block.get("within_category_mean")), fmt(row["median_ratio"]))
    screen.print(main)

    if result["loco"]:
        loco = result["loco"]
        table = Table(title="Leave one category out: within-category ρ, in training → held out")
        for col in ("category", "n eval", "admission", "refined"):
            table.add_column(col, justify="left" if col == "category" else "right")
        arrow = lambda pair: f"{fmt(pair['in_training'])} → {fmt(pair['held_out'])}"  # noqa: E731
        for r in loco["rows"]:
            table.add_row(terminal(r["category"]), str(r["n_eval"]), arrow(r["admission"]), arrow(r["refined"]))
        table.add_row("mean", "", arrow(loco["mean"]["admission"]), arrow(loco["mean"]["refined"]))
        screen.print(table)
        if loco["hold_out"]:
            h = loco["hold_out"]
            screen.print(f"all requests, {terminal(h['category'])} held out: admission ρ {arrow(h['admission'])}, "
                          f"refined ρ {arrow(h['refined'])}")
        for s in loco["skipped"]:
            screen.print(terminal(f"skipped {s['category']}: {s['reason']}"))

    from dwise_predict.evaluation.report import winner_lines

    for line in winner_lines(result.get("winner")):
        screen.print(terminal(line))
    for item in result.get("ablations") or []:
        screen.print(terminal(f"ablation {item['kind']}: {item['verdict']['text']}"))

    table = Table(title="Baselines (remaining rounds, evaluation split)")
    for col in ("predictor", "ρ", "τ", "R²"):
        table.add_column(col, justify="left" if col == "predictor" else "right")
    for r in result["baselines"]:
        table.add_row(terminal(r["name"]), fmt(r["spearman"]), fmt(r["kendall"]), fmt(r["r2"]))
    screen.print(table)


def characterize_command(
    traces: TracesArgument,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write characterization.json, .html, .md and plots here.")] = None,
    split_decodings: Annotated[bool, typer.Option("--split-decodings", help="TRACES of different algorithms or parameters (threshold, dtype, ...): one section per decoding instead of a refusal. Different block sizes are split either way.")] = False,
    stability: Annotated[bool, typer.Option("--stability", help="TRACES are repeated runs of the same prompts (one decoding and budget): add the round-count stability table (the DWISE paper, Table 11), requests matched by request_id.")] = False,
    json_out: JsonOption = False,
) -> None:
    """Measure the workload in traces: rounds spread, tiers, wall time, truncation, budgets.

    Amin et al.'s measurements on any model: p25/p50/p90/max of denoising rounds, max/min ratio and CV;
    distinct values and dominant spacing ("tiers"); round count vs wall time; share truncated by the
    output budget; per category too. Given traces at several budgets, CV and truncation per budget.
    And how each first-round early signal orders requests inside each category: where its direction
    reverses between categories, no predictor can carry it to a category it never saw.

    Decodings are never pooled: traces of several block sizes get one section each and Amin et al.'s
    block-size invariance table; traces of several algorithms or parameters are refused unless
    --split-decodings. With --stability, the share of requests whose round count is identical (within
    one round, within 10 %) from one run to another, as the DWISE paper's Table 11. Given traces of
    `collect --algorithm D2F` and of another decoding of the same prompts (--split-decodings), Amin et
    al.'s D2F-against-base table (Fig. 4, §III-A/B): CV of rounds and of wall time on the requests both
    ran, their ratio, and the tier detector's verdict on each.

    Examples:

        dwise-predict characterize traces/

        dwise-predict characterize traces_b128/ traces_b256/ traces_b512/ --out char/

        dwise-predict characterize block8/ block16/ --out invariance/   # one section per block size

        dwise-predict characterize lowconf/ d2f/ --split-decodings     # one section per algorithm; D2F vs base

        dwise-predict characterize run0/ run1/ run2/ --stability --out table11/

        dwise-predict characterize traces/ --json
    """
    from contextlib import nullcontext

    from dwise_predict.evaluation.characterize import characterize
    from dwise_predict.evaluation.inputs import load_many
    from dwise_predict.evaluation.report import write_characterization
    from dwise_predict.files import claim_output

    inputs = [("TRACES", path) for path in traces]
    claim = (claim_output(out, inputs, "a characterization", "characterization.json", replace=True,
                          contents=("characterization.*", "plots")) if out else nullcontext())
    with claim:
        datasets = load_many(traces)
        result = characterize(datasets, split_decodings=split_decodings, stability=stability)
        if out is not None:
            html_path = write_characterization(result, datasets, out)
            log(f"wrote {html_path}, characterization.md, characterization.json and plots in {out}")
    if json_out:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        _print_characterization(result)


def _print_characterization(result: dict) -> None:
    from dwise_predict.evaluation import report

    screen = console(160)
    for comparison in result.get("d2f_vs_base", ()):  # Amin et al., Fig. 4 and §III-A/B
        from dwise_predict.evaluation.d2f_report import d2f_table, d2f_text

        screen.print(_rich_table(d2f_table(comparison)))
        screen.print(terminal(d2f_text(comparison)))
    for table in result.get("invariance", ()):
        screen.print(_rich_table(report.invariance_table(table)))
        screen.print(terminal(report.invariance_text(table)))
    for section in result.get("configurations", [result]):
        _print_decoding(screen, section, f"{result['model']}; {section['label']}")
    if "stability" in result:
        for cells in report.stability_tables(result["stability"]):
            screen.print(_rich_table(cells))


def _rich_table(cells):
    """A report table (:class:`dwise_predict.evaluation.document.Table`) for the terminal."""
    from rich.table import Table

    table = Table(title=terminal(cells.caption))
    for i, col in enumerate(cells.columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in cells.rows:
        table.add_row(*map(terminal, row))
    return table


def _print_decoding(screen, section: dict, title: str) -> None:
    """One decoding's tables: rounds per category, versus the budget, the early signals."""
    from rich.table import Table

    from dwise_predict.evaluation.report import WALL_TIME_NOTE

    table = Table(title=f"Denoising rounds — {terminal(title)}",
                  caption=WALL_TIME_NOTE.replace("r(rounds, wall)", "r(wall)", 1), caption_justify="left")
    cols = ("category", "n", "p25", "p50", "p90", "max", "max/min", "CV", "distinct", "tiers", "r(wall)", "truncated")
    for col in cols:
        table.add_column(col, justify="left" if col in ("category", "tiers") else "right")
    for name, s in [("all", section["overall"]), *section["per_category"].items()]:
        r, d = s["rounds"], s["discreteness"]
        table.add_row(terminal(name), str(r["n"]), fmt(r["p25"], 1), fmt(r["p50"], 1), fmt(r["p90"], 1),
                      fmt(r["max"], 0),
                      fmt(r["max_min_ratio"], 1), fmt(r["cv"]), str(d["distinct"]),
                      d["tiers"] or f"spacing {fmt(d['dominant_spacing'])}", fmt(s["wall_time"]["pearson"]),
                      f"{100 * s['truncated_share']:.1f}%")
    screen.print(table)
    if len(section["budget_sweep"]) > 1:
        sweep = Table(title="Versus output budget")
        for col in ("budget", "n", "CV", "truncated", "p50", "p90"):
            sweep.add_column(col, justify="right")
        for r in section["budget_sweep"]:
            sweep.add_row(str(r["budget"]), str(r["n"]), fmt(r["cv"]), f"{100 * r['truncated_share']:.1f}%",
                          fmt(r["p50"], 1), fmt(r["p90"], 1))
        screen.print(sweep)
    if section["signal_directions"]:
        from dwise_predict.evaluation.report import signal_directions_table

        cells = signal_directions_table(section["signal_directions"])
        cells.caption += " (▲ / ▼: above / below zero)"
        screen.print(_rich_table(cells))
