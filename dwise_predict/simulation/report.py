"""What the scheduling lab shows: the comparison table (rich), CSV, JSON and bar / sweep plots,
written atomically, and the scheduling section of the HTML / Markdown report.

The report's columns follow the DWISE paper's tables: mean / p50 / p99 / max latency and TTFB
(Table 4), prefill-only time share (Table 3), ``r̂ = 0`` share (Table 6), per-category p99 and max
(Table 16), admissions blocked by the ``k·B`` cap (Fig. 10). The console table and the report read
one column list (:data:`METRIC_COLUMNS`) and print each scheduler's ``adds`` from its spec.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import StoreError
from dwise_predict.evaluation.document import Document, Figure, Section, Table, fmt, write_document
from dwise_predict.files import atomic_write_bytes, loads_json, write_csv, write_errors
from dwise_predict.simulation.schedulers import ALL_SCHEDULERS
from dwise_predict.simulation.styles import policy_style
from dwise_predict.simulation.work_ranking import SUBSET_COLUMNS
from dwise_predict.text import plot_label


@dataclass(frozen=True)
class MetricColumn:
    """One metric of the comparison tables: the row key, the console's header and format, and
    whether the report shows it (under ``report_header`` where that differs). An ``optional`` column
    is shown only where a row carries its key (what ``simulate`` adds to the rows; the quickstart's
    rows lack it); ``absent`` is the cell of a row whose value is None."""

    key: str
    header: str
    fmt: str
    in_report: bool = True
    report_header: str = ""
    optional: bool = False
    absent: str = ""

    @property
    def report_title(self) -> str:
        return self.report_header or self.header


# between the group column (arrival, rate or k) with the scheduler's name and the last, "adds"
METRIC_COLUMNS = (
    MetricColumn("batch_former", "batch former", "{}", optional=True),
    MetricColumn("mean_latency_s", "mean s", "{:.2f}"),
    MetricColumn("p50_latency_s", "p50 s", "{:.2f}"),
    MetricColumn("p99_latency_s", "p99 s", "{:.2f}"),
    MetricColumn("max_latency_s", "max s", "{:.2f}"),
    MetricColumn("mean_latency_rounds", "mean rounds", "{:.1f}", in_report=False),
    MetricColumn("mean_ttfb_s", "TTFB s", "{:.2f}"),
    MetricColumn("throughput_rps", "req/s", "{:.2f}"),
    MetricColumn("prefill_only_time_pct", "prefill-only time %", "{:.1f}"),
    MetricColumn("idle_slots_pct", "idle slots %", "{:.1f}"),
    MetricColumn("preemptions_per_request", "preempt/req", "{:.2f}"),
    MetricColumn("rhat_zero_pct", "r̂=0 %", "{:.1f}"),
    MetricColumn("cap_blocked_rounds_pct", "cap-blocked %", "{:.1f}"),
    MetricColumn("speedup_vs_default", "speedup", "{:.2f}x", report_header="speed-up"),
    # ρ of the scheduler's ranking with the work (simulation.work_ranking): "—" where it ranks by no estimate
    MetricColumn("rho_admission", "ρ adm.", "{:.3f}", optional=True, absent="—", report_header="ρ at admission"),
    MetricColumn("rho_refined", "ρ ref.", "{:.3f}", optional=True, absent="—", report_header="ρ after refinement"),
)
# the group column of each kind of run: (row key, header, console format)
GROUP_COLUMNS = {"arrival": ("arrival", "arrival", "{}"), "rate_rps": ("rate_rps", "rate req/s", "{:.2f}"),
                 "k": ("k", "k", "{:g}")}
INTERVAL = "{:.2f} [{:.2f}, {:.2f}]"
SIMULATE_JSONS = ("simulate.json", "sweep.json", "k_sweep.json")  # what a replay, a load sweep, a k sweep always write
# every name a simulate output holds (the three stems' files, the report): a folder holding anything
# else is the user's, never written into
SIMULATE_CONTENTS = (*(f"{Path(name).stem}{part}.{ext}" for name in SIMULATE_JSONS for part, ext in
                       (("", "csv"), ("", "json"), ("", "png"), ("_categories", "csv"), ("_categories", "png"))),
                     "report.html", "report.md", "plots")
BATCH_TIMEOUT_JSON = "batch_timeout.json"  # always written: a folder holding it is a study the next run may replace
BATCH_TIMEOUT_FILES = ("batch_timeout.csv", BATCH_TIMEOUT_JSON, "batch_timeout.png")  # all a study's folder holds
BATCH_TIMEOUT_COLUMNS = ("ρ", "λ req/s", "T_min s", "T_min (cap B) s", "mean s", "p50 s", "p95 s", "p99 s", "max s")
# the DWISE paper's Table 6 (`simulate --refine-every`): one row per arrival pattern and refinement setting
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


def adds(policy: str | None) -> str:
    """What ``policy`` adds over the row before it (its spec's ``adds``; "" for an unknown name)."""
    spec = ALL_SCHEDULERS.get(policy)
    return spec.adds if spec else ""


def _cell(row: dict, key: str, form: str, absent: str = "") -> str:
    """A console cell: ``form`` applied, the interval beside a mean of several seeds, "" where missing
    (``absent`` where the row holds None)."""
    if key not in row or row[key] is None:
        return absent if key in row else ""
    if f"{key}_lo" in row:  # several arrival seeds: mean [95 % bootstrap interval]
        return INTERVAL.format(row[key], row[f"{key}_lo"], row[f"{key}_hi"])
    return form.format(row[key])


def render_table(rows: list[dict], title: str, group: str = "arrival"):
    """The console's comparison table: one row per (group, scheduler), ``group`` a key of
    :data:`GROUP_COLUMNS`."""
    from rich.table import Table

    columns = [GROUP_COLUMNS[group], ("policy", "policy", "{}"),
               *((c.key, c.header, c.fmt) for c in METRIC_COLUMNS if _shown(c, rows))]
    table = Table(title=title)
    for _, header, _ in columns:
        table.add_column(header, justify="left" if header in ("arrival", "policy", "rate req/s") else "right")
    table.add_column("adds over the row above", justify="right")
    absent = {c.key: c.absent for c in METRIC_COLUMNS}
    for r in rows:
        table.add_row(*[_cell(r, key, form, absent.get(key, "")) for key, _, form in columns], adds(r.get("policy")))
    return table


def render_refine_table(table: dict, title: str):
    """The DWISE paper's Table 6 replayed (:func:`~dwise_predict.simulation.refine_every.replay_refine_every`):
    the rich tables of the replay and of ρ per round."""
    from rich.table import Table

    def build(rows, columns, heading):
        out = Table(title=heading, title_justify="left")
        for _, header, _ in columns:
            out.add_column(header, justify="left" if header in ("arrival", "refine") else "right")
        for r in rows:
            out.add_row(*[_cell(r, key, form) for key, _, form in columns])
        return out

    rank_title = ("Ranking of the remaining rounds after round k (requests still running): the refinement fed round "
                  "k's state vs round 1's decremented")
    return (build(table["rows"], REFINE_COLUMNS, title),
            build(table["rho_by_round"], ROUND_RANK_COLUMNS, rank_title))


def write_outputs(rows: list[dict], out: Path, stem: str, settings: dict, tails: list[dict] | None = None,
                  extra: dict | None = None, report: bool = False) -> list[Path]:
    """``<stem>.csv``, ``<stem>.json`` (rows + settings + per-category tails, and ``extra``'s keys, e.g.
    ``refine_every``) and ``<stem>.png`` in ``out``; with ``tails``, also ``<stem>_categories.csv`` and
    ``<stem>_categories.png``; with ``report``, ``report.html`` and ``report.md`` (the scheduling
    section, from the JSON's plain rows: :func:`write_simulation_report`). Returns the paths written."""
    paths = [out / f"{stem}.csv", out / f"{stem}.json", out / f"{stem}.png"]
    gains = []
    if rows and "arrival" in rows[0]:
        from dwise_predict.simulation.simulator import gain_decomposition

        gains = gain_decomposition(rows)
    saved = json.dumps({"settings": settings, "rows": rows, "categories": tails or [], "gains": gains, **(extra or {})},
                       indent=2, default=str).encode()
    pngs = {}  # what the report shows, by name
    with write_errors(out, "free space or fix permissions and rerun the same command"):
        out.mkdir(parents=True, exist_ok=True)
        # the JSON first: it marks the folder as a simulate output, so a rerun after a kill replaces it
        atomic_write_bytes(paths[1], saved)
        write_csv(paths[0], rows)
        pngs[stem] = _plot(rows, {"sweep": "rate_rps", "k_sweep": "k"}.get(stem))
        atomic_write_bytes(paths[2], pngs[stem])
        if tails:
            paths += [out / f"{stem}_categories.csv", out / f"{stem}_categories.png"]
            pngs[f"{stem}_categories"] = category_plot(tails)
            write_csv(paths[3], tails)
            atomic_write_bytes(paths[4], pngs[f"{stem}_categories"])
    if report:  # an undefined ρ is NaN in the JSON
        paths += write_simulation_report(loads_json(saved, StoreError, str(paths[1]), allow_nan=True), pngs, out)
    return paths


def category_plot(tails: list[dict]) -> bytes:
    """Per-category p99 latency of each scheduler (the DWISE paper's Table 16), first arrival pattern."""
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
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=plot_label(policy),
               **policy_style(policy).bar)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], [plot_label(c) for c in cats], rotation=20, fontsize=8)
    ax.set_ylabel("p99 latency (s)")
    ax.set_yscale("log")
    ax.set_title(f"per-category p99 latency, {pattern} arrivals", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the bars
    return _png(fig)


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
                ax.plot([r[sweep] for r in sub], [r[key] for r in sub], label=plot_label(policy),
                        **policy_style(policy).line)
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
                ax.bar([j + i * width for j in range(len(groups))], values, width, label=plot_label(policy),
                       yerr=yerr, capsize=2, **policy_style(policy).bar)
        for ax, name in zip(axes, ("mean latency (s)", "p99 latency (s)")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
            ax.set_ylabel(name)
            ax.set_yscale("log")  # the default scheduler is often an order of magnitude off
    fig.tight_layout()
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)  # outside the data
    return _png(fig)


def _png(fig) -> bytes:
    """The figure as PNG bytes, cropped to what is drawn (a legend beside the axes included)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_batch_timeout_outputs(out: Path, settings: dict, rows: list[dict], title: str) -> None:
    """``batch_timeout.json`` (settings + rows), ``.csv`` (rows) and ``.png`` (:func:`batch_timeout_plot`
    under ``title``) in ``out``."""
    with write_errors(out, "free space or fix permissions and rerun the same command"):
        out.mkdir(exist_ok=True)
        # the JSON first: it marks the folder as a study, so a rerun after a kill replaces it
        atomic_write_bytes(out / BATCH_TIMEOUT_JSON, json.dumps({"settings": settings, "rows": rows}, indent=2).encode())
        write_csv(out / "batch_timeout.csv", rows)
        atomic_write_bytes(out / "batch_timeout.png", batch_timeout_plot(rows, title))


def render_batch_timeout_table(rows: list[dict], service, requests: int, timeout: float | None):
    """The console's table of a batch-timeout study: per ``ρ`` the thresholds and the fixed-fill
    latencies; with ``timeout``, its verdict and the mean latency under it."""
    from rich.table import Table

    table = Table(title=f"Fixed-fill batching, B={service.batch_size}, S={service.mean:.3g} s, CV={service.cv:.3f}, "
                        f"{requests} requests")
    columns = list(BATCH_TIMEOUT_COLUMNS)
    if timeout is not None:
        columns += [f"T={timeout:g}: verdict", "mean at T s"]
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        cells = [f"{r['rho']:.2f}", f"{r['rate_rps']:.3f}", f"{r['t_min_s']:.2f}", f"{r['t_min_capped_s']:.2f}",
                 f"{r['mean_s']:.2f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}", f"{r['p99_s']:.2f}", f"{r['max_s']:.2f}"]
        if timeout is not None:
            word = "stable" if r["stable"] else "UNSTABLE"
            if r["stable"] == r["mc_diverging"]:
                word += " (MC disagrees)"
            cells += [word, f"{r['mean_at_timeout_s']:.3g}"]
        table.add_row(*cells)
    return table


def batch_timeout_plot(rows: list[dict], title: str) -> bytes:
    """Amin et al.'s Fig. 11 for these service times: mean and p99 latency against ``ρ`` under pure
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


def _shown(column: MetricColumn, rows: list[dict]) -> bool:
    """Whether the tables show ``column``: always, or where optional, when a row carries it."""
    return not column.optional or any(column.key in r for r in rows)


def _report_cell(row: dict, key: str, absent: str = "") -> str:
    """A report cell: two decimals, the interval beside a mean of several seeds, "n/a" where missing
    (``absent`` instead, when given, where the row holds None); a text value as it is."""
    value = row.get(key)
    if absent and key in row and value is None:
        return absent
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, str):
        return value
    if f"{key}_lo" in row:
        return f"{value:.2f} [{row[key + '_lo']:.2f}, {row[key + '_hi']:.2f}]"
    return fmt(float(value), 2)


def scheduler_table(rows: list[dict], group: str) -> Table:
    """The report's comparison: one row per (group, scheduler), the metrics of :data:`METRIC_COLUMNS`
    the report shows, and what the scheduler adds."""
    shown = [c for c in METRIC_COLUMNS if c.in_report and _shown(c, rows)]
    head = [GROUP_COLUMNS[group][1], "scheduler", *(c.report_title for c in shown), "adds"]
    body = [[str(r.get(group)) if group == "arrival" else fmt(float(r[group]), 2), r["policy"],
             *[_report_cell(r, c.key, c.absent) for c in shown], adds(r["policy"])] for r in rows]
    return Table(head, body, "Schedulers on the replayed requests (intervals: 95 % bootstrap over arrival seeds)")


def category_table(tails: list[dict]) -> Table:
    pattern = tails[0]["arrival"]
    body = [[t["category"], t["policy"], fmt(t["requests"]), fmt(t["p99_latency_s"], 2), fmt(t["max_latency_s"], 2)]
            for t in tails if t["arrival"] == pattern]
    return Table(["category", "scheduler", "n", "p99 s", "max s"], body, f"Per-category tails, {pattern} arrivals")


def simulation_section(saved: dict, pngs: dict[str, bytes]) -> Section:
    """A report section from the simulator's saved JSON (``settings``, ``rows``, ``categories``)."""
    settings, rows = saved["settings"], saved["rows"]
    group = next((g for g in ("arrival", "k", "rate_rps") if rows and g in rows[0]), "arrival")
    cost = settings.get("round_cost") or {}
    text = (f"{settings.get('requests', len(rows) and rows[0].get('requests'))} requests, B = {settings.get('slots')}, "
            f"k = {settings.get('k')}, round cost from: {cost.get('source', 'flags')} "
            f"(base {fmt(cost.get('base_ms'), 3)} ms, prefill block {fmt(cost.get('prefill_block_ms'), 3)} ms, "
            f"decode block {fmt(cost.get('decode_block_ms'), 3)} ms).")
    blocks: list = [scheduler_table(rows, group)]
    if saved.get("gains"):
        blocks.append(Table([group if group != "rate_rps" else "rate req/s", "step", "from", "to", "mean-latency gain"],
                            [[str(g[group]), g["step"], g["from"], g["to"], f"{g['gain']:.2f}x"] for g in saved["gains"]],
                            "Where the gain comes from (ratio of mean latency, from / to)"))
    for name, png in pngs.items():
        blocks.append(Figure(name, png, "Mean and p99 latency per scheduler (log scale)." if "categories" not in name
                             else "Per-category p99 latency."))
    if saved.get("categories"):
        blocks.append(category_table(saved["categories"]))
    if saved.get("subset_table"):
        head, body = subset_cells(saved["subset_table"])
        blocks.append(Table(head, body, f"{SUBSET_TITLE}. {saved['subset_table']['note']}"))
    return Section("Scheduling simulation", text, blocks)


SUBSET_TITLE = "Output length versus work by subset (the DWISE paper's Table 12)"


def subset_cells(table: dict) -> tuple[list[str], list[list[str]]]:
    """The DWISE paper's Table 12 (:func:`~dwise_predict.simulation.work_ranking.subset_table`) as text:
    the header and one row per quantity (shares in %, ρ to two decimals, Δ latency signed; "—" where
    undefined)."""
    body = [[r["quantity"], *(_subset_cell(r["quantity"], r[c]) for c in SUBSET_COLUMNS)] for r in table["rows"]]
    return ["", *table["columns"]], body


def _subset_cell(quantity: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.1f}" if quantity.endswith("%") else f"{value:+.2f}" if quantity.startswith("Δ") else f"{value:.2f}"


def render_subset_table(table: dict, title: str):
    """The console's Table 12 (:func:`subset_cells`), names from the traces escaped for the terminal."""
    from rich.table import Table as RichTable

    from dwise_predict.text import terminal

    head, body = subset_cells(table)
    out = RichTable(title=title, caption=terminal(table["note"]), title_justify="left")
    for i, header in enumerate(head):
        out.add_column(terminal(header), justify="left" if i == 0 else "right")
    for row in body:
        out.add_row(*(terminal(c) for c in row))
    return out


def write_simulation_report(saved: dict, pngs: dict[str, bytes], out: str | os.PathLike) -> tuple[Path, Path]:
    """``report.html`` and ``report.md`` in ``out`` holding the scheduling section (and those of
    `simulate`'s retraining studies, :mod:`.retrain_report`, where the run holds them)."""
    from dwise_predict.simulation.retrain_report import retrain_sections

    doc = Document("dwise-predict: scheduling simulation", [f"traces: {saved['settings'].get('traces')}",
                                                            f"bundle: {saved['settings'].get('bundle')}"],
                   [simulation_section(saved, pngs), *retrain_sections(saved)])
    return write_document(doc, out)
