"""The DWISE per-round scheduling policy (the DWISE paper, Algorithm 1) as a class any server can drive.

A server calls, every serving round,

1. :meth:`DwisePolicy.add` (or :meth:`~DwisePolicy.add_many`) for each newly arrived request;
2. :meth:`DwisePolicy.schedule` -> a :class:`RoundPlan`: which waiting requests become resident
   (admission) and which ``B`` resident requests run this round (the rest are paused, KV kept);
3. if the server's own budgets ran other requests than the plan's (a pick it could not fit left
   out, a standby request run in its slot): :meth:`DwisePolicy.ran`;
4. after the forward pass, :meth:`DwisePolicy.complete_round` (the plan ran as planned),
   :meth:`DwisePolicy.complete_slots` (any set of requests, vectorised) or
   :meth:`DwisePolicy.complete` (one request at a time): a prompt block lowers ``P``; the first
   denoising round sets ``r̂`` to the refined estimate (once); any other denoising round lowers
   ``r̂`` by one (not below zero); finished requests leave and free their KV reservation.

Remaining work is ``R = P + r̂`` (prompt blocks and denoising rounds each take one slot of one round,
so they share one scale). Ties are broken by arrival sequence, which is the order requests were
added (within one :meth:`add_many` call given ``arrival`` times: by time, then by request id), so a
fixed input gives a fixed schedule.

Starvation guard (``aging``): pure SRPT lets a long request wait without bound while shorter ones
keep arriving. With ``aging = a > 0`` the rank key is ``R + a · t0``, ``t0`` the round the request
arrived in (rounds counted by the policy), which orders requests exactly as ``R − a · (time
waited)`` would: every round in the server is worth ``a`` rounds of remaining work. A request of
remaining work ``R`` is then passed only by requests that arrived less than ``R / a`` rounds after
it, so its wait is bounded, and the key of a request that does not run never changes, so the
sorted waiting list stays sorted and a simulator may still skip ahead over rounds whose plan cannot
change. ``a = 0`` is Algorithm 1 as published.

Wait cap (``max_wait``): aging orders requests, but admission also needs the request's KV
reservation to fit, and a large reservation that never fits is passed by smaller ones for as long
as they keep the pool busy, whatever its rank. With ``max_wait = W`` a waiting request that has
waited more than ``W`` rounds is *due*: due requests are admitted first, oldest arrival round
first (then by rank), whatever their rank, and while the first of them does not fit (its
reservation, or a row of the ``k * B``) nobody else is admitted, so the resident set only drains
until it does. Draining takes at most ``D = (k + 1) * L`` rounds, ``L`` the most rounds of work
(prompt blocks plus denoising rounds) one request holds: the at most ``k * B`` residents need at
most ``k * B * L`` block slots, served ``B`` a round while ``B`` or more remain and all of them
each round after that, at most ``L`` more rounds. So a request is admitted at most ``W + D``
rounds after it arrives when no due request that arrived before it is waiting (the usual case:
the cap only acts on a server that has starved someone), and ``W + (m + 1) * D`` with ``m`` such
requests ahead of it. Once resident it runs by rank; aging bounds that part. Being due depends on
time, so the policy checks the first request in the wait line every round (a heap by arrival
round; a handful of operations) and a simulator stops skipping ahead at the round it falls due
(:meth:`DwisePolicy.steady_limit`). ``None`` turns the cap off; ``0`` admits in arrival-round
order, blocking (SGLang's admission, with DWISE's ranking inside one round's arrivals).

The two FCFS baselines of the simulator are the same class with ``ranking="arrival"`` (rank by
arrival sequence instead of ``R``) and, for SGLang's default, ``prefill_first=True`` (a round runs
only prompt blocks while any resident request has one left). Keeping one implementation means the
baselines and DWISE differ only where the policies do.

State lives in flat NumPy arrays indexed by a slot number, so a round costs a few vectorised
operations over the resident set (at most ``k * B`` requests) plus a walk over at most ``B``
waiting candidates kept in a sorted list. The resident set is kept in the order of the last ranking:
a round changes the keys of its ``B`` runners only, so the next ranking sorts nearly sorted input,
which a stable sort (timsort) does in about linear time.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import NamedTuple

import numpy as np

from dwise_predict.errors import ConfigError, InputError

WAITING, RUNNING, PAUSED, FREE = 0, 1, 2, 3
RANKINGS = ("remaining", "arrival")
NONE = np.zeros(0, dtype=np.int64)  # an empty slot array, shared (read-only)
NONE.flags.writeable = False
MAX_WAIT = 4096  # the wait cap's default, in rounds (docs/serving.md, "Starvation guard": how it was chosen)


def _key_seq(z: np.ndarray, at: int) -> tuple[float, int]:
    """(key, arrival sequence) of entry ``at`` of sort keys ``key + i·seq`` (:meth:`DwisePolicy._ranked`),
    comparable with the waiting list's entries."""
    v = z.item(at)
    return v.real, int(v.imag)


class RoundPlan(NamedTuple):
    """What one round does, in policy slot numbers (see :meth:`DwisePolicy.ids` for request ids).

    run : int64 array (n_run,), the slots that process one block this round, best rank first.
    prompt : bool array (n_run,), True where that slot processes a prompt block (else denoising).
    admitted : int64 array, slots that moved from waiting to resident this round.
    paused : int64 array, resident slots that do not run this round (KV kept): the standby ones best rank
        first, then (``prefill_first``) those held back by the barrier.
    preempted : int64 array, slots that ran last round, still have work, and are paused now.
    standby : int64 array, the paused slots that could run (the rank's candidates), best rank
        first: the order in which a server fills a slot that one of ``run`` could not take.

    A named tuple (immutable, built in C) rather than a dataclass: a server builds one every step.
    """

    run: np.ndarray
    prompt: np.ndarray
    admitted: np.ndarray
    paused: np.ndarray
    preempted: np.ndarray
    standby: np.ndarray


class DwisePolicy:
    """Preemptive SRPT over block slots with KV-safe admission (the DWISE paper, Algorithm 1).

    Parameters
    ----------
    slots : ``B``, blocks processed per round (one per selected request).
    k : resident-set multiplier: at most ``k * B`` requests hold KV at once.
    kv_budget : KV pool available for reservations, in the unit of the per-request reservations
        passed to :meth:`add` (tokens or blocks); ``None`` means unlimited.
    ranking : ``"remaining"`` ranks by ``R = P + r̂`` (DWISE); ``"arrival"`` by arrival (FCFS).
    prefill_first : run only prompt blocks while any resident request has one left (SGLang's
        default phase barrier); DWISE mixes prompt and denoising blocks (``False``).
    blocking_admission : a waiting request whose reservation does not fit stops admission for the
        round, as SGLang's ``PrefillAdder`` does (``process_dllm_incoming_reqs`` breaks at the first
        request it cannot add), instead of letting a later, smaller one pass it (``False``).
    aging : starvation guard, rounds of remaining work one round in the server is worth (``R`` ranks
        as ``R + aging · arrival round``; see the module docstring); 0 is off. Only the
        ``remaining`` ranking ages.
    max_wait : wait cap in rounds: a request waiting longer is admitted first, and admission stops
        behind it until its reservation fits (see the module docstring for the bound); None is off.

    Raises
    ------
    ConfigError
        ``slots < 1``, ``k < 1``, a non-positive KV budget, an unknown ranking, a negative aging or a
        wait cap that is not a whole number of rounds >= 0.
    """

    def __init__(
        self,
        slots: int,
        k: float = 8,
        kv_budget: float | None = None,
        ranking: str = "remaining",
        prefill_first: bool = False,
        blocking_admission: bool = False,
        aging: float = 0.0,
        max_wait: int | None = MAX_WAIT,
    ):
        problems = []
        if not isinstance(slots, (int, np.integer)) or slots < 1:
            problems.append(f"slots (B) must be a positive integer, got {slots!r}")
        if not k >= 1:
            problems.append(f"k (resident-set multiplier) must be at least 1, got {k!r}")
        if kv_budget is not None and not kv_budget > 0:
            problems.append(f"KV budget must be positive, got {kv_budget!r}")
        if ranking not in RANKINGS:
            problems.append(f"ranking must be one of {', '.join(RANKINGS)}, got {ranking!r}")
        if not (aging >= 0 and math.isfinite(aging)):
            problems.append(f"aging (starvation guard) must be a finite number >= 0, got {aging!r}")
        if max_wait is not None and not (isinstance(max_wait, (int, np.integer)) and max_wait >= 0):
            problems.append(f"max_wait (wait cap) must be a whole number of rounds >= 0 or None, got {max_wait!r}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.slots = int(slots)
        self.k = k
        self.max_resident = int(math.floor(k * slots))
        self.kv_budget = math.inf if kv_budget is None else float(kv_budget)
        self.ranking = ranking
        self.prefill_first = bool(prefill_first)
        self.blocking_admission = bool(blocking_admission)
        self.aging = float(aging)
        self.max_wait = None if max_wait is None else int(max_wait)

        self.rounds = 0  # rounds scheduled so far (the clock of the starvation guard)
        self.kv_used = 0.0
        self._seq_next = 0
        self._ids: list = []
        self._slot_of: dict = {}
        self._free: list[int] = []
        self._waiting: list[tuple[float, int, int]] = []  # sorted (key, seq, slot)
        # the wait cap's line: a heap of (arrival round, key, seq, slot) over the waiting requests, whose
        # entries for requests no longer waiting under that key are dropped when they reach its front
        self._wait_line: list[tuple[float, float, int, int]] = []
        self._resident = np.zeros(0, dtype=np.int64)  # in the last ranking's order, admissions after it
        self._entered_next = 0  # the next admission sequence (kept with prefill_first only: _make_resident)
        self._kept = None  # (run, standby) of the last plan while only its runs have happened since (_replan)
        self._kept_z = None  # the sort keys of the kept runners where a round leaves keys as they were, else None
        # how a round moves its runners' keys: "fall" (P + r̂: lower or kept), "none" (arrival: kept); a
        # subclass whose keys can "rise" turns the short path (_replan) off
        self._key_motion = "fall" if ranking == "remaining" else "none"
        self._alloc(64)

    # --- storage -------------------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "_P", None)
        n_old = 0 if old is None else len(old)

        def grow(name, dtype, fill):
            arr = np.full(capacity, fill, dtype=dtype)
            if n_old:
                arr[:n_old] = getattr(self, name)
            setattr(self, name, arr)

        grow("_P", np.int64, 0)  # unprocessed prompt blocks
        grow("_rhat", np.float64, 0.0)  # estimated remaining denoising rounds
        grow("_rounds", np.int64, 0)  # denoising rounds done
        grow("_seq", np.int64, 0)  # arrival sequence (tie-break)
        grow("_born", np.float64, 0.0)  # the round it arrived in (starvation guard)
        grow("_kv", np.float64, 0.0)  # KV reservation
        grow("_state", np.int8, FREE)
        grow("_preemptions", np.int64, 0)
        grow("_tie", np.complex128, 0)  # i·seq: the key's tie-break as an imaginary part (_ranked)
        grow("_entered", np.int64, 0)  # admission sequence: the prefill-first barrier's held-back order
        self._ids.extend([None] * (capacity - n_old))
        self._free.extend(range(capacity - 1, n_old - 1, -1))  # pop() hands out low slots first

    def _take_slots(self, n: int) -> np.ndarray:
        while len(self._free) < n:
            self._alloc(2 * len(self._P))
        free, cut = self._free, len(self._free) - n
        taken = free[cut:][::-1]  # as n pops would hand them out: low slots first
        del free[cut:]
        return np.array(taken, dtype=np.int64)

    # --- arrivals ------------------------------------------------------------------------------

    def add(self, request_id, prompt_blocks: int, estimate: float = 0.0, kv_reservation: float = 0.0) -> int:
        """Queue one arrived request; returns its slot. See :meth:`add_many`."""
        return int(self.add_many([request_id], [prompt_blocks], [estimate], [kv_reservation])[0])

    def add_many(self, request_ids, prompt_blocks, estimates=None, kv_reservations=None, arrival=None) -> np.ndarray:
        """Queue arrived requests as waiting.

        Parameters
        ----------
        request_ids : sequence of hashable ids (unique among requests in the policy).
        prompt_blocks : array-like (n,), ``P``: prompt blocks still to process.
        estimates : array-like (n,), ``r̂``: estimated total denoising rounds (admission
            predictor), default 0 (the ``r̂ = 0`` variant).
        kv_reservations : array-like (n,), worst-case KV footprint to reserve (unit of ``kv_budget``).
        arrival : optional array-like (n,) of arrival times; the arrival sequence (the tie-break)
            follows (arrival, request id). Without it, the order given is the arrival order.

        Returns
        -------
        int64 array (n,): the slot of each request, in the order given.

        Raises
        ------
        InputError
            Negative prompt blocks, non-finite or negative estimates, a duplicate id.
        ConfigError
            A reservation larger than the whole KV budget (the request could never be admitted).
        """
        ids = list(request_ids)
        n = len(ids)
        P = np.asarray(prompt_blocks, dtype=np.int64).reshape(-1)
        est = np.zeros(n) if estimates is None else np.asarray(estimates, dtype=np.float64).reshape(-1)
        kv = np.zeros(n) if kv_reservations is None else np.asarray(kv_reservations, dtype=np.float64).reshape(-1)
        if not (len(P) == len(est) == len(kv) == n):
            raise InputError(f"add_many got {n} ids but {len(P)} prompt_blocks, {len(est)} estimates, {len(kv)} reservations")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        # ufunc reductions (C-level) for the checks; the offending request is looked up only on failure
        if np.minimum.reduce(P) < 0:
            raise InputError(f"request {ids[int(np.argmax(P < 0))]!r} has negative prompt blocks")
        if not (np.minimum.reduce(est) >= 0 and np.maximum.reduce(est) < math.inf):  # False on a NaN too
            bad = int(np.argmax(~np.isfinite(est) | (est < 0)))
            raise InputError(f"request {ids[bad]!r} has estimate {est[bad]}: estimates must be finite and >= 0")
        if self.kv_budget < math.inf and np.maximum.reduce(kv) > self.kv_budget:  # nothing exceeds no budget
            bad = int(np.argmax(kv > self.kv_budget))
            raise ConfigError(
                f"KV budget {self.kv_budget:g} is smaller than request {ids[bad]!r}'s worst-case reservation "
                f"{kv[bad]:g}: raise the KV budget (it must hold at least one request)"
            )
        if len(set(ids)) < n or not self._slot_of.keys().isdisjoint(ids):  # set operations in C; the walk on failure
            seen: set = set()
            dup = next(i for i in ids if i in self._slot_of or i in seen or seen.add(i))
            raise InputError(f"request id {dup!r} is already queued: ids must be unique")

        slots = self._take_slots(n)
        # the kept plan stays: the short path (_replan) checks whether the waiting list's head, a new
        # request among them, would be admitted (and then ranks everything)
        seq = np.arange(self._seq_next, self._seq_next + n)  # the arrival sequence, in the order given
        if arrival is not None:  # ... or by (arrival, request id)
            order = np.lexsort((np.array([str(i) for i in ids]), np.asarray(arrival, dtype=np.float64)))
            seq[order] = self._seq_next + np.arange(n)
        self._seq_next += n
        self._P[slots], self._rhat[slots], self._kv[slots], self._seq[slots] = P, est, kv, seq
        self._tie[slots] = 1j * seq
        self._rounds[slots] = 0
        self._born[slots] = self.rounds
        self._preemptions[slots] = 0
        self._state[slots] = WAITING
        slot_list = slots.tolist()
        self._slot_of.update(zip(ids, slot_list))
        for slot, rid in zip(slot_list, ids):
            self._ids[slot] = rid
        entries = sorted(zip(self._keys(slots).tolist(), seq.tolist(), slot_list))
        if self._waiting and entries[0] < self._waiting[-1]:
            for entry in entries:
                bisect.insort(self._waiting, entry)
        else:
            self._waiting.extend(entries)
        if self.max_wait is not None:
            self._line_up(entries, float(self.rounds))  # the round just stamped in _born
        return slots

    def _line_up(self, entries: list, born: float) -> None:
        """Put waiting-list entries of requests that arrived in round ``born`` in the wait cap's line
        (rebuilt from the waiting list when stale entries outnumber the live ones, so it stays within
        twice the waiting list)."""
        line = self._wait_line
        if len(line) + len(entries) > 2 * len(self._waiting) + 64:
            line[:] = [(float(self._born[slot]), key, seq, slot) for key, seq, slot in self._waiting]
            heapq.heapify(line)
            return
        for key, seq, slot in entries:
            heapq.heappush(line, (born, key, seq, slot))

    # --- the round -----------------------------------------------------------------------------

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        """Rank key of the given slots: ``R = P + r̂`` (plus ``aging`` times the arrival round) or the
        arrival sequence."""
        if self.ranking == "remaining":
            if self.aging:
                return self._P[slots] + self._rhat[slots] + self.aging * self._born[slots]
            return self._P[slots] + self._rhat[slots]
        return self._seq[slots].astype(np.float64)

    def schedule(self) -> RoundPlan:
        """Admit waiting requests and pick this round's ``B`` requests (Algorithm 1, lines 2-9).

        Requests past the wait cap are admitted first (see the module docstring). Then the rest are
        ranked, waiting ∪ resident, by (key, arrival sequence). A waiting request is admitted when it
        ranks in the top ``B``, fewer than ``k * B`` requests are resident and its reservation fits
        the free KV budget (one that does not fit is passed over for the next, unless
        ``blocking_admission``: then admission stops there); then the ``B`` best-ranked resident
        requests run (with ``prefill_first``: the best-ranked ones that still have prompt blocks, if
        any do).
        """
        self.rounds += 1
        if self._kept is not None:
            plan = self._replan(*self._kept)
            if plan is not None:
                return plan
        res, z = self._ranked(self._resident)
        admitted, blocked = self._admit_due(len(res))
        if admitted:
            res, z = self._make_resident(res, z, admitted)
        if not blocked:
            ranked_in = self._admit_ranked(res, z)
            if ranked_in:
                res, z = self._make_resident(res, z, ranked_in)
                admitted += ranked_in
        self._resident = res
        pool, held_back = res, None
        if self.prefill_first:
            prefill = self._P[res] > 0
            if prefill.any():  # a subsequence of the ranking keeps its order; the held back keep admission order
                pool, held_back = res[prefill], res[~prefill]
                held_back = held_back[self._entered[held_back].argsort()]
        run, standby = pool[: self.slots], pool[self.slots:]

        # A preemption is a request displaced by ranking: one that ran last round and is still a
        # candidate now. Decoders held back by the prefill-first barrier are stalled, not preempted.
        # Residents are running or paused (admitted ones paused), so only the displaced runners
        # change state among the standby ones. (A handful of array operations: on a server this
        # runs on the scheduler thread every step.)
        preempted = standby[self._state[standby] == RUNNING]
        if held_back is None:
            paused = standby
        else:
            self._state[res] = PAUSED
            paused = np.concatenate([standby, held_back])
        if len(preempted):
            self._state[preempted] = PAUSED
            self._preemptions[preempted] += 1
        self._state[run] = RUNNING
        self._kept = (run, standby) if held_back is None and self._key_motion != "rise" else None
        self._kept_z = z[: len(run)] if self._key_motion == "none" else None
        return RoundPlan(run, self._P[run] > 0, np.asarray(admitted, dtype=np.int64) if admitted else NONE, paused,
                         preempted, standby)

    def _ranked(self, slots: np.ndarray, z: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``slots`` sorted by (key, arrival sequence), with their sort keys ``z`` (computed where not given).

        ``z = key + i·seq``: NumPy orders complex numbers by real part, then imaginary part, and seqs are
        unique and exact in a float64 (keys are finite: NaN or infinite estimates are refused or ignored
        where they come in), so one sort ranks them, as a lexsort of (key, seq) would; a stable
        sort (timsort) takes the nearly sorted resident set (see the module docstring) in about linear time.
        """
        if z is None:
            z = self._keys(slots) + self._tie[slots]
        order = z.argsort(kind="stable")  # the method: np.argsort adds a Python-level wrapper per call
        return slots[order], z[order]

    def _make_resident(self, res: np.ndarray, z: np.ndarray, admitted: list) -> tuple[np.ndarray, np.ndarray]:
        """The ranked resident slots and their sort keys with ``admitted`` (just taken off the waiting
        list) added; they are paused until they run."""
        adm = np.asarray(admitted, dtype=np.int64)
        if self.prefill_first:
            self._entered[adm] = self._entered_next + np.arange(len(adm))
            self._entered_next += len(adm)
        self._state[adm] = PAUSED
        return self._ranked(np.concatenate([res, adm]), np.concatenate([z, self._keys(adm) + self._tie[adm]]))

    def _admit_ranked(self, res: np.ndarray, z: np.ndarray) -> list:
        """Admit the waiting requests that rank in the top ``B`` and fit (Algorithm 1's admission), given
        the ranked residents and their sort keys; returns the slots admitted, taken off the waiting list,
        their KV counted."""
        if not self._waiting or len(res) >= self.max_resident:
            return []
        if len(res) >= self.slots:
            # the common case of a busy server: the best waiting request ranks below the B-th resident,
            # so none is admitted (the waiting list is sorted: its head is its best)
            if not self._waiting[0] < (*_key_seq(z, self.slots - 1), math.inf):
                return []
        head = self._waiting[: self.slots]
        thr = self._threshold(z, head)
        admitted, kept = [], []
        n_res = len(res)
        for pos, entry in enumerate(head):
            if entry > thr or n_res >= self.max_resident:
                kept.extend(head[pos:])
                break
            slot = entry[2]
            need = self._kv.item(slot)  # a Python float: the KV sums stay out of NumPy scalars
            if self.kv_used + need <= self.kv_budget:
                admitted.append(slot)
                self.kv_used += need
                n_res += 1
            elif self.blocking_admission:
                kept.extend(head[pos:])
                break
            else:
                kept.append(entry)
        if admitted:
            self._waiting[: len(head)] = kept
        return admitted

    def _due(self) -> tuple | None:
        """The waiting-list entry (key, seq, slot) of the first request in the wait cap's line (the
        oldest arrival round, then the best rank) if it has waited more than ``max_wait`` rounds,
        else None. Drops the line's stale entries (admitted, removed or re-keyed requests) from its
        front."""
        if self.max_wait is None or not self._waiting:
            return None
        line, waiting = self._wait_line, self._waiting
        while True:  # every waiting request is in the line, so a live entry comes before it runs out
            born, key, seq, slot = line[0]
            entry = (key, seq, slot)
            i = bisect.bisect_left(waiting, entry)
            if i < len(waiting) and waiting[i] == entry:
                return entry if self.rounds - born > self.max_wait else None
            heapq.heappop(line)

    def _fits(self, slot: int, n_res: int) -> bool:
        """Whether ``slot`` can be admitted beside ``n_res`` residents: a row free, its KV free."""
        return n_res < self.max_resident and self.kv_used + self._kv.item(slot) <= self.kv_budget

    def _admit_due(self, n_res: int) -> tuple[list, bool]:
        """Admit the requests past the wait cap, first in line first, each whatever its rank, while
        they fit; returns (the slots admitted, whether a due request does not fit: then nobody else
        is admitted this round, so the KV and the row it waits for are its own once freed)."""
        admitted = []
        while (entry := self._due()) is not None:
            slot = entry[2]
            if not self._fits(slot, n_res):
                return admitted, True
            del self._waiting[bisect.bisect_left(self._waiting, entry)]
            heapq.heappop(self._wait_line)  # the entry _due() just found at its front
            self.kv_used += self._kv.item(slot)
            admitted.append(slot)
            n_res += 1
        return admitted, False

    def steady_limit(self, plan: RoundPlan) -> float:
        """Rounds ``plan`` may repeat before the wait cap can change it: until the first request in
        the wait line falls due (it is then admitted, or admission stops behind it); unbounded
        without a cap, with nobody waiting or once the first is due (it stays first until it is
        admitted, which takes a finish). A simulator that skips ahead stops there."""
        if self.max_wait is None or not self._waiting or self._due() is not None:
            return math.inf
        return int(self._wait_line[0][0]) + self.max_wait + 1 - self.rounds

    def _replan(self, run: np.ndarray, standby: np.ndarray) -> RoundPlan | None:
        """This round's plan when only the last plan's runs, finishes and arrivals have happened since
        it (no refinement, override or change of ``P`` from outside): the same plan with its runs
        re-ordered and the rows of finished runners given to the best standby requests, or None where
        a waiting request may now be admitted (then :meth:`schedule` ranks everything).

        Running a round lowers a runner's key or keeps it (``P`` or ``r̂`` drop, not below zero; with
        ``aging`` its arrival term stays) and leaves every other key as it was, so each runner still
        ranks ahead of every paused request it ranked ahead of, and the paused ones keep their order:
        the ranking is the runners re-sorted, then the standby list as it was. So the same ``B`` run
        (less those that finished, whose rows go to the head of the standby list), nobody is
        preempted, and only the runners' own order needs sorting (none where keys stay). On a busy
        server that is most rounds (a handful of array calls over ``B`` requests instead of a ranking
        of the whole resident set).
        """
        z = self._kept_z
        if z is None:
            run, z = self._ranked(run)
        promoted = standby[: self.slots - len(run)]
        if len(promoted):
            standby = standby[len(promoted):]
            run = np.concatenate([run, promoted])
            z = np.concatenate([z, self._keys(promoted) + self._tie[promoted]])
        due = self._due()
        if due is not None:
            if self._fits(due[2], len(self._resident)):
                return None  # admitted this round, whatever its rank
            # else admission waits for it: nobody else is admitted
        elif self._waiting and len(self._resident) < self.max_resident:
            if len(run) < self.slots:
                return None
            # the B-th best request: a waiting one ahead of it would be admitted
            if self._waiting[0] < (*_key_seq(z, len(z) - 1), math.inf):
                return None
        if len(promoted):
            self._state[promoted] = RUNNING
        self._kept = (run, standby)
        self._kept_z = z if self._key_motion == "none" else None
        return RoundPlan(run, self._P[run] > 0, NONE, standby, NONE, standby)

    def _threshold(self, z: np.ndarray, head: list) -> tuple:
        """(key, seq) of the ``B``-th best request in waiting ∪ resident (the top-B cut-off), given the
        ranked residents' sort keys ``z`` (see :meth:`_ranked`) and the head of the waiting list.

        Both sides are sorted by (key, seq) (seqs are unique), so the cut-off is found by a binary
        search for how many of the ``B`` best come from ``head``: a few comparisons instead of
        building and sorting the union on every call."""
        b, m, h = self.slots, len(z), len(head)
        if m + h <= b:
            return (math.inf, 0, 0)
        lo, hi = max(0, b - m), min(b, h)
        while lo < hi:  # the smallest j (taken from head) whose next head entry is not better than resident b - j - 1
            j = (lo + hi) // 2
            if head[j][:2] < _key_seq(z, b - j - 1):
                lo = j + 1
            else:
                hi = j
        i = b - lo  # taken from the residents
        if lo == 0:
            cut = _key_seq(z, i - 1)
        elif i == 0:
            cut = head[lo - 1][:2]
        else:
            cut = max(_key_seq(z, i - 1), head[lo - 1][:2])
        return (cut[0], cut[1], math.inf)

    def ran(self, plan: RoundPlan, slots) -> None:
        """The server ran ``slots`` this round instead of ``plan.run``: its own budgets left some
        picks out (they are paused: waiting for the next round, not preempted) or ran standby
        requests in their place (``plan.standby``; they are running, and one the plan counted as
        preempted was not).

        Raises
        ------
        InputError
            A slot that is not resident (waiting or free).
        """
        slots = np.asarray(slots, dtype=np.int64)
        state = self._state[slots]
        outside = (state == WAITING) | (state == FREE)
        if outside.any():
            raise InputError(f"ran() got slots {slots[outside].tolist()} that are not resident: only the plan's "
                             "picks and its standby requests can run")
        self._kept = None
        self._state[plan.run] = PAUSED
        self._state[slots] = RUNNING
        if len(plan.preempted):  # a request the plan displaced but the server ran after all was not preempted
            ran_now = set(slots.tolist())  # a handful of slots: a set beats np.isin's setup
            self._preemptions[[s for s in plan.preempted.tolist() if s in ran_now]] -= 1

    def complete_round(self, plan: RoundPlan, finished=None, refined=None, repeat: int = 1) -> np.ndarray:
        """Update the fields of the requests that ran (Algorithm 1, lines 11-20).

        Parameters
        ----------
        plan : the :class:`RoundPlan` this round ran.
        finished : bool array (n_run,), True where that request produced its last block.
        refined : float array (n_run,), the refined remaining-rounds estimate of requests whose
            first denoising round this was (NaN or absent: no refinement, ``r̂`` is decremented).
        repeat : the same plan ran this many rounds in a row (a simulator shortcut; valid only while
            no request changes phase, finishes, arrives or is refined in between, which the caller
            guarantees; ``refined`` is then ignored).

        Returns
        -------
        int64 array: the slots that finished and were freed (their slots may be reused).
        """
        self.rounds += repeat - 1  # schedule() counted the first
        return self.complete_slots(plan.run, plan.prompt, finished, refined if repeat == 1 else None, repeat)

    def complete_slots(self, slots, prompt, finished=None, refined=None, rounds=1) -> np.ndarray:
        """Update the fields of the requests that ran, whichever they were (vectorised).

        Parameters
        ----------
        slots : int64 array (n,), slots that ran: the plan's ``run``, or the slots given to :meth:`ran`.
        prompt : bool array (n,), True where that slot processed a prompt block (``P`` lowers by
            one, not below zero), else denoising rounds.
        finished : bool array (n,), True where that request produced its last block (it leaves).
        refined : float array (n,), the refined remaining-rounds estimate, used where this was the
            request's first denoising round and the value is finite.
        rounds : int or int array (n,): denoising rounds each ran (a synchronous server runs a whole
            block in one step); a refined estimate counts from the first of them.

        Returns
        -------
        int64 array: the slots that finished and were freed.
        """
        # C-level array calls only (no numpy function written in Python): a server runs this every step,
        # and the phase it skips when no slot is in it (on a busy server most rounds are all denoising)
        slots = np.asarray(slots, dtype=np.int64)
        prompt = np.asarray(prompt, dtype=bool)
        per_request = isinstance(rounds, (list, tuple)) or getattr(rounds, "ndim", 0)
        # per request: a synchronous server; else one count, as a 0-d array
        steps = np.asarray(rounds, dtype=np.int64) if per_request else np.array(int(rounds), dtype=np.int64)
        n_prompt = np.count_nonzero(prompt)
        if n_prompt:
            pr = slots if n_prompt == len(slots) else slots[prompt]
            self._P[pr] = np.maximum(self._P[pr] - (steps[prompt] if per_request else steps), 0)
        if refined is not None:  # r̂ may rise: the next round ranks everything
            self._kept = None
        if n_prompt < len(slots):
            denoise = ~prompt if n_prompt else slice(None)  # all denoising: views, no mask
            self._denoised(slots[denoise], steps[denoise] if per_request else steps,
                           None if refined is None else np.asarray(refined, dtype=np.float64)[denoise])
        if finished is None:
            return NONE.copy()
        finished = np.asarray(finished, dtype=bool)
        done = slots[finished]
        kept = self._kept
        self._release(done)
        if len(done) and kept is not None and slots is kept[0]:  # the kept plan's runners: the rest keep it (_replan)
            self._kept = (slots[~finished], kept[1])
            if self._kept_z is not None:
                self._kept_z = self._kept_z[~finished]
        return done

    def _denoised(self, dn: np.ndarray, steps, ref: np.ndarray | None) -> None:
        """Count ``steps`` denoising rounds run by ``dn`` and lower their ``r̂`` (not below zero); where
        this was a request's first denoising round and ``ref`` is finite, ``r̂`` becomes ``ref``
        counted from the first of those rounds."""
        done_rounds = self._rounds[dn]
        rhat = np.maximum(self._rhat[dn] - steps, 0.0)
        if ref is not None:
            rhat = np.where((done_rounds == 0) & np.isfinite(ref), np.maximum(ref - (steps - 1), 0.0), rhat)
        self._rounds[dn] = done_rounds + steps
        self._rhat[dn] = rhat

    def refine(self, slots, remaining) -> None:
        """Replace ``r̂`` of resident requests by fresh estimates of their remaining denoising rounds
        (clamped at zero): a refinement after a later round (``simulate --refine-every``, the DWISE paper's
        Table 6). Call it after :meth:`complete_round`, which keeps decrementing ``r̂`` in between.
        A NaN or infinite estimate (a broken graph) leaves that request's ``r̂`` as it was, as
        :meth:`complete_slots` does: NaN would rank anywhere."""
        self._kept = None
        slots = np.asarray(slots, dtype=np.int64)
        remaining = np.broadcast_to(np.asarray(remaining, dtype=np.float64), slots.shape)
        fresh = np.isfinite(remaining)
        self._rhat[slots[fresh]] = np.maximum(remaining[fresh], 0.0)

    def complete(self, request_id, refined: float | None = None, finished: bool = False, prompt: bool | None = None) -> None:
        """Per-request form of :meth:`complete_slots` for a server walking its batch.

        ``prompt`` says whether the request processed a prompt block this round; by default it is
        inferred from ``P > 0`` (the policy's own record, which is exact).
        """
        slot = self._slot(request_id)
        self._kept = None  # any request, not only a runner
        if prompt is None:
            prompt = self._P[slot] > 0
        self.complete_slots([slot], [prompt], [finished], [math.nan if refined is None else refined])

    def set_prompt_blocks(self, request_id, prompt_blocks: int) -> None:
        """Set ``P`` from what the server knows now (a prefix-cache hit covers some prompt blocks).

        A waiting request keeps its place in the sorted waiting list under its new key.
        """
        slot = self._slot(request_id)
        prompt_blocks = int(prompt_blocks)
        if prompt_blocks < 0:
            raise InputError(f"request {request_id!r}: prompt blocks must be >= 0, got {prompt_blocks}")
        if prompt_blocks == self._P[slot]:
            return
        self._kept = None
        if self._state[slot] == WAITING:
            old = next(e for e in self._waiting if e[2] == slot)
            self._waiting.remove(old)
            self._P[slot] = prompt_blocks
            entry = (float(self._keys(np.array([slot]))[0]), old[1], slot)
            bisect.insort(self._waiting, entry)
            if self.max_wait is not None:
                # its old entry there no longer matches: dropped when met
                self._line_up([entry], float(self._born[slot]))
        else:
            self._P[slot] = prompt_blocks

    def remove(self, request_id) -> None:
        """Drop a request in any state (abort), freeing its KV reservation."""
        slot = self._slot(request_id)
        self._kept = None
        if self._state[slot] == WAITING:
            self._waiting = [e for e in self._waiting if e[2] != slot]
            self._state[slot] = FREE
            self._free_slots([slot])
        else:
            self._release(np.array([slot], dtype=np.int64))

    def _release(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        self._kept = None
        self.kv_used = max(self.kv_used - float(np.add.reduce(self._kv[slots])), 0.0)
        self._state[slots] = FREE
        self._resident = self._resident[self._state[self._resident] != FREE]
        self._free_slots(slots.tolist())

    def _free_slots(self, slots: list) -> None:
        slot_of, ids = self._slot_of, self._ids
        for slot in slots:
            del slot_of[ids[slot]]
            ids[slot] = None
        self._free.extend(slots)

    def _slot(self, request_id) -> int:
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise InputError(f"request {request_id!r} is not in the policy (never added, or already finished)") from None

    # --- views ---------------------------------------------------------------------------------

    def ids(self, slots) -> list:
        """Request ids of the given slots."""
        return [self._ids[s] for s in np.asarray(slots).tolist()]

    def slots_of(self, request_ids) -> np.ndarray:
        """Slots of the given request ids (int64 array), which must be in the policy."""
        try:
            return np.fromiter((self._slot_of[rid] for rid in request_ids), dtype=np.int64)
        except KeyError as err:
            raise InputError(f"request {err.args[0]!r} is not in the policy (never added, or already finished)") from None

    def denoising_rounds(self, slots) -> np.ndarray:
        """Denoising rounds each slot's request has run (int64 array)."""
        return self._rounds[np.asarray(slots, dtype=np.int64)]

    def prompt_blocks(self, slots) -> np.ndarray:
        """``P`` of each slot's request (int64 array)."""
        return self._P[np.asarray(slots, dtype=np.int64)]

    def remaining_work(self, request_id) -> float:
        """``R = P + r̂`` of one request."""
        slot = self._slot(request_id)
        return float(self._P[slot] + self._rhat[slot])

    def fields(self, request_id) -> dict:
        """The three per-request fields: ``P``, ``r_hat`` and ``state`` (waiting, running, paused)."""
        slot = self._slot(request_id)
        state = {WAITING: "waiting", RUNNING: "running", PAUSED: "paused"}[int(self._state[slot])]
        return {"P": int(self._P[slot]), "r_hat": float(self._rhat[slot]), "state": state,
                "denoising_rounds": int(self._rounds[slot]), "preemptions": int(self._preemptions[slot])}

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_resident(self) -> int:
        return len(self._resident)

    def preemptions(self, slots) -> np.ndarray:
        """Times each slot's request was paused after running (before it is freed)."""
        return self._preemptions[np.asarray(slots, dtype=np.int64)]
