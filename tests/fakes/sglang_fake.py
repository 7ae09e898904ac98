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

- ``srt/managers/schedule_policy.py`` — ``PrefillAdder`` (its ``__init__``, ``add_one_req``,
  ``add_dllm_staging_req`` and the budgets they charge: ``--max-prefill-tokens`` as
  ``rem_input_tokens``, ``--chunked-prefill-size`` as ``rem_chunk_tokens``, ``max_running_requests``
  blocks as ``rem_dllm_tokens``, ``budget_state``) over ``srt/mem_cache/prefill_budget.py``'s
  ``PrefillBudget`` (KV memory: free tokens of the pool less this step's reservations, a request's
  prompt plus ``max_new_tokens`` at admission), and ``SchedulerDllmMixin.get_new_batch_dllm`` itself;
- ``srt/mem_cache/memory_pool.py`` — ``ReqToTokenPool``'s rows (``alloc``, ``free``,
  ``available_size``), sized per attention-DP worker by ``mem_cache/kv_cache_configurator.py``'s
  ``resolve_max_num_reqs`` (``--max-running-requests // attn_dp_size``, at most half the KV pool):
  a request takes a row when its first batch is prepared and keeps it until ``release_kv_cache``;
- ``srt/managers/scheduler.py`` — ``Scheduler.pause_generation`` / ``continue_generation`` and
  ``schedule_batch.Req.reset_for_retract``: what a pause in ``retract`` mode does to a dLLM server
  (the last batch's requests lose their KV and are queued again, while they stay in the dLLM
  manager's queues). A dLLM request is never decode-retracted: SGLang empties the running batch
  every step (``get_next_batch_to_run`` excludes the last dLLM batch's requests), so the fake has
  no other retraction.

Written here, for what needs a GPU or a real model (each mirrors the SGLang code it names):

- ``Req``: token arrays, ``prefix_len``, ``init_next_round_input`` (``schedule_batch.Req``: fill
  ids, prefix match within SGLang's bound, phase) and the request fields the adder reads (no host
  or storage cache hits);
- ``RadixCache``: block-aligned prefixes of committed tokens (``checkpoint_kv_cache`` inserts and
  sets ``prefix_len = extend_end``); nothing evictable (its prefixes take no room in the pool);
- ``TokenPool``: the KV pool the adder's budget reads (``available_size``): a request holds its
  committed tokens plus one block from its first forward until it finishes, is aborted or retracted;
- ``FakeDllmMixin``: SGLang's ``SchedulerDllmMixin`` subclassed, with ``process_batch_result_dllm``
  rewritten without KV pools, streaming and metrics (sync:
  commit the block's tokens; FDFO: keep an unresolved block in ``dllm_incomplete_ids``, commit a
  resolved one, leftover prompt positions are not output; a request finishes after its planned
  blocks, or, given an EOS id, by SGLang's own ``Req.update_finish_state``), and ``_create_dllm_batch``
  (a plain batch; KV taken from the pool); ``resolve``
  hands it out as ``SchedulerDllmMixin``, so the adapter patches what SGLang's ``Scheduler`` inherits;
- ``Scheduler``: ``get_num_allocatable_reqs`` (the free rows plus those the batch's requests hold,
  at most ``max_running_requests``: SGLang's formula without pipeline stages or beams),
  ``abort_request`` (pops from both queues every request whose rid starts with the given one, as
  SGLang's does; the client's abort is ``send_abort_output``, kept in ``aborted``), the step order of
  ``get_next_batch_to_run`` (``filter_finished_reqs``, then ``finish_dllm_forward``, then
  ``get_new_batch_dllm``), ``idle_step`` (a DP-attention IDLE batch: no requests, forward mode
  ``IDLE``, run through ``DllmAlgorithm.run`` as ``tp_worker`` does and never handed to
  ``process_batch_result_dllm``), and ``dp_tp_group`` (the TP ranks sharing its requests; one
  unless a test gives it a real process group);
- ``FillAlgorithm``: SGLang's ``DllmAlgorithm`` with a ``step`` that, like ``LowConfidence.step``,
  reports *done* when the forward's input held no mask and otherwise fills masks so that block b
  of a request is filled in ``forwards[b] - 1`` steps (so it costs ``forwards[b]`` forwards);
- ``ModelRunner``: every row of a request's block carries the request's hidden vector (its prompt
  vector in a prompt block, and on the leftover prompt positions of its first output block); with
  ``cuda_graph=True`` the logits path is recorded once at ``capture()`` (start-up) and every
  forward replays the recorded tensor operations without running any Python hook, as a CUDA graph
  replay does; an eager IDLE forward returns no ``full_logits`` (``LogitsProcessor`` computes dLLM
  logits for ``DLLM_EXTEND`` only), a replayed one zero rows.

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
ADDER = sglang_reference.load_adder()
PAUSE = sglang_reference.load_pause()
ROWS = sglang_reference.load_row_pool()
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


# --- sglang.srt.sampling.sampling_params, sglang.srt.observability.metrics_collector -----------------


class SamplingParams:
    """``SamplingParams``: what the hook reads of a request's sampling parameters. ``custom_params``
    is the client's dict as sent (``{"dwise_category": ...}`` names the request's category)."""

    def __init__(self, max_new_tokens, custom_params=None, ignore_eos=False):
        self.max_new_tokens, self.custom_params, self.ignore_eos = max_new_tokens, custom_params, ignore_eos


class SchedulerMetricsCollector:
    """``SchedulerMetricsCollector``: a scheduler's, made only under ``--enable-metrics``; its gauges'
    labels (``init_new``: model name, engine type, TP/PP/EP ranks, the DP rank where there is one)."""

    def __init__(self, labels):
        self.labels = dict(labels)


# --- sglang.srt.managers.schedule_batch --------------------------------------------------------------


class Req(ReqDllmMixin, SGL.finish.ReqFinishMixin, SGL.ReqPrefixMixin, PAUSE.ReqRetract):
    """SGLang's request fields the dLLM path reads, with SGLang's own ``ReqDllmMixin`` and, given an
    ``eos_token_id``, its own finish rule (``update_finish_state``, ``finished``)."""

    def __init__(self, rid, origin_input_ids, sampling_params, dllm_config, rounds_per_block, hidden, features,
                 eos_token_id=None, prompt_hidden=None):
        self.rid = rid
        self.origin_input_ids = array("q", [int(t) for t in origin_input_ids])
        self.output_ids = array("q")
        if sampling_params is not None and not hasattr(sampling_params, "ignore_eos"):
            sampling_params.ignore_eos = False  # SGLang's default; the adder reads it
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
        self.kv = KVState()
        self.kv_tokens = 0  # fake-only: tokens this request holds in the TokenPool
        # observability's RequestTimeStats, what the waiting timeout reads: set when queued (0: never, never aborted)
        self.time_stats = SimpleNamespace(wait_queue_entry_time=0.0)
        # what PrefillAdder reads: no host, SWA or storage cache hits, never retracted so far
        self.last_node = self.lock = None
        self.host_hit_length = self.swa_host_hit_length = self.auxiliary_swa_host_hit_length = 0
        self.retracted_stain = False
        self.retraction_count = 0
        self.input_embeds = None  # token ids, not embeddings (reset_for_retract reads it)
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

    @property
    def extend_len(self) -> int:
        """``schedule_batch.Req.extend_len``."""
        return self.extend_end - self.prefix_len

    def needs_host_load_back(self) -> bool:
        return False  # no host cache tier

    def block_input(self):
        """The block this request's next forward runs: its unresolved block, or the next block of fill ids."""
        if self.dllm_incomplete_ids:
            return list(self.dllm_incomplete_ids)
        bs = self.dllm_config.block_size
        return list(self.full_untruncated_fill_ids[self.prefix_len:self.prefix_len + bs])


class KVState:
    """``schedule_batch``'s per-request KV record, the fields the dLLM path reads: a request holds KV
    (``holds_kv``) while it holds a row of the ``ReqToTokenPool``."""

    def __init__(self):
        self.req_pool_idx = None
        self.kv_allocated_len = 0
        self.holds_mamba = False

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None


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
            if tuple(ids[:end]) not in self.prefixes:
                break  # the set holds every shorter prefix of what it holds (insert)
            best = end
        return best

    def insert(self, ids, end):
        # longest first: once a prefix is held, so is every shorter one (a request inserts its
        # committed tokens after each block, so each call adds a block or two, not the whole prompt)
        for stop in range(end // self.block_size * self.block_size, 0, -self.block_size):
            prefix = tuple(ids[:stop])
            if prefix in self.prefixes:
                break
            self.prefixes.add(prefix)

    # what SGLang's PrefillAdder and PrefillBudget ask a tree cache
    disable = False
    buffer_pipeline = None

    def evictable_size(self) -> int:
        return 0

    def supports_mamba(self) -> bool:
        return False

    def lock(self, node):
        return None

    def unlock(self, lock) -> None:
        pass


class ReqToTokenPool(ROWS.ReqToTokenPoolMethods):
    """SGLang's request-row pool (``mem_cache/memory_pool.py``'s ``ReqToTokenPool``: its methods from
    the wheel; this ``__init__`` leaves out the token table, which only the GPU reads): ``size`` rows
    (row 0 is CUDA-graph padding), taken by ``alloc`` when a request's first batch is prepared and
    given back by ``free`` in ``release_kv_cache``; ``available_size()`` is what
    ``Scheduler.get_num_allocatable_reqs`` admits new requests against."""

    _on_alloc_rows = None

    def __init__(self, size):
        self.size = int(size)
        self.free_slots = list(range(1, self.size + 1))
        self.req_generation = torch.zeros(self.size + 1, dtype=torch.int64)
        self._aux_cache = None


class TokenPool:
    """The KV token pool as SGLang's adder reads it (``token_to_kv_pool_allocator``): ``size`` tokens,
    of which a request holds its committed tokens plus one block from its first forward on; ``rows``
    the scheduler's ``ReqToTokenPool``, whose row ``release`` gives back too (``release_kv_cache``)."""

    def __init__(self, size, block_size, page_size=1, rows=None):
        self.size, self.block_size, self.page_size = int(size), block_size, page_size
        self.rows = rows
        self.used = 0

    def available_size(self) -> int:
        return self.size - self.used

    def request_slot_reserve(self, *, has_req_pool_slot, prefill_tokens=0) -> int:
        return 0

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens=0):
        return ADDER.PrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def hold(self, req) -> None:
        """A forward allocated ``req``'s block: it holds what it committed plus that block."""
        held = len(req.origin_input_ids) + len(req.output_ids) + self.block_size
        self.used += held - req.kv_tokens
        req.kv_tokens = req.kv.kv_allocated_len = held

    def release(self, req) -> None:
        """``release_kv_cache``: the request's tokens and its row."""
        self.used -= req.kv_tokens
        req.kv_tokens = req.kv.kv_allocated_len = 0
        if req.kv.holds_kv:
            self.rows.free(req)


class ScheduleBatch:
    def __init__(self, reqs, forward_mode):
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.batch_is_full = False

    def batch_size(self):
        return len(self.reqs)


class PrefillAdder(ADDER.PrefillAdderMethods):
    """SGLang's ``PrefillAdder`` from the wheel (``sglang_reference.load_adder``), with its metrics
    of prefix-cache tiers and storage prefetches (``_account_prefill_cache_admission``: counters for
    logs, no admission decision) left out."""

    def _account_prefill_cache_admission(self, req, prefix_len):
        pass


# --- sglang.srt.model_executor ------------------------------------------------------------------------


class ForwardBatch:
    def __init__(self, batch: ScheduleBatch):
        self.batch_size = batch.batch_size()
        self.reqs = batch.reqs
        self.rids = [r.rid for r in batch.reqs]  # as ForwardBatch.init_new names each row's request
        self.forward_mode = batch.forward_mode
        self.input_ids = torch.tensor([t for r in batch.reqs for t in r.block_input()], dtype=torch.long).reshape(-1)
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
        self.calls = self.idle_calls = 0
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
        if forward_batch.forward_mode.is_idle():
            self.idle_calls += 1
            if self.graph is None:  # eager: LogitsProcessor.forward computes dLLM logits for DLLM_EXTEND only
                return SimpleNamespace(logits_output=SimpleNamespace(full_logits=None, next_token_logits=None),
                                       can_run_graph=False)
            ops, result = self.graph  # IDLE is a graph mode: the padded replay, sliced to its zero real rows
            return SimpleNamespace(logits_output=SimpleNamespace(full_logits=_replay(ops, result)[:0]), can_run_graph=True)
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
            self.token_to_kv_pool_allocator.release(req)  # release_kv_cache

    def _create_prefill_adder(self, running_batch):
        """``_create_dllm_prefill_adder``'s ``PrefillAdder`` with this scheduler's budgets."""
        return PrefillAdder(self.page_size, self.tree_cache, self.token_to_kv_pool_allocator, running_batch, 1.0,
                            self.max_prefill_tokens, self.chunked_prefill_size, 0, 0,
                            prefill_max_requests=self.prefill_max_requests, dllm_config=self.dllm_config)

    def _create_dllm_prefill_adder(self, running_bs, running_batch):
        return self._create_prefill_adder(running_batch)

    def _create_dllm_batch(self, can_run_list, forward_mode, adder, running_batch):
        """``ScheduleBatch.init_new`` + ``prepare_for_extend``: a row for each request without one
        (``alloc_req_slots``, which fails as SGLang's does when the rows run out), and the blocks."""
        if self.req_to_token_pool.alloc(can_run_list) is None:
            raise RuntimeError("alloc_req_slots runs out of memory: the adder admitted more requests than free rows")
        for req in can_run_list:
            self.token_to_kv_pool_allocator.hold(req)
        return ScheduleBatch(can_run_list, forward_mode)


class Scheduler(FakeDllmMixin, PAUSE.SchedulerPause):
    """The scheduler state and the GPU-side methods SGLang's dLLM mixin calls."""

    def __init__(self, dllm_config, batch_capacity, max_total_num_tokens, max_prefill_tokens=10**9, tokenizer=None,
                 chunked_prefill_size=8192, page_size=1, attn_dp_size=1):
        """``batch_capacity``: SGLang's ``--prefill-max-requests`` (requests the adder admits from the
        incoming phase per step); ``max_total_num_tokens``: the KV pool; ``max_prefill_tokens``,
        ``chunked_prefill_size`` (None: ``-1``, off) and ``page_size``: SGLang's flags of those names;
        ``attn_dp_size``: the attention-DP workers the server's ``--max-running-requests`` (the
        config's) is divided among: this scheduler is one of them, with its share of request rows
        (SGLang's ``resolve_max_num_reqs``) as its ``max_running_requests`` (``get_worker_info``)."""
        self.dllm_config = dllm_config
        self.tokenizer = tokenizer  # SGLang's, with additional_stop_token_ids attached; None: skip_tokenizer_init
        self.prefill_max_requests = batch_capacity
        self.max_prefill_tokens, self.chunked_prefill_size, self.page_size = max_prefill_tokens, chunked_prefill_size, page_size
        self.max_total_num_tokens = max_total_num_tokens
        self.max_running_requests = ROWS.rows_per_worker(dllm_config.max_running_requests, attn_dp_size,
                                                         max_total_num_tokens, max_total_num_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests)
        self.token_to_kv_pool_allocator = TokenPool(max_total_num_tokens, dllm_config.block_size, page_size,
                                                    self.req_to_token_pool)
        self.beam_coordinator = BeamCoordinator()
        self.waiting_queue = []
        self.enable_priority_preemption = False
        self.truncation_align_size = None
        self.policy = SimpleNamespace(calc_priority=lambda waiting_queue: None)  # FCFS: SGLang's default keeps order
        self.tree_cache = RadixCache(dllm_config.block_size)
        self.dllm_manager = DllmManager(dllm_config=dllm_config)
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)  # a dLLM server's is empty at every step
        self.last_batch = None
        self.chunked_req = None
        self.dp_tp_group = GroupCoordinator([0], 0, None)  # one TP rank; tests give two a real gloo group
        self.aborted: dict = {}  # rid -> the message the client got
        # what SGLang's pause_generation / continue_generation read (no overlap, disaggregation, HiSparse)
        self.enable_overlap = self.enable_overlap_mlx = self._engine_paused = False
        self.disaggregation_mode = PAUSE.DisaggregationMode.NULL
        self._pause_started_at, self._pause_intervals = None, []
        self.decode_offload_manager = self.hisparse_coordinator = self.cur_batch_for_debug = None
        self.metrics_reporter = SimpleNamespace(last_gen_throughput=0.0, current_scheduler_metrics_enabled=False)
        self.metrics_collector = None  # a SchedulerMetricsCollector under --enable-metrics (tests set one)
        self.kv_events_publisher = SimpleNamespace(publish_kv_events=lambda: None)

    # what SGLang's mixin calls on the scheduler
    def get_num_allocatable_reqs(self, running_bs, num_held_rows=0):
        """``Scheduler.get_num_allocatable_reqs``: requests a batch may take, at most the pipeline's
        micro-batch (``max_running_requests // pp_size``, one stage here) less the running batch, and
        the free rows plus those the counted requests already hold (no beam members)."""
        pp_budget = self.max_running_requests - running_bs
        row_budget = max(self.req_to_token_pool.available_size() + num_held_rows, 0)
        return min(pp_budget, row_budget)

    def stash_chunked_request(self, req):
        """``checkpoint_kv_cache``: cache the request's committed tokens; ``prefix_len = extend_end``."""
        self.tree_cache.insert(req.full_untruncated_fill_ids, req.extend_end)
        req.prefix_len = req.extend_end

    def _add_request_to_queue(self, req, is_retracted=False):
        """``Scheduler._add_request_to_queue`` without disaggregation: to the back of the waiting queue."""
        self.waiting_queue.append(req)

    def abort_request(self, recv_req):
        """``Scheduler.abort_request``: pop from the waiting queue and from both dLLM queues, KV released,
        each request whose rid starts with the given one (SGLang's own rule: ``req-1`` takes ``req-10``)."""
        kept = []
        for req in self.waiting_queue:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                self._release_aborted_request(req)
                self.send_abort_output(AbortReq(rid=req.rid, finished_reason=recv_req.finished_reason), req)
            else:
                kept.append(req)
        self.waiting_queue = kept
        for req in self.dllm_manager.pop_aborted_reqs(recv_req.abort_all, recv_req.rid):
            self._release_aborted_request(req)
            self.send_abort_output(AbortReq(rid=req.rid, finished_reason=recv_req.finished_reason), req)
            if req.kv.holds_kv:
                self.token_to_kv_pool_allocator.release(req)

    def _release_aborted_request(self, req):
        """``Scheduler._release_aborted_request``: the cache-side state of a request (none here)."""

    def send_abort_output(self, abort_req, req):
        """``Scheduler.send_abort_output``: the client gets the abort (here: rid -> its message)."""
        self.aborted[req.rid] = (abort_req.finished_reason or {}).get("message", "aborted")

    def poll_timeout_aborts(self, now: float, timeout_s: float) -> None:
        """``Scheduler._poll_timeout_aborts``, its ``SGLANG_REQ_WAITING_TIMEOUT`` part, at time ``now``
        (``time.perf_counter``'s in SGLang): every request of the waiting queue queued before ``now -
        timeout_s`` (``time_stats.wait_queue_entry_time``) is aborted with SGLang's message, through
        ``abort_request`` (SGLang's loop hands it the ``AbortReq`` before the iteration's batch)."""
        deadline = now - timeout_s
        for req in list(self.waiting_queue):
            if 0 < req.time_stats.wait_queue_entry_time < deadline:
                self.abort_request(AbortReq(rid=req.rid, abort_message="Request waiting timeout reached.",
                                            finished_reason={"type": "abort", "status_code": 503,
                                                             "message": "Request waiting timeout reached."}))

    def step(self, algorithm, runner):
        """One scheduler iteration (``get_next_batch_to_run`` order); returns the batch or None."""
        self.dllm_manager.filter_finished_reqs()
        for req in list(self.dllm_manager.staging_queue):
            self.finish_dllm_forward(req)
        batch = self.get_new_batch_dllm(ScheduleBatch([], ForwardMode.DECODE))
        if batch is None:
            return None
        result = algorithm.run(runner, ForwardBatch(batch), self._algo_states(algorithm, batch))
        self.process_batch_result_dllm(batch, result)
        self.last_batch = batch
        return batch

    def idle_step(self, algorithm, runner):
        """A DP-attention IDLE step (``get_idle_batch``: no requests, ``prepare_for_idle``) as
        ``tp_worker.forward_batch_generation`` runs it on a dLLM server: ``DllmAlgorithm.run``. Its
        result goes to ``process_batch_result_idle``, never to ``process_batch_result_dllm``."""
        batch = ScheduleBatch([], ForwardMode.IDLE)
        return algorithm.run(runner, ForwardBatch(batch), self._algo_states(algorithm, batch))

    @staticmethod
    def _algo_states(algorithm, batch):
        """``tp_worker._forward_batch_generation_dllm``: FDFO carries each request's algorithm state."""
        return [getattr(req, "dllm_algo_state", None) for req in batch.reqs] if algorithm.fdfo else None


class BeamCoordinator:
    """``beam_search.coordinator.BeamCoordinator``: no beam groups (a dLLM request has none)."""

    def retire_group(self, req):
        assert getattr(req, "beam_group", None) is None


class GroupCoordinator:
    """``distributed.parallel_state.GroupCoordinator``: the fields a scheduler's ``dp_tp_group`` has."""

    def __init__(self, ranks, rank, cpu_group):
        self.ranks, self.world_size, self.rank_in_group, self.cpu_group = list(ranks), len(ranks), ranks.index(rank), cpu_group


SchedulerDllmMixin = FakeDllmMixin

MODULES = {
    "sglang.srt.dllm.config": SimpleNamespace(DllmConfig=DllmConfig),
    "sglang.srt.dllm.mixin.req": SimpleNamespace(DllmReqPhase=DllmReqPhase, ReqDllmMixin=ReqDllmMixin),
    "sglang.srt.dllm.mixin.scheduler": SimpleNamespace(SchedulerDllmMixin=FakeDllmMixin, DllmManager=DllmManager),
    "sglang.srt.dllm.algorithm.base": SimpleNamespace(DllmAlgorithm=DllmAlgorithm),
    "sglang.srt.layers.logits_processor": SimpleNamespace(LogitsProcessor=LogitsProcessor),
    "sglang.srt.managers.io_struct": SimpleNamespace(AbortReq=AbortReq),
    "sglang.srt.managers.schedule_batch": SimpleNamespace(Req=Req, ScheduleBatch=ScheduleBatch),
    "sglang.srt.managers.schedule_policy": SimpleNamespace(PrefillAdder=PrefillAdder, AddReqResult=AddReqResult),
    "sglang.srt.managers.scheduler": SimpleNamespace(Scheduler=Scheduler),
    "sglang.srt.model_executor.forward_batch_info": SimpleNamespace(ForwardMode=ForwardMode, ForwardBatch=ForwardBatch),
    "sglang.srt.model_executor.model_runner": SimpleNamespace(ModelRunner=ModelRunner),
    "sglang.srt.configs.model_config": SimpleNamespace(ModelConfig=ModelConfig),
    "sglang.srt.distributed.parallel_state": SimpleNamespace(GroupCoordinator=GroupCoordinator),
    "sglang.srt.mem_cache.memory_pool": SimpleNamespace(ReqToTokenPool=ReqToTokenPool),
    "sglang.srt.beam_search.coordinator": SimpleNamespace(BeamCoordinator=BeamCoordinator),
    "sglang.srt.sampling.sampling_params": SimpleNamespace(SamplingParams=SamplingParams),
    "sglang.srt.observability.metrics_collector": SimpleNamespace(SchedulerMetricsCollector=SchedulerMetricsCollector),
}


def resolve(name: str):
    return MODULES[name]


def serve(scheduler: Scheduler, algorithm: DllmAlgorithm, runner: ModelRunner, max_steps: int = 100_000,
          before_step=None) -> dict:
    """Drive the fake server until every request is done or aborted; returns {rid: forward it finished in}.

    ``before_step(step_index, scheduler)`` runs before each iteration (aborts, pauses).
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
