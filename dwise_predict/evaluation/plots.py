"""The report's plots: each function takes plain arrays or result dicts and returns PNG bytes.

matplotlib runs on the Agg backend (no display needed) and PNGs carry no timestamp, so the same
results give the same bytes. Colours follow categories in sorted order so every plot agrees. Names from
data (categories, requests, rows) pass through :func:`~dwise_predict.text.plot_label`: a ``$`` in one
is shown, never parsed as mathtext.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from dwise_predict.text import plot_label  # noqa: E402

DPI = 100
CMAP = plt.get_cmap("tab10")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _colours(categories: Sequence[str]) -> dict[str, tuple]:
    return {c: CMAP(i % 10) for i, c in enumerate(sorted(set(categories)))}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def scatter_pred_true(pred, true, categories, title: str, rho: float | None) -> bytes:
    """Predicted vs actual rounds per request on log axes (values + 1), coloured by category.

    Parameters
    ----------
    pred, true : arrays of shape (n_requests,), rounds (predicted and actual, same quantity).
    categories : array of shape (n_requests,).
    rho : Spearman ρ shown in the title (None → "n/a").
    """
    pred, true, categories = np.asarray(pred, float), np.asarray(true, float), np.asarray(categories)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for cat, colour in _colours(categories.tolist()).items():
        m = categories == cat
        ax.scatter(true[m] + 1, pred[m] + 1, s=10, alpha=0.7, color=colour, label=plot_label(cat))
    hi = max(true.max(initial=1), pred.max(initial=1)) + 1
    ax.plot([1, hi], [1, hi], color="grey", lw=1, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="actual rounds + 1", ylabel="predicted rounds + 1",
           title=f"{title} (ρ = {_fmt(rho)})")
    ax.legend(fontsize=7, markerscale=1.5, loc="upper left")
    return _png(fig)


def calibration_curve(true, series: dict[str, np.ndarray], bins: int = 10) -> bytes:
    """Median actual remaining rounds per decile of each predictor's estimate, against the estimate.

    Parameters
    ----------
    true : array of shape (n_requests,), actual remaining rounds.
    series : name -> array of shape (n_requests,), estimates of remaining rounds. A calibrated
        predictor lies on the diagonal.
    """
    true = np.asarray(true, float)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    hi = 1.0
    for i, (name, pred) in enumerate(series.items()):
        pred = np.asarray(pred, float)
        edges = np.unique(np.quantile(pred, np.linspace(0, 1, bins + 1)))
        which = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, max(len(edges) - 2, 0))
        xs, ys = [], []
        for b in np.unique(which):
            m = which == b
            xs.append(np.median(pred[m]))
            ys.append(np.median(true[m]))
        ax.plot(xs, ys, marker="o", color=CMAP(i), label=name)
        hi = max(hi, max(xs), max(ys))
    ax.plot([0, hi], [0, hi], color="grey", lw=1, ls="--", label="ideal")
    ax.set(xlabel="predicted remaining rounds (decile median)", ylabel="actual remaining rounds (median)",
           title="Calibration")
    ax.legend(fontsize=8)
    return _png(fig)


def round_histograms(rounds, categories) -> bytes:
    """One histogram of denoising rounds per category (small multiples, shared bin edges)."""
    rounds, categories = np.asarray(rounds, float), np.asarray(categories)
    cats = sorted(set(categories.tolist()))
    cols = min(4, len(cats))
    rows = -(-len(cats) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    edges = np.histogram_bin_edges(rounds, bins=30)
    colours = _colours(cats)
    for ax, cat in zip(axes.flat, cats):
        ax.hist(rounds[categories == cat], bins=edges, color=colours[cat])
        ax.set_title(f"{plot_label(cat)} (n={int((categories == cat).sum())})", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(cats):]:
        ax.axis("off")
    fig.supxlabel("denoising rounds", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def loco_bars(rows: Sequence[dict]) -> bytes:
    """Within-category ρ with the category in training and held out, admission and refined.

    Parameters
    ----------
    rows : LOCO rows with ``category`` and ``admission`` / ``refined`` dicts holding ``in_training``
        and ``held_out`` (ρ or None; None is drawn as an empty slot marked "n/a").
    """
    cats = [r["category"] for r in rows]
    x = np.arange(len(cats))
    bars = [("admission", "in_training", "#9ecae1"), ("admission", "held_out", "#3182bd"),
            ("refined", "in_training", "#fdae6b"), ("refined", "held_out", "#e6550d")]
    width = 0.2
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(cats) + 2), 4))
    for k, (predictor, when, colour) in enumerate(bars):
        values = [r[predictor][when] for r in rows]
        pos = x + (k - 1.5) * width
        ax.bar(pos, [v if v is not None else 0 for v in values], width, color=colour,
               label=f"{predictor}, {when.replace('_', ' ')}")
        for p, v in zip(pos, values):
            if v is None:
                ax.text(p, 0.01, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [plot_label(c) for c in cats], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="within-category Spearman ρ", title="Leave one category out")
    ax.legend(fontsize=7, ncols=2)
    return _png(fig)


def survival_curves(survival, true_remaining, labels: Sequence[str]) -> bytes:
    """S(t) = P(remaining > t) of a few requests, with each request's actual remaining rounds marked.

    Parameters
    ----------
    survival : array of shape (n_shown, K), survival at t = 0..K-1 rounds.
    true_remaining : array of shape (n_shown,), actual remaining rounds.
    """
    survival = np.asarray(survival, float)
    fig, ax = plt.subplots(figsize=(6, 4))
    t = np.arange(survival.shape[1])
    for i, (curve, actual, label) in enumerate(zip(survival, true_remaining, labels)):
        ax.step(t, curve, where="post", color=CMAP(i % 10), label=f"{plot_label(label)} (actual {int(actual)})")
        ax.axvline(actual, color=CMAP(i % 10), ls=":", lw=1)
    ax.set(xlabel="remaining denoising rounds t", ylabel="S(t) = P(remaining > t)", ylim=(0, 1.02),
           title="Survival curves of a few evaluation requests")
    ax.legend(fontsize=7)
    return _png(fig)


def baseline_bars(rows: Sequence[dict]) -> bytes:
    """Spearman ρ and Kendall τ of every baseline on the evaluation split (horizontal bars)."""
    names = [r["name"] for r in rows]
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.2))
    for k, (key, colour) in enumerate((("spearman", "#3182bd"), ("kendall", "#9ecae1"))):
        values = [r[key] for r in rows]
        ax.barh(y + (k - 0.5) * 0.38, [v if v is not None else 0 for v in values], 0.38, color=colour,
                label="Spearman ρ" if key == "spearman" else "Kendall τ")
    ax.set_yticks(y, [plot_label(n) for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.8)
    ax.set(xlabel="rank correlation with actual remaining rounds", title="Baselines (evaluation split)")
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def output_vs_rounds(output_tokens, rounds, categories) -> bytes:
    """Output tokens against denoising rounds per request, coloured by category (Table 12's point)."""
    output_tokens, rounds, categories = (np.asarray(output_tokens, float), np.asarray(rounds, float),
                                         np.asarray(categories))
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for cat, colour in _colours(categories.tolist()).items():
        m = categories == cat
        ax.scatter(output_tokens[m], rounds[m], s=10, alpha=0.7, color=colour, label=plot_label(cat))
    ax.set(xlabel="output tokens", ylabel="denoising rounds", title="Output length versus work")
    ax.legend(fontsize=7, markerscale=1.5)
    return _png(fig)


def budget_sweep(rows: Sequence[dict]) -> bytes:
    """CV of rounds and share truncated against the output budget (Amin et al.'s budget finding)."""
    budgets = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(budgets, [r["cv"] if r["cv"] is not None else np.nan for r in rows], marker="o",
            color=CMAP(0), label="CV of rounds")
    ax.set(xlabel="output budget (tokens)", ylabel="CV of rounds", xscale="log", title="Budget sweep")
    ax.set_xticks(budgets, [str(b) for b in budgets], minor=False)  # the budgets collected, not 3×10²
    ax.minorticks_off()
    twin = ax.twinx()
    twin.plot(budgets, [100 * r["truncated_share"] for r in rows], marker="s", color=CMAP(1),
              label="truncated (%)")
    twin.set(ylabel="truncated by the budget (%)", ylim=(0, 100))
    # under the axes: above them it covered the title, inside them the lines
    fig.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, frameon=False)
    return _png(fig)


def ablation_bars(rows: Sequence[dict], title: str) -> bytes:
    """ρ overall and mean within-category ρ of each ablation row, with 95 % bootstrap intervals, and
    the mean held-out-category ρ (no interval) on the rows that have it (``layers``, ``pooling``, the
    shipped candidate's ``train-size`` rows); a row without a value gets no bar (not a bar at 0)."""
    names = [r["name"] for r in rows]
    y = np.arange(len(names))
    series = [("spearman", "spearman_ci", "#3182bd", "ρ overall"),
              ("within_category_mean", "within_category_ci", "#e6550d", "ρ within category (mean)")]
    if any("held_out_mean" in r for r in rows):
        series.append(("held_out_mean", None, "#756bb1", "ρ within a held-out category (mean)"))
    height = 0.76 / len(series)
    fig, ax = plt.subplots(figsize=(7.5, 0.4 * len(names) * len(series) / 2 + 1.2))
    for k, (key, ci_key, colour, label) in enumerate(series):
        values = np.array([r.get(key) if r.get(key) is not None else np.nan for r in rows], float)
        xerr = None
        if ci_key:
            lo = np.array([v - r[ci_key][0] if r[ci_key] and np.isfinite(v) else 0 for v, r in zip(values, rows)])
            hi = np.array([r[ci_key][1] - v if r[ci_key] and np.isfinite(v) else 0 for v, r in zip(values, rows)])
            xerr = np.vstack([np.clip(lo, 0, None), np.clip(hi, 0, None)])
        shown = np.isfinite(values)
        ax.barh((y + (k - (len(series) - 1) / 2) * height)[shown], values[shown], height, color=colour, label=label,
                xerr=None if xerr is None else xerr[:, shown], error_kw={"lw": 0.8, "capsize": 2})
    ax.set_yticks(y, [plot_label(n) for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.8)
    ax.set(xlabel="Spearman ρ with actual remaining rounds (95% bootstrap interval)", title=plot_label(title))
    if len(series) > 2:  # three bars per row leave no free corner: the legend goes under the axis label
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(series))
    else:
        ax.legend(fontsize=8, loc="lower right")
    return _png(fig)
