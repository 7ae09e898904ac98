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

Every out-of-fold estimate comes from a fit that never saw the fold: the closed-form heads too
(``ridge``, ``ridge-within``, ``ridge-within+signals``) are fitted per fold, their standardisation and
penalties chosen again on the fold's training requests. Refits of the whole split's fit at its
penalties would be faster, but those penalties saw the fold and lift the heads' CV scores
(docs/training.md, "Speed").

The fits several candidates share (:class:`CrossValidation`: per fold the survival, survival-pca and
ridge fits, and the ridge-within heads) run in ``jobs`` threads (torch and numpy release the GIL inside
their kernels), dearest first. Every fit draws from generators of its own (a survival member seeds
its own for its initialisation and dropout; the closed-form members are built blank, see
``HazardMLP.blank``), so the results are the same for any ``jobs`` (tested). The network candidates'
fold fits have the shipped ensemble's members, or its first ``TrainConfig.cv_members`` (faster, and
another choice on some sets: docs/training.md, "Speed"); ``survival+ridge``'s fold blend gives its
ridge member the share it has in the shipped graph either way. The 2,048 x 2,048 benchmark:
docs/training.md, "Speed".

The ridge-within heads' leave-one-category-out refits (a two-stage fit per category, about half the
search's CPU time at H = 2,048) serve only the two ridge-within candidates' held-out-category ρ and the blend
weight of ``ridge-within+signals``. So they are made only when one of those can still be level with
the best (:func:`contenders`: its overall ρ, at its best blend weight, from the grouped folds alone,
within :data:`LEVEL_BAND` of the best score sure to be reached); else both are recorded as out of
reach (:data:`OUT_OF_REACH_NOTE`). No fit the choice depends on is skipped and none is made
otherwise, so the choice is the one the full search makes (tested).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.labels import RemainingRoundsLabels
from dwise_predict.survival.linear import RidgeHead, Standardised, fit_pca_survival, linear_raw
from dwise_predict.traces import TraceDataset
from dwise_predict.training.candidates import NAMES, TrainingSplit, candidate
from dwise_predict.training.within_heads import category_folds, fold_heads, gather_heads, scored_folds

# overall rho this close to the best counts as level with it (then within-category rho decides)
LEVEL_BAND = 0.01
HELD_OUT_NOTE = ("cv_held_out_category: mean within-category rho, each category ranked by the candidate fitted "
                 "without it (leave-one-category-out), for ridge (exact, at its penalty), ridge-within and "
                 "ridge-within+signals (refitted); null for the survival networks, whose refits (one per category) "
                 "would more than double train's time (evaluate --loco measures the shipped one); reported, not "
                 "chosen on")
OUT_OF_REACH_NOTE = ("these candidates cannot be level with the best: their overall rho (ridge-within+signals' at "
                     "each blend weight), from the grouped folds alone, is more than level_band below a score "
                     "another candidate reaches; so their leave-one-category-out refits were not made: "
                     "cv_held_out_category null, ridge-within+signals scored at the default blend weight, none chosen "
                     "(blend_cv: each weight's grouped-CV scores)")
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
    """``jobs - 1`` worker threads beside this one when ``jobs`` > 1, else None. On an error or an
    interrupt here the fits still queued there are cancelled, so the caller waits for the running ones only."""
    if jobs <= 1:
        yield None
        return
    pool = ThreadPoolExecutor(max_workers=jobs - 1, thread_name_prefix="dwise-cv")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


# the order the CV's threads take the shared fits in (CrossValidation.start): dearest first, by rough CPU
# seconds on the 2,048 x 2,048 benchmark (a survival fold's three members the most; a ridge fold takes its
# decomposition from survival-pca's, or the other way round). Except the whole split's ridge
# (ridge-held, ~1.3 s): taken in its turn, the last but the ridge folds' few milliseconds, it left one
# thread working alone for ~1.1 s while the other had finished (an idle run, 2026-12-06); ranked after
# the survival folds, the threads end on the per-fold fits of ~2.5 s each, within a few tenths
_COST = {"survival": 6.0, "ridge-held": 3.0, "within": 2.5, "pca": 2.5, "ridge": 0.3}


class CrossValidation:
    """One training split's grouped folds and the fits that several candidates' out-of-fold estimates
    share, each made once (``Candidate.needs`` names them): per fold ``k`` the survival ensemble, the
    survival-pca ensemble and the ridge fitted without it (``("survival", k)``, ``("pca", k)``,
    ``("ridge", k)``: their raw estimates of its requests); the ridge's held-out-category estimates
    (``("ridge-held",)``); and the ridge-within heads fitted without each fold of either fold set
    (``("within", s, k)``: :meth:`within_keys`).

    :meth:`start` queues them dearest first; the pool's threads take them from the front, and so does
    the caller's thread whenever it would wait (:meth:`result`): each thread begins the dearest fit left,
    so they finish close together (longest processing time first). It is called again for the fits only
    the candidates that can still be chosen need (:func:`contenders`). Every fit draws from
    generators of its own (``SurvivalEnsemble``'s members, the heads' blank members), so where and
    when one runs changes no number. The fits of fold ``k`` (survival, survival-pca, the ridge, the
    grouped ridge-within heads) share one standardisation of its requests, and the ridge and
    survival-pca one decomposition of its Gram matrix (:meth:`standardised`)."""

    def __init__(self, split: TrainingSplit, pool: Executor | None):
        self.split = split
        self.size = len(split.remaining)
        self.num_rounds = RemainingRoundsLabels().fit(split.remaining, split.events).out_features  # K, as every graph
        self.folds = scored_folds(split.fold)
        self.fold_sets = (split.fold, category_folds(split.categories))  # grouped, leave-one-category-out
        self._pool = pool
        self._queued: dict[tuple, Future] = {}  # in the order the pool takes them
        self._made: dict[tuple, object] = {}
        self._standardised: dict[int, Standardised] = {}
        self._fold_locks = {k: threading.Lock() for k in self.folds}

    def start(self, keys: list[tuple]) -> None:
        """Queue the fits ``keys`` (each once), dearest first."""
        for key in sorted(dict.fromkeys(keys), key=lambda key: -_COST[key[0]]):
            self._queued[key] = self._pool.submit(self._fit, key) if self._pool is not None else Future()

    def result(self, key: tuple):
        """The fit ``key`` (queued by :meth:`start`): until a thread has made it, this one makes the
        first queued fit nobody has begun (``key`` itself in its turn), and waits when none is left."""
        while key not in self._made:
            queued = self._queued[key]
            if queued.done() or not self._make_another():
                self._made[key] = queued.result()
        return self._made[key]

    def _make_another(self) -> bool:
        for key in self._queued:
            if key not in self._made and self._queued[key].cancel():
                self._made[key] = self._fit(key)
                return True
        return False

    def _fit(self, key: tuple):
        kind, *fold = key
        fits = {"survival": self._survival, "pca": self._pca, "ridge": self._ridge, "ridge-held": self._ridge_held,
                "within": self._within}
        return fits[kind](*fold)

    def out_of_fold(self, estimate) -> np.ndarray:
        """(N,) ``estimate(k)`` on the validation rows of each fold ``k`` of :attr:`folds` (those with at
        least 8 requests to fit on), NaN elsewhere."""
        out = np.full(self.size, np.nan)
        for k in self.folds:
            out[self.split.fold == k] = estimate(k)
        return out

    def fold_split(self, k: int) -> tuple[TrainingSplit, RefineInputs]:
        """Fold ``k``'s requests to fit on, and the inputs of its validation requests."""
        fit_rows = self.split.fold != k
        return self.split.rows(fit_rows), self.split.inputs.rows(~fit_rows)

    def standardised(self, k: int) -> Standardised:
        """Fold ``k``'s requests to fit on, standardised (``survival.linear.Standardised``): made by the
        first fit that asks, the same object for the others (a second thread asking meanwhile waits)."""
        with self._fold_locks[k]:
            if k not in self._standardised:
                fit, _ = self.fold_split(k)
                self._standardised[k] = Standardised(fit.inputs, fit.remaining, fit.events)
            return self._standardised[k]

    def survival_raw(self, k: int) -> np.ndarray:
        """The survival ensemble fitted for fold ``k`` (``split.cv_members`` members): its raw
        estimates of the validation rows."""
        return self.result(("survival", k))

    def pca_raw(self, k: int) -> np.ndarray:
        """The survival-pca ensemble fitted for fold ``k``: its raw estimates of the validation rows."""
        return self.result(("pca", k))

    def ridge_raw(self, k: int) -> np.ndarray:
        """The ridge fitted for fold ``k``: its raw estimates of the validation rows."""
        return self.result(("ridge", k))

    def ridge_held_out(self) -> np.ndarray:
        """The ridge's raw estimates (N,) of each category by the whole split's ridge without it, at
        that ridge's penalty and standardisation (exact without refitting: ``RidgeHead.fit_held_out``)."""
        return self.result(("ridge-held",))

    def within_keys(self, s: int) -> list[tuple]:
        """The ridge-within heads' fold fits ``("within", s, k)`` for each fold ``k`` of fold set ``s``
        (:attr:`fold_sets`: 0 the grouped folds, 1 leave-one-category-out)."""
        return [("within", s, k) for k in scored_folds(self.fold_sets[s])]

    def within_scores(self, s: int) -> tuple:
        """The ridge-within heads' out-of-fold scores (``within_heads.gather_heads``) under fold set ``s``."""
        return gather_heads(self.fold_sets[s], partial(self._within_result, s))

    def overall_rho(self, raw: np.ndarray) -> float:
        """``cv_spearman`` of out-of-fold raw estimates ``raw`` (N,), as :func:`cross_validate` scores
        them (-inf where undefined, as :func:`choose` ranks it)."""
        scored = self.split.events & np.isfinite(raw)
        calibrated = calibrated_out_of_fold(raw, self.split.remaining, scored, self.split.fold, self.num_rounds)
        return _value(M.spearman(calibrated[scored], self.split.remaining[scored]))

    def _within_result(self, s: int, k: int) -> tuple:
        return self.result(("within", s, k))

    def _survival(self, k: int) -> np.ndarray:
        fit, val = self._standardised_split(k)
        ensemble = self.split.make_fold_ensemble().fit(fit.inputs, fit.remaining, fit.events, like=fit.base)
        return ensemble.predict_raw(val)

    def _pca(self, k: int) -> np.ndarray:
        fit, val = self._standardised_split(k)
        return fit_pca_survival(self.split.make_fold_ensemble, fit.inputs, fit.remaining, fit.events,
                                standardised=fit).predict_raw(val)

    def _ridge(self, k: int) -> np.ndarray:
        fit, val = self._standardised_split(k)
        return RidgeHead().fit(fit.inputs, fit.remaining, fit.events, standardised=fit).ensemble().predict_raw(val)

    def _standardised_split(self, k: int) -> tuple[Standardised, RefineInputs]:
        """:meth:`fold_split` with the requests to fit on standardised (:meth:`standardised`)."""
        return self.standardised(k), self.split.inputs.rows(self.split.fold == k)

    def _ridge_held(self) -> np.ndarray:
        return linear_raw(self.split.ridge[1], self.num_rounds)  # the split's ridge, the final fit's too

    def _within(self, s: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        split = self.split
        # the grouped folds' fits are the other fits' of fold k; leave-one-category-out's are their own
        return fold_heads(split.inputs, split.remaining, split.events, split.categories, self.fold_sets[s], k,
                          split.seed, self.standardised(k) if s == 0 else None)


def cross_validate(split: TrainingSplit, folds: int, candidates: tuple[str, ...] = NAMES,
                   jobs: int = 1, log: Callable[[str], None] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Every candidate's out-of-fold estimates, their scores and the choice (the candidates.json dict).

    Under the grouped folds (``split.fold``, :func:`grouped_folds` of ``folds``) each candidate's
    out-of-fold raw estimates are calibrated fold by fold (:func:`calibrated_out_of_fold`) and
    scored as the scheduler uses them, all requests ranked together: ``cv_spearman``, the primary
    criterion; ``cv_within_category`` and, under leave-one-category-out folds,
    ``cv_held_out_category`` are reported beside it, and within-category ρ breaks ties
    (:func:`choose`). The ridge-within candidates' leave-one-category-out refits are made only when one
    of them can still be level with the best (:func:`contenders`; else ``out_of_reach`` names them).
    ``jobs``: the threads the shared fits run in (see the module docstring); results do not depend on
    it. ``log``: told as each candidate's estimates are done.

    Returns (the record, {candidate: out-of-fold raw estimates (N,) under the grouped folds, NaN where
    unscored}); a closed-form winner's calibration is fitted on its own (``training.fit.calibrate``)."""
    tried = [candidate(name) for name in candidates]
    with _other_thread(jobs) as pool:
        cv = CrossValidation(split, pool)
        cv.start([key for c in tried for key in c.needs(cv)])
        # the ridge-within candidates last: they may need more fits, once the others' scores are known
        rest = [c for c in tried if c.needs_to_be_chosen(cv)]
        estimates = _estimates([c for c in tried if c not in rest], cv, {}, len(tried), log)
        in_reach = contenders(rest, cv, [cv.overall_rho(raw) for raw, *_ in estimates.values()])
        made = [key for c in rest if c.name in in_reach for key in c.needs_to_be_chosen(cv)]
        cv.start(made)
        # a candidate out of reach whose fits a contender needs anyway is scored in full all the same
        complete = {c.name for c in rest if set(c.needs_to_be_chosen(cv)) <= set(made)}
        estimates = _estimates(rest, cv, estimates, len(tried), log, complete)
    out_of_reach = [c.name for c in rest if c.name not in complete]
    record = {"held_out": HELD_OUT_NOTE}
    if out_of_reach:
        record["out_of_reach"] = {"candidates": out_of_reach, "note": OUT_OF_REACH_NOTE}
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
        "fold_members": min(split.cv_members or split.members, split.members),
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


def contenders(rest: list, cv: CrossValidation, known: list[float]) -> set[str]:
    """The names of the candidates of ``rest`` (those with fits they need only to be chosen,
    ``Candidate.needs_to_be_chosen``) that can still be level with the best: the top of their
    ``Candidate.score_range`` within :data:`LEVEL_BAND` of the best overall ρ sure to be reached (the
    ``known`` scores of the others, the bottoms of the ranges). The others cannot be chosen, nor be the
    best that the band is measured from, whatever those fits would give."""
    ranges = {c.name: c.score_range(cv) for c in rest}
    best = max([*known, *(low for low, _ in ranges.values())], default=-np.inf)
    return {name for name, (_, high) in ranges.items() if high >= best - LEVEL_BAND}


def _estimates(tried: list, cv: CrossValidation, done: dict, total: int, log: Callable[[str], None] | None,
               complete: set[str] | None = None) -> dict:
    """``done`` with each of ``tried``'s out-of-fold estimates added, each told to ``log`` as it is done;
    ``complete``: the names of those whose ``Candidate.needs_to_be_chosen`` fits were made (None: all)."""
    for c in tried:
        done[c.name] = c.out_of_fold(cv, complete is None or c.name in complete)
        if log:
            log(f"  candidate {len(done)} of {total} cross-validated: {c.name}")
    return done


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
