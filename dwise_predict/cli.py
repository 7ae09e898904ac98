"""The `dwise-predict` command line: one typer app, every command registered below.

Commands are thin: they validate options, call one library function, and print. Results go to
stdout, logs and progress to stderr. Heavy imports happen inside command bodies so that `--help`
stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from dwise_predict import __version__
from dwise_predict.errors import DwiseError

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
# (each module holds thin typer commands over one library call)
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn user errors into one line on stderr and exit code 1."""
    try:
        app(args=argv, standalone_mode=False)
    except DwiseError as err:
        if os.environ.get("DWISE_DEBUG"):
            raise
        typer.echo(f"error: {err}", err=True)
        return 1
    except typer.Exit as exit_:
        return exit_.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        typer.echo("interrupted: rerun the same command to resume", err=True)
        return 130
    except Exception as err:  # click usage errors carry their own exit code
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            return err.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
