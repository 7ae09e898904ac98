"""Hot swap (issue 55): the hook follows a zoo name or a bundle directory and serves a new verified
bundle from a step boundary on, without a restart and without losing a request; a bundle that does
not fit the server is refused with its reason; a version the live monitor finds worse is rolled back.

Driven through the fake SGLang built on SGLang's own dLLM code (``tests/fakes/sglang_fake.py``), with
bundles exported from hand-built runs (``tests/export_helpers.py``). v2's admission model is trained
on the same prompts with their rounds reversed, so which bundle ranked a request shows in the order
the policy admits it.
"""

import json
import re
import shutil
import time
from types import SimpleNamespace

import lightgbm
import numpy as np
import pytest

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.bundles.load import load_bundle  # noqa: E402
from dwise_predict.bundles.manifest import SEAL_KEY, read_bundle_manifest  # noqa: E402
from dwise_predict.cli import main  # noqa: E402
from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.engine.algorithms import served_decoding  # noqa: E402
from dwise_predict.errors import ConfigError  # noqa: E402
from dwise_predict.exports.bundle import export_bundle  # noqa: E402
from dwise_predict.exports.zoo import publish  # noqa: E402
from dwise_predict.metrics import spearman  # noqa: E402
from dwise_predict.serving import launcher  # noqa: E402
from dwise_predict.serving.launcher import HookConfig  # noqa: E402
from dwise_predict.serving.plugin import config_from_environ  # noqa: E402
from dwise_predict.serving.preflight import checked  # noqa: E402
from dwise_predict.serving.sglang import follow, install  # noqa: E402
from dwise_predict.serving.sglang.follow import Following  # noqa: E402
from dwise_predict.traces.synthetic import make_synthetic_traces  # noqa: E402
from export_helpers import make_run  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402
from fakes.serving_bundle import HIDDEN, served_bundle  # noqa: E402

BS, BUDGET, NAME = 8, 256, "tiny"
CREATED = "2026-01-01T00:00:00+00:00"


class SP:
    def __init__(self, max_new_tokens=BUDGET):
        self.max_new_tokens = max_new_tokens


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """v1 (the serving tests' bundle), v2 (admission trained on reversed rounds), and two that do not
    fit a server of v1: another hidden size, another block size."""
    root = tmp_path_factory.mktemp("swap-bundles")
    v1, traces = served_bundle()

    def export(name, ds, admission_target=None):
        run = make_run(root / f"run-{name}", traces=ds)
        if admission_target is not None:  # the run's admission model, refitted on another target
            train = ds.split("train").requests
            booster = lightgbm.train({"objective": "regression", "num_leaves": 15, "verbose": -1, "seed": 0,
                                      "deterministic": True, "num_threads": 1},
                                     lightgbm.Dataset(train[["words", "newlines", "prompt_tokens"]].to_numpy(float),
                                                      admission_target(train["total_rounds"].to_numpy())),
                                     num_boost_round=100)
            booster.save_model(str(run / "admission.txt"))
        return export_bundle(run, root / name, created=CREATED)

    return SimpleNamespace(
        v1=v1, traces=traces, v2=export("v2", traces, lambda r: np.log1p(r.max() + r.min() - r)),  # long ranked short
        hidden16=export("hidden16", make_synthetic_traces(n_requests=400, hidden_size=16, seed=0)),
        block16=export("block16", make_synthetic_traces(n_requests=400, hidden_size=HIDDEN, block_size=16, seed=0)))


def seal(path) -> str:
    return read_bundle_manifest(path).raw[SEAL_KEY][:12]


def requests(bundles, config, part: str, n: int, prompt_tokens=None, start=0):
    """``n`` fake requests named ``part-i`` with the eval traces' admission features and first-round
    rows; ``prompt_tokens`` (None: the traces' own, in whole blocks) fixes every prompt's length."""
    ds = bundles.traces.split("eval")
    r = ds.requests.iloc[start:start + n]
    lengths = [prompt_tokens or max(int(p), 1) * BS for p in r["prompt_blocks"]]
    out = []
    for i, (words, newlines, length) in enumerate(zip(r["words"], r["newlines"], lengths)):
        features = (float(words), float(newlines), float(r["prompt_tokens"].iloc[i]))
        ids = [100 + 1000 * (start + i) + t for t in range(length)]
        out.append(fake.Req(f"{part}-{i:02d}", ids, SP(), config, [3, 2], ds.first_round[start + i], features,
                            prompt_hidden=ds.prompt_last[start + i]))
    return out


def server(slots=2, k=2):
    config = fake.config(BS, max(8, slots * k))
    scheduler = fake.Scheduler(config, batch_capacity=slots, max_total_num_tokens=10**12)
    return config, scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, HIDDEN, max_bs=slots)


def recorder_for(path):
    decoding = served_decoding("LowConfidence", {}, BS)
    manifest = live_manifest({"name": "fake", "hidden_size": HIDDEN, "config_hash": "x", "weights_sha256": "y"},
                             decoding["algorithm"], decoding["algorithm_config"], BS, BUDGET)
    return LiveRecorder(path, block_size=BS, features=lambda r: r.features, every=5, manifest=manifest)


def hooked(bundle_path, source, zoo=None, recorder=None, poll_s=3600.0, **rollback):
    """v1's hook following ``source`` (the tests poll themselves; the thread has its own test)."""
    return install(load_bundle(bundle_path, backend="torch"), slots=2, k=2, resolve=fake.resolve,
                   features=lambda r: r.features, block_size=BS, device="cpu", max_batch=2, aging=0.0,
                   max_wait=None, recorder=recorder, follow=Following(source, zoo and str(zoo), poll_s, **rollback))


def zoo_with_v1(bundles, tmp_path):
    zoo = tmp_path / "zoo"
    publish(bundles.v1, zoo, name=NAME, verify=False)
    return zoo


def every_request_finished_once(handle, scheduler, reqs):
    assert all(r.finished() for r in reqs) and not scheduler.aborted
    assert handle.stats.finished == len(reqs) == len({r.rid for r in reqs})
    assert handle.state.policy.n_waiting == handle.state.policy.n_resident == 0


# --- a zoo ----------------------------------------------------------------------------------------------


def test_a_new_zoo_version_is_served_from_the_next_step_and_no_request_is_lost(bundles, tmp_path):
    """v1 serves a burst; v2 is published mid-burst and its second half arrives: from the next step v2
    ranks the arrivals (their admission order follows v2's estimates, against v1's), the estimates
    the policy holds stay as they were, every request finishes once, and the recording lists the swap."""
    zoo = zoo_with_v1(bundles, tmp_path)
    recorder = recorder_for(tmp_path / "rec")
    handle = hooked(bundles.v1, NAME, zoo, recorder, rollback_after=0)
    hook, follower = handle.state, handle.state.hot_swap.follower
    assert hook.bundle_version == follower.version == "1"  # the zoo version whose manifest is the bundle's
    config, scheduler, algorithm, runner = server()
    first = requests(bundles, config, "a", 30)
    second = requests(bundles, config, "b", 30, prompt_tokens=2 * BS, start=30)  # one P: ranked by r_hat alone
    scheduler.waiting_queue.extend(first)
    admitted_at, swapped = {}, {}

    def before_step(step, scheduler):
        if step == 40:
            publish(bundles.v2, zoo, name=NAME, verify=False)
            assert follower.poll() == "2" and follower.poll() is None  # offered once
            held = {rid: hook.policy.fields(rid) for rid in hook.table.reqs}
            hook.swap_if_ready()  # what the step's fetch_waiting_reqs does first
            swapped.update(version=hook.bundle_version, kept=held == {rid: hook.policy.fields(rid) for rid in held})
            scheduler.waiting_queue.extend(second)
        waiting = {id(r) for r in scheduler.waiting_queue}
        for r in second if step > 40 else ():
            if id(r) not in waiting and r.rid not in admitted_at:
                admitted_at[r.rid] = step

    try:
        fake.serve(scheduler, algorithm, runner, before_step=before_step)
        every_request_finished_once(handle, scheduler, first + second)
        assert swapped == {"version": "2", "kept": True}
        assert (handle.stats.swaps, handle.stats.rollbacks, hook.bundle_version) == (1, 0, "2")
    finally:
        handle.uninstall()
        recorder.close()
    features = np.array([r.features for r in second], dtype=np.float32)
    v1, v2 = load_bundle(bundles.v1).admission(features), load_bundle(bundles.v2).admission(features)
    assert spearman(v1, v2) < -0.5  # the construction: v2 ranks these prompts against v1
    order = [admitted_at[r.rid] for r in second]
    assert spearman(order, v2) > 0.9 and spearman(order, v1) < -0.4
    manifest = json.loads((tmp_path / "rec" / "manifest.json").read_text())
    assert manifest["bundle_swaps"] == [{"from": "1", "to": "2", "at_request": swapped_at(manifest),
                                         "why": f"new version in {NAME} in the zoo {zoo}"}]
    assert manifest["counts"]["requests"] + sum(v for k, v in manifest["counts"].items() if k.startswith("left_out"))\
        == len(first + second)


def swapped_at(manifest) -> int:
    """The swap's ``at_request``: finished requests before it, fewer than the first half."""
    at = manifest["bundle_swaps"][0]["at_request"]
    assert 0 < at < 30
    return at


@pytest.mark.parametrize("which, reason", [
    ("hidden16", "its hidden size is 16 but the serving bundle's is 32"),
    ("block16", "decoding.block_size = 16"),
])
def test_a_bundle_that_does_not_fit_the_server_is_refused_once_and_never_served(bundles, tmp_path, caplog, which,
                                                                                 reason, monkeypatch):
    zoo = zoo_with_v1(bundles, tmp_path)
    handle = hooked(bundles.v1, NAME, zoo)
    follower = handle.state.hot_swap.follower
    config, scheduler, algorithm, runner = server()
    reqs = requests(bundles, config, "a", 12)
    scheduler.waiting_queue.extend(reqs)
    pulled = []
    monkeypatch.setattr(follow, "pull", lambda *args: pulled.append(args[1]) or shutil.copytree(
        getattr(bundles, which), args[2]))

    def before_step(step, scheduler):
        if step == 3:
            publish(getattr(bundles, which), zoo, name=NAME, verify=False)
            assert follower.poll() is None and follower.poll() is None

    try:
        with caplog.at_level("WARNING", logger="dwise_predict.serving.sglang.follow"):
            fake.serve(scheduler, algorithm, runner, before_step=before_step)
        every_request_finished_once(handle, scheduler, reqs)
        assert (handle.stats.swaps, handle.state.bundle_version) == (0, "1")
    finally:
        handle.uninstall()
    assert list(follower.refused) == ["2"] and reason in follower.refused["2"]
    assert pulled == [f"{NAME}@2"]  # looked at once: a refused version is never pulled again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"dwise: not serving bundle 2 from {NAME} in the zoo") \
        and reason in lines[0]


class MonitorStandIn:
    """The live monitor's ``quality(version) -> (n, refined ρ)``: each version's answers in turn, the
    last one repeated."""

    def __init__(self, quality):
        self.answers, self.asked = quality, []

    def quality(self, version):
        self.asked.append(version)
        answers = self.answers[version]
        return answers.pop(0) if len(answers) > 1 else answers[0]


@pytest.mark.parametrize("new_rho, rolled_back", [(0.5, True), (0.75, False)])
def test_a_version_the_monitor_finds_worse_is_rolled_back_and_never_served_again(bundles, tmp_path, new_rho,
                                                                                 rolled_back):
    """Once ``rollback_after`` requests of v2 finished: a refined ρ 0.3 below v1's (margin 0.1) swaps
    v1 back, rejected for good; 0.05 below keeps v2."""
    zoo = zoo_with_v1(bundles, tmp_path)
    recorder = recorder_for(tmp_path / "rec")
    handle = hooked(bundles.v1, NAME, zoo, recorder, rollback_after=6, rollback_margin=0.1)
    hook, follower = handle.state, handle.state.hot_swap.follower
    config, scheduler, algorithm, runner = server()
    reqs = requests(bundles, config, "a", 40)
    scheduler.waiting_queue.extend(reqs)
    # the first look finds three of v2's requests among the six finished (the rest were v1's), the next six
    monitor = MonitorStandIn({"1": [(200, 0.8)], "2": [(3, new_rho), (6, new_rho)]})

    def before_step(step, scheduler):
        if step == 1:
            hook.monitor = monitor  # bound on the first step: the real one's ρ is not the test's to set
        if step == 4:
            publish(bundles.v2, zoo, name=NAME, verify=False)
            assert follower.poll() == "2"

    try:
        fake.serve(scheduler, algorithm, runner, before_step=before_step)
        every_request_finished_once(handle, scheduler, reqs)
    finally:
        handle.uninstall()
        recorder.close()
    assert monitor.asked == ["1", "2", "2"]  # v1's at the swap, then v2's at each look
    swaps = json.loads((tmp_path / "rec" / "manifest.json").read_text())["bundle_swaps"]
    if rolled_back:
        assert (handle.stats.swaps, handle.stats.rollbacks, hook.bundle_version) == (2, 1, "1")
        why = "rollback: refined rho 0.500 over 6 requests of 2, below 1's 0.800 by more than 0.1"
        assert [(s["from"], s["to"], s["why"]) for s in swaps][1] == ("2", "1", why)
        assert follower.refused == {"2": why} and follower.poll() is None  # never offered again
    else:
        assert (handle.stats.swaps, handle.stats.rollbacks, hook.bundle_version) == (1, 0, "2")
        assert [(s["from"], s["to"]) for s in swaps] == [("1", "2")] and not follower.refused


# --- a bundle directory, the thread, the settings -------------------------------------------------------


def test_a_watched_directory_swaps_when_its_sealed_manifest_changes(bundles, tmp_path):
    """The directory holds v1 (no swap); then a half-written v2 (its manifest before its files: not
    served, not refused, looked at again), then v2 whole: served from the next step, named by its seal."""
    watched = tmp_path / "watched"
    shutil.copytree(bundles.v1, watched)
    handle = hooked(bundles.v1, str(watched))
    hook, follower = handle.state, handle.state.hot_swap.follower
    assert hook.bundle_version == seal(bundles.v1) and len(hook.bundle_version) == 12
    config, scheduler, algorithm, runner = server()
    reqs = requests(bundles, config, "a", 20)
    scheduler.waiting_queue.extend(reqs)
    seen = []

    def before_step(step, scheduler):
        if step == 2:
            assert follower.poll() is None  # unchanged
            shutil.rmtree(watched)
            watched.mkdir()
            shutil.copy(bundles.v2 / "bundle.json", watched / "bundle.json")
            assert follower.poll() is None and not follower.refused and "is missing" in follower.last_failure
        if step == 3:
            shutil.rmtree(watched)
            shutil.copytree(bundles.v2, watched)
            assert follower.poll() == seal(bundles.v2)
        seen.append(hook.bundle_version)

    try:
        fake.serve(scheduler, algorithm, runner, before_step=before_step)
        every_request_finished_once(handle, scheduler, reqs)
    finally:
        handle.uninstall()
    assert seen[:5] == [seal(bundles.v1)] * 4 + [seal(bundles.v2)]  # swapped at the top of step 4
    assert handle.stats.swaps == 1 and not follower.cache.exists()


def test_the_follower_thread_polls_and_stops_with_uninstall(bundles, tmp_path):
    zoo = zoo_with_v1(bundles, tmp_path)
    handle = hooked(bundles.v1, NAME, zoo, poll_s=0.1)
    follower = handle.state.hot_swap.follower
    config, scheduler, algorithm, runner = server()
    scheduler.waiting_queue.extend(requests(bundles, config, "a", 4))
    try:
        assert follower._thread is None  # started by the scheduler's first step
        scheduler.step(algorithm, runner)
        assert follower._thread.is_alive() and follower.served == served_decoding("LowConfidence", {}, BS)
        publish(bundles.v2, zoo, name=NAME, verify=False)
        deadline = time.monotonic() + 60
        while handle.stats.swaps == 0:
            assert time.monotonic() < deadline, "the follower never offered v2"
            time.sleep(0.05)
            scheduler.step(algorithm, runner)
        assert handle.state.bundle_version == "2"
    finally:
        handle.uninstall()
    assert not follower._thread.is_alive() and not follower.cache.exists()


def test_following_needs_a_bundle_and_a_zoo_that_is_one(bundles, tmp_path, monkeypatch, capsys):
    """Each setting refused in one line, by serve as its flag and by the plugin as its variable; good
    ones reach the launcher from both."""
    zoo = zoo_with_v1(bundles, tmp_path)
    bad = {
        "`follow` needs `bundle`, the bundle to serve until a new one comes": {"record": str(tmp_path / "r"),
                                                                               "follow": NAME, "follow_zoo": str(zoo)},
        "`follow_zoo` needs `follow`, the name of the bundle to follow in it": {"bundle": str(bundles.v1),
                                                                                "follow_zoo": str(zoo)},
        f"`follow_zoo` {tmp_path} holds no index.json": {"bundle": str(bundles.v1), "follow": NAME,
                                                         "follow_zoo": str(tmp_path)},
        "`follow_poll_s` must be a finite number of seconds >= 0.1, got 0.05": {"bundle": str(bundles.v1),
                                                                                "follow": NAME, "follow_poll_s": 0.05},
        "`rollback_margin` must be a difference of rank correlations in [0, 2], got -1.0": {
            "bundle": str(bundles.v1), "rollback_margin": -1.0},
        "`rollback_after` must be 0 or more, got -1": {"bundle": str(bundles.v1), "rollback_after": -1},
        "`rollback_after` (600) must be at most `monitor_window` (512)": {"bundle": str(bundles.v1), "follow": NAME,
                                                                          "follow_zoo": str(zoo), "rollback_after": 600},
    }
    for message, fields in bad.items():
        assert any(message in p for p in HookConfig(**fields).problems()), message
        with pytest.raises(ConfigError, match="DWISE_") as err:
            config_from_environ({f"DWISE_{k.upper()}": str(v) for k, v in fields.items()})
        assert not re.search(r"`(follow|rollback|bundle)", str(err.value))  # each named as its variable
    with pytest.raises(ConfigError, match="DWISE_FOLLOW_ZOO .* holds no index.json"):
        config_from_environ({"DWISE_BUNDLE": str(bundles.v1), "DWISE_FOLLOW": NAME, "DWISE_FOLLOW_ZOO": str(tmp_path)})
    started = []
    monkeypatch.setattr(launcher, "serve", lambda config, argv: started.append(config))
    assert main(["serve", "--bundle", str(bundles.v1), "--follow", NAME, "--follow-zoo", str(tmp_path), "--",
                 "--model-path", "m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--follow-zoo {tmp_path} holds no index.json" in err and not started
    assert main(["serve", "--bundle", str(bundles.v1), "--follow", NAME, "--follow-zoo", str(zoo), "--follow-poll-s",
                 "2.5", "--rollback-after", "32", "--rollback-margin", "0.05", "--", "--model-path", "m"]) == 0
    config, = started
    assert (config.follow, config.follow_zoo, config.follow_poll_s, config.rollback_after, config.rollback_margin) \
        == (NAME, str(zoo), 2.5, 32, 0.05)
    environ = config_from_environ({"DWISE_BUNDLE": str(bundles.v1), "DWISE_FOLLOW": NAME, "DWISE_FOLLOW_ZOO": str(zoo),
                                   "DWISE_FOLLOW_POLL_S": "2.5", "DWISE_ROLLBACK_AFTER": "32",
                                   "DWISE_ROLLBACK_MARGIN": "0.05"})
    assert environ == config
    report = checked(config, None)  # serve --check's report of serve's hook (no server resolved here)
    assert report["problems"] == [] and {key: report["hook"][key] for key in ("follow", "follow_zoo", "follow_poll_s")} \
        == {"follow": NAME, "follow_zoo": str(zoo), "follow_poll_s": 2.5}
    with pytest.raises(ConfigError, match="needs a bundle to start from"):
        install(None, resolve=fake.resolve, follow=Following(NAME, str(zoo)))
