"""Typer command `quickstart`: the whole pipeline on the built-in tiny dLLM (thin over run_quickstart)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import SEED_RANGE, JsonOption
from dwise_predict.errors import ConfigError
from dwise_predict.evaluation.document import fmt, fmt_interval
from dwise_predict.quickstart import QuickstartConfig, speedup_lines

_DEFAULT = QuickstartConfig()


def quickstart_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for traces/, run/, report/, bundle/, simulate/.")] = Path("out/quickstart"),
    limit: Annotated[Optional[int], typer.Option(help="Collect only the first N requests of tiny-default (a quicker, noisier try).")] = None,
    seed: Annotated[int, typer.Option(**SEED_RANGE, help="Seed for collection, training and arrivals.")] = _DEFAULT.seed,
    max_epochs: Annotated[Optional[int], typer.Option(help="Cap each survival member's epochs (default: training default).")] = None,
    loco: Annotated[bool, typer.Option(help="Evaluate leave-one-category-out (retrains once per category).")] = _DEFAULT.loco,
    jobs: Annotated[Optional[int], typer.Option(help="Worker processes for the LOCO retrainings (default: cores).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Run the whole pipeline on the built-in tiny dLLM: collect, train, evaluate, export, verify, simulate.

    No GPU and no network needed. Interrupt it and rerun the same command: it resumes at the first
    stage whose output is missing.

    Examples:

        dwise-predict quickstart

        dwise-predict quickstart --out /tmp/qs --limit 96 --max-epochs 20 --no-loco
    """
    import json

    from dwise_predict.cli.collect import CollectProgressBar
    from dwise_predict.quickstart import run_quickstart

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    config = QuickstartConfig(limit=limit, seed=seed, max_epochs=max_epochs, loco=loco, jobs=jobs)
    with CollectProgressBar() as bar:
        summary = run_quickstart(out, config, log=lambda line: typer.echo(line, err=True), collect_progress=bar.update)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _print_quickstart(summary)


def _print_quickstart(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    held = summary["held_out"] or {}
    table = Table(title=f"dwise-predict quickstart: {summary['n_train']} train / {summary['n_eval']} eval requests")
    table.add_column("Spearman ρ (eval split)")
    table.add_column("admission", justify="right")
    table.add_column("refined", justify="right")
    table.add_row("all requests", fmt(summary["admission_rho"], 2), fmt(summary["refined_rho"], 2))
    table.add_row("within category (mean)", fmt(summary["admission_within_category"], 2), fmt(summary["refined_within_category"], 2))
    if held:
        ci = summary.get("held_out_ci") or {}

        def cell(key: str) -> str:  # the held-out mean rests on few requests per category: show its interval
            return f"{fmt(held[key]['held_out'], 2)} {fmt_interval((ci.get(key) or {}).get('held_out'), 2)}".rstrip()

        table.add_row("within category, category held out", cell("admission"), cell("refined"))
    console = Console()
    console.print(table)
    # each figure names its simulation, as in the report's scheduling section
    for line in speedup_lines(summary["speedup_vs_sglang_default"], summary["simulated"]):
        console.print(line)
    console.print(f"bundle (verified): {summary['paths']['bundle']}")
    console.print(f"report: {summary['report']}")


