"""The scheduling section of the HTML / Markdown report: what ``dwise-predict simulate`` found.

Built from the plain rows the simulator writes (``simulate.json`` / ``sweep.json``) and its PNGs, so
evaluation needs nothing from ``serving``. Columns follow seed 000's tables: mean / p50 / p99 / max
latency and TTFB (Table 4), prefill-only time share (Table 3), ``r̂ = 0`` share (Table 6),
per-category p99 and max (Table 16), admissions blocked by the ``k·B`` cap (Fig. 10).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from dwise_predict.evaluation.document import Document, Figure, Section, Table, fmt, write_document

COLUMNS = (
    ("mean_latency_s", "mean s"), ("p50_latency_s", "p50 s"), ("p99_latency_s", "p99 s"), ("max_latency_s", "max s"),
    ("mean_ttfb_s", "TTFB s"), ("throughput_rps", "req/s"), ("prefill_only_time_pct", "prefill-only time %"),
    ("idle_slots_pct", "idle slots %"), ("preemptions_per_request", "preempt/req"), ("rhat_zero_pct", "r̂=0 %"),
    ("cap_blocked_rounds_pct", "cap-blocked %"), ("speedup_vs_default", "speed-up"),
)
# which mechanism each scheduler adds over the row before it (kept in step with simulation.schedulers)
ADDS = {"sglang-default": "baseline", "sglang-sync": "SGLang with --no-dllm-fdfo", "fcfs-mixed": "mixed batching", "mlfq": "work-done levels",
        "ssjf": "predicted length, admission only", "s3": "length buckets, sized KV",
        "ltr": "predicted order, preemptive", "trail": "probe refinement", "dwise-zero": "ordering by prompt work",
        "dwise-admission": "admission estimates", "dwise-raw": "raw refinement", "dwise-refined": "calibration", "dwise-oracle": "perfect estimates"}


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if f"{key}_lo" in row:
        return f"{value:.2f} [{row[key + '_lo']:.2f}, {row[key + '_hi']:.2f}]"
    return fmt(float(value), 2)


def scheduler_table(rows: list[dict], group: str) -> Table:
    """One row per (group, scheduler): the metrics of :data:`COLUMNS` and what the scheduler adds."""
    head = [{"arrival": "arrival", "k": "k", "rate_rps": "rate req/s"}[group], "scheduler"] + [h for _, h in COLUMNS] + ["adds"]
    body = [[str(r.get(group)) if group == "arrival" else fmt(float(r[group]), 2), r["policy"],
             *[_cell(r, k) for k, _ in COLUMNS], ADDS.get(r["policy"], "")] for r in rows]
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
    return Section("Scheduling simulation", text, blocks)


def write_simulation_report(saved: dict, pngs: dict[str, bytes], out: str | os.PathLike) -> tuple[Path, Path]:
    """``report.html`` and ``report.md`` in ``out`` holding the scheduling section."""
    doc = Document("dwise-predict: scheduling simulation", [f"traces: {saved['settings'].get('traces')}",
                                                            f"bundle: {saved['settings'].get('bundle')}"],
                   [simulation_section(saved, pngs)])
    return write_document(doc, out)
