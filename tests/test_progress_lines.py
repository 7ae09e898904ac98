"""Progress off a terminal (issue 53): the long commands write `label: ...` lines on stderr when it is
not a terminal (nohup, CI, a Slurm log), and stdout is the same whether or not it is one
(dwise_predict/cli/progress.py; collect's lines: tests/test_collect_e2e.py)."""

from __future__ import annotations

import json
import sys

import pytest

from dwise_predict.cli import main
from dwise_predict.cli.progress import ProgressLines
from evaluate_helpers import FAST_CONFIG, fixed_config, make_traces, write


class Clock:
    """Seconds set by the test."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return write(make_traces(n_requests=160), tmp_path_factory.mktemp("progress") / "t")


def _lines(err: str, label: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{label}: ")]


def test_counted_lines_come_first_last_and_every_tenth_or_30_seconds(off_a_terminal, capsys):
    clock = Clock()
    lines = ProgressLines("work", clock=clock)
    for done, at in ((0, 0), (1, 5), (9, 20), (10, 21), (11, 50), (12, 52), (40, 60), (100, 61), (100, 62)):
        clock.now = 100.0 + at
        lines.count(done, 100, f"{done}/100")
    # 0: the first; 10: a tenth since 0; 11: 29 s after 10 is not yet 30, 12 is 31 s after it;
    # 40: a tenth; 100: the last, once
    assert capsys.readouterr().err.splitlines() == ["work: 0/100", "work: 10/100", "work: 12/100", "work: 40/100",
                                                    "work: 100/100"]


def test_stage_lines_come_at_once_and_ticks_30_seconds_after_any_line(off_a_terminal, capsys):
    clock = Clock()
    lines = ProgressLines("train", clock=clock)
    lines.stage("fitting")  # at 0 s
    for at in (10, 29, 31, 45, 60, 62):
        clock.now = 100.0 + at
        lines.tick(f"epoch at {at} s")
    clock.now = 170.0
    lines.stage("scoring")
    clock.now = 190.0
    lines.tick("epoch at 90 s")  # 20 s after the stage line: not yet
    assert capsys.readouterr().err.splitlines() == ["train: fitting", "train: epoch at 31 s", "train: epoch at 62 s",
                                                    "train: scoring"]


def test_on_a_terminal_no_line_is_written(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    lines = ProgressLines("train")
    lines.stage("fitting")
    lines.count(5, 5, "done")
    lines.tick("epoch")
    assert not lines.on and capsys.readouterr().err == ""


def _train(traces, out, monkeypatch, capsys, terminal: bool) -> tuple[str, str]:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    config = out.with_suffix(".json")
    config.write_text(json.dumps({**FAST_CONFIG, "members": 2, "max_epochs": 6, "refine": "survival"}))
    assert main(["train", str(traces), "--out", str(out), "--config", str(config)]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_train_off_a_terminal_says_each_stage_and_member_and_prints_the_same_results(traces, tmp_path, monkeypatch,
                                                                                       capsys):
    piped_out, piped_err = _train(traces, tmp_path / "piped", monkeypatch, capsys, terminal=False)
    tty_out, tty_err = _train(traces, tmp_path / "tty", monkeypatch, capsys, terminal=True)
    assert piped_out == tty_out and "Eval split: 53 requests (trained on 107)" in piped_out
    assert _lines(tty_err, "train") == []  # the bar's place
    lines = _lines(piped_err, "train")
    assert lines[:2] == ["train: fitting the admission model (LightGBM) on 107 requests",
                         "train: fitting the refinement predictor (survival) on 107 requests"]
    members = [line for line in lines if "epoch 1," in line]
    assert [line.split(":")[1] for line in members] == [" member 1 of 2 (seed 0)", " member 2 of 2 (seed 1)"]
    assert lines[-2:] == ["train: calibrating its estimates (isotonic map)", "train: scoring the eval split (53 requests)"]


def test_train_choosing_its_predictor_names_each_candidate(traces, tmp_path, off_a_terminal, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**FAST_CONFIG, "cv_folds": 2}))
    assert main(["train", str(traces), "--out", str(tmp_path / "r"), "--config", str(config)]) == 0
    lines = _lines(capsys.readouterr().err, "train")
    assert lines[1] == "train: choosing the refinement predictor: each candidate's 2-fold cross-validation"
    assert [line.rsplit(": ", 1)[1] for line in lines if "cross-validated" in line] == [
        "survival", "ridge", "survival+ridge", "survival-pca", "ridge-within", "ridge-within+signals"]
    assert lines[2].startswith("train:   candidate 1 of 6 cross-validated")


def test_simulate_says_each_arrival_pattern_and_seed_on_stderr_only(traces, off_a_terminal, capsys):
    args = ["simulate", str(traces), "--requests", "40", "--policies", "sglang-default,fcfs-mixed", "--arrival-seeds", "2"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "replayed" in line] == [
        "  burst arrivals, arrival seed 1 of 2: 2 schedulers replayed",
        "  burst arrivals, arrival seed 2 of 2: 2 schedulers replayed",
        "  burst-poisson arrivals, arrival seed 1 of 2: 2 schedulers replayed",
        "  burst-poisson arrivals, arrival seed 2 of 2: 2 schedulers replayed"]
    assert "replayed" not in out and "fcfs-mixed" in out


def test_evaluate_off_a_terminal_says_each_retraining(traces, tmp_path, off_a_terminal, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fixed_config().to_dict(), "bootstrap": 50}))
    assert main(["evaluate", str(traces), "--out", str(tmp_path / "e"), "--config", str(config), "--jobs", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    announced = next(line for line in err if line.startswith("retraining "))
    done = [line for line in err if line.startswith("  done: ")]
    assert announced.startswith(f"retraining {len(done)} times") and len(done) >= 2
