"""Typer command `workload show`: a workload's composition before any decoding (thin over load_workload)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

workload_app = typer.Typer(
    help="Inspect workload presets and spec files.\n\nExamples:\n\n    dwise-predict workload show dwise-paper --allow-missing",
    no_args_is_help=True,
)


@workload_app.command("show")
def show_command(
    spec: Annotated[str, typer.Argument(help="Preset (tiny-default, dwise-paper) or a .toml/.yaml spec file.")] = "tiny-default",
    seed: Annotated[int, typer.Option(help="Workload sampling / split seed.")] = 0,
    limit: Annotated[Optional[int], typer.Option(help="Take only the first N requests.")] = None,
    head: Annotated[int, typer.Option(help="Also list the first N requests (id, split, prompt start).")] = 0,
    allow_missing: Annotated[bool, typer.Option(help="Show the sources that are here instead of failing on missing ones.")] = False,
    allow_network: Annotated[bool, typer.Option(help="Let hub datasets download (default: local cache only).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the composition as JSON on stdout.")] = False,
) -> None:
    """Load a workload and print its composition per source, category and split.

    Examples:

        dwise-predict workload show

        dwise-predict workload show dwise-paper --allow-missing

        dwise-predict workload show my-mix.toml --seed 1 --head 5 --json
    """
    from rich.console import Console
    from rich.table import Table

    from dwise_predict.collectors.workloads import load_workload

    workload = load_workload(spec, seed=seed, limit=limit, allow_missing=allow_missing,
                             allow_network=allow_network or None)
    comp = workload.composition()
    if json_out:
        comp["head"] = [
            {"request_id": r.request_id, "split": r.split, "prompt": r.prompt} for r in workload.requests[:head]
        ]
        typer.echo(json.dumps(comp, indent=2))
        return
    table = Table(title=f"workload {comp['name']} (seed {comp['seed']})")
    for column in ("source", "type", "category", "train", "eval"):
        table.add_column(column, justify="right" if column in ("train", "eval") else "left")
    for name, entry in comp["sources"].items():
        table.add_row(name, entry.get("type", ""), entry.get("category", ""), str(entry["train"]), str(entry["eval"]))
    table.add_section()
    table.add_row("total", "", f"{len(comp['categories'])} categories", str(comp["train"]), str(comp["eval"]))
    console = Console()
    console.print(table)
    for line in comp["missing"]:
        console.print(f"[yellow]missing[/yellow] {line}", highlight=False)
    for r in workload.requests[:head]:
        console.print(f"{r.request_id}  {r.split:5}  {r.prompt[:70]!r}", highlight=False, markup=False)
