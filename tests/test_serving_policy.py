"""DWISE policy (the DWISE paper's Algorithm 1): one test per line of the algorithm, plus ties and bad input."""

import numpy as np
import pytest

from dwise_predict.errors import ConfigError, InputError
from dwise_predict.serving.policy import DwisePolicy


def run_ids(policy, plan):
    return policy.ids(plan.run)


def test_line2_4_only_top_B_of_waiting_and_resident_is_admitted():
    pol = DwisePolicy(slots=1, k=8)
    pol.add("long", prompt_blocks=1, estimate=9)  # R = 10
    pol.add("short", prompt_blocks=1, estimate=2)  # R = 3
    plan = pol.schedule()
    assert pol.ids(plan.admitted) == ["short"]  # "long" ranks second: outside the top B = 1
    assert run_ids(pol, plan) == ["short"]
    assert pol.fields("long")["state"] == "waiting"


def test_line4_resident_cap_k_times_B_blocks_admission():
    pol = DwisePolicy(slots=1, k=1)
    pol.add("a", 0, 5)
    pol.schedule()
    pol.add("b", 0, 1)  # better ranked, but |S| = kB = 1
    plan = pol.schedule()
    assert len(plan.admitted) == 0 and run_ids(pol, plan) == ["a"]
    assert pol.fields("b")["state"] == "waiting"


def test_line4_kv_reservation_must_fit_and_a_blocked_candidate_does_not_block_smaller_ones():
    pol = DwisePolicy(slots=3, k=8, kv_budget=10)
    pol.add("big", 0, 1, kv_reservation=6)
    pol.schedule()
    pol.add_many(["big2", "small"], [0, 0], [1, 2], [6, 3])
    plan = pol.schedule()
    # big2 ranks first among the waiting but 6 + 6 > 10; small (3) still fits: 6 + 3 <= 10
    assert pol.ids(plan.admitted) == ["small"]
    assert pol.kv_used == 9
    pol.complete("big", finished=True)  # frees 6
    plan = pol.schedule()
    assert pol.ids(plan.admitted) == ["big2"] and pol.kv_used == 9


def test_line8_9_run_B_smallest_R_and_pause_the_rest_with_kv_kept():
    pol = DwisePolicy(slots=2, k=8)
    pol.add_many(["a", "b", "c"], [0, 0, 0], [3, 1, 2])
    pol.schedule()  # admits b, c (top 2)
    pol.add("d", 0, 0.5)
    plan = pol.schedule()  # d ranks first: admitted, runs with b; c paused
    assert run_ids(pol, plan) == ["d", "b"]
    assert pol.ids(plan.paused) == ["c"] and pol.fields("c")["state"] == "paused"
    assert pol.ids(plan.preempted) == ["c"] and pol.fields("c")["preemptions"] == 1
    assert pol.n_resident == 3


def test_mixed_phase_batching_runs_prompt_and_denoising_blocks_together():
    pol = DwisePolicy(slots=2, k=8)
    pol.add_many(["prefill", "decode"], [2, 0], [1, 4])
    plan = pol.schedule()
    assert run_ids(pol, plan) == ["prefill", "decode"] and plan.prompt.tolist() == [True, False]


def test_prefill_first_barrier_of_the_default_scheduler():
    pol = DwisePolicy(slots=2, k=1, ranking="arrival", prefill_first=True)
    pol.add_many(["decode", "prefill"], [0, 2], [0, 0])
    plan = pol.schedule()
    assert run_ids(pol, plan) == ["prefill"]  # the decoder stalls while a prompt block is left
    assert len(plan.preempted) == 0


def test_line12_13_prompt_block_decrements_P():
    pol = DwisePolicy(slots=1)
    pol.add("a", prompt_blocks=3, estimate=7)
    plan = pol.schedule()
    pol.complete_round(plan)
    assert pol.fields("a")["P"] == 2 and pol.fields("a")["r_hat"] == 7
    assert pol.remaining_work("a") == 9


def test_line14_15_first_denoising_round_takes_the_refined_estimate_once():
    pol = DwisePolicy(slots=1)
    pol.add("a", prompt_blocks=0, estimate=20)
    plan = pol.schedule()
    pol.complete_round(plan, refined=np.array([5.0]))
    assert pol.fields("a")["r_hat"] == 5.0
    plan = pol.schedule()
    pol.complete_round(plan, refined=np.array([50.0]))  # second denoising round: refinement ignored
    assert pol.fields("a")["r_hat"] == 4.0


def test_line17_decrement_floors_at_zero():
    pol = DwisePolicy(slots=1)
    pol.add("a", prompt_blocks=0, estimate=1.5)
    for expected in (0.5, 0.0, 0.0):
        pol.complete_round(pol.schedule())
        assert pol.fields("a")["r_hat"] == expected


def test_line20_finished_requests_leave_and_free_kv_and_slots():
    pol = DwisePolicy(slots=2, kv_budget=10)
    pol.add_many(["a", "b"], [0, 0], [1, 1], [4, 4])
    plan = pol.schedule()
    freed = pol.complete_round(plan, finished=np.array([True, False]))
    assert pol.ids(freed) == [None]  # the slot was released
    assert pol.kv_used == 4 and pol.n_resident == 1
    with pytest.raises(InputError, match="not in the policy"):
        pol.fields("a")
    slot = pol.add("c", 0, 0)
    assert slot == int(freed[0])  # slots are reused


def test_per_request_complete_equals_vectorised_complete_round():
    def make():
        pol = DwisePolicy(slots=3)
        pol.add_many(["p", "q", "r"], [1, 0, 0], [6, 4, 8])
        return pol, pol.schedule()

    vec, plan = make()
    vec.complete_round(plan, finished=np.array([False, False, True]), refined=np.array([np.nan, 2.0, 1.0]))
    one, plan1 = make()
    assert one.ids(plan1.run) == ["q", "p", "r"]  # R: q 4, p 7, r 8
    for rid, ref, fin in zip(one.ids(plan1.run), (None, 2.0, 1.0), (False, False, True)):
        one.complete(rid, refined=ref, finished=fin)
    for rid in ("p", "q"):
        assert vec.fields(rid) == one.fields(rid)
    assert vec.fields("q")["r_hat"] == 3.0 and vec.fields("p")["P"] == 0 and vec.n_resident == 2


def test_ties_break_by_arrival_order_then_id():
    pol = DwisePolicy(slots=3)
    pol.add_many(["z", "y", "x"], [1, 1, 1], [2, 2, 2])
    assert run_ids(pol, pol.schedule()) == ["z", "y", "x"]  # order given = arrival order
    pol2 = DwisePolicy(slots=3)
    pol2.add_many(["z", "y", "x"], [1, 1, 1], [2, 2, 2], arrival=[0.0, 0.0, 0.0])
    assert run_ids(pol2, pol2.schedule()) == ["x", "y", "z"]  # same arrival time: by id
    pol3 = DwisePolicy(slots=3)
    pol3.add_many(["z", "y", "x"], [1, 1, 1], [2, 2, 2], arrival=[0.2, 0.1, 0.3])
    assert run_ids(pol3, pol3.schedule()) == ["y", "z", "x"]


def test_remove_aborts_waiting_and_resident_requests():
    pol = DwisePolicy(slots=1, kv_budget=5)
    pol.add_many(["a", "b"], [0, 0], [1, 2], [3, 2])
    pol.schedule()
    pol.remove("a")
    pol.remove("b")
    assert pol.kv_used == 0 and pol.n_waiting == 0 and pol.n_resident == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(slots=0), "slots \\(B\\) must be a positive integer"),
        (dict(slots=-3), "slots \\(B\\) must be a positive integer"),
        (dict(slots=4, k=0.5), "k \\(resident-set multiplier\\) must be at least 1"),
        (dict(slots=4, kv_budget=0), "KV budget must be positive"),
        (dict(slots=4, ranking="lifo"), "ranking must be one of"),
    ],
)
def test_bad_configuration_is_one_clear_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        DwisePolicy(**kwargs)
    assert "\n" not in str(err.value)


def test_kv_budget_too_small_for_one_request():
    pol = DwisePolicy(slots=4, kv_budget=8)
    with pytest.raises(ConfigError, match="KV budget 8 is smaller than request 'huge'.*12"):
        pol.add("huge", 2, 1, kv_reservation=12)


def test_bad_request_fields():
    pol = DwisePolicy(slots=4)
    with pytest.raises(InputError, match="negative prompt blocks"):
        pol.add("a", -1, 0)
    with pytest.raises(InputError, match="finite and >= 0"):
        pol.add("a", 1, float("nan"))
    pol.add("a", 1, 1)
    with pytest.raises(InputError, match="already queued"):
        pol.add("a", 1, 1)


# --- the server's budgets, the starvation guard (issue 40) ---------------------------------------------


def test_a_pick_the_server_could_not_run_is_paused_and_a_standby_request_runs_in_its_slot():
    pol = DwisePolicy(slots=2, k=8)
    pol.add_many(["a", "b", "c", "d"], [0, 0, 0, 0], [10, 20, 30, 40])
    pol.schedule()  # admits a, b (top 2)
    pol.add_many(["e"], [0], [5])
    pol.schedule()  # e ranks first: admitted, c and d still waiting
    pol.add_many(["f"], [0], [1])
    plan = pol.schedule()
    assert pol.ids(plan.run) == ["f", "e"] and pol.ids(plan.standby) == ["a", "b"]  # the backfill order
    pol.ran(plan, pol.slots_of(["f", "a"]))  # the server could not fit e: a ran in its slot
    assert [pol.fields(r)["state"] for r in "efa"] == ["paused", "running", "running"]
    pol.complete_slots(pol.slots_of(["f", "a"]), [False, False])  # f: 0 left, a: 9
    plan = pol.schedule()
    assert pol.ids(plan.run) == ["f", "e"]  # e keeps its rank
    assert pol.fields("e")["preemptions"] == 0  # it never ran: not preempted
    assert pol.fields("a")["preemptions"] == 1 and pol.ids(plan.preempted) == ["a"]
    with pytest.raises(InputError, match="not resident"):
        pol.ran(plan, pol.slots_of(["c"]))  # waiting: it cannot have run


def test_complete_slots_with_several_rounds_is_that_many_single_rounds():
    def make():
        pol = DwisePolicy(slots=3)
        pol.add_many(["p", "q", "r"], [2, 0, 0], [6, 4, 8])
        return pol, pol.schedule()

    once, plan = make()
    p, q, r = once.slots_of("pqr")
    once.complete_slots([p, q, r], [True, False, False], finished=[False, False, True], refined=[np.nan, 5.0, 1.0],
                        rounds=[1, 3, 2])  # p a prompt block; q three forwards of its block; r two, finishing
    single, plan = make()
    q, p, r = (single._slot(x) for x in "qpr")
    single.complete_slots([p, q], [True, False], refined=[np.nan, 5.0])
    single.complete_slots([q], [False])
    single.complete_slots([q], [False])
    single.complete_slots([r], [False], refined=[1.0])
    single.complete_slots([r], [False], finished=[True])
    for rid in ("p", "q"):
        assert once.fields(rid) == single.fields(rid)
    assert once.fields("q")["r_hat"] == 3.0 and once.fields("p")["P"] == 1 and once.n_resident == single.n_resident == 2


def _starved(aging: float, rounds: int = 1200) -> int | None:
    """B = 1: a request of 50 rounds arrives at round 0 behind a stream of 2-round requests that keeps
    the server busy; the round it first runs in (None: never within ``rounds``)."""
    pol = DwisePolicy(slots=1, k=4, aging=aging)
    pol.add("long", 0, 50.0)
    for t in range(rounds):
        if t % 2 == 0:
            pol.add(f"short{t}", 0, 2.0)
        plan = pol.schedule()
        if pol.ids(plan.run) == ["long"]:
            return t
        pol.complete_round(plan, finished=[pol.fields(pol.ids(plan.run)[0])["r_hat"] <= 1])
    return None


def test_starvation_guard_bounds_the_wait_of_a_long_request_under_a_stream_of_short_ones():
    assert _starved(aging=0.0) is None  # SRPT as published: it waits as long as the stream lasts
    # with aging a, a newcomer arriving t rounds later ranks behind it once 2 + a t > 50: t > 48 / a
    assert 48 / 0.1 <= _starved(aging=0.1) <= 48 / 0.1 + 50
    assert _starved(aging=1.0) <= 48 + 50


def test_aging_orders_as_remaining_work_less_aging_times_time_waited():
    pol = DwisePolicy(slots=1, k=8, aging=0.5)
    pol.add("early", 0, 10.0)  # arrives in round 0
    for _ in range(8):
        pol.schedule()  # it runs alone; stays at 10 (no complete): time passes
    pol.add("late", 0, 7.0)  # arrives in round 8: 7 + 0.5 * 8 = 11 > 10
    assert pol.ids(pol.schedule().run) == ["early"]
    assert DwisePolicy(slots=1).aging == 0.0
    with pytest.raises(ConfigError, match="aging \\(starvation guard\\) must be a finite number >= 0"):
        DwisePolicy(slots=1, aging=-1)
