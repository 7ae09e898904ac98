"""What the refinement predictor reads of a request, as one checked object (numpy only).

Every refinement candidate fits and predicts on the same inputs, the bundle's graph inputs of
``names.HIDDEN_STATES`` plus three short ones: the pooled hidden states side by side (N, 2H),
prompt tokens after the chat template (N,), output budget in tokens (N,) and the first round's early
signals (N, S) in the order of ``names.EARLY_SIGNALS``. :class:`RefineInputs` holds them as
float32 arrays, checked once when it is made (shapes agree, values finite), so the heads that
standardise them do not check them again; a model checks only that its own sizes match
(:meth:`RefineInputs.check_sizes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.names import HIDDEN_STATES


@dataclass(frozen=True, eq=False)  # arrays: equal is the same object
class RefineInputs:
    """The refinement inputs of N requests (float32; a copy of ``early_signals``, whose column views
    are read-only, the others as given when already float32).

    Raises InputError when a shape disagrees or a value is NaN or infinite.
    """

    hidden: np.ndarray  # (N, 2H): the states of names.HIDDEN_STATES side by side
    prompt_tokens: np.ndarray  # (N,)
    budget: np.ndarray  # (N,)
    early_signals: np.ndarray  # (N, S)

    def __post_init__(self) -> None:
        hidden = np.asarray(self.hidden, dtype=np.float32)
        prompt_tokens = np.asarray(self.prompt_tokens, dtype=np.float32).ravel()
        budget = np.asarray(self.budget, dtype=np.float32).ravel()
        early_signals = np.array(self.early_signals, dtype=np.float32)
        if hidden.ndim != 2 or hidden.shape[1] % len(HIDDEN_STATES):
            raise InputError(f"hidden states must have shape (N, {len(HIDDEN_STATES)}H) ({' and '.join(HIDDEN_STATES)} "
                             f"side by side), got {tuple(hidden.shape)}")
        n = hidden.shape[0]
        if early_signals.ndim != 2 or early_signals.shape[0] != n:
            raise InputError(f"early signals must have shape ({n}, S), got {tuple(early_signals.shape)}")
        if prompt_tokens.shape[0] != n or budget.shape[0] != n:
            raise InputError(f"{n} hidden rows but {prompt_tokens.shape[0]} prompt lengths and {budget.shape[0]} budgets")
        for name, a in (("hidden states", hidden), ("prompt tokens", prompt_tokens), ("budget", budget),
                        ("early signals", early_signals)):
            if not np.isfinite(a).all():
                raise InputError(f"{name} hold NaN or inf: drop those requests")
        for name, a in (("hidden", hidden), ("prompt_tokens", prompt_tokens), ("budget", budget),
                        ("early_signals", early_signals)):
            object.__setattr__(self, name, a)

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def hidden_size(self) -> int:
        """2H, the hidden columns of both states."""
        return int(self.hidden.shape[1])

    @property
    def signal_count(self) -> int:
        """S, the early signals per request."""
        return int(self.early_signals.shape[1])

    def rows(self, which) -> "RefineInputs":
        """The requests selected by ``which`` (a boolean mask or indices), in that order."""
        return RefineInputs(self.hidden[which], self.prompt_tokens[which], self.budget[which], self.early_signals[which])

    def check_sizes(self, hidden_size: int, signal_count: int) -> None:
        """Raise InputError unless these are the sizes a model was trained on (2H and S)."""
        if self.hidden_size != hidden_size:
            raise InputError(f"hidden states have size {self.hidden_size} but the model was trained on {hidden_size}")
        if self.signal_count != signal_count:
            raise InputError(f"{self.signal_count} early signals per request but the model was trained on {signal_count}")
