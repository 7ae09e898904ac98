"""Install the DWISE policy in SGLang's dLLM scheduler at run time (no edits to SGLang's source).

Pinned release: ``sglang==0.5.23``. Everything this module touches in SGLang is listed in
:data:`SURFACE` (module, ``Class.member``, what we do with it, expected parameters);
``tests/test_sglang_surface.py`` checks that table against the real source when it is available and
against the committed snapshot ``tests/fakes/sglang_surface.json`` always.

What the patch does, at the four points of seed 000 §5.1:

- **admission** — ``SchedulerDllmMixin._fetch_waiting_reqs`` is replaced: the policy is first
  reconciled with SGLang's own queues when their sizes say something changed behind its back
  (requests SGLang aborted leave it; requests ``pause_generation(mode="retract")`` queued again
  while leaving them in the dLLM manager stay resident, once), new requests are registered with a
  :class:`~dwise_predict.serving.policy.DwisePolicy` (``P`` = prompt blocks, ``r̂`` = the bundle's
  admission estimate, KV reservation = prompt + output budget + slack blocks; a request whose
  reservation exceeds the whole budget is aborted through SGLang's ``abort_request`` with a
  message), the policy ranks waiting ∪ resident, and the admitted requests move into the dLLM
  manager's queue (SGLang's resident set);
- **batch formation** — ``SchedulerDllmMixin._process_dllm_batches`` is replaced: the ``B`` resident
  requests the policy picked go to SGLang's own ``_process_batch_by_phase``, prompt and denoising
  blocks in one ``DLLM_EXTEND`` batch (no prefill-first barrier). SGLang's adder still applies its
  budgets; a pick it leaves out is recorded as paused (``DwisePolicy.ran``), and while the adder
  still takes requests the next-ranked residents are offered for the free slots in the same step
  (both counted in :class:`HookStats`); after staging, ``P`` follows the prefix SGLang matched
  (``engine.prefill_rounds``). Models that encode the prompt in a separate
  pass (``requires_separate_context_encoding``) cannot mix phases: there the resident queue is only
  reordered and SGLang's own batch former runs;
- **result processing** — ``SchedulerDllmMixin.process_batch_result_dllm`` is wrapped: after SGLang
  commits outputs, the policy's fields are updated for every request of the batch in one vectorised
  call, with the refined estimate for requests whose first denoising round this was (and the
  recorder, in recording mode, gets the request's forwards and, host-side, its pooled rows);
- **refinement input** — ``LogitsProcessor._get_dllm_logits`` is wrapped to mean-pool each
  request's block rows into a static buffer allocated at install (block size and largest batch
  known then), so the copy is captured in SGLang's CUDA graphs and every replay writes it;
  ``DllmAlgorithm.run`` is wrapped to fill that buffer with NaN before a step (until the first
  refinement has checked it) and read the step's first forward's rows from it (copied out only if a
  second forward follows). The first refinement checks those rows: an unwritten buffer (a graph
  captured before install) is a one-line :class:`ConfigError`, never silent zeros. The same first
  forward's early signals (``engine.signals``, the refinement graph's last input) are computed
  from its ``full_logits`` after the forward returns, outside any captured graph. The refinement's
  ``prompt_last`` input is the same buffer's row for the request's last prompt block, kept on the
  device. A request that runs no prompt block of its own after a prefix-cache hit on every full
  block gets the row of the earlier request's forward that computed that same last block over the
  same tokens, as a prompt block or as a finished request's last output block (:class:`_PromptRows`,
  bounded); a prompt shorter than a block, or a hit whose block is not kept, gets the mean of
  its leftover prompt rows in its first denoising forward, as the decoder records for short prompts.
  A dLLM request's fill ids end in a mask block, so SGLang's match (``Req._compute_max_prefix_len``,
  floored to a block) can cover a block-aligned prompt whole: with no leftover rows and no kept
  row, the refinement gets the training mean instead (``HookStats.prompt_from_training_mean``) and
  the recorder leaves the request out of the traces (``LiveRecorder.left_out``). Leftover
  rows are pooled, like the block rows, into a second static buffer through per-row weights written
  before each step.

Refinement runs on the pooled rows in ``process_batch_result_dllm``, after SGLang's own end-of-round
synchronisation, as one batched call of the bundle's torch graph on the rows' device over every
request in its first denoising round. What the host needs of that step (refined estimates, early
signals, and when recording the pooled rows) comes back in one device-to-host copy, and a step
without a first denoising round copies nothing; the rows' own inputs (which rows, prompt tokens,
budget, leftover positions) go to the device in one copy before the forward, through a pinned
buffer. An IDLE batch (DP attention's MLP sync: no requests; eager, no logits) passes through.

On a server with several TP ranks (each its own scheduler, CPU and GPU), the estimates that rank
requests are the first rank's on every rank (:class:`_RankShare`, over the scheduler's
``dp_tp_group``), so a last-bit difference between GPUs cannot build different batches.

On its first step the hook reads the scheduler's ``DllmConfig``: a bundle trained for another
algorithm, other parameters or another block size stops it with one line (rounds in other units),
and so does a recording whose manifest names another (``engine.algorithms.served_decoding``).

A scheduler step is one round only in FDFO mode (``--dllm-fdfo``, SGLang 0.5.23's default: one
forward per step); with ``--no-dllm-fdfo`` SGLang runs every denoising round of a block inside one
step, and the policy is advanced by the number of forwards the step ran (its ranking then changes
per block, not per round). Use FDFO with DWISE.
Install it in the scheduler process with :mod:`dwise_predict.serving.launcher`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import math
import operator
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import compress
from pathlib import Path

import numpy as np

from dwise_predict.engine import prefill_rounds, tokenizer_stop_ids
from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.identity import EARLY_SIGNALS
from dwise_predict.serving.bundle import check_compatible
from dwise_predict.serving.policy import DwisePolicy

SGLANG_VERSION = "0.5.23"

# per-request reads of SGLang's Req objects as C-level callables: a pass over a batch through map() runs
# no Python frame per request (a list comprehension costs about twice as much on the scheduler thread)
_rid = operator.attrgetter("rid")
_phase = operator.attrgetter("dllm_phase")
_slot = operator.attrgetter("_dwise_slot")
_finished = operator.methodcaller("finished")


@dataclass(frozen=True)
class Touch:
    """One thing in SGLang this adapter depends on.

    kind : ``patch`` (replaced or wrapped), ``call`` (called with these parameters) or
        ``attribute`` (read or written: an instance attribute set in the class, a class attribute
        or an enum member).
    params : expected parameter names of a patched or called function, in order.
    """

    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()


_SCHED = "sglang.srt.dllm.mixin.scheduler"
SURFACE: tuple[Touch, ...] = (
    Touch(_SCHED, "SchedulerDllmMixin._fetch_waiting_reqs", "patch", ("self",)),
    Touch(_SCHED, "SchedulerDllmMixin._process_dllm_batches", "patch", ("self", "adder", "running_batch")),
    Touch(_SCHED, "SchedulerDllmMixin.process_batch_result_dllm", "patch", ("self", "batch", "result")),
    Touch("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.run", "patch", ("self", "model_runner", "forward_batch", "algo_states")),
    Touch("sglang.srt.layers.logits_processor", "LogitsProcessor._get_dllm_logits", "patch",
          ("self", "hidden_states", "lm_head", "logits_metadata")),
    Touch(_SCHED, "SchedulerDllmMixin._process_batch_by_phase", "call",
          ("self", "adder", "batch", "staging_phase", "incoming_phase", "running_batch")),
    Touch(_SCHED, "SchedulerDllmMixin.init_diffusion_llm", "call", ("self",)),
    Touch(_SCHED, "DllmManager.add_waiting_reqs", "call", ("self", "reqs")),
    Touch(_SCHED, "DllmManager.waiting_queue", "attribute"),
    Touch(_SCHED, "SchedulerDllmMixin.dllm_manager", "attribute"),
    Touch(_SCHED, "SchedulerDllmMixin.dllm_config", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.waiting_queue", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.max_total_num_tokens", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.tokenizer", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.block_size", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.algorithm", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.algorithm_config", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.max_running_requests", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.requires_separate_context_encoding", "attribute"),
    Touch("sglang.srt.dllm.config", "DllmConfig.first_done_first_out_mode", "attribute"),
    Touch("sglang.srt.dllm.mixin.req", "ReqDllmMixin.dllm_phase", "attribute"),
    Touch("sglang.srt.dllm.mixin.req", "DllmReqPhase.STAGING_PREFILL", "attribute"),
    Touch("sglang.srt.dllm.mixin.req", "DllmReqPhase.INCOMING_PREFILL", "attribute"),
    Touch("sglang.srt.dllm.mixin.req", "DllmReqPhase.STAGING_DECODE", "attribute"),
    Touch("sglang.srt.dllm.mixin.req", "DllmReqPhase.INCOMING_DECODE", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.rid", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.origin_input_ids", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.sampling_params", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.finished", "call", ("self",)),
    Touch("sglang.srt.model_executor.forward_batch_info", "ForwardMode.DLLM_EXTEND", "attribute"),
    Touch("sglang.srt.model_executor.forward_batch_info", "ForwardBatch.rids", "attribute"),
    Touch("sglang.srt.model_executor.model_runner", "ModelRunner.forward", "call",
          ("self", "forward_batch", "skip_attn_backend_init", "pp_proxy_tensors")),
    # lifecycle: reconcile with SGLang's queues, abort what can never fit, follow the prefix match
    Touch(_SCHED, "DllmManager.staging_queue", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.abort_request", "call", ("self", "recv_req")),
    Touch("sglang.srt.managers.io_struct", "AbortReq.finished_reason", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.output_ids", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.prefix_len", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "Req.extend_end", "attribute"),
    Touch("sglang.srt.managers.schedule_batch", "ScheduleBatch.reqs", "attribute"),
    Touch("sglang.srt.managers.schedule_policy", "PrefillAdder.can_run_list", "attribute"),
    # budgets: picks the adder leaves out are backfilled while it still takes requests
    Touch("sglang.srt.managers.schedule_policy", "PrefillAdder.budget_state", "call", ("self",)),
    Touch("sglang.srt.managers.schedule_policy", "AddReqResult.CONTINUE", "attribute"),
    # TP ranks of one batch take the first rank's estimates (its TP group's gloo group)
    Touch("sglang.srt.managers.scheduler", "Scheduler.dp_tp_group", "attribute"),
    Touch("sglang.srt.distributed.parallel_state", "GroupCoordinator.ranks", "attribute"),
    Touch("sglang.srt.distributed.parallel_state", "GroupCoordinator.world_size", "attribute"),
    Touch("sglang.srt.distributed.parallel_state", "GroupCoordinator.rank_in_group", "attribute"),
    Touch("sglang.srt.distributed.parallel_state", "GroupCoordinator.cpu_group", "attribute"),
    # the first forward's logits, mask positions and the model's stop ids: early signals (refinement input, recording)
    Touch("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.mask_id", "attribute"),
    Touch("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.block_size", "attribute"),
    Touch("sglang.srt.model_executor.model_runner", "ModelRunner.model_config", "attribute"),
    Touch("sglang.srt.configs.model_config", "ModelConfig.hf_eos_token_id", "attribute"),
    # the launcher: the scheduler child's entry point
    Touch("sglang.srt.entrypoints.engine", "Engine.run_scheduler_process_func", "attribute"),
)


# --- checking the surface against source (ast only: SGLang is never imported here) --------------


def read_surface(source_root: str | Path) -> dict[str, dict]:
    """What the pinned source holds for each :data:`SURFACE` entry, parsed with ``ast``.

    Parameters
    ----------
    source_root : directory that contains the ``sglang`` package (an unpacked wheel).

    Returns
    -------
    ``{"module:Class.member": {"kind", "exists", "params"}}``; ``params`` lists a function's
    parameter names (for ``patch``/``call`` entries) or is empty.
    """
    root = Path(source_root)
    trees: dict[str, ast.Module] = {}
    out = {}
    for touch in SURFACE:
        if touch.module not in trees:
            path = root / (touch.module.replace(".", "/") + ".py")
            trees[touch.module] = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        cls_name, member = touch.qualname.split(".", 1)
        cls = next((n for n in trees[touch.module].body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
        entry = {"kind": touch.kind, "exists": False, "params": []}
        if cls is not None:
            if touch.kind == "attribute":
                entry["exists"] = member in _class_attributes(cls)
            else:
                fn = next((n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member), None)
                if fn is not None:
                    entry["exists"] = True
                    entry["params"] = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        out[f"{touch.module}:{touch.qualname}"] = entry
    return out


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: class-level assignments (enum members) and ``self.X = ...`` anywhere."""
    names = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name) and node in cls.body:
                    names.add(leaf.id)
                elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def surface_problems(found: dict[str, dict]) -> list[str]:
    """Entries of :data:`SURFACE` that ``found`` (from :func:`read_surface`) lacks or disagrees with."""
    problems = []
    for touch in SURFACE:
        entry = found.get(f"{touch.module}:{touch.qualname}")
        where = f"{touch.module}:{touch.qualname}"
        if not entry or not entry["exists"]:
            problems.append(f"{where} is missing")
        elif touch.params and tuple(entry["params"][: len(touch.params)]) != touch.params:
            problems.append(f"{where} takes {entry['params']}, expected {list(touch.params)} first")
    return problems


# --- the runtime patch ----------------------------------------------------------------------------

UNWRITTEN = (
    "the first refinement read a pooling buffer the forward never wrote (CUDA-graph replays skip "
    "Python): install the hook in the scheduler process before start-up (`dwise-predict serve`, or "
    "sglang_adapter.install(..., block_size=, max_batch=, device=) before the graphs are captured)"
)


@dataclass
class HookStats:
    """What the hook did, for logs and tests (all counts since install).

    rounds : scheduler steps the policy planned.
    admitted : requests the policy moved into SGLang's dLLM queue.
    finished : requests that left the policy because SGLang finished them.
    vanished : requests that left because SGLang dropped them from every queue (``abort_request``).
    retracted : requests SGLang sent back to its waiting queue with their KV released
        (``pause_generation(mode="retract")``, which leaves them in the dLLM manager's queues too:
        they stay resident, the duplicate leaves the waiting queue, and ``P`` follows the prompt and
        output blocks SGLang re-encodes).
    oversized : requests aborted because their KV reservation exceeds the whole budget.
    prefix_blocks : prompt blocks a prefix-cache hit removed from ``P``.
    budget_overrides : policy picks that SGLang's batch budget (its ``PrefillAdder``: KV memory, the
        input-token budget ``--max-prefill-tokens``, request limits) left out of a step; DWISE's
        order yields to those budgets, and the policy records them as paused, not run.
    backfilled : standby requests (ranked next) run in a step in the slots of picks the adder left
        out, where the adder still took requests (its ``budget_state`` said CONTINUE).
    idle : IDLE forwards (DP attention's MLP sync: no requests) that went through the hook.
    host_transfers : device-to-host copies the hook made: one per step that ran a first denoising
        round (refinement or recording), none in any other step.
    refined : requests refined on their first denoising round.
    prompt_from_cache : refined requests that ran no prompt block of their own after a prefix-cache
        hit on every full block: their ``prompt_last`` input was the row an earlier request's forward
        computed for the same last full block over the same tokens.
    prompt_from_leftover : refined requests that ran no prompt block of their own and found no such
        row (a prompt shorter than a block, or a hit whose block has left :class:`_PromptRows`): their
        ``prompt_last`` input was the mean of their leftover prompt rows in the first denoising forward.
    prompt_from_training_mean : refined requests whose prompt rows SGLang never computed in this
        process: a block-aligned prompt cached whole (no leftover tokens) whose last block has left
        :class:`_PromptRows` (or ``prompt_cache=0``). Their ``prompt_last`` input was the training
        requests' mean (``LoadedBundle.prompt_last_mean``), which the graph standardises to zero.
    """

    rounds: int = 0
    admitted: int = 0
    finished: int = 0
    vanished: int = 0
    retracted: int = 0
    oversized: int = 0
    prefix_blocks: int = 0
    budget_overrides: int = 0
    backfilled: int = 0
    idle: int = 0
    host_transfers: int = 0
    refined: int = 0
    prompt_from_cache: int = 0
    prompt_from_leftover: int = 0
    prompt_from_training_mean: int = 0


class _PromptRows:
    """Pooled rows of the blocks recent requests completed — each prompt block's forward, and a
    finished request's last full block's last forward (the one over its final tokens, which SGLang
    caches) — keyed by every token up to the block's end: the ``prompt_last`` of a later request whose
    every full prompt block a prefix-cache hit served (a shared system prompt, a repeated prompt, the
    next turn of a chat: the previous prompt, its answer and fewer new tokens than a block after its
    last full block). Intermediate output blocks are not kept: only a prompt that branches off inside
    an earlier answer would end on one, and keying every block cost the scheduler a hash and a copy per
    row and step.

    A block's rows depend on its own tokens and those before it only (block-causal attention), so the
    row an earlier request computed for a block ending where the later request's last full block ends,
    over the same tokens, is the row that request's own forward would have computed — what ``collect``
    (no prefix cache) records. That needs SGLang to run a prompt block and an output block's forward
    alike: it gives both the forward mode DLLM_EXTEND, and nothing on its forward path reads a
    request's phase (checked against the wheel in ``test_serving_sglang_adapter.py``); algorithms that
    encode the context separately prefill as EXTEND, and for those no rows are keyed. Least recently
    used rows leave first once ``capacity`` are held (``capacity`` rows of H floats on the model's
    device, allocated at install; 0 keeps none).

    The scheduler keeps rows every step but looks one up only for a request that ran no prompt block
    of its own, so a kept row's key (a digest of its tokens, :func:`block_key`) is computed when the
    next lookup comes (:meth:`reserve_tokens`, :meth:`get`), not on the step that keeps it: a server
    whose requests all run their own prompt blocks hashes nothing. Rows kept since the last lookup
    count as more recently used than every keyed row (a keyed row read after they were kept may leave
    before them).
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.slots: OrderedDict = OrderedDict()  # key -> row of ``rows``, least recently used first
        self.pending: deque = deque()  # (its request's _BlockKeys, blocks, block size, row): kept, not yet keyed
        self.rows = None  # (capacity, H) on the model's device (``allocate``)
        self.free = list(range(self.capacity))

    def allocate(self, width: int, device) -> None:
        import torch

        self.rows = torch.zeros((self.capacity, width), device=device)

    def reserve(self, key: bytes) -> int:
        """The row that holds ``key``'s pooled row from now on (the least recently used one's, once
        every row is taken); the caller writes it."""
        slot = self.slots.pop(key, None)
        if slot is None:
            slot = self._take()
        self.slots[key] = slot
        return slot

    def reserve_tokens(self, req, blocks: int, block_size: int) -> int:
        """:meth:`reserve` for the block of ``req`` ending at token ``blocks * block_size``, keyed by
        those tokens (:func:`block_key`) at the next lookup."""
        slot = self._take()
        self.pending.append((_block_keys(req), blocks, block_size, slot))
        return slot

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.slots:
            return self.slots.popitem(last=False)[1]
        return self.pending.popleft()[3]

    def get(self, key: bytes):
        while self.pending:  # key the rows kept since the last lookup, oldest first (a later one wins)
            keys, blocks, block_size, slot = self.pending.popleft()
            pending_key = keys.key(blocks, block_size)
            old = self.slots.pop(pending_key, None)
            if old is not None:
                self.free.append(old)
            self.slots[pending_key] = slot
        slot = self.slots.get(key)
        if slot is None:
            return None
        self.slots.move_to_end(key)
        return self.rows[slot]


class _BlockKeys:
    """The keys of one request's leading blocks (:func:`block_key`): one running hash over its tokens
    (prompt, then output), fed block by block, so its keys cost one pass over its tokens however many
    blocks ask, in whatever order. It holds the request's token lists, not the request."""

    __slots__ = ("origin", "output", "keys", "running", "hashed")

    def __init__(self, req):
        self.origin, self.output = req.origin_input_ids, req.output_ids
        self.keys: dict = {}  # blocks -> key
        self.running = hashlib.blake2b(digest_size=16)
        self.hashed = 0  # blocks in the running hash

    def key(self, blocks: int, block_size: int) -> bytes:
        key = self.keys.get(blocks)
        if key is None:
            running, hashed = self.running, self.hashed
            if blocks < hashed:  # behind the running hash: hash those tokens afresh
                running, hashed = hashlib.blake2b(digest_size=16), 0
            else:
                self.hashed = blocks
            running.update(_token_bytes(self.origin, self.output, hashed * block_size, blocks * block_size))
            key = self.keys[blocks] = running.digest()
        return key


def _block_keys(req) -> _BlockKeys:
    """``req``'s :class:`_BlockKeys`, kept on the request (its token lists as they are now)."""
    keys = req.__dict__.get("_dwise_block_keys")
    if keys is None:
        keys = req._dwise_block_keys = _BlockKeys(req)
    else:
        keys.origin, keys.output = req.origin_input_ids, req.output_ids
    return keys


def block_key(req, blocks: int, block_size: int) -> bytes:
    """Digest of ``req``'s first ``blocks`` full blocks of tokens (prompt, then output: what a
    retraction put back into its prompt, or a finished request's answer): one hash over every token up
    to the block's end (:class:`_BlockKeys`)."""
    return _block_keys(req).key(blocks, block_size)


def _token_bytes(origin, output, start: int, stop: int):
    """Tokens ``[start, stop)`` of a request's prompt ``origin`` then its output, as int64 bytes."""
    n = len(origin)
    if stop <= n:
        tokens = origin[start:stop]
    else:
        tokens = array("q", origin[start:n]) if start < n else array("q")
        tokens.extend(output[max(0, start - n):stop - n])
    return tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)


class _RankShare:
    """Values every TP rank serving one batch must hold bit for bit, taken from the group's first
    rank: the estimates that rank requests (admission at arrival, refinement at the first denoising
    round). Each rank computes them on its own CPU and GPU, and a last-bit difference between ranks
    in a tie would build different batches on different ranks, whose collectives then wait for
    each other forever. Everything else the policy reads (token counts, prefix matches, SGLang's
    queues) is the same on every rank by SGLang's own design: it broadcasts the requests to the TP
    ranks (``broadcast_pyobj`` over the TP group's CPU group) before any rank schedules them.

    ``group``: the scheduler's ``dp_tp_group`` (SGLang's ``GroupCoordinator`` of the ranks sharing
    one waiting queue: the TP group, or the attention-TP group under DP attention); the values cross
    its gloo ``cpu_group`` as one float64 tensor (no pickle), from ``ranks[0]``.
    """

    def __init__(self, group):
        self.group, self.source = group.cpu_group, group.ranks[0]
        self.is_source = group.rank_in_group == 0

    def __call__(self, values, n: int):
        """``values`` (n,) on the first rank (ignored elsewhere) -> the first rank's (n,) float64."""
        import torch

        if self.is_source:
            buffer = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        else:
            buffer = torch.empty(n, dtype=torch.float64)
        torch.distributed.broadcast(buffer, src=self.source, group=self.group)
        return buffer.numpy()


class _ToDevice:
    """Host vectors (float32, or int64 indices) onto the model's device in one copy that does not block the host: a
    copy from pageable memory may synchronise the stream, so on CUDA it goes through a pinned buffer.
    One call per step and buffer: it is written again only after the step's own synchronisation
    (SGLang's, when it commits the step's tokens) has passed. On a CPU device no copy is made: the
    caller's array (a fresh one each call) becomes the tensor."""

    def __init__(self, device, capacity: int, dtype: str = "float32"):
        import torch

        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        on_host = self.device.type == "cpu"
        self.dtype = np.dtype(dtype)
        self.host = None if on_host else torch.empty(capacity, dtype=getattr(torch, dtype), pin_memory=self.pinned)

    def __call__(self, values):
        import torch

        if self.host is None:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=self.dtype))
        n = len(values)
        self.host[:n].numpy()[:] = values
        if not self.pinned:
            return self.host[:n].to(self.device, copy=True)
        return self.host[:n].to(self.device, non_blocking=True)


class _State:
    """What the patched functions share: the policy, the bundle and the refinement buffers."""

    def __init__(self, bundle, slots, k, kv_budget_tokens, kv_fraction, slack_blocks, features, device,
                 block_size, max_batch, recorder, prompt_cache, aging):
        self.bundle = bundle
        self.slots, self.k, self.aging = slots, k, aging
        self.kv_budget_tokens, self.kv_fraction, self.slack_blocks = kv_budget_tokens, kv_fraction, slack_blocks
        self.features = features
        self.device = device
        self.recorder = recorder
        self.policy: DwisePolicy | None = None
        self.share = None  # _RankShare when several TP ranks schedule one batch (bind)
        self.block_size = int(block_size or 0)
        self.max_batch = int(max_batch or 0)
        self.stats = HookStats()
        self.reqs: dict = {}  # rid -> Req, for requests the policy holds
        self.req_at = np.empty(0, dtype=object)  # policy slot -> its Req (each also carries its _dwise_slot)
        self.plan = None  # this round's RoundPlan
        self.picks: list = []  # this round's picks (Reqs), best rank first
        self.foreign: list = []  # requests SGLang's own path put in the dLLM queue this round (finished while waiting)
        self.batch = None  # the batch being run (SGLang's list of Reqs), and per row of it:
        self.batch_slots = self.batch_prompt = self.batch_ours = None  # policy slot (-1: not ours), prompt block, ours
        self.batch_all_ours = False  # every row is ours (then batch_ours is None)
        self.batch_slot_list: list = []  # batch_slots as a list
        self.batch_prompt_at: list = []  # the batch rows of ours at a prompt block
        self.first: dict = {}  # rid -> (prompt tokens, budget, leftover prompt tokens to pool, own_last row or -1)
        #                        of the batch's first denoising forwards
        self.pooled2 = None  # (max_batch, 2, H) static, allocated at install, written inside the forward:
        self.pooled = None  # [:, 0], each row's mean over its block rows,
        self.leftover_pooled = None  # [:, 1], the weighted sum of its leftover prompt rows
        self.weights = None  # (max_batch, 2, block) static: 1/block (the mean), and the leftover weights
        self.first_pooled = None  # (B, H) the step's first forward's rows (a view of pooled; copied if a second forward runs)
        self.signal_threshold = None  # for an algorithm without one of its own: set by check_decoding
        # per policy slot (Python lists, indexed like the policy's own arrays, grown with them in register:
        # read and written for the few rows of a step at a prompt block or a first round, where a list
        # index costs less than a numpy call)
        self.expect_prefix: list = []  # SGLang's prefix_len once its last prompt block ran as planned
        self.own_row: list = []  # its row of own_last (-1: none)
        self.own_last = None  # (k*B, H) device rows: each request's latest prompt-block row, until its first round
        self.kept_rows = None  # own_last's rows, then prompt_rows' (hold_rows)
        self.own_free: list = []  # rows of own_last no request holds
        self.prompt_rows = _PromptRows(prompt_cache)  # the same for recent blocks of any request, by tokens
        self.prompt_mean = None  # the bundle's training mean of prompt_last on the device (install)
        self.leftover_weights = None  # weights[:, 1]: 1/n on a row's n leftover prompt positions, zeros elsewhere
        self.first_leftover = None  # (B, H) the same of leftover_pooled (when the step has first-round rows)
        self.weights_set = False  # leftover_weights holds a nonzero row
        self.last_pooled = None  # (B, H) the pooled buffer after a step's last forward
        self.to_device = None  # _ToDevice, for the step's per-row inputs (install)
        self.to_device_kept = None  # _ToDevice, for the rows kept in prompt_rows (install)
        self.rows: list = []  # batch rows of the step's first denoising forwards (run)
        self.row_rids: list = []  # their request ids
        self.rows_dev = self.tokens_dev = self.budget_dev = None  # the same on the device (run)
        self.row_own, self.own_dev = None, None  # their own_last rows (-1: none), host and device (run)
        self.running = None  # (algorithm, model runner, forward batch, its forward, its step) during run
        self.counted_forward = self.counted_step = None  # what run puts in place of those two (install)
        self.first_signals = None  # (n_rows, 4) early signals of those rows in the step's first forward
        self.stop_ids = None  # (S,) the model's end-of-sequence ids on the logits' device (first forward)
        self.tokenizer_stop_ids: set[int] = set()  # the scheduler tokenizer's stop ids (bind)
        self.forwards = 0  # forwards in the current step
        self.step_done: list = []  # (forwards so far, the algorithm step's done list) per step call (run)
        self.row_forwards = None  # int64 per batch row: forwards until its block reported done (this step; 0: not done)
        self.checked = False  # the first refinement checked that the buffer was written

    def bind(self, scheduler) -> None:
        """Create the policy from the scheduler's dLLM config on first use (no allocation here)."""
        config = scheduler.dllm_config
        self.check_decoding(config)  # a bundle for another block size is named as such, first
        if self.block_size and int(config.block_size) != self.block_size:
            raise ConfigError(
                f"the hook was installed for block_size {self.block_size} but SGLang runs {config.block_size}: "
                "install it with SGLang's block size"
            )
        self.block_size = int(config.block_size)
        if getattr(scheduler, "tokenizer", None) is not None:  # None under --skip-tokenizer-init
            self.tokenizer_stop_ids = tokenizer_stop_ids(scheduler.tokenizer)
        if self.slots * self.k > config.max_running_requests:
            raise ConfigError(
                f"DWISE keeps up to k*B = {self.slots * self.k:g} requests resident but SGLang's "
                f"--max-running-requests is {config.max_running_requests}: raise it to at least k*B"
            )
        group = getattr(scheduler, "dp_tp_group", None)
        if group is not None and group.world_size > 1:
            self.share = _RankShare(group)
        budget = self.kv_budget_tokens
        if budget is None:
            budget = self.kv_fraction * float(scheduler.max_total_num_tokens)
        self.policy = DwisePolicy(self.slots, self.k, kv_budget=budget, aging=self.aging)

    def reconcile(self, scheduler) -> None:
        """Drop what SGLang no longer holds; settle what it queued again.

        SGLang's ``abort_request`` pops requests from its queues and ``filter_finished_reqs`` drops
        finished ones without telling a custom policy. ``pause_generation(mode="retract")`` releases
        the KV of the last batch's requests and appends them to the waiting queue, but leaves them in
        the dLLM manager's queues (SGLang 0.5.23 never retracts a dLLM request otherwise: the running
        batch is emptied every step): such a request stays resident here, and its duplicate leaves
        the waiting queue (SGLang's own ``add_waiting_reqs`` would refuse it as redundant). One that
        SGLang queued again without the manager is registered again with the work it has left.
        """
        manager = scheduler.dllm_manager
        queued = {id(r) for r in scheduler.waiting_queue}
        held = {id(r) for r in manager.waiting_queue} | {id(r) for r in manager.staging_queue}
        duplicates = set()
        for rid, req in list(self.reqs.items()):
            in_queue, in_manager = id(req) in queued, id(req) in held
            if req.finished() or not (in_queue or in_manager):
                self.forget(rid)
                if req.finished():
                    self.stats.finished += 1
                else:
                    self.stats.vanished += 1
            elif in_queue and in_manager:
                duplicates.add(id(req))
                self.stats.retracted += 1
                if self.recorder is not None:
                    self.recorder.arrived(req, self.block_size)  # marks it: its output is re-encoded
            elif in_queue and self.policy.fields(rid)["state"] != "waiting":
                self.forget(rid)  # registered again, with the work it has left
                self.stats.retracted += 1
        if duplicates:
            scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in duplicates]

    def forget(self, rid, policy_too: bool = True) -> None:
        """The request leaves the hook (and the policy, unless it already freed its slot)."""
        req = self.reqs.pop(rid)
        if policy_too:
            self.policy.remove(rid)
        slot = req._dwise_slot
        self.req_at[slot] = None
        req._dwise_slot = -1
        if self.own_row[slot] >= 0:
            self.own_free.append(self.own_row[slot])
            self.own_row[slot] = -1

    def hold_own(self, slot: int) -> int:
        """The row of ``own_last`` of the request in policy slot ``slot``: its own, or a free row taken
        now (the buffer doubles if every row is held: more requests than the k*B resident ones it was
        sized for, which SGLang's queues should not allow)."""
        row = self.own_row[slot]
        if row < 0:
            if not self.own_free:
                import torch

                held = len(self.own_last)
                self.hold_rows(torch.cat([self.own_last, torch.zeros_like(self.own_last), self.prompt_rows.rows]), 2 * held)
                self.own_free.extend(range(2 * held - 1, held - 1, -1))
            row = self.own_row[slot] = self.own_free.pop()
        return row

    def hold_rows(self, rows, own: int) -> None:
        """``rows``: the device rows kept across steps, ``own_last`` (its first ``own`` rows) then the
        prompt-row cache's: one buffer, so a step keeps its rows of both in one device op."""
        self.kept_rows, self.own_last, self.prompt_rows.rows = rows, rows[:own], rows[own:]

    def release_own(self, slots) -> None:
        """The requests in ``slots`` no longer need their prompt-block rows (their first round ran)."""
        own_row = self.own_row
        for slot in slots:
            if own_row[slot] >= 0:
                self.own_free.append(own_row[slot])
                own_row[slot] = -1

    def check_decoding(self, config) -> None:
        """Hold the bundle and the recording to the decoding SGLang serves (``config``: its
        ``DllmConfig``): rounds in another algorithm's or threshold's units would rank requests in
        units this server does not run, or be recorded under a decoding it did not run
        (:func:`~dwise_predict.engine.algorithms.comparable_decoding` says what a bundle is held to)."""
        from dwise_predict.engine.algorithms import comparable_decoding, served_decoding  # torch: not at import
        from dwise_predict.engine.signals import SIGNAL_THRESHOLD

        served = served_decoding(config.algorithm, config.algorithm_config, config.block_size)
        self.signal_threshold = float((config.algorithm_config or {}).get("threshold", SIGNAL_THRESHOLD))
        if self.bundle is not None:
            trained = (self.bundle.manifest.get("decoding") or {}).get("algorithm")
            check_compatible(self.bundle.manifest, None, comparable_decoding(trained, served), "given to the hook")
        if self.recorder is not None:
            said = self.recorder.decoding
            recorded = served_decoding(said.get("algorithm"), said.get("algorithm_config"), said.get("block_size"))
            if recorded != served:
                raise ConfigError(f"the recording says the server decodes with {recorded} but SGLang runs {served}: "
                                  "give the recorder the server's decoding (`dwise-predict serve --record` reads "
                                  "it from SGLang's arguments)")

    def register(self, scheduler, reqs: list) -> None:
        """Add newly arrived requests to the policy, admission estimates in one batch (the first TP
        rank's, on every rank).

        A request whose worst-case KV reservation exceeds the whole budget could never be admitted:
        it is aborted through SGLang's own ``abort_request`` with a message saying so, and the rest
        of the batch is registered.
        """
        bs = self.block_size
        # what is still to encode: the prompt, plus the output of a request queued again (re-encoded)
        seen = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
        kv = [(math.ceil((len(r.origin_input_ids) + r.sampling_params.max_new_tokens) / bs) + self.slack_blocks) * bs
              for r in reqs]
        fits = [k <= self.policy.kv_budget for k in kv]
        for req, k, ok in zip(reqs, kv, fits):
            if not ok:
                self.abort(scheduler, req, f"dwise: request {req.rid} needs a worst-case KV reservation of {k:g} "
                                          f"tokens (prompt + max_new_tokens + slack) but the DWISE KV budget is "
                                          f"{self.policy.kv_budget:g}: lower max_new_tokens or raise the budget")
        reqs = [r for r, ok in zip(reqs, fits) if ok]
        if not reqs:
            return
        seen = [n for n, ok in zip(seen, fits) if ok]
        kv = [k for k, ok in zip(kv, fits) if ok]
        # no prefix is matched before SGLang stages the request; P follows the match from then on
        P = [prefill_rounds(n, bs) for n in seen]
        estimates = np.zeros(len(reqs))
        if self.bundle is not None:
            if self.share is None or self.share.is_source:
                estimates = self.bundle.admission(np.asarray([self.features(r) for r in reqs], dtype=np.float32))
            if self.share is not None:
                estimates = self.share(estimates, len(reqs))
        slots = self.policy.add_many([r.rid for r in reqs], P, np.maximum(np.asarray(estimates, dtype=np.float64), 0.0), kv)
        if len(self.req_at) <= slots.max():
            more = max(len(self.req_at), slots.max() + 1)
            self.req_at = np.concatenate([self.req_at, np.empty(more, dtype=object)])
            self.own_row.extend([-1] * more)
            self.expect_prefix.extend([-1] * more)
        for r, slot in zip(reqs, slots.tolist()):
            self.reqs[r.rid] = r
            self.req_at[slot] = r
            self.expect_prefix[slot] = -1  # (own_row is -1 already: forget released the slot's row)
            r._dwise_slot = slot
        if self.recorder is not None:
            for r in reqs:
                self.recorder.arrived(r, bs)

    def abort(self, scheduler, req, message: str) -> None:
        """Finish one request with an abort through SGLang's own path (the client gets ``message``)."""
        abort_req = scheduler_abort_req(req.rid, message)
        scheduler.abort_request(abort_req)
        self.stats.oversized += 1


_IO = "sglang.srt.managers.io_struct"
_resolve_abort_req = None  # set by install(): the AbortReq class of the SGLang in use


def scheduler_abort_req(rid, message: str):
    """An ``AbortReq`` for one request that carries ``message`` to the client (HTTP 400)."""
    return _resolve_abort_req(rid=rid, finished_reason={"type": "abort", "message": message, "status_code": 400,
                                                        "err_type": "BadRequestError"})


@dataclass
class Installed:
    """Handle on an installed patch: its shared state, its stats and ``uninstall()``."""

    state: _State
    originals: list

    @property
    def stats(self) -> HookStats:
        return self.state.stats

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)
        self.originals.clear()


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


def stop_token_ids(model_runner, tokenizer_ids, device):
    """The ids the served model's requests stop on, as a device tensor for the ``end_probability``
    signal: SGLang's ``ModelConfig.hf_eos_token_id`` (config.json and generation_config.json together)
    and ``tokenizer_ids``, its tokenizer's (:func:`engine.layout.tokenizer_stop_ids`), the set
    ``Req._check_token_based_finish`` tests and ``collect`` gathers. A request's own
    ``stop_token_ids`` are not included: the signal describes the model, like the traces it was
    trained on."""
    import torch

    ids = sorted(set(getattr(model_runner.model_config, "hf_eos_token_id", None) or ()) | set(tokenizer_ids))
    if not ids:
        raise ConfigError("the served model names no eos_token_id (config.json or generation_config.json): "
                          "the early signal end_probability needs it; add it to the model's config")
    return torch.tensor(ids, dtype=torch.long, device=device)


def install(
    bundle=None,
    slots: int = 128,
    k: float = 8,
    kv_budget_tokens: float | None = None,
    kv_fraction: float = 0.9,
    slack_blocks: int = 2,
    features=None,
    device=None,
    resolve=importlib.import_module,
    *,
    block_size: int | None = None,
    max_batch: int | None = None,
    hidden_size: int | None = None,
    recorder=None,
    prompt_cache: int = 4096,
    aging: float = 0.0,
) -> Installed:
    """Patch SGLang's dLLM scheduler (classes, so every scheduler in the process) with DWISE.

    Call it in the scheduler process before the model runner starts (before CUDA-graph capture):
    :func:`dwise_predict.serving.launcher.serve` does that in SGLang's spawned scheduler processes.
    The pooling buffer is allocated here, once, so the copy into it is captured with the forward
    and every replay writes it.

    Parameters
    ----------
    bundle : a :class:`~dwise_predict.serving.bundle.LoadedBundle` (torch backend on the model's
        device) or None for ``r̂ = 0`` (rank by prompt blocks only).
    slots : ``B``, requests per round; match SGLang's batch capacity.
    k : resident-set multiplier; SGLang's ``--max-running-requests`` must be at least ``k * B``.
    kv_budget_tokens : KV tokens available for reservations; default ``kv_fraction`` of the
        scheduler's ``max_total_num_tokens``.
    slack_blocks : extra blocks reserved per resident request.
    features : callable ``req -> (words, newlines, prompt_tokens)`` for admission; SGLang's ``Req``
        keeps token ids, not text, so pass e.g. ``lambda r: featurize(tokenizer.decode(r.origin_input_ids))``.
        Required with a bundle.
    device : torch device of the model (required with a bundle or a recorder).
    block_size : SGLang's dLLM block size (required with a bundle or a recorder; checked against
        the scheduler's config on its first step, and against the bundle's now).
    max_batch : most requests in one forward (the largest captured CUDA-graph batch); the buffer
        has ``max(max_batch, slots)`` rows. A forward with more rows fails loudly.
    hidden_size : the model's hidden size when recording without a bundle.
    recorder : an object with ``decoding`` (what it records SGLang to decode with: checked on the first
        step), ``arrived(req, block_size)``, ``forward(req, prompt, pooled_row, rounds, signals,
        prompt_row)`` (rows as host float32 arrays, or None) and ``finished(req)``
        (:class:`dwise_predict.collectors.live.LiveRecorder`): recording mode.
    prompt_cache : block rows kept for requests that a prefix-cache hit leaves without a prompt
        block of their own (:class:`_PromptRows`; ``prompt_cache`` x H floats on ``device``; 0: none,
        those requests get their leftover prompt rows' mean).
    aging : the policy's starvation guard (:class:`~dwise_predict.serving.policy.DwisePolicy`:
        rounds of remaining work a round in the server is worth; 0: off).
    resolve : module resolver (tests pass a fake SGLang here).
    """
    global _resolve_abort_req
    if bundle is not None and features is None:
        raise ConfigError("the admission predictor needs prompt features: pass features=callable(req) -> (words, newlines, prompt_tokens)")
    pooling = bundle is not None or recorder is not None
    if pooling:
        missing = [name for name, value in (("block_size", block_size), ("device", device)) if value is None]
        if missing:
            raise ConfigError(f"refinement and recording need {' and '.join(missing)} at install time (the pooling "
                              "buffer is allocated before SGLang captures its CUDA graphs): pass them to install()")
    if bundle is not None and block_size is not None:
        bundle_bs = (bundle.manifest.get("decoding") or {}).get("block_size")
        if bundle_bs is not None and int(bundle_bs) != int(block_size):
            raise BundleError(
                f"bundle was trained with block_size {bundle_bs} but SGLang runs {block_size}: "
                "export a bundle for this decoding config"
            )
    state = _State(bundle, slots, k, kv_budget_tokens, kv_fraction, slack_blocks, features, device,
                   block_size, max_batch, recorder, prompt_cache, aging)
    if pooling:
        import torch

        width = bundle.hidden_size if bundle is not None else hidden_size
        if not width:
            raise ConfigError("recording without a bundle needs hidden_size= (the model's hidden size)")
        rows = max(int(max_batch or 0), int(slots))
        state.pooled2 = torch.full((rows, 2, int(width)), math.nan, device=device)
        state.pooled, state.leftover_pooled = state.pooled2[:, 0], state.pooled2[:, 1]
        state.weights = torch.zeros((rows, 2, int(block_size)), device=device)
        state.weights[:, 0] = 1.0 / int(block_size)
        state.leftover_weights = state.weights[:, 1]
        state.to_device = _ToDevice(device, 5 * rows)
        state.to_device_kept = _ToDevice(device, 4 * rows, "int64")  # its own buffer: the next step's copy may be in flight
        resident = int(math.floor(k * slots))  # a row is held from a request's first prompt block to its first round
        state.hold_rows(torch.zeros((resident + state.prompt_rows.capacity, int(width)), device=device), resident)
        state.own_free = list(range(resident - 1, -1, -1))
        if bundle is not None:
            state.prompt_mean = torch.as_tensor(bundle.prompt_last_mean, dtype=torch.float32, device=device)

    sched_mod = resolve(_SCHED)
    req_mod = resolve("sglang.srt.dllm.mixin.req")
    fb_mod = resolve("sglang.srt.model_executor.forward_batch_info")
    continue_ = resolve("sglang.srt.managers.schedule_policy").AddReqResult.CONTINUE
    _resolve_abort_req = resolve(_IO).AbortReq
    mixin = sched_mod.SchedulerDllmMixin
    algorithm = resolve("sglang.srt.dllm.algorithm.base").DllmAlgorithm
    logits = resolve("sglang.srt.layers.logits_processor").LogitsProcessor
    phase = req_mod.DllmReqPhase
    # ReqDllmMixin.is_dllm_prefill as a set lookup (the phases are str enums, hashed as their strings):
    # the method builds a list and compares against it, about 0.3 µs per request and step
    prefill_phases = frozenset((phase.STAGING_PREFILL, phase.INCOMING_PREFILL))
    originals = []

    def patch(owner, name, fn):
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def fetch_waiting_reqs(self):
        if state.policy is None:
            state.bind(self)
        policy, reqs = state.policy, state.reqs
        queue = self.waiting_queue
        # SGLang's waiting queue holds the policy's waiting requests and any new ones (one pass, in C)
        new = [] if all(map(reqs.__contains__, map(_rid, queue))) else [r for r in queue if r.rid not in reqs]
        # the policy's waiting requests are in SGLang's waiting queue and its resident ones in the dLLM
        # manager's (SGLang's filter_finished_reqs has just dropped the finished): a count that differs
        # means SGLang aborted or queued again some of them, and only then are the queues walked
        if len(queue) - len(new) != policy.n_waiting \
                or len(self.dllm_manager.waiting_queue) != policy.n_resident:
            state.reconcile(self)
            new = [r for r in self.waiting_queue if r.rid not in reqs]
        state.foreign = [r for r in new if r.finished()] if new else []
        if state.foreign:  # finished while waiting (SGLang's set_finish_with_abort): SGLang's own path
            done = {id(r) for r in state.foreign}
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in done]
            self.dllm_manager.add_waiting_reqs(state.foreign)
            new = [r for r in new if id(r) not in done]
        if new:
            state.register(self, new)
        plan = state.plan = policy.schedule()
        state.stats.rounds += 1
        if len(plan.admitted):
            admitted = {id(r) for r in state.req_at[plan.admitted].tolist()}
            moving, staying = [], []
            for r in self.waiting_queue:
                (moving if id(r) in admitted else staying).append(r)
            self.waiting_queue = staying
            self.dllm_manager.add_waiting_reqs(moving)
            state.stats.admitted += len(moving)
        state.picks = state.req_at[plan.run].tolist()

    original_batches = mixin._process_dllm_batches

    def stage(self, adder, running_batch, candidates) -> None:
        """Offer ``candidates`` (in rank order) to SGLang's own batch former, prompt blocks first."""
        prompt = list(map(prefill_phases.__contains__, map(_phase, candidates)))  # is_dllm_prefill, in C
        self._process_batch_by_phase(adder, list(compress(candidates, prompt)), phase.STAGING_PREFILL,
                                     phase.INCOMING_PREFILL, running_batch)
        self._process_batch_by_phase(adder, list(compress(candidates, map(operator.not_, prompt))), phase.STAGING_DECODE,
                                     phase.INCOMING_DECODE, running_batch)

    def process_dllm_batches(self, adder, running_batch):
        policy, plan = state.policy, state.plan
        separate = self.dllm_config.requires_separate_context_encoding
        candidates = state.foreign + state.picks if state.foreign else state.picks
        if separate:
            # phases cannot share a forward here: keep SGLang's batch former, in DWISE order
            rank = {id(r): i for i, r in enumerate(state.picks)}
            self.dllm_manager.waiting_queue.sort(key=lambda r: rank.get(id(r), len(rank)))
            mode = original_batches(self, adder, running_batch)
        else:
            # requests SGLang placed there without the policy (finished while waiting) run first, as they would
            stage(self, adder, running_batch, candidates)
            mode = fb_mod.ForwardMode.DLLM_EXTEND
        cut = 0
        if separate or len(adder.can_run_list) != len(candidates):  # SGLang stages only what it is offered
            taken = {id(r) for r in adder.can_run_list}
            cut = sum(id(r) not in taken for r in state.picks)
        if cut:
            # SGLang's adder left picks out (KV memory, --max-prefill-tokens, request limits): while it
            # still takes requests, the next-ranked residents run in their slots; the policy learns
            # which ran, so the picks left out are paused (and ranked again next round), not running
            state.stats.budget_overrides += cut
            if not separate and adder.budget_state() == continue_:
                before = len(adder.can_run_list)
                stage(self, adder, running_batch, state.req_at[plan.standby[:cut]].tolist())
                state.stats.backfilled += len(adder.can_run_list) - before
            ran = np.fromiter((getattr(r, "_dwise_slot", -1) for r in adder.can_run_list), dtype=np.int64)
            policy.ran(plan, ran[ran >= 0])
        plan_batch(self, adder.can_run_list)
        return mode

    def plan_batch(self, staged) -> None:
        """What the batch's requests run, known only now (SGLang matched their prefixes while staging
        them): their phase, ``P`` after a prefix hit or a retraction, and the inputs of the rows whose
        first denoising forward this is. Kept per batch row for the step's result. Per request, two
        attribute reads (in C); the rest is a few array calls and Python for the rows at a prompt block
        or a first round."""
        policy, bs, n = state.policy, state.block_size, len(staged)
        try:
            slot_list = list(map(_slot, staged))
        except AttributeError:  # a request the hook has never seen (one SGLang's own path queued)
            slot_list = [getattr(r, "_dwise_slot", -1) for r in staged]
        prompt_list = list(map(prefill_phases.__contains__, map(_phase, staged)))
        slots, prompt = np.array(slot_list, dtype=np.int64), np.array(prompt_list, dtype=bool)
        all_ours = not slot_list or min(slot_list) >= 0
        ours = None if all_ours else slots >= 0  # the rest: SGLang's own (finished while waiting)
        prompt_at = list(compress(range(n), prompt_list))  # the rows at a prompt block
        if not all_ours:
            prompt_at = [i for i in prompt_at if slot_list[i] >= 0]
        state.batch, state.batch_slots, state.batch_prompt, state.batch_ours = staged, slots, prompt, ours
        state.batch_all_ours, state.batch_slot_list, state.batch_prompt_at = all_ours, slot_list, prompt_at
        P = policy.prompt_blocks(slots)  # (a slot of -1, not ours, reads a value never used)
        with_prompt = np.count_nonzero(P if all_ours else P[ours])
        P, rounds = P.tolist(), policy.denoising_rounds(slots).tolist()
        # P follows what SGLang has left to encode (the prompt, and after a retraction the output) past
        # its prefix: a request whose prefix grew by the block it ran last keeps the P the policy lowered;
        # a row SGLang runs as a prompt block is checked, and so is one the policy still counts prompt
        # blocks for (P > 0) but SGLang runs as denoising (a prefix hit covered them): the policy's P > 0
        # rows number the checked prompt rows that have P > 0 unless there is such a row
        check = prompt_at
        if sum(P[i] > 0 for i in prompt_at) != with_prompt:
            check = [i for i in range(n) if slot_list[i] >= 0 and (prompt_list[i] or P[i] > 0)]
        expect = state.expect_prefix
        for i in check:
            r, slot = staged[i], slot_list[i]
            prefix = r.prefix_len
            planned = prompt_list[i] and expect[slot] == prefix
            expect[slot] = prefix + bs
            if not planned:
                left = prefill_rounds(len(r.origin_input_ids) + len(r.output_ids), bs, prefix) if prompt_list[i] else 0
                if left != P[i]:
                    if left < P[i] and rounds[i] == 0:
                        state.stats.prefix_blocks += P[i] - left
                    policy.set_prompt_blocks(r.rid, left)
        # the first denoising forwards: refinement and recording pool their rows; a softmax over the
        # vocabulary for every row of every step (their early signals) would cost more than the refinement
        state.first = {}
        if state.pooled is not None:
            # rows neither at a prompt block nor past a denoising round (`rounds or prompt`: 0 only there)
            for i in compress(range(n), map(operator.not_, map(operator.or_, rounds, prompt_list))):
                slot = slot_list[i]
                if slot < 0:
                    continue
                r = staged[i]
                own = state.own_row[slot]  # its last prompt block's row; else its leftover prompt rows are pooled
                state.first[r.rid] = (len(r.origin_input_ids), r.sampling_params.max_new_tokens,
                                      0 if own >= 0 else len(r.origin_input_ids) % bs, own)

    original_result = mixin.process_batch_result_dllm

    def process_batch_result_dllm(self, batch, result):
        original_result(self, batch, result)
        if state.policy is None:
            return
        if batch.reqs is not state.batch:  # not the batch the hook formed (SGLang's own former ran it)
            plan_batch(self, batch.reqs)
        if state.batch_all_ours or state.batch_ours.any():
            advance(self)
        # the next batch names its own rows, and pools its own: a pass that does not go through the
        # wrapped DllmAlgorithm.run (Gemma4Renoise's context encoding) finds none, not this batch's
        state.batch, state.first, state.rows, state.row_rids = None, {}, [], []
        state.first_pooled = state.first_signals = state.first_leftover = state.last_pooled = None

    def advance(self) -> None:
        """After SGLang committed the step: refine the first denoising rounds (one graph run), copy what
        the host needs to the host (one transfer), then advance the policy (vectorised) and keep the
        rows later requests or the recorder need."""
        policy, recorder, batch = state.policy, state.recorder, state.batch
        slots, ours, prompt = state.batch_slots, state.batch_ours, state.batch_prompt
        n, all_ours, slot_list = len(batch), state.batch_all_ours, state.batch_slot_list
        steps = max(state.forwards, 1)
        first = state.rows  # the forward's rows are the batch's, in its order
        host = to_host(first) if first and state.first_pooled is not None else None
        refined = None
        if host is not None:
            state.release_own([slot_list[i] for i in first])  # their first round took their prompt-block rows
            if host["refined"] is not None:
                refined = np.full(n, math.nan)
                refined[first] = host["refined"]
        # which requests finished: in FDFO (one algorithm step) SGLang finishes a request only on the
        # step that resolves its block (process_batch_result_dllm skips an unresolved one before any
        # finish check), so only those rows are asked; a synchronous step commits every row
        done = state.step_done[0][1] if len(state.step_done) == 1 and self.dllm_config.first_done_first_out_mode else None
        asked = range(n) if done is None else list(compress(range(n), done))
        finished_at = list(compress(asked, map(_finished, map(batch.__getitem__, asked))))
        finished = None  # most steps finish no request
        if finished_at:
            finished = np.zeros(n, dtype=bool)
            finished[finished_at] = True
        rounds = 1 if steps == 1 else np.where(prompt, 1, steps)
        if all_ours:  # the common case: no request of SGLang's own in the batch
            policy.complete_slots(slots, prompt, finished, refined, rounds)
        else:
            rows = ours.nonzero()[0]
            policy.complete_slots(slots[rows], prompt[rows], None if finished is None else finished[rows],
                                  None if refined is None else refined[rows], rounds if steps == 1 else rounds[rows])
            finished_at = [i for i in finished_at if slot_list[i] >= 0]
        keep_rows(self, finished_at)
        if recorder is not None:
            at = dict(zip(first, range(len(first)))) if host is not None else {}
            done = row_forwards()
            for i in (range(n) if all_ours else ours.nonzero()[0].tolist()):
                r, j = batch[i], at.get(i)
                own = int(done[i]) if done is not None else 0
                if j is None:
                    recorder.forward(r, bool(prompt[i]), None, own or (1 if prompt[i] else steps))
                else:
                    recorder.forward(r, False, host["pooled"][j], own or steps, host["signals"][j],
                                     host["prompt"][j] if host["has_prompt"][j] else None)
        for i in finished_at:
            r = batch[i]
            state.forget(r.rid, policy_too=False)  # the policy freed it in complete_slots
            state.stats.finished += 1
            if recorder is not None:
                recorder.finished(r)

    def keep_rows(self, finished_at: list) -> None:
        """Copy the step's rows that later steps read into device rows (``kept_rows``), in one
        host-to-device copy of their indices, one gather and one copy (two of each after a step of
        several forwards): each prompt block's row, the refinement's
        ``prompt_last`` once its first round comes (``own_last``); and for later requests whose prefix
        SGLang serves from its cache (:class:`_PromptRows`), every block reported done this step that a
        later prompt can end on: a prompt block (a shared system prompt, a repeated prompt) or a
        finished request's last full block (the next turn of a chat). ``finished_at``: the batch rows
        of ours that finished. Python over those rows (a few dozen a step), no array call but the copy's."""
        pooled, last = state.first_pooled, state.last_pooled
        if pooled is None:
            return
        batch, prompt_at, slot_list, bs = state.batch, state.batch_prompt_at, state.batch_slot_list, state.block_size
        hold_own = state.hold_own
        own, own_into = prompt_at, [hold_own(slot_list[i]) for i in prompt_at]
        kept, into = [], []
        if last is not None and state.step_done and state.prompt_rows.capacity \
                and not self.dllm_config.requires_separate_context_encoding:
            done = state.step_done[0][1] if len(state.step_done) == 1 else row_forwards()  # truthy: block done
            reserve = state.prompt_rows.reserve_tokens
            prompt_list = state.batch_prompt.tolist() if finished_at else ()
            for i in sorted(set(prompt_at).union(finished_at)) if finished_at else prompt_at:
                if not done[i]:
                    continue
                r = batch[i]
                end = r.extend_end  # SGLang's prefix ends on a block boundary and the forward ran the block after it
                if not finished_at or prompt_list[i] or len(r.origin_input_ids) + len(r.output_ids) >= end:
                    kept.append(i)
                    into.append(reserve(r, end // bs, bs))  # keyed when a lookup comes
        if not own and not kept:
            return
        if last is pooled or not kept:  # one forward this step (FDFO): one gather, one copy into kept_rows
            base = len(state.own_last)
            index = state.to_device_kept(np.array(own + kept + own_into + [base + j for j in into], dtype=np.int64))
            a = len(own) + len(kept)
            state.kept_rows.index_copy_(0, index[a:], pooled.index_select(0, index[:a]))
            return
        index = state.to_device_kept(np.array(own + own_into + kept + into, dtype=np.int64))
        a, b = len(own), 2 * len(own)
        if a:
            state.own_last.index_copy_(0, index[a:b], pooled.index_select(0, index[:a]))
        if kept:
            state.prompt_rows.rows.index_copy_(0, index[b + len(kept):], last.index_select(0, index[b:b + len(kept)]))

    def to_host(first) -> dict:
        """The step's one device-to-host copy: the refined estimates of the first denoising rounds (the
        bundle's graph run once over all of them), their early signals and, when recording, their
        pooled rows and ``prompt_last`` rows; on the first refinement, whether the forward wrote the
        pooling buffer. ``first``: their batch rows, in the order the forward's rows were staged."""
        import torch

        pooled = state.first_pooled.index_select(0, state.rows_dev)
        n, width = len(first), pooled.shape[1]
        last, has_prompt = prompt_last_rows(first)
        signals = state.first_signals if state.first_signals is not None \
            else torch.full((n, len(EARLY_SIGNALS)), math.nan, device=pooled.device)
        pieces = []
        refine_here = state.bundle is not None and (state.share is None or state.share.is_source)
        if refine_here:
            pieces.append(state.bundle.refine(pooled.float(), last.float(), state.tokens_dev, state.budget_dev, signals))
        pieces.append(signals)
        if state.recorder is not None:
            pieces += [pooled, last]  # a row without prompt rows (has_prompt False) is not read
        if not state.checked:
            pieces.append(torch.isfinite(pooled).all().reshape(1))
        host = torch.cat([piece.float().reshape(-1) for piece in pieces]).cpu().numpy()  # the transfer
        state.stats.host_transfers += 1
        out = {"refined": None, "has_prompt": has_prompt, "slots": state.batch_slots[first]}
        at = 0
        if refine_here:
            out["refined"], at = host[:n], n
        out["signals"], at = host[at:at + 4 * n].reshape(n, 4), at + 4 * n
        if state.recorder is not None:
            out["pooled"] = host[at:at + n * width].reshape(n, width)
            out["prompt"] = host[at + n * width:at + 2 * n * width].reshape(n, width)
            at += 2 * n * width
        if not state.checked:
            if host[at] != 1.0:
                raise ConfigError(UNWRITTEN)
            state.checked = True
        if state.bundle is not None:
            if state.share is not None:
                out["refined"] = state.share(out["refined"], n)
            state.stats.refined += n
        return out

    def prompt_last_rows(first):
        """The refinement's ``prompt_last`` rows of the first-round requests, ``(n, H)`` on the device,
        and whether each has one: its own last prompt block's (``own_last``, gathered in one op);
        without one, an earlier forward's row for the same last full block, else the mean of its
        leftover prompt rows in this forward, else none (a block-aligned prompt cached whole: SGLang
        ran none of its rows here), where the refinement takes the training mean."""
        own = state.row_own >= 0
        rows = state.own_last.index_select(0, state.own_dev)
        if own.all():
            return rows, own
        has, from_cache, leftover = own.copy(), 0, 0
        for j in np.flatnonzero(~own).tolist():
            i = first[j]
            r = state.batch[i]
            blocks, rest = divmod(len(r.origin_input_ids), state.block_size)
            row = state.prompt_rows.get(block_key(r, blocks, state.block_size)) if blocks else None
            from_cache += row is not None
            if row is None and rest:
                row, leftover = state.first_leftover[i], leftover + 1
            if row is None:
                row = state.prompt_mean if state.prompt_mean is not None else rows.new_zeros(rows.shape[1])
            else:
                has[j] = True
            rows[j] = row
        if state.bundle is not None:
            state.stats.prompt_from_cache += from_cache
            state.stats.prompt_from_leftover += leftover
            state.stats.prompt_from_training_mean += int((~has).sum())
        return rows, has

    original_run = algorithm.run

    def counted_forward(*args, **kwargs):
        """``model_runner.forward`` while the hook's ``run`` runs: counts the step's forwards and, after
        its first, takes the pooling buffer's rows and computes the early signals of its first rounds."""
        algo, model_runner, forward_batch, forward, _ = state.running
        if state.forwards == 1 and state.first_pooled is not None:
            # a second forward in the step (synchronous decoding) overwrites the buffer: copy the first's
            # rows out first (device copies, no sync); an FDFO step runs one forward and copies nothing
            state.first_pooled = state.first_pooled.clone()
            if state.first_leftover is not None:
                state.first_leftover = state.first_leftover.clone()
        out = forward(*args, **kwargs)
        if state.forwards == 0 and state.pooled is not None:
            size = forward_batch.batch_size  # views of the buffer, valid until the step's next forward
            state.first_pooled = state.pooled[:size]
            state.first_leftover = state.leftover_pooled[:size] if state.rows else None
            # the first forward's early signals, before the step fills masks: the refinement
            # graph's last input (and recorded). From the forward's output, after any graph replay;
            # an algorithm without a threshold of its own (Gemma4Renoise) counts over the one the
            # DiffusionGemma collector uses (engine.signals.SIGNAL_THRESHOLD or the config's)
            logits_out = out.logits_output.full_logits
            if state.rows and logits_out is not None:
                if state.stop_ids is None:
                    state.stop_ids = stop_token_ids(model_runner, state.tokenizer_stop_ids, logits_out.device)
                state.first_signals = row_signals(
                    logits_out, forward_batch.input_ids, state.rows_dev, algo.mask_id, algo.block_size,
                    float(getattr(algo, "threshold", state.signal_threshold)), state.stop_ids)
        state.forwards += 1
        return out

    def counted_step(batch, full_logits, states):
        """The algorithm's ``step`` while the hook's ``run`` runs: a row's own forwards are those until
        its block first reported done."""
        done = state.running[4](batch, full_logits, states)
        state.step_done.append((state.forwards, done))  # read once, after the step (row_forwards)
        return done

    def row_forwards():
        """int64 per batch row: the forwards until its block first reported done this step (0: not
        done), from the step's done lists in one array conversion; None without a step call."""
        if state.row_forwards is None and len(state.step_done) == 1:  # FDFO: one step call
            forwards, done = state.step_done[0]
            marks = np.fromiter(done, dtype=np.int64, count=len(done))
            state.row_forwards = marks if forwards == 1 else marks * forwards
        elif state.row_forwards is None and state.step_done:
            marks = np.array([done for _, done in state.step_done], dtype=bool)  # (steps, rows)
            counts = np.array([forwards for forwards, _ in state.step_done], dtype=np.int64)
            state.row_forwards = np.where(marks.any(0), counts[marks.argmax(0)], 0)
        return state.row_forwards

    # held by the state, read at each run: benchmarks/hook_overhead.py times them as the hook's
    state.counted_forward, state.counted_step = counted_forward, counted_step

    def run(self, model_runner, forward_batch, algo_states=None):
        state.first_pooled, state.first_signals, state.first_leftover, state.forwards = None, None, None, 0
        state.last_pooled = state.row_forwards = None
        state.step_done = []
        size = forward_batch.batch_size
        state.stats.idle += size == 0  # DP attention's IDLE batch: no rows, and no logits when eager
        if state.pooled is not None:
            if not state.checked:  # what a replay that skipped the copy would leave: caught by the first refinement
                state.pooled.fill_(math.nan)
            stage_rows(forward_batch)
        state.running = (self, model_runner, forward_batch, model_runner.forward, self.step)
        own = vars(model_runner).get("forward")
        own_step = vars(self).get("step")
        model_runner.forward = state.counted_forward
        self.step = state.counted_step
        try:
            out = original_run(self, model_runner, forward_batch, algo_states)
            if state.pooled is not None and state.prompt_rows.capacity:  # no rows kept: none needed
                # a block SGLang emits ran its last forward over its final tokens: that forward writes
                # the block's KV cache (LowConfidence reports done on a forward with no masks left;
                # JointThresholdInDel keeps a block whose ids its step changed for one more forward)
                state.last_pooled = state.first_pooled if state.forwards == 1 else state.pooled[:size]  # read this step
            return out
        finally:
            state.running = None
            if own is None:
                del model_runner.forward  # back to the class method
            else:
                model_runner.forward = own
            if own_step is None:
                del self.step
            else:
                self.step = own_step

    def stage_rows(forward_batch) -> None:
        """The batch rows of the step's first denoising forwards (``ForwardBatch.rids`` names each
        row's request) and their inputs, onto the device in one copy before the forward: row index,
        prompt tokens, budget, the leftover prompt positions to pool (``1/n`` weights on the ``n``
        leftover positions of a request without a prompt block of its own, written into the static
        buffer the captured graphs read; zeros elsewhere) and its row of ``own_last``."""
        first = state.first
        if state.weights_set:
            state.leftover_weights.zero_()
            state.weights_set = False
        state.rows, state.row_rids, state.rows_dev = [], [], None
        if not first:
            return
        rids = (getattr(forward_batch, "rids", None) or ())[: forward_batch.batch_size]
        state.rows = [i for i, rid in enumerate(rids) if rid in first]
        state.row_rids = [rids[i] for i in state.rows]
        if not state.rows:
            return
        n = len(state.rows)
        inputs = np.asarray([first[rid] for rid in state.row_rids], dtype=np.float32)  # (n, 4)
        staged = state.to_device(np.concatenate([np.asarray(state.rows, dtype=np.float32), inputs.T.reshape(-1)]))
        state.rows_dev = staged[:n].long()
        state.tokens_dev, state.budget_dev, leftover = staged[n:2 * n], staged[2 * n:3 * n], staged[3 * n:4 * n]
        state.row_own, state.own_dev = inputs[:, 3], staged[4 * n:].long().clamp_min(0)
        if inputs[:, 2].any():
            import torch

            positions = torch.arange(state.block_size, device=leftover.device)
            weights = (positions[None, :] < leftover[:, None]).float() / leftover.clamp_min(1.0)[:, None]
            state.leftover_weights.index_copy_(0, state.rows_dev, weights.to(state.leftover_weights.dtype))
            state.weights_set = True

    original_logits = logits._get_dllm_logits

    def get_dllm_logits(self, hidden_states, lm_head, logits_metadata):
        buffer = state.pooled
        if buffer is not None:
            rows = hidden_states.shape[0] // state.block_size
            if rows > buffer.shape[0]:
                raise ConfigError(f"a forward of {rows} requests exceeds the pooling buffer's {buffer.shape[0]} rows: "
                                  "install the hook with max_batch at least SGLang's largest CUDA-graph batch")
            # mean of each request's block rows, and the weighted sum of its leftover prompt rows, in one
            # batched product written in place: the addresses a CUDA graph captured
            blocks = hidden_states.view(rows, state.block_size, hidden_states.shape[-1])  # (rows, block, H)
            state.pooled2[:rows].copy_(state.weights[:rows].to(blocks.dtype).bmm(blocks))  # (rows, 2, H)
        return original_logits(self, hidden_states, lm_head, logits_metadata)

    patch(mixin, "_fetch_waiting_reqs", fetch_waiting_reqs)
    patch(mixin, "_process_dllm_batches", process_dllm_batches)
    patch(mixin, "process_batch_result_dllm", process_batch_result_dllm)
    patch(algorithm, "run", run)
    patch(logits, "_get_dllm_logits", get_dllm_logits)
    return Installed(state, originals)
