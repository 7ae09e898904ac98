"""The plugin path: ``DWISE_BUNDLE=… python -m sglang.launch_server`` on this CPU, two data-parallel ranks.

SGLang 0.5.23 runs ``--dp 2`` on a CPU when each rank is given its cores
(``SGLANG_CPU_OMP_THREADS_BIND``; without it a second rank is refused: more ranks than NUMA nodes):
a data-parallel controller and one scheduler per rank, each with the hook and its own recording
directory. Attention DP and TP > 1 do not run on SGLang's CPU path, so the stall of issue 56 (each
attention-DP worker holds ``max_running_requests // attn_dp_size`` rows) cannot be shown live here:
``--dp 2 --enable-dp-attention`` fails SGLang's argument resolution (``assert cfg.tp_size %
cfg.attn_dp_size == 0``), and any TP group of 2 (``--tp 2``, with attention DP or without) dies
building its communicator (``PyNcclCommunicator``: "ValueError: Expected a cuda device, but got: cpu").

One server for the module (:func:`plugged`): a burst, three clients that go away mid-generation,
SIGTERM to the launcher.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

import live_server
import workload

SLOTS, K, RANKS = 2, 1, 2
DISCONNECTS, DISCONNECT_BUDGET = 3, 512  # ~640 forwards each: still running when its client goes
ENGAGED = re.compile(r"DWISE hook engaged in scheduler process (\d+) \(TP rank 0, DP rank (\d+)\)")


@dataclass
class PluggedRun:
    server: live_server.LiveServer
    schedulers: dict  # pid -> title, while it ran
    lock_pids: dict  # recording directory name -> the pid in its lock, while it ran
    arrived: list
    disconnected: list  # rids whose client went away
    exit_code: int | None
    recording: Path
    log: str


@pytest.fixture(scope="module")
def plugged(sglang_venv, tiny_model, ranking_bundle, tmp_path_factory) -> PluggedRun:
    work = tmp_path_factory.mktemp("plugin")
    port = live_server.free_port()
    env = live_server.server_env(DWISE_BUNDLE=str(ranking_bundle), DWISE_SLOTS=str(SLOTS), DWISE_K=str(K),
                                 DWISE_RECORD=str(work / "rec"), SGLANG_CPU_OMP_THREADS_BIND="0|1")
    argv = live_server.launch_server_argv(tiny_model, port, "--dp", str(RANKS), "--max-running-requests",
                                          str(SLOTS * K))
    server = live_server.LiveServer(argv, env, work / "server.log", port).start()
    try:
        server.wait_healthy()
        schedulers = server.scheduler_pids()
        locks = {d.name: int((d / ".lock").read_text()) for d in sorted((work / "rec").glob("dp*"))}
        arrived = workload.send_burst(server, "plugin", fillers=SLOTS * RANKS)
        disconnected = [f"plugin-gone-{i}" for i in range(DISCONNECTS)]
        for i, rid in enumerate(disconnected):
            server.disconnect_mid_stream(workload.prompt(70_000 + 100 * i, 12), DISCONNECT_BUDGET, rid)
        time.sleep(1.0)  # SGLang's tokenizer manager sends the aborts
        server.generate(workload.prompt(80_000, 12), 8, "plugin-after")  # still serving
    except BaseException:
        server.kill()
        raise
    code = server.stop()
    return PluggedRun(server, schedulers, locks, arrived, disconnected, code, work / "rec", server.log_text())


def _counts(run: PluggedRun) -> dict:
    """The recording's manifest counts, summed over its DP-rank directories."""
    total: dict = {}
    for manifest in sorted(run.recording.glob("dp*/manifest.json")):
        for key, value in (json.loads(manifest.read_text()).get("counts") or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def test_the_hook_engages_in_every_scheduler_process(plugged):
    engaged = {int(pid): int(rank) for pid, rank in ENGAGED.findall(plugged.log)}
    titles = {pid: title.split()[0] for pid, title in plugged.schedulers.items()}
    assert sorted(titles.values()) == [f"sglang::scheduler_DP{r}" for r in range(RANKS)]
    assert engaged == {pid: int(title[-1]) for pid, title in titles.items()}, plugged.log[-3000:]
    assert plugged.lock_pids == {f"dp{rank}": pid for pid, rank in engaged.items()}  # each rank records its own


def test_each_rank_finishes_its_share_of_the_burst_in_the_bundles_order(plugged, ranking_bundle):
    replies = [plugged.server.replies.get(rid) for rid in plugged.arrived]
    assert all(r is not None and r.meta["completion_tokens"] == workload.BUDGET for r in replies)
    index = np.array([int(rid.rsplit("-", 1)[1]) for rid in plugged.arrived])
    keys = workload.predicted_keys(ranking_bundle, [workload.LENGTHS[i] for i in index])
    ranks = np.array([r.meta["dp_rank"] for r in replies])
    assert sorted(set(ranks)) == list(range(RANKS))
    for rank in range(RANKS):
        mine = ranks == rank
        finished_at = [r.finished_at for r, m in zip(replies, mine) if m]
        rho = spearmanr(np.argsort(np.argsort(finished_at)), keys[mine]).statistic
        assert rho >= 0.8, f"DP rank {rank}: finish position vs rank key, Spearman {rho:.2f} over {mine.sum()}"


def test_the_recording_keeps_every_finished_request_of_every_rank_through_sigterm(plugged):
    assert plugged.exit_code == 0, f"exit status {plugged.exit_code} (None: its processes outlived SIGTERM by a minute)"
    recorded = pd.concat([pd.read_parquet(d / "requests.parquet").assign(rank=d.name)
                          for d in sorted(plugged.recording.glob("dp*"))])
    finished = {rid for rid in plugged.server.replies}
    assert set(recorded["request_id"]) == finished
    by_rank = {rid: f"dp{r.meta['dp_rank']}" for rid, r in plugged.server.replies.items()}
    assert dict(zip(recorded["request_id"], recorded["rank"])) == by_rank
    assert _counts(plugged)["left_out_warmup"] == RANKS  # SGLang warms up each DP rank once


def test_a_client_that_disconnects_leaves_nothing_in_the_recorder(plugged):
    replies = plugged.server.replies
    assert not set(plugged.disconnected) & set(replies)  # they never finished for a client
    counts = _counts(plugged)
    # each one left the recorder as it was aborted, counted; none was still open when it closed
    assert counts.get("left_out_aborted") == DISCONNECTS, counts
    assert counts.get("left_out_in_flight") == 0, counts
