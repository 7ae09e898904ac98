"""`dwise-predict evaluate` end to end: files written, run directories checked, bad input in one line."""

import json

import numpy as np
import pandas as pd
import pytest

from dwise_predict.cli import main
from dwise_predict.traces import load_traces
from evaluate_helpers import fixed_config, make_traces, write


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcli")
    traces = write(make_traces(), root / "traces")
    config = root / "config.json"
    config.write_text(json.dumps(fixed_config().to_dict()))  # what is written, not which candidate wins
    return root, traces, config


@pytest.fixture(scope="module")
def evaluated(setup):
    root, traces, config = setup
    out = root / "eval"
    code = main(["evaluate", str(traces), "--out", str(out), "--config", str(config), "--hold-out", "mcq",
                 "--jobs", "1", "--json"])
    return code, out


def test_writes_every_file(evaluated, capsys):
    code, out = evaluated
    assert code == 0
    for name in ("metrics", "calibration", "baselines", "loco", "output_vs_work", "characterization", "evaluation"):
        assert json.loads((out / f"{name}.json").read_text()), name
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["traces"]["n_eval"] + evaluation["traces"]["n_train"] == 320
    assert [r["category"] for r in evaluation["loco"]["rows"]] == ["mcq"]  # --hold-out alone retrains once
    assert [r["predictor"] for r in evaluation["calibration"]] == ["admission only", "raw refinement",
                                                                    "calibrated refinement"]
    predictions = pd.read_parquet(out / "predictions.parquet")
    assert len(predictions) == evaluation["traces"]["n_eval"]
    assert (predictions["remaining_rounds"] == predictions["total_rounds"] - 1).all()


def test_report_is_self_contained(evaluated):
    _, out = evaluated
    html = (out / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # nothing fetched: opens offline
    # no survival_curves: the fixed config ships ridge, whose curves are geometric by construction
    plots = ["scatter_admission", "scatter_refined", "calibration", "loco", "baselines",
             "output_vs_rounds", "round_histograms"]
    assert html.count('<img src="data:image/png;base64,') == len(plots)
    md = (out / "report.md").read_text()
    linked = [line.split("](")[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert linked == [f"plots/{name}.png" for name in plots]
    for link in linked:
        png = (out / link).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for title in ("Summary", "Calibration", "Leave one category out", "Baselines", "Output length versus work"):
        assert f"## {title}" in md
    assert "Over all requests with mcq held out: admission ρ" in md
    assert "No survival curves: the shipped refinement candidate, ridge, is a linear score" in md
    # the Workload section's early-signal directions; these synthetic signals reverse nowhere
    assert "**Early signals against total rounds: Spearman ρ [95 % interval] inside each category**" in md
    assert "No signal reverses its direction between categories here." in md
    assert "Inputs whose direction inside a category depends" not in md


def test_run_directory_gives_the_run_metrics(setup, tmp_path, capsys):
    from dwise_predict.training import train_run

    root, traces, _ = setup
    run = tmp_path / "run"
    run_metrics = train_run(traces, run, fixed_config())
    out = tmp_path / "eval"
    assert main(["evaluate", str(traces), "--run", str(run), "--out", str(out), "--jobs", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["run"] == str(run)
    assert result["metrics"]["refined"]["spearman"] == pytest.approx(run_metrics["refined"]["spearman"])
    assert result["metrics"]["admission"]["spearman"] == pytest.approx(run_metrics["admission"]["spearman"])
    assert result["loco"] is None


def test_run_from_other_traces_is_one_line(setup, tmp_path, capsys):
    from dwise_predict.training import train_run

    root, traces, _ = setup
    run = tmp_path / "run"
    train_run(write(make_traces(seed=7), tmp_path / "other"), run, fixed_config())
    assert main(["evaluate", str(traces), "--run", str(run), "--out", str(tmp_path / "eval")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: run {run} was trained on {tmp_path / 'other'}")
    assert "not on these traces" in err[0]
    assert not (tmp_path / "eval" / "report.html").exists()


def test_traces_of_two_models_are_one_line(setup, tmp_path, capsys):
    root, traces, _ = setup
    other = make_traces(seed=5)
    other.manifest["model"] = {**other.manifest["model"], "name": "another-dllm", "config_hash": "x"}
    other_dir = write(other, tmp_path / "other")
    for command in (["evaluate", str(traces), str(other_dir), "--out", str(tmp_path / "e")],
                    ["characterize", str(traces), str(other_dir)]):
        assert main(command) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert "come from different models" in err[0] and "another-dllm" in err[0]
    # the same weights under another name (and directory) are one model: pooled, as the store merges them
    renamed = make_traces(seed=5)
    renamed.manifest["model"] = {**load_traces(traces).manifest["model"], "name": "my-copy", "path": "/elsewhere"}
    assert main(["characterize", str(traces), str(write(renamed, tmp_path / "renamed"))]) == 0
    capsys.readouterr()


def test_bad_options_are_reported_together(setup, tmp_path, capsys):
    root, traces, _ = setup
    assert main(["evaluate", str(traces), "--out", str(tmp_path / "e"), "--jobs", "0", "--min-requests", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--jobs must be at least 1" in err and "--min-requests must be at least 2" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"epochs": 3}))
    assert main(["evaluate", str(traces), "--out", str(tmp_path / "e"), "--config", str(bad)]) == 1
    assert "unknown training options epochs" in capsys.readouterr().err


def test_no_eval_split_is_one_line(tmp_path, capsys):
    ds = make_traces(n_requests=80)
    ds.requests["split"] = "train"
    traces = write(ds, tmp_path / "t")
    assert main(["evaluate", str(traces), "--out", str(tmp_path / "e")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0 evaluation requests" in err[0]


def test_several_trace_directories_are_pooled(tmp_path, capsys):
    from dwise_predict.evaluation.inputs import concat, load_many

    ds = make_traces()
    first = np.arange(len(ds)) < 150
    a, b = write(ds.subset(first), tmp_path / "a"), write(ds.subset(~first), tmp_path / "b")
    pooled = concat(load_many([a, b]))
    assert pooled.data_hash() == ds.data_hash()  # the same requests and hidden states, in order
    # the same collection given twice: request ids clash, one line
    assert main(["evaluate", str(a), str(a), "--out", str(tmp_path / "e")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "appears twice" in err[0]


def test_censored_requests_are_left_out_of_the_rank_tables(tmp_path):
    from dwise_predict.evaluation.evaluate import evaluate

    ds = make_traces()
    censored = (ds.requests["split"] == "eval").to_numpy() & (np.arange(len(ds)) % 5 == 0)
    ds.requests["censored"] = censored  # collection cut short: rounds are a lower bound only
    result = evaluate([write(ds, tmp_path / "t")], jobs=1, config=fixed_config()).result
    n_eval = int((ds.requests["split"] == "eval").sum())
    assert result["traces"]["n_eval"] == n_eval
    assert result["traces"]["n_eval_finished"] == n_eval - int(censored.sum())
    ensemble = next(r for r in result["baselines"] if r["name"] == "refinement predictor (shipped)")
    assert ensemble["spearman"] == pytest.approx(result["metrics"]["refined"]["spearman"])  # same requests


@pytest.mark.parametrize("candidate, drawn, words", [
    ("survival", True, "Ensemble survival curves, of evaluation requests"),
    ("survival-pca", True, "Ensemble survival curves"),
    ("survival+ridge", True, "one ridge member whose own curve is geometric by construction"),
    ("ridge", False, "its survival is geometric by construction"),
    ("ridge-within+signals", False, "not a fitted distribution"),
])
def test_survival_curves_are_drawn_only_where_they_were_fitted(candidate, drawn, words):
    """The report's survival figure is for a candidate whose curves are a fitted model; a linear
    candidate's are a geometric law by construction, so a sentence says so instead."""
    from dwise_predict.evaluation.document import Figure
    from dwise_predict.evaluation.report import _survival_block

    curves = np.cumprod(np.full((2, 8), 0.8), axis=1)
    block = _survival_block({"curves": curves, "true": np.array([3.0, 5.0]), "labels": ["a", "b"]}, candidate)
    assert isinstance(block, Figure) == drawn
    assert words in (block.caption if drawn else block)
