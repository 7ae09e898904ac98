"""`simulate --refine-every`: re-estimating remaining work every n denoising rounds (the DWISE paper's Table 6).

The DWISE paper refines ``r̂`` once, after a request's first denoising round, and lets it fall by one per
round after that (clamped at zero); its Table 6 compares refining every round, every 4 rounds and
every block. Replaying that needs what the hook would see at later rounds: traces collected with
``collect --rounds-hidden N`` hold each request's pooled state and early signals of its first ``N``
denoising rounds (:mod:`dwise_predict.traces.round_states`).

**The estimate at round k** is the bundle's one refinement graph fed round k's pooled state and
signals in place of the first round's (prompt rows, prompt length and budget unchanged), read as the
remaining rounds after round k. A graph per k would need a training target per round and a bundle
input per round (a contract-2 change) for a setting the DWISE paper found to lose; the single graph keeps the
bundle as it is, and :func:`rank_by_round` measures how well it ranks at each round against simply
decrementing the round-1 estimate.

A replay is bounded by ``N``: with ``--refine-every n`` refinements run after rounds ``1, 1 + n,
1 + 2n, …`` up to ``N``; after that ``r̂`` falls by one per round (:class:`~.simulator.LaterRefinements`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.simulation.simulator import (
    SimConfig,
    SimRequests,
    make_arrivals,
    parse_rates,
    simulate,
)

ROUNDS_REPORTED = (1, 2, 4, 8)  # the settings of the DWISE paper's Table 6, as rounds to rank at
NEVER, ONCE = "never", "once"


def round_estimates(ds, bundle, split: str | None = "eval") -> np.ndarray:
    """The bundle's calibrated refinement at each of the first ``N`` denoising rounds.

    Parameters
    ----------
    ds : a TraceDataset collected with ``--rounds-hidden N``.
    bundle : a :class:`~dwise_predict.bundles.load.LoadedBundle`.
    split : the requests :func:`~.simulator.sim_requests_from_traces` replays (``eval``, ``train``, None: all).

    Returns
    -------
    array of shape (n_requests, N), remaining denoising rounds after round k in column k - 1
    (clamped at zero as the replay clamps the first-round refinement); NaN where a request has no
    round k.

    Raises
    ------
    TraceError
        The traces hold no per-round states (naming ``collect --rounds-hidden``).
    """
    from dwise_predict.traces.round_states import round_states

    if split is not None:
        ds = ds.subset(ds.requests["split"].to_numpy() == split)
    rounds = round_states(ds)
    rows, ks = np.nonzero(rounds.recorded[:, None] >= np.arange(1, rounds.rounds + 1)[None, :])
    req = ds.requests
    values = bundle.refine(rounds.states[rows, ks], ds.prompt_last[rows],
                           req["prompt_tokens"].to_numpy(np.float32)[rows], req["budget"].to_numpy(np.float32)[rows],
                           rounds.signals[rows, ks])
    out = np.full((len(req), rounds.rounds), np.nan)
    out[rows, ks] = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    return out


def held_estimates(requests: SimRequests, refine_every: float | str) -> np.ndarray:
    """``r̂`` a request holds after each of its first ``N`` denoising rounds, independent of scheduling.

    ``refine_every`` is ``"never"`` (the admission estimate, decremented), ``"once"`` (the round-1
    refinement, decremented) or ``n`` (re-estimated after rounds ``1, 1 + n, …`` up to ``N``).
    Returns (n_requests, N); column m - 1 holds ``r̂`` after round m (NaN once a request is done).
    """
    kept = requests.round_refined.shape[1]
    m = np.arange(1, kept + 1)[None, :]
    total = requests.total_rounds[:, None]
    if refine_every == NEVER:
        held = np.maximum(np.asarray(requests.admission, dtype=np.float64)[:, None] - m, 0.0)
    else:
        n = math.inf if refine_every == ONCE else float(refine_every)
        held = np.empty((len(requests), kept))
        value, since = np.asarray(requests.refined, dtype=np.float64), np.ones(len(requests))
        for k in range(1, kept + 1):
            if k > 1 and (k - 1) % n == 0:
                fresh = requests.round_refined[:, k - 1]
                use = np.isfinite(fresh)
                value, since = np.where(use, fresh, value), np.where(use, k, since)
            held[:, k - 1] = np.maximum(value - (k - since), 0.0)
    return np.where(total > m, held, np.nan)


def held_rho(requests: SimRequests, refine_every: float | str) -> float | None:
    """Mean over rounds m = 1..N of Spearman ρ between the ``r̂`` held after round m and the true
    remaining rounds ``total − m``, over the requests still running (None where undefined)."""
    from dwise_predict.metrics import spearman

    held = held_estimates(requests, refine_every)
    values = []
    for m in range(1, held.shape[1] + 1):
        alive = requests.total_rounds > m
        rho = spearman(held[alive, m - 1], requests.total_rounds[alive] - m)
        if rho is not None:
            values.append(rho)
    return float(np.mean(values)) if values else None


def rank_by_round(requests: SimRequests, rounds=ROUNDS_REPORTED) -> list[dict]:
    """How well each round's estimate ranks the remaining work, against decrementing round 1's.

    For each round k (of ``rounds``, up to ``N``), over the requests still running after it
    (``total > k``): Spearman ρ and median predicted / actual of the refinement fed round k's state
    (``rho_state``, ``ratio_state``) and of the round-1 refinement decremented by ``k − 1``
    (``rho_decrement``, ``ratio_decrement``), against ``total − k``. At round 1 both are the
    replay's first refinement (``requests.refined``).
    """
    from dwise_predict.metrics import median_ratio, spearman

    kept = requests.round_refined.shape[1]
    rows = []
    for k in [k for k in rounds if k <= kept]:
        alive = requests.total_rounds > k
        remaining = requests.total_rounds[alive] - k
        first = np.asarray(requests.refined, dtype=np.float64)[alive]  # round 1's, as the replay refines
        state = first if k == 1 else requests.round_refined[alive, k - 1]
        decrement = np.maximum(first - (k - 1), 0.0)
        rows.append({"round": k, "requests": int(alive.sum()),
                     "rho_state": spearman(state, remaining), "rho_decrement": spearman(decrement, remaining),
                     "ratio_state": median_ratio(state, remaining),
                     "ratio_decrement": median_ratio(decrement, remaining)})
    return rows


def refine_call_us(bundle, ds, batch: int, repeats: int = 15) -> float:
    """Median wall time of one refinement call on ``batch`` requests' first-round inputs, µs (measured)."""
    idx = np.arange(max(int(batch), 1)) % len(ds)
    req = ds.requests
    inputs = (ds.first_round[idx], ds.prompt_last[idx], req["prompt_tokens"].to_numpy(np.float32)[idx],
              req["budget"].to_numpy(np.float32)[idx], ds.early_signals[idx])
    bundle.refine(*inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bundle.refine(*inputs)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def replay_refine_every(requests: SimRequests, config: SimConfig, ns: list[int], patterns: list[str],
                        rate: str | None = None, ranked: SimRequests | None = None, call_us=None) -> dict:
    """The DWISE paper's Table 6 on these requests: DWISE never refining (``dwise-admission``), refining once
    (``dwise-refined``) and every ``n`` rounds, under each arrival pattern, on one arrival trace per
    pattern.

    Parameters
    ----------
    requests : what to replay, with admission, refined and ``round_refined`` estimates.
    ns : refinement periods in denoising rounds (each >= 1).
    patterns, rate : arrival patterns and the Poisson rate of the non-burst ones (req/s or ``1.5x``).
    ranked : the requests to measure ρ on (the split before resampling; default ``requests``).
    call_us : ``batch -> µs`` of one refinement call (:func:`refine_call_us`), for the predictor
        cost per round; None leaves that column out.

    Returns
    -------
    ``{"rows": [...], "rho_by_round": [...], "rounds_hidden": N}``; a row holds ``arrival``,
    ``refine`` (``never``, ``once`` or n), the policy's metrics, ``refinements_per_request``,
    ``predictor_us_per_round`` and ``rho_held`` (:func:`held_rho`).
    """
    if requests.round_refined is None or requests.admission is None or requests.refined is None:
        raise ConfigError("`refine_every` needs admission, refined and per-round estimates: traces collected with "
                          "`dwise-predict collect --rounds-hidden N` and `bundle`")
    bad = [n for n in ns if not (isinstance(n, (int, np.integer)) and n >= 1)]
    if bad or not ns:
        raise ConfigError(f"`refine_every` takes whole round counts >= 1, got {bad or ns}")
    ranked = requests if ranked is None else ranked
    settings = [NEVER, ONCE, *ns]
    rho = {setting: held_rho(ranked, setting) for setting in settings}
    poisson = (parse_rates(rate or "1.5x", requests, config, "`rate`")[0]
               if any(p != "burst" for p in patterns) else None)
    rows = []
    for pattern in patterns:
        cfg = replace(config, arrival=pattern, rate=None if pattern == "burst" else poisson)
        arrivals = make_arrivals(len(requests), cfg)
        for setting in settings:
            if setting == NEVER:
                metrics = dict(simulate(requests, "dwise-admission", cfg, arrivals).metrics,
                               refinements_per_request=0.0, refining_rounds_pct=0.0, mean_refine_batch=0.0)
            else:
                every = math.inf if setting == ONCE else setting
                metrics = simulate(requests, "dwise-refined", cfg, arrivals, refine_every=every).metrics
            cost = None if call_us is None else (
                0.0 if metrics["refining_rounds_pct"] == 0
                else metrics["refining_rounds_pct"] / 100.0 * call_us(round(metrics["mean_refine_batch"])))
            rows.append({"arrival": pattern, "rate_rps": poisson if pattern != "burst" else None, "refine": setting,
                         **metrics, "predictor_us_per_round": cost, "rho_held": rho[setting]})
    return {"rows": rows, "rho_by_round": rank_by_round(ranked), "rounds_hidden": int(requests.round_refined.shape[1])}
