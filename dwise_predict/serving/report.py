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
    ("mean_latency_rounds", "mean rounds", "{:.1f}"),
    ("mean_ttfb_s", "TTFB s", "{:.2f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("prefill_only_rounds_pct", "prefill-only %", "{:.1f}"),
    ("idle_slots_pct", "idle slots %", "{:.1f}"),
    ("preemptions_per_request", "preempt/req", "{:.2f}"),
    ("speedup_vs_default", "speedup", "{:.2f}x"),
)


def render_table(rows: list[dict], title: str, first: tuple = ("arrival", "arrival", "{}")):
    from rich.table import Table

    columns = (first,) + TABLE_COLUMNS[1:]
    table = Table(title=title)
    for _, header, _ in columns:
        table.add_column(header, justify="left" if header in ("arrival", "policy", "rate req/s") else "right")
    for r in rows:
        table.add_row(*[fmt.format(r[key]) if key in r else "" for key, _, fmt in columns])
    return table


def write_outputs(rows: list[dict], out: Path, stem: str, settings: dict) -> list[Path]:
    """``<stem>.csv``, ``<stem>.json`` (rows + settings) and ``<stem>.png`` in ``out``."""
    paths = [out / f"{stem}.csv", out / f"{stem}.json", out / f"{stem}.png"]
    with write_errors(out, "free space or fix permissions and rerun the same command"):
        out.mkdir(parents=True, exist_ok=True)
        write_csv(paths[0], rows)
        atomic_write_bytes(paths[1], json.dumps({"settings": settings, "rows": rows}, indent=2).encode())
        atomic_write_bytes(paths[2], _plot(rows, stem == "sweep"))
    return paths


def _plot(rows: list[dict], sweep: bool) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    if sweep:
        for policy in policies:
            sub = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate_rps"])
            for ax, key in zip(axes, ("mean_latency_s", "p99_latency_s")):
                ax.plot([r["rate_rps"] for r in sub], [r[key] for r in sub], marker="o", label=policy)
        for ax, name in zip(axes, ("mean latency (s)", "p99 latency (s)")):
            ax.set_xlabel("Poisson arrival rate (req/s)")
            ax.set_ylabel(name)
            ax.set_yscale("log")
    else:
        groups = list(dict.fromkeys(r["arrival"] for r in rows))
        width = 0.8 / max(len(policies), 1)
        for i, policy in enumerate(policies):
            for ax, key in zip(axes, ("mean_latency_s", "p99_latency_s")):
                values = [next((r[key] for r in rows if r["policy"] == policy and r["arrival"] == g), 0.0) for g in groups]
                ax.bar([j + i * width for j in range(len(groups))], values, width, label=policy)
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
