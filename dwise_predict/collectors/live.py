"""Recording mode: contract-1 traces written by the serving hook from a live SGLang server.

The SGLang hook (:mod:`dwise_predict.serving.sglang_adapter`) calls a :class:`LiveRecorder` from
inside the scheduler process: ``arrived`` when a request is registered, ``forward`` after every
step that ran it (with the pooled rows of the step's first forward and the early signals of that
forward), ``finished`` when SGLang finishes it. Finished requests are committed in shards through
the same :class:`~dwise_predict.collectors.store.TraceStore` as ``collect`` (atomic, append-only,
resumable: a restarted server appends new shards and skips request ids a shard already holds), and
:meth:`LiveRecorder.close` consolidates them. Each data-parallel rank records into its own
directory; ``dwise-predict traces merge`` joins them.

Units are SGLang's own, because SGLang ran them: ``prompt_blocks`` is ``floor(n / block_size)``
(the schema's definition, without a prefix cache); the prefill forwards that actually ran, after
prefix-cache hits, are in the extra column ``prefill_rounds``; ``rounds_per_block`` counts the
forwards of each output block (r + 1 for LowConfidence). ``split`` is drawn from a hash of the
request id (20 % eval), ``category`` is ``live`` and ``source`` ``sglang``.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.collectors.collect import contract_row
from dwise_predict.collectors.store import ORDER_COLUMN, TraceStore
from dwise_predict.engine import ENGINE, tokenizer_stop_ids
from dwise_predict.engine.algorithms import DEFAULT_ALGORITHM, served_decoding
from dwise_predict.versions import package_versions

EVAL_FRACTION = 0.2


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
    SGLang's defaults, as ``collect`` records them), engine, versions."""
    return {
        "model": dict(model),
        "decoding": {
            "algorithm": algorithm,
            "algorithm_config": served_decoding(algorithm, algorithm_config, block_size)["algorithm_config"],
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


class _Open:
    """What the recorder knows of one request between arrival and finish."""

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


class LiveRecorder:
    """Writes the requests a hooked SGLang scheduler finishes as contract-1 shards under ``out``.

    Parameters
    ----------
    out : trace directory (one per data-parallel rank).
    block_size : SGLang's dLLM block size.
    features : ``req -> (words, newlines, prompt_tokens)`` (the hook's admission features); the
        prompt text, when the features decoded it, is kept as ``req._dwise_text``.
    every : finished requests per committed shard.

    Some finished requests are not written, and ``left_out`` counts them by reason (the manifest's
    ``counts`` says how many, as ``left_out_<reason>``): ``without_prompt_rows``, a request whose
    prompt rows no forward of this process computed (a block-aligned prompt that SGLang's prefix
    cache matched whole, its last block no longer kept by the hook: ``prompt_last`` would be made
    up); ``retracted``, one SGLang retracted and ran again (its output re-encoded as prompt blocks,
    work `collect` never does); and those :func:`left_out_because` names.
    manifest : the recording's manifest (:func:`live_manifest`); by default built from ``bundle``'s
        model fingerprint (a bundle directory) and ``decoding``.
    decoding : the decoding the server runs (``algorithm``, ``algorithm_config`` with SGLang's
        defaults, ``block_size``: :func:`dwise_predict.serving.launcher.served_algorithm`); by default
        SGLang's default algorithm with its defaults. The hook compares it with the scheduler's
        ``DllmConfig`` on its first step and stops on a difference: traces say what SGLang ran.
    """

    def __init__(self, out, block_size: int, features=None, every: int = 64, manifest: dict | None = None,
                 bundle: str | None = None, decoding: dict | None = None):
        self.out = Path(out)
        self.block_size = int(block_size)
        self.features = features
        self.every = int(every)
        if manifest is None:
            import json

            model, trained = {}, {}
            if bundle is not None:
                spec = json.loads((Path(bundle) / "bundle.json").read_text())
                model, trained = spec.get("model") or {}, spec.get("decoding") or {}
            decoding = decoding or served_decoding(DEFAULT_ALGORITHM, {}, self.block_size)
            manifest = live_manifest(model, decoding["algorithm"], decoding["algorithm_config"],
                                     decoding.get("block_size") or self.block_size, int(trained.get("budget") or 0),
                                     trained.get("dtype") or "bfloat16")
        self.manifest = manifest
        self.store = TraceStore(self.out, manifest).__enter__()
        self.done = self.store.finished_ids()
        self.open: dict = {}
        self.rows: list = []
        self.first: list = []
        self.last: list = []
        self.next_index = len(self.done)
        self.written = 0
        self.left_out: Counter[str] = Counter()  # finished requests not written, by reason (this process's)

    @property
    def decoding(self) -> dict:
        """What this recording says SGLang decodes with (its manifest's ``decoding``)."""
        return self.manifest["decoding"]

    # --- events from the hook -----------------------------------------------------------------------

    def arrived(self, req, block_size: int) -> None:
        rid = str(req.rid)
        if rid in self.open:  # registered again: SGLang retracted it (work lost only if it had run)
            self.open[rid].retracted = self.open[rid].started is not None
            return
        if rid in self.done:
            return
        features = self.features(req) if self.features is not None else (0, 0, len(req.origin_input_ids))
        self.open[rid] = _Open(self.next_index, features, block_size, len(req.origin_input_ids))
        self.next_index += 1

    def forward(self, req, prompt: bool, pooled_row, rounds: int, signals=None, leftover_row=None) -> None:
        """One step ran ``req``: a prompt block, or ``rounds`` forwards of its current output block.
        ``leftover_row``: in its first denoising forward, its ``prompt_last`` should it have run no
        prompt block of its own: the hook's kept row of its last full block after a prefix-cache hit,
        else the mean of its leftover prompt rows (as the decoder records a short prompt); None when
        SGLang computed none of its prompt rows in this process (see :meth:`finished`)."""
        entry = self.open.get(str(req.rid))
        if entry is None:
            return
        if entry.started is None:
            entry.started = time.perf_counter()
        if prompt:
            entry.prefill += 1
            if pooled_row is not None:
                entry.prompt_last = np.asarray(pooled_row, dtype=np.float32)
            return
        if entry.first_round is None and pooled_row is not None:
            entry.first_round = np.asarray(pooled_row, dtype=np.float32)  # the first denoising round's pooled rows
            if signals is not None:
                entry.signals = tuple(float(x) for x in signals)
            if entry.prompt_last is None and leftover_row is not None:
                entry.prompt_last = np.asarray(leftover_row, dtype=np.float32)
        entry.current += rounds
        if len(req.output_ids) > entry.outputs or req.finished():  # the step committed the block
            entry.blocks.append(entry.current)
            entry.current, entry.outputs = 0, len(req.output_ids)

    def finished(self, req) -> None:
        rid = str(req.rid)
        entry = self.open.pop(rid, None)
        if entry is None or entry.first_round is None:
            return
        reason = req.finished_reason
        reason = getattr(reason, "to_json", lambda: {"type": reason})()
        kind = str(reason.get("type")).lower()
        if "abort" in kind:
            return  # an aborted request did not run to its end: not a trace
        output_tokens = received_tokens(req, reason)
        if entry.prompt_last is None:
            # a block-aligned prompt cached whole, whose rows no forward here computed: a made-up
            # prompt_last would be a training row the model never produced
            why = "without_prompt_rows"
        else:
            why = "retracted" if entry.retracted else left_out_because(req, reason, output_tokens)
        if why is not None:
            self.left_out[why] += 1
            return
        if entry.current:
            entry.blocks.append(entry.current)
        words, newlines, _ = entry.features
        frac, conf, ent, end = entry.signals
        row = contract_row(
            request_id=rid, split=live_split(rid), category="live", source="sglang",
            prompt=getattr(req, "_dwise_text", "") or "", prompt_tokens=entry.prompt_tokens, words=int(words),
            newlines=int(newlines), budget=int(req.sampling_params.max_new_tokens), block_size=entry.block_size,
            prompt_blocks=entry.prompt_tokens // entry.block_size, rounds_per_block=entry.blocks,
            output_tokens=output_tokens, finish="budget" if "length" in kind else "eos",
            frac_over_threshold=frac, mean_confidence=conf, mean_entropy=ent, end_probability=end,
            wall_s=time.perf_counter() - entry.started,
        )
        row["prefill_rounds"] = entry.prefill
        row[ORDER_COLUMN] = entry.index
        self.rows.append(row)
        self.first.append(entry.first_round)
        self.last.append(entry.prompt_last)
        self.done.add(rid)
        if len(self.rows) >= self.every:
            self.flush()

    # --- shards -------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Commit the finished requests held in memory as one shard."""
        if not self.rows:
            return
        self.store.write_shard(pd.DataFrame(self.rows), np.stack(self.first), np.stack(self.last))
        self.written += len(self.rows)
        self.rows, self.first, self.last = [], [], []

    def close(self) -> Path:
        """Flush, consolidate ``requests.parquet`` + ``hidden.safetensors``, release the directory."""
        try:
            self.flush()
            if self.done:
                # this process's counts: a resumed recording gives its own
                counts = {"requests": len(self.done), **{f"left_out_{why}": n for why, n in sorted(self.left_out.items())}}
                self.store.consolidate(counts)
        finally:
            self.store.__exit__(None, None, None)
        return self.out


__all__ = ["LiveRecorder", "live_manifest", "live_split"]
