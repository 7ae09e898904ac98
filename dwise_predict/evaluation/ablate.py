"""Ablations as tables: which inputs, how much training data and which seeds the refinement needs.

Each ablation retrains the refinement predictor on the training split under several settings and
scores the calibrated estimate on the evaluation split (finished requests): ρ over all requests and
mean within-category ρ, each with a 95 % bootstrap interval (requests resampled inside their
category, so every resample keeps the category mix), and the difference to the reference row (the
paper's calibrated survival ensemble on the full bundle input) with a *paired* bootstrap interval:
a difference whose interval contains 0 is reported as inside the noise.

- ``inputs`` — the bundle input ``[h1, last prompt block, prompt tokens, budget, early signals]``,
  the same without the early signals, with one hidden state only (``h1``, or the pooled last prompt
  block), and with neither; for
  the ``survival`` (the paper's recipe) and ``ridge-within+signals`` candidates. The row marked
  "not in a bundle" (Amin et al.'s LightGBM on their four early signals, prompt length among them:
  :data:`.baselines.EARLY_SIGNALS`) is for comparison only: a
  tree ensemble is not a contract-2 graph.
- ``train-size`` — 25 %, 50 % and 100 % of the training split (drawn per category with the seed),
  for the same two candidates; the shipped candidate's rows also give the mean held-out-category ρ
  at that size (does more data close the gap to an unseen category?).
- ``seeds`` — five training seeds (``seed .. seed + 4``): per-seed values, mean ± sd (the DWISE paper,
  Table 10), for ``survival``, ``ridge`` (deterministic: sd 0 is its honest answer) and ``auto``
  (the CV choice, recorded per seed).
- ``layers`` — which layer of the first denoising forward carries the signal: the default
  ``first_round`` (reference) and every layer that traces collected with ``collect --layers`` keep
  mean-pooled (``first_round.layer{L}.mean``; layer 0 is the embedding output, the last index equals
  ``first_round``).
- ``pooling`` — which pooling of the final layer: the default ``first_round`` (reference) and each
  stored pooling of the final layer: ``mean``, ``last`` (the block's last row) and ``positions``
  flattened to ``[N, block_size * H]`` (every row kept apart: what the mean could be losing).

``layers`` and ``pooling`` fit the ``ridge`` candidate (fast, closed form) with the hidden input
swapped, the other inputs kept, and also report the mean held-out-category
ρ: for each category with enough requests (:data:`.loco.MIN_REQUESTS`) the ridge is refitted on the
training split without it and scored within it. They are research rows: the serving hook pools the
final layer only, so a better layer or pooling is a finding that no bundle can use yet.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.evaluation import loco
from dwise_predict.evaluation.baselines import early_signal_predictions, keep_inputs
from dwise_predict.evaluation.document import Document, Figure, Section, Table, fmt, fmt_interval, fmt_pm
from dwise_predict.evaluation.pool import RetrainTask, run_tasks
from dwise_predict.names import HIDDEN_STATES
from dwise_predict.metrics import mean_sd, percentile_interval, rank_scores, spearman, stratified_indices
from dwise_predict.traces import TraceDataset
from dwise_predict.traces.hidden_extra import MANIFEST_KEY as HIDDEN_EXTRA_KEY
from dwise_predict.traces.hidden_extra import parse_tensor_name

KINDS = ("inputs", "train-size", "seeds", "layers", "pooling")
HIDDEN_KINDS = ("layers", "pooling")  # need the tensors of `collect --layers`
REFERENCE = "survival, h1 + last prompt block + prompt tokens + budget + early signals"  # the inputs ablation's reference row
INPUT_CANDIDATES = ("survival", "ridge-within+signals")
# the train-size rows that also measure held-out-category ρ: the shipped default candidate (the
# ensemble's 24 extra fits would double the ablation's time for a row that ships nowhere)
TRANSFER_CANDIDATE = "ridge-within+signals"
DEFAULT_HIDDEN = "first_round (default)"  # the layers and pooling ablations' reference row
N_BOOT = 1000
TRAIN_FRACTIONS = (0.25, 0.5, 1.0)
N_SEEDS = 5


def _num(x) -> float | None:
    x = float(np.asarray(x).ravel()[0])
    return x if np.isfinite(x) else None


def score_rows(rows: list[dict], preds: dict[str, np.ndarray], true, categories, reference: str, n_boot: int,
               seed: int) -> dict:
    """Add ρ, within-category ρ, their intervals and the paired difference to ``reference`` to each row;
    returns the table dict with the best bundle row and the verdict."""
    idx = stratified_indices(categories, n_boot, seed)
    boot = {name: rank_scores(p, true, categories, idx) for name, p in preds.items()}
    ref = boot.get(reference)
    ref_point = [_num(v) for v in rank_scores(preds[reference], true, categories)] if ref is not None else None
    for row in rows:
        name = row["name"]
        overall, within = (_num(v) for v in rank_scores(preds[name], true, categories))
        row.update(spearman=overall, within_category_mean=within,
                   spearman_ci=percentile_interval(boot[name][0]), within_category_ci=percentile_interval(boot[name][1]))
        if ref is not None:
            row["delta_vs_reference"] = {
                "spearman": _diff(overall, ref_point[0]),
                "spearman_ci": percentile_interval(boot[name][0] - ref[0]),
                "within_category_mean": _diff(within, ref_point[1]),
                "within_category_ci": percentile_interval(boot[name][1] - ref[1]),
            }
    return {"rows": rows, "reference": reference, "n_boot": n_boot, "verdict": verdict(rows, reference)}


def _diff(a, b):
    return None if a is None or b is None else a - b


def verdict(rows: list[dict], reference: str, bundle_only: bool = True) -> dict:
    """The best bundle row (any row unless ``bundle_only``) by within-category ρ (ties: overall ρ), its
    margin over the reference and whether that margin lies inside the paired bootstrap noise (its 95 %
    interval contains 0)."""
    kind = "bundle row" if bundle_only else "row"
    bundle = [r for r in rows if (r.get("bundle", True) or not bundle_only) and r["within_category_mean"] is not None]
    if not bundle:
        return {"best": None, "text": f"no {kind} has a defined within-category ρ"}
    best = max(bundle, key=lambda r: (r["within_category_mean"], r["spearman"] or -1))
    delta = best.get("delta_vs_reference") or {}
    ci = delta.get("within_category_ci")
    inside = ci is None or ci[0] <= 0.0 <= ci[1]
    if best["name"] == reference:
        text = f"the reference ({reference}) is the best {kind} (within-category ρ {fmt(best['within_category_mean'])})"
    else:
        text = (f"best {kind}: {best['name']}, within-category ρ {fmt(best['within_category_mean'])}, "
                f"{fmt(delta.get('within_category_mean'))} over the reference (paired 95% interval "
                f"{_interval(ci)}): " + ("inside the bootstrap noise" if inside else "outside the bootstrap noise"))
    return {"best": best["name"], "delta_within": delta.get("within_category_mean"), "delta_within_ci": ci,
            "inside_interval": bool(inside), "text": text}


def _interval(ci) -> str:
    return "n/a" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


# --- the ablations ------------------------------------------------------------------------------------


def hidden_settings(kind: str, ds: TraceDataset) -> list[tuple[str, str]]:
    """``(row name, tensor name)`` of the ``layers`` or ``pooling`` ablation, the default first.

    Raises
    ------
    InputError
        ``ds`` lacks the tensors (traces collected without ``collect --layers``): one line saying how
        to re-collect.
    """
    stored = {parsed: name for name in ds.extra_hidden if (parsed := parse_tensor_name(name)) is not None}
    if kind == "layers":
        rows = [(f"layer {layer}, mean", stored[layer, pooling]) for layer, pooling in sorted(stored) if pooling == "mean"]
        need = "`dwise-predict collect --layers 0,1,-1`"  # mean is the default pooling
    else:
        final = (ds.manifest.get(HIDDEN_EXTRA_KEY) or {}).get("final_layer")
        rows = [(f"layer {final}, {pooling}" + (" (flattened)" if pooling == "positions" else ""), stored[layer, pooling])
                for layer, pooling in sorted(stored, key=lambda k: ("mean", "last", "positions").index(k[1]))
                if layer == final]
        need = "`dwise-predict collect --layers -1 --pooling mean,last,positions`"
    if not rows:
        where = f"traces in {ds.path}" if ds.path else "these traces"
        raise InputError(f"`ablate` {kind} needs first-round tensors that {where} lack (collected without them): "
                         f"re-collect with {need}")
    return [(DEFAULT_HIDDEN, "first_round")] + rows


def _with_hidden(ds: TraceDataset, tensor: str) -> TraceDataset:
    """``ds`` with ``first_round`` replaced by the stored tensor ``tensor``, flattened to (N, features),
    and ``prompt_last`` by zeros of the same width (a constant carries nothing): these ablations
    compare first-round tensors alone."""
    hidden = ds.first_round if tensor == "first_round" else ds.extra_hidden[tensor]
    hidden = hidden.reshape(len(ds), -1)  # positions: (N, block, H) -> (N, block * H)
    return TraceDataset(ds.requests, hidden, np.zeros_like(hidden), ds.manifest, ds.path)


def _held_out_tasks(row: str, train: TraceDataset, eval_ds: TraceDataset, config,
                    min_requests: int) -> dict[str, RetrainTask]:
    """The retrainings behind a row's held-out-category ρ: category -> its retraining without it, for
    the categories :func:`.loco.plan` evaluates (at least ``min_requests`` requests on each side);
    named ``"<row> | without <category>"``, unique across rows."""
    tasks, _ = loco.plan(train, eval_ds, config, min_requests=min_requests)
    return {task.name: dataclasses.replace(task, name=f"{row} | without {task.name}") for task in tasks}


def _held_out_rho(held: dict[str, RetrainTask], results: dict, eval_ds: TraceDataset) -> dict[str, float | None]:
    """Category -> within-category ρ of the retraining that held it out of training."""
    cats = eval_ds.requests["category"].astype(str).to_numpy()
    true = eval_ds.requests["total_rounds"].to_numpy(float) - 1.0
    return {category: spearman(results[task.name]["refined"][cats == category], true[cats == category])
            for category, task in held.items()}


def _held_out_fields(held: dict[str, float | None]) -> dict:
    """A row's ``held_out`` (category -> ρ) and ``held_out_mean`` over the categories with a ρ."""
    defined = [v for v in held.values() if v is not None]
    return {"held_out": held, "held_out_mean": float(np.mean(defined)) if defined else None}


def _subsample(train: TraceDataset, fraction: float, seed: int) -> TraceDataset:
    if fraction >= 1.0:
        return train
    rng = np.random.default_rng(seed)
    cats = train.requests["category"].astype(str).to_numpy()
    keep = np.zeros(len(train), dtype=bool)
    for cat in sorted(set(cats)):
        where = np.flatnonzero(cats == cat)
        keep[rng.choice(where, size=max(2, int(round(fraction * where.size))), replace=False)] = True
    return train.subset(keep)


def ablate(kind: str, train: TraceDataset, eval_ds: TraceDataset, config, n_boot: int = N_BOOT,
           log: Callable[[str], None] | None = None, min_requests: int = loco.MIN_REQUESTS,
           jobs: int | None = None, kept: str | os.PathLike | None = None) -> dict:
    """Run one ablation (``kind`` in :data:`KINDS`); ``eval_ds`` should hold finished requests only.
    ``min_requests``: the held-out categories' floor, as ``evaluate --min-requests``. Every retraining
    is a :class:`~.pool.RetrainTask`, all of them run in one pool of ``jobs`` workers
    (:func:`~.pool.run_tasks`; None: one per core), so results do not depend on ``jobs``; ``kept``: its
    folder of finished retrainings (an interrupted run resumes).

    Returns ``{"kind", "rows": [{"name", "candidate", "inputs", "bundle", "n_train", "spearman",
    "spearman_ci", "within_category_mean", "within_category_ci", "delta_vs_reference"}, ...],
    "reference", "verdict", ...}``; ``layers`` and ``pooling`` rows, and ``train-size`` rows of
    :data:`TRANSFER_CANDIDATE`, add ``held_out`` (category -> ρ within it when held out of training)
    and ``held_out_mean``.
    """
    log = log or (lambda message: None)
    if kind not in KINDS:
        raise InputError(f"unknown ablation {kind!r}: choose from {', '.join(KINDS)}")
    true = eval_ds.requests["total_rounds"].to_numpy(float) - 1.0
    cats = eval_ds.requests["category"].astype(str).to_numpy()
    planned = _plan(kind, train, eval_ds, config, min_requests)
    tasks = [task for _, main, held in planned for task in (main, *(held or {}).values())]
    log(f"  ablation {kind}: {len(tasks)} retrainings")
    results = run_tasks(tasks, jobs, on_done=lambda name: log(f"  ablation {kind}: {name}"), kept=kept, log=log)
    rows, preds, per_seed = _fitted_rows(kind, planned, results, true, cats)
    extra: dict = {}
    if kind == "inputs":
        name = "early signals (all four), LightGBM"
        rows.append({"name": name, "candidate": "-", "inputs": "Amin et al.'s four early signals", "bundle": False,
                     "n_train": len(train)})
        preds[name] = early_signal_predictions(train, eval_ds, config.seed)["all four"]
    if kind == "seeds":
        extra["summary"] = {c: _mean_sd(v) for c, v in per_seed.items()}
    reference = {"inputs": REFERENCE, "train-size": "survival, 100% of train", "seeds": f"survival, seed {config.seed}",
                 "layers": DEFAULT_HIDDEN, "pooling": DEFAULT_HIDDEN}[kind]
    table = score_rows(rows, preds, true, cats, reference, n_boot, config.seed)
    if kind == "seeds":
        table["verdict"] = _seeds_verdict(extra["summary"])
    elif kind in HIDDEN_KINDS:  # the question is which layer or pooling carries the signal, bundle or not
        table["verdict"] = verdict(rows, reference, bundle_only=False)
        table["verdict"]["text"] += " (a research finding: the serving hook pools only the final layer's mean)"
    return {"kind": kind, "n_eval": int(len(eval_ds)), "n_train": int(len(train)), **table, **extra}


# One row of an ablation before it is scored: its fields, its fit, and its held-out fits (None where
# the row reports no held-out ρ).
Planned = tuple[dict, RetrainTask, dict[str, RetrainTask] | None]


def _planned(row: dict, train_v: TraceDataset, eval_v: TraceDataset, row_config, min_requests: int,
             held_out: bool = False) -> Planned:
    held = _held_out_tasks(row["name"], train_v, eval_v, row_config, min_requests) if held_out else None
    return row, RetrainTask(row["name"], train_v, eval_v, row_config), held


def _plan(kind: str, train: TraceDataset, eval_ds: TraceDataset, config, min_requests: int) -> list[Planned]:
    """The rows of ablation ``kind``, in table order, each with the retrainings it needs."""
    planned: list[Planned] = []
    if kind == "inputs":
        settings = [("h1 + last prompt block + prompt tokens + budget + early signals", HIDDEN_STATES, True),
                    ("h1 + last prompt block + prompt tokens + budget", HIDDEN_STATES, False),
                    ("h1 + prompt tokens + budget + early signals", ("first_round",), True),
                    ("last prompt block + prompt tokens + budget + early signals", ("prompt_last",), True),
                    ("prompt tokens + budget + early signals", (), True)]
        for candidate in INPUT_CANDIDATES:
            for label, states, signals in settings:
                row = {"name": f"{candidate}, {label}", "candidate": candidate, "inputs": label, "bundle": True,
                       "n_train": len(train)}
                planned.append(_planned(row, keep_inputs(train, states, signals), keep_inputs(eval_ds, states, signals),
                                        dataclasses.replace(config, refine=candidate), min_requests))
    elif kind == "train-size":
        for fraction in TRAIN_FRACTIONS:
            sub = _subsample(train, fraction, config.seed)
            for candidate in INPUT_CANDIDATES:
                row = {"name": f"{candidate}, {fraction:.0%} of train", "candidate": candidate,
                       "inputs": f"{fraction:.0%} of the training split", "bundle": True, "n_train": len(sub)}
                planned.append(_planned(row, sub, eval_ds, dataclasses.replace(config, refine=candidate), min_requests,
                                        held_out=candidate == TRANSFER_CANDIDATE))
    elif kind in HIDDEN_KINDS:
        ridge = dataclasses.replace(config, refine="ridge")
        for label, tensor in hidden_settings(kind, train):
            # only what first_round holds reaches a bundle: the serving hook pools the final layer
            bundle = tensor == "first_round" or np.array_equal(train.extra_hidden[tensor], train.first_round)
            row = {"name": label, "candidate": "ridge", "inputs": f"{tensor} + prompt tokens, budget, early signals",
                   "bundle": bundle, "n_train": len(train)}
            planned.append(_planned(row, _with_hidden(train, tensor), _with_hidden(eval_ds, tensor), ridge,
                                    min_requests, held_out=True))
    else:  # seeds
        for candidate in ("survival", "ridge", "auto"):
            for s in range(config.seed, config.seed + N_SEEDS):
                row = {"name": f"{candidate}, seed {s}", "candidate": candidate, "inputs": f"seed {s}", "bundle": True,
                       "n_train": len(train)}
                planned.append(_planned(row, train, eval_ds, dataclasses.replace(config, refine=candidate, seed=s),
                                        min_requests))
    return planned


def _fitted_rows(kind: str, planned: list[Planned], results: dict, true: np.ndarray,
                 cats: np.ndarray) -> tuple[list[dict], dict[str, np.ndarray], dict[str, list[dict]]]:
    """The planned rows with their retrainings' results: the rows (with held-out ρ where planned),
    each row's estimate by name and, for ``seeds``, each candidate's per-seed scores."""
    rows: list[dict] = []
    preds: dict[str, np.ndarray] = {}
    per_seed: dict[str, list[dict]] = {}
    for row, main, held in planned:
        pred = results[main.name]["refined"]
        if held is not None:
            row.update(_held_out_fields(_held_out_rho(held, results, main.eval)))
        if kind == "seeds":
            chosen = results[main.name]["candidate"]  # the CV's choice where the row's config says auto
            overall, within = rank_scores(pred, true, cats)
            per_seed.setdefault(row["candidate"], []).append({"seed": main.config.seed, "chosen": chosen,
                                                              "spearman": _num(overall), "within_category_mean": _num(within)})
            row["candidate"] = chosen
        rows.append(row)
        preds[row["name"]] = pred
    return rows, preds, per_seed


def _seeds_verdict(summary: dict) -> dict:
    """Over seeds the comparison is of means: the best candidate's mean within-category ρ against the
    reference's, and whether the gap exceeds the two seed spreads (sd) together."""
    means = {c: s["within_category_mean"] for c, s in summary.items() if s["within_category_mean"]["mean"] is not None}
    if not means:
        return {"best": None, "text": "no candidate has a defined within-category ρ over seeds"}
    best = max(means, key=lambda c: means[c]["mean"])
    ref = means.get("survival")
    if best == "survival" or ref is None:
        return {"best": best, "text": f"over {N_SEEDS} seeds the best mean within-category ρ is {best}'s "
                                      f"({fmt_pm(means[best])})", "inside_interval": None}
    gap = means[best]["mean"] - ref["mean"]
    spread = (means[best]["sd"] or 0.0) + (ref["sd"] or 0.0)
    inside = gap <= spread
    return {"best": best, "delta_within": gap, "inside_interval": bool(inside),
            "text": f"over {N_SEEDS} seeds {best} ranks within categories at {fmt_pm(means[best])} against the "
                    f"survival ensemble's {fmt_pm(ref)}: {gap:+.3f}, "
                    + ("within the seed spread" if inside else "larger than both seed spreads together")}


def _mean_sd(values: list[dict]) -> dict:
    return {"seeds": values, **{key: mean_sd(x[key] for x in values) for key in ("spearman", "within_category_mean")}}


# --- rendering ------------------------------------------------------------------------------------------


def ablation_table(result: dict) -> Table:
    held_out = any("held_out_mean" in r for r in result["rows"])
    cols = ["setting", "candidate", "n train", "ρ", "95% CI", "within-category ρ", "95% CI",
            "Δ within vs reference", "paired 95% CI"] + (["held-out-category ρ (mean)"] if held_out else [])
    rows = []
    for r in result["rows"]:
        d = r.get("delta_vs_reference") or {}
        rows.append([r["name"] + ("" if r.get("bundle", True) else " (not in a bundle)"), str(r["candidate"]),
                     str(r["n_train"]), fmt(r["spearman"]), fmt_interval(r["spearman_ci"]),
                     fmt(r["within_category_mean"]), fmt_interval(r["within_category_ci"]),
                     fmt(d.get("within_category_mean")), _interval(d.get("within_category_ci")).strip("n/a")]
                    + ([fmt(r.get("held_out_mean"))] if held_out else []))
    return Table(cols, rows, f"Ablation: {result['kind']} (evaluation split, {result['n_eval']} finished requests; "
                             f"reference: {result['reference']})")


def ablation_document(results: list[dict]) -> Document:
    sections = []
    for result in results:
        from dwise_predict.evaluation.plots import ablation_bars

        kind = result["kind"]
        blocks: list = [result["verdict"]["text"] + ".", ablation_table(result),
                        Figure(f"ablation_{kind.replace('-', '_')}", ablation_bars(result["rows"], f"Ablation: {kind}"),
                               "ρ overall and mean within-category ρ per setting, with 95% bootstrap intervals.")]
        if "summary" in result:
            summary = Table(["candidate", "ρ mean ± sd", "within-category ρ mean ± sd", "chosen per seed"], [
                [c, fmt_pm(s["spearman"]), fmt_pm(s["within_category_mean"]), ", ".join(str(x["chosen"]) for x in s["seeds"])]
                for c, s in result["summary"].items()
            ], "Over seeds (the DWISE paper, Table 10 style)")
            blocks.append(summary)
        sections.append(Section(f"Ablation: {result['kind']}", "", blocks))
    return Document("dwise-predict: ablations", [], sections)

