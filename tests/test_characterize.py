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


def with_rounds(ds, rounds_per_block, category=None, **decoding):
    """``ds`` with the rounds set: ``rounds_per_block`` one list per request (total rounds their sum), its
    categories replaced where given and its manifest's decoding updated with ``decoding``."""
    from dwise_predict.traces import TraceDataset

    requests = ds.requests.assign(rounds_per_block=list(rounds_per_block),
                                  total_rounds=[sum(r) for r in rounds_per_block])
    if category is not None:
        requests["category"] = category
    manifest = {**ds.manifest, "decoding": {**ds.manifest["decoding"], **decoding}}
    return TraceDataset(requests, ds.first_round, ds.prompt_last, manifest)


def test_tier_detector_on_traces_with_known_tiers_and_on_flat_ones():
    """Rounds on 40 + 12k, k = 0..5 (every category on every tier): the detector reports spacing 12 and
    six levels, overall and per category; rounds 1..60, each as often: spacing 1, no tiers."""
    base = make_traces(n_requests=240)
    tiered = characterize([with_rounds(base, [[40 + 12 * ((i // 4) % 6)] for i in range(240)])])
    for stats in [tiered["overall"], *tiered["per_category"].values()]:
        d = stats["discreteness"]
        assert (d["distinct"], d["dominant_spacing"], d["spacing_share"]) == (6, 12, 1.0)
        assert d["tiered"] and d["tiers"] == "40 + 12k"
    flat = characterize([with_rounds(base, [[1 + i % 60] for i in range(240)])])["overall"]["discreteness"]
    assert (flat["distinct"], flat["dominant_spacing"], flat["tiered"], flat["tiers"]) == (60, 1, False, None)


def _two_block_sizes():
    """The same 320 requests at block 8, every block taking 3 rounds (1-4 blocks: 3, 6, 9, 12 rounds), and
    at block 16, every block taking 5 (1-2 blocks: 5, 10)."""
    b8 = with_rounds(make_traces(block_size=8), [[3] * (1 + i % 4) for i in range(320)])
    b16 = with_rounds(make_traces(block_size=16), [[5] * (1 + i % 2) for i in range(320)])
    return b8, b16


def test_block_sizes_are_split_with_amin_et_al_invariance_table():
    b8, b16 = _two_block_sizes()
    result = characterize([b16, b8])  # sections by block size, whatever the inputs' order
    assert "overall" not in result  # never pooled over block sizes
    assert [c["label"] for c in result["configurations"]] == ["synthetic, block 8", "synthetic, block 16"]
    assert [c["overall"]["rounds"]["n"] for c in result["configurations"]] == [320, 320]
    assert [c["decoding"]["block_size"] for c in result["configurations"]] == [8, 16]
    [table] = result["invariance"]
    assert table["label"] == "synthetic" and table["matched"] == 320
    rows = table["rows"]
    assert [r["block_size"] for r in rows] == [8, 16] and [r["n"] for r in rows] == [320, 320]
    assert [r["mean_rounds_per_block"] for r in rows] == [3.0, 5.0]
    assert [r["p50"] for r in rows] == [7.5, 7.5]
    assert rows[0]["cv"] == pytest.approx(np.sqrt(1.25) * 3 / 7.5) and rows[1]["cv"] == pytest.approx(2.5 / 7.5)
    # per request (block 8, block 16): (3, 5), (6, 10), (9, 5), (12, 10); the CV of a pair is |a - b| / (a + b)
    assert table["within_request_cv"] == pytest.approx(np.mean([2 / 8, 4 / 16, 4 / 14, 2 / 22]))
    assert table["across_request_cv"] == pytest.approx((np.sqrt(1.25) * 3 / 7.5 + 2.5 / 7.5) / 2)
    assert table["ratio"] == pytest.approx(table["across_request_cv"] / table["within_request_cv"])


def test_other_algorithms_are_refused_unless_split(tmp_path, capsys):
    from dwise_predict.errors import InputError

    ours = make_traces()
    d2f = with_rounds(ours, ours.requests["rounds_per_block"], algorithm="D2F",
                      algorithm_config={"add_threshold": 0.1, "decode_threshold": 0.9, "confidence_threshold": 1.0})
    with pytest.raises(InputError, match=r"\(algorithm: synthetic vs D2F\).*`split_decodings`"):
        characterize([ours, d2f])
    lower = with_rounds(ours, ours.requests["rounds_per_block"], algorithm_config={"threshold": 0.9})
    with pytest.raises(InputError, match=r"algorithm_config: \{\} vs \{\"threshold\": 0.9\}"):
        characterize([ours, lower])
    split = characterize([ours, d2f], split_decodings=True)
    assert [c["label"] for c in split["configurations"]] == ["synthetic, block 8", "D2F add_threshold=0.1 confidence_threshold=1.0 decode_threshold=0.9, block 8"]
    assert split["invariance"] == []  # one block size per algorithm
    a, b = write(ours, tmp_path / "ours"), write(d2f, tmp_path / "d2f")
    assert main(["characterize", str(a), str(b)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "were decoded differently" in err[0] and "pass --split-decodings" in err[0]
    assert main(["characterize", str(a), str(b), "--split-decodings"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # a long title wraps
    assert ("Denoising rounds — synthetic (synthetic-1); D2F add_threshold=0.1 confidence_threshold=1.0 "
            "decode_threshold=0.9, block 8") in shown


def test_cli_reports_each_block_size_and_the_invariance_table(tmp_path, capsys):
    b8, b16 = _two_block_sizes()
    out = tmp_path / "char"
    assert main(["characterize", str(write(b8, tmp_path / "b8")), str(write(b16, tmp_path / "b16")),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Block-size invariance (Amin et al., §III-E): synthetic" in printed
    assert "On the 320 requests met at every block size" in " ".join(printed.split())
    markdown = (out / "characterization.md").read_text()
    assert "| 8 | 320 | 3.00 | 7.5 | 0.447 |" in markdown and "| 16 | 320 | 5.00 | 7.5 | 0.333 |" in markdown
    assert "## Rounds distribution — synthetic, block 16" in markdown
    assert "within-request CV 0.0096" in markdown  # the paper's figure beside ours
    for i in (1, 2):
        assert (out / "plots" / f"characterization_round_histograms_{i}.png").read_bytes()[:4] == b"\x89PNG"


def _runs():
    """Three runs of the same 100 requests (categories a: 0-49, b: 50-99), 20-26 rounds each: run 1 takes
    one round more on requests 0-9, run 2 five more on requests 10-29; run 1 holds one request more and
    run 2 lists its rows in another order."""
    from dwise_predict.traces import TraceDataset

    category = ["a"] * 50 + ["b"] * 50
    rounds = np.array([20 + i % 7 for i in range(100)])
    first = with_rounds(make_traces(n_requests=100), [[r] for r in rounds], category)
    more = rounds + (np.arange(100) < 10)
    second = with_rounds(make_traces(n_requests=101), [[r] for r in [*more, 30]], [*category, "b"])
    shifted = rounds + 5 * ((np.arange(100) >= 10) & (np.arange(100) < 30))
    third = with_rounds(make_traces(n_requests=100), [[r] for r in shifted], category)
    order = np.random.default_rng(0).permutation(100)
    third = TraceDataset(third.requests.iloc[order].reset_index(drop=True), third.first_round[order],
                         third.prompt_last[order], third.manifest)
    return first, second, third


def test_round_stability_across_three_runs_with_known_differences():
    from dwise_predict.evaluation.stability import round_stability

    first, second, third = _runs()
    result = round_stability([first, second, third])
    assert result["requests"] == [100, 101, 100] and result["matched"] == 100
    # pairs: 0-1 differ on 10 requests by one round; 0-2 on 20 by five (over 10 % of 20-26); 1-2 on all 30
    shares = [(p["runs"], p["identical"], p["within_1"], p["within_10pct"]) for p in result["pairs"]]
    assert shares == [([0, 1], 0.9, 1.0, 1.0), ([0, 2], 0.8, 0.8, 0.8), ([1, 2], 0.7, 0.8, 0.8)]
    overall = result["overall"]
    assert overall["category"] == "all" and overall["n"] == 100
    assert overall["identical"] == pytest.approx(0.8) and overall["identical_in_every_run"] == pytest.approx(0.7)
    assert overall["within_1"] == pytest.approx(2.6 / 3) and overall["within_10pct"] == pytest.approx(2.6 / 3)
    counts = [first.requests["total_rounds"].to_numpy(), second.requests["total_rounds"].to_numpy()[:100],
              third.requests.set_index("request_id").loc[first.requests["request_id"], "total_rounds"].to_numpy()]
    rhos = [stats.spearmanr(counts[i], counts[j]).statistic for i, j in ((0, 1), (0, 2), (1, 2))]
    assert [p["rho"] for p in result["pairs"]] == pytest.approx(rhos) and overall["rho"] == pytest.approx(np.mean(rhos))
    a, b = result["per_category"]  # every difference lies in category a
    assert (a["category"], a["n"], b["category"], b["n"]) == ("a", 50, "b", 50)
    assert a["identical"] == pytest.approx((0.8 + 0.6 + 0.4) / 3) and a["identical_in_every_run"] == pytest.approx(0.4)
    assert a["within_1"] == pytest.approx((1.0 + 0.6 + 0.6) / 3)
    assert (b["identical"], b["identical_in_every_run"], b["within_1"], b["within_10pct"], b["rho"]) == (1.0, 1.0, 1.0,
                                                                                                       1.0, 1.0)


def test_round_stability_refuses_what_is_not_repeated_runs():
    from dwise_predict.errors import InputError
    from dwise_predict.evaluation.stability import round_stability

    first, second, _ = _runs()
    with pytest.raises(InputError, match="give two or more trace sets, got 1"):
        round_stability([first])
    longer = with_rounds(first, first.requests["rounds_per_block"], budget=512)
    with pytest.raises(InputError, match=r"differ \(budget: 256 vs 512\)"):
        round_stability([first, longer])
    renamed = first.requests.assign(request_id=[f"other-{i}" for i in range(100)])
    from dwise_predict.traces import TraceDataset

    with pytest.raises(InputError, match="no request id is in every one of the 2 runs"):
        round_stability([second, TraceDataset(renamed, first.first_round, first.prompt_last, first.manifest)])


def test_cli_stability_table_in_report_and_json(tmp_path, capsys):
    paths = [str(write(ds, tmp_path / f"run{i}")) for i, ds in enumerate(_runs())]
    out = tmp_path / "table11"
    assert main(["characterize", *paths, "--stability", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["stability"] == json.loads((out / "characterization.json").read_text())["stability"]
    assert printed["stability"]["overall"]["identical"] == pytest.approx(0.8)
    assert printed["overall"]["rounds"]["n"] == 301  # the characterization pools the three runs
    markdown = (out / "characterization.md").read_text()
    assert "## Round-count stability across runs" in markdown
    assert "**Round-count stability across 3 runs (the DWISE paper, Table 11)" in markdown
    assert "| all | 100 | 80.0% | 70.0% | 86.7% | 86.7% |" in markdown
    assert "| b | 50 | 100.0% | 100.0% | 100.0% | 100.0% | 1.000 |" in markdown
    assert "| SGLang | different traces | 37.0% | 0.972 |" in markdown  # the paper's rows beside ours
    assert main(["characterize", *paths, "--stability"]) == 0
    assert "Table 11" in capsys.readouterr().out
    assert main(["characterize", paths[0], "--stability"]) == 1
    assert "give two or more trace sets, got 1" in capsys.readouterr().err


def _d2f_and_base():
    """The same 200 requests (ids syn-000000..199; D2F's set holds 40 more) decoded twice. D2F: 8, 16, 24 or
    32 rounds (one to four blocks of 8 on tiers 8 + 8k), CV 8·√1.25 / 20; wall 0.5 s + 10 ms a round, CV
    0.08·√1.25 / 0.7. Base: 20-24 rounds, CV √2 / 22; wall 10 ms a round, the same CV."""
    from dwise_predict.traces import TraceDataset

    def timed(ds, wall):
        return TraceDataset(ds.requests.assign(wall_s=wall(ds.requests["total_rounds"].to_numpy())), ds.first_round,
                            ds.prompt_last, ds.manifest)

    d2f = with_rounds(make_traces(n_requests=240), [[8] * (1 + i % 4) for i in range(240)], algorithm="D2F",
                      algorithm_config={"add_threshold": 0.5, "decode_threshold": 0.9, "confidence_threshold": 1.0})
    base = with_rounds(make_traces(n_requests=200), [[20 + i % 5] for i in range(200)], algorithm="LowConfidence",
                       algorithm_config={"threshold": 0.95})
    return timed(d2f, lambda r: 0.5 + 0.01 * r), timed(base, lambda r: 0.01 * r)


def test_d2f_against_base_on_the_same_prompts_with_known_cvs():
    d2f, base = _d2f_and_base()
    result = characterize([d2f, base], split_decodings=True)
    [table] = result["d2f_vs_base"]
    assert table["matched"] == 200 and table["base"] == "LowConfidence threshold=0.95, block 8"
    assert table["d2f"].startswith("D2F add_threshold=0.5 confidence_threshold=1.0 decode_threshold=0.9")
    ours, theirs = table["rows"]
    assert ours["rounds"]["cv"] == pytest.approx(8 * np.sqrt(1.25) / 20)
    assert theirs["rounds"]["cv"] == pytest.approx(np.sqrt(2) / 22)
    assert table["rounds_cv_ratio"] == pytest.approx(8 * np.sqrt(1.25) / 20 / (np.sqrt(2) / 22))
    assert ours["wall"]["cv"] == pytest.approx(0.08 * np.sqrt(1.25) / 0.7)
    assert table["wall_cv_ratio"] == pytest.approx(0.08 * np.sqrt(1.25) / 0.7 / (np.sqrt(2) / 22))
    assert ours["discreteness"]["tiers"] == "8 + 8k" and ours["discreteness"]["distinct"] == 4
    assert not theirs["discreteness"]["tiered"] and theirs["discreteness"]["dominant_spacing"] == 1
    from dwise_predict.evaluation.d2f_report import tier_verdict

    assert [tier_verdict(r["discreteness"]) for r in table["rows"]] == ["8 + 8k (4 levels)",
                                                                      "no tiers: spacing 1 (5 levels)"]
    # nothing in common, nothing compared; no D2F, no table
    other = with_rounds(make_traces(n_requests=10), [[3]] * 10, algorithm="LowConfidence")
    renamed = other.requests.assign(request_id=[f"x{i}" for i in range(10)])
    from dwise_predict.traces import TraceDataset

    other = TraceDataset(renamed, other.first_round, other.prompt_last, other.manifest)
    assert characterize([d2f, other], split_decodings=True)["d2f_vs_base"][0]["matched"] == 0
    assert "d2f_vs_base" not in characterize([base, other], split_decodings=True)


def test_cli_d2f_against_base_table_in_report_json_and_terminal(tmp_path, capsys):
    d2f, base = _d2f_and_base()
    a, b = write(d2f, tmp_path / "d2f"), write(base, tmp_path / "base")
    out = tmp_path / "char"
    assert main(["characterize", str(a), str(b), "--split-decodings", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "D2F against base on the same prompts (Amin et al., Fig. 4 and §III-A/B)" in printed
    assert "8 + 8k (4 levels)" in printed and "6.96×" in printed and "178 + 29k (11 levels)" in printed
    result = json.loads((out / "characterization.json").read_text())
    assert result["d2f_vs_base"][0]["rounds_cv_ratio"] == pytest.approx(6.957, abs=1e-3)
    markdown = (out / "characterization.md").read_text()
    assert "## D2F against base — D2F add_threshold=0.5" in markdown
    assert "| Amin et al.: D2F |  |  | n/a | 0.272 | 2.64 | 178 + 29k (11 levels) |" in markdown
    assert "| D2F / base |  |  | 6.96× | 1.99× |  |  |" in markdown
    assert "D2F against base on the same prompts" in (out / "characterization.html").read_text()
