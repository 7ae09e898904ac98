"""Baselines side by side on one split: what each signal says about remaining work.

Every row predicts the remaining denoising rounds after the first round (``total_rounds - 1``) of
each evaluation request, from what it may see, and is scored by Spearman ρ, Kendall τ, R² (on the
rounds scale) and mean within-category ρ against the actual remaining rounds:

- **admission LightGBM** — the shipped admission predictor (total estimate minus the first round);
- **survival on the prompt hidden state** (the DWISE paper's "prompt hidden state") — the full refinement
  recipe (candidate search included) retrained on what is known before the first denoising round:
  ``prompt_last`` (the pooled last prompt block), prompt tokens and budget, with the first-round state
  and the round-1 early signals blanked: does denoising add anything over what the model already read?;
- **early signals** (Amin et al.) — fraction over threshold, mean confidence, mean entropy and prompt
  length (:data:`EARLY_SIGNALS`: Amin et al.'s four, not the bundle's four of
  :data:`dwise_predict.names.EARLY_SIGNALS`, which have ``end_probability`` where this set has
  prompt length), each alone and all four together, through a small LightGBM (50 trees, 7 leaves)
  on ``log1p(remaining)``; Amin et al. found R² ≤ 0.15 for each;
- **TRAIL-style probe** — a multinomial logistic classifier over quantile bins of remaining rounds
  on the first-round hidden state (its top 64 principal components); estimate = expected bin mean under its
  probabilities (TRAIL refines output-length estimates from runtime embeddings this way);
- **ridge on the first-round hidden state** — ridge regression (α chosen by cross-validation) on
  ``log1p(remaining)``;
- **refinement predictor (shipped)** — the run's refinement predictor on the bundle's inputs (both
  hidden states, prompt tokens, budget, the bundle's early signals), whichever candidate `train`
  chose (the paper's calibrated survival ensemble, or a ridge head, alone or blended with signal
  heads, in the same graph; see :mod:`dwise_predict.training.select`);
- **ablation: shipped recipe without the first-round state** — the same recipe retrained with only
  the first-round hidden state blanked (the last prompt block, prompt tokens, budget and the round-1
  early signals kept): what the denoised state adds over the first round's scalar signals. Not a
  baseline (it is the shipped predictor minus one input; ``evaluate --ablate inputs`` has the rest),
  so it is reported beside the winner, never as the one to beat;
- **oracles** — the actual remaining rounds (ρ = 1, the ceiling), the actual output tokens (what a
  perfect output-length ranker would use; R² is not comparable there, tokens are not rounds), and
  for synthetic traces the true expected remaining rounds (``oracle_remaining``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dwise_predict import names
from dwise_predict.evaluation.pool import RetrainTask
from dwise_predict.metrics import kendall, r2, spearman, within_category
from dwise_predict.traces import TraceDataset

# column -> what it is (Amin et al.'s four signals, available right after the first denoising round)
EARLY_SIGNALS = {
    "frac_over_threshold": "round 1: share of masked positions over the threshold",
    "mean_confidence": "round 1: mean top-1 probability",
    "mean_entropy": "round 1: mean predictive entropy",
    "prompt_tokens": "prompt length (tokens)",
}
PROBE_BINS = 8
PROBE_COMPONENTS = 64
# retrainings' names; not category names: categories are plain words
PROMPT_HIDDEN_TASK = "__prompt_hidden_state__"
WITHOUT_FIRST_ROUND_TASK = "__without_first_round_state__"
TASK_WORDS = {PROMPT_HIDDEN_TASK: "prompt hidden state", WITHOUT_FIRST_ROUND_TASK: "without the first-round state"}
SHIPPED = "refinement predictor (shipped)"
WITHOUT_FIRST_ROUND = "ablation: shipped recipe without the first-round state"
# what a row is; only "baseline" rows compete with the shipped one for the report's verdict
ROW_KINDS = ("baseline", "shipped", "ablation", "oracle")


class Prediction(NamedTuple):
    """One row of the table before scoring: predicted remaining rounds of every evaluation request."""

    name: str
    input: str  # what the row sees, in words
    pred: np.ndarray  # (n_eval,)
    comparable: bool  # on the rounds scale (R² defined)
    kind: str  # of ROW_KINDS


def remaining_rounds(ds: TraceDataset) -> np.ndarray:
    """Actual remaining rounds after the first denoising round, shape (n,)."""
    return ds.requests["total_rounds"].to_numpy(dtype=float) - 1.0


def keep_inputs(ds: TraceDataset, states: tuple[str, ...] = names.HIDDEN_STATES,
                signals: bool = True) -> TraceDataset:
    """``ds`` with only the hidden ``states`` kept (of ``names.HIDDEN_STATES``; the others become
    zeros: a constant carries nothing); ``signals`` False makes the bundle's round-1 early signals
    constant too (prompt tokens and budget stay: they are known at admission)."""
    requests = ds.requests
    if not signals:
        requests = requests.assign(**{name: 0.0 for name in names.EARLY_SIGNALS})
    kept = {name: getattr(ds, name) if name in states else np.zeros_like(ds.first_round)
            for name in names.HIDDEN_STATES}
    return TraceDataset(requests, kept["first_round"], kept["prompt_last"], ds.manifest, ds.path)


def prompt_hidden_task(train: TraceDataset, eval_ds: TraceDataset, config) -> RetrainTask:
    """The retraining behind the prompt-hidden-state baseline: the recipe on what is known before the
    first denoising round (``prompt_last``, prompt tokens, budget); its ``"refined"`` prediction is
    that row."""
    return RetrainTask(PROMPT_HIDDEN_TASK, keep_inputs(train, ("prompt_last",), signals=False),
                       keep_inputs(eval_ds, ("prompt_last",), signals=False), config)


def without_first_round_task(train: TraceDataset, eval_ds: TraceDataset, config) -> RetrainTask:
    """The retraining behind the ablation row: the recipe with the first-round hidden state alone
    blanked."""
    return RetrainTask(WITHOUT_FIRST_ROUND_TASK, keep_inputs(train, ("prompt_last",)),
                       keep_inputs(eval_ds, ("prompt_last",)), config)


def table_tasks(train: TraceDataset, eval_ds: TraceDataset, config) -> list[RetrainTask]:
    """The two retrainings the table needs (its prompt-state baseline and its ablation), for one pool
    with whatever else the caller retrains."""
    return [prompt_hidden_task(train, eval_ds, config), without_first_round_task(train, eval_ds, config)]


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


def output_length_lightgbm(train: TraceDataset, eval_ds: TraceDataset, seed: int = 0) -> np.ndarray:
    """Predicted output tokens of ``eval_ds`` from the admission features (words, newlines, prompt
    tokens) by the small LightGBM above, fitted on ``train``: what a prompt-only output-length
    predictor (the DWISE paper's SSJF, LTR) learns (``simulate --subset`` ranks work by it)."""
    from dwise_predict.features.prompt import FEATURE_NAMES

    x_train, x_eval = (d.requests[list(FEATURE_NAMES)].to_numpy(dtype=float) for d in (train, eval_ds))
    return _lightgbm_log(x_train, train.requests["output_tokens"].to_numpy(dtype=float), x_eval, seed)


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
    retrained: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    candidate: str = "survival",
) -> list[Prediction]:
    """Every row's predictions of remaining rounds on ``eval_ds``, in the table's order: admission,
    prompt-state survival, early signals, probe, ridge, shipped, the ablation, oracles.

    Parameters
    ----------
    admission_total : array of shape (n_eval,), the admission predictor's total rounds.
    refined : array of shape (n_eval,), the shipped refinement predictor's calibrated remaining rounds.
    retrained : the ``"refined"`` predictions of the retrainings behind two rows, by task name
        (:data:`PROMPT_HIDDEN_TASK`, :data:`WITHOUT_FIRST_ROUND_TASK`); a row whose retraining is not
        given is left out, not faked.
    candidate : the refinement candidate behind ``refined`` (named in its row's input).
    """
    retrained = retrained or {}
    true = remaining_rounds(eval_ds)
    rows = [Prediction("admission LightGBM", "words, newlines, prompt tokens", np.asarray(admission_total, float) - 1.0,
                       True, "baseline")]
    if PROMPT_HIDDEN_TASK in retrained:
        rows.append(Prediction("survival on prompt hidden state", "pooled last prompt block + prompt tokens, budget",
                               retrained[PROMPT_HIDDEN_TASK], True, "baseline"))
    for name, pred in early_signal_predictions(train, eval_ds, seed).items():
        what = "the four early signals together" if name == "all four" else EARLY_SIGNALS[name]
        rows.append(Prediction(f"early signal: {name}", what, pred, True, "baseline"))
    rows.append(Prediction("TRAIL-style probe", "first-round hidden state (bins)", trail_probe(train, eval_ds, seed=seed),
                           True, "baseline"))
    rows.append(Prediction("ridge on first-round state", "first-round hidden state", ridge_hidden(train, eval_ds), True,
                           "baseline"))
    rows.append(Prediction(SHIPPED, f"first-round hidden state, pooled last prompt block, prompt tokens, budget, early "
                                    f"signals (candidate: {candidate})", refined, True, "shipped"))
    if WITHOUT_FIRST_ROUND_TASK in retrained:
        rows.append(Prediction(WITHOUT_FIRST_ROUND, "pooled last prompt block, prompt tokens, budget, early signals",
                               retrained[WITHOUT_FIRST_ROUND_TASK], True, "ablation"))
    rows.append(Prediction("oracle: actual remaining rounds", "the answer", true, True, "oracle"))
    rows.append(Prediction("oracle: actual output tokens", "output length (not rounds)",
                           eval_ds.requests["output_tokens"].to_numpy(dtype=float), False, "oracle"))
    if "oracle_remaining" in eval_ds.requests.columns:
        rows.append(Prediction("oracle: expected remaining (synthetic)", "true hazard",
                               eval_ds.requests["oracle_remaining"].to_numpy(dtype=float), True, "oracle"))
    return rows


def baseline_table(eval_ds: TraceDataset, predictions: list[Prediction]) -> list[dict]:
    """Score every row of ``predictions`` (:func:`baseline_predictions` on ``eval_ds``).

    Returns
    -------
    list of rows ``{"name", "input", "kind", "spearman", "kendall", "r2", "within_category_mean"}``,
    in the order of ``predictions``.
    """
    true = remaining_rounds(eval_ds)
    cats = eval_ds.requests["category"].astype(str).to_numpy()
    return [{"name": p.name, "input": p.input, "kind": p.kind, **score(p.pred, true, cats, p.comparable)}
            for p in predictions]
