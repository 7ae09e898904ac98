"""Crashes mid-collect (kill -9 at several moments, a full disk): rerunning finishes the same traces."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from collect_helpers import make_tiny_dir
from dwise_predict.cli import main
from dwise_predict.traces import load_traces

FLAGS = ["--limit", "32", "--batch-size", "4", "--budget", "24", "--requests-per-shard", "4"]  # 8 shards


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "traces"
    assert main(["collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)]) == 0
    return load_traces(out)


def _shards(out) -> int:
    return len(list((out / "shards").glob("shard-*.parquet"))) if (out / "shards").is_dir() else 0


def _kill_after(out, tiny_dir, shards_before_kill: int, delay_s: float) -> int:
    """Start collect in a subprocess, SIGKILL it ``delay_s`` after ``shards_before_kill`` shards exist."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dwise_predict.cli", "collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while _shards(out) < shards_before_kill and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return _shards(out)


# (shards committed before the kill, extra delay): during start-up, right after a commit, mid-shard.
rng = random.Random(7)
KILL_POINTS = [(0, rng.uniform(0.5, 2.5)), (1, 0.0), (3, rng.uniform(0.0, 0.2))]


@pytest.mark.slow
@pytest.mark.parametrize("shards_before_kill,delay_s", KILL_POINTS)
def test_rerun_after_kill_equals_uninterrupted(shards_before_kill, delay_s, tiny_dir, uninterrupted, tmp_path):
    out = tmp_path / "traces"
    left = _kill_after(out, tiny_dir, shards_before_kill, delay_s)
    assert left < 8 and not (out / "requests.parquet").exists(), "the kill came after the run finished"
    assert main(["collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)]) == 0
    resumed = load_traces(out)
    assert resumed.manifest["counts"]["resumed"] == 4 * left  # committed shards were kept, not redone
    _assert_same(resumed, uninterrupted)
    assert _shards(out) == 8  # one shard per 4 requests, none duplicated


def _assert_same(resumed, whole):
    """Same request ids, round counts, outputs and hidden states (wall times differ)."""
    assert resumed.requests["request_id"].tolist() == whole.requests["request_id"].tolist()
    assert resumed.requests["total_rounds"].tolist() == whole.requests["total_rounds"].tolist()
    assert whole.requests["total_rounds"].nunique() > 3  # a comparison of varied round counts
    assert [list(v) for v in resumed.requests["rounds_per_block"]] == [list(v) for v in whole.requests["rounds_per_block"]]
    assert resumed.requests["output_text"].tolist() == whole.requests["output_text"].tolist()
    np.testing.assert_array_equal(resumed.first_round, whole.first_round)
    np.testing.assert_array_equal(resumed.prompt_last, whole.prompt_last)


@pytest.mark.slow
def test_full_disk_is_one_line_and_a_rerun_finishes(tiny_dir, uninterrupted, tmp_path):
    import resource

    out = tmp_path / "traces"

    def small_files():  # every file may grow to 12 KB: manifests and hidden shards fit, request tables do not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))

    run = subprocess.run(
        [sys.executable, "-m", "dwise_predict.cli", "collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)],
        preexec_fn=small_files, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    # stderr is no terminal here: the progress comes as log lines, then the error as one line
    errors = [line for line in run.stderr.splitlines() if not line.startswith("collect: ")]
    assert run.returncode == 1 and len(errors) == 1 and run.stderr.endswith("\n"), run.stderr
    assert run.stderr.startswith("collect: 0/")
    assert "disk is full" in errors[0] and "rerun the same command to resume" in errors[0]
    assert _shards(out) == 0 and not list((out / "shards").glob(".*tmp*"))  # no half shard, no temp file
    assert main(["collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)]) == 0
    _assert_same(load_traces(out), uninterrupted)
