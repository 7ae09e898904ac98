"""The SGLang adapter driven through a faithful fake of SGLang's dLLM path (SGLang cannot run here).

The strongest check: a fake server patched by the adapter finishes every request in exactly the
round the simulator predicts for the same policy, so the served policy is the simulated one.
"""

import numpy as np
import pytest
import torch

from dwise_predict.errors import BundleError, ConfigError
from dwise_predict.serving.bundle import load_bundle
from dwise_predict.serving.simulator import SimConfig, SimRequests, simulate
from dwise_predict.serving.sglang_adapter import install
from fakes import sglang_fake as fake
from fakes.serving_bundle import served_bundle

BS, BUDGET = 8, 256  # the bundle's block size; output budget in tokens


@pytest.fixture(scope="module")
def served():
    path, traces = served_bundle()
    bundle = load_bundle(path, backend="torch", expect_decoding={"block_size": BS})
    ds = traces.split("eval")
    r = ds.requests.iloc[:40]
    P = np.maximum(r["prompt_blocks"].to_numpy(), 1)  # whole prompt blocks, so SGLang's P equals ours
    L = P * BS
    rpb = [list(x) for x in r["rounds_per_block"]]
    features = np.stack([r["words"].to_numpy(), r["newlines"].to_numpy(), L], axis=1).astype(np.float32)
    hidden = ds.first_round[:40]
    workload = SimRequests(
        request_ids=r["request_id"].to_numpy(), prompt_blocks=P, total_rounds=np.array([sum(x) for x in rpb]),
        first_block_rounds=np.array([x[0] for x in rpb]), output_blocks=np.full(len(r), BUDGET // BS),
        admission=bundle.admission(features).astype(np.float64),
        refined=bundle.refine(hidden, L.astype(np.float32), np.full(len(r), BUDGET, np.float32)).astype(np.float64),
    )
    return bundle, workload, L, rpb, features, hidden


def make_server(served, slots, max_running, fdfo=True):
    _, workload, L, rpb, features, hidden = served
    config = fake.DllmConfig("LowConfidence", {}, BS, 0, max_running, first_done_first_out_mode=fdfo)
    scheduler = fake.Scheduler(config, batch_capacity=slots, max_total_num_tokens=10**12)
    for i, rid in enumerate(workload.request_ids):
        scheduler.waiting_queue.append(
            fake.Req(rid, [1] * int(L[i]), type("SP", (), {"max_new_tokens": BUDGET})(), config, rpb[i],
                     hidden[i], tuple(features[i]))
        )
    return scheduler, fake.DllmAlgorithm(config), fake.ModelRunner(BS, hidden.shape[1])


def finished_rounds(served, finished_at):
    return [finished_at[rid] for rid in served[1].request_ids]


def simulated(served, policy, slots, k=8, kv_budget=None):
    n = len(served[1])
    cfg = SimConfig(slots=slots, k=k, kv_budget=kv_budget, kv_slack_blocks=2)
    return simulate(served[1], policy, cfg, (np.arange(n), np.zeros(n))).completion_round.tolist()


def test_unpatched_fake_is_the_simulators_sglang_default(served):
    scheduler, algorithm, runner = make_server(served, slots=6, max_running=6)
    got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
    assert got == simulated(served, "sglang-default", slots=6)


@pytest.mark.parametrize("kv_blocks", [None, 300])
def test_patched_fake_serves_exactly_the_simulated_dwise_schedule(served, kv_blocks):
    bundle = served[0]
    handle = install(bundle, slots=6, k=2, kv_budget_tokens=None if kv_blocks is None else kv_blocks * BS,
                     features=lambda req: req.features, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12)
        got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
        # the pooled first-round rows the adapter captured are the requests' hidden vectors
        assert handle.state.pooled.shape[1] == bundle.hidden_size
    finally:
        handle.uninstall()
    assert got == simulated(served, "dwise-refined", slots=6, k=2, kv_budget=kv_blocks)
    assert fake.SchedulerDllmMixin._fetch_waiting_reqs.__qualname__.startswith("SchedulerDllmMixin")  # restored


def test_without_a_bundle_the_patch_ranks_by_prompt_blocks_only(served):
    handle = install(None, slots=4, k=2, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=4, max_running=8)
        got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
    finally:
        handle.uninstall()
    assert got == simulated(served, "dwise-zero", slots=4, k=2)


def test_sync_mode_advances_the_policy_by_every_forward_of_the_step(served):
    handle = install(served[0], slots=6, k=2, features=lambda req: req.features, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12, fdfo=False)
        finished = fake.serve(scheduler, algorithm, runner)
        assert handle.state.policy.n_resident == 0 and handle.state.policy.n_waiting == 0
    finally:
        handle.uninstall()
    work = served[1].prompt_blocks + served[1].total_rounds
    assert len(finished) == len(work) and runner.calls >= work.sum() / 6


def test_refusals_are_one_clear_line(served):
    with pytest.raises(ConfigError, match="needs prompt features"):
        install(served[0], resolve=fake.resolve)
    handle = install(None, slots=8, k=8, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=8, max_running=16)
        with pytest.raises(ConfigError, match="--max-running-requests is 16: raise it to at least k\\*B"):
            scheduler.get_new_batch_dllm(None)
    finally:
        handle.uninstall()
    handle = install(served[0], slots=2, k=1, features=lambda r: r.features, resolve=fake.resolve)
    try:
        config = fake.DllmConfig("LowConfidence", {}, 32, 0, 4)
        scheduler = fake.Scheduler(config, 2, 10**9)
        scheduler.waiting_queue.append(fake.Req("x", [1] * 64, type("SP", (), {"max_new_tokens": 64})(), config, [1],
                                                np.zeros(32, np.float32), (1, 0, 64)))
        with pytest.raises(BundleError, match="block_size 8 but SGLang runs 32"):
            scheduler.get_new_batch_dllm(None)
    finally:
        handle.uninstall()


def test_logits_hook_pools_block_rows_into_a_static_buffer(served):
    handle = install(served[0], slots=2, k=1, features=lambda r: r.features, resolve=fake.resolve,
                     device="cpu")
    try:
        buffer = handle.state.pooled
        handle.state.block_size = BS
        rows = torch.arange(2 * BS * 32, dtype=torch.float32).view(2 * BS, 32)
        fake.LogitsProcessor()._get_dllm_logits(rows, None, None)
        assert handle.state.pooled is buffer  # written in place: the address a CUDA graph captured
        torch.testing.assert_close(buffer[:2], rows.view(2, BS, 32).mean(dim=1))
    finally:
        handle.uninstall()
