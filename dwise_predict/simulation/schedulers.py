"""The schedulers the simulator compares: each a configuration of the DWISE policy class, or a small
subclass of it where the ranking key differs (the DWISE paper's Tables 2 and 4 name the baselines).

:data:`SCHEDULERS` is the one description of them: the simulator runs each :class:`SchedulerSpec`,
the report's "adds" column prints its ``adds``, the gain decomposition walks its ``steps``, and
``simulate --help`` lists the names and ``about``. Adding a scheduler is adding a spec here (and a
test); where its estimate kind is new, :data:`NEEDS` and ``SimRequests.estimates`` learn it too.

The rows are ordered so that the differences between adjacent ones are what a comparison isolates:
``sglang-default`` → ``fcfs-mixed`` (mixed-phase batching), ``fcfs-mixed`` → ``dwise-zero``
(ordering by prompt work), → ``dwise-admission`` (admission estimates), → ``dwise-raw``
(refinement), → ``dwise-refined`` (calibration, the DWISE paper's Table 5), → ``dwise-oracle``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.serving.policy import DwisePolicy


@dataclass(frozen=True)
class SchedulerSpec:
    """One scheduler as a configuration, with what it is.

    ranking : ``remaining`` (``P + r̂``), ``arrival``, ``fixed`` (the key at admission, kept) or
        ``mlfq`` (level of work done).
    estimate : where ``r̂`` comes from: ``none``, ``zero``, ``admission``, ``raw`` / ``refined``
        (uncalibrated / calibrated refinement), ``probe`` (TRAIL), ``oracle``.
    prefill_first : SGLang's phase barrier (all-prefill rounds while any resident has prompt left).
    preemptive : ``False`` holds at most ``B`` residents, so a request that starts runs every round
        until it finishes.
    kv : ``budget`` reserves prompt + whole output budget; ``bucket`` prompt + the predicted output
        rounded up to a power of two (S³).
    bucket_key : rank by the power-of-two bucket of the estimate instead of the estimate (S³).
    sync : SGLang's synchronous loop (``--no-dllm-fdfo``): a batch runs each block until all members
        finish it.
    blocking_admission : SGLang's admission: the first request whose KV does not fit stops it.
    about : what it models (``simulate --help`` prints it; all serve in rounds of at most ``B`` block rows).
    adds : the mechanism this row adds over the one before (the tables' "adds" column).
    steps : the gain decomposition's steps that end at this scheduler, as ``(step, from scheduler)``
        (``simulate`` prints each step's mean-latency ratio, from / to).
    family : ``sglang`` (SGLang's own modes), ``dwise`` (DWISE and its variants) or ``baseline`` (the
        published schedulers it is compared with); the plots draw each family in one hue and line style.
    """

    name: str
    ranking: str
    estimate: str = "none"
    prefill_first: bool = False
    preemptive: bool = True
    kv: str = "budget"
    bucket_key: bool = False
    sync: bool = False
    blocking_admission: bool = False
    about: str = ""
    adds: str = ""
    steps: tuple[tuple[str, str], ...] = ()
    family: str = "baseline"


SCHEDULERS: dict[str, SchedulerSpec] = {s.name: s for s in (
    SchedulerSpec("sglang-default", "arrival", prefill_first=True, preemptive=False, blocking_admission=True,
                  about="SGLang 0.5.23's dLLM scheduler as it runs by default (FDFO, --dllm-fdfo): at most B "
                        "requests (--max-running-requests), admitted FCFS (staging before incoming is arrival "
                        "order here) while their KV reservations fit, "
                        "admission stopping at the first that does not (SGLang's PrefillAdder); a round is "
                        "all-prefill while any of them has a prompt block left (one block per request per "
                        "forward), else all-decode; a finished block leaves (first done, first out)",
                  adds="baseline", family="sglang"),
    SchedulerSpec("sglang-sync", "arrival", prefill_first=True, preemptive=False, sync=True, blocking_admission=True,
                  about="the same with --no-dllm-fdfo (SGLang's synchronous loop): a decode step runs the batch's "
                        "current blocks until every member has finished its block (as many forwards as the "
                        "slowest needs), then all move on; finished requests leave only at block boundaries",
                  adds="SGLang with --no-dllm-fdfo", family="sglang"),
    SchedulerSpec("fcfs-mixed", "arrival", about="FCFS over k·B residents, prompt and denoising blocks share rounds",
                  adds="mixed batching", steps=(("mixed batching", "sglang-default"),)),
    SchedulerSpec("mlfq", "mlfq", about="FastServe-style skip-join MLFQ: level floor(log2(1 + work/8)) of the "
                                        "work done (prompt blocks on arrival, then denoising rounds; quanta "
                                        "double per level), preemptive",
                  adds="work-done levels"),
    SchedulerSpec("ssjf", "fixed", "admission", preemptive=False,
                  about="speculative shortest job first: admission by the admission predictor's total work P + r̂, "
                        "never re-ranked, non-preemptive (B residents)",
                  adds="predicted length, admission only"),
    SchedulerSpec("s3", "fixed", "admission", preemptive=False, kv="bucket", bucket_key=True,
                  about="S³: the admission predictor's output length in power-of-two buckets sizes each KV "
                        "reservation (not the whole budget); shorter buckets first, non-preemptive",
                  adds="length buckets, sized KV"),
    SchedulerSpec("ltr", "fixed", "admission", about="learning to rank: preemptive, ranked by the admission "
                                                     "predictor's order (fixed; remaining work is not tracked)",
                  adds="predicted order, preemptive"),
    SchedulerSpec("trail", "remaining", "probe",
                  about="TRAIL: SRPT on remaining work, r̂ replaced after the first denoising round by the "
                        "TRAIL-style probe of `evaluate` on the first-round hidden state (fitted on the train split)",
                  adds="probe refinement"),
    SchedulerSpec("dwise-zero", "remaining", "zero", about="DWISE with r̂ = 0 (ranks by prompt blocks left only)",
                  adds="ordering by prompt work", steps=(("ordering by prompt work", "fcfs-mixed"),), family="dwise"),
    SchedulerSpec("dwise-admission", "remaining", "admission",
                  about="DWISE, r̂ from the admission predictor, decremented per round",
                  adds="admission estimates", steps=(("admission estimates", "dwise-zero"),), family="dwise"),
    SchedulerSpec("dwise-raw", "remaining", "raw",
                  about="DWISE, r̂ replaced by the raw (uncalibrated) refinement after round 1",
                  adds="raw refinement", steps=(("refinement (raw)", "dwise-admission"),), family="dwise"),
    SchedulerSpec("dwise-refined", "remaining", "refined",
                  about="DWISE, r̂ replaced by the calibrated refinement after round 1",
                  adds="calibration",
                  steps=(("calibration", "dwise-raw"), ("refinement (calibrated)", "dwise-admission")), family="dwise"),
    SchedulerSpec("dwise-oracle", "remaining", "oracle", about="DWISE with r̂ = true rounds (bound for any predictor)",
                  adds="perfect estimates", steps=(("headroom to the oracle", "dwise-refined"),), family="dwise"),
)}
# what each estimate kind needs of the workload; the bundle gives admission, raw and refined
NEEDS = {"none": (), "zero": (), "oracle": (), "admission": ("admission",), "refined": ("admission", "refined"),
         "probe": ("probe",), "raw": ("admission", "raw"), "blocks": ("blocks",)}
FROM_BUNDLE = {"admission", "raw", "refined"}
# the gain decomposition: (step, from, to) in the registry's order (``simulator.gain_decomposition``)
GAIN_STEPS = tuple((step, before, spec.name) for spec in SCHEDULERS.values() for step, before in spec.steps)

# The batch former a published baseline runs on. The registry's baselines run on DWISE's mixed-phase
# former (the DWISE paper's Table 4); the paper's Table 2 runs them on SGLang's prefill-first one, "as
# originally designed". Each has a twin here, ``<name>-pf``, derived from its spec with only the phase
# barrier switched on (admission, residency and ranking unchanged, so the pair isolates the former).
# The rows keep one name per scheduler (rows, speed-ups, plots and per-category tails are keyed by it);
# the suffix says the former. FCFS on the prefill-first former is SGLang's default itself, so
# ``fcfs-mixed`` has no twin: its counterpart is ``sglang-default``.
BATCH_FORMERS = ("mixed", "prefill-first", "both")
PREFILL_FIRST_SUFFIX = "-pf"
PREFILL_FIRST: dict[str, SchedulerSpec] = {
    f"{spec.name}{PREFILL_FIRST_SUFFIX}": replace(
        spec, name=f"{spec.name}{PREFILL_FIRST_SUFFIX}", prefill_first=True, steps=(),
        about=f"{spec.about}; on SGLang's prefill-first batch former (a round is all-prefill while any resident "
              "has a prompt block left), as the DWISE paper's Table 2 runs it",
        adds=f"{spec.adds} (prefill-first)")
    for spec in SCHEDULERS.values() if spec.family == "baseline" and spec.ranking != "arrival"}
# what the mixed former gives each baseline: (step, on prefill-first, on mixed), read by the gain
# decomposition beside :data:`GAIN_STEPS` (FCFS's is GAIN_STEPS' "mixed batching" step)
FORMER_STEPS = tuple((f"mixed former ({spec.name[: -len(PREFILL_FIRST_SUFFIX)]})", spec.name,
                      spec.name[: -len(PREFILL_FIRST_SUFFIX)]) for spec in PREFILL_FIRST.values())
# every scheduler a replay may name: SGLang's modes, the baselines on the prefill-first former, then
# the rest of the registry (so a table of both formers reads the DWISE paper's Table 2, then its Table 4)
ALL_SCHEDULERS: dict[str, SchedulerSpec] = {
    **{name: spec for name, spec in SCHEDULERS.items() if spec.family == "sglang"}, **PREFILL_FIRST,
    **{name: spec for name, spec in SCHEDULERS.items() if spec.family != "sglang"}}


def on_batch_former(names: list[str], former: str) -> list[str]:
    """``names`` with each published baseline on the batch former ``former`` (:data:`BATCH_FORMERS`):
    ``mixed`` keeps ``names`` as given, ``prefill-first`` swaps each baseline for its ``-pf`` twin,
    ``both`` keeps it and adds the twin; the others (and ``-pf`` names) stay. Except for ``mixed``,
    the result follows :data:`ALL_SCHEDULERS`' order."""
    if former not in BATCH_FORMERS:
        raise ConfigError(f"`batch_former` must be one of {', '.join(BATCH_FORMERS)}, got {former!r}")
    if former == "mixed":
        return list(names)
    chosen = set()
    for name in names:
        twin = PREFILL_FIRST.get(f"{name}{PREFILL_FIRST_SUFFIX}")
        if twin is None or former == "both":
            chosen.add(name)
        if twin is not None:
            chosen.add(twin.name)
    return [name for name in ALL_SCHEDULERS if name in chosen] + [name for name in names if name not in ALL_SCHEDULERS]


def batch_former(spec: SchedulerSpec) -> str:
    """Which batch former ``spec`` runs on: ``prefill-first`` (SGLang's phase barrier) or ``mixed``."""
    return "prefill-first" if spec.prefill_first else "mixed"


def needs_bundle(spec: SchedulerSpec) -> bool:
    """Whether ``spec``'s estimates come from a predictor bundle (``simulate --bundle``)."""
    return bool(FROM_BUNDLE.intersection(NEEDS[spec.estimate]))


def bucket(values) -> np.ndarray:
    """Power-of-two bucket ceiling of each value (``0 → 1``, ``5 → 8``), S³'s length classes."""
    v = np.maximum(np.asarray(values, dtype=np.float64), 1.0)
    return 2.0 ** np.ceil(np.log2(v))


class ScheduledPolicy(DwisePolicy):
    """:class:`DwisePolicy` with the ``fixed`` and ``mlfq`` rankings of the baselines.

    ``fixed``: the key is ``P + r̂`` as given at :meth:`add_many` (SSJF, LTR, S³), never updated.
    ``mlfq``: the key is the level ``floor(log2(1 + work / quantum))`` of the work done so far, where
    work starts at the prompt blocks (skip-join: a long prompt enters a lower level) and grows by one
    per denoising round; quanta double per level. The baselines run as published: no wait cap by default.
    """

    def __init__(self, slots: int, k: float = 8, kv_budget: float | None = None, ranking: str = "remaining",
                 prefill_first: bool = False, quantum: float = 8.0, blocking_admission: bool = False,
                 max_wait: int | None = None):
        base = ranking if ranking in ("remaining", "arrival") else "remaining"
        super().__init__(slots, k, kv_budget, ranking=base, prefill_first=prefill_first,
                         blocking_admission=blocking_admission, max_wait=max_wait)
        self.ranking = ranking
        # a fixed key never moves (the short path holds, with no re-sort); an MLFQ level rises with work
        self._key_motion = {"fixed": "none", "mlfq": "rise"}.get(ranking, self._key_motion)
        self.quantum = float(quantum)
        self._fixed = np.zeros(len(self._P))
        self._P0 = np.zeros(len(self._P), dtype=np.int64)
        # MLFQ's level of each whole amount of work, and the work to the next level (_grow_levels)
        self._level_of = self._to_next_level = np.zeros(0)

    def _alloc(self, capacity: int) -> None:
        super()._alloc(capacity)
        for name, dtype in (("_fixed", np.float64), ("_P0", np.int64)):
            old = getattr(self, name, None)
            arr = np.zeros(capacity, dtype=dtype)
            if old is not None:
                arr[: len(old)] = old
            setattr(self, name, arr)

    def add_many(self, request_ids, prompt_blocks, estimates=None, kv_reservations=None, arrival=None) -> np.ndarray:
        # the fixed key and the prompt size must be in place before the parent sorts the new entries,
        # so they are handed to _take_slots, which the parent calls first
        P = np.asarray(prompt_blocks, dtype=np.float64).reshape(-1)
        est = np.zeros(len(P)) if estimates is None else np.asarray(estimates, dtype=np.float64).reshape(-1)
        self._pending = (P, est)
        try:
            return super().add_many(request_ids, prompt_blocks, estimates, kv_reservations, arrival)
        finally:
            self._pending = None

    def _take_slots(self, n: int) -> np.ndarray:
        slots = super()._take_slots(n)
        pending = getattr(self, "_pending", None)
        if pending is not None and len(pending[0]) == n == len(pending[1]):
            self._fixed[slots] = pending[0] + pending[1]
            self._P0[slots] = pending[0]
        return slots

    def _work(self, slots: np.ndarray) -> np.ndarray:
        return self._P0[slots] + self._rounds[slots]

    def _grow_levels(self, work: np.ndarray) -> None:
        """Tabulate the MLFQ level ``floor(log2(1 + work / quantum))`` of every whole amount of work up to
        ``work``'s largest (at least doubling the table), and the rounds from it to the next level. Work
        is a whole number (prompt blocks plus rounds), so a round's keys and its steady limit are
        lookups: the same float operations, done once per amount instead of every round."""
        size = max(2 * len(self._level_of), int(np.maximum.reduce(work)) + 1, 64)
        amounts = np.arange(size, dtype=np.int64).astype(np.float64)
        level = np.floor(np.log2(1.0 + amounts / self.quantum))
        next_work = self.quantum * (2.0 ** (level + 1) - 1.0)  # work at which the level goes up
        self._level_of, self._to_next_level = level, np.ceil(next_work - amounts)

    def _tabulated(self, table: str, slots: np.ndarray) -> np.ndarray:
        """``table`` (``_level_of`` or ``_to_next_level``) at the work of each of ``slots``."""
        work = self._work(slots)
        try:
            return getattr(self, table)[work]
        except IndexError:  # more work than tabulated so far
            self._grow_levels(work)
            return getattr(self, table)[work]

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        if self.ranking == "fixed":
            return self._fixed[slots]
        if self.ranking == "mlfq":
            return self._tabulated("_level_of", slots)
        return super()._keys(slots)

    def steady_limit(self, plan) -> int:
        """Rounds ``plan`` may repeat before a runner's key changes (MLFQ demotions) or the wait cap
        acts (:meth:`DwisePolicy.steady_limit`); else unbounded."""
        cap = super().steady_limit(plan)
        if self.ranking != "mlfq":
            return cap
        dn = plan.run[~plan.prompt]
        if len(dn) == 0:
            return cap
        to_next = self._tabulated("_to_next_level", dn)
        return min(cap, max(1, int(to_next[to_next.argmin()])))


def make_policy(spec: SchedulerSpec, slots: int, k: float, kv_budget: float | None, aging: float = 0.0,
                max_wait: int | None = None) -> DwisePolicy:
    """The policy object serving ``spec`` (the plain :class:`DwisePolicy` where it suffices); ``aging``
    and ``max_wait``, the starvation guard and the wait cap of the DWISE schedulers (the ``dwise-*``
    rows: what ``serve`` runs), leave the baselines as published."""
    k_eff = k if spec.preemptive else 1
    options = dict(ranking=spec.ranking, prefill_first=spec.prefill_first, blocking_admission=spec.blocking_admission)
    if spec.ranking in ("remaining", "arrival"):
        dwise = spec.name.startswith("dwise-")
        return DwisePolicy(slots, k_eff, kv_budget, aging=aging if dwise else 0.0, max_wait=max_wait if dwise else None,
                           **options)
    return ScheduledPolicy(slots, k_eff, kv_budget, **options)
