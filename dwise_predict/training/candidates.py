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
the cross-validation shares it needs for its overall score (:meth:`Candidate.needs`: the CV runs them
in its threads) and which only where it can still be chosen (:meth:`Candidate.needs_to_be_chosen`,
with :meth:`Candidate.score_range`: the ridge-within heads' leave-one-category-out refits), how its
out-of-fold estimates are made from them (:meth:`Candidate.out_of_fold`, given a
``training.select.CrossValidation``) and whether it is fitted in closed form (``closed_form``).
Every out-of-fold estimate comes from fits that never saw the fold, standardisation and penalties included
(docs/training.md, "Speed"). A new candidate is one class here, appended to :data:`REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Callable

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.linear import (
    RidgeHead, SignalFeatureHead, blend, blend_heads, fit_pca_survival, linear_raw,
)
from dwise_predict.training.within_heads import BLEND_WEIGHTS, blended, choose_blend_weight, unchosen_blend_weight


@dataclass(frozen=True, eq=False)
class TrainingSplit:
    """What every candidate is fitted on: the training requests' inputs and targets (N each), their
    categories, their grouped CV folds, the seed, how to make an unfitted survival ensemble (all its
    members, or its first ``n`` with ``make_ensemble(n)``) and how many members the cross-validation's
    fold fits of the network candidates have (``TrainConfig.cv_members``)."""

    inputs: RefineInputs
    remaining: np.ndarray  # (N,) remaining rounds after the first
    events: np.ndarray  # (N,) bool, False where censored
    categories: np.ndarray  # (N,) str
    fold: np.ndarray  # (N,) grouped CV fold (training.select.grouped_folds)
    seed: int
    make_ensemble: Callable[..., SurvivalEnsemble]
    cv_members: int

    def rows(self, which) -> "TrainingSplit":
        """The requests selected by the boolean mask ``which``."""
        return TrainingSplit(self.inputs.rows(which), self.remaining[which], self.events[which],
                             self.categories[which], self.fold[which], self.seed, self.make_ensemble, self.cv_members)

    def make_fold_ensemble(self) -> SurvivalEnsemble:
        """An unfitted ensemble of the cross-validation's fold fits: the first ``cv_members`` members
        (all when 0)."""
        return self.make_ensemble(self.cv_members or None)

    @property
    def members(self) -> int:
        """The shipped ensemble's members (one per seed)."""
        return len(self.make_ensemble().seeds)

    @cached_property
    def ridge(self) -> tuple[RidgeHead, np.ndarray]:
        """The one-stage ridge fitted on these requests and its held-out-category log-scores (N,)
        (``RidgeHead.fit_held_out``), made once: the search's held-out estimates of ``ridge`` and
        its final fit are the same fit (an eigendecomposition of the whole split's Gram matrix)."""
        ridge = RidgeHead()
        return ridge, ridge.fit_held_out(self.inputs, self.remaining, self.events, self.categories)


# one candidate's out-of-fold raw estimates (N,) under the grouped folds, under leave-one-category-out
# folds (NaN where not measured), and what it adds to candidates.json
Estimates = tuple[np.ndarray, np.ndarray, dict]


class Candidate:
    """One refinement candidate (see the module docstring for the list)."""

    name: str = ""
    # fitted in closed form: a fold's fit is the final fit on fewer requests, so its out-of-fold estimates
    # calibrate the final one (training.fit.calibrate); the survival networks' raw scale moves with training
    closed_form: bool = False
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
        ``("ridge-held",)`` for the ridge's held-out-category estimates and ``cv.within_keys(0)`` for
        the ridge-within heads' grouped fold fits."""
        raise NotImplementedError

    def needs_to_be_chosen(self, cv) -> list[tuple]:
        """The fits of ``cv`` it needs besides :meth:`needs` only where it can still be chosen (its
        :meth:`score_range` reaches the best's level band, ``training.select``): what it is scored on
        only to be reported (held-out-category ρ) or to settle a choice inside it (a blend weight)."""
        return []

    def score_range(self, cv) -> tuple[float, float]:
        """The lowest and highest ``cv_spearman`` its out-of-fold estimates can have whatever the
        :meth:`needs_to_be_chosen` fits give, from the :meth:`needs` fits alone (-inf: undefined);
        asked only of a candidate that has such fits."""
        raise NotImplementedError

    def out_of_fold(self, cv, complete: bool = True) -> Estimates:
        """Out-of-fold estimates from ``cv``, a ``training.select.CrossValidation``. ``complete``:
        False where its :meth:`needs_to_be_chosen` fits were not made (it cannot be chosen)."""
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

    def out_of_fold(self, cv, complete=True):
        # refitting a network per held-out category would more than double train's time
        return cv.out_of_fold(cv.survival_raw), self._not_held_out(cv), {}


class Ridge(Candidate):
    name = "ridge"
    closed_form = True

    def fit(self, split, progress=None, blend_weight=None):
        ridge = split.ridge[0]
        return ridge.ensemble(), {"ridge": ridge.record()}

    def needs(self, cv):
        return [("ridge", k) for k in cv.folds] + [("ridge-held",)]

    def out_of_fold(self, cv, complete=True):
        # each category held out exactly, without refits (RidgeHead.fit_held_out)
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

    def out_of_fold(self, cv, complete=True):
        return cv.out_of_fold(partial(self._fold, cv)), self._not_held_out(cv), {}

    @staticmethod
    def _fold(cv, k: int) -> np.ndarray:
        """The blend's raw estimate: the mean over the survival members and the ridge member, each
        weighted as in the shipped graph (the ridge one share in ``members + 1``, whatever number of
        members the fold fits have)."""
        members = cv.split.members
        return (members * cv.survival_raw(k) + cv.ridge_raw(k)) / (members + 1)


class RidgeWithin(Candidate):
    name = "ridge-within"
    closed_form = True

    def fit(self, split, progress=None, blend_weight=None):
        ridge = RidgeHead().fit(split.inputs, split.remaining, split.events, groups=split.categories)
        return ridge.ensemble(), {"ridge": ridge.record()}

    def needs(self, cv):
        return cv.within_keys(0)

    def needs_to_be_chosen(self, cv):
        return cv.within_keys(1)  # its held-out-category estimates

    def score_range(self, cv):
        rho = cv.overall_rho(cv.within_scores(0)[2])
        return rho, rho

    def out_of_fold(self, cv, complete=True):
        held = cv.within_scores(1)[2] if complete else self._not_held_out(cv)
        return cv.within_scores(0)[2], held, {}


class SurvivalPCA(Candidate):
    name = "survival-pca"
    survival_curves = "fitted"

    def fit(self, split, progress=None, blend_weight=None):
        return fit_pca_survival(split.make_ensemble, split.inputs, split.remaining, split.events, progress=progress), {}

    def needs(self, cv):
        return [("pca", k) for k in cv.folds]

    def out_of_fold(self, cv, complete=True):
        return cv.out_of_fold(cv.pca_raw), self._not_held_out(cv), {}


class RidgeWithinSignals(Candidate):
    name = "ridge-within+signals"
    closed_form = True

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
        return cv.within_keys(0)

    def needs_to_be_chosen(self, cv):
        return cv.within_keys(1)  # its held-out-category estimates, which the blend weight is chosen on too

    def score_range(self, cv):
        by_prompt = cv.within_scores(0)
        rhos = [cv.overall_rho(linear_raw(blended(w, by_prompt), cv.num_rounds)) for w in BLEND_WEIGHTS]
        return min(rhos), max(rhos)

    def out_of_fold(self, cv, complete=True):
        """At the blend weight chosen on the same out-of-fold estimates (when the rule leaves the
        default, a choice made on the validation folds, so its scores are then slightly optimistic
        against the others'); not ``complete``, at the default weight, none chosen."""
        split, by_prompt = cv.split, cv.within_scores(0)
        if complete:
            by_category = cv.within_scores(1)
            weight, by_weight, score = choose_blend_weight(split.inputs, split.remaining, split.events,
                                                           split.categories, split.fold, split.seed,
                                                           by_prompt=by_prompt, by_category=by_category)
            held = linear_raw(blended(weight, by_category), cv.num_rounds)
        else:
            weight, by_weight, score = unchosen_blend_weight(split.remaining, split.events, split.categories, by_prompt)
            held = self._not_held_out(cv)
        return linear_raw(score, cv.num_rounds), held, {"blend_weight": weight, "blend_cv": by_weight}


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
