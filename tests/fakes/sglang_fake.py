"""A small, faithful fake of the part of SGLang 0.5.23's dLLM path that the DWISE adapter touches.

Same module paths, class names, method names and parameters as the real source (checked against
``sglang_surface.json`` by ``tests/test_sglang_surface.py``), and the same control flow:
``get_new_batch_dllm`` -> ``dllm_manager.init_next_round`` -> ``_fetch_waiting_reqs`` (FCFS up to
``max_running_requests``) -> ``_process_dllm_batches`` (prefill first, else decode, through
``_process_batch_by_phase``) -> ``DllmAlgorithm.run`` (``_run_fdfo``: one forward; ``_run_sync``:
forwards until the block is done) -> ``model_runner.forward`` -> ``LogitsProcessor._get_dllm_logits``
-> ``process_batch_result_dllm``. What it leaves out: KV pools, the prefix cache, token ids and real
logits. A fake request knows its true denoising rounds per output block and its first-round hidden
vector; the fake model emits that vector on every row of the block.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import torch

# --- sglang.srt.dllm.config ------------------------------------------------------------------------


class DllmConfig:
    def __init__(self, algorithm, algorithm_config, block_size, mask_id, max_running_requests,
                 first_done_first_out_mode=False, requires_separate_context_encoding=False,
                 capture_input_preparation=False, delete_token_id=None, split_token_id=None):
        self.algorithm = algorithm
        self.algorithm_config = algorithm_config
        self.block_size = block_size
        self.mask_id = mask_id
        self.max_running_requests = max_running_requests
        self.first_done_first_out_mode = first_done_first_out_mode
        self.requires_separate_context_encoding = requires_separate_context_encoding


# --- sglang.srt.dllm.mixin.req ----------------------------------------------------------------------


class DllmReqPhase(str, enum.Enum):
    STAGING_PREFILL = "staging_prefill"
    STAGING_DECODE = "staging_decode"
    INCOMING_PREFILL = "incoming_prefill"
    INCOMING_DECODE = "incoming_decode"


class ReqDllmMixin:
    def is_dllm_prefill(self):
        return self.dllm_phase in [DllmReqPhase.STAGING_PREFILL, DllmReqPhase.INCOMING_PREFILL]


# --- sglang.srt.managers.schedule_batch ------------------------------------------------------------


class Req(ReqDllmMixin):
    """rid, origin_input_ids, sampling_params as in SGLang; the rest drives the fake model."""

    def __init__(self, rid, origin_input_ids, sampling_params, dllm_config, rounds_per_block, hidden, features):
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.sampling_params = sampling_params
        self.output_ids = []
        self.dllm_config = dllm_config
        self.finished_reason = None
        bs = dllm_config.block_size
        self.dllm_phase = DllmReqPhase.INCOMING_DECODE if len(origin_input_ids) < bs else DllmReqPhase.INCOMING_PREFILL
        # fake-only state
        self.rounds_per_block = list(rounds_per_block)
        self.hidden = hidden
        self.features = features
        self.prefilled = 0
        self.block = 0
        self.block_rounds = 0

    def finished(self):
        return self.finished_reason is not None

    def advance_prefill(self):
        self.prefilled += 1
        done = self.prefilled == len(self.origin_input_ids) // self.dllm_config.block_size
        self.dllm_phase = DllmReqPhase.STAGING_DECODE if done else DllmReqPhase.STAGING_PREFILL

    def denoise(self) -> bool:
        """One denoising round; True when it completes the current block."""
        self.block_rounds += 1
        return self.block_rounds == self.rounds_per_block[self.block]

    def commit_block(self):
        self.output_ids.extend([0] * self.dllm_config.block_size)
        self.block, self.block_rounds = self.block + 1, 0
        self.dllm_phase = DllmReqPhase.STAGING_DECODE
        if self.block == len(self.rounds_per_block):
            self.finished_reason = "eos"


class ScheduleBatch:
    def __init__(self, reqs, forward_mode):
        self.reqs = reqs
        self.forward_mode = forward_mode

    def batch_size(self):
        return len(self.reqs)


# --- sglang.srt.model_executor.forward_batch_info ---------------------------------------------------


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DLLM_EXTEND = 2


class ForwardBatch:
    def __init__(self, batch: ScheduleBatch):
        self.batch_size = batch.batch_size()
        self.reqs = batch.reqs
        self.forward_mode = batch.forward_mode


# --- sglang.srt.layers.logits_processor ---------------------------------------------------------------


class LogitsProcessor:
    def _get_dllm_logits(self, hidden_states, lm_head, logits_metadata):
        return SimpleNamespace(full_logits=hidden_states.sum(dim=-1, keepdim=True), next_token_logits=None)


# --- sglang.srt.model_executor.model_runner -------------------------------------------------------------


class ModelRunner:
    def __init__(self, block_size, hidden_size):
        self.block_size, self.hidden_size = block_size, hidden_size
        self.logits_processor = LogitsProcessor()
        self.calls = 0

    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, reinit_attn_backend=False,
                split_forward_count=1):
        self.calls += 1
        rows = torch.stack([torch.as_tensor(r.hidden, dtype=torch.float32) for r in forward_batch.reqs])  # (B, H)
        hidden_states = rows[:, None, :].expand(-1, self.block_size, -1).reshape(-1, self.hidden_size)  # (B*bs, H)
        logits = self.logits_processor._get_dllm_logits(hidden_states, None, None)
        return SimpleNamespace(logits_output=logits, can_run_graph=False)


# --- sglang.srt.dllm.algorithm.base ----------------------------------------------------------------------


class DllmAlgorithm:
    def __init__(self, config: DllmConfig):
        self.block_size = config.block_size
        self.fdfo = config.first_done_first_out_mode

    def max_steps(self, block_size):
        return block_size + 1

    def step(self, forward_batch, full_logits, states):
        # a prompt block is all prompt: done at once; a denoising block advances one round
        return [True if r.is_dllm_prefill() else r.denoise() for r in forward_batch.reqs]

    def run(self, model_runner, forward_batch, algo_states=None):
        if self.fdfo:
            return self._run_fdfo(model_runner, forward_batch, algo_states)
        return self._run_sync(model_runner, forward_batch)

    def _run_sync(self, model_runner, forward_batch):
        out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
        done = self.step(forward_batch, out.logits_output.full_logits, None)
        while not all(done):
            out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
            done = [d or (not r.is_dllm_prefill() and r.denoise()) for d, r in zip(done, forward_batch.reqs)]
        return out.logits_output, [[0]] * forward_batch.batch_size, None, None, out.can_run_graph

    def _run_fdfo(self, model_runner, forward_batch, algo_states):
        out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
        done = self.step(forward_batch, out.logits_output.full_logits, algo_states)
        accept = [self.block_size if d else 0 for d in done]
        return out.logits_output, [[0]] * forward_batch.batch_size, accept, [None] * len(done), out.can_run_graph


# --- sglang.srt.dllm.mixin.scheduler ---------------------------------------------------------------------


class Adder:
    """PrefillAdder stand-in: takes requests while there is room in the batch."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.can_run_list = []

    def add(self, req):
        if len(self.can_run_list) >= self.capacity:
            return False
        self.can_run_list.append(req)
        return True


class SchedulerDllmMixin:
    def init_diffusion_llm(self):
        self.dllm_manager = DllmManager(dllm_config=self.dllm_config)

    def get_new_batch_dllm(self, running_batch):
        if not self.waiting_queue and self.dllm_manager.is_empty():
            return None
        adder = Adder(self.batch_capacity)
        self.dllm_manager.init_next_round()
        self._fetch_waiting_reqs()
        forward_mode = self._process_dllm_batches(adder, running_batch=running_batch)
        if not adder.can_run_list:
            return None
        self.dllm_manager.add_staging_reqs(adder.can_run_list)
        return ScheduleBatch(adder.can_run_list, forward_mode)

    def process_batch_result_dllm(self, batch, result):
        _, _, accept, _, _ = result
        for idx, req in enumerate(batch.reqs):
            if req.is_dllm_prefill():
                req.advance_prefill()
            elif accept is None or accept[idx]:
                req.commit_block()

    def _fetch_waiting_reqs(self):
        room = self.dllm_config.max_running_requests - len(self.dllm_manager.waiting_queue)
        n = min(room, len(self.waiting_queue))
        if n > 0:
            self.dllm_manager.add_waiting_reqs(self.waiting_queue[:n])
            self.waiting_queue = self.waiting_queue[n:]

    def _process_dllm_batches(self, adder, running_batch):
        prefill_reqs = self.dllm_manager.get_prefill_requests()
        if prefill_reqs:
            self._process_batch_by_phase(adder, prefill_reqs, DllmReqPhase.STAGING_PREFILL,
                                         DllmReqPhase.INCOMING_PREFILL, running_batch=running_batch)
            return ForwardMode.EXTEND if self.dllm_config.requires_separate_context_encoding else ForwardMode.DLLM_EXTEND
        decode_reqs = self.dllm_manager.get_decode_requests()
        self._process_batch_by_phase(adder, decode_reqs, DllmReqPhase.STAGING_DECODE, DllmReqPhase.INCOMING_DECODE,
                                     running_batch=running_batch)
        return ForwardMode.DLLM_EXTEND

    def _process_batch_by_phase(self, adder, batch, staging_phase, incoming_phase, running_batch):
        for phase in (staging_phase, incoming_phase):
            for req in (r for r in batch if r.dllm_phase == phase):
                if not adder.add(req):
                    return


class DllmManager:
    def __init__(self, dllm_config=None):
        self.dllm_config = dllm_config
        self.waiting_queue = []
        self.staging_queue = []

    def get_prefill_requests(self):
        return [req for req in self.waiting_queue if req.is_dllm_prefill()]

    def get_decode_requests(self):
        return [req for req in self.waiting_queue if not req.is_dllm_prefill()]

    def add_waiting_reqs(self, reqs):
        reqs = reqs if isinstance(reqs, list) else [reqs]
        existing = {r.rid for r in self.waiting_queue}
        if any(r.rid in existing for r in reqs):
            raise RuntimeError("Redundant requests detected in dLLM requests.")
        self.waiting_queue.extend(reqs)

    def add_staging_reqs(self, reqs):
        self.staging_queue.extend(reqs if isinstance(reqs, list) else [reqs])

    def is_empty(self):
        return len(self.waiting_queue) == 0

    def filter_finished_reqs(self):
        self.waiting_queue = [r for r in self.waiting_queue if not r.finished()]
        self.staging_queue = [r for r in self.staging_queue if not r.finished()]

    def init_next_round(self):
        self.staging_queue = []


# --- sglang.srt.managers.scheduler -------------------------------------------------------------------------


class Scheduler(SchedulerDllmMixin):
    def __init__(self, dllm_config, batch_capacity, max_total_num_tokens):
        self.dllm_config = dllm_config
        self.batch_capacity = batch_capacity
        self.max_total_num_tokens = max_total_num_tokens
        self.waiting_queue = []
        self.init_diffusion_llm()


MODULES = {
    "sglang.srt.dllm.config": SimpleNamespace(DllmConfig=DllmConfig),
    "sglang.srt.dllm.mixin.req": SimpleNamespace(DllmReqPhase=DllmReqPhase, ReqDllmMixin=ReqDllmMixin),
    "sglang.srt.dllm.mixin.scheduler": SimpleNamespace(SchedulerDllmMixin=SchedulerDllmMixin, DllmManager=DllmManager),
    "sglang.srt.dllm.algorithm.base": SimpleNamespace(DllmAlgorithm=DllmAlgorithm),
    "sglang.srt.layers.logits_processor": SimpleNamespace(LogitsProcessor=LogitsProcessor),
    "sglang.srt.managers.schedule_batch": SimpleNamespace(Req=Req, ScheduleBatch=ScheduleBatch),
    "sglang.srt.managers.scheduler": SimpleNamespace(Scheduler=Scheduler),
    "sglang.srt.model_executor.forward_batch_info": SimpleNamespace(ForwardMode=ForwardMode, ForwardBatch=ForwardBatch),
    "sglang.srt.model_executor.model_runner": SimpleNamespace(ModelRunner=ModelRunner),
}


def resolve(name: str):
    return MODULES[name]


def serve(scheduler: Scheduler, algorithm: DllmAlgorithm, runner: ModelRunner, max_steps: int = 100_000) -> dict:
    """Drive the fake server until every request is done; returns {rid: round it finished in}.

    A round is one model forward, so sync-mode steps count every forward they ran.
    """
    all_reqs = list(scheduler.waiting_queue)
    finished_at = {}
    for _ in range(max_steps):
        batch = scheduler.get_new_batch_dllm(None)
        if batch is None:
            break
        result = algorithm.run(runner, ForwardBatch(batch), None)
        scheduler.process_batch_result_dllm(batch, result)
        for req in batch.reqs:
            if req.finished() and req.rid not in finished_at:
                finished_at[req.rid] = runner.calls
        scheduler.dllm_manager.filter_finished_reqs()
    missing = [r.rid for r in all_reqs if r.rid not in finished_at]
    assert not missing, f"fake server stalled with {missing} unfinished"
    return finished_at
