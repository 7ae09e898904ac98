"""DwisePolicy's short path (``_replan``: a round after which only the last plan's runs happened keeps
its run set and re-sorts the runners) gives the plan the full ranking gives, on random sequences of
arrivals, rounds, finishes, refinements, overrides, prefix hits, later refinements and aborts."""

from __future__ import annotations

import numpy as np
import pytest

from dwise_predict.serving.policy import MAX_WAIT, DwisePolicy


class FullRanking(DwisePolicy):
    """The policy with the short path off: every round ranks waiting ∪ resident in full."""

    def _replan(self, run, standby):
        return None


class Counted(DwisePolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.short = 0
        self.due = 0  # requests the wait cap admitted

    def _admit_due(self, n_res):
        admitted, blocked = super()._admit_due(n_res)
        self.due += len(admitted)
        return admitted, blocked

    def _replan(self, run, standby):
        plan = super()._replan(run, standby)
        self.short += plan is not None
        return plan


def assert_same_plan(a, b):
    for name in ("run", "prompt", "admitted", "paused", "preempted", "standby"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def drive(seed: int, ranking: str, aging: float, rounds: int = 400, max_wait: int | None = MAX_WAIT) -> Counted:
    """Both policies through one random sequence; returns the one with the short path (its counts)."""
    rng = np.random.default_rng(seed)
    kwargs = dict(slots=6, k=3, kv_budget=400.0, ranking=ranking, aging=aging, max_wait=max_wait)
    fast, full = Counted(**kwargs), FullRanking(**kwargs)
    both = (fast, full)
    live, next_id = [], 0
    for _ in range(rounds):
        if rng.random() < 0.08 or not live:  # a few arrivals (estimates with ties)
            n = int(rng.integers(1, 5))
            ids = [f"r{next_id + i}" for i in range(n)]
            next_id += n
            P = rng.integers(0, 4, n)
            est = rng.integers(0, 12, n).astype(float) + rng.choice([0.0, 0.5], n)
            kv = rng.integers(10, 60, n).astype(float)
            for pol in both:
                pol.add_many(ids, P, est, kv)
            live += ids
        plans = [pol.schedule() for pol in both]
        assert_same_plan(*plans)
        plan = plans[0]
        run = plan.run
        if len(run) and rng.random() < 0.05 and len(plan.standby):  # the server's budget cut a pick
            ran = np.concatenate([run[1:], plan.standby[:1]])
            for pol, p in zip(both, plans):
                pol.ran(p, ran)
            run = ran
        if not len(run):
            continue
        prompt = fast.prompt_blocks(run) > 0
        first = (fast.denoising_rounds(run) == 0) & ~prompt
        finished = ~prompt & (rng.random(len(run)) < 0.04)
        refined = None
        if first.any() and rng.random() < 0.7:
            refined = np.where(first, rng.integers(0, 15, len(run)).astype(float), np.nan)
        leaving = fast.ids(run[finished])
        for pol in both:
            pol.complete_slots(run, prompt, finished, refined)
        for rid in leaving:
            live.remove(rid)
        if live and rng.random() < 0.03:  # a prefix hit seen late, a later refinement, an abort
            rid = live[int(rng.integers(len(live)))]
            kind = rng.integers(3)
            for pol in both:
                if kind == 0:
                    pol.set_prompt_blocks(rid, 0)
                elif kind == 1 and pol.fields(rid)["state"] != "waiting":
                    pol.refine(pol.slots_of([rid]), [3.0])
                elif kind == 2:
                    pol.remove(rid)
            if kind == 2:
                live.remove(rid)
    for rid in live:
        assert fast.fields(rid) == full.fields(rid)
    assert fast.n_waiting == full.n_waiting and fast.n_resident == full.n_resident
    return fast


@pytest.mark.parametrize("ranking,aging", [("remaining", 0.0), ("remaining", 0.25), ("arrival", 0.0)])
def test_the_short_path_plans_what_the_full_ranking_plans(ranking, aging):
    short = sum(drive(seed, ranking, aging).short for seed in range(6))
    assert short > 600  # of 2,400 rounds: the short path is taken, and agrees every time


@pytest.mark.parametrize("max_wait", [0, 6, 25])
def test_the_short_path_plans_what_the_full_ranking_plans_while_the_wait_cap_acts(max_wait):
    runs = [drive(seed, "remaining", 0.25, max_wait=max_wait) for seed in range(6)]
    assert sum(run.due for run in runs) > 100  # the cap admitted requests, and both paths agreed on each
    assert sum(run.short for run in runs) > 100


def test_the_short_path_is_off_where_keys_can_rise_or_the_barrier_filters():
    from dwise_predict.simulation.schedulers import ScheduledPolicy

    mlfq, barrier = ScheduledPolicy(2, 2, ranking="mlfq"), DwisePolicy(2, 2, prefill_first=True)
    for pol in (mlfq, barrier):
        pol.add_many(["a", "b", "c"], [2, 0, 0], [0.0, 1.0, 2.0])
    for _ in range(3):  # MLFQ keys rise with the work done: never
        plan = mlfq.schedule()
        assert mlfq._kept is None
        mlfq.complete_slots(plan.run, mlfq.prompt_blocks(plan.run) > 0, np.zeros(len(plan.run), bool))
    plan = barrier.schedule()  # a and b admitted; a runs its prompt blocks alone, b is held back
    assert barrier.ids(plan.run) == ["a"] and barrier._kept is None
