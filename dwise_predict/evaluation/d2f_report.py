"""The D2F-against-base table of the characterization report (Amin et al., Fig. 4 and §III-A/B), with
the paper's figures beside ours; the report and the terminal show the same cells
(:func:`.characterize.d2f_vs_base` measures them)."""

from __future__ import annotations

from dwise_predict.evaluation.document import Section, Table, fmt

# Amin et al. (LLaDA-8B-Instruct, + D2F LoRA for D2F; GSM8K, 512-token budget, H200, one request at a
# time): latency CV, latency max/min, the tier detector's finding; "n/a" where the paper gives none
PAPER_ROWS = (("Amin et al.: D2F", "n/a", "0.272", "2.64", "178 + 29k (11 levels)"),
              ("Amin et al.: base model", "n/a", "0.100", "n/a", "n/a"),
              ("Amin et al.: D2F / base", "n/a", "2.7×", "", ""))


def tier_verdict(discreteness: dict) -> str:
    """The tier detector's verdict on one decoding's rounds, in words."""
    levels = discreteness["distinct"]
    if discreteness["tiered"]:
        return f"{discreteness['tiers']} ({levels} levels)"
    if discreteness["dominant_spacing"] is None:
        return f"one level ({levels})"
    return f"no tiers: spacing {discreteness['dominant_spacing']} ({levels} levels)"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def d2f_table(comparison: dict) -> Table:
    """One row per decoding, their ratio, and Amin et al.'s rows."""
    rows = [[f"{r['label']}", fmt(r["rounds"]["n"]), fmt(r["rounds"]["mean"], 1), fmt(r["rounds"]["cv"]),
             fmt(r["wall"]["cv"]), fmt(r["wall"]["max_min_ratio"], 2), tier_verdict(r["discreteness"])]
            for r in comparison["rows"]]
    rows.append(["D2F / base", "", "", _ratio(comparison["rounds_cv_ratio"]), _ratio(comparison["wall_cv_ratio"]),
                 "", ""])
    rows += [[name, "", "", rounds_cv, wall_cv, max_min, tiers] for name, rounds_cv, wall_cv, max_min, tiers
             in PAPER_ROWS]
    return Table(["decoding", "requests", "mean rounds", "CV of rounds", "CV of wall time", "wall max/min",
                  "tier detector"], rows,
                 f"D2F against base on the same prompts (Amin et al., Fig. 4 and §III-A/B): {comparison['d2f']} "
                 f"vs {comparison['base']}")


def d2f_text(comparison: dict) -> str:
    """What the table compares, and where ours and the paper's differ."""
    if not comparison["matched"]:
        return ("No request was decoded by both (same request_id and budget): collect both decodings from the "
                "same workload, seed and limit.")
    return (f"On the {comparison['matched']} requests both decodings ran. Amin et al.'s base is LLaDA-8B-Instruct "
            "without the D2F adapter; ours is the same model under another decoding, so here the decoding alone "
            "differs. Their tiers count D2F's loop iterations, one more than its forwards (ours): at blocks of 32 "
            "and their thresholds our count of the same pipeline is 177 + 29k. Wall time is the collecting "
            "machine's: D2F decodes one request at a time, so its CV of wall time compares with the base's only "
            "when the base was collected at batch size 1 too.")


def d2f_section(comparison: dict) -> Section:
    return Section(f"D2F against base — {comparison['d2f']} vs {comparison['base']}", "",
                   [d2f_table(comparison), d2f_text(comparison)])
