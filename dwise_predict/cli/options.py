"""Option types and output helpers shared by every command module of the CLI.

Table cells are formatted by :func:`dwise_predict.evaluation.document.fmt`, as the reports are.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from dwise_predict.training.config import MAX_SEED

SEED_RANGE = {"min": 0, "max": MAX_SEED}  # what every --seed takes (a seed option with its own help spreads it in)
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables.")]
SeedOption = Annotated[int, typer.Option("--seed", **SEED_RANGE, help="Seed of every random choice.")]
TracesArgument = Annotated[Path, typer.Argument(help="Trace directory from `dwise-predict collect`.")]
ManyTracesArgument = Annotated[list[Path], typer.Argument(help="Trace directories (of one model); their requests are pooled.")]


def log(message: str) -> None:
    """A progress or status line on stderr (results go to stdout)."""
    typer.echo(message, err=True)


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
