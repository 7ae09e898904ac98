"""Simulator output: the comparison table (rich), CSV, JSON and bar / sweep plots, written atomically."""

from __future__ import annotations

import io
import json
from pathlib import Path

from dwise_predict.files import atomic_write_bytes, write_csv, write_errors

TABLE_COLUMNS = (
    ("arrival", "arrival", "{}"),
    ("policy", "policy", "{}"),
    ("mean_latency_s", "mean s", "{:.2f}"),
    ("p50_latency_s", "p50 s", "{:.2f}"),
    ("p99_latency_s", "p99 s", "{:.2f}"),
    ("max_latency_s", "max s", "{:.2f}"),
    ("mean_latency_rounds", "mean rounds", "{:.1f}"),
    ("mean_ttfb_s", "TTFB s", "{:.2f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("prefill_only_time_pct", "prefill-only time %", "{:.1f}"),
    ("idle_slots_pct", "idle slots %", "{:.1f}"),
    ("preemptions_per_request", "preempt/req", "{:.2f}"),
    ("rhat_zero_pct", "r̂=0 %", "{:.1f}"),
    ("cap_blocked_rounds_pct", "cap-blocked %", "{:.1f}"),
    ("speedup_vs_default", "speedup", "{:.2f}x"),
    ("adds", "adds over the row above", "{}"),
)
INTERVAL = "{:.2f} [{:.2f}, {:.2f}]"
# seed 000 Table 6 (`simulate --refine-every`): one row per arrival pattern and refinement setting
REFINE_COLUMNS = (
    ("arrival", "arrival", "{}"),
    ("refine", "refine", "{}"),
    ("mean_latency_s", "mean s", "{:.2f}"),
    ("p50_latency_s", "p50 s", "{:.2f}"),
    ("preemptions_per_request", "preempt/req", "{:.2f}"),
    ("rhat_zero_pct", "reach r̂=0 %", "{:.1f}"),
    ("refinements_per_request", "refinements/req", "{:.2f}"),
    ("predictor_us_per_round", "predictor µs/round", "{:.0f}"),
    ("rho_held", "ρ(r̂, remaining)", "{:.3f}"),
)
ROUND_RANK_COLUMNS = (
    ("round", "round k", "{}"),
    ("requests", "running after k", "{}"),
    ("rho_state", "ρ, round-k state", "{:.3f}"),
    ("rho_decrement", "ρ, round 1 − (k − 1)", "{:.3f}"),
    ("ratio_state", "median ratio, state", "{:.2f}"),
    ("ratio_decrement", "median ratio, decrement", "{:.2f}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    if key == "adds":
        from dwise_predict.simulation.schedulers import SCHEDULERS

        spec = SCHEDULERS.get(row.get("policy"))
        return spec.gain if spec else ""
    if key not in row or row[key] is None:
        return ""
    if f"{key}_lo" in row:  # several arrival seeds: mean [95 % bootstrap interval]
        return INTERVAL.format(row[key], row[f"{key}_lo"], row[f"{key}_hi"])
    return fmt.format(row[key])


def render_table(rows: list[dict], title: str, first: tuple = ("arrival", "arrival", "{}")):
    from rich.table import Table

    columns = (first,) + TABLE_COLUMNS[1:]
    table = Table(title=title)
    for _, header, _ in columns:
        table.add_column(header, justify="left" if header in ("arrival", "policy", "rate req/s") else "right")
    for r in rows:
        table.add_row(*[_cell(r, key, fmt) for key, _, fmt in columns])
    return table


def render_refine_table(table: dict, title: str):
    """Seed 000 Table 6 replayed (:func:`~dwise_predict.simulation.refine_every.replay_refine_every`):
    the rich tables of the replay and of ρ per round."""
    from rich.table import Table

    def build(rows, columns, heading):
        out = Table(title=heading, title_justify="left")
        for _, header, _ in columns:
            out.add_column(header, justify="left" if header in ("arrival", "refine") else "right")
        for r in rows:
            out.add_row(*[_cell(r, key, fmt) for key, _, fmt in columns])
        return out

    rank_title = ("Ranking of the remaining rounds after round k (requests still running): the refinement fed round "
                  "k's state vs round 1's decremented")
    return (build(table["rows"], REFINE_COLUMNS, title),
            build(table["rho_by_round"], ROUND_RANK_COLUMNS, rank_title))


def write_outputs(rows: list[dict], out: Path, stem: str, settings: dict, tails: list[dict] | None = None,
                  extra: dict | None = None) -> list[Path]:
    """``<stem>.csv``, ``<stem>.json`` (rows + settings + per-category tails, and ``extra``'s keys, e.g.
    ``refine_every``) and ``<stem>.png`` in ``out``; with ``tails``, also ``<stem>_categories.csv`` and
    ``<stem>_categories.png``."""
    paths = [out / f"{stem}.csv", out / f"{stem}.json", out / f"{stem}.png"]
    gains = []
    if rows and "arrival" in rows[0]:
        from dwise_predict.simulation.simulator import gain_decomposition

        gains = gain_decomposition(rows)
    with write_errors(out, "free space or fix permissions and rerun the same command"):
        out.mkdir(parents=True, exist_ok=True)
        # the JSON first: it marks the folder as a simulate output, so a rerun after a kill replaces it
        atomic_write_bytes(paths[1], json.dumps({"settings": settings, "rows": rows, "categories": tails or [],
                                                 "gains": gains, **(extra or {})}, indent=2, default=str).encode())
        write_csv(paths[0], rows)
        atomic_write_bytes(paths[2], _plot(rows, {"sweep": "rate_rps", "k_sweep": "k"}.get(stem)))
        if tails:
            paths += [out / f"{stem}_categories.csv", out / f"{stem}_categories.png"]
            write_csv(paths[3], tails)
            atomic_write_bytes(paths[4], category_plot(tails))
    return paths


def category_plot(tails: list[dict]) -> bytes:
    """Per-category p99 latency of each scheduler (seed 000 Table 16), first arrival pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pattern = tails[0]["arrival"]
    rows = [t for t in tails if t["arrival"] == pattern]
    cats = list(dict.fromkeys(t["category"] for t in rows))
    policies = list(dict.fromkeys(t["policy"] for t in rows))
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(cats)), 4))
    for i, policy in enumerate(policies):
        vals = [next((t["p99_latency_s"] for t in rows if t["policy"] == policy and t["category"] == c), 0.0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=policy)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20, fontsize=8)
    ax.set_ylabel("p99 latency (s)")
    ax.set_yscale("log")
    ax.set_title(f"per-category p99 latency, {pattern} arrivals", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _plot(rows: list[dict], sweep: str | None) -> bytes:
    """Bars per arrival pattern, or lines against ``sweep`` (``rate_rps`` or ``k``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    if sweep:
        for policy in policies:
            sub = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r[sweep])
            for ax, key in zip(axes, ("mean_latency_s", "p99_latency_s")):
                ax.plot([r[sweep] for r in sub], [r[key] for r in sub], marker="o", label=policy)
        for ax, name in zip(axes, ("mean latency (s)", "p99 latency (s)")):
            ax.set_xlabel("Poisson arrival rate (req/s)" if sweep == "rate_rps" else "resident-set multiplier k")
            ax.set_ylabel(name)
            ax.set_yscale("log")
    else:
        groups = list(dict.fromkeys(r["arrival"] for r in rows))
        width = 0.8 / max(len(policies), 1)
        for i, policy in enumerate(policies):
            for ax, key in zip(axes, ("mean_latency_s", "p99_latency_s")):
                picked = [next((r for r in rows if r["policy"] == policy and r["arrival"] == g), {}) for g in groups]
                values = [r.get(key, 0.0) for r in picked]
                yerr = None
                if all(f"{key}_lo" in r for r in picked):  # 95 % bootstrap interval over arrival seeds
                    yerr = [[v - r[f"{key}_lo"] for v, r in zip(values, picked)],
                            [r[f"{key}_hi"] - v for v, r in zip(values, picked)]]
                ax.bar([j + i * width for j in range(len(groups))], values, width, label=policy, yerr=yerr, capsize=2)
        for ax, name in zip(axes, ("mean latency (s)", "p99 latency (s)")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
            ax.set_ylabel(name)
            ax.set_yscale("log")  # the default scheduler is often an order of magnitude off
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def batch_timeout_plot(rows: list[dict], title: str) -> bytes:
    """Seed 001 Fig. 11 for these service times: mean and p99 latency against ``ρ`` under pure
    fixed fill (the U-shape), and at the chosen timeout when the rows carry one (diverging points
    drawn hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rho = [r["rho"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(rho, [r["mean_s"] for r in rows], marker="o", label="mean, fixed fill (T = ∞)")
    ax.plot(rho, [r["p99_s"] for r in rows], marker="s", linestyle="--", label="p99, fixed fill (T = ∞)")
    if rows and "chosen_timeout_s" in rows[0]:
        t = rows[0]["chosen_timeout_s"]
        ok = [r for r in rows if not r["mc_diverging"]]
        bad = [r for r in rows if r["mc_diverging"]]
        ax.plot([r["rho"] for r in ok], [r["mean_at_timeout_s"] for r in ok], marker="^", linestyle="none",
                color="tab:green", label=f"mean at T = {t:g} s (stable)")
        ax.plot([r["rho"] for r in bad], [r["mean_at_timeout_s"] for r in bad], marker="^", linestyle="none",
                markerfacecolor="none", color="tab:red", label=f"mean at T = {t:g} s (diverging)")
        ax.set_yscale("log")
    ax.set_xlabel("utilisation ρ = λS/B")
    ax.set_ylabel("latency (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
