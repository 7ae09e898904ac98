"""Survival pieces: label transform, logistic-hazard NLL, isotonic calibration, seed ensemble."""

import numpy as np
import pytest
import torch

from dwise_predict.errors import InputError
from dwise_predict.metrics import median_ratio, spearman
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.labels import RemainingRoundsLabels, informative
from dwise_predict.survival.loss import logistic_hazard_nll
from dwise_predict.survival.network import isotonic_interp

torch.set_num_threads(1)


def test_labels_events_censoring_and_k():
    labels = RemainingRoundsLabels().fit([0, 3, 5, 2])
    assert labels.out_features == 5
    idx, ev = labels.transform([0, 3, 5, 7, 4, 0], [1, 1, 1, 1, 0, 0])
    # finished below K: (T, 1); finished at/after K: (K-1, 0); censored after c rounds: (c-1, 0)
    assert idx.tolist() == [0, 3, 4, 4, 3, 0]
    assert ev.tolist() == [1, 1, 0, 0, 0, 0]
    assert informative([0, 3, 0], [1, 0, 0]).tolist() == [True, True, False]
    with pytest.raises(InputError, match="finite counts >= 0"):
        labels.transform([-1, 2])


def test_nll_equals_the_likelihood_written_out():
    logits = torch.tensor([[0.3, -1.0, 2.0], [0.5, 0.1, -0.2]])
    h = torch.sigmoid(logits)
    # request 0 finishes at index 2; request 1 survives through index 1
    expected0 = -(torch.log(1 - h[0, 0]) + torch.log(1 - h[0, 1]) + torch.log(h[0, 2]))
    expected1 = -(torch.log(1 - h[1, 0]) + torch.log(1 - h[1, 1]))
    loss = logistic_hazard_nll(logits, torch.tensor([2, 1]), torch.tensor([1.0, 0.0]), reduction="none")
    torch.testing.assert_close(loss, torch.stack([expected0, expected1]))
    mean = logistic_hazard_nll(logits, torch.tensor([2, 1]), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(mean, (expected0 + expected1) / 2)


def test_nll_shape_error_names_the_size_needed():
    with pytest.raises(ValueError, match=r"needs logits of shape \(batch, 8\)"):
        logistic_hazard_nll(torch.zeros(2, 5), torch.tensor([1, 7]), torch.ones(2))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        logistic_hazard_nll(torch.zeros(2, 5), torch.tensor([1, 2, 3]), torch.ones(3))


def test_calibrator_knots_interp_and_graph_parity():
    rng = np.random.default_rng(0)
    raw = rng.uniform(1, 50, 2000)
    actual = rng.geometric(1 / (1 + raw / 1.4)) - 1  # mean raw/1.4, right-skewed
    cal = IsotonicCalibrator().fit(raw, actual)
    assert (np.diff(cal.x_) > 0).all() and (np.diff(cal.y_) > 0).all()
    probe = np.concatenate([raw[:200], [-5.0, 0.0, 1e6]])
    np.testing.assert_array_equal(cal.predict(probe), np.interp(probe, cal.x_, cal.y_))
    assert cal.predict([-5.0])[0] == cal.y_[0] and cal.predict([1e6])[0] == cal.y_[-1]  # clipped
    torch_out = isotonic_interp(torch.tensor(probe, dtype=torch.float32), torch.tensor(cal.x_, dtype=torch.float32),
                                torch.tensor(cal.y_, dtype=torch.float32))
    np.testing.assert_allclose(torch_out.numpy(), cal.predict(probe), rtol=1e-5, atol=1e-4)
    # the median fit puts the median ratio at 1 and keeps the ranking of the raw estimate
    assert median_ratio(cal.predict(raw), actual) == pytest.approx(1.0, abs=0.03)
    inner = (raw > cal.x_[0]) & (raw < cal.x_[-1])
    assert spearman(cal.predict(raw[inner]), raw[inner]) == pytest.approx(1.0)
    # the mean fit (what sklearn's IsotonicRegression targets) leaves a skewed target off
    mean_fit = IsotonicCalibrator(statistic="mean").fit(raw, actual)
    assert median_ratio(mean_fit.predict(raw), actual) > 1.15
    from sklearn.isotonic import IsotonicRegression

    keep = actual > 0
    sk = IsotonicRegression(out_of_bounds="clip").fit(raw[keep], actual[keep])
    np.testing.assert_allclose(mean_fit.y_, np.unique(sk.y_thresholds_))  # same pooled blocks as sklearn
    again = IsotonicCalibrator.from_json(cal.to_json())
    np.testing.assert_array_equal(again.predict(probe), cal.predict(probe))


def test_calibrator_bad_inputs():
    with pytest.raises(InputError, match="NaN or inf"):
        IsotonicCalibrator().fit([1.0, np.nan], [1, 2])
    with pytest.raises(InputError, match="increasing 'x'"):
        IsotonicCalibrator.from_json({"x": [2.0, 1.0], "y": [1.0, 2.0]})
    with pytest.raises(InputError, match="equal-length"):
        IsotonicCalibrator.from_json({"x": [1.0], "y": []})


def _toy(n=800, h=16, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    hidden[:, 0] = z
    remaining = rng.geometric(1 / (1 + np.exp(2.0 + 0.8 * z))) - 1
    return hidden, np.full(n, 50.0), np.full(n, 256.0), remaining, z


def _no_signals(n):
    return np.zeros((n, 3), np.float32)  # constant early signals: the toy's work lives in hidden[:, 0]


def test_ensemble_learns_ranking_and_rebuilds_from_state():
    hidden, tokens, budget, remaining, z = _toy()
    ens = SurvivalEnsemble(width=32, seeds=(0, 1), max_epochs=40, patience=5, lr=3e-3).fit(
        hidden, tokens, budget, _no_signals(len(z)), remaining
    )
    assert ens.num_rounds_ == remaining.max() and len(ens.members_) == 2
    assert ens.input_std_[-4] == 1.0  # constant budget column left unscaled
    raw = ens.predict_raw(hidden, tokens, budget, _no_signals(len(z)))
    assert spearman(raw, z) > 0.75  # z is one of 16 input columns; the other 15 are noise
    surv = ens.predict_survival(hidden, tokens, budget, _no_signals(len(z)))
    assert surv.shape == (len(z), ens.num_rounds_)
    assert (np.diff(surv, axis=1) <= 1e-7).all()
    np.testing.assert_allclose(surv.sum(axis=1), raw, rtol=1e-4)  # E[T] = sum_t S(t), same graph
    rebuilt = SurvivalEnsemble.from_state(ens.state(), ens.spec())
    np.testing.assert_array_equal(rebuilt.predict_raw(hidden, tokens, budget, _no_signals(len(z))), raw)
    with pytest.raises(InputError, match="size 15 but the model was trained on 16"):
        ens.predict_raw(hidden[:, :15], tokens, budget, _no_signals(len(z)))


def test_ensemble_bad_inputs():
    hidden, tokens, budget, remaining, _ = _toy(40)
    with pytest.raises(InputError, match="40 hidden rows but 39 prompt lengths"):
        SurvivalEnsemble().fit(hidden, tokens[:39], budget, _no_signals(40), remaining)
    bad = hidden.copy()
    bad[3, 2] = np.inf
    with pytest.raises(InputError, match="hidden states hold NaN or inf"):
        SurvivalEnsemble().fit(bad, tokens, budget, _no_signals(40), remaining)
    with pytest.raises(InputError, match=r"early signals must have shape \(40, S\)"):
        SurvivalEnsemble().fit(hidden, tokens, budget, _no_signals(39), remaining)
