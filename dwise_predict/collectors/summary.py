"""Per-category summary of a trace table: what `collect` and `traces show` print."""

from __future__ import annotations

import numpy as np
import pandas as pd

ALL = "all"


def summarize(requests: pd.DataFrame) -> list[dict]:
    """One row per category (then ``all``): counts, round percentiles, output tokens, finishes, accuracy.

    Parameters
    ----------
    requests : a contract-1 request table (``category``, ``total_rounds``, ``output_tokens``,
        ``finish``; ``correct`` optional, NaN where not checkable).

    Returns
    -------
    list of dicts with keys ``category``, ``count``, ``train``, ``eval``, ``rounds_p10``, ``rounds_p50``,
    ``rounds_p90``, ``rounds_max`` (denoising rounds), ``output_tokens_mean``, ``eos``, ``budget``,
    ``accuracy`` (mean of the checkable ``correct`` scores, or ``None``), ``checked`` (how many).
    """
    groups = [(c, g) for c, g in requests.groupby("category", sort=True)]
    return [_row(name, group) for name, group in groups + [(ALL, requests)]]


def _row(name: str, g: pd.DataFrame) -> dict:
    rounds = g["total_rounds"].to_numpy(dtype=float)
    p10, p50, p90 = np.percentile(rounds, [10, 50, 90]) if len(rounds) else (np.nan,) * 3
    correct = g["correct"].to_numpy(dtype=float) if "correct" in g else np.array([])
    checked = correct[~np.isnan(correct)]
    return {
        "category": name,
        "count": int(len(g)),
        "train": int((g["split"] == "train").sum()),
        "eval": int((g["split"] == "eval").sum()),
        "rounds_p10": float(p10),
        "rounds_p50": float(p50),
        "rounds_p90": float(p90),
        "rounds_max": int(rounds.max()) if len(rounds) else 0,
        "output_tokens_mean": float(g["output_tokens"].mean()) if len(g) else 0.0,
        "eos": int((g["finish"] == "eos").sum()),
        "budget": int((g["finish"] == "budget").sum()),
        "accuracy": float(checked.mean()) if len(checked) else None,
        "checked": int(len(checked)),
    }
