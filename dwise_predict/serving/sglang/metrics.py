"""The quality monitor's figures where operators look: SGLang's own ``/metrics`` endpoint and the
recording's manifest.

SGLang 0.5.23 runs prometheus_client in multiprocess mode: before it starts its processes, the
launcher points ``PROMETHEUS_MULTIPROC_DIR`` at a temporary directory
(``srt/utils/common.py``: ``set_prometheus_multiproc_dir``), every process's metrics write their
values into files there, and the HTTP server's ``/metrics`` route (``add_prometheus_middleware``)
collects every file of the directory (``multiprocess.MultiProcessCollector``). A scheduler makes
its collector (``Scheduler.metrics_collector``, ``srt/observability/metrics_collector.py``) only
under ``--enable-metrics``; its gauges carry ``SchedulerMetricsCollector.labels`` (``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank`` under data parallelism,
any ``--extra-metric-labels``) and ``multiprocess_mode="mostrecent"``.

:class:`MonitorGauges` are made the same way, in the scheduler process that refines, and only
where that collector exists and prometheus_client imports (else nothing is exported): SGLang's
labels (less ``priority``, a breakdown of SGLang's queue gauges), ``mostrecent``, and in no
registry of this process (the endpoint reads the files; a second hook in one process, a test's,
must not clash with the first's names). What the endpoint then shows:

- ``dwise_rank_correlation{estimate="admission"|"refined"}``: Spearman ρ of each served estimate
  against the denoising rounds the requests ran, over the monitor's window;
- ``dwise_within_category_rank_correlation``, ``dwise_calibration_ratio`` (median refined /
  actual), ``dwise_monitored_requests`` (requests in the window);
- ``dwise_bundle_swaps_total``, ``dwise_bundle_rollbacks_total``: counters of the hook's bundle swaps;
- ``dwise_bundle_info{version=...}``: 1 for the bundle version serving now, 0 for one served before.

A metric the window holds too few requests for (:mod:`~dwise_predict.serving.monitor`) is NaN.

:class:`MonitorPublisher` hands the monitor's summary to the gauges and to the recorder, whose
writer thread puts it in the recording's manifest as ``monitor``, at most every :data:`PUBLISH_S`
seconds while requests finish, at once when the hook holds no request any more (the end of a
burst, after which no step may come for a long time) and at once when another bundle serves. The
summary ranks the window, milliseconds that SGLang's scheduler thread cannot spare (every step
waits on it): that thread takes only a snapshot of the window (a copy of its small arrays,
microseconds: :meth:`~dwise_predict.serving.monitor.QualityMonitor.snapshot`) and leaves it in a
one-slot mailbox, the newest replacing one not yet taken; one daemon thread, started with the
first, ranks it and updates the gauges and the recorder. The hook's uninstall stops that thread;
the recorder's close and flush (SIGTERM, SIGINT, exit) summarise on their own thread
(:meth:`MonitorPublisher.publish_now`), so the manifest's ``monitor`` is the window's at the end.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time

logger = logging.getLogger(__name__)

PUBLISH_S = 2.0
MODE = "mostrecent"  # SGLang's scheduler gauges': the value the process set last


def _value(metric) -> float:
    """A summary's metric as a gauge value: NaN where it is None (too few requests)."""
    return math.nan if metric is None else float(metric)


class MonitorGauges:
    """The monitor's gauges and the swap counters, under one scheduler's SGLang labels.

    labels : SGLang's labels of this scheduler (label name -> value).
    gauge, counter : prometheus_client's ``Gauge`` and ``Counter`` (or classes with their API).
    """

    def __init__(self, labels: dict, gauge, counter):
        self.labels = {str(k): str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.rank = gauge("dwise_rank_correlation", "Spearman rank correlation of the served estimate with the "
                          "denoising rounds requests ran, over the DWISE monitor's window",
                          labelnames=[*names, "estimate"], multiprocess_mode=MODE, registry=None)
        self.within = gauge("dwise_within_category_rank_correlation", "Mean over request categories of the "
                            "refined estimate's rank correlation inside each", labelnames=names, multiprocess_mode=MODE,
                            registry=None)
        self.calibration = gauge("dwise_calibration_ratio", "Median of refined estimate / actual denoising rounds",
                                 labelnames=names, multiprocess_mode=MODE, registry=None)
        self.requests = gauge("dwise_monitored_requests", "Finished requests in the DWISE monitor's window",
                              labelnames=names, multiprocess_mode=MODE, registry=None)
        self.swaps = counter("dwise_bundle_swaps", "Bundles the DWISE hook swapped in while serving",
                             labelnames=names, registry=None)
        self.rollbacks = counter("dwise_bundle_rollbacks", "Swaps the DWISE hook rolled back",
                                 labelnames=names, registry=None)
        self.info = gauge("dwise_bundle_info", "1 for the bundle version serving now (0: served before)",
                          labelnames=[*names, "version"], multiprocess_mode=MODE, registry=None)
        self.counted_swaps = self.counted_rollbacks = 0
        self.version: str | None = None

    @classmethod
    def of_scheduler(cls, scheduler) -> MonitorGauges | None:
        """The gauges for ``scheduler`` (SGLang's), or None where its metrics are off (no
        ``metrics_collector``: no ``--enable-metrics``) or prometheus_client does not import."""
        collector = getattr(scheduler, "metrics_collector", None)
        if collector is None:
            return None
        try:
            from prometheus_client import Counter, Gauge  # SGLang's: imported after PROMETHEUS_MULTIPROC_DIR is set
        except ImportError:
            return None
        return cls({k: v for k, v in collector.labels.items() if k != "priority"}, Gauge, Counter)

    def update(self, summary: dict, swaps: int, rollbacks: int, version: str) -> None:
        """Set every gauge from a monitor ``summary``; count the swaps and rollbacks since the last
        update; mark ``version`` as the one serving."""
        labels = self.labels
        self.rank.labels(**labels, estimate="admission").set(_value(summary["admission_rho"]))
        self.rank.labels(**labels, estimate="refined").set(_value(summary["refined_rho"]))
        self.within.labels(**labels).set(_value(summary["within_category_rho"]))
        self.calibration.labels(**labels).set(_value(summary["calibration_ratio"]))
        self.requests.labels(**labels).set(summary["window"])
        self.swaps.labels(**labels).inc(max(swaps - self.counted_swaps, 0))
        self.rollbacks.labels(**labels).inc(max(rollbacks - self.counted_rollbacks, 0))
        self.counted_swaps = max(swaps, self.counted_swaps)
        self.counted_rollbacks = max(rollbacks, self.counted_rollbacks)
        if version != self.version:
            if self.version is not None:
                self.info.labels(**labels, version=self.version).set(0)
            self.info.labels(**labels, version=version).set(1)
            self.version = version


class MonitorPublisher:
    """The monitor's summary to the gauges (or None) and the recorder (or None), when due, ranked
    off the scheduler thread. Sets the recorder's ``monitor_now`` to :meth:`publish_now`.

    Scheduler thread: ``published``, the monitor's ``observed`` at the last snapshot handed on;
    ``published_at`` its time (``time.monotonic``); ``version`` the bundle version it was taken under.
    """

    def __init__(self, monitor, gauges: MonitorGauges | None, recorder):
        # the summaries rank with scipy, which dwise_predict.metrics imports at first use (so that `serve
        # --check` starts fast): import it here, as the hook is built, not on the worker's first summary,
        # where ~0.8 s of module code holding the GIL would stall the scheduler thread mid-serving
        import scipy.stats  # noqa: F401

        self.monitor, self.gauges, self.recorder = monitor, gauges, recorder
        self.published = 0
        self.published_at = -math.inf
        self.version: str | None = None
        self.stats = None  # the hook's HookStats (swaps, rollbacks), from the first finishes on
        self._order = itertools.count()  # snapshots in the order taken: an older summary never replaces a newer
        self._handed = -1  # the order of the summary the gauges and the recorder hold
        self._handing = threading.RLock()  # re-entrant: publish_now may run in a signal handler on a thread holding it
        self._mailbox = threading.Condition()
        self._job: tuple | None = None  # the snapshot the worker is to summarise next (one slot: the newest)
        self._stopping = False
        self._worker: threading.Thread | None = None
        if recorder is not None:
            recorder.monitor_now = self.publish_now

    def after_finishes(self, stats, version: str, idle: bool) -> None:
        """After a step that finished requests: hand a snapshot to the worker if the monitor observed
        any since the last and :data:`PUBLISH_S` seconds have passed or the hook holds no request
        (``idle``), or if another bundle serves now (a swap is shown at once). O(1) otherwise;
        microseconds when it hands one on."""
        due = idle or time.monotonic() - self.published_at >= PUBLISH_S
        if (self.monitor.observed != self.published and due) or version != self.version:
            self.published, self.published_at, self.version, self.stats = (self.monitor.observed, time.monotonic(),
                                                                           version, stats)
            job = self._snapshot()
            with self._mailbox:
                self._job = job
                self._mailbox.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="dwise-monitor", daemon=True)
                self._worker.start()

    def publish_now(self) -> dict | None:
        """Summarise the monitor on the calling thread now and hand the summary on; return it (None
        before the first finishes: nothing to publish)."""
        if self.version is None:
            return None
        return self._hand_on(*self._snapshot())

    def stop(self, timeout: float = 5.0) -> None:
        """Let the worker summarise the snapshot it holds, if any, and end (waits up to ``timeout``
        seconds). Snapshots handed on after this are not summarised."""
        with self._mailbox:
            self._stopping = True
            self._mailbox.notify()
        if self._worker is not None:
            self._worker.join(timeout)

    def _snapshot(self) -> tuple:
        return (next(self._order), self.monitor.snapshot(), self.stats.swaps, self.stats.rollbacks, self.version)

    def _work(self) -> None:
        while True:
            with self._mailbox:
                while self._job is None and not self._stopping:
                    self._mailbox.wait()
                job, self._job = self._job, None
            if job is None:
                return
            try:
                self._hand_on(*job)
            except Exception:  # the scheduler serves on; the next snapshot may do better
                logger.exception("dwise: summarising the quality monitor failed")

    def _hand_on(self, order: int, snapshot, swaps: int, rollbacks: int, version: str) -> dict:
        """Rank ``snapshot`` and set the gauges and the recorder's ``monitor`` from it, unless a
        newer snapshot's summary got there first."""
        summary = snapshot.summary()
        with self._handing:
            if order > self._handed:
                self._handed = order
                if self.gauges is not None:
                    self.gauges.update(summary, swaps, rollbacks, version)
                if self.recorder is not None:
                    self.recorder.monitor = summary  # a fresh dict: the writer thread reads it, nobody changes it
        return summary


__all__ = ["PUBLISH_S", "MonitorGauges", "MonitorPublisher"]
