"""Round-count stability across repeated runs of the same prompts (the DWISE paper, Table 11).

A request's round count is not a constant of its prompt: batched with other requests, its forwards
see other numerics, and a block may take one round more or less. The DWISE paper replayed its
workload on LLaDA2.1-mini and compared per-request round counts between runs: 98 % identical under
DWISE on the same trace, 92 % across different traces, 37 % under SGLang across seeds, Spearman ρ
0.97 or above in each case. That bounds how exactly any predictor, and the oracle, can know a
request's work.

Here each input is one run. Requests are matched by ``request_id`` (runs of the same prompts share
ids: ``collect`` with one ``--seed`` and workload, or a replay client that sends its own ids); for
every pair of runs, over the requests present in every run, it counts the share with identical total
rounds, within one round, and within 10 % (the larger count at most 1.1 times the smaller), and
Spearman ρ between the two runs' counts. Pairs are averaged (the paper compares runs pairwise); the
share identical in every run at once is reported beside them. Overall and per category.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.evaluation.decodings import first_difference
from dwise_predict.metrics import spearman
from dwise_predict.names import DECODING_KEYS
from dwise_predict.traces import TraceDataset

# the DWISE paper's Table 11 (LLaDA2.1-mini): policy, runs compared, identical share, Spearman ρ
PAPER_TABLE_11 = (("DWISE", "same trace", 0.98, 0.998), ("DWISE", "different traces", 0.92, 0.994),
                  ("SGLang", "different traces", 0.37, 0.972))
WITHIN_ROUNDS = 1  # "within one round"
WITHIN_PERCENT = 10  # "within 10 %": the larger count at most this much above the smaller


def round_stability(runs: Sequence[TraceDataset]) -> dict:
    """Per-request round-count agreement between repeated runs of the same prompts.

    Parameters
    ----------
    runs : two or more trace datasets of one decoding and budget (checked), one per run.

    Returns
    -------
    dict with ``runs`` (paths), ``requests`` (per run, its request count), ``matched`` (requests present
    in every run), ``overall`` and ``per_category`` (rows: ``category``, ``n``, ``identical``,
    ``identical_in_every_run``, ``within_1``, ``within_10pct`` (shares), ``rho`` (mean over pairs;
    None where every pair has a constant side)) and ``pairs`` (per pair of runs: ``runs`` (their
    indices), ``identical``, ``within_1``, ``within_10pct``, ``rho``, all requests).

    Raises
    ------
    InputError : fewer than two runs, runs of different decodings or budgets, or no request id in
        every run.
    """
    if len(runs) < 2:
        raise InputError(f"round stability compares repeated runs of the same prompts: give two or more trace "
                         f"sets, got {len(runs)}")
    for other in runs[1:]:
        diff = first_difference(runs[0], other, DECODING_KEYS)
        if diff is not None:
            raise InputError(f"round stability compares runs of one decoding, but {runs[0].path} and {other.path} "
                             f"differ ({diff}): give runs of one decoding and budget")
    counts, categories = _matched_counts(runs)
    rows = [{"category": "all", **_agreement(counts)}]
    rows += [{"category": str(c), **_agreement(counts[categories == c])} for c in sorted(set(categories))]
    return {
        "runs": [str(r.path) if r.path else None for r in runs],
        "requests": [len(r) for r in runs],
        "matched": int(len(counts)),
        "overall": rows[0],
        "per_category": rows[1:],
        "pairs": [{"runs": [i, j], **_pair(counts[:, i], counts[:, j])}
                  for i, j in combinations(range(counts.shape[1]), 2)],
    }


def _matched_counts(runs: Sequence[TraceDataset]) -> tuple[np.ndarray, np.ndarray]:
    """Total rounds of the requests present in every run, ``(matched, runs)``, in the first run's order,
    and their categories (the first run's)."""
    first = runs[0].requests.set_index("request_id")
    table = first[["category", "total_rounds"]].rename(columns={"total_rounds": 0})
    for k, run in enumerate(runs[1:], start=1):
        table = table.join(run.requests.set_index("request_id")["total_rounds"].rename(k), how="inner")
    if table.empty:
        raise InputError(f"no request id is in every one of the {len(runs)} runs: repeated runs of the same prompts "
                         "share ids (collect them with one seed and workload)")
    return table[list(range(len(runs)))].to_numpy(dtype=float), table["category"].astype(str).to_numpy()


def _pair(a: np.ndarray, b: np.ndarray) -> dict:
    """Agreement of two runs' counts of the same requests."""
    low, high = np.minimum(a, b), np.maximum(a, b)
    return {"identical": float(np.mean(a == b)), "within_1": float(np.mean(high - low <= WITHIN_ROUNDS)),
            "within_10pct": float(np.mean(100 * high <= (100 + WITHIN_PERCENT) * low)),  # whole numbers: exact
            "rho": spearman(a, b)}


def _agreement(counts: np.ndarray) -> dict:
    """One table row over ``counts`` (requests, runs): the pairs' shares averaged, the share identical in
    every run, and the pairs' mean ρ."""
    pairs = [_pair(counts[:, i], counts[:, j]) for i, j in combinations(range(counts.shape[1]), 2)]
    rhos = [p["rho"] for p in pairs if p["rho"] is not None]
    return {"n": int(len(counts)),
            "identical": float(np.mean([p["identical"] for p in pairs])),
            "identical_in_every_run": float(np.mean((counts == counts[:, :1]).all(axis=1))),
            "within_1": float(np.mean([p["within_1"] for p in pairs])),
            "within_10pct": float(np.mean([p["within_10pct"] for p in pairs])),
            "rho": float(np.mean(rhos)) if rhos else None}
