"""`characterize`: seed 001's measurements, checked on hand-made and synthetic round counts."""

import json

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.evaluation.characterize import characterize, discreteness, rounds_distribution, rounds_vs_wall
from evaluate_helpers import make_traces, write


def test_rounds_distribution_by_hand():
    stats = rounds_distribution(np.array([2, 4, 4, 6, 8, 12]))
    assert stats["n"] == 6 and stats["min"] == 2 and stats["max"] == 12
    assert stats["p50"] == 5.0 and stats["p25"] == 4.0 and stats["p90"] == 10.0
    assert stats["max_min_ratio"] == 6.0
    assert stats["cv"] == pytest.approx(np.std([2, 4, 4, 6, 8, 12]) / 6.0)
    assert rounds_distribution(np.array([0, 3]))["max_min_ratio"] is None


def test_tiers_are_found_like_seed_001():
    rng = np.random.default_rng(0)
    tiered = 178 + 29 * rng.integers(0, 11, 500)  # seed 001's 178 + 29k, k = 0..10
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
    assert main(["characterize", str(a)]) == 0
    table = capsys.readouterr().out
    assert "Denoising rounds" in table and "mcq" in table
