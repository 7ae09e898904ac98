"""SGLang's waiting timeout (``SGLANG_REQ_WAITING_TIMEOUT``) kept by the policy: its wait cap, in rounds.

SGLang aborts every request that has sat in ``Scheduler.waiting_queue`` longer than the timeout
(``Scheduler._poll_timeout_aborts``, each loop iteration: ``time_stats.wait_queue_entry_time``, set
when ``_add_request_to_queue`` queues the request, again when a retraction queues it back; the
client gets a 503, "Request waiting timeout reached."). Stock SGLang's dLLM scheduler moves requests
from that queue into the dLLM manager's, in arrival order, as rows free up: the timeout sheds load,
aborting what waited too long for a row. The hook leaves every request the policy has not admitted
in that queue and the policy admits by rank, so the same timeout would abort the long requests
DWISE puts off, on a server with rows and KV to spare.

The hook keeps the timeout's meaning — waited too long for admission — and has the policy admit a
request before the timeout would abort it: a request that has waited :data:`DUE_AFTER` of the
timeout is *due* (``DwisePolicy``'s wait cap: admitted first, whatever its rank, and nobody else is
admitted until it fits), which leaves it the rest of the timeout for the residents holding the KV
it needs to finish. The cap is in rounds, so before each round :class:`WaitingTimeout` counts the
rounds begun in the last ``DUE_AFTER × timeout`` seconds (in :data:`SLICES` slices of that window)
and makes that the policy's cap when it is below the configured one (``max_wait``; also where that
is off): a request registered before the first of those rounds was queued before it, so it has
waited longer than that. A request the
policy cannot admit within the timeout even so (KV and rows held by residents that do not finish
in time: an overloaded server) is aborted by SGLang, as it would be without the hook.

Every TP rank of one batch must plan alike (``requests._RankShare``), and wall clocks differ
between ranks: with several, the first rank counts the rounds and every :data:`SHARE_EVERY`
rounds sends its count to the others (one broadcast of one number), which all set it at the same
round; between, each keeps the last one. Off (``SGLANG_REQ_WAITING_TIMEOUT`` unset or not above
0, as SGLang reads it) nothing here runs.
"""

from __future__ import annotations

import os
import time
from collections import deque

import numpy as np

VARIABLE = "SGLANG_REQ_WAITING_TIMEOUT"  # seconds, SGLang's envs.EnvFloat (default -1: off)
DUE_AFTER = 0.5  # the share of the timeout after which a waiting request is admitted first
SHARE_EVERY = 32  # rounds between the first TP rank's counts (a gloo broadcast each)
SLICES = 64  # the window's rounds are counted in slices of 1/64 of it: bounded memory however fast rounds come
NO_CAP = 2**62  # the policy's cap until the first count, where max_wait is off: rounds no server reaches


def waiting_timeout(environ=None) -> float | None:
    """``SGLANG_REQ_WAITING_TIMEOUT`` in seconds, as SGLang reads it (``envs.EnvFloat``: a value that
    is no number is its default, -1), or None where it aborts nothing (not above 0)."""
    value = (os.environ if environ is None else environ).get(VARIABLE)
    try:
        seconds = float(value) if value is not None else -1.0
    except ValueError:
        return None
    return seconds if seconds > 0 else None


class WaitingTimeout:
    """Before each round, the policy's wait cap from SGLang's waiting timeout (see the module).

    timeout_s : SGLang's waiting timeout, seconds (:func:`waiting_timeout`).
    max_wait : the configured cap in rounds (None: off), which the count never raises.
    share : the scheduler's :class:`~dwise_predict.serving.sglang.requests._RankShare`, or None.
    clock : seconds; default ``time.perf_counter`` as it is now, SGLang's clock for
        ``wait_queue_entry_time`` and its timeout.
    """

    def __init__(self, timeout_s: float, max_wait: int | None, share=None, clock=None):
        self.window = DUE_AFTER * float(timeout_s)
        self.slice = self.window / SLICES
        self.max_wait, self.share = max_wait, share
        self.clock = time.perf_counter if clock is None else clock
        # the counting rank's rounds begun in the last window: [start of a slice, rounds begun in it],
        # oldest first, at most SLICES + 1 of them (a scheduler spinning on a batch it cannot form
        # starts a round every few µs), and their sum
        self.slices: deque = deque()
        self.count = 0

    @property
    def initial(self) -> int:
        """The policy's cap before the first count (a whole number: the policy keeps its wait line)."""
        return NO_CAP if self.max_wait is None else self.max_wait

    def __call__(self, policy) -> None:
        """The round about to be planned starts now: the policy's cap is the rounds begun in the last
        window, this one included, or the configured cap where that is lower. A slice leaves once its
        start is out of the window, the rounds it holds with it, so the cap may fall a slice's rounds
        short: a request is due after between 63/64 and all of the window. A few operations a round
        (a clock read, a count, now and then a slice in or out); on several TP ranks the count
        crosses to the others every :data:`SHARE_EVERY` rounds."""
        share = self.share
        if share is None or share.is_source:
            slices, now = self.slices, self.clock()
            if slices and now - slices[-1][0] < self.slice:
                slices[-1][1] += 1
            else:
                slices.append([now, 1])
            self.count += 1
            edge = now - self.window
            while slices[0][0] < edge:  # never the newest: it began less than a slice ago
                self.count -= slices.popleft()[1]
        if share is None:
            count = self.count
        elif (policy.rounds + 1) % SHARE_EVERY:  # the round schedule() is about to count: alike on every rank
            return
        else:
            count = int(share(np.array([self.count], dtype=np.float64), 1)[0])
        policy.max_wait = count if self.max_wait is None else min(count, self.max_wait)
