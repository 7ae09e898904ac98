"""Amin et al.'s §V: the batch-timeout stability rule for fixed-fill synchronized batching.

The service model (Amin et al., "fixed-fill synchronized batching under Poisson arrivals"): requests
arrive as a Poisson process of rate ``λ``. The first request that finds no batch forming opens a
window; the batch closes when it holds ``B`` requests or ``T`` seconds after the window opened,
whichever comes first, and joins a FIFO queue in front of one server. Serving a batch takes one
service time ``S_i`` drawn (with replacement) from measured batch service times, whatever the
batch holds: under step-level parallelism a partial batch still costs a full forward pass per
denoising step. A request's latency is the end of its batch's service minus its arrival.

Utilisation is ``ρ = λ S / B`` (capacity ``B / S`` req/s with full batches).

The rule. Batches are formed independently of the server, so a cycle (window opening to window
closing) lasts ``1/λ`` (waiting for the opener) plus the window. Ignoring the cap ``B`` a batch holds
``1 + λT`` requests on average and the server keeps up iff ``λ S < 1 + λ T``, i.e.

    ``T_min = S − 1/λ``            (Amin et al., Eq. for T_min)

Below ``T_min`` batches arrive faster than they are served and the queue (and latency) grows
without bound. With the cap the window may close early (the ``B``-th arrival), so the exact
threshold :func:`exact_min_timeout` sits a little above ``T_min``; both are reported.

References
----------
Amin et al.'s §V (Table II notation, Table III percentiles, Fig. 11 U-shape); Deb & Serfozo (1973),
optimal control of batch service queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dwise_predict.errors import ConfigError, InputError
from dwise_predict.files import loads_json

PAPER_RHOS = (0.30, 0.50, 0.70, 0.85, 0.95)
PAPER_SUMMARY = {"batch_size": 8, "mean_s": 8.74, "cv": 0.266, "n": 8}  # Amin et al.'s §V, Table II
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class ServiceTimes:
    """Measured batch service times in seconds, where they came from and the batch size they hold."""

    samples: np.ndarray
    batch_size: int
    source: str

    def __post_init__(self) -> None:
        arr = np.asarray(self.samples, dtype=np.float64).reshape(-1)
        if len(arr) == 0 or not np.isfinite(arr).all() or (arr <= 0).any():
            raise InputError(f"batch service times ({self.source}) must be positive finite seconds, got {len(arr)} values")
        if not isinstance(self.batch_size, (int, np.integer)) or self.batch_size < 1:
            raise InputError(f"batch size must be a positive integer, got {self.batch_size!r}")
        object.__setattr__(self, "samples", arr)

    @property
    def mean(self) -> float:
        return float(self.samples.mean())

    @property
    def cv(self) -> float:
        return float(self.samples.std() / self.samples.mean())


def paper_service_times(n: int = PAPER_SUMMARY["n"], mean_s: float = PAPER_SUMMARY["mean_s"],
                        cv: float = PAPER_SUMMARY["cv"], batch_size: int = PAPER_SUMMARY["batch_size"]) -> ServiceTimes:
    """Service times standing in for Amin et al.'s eight measured ones, from their summary statistics.

    The paper gives only the mean (8.74 s) and CV (0.266) of ``n = 8`` samples. We place ``n``
    points at the mid-quantiles ``(i + 0.5) / n`` of a gamma distribution and rescale them so their
    mean and CV are exactly the stated ones (deterministic: no seed).
    """
    if n < 2 or not mean_s > 0 or not cv >= 0:
        raise ConfigError(f"paper summary needs n >= 2, mean > 0 and cv >= 0, got n={n}, mean={mean_s}, cv={cv}")
    z = np.array([_normal_ppf((i + 0.5) / n) for i in range(n)])
    # Wilson-Hilferty: gamma quantiles from normal ones (skewed like a service-time distribution)
    shape = 1.0 / cv**2 if cv > 0 else 1e6
    q = shape * (1 - 1 / (9 * shape) + z * math.sqrt(1 / (9 * shape))) ** 3
    q = (q - q.mean()) / (q.std() or 1.0)  # standardise, then put on the stated scale
    samples = mean_s * (1.0 + cv * q)
    return ServiceTimes(samples, batch_size, f"Amin et al.'s summary: B={batch_size}, S={mean_s} s, CV={cv}, n={n}")


def _normal_ppf(p: float) -> float:
    """Standard normal quantile (bisection on erf; exact to 1e-12, standard library only)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def load_service_times(path: Path, batch_size: int | None = None) -> ServiceTimes:
    """Service times from a file: JSON (a list of seconds, or ``{"batch_size": B, "service_s": [...]}``)
    or text with one number per line (``#`` comments allowed).

    Raises
    ------
    InputError
        The file is missing, unreadable, holds no numbers, or gives no batch size.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"service-time file {path} does not exist")
    text = path.read_text()
    size = batch_size
    try:
        if path.suffix == ".json":
            obj = loads_json(text, InputError, str(path))
            if isinstance(obj, dict):
                size = size or obj.get("batch_size")
                obj = obj.get("service_s")
            values = [float(v) for v in obj]
        else:
            values = [float(line.split("#")[0]) for line in text.splitlines() if line.split("#")[0].strip()]
    except (ValueError, TypeError) as err:
        raise InputError(f"{path}: expected service times in seconds ({err})") from None
    if size is None:
        raise InputError(f"{path} does not say its batch size: pass `batch_size`")
    return ServiceTimes(np.asarray(values), int(size), f"file {path}")


def min_timeout(mean_service_s: float, rate: float) -> float:
    """Closed-form minimum safe timeout ``T_min = S − 1/λ`` in seconds (may be negative: any T is safe)."""
    return mean_service_s - 1.0 / rate


def expected_window(timeout_s: float, rate: float, batch_size: int) -> float:
    """Mean time a window stays open: ``E[min(T, time of the (B−1)-th further arrival)]``.

    ``∫_0^T P(N(t) < B−1) dt = (1/λ) Σ_{j<B−1} P(Poisson(λT) > j)``; ``T`` may be ``inf``.
    """
    k = batch_size - 1
    if k == 0:
        return 0.0
    if math.isinf(timeout_s):
        return k / rate
    m = rate * timeout_s
    term, cdf, total = math.exp(-m), 0.0, 0.0
    for j in range(k):
        cdf += term  # P(Poisson(m) <= j)
        total += 1.0 - cdf
        term *= m / (j + 1)
    return total / rate


def exact_min_timeout(mean_service_s: float, rate: float, batch_size: int) -> float:
    """Smallest ``T`` whose batches the server keeps up with, counting the cap ``B``.

    Stability needs the mean cycle ``1/λ + E[window]`` to exceed ``S``; returns ``inf`` when even
    always-full batches are too slow (``λ S >= B``) and ``-inf`` when any timeout is safe.
    """
    if rate * mean_service_s >= batch_size:
        return math.inf
    if 1.0 / rate >= mean_service_s:
        return -math.inf
    lo, hi = 0.0, max(mean_service_s, 1.0)
    while 1.0 / rate + expected_window(hi, rate, batch_size) < mean_service_s:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1.0 / rate + expected_window(mid, rate, batch_size) < mean_service_s:
            lo = mid
        else:
            hi = mid
    return hi


def simulate_batching(service: ServiceTimes, rate: float, timeout_s: float = math.inf,
                      n_requests: int = 20_000, seed: int = 0) -> dict:
    """Monte Carlo of fixed-fill synchronized batching (see the module docstring).

    Parameters
    ----------
    service : measured batch service times (resampled with replacement) and ``B``.
    rate : Poisson arrival rate ``λ``, req/s.
    timeout_s : ``T``; ``inf`` waits for a full batch (pure fixed fill, Amin et al.'s Fig. 11).
    n_requests : requests simulated (Amin et al.: 20,000).

    Returns
    -------
    dict with ``latency_s`` (array (n_requests,)), ``batch_sizes`` (array (n_batches,)),
    ``queue_wait_s`` (array (n_batches,), time each batch waited for the server) and
    ``server_busy`` (fraction of the makespan the server was busy).
    """
    if not rate > 0 or not timeout_s >= 0 or n_requests < 1:
        raise ConfigError(f"need rate > 0, timeout >= 0 and n_requests >= 1, got {rate}, {timeout_s}, {n_requests}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n_requests))
    B = service.batch_size
    starts, closes = [], []
    i = 0
    while i < n_requests:
        last_in_time = int(np.searchsorted(arrivals, arrivals[i] + timeout_s, side="right"))
        end = min(i + B, last_in_time, n_requests)
        full = end - i == B
        closes.append(arrivals[end - 1] if full else min(arrivals[i] + timeout_s, arrivals[-1] if end == n_requests else math.inf))
        starts.append(i)
        i = end
    starts.append(n_requests)
    sizes = np.diff(starts)
    closes = np.asarray(closes)
    durations = rng.choice(service.samples, size=len(sizes), replace=True)
    ends = np.empty(len(sizes))
    waits = np.empty(len(sizes))
    free = 0.0
    for b in range(len(sizes)):  # FIFO single server
        begin = max(closes[b], free)
        waits[b] = begin - closes[b]
        free = ends[b] = begin + durations[b]
    latency = np.repeat(ends, sizes) - arrivals
    makespan = ends[-1] - arrivals[0]
    return {"latency_s": latency, "batch_sizes": sizes, "queue_wait_s": waits,
            "server_busy": float(durations.sum() / makespan)}


def diverging(queue_wait_s: np.ndarray) -> bool:
    """Whether the queue in front of the server grows through the run (an unstable system).

    A stable queue's waits are stationary; an unstable one's grow linearly. We compare the mean
    wait of the last fifth of batches with that of the second fifth (the first is warm-up): growth
    by more than half the mean service scale, and by a factor above 2, means divergence.
    """
    n = len(queue_wait_s)
    if n < 10:
        return False
    early = float(queue_wait_s[n // 5: 2 * n // 5].mean())
    late = float(queue_wait_s[4 * n // 5:].mean())
    return late > 2.0 * early + 1e-9 and late - early > 0.5 * float(np.median(queue_wait_s) + 1e-9)


def study(service: ServiceTimes, rhos=PAPER_RHOS, timeout_s: float = math.inf,
          n_requests: int = 20_000, seed: int = 0) -> list[dict]:
    """One row per utilisation: closed-form ``T_min``, the capped threshold and Monte Carlo percentiles.

    ``rhos`` are utilisations ``ρ = λ S / B``; the row's ``timeout_s`` is the ``T`` simulated.
    """
    S, B = service.mean, service.batch_size
    rows = []
    for rho in rhos:
        if not 0 < rho:
            raise ConfigError(f"`rhos` must be positive, got {rho}")
        rate = rho * B / S
        sim = simulate_batching(service, rate, timeout_s, n_requests, seed)
        lat = sim["latency_s"]
        row = {"rho": float(rho), "rate_rps": rate, "timeout_s": timeout_s,
               "t_min_s": min_timeout(S, rate), "t_min_capped_s": exact_min_timeout(S, rate, B),
               "mean_s": float(lat.mean())}
        row.update({f"p{p}_s": float(np.percentile(lat, p)) for p in PERCENTILES})
        row.update({"max_s": float(lat.max()), "mean_batch": float(sim["batch_sizes"].mean()),
                    "server_busy": sim["server_busy"], "diverging": diverging(sim["queue_wait_s"])})
        rows.append(row)
    return rows


def verdict(service: ServiceTimes, rate: float, timeout_s: float, n_requests: int = 20_000, seed: int = 0) -> dict:
    """Stable or not for a chosen ``T`` at arrival rate ``λ``: the rule, the capped threshold, the Monte Carlo.

    ``stable`` follows the capped threshold (exact for this service model); ``rule_stable`` is
    Amin et al.'s closed form; ``monte_carlo_diverging`` what a run of ``n_requests`` shows.
    """
    S, B = service.mean, service.batch_size
    t_min, t_cap = min_timeout(S, rate), exact_min_timeout(S, rate, B)
    sim = simulate_batching(service, rate, timeout_s, n_requests, seed)
    return {"rate_rps": rate, "rho": rate * S / B, "timeout_s": timeout_s, "t_min_s": t_min, "t_min_capped_s": t_cap,
            "rule_stable": timeout_s >= t_min, "stable": timeout_s >= t_cap,
            "monte_carlo_diverging": diverging(sim["queue_wait_s"]),
            "mean_s": float(sim["latency_s"].mean()), "p99_s": float(np.percentile(sim["latency_s"], 99)),
            "mean_batch": float(sim["batch_sizes"].mean())}


def timeout_study(service: ServiceTimes, rhos=PAPER_RHOS, timeout_s: float | None = None,
                  n_requests: int = 20_000, seed: int = 0) -> list[dict]:
    """What ``dwise-predict batch-timeout`` reports: per ``ρ``, pure fixed fill (``T = ∞``: the
    U-shape) and, when ``timeout_s`` is given, the verdict and Monte Carlo latency at that ``T``."""
    rows = study(service, rhos, math.inf, n_requests, seed)
    if timeout_s is not None:
        for row in rows:
            v = verdict(service, row["rate_rps"], timeout_s, n_requests, seed)
            row.update({"chosen_timeout_s": timeout_s, "rule_stable": v["rule_stable"], "stable": v["stable"],
                        "mc_diverging": v["monte_carlo_diverging"], "mean_at_timeout_s": v["mean_s"],
                        "p99_at_timeout_s": v["p99_s"], "mean_batch_at_timeout": v["mean_batch"]})
    return rows
