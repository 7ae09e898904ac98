"""Start SGLang with the DWISE hook installed inside its scheduler processes.

SGLang 0.5.23 starts each scheduler (one per TP/PP/DP rank) as a ``spawn`` child process
(``entrypoints/engine.py``): a patch applied in the launching process is not there. Both of its
entry points take the child's target as a parameter — ``http_server.launch_server(...,
run_scheduler_process_func=...)`` and ``Engine.run_scheduler_process_func`` — so we hand them a
:class:`SchedulerEntry`: a picklable callable that, in the child, loads the bundle on the rank's
GPU, calls :func:`~dwise_predict.serving.sglang.install` (before the model runner exists,
so before any CUDA graph is captured) and then runs SGLang's own ``run_scheduler_process``. The
hook's config is resolved in the launching process against SGLang's resolved server arguments
(:func:`resolved`: the pooling buffer's rows from the CUDA-graph batch sizes SGLang decided for
this GPU, the tokenizer SGLang will load), the same way on every path: ``serve``, :func:`engine`
and the SGLang plugin (:mod:`dwise_predict.serving.plugin`, for ``python -m sglang.launch_server``).

Shell::

    dwise-predict serve --bundle bundle/ -- --model-path inclusionAI/LLaDA2.0-mini --dllm-algorithm LowConfidence \\
        --dllm-fdfo --max-running-requests 1024 --port 30000

Python::

    from dwise_predict.serving.launcher import HookConfig, engine, serve
    serve(HookConfig(bundle="bundle/", slots=128, k=8), ["--model-path", "...", "--dllm-fdfo"])   # HTTP server
    llm = engine(HookConfig(bundle="bundle/"), model_path="...", dllm_algorithm="LowConfidence")  # offline Engine

Recording mode (``HookConfig(record="traces/")``): one scheduler process per data-parallel rank (the
first of its attention group, :func:`recording_directory`) writes contract-1 shards of the requests
it finished to ``traces/dp<rank>/``; ``dwise-predict traces merge`` joins them. What happens to a
recording on each kind of shutdown is in ``docs/serving.md``.

Before SGLang loads the model, :func:`resolved` checks the hook against the served model and server
(:mod:`.checks`: hidden size, block size, model identity, the request rows of each scheduler) and the
bundle's decoding (:func:`check_served_algorithm`), and refuses in one line; ``serve --check``
(:mod:`.preflight`) reports every problem at once. Each scheduler process the hook went into logs one
line saying so (:func:`engaged_line`).

Besides what ``serving.sglang.SURFACE`` lists, the launcher calls SGLang's ``load_plugins``,
``prepare_server_args``, ``ServerArgs.resolve_once``, ``resolved_view``, ``launch_server``,
``kill_process_tree``, ``Engine``, ``resolve_spawn_dp_rank`` and ``compute_dp_attention_world_info``
(each checked against the 0.5.23 wheel in ``tests/test_serving_launcher.py`` and
``tests/test_serving_plugin.py``).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import signal
from dataclasses import asdict, dataclass, field, fields, replace
from numbers import Integral, Real
from pathlib import Path

from dwise_predict.bundles.manifest import BUNDLE_FILE, NAME_PATTERN, BundleIdentity, printable
from dwise_predict.errors import BundleError, ConfigError, DwiseError, InputError
from dwise_predict.files import read_json_object, refuse_aliasing
from dwise_predict.serving.checks import Findings, scheduler_rows, server_findings

RUN_SCHEDULER_PROCESS = "sglang.srt.managers.scheduler:run_scheduler_process"
logger = logging.getLogger(__name__)
ACTIVE = None  # the Installed handle of this process (set in a scheduler child)
LOCK_FILE = ".lock"  # a recording directory's lock file, holding its writer's pid (collectors.store)
# a trace dataset's files (traces.dataset, collectors.store) and what a recording's manifest says wrote
# it (collectors.live.live_manifest), named here: those modules import pandas, not for every SGLang process
MANIFEST_FILE, REQUESTS_FILE, SHARDS_DIR = "manifest.json", "requests.parquet", "shards"
RECORDER = "sglang-hook"
RANK_DIRECTORY = re.compile(r"dp\d+(-\d+)?")  # the names recording_directory gives
FROM_SERVER = {"from_server": True}  # metadata of a HookConfig field that SGLang's arguments fill, not the user


@dataclass(frozen=True)
class HookConfig:
    """Everything a scheduler child needs to install the hook (plain values: it crosses ``spawn``).

    bundle : predictor bundle directory, or None (rank by prompt blocks only: ``r̂ = 0``).
    slots, k : ``B`` and the resident-set multiplier (SGLang's ``--max-running-requests`` >= k*B).
    kv_budget_tokens, kv_fraction, slack_blocks : KV reservations (see ``serving.sglang.install``).
    block_size : SGLang's dLLM block size; default the bundle's.
    max_batch : the largest batch of one forward; default the larger of ``slots`` and what the
        server can run in one forward (:func:`largest_forward`: its largest CUDA-graph batch or
        ``--max-running-requests``).
    hidden_size : the model's hidden size (recording without a bundle); default the bundle's.
    tokenizer : tokenizer directory or hub id for the admission features (prompt text); default
        the server's ``--tokenizer-path`` or ``--model-path``.
    tokenizer_revision, trust_remote_code : how the tokenizer is loaded, as SGLang's scheduler loads
        its own: the server's ``--revision`` (where ``tokenizer`` is the server's) and
        ``--trust-remote-code``. Filled from SGLang's arguments by :func:`resolved`; no option of
        ``serve`` or the plugin (:func:`option_fields`).
    record : directory for recording mode, or None.
    record_every : most requests per committed shard while recording.
    record_flush_s : seconds after which a finished request is committed whatever the traffic (the
        most a scheduler process killed outright loses: ``docs/serving.md``).
    prompt_cache : block rows the hook keeps for requests that a prefix-cache hit leaves without a
        prompt block of their own (``serving.sglang.install``; 0: none).
    aging : the policy's starvation guard (``DwisePolicy(aging=)``: rounds of remaining work one round
        in the server is worth; 0: off). The default's choice: docs/serving.md, "Starvation guard".
    max_wait : the policy's wait cap in rounds (``DwisePolicy(max_wait=)``: a request waiting longer is
        admitted first; 0: off, as ``--aging 0`` is). Default the policy's, ``policy.MAX_WAIT``. Where
        ``SGLANG_REQ_WAITING_TIMEOUT`` is set the hook lowers it to admit before that timeout
        (``serving.sglang.timeout``), also where it is 0.
    monitor_window : finished requests the live quality monitor ranks (with a bundle): its ρ,
        within-category ρ and calibration on SGLang's ``/metrics`` (``--enable-metrics``) and in a
        recording's manifest (``serving.monitor``, ``serving.sglang.metrics``). At least
        :data:`MIN_MONITOR_WINDOW`, the fewest requests the monitor reports on.
    follow : hot swap: a bundle name in ``follow_zoo`` (its latest version), or, without
        ``follow_zoo``, a bundle directory whose sealed manifest is watched. Each scheduler process
        polls it every ``follow_poll_s`` seconds and serves a new bundle that fits the server from a
        step boundary on (``serving.sglang.follow``). Needs ``bundle``, the one to start from.
    follow_zoo : the zoo ``follow`` names a bundle in (a directory holding ``index.json``).
    follow_poll_s : seconds between two looks at ``follow`` (at least :data:`MIN_POLL_S`).
    rollback_after, rollback_margin : a new version whose refined ρ over its first ``rollback_after``
        finished requests (on the live monitor) falls more than ``rollback_margin`` below the old
        version's is swapped back and never served again (``rollback_after`` 0: never).
    resolver : ``"module:function"`` that resolves SGLang module names (tests pass a fake); None
        imports SGLang.

    :meth:`problems` checks every field (types, ranges, finite numbers, the bounds :data:`MAX_ROWS`
    and :data:`MAX_WIDTH` on what install allocates, where ``record`` may be written).
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
    tokenizer_revision: str | None = field(default=None, metadata=FROM_SERVER)
    trust_remote_code: bool = field(default=False, metadata=FROM_SERVER)
    record: str | None = None
    record_every: int = 64
    record_flush_s: float = 5.0
    prompt_cache: int = 4096
    aging: float = 0.1
    max_wait: int = 4096  # policy.MAX_WAIT (the policy module is not imported here: numpy, in every SGLang process)
    monitor_window: int = 512  # monitor.WINDOW (numpy and scipy, not imported here either)
    follow: str | None = None
    follow_zoo: str | None = None
    follow_poll_s: float = 10.0
    rollback_after: int = 64
    rollback_margin: float = 0.1
    resolver: str | None = None

    def problems(self) -> list[str]:
        """Every setting that cannot work, one line each naming its parameter in backticks (``serve``
        prints it as the flag, the plugin as the variable), before anything is allocated or written."""
        out = [*_count_problems(self), *_number_problems(self)]
        if self.bundle is not None and not (Path(self.bundle) / "bundle.json").is_file():
            out.append(f"`bundle` {self.bundle} has no bundle.json: pass a directory written by `dwise-predict export`")
        if self.bundle is None and self.record is None:
            out.append("nothing to do: pass `bundle` (schedule with DWISE), `record` (collect traces), or both")
        if self.record is not None:
            out += record_problems(self.record, self.bundle)
        out += follow_problems(self)
        if self.resolver is not None and ":" not in str(self.resolver):
            out.append(f"`resolver` must be \"module:function\", got {self.resolver!r}")
        return out


# Upper bounds of the settings that size what install allocates on the model's GPU before SGLang
# captures its CUDA graphs (serving.sglang.buffers.PoolingBuffers): floor(k*B) resident rows and
# `prompt_cache` cached rows of H fp32 each, `max_batch` rows of 2*H and (2, block_size) each. 65,536
# rows is 64 times the docs' --max-running-requests 1024 and 128 times the largest batch SGLang
# captures in a CUDA graph by default (512); at H = 8,192 that many rows are 2 GiB, past which the
# hook would take the memory SGLang sizes its KV cache from. No released model is 65,536 wide
# (hidden size or block).
MAX_ROWS = 65_536
MAX_WIDTH = 65_536
MIN_MONITOR_WINDOW = 32  # monitor.MIN_REQUESTS: a smaller window would never report
MIN_POLL_S = 0.1  # the shortest `follow_poll_s`: a look is a stat and a small read, a new bundle a load
# whole-number settings: (name, least, most or None, what the most bounds); None is "unset" where the
# field is optional
_COUNTS = (
    ("slots", 1, MAX_ROWS, "B resident rows of H floats on the GPU"),
    ("slack_blocks", 0, None, ""),
    ("block_size", 1, MAX_WIDTH, "tokens per dLLM block; the pooling masks hold max_batch x 2 of them"),
    ("max_batch", 1, MAX_ROWS, "requests per forward, pooling rows of 2 x H floats on the GPU"),
    ("hidden_size", 1, MAX_WIDTH, "the model's width, floats per pooled row on the GPU"),
    ("record_every", 1, None, ""),
    ("prompt_cache", 0, MAX_ROWS, "rows of H floats on the GPU"),
    ("monitor_window", MIN_MONITOR_WINDOW, MAX_ROWS, "finished requests ranked on SGLang's scheduler thread"),
    ("rollback_after", 0, None, ""),
)


def _whole(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _count_problems(config: HookConfig) -> list[str]:
    """The whole-number settings' problems (:data:`_COUNTS`, the wait cap) and k*B's bound."""
    out = []
    for name, least, most, why in _COUNTS:
        value = getattr(config, name)
        if value is None and HookConfig.__dataclass_fields__[name].default is None:
            continue  # unset: its default (the bundle's, the server's)
        if not _whole(value):
            out.append(f"`{name}` must be a whole number, got {value!r}")
        elif value < least:
            bound = "positive" if least == 1 else "0 or more" if least == 0 else f"at least {least}"
            out.append(f"`{name}` must be {bound}, got {value}")
        elif most is not None and value > most:
            out.append(f"`{name}` must be at most {most:,} ({why}), got {value:,}")
    if not (_whole(config.max_wait) and config.max_wait >= 0):
        out.append(f"`max_wait` must be a whole number of rounds >= 0 (0: no wait cap), got {config.max_wait}")
    if _whole(config.slots) and config.slots <= MAX_ROWS and _finite(config.k) and config.slots * config.k > MAX_ROWS:
        out.append(f"`k` x `slots` (k*B, the resident requests: rows of H floats on the GPU, and SGLang's "
                   f"--max-running-requests at least as many) must be at most {MAX_ROWS:,}, got {config.slots * config.k:,g}")
    return out


def _number_problems(config: HookConfig) -> list[str]:
    """The real-valued settings' problems: each finite, in its range."""
    out = []
    if not _finite(config.k):
        out.append(f"`k` must be a finite number, got {config.k}")
    elif config.k < 1:
        out.append(f"`k` must be at least 1, got {config.k}")
    if config.kv_budget_tokens is not None and not (_finite(config.kv_budget_tokens) and config.kv_budget_tokens > 0):
        out.append(f"`kv_budget_tokens` must be a finite number > 0 (or unset: `kv_fraction` of SGLang's KV pool), "
                   f"got {config.kv_budget_tokens}")
    if not (_finite(config.kv_fraction) and 0 < config.kv_fraction <= 1):
        out.append(f"`kv_fraction` must be a share of SGLang's KV pool in (0, 1], got {config.kv_fraction}")
    if not (_finite(config.record_flush_s) and config.record_flush_s > 0):
        out.append(f"`record_flush_s` must be a finite number of seconds > 0, got {config.record_flush_s}")
    if not (_finite(config.aging) and config.aging >= 0):
        out.append(f"`aging` must be a finite number >= 0 (0: no starvation guard), got {config.aging}")
    if not (_finite(config.follow_poll_s) and config.follow_poll_s >= MIN_POLL_S):
        out.append(f"`follow_poll_s` must be a finite number of seconds >= {MIN_POLL_S:g}, got {config.follow_poll_s}")
    if not (_finite(config.rollback_margin) and 0 <= config.rollback_margin <= 2):
        out.append(f"`rollback_margin` must be a difference of rank correlations in [0, 2], "
                   f"got {config.rollback_margin}")
    return out


def follow_problems(config: HookConfig) -> list[str]:
    """Why the hook cannot follow what ``config`` names (empty: it can, or follows nothing). A name
    that the zoo does not hold yet is no problem: the hook serves ``bundle`` until one is published."""
    follow, zoo = config.follow, config.follow_zoo
    if follow is None:
        return [] if zoo is None else ["`follow_zoo` needs `follow`, the name of the bundle to follow in it"]
    out = [] if config.bundle is not None else ["`follow` needs `bundle`, the bundle to serve until a new one comes"]
    if _whole(config.rollback_after) and _whole(config.monitor_window) and config.rollback_after > config.monitor_window:
        out.append(f"`rollback_after` ({config.rollback_after}) must be at most `monitor_window` "
                   f"({config.monitor_window}): the monitor judges a new version on requests it still holds")
    if zoo is None:
        if Path(follow).exists() and not Path(follow).is_dir():
            out.append(f"`follow` {follow} is a file: give a bundle directory to watch, or a bundle name with "
                       "`follow_zoo`")
        return out
    if not NAME_PATTERN.fullmatch(str(follow)):
        out.append(f"`follow` {printable(follow)} is not a zoo name (1-100 letters, digits, '.', '_' or '-', starting "
                   "with a letter or digit)")
    if not (Path(zoo) / "index.json").is_file():
        out.append(f"`follow_zoo` {zoo} holds no index.json: give a zoo (`dwise-predict publish BUNDLE --zoo ZOO` "
                   "makes one)")
    return out


def record_problems(record: str | os.PathLike, bundle: str | os.PathLike | None) -> list[str]:
    """Why ``record`` cannot take a recording (empty: it can). A recording writes one directory per
    data-parallel rank into ``record`` (:func:`recording_directory`: ``dp0/`` ...), and a restarted
    server resumes them: ``record`` is new, empty, or an earlier recording's ``record``. Refused: a
    path that is, holds or lies inside the bundle (:func:`~dwise_predict.files.refuse_aliasing`), a
    file, a trace dataset or a path inside one (a ``collect`` output, merged traces, one rank's
    recording: what the recorder would write into), and a directory whose ``dp<rank>/`` is a trace
    dataset no recording wrote."""
    try:
        refuse_aliasing(record, [("`bundle`", bundle)], param="record")
        return _target_problems(Path(record))
    except InputError as err:
        return [str(err)]
    except OSError as err:  # a name too long for the file system, a directory it may not read
        return [f"`record` {record} cannot be inspected ({err.strerror or err}): choose another directory"]


def _target_problems(target: Path) -> list[str]:
    """:func:`record_problems` past the bundle: the file system's view of ``target``."""
    if target.exists() and not target.is_dir():
        return [f"`record` {target} is a file: pass a new or empty directory, or an earlier recording's `record`"]
    resolved = target.resolve()
    inside = next((d for d in (resolved, *resolved.parents) if _trace_dataset(d)), None)
    if inside is not None:
        where = "is a trace dataset" if inside == resolved else f"lies inside the trace dataset {inside}"
        return [f"`record` {target} {where}: a recording writes a directory per DP rank (dp0/ ...) into a new or "
                "empty directory, or into an earlier recording's `record` to resume it; choose one of those"]
    ranks = sorted(target.glob("dp*")) if resolved.is_dir() else []
    for rank in ranks:
        if RANK_DIRECTORY.fullmatch(rank.name) and (rank / MANIFEST_FILE).is_file() and not _recording(rank):
            return [f"`record` {target} holds {rank.name}/, a trace dataset that no recording wrote (a `collect` "
                    "output?): choose a new or empty directory, or an earlier recording's `record`"]
    return []


def _trace_dataset(directory: Path) -> bool:
    """Whether ``directory`` holds a trace dataset: a manifest and the requests or shards it describes."""
    return (directory / MANIFEST_FILE).is_file() and ((directory / REQUESTS_FILE).is_file()
                                                      or (directory / SHARDS_DIR).is_dir())


def _recording(directory: Path) -> bool:
    """Whether the trace dataset in ``directory`` is a recording of this hook (what its manifest says
    wrote it), which a restarted server resumes."""
    try:
        collection = read_json_object(directory / MANIFEST_FILE, ConfigError).get("collection")
    except DwiseError:
        return False
    return isinstance(collection, dict) and collection.get("recorder") == RECORDER


def option_fields() -> list:
    """The :class:`HookConfig` fields a user sets (``serve``'s options, the plugin's ``DWISE_*``
    variables): all but those filled from SGLang's own arguments."""
    return [f for f in fields(HookConfig) if not f.metadata.get("from_server")]


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
    """Fill block size, hidden size, batch and tokenizer from the bundle, the served model and the server
    arguments (``server_args``: SGLang's resolved view of them, see :func:`largest_forward`), after
    every check :func:`startup_findings` runs: one line naming every problem, before SGLang loads the
    model."""
    findings = startup_findings(config, server_args)
    findings.raise_problems()
    return filled_config(config, findings, server_args)


def filled_config(config: HookConfig, findings: Findings, server_args) -> HookConfig:
    """``config`` with what :func:`resolved` fills in, from checks that found no problem."""
    block_size, hidden = findings.served["hook_block_size"], findings.served["hook_hidden_size"]
    max_batch, tokenizer, revision = config.max_batch, config.tokenizer, config.tokenizer_revision
    trust_remote_code = config.trust_remote_code
    if server_args is not None:
        max_batch = max_batch or max(config.slots, largest_forward(server_args))
        if not tokenizer:  # the server's tokenizer, at the revision SGLang's scheduler loads it at
            tokenizer = getattr(server_args, "tokenizer_path", None) or getattr(server_args, "model_path", None)
            revision = getattr(server_args, "revision", None)
        trust_remote_code = bool(getattr(server_args, "trust_remote_code", False))
    return replace(config, block_size=int(block_size), hidden_size=int(hidden) if hidden else None,
                   max_batch=int(max_batch or config.slots), tokenizer=tokenizer, tokenizer_revision=revision,
                   trust_remote_code=trust_remote_code)


def startup_findings(config: HookConfig, server_args=None) -> Findings:
    """Every check of ``config`` that can run before SGLang loads the model: its own problems; with
    ``server_args`` (SGLang's resolved view), the served model and server (:mod:`.checks`) and the
    bundle's decoding (:func:`check_served_algorithm`, at SGLang's block size); then whether the
    hook has a block size and (recording) a hidden size: given, the bundle's, or the served model's
    (``served["hook_block_size"]``, ``served["hook_hidden_size"]``). A bundle whose ``bundle.json``
    cannot be read raises at once."""
    findings = Findings()
    for problem in config.problems():
        findings.refuse(ConfigError, problem)
    if findings.problems:
        return findings
    trained = None
    if config.bundle is not None:  # what the hook is held to; the hook's loader checks the whole bundle
        path = Path(config.bundle) / BUNDLE_FILE  # bounded: deeply nested JSON is one line, not a RecursionError
        trained = BundleIdentity.of(read_json_object(path, BundleError, str(path), "re-export the bundle"))
    if server_args is not None:
        findings = server_findings(config, trained, server_args)
        if config.record:
            check_recorded_algorithm(findings, server_args)
        if trained is not None:
            try:
                check_served_algorithm(trained, config.bundle, server_args, findings.served.get("block_size"))
            except BundleError as err:
                findings.refuse(BundleError, str(err))
    block_size = (config.block_size or (trained.decoding.block_size if trained else None)
                  or findings.served.get("block_size"))
    hidden = config.hidden_size or (trained.hidden_size if trained else None) or findings.served.get("hidden_size")
    findings.served.update(hook_block_size=block_size, hook_hidden_size=hidden)
    missing = [flag for flag, value in (("`block_size`", block_size), ("`hidden_size`", hidden if config.record else 1))
               if not value]
    if missing:
        findings.refuse(ConfigError, f"the hook needs {' and '.join(missing)} (the model's dLLM block size and hidden "
                                     "size; a bundle carries both, a local --model-path gives both): pass them")
    return findings


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


def check_recorded_algorithm(findings: Findings, server_args) -> None:
    """Refuse recording a decoding that every reader of the recording would refuse (SGLang runs the
    parameters it is given; the engine's rules, ``check_recorded_config``, are what traces are held to)."""
    from dwise_predict.engine.algorithms import check_recorded_config

    served = served_algorithm(server_args)
    if served is None:
        return
    try:
        check_recorded_config(served["algorithm"], served["algorithm_config"])
    except ConfigError as err:
        findings.refuse(ConfigError, f"cannot record SGLang's {served['algorithm']} decoding: {err}; traces of it "
                                     "would be refused: correct the algorithm config file")


def check_served_algorithm(trained: BundleIdentity, bundle: str, server_args, block_size: int | None = None) -> None:
    """Refuse, before SGLang loads the model, a bundle trained for another algorithm or parameters
    or block size (the algorithm config file's, else ``block_size``: SGLang's for the model, see
    :func:`~.checks.served_block_size`) than the server will run. The hook checks again on its first
    step, against the scheduler's ``DllmConfig``."""
    from dwise_predict.engine.algorithms import comparable_decoding
    from dwise_predict.bundles.load import check_compatible

    served = served_algorithm(server_args, block_size)
    # a bundle of a decoding SGLang does not serve (D2F) is refused whatever the server runs
    expected = comparable_decoding(trained.decoding.algorithm, served or {"block_size": None})
    if served is not None:
        check_compatible(trained, None, expected, bundle)


class SchedulerEntry:
    """SGLang's ``run_scheduler_process`` with the DWISE hook installed first, in the child process.

    Picklable (a plain config and a target), so SGLang can hand it to ``spawn``. ``target`` is the
    scheduler main to run after installing: ``"module:function"``, or the function itself (the
    plugin wraps whatever SGLang or a subclass of its ``Engine`` would have run; tests pass a
    stand-in).
    """

    def __init__(self, config: HookConfig, target=RUN_SCHEDULER_PROCESS):
        self.config = config
        self.target = target

    def __call__(self, *args, **kwargs):
        # run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, ...)
        names = ("server_args", "port_args", "gpu_id", "tp_rank", "pp_rank", "dp_rank")
        ranks = {name: kwargs.get(name, args[i] if i < len(args) else None) for i, name in enumerate(names)}
        install_in_this_process(self.config, ranks["server_args"], gpu_id=ranks["gpu_id"] or 0,
                                tp_rank=ranks["tp_rank"] or 0, pp_rank=ranks["pp_rank"] or 0,
                                dp_rank=ranks["dp_rank"])
        target = _load(self.target) if isinstance(self.target, str) else self.target
        return target(*args, **kwargs)


def recording_directory(server_args, tp_rank: int, pp_rank: int, dp_rank: int | None, resolve=importlib.import_module
                        ) -> str | None:
    """The directory (under ``--record``) this scheduler process records into, or None when another
    process of its group records the requests it runs.

    Each data-parallel rank schedules its own requests. Under attention DP (``--attn-dp-size``, or
    the older ``--enable-dp-attention --dp-size N`` that SGLang resolves to it) every attention-DP
    group of the TP group is such a rank: its first process (attention-TP rank 0, attention-CP rank
    0) records, by SGLang's own placement (``compute_dp_attention_world_info``, read from the
    resolved arguments); the other processes of the group run the same batches. The directory is
    ``dp<rank>`` for the rank SGLang's scheduler resolves (``resolve_spawn_dp_rank``: the launcher's,
    else ``SGLANG_DP_RANK`` for data-parallel servers launched one by one), ``dp0`` without one;
    when SGLang keeps the launcher's attention-DP rank over a ``SGLANG_DP_RANK`` that is set (attention
    DP inside an externally launched replica), ``dp<SGLANG_DP_RANK>-<rank>``, so replicas never share
    a directory. Pipeline stages other than the first record nothing."""
    if pp_rank != 0:
        return None
    tp_size, attn_dp_size, attn_cp_size = 1, 1, 1
    if server_args is not None:
        view = resolve("sglang.srt.arg_groups.model_override_base").resolved_view(server_args)
        tp_size, attn_dp_size, attn_cp_size = int(view.tp_size), int(view.attn_dp_size), int(view.attn_cp_size)
    attn_tp_rank, attn_tp_size, _, _ = resolve("sglang.srt.layers.dp_attention").compute_dp_attention_world_info(
        tp_rank, tp_size, attn_dp_size, attn_cp_size)
    if attn_tp_rank != 0 or (tp_rank // attn_tp_size) % attn_cp_size != 0:
        return None
    rank = resolve("sglang.srt.managers.scheduler").resolve_spawn_dp_rank(dp_rank)
    replica = os.environ.get("SGLANG_DP_RANK")
    if dp_rank is not None and replica is not None:
        return f"dp{int(replica)}-{int(rank)}"
    return f"dp{int(rank or 0)}"


def install_in_this_process(config: HookConfig, server_args=None, gpu_id: int = 0, tp_rank: int = 0, pp_rank: int = 0,
                            dp_rank: int | None = None):
    """Install the hook in the current (scheduler) process; returns the ``Installed`` handle.

    ``server_args``: SGLang's, whose decoding a recording is made in (:func:`served_algorithm`) and
    whose parallel layout decides which process records (:func:`recording_directory`, with the
    launcher's ``dp_rank``). A recorder commits on SIGTERM, SIGINT and at exit
    (:meth:`LiveRecorder.close_on_exit`): call this from the process's main thread."""
    global ACTIVE
    from dwise_predict.serving.sglang import install
    from dwise_predict.serving.sglang.follow import Following

    resolve = _load(config.resolver) if config.resolver else importlib.import_module
    device = _device(gpu_id)
    bundle = None
    if config.bundle is not None:
        from dwise_predict.bundles.load import load_bundle

        bundle = load_bundle(config.bundle, backend="torch", device=device)
    where = recording_directory(server_args, tp_rank, pp_rank, dp_rank, resolve) if config.record else None
    tokenizer = (_tokenizer(config.tokenizer, config.tokenizer_revision, config.trust_remote_code)
                 if bundle is not None or where is not None else None)
    features = _features(tokenizer, keep_text=where is not None) if bundle is not None or config.record else None
    recorder = None
    if where is not None:
        # recording is a collector: its writer lives in collectors/ (see tests/test_layering.py)
        from dwise_predict.collectors.live import LiveRecorder, served_model

        # the served model's identity, as `collect` records it (its weights read once, here, per recording rank)
        model_path = getattr(server_args, "model_path", None)
        model = served_model(model_path, getattr(server_args, "revision", None),
                             bool(getattr(server_args, "trust_remote_code", False))) if model_path else None
        recorder = LiveRecorder(Path(config.record) / where, block_size=config.block_size, features=features,
                                every=config.record_every, bundle=config.bundle, flush_s=config.record_flush_s,
                                decoding=served_algorithm(server_args, config.block_size), tokenizer=tokenizer,
                                model=model)
        recorder.close_on_exit()
    ACTIVE = install(bundle, slots=config.slots, k=config.k, kv_budget_tokens=config.kv_budget_tokens,
                     kv_fraction=config.kv_fraction, slack_blocks=config.slack_blocks, features=features,
                     device=device if (bundle is not None or recorder is not None) else None, resolve=resolve,
                     block_size=config.block_size, max_batch=config.max_batch, hidden_size=config.hidden_size,
                     recorder=recorder, prompt_cache=config.prompt_cache, aging=config.aging,
                     max_wait=config.max_wait or None,  # 0: off
                     monitor_window=config.monitor_window,
                     follow=None if config.follow is None else Following(
                         config.follow, config.follow_zoo, config.follow_poll_s, config.rollback_after,
                         config.rollback_margin))
    # before SGLang configures logging in this process: Python's last-resort handler prints a warning
    logger.warning(engaged_line(config, server_args, tp_rank, dp_rank, where, resolve))
    return ACTIVE


def engaged_line(config: HookConfig, server_args, tp_rank: int, dp_rank: int | None, where: str | None,
                 resolve=importlib.import_module) -> str:
    """The start-up line of a scheduler process the hook went into: which bundle, ``B``, ``k``, the
    request rows each scheduler holds (:func:`~.checks.scheduler_rows`, from SGLang's resolved
    arguments), where it records. A scheduler process without it runs without the hook."""
    rows = "?"
    if server_args is not None:
        rows = scheduler_rows(resolve("sglang.srt.arg_groups.model_override_base").resolved_view(server_args))[0]
    bundle = f"bundle {config.bundle}" if config.bundle is not None else "no bundle (r_hat = 0)"
    if config.follow is not None and ACTIVE is not None:  # hot swap: what it serves now, what it follows
        source = config.follow if config.follow_zoo is None else f"{config.follow} in the zoo {config.follow_zoo}"
        bundle += f" (version {ACTIVE.state.bundle_version}), following {source} every {config.follow_poll_s:g} s"
    recording = (f"recording to {Path(config.record) / where}" if where is not None else
                 "another process of its group records" if config.record is not None else "not recording")
    return (f"DWISE hook engaged in scheduler process {os.getpid()} (TP rank {tp_rank}, DP rank {dp_rank}): {bundle}, "
            f"B = {config.slots}, k = {config.k:g}, k*B = {config.slots * config.k:g} of {rows} request rows per "
            f"scheduler, block size {config.block_size}; {recording}")


def _device(gpu_id: int) -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return f"cuda:{gpu_id}" if torch.cuda.is_available() else "cpu"


def _tokenizer(path: str | None, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer at ``path`` (a directory or hub id), at ``revision`` and with the server's
    ``trust_remote_code`` (as SGLang's scheduler loads its own), or None without one."""
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)


class RequestFeatures:
    """``req -> (words, newlines, prompt_tokens)``, the admission features of an SGLang ``Req``, from its
    token ids without decoding them (:class:`~dwise_predict.features.token_tables.TokenFeaturizer`:
    tables built once, here, a few gathers per arrival on the scheduler thread). The ``Req`` holds
    the chat-templated ids: the words and newlines are those of the user's text inside them, as
    ``collect`` counts them (:meth:`~dwise_predict.features.prompt.PromptFeaturizer.user_span`); of
    the whole input where the template cannot be stripped (a system prompt or several turns: the
    template's markup then counts too). Kept on the request (``req._dwise_features``): the hook and
    a recorder both ask.

    Parameters
    ----------
    featurizer : a ``TokenFeaturizer``, or None (no tokenizer: zero words and newlines).
    keep_text : also decode the prompt into ``req._dwise_text``, the traces' prompt column, for a
        recorder (recording pays that decode, admission alone never does).
    """

    def __init__(self, featurizer, keep_text: bool = False):
        self.featurizer, self.keep_text = featurizer, keep_text

    def __call__(self, req) -> tuple[int, int, int]:
        found = getattr(req, "_dwise_features", None)
        if found is not None:
            return found
        ids = req.origin_input_ids
        if self.featurizer is None:
            found = (0, 0, len(ids))
        else:
            found = self.featurizer(ids)
            if self.keep_text:
                req._dwise_text = self.featurizer.text(ids)
        req._dwise_features = found
        return found


def _features(tokenizer, keep_text: bool = False) -> RequestFeatures:
    """The hook's :class:`RequestFeatures` for ``tokenizer``: a loaded tokenizer, a path to load one
    from, or None (no text: zero words)."""
    from dwise_predict.features.token_tables import TokenFeaturizer

    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _tokenizer(str(tokenizer))
    return RequestFeatures(TokenFeaturizer(tokenizer) if tokenizer is not None else None, keep_text)


def _sglang(what: str, name: str):
    """SGLang's module ``name``, or a one-line :class:`ConfigError` saying ``what`` needs it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(f"{what} needs sglang==0.5.23 installed in this environment ({err})") from None


def server_arguments(sglang_argv: list[str], what: str = "dwise-predict serve"):
    """SGLang's server arguments for ``sglang_argv`` as its launcher builds them (plugins loaded first,
    ``prepare_server_args``, ``resolve_once``), and their resolved view: the decisions ``resolve_once``
    took for this machine (the CUDA-graph batch sizes from the GPU's memory, the tokenizer path)."""
    plugins = _sglang(what, "sglang.srt.plugins")
    arguments = _sglang(what, "sglang.srt.server_args")
    views = _sglang(what, "sglang.srt.arg_groups.model_override_base")
    plugins.load_plugins()
    server_args = arguments.prepare_server_args(list(sglang_argv))
    server_args.resolve_once()
    return server_args, views.resolved_view(server_args)


def plan(config: HookConfig, sglang_argv: list[str]) -> dict:
    """What ``serve`` would start, as plain JSON: the hook's config resolved against SGLang's own
    resolution of ``sglang_argv`` on this machine (``max_batch``, ``tokenizer``, block and hidden
    size), and SGLang's arguments. Starts nothing (``serve --dry-run``)."""
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    _, view = server_arguments(sglang_argv, "dwise-predict serve --dry-run (it resolves SGLang's arguments as the "
                                            "server will)")
    return {"hook": describe(resolved(config, view)), "sglang_args": list(sglang_argv)}


def serve(config: HookConfig, sglang_argv: list[str]) -> None:
    """``sglang serve`` / ``python -m sglang.launch_server`` with the hook in every scheduler process.

    ``sglang_argv`` are SGLang's own server arguments. Runs until the server stops; then, as SGLang's
    own launcher does, kills what is left of the process tree (``kill_process_tree`` of this process,
    itself spared), so no scheduler outlives the server.
    """
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    http = _sglang("dwise-predict serve", "sglang.srt.entrypoints.http_server")
    utils = _sglang("dwise-predict serve", "sglang.srt.utils")
    server_args, view = server_arguments(sglang_argv)
    try:
        for flag in ("encoder_only", "smg_grpc_mode", "use_ray"):
            if getattr(view, flag, False):
                raise ConfigError(f"dwise-predict serve runs SGLang's HTTP server only; drop --{flag.replace('_', '-')}")
        http.launch_server(server_args, run_scheduler_process_func=SchedulerEntry(resolved(config, view)))
    finally:
        utils.kill_process_tree(os.getpid(), include_parent=False)


def engine(config: HookConfig, **engine_kwargs):
    """An offline ``sglang.Engine`` whose scheduler processes run with the hook installed.

    ``engine_kwargs`` are ``Engine``'s (SGLang's ``ServerArgs`` fields, or ``server_args=``). The
    server arguments are built here as ``Engine.__init__`` builds them (plugins loaded first, SGLang's
    default ``log_level="error"``) and resolved, so the hook is configured from what the engine will
    run: the pooling buffer holds SGLang's largest CUDA-graph batch for this GPU, admission reads the
    model's tokenizer. ``shutdown()`` (also at exit) lets each recording scheduler commit and
    consolidate before SGLang's own shutdown SIGKILLs the schedulers (:func:`stop_recordings`).
    """
    Engine = _sglang("dwise_predict.serving.launcher.engine", "sglang.srt.entrypoints.engine").Engine
    _sglang("dwise_predict.serving.launcher.engine", "sglang.srt.plugins").load_plugins()
    server_args = engine_kwargs.pop("server_args", None)
    if server_args is None:
        engine_kwargs.setdefault("log_level", "error")
        server_args = Engine.server_args_class(**engine_kwargs)
    elif engine_kwargs:
        raise ConfigError(f"engine(): pass server_args= or ServerArgs fields, not both ({', '.join(engine_kwargs)})")
    server_args.resolve_once()
    views = _sglang("dwise_predict.serving.launcher.engine", "sglang.srt.arg_groups.model_override_base")
    entry = SchedulerEntry(resolved(config, views.resolved_view(server_args)))
    record = entry.config.record

    def shutdown(self):
        if record is not None:
            stop_recordings(record)
        Engine.shutdown(self)

    hooked = type("DwiseEngine", (Engine,), {"run_scheduler_process_func": staticmethod(entry), "shutdown": shutdown})
    return hooked(server_args=server_args)


def stop_recordings(record: str | os.PathLike, timeout: float = 60.0) -> list[int]:
    """SIGTERM each scheduler process of this process's tree that records under ``record`` (the pid
    in its recording directory's lock file) and wait up to ``timeout`` seconds for them to exit.
    Their recorders commit and consolidate on SIGTERM, then end the process as SIGTERM would
    (:meth:`LiveRecorder.close_on_exit`): what an ``Engine`` shutdown, a SIGKILL of every scheduler
    (``kill_process_tree``), would otherwise cut short. Returns the pids signalled."""
    import psutil  # SGLang's own dependency (its kill_process_tree uses it)

    ours = {child.pid: child for child in psutil.Process().children(recursive=True)}
    signalled = []
    for lock in sorted(Path(record).glob(f"*/{LOCK_FILE}")):
        pid = _lock_holder(lock)
        if pid in ours:
            try:
                ours[pid].send_signal(signal.SIGTERM)
                signalled.append(pid)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs([ours[pid] for pid in signalled], timeout=timeout)
    return signalled


def _lock_holder(path: Path) -> int | None:
    """The pid in a store's lock file while a process holds the lock (a released lock file keeps the
    pid of its last holder, which may since name another process), else None."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: the pid is its holder's
        try:
            return int(os.pread(fd, 32, 0).decode(errors="replace").strip() or 0) or None
        except ValueError:
            return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe(config: HookConfig) -> dict:
    """The config as plain JSON (for `serve --json` and logs)."""
    return asdict(config)
