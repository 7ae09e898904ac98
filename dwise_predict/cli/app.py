"""The `dwise-predict` typer app: every command registered below, and the entry point.

Commands are thin: they validate options, call one library function, and print. Results go to
stdout, logs and progress to stderr. Heavy imports happen inside command bodies so that `--help`
stays fast.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Annotated, Optional

import typer

from dwise_predict import __version__
from dwise_predict.cli.batch_timeout import batch_timeout_command
from dwise_predict.cli.bundles import export_command, publish_command, verify_command, zoo_app
from dwise_predict.cli.collect import collect_command, traces_app, workload_app
from dwise_predict.cli.dllm import dllm_app
from dwise_predict.cli.evaluate import characterize_command, evaluate_command
from dwise_predict.cli.options import as_flags
from dwise_predict.cli.quickstart import quickstart_command
from dwise_predict.cli.refresh import refresh_command
from dwise_predict.cli.round_profile import profile_rounds_command
from dwise_predict.cli.serve import serve_command
from dwise_predict.cli.simulate import SCHEDULERS_HELP, simulate_command
from dwise_predict.cli.streams import OutputStreamError, closed_stdout_error, open_results_stdout, restore_stdout
from dwise_predict.cli.train import compare_regressors_command, train_command
from dwise_predict.errors import DwiseError
from dwise_predict.files import NAME_MAX, PATH_MAX
from dwise_predict.text import visible
from typer.exceptions import TyperException

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
app.command("quickstart")(quickstart_command)
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
app.command("simulate", epilog=SCHEDULERS_HELP)(simulate_command)
app.command("profile-rounds")(profile_rounds_command)
app.command("batch-timeout")(batch_timeout_command)
# everything after `--` is SGLang's own server arguments
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve_command)
# the loop's return: recordings of live traffic -> a candidate, published only when it wins
app.command("refresh")(refresh_command)
# ------------------------------------------------------------------------------------------------


INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    """Entry point: the app on a stdout that survives any locale and a full or closed stream
    (:mod:`~dwise_predict.cli.streams`), a failure to write the results one line and exit 1."""
    closed = closed_stdout_error()
    if closed is not None:
        return _error_line(closed)
    original = open_results_stdout()
    try:
        code = _run(argv)
    finally:
        try:
            restore_stdout(original)
        except OutputStreamError as err:
            code = _error_line(err)
    return code


def _run(argv: list[str] | None) -> int:
    """Run the app and turn user errors into one line on stderr and exit code 1.

    The one table of what a failure prints: a :class:`DwiseError` (ours) or a command-line usage
    error (typer's: unknown option or command, missing argument, bad value) is one line and exit 1
    or 2; Ctrl-C is one line and 130; anything else is a bug and keeps its traceback. Ours names
    the library's parameters by their flags (:func:`~dwise_predict.cli.options.as_flags`).
    ``DWISE_DEBUG=1`` re-raises ours with the traceback.
    """
    try:
        # standalone_mode=False: click returns a command's typer.Exit code instead of exiting
        code = app(args=argv, prog_name="dwise-predict", standalone_mode=False)
        if code == INTERRUPTED:  # typer turns Ctrl-C into this code without a word; no command returns it
            typer.echo("interrupted: rerun the same command to resume", err=True)
    except DwiseError as err:
        if os.environ.get("DWISE_DEBUG"):
            raise
        return _error_line(err)
    except typer.Exit as exit_:
        return exit_.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return INTERRUPTED
    except TyperException as err:  # typer's bundled click: usage errors carry their own exit code
        return _usage_error(err)
    except OSError as err:  # a path no file system holds, met wherever it is first used: the user's to fix
        if err.errno != errno.ENAMETOOLONG:
            raise
        return _error_line(DwiseError(_too_long(err)))
    return code if isinstance(code, int) else 0


def _too_long(err: OSError) -> str:
    """The one line for a path over the file system's limits, naming them (files.NAME_MAX, PATH_MAX)."""
    name = os.fsdecode(err.filename or "")
    shown = name if len(name) <= 80 else f"{name[:40]}…{name[-36:]}"
    return (f"the path {shown} is too long: a file name may have {NAME_MAX} bytes and a whole path "
            f"{PATH_MAX:,} (PATH_MAX); choose a shorter one")


def _error_line(err: DwiseError) -> int:
    """Ours as one line on stderr (nothing where stderr is closed too), and exit code 1."""
    if sys.stderr is not None:
        typer.echo(f"error: {_one_line(as_flags(str(err)))}", err=True)
    return 1


def _usage_error(err: TyperException) -> int:
    """One line for a command-line mistake, naming it and the command whose --help lists the options."""
    ctx = getattr(err, "ctx", None)
    if type(err).__name__ == "NoArgsIsHelpError":  # a group or command given nothing: its help is the answer
        typer.echo(ctx.get_help())
        return 0
    command = ctx.command_path if ctx is not None else app.info.name
    message = _one_line(err.format_message()).rstrip(".")
    typer.echo(f"error: {message}: see `{command} --help`", err=True)
    return err.exit_code


def _one_line(message: str) -> str:
    """A message as one line that the terminal only shows: a user's value holding a line break
    (``--version '7\\n'``, a path with U+2028), an escape sequence or another control character (a
    name in a trace set) shows it escaped (:func:`~dwise_predict.text.visible`)."""
    return visible(message)
