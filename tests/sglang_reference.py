"""SGLang 0.5.23's own dLLM code, importable on a CPU: the reference our engine module is tested against.

``scripts/fetch_sglang.py`` unpacks the wheel's Python source. SGLang cannot be imported whole here
(its package ``__init__`` and many modules need CUDA kernels), so :func:`load` registers empty
parent packages that point at the unpacked tree and the smallest stand-ins for the few GPU-side
names the dLLM modules import (``ForwardBatch``, ``ModelRunner``, ``LogitsProcessorOutput``,
``ServerArgs``, ``is_npu`` …). Everything the tests call — the algorithm classes, ``_run_sync``,
``DllmConfig``, ``ReqDllmMixin``, ``Req.update_finish_state`` — is SGLang's code, unmodified.
"""

from __future__ import annotations

import ast
import enum
import importlib
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from fetch_sglang import is_complete, source_root  # noqa: E402

SKIP_REASON = ("SGLang 0.5.23's source is not here: run `python scripts/fetch_sglang.py` (fetches the 39 MB wheel "
               "from PyPI, no install) to check the engine semantics against SGLang's own code")


def available() -> bool:
    return is_complete(source_root())


@dataclass
class ForwardBatch:
    """Stand-in for ``forward_batch_info.ForwardBatch``: the fields the dLLM algorithms read."""

    batch_size: int
    input_ids: torch.Tensor  # (batch_size * block_size,)
    dllm_prompt_mask: torch.Tensor | None = None

    def mark_forward_metadata_ready(self, replan_equivalent: bool = True) -> None:
        pass


@dataclass
class LogitsProcessorOutput:
    full_logits: torch.Tensor


@dataclass
class ForwardOutput:
    logits_output: LogitsProcessorOutput
    can_run_graph: bool = False


class ModelRunner:
    """Stand-in for ``model_runner.ModelRunner``: ``forward`` asks ``logits_fn`` and counts the calls."""

    def __init__(self, logits_fn):
        self.logits_fn = logits_fn
        self.forwards = 0

    def forward(self, forward_batch, pp_proxy_tensors=None) -> ForwardOutput:
        self.forwards += 1
        return ForwardOutput(LogitsProcessorOutput(self.logits_fn(forward_batch.input_ids.clone(), self.forwards)))


def _module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    if path is not None:
        module.__path__ = [str(path)]
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


class _Placeholder:
    """A name that is imported for type hints only."""


class AddReqResult(enum.Enum):
    """``schedule_policy.AddReqResult`` (the same three members)."""

    CONTINUE = enum.auto()
    NO_TOKEN = enum.auto()
    OTHER = enum.auto()


@dataclass
class SamplingParams:
    """Stand-in for ``sampling.sampling_params.SamplingParams`` after ``normalize``: the fields the
    finish rule reads, at SGLang's defaults (no stop strings or regexes, EOS not ignored)."""

    max_new_tokens: int
    ignore_eos: bool = False
    stop_token_ids: set | None = None
    stop_strs: list = field(default_factory=list)
    stop_regex_strs: list = field(default_factory=list)


# schedule_batch.Req's finish rule: what ends a request after the scheduler appends a block's tokens
FINISH_METHODS = ("finished", "update_finish_state", "_check_vocab_boundary_finish", "_check_str_based_finish",
                  "_check_token_based_finish", "_cap_finished_len_at_max_new_tokens")
FINISH_REASONS = ("BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX",
                  "FINISH_LENGTH", "FINISH_ABORT")


def compile_members(path: Path, owner: str, methods: tuple[str, ...], classes: tuple[str, ...] = (),
                    namespace: dict | None = None) -> dict:
    """Methods of class ``owner`` and whole module-level ``classes`` of an SGLang module that cannot
    be imported on a CPU, compiled from its syntax tree as written (tracebacks keep SGLang's file and
    line numbers); the methods become the class ``{owner}Methods``. Returns name -> object.

    ``namespace``: the module-level names the compiled code reads at run time, for a module whose
    imports need CUDA (stand-ins, named by the caller). Annotations are not evaluated (SGLang's
    modules say ``from __future__ import annotations``)."""
    import __future__

    tree = ast.parse(path.read_text(), str(path))
    defined = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found = [node for node in defined[owner].body if isinstance(node, ast.FunctionDef) and node.name in methods] \
        if owner in defined else []
    missing = set(methods) - {m.name for m in found} | set(classes) - set(defined)
    if missing:
        raise RuntimeError(f"SGLang's {path.name} no longer defines {sorted(missing)}")
    holder = ast.ClassDef(name=f"{owner}Methods", bases=[], keywords=[], body=found or [ast.Pass()], decorator_list=[],
                          type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[defined[n] for n in classes] + [holder], type_ignores=[]))
    import re
    from typing import List, Optional, Set, Union

    names = {"re": re, "List": List, "Optional": Optional, "Set": Set, "Union": Union, **(namespace or {})}
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), names)
    return {name: names[name] for name in (*classes, f"{owner}Methods")}


def compile_functions(path: Path, names: tuple[str, ...], namespace: dict | None = None) -> dict:
    """Module-level functions of an SGLang module that cannot be imported on a CPU, compiled from its
    syntax tree as written (tracebacks keep SGLang's file and line numbers), with ``namespace`` as
    their globals: the names they call, given by the caller (stand-ins, or other functions compiled
    the same way). Returns name -> function."""
    tree = ast.parse(path.read_text(), str(path))
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in found}
    if missing:
        raise RuntimeError(f"SGLang's {path.name} no longer defines {sorted(missing)}")
    for node in found:
        node.decorator_list = []
    import __future__

    scope = dict(namespace or {})
    module = ast.fix_missing_locations(ast.Module(body=found, type_ignores=[]))
    # annotations stay strings: the types they name are the module's imports, not needed to run
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), scope)
    return {name: scope[name] for name in names}


def _finish_rule(path: Path) -> types.SimpleNamespace:
    """``Req``'s finish rule (``ReqFinishMixin``: the :data:`FINISH_METHODS`) and the finish reasons,
    from SGLang's ``schedule_batch.py`` (fifty imports, CUDA kernels among them: see
    :func:`compile_members`). The attributes they read are ``Req.__init__``'s: see
    :func:`init_finish_state`."""
    members = compile_members(path, "Req", FINISH_METHODS, FINISH_REASONS)
    return types.SimpleNamespace(ReqFinishMixin=members.pop("ReqMethods"), **members)


def init_finish_state(req, max_new_tokens: int, eos_token_ids) -> None:
    """The fields ``Req.__init__`` gives a request that the finish rule reads: no tokenizer-side
    stops, no grammar, no vocabulary bound (token ids are checked for being negative only)."""
    req.sampling_params = SamplingParams(max_new_tokens)
    req.eos_token_ids = set(eos_token_ids)
    req.finished_reason = req.finished_len = req.to_finish = req.grammar = req.tokenizer = req.vocab_size = None


def _unused(*args, **kwargs):
    raise NotImplementedError("a GPU-side SGLang function the CPU fake must not reach")


def _forward_mode() -> type:
    """``forward_batch_info.ForwardMode`` (every member: ``DLLM_EXTEND``, ``EXTEND``, ``IDLE`` … and
    its ``is_*`` tests), compiled from the wheel: the module itself needs CUDA."""
    path = source_root() / "sglang" / "srt" / "model_executor" / "forward_batch_info.py"
    return compile_members(path, "ForwardMode", (), ("ForwardMode",),
                           {"IntEnum": enum.IntEnum, "auto": enum.auto})["ForwardMode"]


def load() -> types.SimpleNamespace:
    """Import SGLang's dLLM modules from the unpacked wheel; skip the test when it is not there."""
    if not available():
        pytest.skip(SKIP_REASON)
    if "sglang.srt.dllm.algorithm" not in sys.modules:
        src = source_root() / "sglang"
        _module("sglang", src)
        _module("sglang.srt", src / "srt")
        for package in ("layers", "model_executor", "arg_groups", "configs"):
            _module(f"sglang.srt.{package}", src / "srt" / package)
        _module("sglang.srt.layers.logits_processor", LogitsProcessorOutput=LogitsProcessorOutput)
        _module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=ForwardBatch,
                ForwardMode=_forward_mode())
        _module("sglang.srt.model_executor.model_runner", ModelRunner=ModelRunner)
        _module("sglang.srt.server_args", ServerArgs=_Placeholder)
        _module("sglang.srt.utils", is_npu=lambda: False)
        _module("sglang.srt.arg_groups.overrides", resolving_view=None)
        _module("sglang.srt.configs.model_config", ModelConfig=_Placeholder)
    algorithm = importlib.import_module("sglang.srt.dllm.algorithm")
    return types.SimpleNamespace(
        finish=_finish_rule(source_root() / "sglang" / "srt" / "managers" / "schedule_batch.py"),
        # Req's prefix bound for a radix-cache lookup (reads dllm_config, return_logprob, logprob_start_len)
        ReqPrefixMixin=compile_members(source_root() / "sglang" / "srt" / "managers" / "schedule_batch.py",
                                       "Req", ("_compute_max_prefix_len",))["ReqMethods"],
        # ModelConfig's stop ids (reads hf_config and hf_generation_config: give it both)
        ModelConfigStops=compile_members(source_root() / "sglang" / "srt" / "configs" / "model_config.py",
                                         "ModelConfig", ("_get_hf_eos_token_id",))["ModelConfigMethods"],
        algorithms=algorithm.algo_name_to_cls,
        ForwardMode=sys.modules["sglang.srt.model_executor.forward_batch_info"].ForwardMode,
        DllmConfig=importlib.import_module("sglang.srt.dllm.config").DllmConfig,
        req=importlib.import_module("sglang.srt.dllm.mixin.req"),
        ForwardBatch=ForwardBatch,
        ModelRunner=ModelRunner,
    )


def make_algorithm(sgl, name: str, block_size: int, mask_id: int, params: dict | None = None,
                   delete_token_id: int | None = None, split_token_id: int | None = None):
    """SGLang's algorithm ``name`` built from a real ``DllmConfig`` (synchronous mode)."""
    config = sgl.DllmConfig(algorithm=name, algorithm_config=dict(params or {}), block_size=block_size,
                            mask_id=mask_id, max_running_requests=1, delete_token_id=delete_token_id,
                            split_token_id=split_token_id)
    return sgl.algorithms[name](config)


def load_scheduler() -> types.SimpleNamespace:
    """SGLang's ``srt/dllm/mixin/scheduler.py`` (``SchedulerDllmMixin``, ``DllmManager``), unmodified.

    Its module-level imports beyond :func:`load`'s are the GPU-side scheduler modules
    (``schedule_batch``, ``schedule_policy``, ``mem_cache.common``, ``observability``,
    ``runtime_context``); they get stand-ins that hold the names it imports: the enums it reads
    (``AddReqResult``, ``ForwardMode``) with SGLang's members, and functions that refuse to run for
    the rest (the fake scheduler overrides the methods that would call them).
    """
    sgl = load()
    if "sglang.srt.dllm.mixin.scheduler" not in sys.modules:
        src = source_root() / "sglang"
        for package in ("managers", "mem_cache", "observability"):
            if f"sglang.srt.{package}" not in sys.modules:
                _module(f"sglang.srt.{package}", src / "srt" / package)
        _module("sglang.srt.managers.schedule_batch", FINISH_LENGTH=sgl.finish.FINISH_LENGTH, Req=_Placeholder,
                ScheduleBatch=_Placeholder)
        _module("sglang.srt.managers.schedule_policy", AddReqResult=AddReqResult, PrefillAdder=_Placeholder)
        _module("sglang.srt.mem_cache.common", release_kv_cache=_unused)
        _module("sglang.srt.observability.req_time_stats", set_time_batch=lambda reqs, name: None)
        _module("sglang.srt.runtime_context", get_exec=_unused, get_schedule=_unused)
    scheduler = importlib.import_module("sglang.srt.dllm.mixin.scheduler")
    return types.SimpleNamespace(
        **vars(sgl), SchedulerDllmMixin=scheduler.SchedulerDllmMixin, DllmManager=scheduler.DllmManager,
        AddReqResult=AddReqResult, scheduler_module=scheduler,
        base=importlib.import_module("sglang.srt.dllm.algorithm.base"),
    )


def load_adder() -> types.SimpleNamespace:
    """SGLang's ``PrefillAdder`` (``managers/schedule_policy.py``: its ``__init__`` and every method the
    dLLM path runs — ``add_one_req``, ``add_dllm_staging_req``, the token budgets ``rem_input_tokens``
    (``--max-prefill-tokens``), ``rem_chunk_tokens`` and ``rem_dllm_tokens``, ``budget_state``) over
    SGLang's ``PrefillBudget`` (``mem_cache/prefill_budget.py``: KV memory, what is free plus what the
    radix cache could evict, less what this step reserved), compiled from the wheel. Stand-ins answer
    for a plain token pool on CUDA: no mamba, SWA, HiCache, KV sharding, AMD tile budget or prefill
    delayer, and the encoder-replay feature off (those branches are never taken)."""
    sgl = load_scheduler()
    root = source_root() / "sglang" / "srt"
    budget = compile_members(root / "mem_cache" / "prefill_budget.py", "PrefillBudget", (), ("PrefillBudget",),
                             {"is_swa_req_ring": _unused})["PrefillBudget"]
    from contextlib import contextmanager, nullcontext

    class _NotThisPool:  # allocator and cache classes the adder tells apart with isinstance
        pass

    namespace = {
        "AddReqResult": AddReqResult, "contextmanager": contextmanager, "nullcontext": nullcontext,
        "dataclass": dataclass, "CLIP_MAX_NEW_TOKENS": 4096, "_IS_HIP": False, "PREFILL_TILE_BUDGET": 0,
        "mamba_prefill_chunk_grid": lambda: 1, "_use_exact_chunk_fill": lambda: False,
        "page_interleave_shard_size": lambda allocator: 1,
        "get_exec": lambda: types.SimpleNamespace(features=types.SimpleNamespace(enable_encoder_swa_bounded_replay=False)),
        "get_schedule": lambda: types.SimpleNamespace(schedule_policy="fcfs"),
        **{name: _NotThisPool for name in ("SWATokenToKVPoolAllocator", "DeepSeekV4HiSparseTokenToKVPoolAllocator",
                                           "UnifiedMambaTokenToKVPoolAllocator", "UnifiedMambaSWATokenToKVPoolAllocator",
                                           "UnifiedRadixCache")},
    }
    methods = ("__init__", "_init_dllm_meta", "rem_total_tokens", "cur_rem_tokens", "_swa_new_tokens",
               "_check_prefill_budget", "_mamba_gap_budget_for_req", "_request_slot_reserve_for_req", "ceil_paged_tokens",
               "budget_state", "_update_prefill_budget", "_replay_len", "_get_dllm_remain_tokens", "_get_dllm_extend_len",
               "add_dllm_staging_req", "_lock_node", "_defer_staged_for_capacity_if_idle", "add_one_req",
               "_select_prefill_admission", "_commit_prefill_admission", "_check_prefill_tile_budget")
    members = compile_members(root / "managers" / "schedule_policy.py", "PrefillAdder", methods, ("_PrefillAdmission",),
                              namespace)
    return types.SimpleNamespace(PrefillAdderMethods=members["PrefillAdderMethods"], PrefillBudget=budget,
                                 CLIP_MAX_NEW_TOKENS=namespace["CLIP_MAX_NEW_TOKENS"])


def load_pause() -> types.SimpleNamespace:
    """SGLang's ``Scheduler.pause_generation`` / ``continue_generation`` (``managers/scheduler.py``)
    and ``Req.reset_for_retract`` (``managers/schedule_batch.py``), compiled from the wheel: what a
    ``pause_generation(mode="retract")`` does to a dLLM server's queues. ``retract_all`` is SGLang's
    loop over ``release_req``, whose KV release (``release_kv_cache``, ``evict_from_tree_cache``) is
    the pool's ``release(req)``; no disaggregation, overlap or HiSparse."""
    import time

    root = source_root() / "sglang" / "srt" / "managers"
    disaggregation = enum.Enum("DisaggregationMode", {"NULL": "null", "PREFILL": "prefill", "DECODE": "decode"})

    def retract_all(*, reqs, token_to_kv_pool_allocator, **pools):
        for req in reqs:  # release_req: the KV first, then the request's own reset
            token_to_kv_pool_allocator.release(req)
            req.reset_for_retract()

    members = compile_members(root / "scheduler.py", "Scheduler", ("pause_generation", "continue_generation"), (),
                              {"time": time, "DisaggregationMode": disaggregation, "retract_all": retract_all})
    reset = compile_members(root / "schedule_batch.py", "Req", ("reset_for_retract",))["ReqMethods"]
    return types.SimpleNamespace(SchedulerPause=members["SchedulerMethods"], ReqRetract=reset,
                                 DisaggregationMode=disaggregation)


class RowSizing:
    """SGLang's ``KVCacheConfigurator.resolve_max_num_reqs`` for a worker without mamba layers:
    ``rows(flag, attn_dp_size, token_capacity, context_len)``. The compiled method reads
    ``--max-running-requests`` from ``get_schedule()``, which this object answers (as set for the call)."""

    max_mamba_cache_size = None

    def __init__(self, path: Path):
        import logging

        self.max_running_requests = None
        self.method = compile_members(path, "KVCacheConfigurator", ("resolve_max_num_reqs",), (),
                                      {"get_schedule": self.schedule, "logger": logging.getLogger("sglang")}
                                      )["KVCacheConfiguratorMethods"].resolve_max_num_reqs

    def schedule(self):
        return self

    def rows(self, max_running_requests, attn_dp_size, token_capacity, context_len) -> int:
        self.max_running_requests = max_running_requests
        worker = types.SimpleNamespace(attn_dp_size=attn_dp_size, mambaish_config=None,
                                       model_config=types.SimpleNamespace(context_len=context_len))
        return self.method(worker, token_capacity)


def load_row_pool() -> types.SimpleNamespace:
    """SGLang's request-row pool and its size, compiled from the wheel, unmodified:
    ``ReqToTokenPool`` (``mem_cache/memory_pool.py``: ``available_size``, ``alloc``, ``alloc_rows``,
    ``free``, ``free_rows``: a request takes a row when its first batch is prepared and gives it back
    in ``release_kv_cache``) and ``KVCacheConfigurator.resolve_max_num_reqs``
    (``mem_cache/kv_cache_configurator.py``: each attention-DP worker gets ``--max-running-requests //
    attn_dp_size`` rows, at most half its KV token pool), as ``rows_per_worker(flag, attn_dp_size,
    token_capacity, context_len)`` (:class:`RowSizing`)."""
    root = source_root() / "sglang" / "srt" / "mem_cache"
    pool = compile_members(root / "memory_pool.py", "ReqToTokenPool",
                           ("available_size", "alloc", "alloc_rows", "free", "free_rows"))["ReqToTokenPoolMethods"]
    return types.SimpleNamespace(ReqToTokenPoolMethods=pool,
                                 rows_per_worker=RowSizing(root / "kv_cache_configurator.py").rows)


def load_server_config() -> types.SimpleNamespace:
    """SGLang's resolved-arguments view (``arg_groups/model_override_base.py``: ``resolved_view``,
    what ``resolve_once`` decided laid over the raw arguments) and its CUDA-graph settings
    (``model_executor/cuda_graph_config.py``: ``CudaGraphConfig``, ``PhaseConfig``, ``Backend``),
    unmodified; stand-ins answer as a CUDA machine for the platform queries they import."""
    sgl = load_scheduler()
    if "sglang.srt.arg_groups.model_override_base" not in sys.modules:
        sys.modules["sglang.srt.runtime_context"].get_platform = _unused
        sys.modules["sglang.srt.utils"].is_cuda = lambda: True
        _module("sglang.srt.platforms", current_platform=None)
        _module("sglang.srt.utils.common", is_mps=_unused, is_no_spec_infer_or_topk_one=_unused)
    views = importlib.import_module("sglang.srt.arg_groups.model_override_base")
    graphs = importlib.import_module("sglang.srt.model_executor.cuda_graph_config")
    return types.SimpleNamespace(**vars(sgl), resolved_view=views.resolved_view, CudaGraphConfig=graphs.CudaGraphConfig,
                                 PhaseConfig=graphs.PhaseConfig, Backend=graphs.Backend)
