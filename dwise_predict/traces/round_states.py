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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

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


# early signals are a fraction, probabilities and an entropy (nats): outside these, a value was edited
# (contract 1 checks the request columns and each round's row of ``round_signals`` against them)
SIGNAL_RANGES = {"frac_over_threshold": (0.0, 1.0), "mean_confidence": (0.0, 1.0), "mean_entropy": (0.0, np.inf),
                 "end_probability": (0.0, 1.0)}
_FIX = "the traces are corrupt; re-collect them"


def round_states(ds) -> RoundStates:
    """The per-round tensors of a :class:`~dwise_predict.traces.dataset.TraceDataset`.

    Raises
    ------
    TraceError
        The traces were collected without ``--rounds-hidden`` (naming the option), or their
        per-round tensors disagree with the table or the manifest (shape, hidden size, a
        ``rounds_hidden`` other than the tensors' rounds, counts other than ``min(N, total_rounds)``,
        a first row other than the first round's record, signals outside their ranges): re-collect them.
    """
    where = f" in {ds.path}" if ds.path else ""
    parts = {**{f"'{name}'": name in ds.extra_hidden for name in TENSORS},
             f"the column {COUNT_COLUMN}": COUNT_COLUMN in ds.requests.columns,
             f"the manifest's {MANIFEST_KEY}": MANIFEST_KEY in ds.manifest}
    if not any(parts.values()):
        raise TraceError(f"the traces{where} hold no per-round states: collect them with "
                         "`dwise-predict collect --rounds-hidden N` (N = the last round to refine at, e.g. 8)")
    if not all(parts.values()):
        raise TraceError(f"the traces{where} hold {', '.join(p for p, held in parts.items() if held)} but not "
                         f"{', '.join(p for p, held in parts.items() if not held)}: the files come from different "
                         "collections; re-collect the traces")
    states, signals = ds.extra_hidden[STATES], ds.extra_hidden[SIGNALS]
    n = len(ds.requests)
    if states.ndim != 3 or states.shape[0] != n or states.shape[2] != ds.hidden_size:
        raise TraceError(f"'{STATES}'{where} has shape {states.shape}, not ({n}, N, {ds.hidden_size}): "
                         "re-collect the traces")
    if signals.shape != (n, states.shape[1], len(EARLY_SIGNALS)):
        raise TraceError(f"'{SIGNALS}'{where} has shape {signals.shape}, not ({n}, {states.shape[1]}, "
                         f"{len(EARLY_SIGNALS)}): re-collect the traces")
    declared = ds.manifest.get(MANIFEST_KEY)
    if type(declared) is not int or declared != states.shape[1]:  # bool is an int: `true` is no depth
        raise TraceError(f"the manifest{where} says {MANIFEST_KEY} {declared!r}, but '{STATES}' holds "
                         f"{states.shape[1]} rounds per request: the files come from different collections; "
                         "re-collect the traces")
    recorded = _recorded(ds, states.shape[1], where)
    _check_first_round(ds, states, signals, where)
    _check_states_finite(ds, states, where)
    _check_signal_ranges(ds, signals, where)
    return RoundStates(states, signals, recorded)


def _refuse_first(ds, bad: np.ndarray, what: Callable[[int], str], where: str) -> None:
    """Raise :class:`TraceError` naming the first request where ``bad`` (n,) holds and ``what(i)`` about it."""
    if bad.any():
        i = int(np.argmax(bad))
        raise TraceError(f"request {ds.requests['request_id'].iloc[i]!r}{where}: {what(i)}: {_FIX}")


def _recorded(ds, rounds: int, where: str) -> np.ndarray:
    """The (n,) int64 ``rounds_recorded`` column, checked to be ``min(N, total_rounds)``: whole numbers
    first, since a fraction cast to an integer would pass for its floor."""
    column = ds.requests[COUNT_COLUMN]
    counts = pd.to_numeric(column, errors="coerce").to_numpy(dtype=float)
    _refuse_first(ds, ~(counts == np.floor(counts)), lambda i: f"{COUNT_COLUMN} is {_shown(column.iloc[i])}, not a "
                                                               "whole number of rounds", where)
    recorded = counts.astype(np.int64)
    expected = np.minimum(ds.requests["total_rounds"].to_numpy(dtype=np.int64), rounds)
    if (recorded != expected).any():
        i = int(np.argmax(recorded != expected))
        raise TraceError(f"{COUNT_COLUMN}{where} of request {ds.requests['request_id'].iloc[i]!r} is {recorded[i]}, "
                         f"not min(N, total_rounds) = {expected[i]}: {_FIX}")
    return recorded


def _shown(value) -> str:
    """A cell as a message shows it: numbers as numbers (8.5, not np.float64(8.5)), anything else quoted."""
    value = value.item() if isinstance(value, np.generic) else value
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def _check_first_round(ds, states: np.ndarray, signals: np.ndarray, where: str) -> None:
    """Row 0 is the request's first round: ``first_round`` bit for bit, and its early-signal columns."""
    _refuse_first(ds, (states[:, 0] != ds.first_round).any(axis=1),
                  lambda i: f"row 0 of '{STATES}' is not its first_round (row 0 holds the first round's record)", where)
    table = ds.early_signals
    _refuse_first(ds, (signals[:, 0] != table).any(axis=1), lambda i: _first_difference(signals[i, 0], table[i]), where)


def _first_difference(stored: np.ndarray, columns: np.ndarray) -> str:
    """What differs between one request's row 0 of ``round_signals`` and its signal columns."""
    j = int(np.argmax(stored != columns))
    return (f"row 0 of '{SIGNALS}' holds {EARLY_SIGNALS[j]} {stored[j]:g}, but its column says {columns[j]:g} "
            "(row 0 holds the first round's signals)")


def _check_states_finite(ds, states: np.ndarray, where: str) -> None:
    """Every round's state finite (the zero rows after a request's last round included): a NaN or inf
    would reach the refined predictor's inputs."""
    bad = ~np.isfinite(states).all(axis=2)  # (n, N): the rounds holding one
    _refuse_first(ds, bad.any(axis=1), lambda i: (
        f"'{STATES}' holds NaN or inf at round {int(np.argmax(bad[i])) + 1}"), where)


def _check_signal_ranges(ds, signals: np.ndarray, where: str) -> None:
    """Every round's signals within :data:`SIGNAL_RANGES` (shares and probabilities in [0, 1], entropy
    finite and >= 0); the rows after a request's last round are zeros, inside every range."""
    for j, name in enumerate(EARLY_SIGNALS):
        low, high = SIGNAL_RANGES[name]
        values = signals[:, :, j]
        outside = ~((values >= low) & (values <= high) & np.isfinite(values))
        limits = f"outside [{low:g}, {high:g}]" if np.isfinite(high) else f"which must be finite and >= {low:g}"
        _refuse_first(ds, outside.any(axis=1), lambda i: (
            f"'{SIGNALS}' holds {name} {values[i][outside[i]][0]:g} at round {int(np.argmax(outside[i])) + 1}, "
            f"{limits}"), where)
