"""Every metric the project reports, as pure functions over arrays (one module, used everywhere).

Sign convention: a larger estimate means more remaining work, so a good predictor has a positive
rank correlation with the true rounds. For survival curves the same holds through the survival
function: a request expected to run longer keeps a higher ``S(t) = P(T > t)``.

Rank metrics return ``None`` (the paper's "n/a") when a side is constant or there are fewer than two
requests, since a correlation is undefined there.

References
----------
Antolini, Boracchi, Biganzoli (2005), "A time-dependent discrimination index for survival data",
Statistics in Medicine 24(24). Definitions as implemented in pycox ``EvalSurv.concordance_td``.
Graf, Schmoor, Sauerbrei, Schumacher (1999), "Assessment and comparison of prognostic classification
schemes for survival data", Statistics in Medicine 18(17-18): the IPCW Brier score, a mean over
the requests (pycox's ``EvalSurv.brier_score`` divides by the sum of the weights instead and starts
its censoring curve at the first duration; tests/test_metrics.py compares with its per-request terms).
"""

from __future__ import annotations

import warnings

import numpy as np


def _stats():
    # scipy.stats takes ~0.8 s to import: importing it at first use keeps the serving hook's start-up
    # (which imports this module through the quality monitor, computing nothing until traffic) fast
    from scipy import stats

    return stats


def _pair(pred, true) -> tuple[np.ndarray, np.ndarray]:
    pred = np.asarray(pred, dtype=np.float64).ravel()
    true = np.asarray(true, dtype=np.float64).ravel()
    if pred.shape != true.shape:
        raise ValueError(f"pred has {pred.size} values but true has {true.size}: pass one value per request")
    return pred, true


def _defined(pred: np.ndarray, true: np.ndarray) -> bool:
    return pred.size >= 2 and np.ptp(pred) > 0 and np.ptp(true) > 0


def spearman(pred, true) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when a side is constant."""
    pred, true = _pair(pred, true)
    if not _defined(pred, true):
        return None
    # what scipy.stats.spearmanr computes for two finite columns (their average ranks, then numpy's
    # corrcoef: the same bits), without its argument handling, which costs as much again (~0.2 ms a
    # call, paid under the GIL beside SGLang's scheduler thread by the serving quality monitor)
    ranks = _stats().rankdata(np.column_stack((pred, true)), axis=0)
    return float(np.corrcoef(ranks, rowvar=False)[1, 0])


def kendall(pred, true) -> float | None:
    """Kendall's tau-b (ties corrected); None when a side is constant."""
    pred, true = _pair(pred, true)
    if not _defined(pred, true):
        return None
    return float(_stats().kendalltau(pred, true).statistic)


def within_category(pred, true, categories) -> tuple[float | None, dict[str, float | None]]:
    """Spearman ρ inside each category, and their unweighted mean over categories where it is defined.

    Parameters
    ----------
    pred, true : arrays of shape (n_requests,).
    categories : array of shape (n_requests,), the request family of each request.

    Returns
    -------
    (mean, per_category): ``per_category`` maps every category (sorted) to its ρ or None; ``mean`` is
    None when no category has a defined ρ.
    """
    pred, true = _pair(pred, true)
    categories = np.asarray(categories).ravel()
    if categories.shape != pred.shape:
        raise ValueError(f"categories has {categories.size} values but pred has {pred.size}")
    per = {str(c): spearman(pred[categories == c], true[categories == c]) for c in sorted(set(categories.tolist()))}
    defined = [v for v in per.values() if v is not None]
    return (float(np.mean(defined)) if defined else None), per


def mean_sd(values) -> dict:
    """``{"mean", "sd", "n"}`` of the defined values (None dropped): the sample deviation needs two
    of them, the mean one; None where there are too few."""
    defined = np.array([float(v) for v in values if v is not None])
    return {"mean": float(defined.mean()) if defined.size else None,
            "sd": float(defined.std(ddof=1)) if defined.size > 1 else None, "n": int(defined.size)}


def mean_interval(values, level: float = 0.95) -> list[float] | None:
    """``[lo, hi]`` Student-t interval of the mean of the defined values (None dropped), e.g. of a
    paired difference over trace draws; None with fewer than two."""
    defined = np.array([float(v) for v in values if v is not None])
    if defined.size < 2:
        return None
    half = _stats().t.ppf(0.5 + level / 2, defined.size - 1) * defined.std(ddof=1) / np.sqrt(defined.size)
    return [float(defined.mean() - half), float(defined.mean() + half)]


def spearman_rows(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Spearman ρ of each row of two (B, n) arrays (Pearson of average ranks), NaN where a side is
    constant: many bootstrap resamples at once."""
    stats = _stats()
    rp = stats.rankdata(pred, axis=1)
    rt = stats.rankdata(true, axis=1)
    rp -= rp.mean(axis=1, keepdims=True)
    rt -= rt.mean(axis=1, keepdims=True)
    denom = np.sqrt((rp * rp).sum(axis=1) * (rt * rt).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (rp * rt).sum(axis=1) / np.where(denom > 0, denom, 1.0), np.nan)


def percentile_interval(values: np.ndarray, level: float = 0.95) -> list[float] | None:
    """``[lo, hi]`` percentile interval of the finite bootstrap values; None when there are none."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    alpha = (1.0 - level) / 2.0
    return None if values.size == 0 else [float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))]


def bootstrap_ci(pred, true, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval of Spearman ρ (requests resampled with replacement).

    Resamples where ρ is undefined (a constant side) are skipped; None when none is defined.
    """
    pred, true = _pair(pred, true)
    if not _defined(pred, true):
        return None
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // pred.size)  # resamples per batch: bounded memory on large eval sets
    rhos = []
    for start in range(0, n_boot, chunk):
        idx = rng.integers(0, pred.size, size=(min(chunk, n_boot - start), pred.size))
        rhos.append(spearman_rows(pred[idx], true[idx]))
    interval = percentile_interval(np.concatenate(rhos) if rhos else np.zeros(0), level)  # n_boot 0: None
    return None if interval is None else (interval[0], interval[1])


def bootstrap_mean_ci(values, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (e.g. one per arrival seed), values
    resampled with replacement; ``(mean, mean)`` with fewer than two values."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        return float(values.mean()), float(values.mean())
    idx = np.random.default_rng(seed).integers(0, values.size, size=(n_boot, values.size))
    lo, hi = percentile_interval(values[idx].mean(axis=1), level)
    return lo, hi


def stratified_indices(categories: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n) resampled request indices, each category resampled within itself (every
    resample keeps the category mix)."""
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, categories.size), dtype=np.int64)
    for cat in sorted(set(categories)):
        where = np.flatnonzero(categories == cat)
        out[:, where] = where[rng.integers(0, where.size, size=(n_boot, where.size))]
    return out


def rank_scores(pred, true, categories, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ρ overall and mean within-category ρ (categories of at least 3 requests, defined values): on
    the data (idx None, arrays of shape (1,)) or on each resample of ``idx`` (arrays of shape (n_boot,))."""
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    categories = np.asarray(categories)
    idx = np.arange(pred.size)[None, :] if idx is None else idx
    overall = spearman_rows(pred[idx], true[idx])
    per = []
    for cat in sorted(set(categories)):
        cols = np.flatnonzero(categories == cat)
        if cols.size >= 3:
            sub = idx[:, cols]
            per.append(spearman_rows(pred[sub], true[sub]))
    with warnings.catch_warnings():  # a resample where no category has a defined ρ: NaN, dropped later
        warnings.simplefilter("ignore", RuntimeWarning)
        within = np.nanmean(np.stack(per), axis=0) if per else np.full(idx.shape[0], np.nan)
    return overall, within


def within_category_ci(pred, true, categories, n_boot: int = 1000, seed: int = 0,
                       level: float = 0.95) -> list[float] | None:
    """Percentile bootstrap interval of the mean within-category ρ, requests resampled inside their
    category (:func:`stratified_indices`); None when no resample has a defined value."""
    categories = np.asarray(categories)
    _, within = rank_scores(pred, true, categories, stratified_indices(categories, n_boot, seed))
    return percentile_interval(within, level)


def median_ratio(pred, true) -> float | None:
    """Median of predicted / actual over requests with actual > 0 (1.0 = calibrated; None if none)."""
    pred, true = _pair(pred, true)
    keep = true > 0
    if not keep.any():
        return None
    return float(np.median(pred[keep] / true[keep]))


def r2(pred, true) -> float | None:
    """Coefficient of determination 1 - SS_res / SS_tot (as sklearn's r2_score); None if true is constant."""
    pred, true = _pair(pred, true)
    ss_tot = float(((true - true.mean()) ** 2).sum())
    if true.size < 2 or ss_tot == 0:
        return None
    return 1.0 - float(((true - pred) ** 2).sum()) / ss_tot


def _survival_inputs(survival, durations, events) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    survival = np.asarray(survival, dtype=np.float64)
    durations = np.asarray(durations, dtype=np.float64).ravel()
    events = np.asarray(events).astype(bool).ravel()
    if survival.ndim != 2 or survival.shape[0] != durations.size or events.size != durations.size:
        raise ValueError(
            f"survival must be (n_requests, K) with one duration and event per row; got {survival.shape}, "
            f"{durations.size} durations, {events.size} events"
        )
    return survival, durations, events


def _grid_index(times: np.ndarray, k: int) -> np.ndarray:
    """Column of the survival grid 0..K-1 in force at each time: the last grid time <= t ('post' steps)."""
    return np.clip(np.floor(times), 0, k - 1).astype(np.int64)


def concordance_td(survival, durations, events, method: str = "adj_antolini") -> float | None:
    """Antolini's time-dependent concordance, as pycox ``EvalSurv.concordance_td``.

    A pair (i, j) is comparable when i's event comes first (``t_i < t_j`` and ``d_i``; with
    ``adj_antolini`` also tied times where one has the event). It is concordant when the request with
    the earlier event has the lower survival at that time, ``S_i(t_i) < S_j(t_i)``; ``adj_antolini``
    (pycox's default) counts ties in survival as half and handles tied times symmetrically.

    Parameters
    ----------
    survival : array of shape (n_requests, K), ``S(t) = P(T > t)`` at grid times t = 0..K-1 (rounds).
    durations : array of shape (n_requests,), observed remaining rounds.
    events : array of shape (n_requests,), 1 where the request finished, 0 where it was censored.
    method : "adj_antolini" (default) or "antolini".

    Returns
    -------
    float in [0, 1] (0.5 = random), or None when no pair is comparable.
    """
    survival, t, d = _survival_inputs(survival, durations, events)
    if method not in ("adj_antolini", "antolini"):
        raise ValueError(f"method must be 'adj_antolini' or 'antolini', not {method!r}")
    col = _grid_index(t, survival.shape[1])
    concordant = comparable = 0.0
    for start in range(0, t.size, 512):  # rows of i in chunks: the pair matrix stays small
        i = np.arange(start, min(start + 512, t.size))
        s_i = survival[i, col[i]][:, None]  # S_i(t_i)              (B, 1)
        s_j = survival[:, col[i]].T  # S_j(t_i) for every j          (B, N)
        ti, tj = t[i][:, None], t[None, :]
        di, dj = d[i][:, None], d[None, :]
        not_self = i[:, None] != np.arange(t.size)[None, :]
        lower, tie = (s_i < s_j), (s_i == s_j)
        if method == "antolini":
            comp = ((ti < tj) & di) | ((ti == tj) & di & ~dj)
            concordant += float((lower & comp & not_self).sum())
        else:
            comp = ((ti < tj) & di) | ((ti == tj) & (di | dj))
            half = lower + 0.5 * tie
            conc = np.where(
                ti < tj,
                half,
                np.where(
                    di & dj, 1.0 - 0.5 * (~tie), np.where(di, half, (s_i > s_j) + 0.5 * tie)
                ),
            )
            concordant += float((conc * (comp & not_self)).sum())
        comparable += float((comp & not_self).sum())
    return concordant / comparable if comparable > 0 else None


def _censoring_km(durations: np.ndarray, events: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Kaplan-Meier estimate of the censoring survival G(t) = P(C > t) at ``times`` (right-continuous)."""
    uniq = np.unique(durations)
    at_risk = (durations[None, :] >= uniq[:, None]).sum(axis=1)
    censored = ((durations[None, :] == uniq[:, None]) & ~events[None, :]).sum(axis=1)
    g = np.cumprod(1.0 - censored / at_risk)
    pos = np.searchsorted(uniq, times, side="right") - 1
    return np.where(pos >= 0, g[np.clip(pos, 0, None)], 1.0)


def brier_scores(survival, durations, events, grid) -> np.ndarray:
    """IPCW Brier score at each grid time, censoring weights from Kaplan-Meier (Graf et al.).

    ``BS(t) = mean_i [ S_i(t)^2 1{T_i <= t, d_i} / G(T_i-) + (1 - S_i(t))^2 1{T_i > t} / G(t) ]``,
    with G fitted on the same requests; pycox's per-request terms, averaged over the requests.

    Parameters
    ----------
    survival : array of shape (n_requests, K), S(t) at grid times 0..K-1.
    durations, events : arrays of shape (n_requests,).
    grid : increasing times (rounds) at which to score.

    Returns
    -------
    array of shape (len(grid),).
    """
    survival, t, d = _survival_inputs(survival, durations, events)
    grid = np.asarray(grid, dtype=np.float64).ravel()
    g_t = _censoring_km(t, d, grid)  # G(t)               (G,)
    # G(T_i-): the censoring survival just before the request's own time.
    uniq = np.unique(t)
    prev = np.concatenate([[-np.inf], uniq])[np.searchsorted(uniq, t)]
    g_ti = np.where(np.isfinite(prev), _censoring_km(t, d, np.where(np.isfinite(prev), prev, 0.0)), 1.0)
    s = survival[:, _grid_index(grid, survival.shape[1])]  # S_i(t)   (N, G)
    died = (t[:, None] <= grid[None, :]) & d[:, None]
    alive = t[:, None] > grid[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(died, s**2 / g_ti[:, None], 0.0) + np.where(alive, (1.0 - s) ** 2 / g_t[None, :], 0.0)
    return score.mean(axis=0)


def integrated_brier(survival, durations, events, grid) -> float:
    """IPCW Brier score integrated over ``grid`` by the trapezoid rule, divided by its span
    (scikit-survival's ``integrated_brier_score``; pycox 0.3.0's uses Simpson's rule)."""
    grid = np.asarray(grid, dtype=np.float64).ravel()
    if grid.size < 2 or not (np.diff(grid) > 0).all():
        raise ValueError("grid needs at least two increasing times")
    scores = brier_scores(survival, durations, events, grid)
    return float(np.trapezoid(scores, grid) / (grid[-1] - grid[0]))


def rank_summary(pred, true, categories, n_boot: int = 1000, seed: int = 0) -> dict:
    """The rank metrics a metrics.json block holds: spearman, spearman_ci, kendall,
    within_category_mean, per_category."""
    mean, per = within_category(pred, true, categories)
    ci = bootstrap_ci(pred, true, n_boot=n_boot, seed=seed)
    return {
        "spearman": spearman(pred, true),
        "spearman_ci": list(ci) if ci is not None else None,
        "kendall": kendall(pred, true),
        "within_category_mean": mean,
        "per_category": per,
    }


__all__ = [
    "bootstrap_ci",
    "bootstrap_mean_ci",
    "percentile_interval",
    "rank_scores",
    "spearman_rows",
    "stratified_indices",
    "within_category_ci",
    "brier_scores",
    "concordance_td",
    "integrated_brier",
    "kendall",
    "median_ratio",
    "r2",
    "rank_summary",
    "spearman",
    "within_category",
]
