"""Recording mode: contract-1 traces written by the serving hook from a live SGLang server.

The SGLang hook (:mod:`dwise_predict.serving.sglang`) calls a :class:`LiveRecorder` from
inside the scheduler process, on the scheduler's thread: ``arrived`` when a request is registered,
``forward`` after every step that ran it (with the pooled rows of the step's first forward and the
early signals of that forward, host arrays), ``finished`` when SGLang finishes it. ``finished``
only queues the request's row; a writer thread of the recorder commits the queue as shards through
the same :class:`~dwise_predict.collectors.store.TraceStore` as ``collect`` (atomic, append-only,
resumable: a restarted server appends new shards and skips request ids a shard already holds), so
no disk write or fsync ever runs on the scheduler's thread. The queue is bounded: when the writer
falls behind by ``queue_size`` requests, a finished request is dropped and counted (``dropped``),
never waited for. The writer commits a shard when ``every`` requests are queued and, whatever the
traffic, ``flush_s`` seconds after the oldest uncommitted one finished, so a process killed outright
(SIGKILL: nothing of it runs) loses at most the requests of its last ``flush_s`` seconds.
:meth:`LiveRecorder.close` commits the rest and consolidates ``requests.parquet`` +
``hidden.safetensors``; :meth:`LiveRecorder.close_on_exit` makes SIGTERM, SIGINT and interpreter
exit run it (``docs/serving.md`` says what each kind of SGLang shutdown does). A recording whose
last run died before consolidating (shards, no ``requests.parquet``) is consolidated when the next
run opens it. Each data-parallel rank records into its own directory; ``dwise-predict traces
merge`` joins them.

The manifest's ``counts`` (:meth:`LiveRecorder.counts`: requests, ``left_out_<reason>``, ``dropped``,
what a failed write lost, the runs that never closed) cover the directory's whole life, every run of
the server that appended to it, and are rewritten with every shard, so a killed run leaves them as of
its last shard. Every request the hook reports is either a trace or counted once there.

A failed write (a full disk, a directory gone read-only) stops recording, not the server: the writer
logs one line naming the directory and the error, counts what it could not write, and from then on
the hook's calls into the recorder do nothing but count (``lost_to_write_error``).

Units are SGLang's own, because SGLang ran them: ``prompt_blocks`` is ``floor(n / block_size)``
(the schema's definition, without a prefix cache); the prefill forwards that actually ran, after
prefix-cache hits, are in the extra column ``prefill_rounds``; ``rounds_per_block`` counts the
forwards of each output block (r + 1 for LowConfidence). ``split`` is drawn from a hash of the
request id (20 % eval), ``category`` is the one the client named (SGLang's sampling parameter
``custom_params: {"dwise_category": ...}``, which the hook reads:
``serving.sglang.requests.category_of``), else ``live``, and ``source`` is ``sglang``.

With a bundle the hook also keeps a live quality monitor (``serving.monitor``); its latest summary
(``LiveRecorder.monitor``) is the manifest's ``monitor``, written with the counts.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import threading
import time
from collections import deque
from itertools import repeat
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.collectors.collect import contract_row
from dwise_predict.collectors.store import ORDER_COLUMN, SHARDS_DIR, TraceStore
from dwise_predict.engine import ENGINE, tokenizer_stop_ids
from dwise_predict.engine.algorithms import DEFAULT_ALGORITHM, check_recorded_config, served_decoding
from dwise_predict.errors import BundleError, ConfigError, ModelError, StoreError
from dwise_predict.files import read_json_object
from dwise_predict.traces.dataset import MANIFEST_FILE, REQUESTS_FILE
from dwise_predict.versions import package_versions

EVAL_FRACTION = 0.2
logger = logging.getLogger(__name__)


def live_split(request_id: str) -> str:
    """``eval`` for a stable 20 % of request ids, else ``train``."""
    digest = int(hashlib.sha256(str(request_id).encode()).hexdigest()[:8], 16)
    return "eval" if digest / 0xFFFFFFFF < EVAL_FRACTION else "train"


def left_out_because(req, reason: dict, output_tokens: int) -> str | None:
    """Why a finished request is no trace of the model's own work, or None when it is one.

    ``collect`` ends a request at the model's own stop ids or at its budget, with the whole budget
    inside the context. A live request may end otherwise, and its rounds would then be a target no
    input explains: ``client_stop`` — the client's ``ignore_eos``, a stop string or regex
    (``FINISH_MATCHED_STR``) or a stop id of its own that is none of the model's
    (``Req._check_token_based_finish``); ``context_end`` — a length finish short of the budget, where
    the context ran out (``_finish_dllm_request_if_needed``)."""
    params = req.sampling_params
    if getattr(params, "ignore_eos", False):
        return "client_stop"
    kind = str(reason.get("type")).lower()
    matched = reason.get("matched")
    if kind == "stop" and isinstance(matched, str):
        return "client_stop"
    if kind == "stop" and matched in (getattr(params, "stop_token_ids", None) or ()) \
            and matched not in _model_stop_ids(req):
        return "client_stop"
    if "length" in kind and output_tokens < int(params.max_new_tokens):
        return "context_end"
    return None


def _model_stop_ids(req) -> set[int]:
    """The ids ``req`` stops on whatever its client asked: the model config's EOS ids and its
    tokenizer's (:func:`dwise_predict.engine.layout.tokenizer_stop_ids`)."""
    ids = {int(i) for i in (getattr(req, "eos_token_ids", None) or ())}
    tokenizer = getattr(req, "tokenizer", None)
    return ids | (tokenizer_stop_ids(tokenizer) if tokenizer is not None else set())


def received_tokens(req, reason: dict) -> int:
    """Output tokens as traces count them (before the EOS, at most the budget) of a finished request.

    SGLang appends whole blocks to ``output_ids``, so they can run past the EOS and the budget;
    ``finished_len`` marks what the client receives (``Req.output_ids_through_stop``), the stop token
    included when a token stopped it (``reason``: the finish reason's ``to_json()``).
    """
    through_stop = getattr(req, "finished_len", None)
    if through_stop is None:
        return len(req.output_ids)
    stopped_by_token = reason.get("type") == "stop" and not isinstance(reason.get("matched"), str)
    return through_stop - 1 if stopped_by_token else through_stop


def live_manifest(model: dict, algorithm: str, algorithm_config: dict, block_size: int, budget: int,
                  dtype: str = "bfloat16", batch_size: int = 0) -> dict:
    """The manifest of a recording: model fingerprint, SGLang's decoding config (its parameters over
    SGLang's defaults, as ``collect`` records them), engine, versions. Parameters that the rule of
    ``algorithm`` refuses (SGLang runs what it is given) raise :class:`ConfigError` before anything is
    written: every reader of the recording would refuse it (``check_recorded_config``)."""
    params = served_decoding(algorithm, algorithm_config, block_size)["algorithm_config"]
    try:
        check_recorded_config(algorithm, params)
    except ConfigError as err:
        raise ConfigError(f"cannot record SGLang's {algorithm} decoding: {err}; traces of it would be refused "
                          "by every reader: correct the algorithm config file") from None
    return {
        "model": dict(model),
        "decoding": {
            "algorithm": algorithm,
            "algorithm_config": params,
            "block_size": int(block_size),
            "budget": int(budget),
            "dtype": dtype,
            "batch_size": int(batch_size),
            "params": {},
            "engine": ENGINE,
            "engine_faithful": True,
        },
        "workload": {"name": "live", "spec": "sglang", "seed": None, "limit": None, "shard": None,
                     "composition": {}, "plan": {}},
        "collection": {"recorder": "sglang-hook"},
        "versions": package_versions(),
    }


def served_model(model_path, revision: str | None = None, trust_remote_code: bool = False) -> dict:
    """The model fingerprint of contract 1 for the model SGLang serves from ``model_path`` (its
    ``--model-path``, ``--revision``, ``--trust-remote-code``), computed as ``collect`` computes it
    (:func:`~dwise_predict.collectors.backends.base.directory_fingerprint` over the config
    transformers loads), so that a recording, the traces ``collect`` writes from the same directory
    and the bundles trained on either carry one identity.

    A local directory gives name, path, ``weights_sha256`` (every ``*.safetensors`` file read once:
    seconds per GB, at the recording scheduler's start), ``config_hash``, hidden and vocabulary size.
    A hub id gives the repo id as ``path`` and its ``revision`` (the one asked for, else the commit
    the config came from) instead of a weights hash: SGLang downloads the weights after the hook is
    installed. Raises :class:`ModelError` when the config cannot be read."""
    from transformers import AutoConfig

    from dwise_predict.collectors.backends.base import directory_fingerprint
    from dwise_predict.dllm import register

    register()  # the built-in tiny dLLM's config class, as `collect` loads it
    local = Path(model_path)
    try:
        config = AutoConfig.from_pretrained(str(model_path), revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"recording needs the served model's identity, but the config of {model_path} cannot be "
                         f"read ({' '.join(str(err).split())}): check --model-path, --revision and "
                         "--trust-remote-code") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = directory_fingerprint(local if local.is_dir() else None, local.name if local.is_dir() else str(model_path),
                                  config.to_dict(), int(text.hidden_size), int(text.vocab_size))
    if not local.is_dir():
        found.update(path=str(model_path), revision=revision or getattr(config, "_commit_hash", None))
    return found


# SGLang 0.5.23's own requests, which no client sent (read from its source; tests/test_serving_recording.py
# runs that source): /health_generate's probes carry rids that start with this prefix
# (sglang.srt.constants.HEALTH_CHECK_RID_PREFIX), and the HTTP server's start-up warmup
# (entrypoints/http_server._execute_server_warmup) is one /generate request per DP rank of this text,
# or of these ids under --skip-tokenizer-init, for this many new tokens, under a fresh uuid rid.
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
WARMUP_TEXT = "The capital city of France is"
WARMUP_IDS = (10, 11, 12)
WARMUP_MAX_NEW_TOKENS = 8

# why a request is not in the traces (the manifest's counts say how many, as left_out_<reason>;
# LiveRecorder's docstring says what each means)
LEFT_OUT_REASONS = ("client_stop", "context_end", "retracted", "without_prompt_rows", "warmup", "health_check",
                    "aborted", "without_first_round", "duplicate", "in_flight")
# the manifest's other counts beside ``requests`` and ``left_out_<reason>`` (LiveRecorder's attributes
# of the same names)
COUNTERS = ("dropped", "lost_to_write_error", "write_errors", "runs_unclosed", "requests_recovered",
            "requests_consolidated")


def warmup_inputs(tokenizer=None) -> set[tuple[int, ...]]:
    """The input ids of SGLang's start-up warmup request: its text as SGLang's tokenizer manager
    tokenises it (``tokenizer(text)``, special tokens added) with the server's ``tokenizer``, and its
    ids under ``--skip-tokenizer-init``."""
    found = {WARMUP_IDS}
    if tokenizer is not None:
        found.add(tuple(int(i) for i in tokenizer(WARMUP_TEXT)["input_ids"]))
    return found


def sglang_own_request(req, warmup: set[tuple[int, ...]] = frozenset({WARMUP_IDS})) -> str | None:
    """``"health_check"`` or ``"warmup"`` when SGLang itself sent ``req`` (see the constants above),
    else None. ``warmup``: the warmup's input ids (:func:`warmup_inputs`)."""
    if str(req.rid).startswith(HEALTH_CHECK_RID_PREFIX):
        return "health_check"
    if int(req.sampling_params.max_new_tokens) == WARMUP_MAX_NEW_TOKENS and len(req.origin_input_ids) <= max(
            map(len, warmup)) and tuple(int(i) for i in req.origin_input_ids) in warmup:
        return "warmup"
    return None


class _Open:
    """What the recorder knows of one request between arrival and finish."""

    __slots__ = ("index", "features", "block_size", "prompt_tokens", "started", "retracted", "prefill", "blocks",
                 "current", "outputs", "first_round", "prompt_last", "signals")  # read every step: no instance dict

    def __init__(self, index, features, block_size, prompt_tokens):
        self.index = index
        self.features = features
        self.block_size = block_size
        self.prompt_tokens = prompt_tokens
        self.started = None  # the first forward that ran it, as `collect` clocks a request from its slot
        self.retracted = False
        self.prefill = 0
        self.blocks: list[int] = []
        self.current = 0
        self.outputs = 0
        self.first_round = None
        self.prompt_last = None
        self.signals = (0.0, 0.0, 0.0, 0.0)


def _host_row(row) -> np.ndarray:
    """A float32 copy of one pooled row given as a host array (or a CPU tensor, through the array
    protocol): the hook's per-step host buffer may be reused by the next step. Never a device
    transfer: a device tensor here is the caller's error (``np.asarray`` refuses it)."""
    return np.asarray(row, dtype=np.float32).reshape(-1).copy()


class LiveRecorder:
    """Writes the requests a hooked SGLang scheduler finishes as contract-1 shards under ``out``.

    Parameters
    ----------
    out : trace directory (one per data-parallel rank).
    block_size : SGLang's dLLM block size.
    features : ``req -> (words, newlines, prompt_tokens)`` (the hook's admission features); the
        prompt text, when the features decoded it, is kept as ``req._dwise_text``.
    every : most finished requests per committed shard.
    manifest : the recording's manifest (:func:`live_manifest`); by default built from ``model``
        (else ``bundle``'s model fingerprint, a bundle directory) and ``decoding``.
    model : the served model's fingerprint (:func:`served_model`): what the manifest's ``model``
        says, and what a restart into this directory is held to.
    decoding : the decoding the server runs (``algorithm``, ``algorithm_config`` with SGLang's
        defaults, ``block_size``: :func:`dwise_predict.serving.launcher.served_algorithm`); by default
        SGLang's default algorithm with its defaults. The hook compares it with the scheduler's
        ``DllmConfig`` on its first step and stops on a difference: traces say what SGLang ran.
    flush_s : seconds after which a finished request is committed whatever the traffic (the most a
        process killed outright loses).
    queue_size : finished requests the writer may fall behind by; past it they are dropped and
        counted, and the scheduler never waits.
    tokenizer : the server's tokenizer, to recognise SGLang's start-up warmup by its input ids
        (:func:`warmup_inputs`); without one only the warmup of ``--skip-tokenizer-init`` is.

    Some requests are not written, and ``left_out`` counts them by reason (:data:`LEFT_OUT_REASONS`):
    ``health_check`` and ``warmup``, SGLang's own requests; ``aborted``, one SGLang aborted (the
    client went away, ``abort_request``, a waiting timeout: finished with an abort, or gone from
    every queue, :meth:`left_unfinished`) or the hook refused; ``without_first_round``, one that
    finished though no forward of this process pooled its first denoising round;
    ``without_prompt_rows``, a finished
    request whose prompt rows no forward of this process computed (a block-aligned prompt that
    SGLang's prefix cache matched whole, its last block no longer kept by the hook: ``prompt_last``
    would be made up); ``retracted``, one SGLang retracted and ran again (its output re-encoded as
    prompt blocks, work `collect` never does); ``duplicate``, one whose request id the recording
    already holds (a client reusing an id across a restart); ``in_flight``, one still running when
    the recorder closed (an ``Engine.shutdown`` mid-traffic); and those :func:`left_out_because`
    names. The other counts (:data:`COUNTERS`): ``dropped``, finished requests the writer was too far
    behind for; ``lost_to_write_error``, finished requests a failed write left unrecorded (those of
    the failed shard, those queued, and every one that finished after it); ``write_errors``, runs
    whose recording a failed write stopped; ``runs_unclosed``, runs that ended without closing (a
    SIGKILL, a crash, a disk that failed at close), whose shards a later start consolidated;
    ``requests_recovered``, of ``requests``, those such runs committed; ``requests_consolidated``,
    the requests of the last consolidation.
    """

    POLL_S = 0.02  # how often the writer looks at the queue (the scheduler never wakes it)

    def __init__(self, out, block_size: int, features=None, every: int = 64, manifest: dict | None = None,
                 bundle: str | None = None, decoding: dict | None = None, flush_s: float = 5.0,
                 queue_size: int = 4096, tokenizer=None, model: dict | None = None):
        self.out = Path(out)
        self.block_size = int(block_size)
        self.features = features
        self.every = int(every)
        self.flush_s = float(flush_s)
        self.queue_size = int(queue_size)
        self.warmup = warmup_inputs(tokenizer)
        if manifest is None:
            manifest = self._default_manifest(model, bundle, decoding)
        self.manifest = {k: v for k, v in manifest.items() if k != "counts"}
        # finished requests not written, by reason, and the other counts: every run of this directory's.
        # All keys exist from the start: the writer reads them while the scheduler's thread counts.
        self.left_out: dict[str, int] = dict.fromkeys(LEFT_OUT_REASONS, 0)
        self.dropped = self.lost_to_write_error = self.write_errors = 0
        self.runs_unclosed = self.requests_recovered = self.requests_consolidated = 0
        self.written = 0  # requests this run committed
        self.failure: BaseException | None = None  # the write error that stopped recording (the writer sets it)
        self.store = TraceStore(self.out).__enter__()  # the lock first: a second server is refused here
        try:
            self._carry_counts()
            self.done = self.store.finished_ids()
            self._base = len(self.done)  # requests the shards held when this run opened them
            unclosed = bool(self.done) and not (self.out / REQUESTS_FILE).is_file()
            if unclosed:  # the last run died before it consolidated: its requests are recovered here
                self.runs_unclosed += 1
                self.requests_recovered += max(0, self._base - self.requests_consolidated)
                self.requests_consolidated = self._base
            self.store.begin(dict(self.manifest, counts=self.counts()))  # refuses another model's directory
            if unclosed:
                self.store.consolidate(self.counts())
        except BaseException as err:
            self.store.__exit__(type(err), err, None)
            raise
        self.open: dict = {}
        self._skipped: dict = {}  # rid -> why, of requests counted when they arrived (SGLang's own, repeats)
        self.next_index = len(self.done)
        self._queue: deque = deque()  # (row, first_round, prompt_last): appended here, popped by the writer
        self._flush_wanted = self._flushed = 0  # flush requests and the last one the writer served
        self._swaps_unwritten = False  # a bundle swap the manifest on disk does not list yet
        # the hook's latest quality-monitor summary (serving.monitor), a dict it replaces, never edits:
        # the manifest's `monitor`, written with the counts; and the one the manifest on disk holds
        self.monitor: dict | None = None
        self._monitor_written: dict | None = None
        # the hook's way to set `monitor` to the summary as of now (MonitorPublisher.publish_now), which
        # it otherwise refreshes every few seconds: called on close and flush, so the manifest's is current
        self.monitor_now = None
        self._stopping = self._closed = False
        self._marked = False  # this run has made the consolidated files stale (store.mark_incomplete)
        self._writer = threading.Thread(target=self._write_loop, name=f"dwise-recorder {self.out}", daemon=True)
        self._writer.start()

    def _default_manifest(self, model: dict | None, bundle: str | None, decoding: dict | None) -> dict:
        """The manifest of a recording of the served ``model`` (else the model ``bundle`` was trained
        for) under ``decoding`` (else SGLang's default algorithm)."""
        trained = {}
        if bundle is not None:
            spec = read_json_object(Path(bundle) / "bundle.json", BundleError, fix="re-export the bundle")
            model, trained = model or spec.get("model") or {}, spec.get("decoding") or {}
        decoding = decoding or served_decoding(DEFAULT_ALGORITHM, {}, self.block_size)
        return live_manifest(model or {}, decoding["algorithm"], decoding["algorithm_config"],
                             decoding.get("block_size") or self.block_size, int(trained.get("budget") or 0),
                             trained.get("dtype") or "bfloat16")

    @property
    def decoding(self) -> dict:
        """What this recording says SGLang decodes with (its manifest's ``decoding``)."""
        return self.manifest["decoding"]

    def counts(self) -> dict:
        """The manifest's counts: requests committed, requests left out by reason, the other counters."""
        return {"requests": self._base + self.written, **{f"left_out_{why}": n for why, n in self.left_out.items()},
                **{name: getattr(self, name) for name in COUNTERS}}

    def summary(self) -> str:
        """One line: what this recording holds and everything it did not record, by reason."""
        counts = self.counts()
        left = ", ".join(f"{why} {n}" for why, n in self.left_out.items() if n) or "none"
        line = (f"dwise recording {self.out}: {counts['requests']} requests ({self.written} committed by this run); "
                f"left out: {left}; dropped (writer behind) {self.dropped}; lost to a failed write "
                f"{self.lost_to_write_error}")
        if self.runs_unclosed:
            line += f"; {self.requests_recovered} requests of {self.runs_unclosed} unclosed runs recovered"
        return line + ("; recording stopped by a failed write" if self.failure is not None else "")

    def _carry_counts(self) -> None:
        """Start from the counts of the runs before, when the directory already holds their traces."""
        path = self.out / MANIFEST_FILE
        if not path.is_file() or not (any((self.out / SHARDS_DIR).glob("shard-*.parquet"))
                                      or (self.out / REQUESTS_FILE).is_file()):
            return  # nothing recorded yet: a manifest alone binds nothing (TraceStore.begin)
        earlier = read_json_object(path, StoreError, fix="that recording directory is damaged")
        before = earlier.get("counts") or {}
        if isinstance(earlier.get("bundle_swaps"), list):  # the swaps of the runs before, listed on
            self.manifest["bundle_swaps"] = earlier["bundle_swaps"]
        for why in self.left_out:
            self.left_out[why] = int(before.get(f"left_out_{why}", 0))
        for name in COUNTERS:
            setattr(self, name, int(before.get(name, 0)))

    # --- events from the hook (the scheduler's thread) ----------------------------------------------

    def bundle_swapped(self, swap: dict) -> None:
        """The hook swapped the bundle it serves (``from`` and ``to`` versions, ``at_request``: the
        requests this server process had finished, ``why``): listed in the manifest's ``bundle_swaps``,
        which the writer writes within ``flush_s`` seconds. A new manifest object, not an edit: the
        writer may be copying the old one."""
        self.manifest = dict(self.manifest, bundle_swaps=[*self.manifest.get("bundle_swaps", []), dict(swap)])
        self._swaps_unwritten = True

    def arrived(self, req, block_size: int) -> None:
        if self.failure is not None:
            self._shed()
            return
        rid = str(req.rid)
        if rid in self.open:  # registered again: SGLang retracted it (work lost only if it had run)
            self.open[rid].retracted = self.open[rid].started is not None
            return
        if rid in self._skipped:
            return
        why = "duplicate" if rid in self.done else sglang_own_request(req, self.warmup)
        if why is not None:  # counted once, even if SGLang queues it again
            self._skipped[rid] = why
            self.left_out[why] += 1
            return
        features = self.features(req) if self.features is not None else (0, 0, len(req.origin_input_ids))
        self.open[rid] = _Open(self.next_index, features, block_size, len(req.origin_input_ids))
        self.next_index += 1

    def forward(self, req, prompt: bool, pooled_row, rounds: int, signals=None, leftover_row=None) -> None:
        """One step ran ``req``: a prompt block, or ``rounds`` forwards of its current output block.

        ``pooled_row`` and ``leftover_row`` are host arrays of H floats (numpy, or CPU tensors: read
        through the array protocol, copied); ``signals`` the step's early signals of the request's row.
        ``leftover_row``: in its first denoising forward, its ``prompt_last`` should it have run no
        prompt block of its own: the hook's kept row of its last full block after a prefix-cache hit,
        else the mean of its leftover prompt rows (as the decoder records a short prompt); None when
        SGLang computed none of its prompt rows in this process (see :meth:`finished`)."""
        if str(req.rid) not in self.open:
            return
        if pooled_row is not None and not prompt:
            self.first_rounds((req,), _host_row(pooled_row)[None],
                              None if signals is None else np.asarray(signals, dtype=np.float64).reshape(1, -1),
                              None if leftover_row is None else _host_row(leftover_row)[None],
                              (leftover_row is not None,), (rounds,))
            return
        if pooled_row is not None:
            self.open[str(req.rid)].prompt_last = _host_row(pooled_row)
        self.forwards((req,), (prompt,), (rounds,))

    def first_rounds(self, reqs, pooled, signals, leftover, has_leftover, rounds) -> None:
        """:meth:`forward` of requests in a denoising round with their pooled rows, many at once (the
        first round's are kept): ``pooled`` and ``leftover`` (n, H) host arrays (each row read is
        copied), ``signals`` (n, 4) or None, ``has_leftover`` whether each ``leftover`` row is one."""
        entry_of = self.open.get
        pooled = np.asarray(pooled, dtype=np.float32)
        leftover = repeat(None) if leftover is None else np.asarray(leftover, dtype=np.float32)
        signals = repeat(None) if signals is None else np.asarray(signals, dtype=np.float64).tolist()
        for req, row, signal, last, has in zip(reqs, pooled, signals, leftover, has_leftover):
            entry = entry_of(str(req.rid))
            if entry is None or entry.first_round is not None:
                continue
            entry.first_round = row.copy()  # the first denoising round's pooled rows
            if signal is not None:
                entry.signals = tuple(signal)
            if entry.prompt_last is None and has:
                entry.prompt_last = last.copy()
        self.forwards(reqs, repeat(False), rounds)

    def forwards(self, reqs, prompts, rounds) -> None:
        """:meth:`forward` without pooled rows, of many requests at once (``prompts``, ``rounds``: each
        one's): one call a step for a batch's rows, not one per row (the scheduler's thread)."""
        entry_of = self.open.get
        for req, prompt, n in zip(reqs, prompts, rounds):
            entry = entry_of(str(req.rid))
            if entry is None:
                continue
            if entry.started is None:
                entry.started = time.perf_counter()
            if prompt:
                entry.prefill += 1
                continue
            entry.current += n
            if len(req.output_ids) > entry.outputs or req.finished():  # the step committed the block
                entry.blocks.append(entry.current)
                entry.current, entry.outputs = 0, len(req.output_ids)

    def finished(self, req, category: str = "live") -> None:
        """SGLang finished ``req``: queue its row for the writer (never a disk write here), or count
        why it is no trace. Also for a request SGLang finished before the hook registered it (aborted
        while waiting): counted as ``aborted``. ``category``: the trace's, the one its client named
        (the hook reads it), else ``live``."""
        if self.failure is not None:
            self._shed()
            self.lost_to_write_error += 1
            return
        rid = str(req.rid)
        if self._skipped.pop(rid, None) is not None:
            return  # counted when it arrived
        entry = self.open.pop(rid, None)
        reason = req.finished_reason
        reason = getattr(reason, "to_json", lambda: {"type": reason})()
        kind = str(reason.get("type")).lower()
        if entry is None:  # never registered: only an abort finishes a request before the hook saw it
            if "abort" in kind:
                self.left_out["aborted"] += 1
            return
        output_tokens = received_tokens(req, reason)
        why = _not_a_trace(entry, req, reason, kind, output_tokens)
        if why is not None:
            self.left_out[why] += 1
            return
        if entry.current:
            entry.blocks.append(entry.current)
        words, newlines, _ = entry.features
        frac, conf, ent, end = entry.signals
        row = contract_row(
            request_id=rid, split=live_split(rid), category=category, source="sglang",
            prompt=getattr(req, "_dwise_text", "") or "", prompt_tokens=entry.prompt_tokens, words=int(words),
            newlines=int(newlines), budget=int(req.sampling_params.max_new_tokens), block_size=entry.block_size,
            prompt_blocks=entry.prompt_tokens // entry.block_size, rounds_per_block=entry.blocks,
            output_tokens=output_tokens, finish="budget" if "length" in kind else "eos",
            frac_over_threshold=frac, mean_confidence=conf, mean_entropy=ent, end_probability=end,
            wall_s=time.perf_counter() - entry.started,
        )
        row["prefill_rounds"] = entry.prefill
        row[ORDER_COLUMN] = entry.index
        if self._closed or len(self._queue) >= self.queue_size:
            self.dropped += 1  # the writer is behind (or gone): never stall the scheduler for it
            return
        self.done.add(rid)
        self._queue.append((row, entry.first_round, entry.prompt_last))

    def left_unfinished(self, req, reason: str = "aborted") -> None:
        """``req`` (a request or its rid) left SGLang without finishing: ``abort_request`` popped it
        from every queue, or the hook refused it before registering it (its KV reservation over the
        budget). Free what the recorder held for it (its host rows) and count it as
        ``left_out_<reason>`` (:data:`LEFT_OUT_REASONS`), unless it was counted when it arrived
        (SGLang's own, a repeated id). Call it once per request, instead of :meth:`finished`."""
        if reason not in self.left_out:
            raise ValueError(f"no such reason {reason!r} to leave a request out: one of {', '.join(LEFT_OUT_REASONS)}")
        if self.failure is not None:
            self._shed()
            return
        rid = str(getattr(req, "rid", req))
        if self._skipped.pop(rid, None) is None:
            self.open.pop(rid, None)
            self.left_out[reason] += 1

    def _shed(self) -> None:
        """Recording stopped (a failed write): free what the hook's requests held here, and count what
        the writer, gone, left queued. The writer touches the queue no more once ``failure`` is set."""
        while self._queue:
            self._queue.popleft()
            self.lost_to_write_error += 1
        self.open.clear()
        self._skipped.clear()

    # --- the writer thread --------------------------------------------------------------------------

    def _write_loop(self) -> None:
        pending: list = []
        oldest = None  # when the oldest uncommitted request was seen
        counted, counts_at = self.counts(), time.monotonic()  # the counts the manifest holds, and since when
        try:
            while True:
                stopping, wanted = self._stopping, self._flush_wanted  # read before draining the queue
                while self._queue:
                    pending.append(self._queue.popleft())
                now = time.monotonic()
                if pending and oldest is None:
                    oldest = now
                urgent = stopping or wanted > self._flushed
                if pending and (urgent or len(pending) >= self.every or now - oldest >= self.flush_s):
                    while pending:
                        self._commit(pending[: self.every])
                        del pending[: self.every]  # committed: no longer lost should the next write fail
                        self._write_counts()  # the counts, as of this shard
                    oldest = None
                    counted, counts_at = self.counts(), now
                elif ((self.counts() != counted or self._swaps_unwritten or self.monitor is not self._monitor_written)
                      and (urgent or now - counts_at >= self.flush_s)):
                    self._write_counts()  # left-outs without a new shard
                    counted, counts_at = self.counts(), now
                self._flushed = wanted
                if stopping and not self._queue:
                    return
                time.sleep(self.POLL_S)
        except Exception as err:  # a full disk, a damaged directory: recording stops, the server does not
            self._stop_recording(err, len(pending))

    def _commit(self, chunk: list) -> None:
        if not self._marked:
            self.store.mark_incomplete()  # until close consolidates again, no reader takes it for whole
            self._marked = True
        rows, first, last = zip(*chunk)
        self.store.write_shard(pd.DataFrame(list(rows)), np.stack(first), np.stack(last))
        self.written += len(rows)

    def _write_counts(self) -> None:
        self._swaps_unwritten = False  # before the manifest is read: a swap after this is written next time
        monitor = self._monitor_written = self.monitor
        self.store.begin(dict(self.manifest, counts=self.counts(), **({"monitor": monitor} if monitor else {})))

    def _stop_recording(self, err: BaseException, unwritten: int) -> None:
        """The writer's end on a write error: count what it held, then set ``failure`` (after which the
        scheduler's thread counts the rest) and say so once."""
        self.lost_to_write_error += unwritten
        self.write_errors += 1
        self.failure = err
        logger.error("dwise: recording into %s stopped, the server keeps serving: %s (finished requests from now "
                     "on are counted, not recorded: counts.lost_to_write_error)", self.out, " ".join(str(err).split()))

    # --- committing ---------------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Commit every finished request queued so far; wait up to ``timeout`` seconds for the writer.
        Safe inside a signal handler on the scheduler's thread (the writer polls; ``monitor_now``'s lock
        is re-entrant and held only while a summary is handed on, by the monitor's thread).
        Returns whether the writer got there in time (False once a failed write stopped recording)."""
        if self._closed or self.failure is not None:
            return self.failure is None
        if self.monitor_now is not None:
            self.monitor_now()
        self._flush_wanted += 1
        target, deadline = self._flush_wanted, time.monotonic() + timeout
        while self._flushed < target and self.failure is None and time.monotonic() < deadline:
            time.sleep(self.POLL_S / 4)
        return self._flushed >= target and self.failure is None

    def close(self, timeout: float = 60.0) -> Path:
        """Count the requests still in flight, commit the rest, consolidate ``requests.parquet`` +
        ``hidden.safetensors``, release the directory, and log :meth:`summary`. A writer that does not
        finish within ``timeout`` seconds (a stalled disk), or a consolidation that fails, leaves the
        consolidation to the next run that opens the directory (counted there as ``runs_unclosed``)."""
        if self._closed:
            return self.out
        self._closed = True
        if self.failure is None:
            self.left_out["in_flight"] += len(self.open)  # before the writer's last pass writes the counts
            self.open.clear()
            if self.monitor_now is not None:
                self.monitor_now()
        self._stopping = True
        try:
            self._writer.join(timeout)
            if self.failure is not None:
                self._shed()
            if not self._writer.is_alive():
                self._consolidate()
        finally:
            self.store.__exit__(None, None, None)
        logger.info(self.summary())
        return self.out

    def _consolidate(self) -> None:
        """The last write of a run: the consolidated files (or the counts alone, with no shards)."""
        try:
            if self._base or self.written:
                counts = dict(self.counts(), requests_consolidated=self._base + self.written)
                self.store.consolidate(counts)
                self.requests_consolidated = counts["requests_consolidated"]
            else:
                self._write_counts()
        except (StoreError, OSError) as err:
            if self.failure is None:  # one line for the failure, as for a failed write while serving
                self._stop_recording(err, 0)

    def close_on_exit(self) -> None:
        """Close at interpreter exit, and commit on SIGTERM and SIGINT, each chained to the handler
        it replaces (call from the main thread of the scheduler process, as SGLang runs it).

        A signal whose previous disposition is the default action (SIGTERM in a scheduler process:
        SGLang installs none there) ends the process as that action would, after :meth:`close`:
        every finished request committed and consolidated first. A Python handler before ours
        (SIGINT's ``KeyboardInterrupt``) runs after the commit, and the process unwinds to the
        ``atexit`` close; an ignored signal stays ignored, after the commit."""
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            signal.signal(sig, lambda signum, frame, previous=previous: self._on_signal(signum, frame, previous))

    def _on_signal(self, signum, frame, previous) -> None:
        if previous in (signal.SIG_DFL, None):  # None: a handler not installed from Python; act as default
            try:
                self.close()
            finally:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.flush()
        if callable(previous):
            previous(signum, frame)


def _not_a_trace(entry: _Open, req, reason: dict, kind: str, output_tokens: int) -> str | None:
    """Why a finished request the recorder followed is no trace (a :data:`LEFT_OUT_REASONS`), or None."""
    if "abort" in kind:
        return "aborted"  # it did not run to its end
    if entry.first_round is None:
        return "without_first_round"  # no pooled first round: the refinement input would be made up
    if entry.prompt_last is None:
        # a block-aligned prompt cached whole, whose rows no forward here computed: a made-up
        # prompt_last would be a training row the model never produced
        return "without_prompt_rows"
    return "retracted" if entry.retracted else left_out_because(req, reason, output_tokens)


__all__ = ["LiveRecorder", "live_manifest", "live_split", "served_model", "sglang_own_request", "warmup_inputs"]
