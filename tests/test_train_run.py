"""Training end to end: known answer on synthetic traces, run directory, determinism, bad input."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dwise_predict.cli import main
from dwise_predict.errors import ConfigError, StoreError, TraceError
from dwise_predict import metrics as M
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.survival.network import build_refine_graph
from dwise_predict.training import (
    Targets,
    TrainConfig,
    evaluate_predictors,
    fit_predictors,
    load_predictors,
    train_run,
)
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces
from dwise_predict.versions import PACKAGE_ROOT, source_fingerprint

torch.set_num_threads(1)
# the reference refinement predictor (the paper's survival ensemble); tests/test_train_select.py covers "auto"
FAST = dict(width=16, members=2, max_epochs=6, patience=3, bootstrap=50, num_threads=1, refine="survival")
RUN_FILES = {"config.json", "metrics.json", "admission.txt", "admission.json", "refine.safetensors", "refine.json",
             "calibration.json", "candidates.json", "curves.json", "curves.png"}


def test_known_answer_refined_tracks_oracle_and_calibration_fixes_the_ratio():
    # 3,000 training and 9,000 eval requests: the median ratio on the eval split is then precise to ~2%
    ds = make_synthetic_traces(12000, 64, eval_fraction=0.75, seed=1)
    train, eval_ds = ds.split("train"), ds.split("eval")
    predictors = fit_predictors(train, TrainConfig(width=64, num_threads=1, refine="survival"))
    metrics = evaluate_predictors(predictors, eval_ds, bootstrap=0)
    remaining = Targets.of(eval_ds).remaining
    oracle = M.spearman(eval_ds.requests["oracle_remaining"], remaining)
    assert metrics["refined"]["spearman"] >= oracle - 0.05
    assert metrics["refined"]["spearman"] > metrics["admission"]["spearman"] + 0.2  # prompt features miss z
    assert 0.95 <= metrics["calibration"]["median_ratio_calibrated"] <= 1.05
    assert metrics["calibration"]["median_ratio_raw"] > 1.2  # the mean of a geometric law sits above its median
    # isotonic calibration keeps the ranking
    assert metrics["refined"]["spearman"] == pytest.approx(metrics["refined_raw"]["spearman"], abs=0.005)
    assert metrics["refined"]["concordance_td"] > 0.65
    assert 0.0 < metrics["refined"]["integrated_brier"] < 0.25


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "syn"
    write_traces(make_synthetic_traces(400, 8, seed=2), path)
    return path


def test_run_directory_layout_and_reload(small, tmp_path):
    metrics = train_run(small, tmp_path / "run", TrainConfig(**FAST))
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} == RUN_FILES
    assert json.loads((run / "metrics.json").read_text()) == metrics
    assert set(metrics) == {"n_train", "n_eval", "refine_candidate", "admission", "refined", "refined_raw", "calibration"}
    assert metrics["refine_candidate"] == "survival"
    assert json.loads((run / "candidates.json").read_text()) == {"mode": "fixed", "candidates": {}, "chosen": "survival"}
    config = json.loads((run / "config.json").read_text())
    assert config["seeds"] == [0, 1] and config["traces"]["hidden_size"] == 8
    assert len(config["traces"]["fingerprint"]) == 64 and "torch" in config["versions"]
    assert config["versions"]["dwise-predict source"] == source_fingerprint()
    spec = json.loads((run / "refine.json").read_text())
    weights = load_file(str(run / "refine.safetensors"))
    assert weights["member1.fc2.weight"].shape == (spec["num_rounds"], 16)
    assert weights["input_mean"].shape == (2 * 8 + 2 + len(EARLY_SIGNALS),)  # two states, prompt tokens, budget, signals
    assert spec["hidden_size"] == 8 and spec["hidden_states"] == ["first_round", "prompt_last"]
    curves = json.loads((run / "curves.json").read_text())["members"]
    assert [len(c["val_loss"]) >= c["best_epoch"] + 1 for c in curves] == [True, True]

    # the run directory rebuilds the same predictions, graph included
    from dwise_predict.traces import load_traces

    ds = load_traces(small)
    eval_ds = ds.split("eval")
    loaded = load_predictors(run)
    graph = build_refine_graph(weights, spec, json.loads((run / "calibration.json").read_text()))
    tokens = torch.tensor(eval_ds.requests["prompt_tokens"].to_numpy(np.float32))
    budget = torch.tensor(eval_ds.requests["budget"].to_numpy(np.float32))
    with torch.no_grad():
        out = graph(torch.from_numpy(eval_ds.first_round), torch.from_numpy(eval_ds.prompt_last), tokens, budget,
                    torch.from_numpy(eval_ds.early_signals)).numpy()
    np.testing.assert_allclose(out, loaded.refined_remaining(eval_ds), rtol=1e-4)  # float32 graph vs float64
    assert evaluate_predictors(loaded, eval_ds, bootstrap=50) == metrics


def test_source_fingerprint_follows_the_code_not_the_bytecode(tmp_path):
    copy = tmp_path / "dwise_predict"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("weights"))
    assert source_fingerprint(copy) == source_fingerprint()
    (copy / "stray.pyc").write_bytes(b"\0")
    assert source_fingerprint.__wrapped__(copy) == source_fingerprint()  # uncached: the .pyc is seen and ignored
    edited = tmp_path / "edited"
    shutil.copytree(copy, edited)
    (edited / "quickstart.py").write_text((edited / "quickstart.py").read_text() + "\n# one line more\n")
    assert source_fingerprint(edited) != source_fingerprint()


def test_same_seed_same_bytes(small, tmp_path):
    for name in ("a", "b"):
        train_run(small, tmp_path / name, TrainConfig(**FAST))
    for f in sorted(RUN_FILES - {"curves.png", "config.json"}):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    train_run(small, tmp_path / "c", TrainConfig(**{**FAST, "seed": 1}))
    assert (tmp_path / "a" / "refine.safetensors").read_bytes() != (tmp_path / "c" / "refine.safetensors").read_bytes()


def test_censored_requests_change_the_fit_not_the_contract():
    """A censored request ran at least its recorded rounds: the survival loss counts those rounds as
    survived, where reading them as finished would pull the estimates down (the classic bias of
    dropping censoring)."""
    ds = make_synthetic_traces(300, 8, seed=4)
    rng = np.random.default_rng(4)
    censored = rng.uniform(size=len(ds)) < 0.4
    total = ds.requests["total_rounds"].to_numpy()
    # collection cut short: a censored request is seen for a uniform share of its rounds
    seen = np.where(censored, 1 + (rng.uniform(size=len(ds)) * (total - 1)).astype(int), total)
    blocks = [[int(s)] if c else list(b) for s, c, b in zip(seen, censored, ds.requests["rounds_per_block"])]
    ds.requests = ds.requests.assign(total_rounds=seen, rounds_per_block=blocks, censored=censored)
    train, ev = ds.split("train"), ds.split("eval")
    np.testing.assert_array_equal(Targets.of(train).events, ~train.requests["censored"].to_numpy())
    # small batches and a larger step: FAST's few steps leave the hazards near their initial value
    config = TrainConfig(**{**FAST, "batch_size": 32, "lr": 1e-2, "max_epochs": 20, "patience": 20})
    aware = fit_predictors(train, config)
    as_finished = fit_predictors(replace(train, requests=train.requests.drop(columns="censored")), config)
    ratio = aware.refined_raw(ev) / as_finished.refined_raw(ev)
    assert np.median(ratio) > 1.2  # 1.35 when written
    metrics = evaluate_predictors(aware, ev, bootstrap=0)
    assert metrics["refined"]["concordance_td"] > 0.55  # 0.63 when written, over censored rows too
    assert metrics["n_eval"] == len(ev)


def test_bad_inputs_raise_typed_errors(small, tmp_path):
    ds = make_synthetic_traces(200, 8, seed=5)
    no_eval = ds.subset(ds.requests["split"].to_numpy() == "train")
    with pytest.raises(TraceError, match="no 'eval' split"):
        train_run(no_eval, tmp_path / "r1", TrainConfig(**FAST))
    assert not (tmp_path / "r1").exists()
    with pytest.raises(TraceError, match="at least 8 requests"):
        fit_predictors(ds.subset(np.arange(len(ds)) < 5), TrainConfig(**FAST))
    with pytest.raises(ConfigError, match="width must be >= 1.*val_fraction"):
        TrainConfig(width=0, val_fraction=1.5).check()
    with pytest.raises(ConfigError, match="unknown training options hidden"):
        TrainConfig.from_dict({"hidden": 3})
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # a folder that is not a run is never replaced
        with pytest.raises(StoreError, match="is not a run directory.*never replaced"):
            train_run(small, tmp_path / "taken", TrainConfig(**FAST), overwrite=overwrite)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_failed_train_leaves_nothing_that_looks_complete(small, tmp_path, monkeypatch):
    import dwise_predict.training.run as training

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "_plot_curves", boom)  # dies halfway through writing the run
    with pytest.raises(KeyboardInterrupt):
        train_run(small, tmp_path / "run", TrainConfig(**FAST))
    assert list(tmp_path.iterdir()) == []  # no run dir, no temporary left behind
    monkeypatch.undo()
    train_run(small, tmp_path / "run", TrainConfig(**FAST))  # rerunning just works
    assert {p.name for p in (tmp_path / "run").iterdir()} == RUN_FILES


def test_cli_train_and_one_line_errors(small, tmp_path, capsys):
    args = ["train", str(small), "--out", str(tmp_path / "run"), "--max-epochs", "4", "--members", "2",
            "--width", "16", "--threads", "1", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_eval"] == json.loads((tmp_path / "run" / "metrics.json").read_text())["n_eval"]
    assert main(args) == 1  # exists
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "already exists" in err[0]
    (tmp_path / "broken").mkdir()
    assert main(["train", str(tmp_path / "broken"), "--out", str(tmp_path / "r2")]) == 1
    assert "has no manifest.json" in capsys.readouterr().err
    assert main(["train", str(small), "--out", str(tmp_path / "r3"), "--max-epochs", "0"]) == 1
    assert "max_epochs must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "r3").exists()
    # a run's config.json retrains the same run; flags next to --config are rejected
    config = str(tmp_path / "run" / "config.json")
    assert main(["train", str(small), "--out", str(tmp_path / "r4"), "--config", config, "--seed", "3"]) == 1
    assert "drop --seed" in capsys.readouterr().err
    assert main(["train", str(small), "--out", str(tmp_path / "r4"), "--config", config, "--json"]) == 0
    capsys.readouterr()
    same = ("refine.safetensors", "metrics.json", "admission.txt")
    assert all((tmp_path / "run" / f).read_bytes() == (tmp_path / "r4" / f).read_bytes() for f in same)


def test_cli_missing_column_and_hidden_mismatch(tmp_path, capsys):
    import pandas as pd
    from safetensors.numpy import save_file

    path = tmp_path / "t"
    write_traces(make_synthetic_traces(100, 8, seed=6), path)
    requests = pd.read_parquet(path / "requests.parquet")
    requests.drop(columns=["newlines"]).to_parquet(path / "requests.parquet")
    assert main(["train", str(path), "--out", str(tmp_path / "r")]) == 1
    assert "lack columns newlines" in capsys.readouterr().err
    requests.to_parquet(path / "requests.parquet")
    save_file({"first_round": np.zeros((99, 8), np.float32), "prompt_last": np.zeros((99, 8), np.float32)},
              str(path / "hidden.safetensors"))
    assert main(["train", str(path), "--out", str(tmp_path / "r")]) == 1
    assert "table has 100 rows" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_train_rejects_zero_jobs_in_one_line(tmp_path, capsys):
    small = write_traces(make_synthetic_traces(40, 4, seed=7), tmp_path / "t")
    assert main(["train", str(small), "--out", str(tmp_path / "r"), "--jobs", "0"]) == 1
    err = capsys.readouterr().err
    assert "--jobs must be at least 1, got 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_cli_compare_regressors_writes_tables(tmp_path, capsys):
    small = write_traces(make_synthetic_traces(100, 4, seed=7), tmp_path / "t")
    assert main(["compare-regressors", str(small), "--out", str(tmp_path / "cmp"), "--folds", "2", "--repeats", "2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 8 and "whitespace" in result["tokenisation"]
    assert (tmp_path / "cmp" / "regressors.csv").read_text().splitlines()[0].startswith("name,rho")
    assert "LightGBM (100, 15 leaves)" in (tmp_path / "cmp" / "regressors.md").read_text()
    assert main(["compare-regressors", str(small), "--folds", "1"]) == 1
    assert "--folds must be at least 2" in capsys.readouterr().err
