"""`simulate --refine-every`: r̂ re-estimated every n denoising rounds (the DWISE paper's Table 6) in the
simulator, worked out by hand, against the refine-once path, and the ρ it reports."""

import math

import numpy as np
import pytest

from dwise_predict.errors import ConfigError
from dwise_predict.simulation.refine_every import held_estimates, held_rho, rank_by_round, replay_refine_every
from dwise_predict.simulation.schedulers import SCHEDULERS
from dwise_predict.simulation.simulator import LaterRefinements, SimConfig, SimRequests, rhat_zero_share, simulate

CFG = SimConfig(slots=1, k=8, round_ms=1000.0, slot_ms=0.0)
ADDED = {"refine_every", "refine_rounds", "refinements_per_request", "refining_rounds_pct", "mean_refine_batch"}


def hand_workload():
    # A: 4 rounds; admission 2, refined 1 after round 1, 10 after round 2.  B: 2 rounds; admission 3, refined 5.
    return SimRequests(request_ids=np.array(["A", "B"]), prompt_blocks=np.array([0, 0]), total_rounds=np.array([4, 2]),
                       first_block_rounds=np.array([4, 2]), output_blocks=np.array([4, 4]),
                       admission=np.array([2.0, 3.0]), refined=np.array([1.0, 5.0]),
                       round_refined=np.array([[1.0, 10.0], [5.0, np.nan]]))


def test_refinement_every_round_worked_out_by_hand():
    arrivals = (np.arange(2), np.zeros(2))
    # once: A (2) runs, r̂ 1 after round 1, 0 after round 2, so it runs to the end; then B
    once = simulate(hand_workload(), "dwise-refined", CFG, arrivals, record=True)
    assert [ids for ids, _ in once.run_log] == [["A"], ["A"], ["A"], ["A"], ["B"], ["B"]]
    # every round: after round 2 A is re-estimated at 10 > B's 3, so B is admitted and runs
    # (5 after its round 1, still below 10); A resumes when B is done
    every = simulate(hand_workload(), "dwise-refined", CFG, arrivals, record=True, refine_every=1)
    assert [ids for ids, _ in every.run_log] == [["A"], ["A"], ["B"], ["B"], ["A"], ["A"]]
    assert every.completion_round.tolist() == [6, 4]
    m = every.metrics
    assert m["preemptions_per_request"] == pytest.approx(0.5)  # A, displaced after round 2
    assert m["refine_rounds"] == [1, 2] and m["refinements_per_request"] == pytest.approx(1.5)  # A twice, B once
    assert m["refining_rounds_pct"] == pytest.approx(50.0) and m["mean_refine_batch"] == pytest.approx(1.0)
    # A's r̂ reaches 0 (after round 2) with work left only when refined once; B's never does
    assert once.metrics["rhat_zero_pct"] == pytest.approx(50.0) and m["rhat_zero_pct"] == pytest.approx(0.0)
    # n beyond the kept rounds (2) refines once
    two = simulate(hand_workload(), "dwise-refined", CFG, arrivals, record=True, refine_every=2)
    assert two.run_log == once.run_log and two.metrics["refine_rounds"] == [1]


def random_workload(n=300, kept=8, seed=0):
    rng = np.random.default_rng(seed)
    total = rng.integers(1, 40, n)
    round_refined = np.maximum(total[:, None] - np.arange(1, kept + 1) + rng.normal(0, 4, (n, kept)), 0.0)
    round_refined[np.arange(kept)[None, :] >= total[:, None]] = np.nan  # no row after the last round
    return SimRequests(request_ids=np.array([f"r{i}" for i in range(n)]), prompt_blocks=rng.integers(0, 5, n),
                       total_rounds=total, first_block_rounds=np.minimum(total, rng.integers(1, 10, n)),
                       output_blocks=np.full(n, 32), admission=np.maximum(total + rng.normal(0, 10, n), 0.0),
                       refined=round_refined[:, 0], round_refined=round_refined)


@pytest.mark.parametrize("arrival", ["burst", "burst-poisson"])
def test_once_through_the_new_path_equals_todays_simulation_exactly(arrival):
    w = random_workload()
    cfg = SimConfig(slots=16, k=4, arrival=arrival, rate=None if arrival == "burst" else 3.0, seed=1)
    today = simulate(w, "dwise-refined", cfg).metrics
    once = simulate(w, "dwise-refined", cfg, refine_every=math.inf).metrics
    assert set(once) - set(today) == ADDED
    assert {k: once[k] for k in today} == today
    assert once["refinements_per_request"] == 1.0 and once["refine_rounds"] == [1]


@pytest.mark.parametrize("every", [1, 3])
def test_fast_forward_stops_at_every_refinement(every):
    w = random_workload(n=120, seed=2)
    cfg = SimConfig(slots=8, k=4, arrival="burst-poisson", rate=2.0, seed=3)
    fast = simulate(w, "dwise-refined", cfg, refine_every=every)
    slow = simulate(w, "dwise-refined", cfg, refine_every=every, fast_forward=False)
    assert fast.completion_round.tolist() == slow.completion_round.tolist()
    assert fast.latency_rounds.tolist() == slow.latency_rounds.tolist()
    seconds = {k for k, v in slow.metrics.items() if isinstance(v, float)}  # summed per span or per round
    exact = [k for k in slow.metrics if k not in seconds]
    assert {k: fast.metrics[k] for k in exact} == {k: slow.metrics[k] for k in exact}
    assert {k: fast.metrics[k] for k in seconds} == pytest.approx({k: slow.metrics[k] for k in seconds}, rel=1e-12)
    # re-estimating changes the schedule on this workload
    assert fast.completion_round.tolist() != simulate(w, "dwise-refined", cfg).completion_round.tolist()


def brute_force_zero_share(admission, refined, rounds, values, total):
    """Walk each request's r̂ round by round as the policy does and note whether it hits 0 with work left."""
    hits = 0
    for i in range(len(total)):
        rhat, hit = admission[i], admission[i] <= 0
        for m in range(1, total[i]):  # after round m, total - m > 0 rounds remain
            rhat = max(rhat - 1.0, 0.0)
            if m == 1:
                rhat = max(refined[i], 0.0)
            elif m in rounds and np.isfinite(values[i, rounds.index(m)]):
                rhat = max(values[i, rounds.index(m)], 0.0)
            hit |= rhat <= 0
        hits += hit
    return 100.0 * hits / len(total)


@pytest.mark.parametrize("seed", range(5))
def test_reach_zero_share_follows_the_walk_of_r_hat(seed):
    rng = np.random.default_rng(seed)
    n = 200
    total = rng.integers(1, 30, n)
    admission, refined = rng.uniform(-1, 30, n), rng.uniform(-1, 30, n)
    rounds = [3, 5, 7]
    values = rng.uniform(-1, 30, (n, 3))
    values[rng.random((n, 3)) < 0.2] = np.nan
    spec = SCHEDULERS["dwise-refined"]
    later = LaterRefinements(np.array(rounds), values)
    assert rhat_zero_share(spec, admission, refined, total, later) == pytest.approx(
        brute_force_zero_share(admission, refined, rounds, values, total))
    assert rhat_zero_share(spec, admission, refined, total, LaterRefinements(np.zeros(0, int), values[:, :0])) == \
        rhat_zero_share(spec, admission, refined, total) == pytest.approx(
            brute_force_zero_share(admission, refined, [], values[:, :0], total))


def test_rho_of_a_perfect_state_at_every_round_is_one():
    w = random_workload(n=400, seed=4)
    perfect = np.where(np.isnan(w.round_refined), np.nan, w.total_rounds[:, None] - np.arange(1, 9))
    rng = np.random.default_rng(5)
    w.round_refined = perfect
    w.refined = np.maximum(w.total_rounds - 1 + rng.normal(0, 6, len(w)), 0.0)  # round 1 alone is noisy
    w.round_refined[:, 0] = w.refined
    rows = {r["round"]: r for r in rank_by_round(w)}
    assert list(rows) == [1, 2, 4, 8]
    assert all(rows[k]["requests"] == int((w.total_rounds > k).sum()) for k in rows)
    assert all(rows[k]["rho_state"] == pytest.approx(1.0) for k in (2, 4, 8))
    assert rows[1]["rho_state"] == rows[1]["rho_decrement"] < 0.95  # at round 1 both are the first refinement
    assert all(rows[k]["rho_decrement"] < 0.95 for k in (2, 4, 8))
    assert all(rows[k]["ratio_state"] == pytest.approx(1.0) for k in (2, 4, 8))
    # refreshing every round holds the true remaining rounds; refining once carries round 1's noise
    held = held_estimates(w, 1)
    alive = w.total_rounds[:, None] > np.arange(1, 9)
    remaining = w.total_rounds[:, None] - np.arange(1, 9)
    np.testing.assert_array_equal(held[:, 1:][alive[:, 1:]], remaining[:, 1:][alive[:, 1:]])
    assert np.isnan(held[~alive]).all()
    assert held_rho(w, 1) > held_rho(w, 4) > held_rho(w, "once") and held_rho(w, "once") < 0.95
    np.testing.assert_array_equal(held_estimates(w, "never")[:, 0][alive[:, 0]],
                                  np.maximum(w.admission - 1, 0)[alive[:, 0]])


def test_table_has_never_once_and_each_period_per_arrival():
    w = random_workload(n=150, seed=6)
    table = replay_refine_every(w, SimConfig(slots=8, k=4), [1, 4], ["burst", "burst-poisson"], "2x")
    assert [(r["arrival"], r["refine"]) for r in table["rows"]] == [
        (a, s) for a in ("burst", "burst-poisson") for s in ("never", "once", 1, 4)]
    assert table["rounds_hidden"] == 8 and [r["round"] for r in table["rho_by_round"]] == [1, 2, 4, 8]
    by = {(r["arrival"], r["refine"]): r for r in table["rows"]}
    for arrival in ("burst", "burst-poisson"):
        never = by[(arrival, "never")]
        assert never["policy"] == "dwise-admission" and never["refinements_per_request"] == 0
        assert by[(arrival, "once")]["refinements_per_request"] == 1.0
        assert by[(arrival, 1)]["refinements_per_request"] > by[(arrival, 4)]["refinements_per_request"] > 1.0
        assert by[(arrival, 1)]["rho_held"] == held_rho(w, 1) and by[(arrival, 1)]["predictor_us_per_round"] is None


def test_refusals_name_what_is_missing():
    w = random_workload(n=20)
    with pytest.raises(ConfigError, match="applies to dwise-refined, not dwise-admission"):
        simulate(w, "dwise-admission", CFG, refine_every=2)
    with pytest.raises(ConfigError, match=">= 1"):
        simulate(w, "dwise-refined", CFG, refine_every=0)
    w.round_refined = None
    with pytest.raises(ConfigError, match="collect --rounds-hidden N"):
        simulate(w, "dwise-refined", CFG, refine_every=2)
    with pytest.raises(ConfigError, match="collect --rounds-hidden N"):
        replay_refine_every(w, CFG, [2], ["burst"])


# --- the command -------------------------------------------------------------------------------


def with_round_states(traces, kept: int = 8, seed: int = 0):
    """The synthetic traces with per-round states in contract 1's layout: round 1 is the first round,
    later rounds drift from it; zeros after each request's last round."""
    from dwise_predict.traces.dataset import TraceDataset

    n, h = traces.first_round.shape
    recorded = np.minimum(traces.requests["total_rounds"].to_numpy(), kept)
    rng = np.random.default_rng(seed)
    states = traces.first_round[:, None, :] + 0.3 * rng.standard_normal((n, kept, h)).astype(np.float32)
    signals = np.repeat(traces.early_signals[:, None, :], kept, axis=1)
    states[:, 0] = traces.first_round
    empty = np.arange(kept)[None, :] >= recorded[:, None]
    states[empty], signals[empty] = 0.0, 0.0
    return TraceDataset(traces.requests.assign(rounds_recorded=recorded), traces.first_round, traces.prompt_last,
                        {**traces.manifest, "rounds_hidden": kept}, None,
                        {"round_states": states, "round_signals": signals})


@pytest.fixture(scope="module")
def traces_and_bundle(tmp_path_factory):
    from fakes.serving_bundle import served_bundle

    from dwise_predict.traces import write_traces

    bundle, traces = served_bundle()
    root = tmp_path_factory.mktemp("refine_every")
    return write_traces(with_round_states(traces), root / "rounds"), write_traces(traces, root / "plain"), bundle


def test_command_prints_and_writes_the_table_beside_todays_figures(traces_and_bundle, tmp_path, capsys):
    import json

    from dwise_predict.cli import main

    traces, _, bundle = traces_and_bundle
    out = tmp_path / "sim"
    args = ["simulate", str(traces), "--bundle", str(bundle), "--slots", "8", "--requests", "300",
            "--policies", "dwise-admission,dwise-refined", "--refine-every", "1,2,4,8", "--out", str(out)]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    table = printed["refine_every"]
    assert [(r["arrival"], r["refine"]) for r in table["rows"]] == [
        (a, s) for a in ("burst", "burst-poisson") for s in ("never", "once", 1, 2, 4, 8)]
    assert all(r["rho_held"] is not None and -1 <= r["rho_held"] <= 1 for r in table["rows"])
    assert all(r["predictor_us_per_round"] > 0 for r in table["rows"] if r["refine"] != "never")
    # never and once are today's dwise-admission and dwise-refined, figure for figure
    today = {(r["arrival"], r["policy"]): r for r in printed["rows"]}
    for row in table["rows"]:
        if row["refine"] in ("never", "once"):
            same = today[(row["arrival"], "dwise-admission" if row["refine"] == "never" else "dwise-refined")]
            # the rows' ranking ρ (simulation.work_ranking) annotates the scheduler, not one replay
            metrics = [k for k in same if k != "speedup_vs_default" and not k.startswith("rho_")]
            assert {k: row[k] for k in metrics} == {k: same[k] for k in metrics}
    assert json.loads((out / "simulate.json").read_text())["refine_every"]["rows"][2]["refine"] == 1
    assert main([*args[:-2], "--arrival", "burst"]) == 0
    text = capsys.readouterr().out
    assert "Refinement every n rounds (the DWISE paper's Table 6)" in text and "ρ(r̂, remaining)" in text
    table_lines = [line for line in text.splitlines() if line.startswith("│ burst ")]
    settings = [line.split("│")[2].strip() for line in table_lines if "dwise" not in line]
    assert settings == ["never", "once", "1", "2", "4", "8"]
    assert "round-k state" in text


@pytest.mark.parametrize("extra,message", [
    (["--refine-every", "2"], "no per-round states: collect them with `dwise-predict collect --rounds-hidden N`"),
    (["--refine-every", "0,x"], "--refine-every must be a comma list of whole round counts >= 1"),
    (["--refine-every", "2", "--rates", "1x,2x"], "--refine-every replays at one load"),
])
def test_command_refusals_are_one_line(traces_and_bundle, capsys, extra, message):
    from dwise_predict.cli import main

    _, plain, bundle = traces_and_bundle
    assert main(["simulate", str(plain), "--bundle", str(bundle), "--requests", "50", *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert main(["simulate", str(plain), "--refine-every", "2"]) == 1
    assert "--refine-every needs --bundle" in capsys.readouterr().err
