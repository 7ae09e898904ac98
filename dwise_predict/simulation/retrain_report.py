"""What `simulate --budget-sweep` and `--drop-category` show (:mod:`.retrain`): one column list per
table, read by the console's rich tables and by the report's sections alike."""

from __future__ import annotations

import math

from dwise_predict.evaluation.document import Section, Table
from dwise_predict.text import terminal

# the DWISE paper's Table 14: budget, tokens, rounds, SGLang and DWISE mean latency, speed-up (p99), ρ
BUDGET_COLUMNS = (
    ("arrival", "arrival", "{}"),
    ("budget", "budget", "{:,}"),
    ("mean_output_tokens", "mean tokens", "{:.1f}"),
    ("at_budget_pct", "at budget %", "{:.1f}"),
    ("mean_rounds", "mean rounds", "{:.1f}"),
    ("sglang_mean_latency_s", "SGLang mean s", "{:.2f}"),
    ("dwise_mean_latency_s", "DWISE mean s", "{:.2f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("p99_speedup", "p99 speed-up", "{:.2f}x"),
    ("refined_rho", "refined ρ", "{:.3f}"),
    ("admission_rho", "admission ρ", "{:.3f}"),
)
# the DWISE paper's Table 7 replayed: the category seen in training against held out
DROP_COLUMNS = (
    ("category", "category", "{}"),
    ("arrival", "arrival", "{}"),
    ("predictors", "predictors", "{}"),
    ("dwise_mean_latency_s", "DWISE mean s", "{:.2f}"),
    ("dwise_mean_latency_category_s", "DWISE mean s, category", "{:.2f}"),
    ("sglang_mean_latency_s", "SGLang mean s", "{:.2f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("refined_rho_category", "refined ρ, category", "{:.3f}"),
    ("admission_rho_category", "admission ρ, category", "{:.3f}"),
    ("refined_rho_all", "refined ρ, all", "{:.3f}"),
    ("admission_rho_all", "admission ρ, all", "{:.3f}"),
)
TEXT_KEYS = ("arrival", "category", "predictors")  # left-aligned; the rest are numbers


def _cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return form.format(value)


def budget_title(table: dict) -> str:
    return (f"Output budgets (the DWISE paper's Table 14): both predictors retrained per budget with "
            f"{table['recipe']}; {_rate_text(table)}")


def drop_title(table: dict) -> str:
    return (f"Held-out category, scheduling (the DWISE paper's Table 7, 'Generalization to unseen categories'): "
            f"retrained with {table['recipe']}, on the whole train split (seen) and without the category "
            f"(held out); {_rate_text(table)}")


def _rate_text(table: dict) -> str:
    rate = table.get("rate_rps")
    return "burst arrivals" if rate is None else f"Poisson part at {rate:.3g} req/s in every row"


def render_tables(tables: dict) -> list:
    """The rich tables of the studies in ``tables`` (``budget_sweep``, ``drop_category``)."""
    from rich.table import Table as RichTable

    out = []
    for key, columns, title in (("budget_sweep", BUDGET_COLUMNS, budget_title),
                                ("drop_category", DROP_COLUMNS, drop_title)):
        if key not in tables:
            continue
        table = RichTable(title=terminal(title(tables[key])), title_justify="left")
        for name, header, _ in columns:
            table.add_column(header, justify="left" if name in TEXT_KEYS else "right")
        for row in tables[key]["rows"]:
            table.add_row(*[terminal(_cell(row, name, form)) for name, _, form in columns])
        out.append(table)
    return out


def skipped_lines(tables: dict) -> list[str]:
    """One line per category the held-out study could not evaluate, with the reason."""
    return [f"not held out: {s['category']}: {s['reason']}" for s in tables.get("drop_category", {}).get("skipped", [])]


def retrain_sections(saved: dict) -> list[Section]:
    """The report's sections of the studies in a saved ``simulate.json`` (none when it holds neither)."""
    sections = []
    if "budget_sweep" in saved:
        table = saved["budget_sweep"]
        sections.append(Section("The DWISE paper's Table 14 (budgets)", budget_title(table) + ".",
                                [_report_table(table["rows"], BUDGET_COLUMNS)]))
    if "drop_category" in saved:
        table = saved["drop_category"]
        blocks: list = [_report_table(table["rows"], DROP_COLUMNS)]
        blocks += skipped_lines(saved)
        sections.append(Section("Held-out category, scheduling", drop_title(table) + ".", blocks))
    return sections


def _report_table(rows: list[dict], columns) -> Table:
    return Table([header for _, header, _ in columns], [[_cell(r, key, form) for key, _, form in columns] for r in rows])
