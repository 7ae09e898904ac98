"""The SGLang names the hook touches, their checks against the pinned source, and one object that
resolves them at install.

Pinned release: ``sglang==0.5.23``. Everything the hook touches in SGLang is listed in
:data:`SURFACE` (module, ``Class.member``, what we do with it, expected parameters);
``tests/test_sglang_surface.py`` checks that table against the real source when it is available and
against the committed snapshot ``tests/fakes/sglang_surface.json`` always. :class:`ResolvedSglang`
resolves what :func:`~dwise_predict.serving.sglang.install.install` patches and calls, once, through
the resolver it is given (tests pass a fake SGLang).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import ConfigError

SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Touch:
    """One thing in SGLang the hook depends on.

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
    # lifecycle: reconcile with SGLang's queues, follow the prefix match, and refuse one queued request
    # (it can never fit; its id is another's) as Scheduler._abort_on_queued_limit does, not through
    # abort_request (it matches ids by prefix)
    Touch(_SCHED, "DllmManager.staging_queue", "attribute"),
    # SGLang's own aborts (a client gone, its waiting timeout): the table settles them at once
    Touch("sglang.srt.managers.scheduler", "Scheduler.abort_request", "patch", ("self", "recv_req")),
    Touch("sglang.srt.managers.scheduler", "Scheduler._release_aborted_request", "call", ("self", "req")),
    Touch("sglang.srt.managers.scheduler", "Scheduler.send_abort_output", "call", ("self", "abort_req", "req")),
    Touch("sglang.srt.managers.scheduler", "Scheduler.beam_coordinator", "attribute"),
    Touch("sglang.srt.beam_search.coordinator", "BeamCoordinator.retire_group", "call", ("self", "req")),
    Touch("sglang.srt.managers.io_struct", "AbortReq.finished_reason", "attribute"),
    # the request rows this scheduler (one attention-DP worker) really has: k*B is held to them
    Touch("sglang.srt.managers.scheduler", "Scheduler.max_running_requests", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.req_to_token_pool", "attribute"),
    Touch("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool.size", "attribute"),
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
    # the live quality monitor: a request's category, as its client names it, and the monitor's gauges
    # beside the scheduler's own (made only under --enable-metrics, with the labels they carry)
    Touch("sglang.srt.sampling.sampling_params", "SamplingParams.custom_params", "attribute"),
    Touch("sglang.srt.managers.scheduler", "Scheduler.metrics_collector", "attribute"),
    Touch("sglang.srt.observability.metrics_collector", "SchedulerMetricsCollector.labels", "attribute"),
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


_IO = "sglang.srt.managers.io_struct"


class ResolvedSglang:
    """The SGLang classes and members the hook patches and calls, resolved once at install (before it
    patches: the methods it wraps are SGLang's own), and the ``AbortReq`` it refuses a request with.

    ``resolve``: module name -> module (``importlib.import_module``; tests pass a fake SGLang)."""

    def __init__(self, resolve):
        scheduler = resolve(_SCHED)
        phase = resolve("sglang.srt.dllm.mixin.req").DllmReqPhase
        self.forward_mode = resolve("sglang.srt.model_executor.forward_batch_info").ForwardMode
        self.continue_ = resolve("sglang.srt.managers.schedule_policy").AddReqResult.CONTINUE
        self.abort_req_class = resolve(_IO).AbortReq
        self.mixin = scheduler.SchedulerDllmMixin
        self.scheduler = resolve("sglang.srt.managers.scheduler").Scheduler
        self.algorithm = resolve("sglang.srt.dllm.algorithm.base").DllmAlgorithm
        self.logits = resolve("sglang.srt.layers.logits_processor").LogitsProcessor
        self.phase = phase
        # ReqDllmMixin.is_dllm_prefill as a set lookup (the phases are str enums, hashed as their strings):
        # the method builds a list and compares against it, about 0.3 µs per request and step
        self.prefill_phases = frozenset((phase.STAGING_PREFILL, phase.INCOMING_PREFILL))
        # what the hook wraps, as SGLang defines it (read before install patches them)
        self.process_dllm_batches = self.mixin._process_dllm_batches
        self.process_batch_result_dllm = self.mixin.process_batch_result_dllm
        self.abort_request = self.scheduler.abort_request
        self.run = self.algorithm.run
        self.get_dllm_logits = self.logits._get_dllm_logits

    def abort_req(self, rid, message: str):
        """An ``AbortReq`` for one request that carries ``message`` to the client (HTTP 400)."""
        return self.abort_req_class(rid=rid, finished_reason={"type": "abort", "message": message, "status_code": 400,
                                                              "err_type": "BadRequestError"})


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
