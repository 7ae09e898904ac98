"""`collect` as a library call: a workload through an instrumented dLLM into a trace dataset.

    from dwise_predict.collectors.collect import collect
    from dwise_predict.collectors.records import DecodingConfig
    collect("tiny", "tiny-default", "traces/", DecodingConfig(batch_size=16), limit=64)

Work is planned in **shards**: the (limited) workload is cut, in workload order, into consecutive
runs of ``requests_per_shard`` requests; shard k belongs to ``--shard i/N`` when ``k % N == i``. Each
shard is decoded as one group and committed as one store shard, so a rerun after a crash decodes the
missing shards in exactly the batches the uninterrupted run used (results are then bit-identical even
where float reductions depend on batch composition), and ``--shard`` runs merged equal the unsharded
run. A crash loses at most the shard in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.collectors.d2f import check_d2f_options
from dwise_predict.collectors.layers import parse_layer_request, resolve_layers
from dwise_predict.collectors.scoring import score_answer
from dwise_predict.collectors.records import DecodeRequest, DecodeResult, DecodingConfig
from dwise_predict.collectors.store import ORDER_COLUMN, TraceStore
from dwise_predict.engine import ENGINE
from dwise_predict.engine.algorithms import default_algorithm, make_rule
from dwise_predict.engine.d2f import D2F
from dwise_predict.errors import ConfigError, InputError, ModelError, StoreError
from dwise_predict.features.prompt import count_newlines, count_words
from dwise_predict.files import read_json_object, refuse_aliasing
from dwise_predict.traces.dataset import MANIFEST_FILE
from dwise_predict.traces import round_states as per_round
from dwise_predict.threads import torch_threads
from dwise_predict.traces.hidden_extra import MANIFEST_KEY, HiddenExtra
from dwise_predict.versions import package_versions

SHARD_REQUESTS_PER_SLOT = 8  # default requests_per_shard = 8 x batch size: short tails, little loss on a crash


@dataclass
class CollectProgress:
    """What a progress display needs; passed to the ``progress`` callback after every request.

    total : requests this run owns (after ``--limit`` and ``--shard``).
    done : of those, finished (including ``resumed``).
    resumed : finished by an earlier run and found in the store.
    rounds : denoising rounds of the requests finished by this run.
    elapsed_s : seconds since this run started decoding.
    """

    total: int
    done: int = 0
    resumed: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0
    started: float = field(default_factory=time.perf_counter, repr=False)


def parse_shard(shard: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"i/N"`` → ``(i, N)``; raise :class:`ConfigError` unless ``0 <= i < N``."""
    if shard is None or isinstance(shard, tuple):
        parsed = shard
    else:
        try:
            i, n = (int(part) for part in str(shard).split("/"))
        except ValueError:
            raise ConfigError(f"`shard` must look like i/N (e.g. 0/4), got {shard!r}") from None
        parsed = (i, n)
    if parsed is not None and not (parsed[1] >= 1 and 0 <= parsed[0] < parsed[1]):
        raise ConfigError(f"`shard` i/N needs 0 <= i < N, got {parsed[0]}/{parsed[1]}")
    return parsed


def plan_shards(n_requests: int, requests_per_shard: int, shard: tuple[int, int] | None) -> list[range]:
    """Workload positions of every shard this run owns, in workload order."""
    runs = [range(s, min(s + requests_per_shard, n_requests)) for s in range(0, n_requests, requests_per_shard)]
    if shard is None:
        return runs
    i, n = shard
    return [r for k, r in enumerate(runs) if k % n == i]


def collect(
    model: str = "tiny",
    workload: str | os.PathLike = "tiny-default",
    out: str | os.PathLike = "traces",
    decoding: DecodingConfig | None = None,
    seed: int = 0,
    limit: int | None = None,
    shard: str | tuple[int, int] | None = None,
    progress: Callable[[CollectProgress], None] | None = None,
    *,
    device: str = "cpu",
    trust_remote_code: bool = False,
    requests_per_shard: int | None = None,
    allow_missing: bool = False,
    allow_network: bool | None = None,
    layers: str | Sequence[int] | None = None,
    pooling: str | Sequence[str] | None = None,
    rounds_hidden: int | None = None,
) -> Path:
    """Decode a workload with an instrumented dLLM into contract 1's trace dataset at ``out``.

    Resumes: requests already in ``out``'s shards are not decoded again. On completion the shards are
    consolidated into ``requests.parquet`` + ``hidden.safetensors`` (rows in workload order).

    Parameters
    ----------
    model : ``tiny`` or a local model directory (see :func:`dwise_predict.collectors.backends.load_backend`).
    workload : a preset name (``tiny-default``, ``dwise-paper``) or a workload spec file.
    out : output directory; created if missing, resumed if it holds this model's and config's traces.
    decoding : algorithm and its parameters, block size, budget, dtype, batch size (default
        :class:`DecodingConfig`; the algorithm defaults to the one SGLang serves the model with).
    seed : workload sampling and split seed (also seeds backends that sample).
    limit : take only the first ``limit`` requests of the workload.
    shard : ``"i/N"``: decode only the i-th of N deterministic parts (merge them with `traces merge`).
    progress : called with a :class:`CollectProgress` at start and after every finished request.
    requests_per_shard : requests per committed shard (default 8 x batch size).
    allow_missing : collect the workload's available sources when some are missing (the manifest's
        workload composition lists the missing ones) instead of refusing.
    allow_network : let hub datasets download (True) or not (False); None (default) follows the
        workload spec's ``allow_network`` (off unless it says so), as :func:`.workloads.load_workload`.
    layers, pooling : also keep the first denoising forward at these layers (``"0,2,-1"``; 0 = the
        embedding output, -1 = the final hidden state) and poolings (``"mean,last,positions"``,
        default ``mean``), as contract 1's optional tensors (:mod:`dwise_predict.traces.hidden_extra`);
        recorded in the manifest under ``hidden_extra``, and a resume must ask for the same.
    rounds_hidden : also keep the pooled state and early signals of each request's first this many
        denoising rounds (contract 1's ``round_states`` / ``round_signals`` and the column
        ``rounds_recorded``, :mod:`dwise_predict.traces.round_states`); recorded in the manifest as
        ``rounds_hidden``, and a resume must ask for the same. None (default) keeps none.

    Returns
    -------
    ``out`` as a :class:`Path`.
    """
    from dwise_predict.collectors.workloads import load_workload

    decoding = decoding or DecodingConfig()
    shard, layer_request, per_shard = _check_options(out, model, workload, decoding, shard, layers, pooling,
                                                     requests_per_shard, rounds_hidden)
    plan_workload = load_workload(workload, seed=seed, limit=limit, allow_missing=allow_missing,
                                  allow_network=allow_network)  # raises on an empty or broken workload
    requests = plan_workload.requests
    owned = plan_shards(len(requests), per_shard, shard)
    _refuse_idle_shard(owned, shard, len(requests), per_shard)
    planned = [requests[i] for run in owned for i in run]
    source_types = {name: entry.get("type") for name, entry in plan_workload.sources.items()}
    # locked before the model load; the shards it commits stay in memory for the consolidation at the end
    with torch_threads(collect_threads(shard)), TraceStore(out, keep_shards=True) as store:
        backend, decoding, hidden_extra = _ready_backend(model, decoding, layer_request, rounds_hidden,
                                                         trust_remote_code, device)
        manifest = _manifest(backend, decoding, plan_workload, workload, limit, shard, per_shard, device, planned,
                             hidden_extra, rounds_hidden)
        done, state = _begin(store, out, manifest, planned, progress)
        on_result = partial(_advance, progress, state)
        for run in owned:
            todo = [i for i in run if requests[i].request_id not in done]
            if todo:
                _decode_shard(store, backend, requests, todo, source_types, decoding, seed, on_result, hidden_extra,
                              rounds_hidden or 0)
        store.consolidate({"requests": state.total, "resumed": state.resumed})
    return Path(out)


def collect_threads(shard: tuple[int, int] | None) -> int | None:
    """Torch threads for a collection (recorded nowhere: they change no result): one when it is one of
    several ``shard`` workers (they run side by side, a core each: more threads would make them wait at
    each other's barriers), else every core this process may run on. None where ``OMP_NUM_THREADS`` is
    set: that choice (a user's, a test harness's) is torch's already."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    if shard is not None and shard[1] > 1:
        return 1
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(cores))


def _refuse_idle_shard(owned: list[range], shard: tuple[int, int] | None, n_requests: int, per_shard: int) -> None:
    """A ``shard`` that owns no request is refused before the store is made (its empty consolidation
    said "run collect first")."""
    if owned:
        return
    groups = -(-n_requests // per_shard)
    raise ConfigError(f"`shard` {shard[0]}/{shard[1]} owns none of the workload's {n_requests:,} requests "
                      f"({groups:,} group(s) of up to {per_shard:,}, dealt to the shards in turn): split it into "
                      f"at most {groups:,} shards, or raise `limit`")


def _check_options(out, model, workload, decoding: DecodingConfig, shard, layers, pooling,
                   requests_per_shard: int | None, rounds_hidden: int | None):
    """Refuse bad options before the workload and the model load: the parsed shard, layer request and
    requests per shard."""
    refuse_aliasing(out, [(label, path) for label, path in (("`model`", model), ("`workload`", workload))
                          if Path(path).exists()])
    if Path(out).exists() and not Path(out).is_dir():
        raise InputError(f"`out` {out} is a file: give a directory (new, empty, or a collection to resume)")
    shard = parse_shard(shard)
    layer_request = parse_layer_request(layers, pooling)
    slots = 1 if decoding.algorithm == D2F.name else decoding.batch_size  # D2F: one request at a time
    per_shard = requests_per_shard or SHARD_REQUESTS_PER_SLOT * slots
    if per_shard <= 0:
        raise ConfigError(f"requests per shard must be positive, got {per_shard}")
    check_rounds_hidden(rounds_hidden)
    check_d2f_options(decoding.algorithm, rounds_hidden)
    return shard, layer_request, per_shard


def _ready_backend(model, decoding: DecodingConfig, layer_request, rounds_hidden: int | None,
                   trust_remote_code: bool, device: str):
    """The loaded backend, the decoding config as it will run (:func:`resolve_decoding`) and the
    extra first-round tensors to keep (None: none); refuses what this model cannot collect."""
    from dwise_predict.collectors.backends import load_backend

    backend = load_backend(model, trust_remote_code=trust_remote_code, dtype=decoding.dtype, device=device,
                           block_size=decoding.block_size)
    if getattr(backend, "tokenizer", None) is None:
        raise ModelError(f"{model} has no tokenizer (tokenizer.json): collect needs its chat template")
    decoding = resolve_decoding(backend, decoding)
    hidden_extra = resolve_layers(layer_request, backend)
    if rounds_hidden and getattr(backend, "runs_own_loop", False):
        raise ConfigError(f"`rounds_hidden`: this model decodes with its own loop ({backend.algorithm}), which the "
                          "collector watches at its first round only: drop `rounds_hidden`")
    return backend, decoding, hidden_extra


def _begin(store: TraceStore, out, manifest: dict, planned: list, progress) -> tuple[set[str], CollectProgress]:
    """Open (or resume) the collection in ``store``: the ids it already holds and the progress
    reported so far. A resume may only grow the planned requests (:func:`_refuse_unplanned`)."""
    done = store.finished_ids()
    _refuse_unplanned(out, done - {r.request_id for r in planned})
    store.begin(manifest)
    state = CollectProgress(total=len(planned))
    state.resumed = state.done = sum(r.request_id in done for r in planned)
    if state.done < state.total:
        store.mark_incomplete()
    _report(progress, state)
    return done, state


def _decode_shard(store: TraceStore, backend, requests: list, todo: list[int], source_types: dict,
                  decoding: DecodingConfig, seed: int, on_result: Callable[[DecodeResult], None],
                  hidden_extra: HiddenExtra | None, rounds_hidden: int) -> None:
    """Decode the unfinished requests ``todo`` (workload positions) of one shard and commit them as
    one store shard."""
    decode_requests = _decode_requests(backend, [requests[i] for i in todo], decoding)
    results = _decode(backend, decode_requests, decoding, seed, on_result, hidden_extra, rounds_hidden)
    rows = [_row(backend, requests[i], i, d.budget, r, source_types.get(requests[i].source))
            for i, d, r in zip(todo, decode_requests, results)]
    store.write_shard(
        pd.DataFrame(rows),
        np.stack([r.first_round_hidden for r in results]),
        np.stack([r.prompt_last_hidden for r in results]),
        {**{name: np.stack([r.first_round_layers[name] for r in results])
            for name in (hidden_extra.names() if hidden_extra else ())},
         **_round_tensors(results, rounds_hidden)},
    )


# the most rounds `rounds_hidden` keeps per request: its tensors are padded to N rows of H floats per
# request (256 x 2,048 x 4 bytes = 2 MiB a request); the refinement studies use up to 8
MAX_ROUNDS_HIDDEN = 256


def check_rounds_hidden(rounds_hidden: int | None) -> None:
    """``--rounds-hidden N`` needs ``1 <= N <=`` :data:`MAX_ROUNDS_HIDDEN` (leave it out to keep none)."""
    if rounds_hidden is not None and not 1 <= rounds_hidden <= MAX_ROUNDS_HIDDEN:
        raise ConfigError(f"`rounds_hidden` must be from 1 to {MAX_ROUNDS_HIDDEN} (the first N denoising rounds), got "
                          f"{rounds_hidden}: each request keeps N x H floats; leave it out to keep the first round only")


def _round_tensors(results: list[DecodeResult], keep: int) -> dict[str, np.ndarray]:
    """``round_states`` (n, keep, H) and ``round_signals`` (n, keep, 4), zeros after a request's last round."""
    if not keep:
        return {}
    return {per_round.STATES: np.stack([per_round.padded(list(r.round_states), keep, r.round_states.shape[1])
                                        for r in results]),
            per_round.SIGNALS: np.stack([per_round.padded(list(r.round_signals), keep, r.round_signals.shape[1])
                                         for r in results])}


def _refuse_unplanned(out, unplanned: set[str]) -> None:
    """A resumed collection may grow (a larger ``--limit``) but never shrink: finished requests that
    this run's plan leaves out would be consolidated under a manifest that does not describe them."""
    if not unplanned:
        return
    try:
        started = read_json_object(Path(out) / MANIFEST_FILE, StoreError).get("workload", {}).get("limit")
    except (OSError, StoreError, AttributeError):
        started = None
    raise StoreError(f"{out} already holds {len(unplanned)} finished requests that this run's workload leaves out "
                     f"(it was started with `limit` {started}): rerun with that `limit` or a larger one, or choose "
                     "another `out`")


def resolve_decoding(backend, decoding: DecodingConfig) -> DecodingConfig:
    """The decoding config as it will run: the algorithm SGLang would pick for this architecture when
    none is given, and every algorithm parameter with its value (SGLang's defaults filled in)."""
    if getattr(backend, "runs_own_loop", False):
        if decoding.algorithm is not None:
            raise ConfigError(f"this model decodes with its own loop ({backend.algorithm}): drop `algorithm`")
        return decoding
    algorithm = decoding.algorithm or default_algorithm(getattr(backend, "architecture", None))
    rule = make_rule(algorithm, backend.mask_token_id, decoding.algorithm_config)
    if isinstance(rule, D2F):  # decoded one request at a time (collectors.d2f): the manifest says so
        decoding = replace(decoding, batch_size=1)
    return replace(decoding, algorithm=algorithm, algorithm_config=rule.params)


def _decode(backend, decode_requests: list[DecodeRequest], decoding: DecodingConfig, seed: int,
            on_result: Callable[[DecodeResult], None], hidden_extra: HiddenExtra | None,
            rounds_hidden: int = 0) -> list[DecodeResult]:
    """Decode one shard's requests with the backend's own loop or the engine-semantics decoder, in input order."""
    if getattr(backend, "runs_own_loop", False):
        stream: Iterator[DecodeResult] = backend.decode_requests(decode_requests, decoding, seed=seed, on_result=on_result)
    else:
        from dwise_predict.collectors.decoder import decode

        stream = decode(backend, decode_requests, decoding, on_result=on_result, hidden_layers=hidden_extra,
                        rounds_hidden=rounds_hidden)
    by_id = {r.request_id: r for r in stream}
    return [by_id[r.request_id] for r in decode_requests]


def _decode_requests(backend, requests: list, decoding: DecodingConfig) -> list[DecodeRequest]:
    """``requests`` through the model's chat template, tokenised as one batch (half the time of one call
    each; the same ids)."""
    # transformers 5.x returns a BatchEncoding unless return_dict=False.
    ids = backend.tokenizer.apply_chat_template([r.messages for r in requests], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    return [DecodeRequest(r.request_id, [int(t) for t in row],
                          int(r.budget if r.budget is not None else decoding.budget)) for r, row in zip(requests, ids)]


def contract_row(*, request_id, split, category, source, prompt, prompt_tokens, words, newlines, budget, block_size,
                 prompt_blocks, rounds_per_block, output_tokens, finish, frac_over_threshold, mean_confidence,
                 mean_entropy, end_probability, wall_s) -> dict:
    """The contract-1 columns of one request (``REQUEST_COLUMNS``), typed; shared by ``collect`` and
    recording mode (:mod:`dwise_predict.collectors.live`)."""
    rounds = list(map(int, rounds_per_block))
    return {
        "request_id": request_id,
        "split": split,
        "category": category,
        "source": source,
        "prompt": prompt,
        "prompt_tokens": int(prompt_tokens),
        "words": int(words),
        "newlines": int(newlines),
        "budget": int(budget),
        "block_size": int(block_size),
        "prompt_blocks": int(prompt_blocks),
        "total_rounds": int(sum(rounds)),
        "rounds_per_block": rounds,
        "output_tokens": int(output_tokens),
        "finish": finish,
        "frac_over_threshold": float(frac_over_threshold),
        "mean_confidence": float(mean_confidence),
        "mean_entropy": float(mean_entropy),
        "end_probability": float(end_probability),
        "wall_s": float(wall_s),
    }


def _row(backend, request, index: int, budget: int, result: DecodeResult, source_type: str | None) -> dict:
    """One contract-1 row (plus output text, correctness where a reference exists, backend extras)."""

    text = backend.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    row = contract_row(
        request_id=request.request_id, split=request.split, category=request.category, source=request.source,
        prompt=request.prompt, prompt_tokens=result.prompt_tokens, words=count_words(request.prompt),
        newlines=count_newlines(request.prompt), budget=budget, block_size=result.block_size,
        prompt_blocks=result.prompt_blocks, rounds_per_block=result.rounds_per_block,
        output_tokens=result.output_tokens, finish=result.finish, frac_over_threshold=result.frac_over_threshold,
        mean_confidence=result.mean_confidence, mean_entropy=result.mean_entropy,
        end_probability=result.end_probability, wall_s=result.wall_s,
    )
    row.update({"output_text": text, "correct": score_answer(request, text, source_type), ORDER_COLUMN: index})
    if result.round_states is not None:
        row[per_round.COUNT_COLUMN] = len(result.round_states)
    row.update({k: v for k, v in result.extra.items() if isinstance(v, (bool, int, float, str)) and k not in row})
    return row


def _advance(progress, state: CollectProgress, result: DecodeResult) -> None:
    state.done += 1
    state.rounds += result.total_rounds
    _report(progress, state)


def _report(progress, state: CollectProgress) -> None:
    if progress is not None:
        state.elapsed_s = time.perf_counter() - state.started
        progress(replace(state))


def _manifest(backend, decoding, plan_workload, spec, limit, shard, per_shard, device, owned,
              hidden_extra: HiddenExtra | None, rounds_hidden: int | None) -> dict:
    composition: dict[str, dict[str, int]] = {}
    for r in owned:
        composition.setdefault(r.category, {}).setdefault(r.split, 0)
        composition[r.category][r.split] += 1
    manifest = {
        "model": backend.fingerprint(),
        "decoding": {
            **decoding.to_dict(),
            "algorithm": getattr(backend, "algorithm", decoding.algorithm),
            "block_size": int(decoding.block_size or backend.block_size),
            "params": backend.decoding_params() if hasattr(backend, "decoding_params") else {},
            "engine": ENGINE,
            "engine_faithful": getattr(backend, "engine_faithful", True),
        },
        "workload": {
            "name": plan_workload.name,
            "spec": str(spec),
            "seed": plan_workload.seed,
            "limit": limit,
            "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
            "composition": composition,
            "plan": plan_workload.composition(),
        },
        "collection": {"requests_per_shard": per_shard, "device": device},
        "versions": package_versions(),
    }
    if hidden_extra is not None:  # absent otherwise: a default collection's manifest is unchanged
        manifest[MANIFEST_KEY] = hidden_extra.to_manifest()
    if rounds_hidden:
        manifest[per_round.MANIFEST_KEY] = rounds_hidden
    return manifest
