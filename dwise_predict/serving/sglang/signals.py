"""The early signals of a forward's rows (``engine.signals``): the refinement graph's last input.

The first denoising forward's early signals are computed from its ``full_logits`` after the forward
returns, outside any captured graph, for the rows of requests in their first denoising round only.
"""

from __future__ import annotations


def row_signals(full_logits, input_ids, rows, mask_id: int, block_size: int, threshold: float, stop_ids):
    """(n, 4) early signals (``engine.signals``) of the batch rows ``rows`` of a forward (a device int64
    index; None: every row), from its ``full_logits`` (B * block, V) and ``input_ids`` (B * block,):
    the softmax over the vocabulary costs block * V per row, and only a request's first denoising
    forward needs it. Device tensor ops only."""
    from dwise_predict.engine.signals import early_signals

    if rows is None:
        return early_signals(full_logits, input_ids, mask_id, block_size, threshold, stop_ids)
    batch = input_ids.numel() // block_size
    logits = full_logits.view(batch, block_size, -1).index_select(0, rows).reshape(len(rows) * block_size, -1)
    picked = input_ids.view(batch, block_size).index_select(0, rows.to(input_ids.device)).reshape(-1)
    return early_signals(logits, picked, mask_id, block_size, threshold, stop_ids)
