"""The fresh-predictor loop on SGLang 0.5.23's real server on this CPU: record → monitor → refresh →
publish → hot swap, with the server running throughout.

One server for the module (:func:`loop`), started by ``dwise-predict serve`` with the stale bundle
(``live_bundle.stale_traces``: it learned that a larger budget means fewer rounds, and on the tiny
random model's traffic rounds rise with the budget), published in a zoo as ``tiny`` version 1 and
followed there, recording, with SGLang's metrics on. Traffic before: requests of mixed budgets and
two categories (``custom_params.dwise_category``); the monitor on ``/metrics`` shows the stale
bundle ranking them backwards. Then ``dwise-predict refresh`` retrains on the recording the server is
still writing, judges the candidate against the serving bundle on held-out recorded requests and
publishes version 2; the hook swaps to it at a step boundary while traffic continues, and the
monitor shows version 2 ranking the requests it served. Every request finishes once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import live_server
import workload
from tiny_sdar import BLOCK

SLOTS, K = 4, 1
BEFORE, AFTER = 200, 80  # requests before the refresh (>= 150: refresh holds out 20 % and needs 30) and after
BUDGETS = (4, 8, 12, 16, 20, 24, 28, 32, 36, 40)
CATEGORIES = ("short-answers", "essays")
CLIENTS = 8  # requests in flight at once
SWAP_TIMEOUT_S = 90.0
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LoopRun:
    server: live_server.LiveServer
    sent: list  # every rid sent, in order
    metrics_before: str  # /metrics after the traffic before the refresh
    metrics_after: str  # /metrics after the traffic after the swap
    refresh: dict  # refresh.json
    refresh_output: str
    recording: Path
    log: str


def request_of(i: int) -> tuple[str, int, dict]:
    """The ``i``-th request: its prompt (no shared prefix), budget and category. Short answers get the
    small budgets, essays the large, with an overlap, so ranks within a category mean something too."""
    budget = BUDGETS[(7 * i) % len(BUDGETS)]
    category = CATEGORIES[0] if budget <= 24 and i % 3 else CATEGORIES[1]
    return workload.prompt(200_000 + 100 * i, 8 + (5 * i) % 33), budget, {"dwise_category": category}


def send(server: live_server.LiveServer, tag: str, indices: range) -> list[str]:
    """Send the requests ``indices``, ``CLIENTS`` at a time; wait for all. Returns their rids."""
    rids, threads = [], []
    gate = threading.Semaphore(CLIENTS)

    def one(i: int, rid: str) -> None:
        with gate:
            text, budget, params = request_of(i)
            server._generate_quietly(text, budget, rid, params)

    for i in indices:
        rids.append(f"{tag}-{i:03d}")
        threads.append(threading.Thread(target=one, args=(i, rids[-1]), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return rids


def metric(page: str, name: str, **labels) -> float | None:
    """The value of ``name`` on a Prometheus page whose labels include ``labels`` (the first match)."""
    for line in page.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def recorded_requests(recording: Path) -> int:
    manifest = recording / "manifest.json"
    return int(json.loads(manifest.read_text()).get("counts", {}).get("requests", 0)) if manifest.is_file() else 0


def wait_for(check, timeout: float, what: str, server: live_server.LiveServer):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def loop(sglang_venv, tiny_model, stale_bundle, tmp_path_factory) -> LoopRun:
    work = tmp_path_factory.mktemp("refresh-loop")
    zoo, recording = work / "zoo", work / "rec"
    cli = [sys.executable, "-m", "dwise_predict.cli"]
    subprocess.run([*cli, "publish", str(stale_bundle), "--zoo", str(zoo), "--name", "tiny"], check=True,
                   capture_output=True, timeout=300)
    hook = ["--bundle", str(stale_bundle), "--follow", "tiny", "--follow-zoo", str(zoo), "--follow-poll-s", "0.5",
            "--slots", str(SLOTS), "--k", str(K), "--record", str(recording), "--record-flush-s", "0.5"]
    port = live_server.free_port()
    server = live_server.LiveServer(
        live_server.serve_argv(tiny_model, port, hook, "--max-running-requests", str(SLOTS * K), "--enable-metrics"),
        live_server.server_env(), work / "server.log", port).start()
    try:
        server.wait_healthy()
        sent = send(server, "before", range(BEFORE))
        wait_for(lambda: recorded_requests(recording / "dp0") >= BEFORE, 60, "the recording of the traffic", server)
        time.sleep(2.5)  # the monitor's summary reaches /metrics at most every 2 s
        metrics_before = server.metrics()
        done = subprocess.run([*cli, "refresh", str(recording / "dp0"), "--zoo", str(zoo), "--name", "tiny",
                               "--out", str(work / "refresh")], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        sent += send(server, "after", range(BEFORE, BEFORE + AFTER))
        wait_for(lambda: "bundle 1 -> 2" in server.log_text(), SWAP_TIMEOUT_S, "the swap to version 2", server)
        sent += send(server, "swapped", range(BEFORE + AFTER, BEFORE + 2 * AFTER))
        time.sleep(2.5)
        metrics_after = server.metrics()
    except BaseException:
        server.kill()
        raise
    server.stop()
    refresh = json.loads((work / "refresh" / "refresh.json").read_text())
    return LoopRun(server, sent, metrics_before, metrics_after, refresh, done.stdout, recording / "dp0",
                   server.log_text())


def test_every_request_finishes_once(loop):
    assert loop.server.client_errors() == ""
    assert sorted(loop.server.replies) == sorted(loop.sent) and len(set(loop.sent)) == BEFORE + 2 * AFTER
    manifest = json.loads((loop.recording / "manifest.json").read_text())
    counts = manifest["counts"]
    left_out = sum(v for k, v in counts.items() if k.startswith("left_out_") and k != "left_out_health_check"
                   and k != "left_out_warmup")
    assert counts["requests"] + left_out == len(loop.sent)


def test_the_monitor_shows_the_stale_bundle_ranking_backwards(loop):
    refined = metric(loop.metrics_before, "dwise_rank_correlation", estimate="refined")
    assert refined is not None and refined < -0.5, loop.metrics_before
    assert metric(loop.metrics_before, "dwise_monitored_requests") >= BEFORE * 0.9
    assert metric(loop.metrics_before, "dwise_bundle_info", version="1") == 1.0


def test_refresh_retrains_on_the_live_recording_and_publishes_a_winner(loop):
    result = loop.refresh
    assert result["decision"] == "published", loop.refresh_output
    assert result["published"]["version"] == "2"
    refined = result["differences"]["refined_rho"]
    assert refined["interval"][0] > 0.5, refined


def test_the_hook_swaps_mid_traffic_and_the_new_version_ranks_right(loop):
    assert metric(loop.metrics_after, "dwise_bundle_swaps_total") == 1.0
    assert metric(loop.metrics_after, "dwise_bundle_rollbacks_total") == 0.0
    assert metric(loop.metrics_after, "dwise_bundle_info", version="2") == 1.0
    manifest = json.loads((loop.recording / "manifest.json").read_text())
    swaps = manifest["bundle_swaps"]
    assert [(s["from"], s["to"]) for s in swaps] == [("1", "2")]
    versions = manifest["monitor"]["versions"]
    assert versions["1"]["refined_rho"] < -0.5 < 0.5 < versions["2"]["refined_rho"], versions


def test_the_recording_carries_the_clients_categories(loop):
    import pandas as pd

    recorded = pd.read_parquet(loop.recording / "requests.parquet")
    assert set(recorded["category"]) == set(CATEGORIES)


def test_figures(loop, record_property):
    """The loop's figures, printed at the end of the run (tests/conftest.py)."""
    versions = json.loads((loop.recording / "manifest.json").read_text())["monitor"]["versions"]
    diff = loop.refresh["differences"]["refined_rho"]
    low, high = diff["interval"]
    lines = ["live refresh loop (SGLang 0.5.23, CPU, tiny SDAR): refined rho of the served estimates",
             *(f"  version {v}: {row['n']} requests, refined rho {row['refined_rho']:+.2f}, "
               f"admission rho {row['admission_rho'] if row['admission_rho'] is None else round(row['admission_rho'], 2)}"
               for v, row in sorted(versions.items())),
             f"  refresh: candidate - serving refined rho {diff['difference']:+.2f} [{low:+.2f}, {high:+.2f}], "
             f"decision {loop.refresh['decision']}"]
    record_property("figures", "\n".join(lines))
    assert np.isfinite(diff["difference"])
