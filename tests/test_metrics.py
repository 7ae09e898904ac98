"""Metrics against hand-computed values, scipy and brute-force transcriptions of pycox's definitions."""

import itertools

import numpy as np
import pytest
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


def test_median_ratio_and_r2():
    assert M.median_ratio([2, 4, 6, 100], [1, 4, 3, 0]) == pytest.approx(2.0)  # ratios 2, 1, 2; actual 0 skipped
    assert M.median_ratio([1, 2], [0, 0]) is None
    true = np.array([1.0, 2.0, 3.0, 4.0])
    assert M.r2(true, true) == 1.0
    assert M.r2(np.full(4, true.mean()), true) == pytest.approx(0.0)
    assert M.r2([1, 2, 3, 5], true) == pytest.approx(1 - 1 / 5)


# --- survival metrics: brute-force transcriptions of pycox ----------------------------------------


def _pycox_concordance(surv, t, d, method):
    """pycox.evaluation.concordance, loop for loop (surv here is (N, K); index = min(t, K-1))."""
    n, k = surv.shape
    idx = np.clip(t.astype(int), 0, k - 1)

    def comparable(ti, tj, di, dj):
        if method == "antolini":
            return ((ti < tj) and di) or ((ti == tj) and di and not dj)
        return ((ti < tj) and di) or ((ti == tj) and (di or dj))

    def concordant(si, sj, ti, tj, di, dj):
        if method == "antolini":
            return float(si < sj and comparable(ti, tj, di, dj))
        conc = 0.0
        if ti < tj:
            conc = (si < sj) + (si == sj) * 0.5
        elif ti == tj:
            if di and dj:
                conc = 1.0 - (si != sj) * 0.5
            elif di:
                conc = (si < sj) + (si == sj) * 0.5
            elif dj:
                conc = (si > sj) + (si == sj) * 0.5
        return conc * comparable(ti, tj, di, dj)

    num = den = 0.0
    for i, j in itertools.permutations(range(n), 2):
        num += concordant(surv[i, idx[i]], surv[j, idx[i]], t[i], t[j], d[i], d[j])
        den += comparable(t[i], t[j], d[i], d[j])
    return num / den


@pytest.mark.parametrize("method", ["adj_antolini", "antolini"])
def test_concordance_td_matches_pycox_loops(method):
    rng = np.random.default_rng(2)
    n, k = 40, 12
    hazards = rng.uniform(0.05, 0.5, size=(n, 1)) * np.ones((1, k))
    surv = np.round(np.cumprod(1 - hazards, axis=1), 2)  # rounding makes ties in survival
    t = rng.integers(0, 14, n).astype(float)  # some beyond the grid, many tied times
    d = rng.uniform(size=n) < 0.7
    assert M.concordance_td(surv, t, d, method) == pytest.approx(_pycox_concordance(surv, t, d, method))


def test_concordance_td_hand_values():
    # two requests, both finish; the one that finishes first (t=1) has lower survival at t=1
    surv = np.array([[0.9, 0.2, 0.1], [0.95, 0.8, 0.5]])
    assert M.concordance_td(surv, [1, 2], [1, 1]) == 1.0
    assert M.concordance_td(surv[::-1], [1, 2], [1, 1]) == 0.0
    assert M.concordance_td(surv, [1, 2], [0, 0]) is None  # nothing observed: no comparable pair


def _brier_loop(surv, t, d, grid):
    """Graf et al. with KM censoring weights, one request and one time at a time."""
    uniq = np.unique(t)

    def g(time):  # KM of the censoring distribution, right-continuous
        value = 1.0
        for u in uniq[uniq <= time]:
            value *= 1 - np.sum((t == u) & ~d) / np.sum(t >= u)
        return value

    out = []
    for s in grid:
        total = 0.0
        for i in range(len(t)):
            si = surv[i, min(int(s), surv.shape[1] - 1)]
            if t[i] <= s and d[i]:
                before = uniq[uniq < t[i]]
                total += si**2 / (g(before[-1]) if before.size else 1.0)
            elif t[i] > s:
                total += (1 - si) ** 2 / g(s)
        out.append(total / len(t))
    return np.array(out)


def test_brier_matches_loop_and_hand_value():
    rng = np.random.default_rng(4)
    n, k = 30, 10
    surv = np.cumprod(1 - rng.uniform(0.05, 0.4, size=(n, k)), axis=1)
    t = rng.integers(0, 10, n).astype(float)
    d = rng.uniform(size=n) < 0.6
    grid = np.arange(0, 9)
    expected = _brier_loop(surv, t, d, grid)
    assert M.brier_scores(surv, t, d, grid) == pytest.approx(expected)
    assert M.integrated_brier(surv, t, d, grid) == pytest.approx(np.trapezoid(expected, grid) / 8)
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
