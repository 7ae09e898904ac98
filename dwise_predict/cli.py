"""The `dwise-predict` command line: one typer app, every command registered below.

Commands are thin: they validate options, call one library function, and print. Results go to
stdout, logs and progress to stderr. Heavy imports happen inside command bodies so that `--help`
stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict import __version__
from dwise_predict.errors import ConfigError, DwiseError

app = typer.Typer(
    name="dwise-predict",
    help="Train, evaluate and ship workload predictors for diffusion-LLM serving schedulers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dwise-predict {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """dwise-predict: collect traces from a dLLM, train, evaluate, export and simulate predictors."""


# --- command registration: every command of the CLI is attached here, in pipeline order ---------
# Each area module holds thin typer commands over one library call; heavy imports stay inside them.
from dwise_predict.collectors.cli import collect_command, traces_app  # noqa: E402
from dwise_predict.collectors.workload_cli import workload_app  # noqa: E402
from dwise_predict.dllm.cli import dllm_app  # noqa: E402
from dwise_predict.evaluation.cli import characterize_command, evaluate_command  # noqa: E402
from dwise_predict.exports.cli import export_command, publish_command, verify_command, zoo_app  # noqa: E402
from dwise_predict.serving.cli import simulate_command  # noqa: E402
from dwise_predict.train_cli import compare_regressors_command, train_command  # noqa: E402


@app.command("quickstart")
def quickstart_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for traces/, run/, report/, bundle/, simulate/.")] = Path("out/quickstart"),
    limit: Annotated[Optional[int], typer.Option(help="Collect only the first N requests of tiny-default (a quicker, noisier try).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for collection, training and arrivals.")] = 0,
    max_epochs: Annotated[Optional[int], typer.Option(help="Cap each survival member's epochs [default: training default].")] = None,
    loco: Annotated[bool, typer.Option(help="Evaluate leave-one-category-out (retrains once per category).")] = True,
    jobs: Annotated[Optional[int], typer.Option(help="Worker processes for the LOCO retrainings [default: cores].")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Run the whole pipeline on the built-in tiny dLLM: collect, train, evaluate, export, verify, simulate.

    No GPU and no network needed. Interrupt it and rerun the same command: it resumes at the first
    stage whose output is missing.

    Examples:

        dwise-predict quickstart

        dwise-predict quickstart --out /tmp/qs --limit 96 --max-epochs 20 --no-loco
    """
    import json

    from dwise_predict.collectors.cli import CollectProgressBar
    from dwise_predict.quickstart import QuickstartConfig, run_quickstart

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

    def fmt(value) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    held = summary["held_out"] or {}
    table = Table(title=f"dwise-predict quickstart: {summary['n_train']} train / {summary['n_eval']} eval requests")
    table.add_column("Spearman ρ (eval split)")
    table.add_column("admission", justify="right")
    table.add_column("refined", justify="right")
    table.add_row("all requests", fmt(summary["admission_rho"]), fmt(summary["refined_rho"]))
    table.add_row("within category (mean)", fmt(summary["admission_within_category"]), fmt(summary["refined_within_category"]))
    if held:
        table.add_row("within category, category held out", fmt(held["admission"]["held_out"]), fmt(held["refined"]["held_out"]))
    console = Console()
    console.print(table)
    for arrival, speedup in summary["speedup_vs_sglang_default"].items():
        console.print(f"simulated mean-latency speed-up of DWISE (refined) over SGLang's default, {arrival}: {speedup:.2f}x")
    console.print(f"bundle (verified): {summary['paths']['bundle']}")
    console.print(f"report: {summary['report']}")


app.add_typer(dllm_app, name="dllm")
app.add_typer(workload_app, name="workload")
app.command("collect")(collect_command)
app.add_typer(traces_app, name="traces")
app.command("train")(train_command)
app.command("compare-regressors")(compare_regressors_command)
app.command("evaluate")(evaluate_command)
app.command("characterize")(characterize_command)
app.command("export")(export_command)
app.command("verify")(verify_command)
app.command("publish")(publish_command)
app.add_typer(zoo_app, name="zoo")
app.command("simulate")(simulate_command)
# ------------------------------------------------------------------------------------------------


INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn user errors into one line on stderr and exit code 1."""
    try:
        # standalone_mode=False: click returns a command's typer.Exit code instead of exiting
        code = app(args=argv, standalone_mode=False)
        if code == INTERRUPTED:  # typer turns Ctrl-C into this code without a word; no command returns it
            typer.echo("interrupted: rerun the same command to resume", err=True)
    except DwiseError as err:
        if os.environ.get("DWISE_DEBUG"):
            raise
        typer.echo(f"error: {err}", err=True)
        return 1
    except typer.Exit as exit_:
        return exit_.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return INTERRUPTED
    except Exception as err:  # click usage errors carry their own exit code
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            return err.exit_code
        raise
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
