"""The wait cap where an operator sets it (issue 56): ``serve --max-wait``, ``HookConfig.max_wait``,
``DWISE_MAX_WAIT``, ``simulate --max-wait`` (0: off), the value the hook's policy gets, and SGLang's
``SGLANG_REQ_WAITING_TIMEOUT``, which aborted the requests the policy keeps in SGLang's waiting queue."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import sglang_reference
from dwise_predict.cli import main
from dwise_predict.errors import ConfigError
from dwise_predict.serving import launcher
from dwise_predict.serving.launcher import HookConfig
from dwise_predict.serving.plugin import config_from_environ
from dwise_predict.serving.policy import MAX_WAIT, DwisePolicy
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

needs_wheel = pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
BS = 8


def test_the_wait_cap_is_an_option_of_the_hook_config_checked_and_read_from_the_plugins_variable():
    assert HookConfig().max_wait == MAX_WAIT  # the policy's default, as before the option existed
    for bad in (-1, 2.5, float("inf")):
        assert f"`max_wait` must be a whole number of rounds >= 0 (0: no wait cap), got {bad}" in \
            HookConfig(record="t/", max_wait=bad).problems()
    assert not HookConfig(record="t/", max_wait=0).problems()
    assert config_from_environ({"DWISE_RECORD": "t/", "DWISE_MAX_WAIT": "0"}).max_wait == 0
    assert config_from_environ({"DWISE_RECORD": "t/"}).max_wait == MAX_WAIT
    with pytest.raises(ConfigError) as err:
        config_from_environ({"DWISE_RECORD": "t/", "DWISE_MAX_WAIT": "-5"})
    assert "DWISE_MAX_WAIT must be a whole number of rounds >= 0 (0: no wait cap), got -5" in str(err.value)
    with pytest.raises(ConfigError, match="DWISE_MAX_WAIT must be an integer, got '1.5'"):
        config_from_environ({"DWISE_RECORD": "t/", "DWISE_MAX_WAIT": "1.5"})


def test_serve_passes_its_max_wait_to_the_launcher(tmp_path, monkeypatch, capsys):
    served = []
    monkeypatch.setattr(launcher, "serve", lambda config, args: served.append(config))
    for flags, want in (([], MAX_WAIT), (["--max-wait", "7"], 7), (["--max-wait", "0"], 0)):
        assert main(["serve", "--record", str(tmp_path / "t"), *flags, "--", "--model-path", "m"]) == 0
        assert served.pop().max_wait == want
    assert main(["serve", "--record", str(tmp_path / "t"), "--max-wait", "-3", "--", "--model-path", "m"]) == 1
    assert "--max-wait must be a whole number of rounds >= 0 (0: no wait cap), got -3" in capsys.readouterr().err
    assert not served


def test_simulate_max_wait_reaches_the_dwise_schedulers_and_0_turns_it_off(tmp_path):
    traces = write_traces(make_synthetic_traces(n_requests=60, hidden_size=8, seed=1, block_size=16), tmp_path / "tr")
    flags = ["simulate", str(traces), "--requests", "16", "--arrival", "burst", "--policies", "dwise-zero", "--slots", "4"]
    for given, want in (([], MAX_WAIT), (["--max-wait", "5"], 5), (["--max-wait", "0"], None)):
        out = tmp_path / f"out{len(given)}{given[-1] if given else ''}"
        assert main([*flags, *given, "--out", str(out)]) == 0
        assert json.loads((out / "simulate.json").read_text())["settings"]["max_wait"] == want


@needs_wheel
@pytest.mark.parametrize("given, want", [(None, MAX_WAIT), (7, 7), (0, None)])
def test_the_hook_config_s_max_wait_is_the_policy_s_in_the_scheduler_process(given, want, monkeypatch):
    from fakes import sglang_fake as fake

    monkeypatch.delenv("SGLANG_REQ_WAITING_TIMEOUT", raising=False)
    config = HookConfig(slots=1, k=2, resolver="fakes.sglang_fake:resolve",
                        **({} if given is None else {"max_wait": given}))
    handle = launcher.install_in_this_process(config)
    try:
        scheduler = fake.Scheduler(fake.config(BS, 4), batch_capacity=4, max_total_num_tokens=10**6)
        _queue(scheduler, "r", 2 * BS, [2], 1.0)
        scheduler.step(fake.FillAlgorithm(scheduler.dllm_config), fake.ModelRunner(BS, 4))
        assert handle.state.policy.max_wait == want
    finally:
        handle.uninstall()
        monkeypatch.setattr(launcher, "ACTIVE", None)


# --- SGLANG_REQ_WAITING_TIMEOUT -------------------------------------------------------------------


class Clock:
    """``time.perf_counter`` while a fake server runs: SGLang's clock (``wait_queue_entry_time``, its
    timeout) and the hook's; the test sets the time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Arrivals:
    """``before_step`` of the fake server: a second a step; a long request (4 prompt blocks) first,
    then a short one (3 prompt tokens: one output block of 2 forwards) every other step, each
    taking the one slot of a round for 2 rounds, so a short one always ranks ahead of the long one;
    then SGLang's timeout poll (``Scheduler._poll_timeout_aborts``)."""

    def __init__(self, clock: Clock, timeout_s: float, shorts: int):
        self.clock, self.timeout_s, self.shorts = clock, timeout_s, shorts

    def __call__(self, step: int, scheduler) -> None:
        self.clock.now = 1.0 + step
        if step == 0:
            _queue(scheduler, "long", 4 * BS, [2, 2, 2], self.clock.now)
        if step % 2 == 0 and step // 2 < self.shorts:
            _queue(scheduler, f"s{step // 2:03d}", 3, [2], self.clock.now)
        scheduler.poll_timeout_aborts(self.clock.now, self.timeout_s)


def _queue(scheduler, rid: str, tokens: int, forwards: list, now: float) -> None:
    """``Scheduler._add_request_to_queue``: appended, and its ``wait_queue_entry_time`` set."""
    from fakes import sglang_fake as fake

    sp = type("SP", (), {"max_new_tokens": 8 * len(forwards)})()
    req = fake.Req(rid, [1 + (31 * len(rid) + t) % 900 for t in range(tokens)], sp, scheduler.dllm_config, forwards,
                   np.zeros(4, np.float32), (1, 0, tokens))
    scheduler._add_request_to_queue(req)
    req.time_stats.wait_queue_entry_time = now


@needs_wheel
def test_a_request_the_policy_parks_is_admitted_before_sglangs_waiting_timeout_aborts_it(monkeypatch):
    """With ``SGLANG_REQ_WAITING_TIMEOUT=40`` and a stream of short requests that always rank ahead of
    a long one, the long one stayed in SGLang's waiting queue (the policy's wait cap is 4,096 rounds)
    until SGLang aborted it after 40 s. It is now due after 20 s (half the timeout): admitted first,
    it leaves the waiting queue, and every request finishes."""
    from fakes import sglang_fake as fake

    from dwise_predict.serving.sglang import install

    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)  # read by the hook when it binds, as SGLang reads it
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "40")
    config = fake.config(BS, 4)
    scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**6)
    handle = install(None, slots=1, k=2, resolve=fake.resolve, features=lambda req: req.features)
    try:
        finished = fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, 4),
                              before_step=Arrivals(clock, 40.0, shorts=60))
    finally:
        handle.uninstall()
    assert scheduler.aborted == {}
    assert "long" in finished and len(finished) == 61
    assert handle.state.policy.max_wait == 21  # the rounds begun in the last 20 s, one a second


@needs_wheel
def test_without_the_timeout_the_long_request_waits_for_the_stream_to_end(monkeypatch):
    """The same stream without the timeout: the policy's own cap (4,096 rounds) does not act, and the
    long request is admitted only once the short ones stop coming (the cap derived from the timeout
    is what admitted it above)."""
    from fakes import sglang_fake as fake

    from dwise_predict.serving.sglang import install

    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.delenv("SGLANG_REQ_WAITING_TIMEOUT", raising=False)
    config = fake.config(BS, 4)
    scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**6)
    handle = install(None, slots=1, k=2, resolve=fake.resolve, features=lambda req: req.features)
    try:
        finished = fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, 4),
                              before_step=Arrivals(clock, float("inf"), shorts=60))
    finally:
        handle.uninstall()
    assert max(finished, key=finished.get) == "long" and handle.state.policy.max_wait == MAX_WAIT


class Share:
    """``_RankShare`` for two ranks in one process: the first rank's value reaches the other."""

    def __init__(self, sent: list, is_source: bool):
        self.sent, self.is_source = sent, is_source

    def __call__(self, values, n: int):
        if self.is_source:
            self.sent.append(np.asarray(values, dtype=np.float64))
        return self.sent[-1]


def test_on_several_tp_ranks_every_rank_gets_the_first_ranks_count_at_the_same_round():
    from dwise_predict.serving.sglang.timeout import SHARE_EVERY, WaitingTimeout, waiting_timeout

    assert [waiting_timeout(env) for env in ({}, {"SGLANG_REQ_WAITING_TIMEOUT": "-1"},
                                             {"SGLANG_REQ_WAITING_TIMEOUT": "0"}, {"SGLANG_REQ_WAITING_TIMEOUT": "x"},
                                             {"SGLANG_REQ_WAITING_TIMEOUT": "30"})] == [None, None, None, None, 30.0]
    clocks, sent = [Clock(), Clock()], []
    ranks = [WaitingTimeout(10.0, 100, Share(sent, source), clock) for source, clock in zip((True, False), clocks)]
    policies = [DwisePolicy(1, max_wait=rank.initial) for rank in ranks]
    seen = []
    for round_ in range(3 * SHARE_EVERY):
        clocks[0].now, clocks[1].now = 0.25 * round_, 7.0 * round_  # the ranks' clocks disagree
        for rank, policy in zip(ranks, policies):
            rank(policy)
            policy.schedule()
        seen.append([policy.max_wait for policy in policies])
    assert all(a == b for a, b in seen)
    assert [a for a, _ in seen[SHARE_EVERY - 2:SHARE_EVERY]] == [100, 21]  # 21 rounds began in the last 5 s, at round 32
    assert len(sent) == 3


def test_rounds_that_come_fast_are_counted_in_a_bounded_number_of_slices():
    """A scheduler spinning on a batch it cannot form starts a round every few µs: the count keeps
    at most 65 slices of the window, and falls short of the exact count by at most one slice's rounds."""
    from dwise_predict.serving.sglang.timeout import SLICES, WaitingTimeout

    clock = Clock()
    cap = WaitingTimeout(2.0, None, clock=clock)  # a window of 1 s
    policy = DwisePolicy(1, max_wait=cap.initial)
    for round_ in range(200_000):
        clock.now = 1e-5 * round_  # 100,000 rounds a second
        cap(policy)
    assert len(cap.slices) <= SLICES + 1
    assert 100_001 - 100_000 // SLICES - 1 <= policy.max_wait <= 100_001  # the exact count: 100,001
