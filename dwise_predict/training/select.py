"""Choosing the refinement predictor: candidates scored by grouped K-fold CV on the training split only.

Candidates (all one graph family, so all export under contract 2 — see
:mod:`dwise_predict.survival.linear`; every one sees only what the bundle receives: ``first_round``,
``prompt_last``, ``prompt_tokens``, ``budget`` and the first round's ``early_signals``):

- ``survival`` — the paper's seed ensemble of survival MLPs (the reference);
- ``ridge`` — ridge of ``log1p(remaining)`` on the standardised input, penalty by leave-one-out;
- ``survival+ridge`` — both in one graph, the raw estimate averaged over all members;
- ``ridge-within`` — the ridge fitted in two stages, first on inputs centred within each category
  (directions that order requests *inside* a category, what an unseen category can reuse), then the
  residual's levels between categories (penalty by leaving one category out), one such fit per
  hidden state averaged; still one linear score, so serving needs no category;
- ``survival-pca`` — the ensemble trained on the top 32 principal components of the standardised
  input, the projection folded into the members' first layer (fewer weights than requests);
- ``ridge-within+signals`` — ``ridge-within`` blended on the log scale with a bag of ridges on
  random GELU features of prompt tokens, budget and the early signals (the non-linear part of seed
  001's signals that a linear head misses); the blend weight is :data:`DEFAULT_BLEND_WEIGHT` unless
  another entry of :data:`BLEND_WEIGHTS` scores clearly better under grouped and
  leave-one-category-out CV on the training split (:func:`choose_blend_weight`).

Folds are grouped by prompt text (requests sharing a prompt, e.g. one prompt at several budgets,
never sit on both sides) and dealt per category, so every validation fold holds every category.
The choice is made on what the scheduler does with the estimate (seed 000's Algorithm 1 ranks every
request together by remaining work ``P + r̂``; when ``r̂`` is set after the first denoising round the
prompt is done, ``P = 0``): each candidate's out-of-fold raw estimates over the whole training split
are calibrated fold by fold (:func:`calibrated_out_of_fold`, so they are on the scale the scheduler
sees) and scored by their Spearman ρ against remaining rounds over all requests (``cv_spearman``).
The candidates within :data:`LEVEL_BAND` of the best are level with it, and among them the best mean
within-category ρ wins (:func:`choose`), ties going to the earlier candidate in :data:`CANDIDATES`
(the reference first). Held-out-category ρ is reported, not chosen on (:data:`HELD_OUT_NOTE`).
Everything is seeded by ``TrainConfig.seed``. Until 2026-12 the choice was by within-category ρ
alone: on sets where the categories' levels carry the work it shipped heads that order requests
inside categories and rank them all far worse (docs/training.md).

With ``jobs=2`` the CV runs in two threads (torch and numpy release the GIL inside their kernels):
this one fits the survival candidates fold by fold while the other fits the ``ridge-within`` folds,
then takes a share of those that are left. The survival fits all stay in this one, one after another:
their dropout draws from torch's global RNG, which each member seeds, and nothing in the
``ridge-within`` fits draws from it (their closed-form members are built blank, see
``HazardMLP.blank``); so the results are the same for any ``jobs``. On the 2-core machine the
2,048 x 2,048 benchmark took 49-55 s this way against 88 s in one thread (2026-12-01).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.labels import RemainingRoundsLabels
from dwise_predict.survival.linear import (
    RidgeHead, SignalFeatureHead, blend, blend_heads, fit_pca_survival, linear_raw,
)
from dwise_predict.traces import TraceDataset

CANDIDATES = ("survival", "ridge", "survival+ridge", "ridge-within", "survival-pca", "ridge-within+signals")
BLEND_WEIGHTS = (0.25, 0.4, 0.5, 0.6, 0.75)  # share of ridge-within in ridge-within+signals
DEFAULT_BLEND_WEIGHT = 0.5  # both heads alike, kept unless CV finds a weight clearly better
# fitted in closed form: a fold's fit is the final fit on fewer requests, so their out-of-fold estimates
# calibrate the final one (training.fit.calibrate); the survival networks' raw scale moves with training
CLOSED_FORM = ("ridge", "ridge-within", "ridge-within+signals")
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


def fit_candidate(name: str, inputs: tuple, remaining: np.ndarray, events: np.ndarray, make_ensemble, progress=None,
                  groups=None, fold=None, blend_weight: float | None = None, seed: int = 0):
    """Fit candidate ``name`` on ``inputs`` (hidden, prompt_tokens, budget, early_signals): a fitted
    SurvivalEnsemble (the graph) and a record of what was chosen inside it (e.g. the ridge penalty).
    ``groups``: the requests' categories (the ``ridge-within`` candidates need them); ``fold``: the
    grouped CV folds that choose ``ridge-within+signals``' blend weight when ``blend_weight`` is None;
    ``seed``: its random features' seed."""
    if name in ("ridge", "ridge-within"):
        ridge = RidgeHead().fit(*inputs, remaining, events, groups=groups if name == "ridge-within" else None)
        return ridge.ensemble(), {"ridge": ridge.record()}
    if name == "ridge-within+signals":
        record = {}
        if blend_weight is None:
            blend_weight, record["blend_cv"], _ = choose_blend_weight(inputs, remaining, events, groups, fold, seed)
        ridge = RidgeHead().fit(*inputs, remaining, events, groups=groups)
        features = SignalFeatureHead(seed=seed).fit(ridge.base_, *inputs, remaining, events)
        record.update(ridge=ridge.record(), signal_features=features.record(), blend_weight=blend_weight)
        return blend_heads(ridge, features, blend_weight), record
    if name == "survival-pca":
        return fit_pca_survival(make_ensemble, *inputs, remaining, events, progress=progress), {}
    ensemble = make_ensemble().fit(*inputs, remaining, events, progress=progress)
    if name == "survival":
        return ensemble, {}
    ridge = RidgeHead().fit(*inputs, remaining, events, like=ensemble)
    return blend(ensemble, ridge), {"ridge": ridge.record()}


def _head_scores(fit_in, val_in, remaining, events, groups, seed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validation log-scores of ridge-within and of the signal-feature head fitted on ``fit_in``, and
    ridge-within's raw estimate (its graph's output: candidate ``ridge-within``)."""
    ridge = RidgeHead().fit(*fit_in, remaining, events, groups=groups)
    features = SignalFeatureHead(seed=seed).fit(ridge.base_, *fit_in, remaining, events)
    return ridge.score(*val_in), features.score(*val_in), ridge.ensemble().predict_raw(*val_in)


def choose_blend_weight(inputs: tuple, remaining, events, groups, fold, seed: int = 0,
                        by_prompt: tuple | None = None, by_category: tuple | None = None) -> tuple[float, dict, np.ndarray]:
    """The blend weight of ``ridge-within+signals``, by the one-standard-error rule.

    Each :data:`BLEND_WEIGHTS` entry is scored per category by the mean of two out-of-fold
    within-category ρ on the training split: under the grouped folds ``fold`` (categories seen in
    training) and under leave-one-category-out folds (each category scored by heads fitted without
    it; grouped CV alone favours the hidden-state ridge, which ranks seen categories well and unseen
    ones poorly). The best-scoring weight replaces :data:`DEFAULT_BLEND_WEIGHT` only when it beats the
    default by more than one standard error of its own score over categories — the
    one-standard-error rule (Breiman et al. 1984; Hastie, Tibshirani & Friedman 2009, §7.10). Why
    not the best outright: with ~40 requests per category the scores of neighbouring weights differ
    by noise, and on four draws of the tiny model's workload the outright choice (0.4-0.75 across
    retrainings) cost 0.06 of held-out-category ρ against the default with nothing gained within
    categories.

    ``by_prompt``, ``by_category``: :func:`_out_of_fold_heads` under ``fold`` and under
    leave-one-category-out folds, when the caller has them already.

    Returns (weight, {weight: scores, "rule": how the weight was chosen}, the blend's out-of-fold
    log-scores under ``fold`` (N,))."""
    groups = np.asarray(groups).astype(str)
    by_prompt = by_prompt or _out_of_fold_heads(inputs, remaining, events, groups, fold, seed)
    by_category = by_category or _out_of_fold_heads(inputs, remaining, events, groups, _category_folds(groups), seed)
    scores, per_category = {}, {}
    for w in BLEND_WEIGHTS:
        seen, seen_per = _blend_within(w, by_prompt[0], by_prompt[1], remaining, events, groups)
        unseen, unseen_per = _blend_within(w, by_category[0], by_category[1], remaining, events, groups)
        scores[str(w)] = {"cv_within_category": seen, "cv_held_out_category": unseen}
        per_category[w] = _category_merit(seen_per, unseen_per, sorted(set(groups)))
    merit = {w: float(np.nanmean(v)) if np.isfinite(v).any() else -np.inf for w, v in per_category.items()}
    best = max(BLEND_WEIGHTS, key=lambda w: (merit[w], -abs(w - DEFAULT_BLEND_WEIGHT)))
    spread = per_category[best][np.isfinite(per_category[best])]
    se = float(spread.std(ddof=1) / np.sqrt(spread.size)) if spread.size >= 2 else np.inf
    gain = merit[best] - merit[DEFAULT_BLEND_WEIGHT]  # NaN when no category has a defined score
    chosen = best if gain > se else DEFAULT_BLEND_WEIGHT
    scores["rule"] = {"default": DEFAULT_BLEND_WEIGHT, "best": best,
                      "gain_over_default": float(gain) if np.isfinite(gain) else None,
                      "standard_error": se if np.isfinite(se) else None}
    return float(chosen), scores, chosen * by_prompt[0] + (1.0 - chosen) * by_prompt[1]


def _out_of_fold_heads(inputs, remaining, events, groups, fold, seed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Out-of-fold log-scores (N,) of ridge-within and of the signal-feature head, and ridge-within's
    raw estimates (N,) (NaN where unscored), the folds fitted here in order."""
    return _gather_heads(len(remaining), _submit_heads(inputs, remaining, events, groups, fold, seed, None))


def _submit_heads(inputs, remaining, events, groups, fold, seed, pool: Executor | None) -> list[tuple]:
    """Start :func:`_head_scores` for every fold (in ``pool``, or here when None): (validation rows,
    future, arguments) for :func:`_gather_heads`."""
    pending = []
    for k in np.unique(fold):
        fit_rows, val_rows = fold != k, fold == k
        if fit_rows.sum() < 8:
            continue
        args = (tuple(a[fit_rows] for a in inputs), tuple(a[val_rows] for a in inputs), remaining[fit_rows],
                events[fit_rows], groups[fit_rows], seed)
        pending.append((val_rows, _start(pool, _head_scores, *args), args))
    return pending


def _gather_heads(n: int, pending: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_out_of_fold_heads`' three arrays from :func:`_submit_heads`' fits."""
    # the fits the other thread has not started run here instead, now that this thread is free: last
    # first, as that thread takes them first to last
    here = {i: _head_scores(*args) for i, (_, fitted, args) in reversed(list(enumerate(pending))) if fitted.cancel()}
    ridge_oof, feature_oof, raw_oof = (np.full(n, np.nan) for _ in range(3))
    for i, (val_rows, fitted, _) in enumerate(pending):
        ridge_oof[val_rows], feature_oof[val_rows], raw_oof[val_rows] = here[i] if i in here else fitted.result()
    return ridge_oof, feature_oof, raw_oof


def _start(pool: Executor | None, fn, *args) -> Future:
    """``fn(*args)`` submitted to ``pool``, or run here at once when None (a finished future)."""
    if pool is not None:
        return pool.submit(fn, *args)
    done: Future = Future()
    done.set_result(fn(*args))
    return done


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


def _category_folds(groups: np.ndarray) -> np.ndarray:
    """Leave-one-category-out folds: each request's fold is its category's index."""
    return np.unique(groups, return_inverse=True)[1]


def _category_merit(seen: dict, unseen: dict, categories: list[str]) -> np.ndarray:
    """Per category, the mean of its defined grouped-CV and leave-one-category-out ρ (NaN if neither)."""
    merit = []
    for c in categories:
        values = [v for v in (seen.get(c), unseen.get(c)) if v is not None]
        merit.append(np.mean(values) if values else np.nan)
    return np.array(merit)


def _blend_within(weight, ridge_oof, feature_oof, remaining, events, groups) -> tuple[float | None, dict]:
    """Mean within-category ρ of the blend's out-of-fold scores, and the per-category values."""
    scored = np.asarray(events, bool) & np.isfinite(ridge_oof)
    pred = weight * ridge_oof[scored] + (1.0 - weight) * feature_oof[scored]
    return M.within_category(pred, remaining[scored], groups[scored])


def cross_validate(
    train: TraceDataset, inputs: tuple, remaining: np.ndarray, events: np.ndarray, make_ensemble, folds: int, seed: int,
    candidates: tuple[str, ...] = CANDIDATES, jobs: int = 1,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Every candidate's out-of-fold estimates, their scores and the choice (the candidates.json dict).

    Under the grouped folds each candidate's out-of-fold raw estimates are calibrated fold by fold
    (:func:`calibrated_out_of_fold`) and scored as the scheduler uses them, all requests ranked
    together: ``cv_spearman``, the primary criterion; ``cv_within_category`` and, under
    leave-one-category-out folds, ``cv_held_out_category`` are reported beside it, and
    within-category ρ breaks ties (:func:`choose`). ``ridge-within+signals`` is scored at its blend
    weight chosen on the same out-of-fold estimates (see :func:`choose_blend_weight`; when the rule
    leaves the default, a choice made on the validation folds, so its scores are then slightly
    optimistic against the others'). ``jobs``: 2 runs the ``ridge-within`` fits in a second thread (see
    the module docstring); results do not depend on it.

    Returns (the record, {candidate: out-of-fold raw estimates (N,) under the grouped folds, NaN where
    unscored}); a closed-form winner's calibration is fitted on its own (``training.fit.calibrate``)."""
    fold = grouped_folds(train, folds, seed)
    cats = train.requests["category"].astype(str).to_numpy()
    by_category = _category_folds(cats)
    num_rounds = RemainingRoundsLabels().fit(remaining, events).out_features  # K, as every candidate's graph
    ridge_within = any(c in ("ridge-within", "ridge-within+signals") for c in candidates)
    with _other_thread(jobs) as pool:
        # ridge-within's fits start first (one set serves both of its candidates, under both fold sets);
        # with jobs = 2 they run beside the survival fits below
        pending = [_submit_heads(inputs, remaining, events, cats, f, seed, pool)
                   for f in (fold, by_category)] if ridge_within else []
        oof = _fold_estimates(inputs, remaining, events, make_ensemble, fold, candidates)
        held = {name: np.full(len(train), np.nan) for name in candidates}
        if "ridge" in held:  # exact without refits (RidgeHead.held_out_scores)
            ridge = RidgeHead().fit(*inputs, remaining, events)
            held["ridge"] = linear_raw(ridge.held_out_scores(*inputs, remaining, events, cats), num_rounds)
        heads = [_gather_heads(len(train), p) for p in pending]
    record = {"held_out": HELD_OUT_NOTE}
    if "ridge-within" in oof:
        oof["ridge-within"], held["ridge-within"] = heads[0][2], heads[1][2]
    if "ridge-within+signals" in oof:
        weight, by_weight, score = choose_blend_weight(inputs, remaining, events, cats, fold, seed, by_prompt=heads[0],
                                                       by_category=heads[1])
        oof["ridge-within+signals"] = linear_raw(score, num_rounds)
        held["ridge-within+signals"] = linear_raw(weight * heads[1][0] + (1.0 - weight) * heads[1][1], num_rounds)
        record.update(blend_weight=weight, blend_cv=by_weight)
    scored = events & np.isfinite(oof[candidates[0]])
    scores = {name: _scores(oof[name], held[name], remaining, scored, cats, fold, num_rounds) for name in candidates}
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
    fake), then the earlier candidate of :data:`CANDIDATES`."""
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


def _fold_estimates(inputs, remaining, events, make_ensemble, fold, candidates) -> dict[str, np.ndarray]:
    """Out-of-fold raw estimates (N,) of each candidate that is not a ``ridge-within`` one (those stay
    NaN, filled by the caller): the survival ensembles, the ridge and their blend, fold by fold."""
    oof = {name: np.full(len(remaining), np.nan) for name in candidates}
    need_survival = any(c in ("survival", "survival+ridge") for c in candidates)
    for k in np.unique(fold):
        fit_rows, val_rows = fold != k, fold == k
        if not val_rows.any() or fit_rows.sum() < 8:
            continue
        fit_in = tuple(a[fit_rows] for a in inputs)
        val_in = tuple(a[val_rows] for a in inputs)
        ridge_like = None
        if need_survival:
            ensemble = make_ensemble().fit(*fit_in, remaining[fit_rows], events[fit_rows])
            members = len(ensemble.members_)
            surv = ensemble.predict_raw(*val_in)
            ridge_like = ensemble
            if "survival" in oof:
                oof["survival"][val_rows] = surv
        if "ridge" in oof or "survival+ridge" in oof:
            ridge = RidgeHead().fit(*fit_in, remaining[fit_rows], events[fit_rows], like=ridge_like)
            ridge_raw = ridge.ensemble().predict_raw(*val_in)
            if "ridge" in oof:
                oof["ridge"][val_rows] = ridge_raw
            if "survival+ridge" in oof:
                oof["survival+ridge"][val_rows] = (members * surv + ridge_raw) / (members + 1)
        if "survival-pca" in oof:
            pca = fit_pca_survival(make_ensemble, *fit_in, remaining[fit_rows], events[fit_rows])
            oof["survival-pca"][val_rows] = pca.predict_raw(*val_in)
    return oof


def _value(x) -> float:
    return -np.inf if x is None else float(x)
