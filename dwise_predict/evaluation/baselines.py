"""Baselines side by side on one split: what each signal says about remaining work.

Every row predicts the remaining denoising rounds after the first round (``total_rounds - 1``) of
each evaluation request, from what it may see, and is scored by Spearman ρ, Kendall τ, R² (on the
rounds scale) and mean within-category ρ against the actual remaining rounds:

- **admission LightGBM** — the shipped admission predictor (total estimate minus the first round);
- **survival on the prompt hidden state** — the full refinement recipe (candidate search included)
  retrained with the first-round state blanked, so it sees ``prompt_last`` (the pooled last prompt
  block) and the other inputs (prompt tokens, budget, early signals): does the denoised state add
  anything over what the model already read?;
- **early signals** (seed 001) — fraction over threshold, mean confidence, mean entropy and prompt
  length (:data:`EARLY_SIGNALS`: seed 001's four, not the bundle's four of
  :data:`dwise_predict.identity.EARLY_SIGNALS`, which have ``end_probability`` where this set has
  prompt length), each alone and all four together, through a small LightGBM (50 trees, 7 leaves)
  on ``log1p(remaining)``; seed 001 found R² ≤ 0.15 for each;
- **TRAIL-style probe** — a multinomial logistic classifier over quantile bins of remaining rounds
  on the first-round hidden state (its top 64 principal components); estimate = expected bin mean under its
  probabilities (TRAIL refines output-length estimates from runtime embeddings this way);
- **ridge on the first-round hidden state** — ridge regression (α chosen by cross-validation) on
  ``log1p(remaining)``;
- **refinement predictor (shipped)** — the run's refinement predictor on the bundle's inputs (both
  hidden states, prompt tokens, budget, the bundle's early signals), whichever candidate `train`
  chose (the paper's calibrated survival ensemble, or a ridge head, alone or blended with signal
  heads, in the same graph; see :mod:`dwise_predict.training.select`);
- **oracles** — the actual remaining rounds (ρ = 1, the ceiling), the actual output tokens (what a
  perfect output-length ranker would use; R² is not comparable there, tokens are not rounds), and
  for synthetic traces the true expected remaining rounds (``oracle_remaining``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dwise_predict.evaluation.pool import RetrainTask
from dwise_predict.metrics import kendall, r2, spearman, within_category
from dwise_predict.traces import TraceDataset

# column -> what it is (seed 001's four signals, available right after the first denoising round)
EARLY_SIGNALS = {
    "frac_over_threshold": "round 1: share of masked positions over the threshold",
    "mean_confidence": "round 1: mean top-1 probability",
    "mean_entropy": "round 1: mean predictive entropy",
    "prompt_tokens": "prompt length (tokens)",
}
PROBE_BINS = 8
PROBE_COMPONENTS = 64
PROMPT_HIDDEN_TASK = "__prompt_hidden_state__"  # a retraining's name; not a category name: categories are plain words


def remaining_rounds(ds: TraceDataset) -> np.ndarray:
    """Actual remaining rounds after the first denoising round, shape (n,)."""
    return ds.requests["total_rounds"].to_numpy(dtype=float) - 1.0


def prompt_hidden_task(train: TraceDataset, eval_ds: TraceDataset, config) -> RetrainTask:
    """The retraining behind the prompt-hidden-state baseline: the same requests with the first-round
    state blanked (zeros: a constant carries nothing), so the recipe sees ``prompt_last`` and the
    short inputs only (its ``"refined"`` prediction is that row)."""
    def with_prompt_state(ds: TraceDataset) -> TraceDataset:
        return dataclasses.replace(ds, first_round=np.zeros_like(ds.first_round))

    return RetrainTask(PROMPT_HIDDEN_TASK, with_prompt_state(train), with_prompt_state(eval_ds), config)


def score(pred, true, categories, comparable_scale: bool = True) -> dict:
    """ρ, τ, R² and mean within-category ρ of one row (None = n/a)."""
    mean, _ = within_category(pred, true, categories)
    return {
        "spearman": spearman(pred, true),
        "kendall": kendall(pred, true),
        "r2": r2(pred, true) if comparable_scale else None,
        "within_category_mean": mean,
    }


def _lightgbm_log(x_train, y_train, x_eval, seed: int) -> np.ndarray:
    """Small LightGBM on log1p(target); predictions back on the rounds scale."""
    import lightgbm as lgb

    model = lgb.LGBMRegressor(
        n_estimators=50, num_leaves=7, min_child_samples=10, learning_rate=0.1,
        random_state=seed, deterministic=True, n_jobs=1, verbose=-1,
    )
    model.fit(x_train, np.log1p(y_train))
    return np.expm1(model.predict(x_eval))


def _standardise(train: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, std = train.mean(axis=0), train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return (train - mean) / std, (other - mean) / std


def early_signal_predictions(train: TraceDataset, eval_ds: TraceDataset, seed: int = 0) -> dict[str, np.ndarray]:
    """Each early signal alone and all four together -> predicted remaining rounds on ``eval_ds``."""
    y = remaining_rounds(train)
    out = {}
    for columns in [(c,) for c in EARLY_SIGNALS] + [tuple(EARLY_SIGNALS)]:
        x_train = train.requests[list(columns)].to_numpy(dtype=float)
        x_eval = eval_ds.requests[list(columns)].to_numpy(dtype=float)
        out["+".join(columns) if len(columns) == 1 else "all four"] = _lightgbm_log(x_train, y, x_eval, seed)
    return out


def trail_probe(train: TraceDataset, eval_ds: TraceDataset, bins: int = PROBE_BINS, seed: int = 0) -> np.ndarray:
    """TRAIL-style probe: classify the first-round hidden state into remaining-round bins (quantile
    edges on the training split), predict the probability-weighted mean of the bins, shape (n_eval,).

    The classifier is a multinomial logistic regression on the first :data:`PROBE_COMPONENTS`
    principal components of the standardised state (fitted on the training split): a linear probe
    like TRAIL's, but on hidden sizes of thousands still fitted in about a second.
    """
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    y = remaining_rounds(train)
    edges = np.unique(np.quantile(y, np.linspace(0, 1, bins + 1))[1:-1])
    label = np.searchsorted(edges, y, side="right")  # bin index 0..len(edges)
    classes = np.unique(label)
    if classes.size < 2:  # every training request in one bin: the probe can only say its mean
        return np.full(len(eval_ds), y.mean())
    bin_mean = np.array([y[label == c].mean() for c in classes])
    x_train, x_eval = _standardise(train.first_round.astype(np.float64), eval_ds.first_round.astype(np.float64))
    pca = PCA(min(PROBE_COMPONENTS, x_train.shape[0] - 1, x_train.shape[1]), random_state=seed).fit(x_train)
    probe = LogisticRegression(C=0.1, max_iter=2000, random_state=seed)
    probe.fit(pca.transform(x_train), label)
    return probe.predict_proba(pca.transform(x_eval)) @ bin_mean[np.searchsorted(classes, probe.classes_)]


def ridge_hidden(train: TraceDataset, eval_ds: TraceDataset) -> np.ndarray:
    """Ridge regression of log1p(remaining) on the standardised first-round hidden state, shape (n_eval,)."""
    from sklearn.linear_model import RidgeCV

    x_train, x_eval = _standardise(train.first_round.astype(np.float64), eval_ds.first_round.astype(np.float64))
    model = RidgeCV(alphas=np.logspace(-2, 4, 13)).fit(x_train, np.log1p(remaining_rounds(train)))
    return np.clip(np.expm1(model.predict(x_eval)), 0.0, None)


def baseline_predictions(
    train: TraceDataset,
    eval_ds: TraceDataset,
    admission_total: np.ndarray,
    refined: np.ndarray,
    prompt_hidden_refined: np.ndarray | None,
    seed: int = 0,
    candidate: str = "survival",
) -> list[tuple[str, str, np.ndarray, bool]]:
    """Every baseline's predictions of remaining rounds on ``eval_ds``: ``(name, input, pred (n_eval,),
    comparable scale)``.

    Parameters
    ----------
    admission_total : array of shape (n_eval,), the admission predictor's total rounds.
    refined : array of shape (n_eval,), the shipped refinement predictor's calibrated remaining rounds.
    prompt_hidden_refined : array of shape (n_eval,), the refinement recipe retrained on the prompt
        hidden state (None leaves that row out).
    candidate : the refinement candidate behind ``refined`` (named in its row's input).
    """
    true = remaining_rounds(eval_ds)
    rows: list[tuple[str, str, np.ndarray, bool]] = [
        ("admission LightGBM", "words, newlines, prompt tokens", np.asarray(admission_total, float) - 1.0, True)
    ]
    if prompt_hidden_refined is not None:
        rows.append(("survival on prompt hidden state", "pooled last prompt block + prompt tokens, budget, early signals",
                     prompt_hidden_refined, True))
    for name, pred in early_signal_predictions(train, eval_ds, seed).items():
        what = "the four early signals together" if name == "all four" else EARLY_SIGNALS[name]
        rows.append((f"early signal: {name}", what, pred, True))
    rows.append(("TRAIL-style probe", "first-round hidden state (bins)", trail_probe(train, eval_ds, seed=seed), True))
    rows.append(("ridge on first-round state", "first-round hidden state", ridge_hidden(train, eval_ds), True))
    rows.append((SHIPPED, f"first-round hidden state, pooled last prompt block, prompt tokens, budget, early signals "
                 f"(candidate: {candidate})", refined, True))
    rows.append(("oracle: actual remaining rounds", "the answer", true, True))
    rows.append(("oracle: actual output tokens", "output length (not rounds)",
                 eval_ds.requests["output_tokens"].to_numpy(dtype=float), False))
    if "oracle_remaining" in eval_ds.requests.columns:
        rows.append(("oracle: expected remaining (synthetic)", "true hazard",
                     eval_ds.requests["oracle_remaining"].to_numpy(dtype=float), True))
    return rows


def baseline_table(eval_ds: TraceDataset, predictions: list[tuple[str, str, np.ndarray, bool]]) -> list[dict]:
    """Score every baseline of ``predictions`` (:func:`baseline_predictions` on ``eval_ds``).

    Returns
    -------
    list of rows ``{"name", "input", "spearman", "kendall", "r2", "within_category_mean"}``, in
    the order: admission, prompt-state survival, early signals, probe, ridge, shipped, oracles.
    """
    true = remaining_rounds(eval_ds)
    cats = eval_ds.requests["category"].astype(str).to_numpy()
    return [{"name": n, "input": i, **score(p, true, cats, comparable)} for n, i, p, comparable in predictions]


SHIPPED = "refinement predictor (shipped)"
