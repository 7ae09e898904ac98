"""Per-category summary of a trace table: what `collect` and `traces show` print."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.errors import DwiseError
from dwise_predict.files import read_json_object

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


def read_for_summary(path: str | Path) -> tuple[pd.DataFrame, dict, bool]:
    """The request table and manifest of a trace directory, and whether it is consolidated
    (when it is not, the committed shards of a collection still running or interrupted)."""
    from dwise_predict.collectors.store import read_shards, request_sources, with_sources
    from dwise_predict.traces import MANIFEST_FILE, REQUESTS_FILE, load_traces

    path = Path(path)
    if (path / REQUESTS_FILE).is_file():
        ds = load_traces(path)
        return ds.requests, ds.manifest, True
    if path.exists() and not path.is_dir():
        raise DwiseError(f"{path} is a file: give a trace directory (the `out` of `dwise-predict collect`)")
    if path.is_dir() and not (path / MANIFEST_FILE).is_file() and any(path.iterdir()):
        raise DwiseError(f"{path} is not a trace directory (no {MANIFEST_FILE}): give the `out` of a "
                         "`dwise-predict collect`")
    shards = read_shards(path) if (path / MANIFEST_FILE).is_file() else []
    if not shards:
        raise DwiseError(f"{path} holds no traces: run `dwise-predict collect --out {path}` first")
    manifest = read_json_object(path / MANIFEST_FILE, DwiseError, fix="the collection is damaged; collect it again")
    manifest = with_sources(manifest, request_sources(shards))  # what consolidation will record
    return pd.concat([s.requests for s in shards], ignore_index=True), manifest, False
