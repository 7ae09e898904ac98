"""Label transform of the survival model: remaining rounds (+ event flag) -> hazard index, event.

Remaining rounds ``T`` take values ``0..K`` and the network has ``K`` hazard logits (see
``network.py``). Following pycox's logistic-hazard convention, a label ``(idx, event)`` means
"the event happened at index ``idx``" when ``event = 1`` and "survived through index ``idx``"
(``T > idx``) when ``event = 0``. So

- a finished request with ``T < K`` -> ``(T, 1)``;
- a finished request with ``T >= K`` -> ``(K - 1, 0)``: ``T > K - 1`` is all the K logits can say
  (``T = K`` closes the support);
- a censored request (collection cut short after ``c`` remaining rounds, so ``T >= c``) ->
  ``(c - 1, 0)``; with ``c = 0`` it carries no information and :func:`informative` drops it.
"""

from __future__ import annotations

import numpy as np

from dwise_predict.errors import InputError


class RemainingRoundsLabels:
    """Fit K (the largest remaining count in training) and map (remaining, events) to (idx, event)."""

    def fit(self, remaining, events=None) -> "RemainingRoundsLabels":
        """Set ``num_rounds_`` = K = max remaining rounds (at least 1) over the training requests."""
        remaining, _ = _check(remaining, events)
        if remaining.size == 0:
            raise InputError("no training requests to fit the survival labels on")
        self.num_rounds_ = max(1, int(remaining.max()))
        return self

    @property
    def out_features(self) -> int:
        """Hazard logits the network needs: K."""
        return self.num_rounds_

    def transform(self, remaining, events=None) -> tuple[np.ndarray, np.ndarray]:
        """(idx int64 (N,), event float32 (N,)) as described in the module docstring."""
        remaining, events = _check(remaining, events)
        k = self.num_rounds_
        idx = np.where(events, remaining, remaining - 1)
        event = events & (remaining < k)
        idx = np.clip(np.where(event, idx, np.minimum(idx, k - 1)), 0, k - 1)
        return idx.astype(np.int64), event.astype(np.float32)


def informative(remaining, events=None) -> np.ndarray:
    """Mask (N,) of requests that tell the loss something: all but censored ones with 0 rounds seen."""
    remaining, events = _check(remaining, events)
    return events | (remaining > 0)


def _check(remaining, events) -> tuple[np.ndarray, np.ndarray]:
    remaining = np.asarray(remaining)
    if remaining.ndim != 1 or not np.isfinite(remaining.astype(np.float64)).all() or (remaining < 0).any():
        raise InputError("remaining rounds must be a 1-D array of finite counts >= 0")
    remaining = remaining.astype(np.int64)
    events = np.ones(remaining.shape, dtype=bool) if events is None else np.asarray(events).astype(bool).ravel()
    if events.shape != remaining.shape:
        raise InputError(f"{remaining.size} remaining counts but {events.size} event flags")
    return remaining, events
