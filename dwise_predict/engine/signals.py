"""The first denoising round's early signals, from the logits of one forward over a block.

Per request, over the block's still-masked positions (a leftover prompt token is not masked): the
fraction whose top-1 probability is above the algorithm's threshold, the mean top-1 probability and
the mean predictive entropy in nats (Amin et al.'s signals), and the probability that the block holds
an end-of-sequence token, ``1 - prod(1 - p_stop)`` over those positions with ``p_stop`` a position's
probability of any stop id (our addition: the model's own guess that the answer ends in its first
output block, where the engine would finish the request; zeros for a block without masks). The
decoder computes them per request while collecting; the serving hook computes them here, on the
device, from SGLang's ``full_logits`` after the forward (outside any captured CUDA graph), for the
refinement graph's ``early_signals`` input and for recording.
"""

from __future__ import annotations

import torch

# requests per chunk: the softmax temporaries are (chunk * block, vocab) floats, not the whole batch's:
# 8 requests, or as many as fit in what 8 requests of a 32-token block over a 32,768-token vocabulary
# take (a small vocabulary, like the fake's, runs in one chunk: the op count is per chunk)
CHUNK_REQUESTS = 8
CHUNK_FLOATS = CHUNK_REQUESTS * 32 * 32768
# the fraction signal's threshold under an algorithm that has none of its own (Gemma4Renoise: the
# DiffusionGemma collector and the serving hook alike), unless its algorithm config gives a "threshold"
SIGNAL_THRESHOLD = 0.9


def early_signals(full_logits: torch.Tensor, input_ids: torch.Tensor, mask_id: int, block_size: int,
                  threshold: float, stop_ids: torch.Tensor, rows: torch.Tensor | None = None,
                  scratch=None) -> torch.Tensor:
    """(B, 4) float32 signals of a forward over B blocks, columns in ``names.EARLY_SIGNALS`` order:
    ``full_logits`` (B * block, V), ``input_ids`` (B * block,), ``stop_ids`` (S,) int64 token ids that
    end a request (on the logits' device). ``rows``: an int64 index of the blocks to compute, on the
    logits' device ((n, 4) signals, in its order; None: every block). ``scratch``: a callable ``shape
    -> (a, b)``, two float32 tensors of that shape on the logits' device that a chunk is computed in
    (its gathered logits, then its probabilities; its log-probabilities), or None (fresh tensors).
    Device tensor ops only, no host synchronisation. The values are the same either way, bit for bit."""
    batch = input_ids.numel() // block_size
    logits = full_logits.view(batch, block_size, -1)
    ids = input_ids.view(batch, block_size)
    if rows is not None:
        ids = ids.index_select(0, rows.to(ids.device))
    masked = (ids == mask_id).to(device=logits.device, dtype=torch.float32)
    count = masked.sum(dim=1).clamp_min(1.0)
    chunk = max(CHUNK_REQUESTS, CHUNK_FLOATS // max(block_size * logits.shape[-1], 1))
    out = []
    for start in range(0, len(ids), chunk):
        logp, probs = _log_probs(logits, start, chunk, rows, scratch)  # (b, bs, V)
        top = logp.amax(dim=-1).exp()  # (b, bs)
        stop = logp.index_select(-1, stop_ids).exp().sum(dim=-1)  # (b, bs)
        # exp(-inf) * -inf would be NaN: log_softmax is finite
        entropy = -torch.exp(logp, out=probs).mul_(logp).sum(dim=-1) if probs is not None \
            else -logp.exp().mul_(logp).sum(dim=-1)
        m = masked[start:start + chunk]
        n = count[start:start + chunk]
        no_end = (torch.log1p(-stop.clamp(max=1.0 - 1e-7)) * m).sum(1)  # log P(no stop anywhere in the block)
        out.append(torch.stack([((top > threshold).float() * m).sum(1) / n, (top * m).sum(1) / n,
                                (entropy * m).sum(1) / n, -torch.expm1(no_end)], 1))
    return torch.cat(out) if out else masked.new_zeros((0, 4))


def _log_probs(logits: torch.Tensor, start: int, chunk: int, rows, scratch) -> tuple:
    """The fp32 log-probabilities of the blocks ``[start, start + chunk)`` (of ``rows`` where given), and
    a tensor of their shape to write the probabilities in (None: a fresh one). With ``scratch``, the
    chunk's logits go into one of its buffers (gathered straight there when fp32) and their log-softmax
    into the other (the kernel ``torch.log_softmax`` runs, given an ``out``); the first holds the
    probabilities after."""
    if rows is None:
        part = logits[start:start + chunk]
    elif scratch is None or logits.dtype != torch.float32:
        part = logits.index_select(0, rows[start:start + chunk])
    else:
        picked = rows[start:start + chunk]
        gathered, logp = scratch((len(picked), *logits.shape[1:]))
        torch.index_select(logits, 0, picked, out=gathered)
        return torch._log_softmax(gathered, -1, False, out=logp), gathered
    if scratch is None:
        return torch.log_softmax(part.float(), dim=-1), None
    gathered, logp = scratch(tuple(part.shape))
    gathered.copy_(part)  # in fp32
    return torch._log_softmax(gathered, -1, False, out=logp), gathered
