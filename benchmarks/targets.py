"""A benchmark's figures against its targets: the lines it prints last and the JSON ``run_all.py`` collects.

Not a benchmark: every script in ``benchmarks/`` builds its :class:`Figure` values and hands them to
:func:`report`, which prints one line per figure (``target <name> <= <target> <unit>: <value>
<unit>, met``) and, with ``--json PATH`` (:func:`add_options`), writes them for ``run_all.py``'s
table. A figure without a target (``target=None``) is printed and tabled as information.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MET, MISSED, NO_TARGET = "met", "MISSED", "no target"


@dataclass(frozen=True)
class Figure:
    """One measured value; ``better`` says which side of ``target`` meets it (``lower``: <=, ``higher``: >=).

    ``context`` is printed in brackets after the target (the size the run measured, when it is not
    the target's)."""

    name: str
    value: float
    unit: str
    target: float | None = None
    better: str = "lower"
    context: str = ""

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"`better` is 'lower' or 'higher', got {self.better!r}")

    @property
    def verdict(self) -> str:
        if self.target is None:
            return NO_TARGET
        met = self.value <= self.target if self.better == "lower" else self.value >= self.target
        return MET if met else MISSED

    @property
    def bound(self) -> str:
        """``<= 30 µs``, or an empty string without a target."""
        if self.target is None:
            return ""
        return f"{'<=' if self.better == 'lower' else '>='} {with_unit(f'{self.target:g}', self.unit)}"

    def line(self) -> str:
        context = f" ({self.context})" if self.context else ""
        measured = with_unit(number(self.value), self.unit)
        if self.target is None:
            return f"figure {self.name}{context}: {measured} (no target)"
        return f"target {self.name} {self.bound}{context}: {measured}, {self.verdict}"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def number(value: float) -> str:
    """Three significant digits, never in exponent notation (``1234`` -> ``1234``, ``0.05312`` -> ``0.0531``)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = min(6, max(0, 2 - math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f}"


def with_unit(text: str, unit: str) -> str:
    """``30 µs``, ``4.9x``, ``13.7 %``: a ratio's ``x`` sticks to its number."""
    return f"{text}{unit}" if unit == "x" else f"{text} {unit}".rstrip()


def add_options(parser: argparse.ArgumentParser, smoke_help: str) -> None:
    """``--smoke`` (the same code path on the smallest input) and ``--json PATH``."""
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the figures and their targets here (benchmarks/run_all.py reads it)")


def report(benchmark: str, figures: list[Figure], args: argparse.Namespace, **details) -> None:
    """Print each figure beside its target; write them to ``args.json`` when given.

    ``details``: what the run measured on (sizes, threads), kept in the JSON beside the figures."""
    for figure in figures:
        print(figure.line())
    if args.json is not None:
        record = {"benchmark": benchmark, "smoke": bool(args.smoke), "figures": [f.as_dict() for f in figures],
                  "details": details}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
