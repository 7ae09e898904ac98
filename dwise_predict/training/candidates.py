"""The refinement candidates: one class each, and :data:`REGISTRY`, the order they are tried and reported.

All are one graph family, so all export under contract 2 (see :mod:`dwise_predict.survival.linear`);
every one sees only what the bundle receives (:class:`~dwise_predict.survival.inputs.RefineInputs`:
``first_round``, ``prompt_last``, ``prompt_tokens``, ``budget`` and the first round's ``early_signals``).

- ``survival`` — the DWISE paper's seed ensemble of survival MLPs (the reference);
- ``ridge`` — ridge of ``log1p(remaining)`` on the standardised input, penalty by leave-one-out;
- ``survival+ridge`` — both in one graph, the raw estimate averaged over all members;
- ``ridge-within`` — the ridge fitted in two stages, first on inputs centred within each category
  (directions that order requests *inside* a category, what an unseen category can reuse), then the
  residual's levels between categories (penalty by leaving one category out), one such fit per
  hidden state averaged; still one linear score, so serving needs no category;
- ``survival-pca`` — the ensemble trained on the top 32 principal components of the standardised
  input, the projection folded into the members' first layer (fewer weights than requests);
- ``ridge-within+signals`` — ``ridge-within`` blended on the log scale with a bag of ridges on
  random GELU features of prompt tokens, budget and the early signals (the non-linear part of Amin
  et al.'s signals that a linear head misses); the blend weight is
  :data:`~dwise_predict.training.within_heads.DEFAULT_BLEND_WEIGHT` unless another entry of
  ``BLEND_WEIGHTS`` scores clearly better under grouped and leave-one-category-out CV on the
  training split (:func:`~dwise_predict.training.within_heads.choose_blend_weight`).

A candidate says how it is fitted on the training split (:meth:`Candidate.fit`), which of the fits
the cross-validation shares it needs (:meth:`Candidate.needs`: the CV runs them in its threads), how
its out-of-fold estimates are made from them (:meth:`Candidate.out_of_fold`, given a
``training.select.CrossValidation``), whether it uses the ridge-within fold fits
(``uses_within_heads``) and whether it is fitted in closed form (``closed_form``). Every out-of-fold
estimate comes from fits that never saw the fold, standardisation and penalties included
(docs/training.md, "Speed"). A new candidate is one class here, appended to :data:`REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.linear import (
    RidgeHead, SignalFeatureHead, blend, blend_heads, fit_pca_survival, linear_raw,
)
from dwise_predict.training.within_heads import choose_blend_weight


@dataclass(frozen=True, eq=False)
class TrainingSplit:
    """What every candidate is fitted on: the training requests' inputs and targets (N each), their
    categories, their grouped CV folds, the seed and how to make an unfitted survival ensemble."""

    inputs: RefineInputs
    remaining: np.ndarray  # (N,) remaining rounds after the first
    events: np.ndarray  # (N,) bool, False where censored
    categories: np.ndarray  # (N,) str
    fold: np.ndarray  # (N,) grouped CV fold (training.select.grouped_folds)
    seed: int
    make_ensemble: Callable[[], SurvivalEnsemble]

    def rows(self, which) -> "TrainingSplit":
        """The requests selected by the boolean mask ``which``."""
        return TrainingSplit(self.inputs.rows(which), self.remaining[which], self.events[which],
                             self.categories[which], self.fold[which], self.seed, self.make_ensemble)


# one candidate's out-of-fold raw estimates (N,) under the grouped folds, under leave-one-category-out
# folds (NaN where not measured), and what it adds to candidates.json
Estimates = tuple[np.ndarray, np.ndarray, dict]


class Candidate:
    """One refinement candidate (see the module docstring for the list)."""

    name: str = ""
    # fitted in closed form: a fold's fit is the final fit on fewer requests, so its out-of-fold estimates
    # calibrate the final one (training.fit.calibrate); the survival networks' raw scale moves with training
    closed_form: bool = False
    uses_within_heads: bool = False  # its CV estimates come from the shared ridge-within fold fits
    # what its graph's survival curves are: "fitted" (trained hazard networks), "blend" (those and a
    # ridge member) or "geometric" (one hazard in every round, a linear score's: survival.linear), which
    # the report does not draw as if fitted
    survival_curves: str = "geometric"

    def fit(self, split: TrainingSplit, progress=None, blend_weight: float | None = None) -> tuple[SurvivalEnsemble, dict]:
        """The fitted graph (a :class:`SurvivalEnsemble`) and a record of what was chosen inside it
        (e.g. the ridge penalty). ``progress``: the survival members' epoch callback;
        ``blend_weight``: the one chosen by the CV, when there was one."""
        raise NotImplementedError

    def needs(self, cv) -> list[tuple]:
        """The fits of ``cv`` (a ``training.select.CrossValidation``) its out-of-fold estimates are
        made from: ``("survival", k)``, ``("pca", k)`` or ``("ridge", k)`` for fold ``k``'s fit,
        ``("ridge-held",)`` for the ridge's held-out-category estimates and ``cv.within_keys()`` for
        the ridge-within heads' fold fits."""
        raise NotImplementedError

    def out_of_fold(self, cv) -> Estimates:
        """Out-of-fold estimates from ``cv``, a ``training.select.CrossValidation``."""
        raise NotImplementedError

    def _not_held_out(self, cv) -> np.ndarray:
        return np.full(cv.size, np.nan)


class Survival(Candidate):
    name = "survival"
    survival_curves = "fitted"

    def fit(self, split, progress=None, blend_weight=None):
        return split.make_ensemble().fit(split.inputs, split.remaining, split.events, progress=progress), {}

    def needs(self, cv):
        return [("survival", k) for k in cv.folds]

    def out_of_fold(self, cv):
        # refitting a network per held-out category would more than double train's time
        return cv.out_of_fold(cv.survival_raw), self._not_held_out(cv), {}


class Ridge(Candidate):
    name = "ridge"
    closed_form = True

    def fit(self, split, progress=None, blend_weight=None):
        ridge = RidgeHead().fit(split.inputs, split.remaining, split.events)
        return ridge.ensemble(), {"ridge": ridge.record()}

    def needs(self, cv):
        return [("ridge", k) for k in cv.folds] + [("ridge-held",)]

    def out_of_fold(self, cv):
        # each category held out exactly, without refits (RidgeHead.held_out_scores)
        return cv.out_of_fold(cv.ridge_raw), cv.ridge_held_out(), {}


class SurvivalRidge(Candidate):
    name = "survival+ridge"
    survival_curves = "blend"

    def fit(self, split, progress=None, blend_weight=None):
        ensemble = split.make_ensemble().fit(split.inputs, split.remaining, split.events, progress=progress)
        ridge = RidgeHead().fit(split.inputs, split.remaining, split.events, like=ensemble)
        return blend(ensemble, ridge), {"ridge": ridge.record()}

    def needs(self, cv):
        return [(kind, k) for kind in ("survival", "ridge") for k in cv.folds]

    def out_of_fold(self, cv):
        return cv.out_of_fold(partial(self._fold, cv)), self._not_held_out(cv), {}

    @staticmethod
    def _fold(cv, k: int) -> np.ndarray:
        """The blend's raw estimate: the mean over the survival members and the ridge member."""
        (survival, members), ridge = cv.survival_fold(k), cv.ridge_raw(k)
        return (members * survival + ridge) / (members + 1)


class RidgeWithin(Candidate):
    name = "ridge-within"
    closed_form = True
    uses_within_heads = True

    def fit(self, split, progress=None, blend_weight=None):
        ridge = RidgeHead().fit(split.inputs, split.remaining, split.events, groups=split.categories)
        return ridge.ensemble(), {"ridge": ridge.record()}

    def needs(self, cv):
        return cv.within_keys()

    def out_of_fold(self, cv):
        by_prompt, by_category = cv.within_scores()
        return by_prompt[2], by_category[2], {}


class SurvivalPCA(Candidate):
    name = "survival-pca"
    survival_curves = "fitted"

    def fit(self, split, progress=None, blend_weight=None):
        return fit_pca_survival(split.make_ensemble, split.inputs, split.remaining, split.events, progress=progress), {}

    def needs(self, cv):
        return [("pca", k) for k in cv.folds]

    def out_of_fold(self, cv):
        return cv.out_of_fold(cv.pca_raw), self._not_held_out(cv), {}


class RidgeWithinSignals(Candidate):
    name = "ridge-within+signals"
    closed_form = True
    uses_within_heads = True

    def fit(self, split, progress=None, blend_weight=None):
        record = {}
        if blend_weight is None:
            blend_weight, record["blend_cv"], _ = choose_blend_weight(
                split.inputs, split.remaining, split.events, split.categories, split.fold, split.seed)
        ridge = RidgeHead().fit(split.inputs, split.remaining, split.events, groups=split.categories)
        features = SignalFeatureHead(seed=split.seed).fit(ridge.base_, split.inputs, split.remaining, split.events)
        record.update(ridge=ridge.record(), signal_features=features.record(), blend_weight=blend_weight)
        return blend_heads(ridge, features, blend_weight), record

    def needs(self, cv):
        return cv.within_keys()

    def out_of_fold(self, cv):
        """At the blend weight chosen on the same out-of-fold estimates (when the rule leaves the
        default, a choice made on the validation folds, so its scores are then slightly optimistic
        against the others')."""
        split, (by_prompt, by_category) = cv.split, cv.within_scores()
        weight, by_weight, score = choose_blend_weight(split.inputs, split.remaining, split.events, split.categories,
                                                       split.fold, split.seed, by_prompt=by_prompt,
                                                       by_category=by_category)
        held = weight * by_category[0] + (1.0 - weight) * by_category[1]
        return (linear_raw(score, cv.num_rounds), linear_raw(held, cv.num_rounds),
                {"blend_weight": weight, "blend_cv": by_weight})


REGISTRY: tuple[Candidate, ...] = (Survival(), Ridge(), SurvivalRidge(), RidgeWithin(), SurvivalPCA(),
                                   RidgeWithinSignals())
NAMES = tuple(c.name for c in REGISTRY)  # ties in the choice go to the earlier one: the reference first
SURVIVAL_CURVES = {c.name: c.survival_curves for c in REGISTRY}


def candidate(name: str) -> Candidate:
    """The registered candidate called ``name``."""
    for c in REGISTRY:
        if c.name == name:
            return c
    raise ConfigError(f"no refinement candidate {name!r}; known: {', '.join(NAMES)}")
