"""`dwise-predict serve` running SGLang 0.5.23's real server on this CPU, with the hook and recording.

One server for the module (:func:`served`): it starts, answers two prefix-cache pairs and a burst,
and is stopped by SIGTERM to its launcher, as systemd or Kubernetes stop a server; each test reads
one side of that run (the start-up line, the finish order, the recording).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

import live_server
import workload
from tiny_sdar import BLOCK

SLOTS, K = 4, 1  # k = 1: the resident set is B, every resident runs every round (live_bundle's docstring)
PREFIX_PAIRS = {"prefix-leftover": 42, "prefix-aligned": 40}  # prompt tokens: 10 blocks and 2 over / exactly 10
PREFIX_BUDGET = 8
ENGAGED = re.compile(r"DWISE hook engaged in scheduler process (\d+)")


@dataclass
class ServedRun:
    server: live_server.LiveServer
    schedulers: dict  # pid -> title, while it ran
    lock_pid: int  # the pid in the recording directory's lock, while it ran
    arrived: list  # the burst's rids in arrival order
    exit_code: int | None  # the launcher's, after SIGTERM (None: the tree did not end in time)
    recording: Path
    log: str


def _lock_pid(directory: Path) -> int:
    return int((directory / ".lock").read_text().strip())


@pytest.fixture(scope="module")
def served(sglang_venv, tiny_model, ranking_bundle, tmp_path_factory) -> ServedRun:
    work = tmp_path_factory.mktemp("serve")
    port = live_server.free_port()
    hook = ["--bundle", str(ranking_bundle), "--slots", str(SLOTS), "--k", str(K), "--record", str(work / "rec")]
    server = live_server.LiveServer(live_server.serve_argv(tiny_model, port, hook, "--max-running-requests",
                                                           str(SLOTS * K)),
                                    live_server.server_env(), work / "server.log", port).start()
    try:
        server.wait_healthy()
        schedulers, lock_pid = server.scheduler_pids(), _lock_pid(work / "rec" / "dp0")
        for name, n in PREFIX_PAIRS.items():
            for turn in ("first", "again"):
                server.generate(workload.prompt(50_000 + 1_000 * n, n), PREFIX_BUDGET, f"{name}-{turn}")
        arrived = workload.send_burst(server, "serve", fillers=SLOTS)
    except BaseException:
        server.kill()
        raise
    code = server.stop()
    return ServedRun(server, schedulers, lock_pid, arrived, code, work / "rec" / "dp0", server.log_text())


@pytest.fixture(scope="module")
def recorded(served) -> pd.DataFrame:
    return pd.read_parquet(served.recording / "requests.parquet").set_index("request_id")


def test_the_hook_engages_in_the_scheduler_process(served):
    engaged = [int(pid) for pid in ENGAGED.findall(served.log)]
    assert len(served.schedulers) == 1, served.schedulers
    assert engaged == list(served.schedulers), served.log[-3000:]
    assert served.lock_pid in served.schedulers  # the recorder lives in that scheduler too


def test_a_burst_finishes_whole_in_the_bundles_order(served, ranking_bundle):
    replies = [served.server.replies.get(rid) for rid in served.arrived]
    assert all(r is not None for r in replies), (f"{sum(r is None for r in replies)} of {workload.BURST} unfinished\n"
                                                 f"{served.server.client_errors()}")
    assert {r.meta["finish_reason"]["type"] for r in replies} == {"length"}
    assert {r.meta["completion_tokens"] for r in replies} == {workload.BUDGET}

    index = [int(rid.rsplit("-", 1)[1]) for rid in served.arrived]
    keys = workload.predicted_keys(ranking_bundle, [workload.LENGTHS[i] for i in index])
    finish_position = np.argsort(np.argsort([r.finished_at for r in replies]))
    # by construction the arrival order says nothing of the ranking, so a server that ignored the
    # bundle would score near 0 here (p < 1e-6 for 0.9 by chance, n = 30)
    assert abs(spearmanr(np.arange(len(index)), keys).statistic) < 0.1
    rho = spearmanr(finish_position, keys).statistic
    assert rho >= 0.9, f"finish position vs the hook's rank key: Spearman {rho:.2f}"


def test_sigterm_ends_every_process_and_the_recording_keeps_every_finished_request(served, recorded):
    assert served.exit_code == 0, f"exit status {served.exit_code} (None: its processes outlived SIGTERM by a minute)"
    finished = set(served.server.replies)
    assert set(recorded.index) == finished
    assert len(finished) == workload.BURST + SLOTS + 2 * len(PREFIX_PAIRS)
    counts = json.loads((served.recording / "manifest.json").read_text())["counts"]
    assert counts["requests"] == len(finished)
    assert counts["left_out_warmup"] == 1  # SGLang's start-up request, one per DP rank, is no trace
    assert counts.get("dropped", 0) == 0


def test_recorded_rounds_are_sglangs_for_block_4(served, recorded):
    burst = recorded.loc[[rid for rid in served.arrived]]
    for rid, row in burst.iterrows():
        n = int(row["prompt_tokens"])
        assert row["block_size"] == BLOCK
        assert row["prompt_blocks"] == n // BLOCK == row["prefill_rounds"], rid
        assert list(row["rounds_per_block"]) == workload.expected_rounds_per_block(n, workload.BUDGET), rid
        assert row["total_rounds"] == sum(row["rounds_per_block"])
        assert row["output_tokens"] == workload.BUDGET and row["finish"] == "budget"


def test_traces_show_reads_the_recording(served, recorded):
    shown = subprocess.run([sys.executable, "-m", "dwise_predict.cli", "traces", "show",
                            str(served.recording)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    summary = " ".join(shown.stdout.split())  # rich wraps its lines to the width it guesses off a terminal
    assert f"{len(recorded)} requests" in summary
    assert "LowConfidence" in summary and f"block {BLOCK}," in summary


@pytest.mark.parametrize("name", list(PREFIX_PAIRS))
def test_a_prefix_cache_hit_is_served_and_recorded_with_the_prefill_it_ran(served, recorded, name):
    n = PREFIX_PAIRS[name]
    first, again = (served.server.replies[f"{name}-{turn}"] for turn in ("first", "again"))
    assert first.meta["cached_tokens"] == 0
    cached = again.meta["cached_tokens"]
    assert cached == BLOCK * (n // BLOCK)  # the radix cache matched every whole prompt block
    assert again.text == first.text and again.meta["completion_tokens"] == PREFIX_BUDGET
    assert recorded.loc[f"{name}-first", "prefill_rounds"] == n // BLOCK
    assert recorded.loc[f"{name}-again", "prefill_rounds"] == 0  # no prompt block left to run
    assert recorded.loc[f"{name}-again", "prompt_blocks"] == n // BLOCK
