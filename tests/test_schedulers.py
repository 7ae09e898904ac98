"""The baseline schedulers and the round-cost model: schedules and times worked out by hand."""

import json
from dataclasses import replace

import numpy as np
import pytest

from dwise_predict.errors import ConfigError, InputError
from dwise_predict.simulation.round_cost import RoundCost, fit_round_cost, load_round_cost
from dwise_predict.simulation.schedulers import GAIN_STEPS, SCHEDULERS, bucket
from dwise_predict.simulation.simulator import (
    SimConfig,
    SimRequests,
    category_tails,
    compare,
    make_arrivals,
    simulate,
    sim_requests_from_traces,
)


def workload(P, rounds, est=None, out_blocks=4, first=None, categories=None):
    n = len(P)
    return SimRequests(
        request_ids=np.array([chr(ord("A") + i) for i in range(n)]),
        prompt_blocks=np.array(P),
        total_rounds=np.array(rounds),
        first_block_rounds=np.array(first if first is not None else rounds),
        output_blocks=np.full(n, out_blocks),
        admission=None if est is None else np.array(est, dtype=float),
        refined=None if est is None else np.maximum(np.array(rounds, dtype=float) - 1, 0),
        categories=None if categories is None else np.array(categories),
    )


def arrivals(times):
    return np.arange(len(times)), np.asarray(times, dtype=float)


ONE_SECOND = SimConfig(slots=1, k=8, round_ms=1000.0, slot_ms=0.0)


def test_registry_names_every_scheduler_of_the_issue():
    assert set(SCHEDULERS) == {"sglang-default", "sglang-sync", "fcfs-mixed", "mlfq", "ssjf", "s3", "ltr", "trail", "dwise-zero",
                               "dwise-admission", "dwise-raw", "dwise-refined", "dwise-oracle"}


def test_each_scheduler_says_what_it_models_and_its_steps_start_from_rows_above():
    names = list(SCHEDULERS)
    for spec in SCHEDULERS.values():
        assert spec.about and spec.adds, spec.name
        for step, before in spec.steps:
            assert names.index(before) < names.index(spec.name), (step, before, spec.name)
    assert GAIN_STEPS == (
        ("mixed batching", "sglang-default", "fcfs-mixed"), ("ordering by prompt work", "fcfs-mixed", "dwise-zero"),
        ("admission estimates", "dwise-zero", "dwise-admission"), ("refinement (raw)", "dwise-admission", "dwise-raw"),
        ("calibration", "dwise-raw", "dwise-refined"), ("refinement (calibrated)", "dwise-admission", "dwise-refined"),
        ("headroom to the oracle", "dwise-refined", "dwise-oracle"))


def test_the_help_and_both_tables_read_the_registry():
    """``simulate --help`` lists every scheduler with its ``about``; the console table and the report
    print its ``adds`` and share one column list (the report leaves out mean rounds)."""
    from rich.console import Console

    from dwise_predict.cli.simulate import SCHEDULERS_HELP
    from dwise_predict.simulation.report import render_table, scheduler_table

    for name, spec in SCHEDULERS.items():
        assert f"{name}: {spec.about}" in SCHEDULERS_HELP
    rows = [{"arrival": "burst", "policy": "s3", "mean_latency_s": 1.5, "mean_latency_rounds": 12.0,
             "speedup_vs_default": 2.0}]
    report = scheduler_table(rows, "arrival")
    assert report.columns[:3] == ["arrival", "scheduler", "mean s"] and report.columns[-2:] == ["speed-up", "adds"]
    assert "mean rounds" not in report.columns
    assert report.rows == [["burst", "s3", "1.50"] + ["n/a"] * 10 + ["2.00", "length buckets, sized KV"]]
    console = Console(width=400, record=True)
    console.print(render_table(rows, "t"))
    printed = console.export_text()
    assert "mean rounds" in printed and "speedup" in printed and "2.00x" in printed
    assert "length buckets, sized KV" in printed and "12.0" in printed


def test_each_family_has_its_own_look_in_the_plots():
    """The family (on the spec, the one source) picks hue and line style: DWISE's variants blue and
    solid, SGLang's modes red and dashed, the baselines their own colours, dash-dotted; no two
    schedulers share a colour (SGLang's synchronous mode and calibrated DWISE once did: both orange)."""
    from matplotlib.colors import to_rgb

    from dwise_predict.simulation.styles import policy_style

    families = {name: spec.family for name, spec in SCHEDULERS.items()}
    assert {n for n, f in families.items() if f == "dwise"} == {n for n in SCHEDULERS if n.startswith("dwise-")}
    assert {n for n, f in families.items() if f == "sglang"} == {"sglang-default", "sglang-sync"}
    assert {n for n, f in families.items() if f == "baseline"} == {"fcfs-mixed", "mlfq", "ssjf", "s3", "ltr", "trail"}
    styles = {name: policy_style(name) for name in SCHEDULERS}
    assert len({s.colour for s in styles.values()}) == len(SCHEDULERS)
    for name, style in styles.items():
        r, g, b = to_rgb(style.colour)
        if families[name] == "dwise":
            assert b > r and b > g and style.linestyle == "-", name
        elif families[name] == "sglang":
            assert r > b and r > g and style.linestyle == "--" and style.hatch, name
        else:
            assert style.linestyle == "-." and not (b > r + 0.2 and b > g + 0.2) and not (r > g + 0.4 and r > b + 0.4), name
    assert policy_style("someone-elses").colour == "#999999"  # a name outside the registry: grey


@pytest.mark.parametrize("sweep", [None, "rate_rps"])
def test_simulation_plots_draw_each_scheduler_in_its_style_with_the_legend_outside_the_data(monkeypatch, sweep):
    from matplotlib.colors import to_hex

    from dwise_predict.simulation import report
    from dwise_predict.simulation.styles import policy_style

    drawn = []
    monkeypatch.setattr(report, "_png", lambda fig: drawn.append(fig) or b"")
    rows = [{"arrival": "burst", "policy": name, "rate_rps": rate, "mean_latency_s": 1.0 + i, "p99_latency_s": 2.0 + i}
            for i, name in enumerate(SCHEDULERS) for rate in (1.0, 2.0)]
    report._plot(rows, sweep)
    tails = [{"arrival": "burst", "policy": name, "category": c, "p99_latency_s": 1.0} for name in SCHEDULERS
             for c in ("math", "chat")]
    report.category_plot(tails)
    for fig in drawn:
        fig.canvas.draw()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
        assert len(legends) == 1
        box = legends[0].get_window_extent()
        assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)  # beside the data, not on it
        assert [t.get_text() for t in legends[0].get_texts()] == list(SCHEDULERS)
        handles = legends[0].legend_handles
        for name, handle in zip(SCHEDULERS, handles):
            colour = handle.get_color() if sweep and fig is drawn[0] else handle.get_facecolor()
            assert to_hex(colour) == policy_style(name).colour, name


def test_srpt_oracle_is_shortest_first_on_a_burst():
    # B = 1, totals 3, 1, 2 at t = 0: shortest first completes at 1, 3, 6 (mean 10/3, the optimum);
    # FCFS at 3, 4, 6 (mean 13/3)
    w = workload([0, 0, 0], [3, 1, 2])
    oracle = simulate(w, "dwise-oracle", ONE_SECOND, arrivals([0, 0, 0]))
    fcfs = simulate(w, "fcfs-mixed", ONE_SECOND, arrivals([0, 0, 0]))
    assert oracle.completion_round.tolist() == [6, 1, 3] and oracle.metrics["mean_latency_s"] == pytest.approx(10 / 3)
    assert fcfs.completion_round.tolist() == [3, 4, 6]


def test_ssjf_is_non_preemptive_and_ltr_preemptive():
    # A (4 rounds, estimate 4) alone at t = 0; B (1) and C (2) arrive at 0.5 s, before round 2.
    # SSJF: A keeps running to round 4, then B (5), C (6, 7). LTR: B preempts A in round 2, C runs
    # 3-4 (key 2 < 4), A finishes in 7.
    w = workload([0, 0, 0], [4, 1, 2], est=[4, 1, 2])
    ssjf = simulate(w, "ssjf", ONE_SECOND, arrivals([0, 0.5, 0.5]))
    ltr = simulate(w, "ltr", ONE_SECOND, arrivals([0, 0.5, 0.5]))
    assert ssjf.completion_round.tolist() == [4, 5, 7] and ssjf.metrics["preemptions_per_request"] == 0
    assert ltr.completion_round.tolist() == [7, 2, 4]


def test_ltr_ranks_by_the_fixed_prediction_dwise_by_remaining_work():
    # A (4 rounds, estimate 4) alone; C (2 rounds, estimate 2) arrives at 2.5 s, before round 4.
    # DWISE: A's r̂ fell to 1 < 2, so A finishes in round 4 and C in 6. LTR keeps A's key 4 > 2:
    # C runs in rounds 4-5, A finishes in 6.
    w = workload([0, 0], [4, 2], est=[4, 2])
    dwise = simulate(w, "dwise-admission", ONE_SECOND, arrivals([0, 2.5]))
    ltr = simulate(w, "ltr", ONE_SECOND, arrivals([0, 2.5]))
    assert dwise.completion_round.tolist() == [4, 6]
    assert ltr.completion_round.tolist() == [6, 5]


def test_mlfq_demotes_by_work_done():
    # quantum 8 rounds: A (20 rounds) sits at level 0 for its first 8 rounds, then level 1 (work
    # 8..23). B (1 round) arrives at 9.5 s, before round 11: level 0 beats A's level 1, so B runs in
    # round 11 and A finishes in 21. Under FCFS B waits for A (round 21, then 22).
    w = workload([0, 0], [20, 1])
    mlfq = simulate(w, "mlfq", ONE_SECOND, arrivals([0, 9.5]))
    fcfs = simulate(w, "fcfs-mixed", ONE_SECOND, arrivals([0, 9.5]))
    assert mlfq.completion_round.tolist() == [21, 11]
    assert fcfs.completion_round.tolist() == [20, 21]
    # B arriving at 3.5 s finds A still at level 0 and earlier in arrival: it waits until A's
    # demotion after A's 8th round, runs in round 9, and A finishes in 21
    assert simulate(w, "mlfq", ONE_SECOND, arrivals([0, 3.5])).completion_round.tolist() == [21, 9]


def test_s3_sizes_kv_by_predicted_bucket():
    # four requests of 2 rounds (estimate 2), 8 output blocks of budget, KV pool 8 blocks, B = 4.
    # SSJF reserves the whole budget (8 blocks): one at a time, done at 2, 4, 6, 8. S³ reserves the
    # bucket of 2 rounds (2 blocks): all four resident, done at 2.
    w = workload([0] * 4, [2] * 4, est=[2] * 4, out_blocks=8)
    cfg = SimConfig(slots=4, k=8, kv_budget=8, kv_slack_blocks=0, round_ms=1000.0, slot_ms=0.0)
    assert simulate(w, "ssjf", cfg, arrivals([0] * 4)).completion_round.tolist() == [2, 4, 6, 8]
    assert simulate(w, "s3", cfg, arrivals([0] * 4)).completion_round.tolist() == [2, 2, 2, 2]
    assert bucket([0, 1, 2, 3, 5, 8.5]).tolist() == [1, 1, 2, 4, 8, 16]


def test_trail_is_srpt_with_the_probe_in_place_of_the_refinement():
    rng = np.random.default_rng(0)
    n = 60
    total = rng.integers(1, 30, n)
    w = workload(rng.integers(0, 5, n).tolist(), total.tolist(), est=(total * rng.uniform(0.5, 2, n)).tolist())
    w.refined = np.maximum(total - 1 + rng.normal(0, 3, n), 0)
    with pytest.raises(ConfigError, match="trail needs"):
        simulate(w, "trail", SimConfig(slots=4))
    # a probe noisier than the refinement, drawn apart from it: trail must read this one
    w.probe = np.maximum(total - 1 + rng.normal(0, 10, n), 0)
    cfg = SimConfig(slots=4, k=2, arrival="burst-poisson", rate=3.0, seed=2)
    trail = simulate(w, "trail", cfg).completion_round.tolist()
    assert trail == simulate(replace(w, refined=w.probe), "dwise-refined", cfg).completion_round.tolist()
    assert trail != simulate(w, "dwise-refined", cfg).completion_round.tolist()


def test_round_cost_fit_recovers_known_coefficients():
    p = np.array([1, 4, 16, 0, 0, 0, 2, 8])
    d = np.array([0, 0, 0, 1, 4, 16, 2, 8])
    ms = 3.0 + 0.5 * p + 0.25 * d
    cost = fit_round_cost(p, d, ms, "test", block_size=8)
    assert (cost.base_ms, cost.prefill_block_ms, cost.decode_block_ms) == pytest.approx((3.0, 0.5, 0.25))
    assert cost.fit_rmse_ms == pytest.approx(0.0, abs=1e-9) and cost.samples == 8
    # a negative coefficient is dropped and the rest refitted (non-negative least squares)
    cost = fit_round_cost(p, d, 3.0 + 0.5 * p - 0.01 * d, "test")
    assert cost.decode_block_ms == 0.0 and cost.prefill_block_ms > 0
    with pytest.raises(InputError, match="vary both row counts"):
        fit_round_cost([1, 2, 3], [0, 0, 0], [1, 2, 3], "test")


def test_round_cost_profile_file(tmp_path):
    samples = [{"prompt_tokens": 8 * p, "decode_blocks": d, "ms": 2 + p + 0.5 * d} for p, d in [(1, 0), (0, 2), (3, 3), (4, 0)]]
    (tmp_path / "p.json").write_text(json.dumps({"source": "my GPU", "block_size": 8, "samples": samples}))
    cost = load_round_cost(tmp_path / "p.json")
    assert cost.source == "my GPU" and cost.prefill_block_ms == pytest.approx(1.0) and cost.base_ms == pytest.approx(2.0)
    (tmp_path / "c.json").write_text(json.dumps({"source": "given", "base_ms": 1, "prefill_block_ms": 2, "decode_block_ms": 3}))
    assert load_round_cost(tmp_path / "c.json").seconds(1, 1) == pytest.approx(0.006)
    (tmp_path / "bad.json").write_text(json.dumps({"samples": [{"ms": 1}]}))
    with pytest.raises(InputError, match="each sample needs"):
        load_round_cost(tmp_path / "bad.json")


def test_sglang_default_times_each_round_by_what_it_holds():
    # The hand schedule of test_simulator (B = 2): rounds [A] [A] [A,B] [C] [A,C] [A], prefill rows
    # in rounds 1, 2, 4. Round = 10 ms + 2 ms per prefill row + 3 ms per decode row:
    # 12, 12, 16, 12, 16, 13 ms -> B done at 40 ms, C at 68 ms, A at 81 ms.
    w = workload([2, 0, 1], [3, 1, 1])
    cfg = SimConfig(slots=2, k=8, round_cost=RoundCost(10.0, 2.0, 3.0, source="hand"))
    r = simulate(w, "sglang-default", cfg, arrivals([0, 0, 0]))
    assert r.latency_s.tolist() == pytest.approx([0.081, 0.040, 0.068])
    assert r.metrics["prefill_only_time_pct"] == pytest.approx(100 * 36 / 81)
    assert r.metrics["round_cost_source"] == "hand"


def test_rhat_zero_share_and_cap_blocked_rounds():
    # admission estimates 2 and 5 against 4 true rounds: the first reaches 0 with work left
    w = workload([0, 0], [4, 4], est=[2, 5])
    r = simulate(w, "dwise-admission", SimConfig(slots=2), arrivals([0, 0]))
    assert r.metrics["rhat_zero_pct"] == 50.0
    assert np.isnan(simulate(w, "fcfs-mixed", SimConfig(slots=2), arrivals([0, 0])).metrics["rhat_zero_pct"])
    # refined (true − 1) never reaches 0 early
    assert simulate(w, "dwise-refined", SimConfig(slots=2), arrivals([0, 0])).metrics["rhat_zero_pct"] == 0.0
    # B = 1, k = 1: the second request waits on the cap in every round of the first (4 of 8)
    r = simulate(w, "dwise-oracle", SimConfig(slots=1, k=1), arrivals([0, 0]))
    assert r.metrics["cap_blocked_rounds_pct"] == pytest.approx(50.0)


def test_category_tails():
    w = workload([0, 0, 0], [1, 2, 3], categories=["code", "math", "math"])
    r = simulate(w, "fcfs-mixed", ONE_SECOND, arrivals([0, 0, 0]))
    rows = {row["category"]: row for row in category_tails(r, w)}
    assert rows["code"]["max_latency_s"] == 1.0 and rows["math"]["max_latency_s"] == 6.0
    assert rows["math"]["requests"] == 2


@pytest.fixture(scope="module")
def synthetic():
    from dwise_predict.traces.synthetic import make_synthetic_traces

    w = sim_requests_from_traces(make_synthetic_traces(n_requests=300, hidden_size=8, seed=3, block_size=16), split=None)
    rng = np.random.default_rng(0)
    w.admission = w.total_rounds * np.exp(rng.normal(0, 0.7, len(w)))
    w.refined = np.maximum(w.total_rounds - 1 + rng.normal(0, 2, len(w)), 0)
    w.probe = np.maximum(w.total_rounds - 1 + rng.normal(0, 6, len(w)), 0)
    w.raw_refined = w.refined * 1.3
    return w


def test_fast_forward_is_exact_for_the_baselines(synthetic):
    cfg = SimConfig(slots=8, k=2, kv_budget=300, arrival="burst-poisson", rate=6.0, seed=5)
    arr = make_arrivals(len(synthetic), cfg)
    for policy in ("mlfq", "ssjf", "s3", "ltr", "trail"):
        fast = simulate(synthetic, policy, cfg, arr)
        slow = simulate(synthetic, policy, cfg, arr, fast_forward=False)
        assert fast.completion_round.tolist() == slow.completion_round.tolist(), policy


def test_draw_scales_the_workload_deterministically(synthetic):
    a, b = synthetic.draw(1000, seed=4), synthetic.draw(1000, seed=4)
    assert len(a) == 1000 and len(set(a.request_ids.tolist())) == 1000
    assert (a.total_rounds == b.total_rounds).all() and a.categories is not None
    assert not (a.total_rounds == synthetic.draw(1000, seed=5).total_rounds).all()
    # every drawn request is one of the originals, predictions travelling with it
    orig = {rid: i for i, rid in enumerate(synthetic.request_ids.tolist())}
    src = np.array([orig[r.rsplit("#", 1)[0]] for r in a.request_ids.tolist()])
    assert (synthetic.admission[src] == a.admission).all() and (synthetic.total_rounds[src] == a.total_rounds).all()


def test_every_scheduler_runs_and_the_oracle_leads(synthetic):
    results = {r.policy: r.metrics for r in compare(synthetic, SimConfig(slots=8, k=4))}
    assert set(results) == set(SCHEDULERS)
    best = min(m["mean_latency_rounds"] for m in results.values())
    assert results["dwise-oracle"]["mean_latency_rounds"] == pytest.approx(best, rel=0.02)


def test_k_sweep_cap_blocks_admissions_at_small_k(synthetic):
    from dwise_predict.simulation.simulator import sweep_k

    rows = sweep_k(synthetic, SimConfig(slots=8, arrival="burst"), [1, 4], ["dwise-oracle"])
    by_k = {r["k"]: r for r in rows}
    assert by_k[1]["cap_blocked_rounds_pct"] > by_k[4]["cap_blocked_rounds_pct"]
    # a bigger resident set lets SRPT pick from more requests: mean latency does not get worse
    assert by_k[4]["mean_latency_rounds"] <= by_k[1]["mean_latency_rounds"]


def test_sglang_sync_mode_worked_out_by_hand():
    # B = 2, 1 s rounds. A: P = 1, blocks of 2 and 3 rounds; B: P = 0, one block of 4; C: P = 0, one
    # block of 1; all at t = 0 in that order.
    # step 1: A and B held; A prefills (round 1). step 2: decode both blocks until the slower is done:
    # 4 forwards (rounds 2-5), B finishes. step 3: C admitted; A's second block (3) and C's (1): 3
    # forwards (rounds 6-8), both finish.
    w = workload([1, 0, 0], [5, 4, 1])
    w.block_rounds = np.empty(3, dtype=object)
    w.block_rounds[:] = [np.array([2, 3]), np.array([4]), np.array([1])]
    r = simulate(w, "sglang-sync", SimConfig(slots=2, round_ms=1000.0, slot_ms=0.0), arrivals([0, 0, 0]))
    assert r.completion_round.tolist() == [8, 5, 8]
    assert r.ttfb_rounds.tolist() == [5, 5, 8]
    assert r.metrics["prefill_only_rounds_pct"] == pytest.approx(100 / 8)
    assert r.metrics["cap_blocked_rounds_pct"] == pytest.approx(100 * 5 / 8)  # C waits through rounds 1-5
    assert r.metrics["idle_slots_pct"] == pytest.approx(100 * (1 - (1 + 8 + 6) / 16))
    # FDFO releases B's slot as soon as a block is done instead: C is not held back until round 5
    fdfo = simulate(w, "sglang-default", SimConfig(slots=2, round_ms=1000.0, slot_ms=0.0), arrivals([0, 0, 0]))
    assert fdfo.metrics["mean_latency_rounds"] < r.metrics["mean_latency_rounds"]


def test_sglang_admission_stops_at_the_first_request_whose_kv_does_not_fit(monkeypatch):
    """SGLang admits waiting requests in order through its PrefillAdder and stops at the first it
    cannot add (``process_dllm_incoming_reqs`` breaks there), in both loops; a later, smaller request
    does not pass it. B = 4, KV budget 5 blocks, no slack; A and B reserve 4 blocks (P = 3, one output
    block of 2 rounds), C one (P = 0, one block of 1 round); all at t = 0 in that order."""
    from dwise_predict.simulation import simulator

    w = workload([3, 3, 0], [2, 2, 1], out_blocks=1)
    w.block_rounds = np.empty(3, dtype=object)
    w.block_rounds[:] = [np.array([2]), np.array([2]), np.array([1])]
    cfg = SimConfig(slots=4, kv_budget=5, kv_slack_blocks=0, round_ms=1000.0, slot_ms=0.0)
    # FDFO: A alone (B does not fit, so C waits behind it): prefill rounds 1-3, decode 4-5; then B
    # and C: B prefills in rounds 6-8 (the barrier holds C), both decode in round 9, B again in 10
    fdfo = simulate(w, "sglang-default", cfg, arrivals([0, 0, 0]), record=True)
    assert fdfo.completion_round.tolist() == [5, 10, 9]
    assert [ids for ids, _ in fdfo.run_log][:5] == [["A"], ["A"], ["A"], ["A"], ["A"]]
    # synchronous: the same admissions; B's and C's blocks run together for B's 2 forwards (9-10)
    sync = simulate(w, "sglang-sync", cfg, arrivals([0, 0, 0]))
    assert sync.completion_round.tolist() == [5, 10, 10]
    # were C allowed past B, it would ride along with A and finish in round 4
    passing = replace(SCHEDULERS["sglang-default"], blocking_admission=False)
    monkeypatch.setitem(simulator.POLICIES, "sglang-default", passing)
    assert simulate(w, "sglang-default", cfg, arrivals([0, 0, 0])).completion_round.tolist() == [5, 10, 4]


@pytest.mark.parametrize("reservations", [(4, 4, 1), (4, 1, 4), (1, 4, 4), (2, 2, 2), (5, 1, 1)])
def test_admission_stops_where_sglangs_own_incoming_loop_stops(reservations):
    """SGLang's ``process_dllm_incoming_reqs`` (from the wheel) adds waiting requests through its
    adder until one is refused; a stand-in for the adder's memory check holds each request's
    reservation against a 5-block pool. The blocking policy admits the same requests; the
    passing-over one (DWISE's) would also take a later request that fits."""
    from types import SimpleNamespace

    import sglang_reference

    from dwise_predict.serving.policy import DwisePolicy

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    sgl, budget = sglang_reference.load_scheduler(), 5.0
    need = dict(zip("ABC", reservations))

    class PoolAdder:  # PrefillAdder's answer for a request whose KV does not fit the pool: NO_TOKEN
        def __init__(self):
            self.used, self.can_run_list, self.preempt_list = 0.0, [], []

        def add_one_req(self, req, has_chunked_req=False, truncation_align_size=None):
            if self.used + need[req.rid] > budget:
                return sgl.AddReqResult.NO_TOKEN
            self.used += need[req.rid]
            self.can_run_list.append(req)
            return sgl.AddReqResult.CONTINUE

    scheduler = SimpleNamespace(get_num_allocatable_reqs=lambda running_bs, num_held_rows=0: 4,
                                enable_priority_preemption=False, tree_cache=None, truncation_align_size=None)
    reqs = [SimpleNamespace(rid=r, kv=SimpleNamespace(holds_kv=False), init_next_round_input=lambda cache: None)
            for r in "ABC"]
    adder = PoolAdder()
    sgl.SchedulerDllmMixin.process_dllm_incoming_reqs(scheduler, adder, reqs,
                                                      running_batch=SimpleNamespace(reqs=[], batch_is_full=False))
    sglang_admitted = [r.rid for r in adder.can_run_list]

    def admitted(blocking):
        policy = DwisePolicy(4, 1, budget, ranking="arrival", prefill_first=True, blocking_admission=blocking)
        policy.add_many(list("ABC"), [0, 0, 0], kv_reservations=list(reservations))
        return policy.ids(policy.schedule().admitted)

    assert admitted(blocking=True) == sglang_admitted
    fits_later = any(sum(reservations[:i]) + reservations[j] <= budget
                     for i in range(3) if sum(reservations[:i + 1]) > budget for j in range(i + 1, 3))
    assert (admitted(blocking=False) != sglang_admitted) == fits_later


def test_gain_decomposition_multiplies_out():
    from dwise_predict.simulation.simulator import gain_decomposition

    means = {"sglang-default": 12.0, "fcfs-mixed": 6.0, "dwise-zero": 4.0, "dwise-admission": 3.0,
             "dwise-raw": 2.5, "dwise-refined": 2.0, "dwise-oracle": 1.6}
    rows = [{"arrival": "burst", "policy": p, "mean_latency_s": m} for p, m in means.items()]
    gains = {g["step"]: g["gain"] for g in gain_decomposition(rows)}
    assert gains["mixed batching"] == 2.0 and gains["ordering by prompt work"] == 1.5
    assert gains["refinement (raw)"] * gains["calibration"] == pytest.approx(gains["refinement (calibrated)"])
    total = gains["mixed batching"] * gains["ordering by prompt work"] * gains["admission estimates"] * gains["refinement (calibrated)"]
    assert total == pytest.approx(12.0 / 2.0)  # the speed-up of dwise-refined over the default
