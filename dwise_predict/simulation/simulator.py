"""Round-level discrete-event simulator: replay traces under a scheduling policy.

Each request of a trace dataset brings its prompt blocks ``P``, its true denoising rounds and the
rounds of its first output block. A serving round runs at most ``B`` blocks (one per selected
request: a prompt block or one denoising round) and takes ``round_ms + slot_ms * blocks`` ms. The
policy (:class:`~dwise_predict.serving.policy.DwisePolicy`, the class a server drives) decides
admission and which requests run; the simulator only advances the true state and the clock, so the
simulated policy is the served one, line for line. (Where every resident request runs and nobody
waits, the rounds up to the next arrival are run without asking it each round, since its plans can
only hold those requests, and it is told what ran at the end.)

Schedulers (:data:`POLICIES`, the registry of :mod:`~dwise_predict.simulation.schedulers`), among
them SGLang's default (FDFO, ``--dllm-fdfo``) and its synchronous loop (``sglang-sync``,
``--no-dllm-fdfo``), FCFS-mixed, MLFQ, SSJF, S³, LTR, TRAIL and the DWISE variants (``r̂ = 0``,
admission, raw and calibrated refinement, oracle), each a configuration of the one policy class.

Round time comes from a :class:`~dwise_predict.simulation.round_cost.RoundCost`: a model fitted to a
measured profile (``--round-profile``), or the flat ``round_ms + slot_ms * blocks`` of the flags.
Its ``source`` is recorded with every result.

Arrivals: ``burst`` (all at t = 0, in a seeded random order) and ``burst-poisson`` (half at t = 0,
the rest a seeded Poisson process of rate ``rate`` req/s), as in the DWISE paper's §6.1, and ``poisson``
(every request from a Poisson process; what the load sweep uses, so latency follows the rate).

Latency is measured in rounds (rounds run between arrival and completion) and in seconds (by the
round-time model); time to first block (TTFB) is when the first output block is complete.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dwise_predict.engine import block_layout
from dwise_predict.errors import ConfigError, TraceError
from dwise_predict.features.prompt import FEATURE_NAMES
from dwise_predict.metrics import bootstrap_mean_ci
from dwise_predict.serving.policy import MAX_WAIT, DwisePolicy
from dwise_predict.simulation.round_cost import RoundCost, flat_round_cost
from dwise_predict.simulation.schedulers import (
    ALL_SCHEDULERS,
    FORMER_STEPS,
    GAIN_STEPS,
    NEEDS,
    SCHEDULERS,
    bucket,
    make_policy,
    on_batch_former,
)

POLICIES = ALL_SCHEDULERS  # name -> SchedulerSpec: the registry and its baselines' prefill-first twins
ARRIVALS = ("burst", "burst-poisson", "poisson")
NEEDS_BUNDLE = {name: NEEDS[spec.estimate] for name, spec in POLICIES.items() if NEEDS[spec.estimate]}


@dataclass(frozen=True)
class SimConfig:
    """Server and arrival settings shared by every policy of one comparison.

    slots : ``B``, blocks per round.
    k : resident-set multiplier (at most ``k * B`` requests hold KV).
    kv_budget : KV pool in blocks (``None``: unlimited). A request reserves its worst case:
        prompt blocks + output blocks of its whole budget + ``kv_slack_blocks``.
    round_ms, slot_ms : without ``round_cost``, a round takes ``round_ms + slot_ms * blocks`` ms.
    round_cost : the fitted round-time model (:mod:`~dwise_predict.simulation.round_cost`); it wins
        over ``round_ms`` / ``slot_ms``.
    arrival : ``burst``, ``burst-poisson`` or ``poisson``; ``rate`` in req/s for the Poisson part.
    seed : arrival order and times.
    aging : the DWISE schedulers' starvation guard (``DwisePolicy(aging=)``; 0: Algorithm 1 as published).
    max_wait : the DWISE schedulers' wait cap in rounds (``DwisePolicy(max_wait=)``; None: off). Its
        default never acts on a load the server keeps up with (docs/serving.md, "Starvation guard").
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
    round_cost: RoundCost | None = None
    aging: float = 0.0
    max_wait: int | None = MAX_WAIT

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.slots, (int, np.integer)) or self.slots < 1:
            problems.append(f"`slots` (B) must be a positive integer, got {self.slots}")
        if not self.k >= 1:
            problems.append(f"`k` must be at least 1, got {self.k}")
        if self.kv_budget is not None and not self.kv_budget > 0:
            problems.append(f"`kv_budget` must be positive (blocks), got {self.kv_budget}")
        if self.kv_slack_blocks < 0:
            problems.append(f"`kv_slack_blocks` must be >= 0, got {self.kv_slack_blocks}")
        if not (self.round_ms >= 0 and self.slot_ms >= 0 and 0 < self.round_ms + self.slot_ms < math.inf):
            problems.append(f"`round_ms` and `slot_ms` must be >= 0 and not both 0, got {self.round_ms}, {self.slot_ms}")
        if self.arrival not in ARRIVALS:
            problems.append(f"`arrival` must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival != "burst" and not (self.rate is not None and self.rate > 0):
            problems.append(f"{self.arrival} arrivals need a positive `rate` (req/s), got {self.rate}")
        if not (self.aging >= 0 and math.isfinite(self.aging)):
            problems.append(f"`aging` must be a finite number >= 0 (0: off), got {self.aging}")
        if self.max_wait is not None and not (isinstance(self.max_wait, (int, np.integer)) and self.max_wait >= 0):
            problems.append(f"`max_wait` must be a whole number of rounds >= 0, got {self.max_wait}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def cost(self) -> RoundCost:
        """The round-time model in force (the fitted one, else the flat one of the flags)."""
        return self.round_cost if self.round_cost is not None else flat_round_cost(self.round_ms, self.slot_ms)

    def round_seconds(self, blocks):
        """Seconds of a round of ``blocks`` rows under the flat model (``round_ms + slot_ms * blocks``)."""
        return (self.round_ms + self.slot_ms * blocks) / 1000.0


@dataclass
class SimRequests:
    """What the simulator replays, one entry per request (arrays of shape (n,)).

    prompt_blocks : ``P``; total_rounds : true denoising rounds (>= 1);
    first_block_rounds : denoising rounds of the first output block (TTFB);
    output_blocks : worst-case output blocks (budget / block size), for KV reservations;
    admission : admission estimates of total rounds, or None;
    refined : refined estimates of remaining rounds after the first denoising round, or None.
    probe : the TRAIL-style probe's estimates of the same (``trail``), or None.
    raw_refined : the refinement before its isotonic calibration (``dwise-raw``), or None.
    block_rounds : object array (n,) of int arrays, rounds of each output block (``sglang-sync``), or None.
    categories : request family of each request (per-category tails), or None.
    round_refined : (n, N) calibrated refinement of the remaining rounds from the state of each of the
        first ``N`` denoising rounds (column k - 1: after round k; NaN where the request has no such
        round), for ``simulate --refine-every`` (:mod:`~dwise_predict.simulation.refine_every`), or None.
    """

    request_ids: np.ndarray
    prompt_blocks: np.ndarray
    total_rounds: np.ndarray
    first_block_rounds: np.ndarray
    output_blocks: np.ndarray
    admission: np.ndarray | None = None
    refined: np.ndarray | None = None
    probe: np.ndarray | None = None
    categories: np.ndarray | None = None
    raw_refined: np.ndarray | None = None
    block_rounds: np.ndarray | None = None
    round_refined: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if n == 0:
            raise TraceError("the traces hold no requests to simulate (check `split`)")
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
        """(r̂ at admission, refined remaining or None) for an estimate source of a scheduler."""
        n = len(self)
        if source in ("none", "zero"):
            return np.zeros(n), None
        if source == "oracle":
            return self.total_rounds.astype(np.float64), (self.total_rounds - 1).astype(np.float64)
        if source == "probe":
            if self.probe is None:
                raise ConfigError("scheduler trail needs the TRAIL-style probe's estimates: pass `bundle` with traces holding a train split")
            start = np.zeros(n) if self.admission is None else np.asarray(self.admission, dtype=np.float64)
            return start, np.asarray(self.probe, dtype=np.float64)
        if self.admission is None:
            raise ConfigError(f"policy dwise-{source} needs admission estimates: pass `bundle`")
        if source == "raw":
            if self.raw_refined is None:
                raise ConfigError("policy dwise-raw needs raw refinement estimates: pass `bundle`")
            return np.asarray(self.admission, dtype=np.float64), np.asarray(self.raw_refined, dtype=np.float64)
        if source == "admission":
            return np.asarray(self.admission, dtype=np.float64), None
        if self.refined is None:
            raise ConfigError("policy dwise-refined needs refined estimates: pass `bundle`")
        return np.asarray(self.admission, dtype=np.float64), np.asarray(self.refined, dtype=np.float64)

    def draw(self, n: int, seed: int = 0) -> "SimRequests":
        """``n`` requests drawn with replacement (seeded), ids suffixed ``#k`` to stay unique.

        The DWISE paper replays 4,096 requests; a collection of a few hundred is resampled to that scale.
        """
        if n < 1:
            raise ConfigError(f"`requests` must be positive, got {n}")
        idx = np.random.default_rng(seed).choice(len(self), size=n, replace=True)
        pick = lambda a: None if a is None else np.asarray(a)[idx]  # noqa: E731
        ids = np.array([f"{self.request_ids[i]}#{k}" for k, i in enumerate(idx.tolist())])
        return SimRequests(ids, self.prompt_blocks[idx], self.total_rounds[idx], self.first_block_rounds[idx],
                           self.output_blocks[idx], pick(self.admission), pick(self.refined), pick(self.probe),
                           pick(self.categories), pick(self.raw_refined), pick(self.block_rounds),
                           pick(self.round_refined))


def sim_requests_from_traces(ds, split: str | None = "eval", bundle=None) -> SimRequests:
    """Build a :class:`SimRequests` from a trace dataset (contract 1), with predictions from a bundle.

    Parameters
    ----------
    ds : TraceDataset.
    split : ``"eval"`` (default), ``"train"`` or None for every request.
    bundle : a :class:`~dwise_predict.bundles.load.LoadedBundle` or None. Admission estimates
        come from its admission graph on the traces' (words, newlines, prompt_tokens); refined ones
        from its refinement graph on the ``first_round`` and ``prompt_last`` hidden states, prompt tokens and budget.
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
            raise TraceError(f"the traces have no '{split}' requests: pick another `split` (train, eval or all)")
        ds = ds.subset(mask)
        req = ds.requests
    total = req["total_rounds"].to_numpy(dtype=np.int64)
    if "rounds_per_block" in req.columns:
        first = np.array([(list(r)[0] if len(r) else t) for r, t in zip(req["rounds_per_block"], total)], dtype=np.int64)
    else:
        first = total.copy()
    # worst-case output blocks by the engine's layout (the first one opens with the leftover prompt)
    output_blocks = np.array([block_layout(max(int(n), 1), int(b)).max_output_blocks(int(budget)) for n, b, budget
                              in zip(req["prompt_tokens"], req["block_size"], req["budget"])], dtype=np.int64)
    admission = refined = raw = None
    if bundle is not None:
        features = req[list(FEATURE_NAMES)].to_numpy(dtype=np.float32)
        admission = np.maximum(bundle.admission(features).astype(np.float64), 0.0)
        inputs = (ds.first_round, ds.prompt_last, req["prompt_tokens"].to_numpy(np.float32), req["budget"].to_numpy(np.float32),
                  ds.early_signals)
        refined = np.maximum(np.asarray(bundle.refine(*inputs), dtype=np.float64), 0.0)
        if hasattr(bundle, "refine_raw"):  # the same ensemble before calibration (the DWISE paper's Table 5)
            raw = np.maximum(np.asarray(bundle.refine_raw(*inputs), dtype=np.float64), 0.0)
    return SimRequests(
        request_ids=req["request_id"].to_numpy(),
        prompt_blocks=req["prompt_blocks"].to_numpy(),
        total_rounds=total,
        first_block_rounds=first,
        output_blocks=output_blocks,
        admission=admission,
        refined=refined,
        raw_refined=raw,
        block_rounds=_block_rounds(req),
        categories=req["category"].to_numpy() if "category" in req.columns else None,
    )


def _block_rounds(req) -> np.ndarray | None:
    """Rounds of each output block per request (object array of int64 arrays), or None without the column."""
    if "rounds_per_block" not in req.columns:
        return None
    out = np.empty(len(req), dtype=object)
    for i, (r, total) in enumerate(zip(req["rounds_per_block"], req["total_rounds"])):
        arr = np.asarray(list(r), dtype=np.int64)
        out[i] = arr if len(arr) else np.array([max(int(total), 1)], dtype=np.int64)
    return out


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
    workload: SimRequests, policy: str, config: SimConfig, arrivals=None, record: bool = False, fast_forward: bool = True,
    refine_every: float | None = None,
) -> SimResult:
    """Replay ``workload`` under one policy.

    Parameters
    ----------
    arrivals : (order, times) from :func:`make_arrivals` (default: made from ``config``), so every
        policy of a comparison sees the identical arrival trace.
    record : keep the request ids run in each round (``run_log``) for inspection and tests.
    fast_forward : run a plan several rounds at once while it provably stays the same (see
        :func:`_steady_rounds`), and where every resident runs and nobody waits, the rounds up to the
        next arrival without asking the policy each round (``_RoundLoop._run_span``: the same groups
        of rounds, so the same results); results in rounds are identical either way (a test checks it).
    refine_every : ``n``: besides the first denoising round, re-estimate ``r̂`` after rounds
        ``1 + n, 1 + 2n, …`` while the workload's ``round_refined`` has them (the DWISE paper's Table 6; ``inf``:
        once, as without it); the metrics then also count the refinements. Only for ``dwise-refined``.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    spec = POLICIES[policy]
    if spec.sync:
        return _simulate_sync(workload, policy, config, arrivals)
    estimate, refined = workload.estimates(spec.estimate)
    later = None if refine_every is None else later_refinements(workload, spec, refine_every)
    kv, estimate = _reservations_and_keys(workload, spec, config, estimate)
    n = len(workload)
    order, times = make_arrivals(n, config) if arrivals is None else arrivals
    pol = make_policy(spec, config.slots, config.k, config.kv_budget, config.aging, config.max_wait)
    loop = _RoundLoop(workload, pol, config.cost, estimate, refined, kv, later, record,
                      spans=later is None and spec.ranking != "mlfq" and not spec.prefill_first)
    ptr, next_arrival = 0, float(times[0]) if n else math.inf
    while loop.n_done < n:
        if next_arrival <= loop.clock:  # the check admit makes first, without its call on most rounds
            ptr = loop.admit(order, times, ptr)
            next_arrival = float(times[ptr]) if ptr < n else math.inf
        if pol.n_resident == 0 and pol.n_waiting == 0:
            loop.clock = float(times[ptr])  # idle server: jump to the next arrival
            continue
        loop.run_round(next_arrival, fast_forward and not record)
    counters = {**loop.counters(), "rhat_zero_pct": rhat_zero_share(spec, estimate, refined, workload.total_rounds, later)}
    result = _result(policy, config, config.cost, times, loop.arrive_round, loop.arrive_s, loop.finish_round,
                     loop.finish_s, loop.ttfb_round, loop.ttfb_s, counters, loop.log)
    if later is not None:
        result.metrics.update(refine_every=refine_every if math.isfinite(refine_every) else None,
                              refine_rounds=[1, *later.rounds.tolist()], refinements_per_request=loop.refinements / n,
                              refining_rounds_pct=100.0 * loop.refining_rounds / max(loop.rounds, 1),
                              mean_refine_batch=loop.refinements / max(loop.refining_rounds, 1))
    return result


def _reservations_and_keys(workload: SimRequests, spec, config: SimConfig,
                           estimate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each request's KV reservation and the estimate the policy ranks it by: S³ reserves the
    predicted output rounded up to its bucket (not the budget), and ranks by the bucket."""
    kv = kv_reservations(workload, config)
    if spec.kv == "bucket":
        kv = np.minimum(kv, workload.prompt_blocks + np.minimum(bucket(estimate), workload.output_blocks)
                        + config.kv_slack_blocks)
    if spec.bucket_key:
        estimate = bucket(estimate)
    return kv, estimate


class _RoundLoop:
    """One replay of :func:`simulate` under way: what the policy does not see (each request's
    denoising rounds done, the request each policy slot holds), the clock, each request's arrival,
    first-block and finish stamps (rounds and seconds) and the run's counters."""

    def __init__(self, workload: SimRequests, pol: DwisePolicy, cost: RoundCost, estimate: np.ndarray,
                 refined: np.ndarray | None, kv: np.ndarray, later: LaterRefinements | None, record: bool,
                 spans: bool = False):
        n = len(workload)
        # whether rounds where every resident runs may go without asking the policy (:meth:`_run_span`):
        # not with later refinements (they act mid-span), nor under MLFQ (its steady limit reads the
        # runners' progress, which the policy learns only at a span's end), nor with the prefill-first
        # barrier (it holds back the runners whose prompt is done while another's is not)
        self.spans = spans
        self.workload, self.pol, self.cost, self.later = workload, pol, cost, later
        self.round_s: dict[tuple[int, int], float] = {}  # (prompt rows, denoising rows) -> round seconds
        self.total_rounds, self.first_block_rounds = workload.total_rounds, workload.first_block_rounds
        # the denoising rounds done at which each request's next stamp falls: its first output block,
        # then (once that is stamped) its last round
        self.next_stamp = workload.first_block_rounds.copy()
        self.estimate, self.refined, self.kv = estimate, refined, kv
        self.steady_limit = getattr(pol, "steady_limit", None)
        self.req_of_slot = np.full(n + 1, -1, dtype=np.int64)
        self.done_rounds = np.zeros(n, dtype=np.int64)
        self.arrive_round, self.arrive_s = np.zeros(n, dtype=np.int64), np.zeros(n)
        self.finish_round, self.finish_s = np.zeros(n, dtype=np.int64), np.zeros(n)
        self.ttfb_round, self.ttfb_s = np.zeros(n, dtype=np.int64), np.zeros(n)
        self.clock, self.rounds, self.n_done = 0.0, 0, 0
        self.used_slots = self.prefill_only = self.preemptions = self.cap_blocked = 0
        self.prefill_only_s = 0.0
        self.refinements = self.refining_rounds = 0
        self.log = [] if record else None  # the request ids run in each round, and which ran a prompt block

    def admit(self, order: np.ndarray, times: np.ndarray, ptr: int) -> int:
        """Hand the policy every request arrived by now, from position ``ptr`` of the arrival order;
        returns the position of the next arrival."""
        if ptr >= len(order) or times[ptr] > self.clock:
            return ptr
        end = int(times.searchsorted(self.clock, side="right"))  # the method: np.searchsorted wraps it in Python
        new = order[ptr:end]
        slots = self.pol.add_many(new, self.workload.prompt_blocks[new], self.estimate[new], self.kv[new])
        if len(self.req_of_slot) <= slots[slots.argmax()]:  # argmax: cheaper than a ufunc reduction
            self.req_of_slot = np.concatenate([self.req_of_slot, np.full(len(self.req_of_slot), -1, dtype=np.int64)])
        self.req_of_slot[slots] = new
        self.arrive_round[new], self.arrive_s[new] = self.rounds, times[ptr:end]
        return end

    def run_round(self, next_arrival: float, fast_forward: bool) -> None:
        """Run the policy's next plan: one round, or with ``fast_forward`` as many as it provably
        stays the same (:func:`_steady_rounds`; never a round that admits), or where every resident
        runs and nobody waits, every round up to the next arrival (:meth:`_run_span`)."""
        # a replay runs ~10^5 rounds: each is a handful of C-level array calls over the <= B runners,
        # the rare stamps (a first output block, a finish) apart
        plan = self.pol.schedule()
        self.preemptions += len(plan.preempted)
        if fast_forward and self.spans and len(plan.paused) == 0 and self.pol.n_waiting == 0:
            self._run_span(plan, next_arrival)
            return
        steady = fast_forward and len(plan.admitted) == 0
        run = self.req_of_slot[plan.run]
        denoise = ~plan.prompt
        dn = run[denoise]
        done = self.done_rounds[dn]
        # rounds from each denoising runner to its next stamp, and the nearest: a plan repeats only up
        # to it, and the round reaching it stamps (one lookup answers both)
        to_stamp = self.next_stamp[dn] - done
        nearest = _least(to_stamp) if len(dn) else math.inf
        # a runner's first denoising round: its refinement is due (count_nonzero: the cheapest numpy call)
        starting = np.count_nonzero(done) < len(done)
        dt = self._round_seconds(len(run) - len(dn), len(dn))
        repeat = 1
        if steady:
            repeat = self._repeat(plan, len(run), len(dn), nearest, starting, dt, next_arrival,
                                  lambda: _least(self.pol.prompt_blocks(plan.run[plan.prompt])),
                                  None if self.later is None else self.later.gaps(done))
        done += repeat  # a copy (gathered): the rounds done after this plan
        self.done_rounds[dn] = done
        self._count(len(run), len(dn), dt, repeat)
        finished = self._stamp(dn, done, (to_stamp <= repeat).nonzero()[0]) if nearest <= repeat else None
        self._complete(plan, denoise, dn, done, finished, repeat, starting and repeat == 1)
        if self.log is not None:
            self.log.append((self.workload.request_ids[run].tolist(), plan.prompt.tolist()))

    def _run_span(self, plan, next_arrival: float) -> None:
        """Every round up to the next arrival (or until the runners are done) while every resident
        request runs and nobody waits, from ``plan`` (this round's; one that admitted runs its round
        alone first), without asking the policy each round.

        No request joins before the next arrival and the resident set only loses the finished, so
        each of these rounds the policy would run the same requests (less those finished), each a
        prompt block while it has one left: only their order would differ, which the replay does not
        read. All of them move in step, so each one's events fall on known rounds of the span: its
        prompt runs out, its first denoising round, its stamps. The rounds are grouped as
        :meth:`run_round` groups them (the same repeats from the same bounds: the same steps of the
        clock, so the same floats and stamps), a few integer operations per group; the policy is then
        told what ran (:meth:`_tell_span`)."""
        req = self.req_of_slot[plan.run]
        start_P, start_done = self.pol.prompt_blocks(plan.run), self.done_rounds[req]
        P, done0 = start_P.tolist(), start_done.tolist()
        ends = sorted(p for p in P if p > 0)  # the span rounds from which a prompt is done
        firsts = {p for p, d in zip(P, done0) if d == 0}  # the span rounds that are a first denoising round
        # each runner's next stamp: (the span round whose end reaches it, runner)
        stamps = [(p + s - d - 1, i) for i, (p, d, s) in enumerate(zip(P, done0, self.next_stamp[req].tolist()))]
        heapq.heapify(stamps)
        finished: list[int] = []
        steady = len(plan.admitted) == 0
        t = k = 0  # rounds run in the span; prompts done by then (ends[:k])
        while True:
            while k < len(ends) and ends[k] <= t:
                k += 1
            n_prompt = len(ends) - k
            n_run = len(P) - len(finished)
            n_dn = n_run - n_prompt
            # the heap holds the prompt runners' stamps too, but each falls after that runner's prompt
            # is done, past the prompt bound of the repeat: the nearest of all gives the same repeat
            nearest = stamps[0][0] - t + 1 if n_dn else math.inf
            dt = self._round_seconds(n_prompt, n_dn)
            repeat = 1
            if steady or t:
                repeat = self._repeat(None, n_run, n_dn, nearest, t in firsts, dt, next_arrival, lambda: ends[k] - t,
                                      None)
            self._count(n_run, n_dn, dt, repeat)
            t += repeat
            while stamps and stamps[0][0] < t:  # the stamps of the group's last round
                i = heapq.heappop(stamps)[1]
                r, d = int(req[i]), done0[i] + t - P[i]
                if self._stamp_one(r, d):
                    finished.append(i)
                else:
                    heapq.heappush(stamps, (t - 1 + int(self.next_stamp[r]) - d, i))
            if len(finished) == len(P) or next_arrival <= self.clock:
                break
        self._tell_span(plan.run, req, start_P, start_done, t, np.array(finished, dtype=np.int64))

    def _stamp_one(self, r: int, done: int) -> bool:
        """:meth:`_stamp` for one request ``r`` that reached its next stamp with ``done`` rounds done;
        returns whether it finished."""
        if done == self.first_block_rounds[r]:
            self.ttfb_round[r], self.ttfb_s[r] = self.rounds, self.clock
            self.next_stamp[r] = self.total_rounds[r]
        if done < self.total_rounds[r]:
            return False
        self.finish_round[r], self.finish_s[r] = self.rounds, self.clock
        self.n_done += 1
        return True

    def _tell_span(self, slots: np.ndarray, req: np.ndarray, start_P: np.ndarray, start_done: np.ndarray,
                   rounds: int, finished: np.ndarray) -> None:
        """Record the rounds done, and tell the policy what a span of ``rounds`` rounds ran
        (:meth:`_run_span`): ``slots`` (requests ``req``) began it with ``start_P`` prompt blocks and
        ``start_done`` denoising rounds; those at positions ``finished`` finished. The policy's
        per-round updates add up (they move integers, and ``r̂`` by whole rounds, exact in float64):
        its state ends as after them, but for which free slots later arrivals take (ties are broken
        by arrival sequence, never by slot)."""
        pol = self.pol
        pol.rounds += rounds - 1  # schedule() counted the first, as complete_round counts a repeat
        prompt_ran = np.minimum(start_P, rounds)
        denoise_ran = np.maximum(rounds - start_P, 0)
        denoise_ran[finished] = self.total_rounds[req[finished]] - start_done[finished]
        self.done_rounds[req] = start_done + denoise_ran
        ran = prompt_ran > 0
        n_ran = np.count_nonzero(ran)  # (count_nonzero: cheaper than any())
        if n_ran:
            pol.complete_slots(slots[ran], np.ones(n_ran, dtype=bool), rounds=prompt_ran[ran])
        ran = denoise_ran > 0
        n_ran = np.count_nonzero(ran)
        if not n_ran:
            return
        gone = np.zeros(len(slots), dtype=bool)
        gone[finished] = True
        refined = None  # where a first denoising round ran (the policy applies one only at that round)
        if self.refined is not None and np.count_nonzero(start_done[ran] == 0):
            refined = self.refined[req[ran]]
        pol.complete_slots(slots[ran], np.zeros(n_ran, dtype=bool), gone[ran], refined,
                           rounds=denoise_ran[ran])

    def _round_seconds(self, n_prompt: int, n_denoise: int) -> float:
        """Seconds of a round of ``n_prompt`` prompt and ``n_denoise`` denoising rows, by the cost model
        once per mix (a replay meets a few hundred mixes over ~10^5 plans)."""
        mix = (n_prompt, n_denoise)
        dt = self.round_s.get(mix)
        if dt is None:
            dt = self.round_s[mix] = float(self.cost.seconds(n_prompt, n_denoise))
        return dt

    def _repeat(self, plan, n_run: int, n_dn: int, nearest: float, starting: bool, dt: float, next_arrival: float,
                least_prompt: Callable[[], int], refine_gaps: np.ndarray | None) -> int:
        """Rounds the plan repeats (:func:`_steady_rounds`), within the policy's steady limit for ``plan``
        (None: no limit applies)."""
        repeat = _steady_rounds(n_run, n_dn, nearest, starting, next_arrival - self.clock, dt, least_prompt,
                                refine_gaps)
        if plan is not None and self.steady_limit is not None and repeat > 1:  # it cannot go below one round
            repeat = max(1, min(repeat, self.steady_limit(plan)))
        return repeat

    def _count(self, n_run: int, n_dn: int, dt: float, repeat: int) -> None:
        """The clock and the counters after ``repeat`` rounds of ``n_run`` rows, ``n_dn`` of them
        denoising (preemptions are counted per plan, by :meth:`run_round`)."""
        pol = self.pol
        self.cap_blocked += repeat * (pol.n_waiting > 0 and pol.n_resident >= pol.max_resident)
        self.clock += dt * repeat
        self.rounds += repeat
        self.used_slots += n_run * repeat
        if n_dn == 0:  # a prefill-only span (skipped otherwise: adding 0.0 leaves the sum as it is)
            self.prefill_only += repeat
            self.prefill_only_s += dt * repeat

    def _stamp(self, dn: np.ndarray, done: np.ndarray, at: np.ndarray) -> np.ndarray | None:
        """Stamp the requests ``dn[at]`` that reached their next stamp: a first output block (the next
        stamp becomes the last round) or the last round. Returns which of ``dn`` finished, or None."""
        hit, hit_done = dn[at], done[at]
        first = hit[hit_done == self.first_block_rounds[hit]]
        self.ttfb_round[first], self.ttfb_s[first] = self.rounds, self.clock
        self.next_stamp[first] = self.total_rounds[first]
        last = hit_done >= self.total_rounds[hit]
        if not np.count_nonzero(last):
            return None
        fin = hit[last]
        self.finish_round[fin], self.finish_s[fin] = self.rounds, self.clock
        self.n_done += len(fin)
        finished = np.zeros(len(dn), dtype=bool)
        finished[at[last]] = True
        return finished

    def _complete(self, plan, denoise: np.ndarray, dn: np.ndarray, done: np.ndarray, finished: np.ndarray | None,
                  repeat: int, refine_due: bool) -> None:
        """Tell the policy the round is over: who finished (``finished``, per ``dn``; None: nobody), and
        the refinements now due (``refine_due``: a first denoising round ran alone; with later
        refinements, theirs too, counted)."""
        refined_now = None
        if self.refined is not None and refine_due:  # the policy uses it only on the first denoising round
            now_first = done == 1
            refined_now = np.full(len(denoise), np.nan)
            refined_now[denoise.nonzero()[0][now_first]] = self.refined[dn[now_first]]
        finished_run = None  # nobody finished: None, which the policy reads as all False
        if finished is not None:
            finished_run = np.zeros(len(denoise), dtype=bool)
            finished_run[denoise] = finished
        self.pol.complete_round(plan, finished_run, refined_now, repeat)
        if self.later is not None and repeat == 1:
            count = int(np.isfinite(refined_now).sum()) if refined_now is not None else 0
            finished = np.zeros(len(dn), dtype=bool) if finished is None else finished
            count += self.later.apply(self.pol, plan.run[denoise], dn, done, finished)
            self.refinements += count
            self.refining_rounds += count > 0

    def counters(self) -> dict:
        """What :func:`_result` reads besides the stamps (all but ``rhat_zero_pct``)."""
        return dict(rounds=self.rounds, clock=self.clock, used_slots=self.used_slots, prefill_only=self.prefill_only,
                    prefill_only_s=self.prefill_only_s, preemptions=self.preemptions, cap_blocked=self.cap_blocked)


@dataclass(frozen=True)
class LaterRefinements:
    """Re-estimates of ``r̂`` after denoising rounds beyond the first (``simulate --refine-every``).

    rounds : int64 (m,), ascending rounds ``1 + n, 1 + 2n, …`` after which ``r̂`` is replaced.
    values : (n_requests, m) the estimate of the remaining rounds at each of them (NaN: none).
    """

    rounds: np.ndarray
    values: np.ndarray

    def gaps(self, done: np.ndarray) -> np.ndarray:
        """Rounds from ``done`` to the next refinement round of each request (none left: omitted)."""
        nxt = np.searchsorted(self.rounds, done, side="right")
        return self.rounds[nxt[nxt < len(self.rounds)]] - done[nxt < len(self.rounds)]

    def apply(self, pol: DwisePolicy, slots: np.ndarray, requests: np.ndarray, done: np.ndarray,
              finished: np.ndarray) -> int:
        """Refine the requests that ran their denoising round ``done`` (one of :attr:`rounds`) and go on;
        returns how many were refined."""
        at = np.searchsorted(self.rounds, done)
        hit = (at < len(self.rounds)) & ~finished
        hit[hit] = self.rounds[at[hit]] == done[hit]
        values = self.values[requests[hit], at[hit]]
        use = np.isfinite(values)
        pol.refine(slots[hit][use], values[use])
        return int(use.sum())


def later_refinements(workload: SimRequests, spec, refine_every: float) -> LaterRefinements:
    """The refinements after rounds ``1 + n, 1 + 2n, …`` up to the last round ``workload.round_refined``
    holds (``n = inf``: none).

    Raises
    ------
    ConfigError
        ``n < 1``, a scheduler other than ``dwise-refined``, or a workload without per-round estimates.
    """
    if not refine_every >= 1:
        raise ConfigError(f"`refine_every` takes round counts >= 1, got {refine_every}")
    if spec.estimate != "refined":
        raise ConfigError(f"`refine_every` re-estimates with the calibrated refinement: it applies to dwise-refined, "
                          f"not {spec.name}")
    if workload.round_refined is None:
        raise ConfigError("`refine_every` needs refinement estimates at later rounds: traces collected with "
                          "`dwise-predict collect --rounds-hidden N` and `bundle`")
    kept = workload.round_refined.shape[1]
    rounds = np.arange(1 + refine_every, kept + 1, refine_every, dtype=np.int64) if math.isfinite(refine_every) \
        else np.zeros(0, dtype=np.int64)
    return LaterRefinements(rounds, np.asarray(workload.round_refined, dtype=np.float64)[:, rounds - 1])


def _result(policy, config, cost, times, arrive_round, arrive_s, finish_round, finish_s, ttfb_round, ttfb_s,
            c: dict, log=None) -> SimResult:
    """Per-request latencies and the summary metrics of one run from its clocks and counters."""
    n = len(finish_round)
    rounds, clock = c["rounds"], c["clock"]
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
        "prefill_only_rounds_pct": 100.0 * c["prefill_only"] / max(rounds, 1),
        "idle_slots_pct": 100.0 * (1.0 - c["used_slots"] / max(rounds * config.slots, 1)),
        "preemptions_per_request": c["preemptions"] / n,
        "max_latency_s": float(latency_s.max()),
        "max_latency_rounds": int(latency_rounds.max()),
        "prefill_only_time_pct": 100.0 * c["prefill_only_s"] / max(clock - float(times[0]), 1e-12),
        "cap_blocked_rounds_pct": 100.0 * c["cap_blocked"] / max(rounds, 1),
        "rhat_zero_pct": c["rhat_zero_pct"],
        "round_cost_source": cost.source,
    }
    return SimResult(policy, metrics, latency_rounds, latency_s, ttfb_r, ttfb_sec, finish_round, log)


def _simulate_sync(workload: SimRequests, policy: str, config: SimConfig, arrivals=None) -> SimResult:
    """SGLang 0.5.23's synchronous dLLM loop, ``--no-dllm-fdfo`` (``sglang-sync``).

    At most ``B`` requests are held, admitted in arrival order as others finish and while their KV
    reservations fit the budget (the first that does not fit waits, and so do those behind it, as
    in SGLang's ``PrefillAdder``). A step is a prefill forward (one prompt block for each held
    request that has one left; prefill first) or, when none has, a decode step: every held
    request's current output block, run for as many forwards as the slowest of them needs
    (``rounds_per_block``), every forward holding all of them; then each moves to its next block,
    and those past their last block leave.
    """
    if workload.block_rounds is None:
        raise ConfigError("sglang-sync needs the rounds of every output block: traces with rounds_per_block")
    n = len(workload)
    kv = kv_reservations(workload, config)
    kv_budget, kv_used = (math.inf if config.kv_budget is None else config.kv_budget), 0.0
    order, times = make_arrivals(n, config) if arrivals is None else arrivals
    cost = config.cost
    # every request's block rounds end to end: request i's block j is flat[start[i] + j]
    n_blocks = np.array([len(b) for b in workload.block_rounds], dtype=np.int64)
    if (n_blocks == 0).any():
        raise TraceError("sglang-sync needs at least one output block per request: rounds_per_block is empty")
    flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in workload.block_rounds])
    start = np.cumsum(n_blocks) - n_blocks
    P = workload.prompt_blocks.copy()
    nxt = np.zeros(n, dtype=np.int64)  # index of the current output block
    arrive_round = np.zeros(n, dtype=np.int64)
    arrive_s, finish_s, ttfb_s = np.zeros(n), np.zeros(n), np.zeros(n)
    finish_round, ttfb_round = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    held: list[int] = []
    clock, rounds, ptr, queued, n_done = 0.0, 0, 0, 0, 0
    c = dict(used_slots=0, prefill_only=0, prefill_only_s=0.0, preemptions=0, cap_blocked=0)
    while n_done < n:
        end = int(np.searchsorted(times, clock, side="right"))
        arrive_round[order[ptr:end]], arrive_s[order[ptr:end]] = rounds, times[ptr:end]
        ptr = end
        while len(held) < config.slots and queued < ptr and kv_used + kv[order[queued]] <= kv_budget:
            held.append(int(order[queued]))
            kv_used += kv[order[queued]]
            queued += 1
        if not held:
            clock = float(times[ptr])
            continue
        idx = np.asarray(held)
        prefill = idx[P[idx] > 0]
        if len(prefill):  # prefill steps, up to the first request out of prompt blocks or the next arrival
            steps, clock, c["prefill_only_s"] = _prefill_steps(
                clock, c["prefill_only_s"], float(cost.seconds(len(prefill), 0)), int(P[prefill].min()),
                float(times[ptr]) if ptr < n else math.inf)
            P[prefill] -= steps
            c["prefill_only"] += steps
            c["used_slots"] += steps * len(prefill)
            c["cap_blocked"] += steps * (queued < ptr and len(held) >= config.slots)
            rounds += steps
            continue
        steps = int(flat[start[idx] + nxt[idx]].max())
        dt = steps * float(cost.seconds(0, len(held)))
        c["used_slots"] += steps * len(held)
        c["cap_blocked"] += steps * (queued < ptr and len(held) >= config.slots)
        clock += dt
        rounds += steps
        at = nxt[idx] + 1
        nxt[idx] = at
        first = idx[at == 1]
        ttfb_round[first], ttfb_s[first] = rounds, clock
        last = at >= n_blocks[idx]
        done = idx[last]
        finish_round[done], finish_s[done] = rounds, clock
        n_done += len(done)
        kv_used -= float(kv[done].sum())
        held = idx[~last].tolist()
    c.update(rounds=rounds, clock=clock, rhat_zero_pct=float("nan"))
    return _result(policy, config, cost, times, arrive_round, arrive_s, finish_round, finish_s, ttfb_round, ttfb_s, c)


def _prefill_steps(clock: float, spent: float, dt: float, limit: int, next_arrival: float) -> tuple[int, float, float]:
    """Up to ``limit`` prefill steps of ``dt`` seconds from ``clock``, the last one the first to reach
    ``next_arrival`` (the loop must stamp it and may admit it); returns (steps, clock, spent) with the
    clock and the prefill-only seconds ``spent`` advanced one step at a time, as a loop of single steps
    adds them (so the sums are the same floats)."""
    steps = 0
    while steps < limit:
        clock += dt
        spent += dt
        steps += 1
        if clock >= next_arrival:
            break
    return steps, clock, spent


def rhat_zero_share(spec, estimate: np.ndarray, refined: np.ndarray | None, total: np.ndarray,
                    later: LaterRefinements | None = None) -> float:
    """Percent of requests whose ``r̂`` reaches 0 while rounds remain (the DWISE paper's Table 6), or NaN
    for schedulers that do not track ``r̂``.

    After ``t`` denoising rounds ``r̂ = max(r̂_0 − t, 0)``, so it hits 0 with work left iff some
    integer ``t`` has ``r̂_0 <= t < total``, i.e. ``ceil(r̂_0) < total``; with refinement the same
    holds from round 1 on with the refined estimate against ``total − 1``. With ``later``
    refinements each one starts a new stretch: an estimate ``e`` set after round ``k`` reaches 0
    after round ``k + ceil(e)``, which counts if that comes before the next refinement and before
    the request's last round.
    """
    if spec.ranking != "remaining" or spec.estimate in ("none", "oracle"):
        return float("nan")
    if refined is None:
        hit = np.ceil(estimate) < total
    elif later is None or not len(later.rounds):
        hit = (estimate <= 0) | (np.ceil(np.maximum(refined, 0.0)) < total - 1)
    else:
        hit = estimate <= 0
        start, value = np.ones(len(total), dtype=np.int64), np.asarray(refined, dtype=np.float64)
        for j, k in enumerate(later.rounds.tolist()):
            applies = (total > k) & np.isfinite(later.values[:, j])
            hit |= applies & (start + np.ceil(np.maximum(value, 0.0)) <= k - 1)
            start = np.where(applies, k, start)
            value = np.where(applies, later.values[:, j], value)
        hit |= start + np.ceil(np.maximum(value, 0.0)) <= total - 1
    return float(100.0 * hit.mean())


def category_tails(result: SimResult, workload: SimRequests) -> list[dict]:
    """Per-category latency tails of one run (the DWISE paper's Table 16): p99 and max, in seconds and rounds."""
    if workload.categories is None:
        return []
    rows = []
    for cat in sorted(set(workload.categories.tolist())):
        m = workload.categories == cat
        lat = result.latency_s[m]
        rows.append({"policy": result.policy, "category": cat, "requests": int(m.sum()),
                     "mean_latency_s": float(lat.mean()), "p99_latency_s": float(np.percentile(lat, 99)),
                     "max_latency_s": float(lat.max()), "p99_latency_rounds": float(np.percentile(result.latency_rounds[m], 99))})
    return rows


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
            f"`kv_budget` {config.kv_budget:g} blocks cannot hold request {workload.request_ids[worst]} "
            f"(worst case {kv[worst]:g} blocks = prompt + budget + slack): raise `kv_budget` to at least {kv.max():g}"
        )
    return kv


def _steady_rounds(n_run: int, n_denoise: int, nearest: float, starting: bool, until_arrival: float, dt: float,
                   least_prompt: Callable[[], int], refine_gaps: np.ndarray | None = None) -> int:
    """How many rounds in a row a plan of ``n_run`` rows provably repeats unchanged (at least 1).

    Between events the same requests keep running: runners' keys only fall (``P`` or ``r̂`` drop
    by one per round, or ``r̂`` stays at 0) while paused and waiting keys stay fixed, so no paused
    request overtakes a runner and the top-B cut-off only falls (no new admission). The plan
    changes at the first event: a prompt runner reaching ``P = 0`` (phase change), a first
    denoising round (refinement), a first output block or a request finishing, or an arrival.
    ``refine_gaps`` (``--refine-every``): rounds until a runner's next refinement, which must run
    alone too. The caller skips this when the round admitted anyone.

    ``n_denoise``: the runners that run a denoising round; ``nearest``: the fewest rounds from one of
    them to its next stamp (its first output block, then its last round; ``inf`` with none denoising);
    ``starting``: one of them is at its first denoising round; ``least_prompt``: the fewest prompt
    blocks left of the other runners (asked only where that bound is not moot).
    """
    if starting or nearest <= 1:  # a refinement, or a stamp after this round (common on a busy server)
        return 1
    steps = []
    if refine_gaps is not None and len(refine_gaps):
        steps.append(int(refine_gaps.min()) - 1)  # 0 when this round refines: it runs alone
    if n_denoise:
        steps.append(nearest)
    if math.isfinite(until_arrival):
        # round j of the span starts at clock + j * dt and must start before the next arrival
        steps.append(max(1, math.ceil(until_arrival / dt) - 1))
    if n_denoise < n_run and not (steps and min(steps) <= 1):  # the costliest bound, unless moot
        steps.append(least_prompt())
    return max(1, min(steps)) if steps else 1


def _least(values: np.ndarray) -> int:
    """The least of a few integers (argmin: a fraction of a ufunc reduction's cost on a handful)."""
    return int(values[values.argmin()])


def available_policies(workload: SimRequests, batch_former: str = "mixed") -> list[str]:
    """Policies the workload's predictions allow (all, or those needing no bundle), the published
    baselines on ``batch_former`` (:func:`~dwise_predict.simulation.schedulers.on_batch_former`)."""
    have = {"admission": workload.admission is not None, "refined": workload.refined is not None,
            "probe": workload.probe is not None, "raw": workload.raw_refined is not None,
            "blocks": workload.block_rounds is not None}
    return [p for p in on_batch_former(list(SCHEDULERS), batch_former)
            if all(have[s] for s in NEEDS_BUNDLE.get(p, ()))]


def compare(workload: SimRequests, config: SimConfig, policies: list[str] | None = None) -> list[SimResult]:
    """Run several policies on the identical arrival trace."""
    policies = policies or available_policies(workload)
    arrivals = make_arrivals(len(workload), config)
    return [simulate(workload, p, config, arrivals) for p in policies]


def compare_arrivals(
    workload: SimRequests, config: SimConfig, patterns: list[str], rate: str = "1.5x", policies: list[str] | None = None,
    arrival_seeds: int = 1, tails: list | None = None, log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Compare policies under each arrival pattern; one metrics row per (pattern, policy).

    ``rate`` is the Poisson rate of the non-burst patterns: req/s, or a multiple of SGLang-default's
    service rate such as ``1.5x``. Rows carry ``arrival``, ``rate_rps``, the policy's metrics and
    ``speedup_vs_default`` (SGLang-default's mean latency over the row's, per pattern).

    With ``arrival_seeds`` > 1 every pattern is replayed under seeds ``config.seed ...
    config.seed + arrival_seeds − 1``; a row then holds each metric's mean over the seeds and, for
    the latency and throughput metrics, ``<metric>_lo`` / ``<metric>_hi``, a 95 % bootstrap interval
    of that mean (:func:`~dwise_predict.metrics.bootstrap_mean_ci`). ``tails``, when a list, receives
    the per-category tails (:func:`category_tails`) of the first seed's runs. ``log`` is told as
    each pattern (and seed) is replayed.
    """
    poisson_rate = parse_rates(rate, workload, config, "`rate`")[0] if any(p != "burst" for p in patterns) else None
    rows = []
    for pattern in patterns:
        per_seed: dict[str, list[dict]] = {}
        for i in range(max(1, arrival_seeds)):
            cfg = replace(config, arrival=pattern, rate=None if pattern == "burst" else poisson_rate, seed=config.seed + i)
            results = compare(workload, cfg, policies)
            for result in results:
                per_seed.setdefault(result.policy, []).append(result.metrics)
                if tails is not None and i == 0:
                    tails.extend({"arrival": pattern, **row} for row in category_tails(result, workload))
            if log:
                seeds = f", arrival seed {i + 1} of {arrival_seeds}" if arrival_seeds > 1 else ""
                log(f"  {pattern} arrivals{seeds}: {len(results)} schedulers replayed")
        for policy, runs in per_seed.items():
            rows.append({"arrival": pattern, "rate_rps": poisson_rate if pattern != "burst" else None,
                         **aggregate_runs(runs, seed=config.seed)})
    add_speedups(rows, "arrival")
    return rows


INTERVAL_METRICS = ("mean_latency_s", "p50_latency_s", "p99_latency_s", "max_latency_s", "mean_ttfb_s",
                    "throughput_rps", "mean_latency_rounds")


def aggregate_runs(runs: list[dict], seed: int = 0) -> dict:
    """One metrics dict from the runs of one policy under several arrival seeds (see :func:`compare_arrivals`)."""
    if len(runs) == 1:
        return dict(runs[0])
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            values = [r[key] for r in runs]
            out[key] = float(np.mean(values))
            if key in INTERVAL_METRICS:
                out[f"{key}_lo"], out[f"{key}_hi"] = bootstrap_mean_ci(values, seed=seed)
        else:
            out[key] = value
    out["arrival_seeds"] = len(runs)
    return out


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
    and ranking has little to reorder; above it the queue grows and ranking pays (the DWISE paper's Fig. 9).
    """
    backlogged = replace(config, arrival="burst", rate=None)
    return simulate(workload, "sglang-default", backlogged).metrics["throughput_rps"]


def parse_rates(text: str, workload: SimRequests, config: SimConfig, param: str = "`rates`") -> list[float]:
    """``"1,2,4"`` (req/s) or ``"0.5x,1x,2x"`` (multiples of :func:`service_rate`) -> req/s."""
    items = rate_items(text, param)
    unit = service_rate(workload, config) if any(multiple for _, multiple in items) else None
    return [value * unit if multiple else value for value, multiple in items]


def rate_items(text: str, param: str = "`rates`") -> list[tuple[float, bool]]:
    """The syntax of a rate list, checked without simulating: ``(value, is a multiple)`` per item."""
    items = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            raise ConfigError(f"{param} {text!r} has an empty item: give e.g. 0.5x,1x,2x or 4,8,16")
        try:
            value = float(item[:-1] if item.endswith("x") else item)
        except ValueError:
            raise ConfigError(f"{param} item {item!r} is not a number or a multiple like 2x") from None
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{param} item {item!r} must be positive")
        items.append((value, item.endswith("x")))
    if not items:
        raise ConfigError(f"{param} is empty: give e.g. 0.5x,1x,2x or 4,8,16")
    return items


def sweep(workload: SimRequests, config: SimConfig, rates: list[float], policies: list[str] | None = None,
          log: Callable[[str], None] | None = None) -> list[dict]:
    """Every policy at each Poisson arrival rate (``poisson`` arrivals; the DWISE paper's Figure 9);
    ``log`` is told as each rate is replayed."""
    rows = []
    for i, rate in enumerate(rates):
        cfg = replace(config, arrival="poisson", rate=rate)
        for result in compare(workload, cfg, policies):
            rows.append({"rate_rps": rate, **result.metrics})
        if log:
            log(f"  rate {i + 1} of {len(rates)} ({rate:.3g} req/s) replayed")
    add_speedups(rows, "rate_rps")
    fcfs = {r["rate_rps"]: r["mean_latency_s"] for r in rows if r["policy"] == "fcfs-mixed"}
    for r in rows:  # what ordering adds over mixed batching alone, at this load
        ref = fcfs.get(r["rate_rps"])
        r["gain_vs_fcfs_mixed"] = ref / r["mean_latency_s"] if ref and r["mean_latency_s"] > 0 else float("nan")
    return rows


def sweep_k(workload: SimRequests, config: SimConfig, ks: list[float], policies: list[str] | None = None) -> list[dict]:
    """Every policy at each resident-set multiplier ``k`` under ``config``'s arrivals (the DWISE paper's Fig. 10).

    Rows carry ``k``, the metrics (``cap_blocked_rounds_pct``: rounds in which requests waited while
    ``k·B`` requests were resident) and ``speedup_vs_default`` per ``k``.
    """
    rows = []
    arrivals = make_arrivals(len(workload), config)
    for k in ks:
        cfg = replace(config, k=k)
        for policy in policies or available_policies(workload):
            rows.append({"k": k, **simulate(workload, policy, cfg, arrivals).metrics})
    add_speedups(rows, "k")
    return rows


def gain_decomposition(rows: list[dict], group_key: str = "arrival") -> list[dict]:
    """Where DWISE's gain over SGLang's default comes from: the mean-latency ratio of each step of
    :data:`~dwise_predict.simulation.schedulers.GAIN_STEPS` (from → to; > 1 means the step helps), per
    group, for the pairs present; then what the mixed former gives each baseline replayed on both
    (:data:`~dwise_predict.simulation.schedulers.FORMER_STEPS`, the DWISE paper's Table 2 over its Table 4)."""
    out = []
    for group in dict.fromkeys(r.get(group_key) for r in rows):
        mean = {r["policy"]: r["mean_latency_s"] for r in rows if r.get(group_key) == group}
        for step, a, b in GAIN_STEPS + FORMER_STEPS:
            if a in mean and b in mean and mean[b] > 0:
                out.append({group_key: group, "step": step, "from": a, "to": b, "gain": mean[a] / mean[b]})
    return out


def ranking_pays_from(rows: list[dict], policy: str = "dwise-refined", margin: float = 1.05) -> float | None:
    """The lowest swept rate from which ``policy`` beats ``fcfs-mixed`` on mean latency by ``margin``
    at every higher rate (below it, ranking stops paying: the queue is too short to reorder); None
    if it never does. Falls back to the best DWISE variant present when ``policy`` is absent."""
    present = {r["policy"] for r in rows}
    if policy not in present:
        policy = next((p for p in ("dwise-refined", "dwise-admission", "dwise-zero") if p in present), None)
        if policy is None or "fcfs-mixed" not in present:
            return None
    gains = sorted((r["rate_rps"], r["gain_vs_fcfs_mixed"]) for r in rows if r["policy"] == policy)
    start = None
    for rate, gain in gains:
        if gain >= margin:
            start = rate if start is None else start
        else:
            start = None
    return start


def replay(
    requests: SimRequests,
    config: SimConfig,
    policies: list[str] | None = None,
    patterns: list[str] | None = None,
    rate: str | None = None,
    rates: str | None = None,
    log: Callable[[str], None] | None = None,
    arrival_seeds: int = 1,
    tails: list | None = None,
    ks: list[float] | None = None,
    batch_former: str = "mixed",
) -> tuple[list[dict], list[str]]:
    """What ``simulate`` runs: a load sweep over ``rates`` when given, else every arrival pattern of
    ``patterns`` (default burst and burst-poisson at ``rate``, default ``1.5x``), each under
    ``arrival_seeds`` seeds (bootstrap intervals), per-category tails appended to ``tails``. With
    ``ks``, a k sweep (:func:`sweep_k`) under the first pattern instead. ``batch_former`` puts the
    published baselines on DWISE's mixed-phase former, SGLang's prefill-first one or both
    (:func:`~dwise_predict.simulation.schedulers.on_batch_former`).

    Returns the metric rows and the policies compared (default: all the predictions allow).

    Raises
    ------
    ConfigError
        A policy needs predictions the requests lack, or the KV budget cannot hold one request
        (checked before any work).
    """
    policies = on_batch_former(policies, batch_former) if policies else available_policies(requests, batch_former)
    allowed = available_policies(requests, "both")
    missing = [p for p in policies if p not in allowed]
    if missing:
        raise ConfigError(f"`policies` {', '.join(missing)} need predictions: pass `bundle` (trail: traces with a train split)")
    kv_reservations(requests, config)
    swept = parse_rates(rates, requests, config) if rates else None  # a bad --rates is refused before any output
    if rate is not None:
        rate_items(rate, "`rate`")  # and a bad --rate too
    if log is not None:
        log(f"replaying {len(requests)} requests under {len(policies)} policies")
    if swept is not None:
        return sweep(requests, config, swept, policies, log), policies
    if ks:
        pattern = (patterns or ["burst"])[0]
        k_rate = None if pattern == "burst" else parse_rates(rate or "1.5x", requests, config, "`rate`")[0]
        return sweep_k(requests, replace(config, arrival=pattern, rate=k_rate), ks, policies), policies
    return compare_arrivals(requests, config, patterns or ["burst", "burst-poisson"], rate or "1.5x", policies,
                            arrival_seeds, tails, log), policies


def sync_batch_service_times(workload: SimRequests, cost: RoundCost, batch_size: int, n_batches: int = 200,
                             seed: int = 0):
    """Service times of synchronized batches of ``batch_size`` requests drawn from ``workload``.

    A synchronized batch (Amin et al.'s §IV-§V) prefills together — round ``t`` holds the members with at
    least ``t`` prompt blocks — then denoises together until its last member is done, round ``t``
    holding the members with at least ``t`` rounds; each round is timed by ``cost``. Returns a
    :class:`~dwise_predict.simulation.batch_timeout.ServiceTimes` for ``batch-timeout``.
    """
    from dwise_predict.simulation.batch_timeout import ServiceTimes

    if batch_size < 1 or n_batches < 1:
        raise ConfigError(f"need a positive batch size and batch count, got {batch_size}, {n_batches}")
    rng = np.random.default_rng(seed)
    times = np.empty(n_batches)
    for b in range(n_batches):
        idx = rng.choice(len(workload), size=batch_size, replace=True)
        P, T = workload.prompt_blocks[idx], workload.total_rounds[idx]
        prefill_rows = (P[None, :] >= np.arange(1, P.max() + 1)[:, None]).sum(1) if P.max() > 0 else np.zeros(0)
        decode_rows = (T[None, :] >= np.arange(1, T.max() + 1)[:, None]).sum(1)
        times[b] = float(np.sum(cost.seconds(prefill_rows, 0)) + np.sum(cost.seconds(0, decode_rows)))
    return ServiceTimes(times, batch_size, f"{n_batches} synchronized batches of {batch_size} drawn from the traces, "
                                           f"rounds timed by: {cost.source}")
