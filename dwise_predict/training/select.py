"""Choosing the refinement predictor: candidates scored by grouped K-fold CV on the training split only.

Candidates (all one graph family, so all export under contract 2 — see
:mod:`dwise_predict.survival.linear`; every one sees only what the bundle receives: ``first_round``,
``prompt_tokens`` and ``budget``. The early signals are *not* bundle inputs, so no candidate uses them):

- ``survival`` — the paper's seed ensemble of survival MLPs (the reference);
- ``ridge`` — ridge of ``log1p(remaining)`` on the standardised state, penalty by leave-one-out;
- ``survival+ridge`` — both in one graph, the raw estimate averaged over all members;
- ``ridge-within`` — the ridge fitted in two stages, first on inputs centred within each category
  (directions that order requests *inside* a category, what an unseen category can reuse), then the
  residual's levels between categories; still one linear score, so serving needs no category;
- ``survival-pca`` — the ensemble trained on the top 32 principal components of the standardised
  input, the projection folded into the members' first layer (fewer weights than requests).

Folds are grouped by prompt text (requests sharing a prompt, e.g. one prompt at several budgets,
never sit on both sides) and dealt per category, so every validation fold holds every category.
Each candidate's out-of-fold raw estimates over the whole training split are scored by the mean
within-category Spearman ρ against remaining rounds (calibration is monotone, so the raw estimate
ranks as the shipped one does); the highest wins, ties going to the earlier candidate in
:data:`CANDIDATES` (the reference first). Everything is seeded by ``TrainConfig.seed``.
"""

from __future__ import annotations

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.survival.linear import RidgeHead, blend, fit_pca_survival
from dwise_predict.traces import TraceDataset

CANDIDATES = ("survival", "ridge", "survival+ridge", "ridge-within", "survival-pca")


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
                  groups=None):
    """Fit candidate ``name`` on ``inputs`` (hidden, prompt_tokens, budget): a fitted SurvivalEnsemble
    (the graph) and a record of what was chosen inside it (e.g. the ridge penalty). ``groups``: the
    requests' categories (``ridge-within`` needs them)."""
    if name in ("ridge", "ridge-within"):
        ridge = RidgeHead().fit(*inputs, remaining, events, groups=groups if name == "ridge-within" else None)
        return ridge.ensemble(), {"ridge": ridge.record()}
    if name == "survival-pca":
        return fit_pca_survival(make_ensemble, *inputs, remaining, events, progress=progress), {}
    ensemble = make_ensemble().fit(*inputs, remaining, events, progress=progress)
    if name == "survival":
        return ensemble, {}
    ridge = RidgeHead().fit(*inputs, remaining, events, like=ensemble)
    return blend(ensemble, ridge), {"ridge": ridge.record()}


def cross_validate(
    train: TraceDataset, inputs: tuple, remaining: np.ndarray, events: np.ndarray, make_ensemble, folds: int, seed: int,
    candidates: tuple[str, ...] = CANDIDATES,
) -> dict:
    """Out-of-fold raw estimates of every candidate and their scores (the candidates.json dict)."""
    fold = grouped_folds(train, folds, seed)
    n = len(train)
    oof = {name: np.full(n, np.nan) for name in candidates}
    need_survival = any(c in ("survival", "survival+ridge") for c in candidates)
    cats = train.requests["category"].astype(str).to_numpy()
    for k in range(folds):
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
        ridge = RidgeHead().fit(*fit_in, remaining[fit_rows], events[fit_rows], like=ridge_like)
        ridge_raw = ridge.ensemble().predict_raw(*val_in)
        if "ridge" in oof:
            oof["ridge"][val_rows] = ridge_raw
        if "survival+ridge" in oof:
            oof["survival+ridge"][val_rows] = (members * surv + ridge_raw) / (members + 1)
        if "survival-pca" in oof:
            pca = fit_pca_survival(make_ensemble, *fit_in, remaining[fit_rows], events[fit_rows])
            oof["survival-pca"][val_rows] = pca.predict_raw(*val_in)
        if "ridge-within" in oof:
            within = RidgeHead().fit(*fit_in, remaining[fit_rows], events[fit_rows], groups=cats[fit_rows])
            oof["ridge-within"][val_rows] = within.ensemble().predict_raw(*val_in)
    scored = events & np.isfinite(oof[candidates[0]])
    scores = {}
    for name in candidates:
        pred, true = oof[name][scored], remaining[scored]
        within, per = M.within_category(pred, true, cats[scored])
        scores[name] = {"cv_within_category": within, "cv_spearman": M.spearman(pred, true), "cv_per_category": per}
    chosen = max(candidates, key=lambda c: (_value(scores[c]["cv_within_category"]), -candidates.index(c)))
    return {
        "mode": "cv",
        "folds": folds,
        "grouping": "prompt text, dealt per category",
        "criterion": "mean within-category Spearman rho of out-of-fold raw estimates (train split only)",
        "n_scored": int(scored.sum()),
        "candidates": scores,
        "chosen": chosen,
    }


def _value(x) -> float:
    return -np.inf if x is None else float(x)
