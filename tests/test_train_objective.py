"""The refinement candidate is chosen on the scheduler's objective and its calibration holds after the choice.

Two synthetic sets with a known law (``make_synthetic_traces``: discrete Weibull remaining rounds whose
level is the category's base level plus the hidden difficulty), with parameters no other test uses:

- *levels*: the categories' levels carry most of the work (``level_scale=2``), a little of it inside
  them (``difficulty_scale=0.8``). A head that learns only the order inside categories ranks them
  well there and all requests badly: what the old criterion (within-category ρ alone) picked.
- *inside*: the difficulty inside the categories carries most of it (``level_scale=0.4``), with a
  hazard that rises with the rounds done (``hazard_shape=4``: the rounds gather around their median),
  and enough requests (1,500 evaluated) that the evaluation sample's own spread stays well inside
  the bound: a calibration off by more than 2 % shows.
"""

import json

import numpy as np
import pytest
import torch

from dwise_predict import metrics as M
from dwise_predict.evaluation.report import candidates_section
from dwise_predict.traces import load_traces, write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces
from dwise_predict.training import Targets, TrainConfig, load_predictors, refine_inputs, train_run
from dwise_predict.training.candidates import NAMES as CANDIDATES, REGISTRY
from dwise_predict.training.fit import torch_threads, training_split
from dwise_predict.training.select import LEVEL_BAND

CLOSED_FORM = [c.name for c in REGISTRY if c.closed_form]

torch.set_num_threads(1)
FAST = dict(width=16, members=2, max_epochs=8, patience=3, bootstrap=0, num_threads=1)
CRITERIA = ("cv_spearman", "cv_spearman_raw", "cv_within_category", "cv_per_category", "cv_held_out_category",
            "cv_held_out_per_category")


def _trained(tmp_path_factory, name, **synthetic):
    path = tmp_path_factory.mktemp(name)
    write_traces(make_synthetic_traces(**synthetic), path / "traces")
    train_run(path / "traces", path / "run", TrainConfig(**FAST))
    return path


@pytest.fixture(scope="module")
def levels(tmp_path_factory):
    return _trained(tmp_path_factory, "levels", n_requests=1500, hidden_size=24, level_scale=2.0,
                    difficulty_scale=0.8, hazard_shape=2.0, seed=1)


@pytest.fixture(scope="module")
def inside(tmp_path_factory):
    return _trained(tmp_path_factory, "inside", n_requests=3000, hidden_size=16, level_scale=0.4,
                    difficulty_scale=1.0, hazard_shape=4.0, eval_fraction=0.5, seed=2)


def _eval_rho_of_every_candidate(path) -> dict[str, tuple[float, float]]:
    """Each candidate fitted on the whole train split as ``train`` fits the chosen one: (overall ρ,
    within-category ρ) of its estimates on the eval split (calibration is monotone: raw ranks the same)."""
    ds = load_traces(path / "traces")
    train, ev = ds.split("train"), ds.split("eval")
    config, selection = TrainConfig(**FAST), json.loads((path / "run" / "candidates.json").read_text())
    split, remaining = training_split(train, Targets.of(train), config), Targets.of(ev).remaining
    categories = ev.requests["category"].to_numpy()
    out = {}
    with torch_threads(1):
        for candidate in REGISTRY:
            ensemble, _ = candidate.fit(split, blend_weight=selection.get("blend_weight"))
            raw = ensemble.predict_raw(refine_inputs(ev))
            out[candidate.name] = (M.spearman(raw, remaining), M.within_category(raw, remaining, categories)[0])
    return out


def test_where_levels_carry_the_work_the_shipped_predictor_ranks_all_requests_as_the_best_candidate(levels):
    metrics = json.loads((levels / "run" / "metrics.json").read_text())
    selection = json.loads((levels / "run" / "candidates.json").read_text())
    on_eval = _eval_rho_of_every_candidate(levels)
    best = max(rho for rho, _ in on_eval.values())
    assert metrics["refined"]["spearman"] >= best - 0.01
    assert on_eval[selection["chosen"]][0] == pytest.approx(metrics["refined"]["spearman"], abs=1e-6)
    # the set separates the criteria: the candidate that orders requests inside their categories best
    # out of fold (what within-category rho alone chose) ranks all of them far worse
    within_cv = {c: s["cv_within_category"] for c, s in selection["candidates"].items()}
    by_within = max(within_cv, key=within_cv.get)
    assert by_within != selection["chosen"] and on_eval[by_within][0] < best - 0.1


def test_candidates_json_records_every_criterion_for_every_candidate_and_why_the_winner_won(levels):
    selection = json.loads((levels / "run" / "candidates.json").read_text())
    assert selection["mode"] == "cv" and set(selection["candidates"]) == set(CANDIDATES)
    # the levels carry the work: the ridge-within heads rank all requests far below the best, so their
    # leave-one-category-out refits, made only to report them or choose the blend weight, were skipped
    overall = {c: s["cv_spearman"] for c, s in selection["candidates"].items()}
    skipped = selection["out_of_reach"]["candidates"]
    assert skipped == ["ridge-within", "ridge-within+signals"] and "level_band" in selection["out_of_reach"]["note"]
    assert all(overall[c] < max(overall.values()) - LEVEL_BAND - 0.1 for c in skipped)
    assert selection["blend_weight"] == 0.5 and selection["blend_cv"]["rule"]["best"] is None
    for name, scores in selection["candidates"].items():
        assert set(CRITERIA) <= set(scores), name
        assert -1 <= scores["cv_spearman"] <= 1 and -1 <= scores["cv_within_category"] <= 1
        # held out: measured for the closed-form heads that can be chosen, one value per category; not
        # for the networks
        held = scores["cv_held_out_category"]
        assert (held is not None) == (name in CLOSED_FORM and name not in skipped), name
        if held is not None:
            assert set(scores["cv_held_out_per_category"]) == set(scores["cv_per_category"])
    within = {c: s["cv_within_category"] for c, s in selection["candidates"].items()}
    level = [c for c in CANDIDATES if overall[c] >= max(overall.values()) - LEVEL_BAND]
    assert selection["level_with_best"] == level and selection["chosen"] == max(level, key=within.get)
    reason = selection["reason"]
    assert reason.startswith(selection["chosen"]) and f"{overall[selection['chosen']]:.3f}" in reason
    assert "overall Spearman rho" in selection["criterion"] and selection["level_band"] == LEVEL_BAND
    assert "leave-one-category-out" in selection["held_out"]
    # the evaluation report shows the same criteria and the reason
    section = candidates_section(selection)
    rows = {row[0].removesuffix(" (shipped)"): row for row in section.blocks[0].rows}
    assert set(rows) == set(CANDIDATES) and rows[selection["chosen"]][0].endswith("(shipped)")
    assert all(rows[c][1] == f"{overall[c]:.3f}" for c in CANDIDATES) and section.text == reason + "."


@pytest.mark.parametrize("which", ["levels", "inside"])
def test_calibration_holds_on_the_eval_split_and_never_ranks_worse_than_the_raw_estimate(which, request):
    path = request.getfixturevalue(which)
    predictors = load_predictors(path / "run")
    ev = load_traces(path / "traces").split("eval")
    remaining, categories = Targets.of(ev).remaining, ev.requests["category"].to_numpy()
    raw = predictors.refined_raw(ev)
    calibrated = predictors.refined_remaining(ev)
    assert 0.98 <= M.median_ratio(calibrated, remaining) <= 1.02
    # strictly increasing: no two requests the raw estimate orders are tied, so rho is the raw one's
    assert len(np.unique(calibrated)) == len(np.unique(raw))
    assert M.spearman(calibrated, remaining) >= M.spearman(raw, remaining) - 1e-12
    assert M.within_category(calibrated, remaining, categories)[0] >= (
        M.within_category(raw, remaining, categories)[0] - 1e-12)
    calibration = json.loads((path / "run" / "calibration.json").read_text())
    chosen = json.loads((path / "run" / "candidates.json").read_text())["chosen"]
    assert calibration["fitted_on"] == ("train, out of fold" if chosen in CLOSED_FORM else "train")
