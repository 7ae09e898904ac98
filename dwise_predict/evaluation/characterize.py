"""Workload characterization of trace datasets: the measurements of Amin et al. on any model.

For the denoising rounds of each request (the work a scheduler must rank) it reports

- the spread: p25 / p50 / p90 / max, max-to-min ratio and coefficient of variation (CV = std / mean);
- discreteness: how many distinct round counts occur and the dominant spacing between consecutive
  distinct values. Amin et al. found counts on fixed "tiers" (``offset + spacing * k``); a dominant
  spacing above one shared by most gaps is that structure, a spacing of one means counts are dense;
- round count versus wall time: Pearson r and Spearman rho (Amin et al. found r > 0.99 on one GPU);
- the share of requests truncated by the output budget (``finish == 'budget'``);
- how each first-round early signal (and prompt length) orders requests inside each category, and
  whether that direction holds from one category to the next (:func:`signal_directions`);

over all requests and per category. Given requests at several output budgets (one or more trace
directories of the same model), it also tabulates CV and truncation per budget: Amin et al. found that
short budgets hide the spread because truncated requests all look alike.

Requests of different decodings are never pooled (:mod:`.decodings`): inputs of several block sizes
get one section each and Amin et al.'s block-size invariance table (:func:`block_size_invariance`);
inputs of several algorithms or parameters are refused unless split on request. Given repeated runs
of the same prompts, it adds the DWISE paper's Table 11 (:mod:`.stability`). Given D2F traces (our
pipeline decoding, ``collect --algorithm D2F``) and traces of another decoding of the same prompts,
split, it adds Amin et al.'s D2F-against-base comparison (Fig. 4, §III-A/B: :func:`d2f_vs_base`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dwise_predict.evaluation.decodings import DecodingGroup, group_by_decoding
from dwise_predict.evaluation.inputs import check_same_model, model_label
from dwise_predict.evaluation.stability import round_stability
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.metrics import bootstrap_ci, spearman
from dwise_predict.traces import TraceDataset

# A spacing counts as "tiers" when it is larger than one round and at least this share of the gaps
# between consecutive distinct round counts equal it.
TIER_SHARE = 0.5
# what signal_directions measures: the first round's early signals, then prompt length
SIGNAL_COLUMNS = (*EARLY_SIGNALS, "prompt_tokens")
# signal_directions' verdict for an input that orders some categories one way and others the other
DEPENDS_ON_CATEGORY = "depends on the category"
# engine.d2f.D2F.name, the algorithm `collect --algorithm D2F` records (evaluation does not import the engine)
D2F_ALGORITHM = "D2F"


def rounds_distribution(rounds: np.ndarray) -> dict:
    """Spread of a set of round counts.

    Parameters
    ----------
    rounds : array of shape (n,), denoising rounds per request (n >= 1).

    Returns
    -------
    dict with ``n``, ``mean``, ``std``, ``min``, ``p25``, ``p50``, ``p90``, ``max``, ``max_min_ratio``
    (None when the minimum is 0) and ``cv`` (std / mean, population std; None when the mean is 0).
    """
    r = np.asarray(rounds, dtype=float)
    mean, std = float(r.mean()), float(r.std())
    lo, hi = float(r.min()), float(r.max())
    p25, p50, p90 = (float(v) for v in np.percentile(r, [25, 50, 90]))
    return {
        "n": int(r.size),
        "mean": mean,
        "std": std,
        "min": lo,
        "p25": p25,
        "p50": p50,
        "p90": p90,
        "max": hi,
        "max_min_ratio": hi / lo if lo > 0 else None,
        "cv": std / mean if mean > 0 else None,
    }


def discreteness(rounds: np.ndarray) -> dict:
    """How the round counts sit on the integer line.

    Returns
    -------
    dict with ``distinct`` (number of distinct counts), ``dominant_spacing`` (most common gap between
    consecutive distinct counts; None with one distinct count), ``spacing_share`` (share of gaps equal
    to it), ``top10_share`` (share of requests on the ten most common counts), ``tiered`` (spacing > 1
    on at least :data:`TIER_SHARE` of the gaps) and ``tiers`` (``"offset + spacing*k"`` when tiered).
    """
    r = np.asarray(rounds).astype(int)
    values, counts = np.unique(r, return_counts=True)
    out = {
        "distinct": int(values.size),
        "dominant_spacing": None,
        "spacing_share": None,
        "top10_share": float(np.sort(counts)[::-1][:10].sum() / r.size),
        "tiered": False,
        "tiers": None,
    }
    if values.size < 2:
        return out
    gaps, gap_counts = np.unique(np.diff(values), return_counts=True)
    spacing = int(gaps[np.argmax(gap_counts)])
    share = float(gap_counts.max() / gap_counts.sum())
    tiered = spacing > 1 and share >= TIER_SHARE
    out.update(dominant_spacing=spacing, spacing_share=share, tiered=tiered)
    if tiered:
        out["tiers"] = f"{int(values[0])} + {spacing}k"
    return out


def rounds_vs_wall(rounds: np.ndarray, wall_s: np.ndarray) -> dict:
    """Pearson r and Spearman rho between round counts and wall seconds (None where either is constant)."""
    r = np.asarray(rounds, dtype=float)
    w = np.asarray(wall_s, dtype=float)
    pearson = None
    if r.size >= 2 and r.std() > 0 and w.std() > 0:
        pearson = float(np.corrcoef(r, w)[0, 1])
    return {"pearson": pearson, "spearman": spearman(r, w)}


def describe(requests: pd.DataFrame) -> dict:
    """All single-set measurements of one request table (rounds, tiers, wall time, truncation)."""
    rounds = requests["total_rounds"].to_numpy()
    return {
        "rounds": rounds_distribution(rounds),
        "discreteness": discreteness(rounds),
        "wall_time": rounds_vs_wall(rounds, requests["wall_s"].to_numpy()),
        "truncated_share": float((requests["finish"] == "budget").mean()),
        "mean_output_tokens": float(requests["output_tokens"].mean()),
    }


def budget_sweep(requests: pd.DataFrame) -> list[dict]:
    """CV, truncation and spread of rounds per output budget, in increasing budget order."""
    rows = []
    for budget, group in requests.groupby("budget", sort=True):
        stats = describe(group)
        rows.append(
            {
                "budget": int(budget),
                "n": int(len(group)),
                "cv": stats["rounds"]["cv"],
                "truncated_share": stats["truncated_share"],
                "p50": stats["rounds"]["p50"],
                "p90": stats["rounds"]["p90"],
                "max_min_ratio": stats["rounds"]["max_min_ratio"],
                "mean_output_tokens": stats["mean_output_tokens"],
            }
        )
    return rows


def characterize(datasets: Sequence[TraceDataset], split_decodings: bool = False, stability: bool = False) -> dict:
    """Characterize one model's traces (one or more directories, e.g. one per output budget or block size).

    Parameters
    ----------
    datasets : trace datasets of the same model (checked; :class:`InputError` otherwise).
    split_decodings : one section per decoding where the inputs differ in algorithm, its parameters,
        dtype, engine or sampling parameters (refused otherwise: :func:`.decodings.group_by_decoding`).
        Inputs that differ only in block size are split by it either way.
    stability : the inputs are repeated runs of the same prompts: add the DWISE paper's Table 11
        (:func:`.stability.round_stability`; they must share one decoding and budget).

    Returns
    -------
    With one decoding: ``model``, ``traces`` and that decoding's section (:func:`characterize_group`:
    ``decoding``, ``label``, ``overall``, ``per_category``, ``per_trace``, ``budget_sweep``,
    ``signal_directions``). With several: ``model``, ``traces``, ``configurations`` (one section per
    decoding, ordered as :func:`.decodings.group_by_decoding` orders them) and ``invariance`` (one
    :func:`block_size_invariance` table per algorithm and parameters met at more than one block size).
    With ``stability``, also ``stability`` (:func:`.stability.round_stability`). With a D2F decoding
    among several, also ``d2f_vs_base`` (:func:`d2f_vs_base` for each D2F and each other decoding).
    """
    check_same_model(datasets)
    groups = group_by_decoding(datasets, split_decodings)
    result: dict = {"model": model_label(datasets[0]), "traces": [str(d.path) if d.path else None for d in datasets]}
    if len(groups) == 1:
        result.update(characterize_group(groups[0]))
    else:
        result["configurations"] = [characterize_group(g) for g in groups]
        result["invariance"] = [block_size_invariance(family) for family in _families(groups) if len(family) > 1]
        d2f = [g for g in groups if g.settings["algorithm"] == D2F_ALGORITHM]
        if d2f:  # absent otherwise: a characterization without D2F is unchanged
            result["d2f_vs_base"] = [d2f_vs_base(d, b) for d in d2f for b in groups
                                     if b.settings["algorithm"] != D2F_ALGORITHM]
    if stability:
        result["stability"] = round_stability(datasets)
    return result


def characterize_group(group: DecodingGroup) -> dict:
    """Every single-decoding measurement of ``group``'s requests (all inputs pooled, and each input)."""
    requests = group.requests
    return {
        "decoding": group.decoding,
        "label": group.label,
        "traces": [path for path, _ in group.parts],
        "overall": describe(requests),
        "per_category": {str(c): describe(g) for c, g in requests.groupby("category", sort=True)},
        "per_trace": [describe(frame) for _, frame in group.parts],
        "budget_sweep": budget_sweep(requests),
        "signal_directions": signal_directions(requests),
    }


def _families(groups: list[DecodingGroup]) -> list[list[DecodingGroup]]:
    """The groups that share algorithm and parameters, one list per family (block sizes ascending)."""
    families: dict[str, list[DecodingGroup]] = {}
    for g in groups:
        families.setdefault(g.family, []).append(g)
    return list(families.values())


def block_size_invariance(family: Sequence[DecodingGroup]) -> dict:
    """Amin et al.'s block-size invariance (§III-E) over groups of one decoding at several block sizes.

    Amin et al. found block size a serving granularity, not a difficulty: a request's latency varied
    little across block sizes 16-128 (within-request CV 0.0096 on HumanEval) against a lot across
    requests (CV 0.345), about 36 times. This measures it in rounds (the work a scheduler ranks): per
    block size the requests, mean rounds per output block (per request ``total_rounds`` over its blocks,
    then averaged), total rounds p50 and CV across requests; then, on the requests met at every block
    size (same ``request_id`` and budget), the mean over requests of the CV of their total rounds across
    block sizes (within) against the mean over block sizes of the CV across those requests (across).

    Returns
    -------
    dict with ``label`` (what the groups share), ``rows`` (one per block size: ``block_size``, ``n``,
    ``mean_rounds_per_block``, ``p50``, ``cv``) and ``matched`` (requests met at every block size),
    ``within_request_cv``, ``across_request_cv`` and ``ratio`` (across / within; None where undefined).
    """
    rows = []
    matched: pd.DataFrame | None = None
    for g in family:
        requests = g.requests
        blocks = requests["rounds_per_block"].map(len).to_numpy(dtype=float)
        spread = rounds_distribution(requests["total_rounds"].to_numpy())
        rows.append({"block_size": g.block_size, "n": spread["n"],
                     "mean_rounds_per_block": float((requests["total_rounds"].to_numpy(dtype=float) / blocks).mean()),
                     "p50": spread["p50"], "cv": spread["cv"]})
        # several inputs of one block size may repeat a request: its first count stands for it
        totals = (requests.drop_duplicates(["request_id", "budget"]).set_index(["request_id", "budget"])["total_rounds"]
                  .rename(g.block_size))
        matched = totals.to_frame() if matched is None else matched.join(totals, how="inner")
    counts = matched.to_numpy(dtype=float)  # (matched requests, block sizes); every count >= 1 (contract 1)
    within = across = None
    if len(counts):
        within = float(np.mean(counts.std(axis=1) / counts.mean(axis=1)))
        across = float(np.mean(counts.std(axis=0) / counts.mean(axis=0)))
    return {"label": family[0].settings_label, "rows": rows, "matched": int(len(counts)), "within_request_cv": within,
            "across_request_cv": across, "ratio": across / within if within else None}


def d2f_vs_base(d2f: DecodingGroup, base: DecodingGroup) -> dict:
    """Amin et al.'s D2F against the base model on the same prompts (Fig. 4, §III-A/B), here two
    decodings of one model.

    Amin et al. (LLaDA-8B-Instruct, GSM8K, 512-token budget, one request at a time) found D2F's
    denoising steps on 11 tiers (178 + 29k) and its latency CV 0.272 against 0.100 for the base model
    without the D2F adapter, 2.7 times. This measures, on the requests both decoded (same
    ``request_id`` and budget; a request repeated in one group counts once, its first row), per
    decoding: the CV of total rounds and of wall time, wall time's max/min, and the tier detector's
    verdict on the rounds (:func:`discreteness`); then D2F's CV over the base's for each.

    Returns
    -------
    dict with ``d2f`` and ``base`` (the groups' labels), ``matched`` (requests in both), ``rows`` (D2F's
    then the base's: ``label``, ``algorithm``, ``rounds`` (:func:`rounds_distribution`), ``wall``
    (:func:`rounds_distribution` of wall seconds), ``discreteness``; empty when nothing matched),
    ``rounds_cv_ratio`` and ``wall_cv_ratio`` (D2F / base; None where undefined).
    """
    key = ["request_id", "budget"]
    matched = d2f.requests.drop_duplicates(key).merge(base.requests.drop_duplicates(key), on=key,
                                                       suffixes=("_d2f", "_base"))
    rows = [{"label": g.label, "algorithm": g.settings["algorithm"],
             "rounds": rounds_distribution(matched[f"total_rounds_{side}"].to_numpy()),
             "wall": rounds_distribution(matched[f"wall_s_{side}"].to_numpy()),
             "discreteness": discreteness(matched[f"total_rounds_{side}"].to_numpy())}
            for g, side in ((d2f, "d2f"), (base, "base"))] if len(matched) else []

    def ratio(measure: str) -> float | None:
        if not rows or rows[0][measure]["cv"] is None or not rows[1][measure]["cv"]:
            return None
        return rows[0][measure]["cv"] / rows[1][measure]["cv"]

    return {"d2f": d2f.label, "base": base.label, "matched": int(len(matched)), "rows": rows,
            "rounds_cv_ratio": ratio("rounds"), "wall_cv_ratio": ratio("wall")}


def signal_directions(requests: pd.DataFrame, columns: Sequence[str] = SIGNAL_COLUMNS, seed: int = 0) -> list[dict]:
    """How each early signal orders requests by total rounds inside each category, and whether that
    direction carries from one category to another.

    Amin et al. measured each first-round signal against rounds over all requests. A predictor learns a
    signal's direction from the categories it is trained on; where the direction reverses from one
    category to another (in the tiny model's quickstart traces a confident first round means fewer
    rounds in code, instruction, math, MCQ and multilingual math, and more in chat), a category never
    seen in training may run against the direction learned from the others, and no predictor orders
    it by that signal. This measures it: Spearman ρ of the signal with total rounds over all requests
    and inside each category, each with its 95 % percentile bootstrap interval (requests resampled,
    :func:`dwise_predict.metrics.bootstrap_ci`). A category's direction counts where its interval
    excludes zero.

    Parameters
    ----------
    columns : request-table columns to measure; those the traces lack (traces collected before a
        signal existed) are left out. seed : the bootstrap's.

    Returns
    -------
    One dict per column: ``column``, ``overall`` and ``per_category`` (category → ``{"n", "rho",
    "interval"}``, None where undefined), ``more_rounds`` and ``fewer_rounds`` (the categories whose
    interval lies above or below zero) and ``direction``: ``"more rounds"`` or ``"fewer rounds"``
    where the categories with a direction agree, ``"depends on the category"`` where they disagree,
    ``"none"`` where no category has one.
    """
    rounds = requests["total_rounds"].to_numpy(dtype=float)
    categories = requests["category"].astype(str).to_numpy()

    def cell(values: np.ndarray, rows: np.ndarray) -> dict:
        interval = bootstrap_ci(values[rows], rounds[rows], seed=seed)
        return {"n": int(rows.sum()), "rho": spearman(values[rows], rounds[rows]),
                "interval": None if interval is None else list(interval)}

    out = []
    for column in (c for c in columns if c in requests.columns):
        values = requests[column].to_numpy(dtype=float)
        per_category = {c: cell(values, categories == c) for c in sorted(set(categories))}
        more = [c for c, v in per_category.items() if v["interval"] and v["interval"][0] > 0]
        fewer = [c for c, v in per_category.items() if v["interval"] and v["interval"][1] < 0]
        direction = (DEPENDS_ON_CATEGORY if more and fewer else "more rounds" if more
                     else "fewer rounds" if fewer else "none")
        out.append({"column": column, "overall": cell(values, np.ones(len(values), dtype=bool)),
                    "per_category": per_category, "more_rounds": more, "fewer_rounds": fewer,
                    "direction": direction})
    return out


def output_vs_work(requests: pd.DataFrame) -> dict:
    """How output length and work diverge, overall and per category (the DWISE paper, Table 12 and §11).

    Work is ``prompt_blocks + total_rounds`` (the ``R = P + r̂`` the scheduler ranks: docs/serving.md).
    Per group: requests and share of all work, mean output tokens and rounds, Spearman ρ between
    output tokens and rounds (and work), rounds per output token (mean, p10, p50, p90), the share that
    hit the budget and the p10-p90 of work among those (same output length, different work: the DWISE
    paper found 38-184). Output-length rankers order requests by tokens; where ρ(tokens, rounds) is
    low or categories swap order, they misorder work.

    Returns
    -------
    dict with ``overall`` (one row) and ``per_category`` (rows sorted by category).
    """
    work_all = float((requests["prompt_blocks"] + requests["total_rounds"]).sum())

    def row(group: pd.DataFrame) -> dict:
        tokens = group["output_tokens"].to_numpy(dtype=float)
        rounds = group["total_rounds"].to_numpy(dtype=float)
        work = rounds + group["prompt_blocks"].to_numpy(dtype=float)
        per_token = rounds / np.maximum(tokens, 1.0)
        p10, p50, p90 = (float(v) for v in np.percentile(per_token, [10, 50, 90]))
        at_budget = (group["finish"] == "budget").to_numpy()
        work_lo = work_hi = None
        if at_budget.any():
            work_lo, work_hi = (float(v) for v in np.percentile(work[at_budget], [10, 90]))
        return {
            "n": int(len(group)),
            "request_share": len(group) / len(requests),
            "work_share": float(work.sum()) / work_all if work_all > 0 else None,
            "mean_output_tokens": float(tokens.mean()),
            "mean_rounds": float(rounds.mean()),
            "spearman_tokens_rounds": spearman(tokens, rounds),
            "spearman_tokens_work": spearman(tokens, work),
            "rounds_per_token_mean": float(per_token.mean()),
            "rounds_per_token_p10": p10,
            "rounds_per_token_p50": p50,
            "rounds_per_token_p90": p90,
            "budget_share": float(at_budget.mean()),
            "work_at_budget_p10": work_lo,
            "work_at_budget_p90": work_hi,
        }

    return {
        "overall": row(requests),
        "per_category": [{"category": str(c), **row(g)} for c, g in requests.groupby("category", sort=True)],
    }
