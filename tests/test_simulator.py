"""Round-level simulator: hand-computed schedules, oracle vs FCFS, fast-forward equivalence, bad input."""

import json

import numpy as np
import pytest

from dwise_predict.errors import ConfigError, TraceError
from dwise_predict.simulation.simulator import (
    SimConfig,
    SimRequests,
    compare,
    make_arrivals,
    parse_rates,
    simulate,
    sim_requests_from_traces,
)


def workload(P, rounds, first=None, out_blocks=4, ids=None):
    n = len(P)
    return SimRequests(
        request_ids=np.array(ids or [chr(ord("A") + i) for i in range(n)]),
        prompt_blocks=np.array(P),
        total_rounds=np.array(rounds),
        first_block_rounds=np.array(first if first is not None else rounds),
        output_blocks=np.full(n, out_blocks),
    )


def in_order(n, times=None):
    return np.arange(n), np.zeros(n) if times is None else np.asarray(times, dtype=float)


# Three requests arriving together in the order A, B, C; B = 2 slots, k = 8:
#   A: P = 2, 3 denoising rounds (R = 5)   B: P = 0, 1 round (R = 1)   C: P = 1, 1 round (R = 2)
HAND = dict(P=[2, 0, 1], rounds=[3, 1, 1])
CFG = SimConfig(slots=2, k=8, round_ms=1000.0, slot_ms=0.0)


def test_srpt_schedule_worked_out_by_hand():
    # round 1: rank B(1) C(2) A(5); top 2 = B, C admitted and run: B denoises (done), C prompt (P=0, R=1)
    # round 2: A now ranks in the top 2 of {C(1), A(5)}: admitted; run C (denoise, done) and A (prompt)
    # round 3: A prompt (P=0); rounds 4-6: A's three denoising rounds, done after round 6
    r = simulate(workload(**HAND), "dwise-oracle", CFG, in_order(3), record=True)
    assert [ids for ids, _ in r.run_log] == [["B", "C"], ["C", "A"], ["A"], ["A"], ["A"], ["A"]]
    assert [p for _, p in r.run_log][:3] == [[False, True], [False, True], [True]]
    assert r.completion_round.tolist() == [6, 1, 2]
    assert r.metrics["mean_latency_rounds"] == pytest.approx(3.0)
    assert r.latency_s.tolist() == [6.0, 1.0, 2.0]  # 1 s rounds
    assert r.metrics["idle_slots_pct"] == pytest.approx(100 * (1 - 8 / 12))  # 2+2+1+1+1+1 blocks of 12
    assert r.metrics["prefill_only_rounds_pct"] == pytest.approx(100 / 6)  # round 3 only


def test_fcfs_mixed_schedule_worked_out_by_hand():
    # round 1: A, B (first two arrivals) run: A prompt, B denoise (done)
    # round 2: C admitted; A prompt (P=0), C prompt (P=0); round 3: A, C denoise (C done)
    # rounds 4, 5: A denoises, done after round 5
    r = simulate(workload(**HAND), "fcfs-mixed", CFG, in_order(3), record=True)
    assert [ids for ids, _ in r.run_log] == [["A", "B"], ["A", "C"], ["A", "C"], ["A"], ["A"]]
    assert r.completion_round.tolist() == [5, 1, 3]
    assert r.metrics["mean_latency_rounds"] == pytest.approx(3.0)


def test_sglang_default_prefill_first_worked_out_by_hand():
    # round 1: A, B resident; prefill first: only A runs (P=1); round 2: only A (P=0); C not admitted
    #   (top 2 by arrival are A, B); round 3: A, B denoise (B done); round 4: C admitted, C prefill
    #   alone; round 5: A, C denoise (C done); round 6: A done.
    r = simulate(workload(**HAND), "sglang-default", CFG, in_order(3), record=True)
    assert [ids for ids, _ in r.run_log] == [["A"], ["A"], ["A", "B"], ["C"], ["A", "C"], ["A"]]
    assert r.completion_round.tolist() == [6, 3, 5]
    assert r.metrics["mean_latency_rounds"] == pytest.approx(14 / 3)
    assert r.metrics["prefill_only_rounds_pct"] == pytest.approx(50.0)  # rounds 1, 2, 4
    assert r.metrics["preemptions_per_request"] == 0.0  # barrier stalls are not preemptions


def test_preemption_by_a_shorter_arrival_and_latency_from_arrival():
    # B = 1. A (5 rounds) alone from t = 0; B (1 round) arrives at t = 1.5 s, so before round 3
    # (rounds take 1 s and start at 0, 1, 2 s). Oracle: R_A = 3 > R_B = 1, so B runs in round 3
    # and A is paused once; A finishes in round 6. FCFS: B waits until A is done (round 6).
    w = workload([0, 0], [5, 1])
    cfg = SimConfig(slots=1, k=8, round_ms=1000.0, slot_ms=0.0)
    arrivals = in_order(2, [0.0, 1.5])
    oracle = simulate(w, "dwise-oracle", cfg, arrivals)
    assert oracle.completion_round.tolist() == [6, 3]
    assert oracle.latency_rounds.tolist() == [6, 1]  # B arrived after 2 rounds
    assert oracle.latency_s.tolist() == pytest.approx([6.0, 1.5])
    assert oracle.metrics["preemptions_per_request"] == 0.5
    fcfs = simulate(w, "fcfs-mixed", cfg, arrivals)
    assert fcfs.latency_rounds.tolist() == [5, 4] and fcfs.latency_s.tolist() == pytest.approx([5.0, 4.5])


def test_time_to_first_block_and_round_time_model():
    # one request, P = 1, output blocks of 2 then 3 rounds; round = 10 ms + 5 ms per block
    w = workload([1], [5], first=[2])
    r = simulate(w, "fcfs-mixed", SimConfig(slots=4, round_ms=10.0, slot_ms=5.0), in_order(1))
    assert r.ttfb_rounds.tolist() == [3] and r.latency_rounds.tolist() == [6]
    assert r.ttfb_s[0] == pytest.approx(0.045) and r.latency_s[0] == pytest.approx(0.090)


def test_idle_server_jumps_to_the_next_arrival():
    w = workload([0, 0], [1, 1])
    r = simulate(w, "fcfs-mixed", SimConfig(slots=1, round_ms=1000.0, slot_ms=0.0), in_order(2, [0.0, 10.0]))
    assert r.metrics["rounds"] == 2 and r.latency_s.tolist() == pytest.approx([1.0, 1.0])
    assert r.metrics["makespan_s"] == pytest.approx(11.0)


def test_kv_budget_limits_residency():
    # each request reserves P + output blocks + slack = 0 + 1 + 0 = 1 block; budget 2 blocks:
    # at most two resident, so B = 4 slots cannot fill
    w = workload([0, 0, 0, 0], [2, 2, 2, 2], out_blocks=1)
    r = simulate(w, "dwise-oracle", SimConfig(slots=4, kv_budget=2, kv_slack_blocks=0), in_order(4))
    assert r.completion_round.tolist() == [2, 2, 4, 4]


@pytest.fixture(scope="module")
def synthetic_workload():
    from dwise_predict.traces.synthetic import make_synthetic_traces

    ds = make_synthetic_traces(n_requests=600, hidden_size=8, seed=3, block_size=16)
    w = sim_requests_from_traces(ds, split=None)
    rng = np.random.default_rng(0)
    w.admission = w.total_rounds * np.exp(rng.normal(0, 0.7, len(w)))
    w.refined = np.maximum(w.total_rounds - 1 + rng.normal(0, 2, len(w)), 0)
    return w


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("arrival", ["burst", "burst-poisson"])
def test_oracle_never_worse_than_fcfs_on_mean_latency(synthetic_workload, seed, arrival):
    cfg = SimConfig(slots=16, k=4, seed=seed, arrival=arrival, rate=20.0 if arrival != "burst" else None)
    results = {r.policy: r.metrics["mean_latency_s"] for r in compare(synthetic_workload, cfg)}
    assert results["dwise-oracle"] <= results["fcfs-mixed"]
    assert results["dwise-oracle"] <= results["sglang-default"]
    assert results["dwise-refined"] < results["sglang-default"]


def test_fast_forward_gives_the_same_schedule(synthetic_workload):
    cfg = SimConfig(slots=16, k=2, kv_budget=400, arrival="burst-poisson", rate=15.0, seed=5)
    arrivals = make_arrivals(len(synthetic_workload), cfg)
    for policy in ("sglang-default", "dwise-refined", "dwise-oracle"):
        fast = simulate(synthetic_workload, policy, cfg, arrivals)
        slow = simulate(synthetic_workload, policy, cfg, arrivals, fast_forward=False)
        assert fast.completion_round.tolist() == slow.completion_round.tolist(), policy
        assert fast.metrics["preemptions_per_request"] == slow.metrics["preemptions_per_request"]
        np.testing.assert_allclose(fast.latency_s, slow.latency_s, rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("guard", [{}, {"aging": 0.05, "max_wait": 60}])
def test_spans_run_the_rounds_the_policy_would_have_planned(synthetic_workload, monkeypatch, guard):
    """Where every resident request runs and nobody waits, the simulator runs the rounds up to the next
    arrival without asking the policy each round (``_RoundLoop._run_span``). Every metric and every
    per-request stamp is the one asking it every round gives, bit for bit, for each scheduler (those
    that never take a span too: MLFQ, the prefill-first ones), with and without the starvation guard
    (whose clock a span advances); and the spans did run."""
    from dwise_predict.simulation import simulator
    from dwise_predict.simulation.schedulers import SCHEDULERS

    spans, real_span, real_init = [], simulator._RoundLoop._run_span, simulator._RoundLoop.__init__
    monkeypatch.setattr(simulator._RoundLoop, "_run_span", lambda self, *a: spans.append(1) or real_span(self, *a))

    def without_spans(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.spans = False

    w = synthetic_workload
    w.probe, w.raw_refined = w.refined + 1.0, w.refined * 1.3
    # below the service rate (~1.3 requests/s here): after the burst, the server often keeps up
    cfg = SimConfig(slots=16, k=2, arrival="burst-poisson", rate=1.0, seed=5, **guard)
    arrivals = make_arrivals(len(w), cfg)
    with_spans = {p: simulate(w, p, cfg, arrivals) for p in SCHEDULERS}
    assert len(spans) > 1000
    monkeypatch.setattr(simulator._RoundLoop, "__init__", without_spans)
    for policy in SCHEDULERS:
        asked, fast = simulate(w, policy, cfg, arrivals), with_spans[policy]
        assert json.dumps(fast.metrics, sort_keys=True) == json.dumps(asked.metrics, sort_keys=True), policy  # NaN too
        for name in ("completion_round", "latency_rounds", "latency_s", "ttfb_rounds", "ttfb_s"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(asked, name), err_msg=f"{policy} {name}")


def test_same_seed_same_result_and_arrivals(synthetic_workload):
    cfg = SimConfig(slots=8, arrival="burst-poisson", rate=10.0, seed=7)
    a, b = simulate(synthetic_workload, "dwise-admission", cfg), simulate(synthetic_workload, "dwise-admission", cfg)
    assert a.metrics == b.metrics
    order, times = make_arrivals(10, SimConfig(arrival="burst-poisson", rate=2.0, seed=1))
    assert sorted(order.tolist()) == list(range(10)) and (times[:5] == 0).all() and (np.diff(times) >= 0).all()
    assert (times[5:] > 0).all()
    _, times = make_arrivals(2000, SimConfig(arrival="poisson", rate=4.0, seed=1))
    assert times[0] == 0 and (times[1:] > 0).all()
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate


def test_rates_parse_multiples_of_the_default_service_rate(synthetic_workload):
    cfg = SimConfig(slots=16)
    one, two = parse_rates("1x,2x", synthetic_workload, cfg)
    backlogged = simulate(synthetic_workload, "sglang-default", cfg).metrics["throughput_rps"]
    assert one == pytest.approx(backlogged) and two == pytest.approx(2 * one)
    assert parse_rates("3.5", synthetic_workload, cfg) == [3.5]
    with pytest.raises(ConfigError, match="`rates` item 'fast'"):
        parse_rates("fast", synthetic_workload, cfg)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(slots=0), "`slots` \\(B\\) must be a positive integer, got 0"),
        (dict(k=0.5), "`k` must be at least 1"),
        (dict(kv_budget=-1), "`kv_budget` must be positive"),
        (dict(arrival="burst-poisson"), "need a positive `rate`"),
    ],
)
def test_bad_options_one_clear_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        SimConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_kv_budget_too_small_for_one_request():
    w = workload([3, 1], [2, 2], out_blocks=4)
    with pytest.raises(ConfigError, match="`kv_budget` 5 blocks cannot hold request A .*at least 9"):
        simulate(w, "fcfs-mixed", SimConfig(slots=2, kv_budget=5))


def test_traces_without_prompt_blocks(synthetic_traces):
    ds = synthetic_traces.subset(np.ones(len(synthetic_traces), bool))
    ds.requests = ds.requests.drop(columns=["prompt_blocks"])
    with pytest.raises(TraceError, match="no prompt_blocks column"):
        sim_requests_from_traces(ds)


def test_policy_needing_a_bundle_without_one(synthetic_traces):
    w = sim_requests_from_traces(synthetic_traces)
    with pytest.raises(ConfigError, match="pass `bundle`"):
        simulate(w, "dwise-refined", SimConfig(slots=4))
