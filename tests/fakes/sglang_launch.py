"""SGLang 0.5.23's launch side for the launcher, plugin and lifecycle tests, on a CPU.

From the wheel, unmodified (compiled from their source by ``sglang_reference.compile_functions``, or
imported where the module imports on a CPU):

- ``layers/dp_attention.compute_dp_attention_world_info`` with the ``runtime_context`` functions it
  calls (``derive_attn_tp_size``, ``derive_attention_ranks``): a TP rank's attention-DP group, as
  the data-parallel controller places schedulers;
- ``managers/scheduler.resolve_spawn_dp_rank``: a scheduler's DP rank, ``SGLANG_DP_RANK`` for none;
- ``arg_groups/model_override_base.resolved_view``: ``resolve_once``'s decisions over the raw flags;
- ``arg_groups/cuda_graph_hook.generate_decode_cuda_graph_batch_sizes``: the decode graph sizes;
- ``srt/plugins`` (``load_plugins``, ``load_plugins_by_group``, ``HookRegistry``): the plugin loader,
  over the installed entry points;
- ``dllm/config.DllmConfig.from_server_args``: the block size (and one-request default) SGLang runs a
  dLLM with, reading the model through the :class:`ModelConfig` stand-in (a ``config.json`` written
  by :func:`write_model`) and the arguments through the wheel's ``resolving_view``.

:func:`resolve` hands these out (and the CPU fake's modules, ``sglang_fake.resolve``) to
``HookConfig(resolver="fakes.sglang_launch:resolve")``.

Written here, for what needs a GPU (:func:`install_entrypoints` puts them in ``sys.modules``; each
mirrors the SGLang code it names): ``server_args.ServerArgs`` / ``prepare_server_args`` (a few flags;
``resolve_once`` declares, in SGLang's own declaration format, what ``memory_hook`` decides on an
H200, what ``parallel_hook`` makes of ``--enable-dp-attention`` and ``serving_hook``'s tokenizer
default), ``entrypoints.engine.Engine`` (its class attributes, ``__init__``'s order, and a
``_launch_subprocesses`` that records the scheduler function it would spawn in :data:`LAUNCHED`),
``entrypoints.http_server.launch_server`` (through ``Engine._launch_subprocesses``, as SGLang's does)
and ``utils.kill_process_tree`` (recorded in :data:`KILLED`), and ``managers.scheduler`` (the CPU
fake's ``Scheduler``, for ``serve --check``'s import). :func:`spawn_schedulers` starts scheduler
functions the way ``Engine._launch_scheduler_processes`` does; :func:`report_scheduler`, run there,
reports what the hook installed in that process. :func:`entrypoints` installs all of it for one test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import sglang_reference
from fakes import sglang_fake

SRC = sglang_reference.source_root() / "sglang" / "srt"
_SERVER = sglang_reference.load_server_config()  # resolved_view, CudaGraphConfig, PhaseConfig, Backend (the wheel's)
_RANKS = sglang_reference.compile_functions(SRC / "runtime_context.py", ("derive_attn_tp_size", "derive_attention_ranks"))
compute_dp_attention_world_info = sglang_reference.compile_functions(
    SRC / "layers" / "dp_attention.py", ("compute_dp_attention_world_info",), _RANKS)["compute_dp_attention_world_info"]
resolve_spawn_dp_rank = sglang_reference.compile_functions(
    SRC / "managers" / "scheduler.py", ("resolve_spawn_dp_rank",), {"os": os, "Optional": Optional})["resolve_spawn_dp_rank"]
generate_decode_cuda_graph_batch_sizes = sglang_reference.compile_functions(
    SRC / "arg_groups" / "cuda_graph_hook.py", ("generate_decode_cuda_graph_batch_sizes",),
    # the flags it reads, at SGLang's defaults (graph padding on, no speculative decoding)
    {"resolving_view": lambda server_args: SimpleNamespace(disable_cuda_graph_padding=False,
                                                           speculative_algorithm=None)},
)["generate_decode_cuda_graph_batch_sizes"]

MODULES = {
    "sglang.srt.layers.dp_attention": SimpleNamespace(compute_dp_attention_world_info=compute_dp_attention_world_info),
    "sglang.srt.managers.scheduler": SimpleNamespace(Scheduler=sglang_fake.Scheduler,
                                                     resolve_spawn_dp_rank=resolve_spawn_dp_rank),
    "sglang.srt.arg_groups.model_override_base": SimpleNamespace(resolved_view=_SERVER.resolved_view),
}


def resolve(name: str):
    return MODULES[name] if name in MODULES else sglang_fake.resolve(name)


# --- server arguments -----------------------------------------------------------------------------


class ServerArgs:
    """SGLang's ``ServerArgs``: the fields the launcher and the hook read, at SGLang's defaults."""

    def __init__(self, model_path=None, tokenizer_path=None, max_running_requests=None, dllm_algorithm=None,
                 dllm_algorithm_config=None, tp_size=1, dp_size=1, attn_dp_size=1, attn_cp_size=1,
                 enable_dp_attention=False, cuda_graph_max_bs_decode=None, log_level=None, gpu_memory_mb=143771,
                 max_total_tokens=None, dllm_fdfo=False, revision=None, trust_remote_code=False,
                 json_model_override_args="{}"):
        self.model_path, self.tokenizer_path = model_path, tokenizer_path
        self.max_running_requests, self.log_level = max_running_requests, log_level
        self.dllm_algorithm, self.dllm_algorithm_config = dllm_algorithm, dllm_algorithm_config
        self.max_total_tokens, self.dllm_fdfo, self.revision = max_total_tokens, dllm_fdfo, revision
        self.trust_remote_code, self.json_model_override_args = trust_remote_code, json_model_override_args
        self.tp_size, self.dp_size, self.attn_dp_size, self.attn_cp_size = tp_size, dp_size, attn_dp_size, attn_cp_size
        self.enable_dp_attention, self.cuda_graph_max_bs_decode = enable_dp_attention, cuda_graph_max_bs_decode
        self.cuda_graph_config = _SERVER.CudaGraphConfig()
        self.encoder_only = self.smg_grpc_mode = self.use_ray = False
        self.gpu_memory_mb = gpu_memory_mb  # what get_device_memory_capacity reports (an H200 by default)
        self._resolved_overrides = []
        self.resolutions = 0

    def resolve_once(self):
        """The declarations SGLang's resolution makes for these flags (idempotent, as SGLang's)."""
        self.resolutions += 1
        if self._resolved_overrides:
            return
        if self.enable_dp_attention and self.attn_dp_size == 1:  # parallel_hook._handle_deprecated_dp_attention
            self._resolved_overrides.append(("_handle_deprecated_dp_attention",
                                             {"attn_dp_size": self.dp_size, "dp_size": 1}))
        # memory_hook.handle_gpu_memory_settings, the H20/H200 branch (90-160 GB): decode graphs up to 256
        # at tp < 4, 512 beyond; a default capped at --max-running-requests; then the graph sizes
        assert 90 * 1024 <= self.gpu_memory_mb < 160 * 1024, "the stand-in knows the H200 branch only"
        max_bs = self.cuda_graph_max_bs_decode
        if max_bs is None:
            max_bs = 256 if self.tp_size < 4 else 512
            if self.max_running_requests is not None:
                max_bs = min(max_bs, self.max_running_requests)
        decode = _SERVER.PhaseConfig(backend=_SERVER.Backend.FULL, max_bs=max_bs,
                                     bs=generate_decode_cuda_graph_batch_sizes(self, max_bs))
        self._resolved_overrides.append(("_handle_gpu_memory_settings",
                                         {"cuda_graph_config": _SERVER.CudaGraphConfig(decode=decode)}))
        if self.tokenizer_path is None:  # serving_hook.handle_missing_default_values
            self._resolved_overrides.append(("_handle_missing_default_values", {"tokenizer_path": self.model_path}))


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    for flag, kind in (("--model-path", str), ("--tokenizer-path", str), ("--max-running-requests", int),
                       ("--dllm-algorithm", str), ("--dllm-algorithm-config", str), ("--tp-size", int),
                       ("--dp-size", int), ("--attn-dp-size", int), ("--cuda-graph-max-bs-decode", int),
                       ("--max-total-tokens", int), ("--revision", str), ("--json-model-override-args", str)):
        parser.add_argument(flag, type=kind)
    for flag in ("--enable-dp-attention", "--dllm-fdfo", "--trust-remote-code"):
        parser.add_argument(flag, action="store_true")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    return ServerArgs(**given)


class ModelConfig:
    """``configs.model_config.ModelConfig``: what ``DllmConfig.from_server_args`` reads of it, the model's
    ``config.json`` as ``hf_config`` (SGLang's loads it through transformers; sub-configs stay mappings)."""

    def __init__(self, hf_config):
        self.hf_config = hf_config
        self.vocab_size = getattr(hf_config, "vocab_size", None)

    @classmethod
    def from_server_args(cls, server_args, model_path=None, model_revision=None, **kwargs):
        config = json.loads((Path(model_path or server_args.model_path) / "config.json").read_text())
        return cls(SimpleNamespace(**config))


def write_model(directory, architecture="SDARForCausalLM", hidden_size=128, **config) -> Path:
    """A model directory as the launcher reads one before SGLang loads it: a ``config.json`` (a
    Qwen3 config, as SDAR's; ``config`` adds or replaces keys) and the tiny dLLM's tokenizer files
    (what the hook's admission features load), no weights."""
    from dwise_predict.dllm import TINY_MODEL_DIR

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL_DIR / name, directory / name)
    body = {"architectures": [architecture], "model_type": "qwen3", "vocab_size": 151680, "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, **config}
    (directory / "config.json").write_text(json.dumps(body))
    return directory


# --- entry points ---------------------------------------------------------------------------------

LAUNCHED: list = []  # (server_args, the scheduler function Engine._launch_subprocesses was given)
KILLED: list = []  # kill_process_tree's arguments
SHUT_DOWN: list = []  # engines whose shutdown ran


def report_scheduler(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    """Stand-in for ``run_scheduler_process`` in a spawned child: reports, through the pipe SGLang would
    use, what the DWISE hook installed in this process."""
    from dwise_predict.serving import launcher

    active = launcher.ACTIVE
    report = {"pid": os.getpid(), "hooked": active is not None}
    if active is not None:
        state = active.state
        report.update(
            patched=sorted(f"{owner.__name__}.{name}={getattr(owner, name).__module__}"
                           for owner, name, _ in active.originals),
            slots=state.slots, k=state.k, block_size=state.block_size,
            pooled_rows=None if state.pooled is None else int(state.pooled.shape[0]),
            prompt_cache=state.prompt_rows.capacity,
            recording=None if state.recorder is None else str(state.recorder.out),
            every=None if state.recorder is None else state.recorder.every,
            flush_s=None if state.recorder is None else state.recorder.flush_s,
        )
    pipe_writer.send(report)
    pipe_writer.close()


class Engine:
    """``entrypoints.engine.Engine``: the class attributes the launcher overrides, ``__init__``'s order
    (plugins, server arguments, ``_launch_subprocesses`` with ``run_scheduler_process_func``)."""

    server_args_class = ServerArgs
    run_scheduler_process_func = staticmethod(report_scheduler)  # SGLang's: scheduler.run_scheduler_process

    def __init__(self, **kwargs):
        importlib.import_module("sglang.srt.plugins").load_plugins()
        if "server_args" in kwargs:
            server_args = kwargs["server_args"]
        else:
            kwargs.setdefault("log_level", "error")
            server_args = self.server_args_class(**kwargs)
        self.server_args = server_args
        self._launch_subprocesses(server_args=server_args, init_tokenizer_manager_func=None,
                                  run_scheduler_process_func=self.run_scheduler_process_func,
                                  run_detokenizer_process_func=None)

    @classmethod
    def _launch_subprocesses(cls, server_args, init_tokenizer_manager_func, run_scheduler_process_func,
                             run_detokenizer_process_func, port_args=None, placement_group=None):
        server_args.resolve_once()
        LAUNCHED.append((server_args, run_scheduler_process_func))
        return None, None, port_args, None, None, []

    def shutdown(self):
        SHUT_DOWN.append(self)


def launch_server(server_args, init_tokenizer_manager_func=None, run_scheduler_process_func=report_scheduler,
                  run_detokenizer_process_func=None, execute_warmup_func=None, launch_callback=None):
    """``http_server.launch_server``: its subprocesses start through ``Engine._launch_subprocesses``."""
    Engine._launch_subprocesses(server_args=server_args, init_tokenizer_manager_func=init_tokenizer_manager_func,
                                run_scheduler_process_func=run_scheduler_process_func,
                                run_detokenizer_process_func=run_detokenizer_process_func)


def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
    KILLED.append({"parent_pid": parent_pid, "include_parent": include_parent})


def install_entrypoints(put=None) -> None:
    """Put the stand-ins where the launcher imports SGLang from (``put(modules, name, module)``:
    ``monkeypatch.setitem`` in a test, a plain assignment in a process of its own); the plugin
    loader is SGLang's own."""
    put = put or (lambda modules, name, module: modules.__setitem__(name, module))
    # SGLang's own DllmConfig (the wheel's dllm/config.py), reading the model through the ModelConfig
    # stand-in and its arguments through the wheel's resolving view
    dllm_config = vars(importlib.import_module("sglang.srt.dllm.config"))
    put(dllm_config, "ModelConfig", ModelConfig)
    put(dllm_config, "resolving_view", sys.modules["sglang.srt.arg_groups.model_override_base"].resolving_view)
    for name, attrs in {
        "sglang.srt.server_args": {"ServerArgs": ServerArgs, "prepare_server_args": prepare_server_args},
        "sglang.srt.entrypoints": {"__path__": []},
        "sglang.srt.entrypoints.engine": {"Engine": Engine},
        "sglang.srt.entrypoints.http_server": {"launch_server": launch_server},
        "sglang.srt.utils": {**vars(sys.modules["sglang.srt.utils"]), "kill_process_tree": kill_process_tree},
        "sglang.srt.managers.scheduler": vars(MODULES["sglang.srt.managers.scheduler"]),
    }.items():
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in attrs.items() if k not in ("__name__", "__spec__", "__loader__")})
        put(sys.modules, name, module)


def entrypoints(monkeypatch):
    """The stand-ins installed for one test (:func:`install_entrypoints`), with empty records of what
    was launched, killed and shut down; returns this module."""
    module = sys.modules[__name__]
    install_entrypoints(monkeypatch.setitem)
    for name in ("LAUNCHED", "KILLED", "SHUT_DOWN"):
        monkeypatch.setattr(module, name, [])
    return module


def spawn_schedulers(launches: list, timeout=180) -> list[dict]:
    """Run each ``(target, server_args, tp_rank, dp_rank)`` as ``Engine._launch_scheduler_processes`` runs
    a scheduler: a ``spawn`` child given (server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank,
    pipe_writer); all at once, as SGLang starts a server's schedulers. Returns their reports, in order."""
    ctx = mp.get_context("spawn")
    children = []
    for target, server_args, tp_rank, dp_rank in launches:
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=target, args=(server_args, None, 0, tp_rank, 0, dp_rank, writer))
        child.start()
        writer.close()
        children.append((child, reader))
    reports = []
    for child, reader in children:
        if not reader.poll(timeout):
            raise RuntimeError("a scheduler child sent nothing")
        reports.append(reader.recv())
    for child, _ in children:
        child.join(60)
    return reports


def main(argv: list[str]) -> None:
    """One launching process, as ``python -m sglang.launch_server ARGS`` starts one with the plugin's
    variables in its environment (and then, with ``--serve FLAGS-JSON``, as ``dwise-predict serve`` with
    those flags): prints, as JSON, the hook config each path hands SGLang and what a scheduler process
    it starts reports."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", help="HookConfig fields as JSON, for launcher.serve after the plugin path")
    args, sglang_argv = parser.parse_known_args(argv)
    install_entrypoints()
    from dwise_predict.serving import launcher

    plugins = importlib.import_module("sglang.srt.plugins")
    # sglang/launch_server.py: load_plugins(); prepare_server_args(argv); run_server -> launch_server
    plugins.load_plugins()
    server_args = prepare_server_args(sglang_argv)
    try:
        launch_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    paths = {"plugin": LAUNCHED[-1][1]}
    if args.serve:
        launcher.serve(launcher.HookConfig(**json.loads(args.serve)), sglang_argv)
        paths["serve"] = LAUNCHED[-1][1]
    out = {name: {"entry": type(entry).__name__, "config": launcher.describe(entry.config)
                  if isinstance(entry, launcher.SchedulerEntry) else None,
                  "target": getattr(entry, "target", None) if isinstance(getattr(entry, "target", None), str) else
                  getattr(getattr(entry, "target", None), "__qualname__", None)} for name, entry in paths.items()}
    if args.serve:
        out["serve"]["killed"] = KILLED[-1]
    # a scheduler child here cannot import SGLang: serve's entry runs the same stand-in the plugin's wraps.
    # The plugin's scheduler runs as the first TP rank, serve's as the last, each given the DP rank the
    # data-parallel controller gives it (its attention-DP group under attention DP, else none)
    view = _SERVER.resolved_view(server_args)
    launches = []
    for (name, entry), tp_rank in zip(paths.items(), (0, view.tp_size - 1)):
        placed = compute_dp_attention_world_info(tp_rank, view.tp_size, view.attn_dp_size, view.attn_cp_size)
        run = entry if name == "plugin" else launcher.SchedulerEntry(entry.config, target=report_scheduler)
        launches.append((run, server_args, tp_rank, placed[2] if view.attn_dp_size > 1 else None))
    reports = spawn_schedulers(launches)
    for name, report in zip(paths, reports):
        out[name]["report"] = report
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
