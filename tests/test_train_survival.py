"""Survival pieces: label transform, logistic-hazard NLL, isotonic calibration, seed ensemble."""

import numpy as np
import pytest
import torch

from dwise_predict.errors import InputError
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.metrics import median_ratio, spearman
from dwise_predict.survival.calibration import TILT, IsotonicCalibrator, _pool_adjacent_violators
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.inputs import RefineInputs
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
    _, values = _pool_adjacent_violators(raw[keep], actual[keep], np.mean)
    np.testing.assert_allclose(values, np.unique(sk.y_thresholds_))  # same pooled blocks as sklearn
    # every knot lies within TILT of its block's value: the map is the fit's steps, tilted by a hair
    assert np.abs(mean_fit.y_ - values[np.searchsorted(values, mean_fit.y_ - TILT - 1e-9)]).max() <= TILT + 1e-9
    again = IsotonicCalibrator.from_json(cal.to_json())
    np.testing.assert_array_equal(again.predict(probe), cal.predict(probe))


def test_median_isotonic_blocks_are_the_pooled_medians_written_out():
    """The L1 fit by hand: y = 1, 5, 2, 2, 9, 8 on x = 1..6 pools {5, 2} (median 3.5), then {5, 2, 2}
    (median 2), then {9, 8} (median 8.5, the middle pair's mean); equal x start in one block. On
    random sets the blocks are those of PAVA with ``np.median`` of each pooled block."""
    blocks, values = _pool_adjacent_violators(np.arange(1.0, 7.0), np.array([1.0, 5, 2, 2, 9, 8]), np.median)
    assert values.tolist() == [1.0, 2.0, 8.5] and [b.tolist() for b in blocks] == [[1.0], [2.0, 3.0, 4.0], [5.0, 6.0]]
    _, tied = _pool_adjacent_violators(np.array([1.0, 1, 1, 2]), np.array([7.0, 1, 4, 3]), np.median)
    assert tied.tolist() == [3.5]  # x = 1 starts as {1, 4, 7} (median 4), then pools with {3}
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 300):
        x, y = np.round(rng.normal(size=n), 1), rng.integers(0, 20, n).astype(float)
        blocks, values = _pool_adjacent_violators(x, y, np.median)
        order = np.lexsort((y, x))
        pooled = np.split(y[order], np.cumsum([len(b) for b in blocks])[:-1])
        np.testing.assert_array_equal(values, [np.median(b) for b in pooled])
        assert (np.diff(values) > 0).all() and np.array_equal(np.concatenate(blocks), x[order])


def test_members_draw_from_their_own_generator_what_the_global_rng_gave():
    """A member's initialisation and dropout come from a generator seeded with its seed: the numbers
    ``torch.manual_seed(seed)`` gave ``nn.Linear`` and ``nn.Dropout`` from the global RNG (so the
    members are those of before), the global RNG is left alone, and members fitted in two threads
    at once are the ones fitted one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    from dwise_predict.survival.network import HazardMLP

    torch.manual_seed(7)
    old = HazardMLP(12, 9, 16, 0.25)
    x = torch.randn(32, 12)
    torch.manual_seed(11)
    expected = old.train()(x)
    draws = torch.Generator().manual_seed(7)
    new = HazardMLP.drawn(12, 9, 16, 0.25, generator=draws)
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    torch.testing.assert_close(new.train().forward_drawn(x, draws.manual_seed(11)), expected, rtol=0, atol=0)
    assert torch.equal(new.eval().forward_drawn(x, draws), new(x))  # no dropout in eval mode
    hidden, tokens, budget, remaining, _ = _toy(300)
    inputs = RefineInputs(hidden, tokens, budget, _no_signals(300))
    fit = lambda: SurvivalEnsemble(width=16, seeds=(0, 1), max_epochs=4).fit(inputs, remaining)  # noqa: E731
    before = torch.get_rng_state()
    alone = fit()
    assert torch.equal(torch.get_rng_state(), before)
    with ThreadPoolExecutor(2) as pool:
        together = [f.result() for f in [pool.submit(fit) for _ in range(2)]]
    for ensemble in together:
        np.testing.assert_array_equal(ensemble.predict_raw(inputs), alone.predict_raw(inputs))


def test_calibrator_extended_over_the_raw_range_keeps_every_order():
    """With ``raw_range`` the map runs from (0, 0) to the range's end at slope 1 past the last fitted
    knot: no two raw estimates in the range share a calibrated value, and the fitted knots are kept."""
    rng = np.random.default_rng(1)
    raw = rng.uniform(5, 30, 500)
    actual = np.maximum(1, np.round(raw * 0.8 + rng.normal(0, 2, 500)))
    plain = IsotonicCalibrator().fit(raw, actual)
    wide = IsotonicCalibrator().fit(raw, actual, raw_range=(0.0, 64.0))
    np.testing.assert_array_equal(wide.x_[1:-1], plain.x_)
    np.testing.assert_array_equal(wide.y_[1:-1], plain.y_)
    assert (wide.x_[0], wide.y_[0]) == (0.0, 0.0)
    assert wide.x_[-1] == 64.0 and wide.y_[-1] == pytest.approx(plain.y_[-1] + 64.0 - plain.x_[-1])
    beyond = np.array([0.5, 2.0, 4.0, 40.0, 50.0, 63.5])  # outside the fitted knots, inside the range
    assert len(np.unique(plain.predict(beyond))) == 2  # the plain fit ties each side
    assert (np.diff(wide.predict(beyond)) > 0).all()
    inner = (raw >= plain.x_[0]) & (raw <= plain.x_[-1])
    np.testing.assert_array_equal(wide.predict(raw[inner]), plain.predict(raw[inner]))  # unchanged between them
    assert IsotonicCalibrator.from_json(wide.to_json()).predict([63.5])[0] == wide.predict([63.5])[0]


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
    return np.zeros((n, 4), np.float32)  # constant early signals: the toy's work lives in hidden[:, 0]


def test_ensemble_learns_ranking_and_rebuilds_from_state():
    hidden, tokens, budget, remaining, z = _toy()
    inputs = RefineInputs(hidden, tokens, budget, _no_signals(len(z)))
    ens = SurvivalEnsemble(width=32, seeds=(0, 1), max_epochs=40, patience=5, lr=3e-3).fit(inputs, remaining)
    assert ens.num_rounds_ == remaining.max() and len(ens.members_) == 2
    assert ens.input_std_[-4] == 1.0  # constant budget column left unscaled
    raw = ens.predict_raw(inputs)
    assert spearman(raw, z) > 0.75  # z is one of 16 input columns; the other 15 are noise
    surv = ens.predict_survival(inputs)
    assert surv.shape == (len(z), ens.num_rounds_)
    assert (np.diff(surv, axis=1) <= 1e-7).all()
    np.testing.assert_allclose(surv.sum(axis=1), raw, rtol=1e-4)  # E[T] = sum_t S(t), same graph
    rebuilt = SurvivalEnsemble.from_state(ens.state(), ens.spec())
    np.testing.assert_array_equal(rebuilt.predict_raw(inputs), raw)
    with pytest.raises(InputError, match="size 14 but the model was trained on 16"):
        ens.predict_raw(RefineInputs(hidden[:, :14], tokens, budget, _no_signals(len(z))))
    with pytest.raises(InputError, match=r"\(N, 2H\) \(first_round and prompt_last side by side\), got \(800, 15\)"):
        RefineInputs(hidden[:, :15], tokens, budget, _no_signals(len(z)))
    with pytest.raises(InputError, match="3 early signals per request but the model was trained on 4"):
        ens.predict_raw(RefineInputs(hidden, tokens, budget, _no_signals(len(z))[:, :3]))


def test_refine_inputs_are_checked_once_when_made():
    hidden, tokens, budget, remaining, _ = _toy(40)
    with pytest.raises(InputError, match="40 hidden rows but 39 prompt lengths"):
        RefineInputs(hidden, tokens[:39], budget, _no_signals(40))
    bad = hidden.copy()
    bad[3, 2] = np.inf
    with pytest.raises(InputError, match="hidden states hold NaN or inf"):
        RefineInputs(bad, tokens, budget, _no_signals(40))
    with pytest.raises(InputError, match=r"early signals must have shape \(40, S\)"):
        RefineInputs(hidden, tokens, budget, _no_signals(39))
    with pytest.raises(InputError, match="40 hidden rows but 39 remaining-round counts"):
        SurvivalEnsemble().fit(RefineInputs(hidden, tokens, budget, _no_signals(40)), remaining[:39])
    inputs = RefineInputs(hidden.astype(np.float64), tokens, budget, _no_signals(40))
    assert inputs.hidden.dtype == inputs.prompt_tokens.dtype == inputs.early_signals.dtype == np.float32
    assert len(inputs) == 40 and inputs.hidden_size == 16 and inputs.signal_count == 4
    part = inputs.rows(np.arange(40) < 10)
    np.testing.assert_array_equal(part.hidden, hidden[:10])
    np.testing.assert_array_equal(part.budget, budget[:10])


def test_the_ensemble_and_the_training_config_share_their_defaults():
    """One default per knob: what ``train`` passes (TrainConfig) is what SurvivalEnsemble() assumes."""
    import inspect

    from dwise_predict.training import TrainConfig

    config, parameters = TrainConfig(), inspect.signature(SurvivalEnsemble).parameters
    shared = ("width", "dropout", "max_epochs", "patience", "lr", "weight_decay", "batch_size", "val_fraction")
    assert {k: parameters[k].default for k in shared} == {k: getattr(config, k) for k in shared}
    assert parameters["weight_decay"].default == 1e-4


def test_prompts_far_longer_than_any_in_training_keep_their_order():
    """Work that grows with prompt length, trained on prompts of 5-40 tokens: requests with 100-400
    tokens (a category never seen, as the tiny model's long-context prompts held out) must come out
    of the exported graph in the order of their length, not all at one value. On a linear length
    scale they sat ~35 deviations out and the ridge score saturated float32 survival at K."""
    from dwise_predict.survival.linear import RidgeHead

    rng = np.random.default_rng(0)
    n = 400
    tokens = rng.integers(5, 41, n).astype(np.float32)
    hidden = rng.standard_normal((n, 16)).astype(np.float32)
    remaining = np.maximum(0, np.round(2 + 0.5 * tokens + rng.normal(0, 1, n))).astype(np.int64)
    budget = np.full(n, 256.0, np.float32)
    inputs = RefineInputs(hidden, tokens, budget, _no_signals(n))
    ridge = RidgeHead().fit(inputs, remaining)
    ensemble = ridge.ensemble()
    raw = ensemble.predict_raw(inputs)
    calibrator = IsotonicCalibrator().fit(raw, remaining, raw_range=(0.0, float(ensemble.num_rounds_)))
    graph = ensemble.graph(calibrator.to_json())
    long = torch.arange(100.0, 401.0, 25.0)  # (13,) prompt lengths never seen
    h = torch.as_tensor(rng.standard_normal((len(long), 16)), dtype=torch.float32)
    with torch.no_grad():
        inputs = (h[:, :8], h[:, 8:], long, torch.full_like(long, 256.0), torch.zeros(len(long), len(EARLY_SIGNALS)))
        raw_long, out = graph.raw(*inputs), graph(*inputs)
    assert (raw_long < ensemble.num_rounds_ - 1e-3).all()  # not saturated at the horizon
    assert spearman(out.numpy(), long.numpy()) > 0.95 and len(np.unique(out.numpy())) == len(long)
    assert (out > calibrator.predict(raw.max())).all()  # longer than anything in training, as it should be


def test_fused_adam_writes_torchs_fused_adam_bits_without_importing_dynamo():
    """``survival.adam.FusedAdam`` is ``torch.optim.Adam(fused=True)``'s update, bit for bit, over 40
    steps of a member with dropout and weight decay; and a whole ensemble fit in a fresh process never
    imports ``torch._dynamo`` (which ``torch.optim`` imports on its first call: 1.3 s of CPU)."""
    import subprocess
    import sys

    from dwise_predict.survival.adam import FusedAdam
    from dwise_predict.survival.network import HazardMLP

    x, y = torch.randn(96, 20, generator=torch.Generator().manual_seed(0)), torch.rand(96, 7)

    def trained(make_optimiser):
        draws = torch.Generator().manual_seed(3)
        net = HazardMLP.drawn(20, 7, 16, 0.2, generator=draws).train()
        opt = make_optimiser(net.parameters())
        for _ in range(40):
            loss = ((net.forward_drawn(x, draws) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return list(net.state_dict().values())

    ours = trained(lambda params: FusedAdam(params, lr=1e-2, weight_decay=1e-3))
    torchs = trained(lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3, fused=True))
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    assert not all(torch.equal(a, b) for a, b in zip(ours, trained(lambda params: FusedAdam(params, lr=2e-2))))
    fit = ("import sys, numpy as np\n"
           "from dwise_predict.survival.ensemble import SurvivalEnsemble\n"
           "from dwise_predict.survival.inputs import RefineInputs\n"
           "rng = np.random.default_rng(0)\n"
           "inputs = RefineInputs(rng.normal(size=(64, 8)).astype(np.float32), np.full(64, 5, np.float32),\n"
           "                      np.full(64, 9, np.float32), np.zeros((64, 0), np.float32))\n"
           "SurvivalEnsemble(width=8, seeds=(0,), max_epochs=2).fit(inputs, rng.integers(0, 6, 64))\n"
           "print('torch._dynamo' in sys.modules)\n")
    assert subprocess.run([sys.executable, "-c", fit], capture_output=True, text=True, check=True).stdout == "False\n"
