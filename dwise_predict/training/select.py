"""Choosing the refinement predictor: the candidates (``training.candidates``) scored by grouped K-fold
CV on the training split only.

Folds are grouped by prompt text (requests sharing a prompt, e.g. one prompt at several budgets,
never sit on both sides) and dealt per category, so every validation fold holds every category.
The choice is made on what the scheduler does with the estimate (the DWISE paper's Algorithm 1 ranks
every request together by remaining work ``P + r̂``; when ``r̂`` is set after the first denoising
round the prompt is done, ``P = 0``): each candidate's out-of-fold raw estimates over the whole
training split are calibrated fold by fold (:func:`calibrated_out_of_fold`, so they are on the scale
the scheduler sees) and scored by their Spearman ρ against remaining rounds over all requests
(``cv_spearman``). The candidates within :data:`LEVEL_BAND` of the best are level with it, and among
them the best mean within-category ρ wins (:func:`choose`), ties going to the earlier candidate of
``candidates.REGISTRY`` (the reference first). Held-out-category ρ is reported, not chosen on
(:data:`HELD_OUT_NOTE`). Everything is seeded by ``TrainConfig.seed``. Until 2026-12 the choice was
by within-category ρ alone: on sets where the categories' levels carry the work it shipped heads
that order requests inside categories and rank them all far worse (docs/training.md).

With ``jobs=2`` the CV runs in two threads (torch and numpy release the GIL inside their kernels):
this one fits the other candidates fold by fold while the other fits the ridge-within folds
(``training.within_heads``), then takes a share of those that are left. The survival fits all stay
in this one, one after another: their dropout draws from torch's global RNG, which each member
seeds, and nothing in the ``ridge-within`` fits draws from it (their closed-form members are built
blank, see ``HazardMLP.blank``); so the results are the same for any ``jobs``. On the 2-core machine
the 2,048 x 2,048 benchmark took 49-55 s this way against 88 s in one thread (2026-12-01).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.labels import RemainingRoundsLabels
from dwise_predict.survival.linear import RidgeHead
from dwise_predict.traces import TraceDataset
from dwise_predict.training.candidates import NAMES, TrainingSplit, candidate
from dwise_predict.training.within_heads import category_folds, gather_heads, submit_heads

# overall rho this close to the best counts as level with it (then within-category rho decides)
LEVEL_BAND = 0.01
HELD_OUT_NOTE = ("cv_held_out_category: mean within-category rho, each category ranked by the candidate fitted "
                 "without it (leave-one-category-out), for ridge (exact, at its penalty), ridge-within and "
                 "ridge-within+signals (refitted); null for the survival networks, whose refits (one per category) "
                 "would more than double train's time (evaluate --loco measures the shipped one); reported, not "
                 "chosen on")
CRITERION = ("overall Spearman rho of the out-of-fold calibrated remaining rounds (train split only; the "
             "scheduler ranks all requests together); within level_band of the best, the best within-category rho")


def grouped_folds(ds: TraceDataset, folds: int, seed: int) -> np.ndarray:
    """Fold index (N,) per request: prompts kept whole, each category's prompts dealt round-robin."""
    rng = np.random.default_rng(seed)
    cats = ds.requests["category"].astype(str).to_numpy()
    prompts = ds.requests["prompt"].astype(str).to_numpy()
    home: dict[str, str] = {}  # a prompt seen in several categories is dealt with its first one
    for p, c in zip(prompts, cats):
        home.setdefault(p, c)
    where: dict[str, int] = {}
    for cat in sorted(set(home.values())):
        groups = np.array(sorted(p for p, c in home.items() if c == cat), dtype=object)
        groups = groups[rng.permutation(len(groups))]
        where.update({g: i % folds for i, g in enumerate(groups)})
    fold = np.array([where[p] for p in prompts], dtype=np.int64)
    return fold


@contextmanager
def _other_thread(jobs: int) -> Iterator[Executor | None]:
    """One worker thread beside this one when ``jobs`` > 1, else None. On an error or an interrupt
    here the fits still queued there are cancelled, so the caller waits for the running one only."""
    if jobs <= 1:
        yield None
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwise-cv")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


class CrossValidation:
    """One training split's grouped folds and the fits that several candidates' out-of-fold estimates
    share, each made once: per fold the survival ensemble's and the ridge's raw estimates of its
    validation rows, and the ridge-within heads under both fold sets (``pending_heads``: begun by
    ``within_heads.submit_heads``, perhaps in the other thread)."""

    def __init__(self, split: TrainingSplit, pending_heads: list[list[tuple]]):
        self.split = split
        self.size = len(split.remaining)
        self.num_rounds = RemainingRoundsLabels().fit(split.remaining, split.events).out_features  # K, as every graph
        self._pending_heads = pending_heads
        self._heads: tuple | None = None
        self._survival: dict[int, tuple[np.ndarray, int]] = {}
        self._ridge: dict[int, np.ndarray] = {}

    def out_of_fold(self, estimate) -> np.ndarray:
        """(N,) ``estimate(k)`` on the validation rows of each fold ``k`` that has at least 8 requests
        to fit on, NaN elsewhere."""
        fold, out = self.split.fold, np.full(self.size, np.nan)
        for k in np.unique(fold):
            if (fold != k).sum() >= 8:
                out[fold == k] = estimate(k)
        return out

    def fold_split(self, k: int) -> tuple[TrainingSplit, RefineInputs]:
        """Fold ``k``'s requests to fit on, and the inputs of its validation requests."""
        fit_rows = self.split.fold != k
        return self.split.rows(fit_rows), self.split.inputs.rows(~fit_rows)

    def survival_fold(self, k: int) -> tuple[np.ndarray, int]:
        """The survival ensemble fitted for fold ``k``: its raw estimates of the validation rows and its
        number of members."""
        if k not in self._survival:
            fit, val = self.fold_split(k)
            ensemble = fit.make_ensemble().fit(fit.inputs, fit.remaining, fit.events)
            self._survival[k] = (ensemble.predict_raw(val), len(ensemble.members_))
        return self._survival[k]

    def survival_raw(self, k: int) -> np.ndarray:
        return self.survival_fold(k)[0]

    def ridge_raw(self, k: int) -> np.ndarray:
        """The ridge fitted for fold ``k``: its raw estimates of the validation rows."""
        if k not in self._ridge:
            fit, val = self.fold_split(k)
            self._ridge[k] = RidgeHead().fit(fit.inputs, fit.remaining, fit.events).ensemble().predict_raw(val)
        return self._ridge[k]

    def within_heads(self) -> tuple:
        """The ridge-within heads' out-of-fold scores (``within_heads.gather_heads``) under the grouped
        folds and under leave-one-category-out folds; the fits the other thread has not begun run here."""
        if self._heads is None:
            self._heads = tuple(gather_heads(self.size, pending) for pending in self._pending_heads)
        return self._heads


def cross_validate(split: TrainingSplit, folds: int, candidates: tuple[str, ...] = NAMES,
                   jobs: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """Every candidate's out-of-fold estimates, their scores and the choice (the candidates.json dict).

    Under the grouped folds (``split.fold``, :func:`grouped_folds` of ``folds``) each candidate's
    out-of-fold raw estimates are calibrated fold by fold (:func:`calibrated_out_of_fold`) and
    scored as the scheduler uses them, all requests ranked together: ``cv_spearman``, the primary
    criterion; ``cv_within_category`` and, under leave-one-category-out folds,
    ``cv_held_out_category`` are reported beside it, and within-category ρ breaks ties
    (:func:`choose`). ``jobs``: 2 runs the ``ridge-within`` fits in a second thread (see the module
    docstring); results do not depend on it.

    Returns (the record, {candidate: out-of-fold raw estimates (N,) under the grouped folds, NaN where
    unscored}); a closed-form winner's calibration is fitted on its own (``training.fit.calibrate``)."""
    tried = [candidate(name) for name in candidates]
    with _other_thread(jobs) as pool:
        # the ridge-within fits start first (one set serves both of its candidates, under both fold sets);
        # with jobs = 2 they run beside the other candidates' fits below
        pending = [submit_heads(split.inputs, split.remaining, split.events, split.categories, f, split.seed, pool)
                   for f in (split.fold, category_folds(split.categories))] if any(c.uses_within_heads for c in tried) else []
        cv = CrossValidation(split, pending)
        estimates = {c.name: c.out_of_fold(cv) for c in tried if not c.uses_within_heads}
        cv.within_heads()
    estimates.update({c.name: c.out_of_fold(cv) for c in tried if c.uses_within_heads})
    record = {"held_out": HELD_OUT_NOTE}
    for name in candidates:
        record.update(estimates[name][2])
    oof = {name: estimates[name][0] for name in candidates}
    scored = split.events & np.isfinite(oof[candidates[0]])
    scores = {name: _scores(oof[name], estimates[name][1], split.remaining, scored, split.categories, split.fold,
                            cv.num_rounds) for name in candidates}
    chosen, reason, level = choose(scores, candidates)
    return {
        "mode": "cv",
        "folds": folds,
        "grouping": "prompt text, dealt per category",
        "criterion": CRITERION,
        "level_band": LEVEL_BAND,
        "n_scored": int(scored.sum()),
        "candidates": scores,
        "level_with_best": level,
        "chosen": chosen,
        "reason": reason,
        **record,
    }, oof


def _scores(raw, held, remaining, scored, cats, fold, num_rounds) -> dict:
    """One candidate's entry of candidates.json from its out-of-fold raw estimates under the grouped
    folds (``raw``) and under leave-one-category-out folds (``held``), over the ``scored`` requests."""
    calibrated = calibrated_out_of_fold(raw, remaining, scored, fold, num_rounds)
    pred, true, groups = calibrated[scored], remaining[scored], cats[scored]
    within, per = M.within_category(pred, true, groups)
    # one model per held-out category and a strictly increasing calibration: raw ranks as calibrated
    kept = scored & np.isfinite(held)
    held_out, held_per = M.within_category(held[kept], remaining[kept], cats[kept])
    return {"cv_spearman": M.spearman(pred, true), "cv_spearman_raw": M.spearman(raw[scored], true),
            "cv_within_category": within, "cv_per_category": per, "cv_held_out_category": held_out,
            "cv_held_out_per_category": held_per}


def calibrated_out_of_fold(raw: np.ndarray, remaining: np.ndarray, scored: np.ndarray, fold: np.ndarray,
                           num_rounds: int) -> np.ndarray:
    """Out-of-fold raw estimates (N,) put on the scale of remaining rounds fold by fold, as the
    scheduler would see them: fold k's by an isotonic calibration fitted on the other folds' scored
    requests (their own out-of-fold estimates, so the map never saw fold k's requests' rounds), like
    the shipped one (``training.fit``). Pooled raw estimates of several fold models need not share a
    scale (a fold's ridge may pick another penalty); the calibrated ones do. NaN where ``raw`` is."""
    out = np.full(len(raw), np.nan)
    for k in np.unique(fold):
        fit_rows, val_rows = scored & (fold != k) & np.isfinite(raw), (fold == k) & np.isfinite(raw)
        if not val_rows.any() or not fit_rows.any():
            continue
        calibrator = IsotonicCalibrator().fit(raw[fit_rows], remaining[fit_rows], raw_range=(0.0, float(num_rounds)))
        out[val_rows] = calibrator.predict(raw[val_rows])
    return out


def choose(scores: dict, candidates: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """The candidate to ship, why (one plain sentence), and the candidates level with the best.

    Level: an overall ``cv_spearman`` within :data:`LEVEL_BAND` of the best. Among those the best
    ``cv_within_category`` wins (the order inside a category is what a level predictor cannot
    fake), then the earlier candidate of ``candidates.REGISTRY``."""
    def value(c, key):
        return _value(scores[c][key])

    best = max(candidates, key=lambda c: (value(c, "cv_spearman"), -candidates.index(c)))
    level = [c for c in candidates if value(c, "cv_spearman") >= value(best, "cv_spearman") - LEVEL_BAND]
    chosen = max(level, key=lambda c: (value(c, "cv_within_category"), -candidates.index(c)))

    def shown(c, key):
        return "n/a" if scores[c][key] is None else f"{scores[c][key]:.3f}"

    overall = f"{chosen}: overall rho {shown(chosen, 'cv_spearman')} of the out-of-fold calibrated estimates"
    if len(level) == 1:
        others = sorted((c for c in candidates if c != chosen), key=lambda c: -value(c, "cv_spearman"))
        runner = (f"; the next, {others[0]}, has {shown(others[0], 'cv_spearman')}, more than {LEVEL_BAND} lower"
                  if others else "")
        return chosen, f"{overall}, the best{runner}", level
    standing = ("the best" if chosen == best else
                f"within {LEVEL_BAND} of the best ({best}, {shown(best, 'cv_spearman')})")
    rivals = ", ".join(f"{c} {shown(c, 'cv_within_category')}" for c in level if c != chosen)
    reason = (f"{overall}, {standing}; of the {len(level)} candidates within {LEVEL_BAND} of the best it ranks "
              f"best within categories ({shown(chosen, 'cv_within_category')} against {rivals})")
    return chosen, reason, level


def _value(x) -> float:
    return -np.inf if x is None else float(x)
