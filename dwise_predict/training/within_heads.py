"""The ridge-within heads fitted fold by fold, and ``ridge-within+signals``' blend weight chosen from them.

Both ``ridge-within`` candidates (``training.candidates``) are scored from one set of fold fits: per
fold, the two-stage ridge (:class:`~dwise_predict.survival.linear.RidgeHead` with groups) and the
signal-feature head on its standardisation (:class:`~dwise_predict.survival.linear.SignalFeatureHead`),
under the grouped folds and under leave-one-category-out folds; each fold's fit chooses its
standardisation and penalties on its own requests (docs/training.md, "Speed"). These fits draw
nothing from torch's global RNG (their members are built blank), so ``training.select`` runs them
in its threads beside the survival fits: one :func:`fold_heads` each, put together by
:func:`gather_heads`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.linear import RidgeHead, SignalFeatureHead, Standardised

BLEND_WEIGHTS = (0.25, 0.4, 0.5, 0.6, 0.75)  # share of ridge-within in ridge-within+signals
DEFAULT_BLEND_WEIGHT = 0.5  # both heads alike, kept unless CV finds a weight clearly better


def head_scores(fit_in: RefineInputs, val_in: RefineInputs, remaining, events, groups,
                seed, standardised: Standardised | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validation log-scores of ridge-within and of the signal-feature head fitted on ``fit_in``, and
    ridge-within's raw estimate (its graph's output: candidate ``ridge-within``). ``standardised``:
    ``fit_in``'s, when other heads fitted on those requests share it."""
    like = None if standardised is None else standardised.base
    ridge = RidgeHead().fit(fit_in, remaining, events, like=like, groups=groups)
    features = SignalFeatureHead(seed=seed).fit(ridge.base_, fit_in, remaining, events)
    return ridge.score(val_in), features.score(val_in), ridge.ensemble().predict_raw(val_in)


def choose_blend_weight(inputs: RefineInputs, remaining, events, groups, fold, seed: int = 0,
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

    ``by_prompt``, ``by_category``: :func:`out_of_fold_heads` under ``fold`` and under
    leave-one-category-out folds, when the caller has them already.

    Returns (weight, {weight: scores, "rule": how the weight was chosen}, the blend's out-of-fold
    log-scores under ``fold`` (N,))."""
    groups = np.asarray(groups).astype(str)
    by_prompt = by_prompt or out_of_fold_heads(inputs, remaining, events, groups, fold, seed)
    by_category = by_category or out_of_fold_heads(inputs, remaining, events, groups, category_folds(groups), seed)
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
    return float(chosen), scores, blended(chosen, by_prompt)


def unchosen_blend_weight(remaining, events, groups, by_prompt: tuple) -> tuple[float, dict, np.ndarray]:
    """:func:`choose_blend_weight`'s answer where the leave-one-category-out refits were not made (the
    candidate cannot be chosen, ``training.select``): the default weight, each weight's grouped-CV
    within-category ρ with its held-out ρ and the rule's figures null, and the blend's log-scores
    under the grouped folds at the default (N,)."""
    groups = np.asarray(groups).astype(str)
    scores = {str(w): {"cv_within_category": _blend_within(w, by_prompt[0], by_prompt[1], remaining, events, groups)[0],
                       "cv_held_out_category": None} for w in BLEND_WEIGHTS}
    scores["rule"] = {"default": DEFAULT_BLEND_WEIGHT, "best": None, "gain_over_default": None, "standard_error": None}
    return DEFAULT_BLEND_WEIGHT, scores, blended(DEFAULT_BLEND_WEIGHT, by_prompt)


def blended(weight: float, heads: tuple) -> np.ndarray:
    """The blend's log-scores (N,): ``weight`` of ridge-within's, the rest the signal-feature head's
    (``heads``: :func:`out_of_fold_heads`' three arrays)."""
    return weight * heads[0] + (1.0 - weight) * heads[1]


def out_of_fold_heads(inputs: RefineInputs, remaining, events, groups, fold,
                      seed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Out-of-fold log-scores (N,) of ridge-within and of the signal-feature head, and ridge-within's
    raw estimates (N,) (NaN where unscored), the folds fitted here in order."""
    return gather_heads(fold, partial(fold_heads, inputs, remaining, events, groups, fold, seed=seed))


def scored_folds(fold: np.ndarray) -> list[int]:
    """The folds of ``fold`` (N,) with at least 8 requests outside them to fit on; the others stay
    unscored."""
    return [int(k) for k in np.unique(fold) if (fold != k).sum() >= 8]


def fold_heads(inputs: RefineInputs, remaining, events, groups, fold, k: int,
               seed, standardised: Standardised | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`head_scores` of fold ``k``'s requests, the heads fitted on the other folds' requests
    (``standardised``: theirs, made already, its ``inputs`` fitted on)."""
    fit_rows, val_rows = fold != k, fold == k
    fit_in = inputs.rows(fit_rows) if standardised is None else standardised.inputs
    return head_scores(fit_in, inputs.rows(val_rows), remaining[fit_rows], events[fit_rows],
                       groups[fit_rows], seed, standardised)


def gather_heads(fold: np.ndarray, scores: Callable[[int], tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`out_of_fold_heads`' three arrays (N,) from ``scores(k)``, :func:`fold_heads` of each of
    the :func:`scored_folds`."""
    out = tuple(np.full(len(fold), np.nan) for _ in range(3))
    for k in scored_folds(fold):
        for whole, part in zip(out, scores(k)):
            whole[fold == k] = part
    return out


def category_folds(groups: np.ndarray) -> np.ndarray:
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
