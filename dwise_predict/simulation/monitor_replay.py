"""The live quality monitor replayed on traces: what a server's ``/metrics`` would have shown.

A trace set (contract 1: ``collect``'s traces, or a recording ``serve --record`` wrote, the same
contract) holds, for each request, what the hook hands the monitor when that request finishes:
its admission features, its first denoising round's states, the denoising rounds it ran and its
category (a recording's is the client's ``custom_params.dwise_category``). :func:`replay_monitor`
feeds a :class:`~dwise_predict.serving.monitor.QualityMonitor` request by request in arrival order
(``workload_index``) with what the hook would: the bundle's admission estimate (clamped at zero,
as ``RequestTable.register`` keeps it), its refined estimate in total rounds (1 + the remaining
rounds after the first denoising round, clamped at zero, as ``RequestTable.keep_refined`` keeps
it), the rounds, the category and the version. The estimates come from
:func:`~dwise_predict.simulation.simulator.sim_requests_from_traces`, the simulator's own, so the
replay and the scheduling lab see one bundle's estimates alike.

What the replay cannot see: a request the server aborted (the monitor leaves it out; a trace set
holds finished requests) and a version swapped mid-traffic (one bundle estimates every request here).
"""

from __future__ import annotations

import numpy as np

from dwise_predict.serving.monitor import WINDOW, QualityMonitor


def replay_monitor(ds, bundle, version: str, window: int = WINDOW) -> dict:
    """The monitor's summary (:meth:`~dwise_predict.serving.monitor.QualityMonitor.summary`) after
    every request of ``ds`` finished under ``bundle`` (a loaded bundle), filed under ``version``.

    The window is the monitor's: the last ``window`` requests in arrival order. A request that ran
    no denoising round is left out, as the hook leaves it out.
    """
    from dwise_predict.simulation.simulator import sim_requests_from_traces

    estimates = sim_requests_from_traces(ds, None, bundle)
    req = ds.requests
    arrival = req["workload_index"].to_numpy() if "workload_index" in req.columns else np.arange(len(req))
    categories = req["category"].astype(str).to_numpy() if "category" in req.columns else np.full(len(req), "live")
    monitor = QualityMonitor(window=window)
    for i in np.argsort(arrival, kind="stable"):
        rounds = int(estimates.total_rounds[i])
        if rounds > 0:
            monitor.observe(float(estimates.admission[i]), 1.0 + float(estimates.refined[i]), rounds,
                            str(categories[i]), version)
    return monitor.summary()


__all__ = ["replay_monitor"]
