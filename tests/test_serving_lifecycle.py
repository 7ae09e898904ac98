"""A recording survives the ways SGLang 0.5.23's scheduler processes end.

Each test runs a recording scheduler process (``tests/recording_child.py``: the hook installed as in
SGLang's scheduler child, the CPU fake serving a stream of requests) and ends it as SGLang, a user or
the OS would: SIGTERM (what ``launcher.stop_recordings`` sends before an ``Engine``'s shutdown
SIGKILLs its schedulers), SIGINT (Ctrl-C reaches the whole process group), SIGKILL (SGLang's
``kill_process_tree``, the parent's death through ``PR_SET_PDEATHSIG``, the OOM killer).
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.collectors.live import LiveRecorder  # noqa: E402
from dwise_predict.collectors.store import read_shards  # noqa: E402
from dwise_predict.serving.launcher import stop_recordings  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
from dwise_predict.traces.dataset import REQUESTS_FILE  # noqa: E402

TESTS = Path(__file__).resolve().parent
START_S = 240  # a child imports torch and SGLang's fake on two shared cores


def start(out: Path, *args: str) -> subprocess.Popen:
    """The child, its stdout lines queued by a thread (``child.lines``): ``select`` on a text pipe misses
    a line that arrived in the same read as the one before it and waits in the reader's buffer."""
    env = dict(os.environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, str(TESTS / "recording_child.py"), str(out), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    child.lines = queue.Queue()
    child.reader = threading.Thread(target=lambda: [child.lines.put(line.strip()) for line in child.stdout], daemon=True)
    child.reader.start()
    return child


def rest_of(child: subprocess.Popen, timeout: float = 60) -> tuple[list[str], str]:
    """Once the child ends: the stdout lines its reader queued and nobody took, and its stderr."""
    err = child.stderr.read()  # to its end: the child's exit closes it
    child.wait(timeout=timeout)
    child.reader.join(timeout=timeout)
    lines = []
    while not child.lines.empty():
        lines.append(child.lines.get())
    return lines, err


def read_until(child: subprocess.Popen, done, timeout: float = START_S) -> list[str]:
    """The child's stdout lines until ``done(lines)`` holds (or the child exits, or time runs out)."""
    lines, deadline = [], time.monotonic() + timeout
    while not done(lines):
        assert time.monotonic() < deadline, f"the child said {lines[-3:]} after {timeout} s"
        try:
            lines.append(child.lines.get(timeout=1.0))
        except queue.Empty:  # nothing said in a second: is it still alive?
            assert child.poll() is None, f"the child exited early: {child.stderr.read()[-2000:]}"
    return lines


def finished(lines: list[str]) -> set[str]:
    return {line.split()[1] for line in lines if line.startswith("finished ")}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "stop_recordings"])
def test_a_recording_stopped_mid_traffic_keeps_every_finished_request(tmp_path, how):
    """Stopped while it serves: every request SGLang finished before the signal is in the traces,
    consolidated, though no shard was due (``record_every`` 1000, the timer at 60 s). SIGTERM ends
    the process as SIGTERM does once the recorder closed; SIGINT unwinds it (``KeyboardInterrupt``)
    through the ``atexit`` close."""
    child = start(tmp_path / "rec", "--flush-s", "60")
    try:
        before = read_until(child, lambda lines: len(finished(lines)) >= 20)
        if how == "stop_recordings":  # it waits for the process, and reaps it: no exit status is left here
            assert stop_recordings(tmp_path / "rec", timeout=60) == [child.pid]
            assert not psutil.pid_exists(child.pid)
        else:
            child.send_signal(getattr(signal, how))
        out, err = rest_of(child)
    finally:
        child.kill()
    printed = finished(before + out)
    if how == "SIGINT":  # Python's own handler ran after the commit: the process unwound
        assert child.returncode == 1 and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
    elif how == "SIGTERM":
        assert child.returncode == -signal.SIGTERM, err[-2000:]
    traces = load_traces(tmp_path / "rec" / "dp0")  # consolidated: requests.parquet is there
    recorded = set(traces.requests["request_id"])
    assert len(printed) >= 20 and printed <= recorded, sorted(printed - recorded)
    assert len(recorded - printed) <= 4  # finished in the step the signal interrupted, not printed yet
    counts = traces.manifest["counts"]
    assert counts["requests"] == len(recorded) and counts["dropped"] == 0


@pytest.mark.slow
def test_a_killed_recording_loses_at_most_its_last_seconds_and_the_next_start_consolidates_it(tmp_path):
    """SIGKILL runs nothing of the process. Its writer committed every finished request within the
    flush interval without more traffic (the scheduler idle, no shard due by count), so nothing is
    lost; the next run to open the directory finds shards without ``requests.parquet`` and
    consolidates them before it records anything."""
    rec = tmp_path / "rec" / "dp0"
    child = start(tmp_path / "rec", "--flush-s", "0.3", "--stop-after", "12")
    try:
        lines = read_until(child, lambda lines: "idle" in lines)
        deadline = time.monotonic() + 30
        while {rid for s in read_shards(rec) for rid in s.requests["request_id"]} != finished(lines):
            assert time.monotonic() < deadline, "the timer did not commit the idle scheduler's requests"
            time.sleep(0.1)
        assert not (rec / REQUESTS_FILE).exists()
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL and len(finished(lines)) == 12
    recorder = LiveRecorder(rec, block_size=8)  # the next start, with the same (default) decoding
    try:
        traces = load_traces(rec)
        assert set(traces.requests["request_id"]) == finished(lines)
        counts = traces.manifest["counts"]
        assert counts["requests"] == 12  # and the manifest says they were recovered from a run that never closed
        assert (counts["runs_unclosed"], counts["requests_recovered"]) == (1, 12)
    finally:
        recorder.close()


@pytest.mark.slow
def test_an_engine_shutdown_under_the_plugin_commits_and_consolidates_the_recording(tmp_path):
    """``sglang.Engine`` with the plugin (``DWISE_RECORD`` set): SGLang's ``Engine.shutdown`` goes
    straight to ``kill_process_tree``, a SIGKILL of every scheduler, and the recorder never closed
    (no shard was due: ``record_every`` 1000, the timer at 60 s, so nothing at all was on disk).
    The plugin wraps ``Engine.shutdown`` too: each recording scheduler commits and consolidates
    first. Run with SGLang's own ``Engine.shutdown``, ``kill_process_tree`` and plugin loader
    (``tests/engine_child.py``)."""
    from dwise_predict.serving.plugin import VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env.update(DWISE_RECORD=str(tmp_path / "rec"), DWISE_BLOCK_SIZE="8", DWISE_HIDDEN_SIZE="16", DWISE_SLOTS="4",
               DWISE_K="2", DWISE_MAX_BATCH="4", DWISE_RECORD_EVERY="1000", DWISE_RECORD_FLUSH_S="60",
               DWISE_RESOLVER="fakes.sglang_launch:resolve", PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(TESTS / "engine_child.py")], capture_output=True, text=True, env=env,
                         timeout=2 * START_S)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "shut down" and len(finished(lines)) == 12, lines[-3:]
    traces = load_traces(tmp_path / "rec" / "dp0")  # consolidated: requests.parquet is there
    assert set(traces.requests["request_id"]) == finished(lines)
    counts = traces.manifest["counts"]
    assert (counts["requests"], counts["runs_unclosed"], counts["left_out_in_flight"]) == (12, 0, 0)
    assert counts["dropped"] == counts["lost_to_write_error"] == 0
