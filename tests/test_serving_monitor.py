"""The live quality monitor (issue 55): known answers on data of known structure."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest

from dwise_predict.errors import ConfigError
from dwise_predict.serving.monitor import QualityMonitor

# a permutation of 0..7 whose Spearman ρ against 0..7 is exactly 0
UNRANKED = (0, 3, 5, 6, 7, 4, 2, 1)


def observe_all(monitor, admission, refined, rounds, category="live", version="v1"):
    for a, r, n in zip(admission, refined, rounds):
        monitor.observe(float(a), float(r), int(n), category, version)


def test_perfect_ranks_give_one_and_reversed_ranks_minus_one():
    monitor = QualityMonitor(window=64)
    rounds = np.arange(1, 41)
    observe_all(monitor, rounds[::-1], 2.0 * rounds, rounds)  # admission reversed, refined twice the truth
    summary = monitor.summary()
    assert summary["observed"] == summary["window"] == 40
    assert summary["admission_rho"] == pytest.approx(-1.0)
    assert summary["refined_rho"] == pytest.approx(1.0)
    assert summary["calibration_ratio"] == pytest.approx(2.0)
    assert summary["categories"] == {"live": {"n": 40, "refined_rho": pytest.approx(1.0)}}
    json.dumps(summary)  # a plain dict: the recording's manifest holds it as it is


def test_within_category_rho_is_zero_where_only_the_categories_are_ranked():
    """Four categories far apart in length, each ranked at random inside (ρ exactly 0 in each): the
    pooled ρ is high, the within-category ρ is 0."""
    monitor = QualityMonitor()
    for c in range(4):
        base = 100 * (c + 1)
        observe_all(monitor, [base] * 8, [base + u for u in UNRANKED], [base + i for i in range(8)], f"cat{c}")
    summary = monitor.summary()
    assert summary["refined_rho"] > 0.9
    assert summary["within_category_rho"] == pytest.approx(0.0, abs=1e-12)
    assert summary["categories"]["cat2"] == {"n": 8, "refined_rho": pytest.approx(0.0, abs=1e-12)}
    assert summary["admission_rho"] > 0.9  # constant inside a category, ordered across them


def test_too_few_requests_give_none_and_small_categories_stay_out_of_the_within_mean():
    monitor = QualityMonitor(min_requests=32, min_per_category=8)
    rounds = np.arange(1, 32)
    observe_all(monitor, rounds, rounds, rounds)  # 31 requests
    summary = monitor.summary()
    assert summary["admission_rho"] is summary["refined_rho"] is summary["calibration_ratio"] is None
    assert summary["within_category_rho"] is None and summary["categories"]["live"] == {"n": 31, "refined_rho": None}
    assert summary["versions"]["v1"] == {"n": 31, "admission_rho": None, "refined_rho": None}
    monitor.observe(40.0, 40.0, 40, "rare", "v1")  # the 32nd; its category has one request
    summary = monitor.summary()
    assert summary["refined_rho"] == pytest.approx(1.0)
    assert summary["within_category_rho"] == pytest.approx(1.0)  # "live" alone: "rare" has too few
    assert summary["categories"]["rare"] == {"n": 1, "refined_rho": None}


def test_the_window_forgets_the_oldest_requests():
    monitor = QualityMonitor(window=64)
    rounds = np.arange(1, 65)
    observe_all(monitor, rounds[::-1], rounds[::-1], rounds, version="old")  # reversed, then evicted
    assert monitor.summary()["refined_rho"] == pytest.approx(-1.0)
    observe_all(monitor, rounds, rounds, rounds, version="new")
    summary = monitor.summary()
    assert (summary["observed"], summary["window"]) == (128, 64)
    assert summary["refined_rho"] == pytest.approx(1.0) and summary["admission_rho"] == pytest.approx(1.0)
    assert set(summary["versions"]) == {"new"} and monitor.quality("old") == (0, None)
    observe_all(monitor, rounds[:16][::-1], rounds[:16][::-1], rounds[:16], version="old")  # 16 of 64 come back
    assert monitor.quality("old") == (16, None)  # fewer than min_requests


def test_each_bundle_version_is_ranked_on_its_own_requests():
    monitor = QualityMonitor()
    rounds = np.arange(1, 41)
    observe_all(monitor, rounds, rounds, rounds, version="a")
    observe_all(monitor, rounds, rounds[::-1], rounds, version="b")  # b's refinement ranks backwards
    summary = monitor.summary()
    assert summary["versions"]["a"] == {"n": 40, "admission_rho": pytest.approx(1.0), "refined_rho": pytest.approx(1.0)}
    assert summary["versions"]["b"] == {"n": 40, "admission_rho": pytest.approx(1.0),
                                        "refined_rho": pytest.approx(-1.0)}
    n, rho = monitor.quality("b")
    assert n == 40 and rho == pytest.approx(-1.0)
    assert monitor.quality("never") == (0, None)


def test_a_request_without_a_refined_estimate_counts_only_for_admission():
    monitor = QualityMonitor(window=128)
    rounds = np.arange(1, 41)
    observe_all(monitor, rounds, rounds, rounds)
    observe_all(monitor, rounds + 100, [math.nan] * 10, rounds[:10] + 100)
    summary = monitor.summary()
    assert summary["window"] == 50 and summary["categories"]["live"]["n"] == 50
    assert summary["refined_rho"] == pytest.approx(1.0) and summary["admission_rho"] == pytest.approx(1.0)
    assert summary["calibration_ratio"] == pytest.approx(1.0)


def test_observing_writes_into_the_arrays_allocated_once():
    monitor = QualityMonitor(window=8)
    arrays = [monitor.admission, monitor.refined, monitor.rounds, monitor.category, monitor.version]
    for i in range(20):
        monitor.observe(i, i, i, "c", "v")
    assert all(a is b for a, b in zip(arrays, [monitor.admission, monitor.refined, monitor.rounds, monitor.category,
                                               monitor.version]))
    assert sorted(monitor.rounds.tolist()) == list(range(12, 20))


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": 2.5}, {"min_requests": True}, {"min_per_category": -1}])
def test_a_bad_size_is_refused(kwargs):
    with pytest.raises(ConfigError, match="quality monitor"):
        QualityMonitor(**kwargs)


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


def test_the_summary_is_published_at_most_every_few_seconds_at_a_bursts_end_and_at_a_swap(monkeypatch):
    """Ranking the window costs milliseconds of SGLang's scheduler thread: after finishes the
    publisher summarises at most every PUBLISH_S seconds, at once when the hook holds no request
    (no step may come for a long time) or when another bundle version serves."""
    from dwise_predict.serving.sglang import metrics

    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    monitor, recorder = QualityMonitor(), types.SimpleNamespace(monitor=None)
    publisher = metrics.MonitorPublisher(monitor, None, recorder)
    stats = types.SimpleNamespace(swaps=0, rollbacks=0)

    def finish(n, idle=False, version="v1", seconds=0.1):
        for _ in range(n):
            monitor.observe(1.0, 1.0, 1, "live", version)
        clock.now += seconds
        publisher.after_finishes(stats, version, idle)
        return publisher.published  # the requests observed when the last snapshot was handed to the worker

    assert finish(1) == 1  # the first finish: nothing published yet
    assert [finish(40) for _ in range(3)] == [1, 1, 1]  # 120 more within 0.3 s: not yet
    assert finish(1, seconds=metrics.PUBLISH_S) == 122
    assert finish(1) == 122 and finish(1, idle=True) == 124  # the burst's end
    assert finish(0, idle=True) == 124 and finish(1, version="v2") == 125  # a swap shows at once
    publisher.stop()  # the worker summarises the snapshot it holds first
    assert recorder.monitor["observed"] == 125 and recorder.monitor["versions"]["v2"]["n"] == 1


def test_the_scheduler_thread_only_snapshots_the_window_and_one_worker_ranks_it(monkeypatch):
    """The summary's ranking (milliseconds) runs on the publisher's one worker thread, never on the
    thread that calls after_finishes (SGLang's scheduler); publish_now ranks on its caller's, for the
    recorder's close; a summary of an older snapshot never replaces a newer one."""
    import threading

    from dwise_predict.serving import monitor as monitor_module
    from dwise_predict.serving.sglang import metrics

    ranked_on = []
    summary = monitor_module.MonitorSnapshot.summary

    def recording_summary(snapshot):
        ranked_on.append(threading.current_thread())
        return summary(snapshot)

    monkeypatch.setattr(monitor_module.MonitorSnapshot, "summary", recording_summary)
    monkeypatch.setattr(QualityMonitor, "summary", None)  # the live window is never ranked: only snapshots
    monitor, recorder = QualityMonitor(window=64), types.SimpleNamespace(monitor=None)
    publisher = metrics.MonitorPublisher(monitor, None, recorder)
    assert recorder.monitor_now == publisher.publish_now and publisher.publish_now() is None  # nothing yet
    stats = types.SimpleNamespace(swaps=0, rollbacks=0)
    rounds = np.arange(64)
    for start in range(0, 64, 8):
        observe_all(monitor, rounds[start:start + 8], rounds[start:start + 8], rounds[start:start + 8])
        publisher.after_finishes(stats, "v1", idle=True)
    assert threading.current_thread() not in ranked_on  # nothing ranked here so far
    publisher.stop()
    assert {t.name for t in ranked_on} == {"dwise-monitor"} and len(set(ranked_on)) == 1
    assert ranked_on[0].daemon and not ranked_on[0].is_alive()  # dies with the process; stopped
    assert 1 <= len(ranked_on) <= 8  # one slot, newest wins: a worker that fell behind skipped snapshots
    assert recorder.monitor["observed"] == 64 and recorder.monitor["refined_rho"] == pytest.approx(1.0)
    late = publisher._snapshot()  # taken before the one below, summarised after it
    observe_all(monitor, [1.0] * 8, [1.0] * 8, [5] * 8)
    assert publisher.publish_now()["observed"] == 72 and ranked_on[-1] is threading.current_thread()
    publisher._hand_on(*late)
    assert recorder.monitor["observed"] == 72  # the older summary did not replace the newer
