"""`characterize`: Amin et al.'s measurements, checked on hand-made and synthetic round counts."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from dwise_predict.cli import main
from dwise_predict.evaluation.characterize import (characterize, discreteness, rounds_distribution, rounds_vs_wall,
                                                    signal_directions)
from dwise_predict.evaluation.report import signal_directions_text
from evaluate_helpers import make_traces, write


def test_rounds_distribution_by_hand():
    stats = rounds_distribution(np.array([2, 4, 4, 6, 8, 12]))
    assert stats["n"] == 6 and stats["min"] == 2 and stats["max"] == 12
    assert stats["p50"] == 5.0 and stats["p25"] == 4.0 and stats["p90"] == 10.0
    assert stats["max_min_ratio"] == 6.0
    assert stats["cv"] == pytest.approx(np.std([2, 4, 4, 6, 8, 12]) / 6.0)
    assert rounds_distribution(np.array([0, 3]))["max_min_ratio"] is None


def test_tiers_are_found_as_amin_et_al_found_them():
    rng = np.random.default_rng(0)
    tiered = 178 + 29 * rng.integers(0, 11, 500)  # Amin et al.'s 178 + 29k, k = 0..10
    d = discreteness(tiered)
    assert d["distinct"] == 11 and d["dominant_spacing"] == 29 and d["spacing_share"] == 1.0
    assert d["tiered"] and d["tiers"] == "178 + 29k"
    dense = discreteness(rng.integers(1, 60, 500))
    assert dense["dominant_spacing"] == 1 and not dense["tiered"] and dense["tiers"] is None
    assert discreteness(np.full(10, 7))["dominant_spacing"] is None


def test_rounds_versus_wall_time():
    rounds = np.arange(1, 21, dtype=float)
    assert rounds_vs_wall(rounds, 0.05 * rounds + 0.2)["pearson"] == pytest.approx(1.0)
    assert rounds_vs_wall(rounds, np.ones(20)) == {"pearson": None, "spearman": None}  # constant: n/a


def test_budget_sweep_over_two_collections():
    short, long = make_traces(budget=64, block_size=8), make_traces(budget=256, block_size=8)
    result = characterize([long, short])  # same request ids in both: the tables are pooled, not merged
    sweep = result["budget_sweep"]
    assert [r["budget"] for r in sweep] == [64, 256]
    assert [r["n"] for r in sweep] == [320, 320]
    assert sweep[0]["truncated_share"] == pytest.approx((short.requests["finish"] == "budget").mean())
    assert sweep[0]["truncated_share"] > sweep[1]["truncated_share"]  # a short budget cuts more requests off
    assert sweep[0]["p90"] <= 64  # and caps the rounds
    assert len(result["per_trace"]) == 2 and result["overall"]["rounds"]["n"] == 640
    assert sorted(result["per_category"]) == ["chat", "code", "math", "mcq"]


def test_cli_writes_report_and_json(tmp_path, capsys):
    a = write(make_traces(budget=64), tmp_path / "b64")
    b = write(make_traces(budget=256), tmp_path / "b256")
    out = tmp_path / "char"
    assert main(["characterize", str(a), str(b), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "characterization.json").read_text())
    assert [r["budget"] for r in printed["budget_sweep"]] == [64, 256]
    html = (out / "characterization.html").read_text()
    assert html.count("data:image/png;base64,") == 2  # histograms + budget sweep
    assert (out / "plots" / "characterization_budget_sweep.png").read_bytes()[:4] == b"\x89PNG"
    # the wall-time correlation is labelled as the collecting machine's, wherever the table is shown
    markdown = (out / "characterization.md").read_text()
    table_at = markdown.index("| r(rounds, wall) |")
    assert markdown.index("on the machine that collected these traces", table_at) > table_at
    assert "not a property of the model" in html
    assert main(["characterize", str(a)]) == 0
    table = capsys.readouterr().out
    assert "Denoising rounds" in table and "mcq" in table
    assert "r(wall): Pearson r" in table and "machine that collected" in " ".join(table.split())


def _signal_table(seed: int = 0, n: int = 80) -> pd.DataFrame:
    """Three categories whose `mean_confidence` runs with rounds in one, against them in another and
    not at all in the third; `mean_entropy` runs against rounds in all three; no `end_probability`
    column (traces from before that signal)."""
    rng = np.random.default_rng(seed)
    frames = []
    for category, sign in (("up", 1.0), ("down", -1.0), ("flat", 0.0)):
        rounds = rng.integers(2, 60, n)
        noise = rng.normal(0.0, 1.0, n)
        confidence = sign * (rounds - rounds.mean()) / rounds.std() + (0.5 if sign else 3.0) * noise
        frames.append(pd.DataFrame({"category": category, "total_rounds": rounds, "mean_confidence": confidence,
                                    "mean_entropy": -rounds + 5.0 * rng.normal(0.0, 1.0, n),
                                    "prompt_tokens": rng.integers(5, 200, n)}))
    return pd.concat(frames, ignore_index=True)


def test_signal_directions_find_a_signal_that_reverses_between_categories():
    requests = _signal_table()
    by_column = {d["column"]: d for d in signal_directions(requests)}
    assert list(by_column) == ["mean_confidence", "mean_entropy", "prompt_tokens"]  # absent columns left out
    confidence = by_column["mean_confidence"]
    assert confidence["more_rounds"] == ["up"] and confidence["fewer_rounds"] == ["down"]
    assert confidence["direction"] == "depends on the category"
    assert by_column["mean_entropy"]["fewer_rounds"] == ["down", "flat", "up"]
    assert by_column["mean_entropy"]["direction"] == "fewer rounds"
    assert by_column["prompt_tokens"]["direction"] == "none"  # unrelated to rounds everywhere
    for category, cell in confidence["per_category"].items():  # ρ is scipy's, inside its own interval
        rows = requests["category"] == category
        assert cell["n"] == 80
        assert cell["rho"] == pytest.approx(stats.spearmanr(requests.loc[rows, "mean_confidence"],
                                                            requests.loc[rows, "total_rounds"]).statistic)
        assert cell["interval"][0] <= cell["rho"] <= cell["interval"][1]
    assert confidence["per_category"]["up"]["interval"][0] > 0.5
    assert confidence["per_category"]["down"]["interval"][1] < -0.5
    assert confidence["overall"]["n"] == 240
    assert signal_directions(requests) == signal_directions(requests)  # seeded bootstrap: deterministic
    text = signal_directions_text(list(by_column.values()))
    assert "Direction depends on the category: mean_confidence (more rounds in up; fewer in down)." in text
    assert "mean_entropy (" not in text  # one direction everywhere: not named


def test_signal_directions_in_reports(tmp_path, capsys):
    traces = write(make_traces(), tmp_path / "t")
    out = tmp_path / "char"
    assert main(["characterize", str(traces), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Early signals against total rounds" in printed and "end_probability" in printed
    result = json.loads((out / "characterization.json").read_text())
    assert [d["column"] for d in result["signal_directions"]] == [
        "frac_over_threshold", "mean_confidence", "mean_entropy", "end_probability", "prompt_tokens"]
    markdown = (out / "characterization.md").read_text()
    assert "## Early signals inside each category" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| direction |"))
    assert row.count("|") == 8  # category, n and five signals
