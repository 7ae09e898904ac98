"""Contract 1 — the consolidated trace dataset every stage after `collect` reads.

A directory holding

- ``manifest.json``: schema version, model fingerprint, decoding config, workload, versions, counts
  (and ``mixed_sources``, fingerprint -> requests, when more than one version of this package's code
  decoded them: :mod:`dwise_predict.collectors.store`);
- ``requests.parquet``: one row per request with the columns in :data:`REQUEST_COLUMNS`
  (more may follow; these keep their names and meaning);
- ``hidden.safetensors``: ``first_round`` ``[N, H]`` and ``prompt_last`` ``[N, H]``, row i belonging to
  row i of ``requests.parquet``; a collection made with ``collect --layers`` adds the tensors named in
  :mod:`dwise_predict.traces.hidden_extra` (``first_round.layer{L}.{mean,last,positions}``), and one
  made with ``collect --rounds-hidden N`` the first ``N`` denoising rounds' pooled states and early
  signals, ``round_states`` ``[N, rounds, H]`` and ``round_signals`` ``[N, rounds, 4]``, with the request
  column ``rounds_recorded`` (:mod:`dwise_predict.traces.round_states`); both kept in
  :attr:`TraceDataset.extra_hidden`.

Outside tools read these files directly (``pd.read_parquet(dir / "requests.parquet")``), so the
names here are a public interface: change one only with a schema-version bump.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.errors import TraceError
from dwise_predict.files import atomic_write, atomic_write_bytes, read_json_object, utf8_name
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.traces.round_states import COUNT_COLUMN as ROUND_COUNT_COLUMN
from dwise_predict.traces.round_states import MANIFEST_KEY as ROUNDS_HIDDEN_KEY
from dwise_predict.traces.round_states import SIGNAL_RANGES as ROUND_SIGNAL_RANGES
from dwise_predict.traces.round_states import TENSORS as ROUND_TENSORS
from dwise_predict.traces.round_states import round_states

SCHEMA_VERSION = 4  # 2: SGLang 0.5.23 units (floor prompt blocks, r + 1 forwards per block, algorithm config);
# 3: a fourth early signal, end_probability; 4: optional per-round states (collect --rounds-hidden)
# the oldest schema in today's round units and columns: later ones only add optional tensors, so a
# collection of schema 3 resumes and merges with one of schema 4
SAME_UNITS_SINCE = 3
MANIFEST_FILE = "manifest.json"
REQUESTS_FILE = "requests.parquet"
HIDDEN_FILE = "hidden.safetensors"
HIDDEN_TENSORS = ("first_round", "prompt_last")

# name -> meaning; the order is the column order we write.
REQUEST_COLUMNS: dict[str, str] = {
    "request_id": "unique id of the request",
    "split": "'train' (fits) or 'eval' (reported)",
    "category": "request family (chat, code, math, ...)",
    "source": "where the prompt came from",
    "prompt": "prompt text before the chat template",
    "prompt_tokens": "prompt tokens after the chat template",
    "words": "whitespace-separated words in the prompt",
    "newlines": "newline characters in the prompt",
    "budget": "output budget in tokens",
    "block_size": "tokens per block",
    "prompt_blocks": "prefill forwards P without a prefix cache: floor(prompt_tokens / block_size) full blocks",
    "total_rounds": "denoising forwards over all output blocks (the engine's count: r + 1 for LowConfidence)",
    "rounds_per_block": "denoising forwards of each output block (list)",
    "output_tokens": "generated tokens before the EOS (cut at the budget)",
    "finish": "'eos' or 'budget'",
    "frac_over_threshold": "first round: fraction of masked positions whose top-1 prob is above the algorithm's threshold",
    "mean_confidence": "first round: mean top-1 probability over the masked positions",
    "mean_entropy": "first round: mean predictive entropy over the masked positions (nats)",
    "end_probability": "first round: probability that the block holds a stop token, 1 - prod(1 - p_stop) over the masked positions",
    "wall_s": "wall-clock seconds from the request's first prompt block to its last round",
}
NUMERIC_COLUMNS = (
    "prompt_tokens", "words", "newlines", "budget", "block_size", "prompt_blocks", "total_rounds",
    "output_tokens", "frac_over_threshold", "mean_confidence", "mean_entropy", "end_probability", "wall_s",
)
# measured on the machine, not decided by the model and the seed: left out of the data fingerprint
MEASURED_COLUMNS = ("wall_s",)
# counts: whole numbers, at least this much
COUNT_COLUMNS = {"prompt_tokens": 0, "words": 0, "newlines": 0, "budget": 1, "block_size": 1, "prompt_blocks": 0,
                 "total_rounds": 1, "output_tokens": 0}
# A block of b tokens takes at most b + 1 forwards under LowConfidence; this bound leaves room for
# algorithms that edit tokens and is checked before anything is sized by the round count (the
# survival model's horizon K), so a corrupt count cannot make training allocate terabytes.
MAX_ROUNDS_PER_TOKEN = 8


@dataclass
class TraceDataset:
    """A loaded trace dataset: the request table, the two hidden-state matrices and the manifest.

    ``extra_hidden`` maps the optional tensors of ``collect --layers`` (names in
    :mod:`dwise_predict.traces.hidden_extra`) and of ``collect --rounds-hidden``
    (:mod:`dwise_predict.traces.round_states`) to arrays whose first axis is the request; empty for a
    default collection.
    """

    requests: pd.DataFrame
    first_round: np.ndarray  # (N, H) float32, pooled final-layer rows of the first denoising round
    prompt_last: np.ndarray  # (N, H) float32, pooled final-layer rows of the last prompt block
    manifest: dict = field(default_factory=dict)
    path: Path | None = None
    extra_hidden: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (N, ...) float32

    def __post_init__(self) -> None:
        validate(self)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def hidden_size(self) -> int:
        return int(self.first_round.shape[1])

    @property
    def early_signals(self) -> np.ndarray:
        """(N, 4) float32, the first round's early signals in :data:`EARLY_SIGNALS` order (the
        refinement graph's ``early_signals`` input)."""
        return self.requests[list(EARLY_SIGNALS)].to_numpy(dtype=np.float32)

    @property
    def model_fingerprint(self) -> dict:
        return self.manifest.get("model", {})

    @property
    def decoding(self) -> dict:
        return self.manifest.get("decoding", {})

    def subset(self, mask: np.ndarray | pd.Series) -> "TraceDataset":
        """Rows where ``mask`` is true, hidden states kept aligned."""
        mask = np.asarray(mask, dtype=bool)
        return TraceDataset(
            self.requests[mask].reset_index(drop=True),
            self.first_round[mask],
            self.prompt_last[mask],
            self.manifest,
            self.path,
            {name: values[mask] for name, values in self.extra_hidden.items()},
        )

    def split(self, name: str) -> "TraceDataset":
        return self.subset(self.requests["split"].to_numpy() == name)

    def data_hash(self) -> str:
        """sha256 over the request table's contract columns and the hidden states: identifies the data
        (recorded as ``traces.fingerprint`` in a run's config.json; the model's identity is
        :attr:`model_fingerprint`). Measured timings (:data:`MEASURED_COLUMNS`) are left out: two
        collections with one seed hold the same requests, rounds and states but never the same
        clock, and a run trained on one must evaluate on the other."""
        h = hashlib.sha256()
        table = self.requests[[c for c in REQUEST_COLUMNS if c not in MEASURED_COLUMNS]].copy()
        table["rounds_per_block"] = table["rounds_per_block"].map(lambda v: ",".join(map(str, v)))
        h.update(pd.util.hash_pandas_object(table, index=False).to_numpy().tobytes())
        h.update(np.ascontiguousarray(self.first_round, dtype=np.float32).tobytes())
        h.update(np.ascontiguousarray(self.prompt_last, dtype=np.float32).tobytes())
        return h.hexdigest()

    def to_dataset(self):
        """This dataset as one ``datasets.Dataset``: the request table plus ``first_round`` and
        ``prompt_last`` as list columns (:mod:`dwise_predict.traces.hf_dataset`)."""
        from dwise_predict.traces.hf_dataset import to_dataset

        return to_dataset(self)


def validate(ds: TraceDataset) -> None:
    """Check contract 1 once; raise :class:`TraceError` naming the first problem and the fix."""
    where = f" in {ds.path}" if ds.path else ""
    missing = [c for c in REQUEST_COLUMNS if c not in ds.requests.columns]
    if missing:
        raise TraceError(
            f"traces{where} lack columns {', '.join(missing)}: re-collect them or add the columns "
            "(see REQUEST_COLUMNS in dwise_predict/traces/dataset.py)"
        )
    n = len(ds.requests)
    for name in HIDDEN_TENSORS:
        arr = getattr(ds, name)
        if arr.ndim != 2 or arr.shape[0] != n:
            raise TraceError(
                f"hidden state '{name}'{where} has shape {tuple(arr.shape)} but the table has {n} rows: "
                "the two files come from different collections; re-run `dwise-predict traces merge`"
            )
    if ds.first_round.shape[1] != ds.prompt_last.shape[1]:
        raise TraceError(f"first_round and prompt_last{where} differ in hidden size")
    for name, arr in ds.extra_hidden.items():
        if arr.ndim < 2 or arr.shape[0] != n:
            raise TraceError(f"hidden state '{name}'{where} has shape {tuple(arr.shape)} but the table has {n} rows: "
                             "the two files come from different collections; collect them again")
    for col, blank, what in (("request_id", True, "a non-empty string"), ("category", True, "a non-empty string"),
                             ("prompt", False, "the prompt's text")):
        if (i := _first_not_text(ds.requests[col], blank)) is not None:
            found = ds.requests[col].iloc[i]
            found = found.item() if isinstance(found, np.generic) else found
            raise TraceError(f"{col}{where} must hold {what}, found {found!r}: fix those rows")
    if ds.requests["request_id"].duplicated().any():
        dup = ds.requests.loc[ds.requests["request_id"].duplicated(), "request_id"].iloc[0]
        raise TraceError(f"request_id '{dup}' appears twice{where}: request ids must be unique")
    bad_split = set(ds.requests["split"].unique()) - {"train", "eval"}
    if bad_split:
        shown = ", ".join(sorted(repr(v.item() if isinstance(v, np.generic) else v) for v in bad_split))
        raise TraceError(f"split{where} must be 'train' or 'eval', found {shown}: fix those rows")
    values = {}
    for col in NUMERIC_COLUMNS:
        values[col] = pd.to_numeric(ds.requests[col], errors="coerce").to_numpy(dtype=float)
        if not np.isfinite(values[col]).all():
            raise TraceError(f"column '{col}'{where} holds NaN, inf or non-numbers: drop or fix those rows")
    for col, least in COUNT_COLUMNS.items():
        bad = (values[col] != np.floor(values[col])) | (values[col] < least)
        if bad.any():
            raise TraceError(f"column '{col}'{where} must hold whole numbers >= {least}, found "
                             f"{values[col][bad][0]:g}: drop or fix those rows")
    reachable = MAX_ROUNDS_PER_TOKEN * (values["budget"] + values["block_size"])
    if (values["total_rounds"] > reachable).any():
        i = int(np.argmax(values["total_rounds"] > reachable))
        raise TraceError(f"total_rounds{where} of request {ds.requests['request_id'].iloc[i]!r} is "
                         f"{values['total_rounds'][i]:g}, more than a budget of {values['budget'][i]:g} tokens can "
                         "take: the traces are corrupt; drop or fix those rows")
    _check_columns_agree(ds.requests, values, where)
    for name, arr in [(name, getattr(ds, name)) for name in HIDDEN_TENSORS] + list(ds.extra_hidden.items()):
        # the per-round tensors are checked below (round_states), which names the request and the round
        if name not in ROUND_TENSORS and not np.isfinite(arr).all():
            raise TraceError(f"hidden state '{name}'{where} holds NaN or inf: drop those requests")
    if any(name in ds.extra_hidden for name in ROUND_TENSORS):
        # schema 4's per-round tensors agree with the table and the manifest. A view that drops the
        # tensors (an ablation's inputs) keeps the column; a file that lost them is refused on load.
        round_states(ds)


# the early signals' ranges (a fraction, probabilities, an entropy), and a clock: outside these, a column was edited
SIGNAL_RANGES = {**ROUND_SIGNAL_RANGES, "wall_s": (0.0, np.inf)}


def _check_columns_agree(requests: pd.DataFrame, values: dict[str, np.ndarray], where: str) -> None:
    """The columns of one request must describe one decoding: each value alone can be plausible and the
    row still impossible (a prompt of 40 tokens in 10**15 prompt blocks replays as a request that never
    ends). Checked here, where every reader passes, so no stage sizes anything by a corrupt count."""
    ids = requests["request_id"]

    def refuse(bad: np.ndarray, what: Callable[[int], str]) -> None:
        if bad.any():
            i = int(np.argmax(bad))
            raise TraceError(f"request {ids.iloc[i]!r}{where}: {what(i)}: the traces are corrupt; drop or fix "
                             "those rows, or collect them again")

    finish = requests["finish"].to_numpy(dtype=object)
    refuse(~np.isin(finish, ["eos", "budget"]), lambda i: f"finish is {finish[i]!r}, not 'eos' or 'budget'")
    tokens, block, budget = values["prompt_tokens"], values["block_size"], values["budget"]
    # the engine lays out floor(n / block) prompt blocks; DiffusionGemma's own encoder pass counts ceil
    blocks = values["prompt_blocks"]
    refuse((blocks < np.floor(tokens / block)) | (blocks > np.ceil(tokens / block)),
           lambda i: f"prompt_blocks is {blocks[i]:g}, but {tokens[i]:g} prompt tokens fill {tokens[i] // block[i]:g} "
                     f"blocks of {block[i]:g}")
    refuse(values["output_tokens"] > budget,
           lambda i: f"output_tokens {values['output_tokens'][i]:g} exceed its budget of {budget[i]:g} tokens")
    for col, (low, high) in SIGNAL_RANGES.items():
        refuse((values[col] < low) | (values[col] > high), lambda i, col=col, low=low, high=high: (
            f"{col} is {values[col][i]:g}, outside [{low:g}, {high:g}]"))
    lengths, sums, bad = _per_block_counts(requests["rounds_per_block"])
    refuse(bad, lambda i: f"rounds_per_block is {requests['rounds_per_block'].iloc[i]!r}, not a list of whole "
                          "numbers >= 1")
    # a request ends at the block reaching its budget: at most the first block and budget / block more
    most = 1 + np.ceil(budget / block)
    refuse(lengths > most, lambda i: f"rounds_per_block lists {lengths[i]:g} blocks, more than a budget of "
                                     f"{budget[i]:g} tokens in blocks of {block[i]:g} reaches ({most[i]:g})")
    refuse(sums != values["total_rounds"],
           lambda i: f"total_rounds is {values['total_rounds'][i]:g} but rounds_per_block sums to {sums[i]:g}")


def _first_not_text(column: pd.Series, blank: bool = False) -> int | None:
    """The position of the first value of ``column`` that is not a string (with ``blank``, or is only
    whitespace), or None. Vectorised first: validation runs on every subset a stage takes."""
    missing = column.isna().to_numpy()  # pandas' string dtype holds NaN for a missing value, and infers "string"
    if missing.any():
        return int(np.argmax(missing))
    if pd.api.types.infer_dtype(column, skipna=False) == "string":
        empty = (column.str.strip() == "").to_numpy() if blank else np.zeros(len(column), dtype=bool)
        return int(np.argmax(empty)) if empty.any() else None
    return next(i for i, v in enumerate(column) if not isinstance(v, str))


def _per_block_counts(column: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``rounds_per_block``: its number of blocks, its sum of rounds and whether it is not a
    non-empty list of whole numbers >= 1 (arrays of shape (n,)). Read through Arrow's list arrays, in C:
    validation runs on every subset a stage takes."""
    import pyarrow as pa

    n = len(column)
    try:
        lists = pa.array(column, from_pandas=True)
        numeric = pa.types.is_list(lists.type) and (pa.types.is_integer(lists.type.value_type)
                                                    or pa.types.is_floating(lists.type.value_type))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        numeric = False
    if not numeric:  # strings, nested lists, mixed rows: find them one by one
        bad = np.array([not _whole_numbers(v) for v in column], dtype=bool)
        lengths = np.array([len(v) if not b else 0 for v, b in zip(column, bad)], dtype=float)
        return lengths, np.array([float(np.sum(v)) if not b else 0.0 for v, b in zip(column, bad)]), bad
    missing = lists.is_null().to_numpy(zero_copy_only=False)
    lengths = lists.value_lengths().fill_null(0).to_numpy().astype(float)
    flat = lists.flatten().to_numpy(zero_copy_only=False).astype(float)
    rows = np.repeat(np.arange(n), lengths.astype(int))
    sums = np.bincount(rows, weights=np.nan_to_num(flat), minlength=n)
    odd = ~np.isfinite(flat) | (flat < 1) | (flat != np.floor(flat))
    bad = missing | (lengths == 0) | (np.bincount(rows, weights=odd, minlength=n) > 0)
    return lengths, sums, bad


def _whole_numbers(value) -> bool:
    """Whether one row's ``rounds_per_block`` is a non-empty list of whole numbers >= 1."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        return False
    try:
        counts = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return False
    return counts.ndim == 1 and bool(np.all(np.isfinite(counts) & (counts >= 1) & (counts == np.floor(counts))))


def check_manifest(manifest: dict, path: str | os.PathLike) -> None:
    """Raise :class:`TraceError` when a trace manifest's schema version is not one this code reads
    (a whole number from :data:`SAME_UNITS_SINCE` to :data:`SCHEMA_VERSION`; JSON's ``true`` is
    not one), or its model, decoding or workload block is not a JSON object."""
    version = manifest.get("schema_version")
    if type(version) is not int:  # bool is a subclass of int: `true` would read as schema 1
        raise TraceError(f"{path} has trace schema version {version!r}, not a whole number: its {MANIFEST_FILE} "
                         "is damaged; collect the traces again")
    if version > SCHEMA_VERSION:
        raise TraceError(f"{path} has trace schema version {version}; this dwise-predict reads up to "
                         f"{SCHEMA_VERSION}: upgrade dwise-predict")
    if version < SAME_UNITS_SINCE:
        raise TraceError(f"{path} has trace schema version {version}; this dwise-predict reads {SAME_UNITS_SINCE} "
                         f"to {SCHEMA_VERSION} (older traces count rounds in other units, or lack end_probability): "
                         "collect them again with this version")
    for key in ("model", "decoding", "workload"):
        if not isinstance(manifest.get(key, {}), dict):
            raise TraceError(f"{path}'s {MANIFEST_FILE} has a {key} that is not a JSON object: the trace dataset is "
                             "damaged; collect it again")


def load_traces(path: str | os.PathLike) -> TraceDataset:
    """Read a consolidated trace directory (contract 1) and validate it."""
    from safetensors.numpy import load_file

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise TraceError(f"{path} is a file: give a trace directory (the `out` of `dwise-predict collect`)")
    if not path.is_dir():
        raise TraceError(f"no trace directory at {path}: run `dwise-predict collect --out {path}` first")
    for name in (MANIFEST_FILE, REQUESTS_FILE, HIDDEN_FILE):
        if not (path / name).is_file():
            hint = (
                "its collection is unfinished: rerun the same `dwise-predict collect` command to finish it "
                "(for `shard` parts, combine them with `dwise-predict traces merge`)"
                if (path / "shards").is_dir()
                else "it is not a complete trace dataset"
            )
            raise TraceError(f"{path} has no {name}: {hint}")
    manifest = read_json_object(path / MANIFEST_FILE, TraceError, fix="the trace dataset is damaged; collect it again")
    check_manifest(manifest, path)
    try:
        # pyarrow and safetensors open UTF-8 paths only: a directory named in other bytes is read by descriptor
        with utf8_name(path / REQUESTS_FILE) as name:
            requests = pd.read_parquet(name)
        with utf8_name(path / HIDDEN_FILE) as name:
            tensors = load_file(name)
    except Exception as err:  # pyarrow / safetensors raise many types for a corrupt file
        fix = ("rerun the `dwise-predict collect` command that wrote it: it rebuilds these files from its shards"
               if (path / "shards").is_dir() else "collect it again")
        raise TraceError(f"cannot read traces in {path} ({err}): {fix}") from None
    missing = [t for t in HIDDEN_TENSORS if t not in tensors]
    if missing:
        raise TraceError(f"{path / HIDDEN_FILE} lacks tensors {', '.join(missing)}")
    if len(requests) == 0:
        raise TraceError(f"{path} holds no requests: collect some with `dwise-predict collect --out {path}`")
    width = tensors["first_round"].shape[1] if tensors["first_round"].ndim == 2 else None
    for where, block in (("hidden_size", manifest), ("model.hidden_size", manifest.get("model", {}))):
        declared = block.get("hidden_size")
        if declared is not None and width is not None and declared != width:
            raise TraceError(f"{path / MANIFEST_FILE} says {where} {declared!r}, but {HIDDEN_FILE} holds rows of "
                             f"{width}: the files come from different collections; collect it again")
    ds = TraceDataset(
        requests,
        tensors["first_round"].astype(np.float32, copy=False),
        tensors["prompt_last"].astype(np.float32, copy=False),
        manifest,
        path,
        {name: values.astype(np.float32, copy=False) for name, values in tensors.items() if name not in HIDDEN_TENSORS},
    )
    if (ROUND_COUNT_COLUMN in requests.columns or ROUNDS_HIDDEN_KEY in manifest) and not ds.extra_hidden.keys() & set(ROUND_TENSORS):
        round_states(ds)  # files that name per-round states but lost the tensors (validation checked any it found)
    return ds


def write_traces(ds: TraceDataset, path: str | os.PathLike) -> Path:
    """Write a consolidated trace directory; each file lands atomically (temp file + rename)."""
    from safetensors.numpy import save

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    manifest = dict(ds.manifest)
    manifest["schema_version"] = SCHEMA_VERSION
    manifest.setdefault("counts", {})
    manifest["counts"].update(
        requests=len(ds),
        **{f"split_{k}": int(v) for k, v in ds.requests["split"].value_counts().items()},
    )
    manifest["hidden_size"] = ds.hidden_size
    columns = list(REQUEST_COLUMNS) + [c for c in ds.requests.columns if c not in REQUEST_COLUMNS]
    # serialised in memory, written by Python: a full disk is an OSError (safetensors' own writer
    # raises its SafetensorError instead), which the callers turn into one line
    hidden = save({"first_round": np.ascontiguousarray(ds.first_round, dtype=np.float32),
                   "prompt_last": np.ascontiguousarray(ds.prompt_last, dtype=np.float32),
                   **{name: np.ascontiguousarray(values, dtype=np.float32) for name, values in ds.extra_hidden.items()}})
    atomic_write_bytes(path / HIDDEN_FILE, hidden)
    atomic_write(path / MANIFEST_FILE, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True)))
    # The request table goes last: its presence marks a complete dataset (a collection directory
    # holds a manifest from its start, and `collect` removes the table before it adds requests).
    atomic_write(path / REQUESTS_FILE, lambda tmp: ds.requests[columns].to_parquet(tmp, index=False))
    return path
