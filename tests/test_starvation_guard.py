"""The starvation guard (``aging``) where users set it: the simulator, ``serve`` and the hook."""

import json

import numpy as np
import pytest
from dwise_predict.cli import main
from dwise_predict.errors import ConfigError
from dwise_predict.serving.launcher import HookConfig
from dwise_predict.serving.simulator import SimConfig, SimRequests, make_arrivals, simulate


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
    from dwise_predict.serving.simulator import sim_requests_from_traces

    w = sim_requests_from_traces(make_synthetic_traces(n_requests=300, hidden_size=8, seed=3, block_size=16), split=None)
    w.admission = w.total_rounds * np.exp(np.random.default_rng(0).normal(0, 0.7, len(w)))
    cfg = SimConfig(slots=8, k=2, arrival="burst-poisson", rate=15.0, seed=5, aging=0.05)
    arrivals = make_arrivals(len(w), cfg)
    fast = simulate(w, "dwise-admission", cfg, arrivals)
    slow = simulate(w, "dwise-admission", cfg, arrivals, fast_forward=False)
    assert fast.completion_round.tolist() == slow.completion_round.tolist()


def test_aging_is_checked_where_it_is_given():
    with pytest.raises(ConfigError, match="--aging must be a finite number >= 0"):
        SimConfig(aging=-0.1)
    assert any("--aging must be a finite number >= 0" in p for p in HookConfig(record="t", aging=-1).problems())
    assert HookConfig().aging > 0  # serve guards by default


def test_serve_and_simulate_take_aging(tmp_path, capsys, monkeypatch):
    import sglang_reference

    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    sglang_launch.install_entrypoints(monkeypatch.setitem)  # --dry-run resolves SGLang's arguments
    from dwise_predict.dllm import TINY_MODEL_DIR

    record = ["serve", "--record", str(tmp_path / "t"), "--block-size", "8", "--hidden-size", "16", "--dry-run"]
    server = ["--", "--model-path", str(TINY_MODEL_DIR), "--dllm-fdfo"]
    assert main([*record, "--aging", "0.5", *server]) == 0
    assert json.loads(capsys.readouterr().out)["hook"]["aging"] == 0.5
    assert main([*record, "--aging", "-1", *server]) == 1
    err = capsys.readouterr().err
    assert "--aging must be a finite number >= 0" in err and err.count("\n") == 1
    assert main(["simulate", "--help"]) == 0 and "--aging" in capsys.readouterr().out
