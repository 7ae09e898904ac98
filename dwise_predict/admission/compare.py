"""Regressor comparison for the admission predictor (the DWISE paper's Table 9) on the user's traces.

Every candidate sees the same three prompt features and the target ``log1p(total rounds)``. Ranking
quality is Spearman ρ between prediction and total rounds, averaged over K-fold cross-validation
folds of the training split. Cost is the median time of one request, single thread: from raw prompt
text (word/newline counts and tokenisation after the chat template included) and model-only (a
prepared 1 x 3 feature row). Each model is timed with its library's own single-row call
(``Booster.predict`` for LightGBM, ``inplace_predict`` for XGBoost, ``predict`` for scikit-learn);
an extra row times this package's compiled LightGBM path (``AdmissionModel.predict_one``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.metrics import spearman
from dwise_predict.admission.features import prompt_features
from dwise_predict.features.prompt import PromptFeaturizer
from dwise_predict.files import atomic_write_text, claim_output, write_csv, write_errors

CANDIDATES = (
    "Ridge",
    "MLP (256-256)",
    "XGBoost (100, depth 6)",
    "LightGBM (500, 31 leaves)",
    "LightGBM (1,000, 63 leaves)",
    "ExtraTrees (100)",
    "LightGBM (100, 15 leaves)",
)
COMPILED = "LightGBM (100, 15 leaves), compiled"


@dataclass
class Candidate:
    """A regressor: how to build it (fresh, seeded) and how it predicts one prepared row."""

    name: str
    build: Callable[[int], object]
    predict_row: Callable[[object, np.ndarray], float]


def candidates() -> list[Candidate]:
    """The seven regressors of Table 9, single-threaded."""
    import lightgbm as lgb
    import xgboost as xgb
    from sklearn.ensemble import ExtraTreesRegressor
    from sklearn.linear_model import Ridge
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def lgbm(n: int, leaves: int) -> Callable[[int], object]:
        return lambda seed: lgb.LGBMRegressor(
            n_estimators=n, num_leaves=leaves, random_state=seed, n_jobs=1, deterministic=True,
            force_row_wise=True, verbose=-1,
        )

    sk = lambda model, row: float(model.predict(row)[0])  # noqa: E731
    booster = lambda model, row: float(model.booster_.predict(row)[0])  # noqa: E731
    return [
        Candidate("Ridge", lambda seed: make_pipeline(StandardScaler(), Ridge(alpha=1.0)), sk),
        Candidate(
            "MLP (256-256)",
            lambda seed: make_pipeline(
                StandardScaler(),
                MLPRegressor(hidden_layer_sizes=(256, 256), early_stopping=True, max_iter=200, random_state=seed),
            ),
            sk,
        ),
        Candidate(
            "XGBoost (100, depth 6)",
            lambda seed: xgb.XGBRegressor(n_estimators=100, max_depth=6, n_jobs=1, random_state=seed),
            lambda model, row: float(model.get_booster().inplace_predict(row)[0]),
        ),
        Candidate("LightGBM (500, 31 leaves)", lgbm(500, 31), booster),
        Candidate("LightGBM (1,000, 63 leaves)", lgbm(1000, 63), booster),
        Candidate(
            "ExtraTrees (100)", lambda seed: ExtraTreesRegressor(n_estimators=100, n_jobs=1, random_state=seed), sk
        ),
        Candidate("LightGBM (100, 15 leaves)", lgbm(100, 15), booster),
    ]


def compare_regressors(
    train,
    folds: int = 5,
    seed: int = 0,
    featurizer: PromptFeaturizer | None = None,
    repeats: int = 300,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Cross-validated ρ and single-request time of each candidate on a trace dataset's requests.

    Parameters
    ----------
    train : TraceDataset (pass the train split).
    folds : K of K-fold cross-validation (shuffled, seeded).
    featurizer : raw text -> features; whitespace tokens when None.
    repeats : single-request timings per model (the median is reported).

    Returns
    -------
    one dict per row: ``name``, ``rho`` (mean over the folds where it is defined; None if none),
    ``rho_std``, ``ms_from_text``, ``us_model_only``.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # one thread, as the timings promise (and BLAS oversubscription is slow)
        return _compare(train, folds, seed, featurizer, repeats, progress)


# the MLP's early stopping holds out a tenth of its training rows, rounded up, and needs two of them
MIN_FOLD_TRAIN = 11


def check_folds(n_train: int, folds: int) -> None:
    """Raise :class:`InputError` unless ``n_train`` requests fill ``folds`` folds: each held-out fold
    needs two requests (a rank correlation), each training fold :data:`MIN_FOLD_TRAIN`."""
    if folds < 2:
        raise InputError(f"`folds` must be >= 2, got {folds}")
    if n_train < folds * 2:
        raise InputError(f"{n_train} training requests cannot fill {folds} folds (need at least {folds * 2}): "
                         "use fewer folds")
    smallest = n_train - -(-n_train // folds)
    if smallest < MIN_FOLD_TRAIN:
        raise InputError(f"{n_train} training requests leave {smallest} to fit on in a fold, fewer than the "
                         f"{MIN_FOLD_TRAIN} the MLP's early stopping needs: collect more requests"
                         + (" or use fewer folds" if folds > 2 else ""))


def _compare(train, folds, seed, featurizer, repeats, progress) -> list[dict]:
    from sklearn.model_selection import KFold

    check_folds(len(train), folds)
    x = prompt_features(train.requests).astype(np.float64)
    y = np.log1p(train.requests["total_rounds"].to_numpy(dtype=np.float64))
    prompts = train.requests["prompt"].astype(str).tolist()
    featurizer = featurizer or PromptFeaturizer(None)
    splits = list(KFold(folds, shuffle=True, random_state=seed).split(x))
    rows = []
    for cand in candidates():
        if progress:
            progress(cand.name)
        rhos = []
        for tr, te in splits:
            model = cand.build(seed).fit(x[tr], y[tr])
            rho = spearman(model.predict(x[te]), y[te])
            if rho is not None:  # a constant prediction (too little data for a split) has no ρ
                rhos.append(rho)
        model = cand.build(seed).fit(x, y)
        row_of = lambda text: np.asarray([featurizer(text)], dtype=np.float64)  # noqa: E731
        rows.append(
            {
                "name": cand.name,
                "rho": float(np.mean(rhos)) if rhos else None,
                "rho_std": float(np.std(rhos)) if rhos else None,
                "ms_from_text": median_time(lambda text: cand.predict_row(model, row_of(text)), prompts, repeats) * 1e3,
                "us_model_only": median_time(lambda row: cand.predict_row(model, row), [x[:1]], repeats) * 1e6,
            }
        )
        if cand.name == "LightGBM (100, 15 leaves)":
            rows.append(_compiled_row(x, y, seed, featurizer, prompts, repeats, rows[-1]))
    return rows


def _compiled_row(x, y, seed, featurizer, prompts, repeats, reference: dict) -> dict:
    """Timing of the admission model's compiled path (same trees, same ρ as the LightGBM row)."""
    from dwise_predict.admission.model import AdmissionModel

    model = AdmissionModel(seed=seed).fit(x, np.expm1(y))
    w, nl, t = x[0]
    return {
        "name": COMPILED,
        "rho": reference["rho"],
        "rho_std": reference["rho_std"],
        "ms_from_text": median_time(lambda text: model.predict_one(*featurizer(text)), prompts, repeats) * 1e3,
        "us_model_only": median_time(lambda _: model.predict_one(w, nl, t), [None], repeats) * 1e6,
    }


def median_time(fn: Callable, inputs: list, repeats: int) -> float:
    """Median seconds of ``fn(input)`` over ``repeats`` calls cycling through ``inputs`` (after warm-up)."""
    for item in inputs[:5]:
        fn(item)
    times = np.empty(repeats)
    for i in range(repeats):
        item = inputs[i % len(inputs)]
        start = time.perf_counter()
        fn(item)
        times[i] = time.perf_counter() - start
    return float(np.median(times))


def to_markdown(rows: list[dict], folds: int, tokenizer_note: str) -> str:
    """The comparison as a Markdown table with a note on how text was tokenised."""
    lines = [
        f"| Predictor | ρ ({folds}-fold CV) | Time from text (ms) | Model only (µs) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        rho = "n/a" if r["rho"] is None else f"{r['rho']:.3f} ± {r['rho_std']:.3f}"
        lines.append(f"| {r['name']} | {rho} | {r['ms_from_text']:.3f} | {r['us_model_only']:.1f} |")
    return "\n".join(lines) + f"\n\nTokenisation: {tokenizer_note}. Times: median of single requests, one thread.\n"


OUTPUT_FILES = ("regressors.csv", "regressors.md")  # all a comparison's --out holds


def claim_comparison_out(out: str | os.PathLike, traces: str | os.PathLike):
    """Check ``out`` can take a comparison and lock it for the ``with`` block
    (:func:`dwise_predict.files.claim_output`): an earlier comparison there is replaced, a folder
    holding anything else (yours, or another command's) never is."""
    return claim_output(out, [("TRACES", traces)], "a regressor comparison", OUTPUT_FILES[0], replace=True,
                        contents=OUTPUT_FILES)


def write_comparison(rows: list[dict], out: str | os.PathLike, folds: int, tokenizer_note: str) -> list[Path]:
    """``regressors.csv`` and ``regressors.md`` in ``out`` (created); returns their paths."""
    out = Path(out)
    with write_errors(out, "free space or fix permissions and rerun the same command"):
        out.mkdir(parents=True, exist_ok=True)
        return [write_csv(out / OUTPUT_FILES[0], rows),
                atomic_write_text(out / OUTPUT_FILES[1], to_markdown(rows, folds, tokenizer_note))]
