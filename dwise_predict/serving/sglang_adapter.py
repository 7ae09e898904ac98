"""Install the DWISE policy in SGLang's dLLM scheduler at run time (no edits to SGLang's source).

Pinned release: ``sglang==0.5.23``. Everything this module touches in SGLang is listed in
:data:`SURFACE` (module, ``Class.member``, what we do with it, expected parameters);
``tests/test_sglang_surface.py`` checks that table against the real source when it is available and
against the committed snapshot ``tests/fakes/sglang_surface.json`` always.

What the patch does, at the four points of seed 000 §5.1:

- **admission** — ``SchedulerDllmMixin._fetch_waiting_reqs`` is replaced: the policy is first
  reconciled with SGLang's own queues (requests SGLang finished or aborted leave it; retracted or
  paused ones, back in the waiting queue, are registered again), new requests are registered with a
  :class:`~dwise_predict.serving.policy.DwisePolicy` (``P`` = prompt blocks, ``r̂`` = the bundle's
  admission estimate, KV reservation = prompt + output budget + slack blocks; a request whose
  reservation exceeds the whole budget is aborted through SGLang's ``abort_request`` with a
  message), the policy ranks waiting ∪ resident, and the admitted requests move into the dLLM
  manager's queue (SGLang's resident set);
- **batch formation** — ``SchedulerDllmMixin._process_dllm_batches`` is replaced: the ``B`` resident
  requests the policy picked go to SGLang's own ``_process_batch_by_phase``, prompt and denoising
  blocks in one ``DLLM_EXTEND`` batch (no prefill-first barrier). SGLang's adder still applies its
  budgets (picks it leaves out are counted in :class:`HookStats`); after staging, ``P`` follows the
  prefix SGLang matched (``engine.prefill_rounds``). Models that encode the prompt in a separate
  pass (``requires_separate_context_encoding``) cannot mix phases: there the resident queue is only
  reordered and SGLang's own batch former runs;
- **result processing** — ``SchedulerDllmMixin.process_batch_result_dllm`` is wrapped: after SGLang
  commits outputs, the policy's fields are updated for every request of the batch, with the refined
  estimate for requests whose first denoising round this was (and the recorder, in recording mode,
  gets the request's forwards and pooled rows);
- **refinement input** — ``LogitsProcessor._get_dllm_logits`` is wrapped to mean-pool each
  request's block rows into a static buffer allocated at install (block size and largest batch
  known then), so the copy is captured in SGLang's CUDA graphs and every replay writes it;
  ``DllmAlgorithm.run`` is wrapped to fill that buffer with NaN before a step and snapshot it after
  the step's first forward. The first refinement checks the snapshot: an unwritten buffer (a graph
  captured before install) is a one-line :class:`ConfigError`, never silent zeros. The same first
  forward's early signals (``engine.signals``, the refinement graph's last input) are computed
  from its ``full_logits`` after the forward returns, outside any captured graph. The refinement's
  ``prompt_last`` input is the same buffer's row for the request's last prompt block, kept on the
  device. A request that runs no prompt block of its own after a prefix-cache hit on every full
  block gets the row of the earlier request's forward that computed that same last block over the
  same tokens, as a prompt block or as the last forward of an output block (:class:`_PromptRows`,
  bounded); a prompt shorter than a block, or a hit whose block no longer is there, gets the mean of
  its leftover prompt rows in its first denoising forward, as the decoder records for short prompts.
  A dLLM request's fill ids end in a mask block, so SGLang's match (``Req._compute_max_prefix_len``,
  floored to a block) can cover a block-aligned prompt whole: with no leftover rows and no kept
  row, the refinement gets the training mean instead (``HookStats.prompt_from_training_mean``) and
  the recorder leaves the request out of the traces (``LiveRecorder.left_out``). Leftover
  rows are pooled, like the block rows, into a second static buffer through per-row weights written
  before each step.

Refinement runs on the pooled rows in ``process_batch_result_dllm``, after SGLang's own end-of-round
synchronisation, as one batched call of the bundle's torch graph on the rows' device.

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
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.engine import prefill_rounds, tokenizer_stop_ids
from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.identity import EARLY_SIGNALS
from dwise_predict.serving.bundle import check_compatible
from dwise_predict.serving.policy import DwisePolicy

SGLANG_VERSION = "0.5.23"


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
    Touch("sglang.srt.dllm.mixin.req", "ReqDllmMixin.is_dllm_prefill", "call", ("self",)),
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
    Touch("sglang.srt.managers.schedule_batch", "ScheduleBatch.reqs", "attribute"),
    Touch("sglang.srt.managers.schedule_policy", "PrefillAdder.can_run_list", "attribute"),
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
    retracted : requests SGLang sent back to its waiting queue (retraction, ``pause_generation``);
        they are re-registered with the work they have left.
    oversized : requests aborted because their KV reservation exceeds the whole budget.
    prefix_blocks : prompt blocks a prefix-cache hit removed from ``P``.
    budget_overrides : policy picks that SGLang's batch budget (its ``PrefillAdder``: tokens,
        requests) left out of a step; DWISE's order yields to those budgets.
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
    refined: int = 0
    prompt_from_cache: int = 0
    prompt_from_leftover: int = 0
    prompt_from_training_mean: int = 0


class _PromptRows:
    """Pooled rows of the blocks recent requests completed — each prompt block's forward, and each
    full output block's last forward (the one over its final tokens, which SGLang caches) — keyed by
    every token up to the block's end: the ``prompt_last`` of a later request whose every full prompt
    block a prefix-cache hit served (a repeated prompt, or the next turn of a chat).

    A block's rows depend on its own tokens and those before it only (block-causal attention), so the
    row an earlier request computed for a block ending where the later request's last full block ends,
    over the same tokens, is the row that request's own forward would have computed — what ``collect``
    (no prefix cache) records. That needs SGLang to run a prompt block and an output block's forward
    alike: it gives both the forward mode DLLM_EXTEND, and nothing on its forward path reads a
    request's phase (checked against the wheel in ``test_serving_sglang_adapter.py``); algorithms that
    encode the context separately prefill as EXTEND, and for those no rows are keyed. Least recently
    used rows leave first once ``capacity`` are held (``capacity`` rows of H floats on the model's
    device; 0 keeps none).
    """

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.rows: OrderedDict = OrderedDict()

    def put(self, key: bytes, row) -> None:
        if not self.capacity:
            return
        self.rows[key] = row
        self.rows.move_to_end(key)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)

    def get(self, key: bytes):
        row = self.rows.get(key)
        if row is not None:
            self.rows.move_to_end(key)
        return row


def block_key(req, blocks: int, block_size: int) -> bytes:
    """Digest of ``req``'s first ``blocks`` full blocks of tokens (prompt, then any output a
    retraction put back into its prompt), chained block by block and kept on the request, so a
    request's keys cost one pass over its tokens however many blocks ask."""
    keys = vars(req).setdefault("_dwise_block_keys", [])
    if len(keys) < blocks:
        import numpy as np

        start, stop, n = len(keys) * block_size, blocks * block_size, len(req.origin_input_ids)
        # only the blocks not hashed yet: the prompt's, then any outputs a retraction put back
        tokens = list(req.origin_input_ids[start:stop]) + list(req.output_ids[max(0, start - n):max(0, stop - n)])
        ids = np.asarray(tokens, dtype=np.int64)
        for k in range(blocks - len(keys)):
            previous = keys[-1] if keys else b""
            keys.append(hashlib.blake2b(previous + ids[k * block_size:(k + 1) * block_size].tobytes(),
                                        digest_size=16).digest())
    return keys[blocks - 1]


class _State:
    """What the patched functions share: the policy, the bundle and the refinement buffers."""

    def __init__(self, bundle, slots, k, kv_budget_tokens, kv_fraction, slack_blocks, features, device,
                 block_size, max_batch, recorder, prompt_cache):
        self.bundle = bundle
        self.slots, self.k = slots, k
        self.kv_budget_tokens, self.kv_fraction, self.slack_blocks = kv_budget_tokens, kv_fraction, slack_blocks
        self.features = features
        self.device = device
        self.recorder = recorder
        self.policy: DwisePolicy | None = None
        self.block_size = int(block_size or 0)
        self.max_batch = int(max_batch or 0)
        self.stats = HookStats()
        self.reqs: dict = {}  # rid -> Req, for requests the policy holds
        self.run_rids: list = []  # this round's picks, best rank first
        self.batch_prompt: dict = {}  # rid -> the request ran a prompt block in the batch being run
        self.first_rids: set | None = None  # requests whose first denoising forward the batch runs
        self.pooled = None  # (max_batch, H) static buffer, allocated at install, written inside the forward
        self.first_pooled = None  # (B, H) snapshot after a step's first forward
        self.signal_threshold = None  # for an algorithm without one of its own: set by check_decoding
        self.prompt_last: dict = {}  # rid -> (H,) pooled rows of its latest prompt-block forward (device)
        self.prompt_rows = _PromptRows(prompt_cache)  # the same for recent blocks of any request, by tokens
        self.block_end: dict = {}  # rid -> where the block it runs in the batch being run ends
        self.leftover_weights = None  # (max_batch, block) static: 1/n on a row's n leftover prompt positions
        self.leftover_pooled = None  # (max_batch, H) static: those rows' weighted sum, written inside the forward
        self.first_leftover = None  # (B, H) its snapshot after a step's first forward
        self.last_pooled = None  # (B, H) the pooled buffer after a step's last forward
        self.first_signals = None  # (B, 4) early signals of that forward, NaN outside first_rids' rows
        self.stop_ids = None  # (S,) the model's end-of-sequence ids on the logits' device (first forward)
        self.tokenizer_stop_ids: set[int] = set()  # the scheduler tokenizer's stop ids (bind)
        self.forwards = 0  # forwards in the current step
        self.row_forwards = None  # per batch row: forwards until its block reported done (this step)
        self.checked = False  # the first refinement checked that the buffer was written

    def first_round(self, req, prompt: bool) -> bool:
        """Does ``req`` run its first denoising forward in this step (the refinement's moment)?"""
        return (not prompt and not getattr(req, "_dwise_rounds", 0)
                and self.policy.fields(req.rid)["denoising_rounds"] == 0)

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
        budget = self.kv_budget_tokens
        if budget is None:
            budget = self.kv_fraction * float(scheduler.max_total_num_tokens)
        self.policy = DwisePolicy(self.slots, self.k, kv_budget=budget)

    def reconcile(self, scheduler) -> None:
        """Drop what SGLang no longer holds; re-register what it sent back to its waiting queue.

        SGLang's ``abort_request`` pops requests from its queues and ``filter_finished_reqs`` drops
        finished ones without telling a custom policy; retraction and ``pause_generation(retract)``
        put resident requests back in ``scheduler.waiting_queue`` with their KV released.
        """
        manager = scheduler.dllm_manager
        queued = {id(r) for r in scheduler.waiting_queue}
        held = {id(r) for r in manager.waiting_queue} | {id(r) for r in manager.staging_queue}
        for rid, req in list(self.reqs.items()):
            if req.finished() or (id(req) not in queued and id(req) not in held):
                self.policy.remove(rid)
                del self.reqs[rid]
                self.prompt_last.pop(rid, None)
                if req.finished():
                    self.stats.finished += 1
                else:
                    self.stats.vanished += 1
            elif id(req) in queued and self.policy.fields(rid)["state"] != "waiting":
                self.policy.remove(rid)  # registered again below, with the work it has left
                del self.reqs[rid]
                self.prompt_last.pop(rid, None)
                self.stats.retracted += 1

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
        """Add newly arrived (or retracted) requests to the policy, admission estimates in one batch.

        A request whose worst-case KV reservation exceeds the whole budget could never be admitted:
        it is aborted through SGLang's own ``abort_request`` with a message saying so, and the rest
        of the batch is registered.
        """
        bs = self.block_size
        # what is still to encode: the prompt, plus the output of a retracted request (re-encoded)
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
        if self.bundle is not None:
            import numpy as np

            estimates = self.bundle.admission(np.asarray([self.features(r) for r in reqs], dtype=np.float32)).tolist()
            # a retracted request keeps its denoising progress: its admission estimate is what is left
            estimates = [max(float(e) - getattr(r, "_dwise_rounds", 0), 0.0) for e, r in zip(estimates, reqs)]
        else:
            estimates = [0.0] * len(reqs)
        self.policy.add_many([r.rid for r in reqs], P, [max(float(e), 0.0) for e in estimates], kv)
        for r in reqs:
            self.reqs[r.rid] = r
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


def first_round_signals(full_logits, forward_batch, mask_id: int, block_size: int, threshold: float,
                        stop_ids, first_rids: set | None):
    """(B, 4) early signals of a step's first forward (``engine.signals``), computed only for the rows
    of the requests in ``first_rids`` and NaN elsewhere: the softmax over the vocabulary costs
    B * block * V per step, and only a request's first denoising forward needs it. SGLang's
    ``ForwardBatch.rids`` names each row's request (host-side, also under CUDA-graph replay); without
    it, or without ``first_rids``, every row is computed."""
    import torch

    from dwise_predict.engine.signals import early_signals

    ids = forward_batch.input_ids
    rids = getattr(forward_batch, "rids", None)
    if first_rids is None or rids is None:
        return early_signals(full_logits, ids, mask_id, block_size, threshold, stop_ids)
    batch = ids.numel() // block_size
    out = torch.full((batch, len(EARLY_SIGNALS)), math.nan, device=full_logits.device)
    rows = [i for i, rid in enumerate(rids[:batch]) if rid in first_rids]
    if rows:
        index = torch.tensor(rows, device=full_logits.device)
        logits = full_logits.view(batch, block_size, -1).index_select(0, index).reshape(len(rows) * block_size, -1)
        picked = ids.view(batch, block_size).index_select(0, index.to(ids.device)).reshape(-1)
        out[index] = early_signals(logits, picked, mask_id, block_size, threshold, stop_ids)
    return out


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
        step), ``arrived(req, block_size)``, ``forward(req, prompt, pooled_row)`` and ``finished(req)``
        (:class:`dwise_predict.collectors.live.LiveRecorder`): recording mode.
    prompt_cache : block rows kept for requests that a prefix-cache hit leaves without a prompt
        block of their own (:class:`_PromptRows`; ``prompt_cache`` x H floats on ``device``; 0: none,
        those requests get their leftover prompt rows' mean).
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
                   block_size, max_batch, recorder, prompt_cache)
    if pooling:
        import torch

        width = bundle.hidden_size if bundle is not None else hidden_size
        if not width:
            raise ConfigError("recording without a bundle needs hidden_size= (the model's hidden size)")
        rows = max(int(max_batch or 0), int(slots))
        state.pooled = torch.full((rows, int(width)), math.nan, device=device)
        state.leftover_weights = torch.zeros((rows, int(block_size)), device=device)
        state.leftover_pooled = torch.zeros((rows, int(width)), device=device)

    sched_mod = resolve(_SCHED)
    req_mod = resolve("sglang.srt.dllm.mixin.req")
    fb_mod = resolve("sglang.srt.model_executor.forward_batch_info")
    _resolve_abort_req = resolve(_IO).AbortReq
    mixin = sched_mod.SchedulerDllmMixin
    algorithm = resolve("sglang.srt.dllm.algorithm.base").DllmAlgorithm
    logits = resolve("sglang.srt.layers.logits_processor").LogitsProcessor
    phase = req_mod.DllmReqPhase
    originals = []

    def patch(owner, name, fn):
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def fetch_waiting_reqs(self):
        if state.policy is None:
            state.bind(self)
        state.reconcile(self)
        # finished while waiting (SGLang's set_finish_with_abort): SGLang's own path, not the policy's
        done = [r for r in self.waiting_queue if r.finished() and r.rid not in state.reqs]
        if done:
            self.waiting_queue = [r for r in self.waiting_queue if not (r.finished() and r.rid not in state.reqs)]
            self.dllm_manager.add_waiting_reqs(done)
        new = [r for r in self.waiting_queue if r.rid not in state.reqs]
        if new:
            state.register(self, new)
        plan = state.policy.schedule()
        state.stats.rounds += 1
        if len(plan.admitted):
            admitted = set(state.policy.ids(plan.admitted))
            moving = [r for r in self.waiting_queue if r.rid in admitted]
            self.waiting_queue = [r for r in self.waiting_queue if r.rid not in admitted]
            self.dllm_manager.add_waiting_reqs(moving)
            state.stats.admitted += len(moving)
        state.run_rids = state.policy.ids(plan.run)

    original_batches = mixin._process_dllm_batches

    def process_dllm_batches(self, adder, running_batch):
        resident = {r.rid: r for r in self.dllm_manager.waiting_queue}
        if self.dllm_config.requires_separate_context_encoding:
            # phases cannot share a forward here: keep SGLang's batch former, in DWISE order
            rank = {rid: i for i, rid in enumerate(state.run_rids)}
            self.dllm_manager.waiting_queue.sort(key=lambda r: rank.get(r.rid, len(rank)))
            mode = original_batches(self, adder, running_batch)
        else:
            # requests SGLang placed there without the policy (finished while waiting) run first, as they would
            run = [r for rid, r in resident.items() if rid not in state.reqs]
            run += [resident[rid] for rid in state.run_rids if rid in resident]
            prefill = [r for r in run if r.is_dllm_prefill()]
            decode = [r for r in run if not r.is_dllm_prefill()]
            self._process_batch_by_phase(adder, prefill, phase.STAGING_PREFILL, phase.INCOMING_PREFILL, running_batch)
            self._process_batch_by_phase(adder, decode, phase.STAGING_DECODE, phase.INCOMING_DECODE, running_batch)
            mode = fb_mod.ForwardMode.DLLM_EXTEND
        staged = adder.can_run_list
        taken = {r.rid for r in staged}
        state.stats.budget_overrides += sum(rid not in taken for rid in state.run_rids if rid in resident)
        # the phase each request runs in is known only now: SGLang matched its prefix while staging it
        state.batch_prompt, state.block_end = {}, {}
        for r in staged:
            if r.rid not in state.reqs:
                continue
            prompt = r.is_dllm_prefill()
            state.batch_prompt[r.rid] = prompt
            fields = state.policy.fields(r.rid)
            if not self.dllm_config.requires_separate_context_encoding:
                # SGLang's prefix ends on a block boundary (it asserts so) and the forward runs the
                # block after it, a prompt block or an output block (`ReqDllmMixin.determine_dllm_phase`)
                state.block_end[r.rid] = r.prefix_len + state.block_size
            if prompt:
                left = prefill_rounds(len(r.origin_input_ids) + len(r.output_ids), state.block_size, r.prefix_len)
            else:
                left = 0
            if left < fields["P"]:
                if fields["denoising_rounds"] == 0 and not getattr(r, "_dwise_prompt_seen", False):
                    state.stats.prefix_blocks += fields["P"] - left
                state.policy.set_prompt_blocks(r.rid, left)
            r._dwise_prompt_seen = True
        # the rows whose early signals the step needs (refinement, recording): a softmax over the
        # vocabulary for every row of every step would cost more than the refinement itself
        state.first_rids = {r.rid for r in staged if r.rid in state.batch_prompt
                            and state.first_round(r, state.batch_prompt[r.rid])}
        return mode

    original_result = mixin.process_batch_result_dllm

    def process_batch_result_dllm(self, batch, result):
        original_result(self, batch, result)
        if state.policy is None:
            return
        reqs = [r for r in batch.reqs if r.rid in state.reqs]
        prompt = [state.batch_prompt.get(r.rid, r.is_dllm_prefill()) for r in reqs]
        # first denoising forwards; only rows the batch former named have early signals (first_rids)
        first = [i for i, r in enumerate(reqs) if state.first_round(r, prompt[i])
                 and (state.first_rids is None or r.rid in state.first_rids)]
        rows = {r.rid: batch.reqs.index(r) for r in reqs}
        if state.first_pooled is not None and first:
            import torch

            if not state.checked:
                snap = state.first_pooled[[batch.reqs.index(reqs[i]) for i in first]]
                if not bool(torch.isfinite(snap).all()):  # one sync, on the first refinement only
                    raise ConfigError(UNWRITTEN)
                state.checked = True
        # prompt_last of first-round requests that ran no prompt block of their own: an earlier
        # forward's row for the same last full block, else the mean of their leftover prompt rows,
        # else None (a block-aligned prompt cached whole: SGLang ran none of its rows here)
        without_block, from_cache = {}, 0
        if first and state.first_pooled is not None:
            for i in first:
                r = reqs[i]
                if r.rid in state.prompt_last:
                    continue
                blocks, leftover = divmod(len(r.origin_input_ids), state.block_size)
                row = state.prompt_rows.get(block_key(r, blocks, state.block_size)) if blocks else None
                from_cache += row is not None
                if row is None and leftover:
                    row = state.first_leftover[rows[r.rid]]
                without_block[r.rid] = row
        refined = {}
        if first and state.bundle is not None and state.first_pooled is not None:
            import torch

            index = torch.tensor([rows[reqs[i].rid] for i in first], device=state.first_pooled.device)
            pooled = state.first_pooled[index]
            missing = sum(row is None for row in without_block.values())
            average = torch.as_tensor(state.bundle.prompt_last_mean, device=pooled.device) if missing else None
            last = torch.stack([state.prompt_last.pop(r.rid) if r.rid not in without_block
                                else average if without_block[r.rid] is None else without_block[r.rid]
                                for r in (reqs[i] for i in first)])
            state.stats.prompt_from_cache += from_cache
            state.stats.prompt_from_leftover += len(without_block) - from_cache - missing
            state.stats.prompt_from_training_mean += missing
            tokens = torch.tensor([float(len(reqs[i].origin_input_ids)) for i in first], device=pooled.device)
            budget = torch.tensor([float(reqs[i].sampling_params.max_new_tokens) for i in first], device=pooled.device)
            signals = state.first_signals[index.to(state.first_signals.device)]
            values = state.bundle.refine(pooled.float(), last.float(), tokens, budget, signals).tolist()  # after SGLang's own sync
            refined = {reqs[i].rid: v for i, v in zip(first, values)}
            state.stats.refined += len(refined)
        steps = max(state.forwards, 1)
        for r, is_prompt in zip(reqs, prompt):
            rounds = 1 if is_prompt else steps
            if is_prompt and state.first_pooled is not None:  # the refinement's prompt_last, a device row
                state.prompt_last[r.rid] = state.first_pooled[rows[r.rid]]
            end = state.block_end.get(r.rid)
            if end is not None and state.last_pooled is not None \
                    and len(r.origin_input_ids) + len(r.output_ids) >= end:
                # the block is committed and full: a later prompt can hold it (a next turn of a chat).
                # A copy: a view would keep the whole step's snapshot alive
                state.prompt_rows.put(block_key(r, end // state.block_size, state.block_size),
                                      state.last_pooled[rows[r.rid]].clone())
            if state.recorder is not None:
                row = state.first_pooled[rows[r.rid]] if state.first_pooled is not None else None
                signals = state.first_signals[rows[r.rid]].tolist() if state.first_signals is not None else None
                own = state.row_forwards[rows[r.rid]] if state.row_forwards else 0
                if r.rid in without_block:
                    leftover = without_block[r.rid]
                else:
                    leftover = state.first_leftover[rows[r.rid]] if state.first_leftover is not None else None
                state.recorder.forward(r, is_prompt, row, own or rounds, signals, leftover)
            if not is_prompt:
                r._dwise_rounds = getattr(r, "_dwise_rounds", 0) + rounds
            for j in range(rounds):
                last = j == rounds - 1
                state.policy.complete(r.rid, refined=refined.get(r.rid) if j == 0 else None,
                                      finished=last and r.finished(), prompt=is_prompt)
            if r.finished():
                del state.reqs[r.rid]
                state.prompt_last.pop(r.rid, None)
                state.stats.finished += 1
                if state.recorder is not None:
                    state.recorder.finished(r)
        # the next batch names its own rows, and pools its own: a pass that does not go through the
        # wrapped DllmAlgorithm.run (Gemma4Renoise's context encoding) finds none, not this batch's
        state.first_rids = state.first_pooled = state.first_signals = state.first_leftover = state.last_pooled = None

    original_run = algorithm.run

    def run(self, model_runner, forward_batch, algo_states=None):
        state.first_pooled, state.first_signals, state.first_leftover, state.forwards = None, None, None, 0
        state.last_pooled = None
        if state.pooled is not None:
            state.pooled.fill_(math.nan)  # what a replay that skipped the copy would leave: caught below
            set_leftover_weights(forward_batch)
        forward = model_runner.forward

        def counted_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            if state.forwards == 0 and state.pooled is not None:
                state.first_pooled = state.pooled[: forward_batch.batch_size].clone()  # device copy, no sync
                state.first_leftover = state.leftover_pooled[: forward_batch.batch_size].clone()
                # the first forward's early signals, before the step fills masks: the refinement
                # graph's last input (and recorded). From the forward's output, after any graph replay;
                # an algorithm without a threshold of its own (Gemma4Renoise) counts over the one the
                # DiffusionGemma collector uses (engine.signals.SIGNAL_THRESHOLD or the config's)
                logits_out = out.logits_output.full_logits
                if state.stop_ids is None:
                    state.stop_ids = stop_token_ids(model_runner, state.tokenizer_stop_ids, logits_out.device)
                state.first_signals = first_round_signals(
                    logits_out, forward_batch, self.mask_id, self.block_size,
                    float(getattr(self, "threshold", state.signal_threshold)), state.stop_ids, state.first_rids)
            state.forwards += 1
            return out

        step = self.step
        state.row_forwards = None

        def counted_step(batch, full_logits, states):
            done = step(batch, full_logits, states)
            if state.row_forwards is None:
                state.row_forwards = [0] * len(done)
            for i, d in enumerate(done):  # a row's own forwards: those until its block first reported done
                if d and not state.row_forwards[i]:
                    state.row_forwards[i] = state.forwards
            return done

        own = vars(model_runner).get("forward")
        own_step = vars(self).get("step")
        model_runner.forward = counted_forward
        self.step = counted_step
        try:
            out = original_run(self, model_runner, forward_batch, algo_states)
            if state.pooled is not None and state.prompt_rows.capacity:  # no rows kept: no snapshot
                # a block SGLang emits ran its last forward over its final tokens: that forward writes
                # the block's KV cache (LowConfidence reports done on a forward with no masks left;
                # JointThresholdInDel keeps a block whose ids its step changed for one more forward)
                state.last_pooled = (state.first_pooled if state.forwards == 1
                                     else state.pooled[: forward_batch.batch_size].clone())
            return out
        finally:
            if own is None:
                del model_runner.forward  # back to the class method
            else:
                model_runner.forward = own
            if own_step is None:
                del self.step
            else:
                self.step = own_step

    def set_leftover_weights(forward_batch) -> None:
        """Weights ``1/n`` on the ``n`` leftover prompt positions of each row whose request runs its first
        denoising forward without a prompt block of its own, zeros elsewhere, written into the static
        buffer before the step (captured graphs read it) by device fills: no host copy on the step's path."""
        weights = state.leftover_weights
        weights.zero_()
        rids = getattr(forward_batch, "rids", None) or ()
        for row, rid in enumerate(rids[: forward_batch.batch_size]):
            req = state.reqs.get(rid)
            if req is None or rid in state.prompt_last or state.batch_prompt.get(rid, True):
                continue
            n = len(req.origin_input_ids) % state.block_size
            if n and state.first_round(req, False):
                weights[row, :n] = 1.0 / n

    original_logits = logits._get_dllm_logits

    def get_dllm_logits(self, hidden_states, lm_head, logits_metadata):
        buffer = state.pooled
        if buffer is not None:
            rows = hidden_states.shape[0] // state.block_size
            if rows > buffer.shape[0]:
                raise ConfigError(f"a forward of {rows} requests exceeds the pooling buffer's {buffer.shape[0]} rows: "
                                  "install the hook with max_batch at least SGLang's largest CUDA-graph batch")
            # mean of each request's block rows, and the weighted sum of its leftover prompt rows, written
            # in place: the addresses a CUDA graph captured
            blocks = hidden_states.view(rows, state.block_size, hidden_states.shape[-1])
            buffer[:rows].copy_(blocks.mean(dim=1))
            weights = state.leftover_weights[:rows].to(blocks.dtype).unsqueeze(-1)  # (rows, block, 1)
            state.leftover_pooled[:rows].copy_((weights * blocks).sum(dim=1))
        return original_logits(self, hidden_states, lm_head, logits_metadata)

    patch(mixin, "_fetch_waiting_reqs", fetch_waiting_reqs)
    patch(mixin, "_process_dllm_batches", process_dllm_batches)
    patch(mixin, "process_batch_result_dllm", process_batch_result_dllm)
    patch(algorithm, "run", run)
    patch(logits, "_get_dllm_logits", get_dllm_logits)
    return Installed(state, originals)
