"""SGLang's offline ``sglang.Engine`` with the DWISE plugin (``DWISE_*`` set), ended by ``Engine.shutdown()``.

SGLang's ``Engine.shutdown`` goes straight to ``kill_process_tree``: every scheduler is SIGKILLed. A
recorder in it must have closed before that (issue 56: with the plugin under a script that builds
``sglang.Engine`` itself, as SGLang's documentation shows, it never did; the recording had shards at
best, never consolidated).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

import live_server

REQUESTS = 6
ENGAGED = re.compile(r"DWISE hook engaged in scheduler process (\d+)")


@dataclass
class EngineRun:
    returncode: int | None  # None: it ran past its time
    finished: list
    output: str
    recording: Path


@pytest.fixture(scope="module")
def engine_run(sglang_venv, tiny_model, ranking_bundle, tmp_path_factory) -> EngineRun:
    work = tmp_path_factory.mktemp("engine")
    env = live_server.server_env(DWISE_BUNDLE=str(ranking_bundle), DWISE_SLOTS="4", DWISE_K="1",
                                 DWISE_RECORD=str(work / "rec"))
    code, output = live_server.run_to_end([str(sglang_venv / "bin" / "python"),
                                           str(Path(__file__).with_name("engine_child.py")), str(tiny_model),
                                           str(REQUESTS)], env, work, live_server.START_TIMEOUT_S + 120)
    lines = [line for line in output.splitlines() if line.startswith('{"finished"')]
    finished = json.loads(lines[-1])["finished"] if lines else []
    return EngineRun(code, finished, output, work / "rec" / "dp0")


def test_the_plugin_engages_under_sglang_engine_and_serves_every_request(engine_run):
    assert engine_run.returncode == 0, engine_run.output[-3000:]
    assert sorted(engine_run.finished) == [f"engine-{i}" for i in range(REQUESTS)]
    assert len(ENGAGED.findall(engine_run.output)) == 1, engine_run.output[-3000:]


def test_engine_shutdown_keeps_every_finished_request_in_the_recording(engine_run):
    assert engine_run.returncode == 0
    recorded = pd.read_parquet(engine_run.recording / "requests.parquet")  # consolidated: the recorder closed
    assert sorted(recorded["request_id"]) == sorted(engine_run.finished)
