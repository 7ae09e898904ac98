"""The evaluation and characterization reports: result dicts (+ prediction arrays) → a Document.

Tables mirror the JSON files written beside the report; "n/a" marks an undefined rank correlation
(a constant side), as in the paper. Plots come from :mod:`dwise_predict.evaluation.plots`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from dwise_predict.evaluation import plots
from dwise_predict.evaluation.characterize import DEPENDS_ON_CATEGORY
from dwise_predict.evaluation.d2f_report import d2f_section
from dwise_predict.evaluation.document import Document, Figure, Section, Table, fmt, fmt_interval
from dwise_predict.files import atomic_dir, write_json


def _arrow(pair: dict, intervals: dict | None = None) -> str:
    """``in training → held out``, each value with its ``[lo, hi]`` where ``intervals`` has one."""
    def cell(side):
        return f"{fmt(pair[side])} {fmt_interval((intervals or {}).get(side))}".rstrip()
    return f"{cell('in_training')} → {cell('held_out')}"


# r(rounds, wall) times the collection, not the model: the same requests collected on another machine
# (or under another load) give another r, so every table of it says so
WALL_TIME_NOTE = ("r(rounds, wall): Pearson r between a request's denoising rounds and its wall time on the machine "
                  "that collected these traces (its speed, load and batching), not a property of the model: "
                  "collected again elsewhere the same requests give another r (Amin et al.: r > 0.99 on one GPU).")


def rounds_table(characterization: dict) -> Table:
    """Per-category spread, tiers, wall-time correlation and truncation (Amin et al.'s measurements)."""
    rows = []
    for name, stats in [("all", characterization["overall"]), *characterization["per_category"].items()]:
        r, d = stats["rounds"], stats["discreteness"]
        rows.append([
            name, fmt(r["n"]), fmt(r["p25"], 1), fmt(r["p50"], 1), fmt(r["p90"], 1), fmt(r["max"], 0),
            fmt(r["max_min_ratio"], 1), fmt(r["cv"], 3), fmt(d["distinct"]), fmt(d["dominant_spacing"]),
            d["tiers"] or "-", fmt(stats["wall_time"]["pearson"]), f"{100 * stats['truncated_share']:.1f}%",
        ])
    return Table(
        ["category", "n", "p25", "p50", "p90", "max", "max/min", "CV", "distinct", "spacing", "tiers",
         "r(rounds, wall)", "truncated"],
        rows,
        "Denoising rounds per request",
    )


def budget_table(sweep: list[dict]) -> Table:
    return Table(
        ["budget", "n", "CV", "truncated", "p50", "p90", "max/min", "mean output tokens"],
        [[fmt(r["budget"]), fmt(r["n"]), fmt(r["cv"]), f"{100 * r['truncated_share']:.1f}%", fmt(r["p50"], 1),
          fmt(r["p90"], 1), fmt(r["max_min_ratio"], 1), fmt(r["mean_output_tokens"], 1)] for r in sweep],
        "Rounds versus output budget",
    )


def signal_directions_table(directions: list[dict]) -> Table:
    """Spearman ρ of each early signal with total rounds per category, with its interval; ▲ / ▼ where
    the interval lies above / below zero (see :func:`.characterize.signal_directions`)."""
    def cell(v: dict) -> str:
        lo_hi = v["interval"]
        mark = "▲" if lo_hi and lo_hi[0] > 0 else "▼" if lo_hi and lo_hi[1] < 0 else ""
        return f"{fmt(v['rho'], 2)} {fmt_interval(lo_hi, 2)} {mark}".strip()

    first = directions[0]
    rows = [[c, fmt(v["n"]), *(cell(d["per_category"][c]) for d in directions)]
            for c, v in first["per_category"].items()]
    rows.append(["all", fmt(first["overall"]["n"]), *(cell(d["overall"]) for d in directions)])
    rows.append(["direction", "", *(d["direction"] for d in directions)])
    return Table(["category", "n", *(d["column"] for d in directions)], rows,
                 "Early signals against total rounds: Spearman ρ [95 % interval] inside each category")


def signal_directions_text(directions: list[dict]) -> str:
    """One paragraph: which signals reverse direction between categories, and what that means for a
    held-out category."""
    mixed = [d for d in directions if d["direction"] == DEPENDS_ON_CATEGORY]
    intro = ("▲ / ▼: the 95 % interval (requests resampled) lies above / below zero: inside that category "
             "more of the signal means more / fewer rounds. ")
    if not mixed:
        return intro + "No signal reverses its direction between categories here."
    named = "; ".join(f"{d['column']} (more rounds in {', '.join(d['more_rounds'])}; fewer in "
                      f"{', '.join(d['fewer_rounds'])})" for d in mixed)
    return (intro + f"Direction depends on the category: {named}. A predictor learns a signal's direction "
            "from the categories it is trained on, so for a held-out category where the signal runs the other "
            "way that direction is the wrong one, however the predictor is built.")


def characterization_document(result: dict, requests: list[pd.DataFrame]) -> Document:
    """Report of :func:`dwise_predict.evaluation.characterize.characterize`.

    Parameters
    ----------
    requests : the requests of each decoding section, in the result's order (one frame when the result
        has one decoding; for the histograms).
    """
    meta = [f"model: {result['model']}", f"traces: {', '.join(str(t) for t in result['traces'])}"]
    if "configurations" not in result:
        meta.append(f"decoding: {result['label']}")
        sections = _decoding_sections(result, requests[0])
    else:
        sections = [d2f_section(c) for c in result.get("d2f_vs_base", ())]  # Amin et al., Fig. 4
        sections += [_invariance_section(table) for table in result["invariance"]]
        for i, (section, frame) in enumerate(zip(result["configurations"], requests), start=1):
            sections += _decoding_sections(section, frame, f"_{i}", f" — {section['label']}")
    if "stability" in result:
        sections.append(stability_section(result["stability"]))
    return Document("dwise-predict: workload characterization", meta, sections)


def _decoding_sections(section: dict, requests: pd.DataFrame, suffix: str = "", heading: str = "") -> list[Section]:
    """One decoding's sections; ``suffix`` tells its plots apart and ``heading`` its titles."""
    blocks: list = [rounds_table(section), WALL_TIME_NOTE,
                    histogram_figure(requests, f"characterization_round_histograms{suffix}")]
    sections = [Section("Rounds distribution" + heading, "", blocks)]
    sweep = section["budget_sweep"]
    budget_blocks: list = [budget_table(sweep)]
    if len(sweep) > 1:
        budget_blocks.append(Figure(f"characterization_budget_sweep{suffix}", plots.budget_sweep(sweep),
                                    "CV of rounds and share truncated versus the output budget."))
    else:
        budget_blocks.append("One output budget in these traces: give traces collected at several budgets "
                             "to see how truncation hides the spread.")
    sections.append(Section("Output budget" + heading, "", budget_blocks))
    if section["signal_directions"]:
        sections.append(Section("Early signals inside each category" + heading, "", [
            signal_directions_text(section["signal_directions"]), signal_directions_table(section["signal_directions"])]))
    return sections


def invariance_table(table: dict) -> Table:
    """One row per block size of :func:`.characterize.block_size_invariance`."""
    return Table(
        ["block size", "requests", "mean rounds per block", "total rounds p50", "CV of total rounds"],
        [[fmt(r["block_size"]), fmt(r["n"]), fmt(r["mean_rounds_per_block"], 2), fmt(r["p50"], 1), fmt(r["cv"])]
         for r in table["rows"]],
        f"Block-size invariance (Amin et al., §III-E): {table['label']}",
    )


def invariance_text(table: dict) -> str:
    """The within- against across-request spread of :func:`.characterize.block_size_invariance`, beside
    Amin et al.'s."""
    paper = ("Amin et al. (LLaDA-8B + D2F, HumanEval, latency over block sizes 16-128): within-request CV 0.0096, "
             "across-request CV 0.345, about 36 times.")
    if not table["matched"]:
        return f"No request is met at every block size (same request_id and budget), so no within-request CV. {paper}"
    ratio = f" ({fmt(table['ratio'], 1)} times)" if table["ratio"] is not None else ""
    return (f"On the {table['matched']} requests met at every block size: within-request CV of total rounds across "
            f"block sizes {fmt(table['within_request_cv'])}, across-request CV {fmt(table['across_request_cv'])}"
            f"{ratio}. {paper}")


def _invariance_section(table: dict) -> Section:
    return Section(f"Block-size invariance — {table['label']}", "", [invariance_table(table), invariance_text(table)])


def _share(value: float) -> str:
    return f"{100 * value:.1f}%"


def stability_tables(stability: dict) -> list[Table]:
    """:func:`.stability.round_stability` as tables: per category, per pair of runs, and the paper's."""
    from dwise_predict.evaluation.stability import PAPER_TABLE_11

    rows = [[r["category"], fmt(r["n"]), _share(r["identical"]), _share(r["identical_in_every_run"]),
             _share(r["within_1"]), _share(r["within_10pct"]), fmt(r["rho"])]
            for r in [stability["overall"], *stability["per_category"]]]
    runs = stability["runs"]
    pairs = [[f"{runs[p['runs'][0]]} vs {runs[p['runs'][1]]}", _share(p["identical"]), _share(p["within_1"]),
              _share(p["within_10pct"]), fmt(p["rho"])] for p in stability["pairs"]]
    return [
        Table(["category", "requests", "identical", "identical in every run", "within ±1", "within ±10%", "ρ"], rows,
              f"Round-count stability across {len(runs)} runs (the DWISE paper, Table 11): "
              "shares averaged over pairs of runs"),
        Table(["runs compared", "identical", "within ±1", "within ±10%", "ρ"], pairs, "Each pair of runs"),
        Table(["policy", "runs compared", "identical", "ρ"],
              [[policy, compared, _share(share), fmt(rho)] for policy, compared, share, rho in PAPER_TABLE_11],
              "The DWISE paper, Table 11 (LLaDA2.1-mini on an H200)"),
    ]


def stability_section(stability: dict) -> Section:
    matched = (f"{stability['matched']} requests present in every run (of {', '.join(map(str, stability['requests']))}); "
               "within ±10%: the larger count at most 10% above the smaller.")
    return Section("Round-count stability across runs", matched, stability_tables(stability))


def write_characterization(result: dict, datasets, out: str | os.PathLike) -> Path:
    """``characterization.json``, ``.html``, ``.md`` and plots of ``result`` as the directory ``out``;
    ``datasets`` are the trace datasets it measured. The directory appears whole (a kill leaves the
    earlier one, or none, never a folder a rerun would take for someone else's), replacing an earlier
    characterization. Returns the HTML path."""
    from dwise_predict.evaluation.decodings import group_by_decoding
    from dwise_predict.evaluation.document import write_document

    out = Path(out)
    # the result's sections, in its order: characterize accepted the inputs, so splitting cannot refuse
    requests = [g.requests for g in group_by_decoding(datasets, split_decodings=True)]
    with atomic_dir(out) as tmp:
        write_json(tmp / "characterization.json", result)
        write_document(characterization_document(result, requests), tmp, stem="characterization")
    return out / "characterization.html"


def histogram_figure(requests: pd.DataFrame, name: str = "round_histograms") -> Figure:
    return Figure(
        name,
        plots.round_histograms(requests["total_rounds"].to_numpy(), requests["category"].astype(str).to_numpy()),
        "Denoising rounds per request, one panel per category.",
    )


def _split_table(metrics: dict) -> Table:
    rows = []
    for key, label in (("admission", "admission (prompt features)"), ("refined", f"refined (calibrated, candidate {metrics.get('refine_candidate', 'survival')})")):
        block = metrics[key]
        ci = block.get("spearman_ci")
        rows.append([
            label, fmt(block["spearman"]), fmt_interval(ci) or "n/a", fmt(block["kendall"]),
            fmt(block["within_category_mean"]), fmt(block.get("concordance_td")), fmt(block.get("integrated_brier")),
        ])
    return Table(["predictor", "Spearman ρ", "95% CI", "Kendall τ", "within-category ρ (mean)",
                  "C-td", "integrated Brier"], rows, "Evaluation split")


def _per_category_table(metrics: dict) -> Table:
    cats = sorted(set(metrics["admission"]["per_category"]) | set(metrics["refined"]["per_category"]))
    return Table(
        ["category", "admission ρ", "refined ρ"],
        [[c, fmt(metrics["admission"]["per_category"].get(c)), fmt(metrics["refined"]["per_category"].get(c))]
         for c in cats],
        "Within-category Spearman ρ",
    )


def _calibration_table(rows: list[dict]) -> Table:
    return Table(
        ["predictor", "median predicted / actual", "Spearman ρ"],
        [[r["predictor"], fmt(r["median_ratio"]), fmt(r["spearman"])] for r in rows],
        "Calibration (the DWISE paper, Table 5)",
    )


def loco_tables(loco: dict) -> list:
    """The LOCO table (in training → held out), the held-out category's all-request ρ and the skipped."""
    ci = loco.get("mean_ci") or {}
    intervals = any(v for sides in ci.values() for v in sides.values())  # none with bootstrap 0
    blocks: list = [
        Table(
            ["held-out category", "n eval", "admission ρ (in training → held out)",
             "refined ρ (in training → held out)", "notes"],
            [[r["category"], fmt(r["n_eval"]), _arrow(r["admission"]), _arrow(r["refined"]),
              "; ".join(r["notes"]) or "-"] for r in loco["rows"]]
            + [["mean", "", _arrow(loco["mean"]["admission"], ci.get("admission")),
                _arrow(loco["mean"]["refined"], ci.get("refined")),
                "defined values only" + ("; [95% interval], evaluation requests resampled in their category" if intervals else "")]],
            "Within-category ρ with the category in training → held out (the DWISE paper, Tables 7 and 17)",
        )
    ]
    chosen = loco.get("hold_out")
    if chosen:
        blocks.append(Table(
            ["predictor", f"ρ over all requests, {chosen['category']} in training → held out"],
            [["admission", _arrow(chosen["admission"])], ["refined", _arrow(chosen["refined"])]],
            f"All evaluation requests with {chosen['category']} held out",
        ))
    if loco["skipped"]:
        blocks.append(Table(["skipped category", "reason"], [[s["category"], s["reason"]] for s in loco["skipped"]],
                            f"Not evaluated (minimum {loco['min_requests']} requests)"))
    return blocks


def _baseline_table(rows: list[dict]) -> Table:
    return Table(
        ["predictor", "input", "Spearman ρ", "Kendall τ", "R²", "within-category ρ"],
        [[r["name"], r["input"], fmt(r["spearman"]), fmt(r["kendall"]), fmt(r["r2"]), fmt(r["within_category_mean"])]
         for r in rows],
        "Remaining rounds on the evaluation split",
    )


def candidates_section(selection: dict) -> Section | None:
    """How ``train`` chose the refinement candidate (candidates.json), when it searched: every
    candidate's out-of-fold criteria on the training split and the reason; None for a fixed one."""
    if selection.get("mode") != "cv":
        return None
    level = set(selection.get("level_with_best", []))
    body = [[name + (" (shipped)" if name == selection["chosen"] else ""), fmt(s.get("cv_spearman")),
             fmt(s.get("cv_spearman_raw")), fmt(s.get("cv_within_category")), fmt(s.get("cv_held_out_category")),
             "yes" if name in level else ""] for name, s in selection["candidates"].items()]
    table = Table(["candidate", "ρ, all requests (calibrated)", "ρ, raw", "within-category ρ",
                   "held-out-category ρ", f"within {selection.get('level_band')} of the best"], body,
                  f"Out of fold on the training split ({selection.get('folds')} grouped folds); n/a: not measured")
    # a run trained before the choice was on overall rho has no reason: name its criterion instead
    why = selection.get("reason") or f"{selection['chosen']}, by {selection.get('criterion')}"
    return Section("Refinement candidates (chosen in training)", f"{why}.", [table])


def _output_work_table(table: dict) -> Table:
    rows = []
    for r in [{"category": "all", **table["overall"]}, *table["per_category"]]:
        rows.append([
            r["category"], fmt(r["n"]), f"{100 * r['work_share']:.1f}%" if r["work_share"] is not None else "n/a",
            fmt(r["mean_output_tokens"], 1), fmt(r["mean_rounds"], 1), fmt(r["spearman_tokens_rounds"]),
            fmt(r["rounds_per_token_p50"], 3),
            f"{fmt(r['rounds_per_token_p10'], 3)}–{fmt(r['rounds_per_token_p90'], 3)}",
            f"{100 * r['budget_share']:.1f}%",
            "-" if r["work_at_budget_p10"] is None
            else f"{fmt(r['work_at_budget_p10'], 0)}–{fmt(r['work_at_budget_p90'], 0)}",
        ])
    return Table(
        ["category", "n", "share of work", "mean output tokens", "mean rounds", "ρ(tokens, rounds)",
         "rounds/token p50", "rounds/token p10–p90", "at budget", "work p10–p90 at budget"],
        rows,
        "Output length versus work (the DWISE paper, Table 12)",
    )


def summary(result: dict) -> list[str]:
    """The report's opening paragraphs: the figures a reader deciding on deployment looks for first."""
    m = result["metrics"]
    adm, ref = m["admission"], m["refined"]
    lines = [
        f"On {result['traces']['n_eval']} evaluation requests, the admission predictor (prompt features only) ranks "
        f"work with Spearman ρ = {fmt(adm['spearman'])} (mean within a category {fmt(adm['within_category_mean'])}); "
        f"after the first denoising round the refined predictor reaches ρ = {fmt(ref['spearman'])} "
        f"(within a category {fmt(ref['within_category_mean'])}).",
        f"Calibration brings the refined estimate's median predicted/actual ratio from "
        f"{fmt(m['calibration']['median_ratio_raw'])} (raw) to {fmt(m['calibration']['median_ratio_calibrated'])}; "
        f"the admission estimate's is {fmt(m['calibration']['median_ratio_admission'])}.",
    ]
    loco = result.get("loco")
    if loco and loco["rows"]:
        mean = loco["mean"]
        ci = ((loco.get("mean_ci") or {}).get("refined") or {}).get("held_out")
        text = (f"With its category held out of training, a category's requests are ranked with mean ρ "
                f"{fmt(mean['refined']['held_out'])}"
                + (f" (95% interval over resampled evaluation requests {fmt_interval(ci)})" if ci else "")
                + f" by the refined predictor (in training: "
                f"{fmt(mean['refined']['in_training'])}) and {fmt(mean['admission']['held_out'])} by the admission "
                f"predictor (in training: {fmt(mean['admission']['in_training'])}).")
        if loco["hold_out"]:
            h = loco["hold_out"]
            text += (f" Over all requests with {h['category']} held out: admission ρ {_arrow(h['admission'])}, "
                     f"refined ρ {_arrow(h['refined'])}.")
        lines.append(text)
    contenders = [r for r in result["baselines"] if r["kind"] in ("baseline", "shipped") and r["spearman"] is not None]
    if contenders:
        best = max(contenders, key=lambda r: r["spearman"])
        early = next((r for r in result["baselines"] if r["name"] == "early signal: all four"), None)
        text = (f"Best predictor of the baseline table (oracles and the ablation aside): {best['name']} "
                f"(ρ = {fmt(best['spearman'])}).")
        if early:
            text += (f" Amin et al.'s four early signals together: ρ = {fmt(early['spearman'])}, "
                     f"R² = {fmt(early['r2'])}.")
        lines.append(text)
    lines += winner_lines(result.get("winner"))
    overall = result["output_vs_work"]["overall"]
    if overall["spearman_tokens_rounds"] is None:
        lines.append(f"Output tokens and denoising rounds have no rank correlation here (one side is constant; "
                     f"{100 * overall['budget_share']:.0f}% of requests hit the output budget): output length "
                     "cannot order this work at all.")
    else:
        lines.append(f"Output tokens and denoising rounds correlate with ρ = {fmt(overall['spearman_tokens_rounds'])} "
                     "over all requests: where this is low, output-length rankers misorder work.")
    return lines


# the two measures the shipped predictor is judged on (key in evaluation.json "winner" -> words)
WINNER_MEASURES = (("within_category", "mean within-category ρ"), ("overall", "ρ over all requests"))


def winner_lines(winner: dict | None) -> list[str]:
    """Which predictor won and by how much: the shipped refinement predictor against the best
    non-oracle baseline, within category and overall, with the paired bootstrap interval's verdict;
    then what the first-round state adds (the ablation without it), where that was measured."""
    if not winner:
        return []
    lines = []
    for label, words in WINNER_MEASURES:
        w = winner.get(label)
        if not w:
            continue
        verb = "beats" if w["shipped_wins"] else "trails"
        lines.append(f"By {words}, the shipped refinement predictor (candidate {winner['candidate']}, "
                     f"{fmt(w['shipped'])}) {verb} the best non-oracle baseline, {w['best_baseline']} "
                     f"({fmt(w['baseline'])}), by {_margin_words(w)}.")
    ablation = winner.get("ablation")
    if ablation:
        parts = [f"{words} {fmt(ablation[label]['ablation'])}, so the first-round state adds "
                 f"{_margin_words(ablation[label])}" for label, words in WINNER_MEASURES if ablation[label]]
        if parts:
            lines.append("Ablation: without the first-round hidden state (the last prompt block, prompt tokens, budget "
                         "and early signals kept) the same recipe reaches " + "; ".join(parts) + ".")
    return lines


def _margin_words(w: dict) -> str:
    ci = w["margin_ci"]
    interval = "n/a" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
    noise = ("inside the bootstrap interval: not a clear difference on these requests" if w["inside_interval"]
             else "outside the bootstrap interval")
    return f"{w['margin']:+.3f} (paired 95% interval {interval}; {noise})"


def evaluation_document(result: dict, arrays: dict) -> Document:
    """Report of one evaluation.

    Parameters
    ----------
    result : the evaluation result (see :func:`dwise_predict.evaluation.evaluate.evaluate`).
    arrays : ``eval_requests`` and ``all_requests`` (DataFrames), ``admission`` / ``refined`` /
        ``refined_raw`` predictions on the evaluation split (n_eval,), and optionally ``survival``
        ``{"curves": (n, K), "true": (n,), "labels": [...]}``.
    """
    every = arrays["all_requests"]
    sections = [
        Section("Summary", "", summary(result)),
        _predictors_section(result["metrics"], arrays),
    ]
    chosen = candidates_section(result.get("selection") or {})
    if chosen is not None:
        sections.append(chosen)
    sections.append(_calibration_section(result["calibration"], arrays))
    if result.get("loco"):
        sections.append(_loco_section(result["loco"], result["characterization"]))
    sections.append(Section("Baselines", "", [
        _baseline_table(result["baselines"]),
        Figure("baselines", plots.baseline_bars(result["baselines"]), "Rank correlation of each baseline."),
    ]))
    if result.get("ablations"):
        from dwise_predict.evaluation.ablate import ablation_document

        sections += ablation_document(result["ablations"]).sections
    sections.append(Section("Output length versus work", "", [
        _output_work_table(result["output_vs_work"]),
        Figure("output_vs_rounds",
               plots.output_vs_rounds(every["output_tokens"].to_numpy(), every["total_rounds"].to_numpy(),
                                      every["category"].astype(str).to_numpy()),
               "Output tokens against denoising rounds, all requests."),
    ]))
    workload = [rounds_table(result["characterization"]), WALL_TIME_NOTE, histogram_figure(every)]
    directions = result["characterization"]["signal_directions"]
    if directions:
        workload += [signal_directions_text(directions), signal_directions_table(directions)]
    sections.append(Section("Workload", "", workload))
    return Document("dwise-predict: evaluation report", _evaluation_meta(result), sections)


def _predictors_section(metrics: dict, arrays: dict) -> Section:
    """The split and per-category tables, both estimates against the truth, and survival curves."""
    ev = arrays["eval_requests"]
    cats = ev["category"].astype(str).to_numpy()
    total = ev["total_rounds"].to_numpy(dtype=float)
    blocks: list = [
        _split_table(metrics),
        _per_category_table(metrics),
        Figure("scatter_admission",
               plots.scatter_pred_true(arrays["admission"], total, cats, "Admission", metrics["admission"]["spearman"]),
               "Admission estimate of total rounds against actual total rounds."),
        Figure("scatter_refined",
               plots.scatter_pred_true(arrays["refined"], total - 1, cats, "Refined", metrics["refined"]["spearman"]),
               "Calibrated refined estimate of remaining rounds against actual remaining rounds."),
    ]
    survival = arrays.get("survival")
    if survival is not None:
        blocks.append(_survival_block(survival, metrics.get("refine_candidate", "survival")))
    return Section("Predictors on the evaluation split", "", blocks)


def _survival_block(survival: dict, candidate: str) -> Figure | str:
    """The survival curves of a few requests, for a candidate whose curves were fitted; a sentence
    instead where they are a linear score's geometric law (drawn, they would pass for a fitted model)."""
    from dwise_predict.training.candidates import SURVIVAL_CURVES

    kind = SURVIVAL_CURVES.get(candidate, "fitted")
    if kind == "geometric":
        return (f"No survival curves: the shipped refinement candidate, {candidate}, is a linear score whose "
                "graph gives every round the same hazard, so its survival is geometric by construction "
                "(dwise_predict/survival/linear.py), not a fitted distribution. The survival candidate "
                "(refine = \"survival\" in the training config) has fitted curves.")
    what = ("Ensemble survival curves" if kind == "fitted" else
            f"Survival curves of candidate {candidate}: the mean of fitted survival members and one ridge member "
            "whose own curve is geometric by construction")
    return Figure("survival_curves", plots.survival_curves(survival["curves"], survival["true"], survival["labels"]),
                  f"{what}, of evaluation requests spread over the estimate's range; dotted lines mark each "
                  "request's actual remaining rounds.")


def _calibration_section(rows: list[dict], arrays: dict) -> Section:
    """Median ratios of the three estimates and their decile calibration curves."""
    remaining = arrays["eval_requests"]["total_rounds"].to_numpy(dtype=float) - 1
    return Section("Calibration", "", [
        _calibration_table(rows),
        Figure("calibration",
               plots.calibration_curve(remaining, {"admission (total − 1)": arrays["admission"] - 1,
                                                   "raw refinement": arrays["refined_raw"],
                                                   "calibrated": arrays["refined"]}),
               "Median actual remaining rounds per decile of each estimate; "
               "the dashed diagonal is perfect calibration."),
    ])


def _loco_section(loco: dict, characterization: dict) -> Section:
    """Leave-one-category-out tables and bars, and the inputs whose direction flips between
    categories (why a held-out category can rank worse than the ones trained on)."""
    blocks = loco_tables(loco)
    if loco["rows"]:
        blocks.insert(1, Figure("loco", plots.loco_bars(loco["rows"]),
                                "Within-category ρ: light = category in training, dark = held out; "
                                "n/a = undefined."))
    mixed = [d["column"] for d in characterization["signal_directions"] if d["direction"] == DEPENDS_ON_CATEGORY]
    if mixed:
        blocks.append(f"Inputs whose direction inside a category depends on the category: {', '.join(mixed)} "
                      "(Workload, early signals): the direction a predictor learns from the categories it "
                      "trains on is the wrong one for a held-out category where such an input runs the other way.")
    return Section("Leave one category out", "", blocks)


def _evaluation_meta(result: dict) -> list[str]:
    """The report's header lines: model, traces, sizes and where the predictors came from."""
    traces = result["traces"]
    return [
        f"model: {traces['model']}",
        f"traces: {', '.join(traces['paths'])} (fingerprint {traces['fingerprint'][:16]}…)",
        f"requests: {traces['n_train']} train, {traces['n_eval']} eval",
        "predictors: "
        + (f"run {result['run']}" if result.get("run") else "trained on the train split by this evaluation"),
    ]


def survival_examples(curves: np.ndarray, estimate: np.ndarray, true: np.ndarray, ids, n: int = 4) -> dict:
    """Pick ``n`` requests spread over the estimate's range (by rank) for the survival plot.

    Parameters
    ----------
    curves : array of shape (n_eval, K), survival of every evaluation request.
    estimate : array of shape (n_eval,), the estimate used to spread the picks.
    """
    order = np.argsort(estimate, kind="stable")
    picks = order[np.unique(np.linspace(0, len(order) - 1, min(n, len(order))).round().astype(int))]
    return {"curves": curves[picks], "true": true[picks], "labels": [str(ids[i]) for i in picks]}
