"""Fitting both predictors on a trace dataset and scoring them on another (no file I/O).

- :func:`fit_predictors` — admission LightGBM + survival ensemble + isotonic calibration fitted on
  one :class:`~dwise_predict.traces.TraceDataset` (leave-one-category-out evaluation calls it once
  per category);
- :func:`evaluate_predictors` — the metrics.json dict on another dataset;
- :func:`torch_threads` (from :mod:`dwise_predict.threads`) — torch on a fixed thread count, so results do not
  depend on the machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np

from dwise_predict import metrics as M
from dwise_predict.threads import torch_threads
from dwise_predict.admission.features import prompt_features
from dwise_predict.admission.model import AdmissionModel
from dwise_predict.errors import ConfigError, TraceError
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.traces import TraceDataset
from dwise_predict.training.candidates import TrainingSplit, candidate
from dwise_predict.training.config import TrainConfig, default_jobs
from dwise_predict.training.select import cross_validate, grouped_folds

CENSORED_COLUMN = "censored"


@dataclass
class Targets:
    """What a dataset says about each request's work: total rounds, remaining after the first, finished?"""

    total: np.ndarray  # (N,) float64, total denoising rounds
    remaining: np.ndarray  # (N,) int64, total - 1
    events: np.ndarray  # (N,) bool, False where collection was cut short (censored)

    @classmethod
    def of(cls, ds: TraceDataset) -> "Targets":
        total = ds.requests["total_rounds"].to_numpy(dtype=np.float64)
        if (total < 1).any():
            raise TraceError("total_rounds must be >= 1 (every request has a first denoising round): fix those rows")
        events = np.ones(len(ds), dtype=bool)
        if CENSORED_COLUMN in ds.requests.columns:
            censored = ds.requests[CENSORED_COLUMN]
            if censored.isna().any():
                raise TraceError(f"column '{CENSORED_COLUMN}' holds missing values: use true/false")
            events = ~censored.to_numpy().astype(bool)
        return cls(total, (total - 1).astype(np.int64), events)


@dataclass
class Predictors:
    """Both fitted predictors plus the calibration; predictions for any trace dataset of the same model."""

    admission: AdmissionModel
    ensemble: SurvivalEnsemble
    calibrator: IsotonicCalibrator
    n_train: int
    selection: dict = field(default_factory=dict)  # candidates.json: CV scores and the chosen candidate

    def admission_total(self, ds: TraceDataset) -> np.ndarray:
        """(N,) predicted total denoising rounds from the prompt features."""
        return self.admission.predict(prompt_features(ds.requests))

    def refined_raw(self, ds: TraceDataset) -> np.ndarray:
        """(N,) ensemble mean of remaining rounds after the first denoising round, uncalibrated."""
        return self.ensemble.predict_raw(refine_inputs(ds))

    def refined_remaining(self, ds: TraceDataset) -> np.ndarray:
        """(N,) calibrated remaining rounds (on the scale of actual remaining rounds)."""
        return self.calibrator.predict(self.refined_raw(ds))

    def predict_survival(self, ds: TraceDataset) -> np.ndarray:
        """(N, K) ensemble survival curves S(t) = P(remaining > t), t = 0..K-1."""
        return self.ensemble.predict_survival(refine_inputs(ds))

    def refine_graph(self):
        """The calibrated ensemble as one torch graph (``network.RefineGraph``), as export builds it."""
        return self.ensemble.graph(self.calibrator.to_json())


def fit_predictors(
    train: TraceDataset,
    config: TrainConfig | None = None,
    progress: Callable[[int, int, float, float], None] | None = None,
    jobs: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Predictors:
    """Fit the admission model, the survival ensemble and the calibration on ``train`` (no file I/O).

    Parameters
    ----------
    train : the requests to fit on (all of them; pass ``ds.split("train")`` for the train split).
    config : the knobs; defaults to ``TrainConfig()``.
    progress : optional ``(member, epoch, train_loss, val_loss)`` callback after each epoch.
    jobs : threads for the candidates' cross-validation (``training.select``; None: 2 when the cores
        hold two of ``config.num_threads`` each); above 1 the admission model fits beside it. The
        predictors do not depend on it.
    log : optional, told as each stage starts (the admission model, each candidate cross-validated,
        the chosen one's fit, its calibration); the predictors do not depend on it.

    Raises
    ------
    TraceError / InputError / ConfigError for unusable data or options.
    """
    config = config or TrainConfig()
    config.check()
    if jobs is not None and jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    if len(train) < 8:
        raise TraceError(f"training needs at least 8 requests, got {len(train)}: collect more traces")
    log = log or _unlogged
    targets = Targets.of(train)
    features = prompt_features(train.requests)
    log(f"fitting the admission model (LightGBM) on {len(train)} requests")
    admission = AdmissionModel(
        n_estimators=config.admission_trees,
        num_leaves=config.admission_leaves,
        learning_rate=config.admission_learning_rate,
        min_child_samples=config.admission_min_child_samples,
        seed=config.seed,
        num_threads=config.num_threads,
    )
    jobs = default_jobs(2, config.num_threads) if jobs is None else jobs
    # with a second job the admission model (LightGBM and its import, ~2 s) fits beside the refinement
    with _beside(partial(admission.fit, features[targets.events], targets.total[targets.events]), jobs) as fitted:
        with torch_threads(config.num_threads):
            ensemble, calibrator, selection = _fit_refinement(train, targets, config, progress, jobs, log)
    return Predictors(fitted.result(), ensemble, calibrator, len(train), selection)


@contextmanager
def _beside(fit: Callable[[], object], jobs: int) -> Iterator[Future]:
    """``fit()`` in a thread of its own while the block runs when ``jobs`` > 1, else first; its future."""
    if jobs <= 1:
        done: Future = Future()
        done.set_result(fit())
        yield done
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwise-admission") as pool:
        yield pool.submit(fit)


def _unlogged(message: str) -> None:
    """The default ``log``: nothing."""


def _fit_refinement(train: TraceDataset, targets: Targets, config: TrainConfig, progress, jobs: int,
                    log: Callable[[str], None]) -> tuple:
    """The chosen refinement candidate (by CV when ``config.refine == "auto"``), its calibration and
    the selection record."""
    split = training_split(train, targets, config)
    out_of_fold = None
    if config.refine == "auto":
        log(f"choosing the refinement predictor: each candidate's {config.cv_folds}-fold cross-validation")
        selection, estimates = cross_validate(split, config.cv_folds, jobs=jobs, log=log)
        if candidate(selection["chosen"]).closed_form:
            out_of_fold = estimates[selection["chosen"]]
    else:
        selection = {"mode": "fixed", "candidates": {}, "chosen": config.refine}
    log(f"fitting the refinement predictor ({selection['chosen']}) on {len(train)} requests")
    ensemble, inner = candidate(selection["chosen"]).fit(split, progress, blend_weight=selection.get("blend_weight"))
    selection.update(inner)
    log("calibrating its estimates (isotonic map)")
    return ensemble, calibrate(ensemble, split.inputs, targets, config.calibration, out_of_fold), selection


def survival_ensemble(config: TrainConfig, members: int | None = None) -> SurvivalEnsemble:
    """An unfitted survival ensemble with ``config``'s knobs (each candidate that trains one makes its
    own); ``members``: only its first that many seeds' members (the cross-validation's fold fits)."""
    return SurvivalEnsemble(
        width=config.width,
        dropout=config.dropout,
        seeds=config.seeds[:members],
        max_epochs=config.max_epochs,
        patience=config.patience,
        lr=config.lr,
        weight_decay=config.weight_decay,
        batch_size=config.batch_size,
        val_fraction=config.val_fraction,
        split_seed=config.seed,
    )


def training_split(train: TraceDataset, targets: Targets, config: TrainConfig) -> TrainingSplit:
    """``train`` as the refinement candidates are fitted on it: inputs, targets, categories, the grouped
    CV folds of ``config.cv_folds`` and ``config``'s seed and survival ensemble."""
    return TrainingSplit(refine_inputs(train), targets.remaining, targets.events,
                         train.requests["category"].astype(str).to_numpy(),
                         grouped_folds(train, config.cv_folds, config.seed), config.seed,
                         partial(survival_ensemble, config), config.cv_members)


def calibrate(ensemble: SurvivalEnsemble, inputs: RefineInputs, targets: Targets, statistic: str,
              out_of_fold: np.ndarray | None = None) -> IsotonicCalibrator:
    """The isotonic map from ``ensemble``'s raw estimate to remaining rounds, fitted on the finished
    training requests: on their out-of-fold raw estimates (``out_of_fold`` (N,), NaN where a fold was
    not scored) when the candidate search made them and the candidate is fitted in closed form
    (``Candidate.closed_form``), else on the ensemble's own estimates of its training requests (seed
    000's recipe).

    Why out of fold for the closed-form heads: the map is applied to requests the head never saw,
    and on its own training requests a ridge on 2H + 6 columns fitted to a few hundred requests
    follows their rounds more closely than on new ones, and a map fitted there puts too many new
    requests below their actual rounds. A closed-form fit on (folds - 1) / folds of the requests
    behaves as the final fit does on new requests (the scheme of scikit-learn's
    ``CalibratedClassifierCV(ensemble=False)``). Why not for the survival networks: their raw scale
    moves with how far training got, which depends on how many requests a fit had, so a fold
    network's estimates are not on the final network's scale. Measured on synthetic sets with a
    known law: docs/training.md, "Calibration"."""
    done = targets.events
    if out_of_fold is not None:
        done = done & np.isfinite(out_of_fold)
        raw, fitted_on = out_of_fold[done], "train, out of fold"
    else:
        raw, fitted_on = ensemble.predict_raw(inputs.rows(done)), "train"
    return IsotonicCalibrator(statistic=statistic, fitted_on=fitted_on).fit(
        raw, targets.remaining[done], raw_range=(0.0, float(ensemble.num_rounds_)))


def evaluate_predictors(predictors: Predictors, eval_ds: TraceDataset, bootstrap: int = 1000, seed: int = 0) -> dict:
    """The metrics.json dict of ``predictors`` on ``eval_ds``.

    Rank metrics and ratios use the finished (uncensored) requests; the survival metrics use all,
    with their event flags. Admission ρ is against total rounds, refined ρ against remaining rounds
    (``total - 1``, the same ranking). ``None`` marks an undefined value (a constant side).
    """
    if len(eval_ds) == 0:
        raise TraceError("no evaluation requests: the traces need an 'eval' split (collect with an eval fraction)")
    targets = Targets.of(eval_ds)
    done = targets.events
    categories = eval_ds.requests["category"].astype(str).to_numpy()
    admission = predictors.admission_total(eval_ds)
    raw = predictors.refined_raw(eval_ds)
    calibrated = predictors.calibrator.predict(raw)
    survival = predictors.predict_survival(eval_ds)

    refined = M.rank_summary(calibrated[done], targets.remaining[done], categories[done], bootstrap, seed)
    refined["concordance_td"] = M.concordance_td(survival, targets.remaining, targets.events)
    last = min(survival.shape[1] - 1, int(targets.remaining.max()))
    refined["integrated_brier"] = (
        M.integrated_brier(survival, targets.remaining, targets.events, np.arange(last + 1)) if last >= 1 else None
    )
    return {
        "n_train": int(predictors.n_train),
        "n_eval": int(len(eval_ds)),
        "refine_candidate": predictors.ensemble.candidate,
        "admission": M.rank_summary(admission[done], targets.total[done], categories[done], bootstrap, seed),
        "refined": refined,
        "refined_raw": {
            "spearman": M.spearman(raw[done], targets.remaining[done]),
            "within_category_mean": M.within_category(raw[done], targets.remaining[done], categories[done])[0],
        },
        "calibration": {
            "median_ratio_admission": M.median_ratio(admission[done], targets.total[done]),
            "median_ratio_raw": M.median_ratio(raw[done], targets.remaining[done]),
            "median_ratio_calibrated": M.median_ratio(calibrated[done], targets.remaining[done]),
        },
    }


def refine_inputs(ds: TraceDataset) -> RefineInputs:
    """The refinement inputs of every request, as every candidate's fit and predict take them: the
    hidden states of ``names.HIDDEN_STATES`` side by side (N, 2H: ``first_round`` then
    ``prompt_last``), prompt_tokens (N,), budget (N,), early_signals (N, 4)."""
    return RefineInputs(
        np.concatenate([ds.first_round, ds.prompt_last], axis=1),
        ds.requests["prompt_tokens"].to_numpy(dtype=np.float32),
        ds.requests["budget"].to_numpy(dtype=np.float32),
        ds.early_signals,
    )
