"""One scheduler step's state, in two parts with two lifetimes.

A step in SGLang's dLLM scheduler runs ``_fetch_waiting_reqs`` (the policy's plan), then
``_process_dllm_batches`` (the batch SGLang forms from it), then the forward
(``DllmAlgorithm.run``), then ``process_batch_result_dllm``. The hook keeps what it learns on the way
in two objects, each made fresh instead of reset field by field:

- :class:`Step`, made at admission and again once the batch's result is processed (the next
  batch names its own rows: a forward before the next admission, DP attention's IDLE batch, finds
  none);
- :class:`StepRun`, made by each wrapped ``DllmAlgorithm.run``, and again once the batch's result is
  processed. It is not the step's: SGLang runs an IDLE batch through ``run`` without a result, and
  Gemma4Renoise runs its context-encoding pass (one forward) straight through ``model_runner.forward``
  (``gemma4_renoise.py``: a batch that is not ``DLLM_EXTEND`` never reaches ``DllmAlgorithm.run``),
  whose result then finds an empty run: no rows, no forwards counted (read as one), not the run
  before it (another batch's, whose done lists have that batch's rows).

A scheduler step is one round only in FDFO mode (``--dllm-fdfo``, SGLang 0.5.23's default: one
forward per step); with ``--no-dllm-fdfo`` SGLang runs every denoising round of a block inside one
step, and the policy is advanced by the number of forwards the step ran (its ranking then changes
per block, not per round). Use FDFO with DWISE.
"""

from __future__ import annotations

import numpy as np


class Step:
    """What one step planned and what its batch runs, per batch row.

    plan : the policy's ``RoundPlan``; picks : its picks (SGLang's ``Req``), best rank first;
    foreign : requests SGLang's own path put in the dLLM queue this step (finished while waiting).
    batch : the batch being run (SGLang's list of ``Req``), and per row of it: ``batch_slots`` the
    policy slot (-1: not ours), ``batch_prompt`` at a prompt block, ``batch_ours`` ours (None when
    ``batch_all_ours``: every row is ours); ``batch_slot_list`` the slots as a list;
    ``batch_prompt_at`` the batch rows of ours at a prompt block.
    first : rid -> (prompt tokens, budget, leftover prompt tokens to pool, own_last row or -1) of
    the batch's first denoising forwards.
    """

    __slots__ = ("plan", "picks", "foreign", "batch", "batch_slots", "batch_prompt", "batch_ours", "batch_all_ours",
                 "batch_slot_list", "batch_prompt_at", "first")

    def __init__(self):  # a step of the scheduler's thread: the fewest stores (the empty lists are replaced, not grown)
        self.plan = self.batch = self.batch_slots = self.batch_prompt = self.batch_ours = None
        self.picks = self.foreign = self.batch_slot_list = self.batch_prompt_at = ()
        self.batch_all_ours = False
        self.first: dict = {}


class StepRun:
    """What one ``DllmAlgorithm.run`` ran: its forwards, the rows of its first denoising forwards and
    the pooled rows it left.

    forwards : forwards so far; step_done : (forwards so far, the algorithm step's done list) per
    step call. rows : batch rows of the step's first denoising forwards; row_rids : their request
    ids; rows_dev, tokens_dev, budget_dev : the same, their prompt tokens and budgets on the device;
    row_own, own_dev : their own_last rows (-1: none), host (a tuple) and device. first_pooled : (B, H) the
    first forward's rows (a view of the pooling buffer; copied if a second forward runs);
    first_leftover : the same of the leftover buffer (when the step has first-round rows);
    first_signals : (n_rows, 4) early signals of ``rows`` in the first forward; last_pooled : (B, H)
    the pooling buffer after the last forward. running : (algorithm, model runner, forward batch,
    its forward, its step) while ``run`` runs.
    """

    __slots__ = ("forwards", "step_done", "_row_forwards", "rows", "row_rids", "rows_dev", "tokens_dev", "budget_dev",
                 "row_own", "own_dev", "first_pooled", "first_leftover", "first_signals", "last_pooled", "running")

    def __init__(self):
        self.forwards = 0
        self.step_done: list = []  # appended to by counted_step
        self._row_forwards = None
        self.rows = self.row_rids = ()  # replaced by stage_rows, never grown
        self.rows_dev = self.tokens_dev = self.budget_dev = self.row_own = self.own_dev = self.running = None
        self.first_pooled = self.first_leftover = self.first_signals = self.last_pooled = None

    def row_forwards(self):
        """int64 per batch row: the forwards until its block first reported done this step (0: not
        done), from the step's done lists in one array conversion; None without a step call."""
        if self._row_forwards is None and len(self.step_done) == 1:  # FDFO: one step call
            forwards, done = self.step_done[0]
            marks = np.fromiter(done, dtype=np.int64, count=len(done))
            self._row_forwards = marks if forwards == 1 else marks * forwards
        elif self._row_forwards is None and self.step_done:
            marks = np.array([done for _, done in self.step_done], dtype=bool)  # (steps, rows)
            counts = np.array([forwards for forwards, _ in self.step_done], dtype=np.int64)
            self._row_forwards = np.where(marks.any(0), counts[marks.argmax(0)], 0)
        return self._row_forwards
