"""Metrics against hand-computed values, scipy and pycox (the survival metrics)."""

import numpy as np
import pandas as pd
import pytest
from pycox import utils
from pycox.evaluation import EvalSurv, ipcw
from scipy import stats

from dwise_predict import metrics as M


def test_spearman_kendall_match_scipy_and_hand_values():
    pred, true = [1, 2, 3, 4], [10, 20, 40, 30]
    # ranks differ in one swapped pair: rho = 1 - 6 * 2 / (4 * 15) = 0.8; tau = (5 - 1) / 6
    assert M.spearman(pred, true) == pytest.approx(0.8)
    assert M.kendall(pred, true) == pytest.approx(4 / 6)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 50), rng.normal(size=50)  # ties on one side
    assert M.spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)
    assert M.kendall(a, b) == pytest.approx(stats.kendalltau(a, b).statistic)


def test_spearman_is_scipys_statistic_to_the_bit():
    # metrics.spearman ranks and correlates as scipy.stats.spearmanr does, without its wrapper: every
    # figure the project reports must keep its bits (ties on either side, both, none; n from 2 up)
    rng = np.random.default_rng(1)
    for n in (2, 3, 7, 50, 513):
        for _ in range(40):
            a = rng.integers(0, 4, n) if rng.random() < 0.5 else rng.normal(size=n)
            b = rng.integers(0, 6, n) * 0.5 if rng.random() < 0.5 else rng.lognormal(size=n)
            if np.ptp(a) > 0 and np.ptp(b) > 0:
                assert M.spearman(a, b) == float(stats.spearmanr(a, b).statistic)


def test_larger_estimate_means_more_work():
    true = np.array([1, 5, 9, 20])
    assert M.spearman(true * 2.0, true) == pytest.approx(1.0)
    assert M.spearman(-true, true) == pytest.approx(-1.0)


def test_constant_side_is_none():
    assert M.spearman([1, 1, 1], [1, 2, 3]) is None
    assert M.kendall([1, 2, 3], [4, 4, 4]) is None
    assert M.spearman([1], [2]) is None
    assert M.bootstrap_ci([1, 1, 1], [1, 2, 3]) is None


def test_within_category_mean_and_na():
    pred = [1, 2, 3, 1, 2, 3, 5, 5]
    true = [1, 2, 3, 3, 2, 1, 1, 2]
    cats = ["a", "a", "a", "b", "b", "b", "c", "c"]
    mean, per = M.within_category(pred, true, cats)
    assert per == {"a": pytest.approx(1.0), "b": pytest.approx(-1.0), "c": None}
    assert mean == pytest.approx(0.0)  # the n/a category does not count


def test_bootstrap_ci_brackets_rho_and_is_seeded():
    rng = np.random.default_rng(1)
    true = rng.normal(size=300)
    pred = true + rng.normal(size=300)
    lo, hi = M.bootstrap_ci(pred, true, n_boot=500, seed=3)
    assert lo < M.spearman(pred, true) < hi
    assert 0.05 < hi - lo < 0.3
    assert M.bootstrap_ci(pred, true, n_boot=500, seed=3) == (lo, hi)
    # brute force: scipy on the same resamples
    idx = np.random.default_rng(3).integers(0, 300, size=(500, 300))
    rhos = [stats.spearmanr(pred[i], true[i]).statistic for i in idx]
    assert (lo, hi) == pytest.approx(tuple(np.quantile(rhos, [0.025, 0.975])))
    assert M.bootstrap_ci(pred, true, n_boot=0) is None  # no resamples: no interval (bootstrap 0 in a config)
    assert M.within_category_ci(pred, true, np.repeat(["a", "b"], 150), n_boot=0) is None


def test_bootstrap_mean_ci_is_the_percentile_interval_of_resampled_means():
    values = np.array([3.0, 5.0, 4.0, 10.0, 6.0])
    lo, hi = M.bootstrap_mean_ci(values, n_boot=2000, seed=7)
    idx = np.random.default_rng(7).integers(0, 5, size=(2000, 5))  # brute force on the same resamples
    assert (lo, hi) == tuple(np.percentile(values[idx].mean(axis=1), [2.5, 97.5]))
    assert 3.0 < lo < values.mean() < hi < 10.0
    assert M.bootstrap_mean_ci([4.0]) == (4.0, 4.0)  # one arrival seed: no spread to resample


def test_median_ratio_and_r2():
    assert M.median_ratio([2, 4, 6, 100], [1, 4, 3, 0]) == pytest.approx(2.0)  # ratios 2, 1, 2; actual 0 skipped
    assert M.median_ratio([1, 2], [0, 0]) is None
    true = np.array([1.0, 2.0, 3.0, 4.0])
    assert M.r2(true, true) == 1.0
    assert M.r2(np.full(4, true.mean()), true) == pytest.approx(0.0)
    assert M.r2([1, 2, 3, 5], true) == pytest.approx(1 - 1 / 5)


# --- survival metrics against pycox 0.3.0's EvalSurv ----------------------------------------------


def _random_case(seed, n=40, k=12):
    """(N, K) survival curves that cross and tie (rounded), durations with ties and some beyond the
    grid, and ~30% censored."""
    rng = np.random.default_rng(seed)
    surv = np.round(np.cumprod(1 - rng.uniform(0.05, 0.5, size=(n, k)), axis=1), 2)
    t = rng.integers(0, k + 2, n).astype(float)
    d = (rng.uniform(size=n) < 0.7).astype(np.int64)
    return surv, t, d


def _eval_surv(surv, t, d):
    """pycox's evaluator of our curves (its frame is grid times x requests), its censoring curve the
    Kaplan-Meier fit of ``M.brier_scores``: pycox's own, started before time 0 so that G(0-) = 1 as
    in Graf et al. (``censor_surv="km"`` starts at the first duration, and a request finishing at 0
    rounds would be weighted by G(0))."""
    km = utils.kaplan_meier(t, 1 - d, start_duration=-1)
    censor = pd.DataFrame(np.repeat(km.to_numpy()[:, None], len(t), axis=1), index=km.index)
    return EvalSurv(pd.DataFrame(surv.T, index=np.arange(surv.shape[1], dtype=float)), t, d, censor_surv=censor)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("method", ["adj_antolini", "antolini"])
def test_concordance_td_matches_pycox(method, seed):
    surv, t, d = _random_case(seed)
    expected = _eval_surv(surv, t, d).concordance_td(method)
    assert M.concordance_td(surv, t, d, method) == pytest.approx(expected, abs=1e-12)


def test_concordance_td_hand_values():
    # two requests, both finish; the one that finishes first (t=1) has lower survival at t=1
    surv = np.array([[0.9, 0.2, 0.1], [0.95, 0.8, 0.5]])
    assert M.concordance_td(surv, [1, 2], [1, 1]) == 1.0
    assert M.concordance_td(surv[::-1], [1, 2], [1, 1]) == 0.0
    assert M.concordance_td(surv, [1, 2], [0, 0]) is None  # nothing observed: no comparable pair


@pytest.mark.parametrize("seed", range(4))
def test_brier_matches_pycox(seed):
    """pycox weights each request's term by the inverse censoring survival as Graf et al. do, but
    ``EvalSurv.brier_score`` divides by the sum of the weights where Graf et al. (and we, and
    scikit-survival) divide by the number of requests: under censoring we compare with pycox's
    per-request terms, without it (every weight 1) with ``EvalSurv.brier_score`` itself."""
    surv, t, d = _random_case(seed)
    grid = np.arange(0, 10, dtype=float)
    ev = _eval_surv(surv, t, d)
    terms, _ = ipcw.brier_score(grid, t, d, surv.T, ev.censor_surv.surv.to_numpy(), ev.index_surv,
                                ev.censor_surv.index_surv, np.inf, False)  # (G, N)
    expected = terms.sum(axis=1) / len(t)
    assert M.brier_scores(surv, t, d, grid) == pytest.approx(expected, abs=1e-12)
    # pycox's integrated_brier_score calls scipy.integrate.simps, gone since SciPy 1.14, and
    # integrates by Simpson's rule; ours is the trapezoid rule over the same curve
    assert M.integrated_brier(surv, t, d, grid) == pytest.approx(np.trapezoid(expected, grid) / 9, abs=1e-12)
    done = np.ones_like(d)
    expected = _eval_surv(surv, t, done).brier_score(grid).to_numpy()
    assert M.brier_scores(surv, t, done, grid) == pytest.approx(expected, abs=1e-12)


def test_brier_hand_values():
    # no censoring, by hand: S = [0.5, 0.5], T = (0, 1); at t=0: (0.5^2 + 0.5^2) / 2; at t=1: 0.5^2 * 2 / 2
    surv2 = np.array([[0.5, 0.5], [0.5, 0.5]])
    assert M.brier_scores(surv2, [0, 1], [1, 1], [0, 1]) == pytest.approx([0.25, 0.25])
    perfect = np.array([[0.0, 0.0], [1.0, 0.0]])  # request 0 finishes at 0, request 1 at 1
    assert M.integrated_brier(perfect, [0, 1], [1, 1], [0, 1]) == 0.0


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="one value per request"):
        M.spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="n_requests, K"):
        M.concordance_td(np.ones((3, 4)), [1, 2], [1, 1])
