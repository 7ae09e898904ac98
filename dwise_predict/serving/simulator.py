"""Round-level discrete-event simulator: replay traces under a scheduling policy.

Each request of a trace dataset brings its prompt blocks ``P``, its true denoising rounds and the
rounds of its first output block. A serving round runs at most ``B`` blocks (one per selected
request: a prompt block or one denoising round) and takes ``round_ms + slot_ms * blocks`` ms. The
policy (:class:`~dwise_predict.serving.policy.DwisePolicy`, the class a server drives) decides
admission and which requests run; the simulator only advances the true state and the clock, so the
simulated policy is the served one, line for line.

Policies (:data:`POLICIES`):

- ``sglang-default``: FCFS admission, prefill-first rounds (SGLang's dLLM scheduler);
- ``fcfs-mixed``: FCFS, prompt and denoising blocks share rounds;
- ``dwise-zero``: remaining-work ranking with ``r̂ = 0`` (prompt blocks only);
- ``dwise-admission``: ``r̂`` from the admission predictor, decremented per round;
- ``dwise-refined``: as above, and ``r̂`` replaced by the refined estimate after the first
  denoising round (the full DWISE);
- ``dwise-oracle``: ``r̂`` = true rounds (the upper bound for any predictor).

Arrivals: ``burst`` (all at t = 0, in a seeded random order) and ``burst-poisson`` (half at t = 0,
the rest a seeded Poisson process of rate ``rate`` req/s), as in seed 000 §6.1, and ``poisson``
(every request from a Poisson process; what the load sweep uses, so latency follows the rate).

Latency is measured in rounds (rounds run between arrival and completion) and in seconds (by the
round-time model); time to first block (TTFB) is when the first output block is complete.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dwise_predict.errors import ConfigError, TraceError
from dwise_predict.features.prompt import FEATURE_NAMES
from dwise_predict.serving.policy import DwisePolicy

# name -> (ranking, prefill_first, estimate source)
POLICIES: dict[str, tuple[str, bool, str]] = {
    "sglang-default": ("arrival", True, "none"),
    "fcfs-mixed": ("arrival", False, "none"),
    "dwise-zero": ("remaining", False, "zero"),
    "dwise-admission": ("remaining", False, "admission"),
    "dwise-refined": ("remaining", False, "refined"),
    "dwise-oracle": ("remaining", False, "oracle"),
}
ARRIVALS = ("burst", "burst-poisson", "poisson")
NEEDS_BUNDLE = {"dwise-admission": ("admission",), "dwise-refined": ("admission", "refined")}


@dataclass(frozen=True)
class SimConfig:
    """Server and arrival settings shared by every policy of one comparison.

    slots : ``B``, blocks per round.
    k : resident-set multiplier (at most ``k * B`` requests hold KV).
    kv_budget : KV pool in blocks (``None``: unlimited). A request reserves its worst case:
        prompt blocks + output blocks of its whole budget + ``kv_slack_blocks``.
    round_ms, slot_ms : a round takes ``round_ms + slot_ms * blocks_in_round`` milliseconds.
    arrival : ``burst``, ``burst-poisson`` or ``poisson``; ``rate`` in req/s for the Poisson part.
    seed : arrival order and times.
    """

    slots: int = 128
    k: float = 8
    kv_budget: float | None = None
    kv_slack_blocks: int = 2
    round_ms: float = 50.0
    slot_ms: float = 0.35
    arrival: str = "burst"
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.slots, (int, np.integer)) or self.slots < 1:
            problems.append(f"--slots (B) must be a positive integer, got {self.slots}")
        if not self.k >= 1:
            problems.append(f"--k must be at least 1, got {self.k}")
        if self.kv_budget is not None and not self.kv_budget > 0:
            problems.append(f"--kv-budget must be positive (blocks), got {self.kv_budget}")
        if self.kv_slack_blocks < 0:
            problems.append(f"--kv-slack must be >= 0, got {self.kv_slack_blocks}")
        if not (self.round_ms >= 0 and self.slot_ms >= 0 and 0 < self.round_ms + self.slot_ms < math.inf):
            problems.append(f"--round-ms and --slot-ms must be >= 0 and not both 0, got {self.round_ms}, {self.slot_ms}")
        if self.arrival not in ARRIVALS:
            problems.append(f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival != "burst" and not (self.rate is not None and self.rate > 0):
            problems.append(f"{self.arrival} arrivals need a positive --rate (req/s), got {self.rate}")
        if problems:
            raise ConfigError("; ".join(problems))

    def round_seconds(self, blocks):
        return (self.round_ms + self.slot_ms * blocks) / 1000.0


@dataclass
class SimRequests:
    """What the simulator replays, one entry per request (arrays of shape (n,)).

    prompt_blocks : ``P``; total_rounds : true denoising rounds (>= 1);
    first_block_rounds : denoising rounds of the first output block (TTFB);
    output_blocks : worst-case output blocks (budget / block size), for KV reservations;
    admission : admission estimates of total rounds, or None;
    refined : refined estimates of remaining rounds after the first denoising round, or None.
    """

    request_ids: np.ndarray
    prompt_blocks: np.ndarray
    total_rounds: np.ndarray
    first_block_rounds: np.ndarray
    output_blocks: np.ndarray
    admission: np.ndarray | None = None
    refined: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if n == 0:
            raise TraceError("the traces hold no requests to simulate (check --split)")
        for name in ("prompt_blocks", "total_rounds", "first_block_rounds", "output_blocks"):
            arr = np.asarray(getattr(self, name))
            if arr.shape != (n,) or not np.isfinite(arr).all():
                raise TraceError(f"workload '{name}' must be {n} finite numbers")
            setattr(self, name, arr.astype(np.int64))
        if (self.prompt_blocks < 0).any():
            raise TraceError("prompt_blocks holds negative values: the traces are corrupt")
        if (self.total_rounds < 1).any():
            raise TraceError("total_rounds must be >= 1 for every request (each needs a first denoising round)")
        self.first_block_rounds = np.clip(self.first_block_rounds, 1, self.total_rounds)

    def __len__(self) -> int:
        return len(self.request_ids)

    def estimates(self, source: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(r̂ at admission, refined remaining or None) for an estimate source of :data:`POLICIES`."""
        n = len(self)
        if source in ("none", "zero"):
            return np.zeros(n), None
        if source == "oracle":
            return self.total_rounds.astype(np.float64), (self.total_rounds - 1).astype(np.float64)
        if self.admission is None:
            raise ConfigError(f"policy dwise-{source} needs admission estimates: pass --bundle")
        if source == "admission":
            return np.asarray(self.admission, dtype=np.float64), None
        if self.refined is None:
            raise ConfigError("policy dwise-refined needs refined estimates: pass --bundle")
        return np.asarray(self.admission, dtype=np.float64), np.asarray(self.refined, dtype=np.float64)


def sim_requests_from_traces(ds, split: str | None = "eval", bundle=None) -> SimRequests:
    """Build a :class:`SimRequests` from a trace dataset (contract 1), with predictions from a bundle.

    Parameters
    ----------
    ds : TraceDataset.
    split : ``"eval"`` (default), ``"train"`` or None for every request.
    bundle : a :class:`~dwise_predict.serving.bundle.LoadedBundle` or None. Admission estimates
        come from its admission graph on the traces' (words, newlines, prompt_tokens); refined ones
        from its refinement graph on ``first_round`` hidden states, prompt tokens and budget.
    """
    req = ds.requests
    if "prompt_blocks" not in req.columns:
        raise TraceError(
            "traces have no prompt_blocks column: the simulator replays prompt blocks; re-collect the "
            "traces or add prompt_blocks = prompt_tokens // block_size"
        )
    if split is not None:
        mask = req["split"].to_numpy() == split
        if not mask.any():
            raise TraceError(f"the traces have no '{split}' requests: pick another --split (train, eval or all)")
        ds = ds.subset(mask)
        req = ds.requests
    total = req["total_rounds"].to_numpy(dtype=np.int64)
    if "rounds_per_block" in req.columns:
        first = np.array([(list(r)[0] if len(r) else t) for r, t in zip(req["rounds_per_block"], total)], dtype=np.int64)
    else:
        first = total.copy()
    output_blocks = -(-req["budget"].to_numpy(dtype=np.int64) // req["block_size"].to_numpy(dtype=np.int64))
    admission = refined = None
    if bundle is not None:
        features = req[list(FEATURE_NAMES)].to_numpy(dtype=np.float32)
        admission = np.maximum(bundle.admission(features).astype(np.float64), 0.0)
        refined = np.maximum(
            np.asarray(bundle.refine(ds.first_round, req["prompt_tokens"].to_numpy(np.float32),
                                     req["budget"].to_numpy(np.float32)), dtype=np.float64), 0.0)
    return SimRequests(
        request_ids=req["request_id"].to_numpy(),
        prompt_blocks=req["prompt_blocks"].to_numpy(),
        total_rounds=total,
        first_block_rounds=first,
        output_blocks=output_blocks,
        admission=admission,
        refined=refined,
    )


def make_arrivals(n: int, config: SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """Seeded arrival order and times.

    Returns
    -------
    order : int64 (n,), request indices in arrival order.
    times : float64 (n,), arrival time in seconds of the request at each position (non-decreasing).
    """
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(n)
    times = np.zeros(n)
    if config.arrival != "burst":
        first = n // 2 + n % 2 if config.arrival == "burst-poisson" else 1  # at t = 0: half, or the first
        times[first:] = np.cumsum(rng.exponential(1.0 / config.rate, n - first))
    return order, times


@dataclass
class SimResult:
    """One policy's run: summary metrics plus per-request arrays (index = workload row)."""

    policy: str
    metrics: dict
    latency_rounds: np.ndarray
    latency_s: np.ndarray
    ttfb_rounds: np.ndarray
    ttfb_s: np.ndarray
    completion_round: np.ndarray
    run_log: list | None = field(default=None, repr=False)


def simulate(
    workload: SimRequests, policy: str, config: SimConfig, arrivals=None, record: bool = False, fast_forward: bool = True
) -> SimResult:
    """Replay ``workload`` under one policy.

    Parameters
    ----------
    arrivals : (order, times) from :func:`make_arrivals` (default: made from ``config``), so every
        policy of a comparison sees the identical arrival trace.
    record : keep the request ids run in each round (``run_log``) for inspection and tests.
    fast_forward : run a plan several rounds at once while it provably stays the same (see
        :func:`_steady_rounds`); results in rounds are identical either way (a test checks it).
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    ranking, prefill_first, source = POLICIES[policy]
    estimate, refined = workload.estimates(source)
    n = len(workload)
    kv = kv_reservations(workload, config)
    order, times = make_arrivals(n, config) if arrivals is None else arrivals
    pol = DwisePolicy(config.slots, config.k, config.kv_budget, ranking=ranking, prefill_first=prefill_first)

    total, first_block = workload.total_rounds, workload.first_block_rounds
    req_of_slot = np.full(n + 1, -1, dtype=np.int64)
    done_rounds = np.zeros(n, dtype=np.int64)
    arrive_round = np.zeros(n, dtype=np.int64)
    arrive_s = np.zeros(n)
    finish_round = np.zeros(n, dtype=np.int64)
    finish_s = np.zeros(n)
    ttfb_round = np.zeros(n, dtype=np.int64)
    ttfb_s = np.zeros(n)
    clock, rounds, ptr, n_done = 0.0, 0, 0, 0
    used_slots = prefill_only = preemptions = 0
    log = [] if record else None

    while n_done < n:
        if ptr < n and times[ptr] <= clock:
            end = int(np.searchsorted(times, clock, side="right"))
            new = order[ptr:end]
            slots = pol.add_many(new, workload.prompt_blocks[new], estimate[new], kv[new])
            if len(req_of_slot) <= slots.max():
                req_of_slot = np.concatenate([req_of_slot, np.full(len(req_of_slot), -1, dtype=np.int64)])
            req_of_slot[slots] = new
            arrive_round[new], arrive_s[new] = rounds, times[ptr:end]
            ptr = end
        if pol.n_resident == 0 and pol.n_waiting == 0:
            clock = float(times[ptr])  # idle server: jump to the next arrival
            continue
        plan = pol.schedule()
        run = req_of_slot[plan.run]
        n_run = len(run)
        dn_pos = np.flatnonzero(~plan.prompt)
        dn = run[dn_pos]
        dt = config.round_seconds(n_run)
        repeat = 1
        if fast_forward and not record and len(plan.admitted) == 0:
            next_arrival = float(times[ptr]) if ptr < n else math.inf
            repeat = _steady_rounds(pol, plan, done_rounds[dn], total[dn], first_block[dn], next_arrival - clock, dt)
        done_rounds[dn] += repeat
        clock += dt * repeat
        rounds += repeat
        used_slots += n_run * repeat
        prefill_only += repeat * (len(dn) == 0)
        preemptions += len(plan.preempted)
        first_hit = dn[done_rounds[dn] == first_block[dn]]
        ttfb_round[first_hit], ttfb_s[first_hit] = rounds, clock
        finished = np.zeros(n_run, dtype=bool)
        finished[dn_pos] = done_rounds[dn] >= total[dn]
        refined_now = None
        if refined is not None:
            refined_now = np.full(n_run, np.nan)
            refined_now[dn_pos] = refined[dn]  # the policy uses it only on the first denoising round
        pol.complete_round(plan, finished, refined_now, repeat)
        fin = run[finished]
        finish_round[fin], finish_s[fin] = rounds, clock
        n_done += len(fin)
        if record:
            log.append((workload.request_ids[run].tolist(), plan.prompt.tolist()))

    latency_rounds = finish_round - arrive_round
    latency_s = finish_s - arrive_s
    ttfb_r = ttfb_round - arrive_round
    ttfb_sec = ttfb_s - arrive_s
    makespan = max(clock - float(times[0]), 1e-12)
    metrics = {
        "policy": policy,
        "requests": n,
        "rounds": rounds,
        "mean_latency_rounds": float(latency_rounds.mean()),
        "p50_latency_rounds": float(np.percentile(latency_rounds, 50)),
        "p99_latency_rounds": float(np.percentile(latency_rounds, 99)),
        "mean_latency_s": float(latency_s.mean()),
        "p50_latency_s": float(np.percentile(latency_s, 50)),
        "p99_latency_s": float(np.percentile(latency_s, 99)),
        "mean_ttfb_rounds": float(ttfb_r.mean()),
        "p50_ttfb_rounds": float(np.percentile(ttfb_r, 50)),
        "p99_ttfb_rounds": float(np.percentile(ttfb_r, 99)),
        "mean_ttfb_s": float(ttfb_sec.mean()),
        "p50_ttfb_s": float(np.percentile(ttfb_sec, 50)),
        "p99_ttfb_s": float(np.percentile(ttfb_sec, 99)),
        "throughput_rps": n / makespan,
        "throughput_per_round": n / max(rounds, 1),
        "makespan_s": makespan,
        "prefill_only_rounds_pct": 100.0 * prefill_only / max(rounds, 1),
        "idle_slots_pct": 100.0 * (1.0 - used_slots / max(rounds * config.slots, 1)),
        "preemptions_per_request": preemptions / n,
    }
    return SimResult(policy, metrics, latency_rounds, latency_s, ttfb_r, ttfb_sec, finish_round, log)


def kv_reservations(workload: SimRequests, config: SimConfig) -> np.ndarray:
    """Worst-case KV blocks of each request (prompt + whole output budget + slack).

    Raises
    ------
    ConfigError
        The KV budget cannot hold the largest request on its own (it could never be admitted).
    """
    kv = (workload.prompt_blocks + workload.output_blocks + config.kv_slack_blocks).astype(np.float64)
    if config.kv_budget is not None and kv.max() > config.kv_budget:
        worst = int(np.argmax(kv))
        raise ConfigError(
            f"--kv-budget {config.kv_budget:g} blocks cannot hold request {workload.request_ids[worst]} "
            f"(worst case {kv[worst]:g} blocks = prompt + budget + slack): raise --kv-budget to at least {kv.max():g}"
        )
    return kv


def _steady_rounds(pol: DwisePolicy, plan, done, total, first_block, until_arrival: float, dt: float) -> int:
    """How many rounds in a row ``plan`` provably repeats unchanged (at least 1).

    Between events the same requests keep running: runners' keys only fall (``P`` or ``r̂`` drop
    by one per round, or ``r̂`` stays at 0) while paused and waiting keys stay fixed, so no paused
    request overtakes a runner and the top-B cut-off only falls (no new admission). The plan
    changes at the first event: a prompt runner reaching ``P = 0`` (phase change), a first
    denoising round (refinement), a first output block or a request finishing, or an arrival.
    The caller skips this when the round admitted anyone.
    """
    if len(done) and (done == 0).any():
        return 1
    steps = []
    prompt_P = pol._P[plan.run[plan.prompt]]
    if len(prompt_P):
        steps.append(int(prompt_P.min()))
    if len(done):
        steps.append(int((total - done).min()))
        before_first = first_block - done
        before_first = before_first[before_first > 0]
        if len(before_first):
            steps.append(int(before_first.min()))
    if math.isfinite(until_arrival):
        # round j of the span starts at clock + j * dt and must start before the next arrival
        steps.append(max(1, math.ceil(until_arrival / dt) - 1))
    return max(1, min(steps)) if steps else 1


def available_policies(workload: SimRequests) -> list[str]:
    """Policies the workload's predictions allow (all, or those needing no bundle)."""
    have = {"admission": workload.admission is not None, "refined": workload.refined is not None}
    return [p for p in POLICIES if all(have[s] for s in NEEDS_BUNDLE.get(p, ()))]


def compare(workload: SimRequests, config: SimConfig, policies: list[str] | None = None) -> list[SimResult]:
    """Run several policies on the identical arrival trace."""
    policies = policies or available_policies(workload)
    arrivals = make_arrivals(len(workload), config)
    return [simulate(workload, p, config, arrivals) for p in policies]


def compare_arrivals(
    workload: SimRequests, config: SimConfig, patterns: list[str], rate: str = "1.5x", policies: list[str] | None = None
) -> list[dict]:
    """Compare policies under each arrival pattern; one metrics row per (pattern, policy).

    ``rate`` is the Poisson rate of the non-burst patterns: req/s, or a multiple of SGLang-default's
    service rate such as ``1.5x``. Rows carry ``arrival``, ``rate_rps``, the policy's metrics and
    ``speedup_vs_default`` (SGLang-default's mean latency over the row's, per pattern).
    """
    poisson_rate = parse_rates(rate, workload, config)[0]
    rows = []
    for pattern in patterns:
        cfg = replace(config, arrival=pattern, rate=None if pattern == "burst" else poisson_rate)
        for result in compare(workload, cfg, policies):
            rows.append({"arrival": pattern, "rate_rps": cfg.rate, **result.metrics})
    add_speedups(rows, "arrival")
    return rows


def add_speedups(rows: list[dict], group_key: str) -> None:
    """Add ``speedup_vs_default``: sglang-default's mean latency over each row's, per group."""
    base = {r[group_key]: r["mean_latency_s"] for r in rows if r["policy"] == "sglang-default"}
    for r in rows:
        ref = base.get(r[group_key])
        r["speedup_vs_default"] = ref / r["mean_latency_s"] if ref and r["mean_latency_s"] > 0 else float("nan")


def service_rate(workload: SimRequests, config: SimConfig) -> float:
    """SGLang's default policy's service rate on this workload, req/s: its throughput when backlogged.

    Measured by simulating ``sglang-default`` under burst arrivals with ``config``'s server settings.
    ``--rate`` / ``--rates`` multiples (``2x``) are relative to it: below ``1x`` the default keeps up
    and ranking has little to reorder; above it the queue grows and ranking pays (seed 000 Fig. 9).
    """
    backlogged = replace(config, arrival="burst", rate=None)
    return simulate(workload, "sglang-default", backlogged).metrics["throughput_rps"]


def parse_rates(text: str, workload: SimRequests, config: SimConfig) -> list[float]:
    """``"1,2,4"`` (req/s) or ``"0.5x,1x,2x"`` (multiples of :func:`service_rate`) -> req/s."""
    rates = []
    unit = None
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise ConfigError(f"--rates {text!r} has an empty item: give e.g. 0.5x,1x,2x or 4,8,16")
        try:
            if item.endswith("x"):
                factor = float(item[:-1])
                unit = service_rate(workload, config) if unit is None else unit
                value = factor * unit
            else:
                value = float(item)
        except ValueError:
            raise ConfigError(f"--rates item {item!r} is not a number or a multiple like 2x") from None
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"--rates item {item!r} must be positive")
        rates.append(value)
    if not rates:
        raise ConfigError("--rates is empty: give e.g. 0.5x,1x,2x or 4,8,16")
    return rates


def sweep(workload: SimRequests, config: SimConfig, rates: list[float], policies: list[str] | None = None) -> list[dict]:
    """Every policy at each Poisson arrival rate (``poisson`` arrivals; seed 000 Figure 9)."""
    rows = []
    for rate in rates:
        cfg = replace(config, arrival="poisson", rate=rate)
        for result in compare(workload, cfg, policies):
            rows.append({"rate_rps": rate, **result.metrics})
    add_speedups(rows, "rate_rps")
    return rows


def replay(
    requests: SimRequests,
    config: SimConfig,
    policies: list[str] | None = None,
    patterns: list[str] | None = None,
    rate: str | None = None,
    rates: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[list[dict], list[str]]:
    """What ``simulate`` runs: a load sweep over ``rates`` when given, else every arrival pattern of
    ``patterns`` (default burst and burst-poisson at ``rate``, default ``1.5x``).

    Returns the metric rows and the policies compared (default: all the predictions allow).

    Raises
    ------
    ConfigError
        A policy needs predictions the requests lack, or the KV budget cannot hold one request
        (checked before any work).
    """
    allowed = available_policies(requests)
    missing = [p for p in policies or [] if p not in allowed]
    if missing:
        raise ConfigError(f"--policies {', '.join(missing)} need predictions: pass --bundle")
    policies = policies or allowed
    kv_reservations(requests, config)
    swept = parse_rates(rates, requests, config) if rates else None  # a bad --rates is refused before any output
    if log is not None:
        log(f"replaying {len(requests)} requests under {len(policies)} policies")
    if swept is not None:
        return sweep(requests, config, swept, policies), policies
    return compare_arrivals(requests, config, patterns or ["burst", "burst-poisson"], rate or "1.5x", policies), policies
