"""The hook: one method per SGLang entry point it takes over, at the four points of the DWISE paper's §5.1.

- **admission** — ``SchedulerDllmMixin._fetch_waiting_reqs`` is replaced
  (:meth:`DwiseHook.fetch_waiting_reqs`): the request table is reconciled with SGLang's queues and
  new requests registered (:mod:`~dwise_predict.serving.sglang.requests`), the policy ranks waiting
  ∪ resident, and the admitted requests move into the dLLM manager's queue (SGLang's resident set);
  where ``SGLANG_REQ_WAITING_TIMEOUT`` is set, the policy's wait cap first follows it, so a request
  is admitted before SGLang's timeout would abort it in the waiting queue
  (:mod:`~dwise_predict.serving.sglang.timeout`);
- **batch formation** — ``SchedulerDllmMixin._process_dllm_batches`` is replaced
  (:meth:`DwiseHook.process_dllm_batches`): the ``B`` resident requests the policy picked go to
  SGLang's own ``_process_batch_by_phase``, prompt and denoising blocks in one ``DLLM_EXTEND`` batch
  (no prefill-first barrier). SGLang's adder still applies its budgets; a pick it leaves out is
  recorded as paused (``DwisePolicy.ran``), and while the adder still takes requests the
  next-ranked residents are offered for the free slots in the same step (both counted in
  :class:`~dwise_predict.serving.sglang.requests.HookStats`); after staging, ``P`` follows the
  prefix SGLang matched (``engine.prefill_rounds``). Models that encode the prompt in a separate
  pass (``requires_separate_context_encoding``) cannot mix phases: there the resident queue is only
  reordered and SGLang's own batch former runs;
- **result processing** — ``SchedulerDllmMixin.process_batch_result_dllm`` is wrapped
  (:meth:`DwiseHook.process_batch_result_dllm`): after SGLang commits outputs, the policy's fields
  are updated for every request of the batch in one vectorised call, with the refined estimate for
  requests whose first denoising round this was (and the recorder, in recording mode, gets the
  request's forwards and, host-side, its pooled rows); with a bundle, each finished request's
  served estimates and rounds go to the quality monitor (:mod:`~dwise_predict.serving.monitor`),
  whose summary :mod:`~dwise_predict.serving.sglang.metrics` publishes;
- **refinement input** — ``LogitsProcessor._get_dllm_logits`` is wrapped
  (:meth:`DwiseHook.get_dllm_logits`) to mean-pool each request's block rows into the static buffer
  of :mod:`~dwise_predict.serving.sglang.buffers`; ``DllmAlgorithm.run`` is wrapped
  (:meth:`DwiseHook.run`) to fill that buffer with NaN before a step (until the first refinement has
  checked it) and read the step's first forward's rows from it (copied out only if a second forward
  follows). The same first forward's early signals (:mod:`~dwise_predict.serving.sglang.signals`)
  are computed from its ``full_logits`` after the forward returns. The refinement's ``prompt_last``
  input is the row of the request's last prompt block; a prompt shorter than a block, or a prefix
  hit whose block is not kept, gets the mean of its leftover prompt rows in its first denoising
  forward, as the decoder records for short prompts. A dLLM request's fill ids end in a mask block,
  so SGLang's match (``Req._compute_max_prefix_len``, floored to a block) can cover a block-aligned
  prompt whole: with no leftover rows and no kept row, the refinement gets the training mean instead
  (``HookStats.prompt_from_training_mean``) and the recorder leaves the request out of the traces
  (``LiveRecorder.left_out``).

Refinement runs on the pooled rows in ``process_batch_result_dllm``, after SGLang's own end-of-round
synchronisation, as one batched call of the bundle's torch graph on the rows' device over every
request in its first denoising round. What the host needs of that step (refined estimates, early
signals, and when recording the pooled rows) comes back in one device-to-host copy, and a step
without a first denoising round copies nothing. An IDLE batch (DP attention's MLP sync: no requests;
eager, no logits) passes through.

On its first step the hook reads the scheduler's ``DllmConfig``: a bundle trained for another
algorithm, other parameters or another block size stops it with one line (rounds in other units),
and so does a recording whose manifest names another (``engine.algorithms.served_decoding``).

Every method here runs on SGLang's scheduler thread, and every microsecond of it is step latency:
per-request reads of SGLang's ``Req`` objects are C-level callables mapped over a batch, small rows
are Python lists, and attributes read in a loop are bound to locals first.
"""

from __future__ import annotations

import logging
import math
import operator
from functools import partial
from itertools import chain, compress, repeat

import numpy as np

from dwise_predict.engine import prefill_rounds, tokenizer_stop_ids
from dwise_predict.errors import ConfigError
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.bundles.load import check_compatible
from dwise_predict.serving.monitor import WINDOW, QualityMonitor
from dwise_predict.serving.policy import MAX_WAIT, DwisePolicy
from dwise_predict.serving.sglang.buffers import UNWRITTEN, block_key
from dwise_predict.serving.sglang.follow import bundle_version
from dwise_predict.serving.sglang.metrics import MonitorGauges, MonitorPublisher
from dwise_predict.serving.sglang.requests import HookStats, RequestTable, _RankShare, category_of
from dwise_predict.serving.sglang.signals import row_signals, signal_scratch
from dwise_predict.serving.sglang.step import Step, StepRun
from dwise_predict.serving.sglang.surface import stop_token_ids
from dwise_predict.serving.sglang.timeout import WaitingTimeout, waiting_timeout

# per-request reads of SGLang's Req objects as C-level callables: a pass over a batch through map() runs
# no Python frame per request (a list comprehension costs about twice as much on the scheduler thread)
_rid = operator.attrgetter("rid")
_extend_end = operator.attrgetter("extend_end")
_phase = operator.attrgetter("dllm_phase")
_slot = operator.attrgetter("_dwise_slot")
_finished = operator.methodcaller("finished")
logger = logging.getLogger(__name__)


def _flat32(piece):
    """``piece`` as a flat float32 tensor (no conversion call for one that is float32 already)."""
    import torch  # imported by the time a step copies to the host; not at the hook's import

    return (piece if piece.dtype == torch.float32 else piece.float()).reshape(-1)


def _unknown(reqs: dict, queue: list) -> list:
    """The requests of ``queue`` whose id is not in ``reqs``, in queue order (C-level passes)."""
    known = list(map(reqs.__contains__, map(_rid, queue)))
    return [] if all(known) else list(compress(queue, map(operator.not_, known)))


def _rank_of(rank: dict, req) -> int:
    """``req``'s place in ``rank`` (id -> place), after every ranked request if it has none."""
    return rank.get(id(req), len(rank))


class DwiseHook:
    """The policy, the bundle and the refinement buffers behind SGLang's patched entry points.

    Each entry point is a method that takes the SGLang object it was called on (the scheduler, the
    algorithm, the logits processor) after its own ``self``; the policy and the request table are
    made on the scheduler's first step (:meth:`bind`).

    sglang : the :class:`~dwise_predict.serving.sglang.surface.ResolvedSglang` (SGLang's own methods).
    buffers : the :class:`~dwise_predict.serving.sglang.buffers.PoolingBuffers`, or None without a
        bundle or a recorder (no pooling).
    prompt_rows : the prompt-row cache (the buffers' ``prompt_rows``).
    monitor_window : finished requests the quality monitor ranks (:mod:`~dwise_predict.serving.monitor`).
    hot_swap : the :class:`~dwise_predict.serving.sglang.follow.HotSwap` of a hook that follows a zoo
        name or a bundle directory, else None.
    """

    def __init__(self, sglang, bundle, features, recorder, *, slots, k, kv_budget_tokens, kv_fraction, slack_blocks,
                 aging, block_size, prompt_rows, buffers, max_wait=MAX_WAIT, monitor_window=WINDOW, hot_swap=None):
        self.sglang = sglang
        self.bundle, self.features, self.recorder = bundle, features, recorder
        self.slots, self.k, self.aging, self.max_wait = slots, k, aging, max_wait
        self.waiting_timeout = None  # SGLANG_REQ_WAITING_TIMEOUT as the policy's wait cap, where set (bind)
        self.kv_budget_tokens, self.kv_fraction, self.slack_blocks = kv_budget_tokens, kv_fraction, slack_blocks
        self.block_size = int(block_size or 0)
        self.prompt_rows, self.buffers = prompt_rows, buffers
        self.stats = HookStats()
        self.policy: DwisePolicy | None = None  # made on the first step (bind)
        self.table: RequestTable | None = None  # made with the policy
        self.share = None  # _RankShare when several TP ranks schedule one batch (bind)
        self.step = Step()
        self.step_run = StepRun()
        self.signal_threshold = None  # for an algorithm without one of its own: set by check_decoding
        self.tokenizer_stop_ids: set[int] = set()  # the scheduler tokenizer's stop ids (bind)
        self.stop_ids = None  # (S,) the model's end-of-sequence ids on the logits' device (first forward)
        self.signal_scratch = None  # the early signals' buffers on a CPU (signals.signal_scratch; first forward)
        self.checked = False  # the first refinement checked that the buffer was written
        # with a bundle: kept (bind) only on the rank that refines, whose estimates the others take
        self.monitor = QualityMonitor(monitor_window) if bundle is not None else None
        self.publisher: MonitorPublisher | None = None  # the monitor's summary to /metrics and the recording (bind)
        self.hot_swap = hot_swap  # follow.HotSwap when the hook follows a zoo name or a bundle directory
        # the serving bundle's version: the zoo's when following one (follow.BundleFollower.version)
        self.bundle_version = hot_swap.follower.version if hot_swap is not None else bundle_version(bundle)
        self.served = None  # the decoding SGLang serves (check_decoding), what a new bundle is held to

    @property
    def pooled(self):
        """The pooling buffer's block-mean rows (None without pooling)."""
        return self.buffers.pooled if self.buffers is not None else None

    # --- the first step ------------------------------------------------------------------------------

    def bind(self, scheduler) -> None:
        """Create the policy and the request table from the scheduler's dLLM config on first use (no
        allocation here)."""
        config = scheduler.dllm_config
        self.check_decoding(config)  # a bundle for another block size is named as such, first
        if self.hot_swap is not None:
            self.hot_swap.follower.start(self.served)
        if self.block_size and int(config.block_size) != self.block_size:
            raise ConfigError(
                f"the hook was installed for block_size {self.block_size} but SGLang runs {config.block_size}: "
                "install it with SGLang's block size"
            )
        self.block_size = int(config.block_size)
        if getattr(scheduler, "tokenizer", None) is not None:  # None under --skip-tokenizer-init
            self.tokenizer_stop_ids = tokenizer_stop_ids(scheduler.tokenizer)
        self.check_rows(scheduler)
        group = getattr(scheduler, "dp_tp_group", None)
        if group is not None and group.world_size > 1:
            self.share = _RankShare(group)
        budget = self.kv_budget_tokens
        if budget is None:
            budget = self.kv_fraction * float(scheduler.max_total_num_tokens)
        max_wait, timeout = self.max_wait, waiting_timeout()  # the timeout: SGLang's, read in this process
        if timeout is not None:
            self.waiting_timeout = WaitingTimeout(timeout, max_wait, self.share)
            max_wait = self.waiting_timeout.initial
        self.policy = DwisePolicy(self.slots, self.k, kv_budget=budget, aging=self.aging, max_wait=max_wait)
        if self.share is not None and not self.share.is_source:
            self.monitor = None
        if self.monitor is not None:
            self.publisher = MonitorPublisher(self.monitor, MonitorGauges.of_scheduler(scheduler), self.recorder)
        self.table = RequestTable(self.policy, self.share, self.block_size, self.slack_blocks, self.bundle,
                                  self.features, self.recorder, self.stats, self.sglang, self.buffers, self.monitor)

    def check_rows(self, scheduler) -> None:
        """Hold ``k*B`` to the request rows this scheduler really has. A request holds a row from its
        first forward to its end, and SGLang starts one that holds none only in a free row
        (``get_num_allocatable_reqs``): with more residents than rows, residents the policy pauses can
        hold every row while every pick and backfill is a request that has not started, and no batch
        runs again. ``DllmConfig.max_running_requests`` is the server's flag; each attention-DP worker
        gets its share (``resolve_max_num_reqs``: the flag // attention-DP size, at most half the KV
        pool, lowered again by memory profiling), known only here: ``Scheduler.max_running_requests``
        (``get_worker_info``; also the pipeline's micro-batch a step may take) and the
        ``req_to_token_pool``'s rows. The launcher checks what the flags decide before the model loads
        (:mod:`~dwise_predict.serving.checks`)."""
        rows = min(int(scheduler.max_running_requests), int(scheduler.req_to_token_pool.size))
        resident = self.slots * self.k
        if resident > rows:
            raise ConfigError(
                f"DWISE keeps up to k*B = {resident:g} requests resident but this scheduler holds {rows} request rows "
                f"(SGLang's max_running_requests for this worker, from --max-running-requests "
                f"{scheduler.dllm_config.max_running_requests}): raise --max-running-requests to {math.ceil(resident)} "
                "times the attention-DP size (and the KV memory where SGLang logs that it reduced "
                "max_running_requests), or lower B or k"
            )

    def check_decoding(self, config) -> None:
        """Hold the bundle and the recording to the decoding SGLang serves (``config``: its
        ``DllmConfig``): rounds in another algorithm's or threshold's units would rank requests in
        units this server does not run, or be recorded under a decoding it did not run
        (:func:`~dwise_predict.engine.algorithms.comparable_decoding` says what a bundle is held to)."""
        from dwise_predict.engine.algorithms import comparable_decoding, served_decoding  # torch: not at import
        from dwise_predict.engine.signals import SIGNAL_THRESHOLD

        served = self.served = served_decoding(config.algorithm, config.algorithm_config, config.block_size)
        self.signal_threshold = float((config.algorithm_config or {}).get("threshold", SIGNAL_THRESHOLD))
        if self.bundle is not None:
            trained = self.bundle.manifest.identity
            check_compatible(trained, None, comparable_decoding(trained.decoding.algorithm, served), "given to the hook")
        if self.recorder is not None:
            said = self.recorder.decoding
            recorded = served_decoding(said.get("algorithm"), said.get("algorithm_config"), said.get("block_size"))
            if recorded != served:
                raise ConfigError(f"the recording says the server decodes with {recorded} but SGLang runs {served}: "
                                  "give the recorder the server's decoding (`dwise-predict serve --record` reads "
                                  "it from SGLang's arguments)")

    # --- admission and batch formation (SchedulerDllmMixin) -------------------------------------------

    def fetch_waiting_reqs(self, scheduler) -> None:
        """``_fetch_waiting_reqs``: reconcile, register arrivals, plan the step, admit into the dLLM queue."""
        if self.policy is None:
            self.bind(scheduler)
        self.swap_if_ready()
        step = self.step = Step()
        policy, table = self.policy, self.table
        reqs = table.reqs
        queue = scheduler.waiting_queue
        # SGLang's waiting queue holds the policy's waiting requests and any new ones (one pass, in C)
        new = _unknown(reqs, queue)
        # the policy's waiting requests are in SGLang's waiting queue and its resident ones in the dLLM
        # manager's (SGLang's filter_finished_reqs has just dropped the finished): a count that differs
        # means SGLang aborted or queued again some of them, and only then are the queues walked
        if len(queue) - len(new) != policy.n_waiting \
                or len(scheduler.dllm_manager.waiting_queue) != policy.n_resident:
            table.reconcile(scheduler)
            # a request under an id the table holds for another is no new one, and would make the
            # counts differ every step: refused now, once
            table.refuse_held_ids(scheduler)
            new = _unknown(reqs, scheduler.waiting_queue)
        step.foreign = list(compress(new, map(_finished, new))) if new else []
        if step.foreign:  # finished while waiting, never registered: SGLang's own path
            done = {id(r) for r in step.foreign}
            scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in done]
            scheduler.dllm_manager.add_waiting_reqs(step.foreign)
            new = [r for r in new if id(r) not in done]
            if self.recorder is not None:
                for r in step.foreign:
                    self.recorder.finished(r)  # counted by its finish reason (an abort), once
        if new:
            table.register(scheduler, new, self.bundle_version)
        if self.waiting_timeout is not None:  # admit before SGLang's waiting timeout would abort
            self.waiting_timeout(policy)
        plan = step.plan = policy.schedule()
        self.stats.rounds += 1
        if len(plan.admitted):
            admitted = set(map(id, table.req_at[plan.admitted].tolist()))
            queue = scheduler.waiting_queue
            moves = list(map(admitted.__contains__, map(id, queue)))
            moving = list(compress(queue, moves))
            scheduler.waiting_queue = list(compress(queue, map(operator.not_, moves)))
            scheduler.dllm_manager.add_waiting_reqs(moving)
            self.stats.admitted += len(moving)
        step.picks = table.req_at[plan.run].tolist()

    def swap_if_ready(self) -> None:
        """At the step boundary: the follower's new bundle, or a rollback (:class:`~.follow.HotSwap`)."""
        if self.hot_swap is not None:
            self.hot_swap.step(self)

    def stop(self) -> None:
        """Stop the threads beside the scheduler's: the bundle follower and the monitor's summary
        worker (``Installed.uninstall``)."""
        if self.hot_swap is not None:
            self.hot_swap.follower.stop()
        if self.publisher is not None:
            self.publisher.stop()

    def swap(self, bundle, version: str, why: str) -> None:
        """Serve ``bundle`` (a checked one: :class:`~.follow.BundleFollower`) as ``version`` from this
        step on: new arrivals get its admission estimates, first denoising rounds its refinement and,
        without prompt rows, its training mean; every estimate the policy holds stays. Counted, logged
        in one line and, when recording, listed in the recording's manifest."""
        before = self.bundle_version
        self.bundle, self.bundle_version = bundle, version
        if self.table is not None:
            self.table.bundle = bundle
        if self.buffers is not None and self.buffers.prompt_mean is not None:
            import torch

            self.buffers.prompt_mean.copy_(torch.from_numpy(bundle.prompt_last_mean))  # in place: H floats
        self.stats.swaps += 1
        logger.warning("dwise: bundle %s -> %s after %d finished requests (%s)", before, version, self.stats.finished,
                       why)
        if self.recorder is not None:
            self.recorder.bundle_swapped({"from": before, "to": version, "at_request": self.stats.finished, "why": why})

    def stage(self, scheduler, adder, running_batch, candidates) -> None:
        """Offer ``candidates`` (in rank order) to SGLang's own batch former, prompt blocks first."""
        phase = self.sglang.phase
        prompt = list(map(self.sglang.prefill_phases.__contains__, map(_phase, candidates)))  # is_dllm_prefill, in C
        scheduler._process_batch_by_phase(adder, list(compress(candidates, prompt)), phase.STAGING_PREFILL,
                                          phase.INCOMING_PREFILL, running_batch)
        scheduler._process_batch_by_phase(adder, list(compress(candidates, map(operator.not_, prompt))),
                                          phase.STAGING_DECODE, phase.INCOMING_DECODE, running_batch)

    def process_dllm_batches(self, scheduler, adder, running_batch):
        """``_process_dllm_batches``: the policy's picks to SGLang's batch former; backfill what its
        budgets left out."""
        policy, step = self.policy, self.step
        plan = step.plan
        separate = scheduler.dllm_config.requires_separate_context_encoding
        candidates = step.foreign + step.picks if step.foreign else step.picks
        if separate:
            # phases cannot share a forward here: keep SGLang's batch former, in DWISE order
            rank = {id(r): i for i, r in enumerate(step.picks)}
            scheduler.dllm_manager.waiting_queue.sort(key=partial(_rank_of, rank))
            mode = self.sglang.process_dllm_batches(scheduler, adder, running_batch)
        else:
            # requests SGLang placed there without the policy (finished while waiting) run first, as they would
            self.stage(scheduler, adder, running_batch, candidates)
            mode = self.sglang.forward_mode.DLLM_EXTEND
        cut = 0
        if separate or len(adder.can_run_list) != len(candidates):  # SGLang stages only what it is offered
            taken = {id(r) for r in adder.can_run_list}
            cut = sum(id(r) not in taken for r in step.picks)
        if cut:
            # SGLang's adder left picks out (KV memory, --max-prefill-tokens, request limits): while it
            # still takes requests, the next-ranked residents run in their slots; the policy learns
            # which ran, so the picks left out are paused (and ranked again next round), not running
            self.stats.budget_overrides += cut
            if not separate and adder.budget_state() == self.sglang.continue_:
                before = len(adder.can_run_list)
                self.stage(scheduler, adder, running_batch, self.table.req_at[plan.standby[:cut]].tolist())
                self.stats.backfilled += len(adder.can_run_list) - before
            ran = np.fromiter((getattr(r, "_dwise_slot", -1) for r in adder.can_run_list), dtype=np.int64)
            policy.ran(plan, ran[ran >= 0])
        self.plan_batch(scheduler, adder.can_run_list)
        return mode

    def plan_batch(self, scheduler, staged) -> None:
        """What the batch's requests run, known only now (SGLang matched their prefixes while staging
        them): their phase, ``P`` after a prefix hit or a retraction, and the inputs of the rows whose
        first denoising forward this is. Kept per batch row for the step's result. Per request, two
        attribute reads (in C); the rest is a few array calls and Python for the rows at a prompt block
        or a first round."""
        policy, step, bs, n = self.policy, self.step, self.block_size, len(staged)
        try:
            slot_list = list(map(_slot, staged))
        except AttributeError:  # a request the hook has never seen (one SGLang's own path queued)
            slot_list = [getattr(r, "_dwise_slot", -1) for r in staged]
        prompt_list = list(map(self.sglang.prefill_phases.__contains__, map(_phase, staged)))
        slots, prompt = np.array(slot_list, dtype=np.int64), np.array(prompt_list, dtype=bool)
        all_ours = not slot_list or min(slot_list) >= 0
        ours = None if all_ours else slots >= 0  # the rest: SGLang's own (finished while waiting)
        prompt_at = list(compress(range(n), prompt_list))  # the rows at a prompt block
        if not all_ours:
            prompt_at = [i for i in prompt_at if slot_list[i] >= 0]
        step.batch, step.batch_slots, step.batch_prompt, step.batch_ours = staged, slots, prompt, ours
        step.batch_all_ours, step.batch_slot_list, step.batch_prompt_at = all_ours, slot_list, prompt_at
        P = policy.prompt_blocks(slots)  # (a slot of -1, not ours, reads a value never used)
        with_prompt = np.count_nonzero(P if all_ours else P[ours])
        P, rounds = P.tolist(), policy.denoising_rounds(slots).tolist()
        # P follows what SGLang has left to encode (the prompt, and after a retraction the output) past
        # its prefix: a request whose prefix grew by the block it ran last keeps the P the policy lowered;
        # a row SGLang runs as a prompt block is checked, and so is one the policy still counts prompt
        # blocks for (P > 0) but SGLang runs as denoising (a prefix hit covered them): the policy's P > 0
        # rows number the checked prompt rows that have P > 0 unless there is such a row
        check = prompt_at
        if sum(map(operator.gt, map(P.__getitem__, prompt_at), repeat(0))) != with_prompt:
            check = [i for i in range(n) if slot_list[i] >= 0 and (prompt_list[i] or P[i] > 0)]
        expect = self.table.expect_prefix
        for i in check:
            r, slot = staged[i], slot_list[i]
            prefix = r.prefix_len
            planned = prompt_list[i] and expect[slot] == prefix
            expect[slot] = prefix + bs
            if not planned:
                left = prefill_rounds(len(r.origin_input_ids) + len(r.output_ids), bs, prefix) if prompt_list[i] else 0
                if left != P[i]:
                    if left < P[i] and rounds[i] == 0:
                        self.stats.prefix_blocks += P[i] - left
                    policy.set_prompt_blocks(r.rid, left)
        # the first denoising forwards: refinement and recording pool their rows; a softmax over the
        # vocabulary for every row of every step (their early signals) would cost more than the refinement
        first = step.first = {}
        if self.buffers is not None:
            own_row = self.table.own_row
            # rows neither at a prompt block nor past a denoising round (`rounds or prompt`: 0 only there)
            for i in compress(range(n), map(operator.not_, map(operator.or_, rounds, prompt_list))):
                slot = slot_list[i]
                if slot < 0:
                    continue
                r = staged[i]
                own = own_row[slot]  # its last prompt block's row; else its leftover prompt rows are pooled
                first[r.rid] = (len(r.origin_input_ids), r.sampling_params.max_new_tokens,
                                0 if own >= 0 else len(r.origin_input_ids) % bs, own)

    def abort_request(self, scheduler, recv_req):
        """``Scheduler.abort_request``, wrapped: SGLang pops the aborted requests from its queues (a
        client gone, its waiting timeout), then the request table lets them go at once, the recorder
        with them. Left to the next step's count check they would stay where no step follows: an idle
        rank, a server about to stop."""
        out = self.sglang.abort_request(scheduler, recv_req)
        if self.table is not None:
            self.table.reconcile(scheduler)
        return out

    # --- result processing (SchedulerDllmMixin) --------------------------------------------------------

    def process_batch_result_dllm(self, scheduler, batch, result) -> None:
        """``process_batch_result_dllm``, wrapped: SGLang commits, then the policy advances."""
        self.sglang.process_batch_result_dllm(scheduler, batch, result)
        if self.policy is None:
            return
        if batch.reqs is not self.step.batch:  # not the batch the hook formed (SGLang's own former ran it)
            self.plan_batch(scheduler, batch.reqs)
        step = self.step
        if step.batch_all_ours or step.batch_ours.any():
            self.advance(scheduler)
        # the next batch names its own rows, pools its own and counts its own forwards: a pass that does
        # not go through the wrapped DllmAlgorithm.run (Gemma4Renoise's context encoding: one forward)
        # finds no rows and no forwards (one, to the policy and the recorder), not this batch's
        self.step = Step()
        self.step_run = StepRun()

    def advance(self, scheduler) -> None:
        """After SGLang committed the step: refine the first denoising rounds (one graph run), copy what
        the host needs to the host (one transfer), then advance the policy (vectorised) and keep the
        rows later requests or the recorder need."""
        policy, recorder, step, run = self.policy, self.recorder, self.step, self.step_run
        batch, slots, ours, prompt = step.batch, step.batch_slots, step.batch_ours, step.batch_prompt
        n, all_ours, slot_list = len(batch), step.batch_all_ours, step.batch_slot_list
        steps = max(run.forwards, 1)
        first = run.rows  # the forward's rows are the batch's, in its order
        host = self.to_host(first) if first and run.first_pooled is not None else None
        refined = None
        if host is not None:
            first_slots = list(map(slot_list.__getitem__, first))
            self.buffers.release_own(self.table.own_row, first_slots)  # their first round took their prompt-block rows
            if host["refined"] is not None:
                # per batch row: its first round's refinement, else NaN; a list made into one array (a fill
                # and a scatter by a list of rows cost more numpy calls on the scheduler thread)
                values = host["refined"].tolist()
                refined = [math.nan] * n
                for i, value in zip(first, values):
                    refined[i] = value
                refined = np.array(refined)
                if self.monitor is not None:
                    self.table.keep_refined(first_slots, values)
        # which requests finished: in FDFO (one algorithm step) SGLang finishes a request only on the
        # step that resolves its block (process_batch_result_dllm skips an unresolved one before any
        # finish check), so only those rows are asked; a synchronous step commits every row
        done = run.step_done[0][1] if len(run.step_done) == 1 and scheduler.dllm_config.first_done_first_out_mode \
            else None
        asked = range(n) if done is None else list(compress(range(n), done))
        finished_at = list(compress(asked, map(_finished, map(batch.__getitem__, asked))))
        finished = None  # most steps finish no request
        if finished_at:
            finished = np.zeros(n, dtype=bool)
            finished[finished_at] = True
        rounds = 1 if steps == 1 else np.where(prompt, 1, steps)
        if all_ours:  # the common case: no request of SGLang's own in the batch
            policy.complete_slots(slots, prompt, finished, refined, rounds)
        else:
            rows = ours.nonzero()[0]
            policy.complete_slots(slots[rows], prompt[rows], None if finished is None else finished[rows],
                                  None if refined is None else refined[rows], rounds if steps == 1 else rounds[rows])
            finished_at = [i for i in finished_at if slot_list[i] >= 0]
        self.keep_rows(scheduler, finished_at)
        if recorder is not None:
            self.record(host, steps)
        if finished_at and self.monitor is not None:  # their slots, freed in complete_slots, are not reused yet
            self.table.observe_finished([batch[i] for i in finished_at], [slot_list[i] for i in finished_at])
        forget, stats = self.table.forget, self.stats
        for i in finished_at:
            r = batch[i]
            forget(r.rid, policy_too=False)  # the policy freed it in complete_slots
            stats.finished += 1
            if recorder is not None:
                recorder.finished(r, category_of(r))
        if finished_at and self.publisher is not None:
            self.publisher.after_finishes(stats, self.bundle_version, idle=not (policy.n_waiting or policy.n_resident))

    def record(self, host, steps: int) -> None:
        """The step's forwards of each of our batch rows to the recorder: its own forwards, and for a
        first denoising round its pooled row, early signals and ``prompt_last`` row (``host``)."""
        step, recorder = self.step, self.recorder
        batch, prompt = step.batch, step.batch_prompt
        first = self.step_run.rows if host is not None else ()
        done = self.step_run.row_forwards()
        # each row's forwards: its own, until its block reported done; else a prompt block, or the step's
        rounds = np.where(prompt, 1, steps)
        if done is not None:
            rounds = np.where(done > 0, done, rounds)
        rest = np.ones(len(batch), dtype=bool) if step.batch_all_ours else step.batch_ours.copy()
        if first:
            rest[first] = False  # the first rounds: their pooled rows go with them (first_rounds)
        rest = rest.nonzero()[0]
        recorder.forwards(list(map(batch.__getitem__, rest.tolist())), prompt[rest].tolist(), rounds[rest].tolist())
        if first:
            recorder.first_rounds(list(map(batch.__getitem__, first)), host["pooled"], host["signals"], host["prompt"],
                                  host["has_prompt"], rounds[first].tolist())

    def keep_rows(self, scheduler, finished_at: list) -> None:
        """Copy the step's rows that later steps read into device rows (``kept_rows``), in one
        host-to-device copy of their indices, one gather and one copy (two of each after a step of
        several forwards): each prompt block's row, the refinement's
        ``prompt_last`` once its first round comes (``own_last``); and for later requests whose prefix
        SGLang serves from its cache (:class:`~dwise_predict.serving.sglang.buffers._PromptRows`), every
        block reported done this step that a later prompt can end on: a prompt block (a shared system
        prompt, a repeated prompt) or a finished request's last full block (the next turn of a chat).
        ``finished_at``: the batch rows of ours that finished. Python over those rows (a few dozen a
        step), no array call but the copy's."""
        run = self.step_run
        pooled, last = run.first_pooled, run.last_pooled
        if pooled is None:
            return
        step, buffers = self.step, self.buffers
        prompt_at, slot_list = step.batch_prompt_at, step.batch_slot_list
        hold_own, own_row = buffers.hold_own, self.table.own_row
        own, own_into = prompt_at, [hold_own(own_row, slot_list[i]) for i in prompt_at]
        kept, into = self.kept_blocks(scheduler, finished_at) if last is not None else ([], [])
        if not own and not kept:
            return
        if last is pooled or not kept:  # one forward this step (FDFO): one gather, one copy into kept_rows
            base = len(buffers.own_last)
            index = buffers.to_device_kept(own + kept + own_into + [base + j for j in into])
            a = len(own) + len(kept)
            buffers.kept_rows.index_copy_(0, index[a:], pooled.index_select(0, index[:a]))
            return
        index = buffers.to_device_kept(own + own_into + kept + into)
        a, b = len(own), 2 * len(own)
        if a:
            buffers.own_last.index_copy_(0, index[a:b], pooled.index_select(0, index[:a]))
        if kept:
            buffers.prompt_rows.rows.index_copy_(0, index[b + len(kept):], last.index_select(0, index[b:b + len(kept)]))

    def kept_blocks(self, scheduler, finished_at: list) -> tuple[list, list]:
        """The batch rows whose block, reported done this step, the prompt-row cache keeps (a prompt
        block, or a finished request's last full block), and the cache row each goes to."""
        run, step = self.step_run, self.step
        if not (run.step_done and self.prompt_rows.capacity) \
                or scheduler.dllm_config.requires_separate_context_encoding:
            return [], []
        batch, bs = step.batch, self.block_size
        done = run.step_done[0][1] if len(run.step_done) == 1 else run.row_forwards()  # truthy: block done
        rows = prompt_at = step.batch_prompt_at
        if finished_at:
            prompt_at = set(prompt_at)
            rows = sorted(prompt_at.union(finished_at))
        kept = list(compress(rows, map(done.__getitem__, rows)))
        reqs = list(map(batch.__getitem__, kept))
        # SGLang's prefix ends on a block boundary and the forward ran the block after it
        ends = list(map(_extend_end, reqs))
        if finished_at:  # a finished request's last block is kept when it is full
            full = [i in prompt_at or len(r.origin_input_ids) + len(r.output_ids) >= end
                    for i, r, end in zip(kept, reqs, ends)]
            if not all(full):
                kept, reqs, ends = (list(compress(x, full)) for x in (kept, reqs, ends))
        return kept, self.prompt_rows.reserve_blocks(reqs, [end // bs for end in ends], bs)  # keyed at a lookup

    def to_host(self, first) -> dict:
        """The step's one device-to-host copy: the refined estimates of the first denoising rounds (the
        bundle's graph run once over all of them) and, when recording, their early signals, pooled rows
        and ``prompt_last`` rows; on the first refinement, whether the forward wrote the
        pooling buffer. ``first``: their batch rows, in the order the forward's rows were staged."""
        import torch

        run = self.step_run
        pooled = run.first_pooled.index_select(0, run.rows_dev)
        n, width = len(first), pooled.shape[1]
        last, has_prompt = self.prompt_last_rows(first)
        signals = run.first_signals if run.first_signals is not None \
            else torch.full((n, len(EARLY_SIGNALS)), math.nan, device=pooled.device)
        pieces = []
        refine_here = self.bundle is not None and (self.share is None or self.share.is_source)
        if refine_here:
            pieces.append(self.bundle.refine(pooled.float(), last.float(), run.tokens_dev, run.budget_dev, signals))
        if self.recorder is not None:  # the host reads the early signals only to record them
            pieces += [signals, pooled, last]  # a row without prompt rows (has_prompt False) is not read
        if not self.checked:
            pieces.append(torch.isfinite(pooled).all().reshape(1))
        host = None  # a TP rank that neither refines nor records, once checked, needs nothing of the step
        if pieces:
            host = torch.cat(list(map(_flat32, pieces))).cpu().numpy()  # the transfer
            self.stats.host_transfers += 1
        out = {"refined": None, "has_prompt": has_prompt}
        at = 0
        if refine_here:
            out["refined"], at = host[:n], n
        if self.recorder is not None:
            out["signals"], at = host[at:at + 4 * n].reshape(n, 4), at + 4 * n
            out["pooled"] = host[at:at + n * width].reshape(n, width)
            out["prompt"] = host[at + n * width:at + 2 * n * width].reshape(n, width)
            at += 2 * n * width
        if not self.checked:
            if host[at] != 1.0:
                raise ConfigError(UNWRITTEN)
            self.checked = True
        if self.bundle is not None:
            if self.share is not None:
                out["refined"] = self.share(out["refined"], n)
            self.stats.refined += n
        return out

    def prompt_last_rows(self, first):
        """The refinement's ``prompt_last`` rows of the first-round requests, ``(n, H)`` on the device,
        and whether each has one: its own last prompt block's (``own_last``, gathered in one op);
        without one, an earlier forward's row for the same last full block, else the mean of its
        leftover prompt rows in this forward, else none (a block-aligned prompt cached whole: SGLang
        ran none of its rows here), where the refinement takes the training mean."""
        run, buffers = self.step_run, self.buffers
        rows = buffers.own_last.index_select(0, run.own_dev)
        has = list(map(operator.le, repeat(0), run.row_own))  # own_last row >= 0 (plain Python: a few rows)
        if all(has):
            return rows, has
        batch, bs = self.step.batch, self.block_size
        from_cache, leftover, mean = 0, 0, 0
        for j in compress(range(len(has)), map(operator.not_, has)):
            i = first[j]
            r = batch[i]
            blocks, rest = divmod(len(r.origin_input_ids), bs)
            row = self.prompt_rows.get(block_key(r, blocks, bs), self.stats.rounds) if blocks else None
            from_cache += row is not None
            if row is None and rest:
                row, leftover = run.first_leftover[i], leftover + 1
            if row is None:
                row, mean = buffers.prompt_mean if buffers.prompt_mean is not None else 0.0, mean + 1
            else:
                has[j] = True
            rows[j] = row
        if self.bundle is not None:
            self.stats.prompt_from_cache += from_cache
            self.stats.prompt_from_leftover += leftover
            self.stats.prompt_from_training_mean += mean
        return rows, has

    # --- the forward (DllmAlgorithm, LogitsProcessor) ---------------------------------------------------

    def run(self, algorithm, model_runner, forward_batch, algo_states=None):
        """``DllmAlgorithm.run``, wrapped: stage the first rounds' rows, then SGLang's own loop with the
        model runner's ``forward`` and the algorithm's ``step`` counted (:meth:`counted_forward`,
        :meth:`counted_step`)."""
        run = self.step_run = StepRun()
        size = forward_batch.batch_size
        self.stats.idle += size == 0  # DP attention's IDLE batch: no rows, and no logits when eager
        buffers = self.buffers
        if buffers is not None:
            if not self.checked:  # what a replay that skipped the copy would leave: caught by the first refinement
                buffers.pooled.fill_(math.nan)
            self.stage_rows(forward_batch)
        run.running = (algorithm, model_runner, forward_batch, model_runner.forward, algorithm.step)
        own = vars(model_runner).get("forward")
        own_step = vars(algorithm).get("step")
        # read here, each run: benchmarks/hook_timing.py wraps them on the hook to time them
        model_runner.forward = self.counted_forward
        algorithm.step = self.counted_step
        try:
            out = self.sglang.run(algorithm, model_runner, forward_batch, algo_states)
            if buffers is not None and self.prompt_rows.capacity:  # no rows kept: none needed
                # a block SGLang emits ran its last forward over its final tokens: that forward writes
                # the block's KV cache (LowConfidence reports done on a forward with no masks left;
                # JointThresholdInDel keeps a block whose ids its step changed for one more forward)
                run.last_pooled = run.first_pooled if run.forwards == 1 else buffers.rows_of(size)[0]  # read this step
            return out
        finally:
            run.running = None
            if own is None:
                del model_runner.forward  # back to the class method
            else:
                model_runner.forward = own
            if own_step is None:
                del algorithm.step
            else:
                algorithm.step = own_step

    def stage_rows(self, forward_batch) -> None:
        """The batch rows of the step's first denoising forwards (``ForwardBatch.rids`` names each
        row's request) and their inputs, onto the device in one copy before the forward: row index,
        prompt tokens, budget, the leftover prompt positions to pool (a mask of ones on the ``n``
        leftover positions of a request without a prompt block of its own and its ``1/n`` in fp32,
        written into the static buffers the captured graphs read; zeros elsewhere) and its row of
        ``own_last``."""
        first, run, buffers = self.step.first, self.step_run, self.buffers
        if buffers.weights_set:
            buffers.leftover_mask.zero_()  # a zero mask pools nothing, whatever its scale
            buffers.weights_set = False
        if not first:
            return
        rids = (getattr(forward_batch, "rids", None) or ())[: forward_batch.batch_size]
        ours = list(map(first.__contains__, rids))
        run.rows, run.row_rids = list(compress(range(len(rids)), ours)), list(compress(rids, ours))
        if not run.rows:
            return
        n, bs = len(run.rows), self.block_size
        tokens, budgets, leftover, own = zip(*map(first.__getitem__, run.row_rids))  # the inputs' columns
        weighted = any(leftover)
        # one host vector, one copy: rows and own_last rows (-1 as 0: the row gathered for a request without
        # one is not read) first, as they are read as int64 (one conversion), then tokens, budgets and,
        # with leftover rows to pool, each row's mask and 1/n; built as one list (a numpy call per piece
        # costs more on the scheduler thread, whose caches the forward has just swept)
        staged = [*run.rows, *map(max, own, repeat(0)), *tokens, *budgets]
        if weighted:
            staged += chain.from_iterable(map(buffers.leftover_weights.__getitem__, leftover))
        staged = buffers.to_device(staged)
        indices = staged[:2 * n].long()
        run.rows_dev, run.own_dev = indices[:n], indices[n:]
        run.tokens_dev, run.budget_dev = staged[2 * n:3 * n], staged[3 * n:4 * n]
        run.row_own = own
        if weighted:
            weights = staged[4 * n:].view(n, bs + 1)
            buffers.leftover_mask.index_copy_(0, run.rows_dev, weights[:, :bs])
            buffers.leftover_scale.index_copy_(0, run.rows_dev, weights[:, bs:])
            buffers.weights_set = True

    def counted_forward(self, *args, **kwargs):
        """``model_runner.forward`` while the hook's ``run`` runs: counts the step's forwards and, after
        its first, takes the pooling buffer's rows and computes the early signals of its first rounds."""
        run = self.step_run
        algorithm, model_runner, forward_batch, forward, _ = run.running
        if run.forwards == 1 and run.first_pooled is not None:
            # a second forward in the step (synchronous decoding) overwrites the buffer: copy the first's
            # rows out first (device copies, no sync); an FDFO step runs one forward and copies nothing
            run.first_pooled = run.first_pooled.clone()
            if run.first_leftover is not None:
                run.first_leftover = run.first_leftover.clone()
        out = forward(*args, **kwargs)
        if run.forwards == 0 and self.buffers is not None:
            size = forward_batch.batch_size  # views of the buffer, valid until the step's next forward
            run.first_pooled, leftover = self.buffers.rows_of(size)
            run.first_leftover = leftover if run.rows else None
            # the first forward's early signals, before the step fills masks: the refinement
            # graph's last input (and recorded). From the forward's output, after any graph replay;
            # an algorithm without a threshold of its own (Gemma4Renoise) counts over the one the
            # DiffusionGemma collector uses (engine.signals.SIGNAL_THRESHOLD or the config's)
            logits_out = out.logits_output.full_logits
            if run.rows and logits_out is not None:
                if self.stop_ids is None:
                    self.stop_ids = stop_token_ids(model_runner, self.tokenizer_stop_ids, logits_out.device)
                    self.signal_scratch = signal_scratch(logits_out.device)
                run.first_signals = row_signals(
                    logits_out, forward_batch.input_ids, run.rows_dev, algorithm.mask_id, algorithm.block_size,
                    float(getattr(algorithm, "threshold", self.signal_threshold)), self.stop_ids, self.signal_scratch)
        run.forwards += 1
        return out

    def counted_step(self, batch, full_logits, states):
        """The algorithm's ``step`` while the hook's ``run`` runs: a row's own forwards are those until
        its block first reported done."""
        run = self.step_run
        done = run.running[4](batch, full_logits, states)
        run.step_done.append((run.forwards, done))  # read once, after the step (StepRun.row_forwards)
        return done

    def get_dllm_logits(self, processor, hidden_states, lm_head, logits_metadata):
        """``LogitsProcessor._get_dllm_logits``, wrapped: pool each request's block rows into the static
        buffer first (inside the captured graph on a GPU)."""
        buffers = self.buffers
        if buffers is not None:
            buffer, bs = buffers.pooled, self.block_size
            rows = hidden_states.shape[0] // bs
            if rows > buffer.shape[0]:
                raise ConfigError(f"a forward of {rows} requests exceeds the pooling buffer's {buffer.shape[0]} rows: "
                                  "install the hook with max_batch at least SGLang's largest CUDA-graph batch")
            # mean of each request's block rows, and of its leftover prompt rows, in one batched product
            # written in place (the addresses a CUDA graph captured), summed in fp32 whatever the model's dtype
            buffers.pool(hidden_states.view(rows, bs, hidden_states.shape[-1]))  # (rows, block, H) -> (rows, 2, H)
        return self.sglang.get_dllm_logits(processor, hidden_states, lm_head, logits_metadata)
