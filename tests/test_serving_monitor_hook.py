"""The live quality monitor inside the hook (issue 55), through the fake SGLang server: what each
finished request was served with reaches the monitor, its summary reaches SGLang's metrics (a fake
prometheus_client here; the real one in its multiprocess mode below) and the recording's manifest,
and the client's category reaches the traces."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.bundles.load import load_bundle  # noqa: E402
from dwise_predict.cli import main  # noqa: E402
from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.engine.algorithms import served_decoding  # noqa: E402
from dwise_predict.serving.sglang import install  # noqa: E402
from dwise_predict.serving.sglang.metrics import MonitorGauges  # noqa: E402
from dwise_predict.serving.sglang.requests import MAX_CATEGORY_CHARS, category_of  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402
from fakes.serving_bundle import HIDDEN, served_bundle  # noqa: E402
from live.live_server import VENV, venv_ready  # noqa: E402

BS, BUDGET = 8, 256
MODEL = {"name": "fake", "hidden_size": HIDDEN, "config_hash": "x", "weights_sha256": "y"}
CATEGORIES = ("math", "code", None)  # None: the client names none ("live")


class KnownEstimates:
    """The served bundle (its manifest, width, training mean) with estimates the test chose: the
    admission estimate is the request's first feature, the refinement the first coordinate of its
    pooled first-round row."""

    def __init__(self, bundle):
        self.manifest, self.hidden_size, self.prompt_last_mean = bundle.manifest, bundle.hidden_size, bundle.prompt_last_mean

    def admission(self, x):
        return np.asarray(x, dtype=np.float32)[:, 0]

    def refine(self, pooled, prompt_last, tokens, budget, signals):
        return pooled[:, 0].clone()


@pytest.fixture(scope="module")
def bundle():
    return KnownEstimates(load_bundle(served_bundle()[0], backend="torch", expect_decoding={"block_size": BS}))


def burst(config, n=40, health_checks=1):
    """``n`` requests of 2 prompt blocks and 1 to 3 output blocks, a category each in turn; each
    one's refined estimate (its hidden vector's first coordinate) is its true remaining rounds after the
    first (the bundle contract's output) and its admission estimate falls as they rise; and SGLang's
    health probes. Returns (requests, true rounds)."""
    rng = np.random.default_rng(0)
    reqs, rounds = [], {}
    for i in range(n):
        forwards = [int(f) for f in rng.integers(2, BS + 2, size=int(rng.integers(1, 4)))]
        hidden = rng.normal(size=HIDDEN).astype(np.float32)
        hidden[0] = sum(forwards) - 1
        category = CATEGORIES[i % len(CATEGORIES)]
        params = fake.SamplingParams(BUDGET, {"dwise_category": category} if category else None)
        reqs.append(fake.Req(f"r{i:02d}", [100 + 1000 * i + t for t in range(2 * BS)], params, config, forwards, hidden,
                             (100.0 - sum(forwards), 0, 2 * BS)))
        rounds[reqs[-1].rid] = sum(forwards)
    for j in range(health_checks):  # max_new_tokens 1, as /health_generate sends it
        reqs.append(fake.Req(f"HEALTH_CHECK_{j}", [7] * BS, fake.SamplingParams(1), config, [2],
                             np.ones(HIDDEN, np.float32), (5.0, 0, BS)))
    return reqs, rounds


def serve(bundle, config, reqs, recorder=None, metrics_collector=None, **kw):
    handle = install(bundle, slots=4, k=2, resolve=fake.resolve, features=lambda r: r.features, block_size=BS,
                     device="cpu", max_batch=4, recorder=recorder, **kw)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        scheduler.metrics_collector = metrics_collector
        scheduler.waiting_queue.extend(reqs)
        fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, HIDDEN, max_bs=4))
    finally:
        handle.uninstall()
    return handle.state


def test_the_monitor_sees_each_finished_request_with_what_it_was_served(bundle):
    config = fake.config(BS, 8)
    reqs, rounds = burst(config)
    hook = serve(bundle, config, reqs)
    summary = hook.monitor.summary()
    assert summary["observed"] == summary["window"] == 40  # the health probe is SGLang's, not a client's
    assert summary["refined_rho"] == pytest.approx(1.0) and summary["calibration_ratio"] == pytest.approx(1.0)
    assert summary["admission_rho"] == pytest.approx(-1.0)
    assert summary["within_category_rho"] == pytest.approx(1.0)
    assert {c: row["n"] for c, row in summary["categories"].items()} == {"math": 14, "code": 13, "live": 13}
    assert summary["versions"] == {hook.bundle_version: {"n": 40, "admission_rho": pytest.approx(-1.0),
                                                         "refined_rho": pytest.approx(1.0)}}
    assert sorted(hook.monitor.rounds[:40].tolist()) == sorted(rounds.values())  # the policy's count, per request


def test_without_a_bundle_or_on_a_rank_that_takes_the_estimates_there_is_no_monitor(bundle, tmp_path):
    config = fake.config(BS, 8)
    manifest = live_manifest(MODEL, "LowConfidence", {}, BS, BUDGET)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, manifest=manifest)
    try:
        hook = serve(None, config, burst(config, n=4)[0], recorder=recorder, hidden_size=HIDDEN)
    finally:
        recorder.close()
    assert hook.monitor is None and hook.publisher is None
    for rank, monitored in ((0, True), (1, False)):
        handle = install(bundle, slots=4, k=2, resolve=fake.resolve, features=lambda r: r.features, block_size=BS,
                         device="cpu", max_batch=4)
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        scheduler.dp_tp_group = fake.GroupCoordinator([0, 1], rank, None)
        handle.state.bind(scheduler)
        handle.uninstall()
        assert (handle.state.monitor is not None) == (handle.state.table.monitor is not None) == monitored


def test_the_recording_holds_the_clients_categories_and_the_monitors_summary(bundle, tmp_path, capsys):
    config = fake.config(BS, 8)
    reqs, rounds = burst(config)
    decoding = served_decoding("LowConfidence", {}, BS)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, features=lambda r: (1, 0, len(r.origin_input_ids)),
                            manifest=live_manifest(MODEL, decoding["algorithm"], decoding["algorithm_config"], BS,
                                                   BUDGET))
    try:
        hook = serve(bundle, config, reqs, recorder=recorder)
    finally:
        recorder.close()
    ds = load_traces(tmp_path / "t")  # contract 1, validated, with the extra manifest key
    categories = dict(zip(ds.requests["request_id"], ds.requests["category"]))
    assert categories == {r.rid: category_of(r) for r in reqs if r.rid in rounds}
    assert set(categories.values()) == {"math", "code", "live"}
    monitor = ds.manifest["monitor"]
    assert monitor == json.loads(json.dumps(hook.monitor.summary()))  # the last summary: the burst's end published it
    assert monitor["window"] == 40 and monitor["refined_rho"] == pytest.approx(1.0)
    assert main(["traces", "show", str(tmp_path / "t"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {row["category"] for row in shown["categories"]} >= {"math", "code", "live"}


def test_a_category_is_a_bounded_string_or_live():
    def req(custom_params):
        return types.SimpleNamespace(sampling_params=fake.SamplingParams(8, custom_params))

    assert category_of(req({"dwise_category": "math", "thinking_budget": 5})) == "math"
    assert category_of(req({"dwise_category": "x" * 1000})) == "x" * MAX_CATEGORY_CHARS
    assert category_of(req({"dwise_category": "\x1b[2J<b>"})) == "\x1b[2J<b>"  # escaped where printed, not here
    for params in (None, {}, {"dwise_category": 3}, {"dwise_category": ["a"]}, {"dwise_category": "  "}, "math"):
        assert category_of(req(params)) == "live"
    assert category_of(types.SimpleNamespace(sampling_params=types.SimpleNamespace(max_new_tokens=8))) == "live"


# --- SGLang's metrics -------------------------------------------------------------------------------


class FakeMetric:
    """prometheus_client's ``Gauge`` / ``Counter`` as the gauges use them: values by label set."""

    made: dict = {}

    def __init__(self, name, documentation, labelnames, multiprocess_mode=None, registry="default"):
        assert registry is None and documentation
        self.name, self.labelnames, self.mode, self.values = name, tuple(labelnames), multiprocess_mode, {}
        FakeMetric.made[name] = self

    def labels(self, **labels):
        assert set(labels) == set(self.labelnames)
        return FakeChild(self, tuple(sorted(labels.items())))


class FakeChild:
    def __init__(self, metric, key):
        self.metric, self.key = metric, key

    def set(self, value):
        self.metric.values[self.key] = float(value)

    def inc(self, amount=1.0):
        assert amount >= 0
        self.metric.values[self.key] = self.metric.values.get(self.key, 0.0) + amount


def key(**labels) -> tuple:
    return tuple(sorted((name, str(v)) for name, v in labels.items()))


def value(name, **labels):
    return FakeMetric.made[name].values[key(**SGLANG_LABELS, **labels)]


SGLANG_LABELS = {"model_name": "fake", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


@pytest.fixture
def prometheus(monkeypatch):
    FakeMetric.made = {}
    monkeypatch.setitem(sys.modules, "prometheus_client", types.SimpleNamespace(Gauge=FakeMetric, Counter=FakeMetric))
    return FakeMetric.made


def test_the_gauges_follow_the_summary_under_sglangs_labels_only_with_its_metrics_on(bundle, prometheus):
    config = fake.config(BS, 8)
    hook = serve(bundle, config, burst(config)[0])
    assert hook.publisher.gauges is None and not prometheus  # no --enable-metrics: no collector, nothing made
    collector = fake.SchedulerMetricsCollector({**SGLANG_LABELS, "tp_rank": 0, "priority": ""})
    hook = serve(bundle, config, burst(config)[0], metrics_collector=collector)
    assert set(prometheus) == {"dwise_rank_correlation", "dwise_within_category_rank_correlation",
                               "dwise_calibration_ratio", "dwise_monitored_requests", "dwise_bundle_swaps",
                               "dwise_bundle_rollbacks", "dwise_bundle_info"}
    assert {m.name for m in prometheus.values() if m.mode != "mostrecent"} == {"dwise_bundle_swaps",
                                                                              "dwise_bundle_rollbacks"}  # counters
    assert value("dwise_rank_correlation", estimate="refined") == pytest.approx(1.0)
    assert value("dwise_rank_correlation", estimate="admission") == pytest.approx(-1.0)
    assert value("dwise_within_category_rank_correlation") == pytest.approx(1.0)
    assert value("dwise_calibration_ratio") == pytest.approx(1.0)
    assert value("dwise_monitored_requests") == 40
    assert value("dwise_bundle_info", version=hook.bundle_version) == 1.0
    assert value("dwise_bundle_swaps") == 0.0


def test_gauges_count_swaps_once_and_mark_the_version_serving(prometheus):
    gauges = MonitorGauges({"tp_rank": 1, "dp_rank": 0}, FakeMetric, FakeMetric)
    summary = {"admission_rho": None, "refined_rho": 0.5, "within_category_rho": None, "calibration_ratio": 1.25,
               "window": 3}
    gauges.update(summary, 0, 0, "aaa")
    gauges.update(summary, 2, 1, "bbb")
    gauges.update(summary, 2, 1, "bbb")
    labels = {"tp_rank": 1, "dp_rank": 0}
    assert np.isnan(prometheus["dwise_rank_correlation"].values[key(**labels, estimate="admission")])  # too few
    assert prometheus["dwise_rank_correlation"].values[key(**labels, estimate="refined")] == 0.5
    assert prometheus["dwise_bundle_swaps"].values[key(**labels)] == 2.0
    assert prometheus["dwise_bundle_rollbacks"].values[key(**labels)] == 1.0
    info = prometheus["dwise_bundle_info"].values
    assert info[key(**labels, version="aaa")] == 0.0 and info[key(**labels, version="bbb")] == 1.0


def test_without_prometheus_client_nothing_is_exported(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    scheduler = types.SimpleNamespace(metrics_collector=fake.SchedulerMetricsCollector(SGLANG_LABELS))
    assert MonitorGauges.of_scheduler(scheduler) is None


# SGLang's /metrics route, as add_prometheus_middleware builds it: a registry of a MultiProcessCollector
# over PROMETHEUS_MULTIPROC_DIR, where the scheduler process's gauges wrote their values
EXPOSE = """
import sys
from dwise_predict.serving.sglang.metrics import MonitorGauges
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, multiprocess

gauges = MonitorGauges({"model_name": "m", "tp_rank": 0}, Gauge, Counter)
gauges.update({"admission_rho": 0.25, "refined_rho": 0.75, "within_category_rho": None, "calibration_ratio": 1.5,
               "window": 64}, 1, 0, "abc123")
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
sys.stdout.write(generate_latest(registry).decode())
"""


def _python_with_prometheus() -> str | None:
    found = subprocess.run([sys.executable, "-c", "import prometheus_client"], capture_output=True).returncode == 0
    if found:
        return sys.executable
    return str(VENV / "bin" / "python") if venv_ready() else None


def test_sglangs_metrics_endpoint_shows_the_gauges_from_the_scheduler_process(tmp_path):
    python = _python_with_prometheus()
    if python is None:
        pytest.skip("prometheus_client is in neither this environment nor .venv-sglang")
    out = subprocess.run([python, "-c", EXPOSE], capture_output=True, text=True, timeout=120, check=True,
                         env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout
    samples = exposed(out)
    base = {"model_name": "m", "tp_rank": "0"}
    assert samples[("dwise_rank_correlation", key(**base, estimate="refined"))] == 0.75, out
    assert samples[("dwise_rank_correlation", key(**base, estimate="admission"))] == 0.25
    assert np.isnan(samples[("dwise_within_category_rank_correlation", key(**base))])
    assert samples[("dwise_calibration_ratio", key(**base))] == 1.5
    assert samples[("dwise_monitored_requests", key(**base))] == 64
    assert samples[("dwise_bundle_swaps_total", key(**base))] == 1.0
    assert samples[("dwise_bundle_rollbacks_total", key(**base))] == 0.0
    assert samples[("dwise_bundle_info", key(**base, version="abc123"))] == 1.0


def exposed(text: str) -> dict:
    """Prometheus's text format -> {(sample name, sorted labels): value} (no escapes in these labels)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, number = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            pairs = [pair.split("=", 1) for pair in labels.rstrip("}").split(",") if pair]
            samples[(name, key(**{k: v.strip('"') for k, v in pairs}))] = float(number)
    return samples
