"""The starvation guards where users set them: aging (``aging``) and the wait cap (``max_wait``), in the
policy, the simulator, ``serve`` and the hook."""

import json
import math

import numpy as np
import pytest
from dwise_predict.cli import main
from dwise_predict.errors import ConfigError
from dwise_predict.serving.launcher import HookConfig
from dwise_predict.serving.policy import MAX_WAIT, DwisePolicy
from dwise_predict.simulation.simulator import SimConfig, SimRequests, make_arrivals, simulate


def stream(n_short: int = 300) -> SimRequests:
    """One request of 60 rounds, then short ones (4 rounds) arriving faster than B = 1 serves them."""
    n = n_short + 1
    return SimRequests(request_ids=np.array([f"r{i}" for i in range(n)]), prompt_blocks=np.zeros(n, np.int64),
                       total_rounds=np.array([60] + [4] * n_short), first_block_rounds=np.array([60] + [4] * n_short),
                       output_blocks=np.full(n, 8), admission=np.array([60.0] + [4.0] * n_short))


def test_aging_bounds_the_long_requests_wait_in_the_simulator_and_leaves_the_baselines_alone():
    w = stream()
    arrivals = (np.arange(len(w)), np.concatenate([[0.0], np.arange(len(w) - 1) * 0.045]))  # a short every ~3.7 rounds
    base = SimConfig(slots=1, k=4, round_ms=12.0, slot_ms=0.0)
    latency = {a: simulate(w, "dwise-admission", SimConfig(**{**base.__dict__, "aging": a}), arrivals).latency_rounds
               for a in (0.0, 0.2)}
    assert latency[0.0][0] > 900  # as published: the long one waits for the whole stream (about 1,200 rounds)
    assert latency[0.2][0] < 60 / 0.2 + 60 + 4 * 5  # passed only by arrivals within R / a = 300 rounds of it
    assert latency[0.2].max() < latency[0.0].max()
    for policy in ("fcfs-mixed", "sglang-default"):  # the guard is the DWISE schedulers' only
        same = [simulate(w, policy, SimConfig(**{**base.__dict__, "aging": a}), arrivals).latency_rounds for a in (0.0, 0.2)]
        assert same[0].tolist() == same[1].tolist()


def test_aging_keeps_the_simulators_fast_forward_exact():
    """A key that does not move while its request waits: skipping ahead over rounds whose plan cannot
    change gives the same schedule with the guard on."""
    from dwise_predict.traces.synthetic import make_synthetic_traces
    from dwise_predict.simulation.simulator import sim_requests_from_traces

    w = sim_requests_from_traces(make_synthetic_traces(n_requests=300, hidden_size=8, seed=3, block_size=16), split=None)
    w.admission = w.total_rounds * np.exp(np.random.default_rng(0).normal(0, 0.7, len(w)))
    cfg = SimConfig(slots=8, k=2, arrival="burst-poisson", rate=15.0, seed=5, aging=0.05)
    arrivals = make_arrivals(len(w), cfg)
    fast = simulate(w, "dwise-admission", cfg, arrivals)
    slow = simulate(w, "dwise-admission", cfg, arrivals, fast_forward=False)
    assert fast.completion_round.tolist() == slow.completion_round.tolist()


def test_aging_is_checked_where_it_is_given():
    with pytest.raises(ConfigError, match="`aging` must be a finite number >= 0"):
        SimConfig(aging=-0.1)
    assert any("`aging` must be a finite number >= 0" in p for p in HookConfig(record="t", aging=-1).problems())
    assert HookConfig().aging > 0  # serve guards by default


def test_serve_and_simulate_take_aging(tmp_path, capsys, monkeypatch):
    import sglang_reference

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    sglang_launch.install_entrypoints(monkeypatch.setitem)  # --dry-run resolves SGLang's arguments
    model = sglang_launch.write_model(tmp_path / "sdar", hidden_size=16)  # SDAR: block 4

    record = ["serve", "--record", str(tmp_path / "t"), "--block-size", "4", "--hidden-size", "16", "--dry-run"]
    server = ["--", "--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "1024"]
    assert main([*record, "--aging", "0.5", *server]) == 0
    assert json.loads(capsys.readouterr().out)["hook"]["aging"] == 0.5
    assert main([*record, "--aging", "-1", *server]) == 1
    err = capsys.readouterr().err
    assert "--aging must be a finite number >= 0" in err and err.count("\n") == 1
    assert main(["simulate", "--help"]) == 0 and "--aging" in capsys.readouterr().out


# --- the wait cap: requests whose KV reservation does not fit (issue 56) ----------------------------

def _replay_with_a_big_reservation(rounds: int, **policy) -> tuple[int | None, int | None, int]:
    """B = 4, a KV pool of 100: a request of 20 rounds reserving 60 arrives at round 0 into a steady
    stream of small ones (4 rounds, reserving 30; one every 1.5 rounds: 67 % of the block slots) that
    always holds at least 2 of them resident, so at least 60 of the pool: the big one never fits unless
    admission stops for it. Returns (round it was admitted, round it finished, the most rounds of work
    one request held), None where that did not happen within ``rounds``."""
    pol = DwisePolicy(slots=4, k=4, kv_budget=100.0, **policy)
    work = {"big": 20}
    admitted = finished = None
    for t in range(rounds):
        if t % 3 in (0, 2):  # gaps of 2 and 1 rounds: 2 arrivals every 3 rounds
            work[f"small{t}"] = 4
            pol.add(f"small{t}", 0, 4.0, 30.0)
        if t == 2:
            pol.add("big", 0, 20.0, 60.0)
        plan = pol.schedule()
        ids = pol.ids(plan.run)
        if "big" in pol.ids(plan.admitted):
            admitted = pol.rounds - 1  # the round it arrived in counts as round 0 of its wait
        done = [pol.denoising_rounds([s])[0] + 1 >= work[rid] for s, rid in zip(plan.run, ids)]
        pol.complete_round(plan, finished=done)
        if "big" in [rid for rid, d in zip(ids, done) if d]:
            finished = pol.rounds - 1
            break
    return admitted, finished, max(work.values())


def test_a_request_whose_reservation_never_fits_is_admitted_within_the_wait_cap():
    # without the cap (and with it, as before this change, by default): never admitted
    assert _replay_with_a_big_reservation(20_000, aging=0.1, max_wait=None)[0] is None
    k, L = 4, 20
    for max_wait, aging in ((50, 0.1), (50, 0.0), (MAX_WAIT, 0.1)):
        admitted, finished, most = _replay_with_a_big_reservation(max_wait + 200, aging=aging, max_wait=max_wait)
        assert most == L
        waited = admitted - 2
        assert max_wait < waited <= max_wait + (k + 1) * L  # the stated bound: W + D, D = (k + 1) L
        assert waited <= max_wait + 4  # in fact: the residents it waits for finish within 4 rounds
        if aging:  # ranked by R + a t0 it runs at once: nothing younger ranks ahead of it
            assert finished - admitted == 20 - 1
    # the default cap is on, in the policy and in the simulator's DWISE rows
    assert DwisePolicy(slots=1).max_wait == MAX_WAIT == SimConfig().max_wait


def test_due_requests_go_first_oldest_first_and_block_admission_until_they_fit():
    pol = DwisePolicy(slots=1, k=4, kv_budget=10.0, max_wait=3)
    pol.add("resident", 0, 50.0, 6.0)
    assert pol.ids(pol.schedule().admitted) == ["resident"]  # round 1
    pol.add("old-big", 0, 30.0, 8.0)  # arrives in round 1; 8 do not fit beside "resident"'s 6
    pol.schedule()
    pol.add("young-big", 0, 1.0, 8.0)  # arrives in round 2, ranks best of all, does not fit either
    pol.add("small", 0, 40.0, 2.0)  # fits, but does not rank in the top B = 1
    for _ in range(2):  # rounds 3 and 4: nobody is due, nobody admitted
        assert len(pol.schedule().admitted) == 0 and pol.steady_limit(None) == 5 - pol.rounds
    plan = pol.schedule()  # round 5: "old-big" has waited 4 > 3 rounds; it does not fit: nobody is admitted
    assert len(plan.admitted) == 0 and pol.n_waiting == 3 and pol.steady_limit(plan) == math.inf
    assert len(pol.schedule().admitted) == 0  # round 6: the others are due too, behind it
    plan = pol.schedule()
    pol.complete_round(plan, finished=[True])  # "resident" leaves: its 6 are free
    assert pol.ids(pol.schedule().admitted) == ["old-big"]  # first, whatever its rank
    assert pol.fields("small")["state"] == "waiting"  # it would fit, but "young-big" is first in line now
    plan = pol.schedule()
    assert pol.ids(plan.run) == ["old-big"]
    pol.complete_round(plan, finished=[True])
    assert pol.ids(pol.schedule().admitted) == ["young-big", "small"]


def test_the_wait_cap_keeps_the_simulators_fast_forward_exact():
    """Falling due is the one event that depends on time alone: skipping ahead stops at it."""
    from dwise_predict.traces.synthetic import make_synthetic_traces
    from dwise_predict.simulation.simulator import sim_requests_from_traces

    # B = 1, k = 2: "a" runs 100 rounds alone; "x" and "z" rank behind it. "x" falls due in round 11 and
    # takes the second row; from then on "z" waits with every row held, which the metrics count.
    w = SimRequests(request_ids=np.array(["a", "x", "z"]), prompt_blocks=np.zeros(3, np.int64),
                    total_rounds=np.array([100, 200, 300]), first_block_rounds=np.array([100, 200, 300]),
                    output_blocks=np.full(3, 8), admission=np.array([100.0, 200.0, 300.0]))
    cfg = SimConfig(slots=1, k=2, round_ms=10.0, slot_ms=0.0, max_wait=10)
    fast, slow = (simulate(w, "dwise-admission", cfg, fast_forward=ff).metrics for ff in (True, False))
    assert fast == pytest.approx(slow) and fast["cap_blocked_rounds_pct"] == pytest.approx(100 * (100 - 10) / 600)
    off = simulate(w, "dwise-admission", SimConfig(**{**cfg.__dict__, "max_wait": None})).metrics
    assert off["cap_blocked_rounds_pct"] == 0  # "x" waits for "a" to leave; no row is ever short

    # and on a random stream with a KV budget, where due requests block admission
    w = sim_requests_from_traces(make_synthetic_traces(n_requests=300, hidden_size=8, seed=3, block_size=16), split=None)
    w.admission = w.total_rounds * np.exp(np.random.default_rng(0).normal(0, 0.7, len(w)))
    budget = float(np.sort(w.prompt_blocks + w.output_blocks + 2)[-1]) * 3  # room for about three at once
    for max_wait in (5, 40):
        cfg = SimConfig(slots=8, k=2, arrival="burst-poisson", rate=15.0, seed=5, aging=0.05, kv_budget=budget,
                        max_wait=max_wait)
        arrivals = make_arrivals(len(w), cfg)
        fast = simulate(w, "dwise-admission", cfg, arrivals)
        slow = simulate(w, "dwise-admission", cfg, arrivals, fast_forward=False)
        assert fast.completion_round.tolist() == slow.completion_round.tolist() and fast.metrics == pytest.approx(slow.metrics)
        off = simulate(w, "dwise-admission", SimConfig(**{**cfg.__dict__, "max_wait": None}), arrivals)
        assert fast.completion_round.tolist() != off.completion_round.tolist()  # the cap acted


def test_the_wait_cap_is_checked_and_stays_out_of_the_baselines():
    for bad in (-1, 2.5):
        with pytest.raises(ConfigError, match="max_wait \\(wait cap\\) must be a whole number of rounds >= 0"):
            DwisePolicy(slots=1, max_wait=bad)
        with pytest.raises(ConfigError, match="`max_wait` must be a whole number of rounds >= 0"):
            SimConfig(max_wait=bad)
    from dwise_predict.simulation.schedulers import SCHEDULERS, make_policy

    caps = {name: make_policy(spec, 4, 2, None, max_wait=7).max_wait for name, spec in SCHEDULERS.items()
            if not spec.sync}
    assert {name for name, cap in caps.items() if cap == 7} == {name for name in caps if name.startswith("dwise-")}
    assert all(cap is None for name, cap in caps.items() if not name.startswith("dwise-"))
