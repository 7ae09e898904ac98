"""`train --exclude`, the refinement candidates and their choice by grouped cross-validation.

Synthetic traces (make_synthetic_traces): remaining rounds follow a geometric law whose log-mean is
linear in a latent difficulty that only the first-round hidden state sees, so a linear head on the
standardised state is the right model and must be found; prompt features cannot see it.
"""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import Ridge

from dwise_predict import metrics as M
from dwise_predict.cli import main
from dwise_predict.errors import ConfigError
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.survival.linear import (
    DEFAULT_ALPHAS, RidgeHead, SignalFeatureHead, _ridge_loo, _ridge_two_stage, blend, blend_heads,
)
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.traces import load_traces, write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces
from dwise_predict.training import Targets, TrainConfig, load_predictors, refine_inputs, train_run
from dwise_predict.training.fit import training_split
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.training.candidates import NAMES as CANDIDATES
from dwise_predict.training.select import LEVEL_BAND, grouped_folds
from dwise_predict.training.within_heads import BLEND_WEIGHTS, DEFAULT_BLEND_WEIGHT, choose_blend_weight

torch.set_num_threads(1)
FAST = dict(width=16, members=2, max_epochs=8, patience=3, bootstrap=20, num_threads=1)


def inputs(ds):
    return refine_inputs(ds)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "syn"
    write_traces(make_synthetic_traces(600, 24, difficulty_scale=1.2, seed=3), path)
    return path


# --- train --exclude ----------------------------------------------------------------------------


def test_exclude_trains_without_the_categories_and_records_them(traces, tmp_path, monkeypatch):
    import dwise_predict.training.run as run_module

    seen = {}
    real = run_module.fit_predictors

    def spy(train, config, progress=None, jobs=None, log=None):
        seen["categories"] = set(train.requests["category"])
        seen["n"] = len(train)
        return real(train, config, progress, jobs, log)

    monkeypatch.setattr(run_module, "fit_predictors", spy)
    ds = load_traces(traces)
    metrics = train_run(traces, tmp_path / "run", TrainConfig(**FAST, refine="ridge", exclude=("mcq", "code")))
    train = ds.split("train").requests
    assert "mcq" not in seen["categories"] and "code" not in seen["categories"]
    assert seen["categories"] == set(train["category"]) - {"mcq", "code"}
    assert metrics["n_train"] == seen["n"] == int((~train["category"].isin(["mcq", "code"])).sum())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["exclude"] == ["mcq", "code"]
    # the eval split keeps the excluded categories, reported as held out
    excluded = metrics["excluded"]
    assert excluded["categories"] == ["mcq", "code"]
    assert excluded["n_train_removed"] == int(train["category"].isin(["mcq", "code"]).sum())
    assert "mcq" in metrics["refined"]["per_category"]
    held = [metrics["refined"]["per_category"][c] for c in ("mcq", "code")]
    assert excluded["refined_within_category_held_out"] == pytest.approx(sum(held) / 2)
    # the hidden state still ranks an unseen category (a linear direction shared by all categories)
    assert excluded["refined_within_category_held_out"] > excluded["admission_within_category_held_out"] + 0.2
    # the recorded config retrains the same run
    again = train_run(traces, tmp_path / "again", TrainConfig.from_file(tmp_path / "run" / "config.json"))
    assert again == metrics


def test_exclude_errors_are_one_line(traces, tmp_path, capsys):
    with pytest.raises(ConfigError, match="no such category in the traces; known: chat, code"):
        train_run(traces, tmp_path / "r", TrainConfig(**FAST, exclude=("poetry",)))
    assert not (tmp_path / "r").exists()
    assert main(["train", str(traces), "--out", str(tmp_path / "r"), "--exclude", "poetry", "--exclude", "mcq"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--exclude poetry" in err[0] and "known:" in err[0]
    everything = ["--exclude", "chat", "--exclude", "instruction", "--exclude", "code", "--exclude", "math",
                  "--exclude", "multilingual_math", "--exclude", "mcq", "--exclude", "hard_mcq"]
    assert main(["train", str(traces), "--out", str(tmp_path / "r"), *everything, "--exclude", "long_context"]) == 1
    assert "leaves 0 training requests" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_exclude_is_repeatable_and_recorded(traces, tmp_path, capsys):
    args = ["train", str(traces), "--out", str(tmp_path / "run"), "--exclude", "mcq", "--exclude", "chat",
            "--refine", "ridge", "--max-epochs", "2", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["excluded"]["categories"] == ["mcq", "chat"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["exclude"] == ["mcq", "chat"]


# --- candidates -----------------------------------------------------------------------------------


def test_gelu_pair_is_exactly_linear_so_the_ridge_member_ranks_like_the_ridge():
    z = torch.linspace(-30, 30, 2001, dtype=torch.float64)
    assert torch.allclose(F.gelu(z) - F.gelu(-z), z, atol=1e-12)
    ds = make_synthetic_traces(500, 24, seed=5)
    train, ev = ds.split("train"), ds.split("eval")
    ridge = RidgeHead().fit(inputs(train), Targets.of(train).remaining)
    score = ridge.score(inputs(ev))
    raw = ridge.ensemble().predict_raw(inputs(ev))
    assert M.spearman(score, raw) == pytest.approx(1.0, abs=1e-9)
    assert np.all(np.diff(raw[np.argsort(score)]) >= 0)  # raw is increasing in the ridge score
    # raw = E[min(Geometric, K)] with mean exp(z): close to exp(score) below the truncation
    small = score < 2.0
    np.testing.assert_allclose(raw[small], np.exp(score[small]), rtol=2e-3)
    assert ridge.alpha_ in ridge.alphas and ridge.record()["loo_mse"] > 0


def test_ridge_recovers_the_hidden_difficulty():
    ds = make_synthetic_traces(3000, 32, seed=1)
    train, ev = ds.split("train"), ds.split("eval")
    ridge = RidgeHead().fit(inputs(train), Targets.of(train).remaining)
    remaining = Targets.of(ev).remaining
    rho = M.spearman(ridge.ensemble().predict_raw(inputs(ev)), remaining)
    oracle = M.spearman(ev.requests["oracle_remaining"], remaining)
    assert rho >= oracle - 0.03
    # inside a category the score orders requests by the latent difficulty (the rest is category base)
    within, _ = M.within_category(ridge.score(inputs(ev)), ev.requests["difficulty"], ev.requests["category"])
    assert within > 0.9


def test_the_registry_holds_every_candidate_once_in_the_order_they_are_tried():
    """The order is the choice's tie-break (the reference first); closed-form candidates calibrate on
    their out-of-fold estimates; the ridge-within ones have fits they need only to be chosen."""
    from dwise_predict.training.candidates import REGISTRY, Candidate, candidate

    assert CANDIDATES == ("survival", "ridge", "survival+ridge", "ridge-within", "survival-pca", "ridge-within+signals")
    assert [c.name for c in REGISTRY if c.closed_form] == ["ridge", "ridge-within", "ridge-within+signals"]
    assert [c.name for c in REGISTRY if type(c).needs_to_be_chosen is not Candidate.needs_to_be_chosen] == [
        "ridge-within", "ridge-within+signals"]
    assert candidate("survival-pca") is REGISTRY[4]
    with pytest.raises(ConfigError, match="no refinement candidate 'lasso'; known: survival, ridge, survival"):
        candidate("lasso")
    with pytest.raises(ConfigError, match=r"must be one of auto, survival, ridge, survival\+ridge, ridge-within, "
                                          r"survival-pca, ridge-within\+signals \(got 'lasso'\)"):
        TrainConfig(refine="lasso").check()


def test_grouped_folds_keep_prompts_whole_and_every_category_in_every_fold():
    ds = make_synthetic_traces(400, 8, seed=2)
    fold = grouped_folds(ds, 3, seed=0)
    assert set(fold) == {0, 1, 2}
    r = ds.requests.assign(fold=fold)
    assert (r.groupby("prompt")["fold"].nunique() == 1).all()
    assert (r.groupby("category")["fold"].nunique() == 3).all()
    np.testing.assert_array_equal(fold, grouped_folds(ds, 3, seed=0))


def test_auto_picks_the_best_cv_candidate_and_records_every_score(traces, tmp_path):
    metrics = train_run(traces, tmp_path / "run", TrainConfig(**FAST))
    run = tmp_path / "run"
    selection = json.loads((run / "candidates.json").read_text())
    assert selection["mode"] == "cv" and selection["folds"] == 3
    assert set(selection["candidates"]) == set(CANDIDATES)
    assert len(CANDIDATES) == 6 and "ridge-within+signals" in CANDIDATES
    overall = {c: s["cv_spearman"] for c, s in selection["candidates"].items()}
    within = {c: s["cv_within_category"] for c, s in selection["candidates"].items()}
    # the rule: level with the best overall rho (out of fold, calibrated), then the best within categories
    level = [c for c in CANDIDATES if overall[c] >= max(overall.values()) - LEVEL_BAND]
    assert selection["level_with_best"] == level
    assert selection["chosen"] == max(level, key=within.get)
    # an 8-epoch, width-16 ensemble cannot match a linear head on a linear problem
    assert selection["chosen"] != "survival" and overall[selection["chosen"]] > overall["survival"] + 0.05
    assert json.loads((run / "refine.json").read_text())["candidate"] == selection["chosen"]
    assert metrics["refine_candidate"] == selection["chosen"]
    assert "alpha" in selection["ridge"]
    ev = load_traces(traces).split("eval")
    remaining = Targets.of(ev).remaining
    oracle = M.spearman(ev.requests["oracle_remaining"], remaining)
    assert metrics["refined"]["spearman"] >= oracle - 0.08
    assert metrics["refined"]["within_category_mean"] > metrics["admission"]["within_category_mean"] + 0.3
    assert 0.85 <= metrics["calibration"]["median_ratio_calibrated"] <= 1.15
    # deterministic for a fixed seed
    train_run(traces, tmp_path / "again", TrainConfig(**FAST))
    for name in ("candidates.json", "refine.safetensors", "refine.json", "metrics.json", "calibration.json"):
        assert (run / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    # the run directory rebuilds the chosen candidate
    loaded = load_predictors(run)
    assert loaded.ensemble.candidate == selection["chosen"] and loaded.selection == selection


def test_well_trained_reference_can_win():
    """Selection is by score, not a preference for the linear heads: where remaining rounds grow with
    the square of the latent difficulty, no linear score on the hidden state (which holds z, not z²)
    can order them, and the survival MLP must win the CV against the ridge."""
    from dwise_predict.training.select import cross_validate

    ds = make_synthetic_traces(600, 16, seed=3)
    z = ds.requests["difficulty"].to_numpy()
    hazard = 1.0 / (1.0 + np.exp(1.0 + 1.2 * z**2))  # geometric law with log-mean 1 + 1.2 z², as the generator's
    remaining = np.minimum(np.random.default_rng(0).geometric(hazard) - 1, 255)
    # the CV reads only total_rounds (through Targets), the category and the prompt of the requests
    ds.requests = ds.requests.assign(total_rounds=remaining + 1, rounds_per_block=[[int(r) + 1] for r in remaining])
    # ~240 requests fit per fold: small batches so that 30 epochs are enough steps
    config = TrainConfig(width=32, members=1, max_epochs=30, patience=30, lr=1e-2, batch_size=32, cv_folds=2)
    # the ridge first: a tie, or a choice of the first candidate whatever the scores, would pick it
    out, _ = cross_validate(training_split(ds, Targets.of(ds), config), 2, candidates=("ridge", "survival"))
    scores = {c: s["cv_spearman"] for c, s in out["candidates"].items()}
    assert out["chosen"] == "survival" and out["level_with_best"] == ["survival"]
    assert abs(scores["ridge"]) < 0.15  # z and -z are equally long: a linear direction ranks at chance
    assert scores["survival"] > scores["ridge"] + 0.3


def test_cv_scores_and_choice_are_the_same_in_one_thread_and_in_two(traces):
    """``jobs`` only says where the fits run (every fit draws from generators of its own), in one,
    two or three threads."""
    from dwise_predict.training.select import cross_validate

    ds = load_traces(traces).split("train")
    config = TrainConfig(width=16, members=2, max_epochs=3, cv_folds=2)
    runs = [cross_validate(training_split(ds, Targets.of(ds), config), 2, jobs=jobs) for jobs in (1, 2, 3)]
    (one, one_oof) = runs[0]
    assert set(one["candidates"]) == set(CANDIDATES) and "blend_cv" in one
    for other, other_oof in runs[1:]:
        assert json.dumps(one, sort_keys=True) == json.dumps(other, sort_keys=True)
        for name in CANDIDATES:
            np.testing.assert_array_equal(one_oof[name], other_oof[name])


def test_cv_members_fits_the_network_candidates_folds_with_the_first_members_and_blends_as_shipped(traces, monkeypatch):
    """``cv_members`` = 2 of 3: each network candidate's fold fits are the first two seeds' members, the
    same members a 2-member run fits, and survival+ridge's fold blend still gives the ridge the one share
    in four it has in the shipped graph; the shipped ensemble keeps all three members. 0 (the default)
    is every member."""
    from dwise_predict.training import select

    ds = load_traces(traces).split("train")
    base = dict(width=16, max_epochs=3, cv_folds=2)
    fits = []
    real = SurvivalEnsemble.fit
    monkeypatch.setattr(SurvivalEnsemble, "fit", lambda self, *a, **k: fits.append(self.seeds) or real(self, *a, **k))
    trimmed, trimmed_oof = select.cross_validate(training_split(ds, Targets.of(ds), TrainConfig(members=3, cv_members=2, **base)), 2)
    assert fits == [(0, 1)] * 4 and trimmed["fold_members"] == 2  # survival and survival-pca, two folds each
    two, two_oof = select.cross_validate(training_split(ds, Targets.of(ds), TrainConfig(members=2, **base)), 2)
    assert two["fold_members"] == 2
    for name in ("survival", "survival-pca", "ridge"):
        np.testing.assert_array_equal(trimmed_oof[name], two_oof[name])
    np.testing.assert_allclose(trimmed_oof["survival+ridge"], (3 * two_oof["survival"] + two_oof["ridge"]) / 4)
    np.testing.assert_allclose(two_oof["survival+ridge"], (2 * two_oof["survival"] + two_oof["ridge"]) / 3)
    fits.clear()
    train_split = training_split(ds, Targets.of(ds), TrainConfig(members=3, **base))
    assert train_split.make_fold_ensemble().seeds == (0, 1, 2) and train_split.members == 3
    with pytest.raises(ConfigError, match=r"cv_members must be >= 0, 0 for all members \(got -1\)"):
        TrainConfig(cv_members=-1).check()


def test_skipping_the_refits_of_candidates_out_of_reach_changes_no_score_the_choice_reads(traces, monkeypatch):
    """The ridge-within heads' leave-one-category-out refits are made only for a candidate that can still
    be level with the best. Here both trail ridge by more than the band at every blend weight: the search
    skips the refits, and against the full search (every candidate a contender) the choice, every overall
    and within-category score and every out-of-fold estimate are the same, bar ridge-within+signals', which
    is scored at the default blend weight instead of the weight the refits would have chosen."""
    from unittest import mock

    from dwise_predict.training import select

    ds = load_traces(traces).split("train")
    split = training_split(ds, Targets.of(ds), TrainConfig(width=16, members=2, max_epochs=3, cv_folds=2))
    heads = mock.Mock(wraps=select.fold_heads)
    monkeypatch.setattr(select, "fold_heads", heads)
    pruned, pruned_oof = select.cross_validate(split, 2)
    assert pruned["out_of_reach"]["candidates"] == ["ridge-within", "ridge-within+signals"]
    # the ridge-within heads fitted without each grouped fold, and without no category
    assert [call.args[4] is split.fold for call in heads.call_args_list] == [True, True]
    monkeypatch.setattr(select, "contenders", lambda rest, cv, known: {c.name for c in rest})
    full, full_oof = select.cross_validate(split, 2)
    assert "out_of_reach" not in full and full["chosen"] == pruned["chosen"] == "ridge"
    assert full["level_with_best"] == pruned["level_with_best"] and full["reason"] == pruned["reason"]
    best = max(s["cv_spearman"] for s in full["candidates"].values())
    assert full["candidates"]["ridge-within+signals"]["cv_spearman"] < best - LEVEL_BAND
    for name in CANDIDATES[:5]:
        assert pruned["candidates"][name]["cv_spearman"] == full["candidates"][name]["cv_spearman"], name
        assert pruned["candidates"][name]["cv_within_category"] == full["candidates"][name]["cv_within_category"]
        np.testing.assert_array_equal(pruned_oof[name], full_oof[name])
    assert full["candidates"]["ridge-within"]["cv_held_out_category"] is not None
    assert pruned["candidates"]["ridge-within"]["cv_held_out_category"] is None
    assert pruned["blend_weight"] == DEFAULT_BLEND_WEIGHT and full["blend_cv"]["rule"]["best"] in BLEND_WEIGHTS
    for w in map(str, BLEND_WEIGHTS):  # each weight's grouped-CV score stays; its held-out one is not measured
        assert pruned["blend_cv"][w]["cv_within_category"] == full["blend_cv"][w]["cv_within_category"]
        assert pruned["blend_cv"][w]["cv_held_out_category"] is None


def test_linear_heads_out_of_fold_estimates_come_from_fits_without_the_fold(traces):
    """Each fold's estimates by ridge and ridge-within are those of a head fitted on the other folds
    alone, standardisation and penalties chosen there: the whole split's penalties saw the fold and
    lifted ridge-within's CV rho from 0.835 to 0.875 on the quickstart (docs/training.md, "Speed")."""
    from dwise_predict.training.select import cross_validate

    ds = load_traces(traces).split("train")
    split = training_split(ds, Targets.of(ds), TrainConfig(cv_folds=3))
    _, oof = cross_validate(split, 3, candidates=("ridge", "ridge-within"))
    for k in range(3):
        fit, val = split.rows(split.fold != k), split.inputs.rows(split.fold == k)
        ridge = RidgeHead().fit(fit.inputs, fit.remaining, fit.events)
        within = RidgeHead().fit(fit.inputs, fit.remaining, fit.events, groups=fit.categories)
        np.testing.assert_array_equal(oof["ridge"][split.fold == k], ridge.ensemble().predict_raw(val))
        np.testing.assert_array_equal(oof["ridge-within"][split.fold == k], within.ensemble().predict_raw(val))


def test_ridge_within_folds_draw_nothing_from_torchs_global_rng(traces):
    """Nothing in the CV's fits may draw from it (a draw in another thread would change what a
    survival member drew, a run-to-run difference seen before the closed-form members were built
    blank): here a ridge-within fold fit."""
    from dwise_predict.training.within_heads import head_scores

    ds = load_traces(traces).split("train")
    t, rows = Targets.of(ds), np.arange(len(ds)) % 3 != 0
    fit_in, val_in = (inputs(ds).rows(r) for r in (rows, ~rows))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    head_scores(fit_in, val_in, t.remaining[rows], t.events[rows], ds.requests["category"].to_numpy()[rows], 0)
    assert torch.equal(torch.get_rng_state(), before)


def test_an_error_beside_the_cv_thread_cancels_the_fits_queued_there():
    """An interrupt (or error) in the CV's own thread waits for the other thread's running fit only."""
    import threading
    import time

    from dwise_predict.training.select import _other_thread

    first_started, ran = threading.Event(), []

    def fit(i):
        ran.append(i)
        first_started.set()
        time.sleep(0.2)

    with pytest.raises(KeyboardInterrupt):
        with _other_thread(2) as pool:
            queued = [pool.submit(fit, i) for i in range(4)]
            first_started.wait(5)
            raise KeyboardInterrupt
    assert ran == [0] and queued[0].done() and all(f.cancelled() for f in queued[1:])
    with _other_thread(1) as pool:
        assert pool is None  # one job: every fit runs in the caller's thread


@pytest.mark.parametrize("candidate", ["ridge", "survival+ridge", "ridge-within", "survival-pca", "ridge-within+signals"])
def test_every_candidate_exports_under_contract_2_with_parity(traces, tmp_path, candidate, capsys):
    run, bundle = tmp_path / "run", tmp_path / "bundle"
    train_run(traces, run, TrainConfig(**FAST, refine=candidate))
    assert main(["export", str(run), "--out", str(bundle), "--name", "syn"]) == 0
    assert main(["verify", str(bundle)]) == 0
    capsys.readouterr()
    ev = load_traces(traces).split("eval")
    tokens, budget, signals = inputs(ev).prompt_tokens, inputs(ev).budget, inputs(ev).early_signals
    expected = load_predictors(run).refined_remaining(ev)
    session = ort.InferenceSession(str(bundle / "refine.onnx"))
    assert [i.name for i in session.get_inputs()] == ["first_round", "prompt_last", "prompt_tokens", "budget",
                                                      "early_signals"]
    assert [o.name for o in session.get_outputs()] == ["remaining_rounds"]
    onnx_out = session.run(None, {"first_round": ev.first_round, "prompt_last": ev.prompt_last, "prompt_tokens": tokens,
                                  "budget": budget, "early_signals": signals})[0]
    scripted = torch.jit.load(str(bundle / "refine.pt"))
    with torch.no_grad():
        ts_out = scripted(*map(lambda a: torch.from_numpy(np.array(a)),
                               (ev.first_round, ev.prompt_last, tokens, budget, signals))).numpy()
    np.testing.assert_allclose(onnx_out, expected, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(ts_out, expected, rtol=1e-3, atol=1e-3)
    assert M.spearman(onnx_out, expected) > 0.999
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["inputs"]["refine"]["candidate"] == candidate
    # A budget past the largest one trained on (these traces have one: 256) reads as that one. A server
    # sends whatever max_new_tokens it has (SGLang's OpenAI API: the context left when the client sets
    # none); unclamped, it met weights that no gradient reached while the budget column was constant.
    assert set(budget.tolist()) == {manifest["inputs"]["refine"]["budget_norm"]}
    feeds = {"first_round": ev.first_round, "prompt_last": ev.prompt_last, "prompt_tokens": tokens,
             "early_signals": signals}
    beyond = session.run(None, {**feeds, "budget": np.full_like(budget, 32768.0)})[0]
    np.testing.assert_array_equal(beyond, onnx_out)
    with torch.no_grad():
        ts_beyond = scripted(*map(lambda a: torch.from_numpy(np.array(a)),
                                  (ev.first_round, ev.prompt_last, tokens, np.full_like(budget, 32768.0), signals)))
    np.testing.assert_array_equal(ts_beyond.numpy(), ts_out)
    assert manifest["metrics"]["refine_candidate"] == candidate
    card = (bundle / "README.md").read_text()
    assert f"candidate: {candidate}" in card


def test_blend_is_one_graph_of_equal_width_members():
    ds = make_synthetic_traces(300, 16, seed=7)
    tr = ds.split("train")
    t = Targets.of(tr)
    ens = SurvivalEnsemble(width=16, seeds=(0, 1), max_epochs=3).fit(inputs(tr), t.remaining, t.events)
    ridge = RidgeHead().fit(inputs(tr), t.remaining, t.events, like=ens)
    both = blend(ens, ridge)
    assert both.spec()["members"] == 3 and both.spec()["width"] == 16 and both.candidate == "survival+ridge"
    ev = ds.split("eval")
    expected = (2 * ens.predict_raw(inputs(ev)) + ridge.ensemble().predict_raw(inputs(ev))) / 3
    np.testing.assert_allclose(both.predict_raw(inputs(ev)), expected, rtol=1e-5)
    with pytest.raises(Exception, match="like="):
        blend(ens, RidgeHead().fit(inputs(tr), t.remaining, t.events))


def test_config_rejects_unknown_refine_and_too_few_folds():
    with pytest.raises(ConfigError, match="`refine` must be one of auto.*cv_folds must be >= 2"):
        TrainConfig(refine="xgboost", cv_folds=1).check()
    assert TrainConfig.from_dict({"exclude": ["mcq"]}).exclude == ("mcq",)
    assert TrainConfig(exclude=["a", "b"]).to_dict()["exclude"] == ["a", "b"]


def test_ridge_within_transfers_to_a_held_out_category():
    ds = make_synthetic_traces(800, 32, difficulty_scale=1.0, seed=1)
    tr, ev = ds.split("train"), ds.split("eval")
    seen = tr.subset(tr.requests["category"].to_numpy() != "mcq")
    held = ev.subset(ev.requests["category"].to_numpy() == "mcq")
    t = Targets.of(seen)
    within = RidgeHead().fit(inputs(seen), t.remaining, t.events, groups=seen.requests["category"].to_numpy())
    plain = RidgeHead().fit(inputs(seen), t.remaining, t.events)
    truth = Targets.of(held).remaining
    rho_within = M.spearman(within.ensemble().predict_raw(inputs(held)), truth)
    rho_plain = M.spearman(plain.ensemble().predict_raw(inputs(held)), truth)
    assert rho_within > 0.6 and rho_within >= rho_plain - 0.05  # a category never seen in training
    assert within.ensemble().candidate == "ridge-within"
    assert set(within.record()["states"]) == {"first_round", "prompt_last"}  # one two-stage fit per state
    assert all(fit["cv_between"] == "leave-one-category-out" for fit in within.record()["states"].values())


def test_leave_one_category_out_penalty_is_what_refitting_without_each_category_gives():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 300))
    groups = rng.integers(0, 5, 120).astype(str)
    y = x[:, 0] + 2.0 * (groups == "1") + rng.normal(size=120)
    fitted, _, alpha, mse = _ridge_loo(x, y, DEFAULT_ALPHAS, groups=groups)
    refit = []  # scikit-learn's ridge refitted once per left-out category and penalty
    for a in DEFAULT_ALPHAS:
        error = 0.0
        for cat in np.unique(groups):
            seen = groups != cat
            reference = Ridge(alpha=a).fit(x[seen], y[seen])
            error += np.sum((y[~seen] - reference.predict(x[~seen])) ** 2)
        refit.append(error / len(y))
    assert alpha == DEFAULT_ALPHAS[int(np.argmin(refit))]
    assert mse == pytest.approx(min(refit), rel=1e-6)  # no refit: the block hat-matrix identity
    np.testing.assert_allclose(fitted, _ridge_loo(x, y, (alpha,))[0], rtol=1e-10)  # the fit itself is the same


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ridge_within_does_not_memorise_the_levels_of_the_categories_seen(seed):
    # twelve categories, each with its own mean input and level (unrelated to each other); inside every
    # category column 20 orders the requests. Eight are seen: with leave-one-out the second stage maps
    # the eight means to their levels, directions that only scramble the order inside the other four;
    # leaving a category out finds them useless there and shrinks the second stage
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(12), 40)
    x = rng.normal(0.0, 2.0, (12, 60))[groups] + rng.normal(size=(480, 60))
    y = rng.normal(0.0, 2.0, 12)[groups] + 0.5 * x[:, 20] + 0.3 * rng.normal(size=480)
    seen = groups < 8
    coef, _, record = _ridge_two_stage(x[seen], y[seen], groups[seen].astype(str), DEFAULT_ALPHAS)
    within = _ridge_two_stage_within(x[seen], y[seen], groups[seen])
    levels, _, alpha_loo, _ = _ridge_loo(x[seen], y[seen] - x[seen] @ within, DEFAULT_ALPHAS)
    # at least 100 times the penalty: four steps of the sqrt(10) grid (compared as grid steps: 100 x the
    # float alpha_loo can land a rounding error above the grid's own value four steps up)
    assert DEFAULT_ALPHAS.index(record["alpha_between"]) >= DEFAULT_ALPHAS.index(alpha_loo) + 4
    new = [groups == cat for cat in range(8, 12)]
    rho_group_cv = np.mean([M.spearman(x[rows] @ coef, y[rows]) for rows in new])
    rho_loo = np.mean([M.spearman(x[rows] @ (within + levels), y[rows]) for rows in new])
    assert rho_group_cv > 0.7 and rho_group_cv > rho_loo + 0.05


def _ridge_two_stage_within(x, y, groups):
    xc, yc = x.copy(), y.copy()
    for cat in np.unique(groups):
        xc[groups == cat] -= x[groups == cat].mean(axis=0)
        yc[groups == cat] -= y[groups == cat].mean()
    return _ridge_loo(xc, yc, DEFAULT_ALPHAS)[0]


def test_survival_pca_folds_the_projection_into_the_first_layer_exactly():
    from dwise_predict.survival.linear import fit_pca_survival

    ds = make_synthetic_traces(400, 48, seed=8)
    tr, ev = ds.split("train"), ds.split("eval")
    t = Targets.of(tr)
    make = lambda: SurvivalEnsemble(width=16, seeds=(0, 1), max_epochs=5, split_seed=0)  # noqa: E731
    folded = fit_pca_survival(make, inputs(tr), t.remaining, t.events, components=8)
    assert folded.candidate == "survival-pca" and folded.spec()["in_features"] == 2 * 48 + 2 + len(EARLY_SIGNALS)
    x = folded.standardise(inputs(ev)).double()
    z = (x @ folded.projection_).float().numpy()
    zeros = np.zeros(len(ev), np.float32)
    np.testing.assert_allclose(folded.predict_raw(inputs(ev)),
                               folded.inner_.predict_raw(RefineInputs(z, zeros, zeros, np.zeros((len(ev), 0), np.float32))),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, hidden, censored", [(160, 96, 0), (160, 96, 12), (300, 16, 0)])
def test_a_shared_standardisation_changes_no_number(n, hidden, censored, monkeypatch):
    """The cross-validation's fits of one fold share one Standardised (training.select): the survival
    ensemble, the ridge, ridge-within and survival-pca fitted through it give the same bits as each
    fitted alone, with more columns than requests (the Gram matrix of the requests) and fewer (of the
    columns), every request finished (the ridge takes survival-pca's decomposition) or some censored
    (it makes its own)."""
    from dwise_predict.survival import linear
    from dwise_predict.survival.linear import Standardised, fit_pca_survival

    tr = make_synthetic_traces(n, hidden, seed=9).split("train")
    t, cats = Targets.of(tr), tr.requests["category"].to_numpy()
    events = t.events.copy()
    events[:censored] = False
    x = inputs(tr)
    make = lambda: SurvivalEnsemble(width=8, seeds=(0,), max_epochs=3, split_seed=0)  # noqa: E731
    shared = Standardised(x, t.remaining, events)
    pca_shared = fit_pca_survival(make, x, t.remaining, events, components=8, standardised=shared)
    pca_alone = fit_pca_survival(make, x, t.remaining, events, components=8)
    assert torch.equal(pca_shared.projection_, pca_alone.projection_)
    assert torch.equal(pca_shared.members_[0].fc1.weight, pca_alone.members_[0].fc1.weight)
    survival_shared = make().fit(x, t.remaining, events, like=shared.base)
    survival_alone = make().fit(x, t.remaining, events)
    assert torch.equal(survival_shared.input_std_, survival_alone.input_std_)
    assert torch.equal(survival_shared.members_[0].fc1.weight, survival_alone.members_[0].fc1.weight)
    for groups in (None, cats):
        alone = RidgeHead().fit(x, t.remaining, events, groups=groups)
        through = RidgeHead().fit(x, t.remaining, events, groups=groups, standardised=shared)
        assert np.array_equal(through.coef_, alone.coef_) and through.intercept_ == alone.intercept_
        assert through.record() == alone.record()
    made = []
    real = linear._gram_eigh
    monkeypatch.setattr(linear, "_gram_eigh", lambda *a: made.append(1) or real(*a))
    RidgeHead().fit(x, t.remaining, events, standardised=shared)
    assert len(made) == (1 if censored else 0)  # all finished: survival-pca's decomposition is the ridge's


def _signal_traces(n=900, seed=4):
    """Synthetic traces whose work is visible only through an interaction of two early signals: the
    hidden state is replaced by noise, ``frac_over_threshold`` is a random sign and
    ``mean_confidence`` carries the latent difficulty's rank times that sign. Each signal alone, and
    any linear combination, ranks nothing; their product ranks everything."""
    ds = make_synthetic_traces(n, 16, seed=seed)
    rng = np.random.default_rng(seed)
    u = (np.argsort(np.argsort(ds.requests["difficulty"].to_numpy())) + 0.5) / n  # rank of z in (0, 1)
    sign = rng.choice([-1.0, 1.0], n)
    requests = ds.requests.assign(frac_over_threshold=(sign + 1) / 2, mean_confidence=0.5 + 0.5 * sign * u)
    noise = rng.standard_normal(ds.first_round.shape).astype(np.float32)
    return type(ds)(requests, noise, ds.prompt_last, ds.manifest)


def test_signal_features_learn_what_a_linear_head_cannot_and_cv_prefers_their_share():
    ds = _signal_traces()
    tr, ev = ds.split("train"), ds.split("eval")
    t, truth, cats = Targets.of(tr), ev.requests["difficulty"], ev.requests["category"]
    ridge = RidgeHead().fit(inputs(tr), t.remaining, t.events, groups=tr.requests["category"].to_numpy())
    features = SignalFeatureHead().fit(ridge.base_, inputs(tr), t.remaining, t.events)
    within_linear, _ = M.within_category(ridge.score(inputs(ev)), truth, cats)
    within_features, _ = M.within_category(features.score(inputs(ev)), truth, cats)
    assert abs(within_linear) < 0.2 and within_features > 0.7
    weight, scores, oof = choose_blend_weight(inputs(tr), t.remaining, t.events, tr.requests["category"].to_numpy(),
                                              grouped_folds(tr, 3, 0))
    assert set(scores) == {str(w) for w in BLEND_WEIGHTS} | {"rule"} and oof.shape == (len(tr),)
    held_out = {w: scores[str(w)]["cv_held_out_category"] for w in BLEND_WEIGHTS}
    assert held_out[min(BLEND_WEIGHTS)] > 0.3 and held_out[min(BLEND_WEIGHTS)] > held_out[max(BLEND_WEIGHTS)]  # transfers
    # CV ranks the feature head's largest share first; on the log scale the noise ridge moves the
    # blend's ranking little (a gain under one standard error), so the default weight is kept
    rule = scores["rule"]
    assert rule["best"] == min(BLEND_WEIGHTS) and 0 < rule["gain_over_default"] < rule["standard_error"]
    assert weight == DEFAULT_BLEND_WEIGHT


def test_a_candidate_within_reach_gets_the_refits_and_shares_them_with_one_out_of_reach():
    """Work only in an interaction of two early signals: ridge-within+signals comes within the band of
    ridge's overall rho at some blend weight, so the leave-one-category-out refits are made and its
    weight is chosen on them; ridge-within, far out of reach itself, is reported in full from the same
    refits."""
    from dwise_predict.training.select import cross_validate

    ds = _signal_traces().split("train")
    out, _ = cross_validate(training_split(ds, Targets.of(ds), TrainConfig(cv_folds=3)), 3,
                            candidates=("ridge", "ridge-within", "ridge-within+signals"))
    scores = out["candidates"]
    assert "out_of_reach" not in out and out["chosen"] == "ridge"
    assert scores["ridge-within"]["cv_spearman"] < scores["ridge"]["cv_spearman"] - 0.3
    assert scores["ridge-within+signals"]["cv_held_out_category"] > 0.3
    assert scores["ridge-within"]["cv_held_out_category"] is not None
    assert set(out["blend_cv"]) == {str(w) for w in BLEND_WEIGHTS} | {"rule"}


def test_blend_weight_stays_at_the_default_when_the_weights_differ_by_noise():
    """Work unrelated to every input: each weight's CV score is noise around 0, so whichever scores
    best does not clear one standard error over the default, which is kept."""
    ds = make_synthetic_traces(320, 16, seed=9)
    rng = np.random.default_rng(9)
    total = rng.integers(2, 60, len(ds))
    ds = type(ds)(ds.requests.assign(total_rounds=total, rounds_per_block=[[int(t)] for t in total]), ds.first_round,
                  ds.prompt_last, ds.manifest)
    tr = ds.split("train")
    t = Targets.of(tr)
    weight, scores, _ = choose_blend_weight(inputs(tr), t.remaining, t.events, tr.requests["category"].to_numpy(),
                                            grouped_folds(tr, 3, 0))
    assert weight == DEFAULT_BLEND_WEIGHT == 0.5
    assert scores["rule"]["gain_over_default"] <= scores["rule"]["standard_error"]


def test_blended_heads_are_one_member_that_ranks_exactly_like_the_blended_score():
    ds = make_synthetic_traces(400, 16, seed=6)
    tr, ev = ds.split("train"), ds.split("eval")
    t = Targets.of(tr)
    ridge = RidgeHead().fit(inputs(tr), t.remaining, t.events, groups=tr.requests["category"].to_numpy())
    features = SignalFeatureHead(width=64).fit(ridge.base_, inputs(tr), t.remaining, t.events)
    both = blend_heads(ridge, features, 0.4)
    assert both.spec()["members"] == 1 and both.candidate == "ridge-within+signals"
    # two units carry the ridge score; the bag's 8 x 64 random units read the short inputs only
    assert both.spec()["width"] == 2 and both.spec()["short_width"] == 8 * 64 == features.units
    assert both.spec()["short_features"] == 2 + len(EARLY_SIGNALS)
    score = 0.4 * ridge.score(inputs(ev)) + 0.6 * features.score(inputs(ev))
    raw = both.predict_raw(inputs(ev))
    assert M.spearman(score, raw) > 0.9999
    small = score < 2.0  # below the horizon the geometric law's mean is exp(z)
    np.testing.assert_allclose(raw[small], np.exp(score[small]), rtol=5e-3)
    with pytest.raises(Exception, match="one prepared ensemble"):
        blend_heads(RidgeHead().fit(inputs(tr), t.remaining, t.events), features, 0.4)


def test_blend_weight_leaves_the_default_when_one_weight_is_clearly_better():
    """Work in the hidden state, early signals pure noise: the more weight on the state's ridge the
    better, by several standard errors, so the rule takes the largest share."""
    ds = make_synthetic_traces(480, 16, seed=3)
    rng = np.random.default_rng(3)
    noise = {name: rng.random(len(ds)) for name in ("frac_over_threshold", "mean_confidence", "mean_entropy")}
    ds = type(ds)(ds.requests.assign(**noise), ds.first_round, ds.prompt_last, ds.manifest)
    tr = ds.split("train")
    t = Targets.of(tr)
    weight, scores, _ = choose_blend_weight(inputs(tr), t.remaining, t.events, tr.requests["category"].to_numpy(),
                                            grouped_folds(tr, 3, 0))
    assert weight == max(BLEND_WEIGHTS) == scores["rule"]["best"]
    assert scores["rule"]["gain_over_default"] > 2 * scores["rule"]["standard_error"]


def test_blend_weight_with_no_defined_score_keeps_the_default_and_records_json():
    """One category and constant work: no within-category ρ is defined anywhere; the rule keeps the
    default and its record is strict JSON (candidates.json refuses NaN)."""
    import json

    ds = make_synthetic_traces(120, 16, seed=2, categories={"chat": (2.8, 60, 1.0)})
    ds = type(ds)(ds.requests.assign(total_rounds=9, rounds_per_block=[[9]] * len(ds)), ds.first_round, ds.prompt_last,
                  ds.manifest)
    tr = ds.split("train")
    t = Targets.of(tr)
    weight, scores, _ = choose_blend_weight(inputs(tr), t.remaining, t.events, tr.requests["category"].to_numpy(),
                                            grouped_folds(tr, 3, 0))
    assert weight == DEFAULT_BLEND_WEIGHT and scores["rule"]["gain_over_default"] is None
    json.dumps(scores, allow_nan=False)
