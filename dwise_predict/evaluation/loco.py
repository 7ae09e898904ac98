"""Leave-one-category-out evaluation (the DWISE paper, Tables 7 and 17).

For each request category, both predictors are retrained on the training split without it and
scored on that category's evaluation requests. Each cell is a within-category Spearman ρ "with the
category in training → held out"; the in-training side comes from the predictors trained on the
whole training split. The same retrained predictors also give ρ over *all* evaluation requests with
one category held out (the paper's MCQ example: admission 0.72 → 0.36, refined 0.89 kept).

Admission ρ compares predicted with actual total rounds, refined ρ compares predicted with actual
remaining rounds (total − 1); both rank requests the same way. A constant prediction (the paper's
long-context case, where every held-out prompt is longer than any seen in training) has no rank
correlation: its ρ is None, shown as "n/a", with the reason recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.metrics import spearman, within_category_ci
from dwise_predict.evaluation.pool import RetrainTask
from dwise_predict.traces import TraceDataset

# Fewest evaluation (and training) requests of a category for a within-category ρ worth reporting:
# below this a rank correlation is mostly noise.
MIN_REQUESTS = 10
PREFERRED_HOLD_OUT = "mcq"  # the paper's example of ρ over all requests with one category held out


def plan(
    train: TraceDataset,
    eval_ds: TraceDataset,
    config,
    categories: Sequence[str] | None = None,
    min_requests: int = MIN_REQUESTS,
) -> tuple[list[RetrainTask], list[dict]]:
    """The retraining tasks of a LOCO evaluation, and the categories skipped with the reason.

    Parameters
    ----------
    categories : the categories to hold out (default: every category of either split). An unknown
        name raises :class:`InputError` listing the known ones.
    min_requests : fewest evaluation and training requests a category needs to be evaluated.

    Returns
    -------
    (tasks, skipped): one :class:`RetrainTask` per evaluated category (named after it, training on
    ``train`` without it); ``skipped`` holds ``{"category", "reason"}`` for the others.
    """
    train_cats = train.requests["category"].astype(str).to_numpy()
    eval_cats = eval_ds.requests["category"].astype(str).to_numpy()
    categories = check_categories(train, eval_ds, categories)
    tasks, skipped = [], []
    for cat in categories:
        n_eval, n_train = int((eval_cats == cat).sum()), int((train_cats == cat).sum())
        n_rest = int((train_cats != cat).sum())
        reason = None
        if n_eval < min_requests:
            reason = f"{n_eval} evaluation requests, fewer than the minimum {min_requests}"
        elif n_train < min_requests:
            reason = f"{n_train} training requests, fewer than the minimum {min_requests} (no in-training ρ)"
        elif n_rest < min_requests:
            reason = f"only {n_rest} training requests outside it: nothing to train on when it is held out"
        if reason:
            skipped.append({"category": cat, "reason": reason})
        else:
            tasks.append(RetrainTask(cat, train.subset(train_cats != cat), eval_ds, config))
    return tasks, skipped


def check_categories(train: TraceDataset, eval_ds: TraceDataset, categories: Sequence[str] | None,
                     param: str = "`hold_out`") -> list[str]:
    """``categories`` (default: all of either split, sorted), after checking each one exists; the
    refusal tells the user to pass a known one to ``param`` (the caller's parameter).

    Raises
    ------
    InputError
        naming the unknown categories and listing the known ones.
    """
    known = sorted(set(train.requests["category"].astype(str)) | set(eval_ds.requests["category"].astype(str)))
    if categories is None:
        return known
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise InputError(
            f"unknown category {', '.join(map(repr, unknown))}: the traces hold {', '.join(known)}; "
            f"pass one of those to {param}"
        )
    return list(categories)


def _rho(pred: np.ndarray, true: np.ndarray) -> tuple[float | None, str | None]:
    """Spearman ρ and, when undefined, why."""
    value = spearman(pred, true)
    if value is not None:
        return value, None
    if len(pred) < 2:
        return None, "fewer than two requests"
    constant = [name for name, v in (("prediction", pred), ("actual rounds", true)) if np.ptp(v) == 0]
    return None, " and ".join(constant) + " constant"


def _mean(values: list[float | None]) -> float | None:
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def table(
    eval_ds: TraceDataset,
    in_training: dict[str, np.ndarray],
    held_out: dict[str, dict[str, np.ndarray]],
    skipped: list[dict],
    hold_out: str | None = None,
    min_requests: int = MIN_REQUESTS,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Assemble the LOCO table from evaluation-split predictions.

    Parameters
    ----------
    eval_ds : the evaluation split (n_eval requests).
    in_training : ``{"admission": total rounds, "refined": remaining rounds}``, arrays of shape
        (n_eval,), from the predictors trained on the whole training split.
    held_out : category -> the same two arrays from the predictors retrained without it.
    skipped : categories not evaluated, with the reason (from :func:`plan`).
    hold_out : the category whose all-request ρ is singled out; None picks "mcq" when evaluated,
        else the evaluated category with the most evaluation requests.
    n_boot, seed : resamples of the means' bootstrap intervals (0: none).

    Returns
    -------
    dict with ``rows`` (per category: ``category``, ``n_eval``, ``admission`` / ``refined`` each
    ``{"in_training", "held_out"}`` within-category ρ, ``overall`` the same over all evaluation
    requests, ``notes`` why a ρ is n/a), ``mean`` (unweighted over rows, defined values only),
    ``mean_ci`` (the same shape: 95 % intervals of those means, evaluation requests resampled inside
    their category — the noise of the evaluation split, not of the retraining), ``hold_out`` (the
    singled-out category's all-request ρ) and ``skipped``.
    """
    total = eval_ds.requests["total_rounds"].to_numpy(dtype=float)
    truth = {"admission": total, "refined": total - 1.0}
    cats = eval_ds.requests["category"].astype(str).to_numpy()
    overall_in = {k: spearman(in_training[k], truth[k]) for k in truth}
    rows = []
    for cat, preds in held_out.items():
        m = cats == cat
        row = {"category": cat, "n_eval": int(m.sum()), "notes": [], "overall": {}}
        for key in truth:
            rho_in, why_in = _rho(in_training[key][m], truth[key][m])
            rho_out, why_out = _rho(preds[key][m], truth[key][m])
            row[key] = {"in_training": rho_in, "held_out": rho_out}
            for side, why in (("in training", why_in), ("held out", why_out)):
                if why:
                    row["notes"].append(f"{key} {side}: n/a ({why})")
            row["overall"][key] = {"in_training": overall_in[key], "held_out": spearman(preds[key], truth[key])}
        rows.append(row)
    mean = {
        key: {side: _mean([r[key][side] for r in rows]) for side in ("in_training", "held_out")} for key in truth
    }
    evaluated = {r["category"]: r for r in rows}
    mean_ci = _mean_intervals(cats, truth, in_training, held_out, n_boot, seed)
    if hold_out is None and evaluated:
        largest = max(rows, key=lambda r: r["n_eval"])["category"]
        hold_out = PREFERRED_HOLD_OUT if PREFERRED_HOLD_OUT in evaluated else largest
    chosen = None
    if hold_out in evaluated:
        chosen = {"category": hold_out, **evaluated[hold_out]["overall"]}
    return {"min_requests": min_requests, "rows": rows, "mean": mean, "mean_ci": mean_ci, "hold_out": chosen,
            "skipped": skipped}


def _mean_intervals(cats, truth, in_training, held_out, n_boot: int, seed: int) -> dict:
    """Bootstrap intervals of the mean within-category ρ on the evaluated categories' requests, for
    each predictor in training and held out. Each category's held-out predictions come from its own
    retraining; put side by side they form one vector whose within-category ρ are the table's."""
    rows = np.isin(cats, list(held_out))
    out = {}
    for key in truth:
        composite = np.full(cats.size, np.nan)
        for cat, preds in held_out.items():
            composite[cats == cat] = np.asarray(preds[key], float)[cats == cat]
        out[key] = {side: within_category_ci(pred[rows], truth[key][rows], cats[rows], n_boot, seed)
                    if n_boot > 0 and rows.any() else None
                    for side, pred in (("in_training", np.asarray(in_training[key], float)), ("held_out", composite))}
    return out
