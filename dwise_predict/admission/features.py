"""The admission feature matrix of a contract-1 request table (the pandas side of
:mod:`dwise_predict.features.prompt`, which the serving side imports without pandas)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dwise_predict.errors import TraceError
from dwise_predict.features.prompt import FEATURE_NAMES


def prompt_features(requests: pd.DataFrame) -> np.ndarray:
    """The admission features of every request in a contract-1 request table.

    Parameters
    ----------
    requests : DataFrame with the columns ``words``, ``newlines`` and ``prompt_tokens``.

    Returns
    -------
    array of shape (n_requests, 3), float32: words, newlines, prompt tokens (in that order).

    Raises
    ------
    TraceError
        A column is missing, or holds NaN, inf or non-numbers.
    """
    missing = [c for c in FEATURE_NAMES if c not in requests.columns]
    if missing:
        raise TraceError(f"request table lacks feature columns {', '.join(missing)}: re-collect the traces")
    values = np.column_stack(
        [pd.to_numeric(requests[c], errors="coerce").to_numpy(dtype=np.float64) for c in FEATURE_NAMES]
    ) if len(requests) else np.zeros((0, len(FEATURE_NAMES)))
    bad = ~np.isfinite(values)
    if bad.any():
        column = FEATURE_NAMES[int(np.nonzero(bad.any(axis=0))[0][0])]
        raise TraceError(f"feature column '{column}' holds NaN, inf or non-numbers: drop or fix those rows")
    return values.astype(np.float32)
