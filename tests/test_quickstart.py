"""The README's first command at reduced size: every artifact exists, the bundle verifies, a rerun resumes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs")
    cmd = [sys.executable, "-m", "dwise_predict.cli", "quickstart", "--out", str(out), "--limit", "96",
           "--max-epochs", "15", "--jobs", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, json.loads(done.stdout), cmd


def test_every_stage_left_its_artifacts(quickstart):
    out, summary, _ = quickstart
    for name in ("manifest.json", "requests.parquet", "hidden.safetensors"):
        assert (out / "traces" / name).stat().st_size > 0
    for name in ("admission.txt", "refine.safetensors", "calibration.json", "metrics.json", "config.json"):
        assert (out / "run" / name).stat().st_size > 0
    for name in ("bundle.json", "refine.onnx", "refine.pt", "admission.onnx", "README.md"):
        assert (out / "bundle" / name).stat().st_size > 0
    html = (out / "report" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4
    rows = json.loads((out / "simulate" / "simulate.json").read_text())["rows"]
    assert {r["policy"] for r in rows} >= {"sglang-default", "dwise-refined", "dwise-oracle"}
    assert summary["n_train"] + summary["n_eval"] == 96
    assert summary["verified"] is True
    # the refined predictor sees the first round: on the tiny dLLM it must rank requests
    assert summary["refined_rho"] > 0.3


def test_verify_command_passes_on_the_bundle(quickstart):
    out, _, _ = quickstart
    done = subprocess.run([sys.executable, "-m", "dwise_predict.cli", "verify", str(out / "bundle")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rerun_resumes_and_reports_the_same(quickstart):
    out, summary, cmd = quickstart
    before = (out / "run" / "metrics.json").stat().st_mtime_ns
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["refined_rho"] == summary["refined_rho"]
    assert (out / "run" / "metrics.json").stat().st_mtime_ns == before  # training was not redone


def test_rerun_with_other_options_redoes_the_stages_they_change(quickstart):
    """Last in this module: it replaces the fixture's run. The first run trained 15 epochs with LOCO;
    asking for 14 without LOCO must retrain and re-evaluate, not resume the old run and report."""
    out, _, cmd = quickstart
    cmd = [arg for arg in cmd if arg != "15"]
    cmd[cmd.index("--max-epochs") + 1:cmd.index("--max-epochs") + 1] = ["14"]
    done = subprocess.run([*cmd, "--no-loco"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{out / 'run'} was made with max_epochs=15 (now 14): redoing it and every later stage" in done.stderr
    assert json.loads((out / "run" / "config.json").read_text())["max_epochs"] == 14
    assert json.loads(done.stdout)["held_out"] is None  # the report was redone without LOCO
    stamps = json.loads((out / "stages.json").read_text())
    assert stamps["run"]["max_epochs"] == stamps["report"]["max_epochs"] == 14 and stamps["report"]["loco"] is False
