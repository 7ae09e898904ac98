"""D2F's pipeline of blocks, instrumented like the decoder, into the same trace contract.

D2F is ours, not SGLang 0.5.23's (:mod:`dwise_predict.engine.d2f` holds the rule and says why it is
here); this module runs it on any ``BlockBackend`` and records what :mod:`.decoder` records, in the
engine's units (a round is one forward of a request).

Per request:

- **Prompt**: D2F starts its first output block right after the prompt, so the prompt is prefilled in
  ⌈n / B⌉ forwards of up to B tokens, the last one short where B does not divide n; ``prompt_blocks``
  holds that count, the prefill rounds P (contract 1 allows floor or ceil).
- **Denoising**: each round is one forward over the row ``[finished blocks to commit | blocks in
  flight]``, block-causal (``StepBatch.block_len``). A finished block is committed (its keys and
  values kept) in the next forward once every block before it is finished, as D2F caches it; one
  finished behind an unfinished block stays in flight and is recomputed, as in D2F. The request ends
  when no block in flight holds a mask and no block may join (an end-of-sequence token was unmasked,
  or the budget's ⌈budget / B⌉ blocks are all in). Output and finish are the engine's
  (:func:`dwise_predict.engine.finish_after_block`, block by block): the tokens before the first EOS,
  cut at the budget. Blocks after the EOS's are decoded to the end, as D2F does: they cost rounds.
- ``total_rounds`` counts the denoising forwards. ``rounds_per_block`` gives each forward to the
  newest block in flight at that forward, so a block's count is the rounds from its start to the next
  block's start (the pipeline's spacing, the tier step of Amin et al.). The extra column
  ``pipeline_depth`` is the most blocks one forward held.
- As the decoder records it: ``first_round_hidden`` is the mean of the first output block's B rows at
  its first forward (the first denoising round, where it is the only block), the early signals over
  its masked positions (``frac_over_threshold`` above τ_decode), ``prompt_last_hidden`` the mean of
  the last prefill forward's prompt rows, ``first_round_layers`` under ``hidden_layers``.
  ``rounds_hidden`` is refused: a D2F round denoises several blocks, a round state pools one block.

Requests are decoded one at a time (``collect`` records batch size 1). Amin et al. measured D2F's
latency one request at a time, so ``wall_s`` is then each request's own latency (in a batch it is the
batch's); and a D2F row's width changes round by round with the pipeline, so a batch would pad every
row to the widest. Greedy and one at a time, the decoding is deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dwise_predict.collectors.backends.base import BlockBackend, StepBatch, StepOutput
from dwise_predict.collectors.layers import pool_first_round
from dwise_predict.collectors.records import DecodeRequest, DecodeResult
from dwise_predict.engine import finish_after_block
from dwise_predict.engine.d2f import D2F
from dwise_predict.engine.signals import early_signals
from dwise_predict.errors import ConfigError, InputError
from dwise_predict.traces.hidden_extra import HiddenExtra


def check_d2f_options(algorithm: str | None, rounds_hidden: int | None) -> None:
    """Refuse what D2F cannot record (before a model loads): ``rounds_hidden``."""
    if algorithm == D2F.name and rounds_hidden:
        raise ConfigError("`rounds_hidden` does not fit D2F: each D2F round denoises several blocks at once and a "
                          "round state pools one block's rows; drop `rounds_hidden`")


@dataclass
class _Pipeline:
    """One request's blocks while it decodes: tokens, masked positions and rounds of each block (in
    output order), how many are committed, and what is recorded."""

    request: DecodeRequest
    max_blocks: int
    admit_round: int
    t0: float = field(default_factory=time.perf_counter)
    blocks: list[torch.Tensor] = field(default_factory=list)  # (B,) each
    masked: list[int] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    committed: int = 0
    eos_seen: bool = False
    depth: int = 0
    signals: tuple[float, ...] | None = None  # first round, in names.EARLY_SIGNALS order
    first_hidden: np.ndarray | None = None  # (H,)
    prompt_hidden: np.ndarray | None = None  # (H,)
    layer_hidden: dict[str, np.ndarray] = field(default_factory=dict)

    def completion(self, k: int) -> float:
        """Share of block ``k``'s positions unmasked (every D2F block starts all masked)."""
        return 1.0 - self.masked[k] / len(self.blocks[k])

    def may_add(self) -> bool:
        return not self.eos_seen and len(self.blocks) < self.max_blocks

    def finished(self) -> bool:
        return not any(self.masked) and not self.may_add()


def decode_pipeline(backend: BlockBackend, requests: list[DecodeRequest], rule: D2F, block: int,
                    on_result: Callable[[DecodeResult], None] | None = None,
                    progress: Callable[[int], None] | None = None, hidden_layers: HiddenExtra | None = None,
                    rounds_hidden: int = 0) -> Iterator[DecodeResult]:
    """Decode ``requests`` (already validated by :func:`.decoder.decode`) with D2F, one at a time, in
    order; the parameters are :func:`.decoder.decode`'s. Errors are raised by this call."""
    check_d2f_options(rule.name, rounds_hidden)
    too_long = [r.request_id for r in requests if len(r.prompt_ids) + -(-r.budget // block) * block > backend.max_context]
    if too_long:
        raise InputError(f"cannot decode with D2F: prompt + budget in whole blocks after it longer than the model's "
                         f"context of {backend.max_context} tokens: {', '.join(too_long[:3])} ({len(too_long)} "
                         "requests). Drop or shorten those requests, or lower `budget`")
    return _run(backend, requests, rule, block, on_result, progress, hidden_layers)


def _run(backend: BlockBackend, requests: list[DecodeRequest], rule: D2F, block: int, on_result, progress,
         hidden_layers: HiddenExtra | None) -> Iterator[DecodeResult]:
    backend.allocate(1)
    stop_ids = torch.tensor(backend.eos_token_ids, dtype=torch.long, device=backend.device)
    round_index = 0
    for request in requests:
        backend.reset_slot(0)
        p = _Pipeline(request, max_blocks=-(-request.budget // block), admit_round=round_index)
        round_index += _prefill(backend, p, block)
        while not p.finished():
            if p.may_add() and (not p.blocks or rule.adds_block(p.completion(-1))):
                p.blocks.append(torch.full((block,), rule.mask_id, dtype=torch.long, device=backend.device))
                p.masked.append(block)
                p.rounds.append(0)
            _denoise(backend, p, rule, block, hidden_layers, stop_ids)
            round_index += 1
        result = _result(p, round_index, block, backend.eos_token_ids)
        if on_result is not None:
            on_result(result)
        yield result
        if progress is not None:
            progress(1)


def _batch(ids: list[int] | torch.Tensor, commit: int, out_start: int, window: int, block: int, pad: int,
           device, all_layers: bool = False) -> StepBatch:
    """A one-row step: ``ids`` placed after the slot's committed tokens, padded to hold the window."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    row = torch.full((1, max(len(ids), out_start + window)), pad, dtype=torch.long, device=device)
    row[0, :len(ids)] = ids
    one = torch.ones(1, dtype=torch.long, device=device)
    return StepBatch(slots=torch.zeros(1, dtype=torch.long, device=device), input_ids=row, n_valid=one * len(ids),
                     commit_len=one * commit, out_start=one * out_start, window=window, all_layers=all_layers,
                     block_len=block)


def _prefill(backend: BlockBackend, p: _Pipeline, block: int) -> int:
    """The prompt in ⌈n / B⌉ committed forwards; keeps the last one's pooled prompt rows. Returns P."""
    prompt = p.request.prompt_ids
    starts = range(0, len(prompt), block)
    for start in starts:
        chunk = prompt[start:start + block]
        out = backend.step(_batch(chunk, len(chunk), 0, block, block, backend.pad_token_id, backend.device))
    p.prompt_hidden = out.hidden[0, :len(chunk)].float().mean(0).cpu().numpy()
    return len(starts)


def _denoise(backend: BlockBackend, p: _Pipeline, rule: D2F, block: int, hidden_layers: HiddenExtra | None,
             stop_ids: torch.Tensor) -> None:
    """One round: commit the leading finished blocks and denoise every block in flight in one forward."""
    first = p.committed
    done = first
    while p.masked[done] == 0:  # a block is cached once every block before it is finished (one in flight holds a mask)
        done += 1
    flight = range(done, len(p.blocks))
    recording = p.signals is None
    out = backend.step(_batch(torch.cat(p.blocks[first:]), (done - first) * block, (done - first) * block,
                              len(flight) * block, block, backend.pad_token_id, backend.device,
                              all_layers=recording and hidden_layers is not None))
    p.committed = done
    logits = out.logits[0, :len(flight) * block].view(len(flight), block, -1)
    ids = torch.stack([p.blocks[k] for k in flight])  # (m, B)
    if recording:
        _record_first_round(p, out, logits[0], ids[0], rule, hidden_layers, stop_ids)
    # activation as the round starts: a block whose predecessor is complete enough (the first: the prompt's)
    active = torch.tensor([k == 0 or rule.activates(p.completion(k - 1)) for k in flight], device=ids.device)
    new, filled = rule.unmask(ids, logits, active)
    for j, k in enumerate(flight):
        p.blocks[k] = new[j]
        p.masked[k] = int((new[j] == rule.mask_id).sum())
    p.eos_seen |= bool(torch.isin(new[filled], stop_ids).any())
    p.rounds[-1] += 1  # the round goes to the newest block
    p.depth = max(p.depth, len(flight))


def _record_first_round(p: _Pipeline, out: StepOutput, logits: torch.Tensor, ids: torch.Tensor, rule: D2F,
                        hidden_layers: HiddenExtra | None, stop_ids: torch.Tensor) -> None:
    """Early signals and pooled rows of the first output block's first forward (``logits`` (B, V),
    ``ids`` (B,)), the request's first denoising round."""
    block = len(ids)
    p.signals = tuple(early_signals(logits, ids, rule.mask_id, block, rule.signal_threshold, stop_ids)[0].tolist())
    p.first_hidden = out.hidden[0, :block].float().mean(0).cpu().numpy()
    if hidden_layers is not None:
        p.layer_hidden = pool_first_round(out.layers[0][:, :block], hidden_layers)


def _result(p: _Pipeline, round_index: int, block: int, eos_ids: tuple[int, ...]) -> DecodeResult:
    output: list[int] = []
    finish = ""
    for tokens in p.blocks:  # the engine's finish, block by block: the first EOS, or the budget
        ending = finish_after_block(len(output), tokens.tolist(), p.request.budget, eos_ids)
        output.extend(tokens.tolist())
        if ending is not None:
            finish, kept = ending
            del output[kept:]
            break
    frac, conf, entropy, end = p.signals
    prompt = p.request.prompt_ids
    return DecodeResult(
        request_id=p.request.request_id, prompt_tokens=len(prompt), prompt_blocks=-(-len(prompt) // block),
        block_size=block, rounds_per_block=list(p.rounds), output_ids=output, finish=finish,
        frac_over_threshold=frac, mean_confidence=conf, mean_entropy=entropy, end_probability=end,
        wall_s=time.perf_counter() - p.t0, first_round_hidden=p.first_hidden.astype(np.float32),
        prompt_last_hidden=p.prompt_hidden.astype(np.float32),
        extra={"admit_round": p.admit_round, "finish_round": round_index, "slot": 0, "pipeline_depth": p.depth},
        first_round_layers=p.layer_hidden)
