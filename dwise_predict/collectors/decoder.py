"""The instrumented, step-level-batched threshold decoder (one loop for every backend).

Rules (DESIGN.md vocabulary)
----------------------------
- A **round** is one batched ``backend.step``. Each active slot contributes one row: a prompt block
  (prefill) or one denoising step of its current output block. Requests at different stages share a
  round, and a finished request's slot is refilled from the queue before the next round.
- **Prefill**: the prompt is cut into ``ceil(prompt_tokens / block)`` blocks from its first token (the
  last may be short), one per round, each committed to the slot's KV cache.
- **Output blocks** of ``block`` tokens start right after the prompt, fully masked. Each round every
  masked position whose top-1 probability is at least ``threshold`` takes its top-1 token, and at
  least the single most confident masked position does; the ``<mask>`` token itself is never
  predicted (its logit is suppressed, so every round makes progress). Greedy, no sampling.
- A block is finished when nothing is masked. Generation ends after the block holding the first EOS
  (finish ``"eos"``; output = tokens before that EOS) or after ``ceil(budget / block)`` output blocks
  (finish ``"budget"``; output truncated to ``budget`` tokens).
- **Committing a finished block**: its clean keys/values are computed in the request's next round,
  in the same row as the first denoising step of the next block (``[finished | next]``, block-causal,
  see ``backends.base``). That costs no extra round, so a request's rounds are exactly
  ``prompt_blocks + total denoising rounds`` (its workload); the last block is never committed.

Recorded per request (``DecodeResult``)
---------------------------------------
rounds per output block, prompt tokens/blocks, output ids, finish, wall time (admission to finish,
seconds, shared with the batch), the first denoising round's final-layer hidden rows of the first
output block mean-pooled (``first_round_hidden``), the last prompt block's rows mean-pooled
(``prompt_last_hidden``, valid tokens only), and that first round's early signals over its masked
positions: fraction with top-1 probability ≥ threshold, mean top-1 probability, mean entropy (nats).
``extra`` holds ``admit_round``/``finish_round`` (global round indices) and ``slot``.

Bad input is rejected before anything is decoded: an empty request list, an empty prompt, a budget
≤ 0, duplicate request ids, or a prompt that does not fit the context with its output budget raise
``InputError`` naming the first offenders (decided: raise, not skip, so a long collection never runs
with silently missing rows; the caller drops or shortens those requests).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dwise_predict.collectors.backends.base import BlockBackend, StepBatch
from dwise_predict.collectors.records import DecodeRequest, DecodeResult, DecodingConfig
from dwise_predict.errors import ConfigError, InputError


@dataclass
class _Active:
    """Bookkeeping of one request while it holds a slot."""

    request: DecodeRequest
    prompt: list[int]
    prompt_blocks: int
    max_blocks: int
    admit_round: int
    t0: float
    next_prompt_block: int = 0
    finish: str = ""
    rounds_per_block: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    signals: tuple[float, float, float] | None = None  # first round: frac over threshold, confidence, entropy
    first_hidden: np.ndarray | None = None  # (H,)
    prompt_hidden: np.ndarray | None = None  # (H,)


def _validate(requests: list[DecodeRequest], block: int, max_context: int) -> None:
    if not requests:
        raise InputError("no requests to decode: the workload is empty; give at least one prompt")
    problems: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in requests:
        need = len(r.prompt_ids) + math.ceil(max(r.budget, 1) / block) * block
        if not r.prompt_ids:
            problems.setdefault("empty prompt", []).append(r.request_id)
        elif r.budget <= 0:
            problems.setdefault("budget <= 0", []).append(r.request_id)
        elif need > max_context:
            problems.setdefault(f"prompt + budget longer than the model's context of {max_context} tokens",
                                []).append(f"{r.request_id} ({len(r.prompt_ids)}+{r.budget})")
        if r.request_id in seen:
            problems.setdefault("duplicate request id", []).append(r.request_id)
        seen.add(r.request_id)
    if problems:
        parts = [f"{what}: {', '.join(ids[:3])}{' …' if len(ids) > 3 else ''} ({len(ids)} requests)"
                 for what, ids in problems.items()]
        raise InputError("cannot decode: " + "; ".join(parts)
                         + ". Drop or shorten those requests, or lower --budget")


def decode(backend: BlockBackend, requests: Iterable[DecodeRequest], config: DecodingConfig,
           on_result: Callable[[DecodeResult], None] | None = None,
           progress: Callable[[int], None] | None = None) -> Iterator[DecodeResult]:
    """Decode ``requests`` with ``config.batch_size`` slots; yield results in the order they finish.

    Parameters
    ----------
    backend : a ``BlockBackend`` (e.g. ``load_tiny_backend(dtype=config.dtype)``).
    requests : prompts already through the chat template, each with its output budget in tokens.
    config : threshold, block size (None = the model's), batch size; ``config.budget`` is recorded by
        the caller, each request's own ``budget`` is what the decoder enforces.
    on_result : called with each result as it finishes (before it is yielded).
    progress : called with the number of requests finished in a round (for a progress bar).

    Returns
    -------
    Iterator of ``DecodeResult``; validation errors are raised by this call, before any decoding.
    """
    block = config.block_size or backend.block_size  # DecodingConfig has checked threshold and its own size
    if block <= 0:
        raise ConfigError(f"the model's block size must be positive, got {block}: pass --block-size")
    requests = list(requests)
    _validate(requests, block, backend.max_context)
    return _run(backend, deque(requests), config, block, on_result, progress)


def _run(backend: BlockBackend, queue: deque, config: DecodingConfig, block: int,
         on_result, progress) -> Iterator[DecodeResult]:
    n_slots = min(config.batch_size, len(queue))
    backend.allocate(n_slots)
    mask_id, eos_id, pad_id = backend.mask_token_id, backend.eos_token_id, backend.pad_token_id
    threshold = config.threshold
    # per-slot decoding state as tensors on the model's device, so the denoising update is one
    # vectorised pass and logits never leave the device
    dev = backend.device
    blk = torch.full((n_slots, block), mask_id, dtype=torch.long, device=dev)  # current output block
    prev = torch.full((n_slots, block), pad_id, dtype=torch.long, device=dev)  # finished block awaiting commit
    pending = torch.zeros(n_slots, dtype=torch.bool, device=dev)  # prev must be committed in the next row
    block_rounds = torch.zeros(n_slots, dtype=torch.long, device=dev)  # rounds spent on the current block
    slots: list[_Active | None] = [None] * n_slots
    round_index = 0

    while True:
        for s in range(n_slots):  # refill free slots from the queue
            if slots[s] is None and queue:
                req = queue.popleft()
                slots[s] = _Active(request=req, prompt=list(req.prompt_ids),
                                   prompt_blocks=math.ceil(len(req.prompt_ids) / block),
                                   max_blocks=math.ceil(req.budget / block),
                                   admit_round=round_index, t0=time.perf_counter())
                backend.reset_slot(s)
                blk[s], pending[s], block_rounds[s] = mask_id, False, 0
        active = [s for s in range(n_slots) if slots[s] is not None]
        if not active:
            return
        prefill = [i for i, s in enumerate(active) if slots[s].next_prompt_block < slots[s].prompt_blocks]
        batch, d_rows = _rows(active, prefill, slots, blk, prev, pending, block, pad_id)
        d_slots = batch.slots[d_rows]
        out = backend.step(batch)
        round_index += 1

        # ---- prefill rows: advance; keep the pooled last prompt block
        for i in prefill:
            a = slots[active[i]]
            a.next_prompt_block += 1
            if a.next_prompt_block == a.prompt_blocks:
                n = int(batch.n_valid[i])
                a.prompt_hidden = out.hidden[i, :n].float().mean(0).cpu().numpy()

        finished: list[int] = []
        if len(d_rows):
            finished = _denoise(out, d_rows, d_slots, blk, prev, pending, block_rounds, slots,
                                mask_id, eos_id, threshold)
        for s in finished:
            result = _result(slots[s], s, block, round_index)
            slots[s] = None
            if on_result is not None:
                on_result(result)
            yield result
        if progress is not None and finished:
            progress(len(finished))


def _rows(active: list[int], prefill: list[int], slots: list, blk, prev, pending, block: int,
          pad_id: int) -> tuple[StepBatch, torch.Tensor]:
    """The round's input: one row per active slot (``active`` in slot order); ``prefill`` holds the
    row indices that take a prompt block. Returns the batch and the denoising row indices."""
    n, dev = len(active), blk.device
    slot_ids = torch.tensor(active, dtype=torch.long, device=dev)
    is_prefill = torch.zeros(n, dtype=torch.bool, device=dev)
    is_prefill[prefill] = True
    d_rows = (~is_prefill).nonzero().squeeze(1)  # (n_d,)
    d_slots = slot_ids[d_rows]
    d_pend = pending[d_slots]  # these rows carry their finished block's commit
    width = 2 * block if bool(d_pend.any()) else block

    ids = torch.full((n, width), pad_id, dtype=torch.long, device=dev)
    n_valid = torch.full((n,), block, dtype=torch.long, device=dev)
    commit = torch.zeros(n, dtype=torch.long, device=dev)
    ids[d_rows, :block] = torch.where(d_pend[:, None], prev[d_slots], blk[d_slots])
    if width > block:
        carry = d_rows[d_pend]
        ids[carry, block:] = blk[d_slots[d_pend]]
        n_valid[carry] = 2 * block
        commit[carry] = block
    out_start = commit.clone()  # a carrying row's current block comes after the committed one
    for i in prefill:
        a = slots[active[i]]
        chunk = a.prompt[a.next_prompt_block * block:(a.next_prompt_block + 1) * block]
        ids[i, : len(chunk)] = torch.tensor(chunk, dtype=torch.long, device=dev)
        n_valid[i] = commit[i] = len(chunk)
        out_start[i] = 0
    batch = StepBatch(slots=slot_ids, input_ids=ids, n_valid=n_valid, commit_len=commit,
                      out_start=out_start, window=block)
    return batch, d_rows


def _denoise(out, d_rows, d_slots, blk, prev, pending, block_rounds, slots, mask_id, eos_id,
             threshold) -> list[int]:
    """One threshold-decoding step for every denoising row; returns the slots whose request ended."""
    logits = out.logits[d_rows].float()  # (n_d, block, V)
    logits[..., mask_id] = float("-inf")  # never "predict" the mask: every round must make progress
    logp = torch.log_softmax(logits, dim=-1)
    conf, top = logp.max(dim=-1)  # (n_d, block), log top-1 probability and token
    conf = conf.exp()
    cur = blk[d_slots]  # (n_d, block)
    masked = cur == mask_id
    take = masked & (conf >= threshold)
    # at least one per row: the most confident masked position
    best = torch.where(masked, conf, torch.full_like(conf, -1.0)).argmax(dim=1)  # (n_d,)
    take[torch.arange(len(d_rows), device=take.device), best] |= masked.any(dim=1)
    new = torch.where(take, top, cur)
    blk[d_slots] = new
    pending[d_slots] = False  # a carried commit happened in this round's forward
    block_rounds[d_slots] += 1
    rounds = block_rounds[d_slots].tolist()
    done = (~(new == mask_id).any(dim=1)).tolist()

    finished = []
    for j, s in enumerate(d_slots.tolist()):
        a = slots[s]
        if not a.rounds_per_block and rounds[j] == 1:  # first denoising round of the first block
            m = masked[j]
            p = logp[j, m].exp()  # (n_masked, V)
            entropy = -(p * logp[j, m].clamp_min(-1e30)).sum(-1)  # 0 * log 0 taken as 0
            a.signals = (float((conf[j, m] >= threshold).float().mean()), float(conf[j, m].mean()),
                         float(entropy.mean()))
            a.first_hidden = out.hidden[d_rows[j]].float().mean(0).cpu().numpy()
        if not done[j]:
            continue
        a.rounds_per_block.append(rounds[j])
        block_rounds[s] = 0
        tokens = new[j].tolist()
        if eos_id in tokens:
            a.output.extend(tokens[: tokens.index(eos_id)])
            a.finish = "eos"
            finished.append(s)
        elif len(a.rounds_per_block) == a.max_blocks:
            a.output.extend(tokens)
            del a.output[a.request.budget:]
            a.finish = "budget"
            finished.append(s)
        else:
            a.output.extend(tokens)
            prev[s] = new[j]
            pending[s] = True
            blk[s] = mask_id
    return finished


def _result(a: _Active, slot: int, block: int, round_index: int) -> DecodeResult:
    frac, conf, entropy = a.signals
    return DecodeResult(
        request_id=a.request.request_id,
        prompt_tokens=len(a.prompt),
        prompt_blocks=a.prompt_blocks,
        block_size=block,
        rounds_per_block=list(a.rounds_per_block),
        output_ids=list(a.output),
        finish=a.finish,
        frac_over_threshold=frac,
        mean_confidence=conf,
        mean_entropy=entropy,
        wall_s=time.perf_counter() - a.t0,
        first_round_hidden=a.first_hidden.astype(np.float32),
        prompt_last_hidden=a.prompt_hidden.astype(np.float32),
        extra={"admit_round": a.admit_round, "finish_round": round_index, "slot": slot},
    )
