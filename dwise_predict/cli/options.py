"""Option types and output helpers shared by every command module of the CLI.

Table cells are formatted by :func:`dwise_predict.evaluation.document.fmt`, as the reports are.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Callable, TypeVar

import typer

from dwise_predict.errors import DwiseError
from dwise_predict.files import read_json_object
from dwise_predict.training.config import MAX_SEED
from dwise_predict.text import visible

SEED_RANGE = {"min": 0, "max": MAX_SEED}  # what every --seed takes (a seed option with its own help spreads it in)
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables.")]
SeedOption = Annotated[int, typer.Option("--seed", **SEED_RANGE, help="Seed of every random choice.")]

# The one table from a library parameter to the flag that sets it. Library messages name a parameter
# as a Python caller passes it, in backticks ("`slots` (B) must be ..."); the CLI prints the flag.
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "ablate", "across", "aging", "algorithm", "algorithm_config", "allow_missing", "allow_network", "arrival",
    "batch_former", "batch_size", "block_size", "bootstrap", "budget", "budget_sweep",
    "bundle", "config", "created", "device", "drop_category", "dtype", "exclude", "folds", "follow", "follow_poll_s", "follow_zoo",
    "force", "hidden_size", "hold_out", "jobs",
    "k", "kv_budget", "kv_budget_tokens", "kv_fraction", "layers", "limit", "lr", "max_batch", "max_wait", "model",
    "monitor_window",
    "n_heads", "n_layers", "name", "out",
    "overwrite", "policies", "pooling", "precision", "prompt_cache", "publish", "rate", "rates", "record",
    "record_every", "record_flush_s", "refine", "refine_every", "requests", "revision", "rhos", "rollback_after",
    "rollback_margin", "round_ms", "round_profile", "rounds_hidden", "run", "seed", "shard", "slack_blocks", "slot_ms", "slots", "split",
    "split_decodings", "steps", "threads",
    "tokenizer", "traces", "trust_remote_code", "version", "window", "workload", "zoo",
)} | {"kv_slack_blocks": "--kv-slack", "max_minutes": "--minutes", "out_dir": "--out",
      "subset_categories": "--subset",
      "repo_id": "--hub"}
_PARAM = re.compile(r"`([a-z][a-z0-9_]*)`")


def as_flags(message: str) -> str:
    """A library message as the CLI user reads it: each parameter named in backticks becomes its flag
    (:data:`FLAGS`); other backticked words stay."""
    return _PARAM.sub(lambda m: FLAGS.get(m.group(1), m.group(0)), message)


T = TypeVar("T")


def checked_traces(value: T) -> T:
    """The callback of every argument naming trace directories (a path, a list of them, or None): the
    decoding each manifest records checked by the engine's rules before any stage reads it
    (:func:`~dwise_predict.engine.algorithms.check_recorded_decoding`), here where every command that
    reads traces passes (the traces package may not import the engine, nor may training or evaluation).
    A manifest that is absent or unreadable is left to the command, whose reader names it."""
    from dwise_predict.engine.algorithms import check_recorded_decoding
    from dwise_predict.traces import MANIFEST_FILE

    for path in [] if value is None else value if isinstance(value, (list, tuple)) else [value]:
        manifest = Path(path) / MANIFEST_FILE
        try:
            recorded = read_json_object(manifest, DwiseError)
        except (DwiseError, OSError):
            continue
        check_recorded_decoding(recorded.get("decoding", {}), str(manifest))
    return value


TracesArgument = Annotated[Path, typer.Argument(help="Trace directory from `dwise-predict collect`.",
                                                callback=checked_traces)]
ManyTracesArgument = Annotated[list[Path], typer.Argument(help="Trace directories (of one model); their requests are pooled.",
                                                          callback=checked_traces)]


def comma_items(text: str, item: Callable[[str], T]) -> list[T]:
    """A comma-list option's items, each through ``item``, empty ones skipped; ``item``'s ValueError
    propagates (for an option whose own check follows, as ``--policies``'s names)."""
    return [item(x) for x in text.split(",") if x.strip()]


def comma_list(text: str, item: Callable[[str], T], flag: str, what: str, problems: list[str],
               valid: Callable[[T], bool] | None = None) -> list[T] | None:
    """A comma-list option (``--rows 1,4,16``) as its items, empty ones skipped; None after noting the
    problem ``"{flag} must be a comma list of {what}, got '...'"`` when an item does not parse, or,
    with ``valid``, when no item is given or one is not valid."""
    try:
        values = comma_items(text, item)
    except ValueError:
        values = None
    if values is None or valid is not None and not (values and all(valid(v) for v in values)):
        problems.append(f"{flag} must be a comma list of {what}, got {text!r}")
        return None
    return values


def log(message: str) -> None:
    """A progress or status line on stderr (results go to stdout), a name in it shown, never obeyed."""
    typer.echo(visible(message), err=True)


def console(width: int = 140):
    """A rich console on stdout; ``width`` wide when piped, so tables stay one row per line in logs."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else width)


def table(title: str, columns: tuple[str, ...]):
    """A rich table with left-aligned ``columns``."""
    from rich.table import Table

    t = Table(title=title)
    for column in columns:
        t.add_column(column)
    return t
