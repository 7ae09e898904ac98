"""`dwise-predict simulate`: outputs on disk, the load sweep, and one-line refusals."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from dwise_predict.cli import main
from dwise_predict.traces import write_traces
from fakes.serving_bundle import served_bundle


@pytest.fixture(scope="module")
def traces_and_bundle(tmp_path_factory):
    bundle, traces = served_bundle()
    path = write_traces(traces, tmp_path_factory.mktemp("traces") / "tr")
    return path, bundle, traces


def test_simulate_writes_table_csv_json_and_plot(traces_and_bundle, tmp_path, capsys):
    traces, bundle, _ = traces_and_bundle
    out = tmp_path / "sim"
    profile = tmp_path / "gpu.json"
    profile.write_text(json.dumps({"source": "a test GPU", "base_ms": 20, "prefill_block_ms": 0.2, "decode_block_ms": 0.5}))
    assert main(["simulate", str(traces), "--bundle", str(bundle), "--slots", "8", "--out", str(out), "--json",
                 "--requests", "300", "--arrival-seeds", "2", "--round-profile", str(profile)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 26 and {r["arrival"] for r in rows} == {"burst", "burst-poisson"}
    assert {r["policy"] for r in rows} == {"sglang-default", "sglang-sync", "fcfs-mixed", "mlfq", "ssjf", "s3", "ltr", "trail",
                                           "dwise-zero", "dwise-admission", "dwise-raw", "dwise-refined", "dwise-oracle"}
    assert all(r["requests"] == 300 and r["round_cost_source"] == "a test GPU" and r["arrival_seeds"] == 2 for r in rows)
    assert all(r["mean_latency_s_lo"] <= r["mean_latency_s"] <= r["mean_latency_s_hi"] for r in rows)
    default = [r for r in rows if r["policy"] == "sglang-default"]
    assert all(r["speedup_vs_default"] == pytest.approx(1.0) for r in default)
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "simulate.csv").read_text().count("\n") == 27
    assert (out / "simulate_categories.png").is_file()
    html = (out / "report.html").read_text()
    assert "Scheduling simulation" in html and "a test GPU" in html and html.count("data:image/png;base64,") == 2
    assert "Where the gain comes from" in html and "mixed batching" in html
    saved = json.loads((out / "simulate.json").read_text())
    assert saved["rows"] == rows and saved["settings"]["slots"] == 8
    assert saved["settings"]["round_cost"]["source"] == "a test GPU" and saved["settings"]["requests"] == 300
    assert {c["category"] for c in saved["categories"]} and {c["policy"] for c in saved["categories"]} == {r["policy"] for r in rows}


def test_without_a_bundle_only_policies_that_need_none(traces_and_bundle, capsys):
    traces, _, _ = traces_and_bundle
    assert main(["simulate", str(traces), "--arrival", "burst", "--slots", "8", "--json", "--requests", "0"]) == 0
    policies = [r["policy"] for r in json.loads(capsys.readouterr().out)]
    assert policies == ["sglang-default", "sglang-sync", "fcfs-mixed", "mlfq", "trail", "dwise-zero", "dwise-oracle"]


def test_rate_sweep(traces_and_bundle, tmp_path, capsys):
    traces, _, _ = traces_and_bundle
    args = ["simulate", str(traces), "--rates", "0.25x,4x", "--policies", "sglang-default,dwise-oracle",
            "--slots", "8", "--out", str(tmp_path), "--json", "--requests", "0"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4 and (tmp_path / "sweep.png").is_file()
    by = {(r["policy"], r["rate_rps"]): r["mean_latency_s"] for r in rows}
    low, high = sorted({r["rate_rps"] for r in rows})
    assert by[("sglang-default", high)] > by[("sglang-default", low)]  # queueing grows with load


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--slots", "0"], "--slots (B) must be a positive integer, got 0"),
        (["--k", "0.5"], "--k must be at least 1"),
        (["--kv-budget", "10"], "--kv-budget 10 blocks cannot hold request"),
        (["--policies", "lifo"], "--policies: unknown lifo"),
        (["--policies", "dwise-refined"], "need predictions: pass --bundle"),
    ],
)
def test_bad_options_one_line_exit_1(traces_and_bundle, capsys, extra, message):
    traces, _, _ = traces_and_bundle
    assert main(["simulate", str(traces), *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bundle_for_another_model_is_refused(traces_and_bundle, tmp_path, capsys):
    _, bundle, traces = traces_and_bundle
    other = traces.subset(np.ones(len(traces), bool))
    other.manifest = {**traces.manifest, "model": {**traces.manifest["model"], "config_hash": "llada2-mini"}}
    path = write_traces(other, tmp_path / "other")
    assert main(["simulate", str(path), "--bundle", str(bundle)]) == 1
    err = capsys.readouterr().err.strip()
    assert "built for another model (model.config_hash = 'synthetic-0'" in err and len(err.splitlines()) == 1


def test_traces_without_prompt_blocks_are_refused(traces_and_bundle, tmp_path, capsys):
    traces, _, _ = traces_and_bundle
    copy = tmp_path / "tr"
    shutil.copytree(traces, copy)
    table = pd.read_parquet(copy / "requests.parquet").drop(columns=["prompt_blocks"])
    table.to_parquet(copy / "requests.parquet", index=False)
    assert main(["simulate", str(copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert "prompt_blocks" in err and len(err.splitlines()) == 1


def test_k_sweep_command(traces_and_bundle, tmp_path, capsys):
    traces, _, _ = traces_and_bundle
    args = ["simulate", str(traces), "--ks", "1,4", "--policies", "sglang-default,dwise-oracle", "--slots", "4",
            "--requests", "200", "--out", str(tmp_path), "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["k"], r["policy"]) for r in rows] == [(1, "sglang-default"), (1, "dwise-oracle"), (4, "sglang-default"), (4, "dwise-oracle")]
    oracle = {r["k"]: r for r in rows if r["policy"] == "dwise-oracle"}
    assert oracle[1]["cap_blocked_rounds_pct"] > oracle[4]["cap_blocked_rounds_pct"]
    assert (tmp_path / "k_sweep.png").is_file() and "Scheduling simulation" in (tmp_path / "report.html").read_text()
    assert main(["simulate", str(traces), "--ks", "0.5", "--rates", "1x"]) == 1
    err = capsys.readouterr().err
    assert "--ks and --rates conflict" in err and "--ks must be" in err


def test_raw_refinement_is_the_calibrated_one_before_its_isotonic_map(traces_and_bundle):
    from dwise_predict.bundles.load import load_bundle

    _, bundle_dir, traces = traces_and_bundle
    bundle = load_bundle(bundle_dir)
    h, last = traces.first_round[:32], traces.prompt_last[:32]
    pt = traces.requests["prompt_tokens"].to_numpy(np.float32)[:32]
    bu = traces.requests["budget"].to_numpy(np.float32)[:32]
    sig = traces.early_signals[:32]
    raw = bundle.refine_raw(h, last, pt, bu, sig)
    knots = json.loads((bundle_dir / "calibration.json").read_text())
    np.testing.assert_allclose(np.interp(raw, knots["x"], knots["y"]), bundle.refine(h, last, pt, bu, sig), rtol=1e-4,
                               atol=1e-3)


def test_serve_check_reports_every_problem_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """``serve --check`` resolves SGLang's arguments as the server will and reports every check at once:
    here a ``--hidden-size`` the model does not have and a ``k*B`` the scheduler cannot hold (each
    refused by itself at launch, in one line; today both went through to a crash after the model
    loaded), SGLang's scheduler surface, and what the hook would install once they are fixed. It
    starts nothing; ``--dry-run`` refuses the same arguments in one line."""
    import os
    import sys

    import sglang_reference

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    from dwise_predict.serving.plugin import engaged

    sglang = sglang_launch.entrypoints(monkeypatch)
    for name in [name for name in os.environ if engaged({name: ""})]:
        monkeypatch.delenv(name)  # serve's flags only: the plugin is not asked
    model = sglang.write_model(tmp_path / "sdar", hidden_size=64)  # SDAR: block 4
    hook = ["serve", "--record", str(tmp_path / "t"), "--slots", "64", "--k", "4"]
    server = ["--", "--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "128"]
    assert main([*hook, "--hidden-size", "32", "--check", *server]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["ok"] is False and report["surface"] == [] and report["plugin"] == {"asked": False}
    assert report["serve"]["hook"] is None and report["serve"]["problems"] == [
        "DWISE keeps up to k*B = 256 requests resident in each scheduler (--slots=64 x --k=4) but each scheduler "
        "holds 128 (--max-running-requests 128): pass --max-running-requests 256, or lower --slots or --k",
        f"--hidden-size=32 but the served model {model} has hidden size 64: leave --hidden-size out"]
    assert captured.err.count("problem: ") == 2
    assert main([*hook, "--hidden-size", "32", "--dry-run", *server]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: DWISE keeps up to k*B = 256") and len(err.splitlines()) == 1

    fixed = server[:-1] + ["256"]
    assert main([*hook, "--check", *fixed]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["serve"]["problems"] == []
    assert (report["serve"]["hook"]["block_size"], report["serve"]["hook"]["hidden_size"]) == (4, 64)
    assert report["serve"]["server"]["rows_per_scheduler"] == 256 and report["serve"]["server"]["block_size"] == 4
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.scheduler", None)  # SGLang's scheduler fails to import
    assert main([*hook, "--check", *fixed]) == 1
    surface, = json.loads(capsys.readouterr().out)["surface"]
    assert surface.startswith("SGLang's scheduler module does not import here (ModuleNotFoundError")
    assert not sglang.LAUNCHED
