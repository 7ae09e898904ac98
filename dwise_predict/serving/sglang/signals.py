"""The early signals of a forward's rows (``engine.signals``): the refinement graph's last input.

The first denoising forward's early signals are computed from its ``full_logits`` after the forward
returns, outside any captured graph, for the rows of requests in their first denoising round only.
On a CPU they are computed in a :class:`SignalScratch` kept from step to step.
"""

from __future__ import annotations

import math


class SignalScratch:
    """Two float32 host buffers the early signals of a step compute in (``engine.signals.early_signals``'s
    ``scratch``), grown to the largest chunk asked for and kept. On a CPU, torch hands a freed tensor
    of that size (a chunk's temporaries: up to ``CHUNK_FLOATS``, 32 MiB) back to the system, so a
    fresh one faults in every page again: with fresh temporaries, a first-round row's signals over a
    151,680-token vocabulary cost about 7.5 ms of one core, in these buffers 2.2 ms (the same values,
    bit for bit). On a GPU the caching allocator keeps freed blocks, and a buffer held for good would
    take memory SGLang sized its KV pool without: no scratch there."""

    __slots__ = ("gathered", "logp")

    def __init__(self):
        self.gathered = self.logp = None

    def __call__(self, shape: tuple) -> tuple:
        import torch  # imported by the first forward; not at the hook's import

        size = math.prod(shape)
        if self.gathered is None or self.gathered.numel() < size:
            # normal tensors, which SGLang's inference mode may write in place, and code outside it too
            with torch.inference_mode(False):
                self.gathered, self.logp = torch.empty(size), torch.empty(size)
        return self.gathered[:size].view(shape), self.logp[:size].view(shape)


def signal_scratch(device) -> SignalScratch | None:
    """A :class:`SignalScratch` for signals computed on ``device`` (a torch device): on a CPU only."""
    return SignalScratch() if device.type == "cpu" else None


def row_signals(full_logits, input_ids, rows, mask_id: int, block_size: int, threshold: float, stop_ids,
                scratch: SignalScratch | None = None):
    """(n, 4) early signals (``engine.signals``) of the batch rows ``rows`` of a forward (a device int64
    index; None: every row), from its ``full_logits`` (B * block, V) and ``input_ids`` (B * block,):
    the softmax over the vocabulary costs block * V per row, and only a request's first denoising
    forward needs it. Device tensor ops only; in ``scratch`` where given (:func:`signal_scratch`)."""
    from dwise_predict.engine.signals import early_signals

    return early_signals(full_logits, input_ids, mask_id, block_size, threshold, stop_ids, rows=rows,
                         scratch=scratch)
