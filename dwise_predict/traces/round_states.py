"""Contract 1's optional per-round tensors (`collect --rounds-hidden N`, trace schema 4).

A collection made with ``--rounds-hidden N`` keeps, for each request, what the refinement graph
would be fed at each of its first ``N`` denoising rounds, in ``hidden.safetensors``:

- ``round_states`` ``[N_requests, N, H]`` — row ``k - 1`` of request i: the mean of the final-layer
  rows of the block being denoised in the request's k-th denoising forward (counted over all its
  output blocks: round ``b + 1`` of a request whose first block took ``b`` forwards is the first
  forward of its second block), pooled as the serving hook pools them; row 0 is ``first_round``,
  bit for bit;
- ``round_signals`` ``[N_requests, N, 4]`` — that forward's early signals over the block's
  still-masked positions (:data:`dwise_predict.names.EARLY_SIGNALS` order, computed by
  ``engine.signals`` as the hook computes them); row 0 holds the request's signal columns. A forward
  that sees its block with no mask left (the one that shows a ``LowConfidence`` block done) has
  signals 0;

and in ``requests.parquet`` the column ``rounds_recorded``: how many of those rows hold a round,
``min(N, total_rounds)``. A request that finished before round ``N`` has no later rows: they are
zeros, never read (see :func:`round_states`).

The manifest records ``"rounds_hidden": N`` (absent in a default collection). Traces of schema 3 or
without the key simply have no per-round states; the tensors travel with the other optional
tensors (:attr:`TraceDataset.extra_hidden`) through shards, resume, ``traces merge`` and
:func:`write_traces`. Only research and ``simulate --refine-every`` read them: the serving hook
refines from the first round alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dwise_predict.errors import TraceError
from dwise_predict.names import EARLY_SIGNALS

MANIFEST_KEY = "rounds_hidden"
STATES = "round_states"
SIGNALS = "round_signals"
COUNT_COLUMN = "rounds_recorded"
TENSORS = (STATES, SIGNALS)


@dataclass(frozen=True)
class RoundStates:
    """The per-round inputs of a trace dataset, checked (see :func:`round_states`).

    states : (n, N, H) float32; signals : (n, N, 4) float32; recorded : (n,) int64, rows that hold a
    round (the rest are zeros).
    """

    states: np.ndarray
    signals: np.ndarray
    recorded: np.ndarray

    @property
    def rounds(self) -> int:
        """``N``, the rounds kept per request."""
        return int(self.states.shape[1])

    def has_round(self, k: int) -> np.ndarray:
        """(n,) bool: which requests have a row for denoising round ``k`` (1-based)."""
        return self.recorded >= k


def padded(rows: list[np.ndarray], keep: int, width: int) -> np.ndarray:
    """The ``(keep, width)`` float32 rows of one request, zeros after the rounds it ran."""
    out = np.zeros((keep, width), dtype=np.float32)
    if rows:
        out[: len(rows)] = np.stack(rows).astype(np.float32)
    return out


def round_states(ds) -> RoundStates:
    """The per-round tensors of a :class:`~dwise_predict.traces.dataset.TraceDataset`.

    Raises
    ------
    TraceError
        The traces were collected without ``--rounds-hidden`` (naming the option), or their
        per-round tensors disagree with the table (shape, hidden size, counts other than
        ``min(N, total_rounds)``): re-collect them.
    """
    where = f" {ds.path}" if ds.path else ""
    if not all(name in ds.extra_hidden for name in TENSORS) or COUNT_COLUMN not in ds.requests.columns:
        raise TraceError(f"the traces{where} hold no per-round states: collect them with "
                         "`dwise-predict collect --rounds-hidden N` (N = the last round to refine at, e.g. 8)")
    states, signals = ds.extra_hidden[STATES], ds.extra_hidden[SIGNALS]
    n = len(ds.requests)
    if states.ndim != 3 or states.shape[0] != n or states.shape[2] != ds.hidden_size:
        raise TraceError(f"'{STATES}'{where} has shape {states.shape}, not ({n}, N, {ds.hidden_size}): "
                         "re-collect the traces")
    if signals.shape != (n, states.shape[1], len(EARLY_SIGNALS)):
        raise TraceError(f"'{SIGNALS}'{where} has shape {signals.shape}, not ({n}, {states.shape[1]}, "
                         f"{len(EARLY_SIGNALS)}): re-collect the traces")
    recorded = ds.requests[COUNT_COLUMN].to_numpy(dtype=np.int64)
    expected = np.minimum(ds.requests["total_rounds"].to_numpy(dtype=np.int64), states.shape[1])
    if (recorded != expected).any():
        i = int(np.argmax(recorded != expected))
        raise TraceError(f"{COUNT_COLUMN}{where} of request {ds.requests['request_id'].iloc[i]!r} is {recorded[i]}, "
                         f"not min(N, total_rounds) = {expected[i]}: the traces are corrupt; re-collect them")
    return RoundStates(states, signals, recorded)
