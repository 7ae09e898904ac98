"""The hook's per-request table, the TP ranks' shared estimates and the hook's counters.

The policy is first reconciled with SGLang's own queues when their sizes say something changed
behind its back (requests SGLang aborted leave it; requests ``pause_generation(mode="retract")``
queued again while leaving them in the dLLM manager stay resident, once); new requests are
registered with a :class:`~dwise_predict.serving.policy.DwisePolicy` (``P`` = prompt blocks, ``r̂`` =
the bundle's admission estimate, KV reservation = prompt + output budget + slack blocks). A request
whose reservation exceeds the whole budget, or that comes under a request id the table already holds
for another request, is refused alone, as SGLang refuses a queued request (:meth:`RequestTable.refuse`),
not through ``abort_request``, which aborts every request whose id starts with the one given.

With a quality monitor (:mod:`~dwise_predict.serving.monitor`: a bundle, on the rank that refines),
the table keeps per policy slot the estimates the request was served with (admission at
registration, the refinement of its first denoising round, the bundle version) and, when SGLang
finishes it, hands them to the monitor beside the denoising rounds the policy counted for it, and
its category (:func:`category_of`).

With a recorder, the table tells it when a request it registered leaves without the hook seeing it
finish in a batch (``finished`` or ``left_unfinished``, once per request: ``forget`` alone is also
the path of a request SGLang queued again, which stays recorded), and when it refuses one.

On a server with several TP ranks (each its own scheduler, CPU and GPU), the estimates that rank
requests are the first rank's on every rank (:class:`_RankShare`, over the scheduler's
``dp_tp_group``), so a last-bit difference between GPUs cannot build different batches.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import compress, repeat

import numpy as np

from dwise_predict.engine import prefill_rounds

# a client names its request's category in SGLang's sampling parameters: {"custom_params":
# {"dwise_category": "math"}} (SamplingParams.custom_params, which reaches the scheduler's Req as sent)
CATEGORY_PARAM = "dwise_category"
LIVE_CATEGORY = "live"  # a request that names none
MAX_CATEGORY_CHARS = 64  # a client's string, kept in the window, the traces and the manifest: bounded


_rid = operator.attrgetter("rid")
_origin = operator.attrgetter("origin_input_ids")
_output = operator.attrgetter("output_ids")
_max_new_tokens = operator.attrgetter("sampling_params.max_new_tokens")


def category_of(req) -> str:
    """The category the client named for ``req`` (its ``custom_params["dwise_category"]``, a string
    of at most :data:`MAX_CATEGORY_CHARS` characters, longer ones cut), else ``"live"``. Returned as
    sent: whoever prints it escapes it for the medium (:mod:`dwise_predict.text`)."""
    params = getattr(req.sampling_params, "custom_params", None)
    category = params.get(CATEGORY_PARAM) if isinstance(params, dict) else None
    if not isinstance(category, str) or not category.strip():
        return LIVE_CATEGORY
    return category[:MAX_CATEGORY_CHARS]


def _aborted(req) -> bool:
    """Whether SGLang finished ``req`` with an abort (its finish reason's type; the fake's a string)."""
    reason = req.finished_reason
    to_json = getattr(reason, "to_json", None)
    return "abort" in str(to_json().get("type") if to_json is not None else reason).lower()


@dataclass
class HookStats:
    """What the hook did, for logs and tests (all counts since install).

    rounds : scheduler steps the policy planned.
    admitted : requests the policy moved into SGLang's dLLM queue.
    finished : requests that left the policy because SGLang finished them.
    vanished : requests that left because SGLang dropped them from every queue (``abort_request``).
    retracted : requests SGLang sent back to its waiting queue with their KV released
        (``pause_generation(mode="retract")``, which leaves them in the dLLM manager's queues too:
        they stay resident, the duplicate leaves the waiting queue, and ``P`` follows the prompt and
        output blocks SGLang re-encodes).
    oversized : requests refused because their KV reservation exceeds the whole budget.
    duplicates : requests refused because they came under a request id the hook holds for another
        request (the table, the policy and SGLang's dLLM queues are keyed by it).
    prefix_blocks : prompt blocks a prefix-cache hit removed from ``P``.
    budget_overrides : policy picks that SGLang's batch budget (its ``PrefillAdder``: KV memory, the
        input-token budget ``--max-prefill-tokens``, request limits) left out of a step; DWISE's
        order yields to those budgets, and the policy records them as paused, not run.
    backfilled : standby requests (ranked next) run in a step in the slots of picks the adder left
        out, where the adder still took requests (its ``budget_state`` said CONTINUE).
    idle : IDLE forwards (DP attention's MLP sync: no requests) that went through the hook.
    host_transfers : device-to-host copies the hook made: one per step that ran a first denoising
        round (refinement or recording), none in any other step (nor on a TP rank that neither
        refines nor records).
    refined : requests refined on their first denoising round.
    prompt_from_cache : refined requests that ran no prompt block of their own after a prefix-cache
        hit on every full block: their ``prompt_last`` input was the row an earlier request's forward
        computed for the same last full block over the same tokens.
    prompt_from_leftover : refined requests that ran no prompt block of their own and found no such
        row (a prompt shorter than a block, or a hit whose block has left :class:`_PromptRows`): their
        ``prompt_last`` input was the mean of their leftover prompt rows in the first denoising forward.
    prompt_from_training_mean : refined requests whose prompt rows SGLang never computed in this
        process: a block-aligned prompt cached whole (no leftover tokens) whose last block has left
        :class:`_PromptRows` (or ``prompt_cache=0``). Their ``prompt_last`` input was the training
        requests' mean (``LoadedBundle.prompt_last_mean``), which the graph standardises to zero.
    swaps : times the hook changed the bundle it serves (``DwiseHook.swap``: a new version it follows,
        or a rollback).
    rollbacks : of those swaps, the ones back to the previous version because the monitor found the
        new one ranking worse (:class:`~dwise_predict.serving.sglang.follow.HotSwap`).
    """

    rounds: int = 0
    admitted: int = 0
    finished: int = 0
    vanished: int = 0
    retracted: int = 0
    oversized: int = 0
    duplicates: int = 0
    prefix_blocks: int = 0
    budget_overrides: int = 0
    backfilled: int = 0
    idle: int = 0
    host_transfers: int = 0
    refined: int = 0
    prompt_from_cache: int = 0
    prompt_from_leftover: int = 0
    prompt_from_training_mean: int = 0
    swaps: int = 0
    rollbacks: int = 0


class _RankShare:
    """Values every TP rank serving one batch must hold bit for bit, taken from the group's first
    rank: the estimates that rank requests (admission at arrival, refinement at the first denoising
    round). Each rank computes them on its own CPU and GPU, and a last-bit difference between ranks
    in a tie would build different batches on different ranks, whose collectives then wait for
    each other forever. Everything else the policy reads (token counts, prefix matches, SGLang's
    queues) is the same on every rank by SGLang's own design: it broadcasts the requests to the TP
    ranks (``broadcast_pyobj`` over the TP group's CPU group) before any rank schedules them.

    ``group``: the scheduler's ``dp_tp_group`` (SGLang's ``GroupCoordinator`` of the ranks sharing
    one waiting queue: the TP group, or the attention-TP group under DP attention); the values cross
    its gloo ``cpu_group`` as one float64 tensor (no pickle), from ``ranks[0]``.
    """

    def __init__(self, group):
        self.group, self.source = group.cpu_group, group.ranks[0]
        self.is_source = group.rank_in_group == 0

    def __call__(self, values, n: int):
        """``values`` (n,) on the first rank (ignored elsewhere) -> the first rank's (n,) float64."""
        import torch

        if self.is_source:
            buffer = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        else:
            buffer = torch.empty(n, dtype=torch.float64)
        torch.distributed.broadcast(buffer, src=self.source, group=self.group)
        return buffer.numpy()


class RequestTable:
    """The requests the policy holds, by id and by policy slot, and what the hook keeps per slot.
    Created with the policy, on the scheduler's first step.

    policy : the :class:`~dwise_predict.serving.policy.DwisePolicy` (its slots index the lists here).
    share : a :class:`_RankShare` when several TP ranks schedule one batch, else None.
    block_size : SGLang's dLLM block size.
    sglang : the :class:`~dwise_predict.serving.sglang.surface.ResolvedSglang` (its ``AbortReq``).
    buffers : the :class:`~dwise_predict.serving.sglang.buffers.PoolingBuffers` (prompt-block rows
        a request leaving frees), or None without pooling.
    monitor : the :class:`~dwise_predict.serving.monitor.QualityMonitor` the finished requests go
        to, or None (no bundle, or a TP rank that does not refine).
    """

    def __init__(self, policy, share, block_size: int, slack_blocks: int, bundle, features, recorder,
                 stats: HookStats, sglang, buffers, monitor=None):
        self.policy, self.share, self.block_size, self.slack_blocks = policy, share, block_size, slack_blocks
        self.bundle, self.features, self.recorder, self.stats = bundle, features, recorder, stats
        self.sglang, self.buffers, self.monitor = sglang, buffers, monitor
        self.health_prefix = None  # the rid prefix of SGLang's health probe, which the monitor leaves out
        self.abort_kinds: dict = {}  # finish-reason class -> whether it is an abort (aborted)
        if monitor is not None:
            # imported as the table is made (the scheduler's first step), not at the first finish mid-serving:
            # collectors.live loads the collect stack (0.1 s holding the scheduler thread)
            from dwise_predict.collectors.live import HEALTH_CHECK_RID_PREFIX

            self.health_prefix = HEALTH_CHECK_RID_PREFIX
        self.reqs: dict = {}  # rid -> Req, for requests the policy holds
        self.req_at = np.empty(0, dtype=object)  # policy slot -> its Req (each also carries its _dwise_slot)
        # per policy slot (Python lists, indexed like the policy's own arrays, grown with them in register:
        # read and written for the few rows of a step at a prompt block or a first round, where a list
        # index costs less than a numpy call)
        self.expect_prefix: list = []  # SGLang's prefix_len once its last prompt block ran as planned
        self.own_row: list = []  # its row of the buffers' own_last (-1: none)
        # what the request was served with, for the monitor: its admission estimate, its refined one
        # (total rounds; NaN until its first denoising round) and the bundle version that made them
        self.served_admission: list = []
        self.served_refined: list = []
        self.served_version: list = []

    def reconcile(self, scheduler) -> None:
        """Drop what SGLang no longer holds; settle what it queued again.

        SGLang's ``abort_request`` pops requests from its queues and ``filter_finished_reqs`` drops
        finished ones without telling a custom policy. ``pause_generation(mode="retract")`` releases
        the KV of the last batch's requests and appends them to the waiting queue, but leaves them in
        the dLLM manager's queues (SGLang 0.5.23 never retracts a dLLM request otherwise: the running
        batch is emptied every step): such a request stays resident here, and its duplicate leaves
        the waiting queue (SGLang's own ``add_waiting_reqs`` would refuse it as redundant). One that
        SGLang queued again without the manager is registered again with the work it has left.
        """
        manager = scheduler.dllm_manager
        queued = {id(r) for r in scheduler.waiting_queue}
        held = {id(r) for r in manager.waiting_queue} | {id(r) for r in manager.staging_queue}
        duplicates = set()
        recorder = self.recorder
        for rid, req in list(self.reqs.items()):
            in_queue, in_manager = id(req) in queued, id(req) in held
            if req.finished() or not (in_queue or in_manager):
                if req.finished() and self.monitor is not None:
                    self.observe_finished([req], [req._dwise_slot])  # before its slot is freed
                self.forget(rid)
                if req.finished():
                    self.stats.finished += 1
                    if recorder is not None:
                        recorder.finished(req, category_of(req))
                else:
                    self.stats.vanished += 1
                    if recorder is not None:
                        recorder.left_unfinished(req, "aborted")  # its rows freed now, not at shutdown
            elif in_queue and in_manager:
                duplicates.add(id(req))
                self.stats.retracted += 1
                if self.recorder is not None:
                    self.recorder.arrived(req, self.block_size)  # marks it: its output is re-encoded
            elif in_queue and self.policy.fields(rid)["state"] != "waiting":
                self.forget(rid)  # registered again, with the work it has left
                self.stats.retracted += 1
        if duplicates:
            scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in duplicates]

    def forget(self, rid, policy_too: bool = True) -> None:
        """The request leaves the hook (and the policy, unless it already freed its slot)."""
        req = self.reqs.pop(rid)
        if policy_too:
            self.policy.remove(rid)
        slot = req._dwise_slot
        self.req_at[slot] = None
        req._dwise_slot = -1
        if self.own_row[slot] >= 0:
            self.buffers.release_own(self.own_row, (slot,))

    def keep_refined(self, slots: list, refined: list) -> None:
        """The refinements of the requests in ``slots``, whose first denoising round this step was, as
        the policy takes them (remaining rounds after that round, clamped at zero), kept in total
        rounds as the monitor compares them: that first round plus the remaining. NaN stays NaN (none:
        the policy keeps ranking by the admission estimate)."""
        served = self.served_refined
        for slot, value in zip(slots, refined):
            served[slot] = 1.0 + max(value, 0.0) if math.isfinite(value) else math.nan

    def observe_finished(self, reqs: list, slots: list) -> None:
        """Hand the monitor the requests SGLang finished (``slots``: their policy slots, read before
        any is reused): what each was served with beside the denoising rounds the policy counted for
        it. Left out: an abort (its rounds were cut short), SGLang's own health probe, and a request
        that ran no denoising round."""
        rounds = self.policy.denoising_rounds(slots).tolist()
        admission, refined, version = self.served_admission, self.served_refined, self.served_version
        observe, health = self.monitor.observe, self.health_prefix
        for req, slot, n in zip(reqs, slots, rounds):
            if n > 0 and not self.aborted(req) and not str(req.rid).startswith(health):
                observe(admission[slot], refined[slot], n, category_of(req), version[slot])

    def aborted(self, req) -> bool:
        """:func:`_aborted`, asked once per finish-reason class: each of SGLang's classes has one type
        (``FINISH_ABORT``'s is "abort"), and its ``to_json`` builds a dict per call."""
        kind = type(req.finished_reason)
        known = self.abort_kinds.get(kind)
        if known is None:
            known = _aborted(req)
            if hasattr(kind, "to_json"):  # not a bare string (the test fake's)
                self.abort_kinds[kind] = known
        return known

    def register(self, scheduler, reqs: list, version: str = "none") -> None:
        """Add newly arrived requests to the policy, admission estimates in one batch (the first TP
        rank's, on every rank). ``version``: the serving bundle's (``DwiseHook.bundle_version``),
        which the monitor files their estimates under.

        A request whose worst-case KV reservation exceeds the whole budget could never be admitted,
        and a second request under one id cannot be told apart from the first: each is refused
        (:meth:`refuse`) with a message saying why, and the rest of the batch is registered.
        """
        bs = self.block_size
        if len(set(map(_rid, reqs))) < len(reqs):  # two arrivals under one id: the first is kept
            reqs = self.first_of_each_id(scheduler, reqs)
        # what is still to encode: the prompt, plus the output of a request queued again (re-encoded)
        prompt = list(map(len, map(_origin, reqs)))
        seen = list(map(operator.add, prompt, map(len, map(_output, reqs))))
        slack = self.slack_blocks  # a reservation: ceil((prompt + max_new_tokens) / bs) blocks, plus the slack
        kv = [(-(-(n + m) // bs) + slack) * bs for n, m in zip(prompt, map(_max_new_tokens, reqs))]
        if not max(kv) <= self.policy.kv_budget:  # (not `>`: a NaN budget refuses every request, as each `<=` does)
            fits = [k <= self.policy.kv_budget for k in kv]
            refused = [(req, f"dwise: request {req.rid} needs a worst-case KV reservation of {k:g} tokens (prompt + "
                             f"max_new_tokens + slack) but the DWISE KV budget is {self.policy.kv_budget:g}: lower "
                             "max_new_tokens or raise the budget") for req, k, ok in zip(reqs, kv, fits) if not ok]
            self.refuse(scheduler, refused)
            self.stats.oversized += len(refused)
            if self.recorder is not None:
                for req, _ in refused:
                    self.recorder.left_unfinished(req, "aborted")  # never registered: counted here, once
            reqs, seen, kv = (list(compress(x, fits)) for x in (reqs, seen, kv))
            if not reqs:
                return
        # no prefix is matched before SGLang stages the request; P follows the match from then on
        P = list(map(prefill_rounds, seen, repeat(bs)))
        estimates = np.zeros(len(reqs))
        if self.bundle is not None:
            if self.share is None or self.share.is_source:
                estimates = self.bundle.admission(np.asarray(list(map(self.features, reqs)), dtype=np.float32))
            if self.share is not None:
                estimates = self.share(estimates, len(reqs))
        estimates = np.maximum(np.asarray(estimates, dtype=np.float64), 0.0)
        rids = list(map(_rid, reqs))
        slots = self.policy.add_many(rids, P, estimates, kv)
        slot_list = slots.tolist()
        if len(self.req_at) <= max(slot_list):
            more = max(len(self.req_at), max(slot_list) + 1)
            self.req_at = np.concatenate([self.req_at, np.empty(more, dtype=object)])
            self.own_row.extend([-1] * more)
            self.expect_prefix.extend([-1] * more)
            self.served_admission.extend([math.nan] * more)
            self.served_refined.extend([math.nan] * more)
            self.served_version.extend([version] * more)
        if self.monitor is not None:
            for slot, estimate in zip(slot_list, estimates.tolist()):
                self.served_admission[slot], self.served_refined[slot] = estimate, math.nan
                self.served_version[slot] = version
        self.reqs.update(zip(rids, reqs))
        for r, slot in zip(reqs, slot_list):
            self.req_at[slot] = r
            self.expect_prefix[slot] = -1  # (own_row is -1 already: forget released the slot's row)
            r._dwise_slot = slot
        if self.recorder is not None:
            for r in reqs:
                self.recorder.arrived(r, bs)

    def refuse_held_ids(self, scheduler) -> None:
        """Refuse each request in SGLang's waiting queue under an id the table holds for another request
        (a walk of the queue: run with :meth:`reconcile`, whose counts such a request sets off)."""
        held = self.reqs
        self.refuse_duplicates(scheduler, [r for r in scheduler.waiting_queue if held.get(r.rid, r) is not r])

    def first_of_each_id(self, scheduler, reqs: list) -> list:
        """``reqs`` (arrivals) less each that came under the id of an earlier one, which is refused."""
        first, kept, again = {}, [], []
        for r in reqs:
            (kept if first.setdefault(r.rid, r) is r else again).append(r)
        self.refuse_duplicates(scheduler, again)
        return kept

    def refuse_duplicates(self, scheduler, duplicates: list) -> None:
        """Refuse requests whose id another request holds. Never told to the recorder, which keys
        requests by id too: the id is the other request's there."""
        if duplicates:
            self.refuse(scheduler, [(r, f"dwise: request id {r.rid} is already held by another request: send it "
                                        "under an id of its own") for r in duplicates])
            self.stats.duplicates += len(duplicates)

    def refuse(self, scheduler, refused: list) -> None:
        """End each ``(request, message)`` of ``refused``, requests in SGLang's waiting queue that no
        batch ran, as SGLang ends a queued request it refuses (``Scheduler._abort_on_queued_limit``):
        out of the waiting queue, its cache-side state released (``_release_aborted_request``), its
        beam group retired, and its client sent the message, HTTP 400 (``send_abort_output``). Only
        these requests: SGLang's ``abort_request`` would also abort every request whose id starts with
        theirs (``req-1`` takes ``req-10``)."""
        gone = {id(req) for req, _ in refused}
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in gone]
        for req, message in refused:
            scheduler._release_aborted_request(req)
            scheduler.beam_coordinator.retire_group(req)
            scheduler.send_abort_output(self.sglang.abort_req(req.rid, message), req)
