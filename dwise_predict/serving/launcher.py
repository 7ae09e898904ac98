"""Start SGLang with the DWISE hook installed inside its scheduler processes.

SGLang 0.5.23 starts each scheduler (one per TP/PP/DP rank) as a ``spawn`` child process
(``entrypoints/engine.py``): a patch applied in the launching process is not there. Both of its
entry points take the child's target as a parameter — ``http_server.launch_server(...,
run_scheduler_process_func=...)`` and ``Engine.run_scheduler_process_func`` — so we hand them a
:class:`SchedulerEntry`: a picklable callable that, in the child, loads the bundle on the rank's
GPU, calls :func:`~dwise_predict.serving.sglang_adapter.install` (before the model runner exists,
so before any CUDA graph is captured) and then runs SGLang's own ``run_scheduler_process``.

Shell::

    dwise-predict serve --bundle bundle/ -- --model-path inclusionAI/LLaDA2.0-mini --dllm-algorithm LowConfidence \\
        --dllm-fdfo --max-running-requests 1024 --port 30000

Python::

    from dwise_predict.serving.launcher import HookConfig, engine, serve
    serve(HookConfig(bundle="bundle/", slots=128, k=8), ["--model-path", "...", "--dllm-fdfo"])   # HTTP server
    llm = engine(HookConfig(bundle="bundle/"), model_path="...", dllm_algorithm="LowConfidence")  # offline Engine

Recording mode (``HookConfig(record="traces/")``): each DP rank's scheduler (TP rank 0) writes
contract-1 shards of the requests it finished to ``traces/dp<rank>/``; ``dwise-predict traces merge``
joins them. See ``docs/serving.md``.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.files import loads_json

RUN_SCHEDULER_PROCESS = "sglang.srt.managers.scheduler:run_scheduler_process"
ACTIVE = None  # the Installed handle of this process (set in a scheduler child)


@dataclass(frozen=True)
class HookConfig:
    """Everything a scheduler child needs to install the hook (plain values: it crosses ``spawn``).

    bundle : predictor bundle directory, or None (rank by prompt blocks only: ``r̂ = 0``).
    slots, k : ``B`` and the resident-set multiplier (SGLang's ``--max-running-requests`` >= k*B).
    kv_budget_tokens, kv_fraction, slack_blocks : KV reservations (see ``sglang_adapter.install``).
    block_size : SGLang's dLLM block size; default the bundle's.
    max_batch : the largest batch of one forward; default the larger of ``slots`` and what the
        server can run in one forward (:func:`largest_forward`: its largest CUDA-graph batch or
        ``--max-running-requests``).
    hidden_size : the model's hidden size (recording without a bundle); default the bundle's.
    tokenizer : tokenizer directory or hub id for the admission features (prompt text); default
        the server's ``--tokenizer-path`` or ``--model-path``.
    record : directory for recording mode, or None.
    record_every : requests per committed shard while recording.
    prompt_cache : block rows the hook keeps for requests that a prefix-cache hit leaves without a
        prompt block of their own (``sglang_adapter.install``; 0: none).
    resolver : ``"module:function"`` that resolves SGLang module names (tests pass a fake); None
        imports SGLang.
    """

    bundle: str | None = None
    slots: int = 128
    k: float = 8
    kv_budget_tokens: float | None = None
    kv_fraction: float = 0.9
    slack_blocks: int = 2
    block_size: int | None = None
    max_batch: int | None = None
    hidden_size: int | None = None
    tokenizer: str | None = None
    record: str | None = None
    record_every: int = 64
    prompt_cache: int = 4096
    resolver: str | None = None

    def problems(self) -> list[str]:
        out = []
        if self.slots < 1:
            out.append(f"--slots must be positive, got {self.slots}")
        if self.k < 1:
            out.append(f"--k must be at least 1, got {self.k}")
        if self.bundle is not None and not (Path(self.bundle) / "bundle.json").is_file():
            out.append(f"--bundle {self.bundle} has no bundle.json: pass a directory written by `dwise-predict export`")
        if self.bundle is None and self.record is None:
            out.append("nothing to do: pass --bundle (schedule with DWISE), --record (collect traces), or both")
        if self.record_every < 1:
            out.append(f"--record-every must be positive, got {self.record_every}")
        if self.prompt_cache < 0:
            out.append(f"--prompt-cache must be 0 or more, got {self.prompt_cache}")
        return out


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def largest_forward(server_args) -> int:
    """The most requests one dLLM forward of this server can hold (what the hook's pooling buffer
    needs), from its *resolved* arguments (SGLang's ``resolved_view``: ``resolve_once`` records its
    decisions beside the raw flags). SGLang's decode graph runner captures ``DLLM_EXTEND`` at every
    size of ``cuda_graph_config.decode.bs`` (by default up to 256 on an H100/H200 at tp < 4, 512
    beyond), and eager batches run up to ``--max-running-requests``: the larger of the two."""
    decode = getattr(getattr(server_args, "cuda_graph_config", None), "decode", None)
    sizes = [*(getattr(decode, "bs", None) or ()), getattr(decode, "max_bs", None),
             getattr(server_args, "max_running_requests", None)]
    return max([int(size) for size in sizes if size] or [0])


def resolved(config: HookConfig, server_args=None) -> HookConfig:
    """Fill block size, hidden size, batch and tokenizer from the bundle and the server arguments
    (``server_args``: SGLang's resolved view of them, see :func:`largest_forward`)."""
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    block_size, hidden, tokenizer = config.block_size, config.hidden_size, config.tokenizer
    if config.bundle is not None:
        path = Path(config.bundle) / "bundle.json"  # bounded: deeply nested JSON is one line, not a RecursionError
        manifest = loads_json(path.read_bytes(), BundleError, str(path), "re-export the bundle")
        block_size = block_size or (manifest.get("decoding") or {}).get("block_size")
        hidden = hidden or (manifest.get("model") or {}).get("hidden_size")
        if server_args is not None:
            check_served_algorithm(manifest, config.bundle, server_args)
    max_batch = config.max_batch
    if server_args is not None:
        max_batch = max_batch or max(config.slots, largest_forward(server_args))
        tokenizer = tokenizer or getattr(server_args, "tokenizer_path", None) or getattr(server_args, "model_path", None)
    missing = [flag for flag, value in (("--block-size", block_size), ("--hidden-size", hidden if config.record else 1))
               if not value]
    if missing:
        raise ConfigError(f"the hook needs {' and '.join(missing)} (the model's dLLM block size and hidden size; "
                          "a bundle carries both): pass them")
    return replace(config, block_size=int(block_size), hidden_size=int(hidden) if hidden else None,
                   max_batch=int(max_batch or config.slots), tokenizer=tokenizer)


def served_algorithm(server_args, block_size: int | None = None) -> dict | None:
    """The decoding SGLang will run, from its arguments, before it starts: ``--dllm-algorithm`` and
    the ``--dllm-algorithm-config`` file read as SGLang reads them
    (:func:`~dwise_predict.engine.algorithms.served_decoding`), with the file's ``block_size``, else
    ``block_size``. None for a server without a dLLM algorithm."""
    from dwise_predict.engine.algorithms import AlgorithmConfig, read_algorithm_file, served_decoding

    algorithm = getattr(server_args, "dllm_algorithm", None)
    if algorithm is None:
        return None
    path = getattr(server_args, "dllm_algorithm_config", None)
    raw = read_algorithm_file(path) if path else {}
    return served_decoding(algorithm, raw, AlgorithmConfig.from_mapping(raw, "--dllm-algorithm-config").block_size
                           or block_size)


def check_served_algorithm(manifest: dict, bundle: str, server_args) -> None:
    """Refuse, before SGLang loads the model, a bundle trained for another algorithm or parameters
    (or the block size the algorithm config file names) than the server will run. The hook checks
    again on its first step, against the scheduler's ``DllmConfig``, block size included."""
    from dwise_predict.engine.algorithms import comparable_decoding
    from dwise_predict.serving.bundle import check_compatible

    served = served_algorithm(server_args)
    if served is not None:
        check_compatible(manifest, None, comparable_decoding((manifest.get("decoding") or {}).get("algorithm"), served),
                         bundle)


class SchedulerEntry:
    """SGLang's ``run_scheduler_process`` with the DWISE hook installed first, in the child process.

    Picklable (a plain config and a target path), so SGLang can hand it to ``spawn``. ``target`` is
    ``"module:function"`` of the scheduler main to run after installing (tests pass a stand-in).
    """

    def __init__(self, config: HookConfig, target: str = RUN_SCHEDULER_PROCESS):
        self.config = config
        self.target = target

    def __call__(self, *args, **kwargs):
        # run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, ...)
        names = ("server_args", "port_args", "gpu_id", "tp_rank", "pp_rank", "dp_rank")
        ranks = {name: kwargs.get(name, args[i] if i < len(args) else None) for i, name in enumerate(names)}
        install_in_this_process(self.config, ranks["server_args"], gpu_id=ranks["gpu_id"] or 0,
                                tp_rank=ranks["tp_rank"] or 0, pp_rank=ranks["pp_rank"] or 0,
                                dp_rank=ranks["dp_rank"] or 0)
        return _load(self.target)(*args, **kwargs)


def install_in_this_process(config: HookConfig, server_args=None, gpu_id: int = 0, tp_rank: int = 0, pp_rank: int = 0,
                            dp_rank: int = 0):
    """Install the hook in the current (scheduler) process; returns the ``Installed`` handle.
    ``server_args``: SGLang's, whose decoding a recording is made in (:func:`served_algorithm`)."""
    global ACTIVE
    from dwise_predict.serving.sglang_adapter import install

    device = _device(gpu_id)
    bundle = None
    if config.bundle is not None:
        from dwise_predict.serving.bundle import load_bundle

        bundle = load_bundle(config.bundle, backend="torch", device=device)
    features = _features(config.tokenizer) if bundle is not None or config.record else None
    recorder = None
    if config.record is not None and tp_rank == 0 and pp_rank == 0:
        # recording is a collector: its writer lives in collectors/ (see tests/test_layering.py)
        from dwise_predict.collectors.live import LiveRecorder

        recorder = LiveRecorder(Path(config.record) / f"dp{dp_rank}", block_size=config.block_size,
                                features=features, every=config.record_every, bundle=config.bundle,
                                decoding=served_algorithm(server_args, config.block_size))
    resolve = _load(config.resolver) if config.resolver else importlib.import_module
    ACTIVE = install(bundle, slots=config.slots, k=config.k, kv_budget_tokens=config.kv_budget_tokens,
                     kv_fraction=config.kv_fraction, slack_blocks=config.slack_blocks, features=features,
                     device=device if (bundle is not None or recorder is not None) else None, resolve=resolve,
                     block_size=config.block_size, max_batch=config.max_batch, hidden_size=config.hidden_size,
                     recorder=recorder, prompt_cache=config.prompt_cache)
    return ACTIVE


def _device(gpu_id: int) -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return f"cuda:{gpu_id}" if torch.cuda.is_available() else "cpu"


def _features(tokenizer: str | None):
    """``req -> (words, newlines, prompt_tokens)``: SGLang's ``Req`` holds the chat-templated ids, so
    the words and newlines are counted over the user's text inside them, as ``collect`` counts them
    (:meth:`PromptFeaturizer.user_text`); over the whole decoded input where the template cannot be
    stripped (a system prompt or several turns: the template's markup then counts too)."""
    from dwise_predict.features.prompt import PromptFeaturizer, count_newlines, count_words

    featurizer = None
    if tokenizer:
        from transformers import AutoTokenizer

        featurizer = PromptFeaturizer(AutoTokenizer.from_pretrained(tokenizer))

    def features(req):
        text = getattr(req, "_dwise_text", None)
        if text is None:
            ids = list(req.origin_input_ids)
            text = "" if featurizer is None else featurizer.user_text(ids)
            if text is None:
                text = featurizer.tokenizer.decode(ids)
            req._dwise_text = text
        return (count_words(text), count_newlines(text), len(req.origin_input_ids))

    return features


def serve(config: HookConfig, sglang_argv: list[str]) -> None:
    """``sglang serve`` / ``python -m sglang.launch_server`` with the hook in every scheduler process.

    ``sglang_argv`` are SGLang's own server arguments. Runs until the server stops.
    """
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args
    except ImportError as err:
        raise ConfigError(f"dwise-predict serve needs sglang==0.5.23 installed in this environment ({err})") from None
    load_plugins()
    server_args = prepare_server_args(list(sglang_argv))
    server_args.resolve_once()
    for flag in ("encoder_only", "smg_grpc_mode", "use_ray"):
        if getattr(server_args, flag, False):
            raise ConfigError(f"dwise-predict serve runs SGLang's HTTP server only; drop --{flag.replace('_', '-')}")
    launch_server(server_args, run_scheduler_process_func=SchedulerEntry(resolved(config, resolved_view(server_args))))


def engine(config: HookConfig, **engine_kwargs):
    """An offline ``sglang.Engine`` whose scheduler processes run with the hook installed."""
    from sglang.srt.entrypoints.engine import Engine

    entry = SchedulerEntry(resolved(config))
    hooked = type("DwiseEngine", (Engine,), {"run_scheduler_process_func": staticmethod(entry)})
    return hooked(**engine_kwargs)


def describe(config: HookConfig) -> dict:
    """The config as plain JSON (for `serve --json` and logs)."""
    return asdict(config)
