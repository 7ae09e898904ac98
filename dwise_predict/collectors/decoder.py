"""The instrumented, step-level-batched decoder: SGLang's dLLM semantics, one loop for every backend.

What a request costs is decided by :mod:`dwise_predict.engine` (the serving engine is the source of
truth); this module batches requests through a ``BlockBackend`` in those units and records them.

Rules
-----
- A **round** is one batched ``backend.step``. Each active slot contributes one row: a prompt block
  (prefill) or one denoising forward of its current output block. Requests at different stages share
  a round, and a finished request's slot is refilled from the queue before the next round. Counts are
  per request, as SGLang's FDFO mode (or a batch of one) runs them; a synchronous SGLang batch waits
  for its slowest block, which the simulator models, not the trace.
- **Layout** (``engine.layout``): ``n // block`` full prompt blocks, one prefill row each; the
  ``n % block`` leftover prompt tokens open the first output block under the prompt mask.
- **Denoising**: after each forward the algorithm's step rule (``engine.algorithms``) decides whether
  the block is done and otherwise fills/edits positions; a block's count is the forwards it took,
  the one that showed it done included (``r + 1`` for ``LowConfidence``), capped as SGLang caps it.
- A request ends after the block whose emitted tokens hold an EOS (finish ``"eos"``; output = tokens
  before it) or once its output reaches the budget (finish ``"budget"``; output cut to the budget);
  an EOS past the budget is a budget finish, as in SGLang (``engine.layout.finish_after_block``).
- **Committing a finished block**: the engine keeps the KV of the forward that showed the block
  done; the backend computes the same keys/values in the request's next row, in front of its next
  block (``[finished | next]``, block-causal, see ``backends.base``). That costs no extra round.

Recorded per request (``DecodeResult``)
---------------------------------------
forwards per output block, prompt tokens and full prompt blocks (the prefill forwards P), output ids,
finish, wall time (admission to finish, shared with the batch), ``first_round_hidden`` (the mean of
all ``block`` final-layer rows of the first output block's first denoising forward, leftover prompt
rows included: what the serving hook pools), ``prompt_last_hidden`` (the mean of the last prompt
tokens' rows as the engine processes them: the last full prompt block, or the leftover prompt rows
of the first denoising forward when the prompt is shorter than a block), and that first forward's
early signals over its masked positions: fraction whose top-1 probability is above the algorithm's
threshold, mean top-1 probability, mean entropy (nats). ``extra`` holds ``admit_round`` /
``finish_round`` (global round indices) and ``slot``. Given ``hidden_layers`` (`collect --layers`),
``first_round_layers`` holds the same forward's rows at those layers and poolings
(:func:`.layers.pool_first_round`); only rounds holding a first denoising forward ask the backend
for every layer. Given ``rounds_hidden`` N (`collect --rounds-hidden`), ``round_states`` /
``round_signals`` hold the same two records for each of the request's first ``min(N, total)``
denoising forwards, counted over all its blocks: round 1 is the first round's record itself, round k
the mean of the window rows of the block that forward denoised and the signals over that block's
still-masked positions (:mod:`dwise_predict.traces.round_states`).

Bad input is rejected before anything is decoded: an empty request list, an empty prompt, a budget
≤ 0, duplicate request ids, or a prompt that does not fit the context with its output budget raise
``InputError`` naming the first offenders (raise, not skip: a long collection never runs with
silently missing rows; the caller drops or shortens those requests).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dwise_predict.collectors.backends.base import BlockBackend, StepBatch
from dwise_predict.collectors.d2f import decode_pipeline
from dwise_predict.collectors.layers import pool_first_round
from dwise_predict.collectors.records import DecodeRequest, DecodeResult, DecodingConfig
from dwise_predict.engine import BlockLayout, block_layout, finish_after_block
from dwise_predict.engine.algorithms import DEFAULT_ALGORITHM, StepRule, forwards_exhausted, make_rule
from dwise_predict.engine.d2f import D2F
from dwise_predict.engine.signals import early_signals
from dwise_predict.errors import ConfigError, InputError
from dwise_predict.traces.hidden_extra import HiddenExtra

# first denoising forwards whose early signals wait to be computed in one batch (_PendingFirstRounds):
# each holds its block's logits (block x vocabulary floats, 16 MiB for LLaDA's 32 x 126,464), so
# they are computed once a slot count of finished requests waits for them, at the end, or at this
# many, whichever comes first
MAX_PENDING_FIRST_ROUNDS = 64

@dataclass
class _Active:
    """Bookkeeping of one request while it holds a slot."""

    request: DecodeRequest
    prompt: list[int]
    layout: BlockLayout
    admit_round: int
    t0: float
    next_prompt_block: int = 0
    finish: str = ""
    rounds_per_block: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    signals: tuple[float, ...] | None = None  # first round, in names.EARLY_SIGNALS order
    first_hidden: np.ndarray | None = None  # (H,)
    prompt_hidden: np.ndarray | None = None  # (H,)
    layer_hidden: dict[str, np.ndarray] = field(default_factory=dict)  # `collect --layers` tensors
    round_states: list[np.ndarray] = field(default_factory=list)  # `collect --rounds-hidden`: (H,) per round
    round_signals: list[tuple[float, ...]] = field(default_factory=list)  # and its signals
    slot: int = -1  # from its finish on (its result may wait for its first round's signals: _release)
    finish_round: int = 0
    wall_s: float = 0.0


def _validate(requests: list[DecodeRequest], block: int, max_context: int) -> None:
    if not requests:
        raise InputError("no requests to decode: the workload is empty; give at least one prompt")
    problems: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in requests:
        if not r.prompt_ids:
            problems.setdefault("empty prompt", []).append(r.request_id)
        elif r.budget <= 0:
            problems.setdefault("budget <= 0", []).append(r.request_id)
        else:
            layout = block_layout(len(r.prompt_ids), block)
            need = (layout.prompt_blocks + layout.max_output_blocks(r.budget)) * block
            if need > max_context:
                problems.setdefault(f"prompt + budget longer than the model's context of {max_context} tokens",
                                    []).append(f"{r.request_id} ({len(r.prompt_ids)}+{r.budget})")
        if r.request_id in seen:
            problems.setdefault("duplicate request id", []).append(r.request_id)
        seen.add(r.request_id)
    if problems:
        parts = [f"{what}: {', '.join(ids[:3])}{' …' if len(ids) > 3 else ''} ({len(ids)} requests)"
                 for what, ids in problems.items()]
        raise InputError("cannot decode: " + "; ".join(parts)
                         + ". Drop or shorten those requests, or lower `budget`")


def decode(backend: BlockBackend, requests: Iterable[DecodeRequest], config: DecodingConfig,
           on_result: Callable[[DecodeResult], None] | None = None,
           progress: Callable[[int], None] | None = None,
           hidden_layers: HiddenExtra | None = None, rounds_hidden: int = 0) -> Iterator[DecodeResult]:
    """Decode ``requests`` with ``config.batch_size`` slots; yield results in the order they finish.

    Parameters
    ----------
    backend : a ``BlockBackend`` (e.g. ``load_tiny_backend(dtype=config.dtype)``).
    requests : prompts already through the chat template, each with its output budget in tokens.
    config : algorithm and its parameters (``None``: SGLang's default), block size (None = the
        model's), batch size; ``config.budget`` is recorded by the caller, each request's own
        ``budget`` is what the decoder enforces.
    on_result : called with each result before it is yielded. Results come in the order requests
        finish, released together once their first rounds' early signals are computed (at the
        latest when ``batch_size`` of them wait, or at the end).
    progress : called with the number of results released together (for a progress bar).
    hidden_layers : layers and poolings of the first denoising forward to keep besides ``first_round``
        (resolved against ``backend`` by :func:`.layers.resolve_layers`); None keeps none.
    rounds_hidden : keep the pooled rows and early signals of each request's first this many
        denoising forwards (``DecodeResult.round_states`` / ``round_signals``); 0 keeps none.

    Returns
    -------
    Iterator of ``DecodeResult``; configuration and validation errors are raised by this call,
    before any decoding.
    """
    block = config.block_size or backend.block_size  # DecodingConfig has checked its own size
    if block <= 0:
        raise ConfigError(f"the model's block size must be positive, got {block}: pass `block_size`")
    if rounds_hidden < 0:
        raise ConfigError(f"`rounds_hidden` must be >= 0, got {rounds_hidden}")
    rule = make_rule(config.algorithm or DEFAULT_ALGORITHM, backend.mask_token_id, config.algorithm_config)
    rule.bind(backend)
    requests = list(requests)
    _validate(requests, block, backend.max_context)
    if isinstance(rule, D2F):  # ours, not SGLang's: a pipeline of blocks per forward, its own loop
        return decode_pipeline(backend, requests, rule, block, on_result, progress, hidden_layers, rounds_hidden)
    return _run(backend, deque(requests), config, rule, block, on_result, progress, hidden_layers, rounds_hidden)


def _run(backend: BlockBackend, queue: deque, config: DecodingConfig, rule: StepRule, block: int,
         on_result, progress, hidden_layers: HiddenExtra | None, rounds_hidden: int) -> Iterator[DecodeResult]:
    n_slots = min(config.batch_size, len(queue))
    backend.allocate(n_slots)
    mask_id, pad_id = backend.mask_token_id, backend.pad_token_id
    # per-slot blocks as host lists: a round's input and the step rule's blocks are one tensor each,
    # made from them, and the step's result comes back as one list; kept as device tensors, the
    # gathers and scatters around each step cost a dozen dispatches a round (on CUDA the step's
    # result is read on the host either way). Logits never leave the device.
    dev = backend.device
    s = _Slots(
        blk=[[mask_id] * block for _ in range(n_slots)],
        prompt_len=[0] * n_slots,
        prev=[None] * n_slots,
        forwards=[0] * n_slots,
        rule_state=rule.new_state(n_slots, dev),
        active=[None] * n_slots,
        device=dev,
        stop_ids=torch.tensor(backend.eos_token_ids, dtype=torch.long, device=dev),
        no_prompt=[False] * block,
        pending=_PendingFirstRounds(),
        waiting=[],
    )
    round_index = 0

    while True:
        for slot in range(n_slots):  # refill free slots from the queue
            if s.active[slot] is None and queue:
                req = queue.popleft()
                s.admit(slot, req, block, round_index, rule, mask_id)
                backend.reset_slot(slot)
        active = [slot for slot in range(n_slots) if s.active[slot] is not None]
        if not active:
            return
        prefill = [i for i, slot in enumerate(active)
                   if s.active[slot].next_prompt_block < s.active[slot].layout.prompt_blocks]
        batch, d_rows, slots = _rows(active, prefill, s, block, pad_id)
        if hidden_layers is not None:  # a request's first denoising forward is in this round
            batch.all_layers = any(not s.active[slot].rounds_per_block and s.forwards[slot] == 0 for slot in slots)
        out = backend.step(batch)
        round_index += 1

        for i in prefill:  # prefill rows: advance; keep the pooled last prompt block
            a = s.active[active[i]]
            a.next_prompt_block += 1
            if a.next_prompt_block == a.layout.prompt_blocks:
                a.prompt_hidden = out.hidden[i].float().mean(0).cpu().numpy()

        finished: list[int] = []
        if slots:
            finished = _denoise(out, d_rows, slots, s, rule, block, backend.eos_token_ids, mask_id, hidden_layers,
                                rounds_hidden)
        s.finish(finished, round_index)
        # finished requests wait for their first rounds' signals, computed for a slot count of them at
        # once (or at the cap, or at the end): one batch of ~40 dispatches where each finish paid one
        if s.pending.held >= MAX_PENDING_FIRST_ROUNDS or s.waiting and (
                len(s.waiting) >= n_slots or not queue and s.active.count(None) == n_slots):
            s.pending.flush(rule, mask_id, s.stop_ids)
        yield from _release(s, rounds_hidden, on_result, progress)


@dataclass
class _Slots:
    """Per-slot state: the current block's tokens and how many of its first positions are prompt
    tokens, a finished block awaiting its commit (None: none), forwards spent on the current block,
    the step rule's state, the request holding the slot; the model's device, the stop ids on it and
    a prompt mask row of no prompt position (read only), made once, not every round; the first
    denoising forwards whose records are still to compute, and the finished requests whose results
    wait for them (in finish order)."""

    blk: list[list[int]]
    prompt_len: list[int]
    prev: list[list[int] | None]
    forwards: list[int]
    rule_state: dict
    active: list
    device: torch.device
    stop_ids: torch.Tensor
    no_prompt: list[bool]
    pending: _PendingFirstRounds
    waiting: list[_Active]

    def admit(self, slot: int, req: DecodeRequest, block: int, round_index: int, rule: StepRule,
              mask_id: int) -> None:
        layout = block_layout(len(req.prompt_ids), block)
        self.active[slot] = _Active(request=req, prompt=list(req.prompt_ids), layout=layout,
                                    admit_round=round_index, t0=time.perf_counter())
        leftover = list(req.prompt_ids[layout.prompt_blocks * block:])  # shorter than a block
        self.blk[slot] = leftover + [mask_id] * (block - len(leftover))
        self.prompt_len[slot] = len(leftover)
        self.prev[slot] = None
        self.new_block(slot, rule)

    def finish(self, slots: list[int], round_index: int) -> None:
        """Free ``slots``, whose requests ended in round ``round_index``: they join :attr:`waiting`."""
        now = time.perf_counter()
        for slot in slots:
            a = self.active[slot]
            a.slot, a.finish_round, a.wall_s = slot, round_index, now - a.t0
            self.waiting.append(a)
            self.active[slot] = None

    def new_block(self, slot: int, rule: StepRule) -> None:
        self.forwards[slot] = 0
        if self.rule_state:  # a rule without per-slot state (LowConfidence) has nothing to reset
            rule.start_block(self.rule_state, torch.tensor([slot], device=self.device))


def _rows(active: list[int], prefill: list[int], s: _Slots, block: int,
          pad_id: int) -> tuple[StepBatch, list[int] | None, list[int]]:
    """The round's input: one row per active slot (``active`` in slot order); ``prefill`` holds the
    row indices that take a prompt block. Returns the batch, the denoising row indices (None: every
    row) and those rows' slots."""
    n, dev = len(active), s.device
    taking_prompt = set(prefill)
    denoising = [i for i in range(n) if i not in taking_prompt]
    # a row carrying its finished block's commit is [finished block | current block]; then every row
    # is two blocks wide, the rest padding
    width = 2 * block if any(s.prev[active[i]] is not None for i in denoising) else block
    rows, n_valid, commit, out_start = [], [block] * n, [0] * n, [0] * n
    for i, slot in enumerate(active):
        if i in taking_prompt:  # its next full prompt block
            a = s.active[slot]
            row = a.prompt[a.next_prompt_block * block:(a.next_prompt_block + 1) * block]
            commit[i] = block
        elif s.prev[slot] is not None:  # the current block comes after the committed one
            row = s.prev[slot] + s.blk[slot]
            n_valid[i], commit[i], out_start[i] = 2 * block, block, block
        else:
            row = s.blk[slot]
        rows.append(row + [pad_id] * (width - len(row)))
    ids = _tensor(rows, np.int64, dev)
    # the four per-row vectors in one copy, as views of one tensor
    slot_ids, n_valid_t, commit_t, out_start_t = _tensor([active, n_valid, commit, out_start], np.int64, dev).unbind()
    batch = StepBatch(slots=slot_ids, input_ids=ids, n_valid=n_valid_t, commit_len=commit_t,
                      out_start=out_start_t, window=block)
    return batch, (denoising if prefill else None), [active[i] for i in denoising]


def _denoise(out, d_rows: list[int] | None, slots: list[int], s: _Slots, rule: StepRule, block: int,
             eos_ids: tuple[int, ...], mask_id: int, hidden_layers: HiddenExtra | None, rounds_hidden: int) -> list[int]:
    """One step of the algorithm for the denoising rows ``d_rows`` (None: every row) of the round's
    output, held by ``slots``; returns the slots whose request ended."""
    # every row's, read only: a denoising row's are at its output row (not gathered: the rule and the
    # records read only the rows they need)
    logits = out.logits.float()
    dev = s.device
    d_slots = torch.tensor(slots, dtype=torch.long, device=dev) if s.rule_state else None  # a stateless rule reads none
    blocks = [s.blk[slot] for slot in slots]
    for slot in slots:
        s.forwards[slot] += 1
    forwards = [s.forwards[slot] for slot in slots]
    first = [(not s.active[slot].rounds_per_block) and f == 1 for slot, f in zip(slots, forwards)]
    ids = _tensor(blocks, np.int64, dev) if rounds_hidden else None  # the signals' input
    if any(first):
        _record_first_round(out, d_rows, slots, first, logits, blocks, s, hidden_layers)
    if rounds_hidden:  # round 1 copies the first round's record: computed now
        s.pending.flush(rule, mask_id, s.stop_ids)
        _record_rounds(out, d_rows, slots, logits, ids, s, rule, mask_id, rounds_hidden)

    tokens_by_row, done_rows = rule.step_lists(blocks, _prompt_rows(s, slots, block), logits, s.rule_state, d_slots,
                                               logit_rows=d_rows)
    for j, f in enumerate(forwards):
        if forwards_exhausted(rule, f, block):  # the engine's loop ends these unstepped
            tokens_by_row[j], done_rows[j] = blocks[j], True
    for slot, tokens in zip(slots, tokens_by_row):
        s.blk[slot] = tokens
        s.prev[slot] = None  # a carried commit happened in this round's forward

    finished, going_on = [], []
    for j, slot in enumerate(slots):
        if not done_rows[j]:
            continue
        a = s.active[slot]
        tokens = tokens_by_row[j][a.layout.output_start(len(a.rounds_per_block)):]
        a.rounds_per_block.append(forwards[j])
        ending = finish_after_block(len(a.output), tokens, a.request.budget, eos_ids)
        a.output.extend(tokens)
        if ending is not None:
            a.finish, kept = ending
            del a.output[kept:]
            finished.append(slot)
        else:
            going_on.append(j)
    for j in going_on:  # the finished block is committed in front of the next one (its row's next forward)
        slot = slots[j]
        s.prev[slot], s.blk[slot], s.prompt_len[slot] = tokens_by_row[j], [mask_id] * block, 0
        s.new_block(slot, rule)
    return finished


def _tensor(rows: list[list], dtype, device) -> torch.Tensor:
    """``rows`` as a tensor on ``device``, through numpy: ``torch.tensor`` reads a nested list
    element by element, 2-3x slower at a round's sizes (on the host, no ``to``: a dispatch a call)."""
    tensor = torch.from_numpy(np.array(rows, dtype=dtype))
    return tensor if device.type == "cpu" else tensor.to(device)


def _prompt_rows(s: _Slots, slots: list[int], block: int) -> list[list[bool]]:
    """(n, block) bool lists: the leftover prompt positions of each slot's current block (only a
    request's first output block has any)."""
    return [[i < k for i in range(block)] if k else s.no_prompt for k in (s.prompt_len[slot] for slot in slots)]


def _output_rows(d_rows: list[int] | None, at: list[int], device) -> torch.Tensor:
    """The round's output rows of the denoising rows ``at`` (indices into ``d_rows``; None: every row)."""
    return torch.tensor(at if d_rows is None else [d_rows[j] for j in at], dtype=torch.long, device=device)


def _record_first_round(out, d_rows, slots: list[int], first: list[bool], logits, blocks: list[list[int]], s: _Slots,
                        hidden_layers: HiddenExtra | None) -> None:
    """The first denoising forward of a request's first block (``blocks``, ``first``: the denoising rows',
    in ``slots`` order; ``logits``: the round's every row): its rows are kept for the early signals and
    the pooled hidden row (:class:`_PendingFirstRounds`); the `collect --layers` poolings and a short
    prompt's pooled rows are taken now."""
    rows = [j for j, is_first in enumerate(first) if is_first]
    source = _output_rows(d_rows, rows, s.device)
    states = out.hidden.index_select(0, source).float()  # (k, block, H)
    requests = [s.active[slots[j]] for j in rows]
    s.pending.add(requests, logits.index_select(0, source), [blocks[j] for j in rows], states)
    layers = None if hidden_layers is None else out.layers.index_select(0, source)
    for k, a in enumerate(requests):
        if hidden_layers is not None:
            a.layer_hidden = pool_first_round(layers[k], hidden_layers)
        if a.prompt_hidden is None:  # a prompt shorter than a block: its rows sit in this forward
            a.prompt_hidden = states[k, : a.layout.leftover].mean(0).cpu().numpy()


@dataclass
class _PendingFirstRounds:
    """First denoising forwards whose early signals and pooled hidden rows are not computed yet: one
    entry a round (its requests, and their logits (k, block, V), input blocks (k lists of block ids,
    made one tensor at the flush) and final hidden rows (k, block, H)). :meth:`flush` computes every
    kept request's at once, before a result needs them: ~40 dispatches for many rounds' requests,
    where each round's own call paid them. Each row's values are its own (a position's softmax, a
    block's sums), bit for bit the same in any batch."""

    requests: list[list[_Active]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    ids: list[list[list[int]]] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    held: int = 0  # requests kept (each holds its block's logits: flushed at MAX_PENDING_FIRST_ROUNDS)

    def add(self, requests: list[_Active], logits: torch.Tensor, ids: list[list[int]], states: torch.Tensor) -> None:
        self.held += len(requests)
        self.requests.append(requests)
        self.logits.append(logits)
        self.ids.append(ids)
        self.states.append(states)

    def flush(self, rule: StepRule, mask_id: int, stop_ids: torch.Tensor) -> None:
        """Set ``signals`` and ``first_hidden`` of every kept request; keep none after."""
        if not self.requests:
            return
        logits = torch.cat(self.logits)
        ids = _tensor([row for rows in self.ids for row in rows], np.int64, logits.device)
        signals = early_signals(logits.flatten(0, 1), ids.flatten(), mask_id, ids.shape[1],
                                rule.params.get("threshold", 0.0), stop_ids).tolist()
        pooled = torch.cat(self.states).mean(1).cpu().numpy()  # each row's mean, bit for bit that row's alone
        for k, a in enumerate(a for requests in self.requests for a in requests):
            a.signals, a.first_hidden = tuple(signals[k]), pooled[k]
        for kept in (self.requests, self.logits, self.ids, self.states):
            kept.clear()
        self.held = 0


def _record_rounds(out, d_rows, slots: list[int], logits, ids, s: _Slots, rule: StepRule, mask_id: int,
                   keep: int) -> None:
    """Each denoising row's pooled window rows and early signals, while its request has run at most
    ``keep`` denoising forwards (`collect --rounds-hidden`). Round 1 copies the first round's record
    (after :func:`_record_first_round`), so that row equals ``first_round`` bit for bit."""
    later = []
    for j, slot in enumerate(slots):
        a = s.active[slot]
        if len(a.round_states) >= keep:
            continue
        if not a.round_states:  # this is its first denoising forward
            a.round_states.append(a.first_hidden)
            a.round_signals.append(a.signals)
        else:
            later.append(j)
    if not later:
        return
    at, source = torch.tensor(later, dtype=torch.long, device=ids.device), _output_rows(d_rows, later, ids.device)
    pooled = out.hidden.index_select(0, source).float().mean(1).cpu().numpy()  # as first_round
    for k, (j, row_signals) in enumerate(zip(later, _signals(logits, ids, source, at, rule, mask_id, s.stop_ids))):
        a = s.active[slots[j]]
        a.round_states.append(pooled[k])
        a.round_signals.append(tuple(row_signals))


def _signals(logits, ids, logit_rows: torch.Tensor, rows: torch.Tensor, rule: StepRule, mask_id: int,
             stop_ids: torch.Tensor) -> list[list[float]]:
    """Early signals of the given denoising rows (``rows`` of ``ids``, ``logit_rows`` of ``logits``: non-empty
    index tensors) over their blocks' masked positions (``engine.signals``)."""
    # the leftover prompt tokens of the first output block hold token ids, never the mask id (so too
    # in _PendingFirstRounds.flush)
    return early_signals(logits.index_select(0, logit_rows).flatten(0, 1), ids.index_select(0, rows).flatten(), mask_id,
                         ids.shape[1], rule.params.get("threshold", 0.0), stop_ids).tolist()


def _release(s: _Slots, rounds_hidden: int, on_result, progress) -> Iterator[DecodeResult]:
    """The results of the waiting requests, in finish order, once every one has its first round's
    records (none before: results come in the order requests finish)."""
    if not s.waiting or any(a.signals is None for a in s.waiting):
        return
    released, s.waiting = s.waiting, []
    for a in released:
        result = _result(a, rounds_hidden)
        if on_result is not None:
            on_result(result)
        yield result
    if progress is not None:
        progress(len(released))


def _result(a: _Active, rounds_hidden: int = 0) -> DecodeResult:
    frac, conf, entropy, end = a.signals
    return DecodeResult(
        request_id=a.request.request_id,
        prompt_tokens=len(a.prompt),
        prompt_blocks=a.layout.prompt_blocks,
        block_size=a.layout.block_size,
        rounds_per_block=list(a.rounds_per_block),
        output_ids=list(a.output),
        finish=a.finish,
        frac_over_threshold=frac,
        mean_confidence=conf,
        mean_entropy=entropy,
        end_probability=end,
        wall_s=a.wall_s,
        first_round_hidden=a.first_hidden.astype(np.float32),
        prompt_last_hidden=a.prompt_hidden.astype(np.float32),
        extra={"admit_round": a.admit_round, "finish_round": a.finish_round, "slot": a.slot},
        first_round_layers=a.layer_hidden,
        round_states=np.stack(a.round_states).astype(np.float32) if rounds_hidden else None,
        round_signals=np.asarray(a.round_signals, dtype=np.float32) if rounds_hidden else None,
    )
