"""One table over several trace sets (the DWISE paper, Table 8 style): each set trained and scored on its own.

``evaluate A B C --across`` trains both predictors on each set's training split (the same
``TrainConfig``, so the refinement candidate is chosen per set by its own cross-validation), scores
them on that set's evaluation split, and scores every non-oracle baseline of ``evaluate`` on the
same requests (:mod:`.baselines`; the prompt-hidden-state recipe and the ablation without the
first-round state are two more retrainings per set);
the per-set table shows the two simple ones (ridge on the first-round state; Amin et al.'s four early
signals together). The sets may come from different models: that is the point of the table. With
``--loco`` each set is also evaluated leave-one-category-out (its mean held-out-category refined ρ,
see :mod:`.loco`).

With two or more sets a last row gives each column's mean ± sd over them, and a second table sets
the shipped predictor against every baseline, paired by set (:func:`versus_baselines`): does it beat
the best of them on average over the draws, and in how many? When the sets are draws of one model's
workload (``collect --seed 1``, ``--seed 2`` …), that is the question one draw cannot answer (seed
000 Table 10 reports the spread over seeds; ``evaluate --ablate seeds`` gives ours).

A table over many sets takes a while (fourteen draws of the tiny model's workload with ``--loco``:
12-18 min on 2 cores), so each set's row is kept as it finishes, in a folder beside ``--out``
(:func:`~.pool.kept_results_dir`; the retrainings inside a set too), under a key of its traces' data,
the options and the code (:func:`~.pool.result_key`): a rerun of an interrupted command evaluates
only the sets that were not done. The table itself appears whole, by rename, replacing only an
earlier table (:func:`claim_across_out`, :func:`write_across`); what was kept goes once it is there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from dwise_predict import metrics as M
from dwise_predict.errors import InputError, StoreError
from dwise_predict.evaluation.document import Document, Section, Table, fmt, fmt_interval, fmt_pm
from dwise_predict.evaluation.inputs import model_label
from dwise_predict.evaluation.pool import fit_kept, kept_results_dir, result_key, run_tasks
from dwise_predict.files import atomic_dir, claim_output, read_json_object, write_json
from dwise_predict.traces import load_traces

ACROSS_MARKER = "across.json"  # a directory holding it is an across-set table: the next one replaces it


# the baselines with columns in the per-set table (label -> name in the row's "baselines"); the
# comparison table under it holds every baseline
BASELINES = {"ridge": "ridge on first-round state", "early signals": "early signal: all four"}
# the measures the shipped predictor is compared on over the sets (key in metrics -> words)
MEASURES = {"within_category_mean": "within-category ρ", "spearman": "ρ over all requests"}


def claim_across_out(out: str | os.PathLike, traces: Sequence[str | os.PathLike]):
    """Check ``out`` can take an across-set table and lock it for the ``with`` block (see
    :func:`dwise_predict.files.claim_output`): an earlier table there is replaced; a trace set, an
    evaluation or a folder of yours never is."""
    return claim_output(out, [("TRACES", path) for path in traces], "an across-set table", ACROSS_MARKER,
                        replace=True, contents=("across.*", "plots"))


def write_across(result: dict, out: str | os.PathLike) -> Path:
    """``across.json``, ``across.md`` and ``across.html`` of ``result`` as the directory ``out``
    (appearing whole, replacing an earlier table); the rows kept for a resume are removed after. Returns
    the HTML path."""
    from dwise_predict.evaluation.document import write_document

    out = Path(out)
    with atomic_dir(out) as tmp:
        write_json(tmp / ACROSS_MARKER, result)
        write_document(across_document(result), tmp, stem="across")
    shutil.rmtree(kept_results_dir(out), ignore_errors=True)
    return out / "across.html"


def across_sets(paths: Sequence[str | os.PathLike], config, log: Callable[[str], None] | None = None,
                loco: bool = False, jobs: int | None = None, min_requests: int | None = None,
                finished: str | os.PathLike | None = None) -> dict:
    """``{"rows": [...one per trace set...], "summary": {column: {"mean", "sd", "n"}} and "versus"
    (two or more sets), "config": ...}``; see the module docstring. ``loco``: also hold out each
    category of each set in turn (``jobs`` worker processes and ``min_requests`` per category, as
    ``evaluate --loco``). ``finished``: a folder where each set's row is kept as soon as it is done
    and found again by a rerun with the same traces, options and code (None: nothing kept)."""
    from dwise_predict.evaluation import loco as loco_mod
    from dwise_predict.evaluation.baselines import TASK_WORDS, baseline_predictions, baseline_table, table_tasks
    from dwise_predict.training import Targets, evaluate_predictors

    log = log or (lambda message: None)
    if len(paths) < 1:
        raise InputError("`across` needs at least one TRACES path")
    min_requests = loco_mod.MIN_REQUESTS if min_requests is None else min_requests
    rows = []
    for path in paths:
        ds = load_traces(path)
        train, ev = ds.split("train"), ds.split("eval")
        if len(ev) == 0 or len(train) < 8:
            raise InputError(f"{path}: needs a train split (>= 8 requests) and an eval split to be evaluated")
        kept = None if finished is None else Path(finished) / f"{result_key([ds], config, loco=loco, min_requests=min_requests)}.json"
        if kept is not None and (row := _read_row(kept)) is not None:
            log(f"  {path}: evaluated before the interruption, row kept in {kept.parent}")
            rows.append({**row, "path": str(path)})
            continue
        log(f"  {path}: training on {len(train)} requests")
        predictors = fit_kept(train, config, finished, log)
        metrics = evaluate_predictors(predictors, ev, config.bootstrap, config.seed)
        scored = ev.subset(Targets.of(ev).events)
        loco_tasks, skipped = loco_mod.plan(train, scored, config, min_requests=min_requests) if loco else ([], [])
        tasks = loco_tasks + table_tasks(train, scored, config)
        log(f"    retraining {len(tasks)} times ({len(loco_tasks)} held-out categories "
            "+ prompt-hidden-state baseline + the ablation without the first-round state)")
        retrained = run_tasks(tasks, jobs, kept=finished, log=log)
        shipped = {"admission": predictors.admission_total(scored), "refined": predictors.refined_remaining(scored)}
        predictions = baseline_predictions(train.subset(Targets.of(train).events), scored, shipped["admission"],
                                           shipped["refined"], {name: retrained[name]["refined"] for name in TASK_WORDS},
                                           config.seed, predictors.ensemble.candidate)
        table = baseline_table(scored, predictions)
        baselines, ablations = ({r["name"]: {k: r[k] for k in ("spearman", "within_category_mean")}
                                 for r in table if r["kind"] == kind} for kind in ("baseline", "ablation"))
        rows.append({
            "path": str(path),
            "model": model_label(ds),
            "hidden_size": ds.hidden_size,
            "n_train": len(train),
            "n_eval": len(ev),
            "candidate": predictors.ensemble.candidate,
            # the choice's criterion and its tie-break (training.select.choose), out of fold on the train split
            "cv": {c: {"spearman": s.get("cv_spearman"), "within_category": s.get("cv_within_category")}
                   for c, s in predictors.selection.get("candidates", {}).items()},
            "admission": _pick(metrics["admission"]),
            "refined": _pick(metrics["refined"]),
            "median_ratio_calibrated": metrics["calibration"]["median_ratio_calibrated"],
            "baselines": baselines,
            "ablations": ablations,
        })
        if loco:
            held = {t.name: retrained[t.name] for t in loco_tasks}
            table = loco_mod.table(scored, shipped, held, skipped, min_requests=min_requests, n_boot=0)  # means only
            rows[-1]["held_out"] = {"mean": table["mean"]["refined"]["held_out"],
                                    "categories": {r["category"]: r["refined"]["held_out"] for r in table["rows"]},
                                    "skipped": [s["category"] for s in table["skipped"]]}
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            write_json(kept, rows[-1])
    result = {"rows": rows, "config": config.to_dict()}
    if len(rows) >= 2:
        result["summary"] = {name: M.mean_sd(get(r) for r in rows) for name, get in SUMMARY_COLUMNS.items()
                             if any(get(r) is not None for r in rows)}
        result["versus"] = versus_baselines(rows)
    return result


def _read_row(path: Path) -> dict | None:
    """A kept row, or None when there is none (or it cannot be read: then the set is evaluated again)."""
    try:
        return read_json_object(path, StoreError)
    except (OSError, StoreError):
        return None


def versus_baselines(rows: Sequence[dict]) -> dict:
    """The shipped refinement predictor against every non-oracle baseline over the sets, paired by set.

    For each baseline scored in every set, and each measure (``"spearman"``, ``"within_category_mean"``):
    its mean ± sd over the sets, the shipped predictor's margin over it (shipped − baseline, per set) as
    mean ± sd with a 95 % Student-t interval of the mean, and in how many sets the shipped predictor is
    level or ahead. ``"best"``: per measure, the baseline with the highest mean and the shipped
    predictor's margin over it (``"inside_interval"``: the interval holds 0, no clear difference).
    ``"ablations"``: the same for the ablation rows (the shipped recipe without the first-round
    state), which are never the best baseline: their margin is what the left-out input adds."""
    shipped = {measure: [r["refined"][measure] for r in rows] for measure in MEASURES}

    def paired(key: str) -> dict:
        names = [n for n in rows[0].get(key, {}) if all(n in r.get(key, {}) for r in rows)]
        return {name: {measure: _paired(shipped[measure], [r[key][name][measure] for r in rows])
                       for measure in MEASURES} for name in names}

    baselines, best = paired("baselines"), {}
    for measure in MEASURES:
        scored = [n for n in baselines if baselines[n][measure]["margin"]["mean"] is not None]  # both sides defined
        if not scored:
            best[measure] = None
            continue
        top = max(scored, key=lambda n: baselines[n][measure]["mean"])
        stat = baselines[top][measure]
        best[measure] = {"baseline": top, "shipped": M.mean_sd(shipped[measure])["mean"], **_verdict(stat)}
    return {"baselines": baselines, "ablations": paired("ablations"), "best": best}


def _paired(shipped: list, theirs: list) -> dict:
    """One row's values over the sets and the shipped predictor's margins over it, paired by set."""
    margins = [None if a is None or b is None else a - b for a, b in zip(shipped, theirs)]
    defined = [m for m in margins if m is not None]
    return {**M.mean_sd(theirs), "margin": M.mean_sd(margins), "margin_ci": M.mean_interval(margins),
            "sets_shipped_level_or_ahead": sum(m >= 0 for m in defined), "sets": len(defined)}


def _verdict(stat: dict) -> dict:
    """A row's margin over the sets (of :func:`_paired`) as a verdict: does its interval hold 0?"""
    ci = stat["margin_ci"]
    return {"mean": stat["mean"], "margin": stat["margin"]["mean"], "margin_ci": ci,
            "inside_interval": ci is None or ci[0] <= 0.0 <= ci[1],
            "sets_shipped_level_or_ahead": stat["sets_shipped_level_or_ahead"], "sets": stat["sets"]}


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
    sections = [Section("Across trace sets", "", [table])]
    if "versus" in result:
        sections.append(_versus_section(result["versus"], len(result["rows"])))
    return Document("dwise-predict: predictors across trace sets", [], sections)


def _versus_section(versus: dict, n_sets: int) -> Section:
    """The shipped predictor against every baseline over the sets: one sentence per measure, then the table."""
    lines = []
    for measure, words in MEASURES.items():
        best = versus["best"][measure]
        if best is None:
            lines.append(f"By mean {words} over the {n_sets} sets: no baseline is defined.")
            continue
        lines.append(
            f"By mean {words} over the {n_sets} sets, the shipped refinement predictor ({fmt(best['shipped'])}) "
            f"{'leads' if best['margin'] >= 0 else 'trails'} the best non-oracle baseline, {best['baseline']} "
            f"({fmt(best['mean'])}), by {_over_sets(best)}.")
    cols = ["baseline"] + [c for words in MEASURES.values()
                           for c in (f"{words}, mean ± sd", f"shipped − baseline, {words} (95% interval)",
                                     "sets shipped level or ahead")]

    def within_mean(name: str) -> tuple[bool, float]:  # best first, undefined last
        mean = versus["baselines"][name]["within_category_mean"]["mean"]
        return mean is None, -(mean or 0.0)

    ablations = versus.get("ablations", {})
    for stats in ablations.values():
        parts = [f"{words} {fmt(stats[measure]['mean'])}, so the first-round state adds "
                 f"{_over_sets(_verdict(stats[measure]))}"
                 for measure, words in MEASURES.items() if stats[measure]["margin"]["mean"] is not None]
        if parts:
            lines.append(f"Ablation over the {n_sets} sets: without the first-round hidden state the same recipe "
                         "reaches mean " + "; ".join(parts) + ".")
    rows = []
    every = {**versus["baselines"], **ablations}
    for name in sorted(versus["baselines"], key=within_mean) + list(ablations):
        cells = [name]
        for measure in MEASURES:
            stat = every[name][measure]
            margin = stat["margin"]["mean"]
            cells += [fmt_pm(stat), "n/a" if margin is None else f"{margin:+.3f} {fmt_interval(stat['margin_ci'])}".strip(),
                      f"{stat['sets_shipped_level_or_ahead']} / {stat['sets']}"]
        rows.append(cells)
    table = Table(cols, rows, "The shipped refinement predictor against every non-oracle baseline (and the ablation "
                              "without the first-round state), paired by trace set")
    return Section("Shipped against every baseline", "", lines + [table])


def _over_sets(verdict: dict) -> str:
    """A margin over the sets (of :func:`_verdict`) in words: mean, t-interval, verdict and the count of
    sets level or ahead."""
    noise = ("inside the interval: not a clear difference over these sets" if verdict["inside_interval"]
             else "outside the interval")
    return (f"{verdict['margin']:+.3f} (95% t-interval over the sets {fmt_interval(verdict['margin_ci'])}; {noise}); "
            f"level or ahead in {verdict['sets_shipped_level_or_ahead']} of {verdict['sets']} sets")

