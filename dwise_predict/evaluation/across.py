"""One table over several trace sets (seed 000, Table 8 style): each set trained and scored on its own.

``evaluate A B C --across`` trains both predictors on each set's training split (the same
``TrainConfig``, so the refinement candidate is chosen per set by its own cross-validation), scores
them on that set's evaluation split, and adds the two strongest simple baselines on the same
requests (ridge on the first-round state; seed 001's four early signals together). The sets may
come from different models: that is the point of the table. With ``--loco`` each set is also
evaluated leave-one-category-out (its mean held-out-category refined ρ, see :mod:`.loco`).

With two or more sets a last row gives each column's mean ± sd over them. When the sets are draws
of one model's workload (``collect --seed 1``, ``--seed 2`` …), that row is the spread a reader
should expect from the trace draw alone (seed 000 Table 10 reports the spread over seeds;
``evaluate --ablate seeds`` gives ours).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from dwise_predict import metrics as M
from dwise_predict.errors import InputError
from dwise_predict.evaluation.document import Document, Section, Table, fmt, fmt_interval, fmt_pm
from dwise_predict.evaluation.inputs import model_label
from dwise_predict.evaluation.pool import fit
from dwise_predict.traces import load_traces


# the baselines of each row (table label -> name in the row's "baselines")
BASELINES = {"ridge": "ridge on first-round state", "early signals": "early signals (all four)"}


def across_sets(paths: Sequence[str | os.PathLike], config, log: Callable[[str], None] | None = None,
                loco: bool = False, jobs: int | None = None, min_requests: int | None = None) -> dict:
    """``{"rows": [...one per trace set...], "summary": {column: {"mean", "sd", "n"}} (two or more
    sets), "config": ...}``; see the module docstring. ``loco``: also hold out each category of each
    set in turn (``jobs`` worker processes and ``min_requests`` per category, as ``evaluate --loco``)."""
    from dwise_predict.evaluation.baselines import early_signal_predictions, remaining_rounds, ridge_hidden
    from dwise_predict.training import Targets, evaluate_predictors

    log = log or (lambda message: None)
    if len(paths) < 1:
        raise InputError("--across needs at least one TRACES path")
    rows = []
    for path in paths:
        ds = load_traces(path)
        train, ev = ds.split("train"), ds.split("eval")
        if len(ev) == 0 or len(train) < 8:
            raise InputError(f"{path}: needs a train split (>= 8 requests) and an eval split to be evaluated")
        log(f"  {path}: training on {len(train)} requests")
        predictors = fit(train, config)
        metrics = evaluate_predictors(predictors, ev, config.bootstrap, config.seed)
        done_train = train.subset(Targets.of(train).events)
        scored = ev.subset(Targets.of(ev).events)
        true = remaining_rounds(scored)
        cats = scored.requests["category"].astype(str).to_numpy()
        baselines = {
            BASELINES["ridge"]: ridge_hidden(done_train, scored),
            BASELINES["early signals"]: early_signal_predictions(done_train, scored, config.seed)["all four"],
        }
        base = {name: {"spearman": M.spearman(p, true), "within_category_mean": M.within_category(p, true, cats)[0]}
                for name, p in baselines.items()}
        rows.append({
            "path": str(path),
            "model": model_label(ds),
            "hidden_size": ds.hidden_size,
            "n_train": len(train),
            "n_eval": len(ev),
            "candidate": predictors.ensemble.candidate,
            "cv": {c: s.get("cv_within_category") for c, s in predictors.selection.get("candidates", {}).items()},
            "admission": _pick(metrics["admission"]),
            "refined": _pick(metrics["refined"]),
            "median_ratio_calibrated": metrics["calibration"]["median_ratio_calibrated"],
            "baselines": base,
        })
        if loco:
            rows[-1]["held_out"] = _held_out(train, ev, predictors, config, jobs, min_requests, log)
    result = {"rows": rows, "config": config.to_dict()}
    if len(rows) >= 2:
        result["summary"] = {name: M.mean_sd(get(r) for r in rows) for name, get in SUMMARY_COLUMNS.items()
                             if any(get(r) is not None for r in rows)}
    return result


def _baseline(label: str, metric: str) -> Callable[[dict], float | None]:
    return lambda r: r["baselines"][BASELINES[label]][metric]


# the columns after the refinement's name, in table order; the last row averages each over trace sets
SUMMARY_COLUMNS: dict[str, Callable[[dict], float | None]] = {
    "admission ρ": lambda r: r["admission"]["spearman"],
    "refined ρ": lambda r: r["refined"]["spearman"],
    "refined within-cat ρ": lambda r: r["refined"]["within_category_mean"],
    "held-out-cat ρ": lambda r: (r.get("held_out") or {}).get("mean"),
    **{f"{label} {column}": _baseline(label, metric) for label in BASELINES
       for column, metric in (("ρ", "spearman"), ("within-cat ρ", "within_category_mean"))},
}


def _held_out(train, ev, predictors, config, jobs, min_requests, log) -> dict:
    """The set's leave-one-category-out summary: mean held-out refined ρ, per category, skipped."""
    from dwise_predict.evaluation import loco as loco_mod
    from dwise_predict.evaluation.pool import run_tasks
    from dwise_predict.training import Targets

    min_requests = loco_mod.MIN_REQUESTS if min_requests is None else min_requests
    scored = ev.subset(Targets.of(ev).events)
    tasks, skipped = loco_mod.plan(train, scored, config, min_requests=min_requests)
    log(f"    holding out {len(tasks)} categories in turn")
    held = run_tasks(tasks, jobs)
    in_training = {"admission": predictors.admission_total(scored), "refined": predictors.refined_remaining(scored)}
    table = loco_mod.table(scored, in_training, held, skipped, min_requests=min_requests, n_boot=0)  # means only
    return {"mean": table["mean"]["refined"]["held_out"],
            "categories": {r["category"]: r["refined"]["held_out"] for r in table["rows"]},
            "skipped": [s["category"] for s in table["skipped"]]}


def _pick(block: dict) -> dict:
    return {k: block.get(k) for k in ("spearman", "spearman_ci", "within_category_mean")}


def across_document(result: dict) -> Document:
    held_out = any("held_out" in r for r in result["rows"])
    scored = [c for c in SUMMARY_COLUMNS if held_out or c != "held-out-cat ρ"]
    cols = ["traces", "model", "H", "train / eval", "refinement"] + scored[:2] + ["95% CI"] + scored[2:] + ["median pred/actual"]
    rows = []
    for r in result["rows"]:
        ci = r["refined"]["spearman_ci"]
        values = [fmt(SUMMARY_COLUMNS[c](r)) for c in scored]
        rows.append([r["path"], r["model"], str(r["hidden_size"]), f"{r['n_train']} / {r['n_eval']}", r["candidate"]]
                    + values[:2] + [fmt_interval(ci)] + values[2:]
                    + [fmt(r["median_ratio_calibrated"], 2)])
    summary = result.get("summary")
    if summary:
        cell = {name: fmt_pm(stat) for name, stat in summary.items()}
        rows.append([f"mean ± sd over {len(result['rows'])} sets", "", "", "", ""]
                    + [cell.get(c, "") for c in cols[5:]])
    table = Table(cols, rows, "Predictors per trace set (each trained on its own train split, scored on its eval split)")
    return Document("dwise-predict: predictors across trace sets", [], [Section("Across trace sets", "", [table])])

