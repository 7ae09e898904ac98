"""Logistic-hazard negative log-likelihood (pycox's ``nll_logistic_hazard``).

With hazards ``h_j = sigmoid(logit_j)`` and a label ``(idx, event)`` (see ``labels.py``):

    event = 1:  -log h_idx - sum_{j < idx} log(1 - h_j)      (the request finished at idx)
    event = 0:             - sum_{j <= idx} log(1 - h_j)     (it survived through idx)

Both are the cumulative sum of per-logit binary cross-entropies against a target that is 1 only
at ``idx`` for events, read at ``idx``.

References
----------
Gensheimer & Narasimhan (2019), "A scalable discrete-time survival model for neural networks";
Kvamme & Borgan (2019), "Continuous and discrete-time survival prediction with neural networks".
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def logistic_hazard_nll(
    logits: torch.Tensor,
    idx: torch.Tensor,
    events: torch.Tensor,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Negative log-likelihood of discrete-time survival labels under logistic hazards.

    Parameters
    ----------
    logits : tensor of shape (batch, K), hazard logits.
    idx : int64 tensor of shape (batch,), label index in 0..K-1.
    events : tensor of shape (batch,), 1 = event at idx, 0 = survived through idx.
    reduction : "mean", "sum" or "none" (per-request losses of shape (batch,)).

    Raises
    ------
    ValueError
        Shapes disagree, or a label index needs more hazard logits than ``logits`` has.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape (batch, K), got {tuple(logits.shape)}")
    batch, k = logits.shape
    if idx.shape != (batch,) or events.shape != (batch,):
        raise ValueError(
            f"idx and events must have shape ({batch},) to match logits {tuple(logits.shape)}; "
            f"got {tuple(idx.shape)} and {tuple(events.shape)}"
        )
    if batch and (int(idx.max()) >= k or int(idx.min()) < 0):
        raise ValueError(
            f"label index {int(idx.max())} needs logits of shape (batch, {int(idx.max()) + 1}) or wider, "
            f"got K={k}: build the network with out_features from the labels fitted on the training split"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    idx = idx.long().unsqueeze(1)  # (batch, 1)
    target = torch.zeros_like(logits).scatter(1, idx, events.to(logits.dtype).unsqueeze(1))
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")  # (batch, K)
    loss = bce.cumsum(dim=1).gather(1, idx).squeeze(1)  # (batch,)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.mean()
