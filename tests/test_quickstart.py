"""The README's first command at reduced size: every artifact exists, the bundle verifies, a rerun resumes.

The command runs in this process through the CLI's ``main`` (what the console script calls): a fresh
interpreter would only add its start-up, which test_cli covers (``python -m dwise_predict.cli``).
"""

import json

import pytest

from dwise_predict.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs")
    args = ["quickstart", "--out", str(out), "--limit", "96", "--max-epochs", "15", "--jobs", "1", "--json"]
    assert main(args) == 0
    return out, json.loads((out / "summary.json").read_text()), args


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
    # the simulated gain comes with what it assumed (B, k and a round cost with no profile behind it)
    assert summary["simulated"] == {"slots": 16, "k": 4, "round_ms": 50.0, "slot_ms": 0.35,
                                    "round_cost": "the default, no profile"}
    # the bundle passed `verify_bundle` (what `dwise-predict verify` runs: hashes, then both graphs
    # against the run in a fresh process); a failure stops the quickstart with exit code 1
    assert summary["verified"] is True
    # the refined predictor sees the first round: on the tiny dLLM it must rank requests
    assert summary["refined_rho"] > 0.3


def test_the_report_carries_the_scheduling_section(quickstart):
    """The page the README says to open holds the simulation beside the evaluation: its heading after
    the evaluation's sections, the speed-up naming what it assumed, the plots inline, the tables."""
    out, summary, _ = quickstart
    html = (out / "report" / "report.html").read_text()
    assert html.index("<h2>Workload</h2>") < html.index("<h2>Scheduling simulation</h2>")
    scheduling = html[html.index("<h2>Scheduling simulation</h2>"):]
    burst = summary["speedup_vs_sglang_default"]["burst"]
    assert (f"Simulated mean-latency speed-up of DWISE (refined) over SGLang&#x27;s default: {burst:.2f}x "
            "(burst arrivals, B = 16, k = 4.0, round cost: the default, no profile)") in scheduling
    assert (f"{summary['n_eval']} requests, B = 16, k = 4.0, round cost from: the default, no profile "
            "(base 50.000 ms, prefill block 0.350 ms, decode block 0.350 ms).") in scheduling
    assert scheduling.count("data:image/png;base64,") == 2  # latency per scheduler, per-category p99
    assert scheduling.count("<h2>") == 1 and html.count("<h2>Scheduling simulation</h2>") == 1
    md = (out / "report" / "report.md").read_text()
    scheduling_md = md[md.index("## Scheduling simulation"):]
    assert "**Schedulers on the replayed requests" in scheduling_md
    assert "| arrival | scheduler | mean s |" in scheduling_md
    assert "| burst | dwise-refined |" in scheduling_md and "| burst-poisson | sglang-default |" in scheduling_md
    assert "![simulate](plots/simulate.png)" in scheduling_md
    assert (out / "report" / "plots" / "simulate.png").read_bytes() == (out / "simulate" / "simulate.png").read_bytes()


def test_rerun_resumes_and_reports_the_same(quickstart, capsys):
    out, summary, args = quickstart
    before = (out / "run" / "metrics.json").stat().st_mtime_ns
    report = (out / "report" / "report.html").read_text(), (out / "report" / "report.md").read_text()
    capsys.readouterr()
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["refined_rho"] == summary["refined_rho"]
    assert (out / "run" / "metrics.json").stat().st_mtime_ns == before  # training was not redone
    # the resumed evaluation's report gets the scheduling section again, in place of the first run's
    assert ((out / "report" / "report.html").read_text(), (out / "report" / "report.md").read_text()) == report


def test_rerun_with_other_options_redoes_the_stages_they_change(quickstart, capsys):
    """Last in this module: it replaces the fixture's run. The first run trained 15 epochs with LOCO;
    asking for 14 without LOCO must retrain and re-evaluate, not resume the old run and report."""
    out, _, args = quickstart
    args = [arg for arg in args if arg != "15"]
    args[args.index("--max-epochs") + 1:args.index("--max-epochs") + 1] = ["14"]
    capsys.readouterr()
    assert main([*args, "--no-loco"]) == 0
    done = capsys.readouterr()
    assert f"{out / 'run'} was made with max_epochs=15 (now 14): redoing it and every later stage" in done.err
    assert json.loads((out / "run" / "config.json").read_text())["max_epochs"] == 14
    assert json.loads(done.out)["held_out"] is None  # the report was redone without LOCO
    stamps = json.loads((out / "stages.json").read_text())
    assert stamps["run"]["max_epochs"] == stamps["report"]["max_epochs"] == 14 and stamps["report"]["loco"] is False
