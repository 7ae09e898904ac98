"""The live quality monitor: how well the serving bundle's estimates rank the requests it really serves.

A predictor trained on one prompt mix goes stale when traffic drifts, and nothing but the finished
requests says so. For each request it finishes, the hook (:mod:`~dwise_predict.serving.sglang`)
hands :meth:`QualityMonitor.observe` the estimates it ranked the request with — the admission
estimate at arrival and the refined estimate of its first denoising round, both in total denoising
rounds — beside the denoising rounds the request really ran, its category (the client's
``dwise_category``, else ``live``) and the version of the bundle that estimated it.

The last ``window`` observations live in ring arrays allocated once: an observation is five
stores, O(1), with no allocation, on SGLang's scheduler thread. Categories and versions are kept as
references to their strings in object arrays rather than codes of a growing table, so a client that
sends a new category with every request costs the window's slots and nothing more.

:meth:`QualityMonitor.snapshot` copies the window (microseconds: the hook takes one on the scheduler
thread and ranks it on another, :mod:`~dwise_predict.serving.sglang.metrics`); a
:class:`MonitorSnapshot`'s :meth:`~MonitorSnapshot.summary` ranks it (a few milliseconds for 512
requests; :meth:`QualityMonitor.summary` ranks the live window on the calling thread): Spearman ρ of
each estimate against the rounds, within-category ρ, the calibration ratio, and one row per category
and per bundle version. Every metric is the house's (:mod:`dwise_predict.metrics`): ρ is
:func:`~dwise_predict.metrics.spearman`, within-category ρ
:func:`~dwise_predict.metrics.within_category` (the unweighted mean over categories of the ρ inside
each) over the categories with at least ``min_per_category`` refined requests in the window, the
calibration ratio :func:`~dwise_predict.metrics.median_ratio` (median of refined / actual). A value
resting on fewer than ``min_requests`` requests (``min_per_category`` for one category) is None, as
is a ρ where a side is constant.

A request without a refined estimate (its refinement was NaN, and the policy kept ranking it by
its admission estimate) counts in ``n`` and in the admission ρ, not in the refined metrics; one
without a finite admission estimate counts in ``n`` only.
"""

from __future__ import annotations

import math

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.metrics import median_ratio, spearman, within_category

WINDOW = 512
MIN_REQUESTS = 32
MIN_PER_CATEGORY = 8


class QualityMonitor:
    """Rolling rank quality of the served estimates over the last ``window`` finished requests.

    window : finished requests the summary covers (the latest).
    min_requests : fewest requests behind an overall or per-version metric (else None).
    min_per_category : fewest refined requests of a category for its ρ and its place in the
        within-category mean.
    """

    def __init__(self, window: int = WINDOW, min_requests: int = MIN_REQUESTS,
                 min_per_category: int = MIN_PER_CATEGORY):
        for name, value in (("window", window), ("min_requests", min_requests),
                            ("min_per_category", min_per_category)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"the quality monitor's {name} must be a whole number >= 1, got {value!r}")
        self.size, self.min_requests, self.min_per_category = int(window), int(min_requests), int(min_per_category)
        self.admission = np.zeros(self.size)
        self.refined = np.full(self.size, math.nan)
        self.rounds = np.zeros(self.size)
        self.category = np.full(self.size, "", dtype=object)
        self.version = np.full(self.size, "", dtype=object)
        self.observed = 0  # finished requests observed since the start (the ring's write position, modulo size)

    def observe(self, admission: float, refined: float, rounds: int, category: str, version: str) -> None:
        """One finished request: its admission and refined estimates (total denoising rounds; NaN:
        none), the denoising rounds it ran, its category and the bundle version that estimated it."""
        i = self.observed % self.size
        self.admission[i] = admission
        self.refined[i] = refined
        self.rounds[i] = rounds
        self.category[i] = category
        self.version[i] = version
        self.observed += 1

    def snapshot(self) -> MonitorSnapshot:
        """The window as it is now, in arrays of its own (a copy of five arrays of ``window``
        values: microseconds), to summarise on another thread while this monitor observes on."""
        return self._window(copy=True)

    def summary(self) -> dict:
        """:meth:`MonitorSnapshot.summary` of the window now, ranked on the calling thread."""
        return self._window(copy=False).summary()

    def quality(self, version: str) -> tuple[int, float | None]:
        """:meth:`MonitorSnapshot.quality` of the window now, ranked on the calling thread."""
        return self._window(copy=False).quality(version)

    def _window(self, copy: bool) -> MonitorSnapshot:
        n = min(self.observed, self.size)
        arrays = [a[:n].copy() if copy else a[:n] for a in
                  (self.admission, self.refined, self.rounds, self.category, self.version)]
        return MonitorSnapshot(*arrays, observed=self.observed, min_requests=self.min_requests,
                               min_per_category=self.min_per_category)


class MonitorSnapshot:
    """A :class:`QualityMonitor`'s window at one moment, read-only: the figures are computed here.

    admission, refined, rounds, category, version : the window's requests (in ring order: no
        figure depends on the order), each array set read-only.
    observed : the monitor's finished requests since the start.
    min_requests, min_per_category : the monitor's.
    """

    __slots__ = ("admission", "refined", "rounds", "category", "version", "observed", "min_requests",
                 "min_per_category")

    def __init__(self, admission, refined, rounds, category, version, *, observed: int, min_requests: int,
                 min_per_category: int):
        for array in (admission, refined, rounds, category, version):
            array.flags.writeable = False
        self.admission, self.refined, self.rounds, self.category, self.version = (admission, refined, rounds,
                                                                                 category, version)
        self.observed, self.min_requests, self.min_per_category = observed, min_requests, min_per_category

    def summary(self) -> dict:
        """The window's metrics, a plain dict (JSON as it is): ``observed`` (since the start),
        ``window`` (requests covered), ``admission_rho``, ``refined_rho``, ``within_category_rho``,
        ``calibration_ratio``, ``categories`` ({category: {n, refined_rho}}) and ``versions``
        ({version: {n, admission_rho, refined_rho}}); None where too few requests."""
        admission, refined, rounds = self.admission, self.refined, self.rounds
        has, ranked = np.isfinite(refined), np.isfinite(admission)
        enough = has.sum() >= self.min_requests
        within, per = self._within(refined[has], rounds[has], self.category[has]) if enough else (None, {})
        names, counts = np.unique(self.category, return_counts=True)
        return {
            "observed": self.observed,
            "window": len(rounds),
            "admission_rho": spearman(admission[ranked], rounds[ranked]) if ranked.sum() >= self.min_requests else None,
            "refined_rho": spearman(refined[has], rounds[has]) if enough else None,
            "within_category_rho": within,
            "calibration_ratio": median_ratio(refined[has], rounds[has]) if enough else None,
            "categories": {str(c): {"n": int(k), "refined_rho": per.get(str(c))} for c, k in zip(names, counts)},
            "versions": {v: self._version_row(v) for v in sorted(set(self.version.tolist()))},
        }

    def _within(self, refined: np.ndarray, rounds: np.ndarray, categories: np.ndarray) -> tuple:
        """Within-category ρ (:func:`~dwise_predict.metrics.within_category`) over the categories with
        at least ``min_per_category`` of these (refined) requests, and each such category's ρ."""
        names, counts = np.unique(categories, return_counts=True)
        kept = names[counts >= self.min_per_category]
        if not len(kept):
            return None, {}
        rows = np.isin(categories, kept)
        return within_category(refined[rows], rounds[rows], categories[rows].astype(str))

    def _version_row(self, version: str) -> dict:
        count, refined_rho = self.quality(version)
        rows = (self.version == version) & np.isfinite(self.admission)
        enough = rows.sum() >= self.min_requests
        admission_rho = spearman(self.admission[rows], self.rounds[rows]) if enough else None
        return {"n": count, "admission_rho": admission_rho, "refined_rho": refined_rho}

    def quality(self, version: str) -> tuple[int, float | None]:
        """``(n, refined_rho)`` of the window's requests estimated by bundle ``version``: how many,
        and the ρ of their refined estimates (None with fewer than ``min_requests`` refined)."""
        rows = self.version == version
        has = rows & np.isfinite(self.refined)
        refined_rho = spearman(self.refined[has], self.rounds[has]) if has.sum() >= self.min_requests else None
        return int(rows.sum()), refined_rho


__all__ = ["MIN_PER_CATEGORY", "MIN_REQUESTS", "WINDOW", "MonitorSnapshot", "QualityMonitor"]
