"""Amin et al.'s batch-timeout rule (§V): closed form, the capped threshold, the Monte Carlo's divergence and U-shape."""

import json
import math

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.errors import InputError
from dwise_predict.simulation import batch_timeout as bt

PAPER = bt.paper_service_times()


def test_paper_stand_in_has_the_stated_summary():
    assert len(PAPER.samples) == 8 and PAPER.batch_size == 8
    assert PAPER.mean == pytest.approx(8.74) and PAPER.cv == pytest.approx(0.266)


def test_closed_form_t_min_and_the_papers_lambda_t_at_rho_095():
    rate = 0.95 * 8 / 8.74  # ρ = λS/B
    t_min = bt.min_timeout(8.74, rate)
    assert t_min == pytest.approx(8.74 - 8.74 / 7.6)
    assert rate * t_min == pytest.approx(6.6, abs=0.05)  # Amin et al.: "at ρ = 0.95, λT ≈ 6.6"
    assert bt.min_timeout(2.0, 0.25) == -2.0  # arrivals sparser than one service: any timeout is safe


def test_expected_window_known_values():
    # B = 2: the window closes at the next arrival or at T: E[min(T, Exp(λ))] = (1 − e^{−λT}) / λ
    assert bt.expected_window(3.0, 0.5, 2) == pytest.approx((1 - math.exp(-1.5)) / 0.5)
    assert bt.expected_window(math.inf, 0.5, 5) == pytest.approx(8.0)  # (B − 1) / λ
    assert bt.expected_window(1.0, 2.0, 1) == 0.0
    # with a huge cap the window is T: the closed form is then exact
    assert bt.exact_min_timeout(8.74, 0.64, 10_000) == pytest.approx(bt.min_timeout(8.74, 0.64), abs=1e-9)
    # the cap closes windows early, so the exact threshold lies above T_min, more so near ρ = 1
    lo, hi = (bt.exact_min_timeout(8.74, r * 8 / 8.74, 8) - bt.min_timeout(8.74, r * 8 / 8.74) for r in (0.5, 0.95))
    assert 0 < lo < hi
    assert bt.exact_min_timeout(8.74, 1.0, 8) == math.inf  # λS >= B: nothing keeps up


def test_deterministic_service_without_cap_diverges_exactly_below_t_min():
    # constant S = 4 s, λ = 1: T_min = 3 s. Without a binding cap each batch cycle lasts 1/λ + T.
    service = bt.ServiceTimes(np.array([4.0]), batch_size=10_000, source="test")
    below = bt.simulate_batching(service, 1.0, 2.5, n_requests=20_000, seed=1)
    above = bt.simulate_batching(service, 1.0, 3.5, n_requests=20_000, seed=1)
    assert bt.diverging(below["queue_wait_s"]) and not bt.diverging(above["queue_wait_s"])
    assert below["batch_sizes"].mean() == pytest.approx(1 + 2.5, rel=0.03)  # E[batch] = 1 + λT
    assert below["server_busy"] > 0.99 and above["server_busy"] == pytest.approx(4 / 4.5, rel=0.03)
    assert below["latency_s"].mean() > 50 * above["latency_s"].mean()


def test_fixed_fill_batches_are_full_and_fill_wait_matches_the_formula():
    # far from saturation, latency ≈ fill wait (B − 1) / (2λ) + S (constant S, no queue)
    service = bt.ServiceTimes(np.array([1.0]), batch_size=8, source="test")
    sim = bt.simulate_batching(service, 0.5, math.inf, n_requests=20_000, seed=0)
    assert (sim["batch_sizes"] == 8).all()
    assert sim["latency_s"].mean() == pytest.approx(7 / (2 * 0.5) + 1.0, rel=0.02)


def test_u_shape_in_rho_on_the_papers_inputs():
    rows = bt.study(PAPER, bt.PAPER_RHOS, n_requests=20_000, seed=0)
    mean = [r["mean_s"] for r in rows]
    best = int(np.argmin(mean))
    assert 0 < best < len(mean) - 1  # falls, then rises: the minimum is inside the range
    assert rows[best]["rho"] in (0.5, 0.7, 0.85)  # Amin et al.: lowest mean near ρ ≈ 0.70
    assert mean[0] > mean[best] and mean[-1] > mean[best]
    assert not any(r["diverging"] for r in rows)  # ρ < 1 with full batches: stable everywhere


def test_verdict_follows_the_rule_on_the_papers_inputs():
    rate = 0.7 * 8 / 8.74
    cap = bt.exact_min_timeout(8.74, rate, 8)
    unstable = bt.verdict(PAPER, rate, bt.min_timeout(8.74, rate) - 2.0)
    stable = bt.verdict(PAPER, rate, cap + 1.0)
    assert not unstable["rule_stable"] and not unstable["stable"] and unstable["monte_carlo_diverging"]
    assert stable["stable"] and not stable["monte_carlo_diverging"]
    assert unstable["mean_s"] > 20 * stable["mean_s"]


def test_same_seed_same_numbers():
    a = bt.study(PAPER, (0.5,), n_requests=2000, seed=3)
    b = bt.study(PAPER, (0.5,), n_requests=2000, seed=3)
    assert a == b


def test_service_time_files(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"batch_size": 4, "service_s": [1.0, 2.0, 3.0]}))
    s = bt.load_service_times(tmp_path / "s.json")
    assert s.batch_size == 4 and s.mean == 2.0
    (tmp_path / "s.txt").write_text("# seconds\n1.5\n2.5\n")
    assert bt.load_service_times(tmp_path / "s.txt", 2).mean == 2.0
    with pytest.raises(InputError, match="does not say its batch size"):
        bt.load_service_times(tmp_path / "s.txt")
    (tmp_path / "bad.txt").write_text("1\n-2\n")
    with pytest.raises(InputError, match="positive finite"):
        bt.load_service_times(tmp_path / "bad.txt", 2)


def test_cli_prints_verdicts_and_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "bt"
    assert main(["batch-timeout", "--timeout", "8", "--requests", "4000", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["rho"] for r in rows] == list(bt.PAPER_RHOS)
    assert [r["stable"] for r in rows] == [8 >= r["t_min_capped_s"] for r in rows]
    assert rows[-1]["stable"] is False  # at ρ = 0.95 the capped threshold is above 8 s
    assert (out / "batch_timeout.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["batch-timeout", "--rhos", "0.5,-1", "--timeout", "-3"]) == 1
    err = capsys.readouterr().err
    assert "--rhos" in err and "--timeout" in err and err.count("\n") == 1


def test_service_times_of_synchronized_batches_from_traces_and_a_round_cost():
    # a: P = 2, 3 rounds; b: P = 0, 1 round. Round = 10 ms + 1 ms per prefill row + 2 ms per decode row.
    # {b, b}: one decode round of 2 rows = 14 ms; {a, b}: 2 prefill rounds of 1 row (22 ms) + decode
    # rounds of 2, 1, 1 rows (14 + 12 + 12 ms) = 60 ms; {a, a}: 2 x 12 + 3 x 14 = 66 ms
    from dwise_predict.simulation.round_cost import RoundCost
    from dwise_predict.simulation.simulator import SimRequests, sync_batch_service_times

    w = SimRequests(np.array(["a", "b"]), np.array([2, 0]), np.array([3, 1]), np.array([3, 1]), np.array([4, 4]))
    s = sync_batch_service_times(w, RoundCost(10, 1, 2, source="hand"), 2, n_batches=40, seed=0)
    assert set(np.round(s.samples * 1000, 6).tolist()) <= {14.0, 60.0, 66.0} and len(set(s.samples.tolist())) == 3
    assert s.batch_size == 2 and "hand" in s.source


def test_cli_from_traces_and_a_round_profile(tmp_path, capsys):
    from dwise_predict.traces import write_traces
    from dwise_predict.traces.synthetic import make_synthetic_traces

    traces = write_traces(make_synthetic_traces(n_requests=120, hidden_size=8, seed=1, block_size=16), tmp_path / "tr")
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"source": "unit profile", "base_ms": 40, "prefill_block_ms": 1, "decode_block_ms": 2}))
    args = ["batch-timeout", "--traces", str(traces), "--round-profile", str(profile), "--batch-size", "4",
            "--requests", "2000", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert "unit profile" in result["settings"]["source"] and result["settings"]["batch_size"] == 4
    s = result["settings"]["mean_s"]
    assert [r["t_min_s"] for r in result["rows"]] == pytest.approx([s - s / (rho * 4) for rho in bt.PAPER_RHOS])
    assert main(["batch-timeout", "--traces", str(traces)]) == 1
    assert "--traces and --round-profile go together" in capsys.readouterr().err
