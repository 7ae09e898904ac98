"""Every command is registered in one place, has help with an example, and answers --help."""

import subprocess
import sys

import pytest
import typer.main

from dwise_predict import __version__
from dwise_predict.cli import app, main


def _is_group(cmd) -> bool:
    # typer bundles its own click, so duck-type instead of isinstance(click.Group)
    return hasattr(cmd, "commands")


def _commands(group, prefix=()):
    for name, cmd in sorted(group.commands.items()):
        yield prefix + (name,), cmd
        if _is_group(cmd):
            yield from _commands(cmd, prefix + (name,))


COMMANDS = list(_commands(typer.main.get_command(app)))


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dwise-predict {__version__}"


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_command_has_help_with_example(path, cmd, capsys):
    assert cmd.help, f"{' '.join(path)} has no help"
    if not _is_group(cmd):
        assert "Example" in cmd.help, f"{' '.join(path)}: help lacks an Examples section"
    assert main([*path, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


def test_console_script_runs_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "dwise_predict.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout


def test_ctrl_c_exits_130_with_one_line_saying_how_to_resume(monkeypatch, tmp_path, capsys):
    from dwise_predict.dllm import train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_tiny", interrupted)
    assert main(["dllm", "train-tiny", "--out", str(tmp_path / "m")]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: rerun the same command to resume"


def test_the_printed_summary_carries_the_held_out_interval_and_the_simulations_assumptions(capsys, monkeypatch):
    from dwise_predict.cli.quickstart import _print_quickstart

    monkeypatch.setenv("COLUMNS", "200")
    pair = lambda a, b: {"in_training": a, "held_out": b}  # noqa: E731
    summary = {"n_train": 320, "n_eval": 160, "admission_rho": 0.6, "refined_rho": 0.9, "admission_within_category": 0.4,
               "refined_within_category": 0.68, "held_out": {"admission": pair(0.4, -0.07), "refined": pair(0.68, 0.36)},
               "held_out_ci": {"admission": pair(None, [-0.22, 0.07]), "refined": pair([0.55, 0.75], [0.211, 0.478])},
               "speedup_vs_sglang_default": {"burst": 5.77}, "simulated": {"slots": 16, "k": 4, "round_ms": 50.0, "slot_ms": 0.35},
               "paths": {"bundle": "b"}, "report": "r"}
    _print_quickstart(summary)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "category held out" in line)
    assert "0.36 [0.21, 0.48]" in row
    assert "-0.07 [-0.22, 0.07]" in row
    # the simulated gain says what it assumed: no round-cost profile, so it is an upper bound
    assert "over SGLang's default: 5.77x (burst arrivals, B = 16, k = 4, round cost: the default, no profile)" in out
    assert "(B = 16, a round 50 ms + 0.35 ms a block, prompt or denoising alike: an upper bound;" in out
