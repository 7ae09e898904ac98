"""One evaluation: the main split, calibration, baselines, leave-one-category-out, output vs work.

:func:`evaluate` computes everything and returns an :class:`Evaluation` (a JSON-ready result dict
plus the prediction arrays the plots need); :func:`write_evaluation` writes it to a directory:

- ``metrics.json`` — the predictors on the evaluation split (the run directory's metrics.json keys);
- ``calibration.json`` — the DWISE paper's Table 5: admission only, raw refinement, calibrated;
- ``baselines.json`` — every baseline's ρ, τ, R², within-category ρ (see :mod:`.baselines`);
- ``loco.json`` — leave-one-category-out (when asked; see :mod:`.loco`);
- ``output_vs_work.json`` — the DWISE paper's Table 12 (see :func:`.characterize.output_vs_work`);
- ``characterization.json`` — the workload's round statistics (see :mod:`.characterize`);
- ``evaluation.json`` — all of the above with provenance (traces, fingerprint, run, versions);
- ``predictions.parquet`` — per evaluation request: id, category, actual and predicted rounds;
- ``report.html`` (self-contained), ``report.md`` and ``plots/*.png``.

The predictors come from a run directory (refused when it was trained on other traces: the
fingerprints must match) or are trained here on the training split. Every retraining (one per
held-out category, one for the prompt-hidden-state baseline) runs in a process pool.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.errors import InputError
from dwise_predict.evaluation import loco as loco_mod
from dwise_predict.evaluation.baselines import (SHIPPED, TASK_WORDS, baseline_predictions, baseline_table,
                                                remaining_rounds, table_tasks)
from dwise_predict.evaluation.characterize import characterize, output_vs_work
from dwise_predict.files import atomic_dir, atomic_write, claim_output, write_json
from dwise_predict.evaluation.inputs import concat, load_many, model_label
from dwise_predict.evaluation.pool import fit_kept, kept_results_dir, run_tasks
from dwise_predict.evaluation.report import survival_examples
from dwise_predict.runs import load_run
from dwise_predict.text import visible
from dwise_predict.traces import TraceDataset
from dwise_predict.versions import package_versions

EVALUATION_MARKER = "evaluation.json"  # a directory holding it is an evaluation: the next one replaces it
# every name an evaluation holds: a folder holding anything else is yours, never replaced with it
EVALUATION_CONTENTS = ("*.json", "predictions.parquet", "report.html", "report.md", "ablations.html", "ablations.md", "plots")

SURVIVAL_EXAMPLES = 4


@dataclass
class Evaluation:
    """The result dict (JSON-ready) and the arrays behind the plots."""

    result: dict
    arrays: dict


def _fail_fast(ds: TraceDataset, train: TraceDataset, eval_ds: TraceDataset) -> None:
    """Both splits are needed even with a run: the baselines and LOCO retrain on the train split."""
    problems = []
    if len(eval_ds) < 2:
        problems.append(f"the traces hold {len(eval_ds)} evaluation requests (split == 'eval'); at least 2 are needed")
    if len(train) < 2:
        problems.append(f"the traces hold {len(train)} training requests (split == 'train'); at least 2 are needed")
    if problems:
        where = f" in {ds.path}" if ds.path else ""
        raise InputError("; ".join(problems) + f"{where}: collect traces with both splits")


def _check_run_matches(run_config: dict, ds: TraceDataset, run: Path) -> None:
    """Refuse a run directory whose config.json names other traces than the ones evaluated."""
    recorded = run_config.get("traces", {}).get("fingerprint")
    if recorded is None:
        raise InputError(f"{run / 'config.json'} records no traces.fingerprint: re-run `dwise-predict train`")
    if recorded != ds.data_hash():
        trained_on = run_config.get("traces", {}).get("path") or "other traces"
        raise InputError(
            f"run {run} was trained on {trained_on} (fingerprint {recorded[:12]}), not on these traces "
            f"({ds.data_hash()[:12]}): pass the traces it was trained on, or drop `run` to train here"
        )


def _calibration_rows(metrics: dict) -> list[dict]:
    cal = metrics["calibration"]
    return [
        {"predictor": "admission only", "median_ratio": cal["median_ratio_admission"],
         "spearman": metrics["admission"]["spearman"]},
        {"predictor": "raw refinement", "median_ratio": cal["median_ratio_raw"],
         "spearman": metrics["refined_raw"]["spearman"]},
        {"predictor": "calibrated refinement", "median_ratio": cal["median_ratio_calibrated"],
         "spearman": metrics["refined"]["spearman"]},
    ]


def evaluate(
    traces: Sequence[str | os.PathLike],
    run: str | os.PathLike | None = None,
    loco: bool = False,
    hold_out: str | None = None,
    jobs: int | None = None,
    min_requests: int = loco_mod.MIN_REQUESTS,
    config=None,
    log: Callable[[str], None] | None = None,
    ablate: Sequence[str] = (),
    kept: str | os.PathLike | None = None,
) -> Evaluation:
    """Evaluate the predictors on the traces' evaluation split.

    Parameters
    ----------
    traces : one or more trace directories of the same model (their requests are pooled).
    run : a training run directory; None trains both predictors here on the training split.
    loco : hold out every category in turn (retraining both predictors each time).
    hold_out : a category whose all-request ρ with it held out is singled out; with ``loco`` False
        only that category is retrained. Default: "mcq" when present (see :func:`.loco.table`).
    jobs : worker processes for the retrainings (None: cores / ``config.num_threads``).
    min_requests : fewest evaluation and training requests of a category evaluated in LOCO.
    config : a ``TrainConfig`` for every (re)training; default: the run's recorded config, else
        ``TrainConfig()``.
    log : progress messages (to stderr in the CLI).
    ablate : ablations to run (``inputs``, ``train-size``, ``seeds``, ``layers``, ``pooling``; see :mod:`.ablate`).
    kept : a folder keeping the main fit (without ``run``) and each finished retraining, so a rerun
        after an interruption skips them (:func:`.pool.fit_kept`, :func:`.pool.run_tasks`; the CLI
        keeps them beside ``--out``).

    Raises
    ------
    InputError
        mixed models, an empty split, an unknown category, or a run trained on other traces.
    """
    from dwise_predict.training import Targets, evaluate_predictors

    log = log or (lambda message: None)
    started = time.monotonic()
    datasets = load_many(traces)
    ds = concat(datasets)
    train, eval_ds = ds.split("train"), ds.split("eval")
    _check_before_training(ds, train, eval_ds, hold_out, ablate)
    predictors, config = _predictors(run, ds, train, config, kept, log)

    metrics = evaluate_predictors(predictors, eval_ds, config.bootstrap, config.seed)
    # Rank tables use finished requests, as metrics.json does: a request whose collection was cut
    # short (`censored`) has only a lower bound on its rounds. The retrainings still see all of them.
    scored = eval_ds.subset(Targets.of(eval_ds).events)
    preds = _estimates(predictors, scored)
    retrained, loco_result = _retrain(train, scored, preds, config, loco, hold_out, min_requests, jobs, kept, log)

    log("fitting baselines")
    finished_train = train.subset(Targets.of(train).events)
    baselines, winner = _baselines(predictors, finished_train, scored, preds, retrained, config)
    ablations = _ablations(ablate, finished_train, scored, config, min_requests, jobs, kept, log)
    arrays = _plot_arrays(predictors, ds, scored, preds)

    result = {
        "traces": _traces_record(datasets, ds, train, eval_ds, scored),
        "run": visible(str(run)) if run is not None else None,  # a byte that is not UTF-8 as its escape
        "config": config.to_dict(),
        "metrics": metrics,
        "calibration": _calibration_rows(metrics),
        "baselines": baselines,
        "winner": winner,
        "selection": predictors.selection,
        "ablations": ablations,
        "loco": loco_result,
        "output_vs_work": output_vs_work(ds.requests),
        "characterization": characterize([ds]),
        "versions": package_versions(),
        "elapsed_s": round(time.monotonic() - started, 2),
    }
    return Evaluation(result, arrays)


def _check_before_training(ds: TraceDataset, train: TraceDataset, eval_ds: TraceDataset, hold_out: str | None,
                           ablate: Sequence[str]) -> None:
    """Refuse what would fail only after minutes of training: a missing split, an unknown held-out
    category or ablation, an ablation of hidden layers the traces were not collected with."""
    from dwise_predict.evaluation import ablate as ablate_mod

    _fail_fast(ds, train, eval_ds)
    if hold_out is not None:
        loco_mod.check_categories(train, eval_ds, [hold_out])
    unknown = [k for k in ablate if k not in ablate_mod.KINDS]
    if unknown:
        raise InputError(f"`ablate` {', '.join(unknown)}: unknown; choose from {', '.join(ablate_mod.KINDS)}")
    for kind in ablate:
        if kind in ablate_mod.HIDDEN_KINDS:  # traces without `collect --layers` are refused here
            ablate_mod.hidden_settings(kind, ds)


def _predictors(run: str | os.PathLike | None, ds: TraceDataset, train: TraceDataset, config, kept, log):
    """The predictors evaluated and the config of every retraining: a run's (when it was trained on
    these traces), else both predictors fitted here on the training split."""
    from dwise_predict.training import TrainConfig, load_predictors

    if run is not None:
        run_files = load_run(run)
        _check_run_matches(run_files.config, ds, Path(run))
        predictors = load_predictors(run_files)
        config = config or TrainConfig.from_dict(run_files.config)
        log(f"loaded predictors from {run}")
    else:
        config = config or TrainConfig()
        log(f"training both predictors on {len(train)} requests")
        predictors = fit_kept(train, config, kept, log)
    return predictors, config


def _retrain(train: TraceDataset, scored: TraceDataset, preds: dict, config, loco: bool, hold_out: str | None,
             min_requests: int, jobs: int | None, kept, log) -> tuple[dict, dict | None]:
    """Every retraining in one pool (LOCO categories, the prompt-hidden-state baseline and the
    ablation without the first-round state); returns their results by task name and the LOCO table
    (None when no category is held out)."""
    loco_tasks, skipped = [], []
    if loco or hold_out is not None:
        loco_tasks, skipped = loco_mod.plan(train, scored, config, None if loco else [hold_out], min_requests)
        if not loco and skipped:
            raise InputError(f"cannot hold out {hold_out!r}: {skipped[0]['reason']}")
    tasks = loco_tasks + table_tasks(train, scored, config)
    log(f"retraining {len(tasks)} times ({len(loco_tasks)} held-out categories + prompt-hidden-state baseline "
        "+ the ablation without the first-round state)")
    retrained = run_tasks(tasks, jobs, on_done=lambda name: log(f"  done: {TASK_WORDS.get(name, 'without ' + name)}"),
                          kept=kept, log=log)

    loco_result = None
    if loco_tasks or skipped:
        held = {t.name: retrained[t.name] for t in loco_tasks}
        loco_result = loco_mod.table(scored, preds, held, skipped, hold_out, min_requests, config.bootstrap,
                                     config.seed)
    return retrained, loco_result


def _estimates(predictors, scored: TraceDataset) -> dict[str, np.ndarray]:
    """The predictors' estimates on the scored requests: admission total rounds, calibrated and raw
    refined remaining rounds."""
    return {
        "admission": np.asarray(predictors.admission_total(scored), dtype=float),
        "refined": np.asarray(predictors.refined_remaining(scored), dtype=float),
        "refined_raw": np.asarray(predictors.refined_raw(scored), dtype=float),
    }


def _baselines(predictors, finished_train: TraceDataset, scored: TraceDataset, preds: dict, retrained: dict,
               config) -> tuple[list[dict], dict]:
    """The baseline table (see :mod:`.baselines`) and which predictor won (see :func:`_winner`)."""
    candidate = predictors.ensemble.candidate
    predictions = baseline_predictions(finished_train, scored, preds["admission"], preds["refined"],
                                       {name: retrained[name]["refined"] for name in TASK_WORDS}, config.seed, candidate)
    return baseline_table(scored, predictions), _winner(predictions, scored, candidate, config)


def _plot_arrays(predictors, ds: TraceDataset, scored: TraceDataset, preds: dict) -> dict:
    """What the report's plots draw beside the result: the requests, the estimates and a few
    requests' survival curves spread over the estimate's range."""
    arrays = {"eval_requests": scored.requests, "all_requests": ds.requests, **preds}
    arrays["survival"] = survival_examples(
        predictors.predict_survival(scored),
        preds["refined"],
        scored.requests["total_rounds"].to_numpy(dtype=float) - 1,
        scored.requests["request_id"].to_numpy(),
        SURVIVAL_EXAMPLES,
    )
    return arrays


def _ablations(ablate: Sequence[str], finished_train: TraceDataset, scored: TraceDataset, config, min_requests: int,
               jobs: int | None, kept, log) -> list[dict]:
    """Each ablation asked for, once, in the order first asked (see :func:`.ablate.ablate`)."""
    from dwise_predict.evaluation import ablate as ablate_mod

    ablations = []
    for kind in dict.fromkeys(ablate):
        log(f"ablation: {kind}")
        ablations.append(ablate_mod.ablate(kind, finished_train, scored, config, n_boot=_n_boot(config), log=log,
                                            min_requests=min_requests, jobs=jobs, kept=kept))
    return ablations


def _traces_record(datasets: list[TraceDataset], ds: TraceDataset, train: TraceDataset, eval_ds: TraceDataset,
                   scored: TraceDataset) -> dict:
    """What was evaluated: the trace directories, their pooled fingerprint, model, decoding and sizes."""
    return {
        "paths": [visible(str(d.path)) for d in datasets],  # a byte that is not UTF-8 as its escape
        "fingerprint": ds.data_hash(),
        "model": model_label(ds),
        "decoding": ds.decoding,
        "n_requests": len(ds),
        "n_train": len(train),
        "n_eval": len(eval_ds),
        "n_eval_finished": len(scored),
    }


def claim_evaluation_out(out: str | os.PathLike, traces: Sequence[str | os.PathLike],
                         run: str | os.PathLike | None = None):
    """Check ``out`` can take an evaluation and lock it for the ``with`` block (see
    :func:`dwise_predict.files.claim_output`): an earlier evaluation there is replaced, the traces,
    the run or a foreign folder never are."""
    inputs = [*(("TRACES", path) for path in traces), ("`run`", run)]
    return claim_output(out, inputs, "an evaluation", EVALUATION_MARKER, replace=True, contents=EVALUATION_CONTENTS)


def _n_boot(config) -> int:
    return int(config.bootstrap) if config.bootstrap >= 100 else 200


# the measures the shipped predictor is judged on: key of a scored row -> key in the result's "winner"
_WINNER_KEYS = (("within_category_mean", "within_category"), ("spearman", "overall"))


def _winner(predictions, scored: TraceDataset, candidate: str, config) -> dict:
    """Which predictor won: the shipped refinement predictor against the best baseline (by
    within-category ρ, and separately by ρ overall), with paired bootstrap intervals of the differences
    (requests resampled within category). ``inside_interval`` is True where the interval contains 0.
    ``ablation`` (where the table has that row): the same margins over the shipped recipe without the
    first-round state, i.e. what that state adds."""
    from dwise_predict.evaluation.ablate import score_rows

    true = remaining_rounds(scored)
    cats = scored.requests["category"].astype(str).to_numpy()
    kinds = {p.name: p.kind for p in predictions if p.kind != "oracle"}
    preds = {p.name: np.asarray(p.pred, float) for p in predictions if p.name in kinds}
    rows = [{"name": name, "bundle": name == SHIPPED} for name in preds]
    table = score_rows(rows, preds, true, cats, SHIPPED, _n_boot(config), config.seed)
    shipped = next(r for r in table["rows"] if r["name"] == SHIPPED)
    baselines = [r for r in table["rows"] if kinds[r["name"]] == "baseline"]
    ablation = next((r for r in table["rows"] if kinds[r["name"]] == "ablation"), None)
    out = {"candidate": candidate, "shipped": {k: shipped[k] for k in ("spearman", "spearman_ci", "within_category_mean",
                                                                         "within_category_ci")}}
    for key, label in _WINNER_KEYS:
        defined = [r for r in baselines if r[key] is not None]
        if not defined or shipped[key] is None:
            out[label] = None
            continue
        best = max(defined, key=lambda r: r[key])
        out[label] = {"best_baseline": best["name"], "baseline": best[key], **_margin(shipped, best, key)}
    if ablation is not None:
        out["ablation"] = {"name": ablation["name"], **{
            label: None if shipped[key] is None or ablation[key] is None
            else {"ablation": ablation[key], **_margin(shipped, ablation, key)}
            for key, label in _WINNER_KEYS}}
    return out


def _margin(shipped: dict, other: dict, key: str) -> dict:
    """The shipped row's margin over ``other`` on ``key`` (scored by ``score_rows`` against the shipped
    row), with its paired 95 % interval and whether that interval contains 0."""
    ci = other["delta_vs_reference"]["within_category_ci" if key == "within_category_mean" else "spearman_ci"]
    margin = shipped[key] - other[key]
    return {"shipped": shipped[key], "margin": margin, "margin_ci": None if ci is None else [-ci[1], -ci[0]],
            "inside_interval": bool(ci is None or ci[0] <= 0.0 <= ci[1]), "shipped_wins": margin >= 0}


def write_evaluation(evaluation: Evaluation, out: str | os.PathLike) -> dict[str, Path]:
    """Write the JSON files, predictions and report of ``evaluation`` as the directory ``out``; returns
    name -> path. The directory appears whole, replacing an earlier evaluation there (none of its
    files, e.g. a ``loco.json`` of other traces, stays behind)."""
    out = Path(out)
    with atomic_dir(out) as tmp:
        written = _write_evaluation(evaluation, tmp)
    shutil.rmtree(kept_results_dir(out), ignore_errors=True)  # the retrainings kept for a resume
    return {name: out / path.relative_to(tmp) for name, path in written.items()}


def _write_evaluation(evaluation: Evaluation, out: Path) -> dict[str, Path]:
    from dwise_predict.evaluation.document import write_document
    from dwise_predict.evaluation.report import evaluation_document

    result, arrays = evaluation.result, evaluation.arrays
    written = {}
    sections = {"metrics": result["metrics"], "calibration": result["calibration"], "baselines": result["baselines"],
                "output_vs_work": result["output_vs_work"], "characterization": result["characterization"]}
    if result["loco"] is not None:
        sections["loco"] = result["loco"]
    if result.get("ablations"):
        sections["ablations"] = result["ablations"]
        for item in result["ablations"]:
            sections[f"ablation_{item['kind'].replace('-', '_')}"] = item
    for name, value in {**sections, "evaluation": result}.items():
        written[name] = out / f"{name}.json"
        write_json(written[name], value)

    ev = arrays["eval_requests"]
    table = pd.DataFrame({
        "request_id": ev["request_id"].to_numpy(),
        "category": ev["category"].astype(str).to_numpy(),
        "total_rounds": ev["total_rounds"].to_numpy(),
        "remaining_rounds": ev["total_rounds"].to_numpy() - 1,
        "admission_total": arrays["admission"],
        "refined_raw": arrays["refined_raw"],
        "refined": arrays["refined"],
    })
    written["predictions"] = atomic_write(out / "predictions.parquet", lambda tmp: table.to_parquet(tmp, index=False))

    written["report_html"], written["report_md"] = write_document(evaluation_document(result, arrays), out)
    if result.get("ablations"):
        from dwise_predict.evaluation.ablate import ablation_document

        written["ablations_html"], written["ablations_md"] = write_document(
            ablation_document(result["ablations"]), out, stem="ablations")
    return written
