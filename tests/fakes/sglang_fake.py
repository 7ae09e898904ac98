"""A CPU fake of SGLang 0.5.23's dLLM serving path, built around SGLang's own pure-Python pieces.

Loaded from the wheel (``tests/sglang_reference.py``; ``scripts/fetch_sglang.py`` fetches it), and
used unmodified:

- ``srt/dllm/mixin/req.py`` — ``ReqDllmMixin`` (``init_diffusion_llm``, ``_init_fill_ids_for_dllm``,
  ``_update_block_offset_for_dllm``, ``determine_dllm_phase``: phases follow the prefix match, the
  leftover prompt tokens open the first output block) and ``DllmReqPhase``;
- ``srt/dllm/mixin/scheduler.py`` — ``SchedulerDllmMixin`` (``_fetch_waiting_reqs``,
  ``_process_dllm_batches``, ``_process_batch_by_phase``, ``process_dllm_incoming_reqs``,
  ``process_dllm_staging_reqs``, ``_update_state_for_batch``, ``finish_dllm_forward``) and
  ``DllmManager`` (queues, ``pop_aborted_reqs``, ``filter_finished_reqs``, ``init_next_round``);
- ``srt/dllm/algorithm/base.py`` — ``DllmAlgorithm.run`` / ``_run_sync`` / ``_run_fdfo``, the loop
  that makes a KV-keeping block filled in r steps cost r + 1 forwards;
- ``srt/dllm/config.py`` — ``DllmConfig``;
- ``srt/managers/schedule_batch.py`` — ``Req``'s finish rule (``update_finish_state`` and the checks
  it calls), the finish reasons (``FINISH_MATCHED_TOKEN``, ``FINISH_LENGTH`` …) and the bound of a
  prefix-cache lookup (``_compute_max_prefix_len``), compiled from that file's own text
  (``sglang_reference.load``: the module itself needs CUDA).

Written here, for what needs a GPU or a real model (each mirrors the SGLang code it names):

- ``Req``: token arrays, ``prefix_len``, ``init_next_round_input`` (``schedule_batch.Req``: fill
  ids, prefix match within SGLang's bound, phase);
- ``RadixCache``: block-aligned prefixes of committed tokens (``checkpoint_kv_cache`` inserts and
  sets ``prefix_len = extend_end``);
- ``PrefillAdder``: SGLang's batch budgets (requests per batch, tokens per batch); a request that
  does not fit is left out of the step;
- ``FakeDllmMixin``: SGLang's ``SchedulerDllmMixin`` subclassed, with ``process_batch_result_dllm``
  rewritten without KV pools, streaming and metrics (sync:
  commit the block's tokens; FDFO: keep an unresolved block in ``dllm_incomplete_ids``, commit a
  resolved one, leftover prompt positions are not output; a request finishes after its planned
  blocks, or, given an EOS id, by SGLang's own ``Req.update_finish_state``); ``resolve``
  hands it out as ``SchedulerDllmMixin``, so the adapter patches what SGLang's ``Scheduler`` inherits;
- ``Scheduler``: ``get_new_batch_dllm`` with the fake adder, ``abort_request`` (pops from both
  queues, as SGLang's does), ``retract`` (KV released, back to the waiting queue), and the step
  order of ``get_next_batch_to_run`` (``filter_finished_reqs``, then ``finish_dllm_forward``);
- ``FillAlgorithm``: SGLang's ``DllmAlgorithm`` with a ``step`` that, like ``LowConfidence.step``,
  reports *done* when the forward's input held no mask and otherwise fills masks so that block b
  of a request is filled in ``forwards[b] - 1`` steps (so it costs ``forwards[b]`` forwards);
- ``ModelRunner``: every row of a request's block carries the request's hidden vector (its prompt
  vector in a prompt block, and on the leftover prompt positions of its first output block); with
  ``cuda_graph=True`` the logits path is recorded once at ``capture()`` (start-up) and every
  forward replays the recorded tensor operations without running any Python hook, as a CUDA graph
  replay does.

A fake request knows its forwards per output block (SGLang units, as traces record them), its
first-round hidden vector and its prompt hidden vector (the first-round one unless given).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

import sglang_reference

SGL = sglang_reference.load_scheduler()
DllmConfig = SGL.DllmConfig
DllmReqPhase = SGL.req.DllmReqPhase
ReqDllmMixin = SGL.req.ReqDllmMixin
RealSchedulerDllmMixin = SGL.SchedulerDllmMixin
SchedulerDllmMixin = RealSchedulerDllmMixin  # rebound to FakeDllmMixin below
DllmManager = SGL.DllmManager
DllmAlgorithm = SGL.base.DllmAlgorithm
ForwardMode = SGL.ForwardMode
AddReqResult = SGL.AddReqResult
MASK = 0  # mask id; prompt and output tokens are >= 1
FILL = 7  # the token the fake model "predicts"


def config(block_size, max_running_requests, fdfo=True, mask_id=MASK, algorithm="LowConfidence",
           algorithm_config=None):
    """SGLang's real ``DllmConfig`` (LowConfidence with its defaults unless told otherwise)."""
    return DllmConfig(algorithm=algorithm, algorithm_config=dict(algorithm_config or {}), block_size=block_size,
                      mask_id=mask_id, max_running_requests=max_running_requests, first_done_first_out_mode=fdfo)


# --- sglang.srt.managers.io_struct -------------------------------------------------------------------


class AbortReq:
    def __init__(self, rid="", abort_all=False, finished_reason=None, abort_message=None):
        self.rid, self.abort_all, self.finished_reason, self.abort_message = rid, abort_all, finished_reason, abort_message


# --- sglang.srt.managers.schedule_batch --------------------------------------------------------------


class Req(ReqDllmMixin, SGL.finish.ReqFinishMixin, SGL.ReqPrefixMixin):
    """SGLang's request fields the dLLM path reads, with SGLang's own ``ReqDllmMixin`` and, given an
    ``eos_token_id``, its own finish rule (``update_finish_state``, ``finished``)."""

    def __init__(self, rid, origin_input_ids, sampling_params, dllm_config, rounds_per_block, hidden, features,
                 eos_token_id=None, prompt_hidden=None):
        self.rid = rid
        self.origin_input_ids = array("q", [int(t) for t in origin_input_ids])
        self.output_ids = array("q")
        self.sampling_params = sampling_params
        self.finished_reason = None
        if eos_token_id is not None:  # a real model: SGLang's finish rule reads these
            sglang_reference.init_finish_state(self, sampling_params.max_new_tokens, {eos_token_id})
        self.prefix_len = 0
        self.extend_end = 0
        self.dllm_initialized = False
        self.full_untruncated_fill_ids = array("q")
        self.inflight_middle_chunks = 0
        self.return_logprob, self.logprob_start_len = False, -1  # read by SGLang's _compute_max_prefix_len
        self.kv = SimpleNamespace(holds_kv=False)
        self.init_diffusion_llm(dllm_config)  # SGLang's: the first phase from the prompt length
        # fake-only: forwards per output block (SGLang units) and the model's hidden vector
        self.forwards_per_block = [int(x) for x in rounds_per_block]
        self.hidden = hidden
        self.prompt_hidden = hidden if prompt_hidden is None else prompt_hidden
        self.features = features
        self.eos_token_id = eos_token_id  # with a real model: finish on EOS or budget (update_finish_state)
        self.fills = 0  # fill steps done in the current block
        self.blocks_done = 0

    def init_next_round_input(self, tree_cache=None):
        """``schedule_batch.Req.init_next_round_input``, dLLM path."""
        self._init_fill_ids_for_dllm()
        if tree_cache is not None:
            self.prefix_len = tree_cache.match(self)
            self._update_block_offset_for_dllm()
        self.determine_dllm_phase()

    def block_input(self):
        """The block this request's next forward runs: its unresolved block, or the next block of fill ids."""
        if self.dllm_incomplete_ids:
            return list(self.dllm_incomplete_ids)
        bs = self.dllm_config.block_size
        return list(self.full_untruncated_fill_ids[self.prefix_len:self.prefix_len + bs])


class RadixCache:
    """Block-aligned prefixes of committed tokens (what SGLang's radix cache hands a dLLM request)."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.prefixes: set = set()

    def match(self, req) -> int:
        # real tokens only, on block boundaries: SGLang's own bound (Req._compute_max_prefix_len)
        ids = req.full_untruncated_fill_ids
        limit = req._compute_max_prefix_len(len(ids))
        best = 0
        for end in range(self.block_size, limit + 1, self.block_size):
            if tuple(ids[:end]) in self.prefixes:
                best = end
        return best

    def insert(self, ids, end):
        for stop in range(self.block_size, end // self.block_size * self.block_size + 1, self.block_size):
            self.prefixes.add(tuple(ids[:stop]))


class ScheduleBatch:
    def __init__(self, reqs, forward_mode):
        self.reqs = reqs
        self.forward_mode = forward_mode

    def batch_size(self):
        return len(self.reqs)


class PrefillAdder:
    """SGLang's batch budgets: at most ``max_requests`` requests and ``max_tokens`` tokens per step."""

    def __init__(self, block_size, max_requests, max_tokens):
        self.block_size, self.max_requests, self.max_tokens = block_size, max_requests, max_tokens
        self.can_run_list = []
        self.preempt_list = []
        self.tokens = 0

    def _add(self, req):
        if len(self.can_run_list) >= self.max_requests:
            return AddReqResult.OTHER
        if self.tokens + self.block_size > self.max_tokens:
            return AddReqResult.NO_TOKEN
        req.extend_end = req.prefix_len + self.block_size  # one block per forward (_get_dllm_extend_len)
        self.tokens += self.block_size
        self.can_run_list.append(req)
        return AddReqResult.CONTINUE

    def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
        return self._add(req)

    def add_dllm_staging_req(self, req):
        return self._add(req)


# --- sglang.srt.model_executor ------------------------------------------------------------------------


class ForwardBatch:
    def __init__(self, batch: ScheduleBatch):
        self.batch_size = batch.batch_size()
        self.reqs = batch.reqs
        self.rids = [r.rid for r in batch.reqs]  # as ForwardBatch.init_new names each row's request
        self.forward_mode = batch.forward_mode
        self.input_ids = torch.tensor([t for r in batch.reqs for t in r.block_input()], dtype=torch.long)
        self.dllm_prompt_mask = None

    def mark_forward_metadata_ready(self, replan_equivalent=True):
        pass


class LogitsProcessor:
    def _get_dllm_logits(self, hidden_states, lm_head, logits_metadata):
        return SimpleNamespace(full_logits=hidden_states.sum(dim=-1, keepdim=True), next_token_logits=None)


class _Tape(TorchDispatchMode):
    """Records the tensor operations of one call (what a CUDA graph captures)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _replay(ops, result):
    """Run recorded operations again on the same static tensors; no Python of the original call runs."""
    new = {}

    def sub(x):
        return new.get(id(x), x) if isinstance(x, torch.Tensor) else x

    for func, args, kwargs, out in ops:
        again = func(*tree_map(sub, args), **tree_map(sub, kwargs))
        for old, fresh in zip(tree_flatten(out)[0], tree_flatten(again)[0]):
            if isinstance(old, torch.Tensor):
                new[id(old)] = fresh
    return sub(result)


class ModelConfig:
    """SGLang's ``ModelConfig``: only the end-of-sequence ids (config.json and generation_config.json together)."""

    def __init__(self, hf_eos_token_id):
        self.hf_eos_token_id = set(hf_eos_token_id)


class ModelRunner:
    """Every row of a request's block carries its hidden vector; optionally replayed like a CUDA graph."""

    def __init__(self, block_size, hidden_size, cuda_graph=False, max_bs=16, eos_ids=(0,)):
        self.block_size, self.hidden_size = block_size, hidden_size
        self.model_config = ModelConfig(eos_ids)  # the fake's logits have one entry, id 0
        self.logits_processor = LogitsProcessor()
        self.calls = 0
        self.cuda_graph, self.max_bs = cuda_graph, max_bs
        self.graph = None
        if cuda_graph:
            self.capture()

    def capture(self):
        """Start-up capture: the logits path runs once on static buffers, recorded."""
        self.static_hidden = torch.zeros(self.max_bs * self.block_size, self.hidden_size)
        with _Tape() as tape:
            out = self.logits_processor._get_dllm_logits(self.static_hidden, None, None)
        self.graph = (tape.ops, out.full_logits)

    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, reinit_attn_backend=False,
                split_forward_count=1):
        self.calls += 1
        hidden_states = torch.cat([self._block_rows(r) for r in forward_batch.reqs])  # (B*bs, H)
        if self.graph is not None and forward_batch.batch_size <= self.max_bs:
            self.static_hidden.zero_()
            self.static_hidden[: hidden_states.shape[0]].copy_(hidden_states)
            ops, result = self.graph
            full = _replay(ops, result)[: hidden_states.shape[0]]
            return SimpleNamespace(logits_output=SimpleNamespace(full_logits=full), can_run_graph=True)
        logits = self.logits_processor._get_dllm_logits(hidden_states, None, None)
        return SimpleNamespace(logits_output=logits, can_run_graph=False)


    def _block_rows(self, req):
        """(bs, H) rows of ``req``'s block: its prompt vector in a prompt block and on the leftover
        prompt positions that open its first output block, its hidden vector elsewhere."""
        rows = torch.as_tensor(req.hidden, dtype=torch.float32).expand(self.block_size, -1).clone()
        prompt = torch.as_tensor(req.prompt_hidden, dtype=torch.float32)
        if req.is_dllm_prefill():
            rows[:] = prompt
        elif req.blocks_done == 0:
            rows[: len(req.origin_input_ids) % self.block_size] = prompt
        return rows


# --- sglang.srt.dllm.algorithm ------------------------------------------------------------------------


class FillAlgorithm(DllmAlgorithm):
    """SGLang's ``DllmAlgorithm`` (its ``run`` loops) with a LowConfidence-shaped ``step``."""

    def step(self, forward_batch, full_logits, states):
        bs = self.block_size
        ids = forward_batch.input_ids.view(forward_batch.batch_size, bs)  # (B, bs), filled in place
        done = []
        for i, req in enumerate(forward_batch.reqs):
            masked = (ids[i] == self.mask_id).nonzero().flatten().tolist()
            if not masked:  # done is decided before filling: this forward persisted the last fill
                done.append(True)
                continue
            steps = max(req.forwards_per_block[min(req.blocks_done, len(req.forwards_per_block) - 1)] - 1, 1)
            left = max(steps - req.fills, 1)
            take = -(-len(masked) // left)
            for pos in masked[:take]:
                ids[i, pos] = FILL
            req.fills += 1
            done.append(False)
        return done


# --- sglang.srt.managers.scheduler --------------------------------------------------------------------


class FakeDllmMixin(SchedulerDllmMixin):
    """SGLang's ``SchedulerDllmMixin`` with its GPU-bound ``process_batch_result_dllm`` rewritten.

    It stands where the real mixin stands for the adapter (``resolve`` hands it out under that
    name), so the adapter patches and wraps exactly what SGLang's ``Scheduler`` would inherit.
    """

    def process_batch_result_dllm(self, batch, result):
        """SGLang's commit logic, without KV pools, streaming or metrics."""
        _, next_token_ids, accept, _, _ = result
        bs = self.dllm_config.block_size
        fdfo = self.dllm_config.first_done_first_out_mode
        if not (fdfo or next_token_ids):
            return
        for idx, req in enumerate(batch.reqs):
            if req.finished():
                continue
            if not fdfo:
                tokens = [int(t) for t in next_token_ids[idx]]
                if not tokens:
                    continue
                req.full_untruncated_fill_ids[req.extend_end - len(tokens):req.extend_end] = array("q", tokens)
                self._commit(req, tokens)
                continue
            tokens = [int(t) for t in next_token_ids[idx]]
            if accept[idx] == 0:
                req.dllm_incomplete_ids = array("q", tokens)
                continue
            req.dllm_incomplete_ids = array("q")
            req.full_untruncated_fill_ids[req.extend_end - bs:req.extend_end] = array("q", tokens)
            len_input, len_fill = len(req.origin_input_ids), req.extend_end
            if len_fill <= len_input:
                continue  # a prompt block
            if len_fill - len(tokens) < len_input:
                tokens = tokens[len_input - len_fill:]  # leftover prompt positions are not output
            self._commit(req, tokens)

    def _commit(self, req, tokens):
        req.output_ids.extend(tokens)
        req.fills = 0
        req.blocks_done += 1
        if req.eos_token_id is not None:  # a real model: SGLang's own rule
            req.update_finish_state(new_accepted_len=len(tokens))
        elif req.blocks_done >= len(req.forwards_per_block):
            req.finished_reason = "eos"
        elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finished_reason = "length"
        if req.finished():
            self.tree_cache.insert(req.full_untruncated_fill_ids, req.extend_end)


class Scheduler(FakeDllmMixin):
    """The scheduler state and the GPU-side methods SGLang's dLLM mixin calls."""

    def __init__(self, dllm_config, batch_capacity, max_total_num_tokens, max_prefill_tokens=10**9, tokenizer=None):
        self.dllm_config = dllm_config
        self.tokenizer = tokenizer  # SGLang's, with additional_stop_token_ids attached; None: skip_tokenizer_init
        self.batch_capacity = batch_capacity
        self.max_prefill_tokens = max_prefill_tokens
        self.max_total_num_tokens = max_total_num_tokens
        self.waiting_queue = []
        self.enable_priority_preemption = False
        self.truncation_align_size = None
        self.tree_cache = RadixCache(dllm_config.block_size)
        self.dllm_manager = DllmManager(dllm_config=dllm_config)
        self.aborted: dict = {}  # rid -> the message the client got

    # what SGLang's mixin calls on the scheduler
    def get_num_allocatable_reqs(self, running_bs, num_held_rows=0):
        return 10**9

    def stash_chunked_request(self, req):
        """``checkpoint_kv_cache``: cache the request's committed tokens; ``prefix_len = extend_end``."""
        self.tree_cache.insert(req.full_untruncated_fill_ids, req.extend_end)
        req.prefix_len = req.extend_end

    def get_new_batch_dllm(self, running_batch=None):
        """``SchedulerDllmMixin.get_new_batch_dllm`` with the fake adder and batch."""
        if not self.waiting_queue and self.dllm_manager.is_empty():
            return None
        adder = PrefillAdder(self.dllm_config.block_size, self.batch_capacity, self.max_prefill_tokens)
        self.dllm_manager.init_next_round()
        self._fetch_waiting_reqs()
        forward_mode = self._process_dllm_batches(adder, running_batch=SimpleNamespace(reqs=[], batch_is_full=False))
        if not adder.can_run_list:
            return None
        self._update_state_for_batch(adder.can_run_list, adder)
        return ScheduleBatch(adder.can_run_list, forward_mode)

    def abort_request(self, recv_req):
        """``Scheduler.abort_request``: pop from the waiting queue and from both dLLM queues."""
        kept = []
        for req in self.waiting_queue:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                self.aborted[req.rid] = (recv_req.finished_reason or {}).get("message", "aborted")
            else:
                kept.append(req)
        self.waiting_queue = kept
        for req in self.dllm_manager.pop_aborted_reqs(recv_req.abort_all, recv_req.rid):
            self.aborted[req.rid] = (recv_req.finished_reason or {}).get("message", "aborted")

    def retract(self, rids):
        """Retraction / ``pause_generation(mode="retract")``: KV released, back to the waiting queue."""
        manager = self.dllm_manager
        out = [r for r in manager.waiting_queue if r.rid in rids and not r.finished()]
        manager.waiting_queue = [r for r in manager.waiting_queue if r.rid not in rids]
        manager.staging_queue = [r for r in manager.staging_queue if r.rid not in rids]
        for req in out:
            req.prefix_len, req.dllm_initialized, req.fills = 0, False, 0
            req.dllm_incomplete_ids = array("q")
            req.init_diffusion_llm(req.dllm_config)
            self.waiting_queue.append(req)

    def step(self, algorithm, runner):
        """One scheduler iteration (``get_next_batch_to_run`` order); returns the batch or None."""
        self.dllm_manager.filter_finished_reqs()
        for req in list(self.dllm_manager.staging_queue):
            self.finish_dllm_forward(req)
        batch = self.get_new_batch_dllm()
        if batch is None:
            return None
        result = algorithm.run(runner, ForwardBatch(batch), None)
        self.process_batch_result_dllm(batch, result)
        return batch


SchedulerDllmMixin = FakeDllmMixin

MODULES = {
    "sglang.srt.dllm.config": SimpleNamespace(DllmConfig=DllmConfig),
    "sglang.srt.dllm.mixin.req": SimpleNamespace(DllmReqPhase=DllmReqPhase, ReqDllmMixin=ReqDllmMixin),
    "sglang.srt.dllm.mixin.scheduler": SimpleNamespace(SchedulerDllmMixin=FakeDllmMixin, DllmManager=DllmManager),
    "sglang.srt.dllm.algorithm.base": SimpleNamespace(DllmAlgorithm=DllmAlgorithm),
    "sglang.srt.layers.logits_processor": SimpleNamespace(LogitsProcessor=LogitsProcessor),
    "sglang.srt.managers.io_struct": SimpleNamespace(AbortReq=AbortReq),
    "sglang.srt.managers.schedule_batch": SimpleNamespace(Req=Req, ScheduleBatch=ScheduleBatch),
    "sglang.srt.managers.schedule_policy": SimpleNamespace(PrefillAdder=PrefillAdder),
    "sglang.srt.managers.scheduler": SimpleNamespace(Scheduler=Scheduler),
    "sglang.srt.model_executor.forward_batch_info": SimpleNamespace(ForwardMode=ForwardMode, ForwardBatch=ForwardBatch),
    "sglang.srt.model_executor.model_runner": SimpleNamespace(ModelRunner=ModelRunner),
    "sglang.srt.configs.model_config": SimpleNamespace(ModelConfig=ModelConfig),
}


def resolve(name: str):
    return MODULES[name]


def serve(scheduler: Scheduler, algorithm: DllmAlgorithm, runner: ModelRunner, max_steps: int = 100_000,
          before_step=None) -> dict:
    """Drive the fake server until every request is done or aborted; returns {rid: forward it finished in}.

    ``before_step(step_index, scheduler)`` runs before each iteration (aborts, retractions).
    """
    all_reqs = list(scheduler.waiting_queue)
    finished_at = {}
    for step in range(max_steps):
        if before_step is not None:
            before_step(step, scheduler)
        batch = scheduler.step(algorithm, runner)
        if batch is None:
            if not scheduler.waiting_queue and scheduler.dllm_manager.is_empty():
                break
            continue
        for req in batch.reqs:
            if req.finished() and req.rid not in finished_at:
                finished_at[req.rid] = runner.calls
    missing = [r.rid for r in all_reqs if r.rid not in finished_at and r.rid not in scheduler.aborted]
    assert not missing, f"fake server stalled with {missing} unfinished"
    return finished_at
