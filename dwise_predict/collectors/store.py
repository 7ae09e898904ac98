"""The shard store behind `collect` and `traces merge` (contract 1 while collecting).

Layout of an output directory ``OUT``::

    OUT/.lock                     fcntl lock: one writer at a time
    OUT/manifest.json             written at start: model fingerprint, decoding config, workload, versions
    OUT/shards/shard-000000.safetensors   first_round + prompt_last rows of one shard (and the
                                          `collect --layers` tensors, traces.hidden_extra)
    OUT/shards/shard-000000.parquet       the shard's request rows (its presence commits the shard)
    OUT/requests.parquet + OUT/hidden.safetensors   consolidated on completion (contract 1)

Commit protocol: a shard's safetensors file lands first (temp + fsync + rename), then its Parquet file
(the same way). A shard counts only when its Parquet file exists and both files agree on the request
ids, so a kill at any moment leaves either a whole shard or an orphan safetensors file that is ignored
and overwritten by the next shard. The safetensors metadata records checksums of both files' content
(:data:`CHECKSUM_KEYS`), checked wherever shards are read (resume, consolidation, merge): a shard
damaged on disk is refused by name, never merged (shards written before checksums were recorded
are read unchecked). Shards are never rewritten: a finished request is never lost, and
:meth:`TraceStore.missing` makes a rerun decode only what no shard holds, so none is duplicated.

Identity: a directory belongs to one model (weights sha256 + config hash), one decoding config
(algorithm and its parameters, block size, budget, dtype, backend parameters) and one engine
semantics (the engine version and the trace schema): traces in other units are never mixed. The
batch size is recorded but not part of the identity, so a run can resume with another ``--batch-size``.
The ``--layers`` / ``--pooling`` spec (manifest key ``hidden_extra``) is not part of the model or
decoding identity, but every shard of a directory carries the same tensors, so a resume or a merge
with another spec is refused (:func:`check_same_hidden_extra`); so is one with another
``--rounds-hidden`` (manifest key ``rounds_hidden``, :func:`check_same_rounds_hidden`). Schema 4 only
added those optional per-round tensors, so a collection of schema 3 resumes and merges with it.

Code: the package's own source is not part of the identity (a resume after an upgrade keeps the
finished requests), but each shard records the source fingerprint of the code that decoded it, and
a dataset whose requests were decoded by more than one version of the code says so in its manifest
(``mixed_sources``: fingerprint -> requests; absent when one version did all of them).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.engine import ENGINE
from dwise_predict.errors import StoreError, TraceError
from dwise_predict.files import (FileLock, atomic_write_bytes, loads_json, read_json_object, refuse_aliasing,
                                 refuse_unusable_path, write_errors)
from dwise_predict.names import DECODING_KEYS, MODEL_KEYS, identity
from dwise_predict.traces.hidden_extra import MANIFEST_KEY as HIDDEN_EXTRA_KEY
from dwise_predict.traces.round_states import MANIFEST_KEY as ROUNDS_HIDDEN_KEY
from dwise_predict.traces.dataset import (
    HIDDEN_FILE,
    MANIFEST_FILE,
    REQUESTS_FILE,
    SAME_UNITS_SINCE,
    SCHEMA_VERSION,
    TraceDataset,
    load_traces,
    write_traces,
)
from dwise_predict.versions import SOURCE_KEY, source_fingerprint

SHARDS_DIR = "shards"
LOCK_FILE = ".lock"
ORDER_COLUMN = "workload_index"  # position of the request in its workload: consolidation sorts by it
MIXED_SOURCES = "mixed_sources"  # manifest key: source fingerprint -> requests, when more than one decoded them
UNRECORDED = "unrecorded"  # a shard written before shards recorded their code
SEVERAL = "several"  # rows of a consolidated input that was itself mixed: which code decoded each is not kept
# safetensors metadata of a shard: sha256 of its Parquet file's bytes, and of its own tensors' names,
# shapes and values (its own bytes cannot hold their own hash)
CHECKSUM_KEYS = ("requests_sha256", "tensors_sha256")


def model_identity(manifest: dict) -> dict:
    """The fingerprint fields that decide whether two collections come from the same model."""
    return identity(manifest.get("model"), MODEL_KEYS)


def decoding_identity(manifest: dict) -> dict:
    """The decoding fields that change results (everything but the batch size). The parameters of an
    algorithm our engine mirrors are taken over SGLang's defaults, as a server reads them: an older
    recording's LowConfidence ``{}`` and today's ``{"threshold": 0.95}`` are one decoding."""
    from dwise_predict.engine.algorithms import served_decoding  # torch: not for every reader of a store

    found = identity(manifest.get("decoding"), DECODING_KEYS)
    if isinstance(found["algorithm_config"], dict):
        found["algorithm_config"] = served_decoding(found["algorithm"], found["algorithm_config"], None)["algorithm_config"]
    return found


def check_compatible(theirs: dict, ours: dict, where: str, fix: str) -> None:
    """Raise :class:`StoreError` when two manifests differ in model or decoding identity.

    ``where`` names the directory holding ``theirs``; ``fix`` says what the user can do.
    """
    schemas = theirs.get("schema_version"), ours.get("schema_version", SCHEMA_VERSION)
    if not all(isinstance(v, int) and SAME_UNITS_SINCE <= v <= SCHEMA_VERSION for v in schemas):
        raise StoreError(
            f"{where} holds traces of schema {schemas[0]!r}, in other round units than this dwise-predict "
            f"writes (schema {SCHEMA_VERSION}, {ENGINE} semantics): recollect them with this version, or {fix}")
    if model_identity(theirs) != model_identity(ours):
        a, b = theirs.get("model", {}), ours.get("model", {})
        raise StoreError(
            f"{where} holds traces of another model ({a.get('name')}, weights {str(a.get('weights_sha256'))[:12]}) "
            f"than this one ({b.get('name')}, weights {str(b.get('weights_sha256'))[:12]}): {fix}"
        )
    if decoding_identity(theirs) != decoding_identity(ours):
        a, b = decoding_identity(theirs), decoding_identity(ours)
        diff = ", ".join(f"{k} {a[k]!r} vs {b[k]!r}" for k in DECODING_KEYS if a[k] != b[k])
        raise StoreError(f"{where} holds traces decoded with another config ({diff}): {fix}")


def check_same_hidden_extra(theirs: dict, ours: dict, where: str, fix: str) -> None:
    """Raise :class:`StoreError` when two manifests keep different `collect --layers` tensors."""
    a, b = _layers_label(theirs), _layers_label(ours)
    if a != b:
        raise StoreError(f"{where} holds first-round tensors {a}, not {b}: {fix}")


def check_same_rounds_hidden(theirs: dict, ours: dict, where: str, fix: str) -> None:
    """Raise :class:`StoreError` when two manifests keep per-round states of different depths."""
    a, b = theirs.get(ROUNDS_HIDDEN_KEY), ours.get(ROUNDS_HIDDEN_KEY)
    if a != b:
        label = lambda n: f"`rounds_hidden` {n}" if n else "no per-round states (no `rounds_hidden`)"  # noqa: E731
        raise StoreError(f"{where} holds {label(a)}, not {label(b)}: {fix}")


def _layers_label(manifest: dict) -> str:
    spec = manifest.get(HIDDEN_EXTRA_KEY)
    if not spec:
        return "first_round only (no `layers`)"
    return f"`layers` {','.join(map(str, spec['layers']))} `pooling` {','.join(spec['pooling'])}"


@dataclass
class Shard:
    """One committed shard: its request rows and the hidden rows aligned with them."""

    requests: pd.DataFrame
    first_round: np.ndarray  # (n, H) float32
    prompt_last: np.ndarray  # (n, H) float32
    path: Path
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # `collect --layers` tensors, (n, ...) float32
    source: str = UNRECORDED  # the source fingerprint of the code that decoded these requests


def read_shards(out: Path) -> list[Shard]:
    """Every committed shard under ``out/shards``, in write order (orphans from a crash are skipped).

    Raises :class:`StoreError` naming a shard that cannot be read, whose two files disagree, or whose
    content differs from the checksums recorded when it was written (a bit flipped on disk).
    """
    return [read_shard(table) for table in committed_tables(out)]


def committed_tables(out: Path) -> list[Path]:
    """The Parquet files of the committed shards under ``out/shards``, in write order."""
    return sorted((out / SHARDS_DIR).glob("shard-*.parquet"))


def read_shard(table: Path) -> Shard:
    """The committed shard whose Parquet file is ``table``, checked as :func:`read_shards` says."""
    from safetensors import safe_open

    tensors = table.with_suffix(".safetensors")
    redo = f"delete {table.name} and {tensors.name} and rerun to decode those requests again"
    try:
        table_bytes = table.read_bytes()
        requests = pd.read_parquet(io.BytesIO(table_bytes))
        with safe_open(str(tensors), framework="numpy") as f:
            metadata = f.metadata() or {}
            ids = loads_json(metadata["request_ids"], StoreError, f"the request ids of {tensors}")
            hidden = {name: f.get_tensor(name) for name in f.keys()}
        first_round, prompt_last = hidden.pop("first_round"), hidden.pop("prompt_last")
    except Exception as err:  # pyarrow / safetensors / json raise many types for a damaged file
        raise StoreError(f"shard {table} cannot be read ({err}): {redo}") from None
    if ids != requests["request_id"].tolist() or len(first_round) != len(requests):
        raise StoreError(
            f"shard {table} and {tensors.name} disagree on their requests: delete both and rerun to decode "
            "those requests again"
        )
    recorded = [metadata.get(key) for key in CHECKSUM_KEYS]
    found = [hashlib.sha256(table_bytes).hexdigest(),
             _tensors_digest({"first_round": first_round, "prompt_last": prompt_last, **hidden})]
    if any(r is not None and r != f for r, f in zip(recorded, found)):
        raise StoreError(f"shard {table} is damaged: its content differs from the checksum recorded when it was "
                         f"written: {redo}")
    return Shard(requests, first_round, prompt_last, table, hidden, metadata.get("source", UNRECORDED))


@dataclass
class _KeptShard:
    """A shard this store committed, as it handed it to the files, and the sha256 of each file's bytes
    (Parquet, safetensors): while a file still holds those bytes, reading it back gives this shard."""

    shard: Shard
    file_digests: tuple[str, str]

    def matches_files(self) -> bool:
        files = (self.shard.path, self.shard.path.with_suffix(".safetensors"))
        try:
            return all(hashlib.sha256(path.read_bytes()).hexdigest() == digest
                       for path, digest in zip(files, self.file_digests))
        except OSError:  # gone or unreadable: read_shard says which and what to do
            return False


def _tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors``, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        values = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{values.dtype.str}|{values.shape}|".encode())
        digest.update(values.tobytes())
    return digest.hexdigest()


def request_sources(shards: list[Shard]) -> list[str]:
    """The source fingerprint behind each request of ``shards``, in shard order."""
    return [s.source for s in shards for _ in range(len(s.requests))]


def with_sources(manifest: dict, sources: Iterable[str]) -> dict:
    """``manifest`` with ``mixed_sources`` (fingerprint -> requests) when ``sources`` (one per request)
    hold more than one fingerprint (or rows of an already mixed input), without it otherwise."""
    counts = pd.Series(list(sources), dtype=object).value_counts()
    manifest = {k: v for k, v in manifest.items() if k != MIXED_SOURCES}
    if len(counts) > 1 or SEVERAL in counts:
        manifest[MIXED_SOURCES] = {str(source): int(n) for source, n in sorted(counts.items())}
    return manifest


def mixed_sources_note(path: str | os.PathLike, manifest: dict) -> str | None:
    """One line saying which versions of the code decoded a dataset's requests, or None when one did."""
    mixed = manifest.get(MIXED_SOURCES)
    if not mixed:
        return None
    counts = ", ".join(f"{source[:12]}: {n}" for source, n in mixed.items())
    return (f"note: {path}'s requests were decoded by {len(mixed)} versions of dwise-predict's code (source "
            f"fingerprint: requests; {counts}); delete its shards and collect again for one")


def concat_shards(shards: list[Shard], manifest: dict, sort_keys: list[str] | None = None) -> TraceDataset:
    """Stack shards into one :class:`TraceDataset`, rows sorted by ``sort_keys`` (default: workload order)."""
    requests, first_round, prompt_last, extra = _stack(shards, sort_keys or [ORDER_COLUMN])
    return TraceDataset(requests, first_round, prompt_last, manifest, extra_hidden=extra)


def _row_shapes(shard: Shard) -> dict[str, tuple]:
    """The shape of one request's rows in each hidden tensor of ``shard``."""
    return {"first_round": shard.first_round.shape[1:], "prompt_last": shard.prompt_last.shape[1:],
            **{name: values.shape[1:] for name, values in sorted(shard.extra.items())}}


def _stack(shards: list[Shard], sort_keys: list[str]) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, dict]:
    if not shards:
        raise StoreError("no finished requests to consolidate: run `dwise-predict collect` first")
    names = sorted(shards[0].extra)
    shapes = _row_shapes(shards[0])
    for s in shards:
        if sorted(s.extra) != names:  # the manifest checks make this a damaged or hand-made shard
            raise StoreError(f"shard {s.path} holds other first-round tensors ({', '.join(sorted(s.extra)) or 'none'}) "
                             f"than {shards[0].path} ({', '.join(names) or 'none'}): delete the odd shard and rerun")
        if _row_shapes(s) != shapes:  # two hidden sizes: two models behind one manifest
            odd = next(name for name in shapes if _row_shapes(s)[name] != shapes[name])
            raise StoreError(f"{s.path} holds {odd} rows of shape {_row_shapes(s)[odd]}, {shards[0].path} of "
                             f"{shapes[odd]}: they come from different models; combine only collections of one model")
    requests = pd.concat([s.requests for s in shards], ignore_index=True)
    first_round = np.concatenate([s.first_round for s in shards])
    prompt_last = np.concatenate([s.prompt_last for s in shards])
    order = np.lexsort([requests[k].to_numpy() for k in reversed(sort_keys)])
    extra = {name: np.concatenate([s.extra[name] for s in shards])[order] for name in names}
    return requests.iloc[order].reset_index(drop=True), first_round[order], prompt_last[order], extra


class TraceStore:
    """The single writer of one output directory: lock, manifest, append-only shards, consolidation.

    Use as a context manager; the lock is taken on entry and held until exit, so a second writer is
    refused before it loads a model.

    Parameters
    ----------
    out : output directory (created if missing).
    manifest : the run's manifest (``model``, ``decoding``, ``workload``, ``versions`` ...), or
        ``None`` to pass it later to :meth:`begin`.
    keep_shards : keep each shard :meth:`write_shard` commits in memory (its arrays as given, not
        copied), so :meth:`consolidate` parses and re-hashes only the shards of earlier runs; a kept
        shard's two files are still checked, byte for byte against what was written (sha256), and one
        that changed on disk is read and refused as any damaged shard is. For `collect`, which
        consolidates every shard at its end anyway; not for a recording server that writes for days.
    """

    def __init__(self, out: str | os.PathLike, manifest: dict | None = None, keep_shards: bool = False) -> None:
        self.out = Path(out)
        self.manifest = manifest
        self._file_lock: FileLock | None = None
        self._created = False  # whether __enter__ made the directory
        self._kept: dict[Path, _KeptShard] | None = {} if keep_shards else None  # by Parquet path

    # -- opening -----------------------------------------------------------------------------------

    def __enter__(self) -> "TraceStore":
        refuse_unusable_path(self.out)
        self._created = not self.out.exists()
        with _store_errors(self.out):
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock()
        try:
            if self.manifest is not None:
                self.begin(self.manifest)
        except BaseException:
            self._unlock()
            raise
        return self

    def begin(self, manifest: dict) -> None:
        """Check ``manifest`` against what ``out`` holds, then write it (atomically).

        Raises :class:`StoreError` when ``out`` holds shards of another model or decoding config, or of
        another workload name, seed or ``--shard`` selection.
        """
        self.manifest = dict(manifest, schema_version=SCHEMA_VERSION)
        self._check_existing()
        with _store_errors(self.out):
            atomic_write_bytes(self.out / MANIFEST_FILE, json.dumps(self.manifest, indent=2, sort_keys=True).encode(), durable=True)

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._created and [p.name for p in self.out.iterdir()] == [LOCK_FILE]:
            # refused before anything was written (a bad --model, --device, --layers): leave no trace
            # of the attempt. Unlinked while still held, so no other writer can take this lock file.
            (self.out / LOCK_FILE).unlink()
            self._unlock()
            self.out.rmdir()
            return
        self._unlock()

    def _lock(self) -> None:
        self._file_lock = FileLock(self.out / LOCK_FILE, lambda holder: (
            f"{self.out} is being written by another dwise-predict process (pid {holder}): wait for it to "
            "finish, or give this run another `out`"))
        self._file_lock.__enter__()

    def _unlock(self) -> None:
        if self._file_lock is not None:
            self._file_lock.__exit__()
            self._file_lock = None

    def _check_existing(self) -> None:
        path = self.out / MANIFEST_FILE
        has_shards = any((self.out / SHARDS_DIR).glob("shard-*.parquet"))
        if not path.is_file():
            if has_shards:
                raise StoreError(
                    f"{self.out} has shards but no {MANIFEST_FILE}: it was not written by this version of "
                    "dwise-predict; choose another `out`"
                )
            if any(not p.name.startswith(".") and p.name != SHARDS_DIR for p in self.out.iterdir()):  # lock, temp files
                raise StoreError(f"{self.out} holds files but is not a trace collection (no {MANIFEST_FILE}): "
                                 "traces are never written into another folder; choose a new or empty `out`")
            return
        if not has_shards and not (self.out / REQUESTS_FILE).is_file():
            return  # a run that stopped before its first shard binds nothing
        theirs = read_json_object(path, StoreError, fix="choose another `out`")
        fix = "choose another `out` (or delete that directory to start over)"
        check_compatible(theirs, self.manifest, str(self.out), fix)
        check_same_hidden_extra(theirs, self.manifest, str(self.out),
                                "rerun with the `layers` and `pooling` it was collected with, or " + fix)
        check_same_rounds_hidden(theirs, self.manifest, str(self.out),
                                 "rerun with the `rounds_hidden` it was collected with, or " + fix)
        for key in ("name", "seed", "shard"):
            a, b = theirs.get("workload", {}).get(key), self.manifest.get("workload", {}).get(key)
            if a != b:
                raise StoreError(
                    f"{self.out} holds traces of workload {key} {a!r}, this run asks for {b!r}: {fix}"
                    + ("; collect each `shard` into its own `out` and combine them with `dwise-predict traces merge`"
                       if key == "shard" else "")
                )

    # -- shards ------------------------------------------------------------------------------------

    def finished_ids(self) -> set[str]:
        """Request ids that a committed shard already holds."""
        return {rid for shard in read_shards(self.out) for rid in shard.requests["request_id"]}

    def missing(self, request_ids: Iterable[str]) -> list[str]:
        """The ids of ``request_ids`` that no committed shard holds, in the given order."""
        done = self.finished_ids()
        return [rid for rid in request_ids if rid not in done]

    def write_shard(self, requests: pd.DataFrame, first_round: np.ndarray, prompt_last: np.ndarray,
                    extra: dict[str, np.ndarray] | None = None) -> Path:
        """Commit one shard atomically and return its Parquet path.

        Parameters
        ----------
        requests : one row per finished request; must hold ``request_id`` and ``workload_index``.
        first_round, prompt_last : arrays of shape (n, H), float32, row i belonging to row i of ``requests``.
        extra : the `collect --layers` tensors by name (:mod:`dwise_predict.traces.hidden_extra`), each
            with n rows.
        """
        extra = extra or {}
        if (ORDER_COLUMN not in requests.columns or len(first_round) != len(requests) != len(prompt_last)
                or any(len(v) != len(requests) for v in extra.values())):
            raise ValueError("a shard needs workload_index and hidden rows aligned with its requests")
        from safetensors.numpy import save

        shards = self.out / SHARDS_DIR
        with _store_errors(self.out):
            shards.mkdir(exist_ok=True)
        taken = [int(p.stem.split("-")[1]) for p in shards.glob("shard-*.parquet")]
        stem = shards / f"shard-{max(taken, default=-1) + 1:06d}"
        table = io.BytesIO()
        requests.reset_index(drop=True).to_parquet(table, index=False)
        hidden = {
            "first_round": np.ascontiguousarray(first_round, dtype=np.float32),
            "prompt_last": np.ascontiguousarray(prompt_last, dtype=np.float32),
            **{name: np.ascontiguousarray(v, dtype=np.float32) for name, v in extra.items()},
        }
        table_digest, source = hashlib.sha256(table.getvalue()).hexdigest(), source_fingerprint()
        blob = save(hidden, metadata={
            "request_ids": json.dumps(requests["request_id"].tolist()), "source": source,
            **dict(zip(CHECKSUM_KEYS, (table_digest, _tensors_digest(hidden))))})
        path = stem.with_suffix(".parquet")
        with _store_errors(self.out):
            # safetensors first: the Parquet file's arrival is what commits the shard.
            atomic_write_bytes(stem.with_suffix(".safetensors"), blob, durable=True)
            atomic_write_bytes(path, table.getvalue(), durable=True)
        if self._kept is not None:
            first, last = hidden.pop("first_round"), hidden.pop("prompt_last")
            self._kept[path] = _KeptShard(Shard(requests.reset_index(drop=True), first, last, path, hidden, source),
                                          (table_digest, hashlib.sha256(blob).hexdigest()))
        return path

    def mark_incomplete(self) -> None:
        """Before decoding more requests into a finished collection (a larger ``--limit``): remove its
        consolidated files, which the shards reproduce, so that until the new consolidation no reader
        takes the directory for a complete dataset."""
        if not any((self.out / SHARDS_DIR).glob("shard-*.parquet")):
            return
        with _store_errors(self.out):
            for name in (REQUESTS_FILE, HIDDEN_FILE):  # requests.parquet first: its presence marks a whole dataset
                (self.out / name).unlink(missing_ok=True)

    # -- consolidation -----------------------------------------------------------------------------

    def consolidate(self, counts: dict | None = None) -> Path:
        """Write ``requests.parquet`` + ``hidden.safetensors`` + the final manifest from every shard."""
        shards = [self._committed_shard(table) for table in committed_tables(self.out)]
        manifest = with_sources(self.manifest, request_sources(shards))
        manifest["counts"] = dict(counts or {})
        dataset = concat_shards(shards, manifest)
        with _store_errors(self.out):
            write_traces(dataset, self.out)
        return self.out

    def _committed_shard(self, table: Path) -> Shard:
        """The shard committed as ``table``: the one kept in memory while its files hold what was
        written (so it reads back as that shard), else read from the files and checked."""
        kept = self._kept.get(table) if self._kept is not None else None
        return kept.shard if kept is not None and kept.matches_files() else read_shard(table)


def merge(dirs: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Combine the shards of several collection directories into one consolidated trace dataset.

    Inputs must share model and decoding identity; request ids must not repeat with different results
    (an identical repeat, e.g. the same directory given twice, is kept once). Rows follow workload
    order, so ``--shard 0/2`` and ``--shard 1/2`` merged equal the unsharded collection. A directory
    without shards is read through its consolidated files.

    Returns
    -------
    The output directory, holding contract 1's three files.
    """
    if not dirs:
        raise StoreError("traces merge needs at least one input directory")
    refuse_aliasing(out, [("DIRS", d) for d in dirs])
    inputs = []
    for d in map(Path, dirs):
        if not (d / MANIFEST_FILE).is_file():
            raise StoreError(f"{d} is not a collection directory (no {MANIFEST_FILE}): check the path")
        manifest = read_json_object(d / MANIFEST_FILE, StoreError, fix="that directory is damaged")
        shards = read_shards(d) if (d / SHARDS_DIR).is_dir() else []
        if not shards:
            try:
                ds = load_traces(d)
            except TraceError as err:
                raise StoreError(f"{d} holds no shards and no readable traces: {err}") from None
            # a dataset written elsewhere (not by collect) may lack the workload order: keep its row order
            requests = ds.requests if ORDER_COLUMN in ds.requests else ds.requests.assign(**{ORDER_COLUMN: range(len(ds))})
            source = (SEVERAL if MIXED_SOURCES in manifest
                      else (manifest.get("versions") or {}).get(SOURCE_KEY) or UNRECORDED)
            shards = [Shard(requests, ds.first_round, ds.prompt_last, d / REQUESTS_FILE, ds.extra_hidden, source)]
        inputs.append((d, manifest, shards))
    first_dir, first, _ = inputs[0]
    for d, manifest, _ in inputs:
        check_compatible(manifest, first, str(d), f"merge only directories collected with the same model and decoding config as {first_dir}")
        check_same_hidden_extra(manifest, first, str(d), f"merge only directories collected with the same `layers` and "
                                                         f"`pooling` as {first_dir}")
        check_same_rounds_hidden(manifest, first, str(d),
                                 f"merge only directories collected with the same `rounds_hidden` as {first_dir}")

    # Collections of one workload interleave by workload order; different workloads follow input order.
    workloads: list[tuple] = []
    parts = []
    for d, manifest, shards in inputs:
        key = (manifest.get("workload", {}).get("name"), manifest.get("workload", {}).get("seed"))
        if key not in workloads:
            workloads.append(key)
        for s in shards:
            parts.append(Shard(s.requests.assign(_workload=workloads.index(key), _source=s.source), s.first_round,
                               s.prompt_last, s.path, s.extra))
    requests, first_round, prompt_last, extra = _stack(parts, ["_workload", ORDER_COLUMN])
    keep = _unique_rows(requests)
    sources = requests.loc[keep, "_source"]
    requests = requests[keep].drop(columns=["_workload", "_source"]).reset_index(drop=True)
    merged_manifest = with_sources({
        **{key: value for key, value in first.items() if key != "monitor"},  # one recording rank's live monitor
        "workload": _merged_workload([m for _, m, _ in inputs], requests),
        "merged_from": [str(d) for d, _, _ in inputs],
    }, sources)
    dataset = TraceDataset(requests, first_round[keep], prompt_last[keep], merged_manifest,
                           extra_hidden={name: values[keep] for name, values in extra.items()})
    out = Path(out)
    refuse_unusable_path(out)
    if any((out / SHARDS_DIR).glob("shard-*.parquet")):
        raise StoreError(f"{out} holds shards of a collection: merge into a fresh `out`")
    with TraceStore(out, merged_manifest) as store:
        with _store_errors(out):
            write_traces(dataset, store.out)
    return out


def _merged_workload(manifests: list[dict], requests: pd.DataFrame) -> dict:
    workloads = [m.get("workload", {}) for m in manifests]
    names = sorted({str(w.get("name")) for w in workloads})
    seeds = sorted({w.get("seed") for w in workloads}, key=str)
    composition = requests.groupby(["category", "split"]).size()
    return {
        "name": names[0] if len(names) == 1 else names,
        "seed": seeds[0] if len(seeds) == 1 else seeds,
        "shard": None,
        "composition": {c: {s: int(n) for (c2, s), n in composition.items() if c2 == c}
                        for c in composition.index.get_level_values(0).unique()},
        "shards": [w.get("shard") for w in workloads],
    }


def _unique_rows(requests: pd.DataFrame) -> np.ndarray:
    """Mask keeping the first of identical repeats of a request id; refuse repeats whose results differ."""
    dup = requests["request_id"].duplicated(keep="first").to_numpy()
    rounds = requests["rounds_per_block"].map(lambda v: ",".join(map(str, v)))
    result = rounds + "|" + requests["output_tokens"].astype(str)
    first = dict(zip(requests["request_id"][~dup], result[~dup]))
    for rid, res in zip(requests["request_id"][dup], result[dup]):
        if first[rid] != res:
            raise StoreError(
                f"request '{rid}' appears in more than one input with different results: "
                "merge directories of disjoint `shard` runs only"
            )
    return ~dup


def _store_errors(out: Path):
    """Turn an OSError while writing the store ``out`` into one clear :class:`StoreError` line."""
    return write_errors(out, "shards already written stay readable: free space or fix permissions and rerun the "
                             "same command to resume, or choose another `out`", every=True)
