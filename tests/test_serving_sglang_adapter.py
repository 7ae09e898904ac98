"""The SGLang adapter driven through a fake built on SGLang's own dLLM code (SGLang cannot run here).

The fake (``tests/fakes/sglang_fake.py``) runs SGLang 0.5.23's real ``ReqDllmMixin``,
``SchedulerDllmMixin``, ``DllmManager`` and ``DllmAlgorithm.run`` from the wheel, so blocks cost
r + 1 forwards, prompts lay out as full blocks plus a leftover block, prefixes hit a radix cache,
and batches obey an adder's budgets. Each test below names the "Why" bullet of issue 16 it covers;
each fails on the adapter before that issue.
"""

import collections
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.engine import prefill_rounds  # noqa: E402
from dwise_predict.errors import BundleError, ConfigError  # noqa: E402
from dwise_predict.bundles.load import load_bundle  # noqa: E402
from dwise_predict.bundles.manifest import BundleManifest  # noqa: E402
from dwise_predict.serving.policy import DwisePolicy  # noqa: E402
from dwise_predict.simulation.simulator import SimConfig, SimRequests, simulate  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
from dwise_predict.serving.sglang import UNWRITTEN, install  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402
from fakes.serving_bundle import served_bundle  # noqa: E402

BS, BUDGET = 8, 256  # the bundle's block size; output budget in tokens


class SP:
    def __init__(self, max_new_tokens=BUDGET):
        self.max_new_tokens = max_new_tokens


# the fake model's logits have one vocabulary entry, its end-of-sequence id: top-1 probability 1 (over
# any threshold below 1), entropy 0 and a stop token certain at every masked position
FAKE_SIGNALS = np.array([1.0, 1.0, 0.0, 1.0], np.float32)


@pytest.fixture(scope="module")
def served():
    path, traces = served_bundle()
    bundle = load_bundle(path, backend="torch", expect_decoding={"block_size": BS})
    ds = traces.split("eval")
    r = ds.requests.iloc[:40]
    P = np.maximum(r["prompt_blocks"].to_numpy(), 1)  # whole prompt blocks, so SGLang's P equals ours
    L = P * BS
    # a LowConfidence block costs r + 1 forwards, 2 <= r + 1 <= block + 1 (at least one fill per step;
    # the synthetic traces are not bound by that, so clip them to what SGLang can run)
    rpb = [[min(max(int(v), 2), BS + 1) for v in x] for x in r["rounds_per_block"]]
    features = np.stack([r["words"].to_numpy(), r["newlines"].to_numpy(), L], axis=1).astype(np.float32)
    hidden, prompt_rows = ds.first_round[:40], ds.prompt_last[:40]
    workload = SimRequests(
        request_ids=r["request_id"].to_numpy(), prompt_blocks=P, total_rounds=np.array([sum(x) for x in rpb]),
        first_block_rounds=np.array([x[0] for x in rpb]), output_blocks=np.full(len(r), BUDGET // BS),
        admission=bundle.admission(features).astype(np.float64),
        refined=bundle.refine(hidden, prompt_rows, L.astype(np.float32), np.full(len(r), BUDGET, np.float32),
                              np.tile(FAKE_SIGNALS, (len(r), 1))).astype(np.float64),
    )
    return bundle, workload, L, rpb, features, hidden, prompt_rows


def prompt(i, n, shared=0):
    """Prompt ids of request i: the first ``shared`` tokens common to all, the rest its own."""
    return [1 + (t % 50) for t in range(shared)] + [100 + 1000 * i + t for t in range(n - shared)]


def make_server(served, slots, max_running, fdfo=True, graph=False, max_prefill_tokens=10**9):
    _, workload, L, rpb, features, hidden, prompt_rows = served
    config = fake.config(BS, max_running, fdfo=fdfo)
    scheduler = fake.Scheduler(config, batch_capacity=slots, max_total_num_tokens=10**12,
                               max_prefill_tokens=max_prefill_tokens)
    for i, rid in enumerate(workload.request_ids):
        scheduler.waiting_queue.append(fake.Req(rid, prompt(i, int(L[i])), SP(), config, rpb[i], hidden[i],
                                                tuple(features[i]), prompt_hidden=prompt_rows[i]))
    runner = fake.ModelRunner(BS, hidden.shape[1], cuda_graph=graph, max_bs=slots)
    return scheduler, fake.FillAlgorithm(config), runner


def finished_rounds(served, finished_at):
    return [finished_at[rid] for rid in served[1].request_ids]


def simulated(served, policy, slots, k=8, kv_budget=None):
    n = len(served[1])
    cfg = SimConfig(slots=slots, k=k, kv_budget=kv_budget, kv_slack_blocks=2)
    return simulate(served[1], policy, cfg, (np.arange(n), np.zeros(n))).completion_round.tolist()


def hooked(bundle, slots, k, **kw):
    kw.setdefault("features", lambda req: req.features)
    if bundle is not None:
        kw.setdefault("block_size", BS)
        kw.setdefault("device", "cpu")
        kw.setdefault("max_batch", slots)
    return install(bundle, slots=slots, k=k, resolve=fake.resolve, **kw)


class RecordingBundle:
    """The served bundle, remembering the pooled rows each refinement saw."""

    def __init__(self, bundle):
        self.bundle, self.seen, self.seen_prompt, self.signals = bundle, [], [], []
        self.manifest, self.hidden_size = bundle.manifest, bundle.hidden_size
        self.prompt_last_mean = bundle.prompt_last_mean

    def admission(self, x):
        return self.bundle.admission(x)

    def refine(self, pooled, prompt_last, tokens, budget, signals):
        self.seen.append(pooled.clone())
        self.seen_prompt.append(prompt_last.clone())
        self.signals.append(signals.clone())
        return self.bundle.refine(pooled, prompt_last, tokens, budget, signals)


# --- the fake is SGLang's semantics, not ours ----------------------------------------------------------


def test_fake_blocks_cost_r_plus_1_forwards_and_the_leftover_prompt_opens_the_first_block():
    config = fake.config(BS, 1)
    scheduler = fake.Scheduler(config, batch_capacity=1, max_total_num_tokens=10**9)
    n, forwards = 20, [3, 5, 2]  # 2 full prompt blocks + 4 leftover tokens; fills 2, 4, 1
    req = fake.Req("a", prompt(0, n), SP(), config, forwards, np.zeros(4, np.float32), (1, 0, n))
    scheduler.waiting_queue.append(req)
    runner = fake.ModelRunner(BS, 4)
    fake.serve(scheduler, fake.FillAlgorithm(config), runner)
    assert runner.calls == prefill_rounds(n, BS) + sum(forwards) == 2 + 10
    assert len(req.output_ids) == (BS - n % BS) + BS + BS  # the leftover positions are not output


def test_sglang_runs_prompt_blocks_and_output_blocks_in_one_forward_mode():
    """The hook keeps a block's last forward as the row a later prompt forward over the same tokens
    would compute (``_PromptRows``). That holds because SGLang's scheduler gives a prompt block and an
    output block's denoising forward the same forward mode, DLLM_EXTEND, and its attention backends
    choose masks by forward mode (the cached prefix, then the block bidirectionally), not by a
    request's phase. Only an algorithm that encodes the context separately
    (``requires_separate_context_encoding``) prefills as EXTEND, and there the hook keys no rows."""
    config = fake.config(BS, 1)
    scheduler = fake.Scheduler(config, batch_capacity=1, max_total_num_tokens=10**9)
    req = fake.Req("a", prompt(0, 20), SP(), config, [2, 2], np.zeros(4, np.float32), (1, 0, 20))
    scheduler.waiting_queue.append(req)
    runner, algorithm = fake.ModelRunner(BS, 4), fake.FillAlgorithm(config)
    modes = []
    while not req.finished():
        batch = scheduler.step(algorithm, runner)  # SGLang's _process_dllm_batches picks its mode
        modes.append((req.dllm_phase, batch.forward_mode))  # the phase SGLang staged the batch in
    assert modes == [(fake.DllmReqPhase.STAGING_PREFILL, fake.ForwardMode.DLLM_EXTEND)] * prefill_rounds(20, BS) \
        + [(fake.DllmReqPhase.STAGING_DECODE, fake.ForwardMode.DLLM_EXTEND)] * 4  # two blocks of two forwards

    # the separate-context algorithms: SGLang's own method on a scheduler holding one prefill request
    for separate, mode in ((False, fake.ForwardMode.DLLM_EXTEND), (True, fake.ForwardMode.EXTEND)):
        stub = SimpleNamespace(
            dllm_config=SimpleNamespace(requires_separate_context_encoding=separate),
            dllm_manager=SimpleNamespace(get_prefill_requests=lambda: [req]),
            _process_batch_by_phase=lambda *args, **kwargs: None)
        assert fake.RealSchedulerDllmMixin._process_dllm_batches(stub, None, None) == mode
    # and nothing on the forward path (model runner, attention backends, models) reads a request's phase
    srt = sglang_reference.source_root() / "sglang" / "srt"
    forward_path = [f for d in ("model_executor", "layers", "models") for f in (srt / d).rglob("*.py")]
    assert len(forward_path) > 100 and (srt / "layers" / "attention" / "triton_backend.py") in forward_path
    assert [f for f in forward_path if "dllm_phase" in f.read_text() or "DllmReqPhase" in f.read_text()] == []


def test_unpatched_fake_is_the_simulators_sglang_default(served):
    scheduler, algorithm, runner = make_server(served, slots=6, max_running=6)
    got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
    assert got == simulated(served, "sglang-default", slots=6)


# --- the policy the hook serves is the simulated one ----------------------------------------------------


@pytest.mark.parametrize("kv_blocks", [None, 300])
def test_patched_fake_serves_exactly_the_simulated_dwise_schedule(served, kv_blocks):
    handle = hooked(served[0], slots=6, k=2, kv_budget_tokens=None if kv_blocks is None else kv_blocks * BS)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12)
        got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
        assert handle.stats.refined == len(got) and handle.stats.finished == len(got)
        assert handle.state.policy.n_resident == handle.state.policy.n_waiting == 0
    finally:
        handle.uninstall()
    assert got == simulated(served, "dwise-refined", slots=6, k=2, kv_budget=kv_blocks)
    assert fake.SchedulerDllmMixin._fetch_waiting_reqs.__module__ == "sglang.srt.dllm.mixin.scheduler"  # restored


def test_without_a_bundle_the_patch_ranks_by_prompt_blocks_only(served):
    handle = install(None, slots=4, k=2, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=4, max_running=8)
        got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
    finally:
        handle.uninstall()
    assert got == simulated(served, "dwise-zero", slots=4, k=2)


@pytest.mark.parametrize("slots", [1, 6])
def test_sync_mode_advances_the_policy_by_every_forward_of_the_step(served, slots, monkeypatch):
    """Without FDFO a step runs a block to its end: every request of the step is advanced by the
    forwards the step ran (its slowest block's), so alone in its steps a request is advanced by its
    own rounds exactly, and in company by at least them."""
    rounds = collections.Counter()
    complete = DwisePolicy.complete_slots

    def counted(self, slots_, prompt, finished=None, refined=None, steps=1):
        for rid, is_prompt, n in zip(self.ids(slots_), prompt, np.broadcast_to(steps, np.shape(slots_))):
            rounds[rid] += 0 if is_prompt else int(n)
        return complete(self, slots_, prompt, finished, refined, steps)

    monkeypatch.setattr(DwisePolicy, "complete_slots", counted)
    handle = hooked(served[0], slots=slots, k=2)
    try:
        scheduler, algorithm, runner = make_server(served, slots=slots, max_running=2 * slots, fdfo=False)
        finished = fake.serve(scheduler, algorithm, runner)
        assert handle.state.policy.n_resident == 0 and handle.state.policy.n_waiting == 0
    finally:
        handle.uninstall()
    work = served[1].prompt_blocks + served[1].total_rounds
    assert len(finished) == len(work) and runner.calls >= work.sum() / slots
    advanced = np.array([rounds[rid] for rid in served[1].request_ids])
    if slots == 1:
        assert (advanced == served[1].total_rounds).all()
    else:
        assert (advanced >= served[1].total_rounds).all() and advanced.sum() > served[1].total_rounds.sum()


# --- Why, CUDA graphs ------------------------------------------------------------------------------------


def test_graph_replays_give_the_same_pooled_rows_as_eager_python(served):
    """Graphs captured after install replay the pooling copy: refinement sees the true rows, not zeros."""
    seen, seen_prompt = {}, {}
    for graph in (False, True):
        bundle = RecordingBundle(served[0])
        handle = hooked(bundle, slots=6, k=2)
        try:
            scheduler, algorithm, runner = make_server(served, slots=6, max_running=12, graph=graph)
            fake.serve(scheduler, algorithm, runner)
        finally:
            handle.uninstall()
        seen[graph], seen_prompt[graph] = torch.cat(bundle.seen), torch.cat(bundle.seen_prompt)
        # the early signals come from the same forward's logits, outside the replayed graph
        torch.testing.assert_close(torch.cat(bundle.signals), torch.tensor(FAKE_SIGNALS).expand(40, 4))
    torch.testing.assert_close(seen[True], seen[False])
    torch.testing.assert_close(seen_prompt[True], seen_prompt[False])
    # every pooled row is some request's hidden vector (the fake model's block rows), and every
    # prompt_last row its prompt vector (its last prompt block's rows)
    for rows, vectors in ((seen[True], served[5]), (seen_prompt[True], served[6])):
        match = (rows[:, None, :] - torch.as_tensor(vectors)[None]).abs().amax(dim=-1).amin(dim=1)
        assert len(rows) == 40 and float(match.max()) < 1e-5


def test_early_signals_are_computed_for_first_round_rows_only(served, monkeypatch):
    """The signals' softmax runs over the vocabulary for every row it is given: the hook gives it the
    rows whose first denoising forward the step runs (named by ForwardBatch.rids), one per request over
    the whole run instead of every row of every step, and serves the same schedule."""
    import dwise_predict.engine.signals as signals_mod

    real, rows_given = signals_mod.early_signals, []

    def counting(full_logits, input_ids, mask_id, block_size, threshold, stop_ids, rows=None, scratch=None):
        rows_given.append(input_ids.numel() // block_size if rows is None else len(rows))
        return real(full_logits, input_ids, mask_id, block_size, threshold, stop_ids, rows=rows, scratch=scratch)

    monkeypatch.setattr(signals_mod, "early_signals", counting)
    bundle = RecordingBundle(served[0])
    handle = hooked(bundle, slots=6, k=2)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12)
        got = finished_rounds(served, fake.serve(scheduler, algorithm, runner))
    finally:
        handle.uninstall()
    assert sum(rows_given) == len(got) == 40 and len(rows_given) < runner.calls
    torch.testing.assert_close(torch.cat(bundle.signals), torch.tensor(FAKE_SIGNALS).expand(40, 4))
    assert got == simulated(served, "dwise-refined", slots=6, k=2)


@pytest.mark.parametrize("tokenizer", [SimpleNamespace(eos_token_id=0, additional_stop_token_ids=None),
                                       SimpleNamespace(eos_token_id=None, additional_stop_token_ids={0}), None])
def test_end_probability_counts_the_ids_sglang_stops_on_through_its_tokenizer(served, tokenizer):
    """Here the model config names no end-of-sequence id; SGLang's finish rule also stops on its
    tokenizer's ``eos_token_id`` and ``additional_stop_token_ids`` (the fake model's one logit, id 0),
    and so does the signal, as ``collect`` gathers them. Without any id the hook says so."""
    bundle = RecordingBundle(served[0])
    handle = hooked(bundle, slots=6, k=2)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12)
        runner.model_config, scheduler.tokenizer = fake.ModelConfig(()), tokenizer
        if tokenizer is None:
            with pytest.raises(ConfigError, match="names no eos_token_id"):
                fake.serve(scheduler, algorithm, runner)
            return
        fake.serve(scheduler, algorithm, runner)
    finally:
        handle.uninstall()
    torch.testing.assert_close(torch.cat(bundle.signals), torch.tensor(FAKE_SIGNALS).expand(40, 4))


def test_a_graph_captured_before_install_fails_loudly_instead_of_refining_on_an_unwritten_buffer(served):
    scheduler, algorithm, runner = make_server(served, slots=6, max_running=12, graph=True)  # captured unhooked
    handle = hooked(served[0], slots=6, k=2)
    try:
        with pytest.raises(ConfigError) as err:
            fake.serve(scheduler, algorithm, runner)
    finally:
        handle.uninstall()
    assert str(err.value) == UNWRITTEN and "\n" not in UNWRITTEN


def test_refinement_needs_block_size_and_device_at_install(served):
    with pytest.raises(ConfigError, match="need block_size and device at install time"):
        install(served[0], features=lambda r: r.features, resolve=fake.resolve)
    with pytest.raises(BundleError, match="block_size 8 but SGLang runs 32"):
        install(served[0], features=lambda r: r.features, block_size=32, device="cpu", resolve=fake.resolve)


# --- Why, lifecycle --------------------------------------------------------------------------------------


def test_aborted_requests_leave_the_policy_and_new_ones_are_admitted_after_k_b_ghosts(served):
    handle = hooked(served[0], slots=2, k=2)  # k*B = 4 residents
    doomed = [str(r) for r in served[1].request_ids[:8]]

    def abort_early(step, scheduler):
        if step == 3:
            for rid in doomed:
                scheduler.abort_request(fake.AbortReq(rid=rid))

    try:
        scheduler, algorithm, runner = make_server(served, slots=2, max_running=4)
        finished = fake.serve(scheduler, algorithm, runner, before_step=abort_early)
        policy = handle.state.policy
        assert all(rid not in policy._slot_of for rid in doomed)
        assert policy.n_resident == policy.n_waiting == 0 and handle.stats.vanished == len(scheduler.aborted)
    finally:
        handle.uninstall()
    assert set(finished) | set(scheduler.aborted) == {str(r) for r in served[1].request_ids}
    assert len(finished) == 40 - len(scheduler.aborted) and set(scheduler.aborted) <= set(doomed)


def test_a_pause_in_retract_mode_leaves_requests_in_sglangs_dllm_queues_and_the_hook_keeps_them_resident(served):
    """SGLang 0.5.23 never decode-retracts a dLLM request (the running batch is emptied every step).
    ``pause_generation(mode="retract")`` (SGLang's own, from the wheel) releases the last batch's KV and
    appends its requests to the waiting queue, but leaves them in the dLLM manager's queues: the hook
    keeps them resident, once, instead of registering them as new (SGLang's ``add_waiting_reqs``
    refuses a request twice as redundant)."""
    handle = install(None, slots=3, k=2, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=3, max_running=6)
        for _ in range(5):
            scheduler.step(algorithm, runner)
        last = [r for r in scheduler.last_batch.reqs if not r.finished()]
        assert len(last) == 3 and scheduler.running_batch.reqs == []
        scheduler.pause_generation(SimpleNamespace(mode="retract"))
        manager = scheduler.dllm_manager
        for req in last:  # what SGLang did: KV released, queued again, still in the dLLM queues
            assert not req.kv.holds_kv and req.prefix_len == 0 and req.retraction_count == 1
            assert req in scheduler.waiting_queue and req in manager.waiting_queue and req in manager.staging_queue
        scheduler.continue_generation(SimpleNamespace(torch_empty_cache=False))
        scheduler.dllm_manager.init_next_round = lambda: None  # keep the staging queue: see below
        scheduler._fetch_waiting_reqs()  # the hook's admission, the step after the pause
        policy = handle.state.policy
        for req in last:
            assert req not in scheduler.waiting_queue and manager.waiting_queue.count(req) == 1
            assert policy.fields(req.rid)["state"] != "waiting"
        assert handle.stats.retracted == 3 and policy.n_resident == len(manager.waiting_queue)
    finally:
        handle.uninstall()
    # SGLang's own next step then checkpoints each of them (finish_dllm_forward on the staging queue)
    # with its KV gone and extend_end None: 0.5.23 cannot resume a dLLM server from such a pause


def test_the_fakes_adder_is_sglangs_with_kv_memory_and_token_budgets():
    """SGLang's own PrefillAdder (from the wheel) over a KV pool: a new request is admitted while its
    fill ids (prompt and mask block) plus max_new_tokens and a page fit what is free less this step's
    reservations (its block and a page per request admitted), and admission stops at the first that
    does not; KV held by running requests waits for them to finish."""
    assert fake.PrefillAdder.add_one_req.__code__.co_filename.endswith("sglang/srt/managers/schedule_policy.py")
    config = fake.config(BS, 4)
    scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=100)
    for i in range(3):  # each asks 16 prompt + 8 mask + 64 new + 1 page = 89 tokens, reserves 8 + 1
        scheduler.waiting_queue.append(fake.Req(f"r{i}", prompt(i, 16), SP(64), config, [2], np.zeros(4, np.float32),
                                                (1, 0, 16)))
    runner, algorithm = fake.ModelRunner(BS, 4), fake.FillAlgorithm(config)
    batch = scheduler.step(algorithm, runner)
    assert [r.rid for r in batch.reqs] == ["r0", "r1"]  # 89 < 100 and 89 < 100 - 9; not 89 < 100 - 18
    assert scheduler.token_to_kv_pool_allocator.used == 2 * (16 + BS)  # what their first forwards hold
    finished = fake.serve(scheduler, algorithm, runner)
    assert sorted(finished) == ["r0", "r1", "r2"] and scheduler.token_to_kv_pool_allocator.used == 0


class FixedAdmission(RecordingBundle):
    """The served bundle with admission estimates chosen by the test: each request's first feature."""

    def admission(self, x):
        return np.asarray(x, dtype=np.float32)[:, 0]


def test_a_pick_sglangs_input_budget_cuts_is_paused_and_the_next_ranked_runs_in_its_slot(served):
    """Without chunked prefill SGLang's adder refuses a prompt whose remaining fill ids reach the step's
    input-token budget (--max-prefill-tokens) once the step holds a request, and goes on taking
    shorter ones. The hook gives that slot to the next-ranked resident in the same step, and the
    policy records the pick as paused, not running; it runs once it heads the step."""
    config = fake.config(BS, 8)
    width = served[5].shape[1]
    bundle = FixedAdmission(served[0])
    handle = hooked(bundle, slots=2, k=2)

    def req(rid, n, estimate):
        return fake.Req(rid, prompt(len(rid) + ord(rid[-1]), n), SP(), config, [2, 2], served[5][0], (estimate, 0, n),
                        prompt_hidden=served[6][0])

    try:
        scheduler = fake.Scheduler(config, batch_capacity=8, max_total_num_tokens=10**9, max_prefill_tokens=5 * BS,
                                   chunked_prefill_size=None)
        runner, algorithm = fake.ModelRunner(BS, width, max_bs=4), fake.FillAlgorithm(config)
        scheduler.waiting_queue += [req("b", 2 * BS, 20), req("c", 2 * BS, 20)]
        scheduler.step(algorithm, runner)  # b and c resident
        scheduler.waiting_queue += [req("a", 2 * BS, 0), req("long", 9 * BS, 0)]
        batch = scheduler.step(algorithm, runner)  # picks a (R 2) and long (R 9); b, c standby (R 21)
        policy = handle.state.policy
        assert [r.rid for r in batch.reqs] == ["a", "b"]  # long's 80 fill ids >= 40 - 8 left: b in its slot
        assert policy.fields("long")["state"] == "paused" and policy.fields("long")["preemptions"] == 0
        assert (handle.stats.budget_overrides, handle.stats.backfilled) == (1, 1)
        finished = fake.serve(scheduler, algorithm, runner)
    finally:
        handle.uninstall()
    assert sorted(finished) == ["a", "b", "c", "long"]


@pytest.mark.parametrize("fdfo,graph", [(False, False), (True, True)])
def test_an_idle_batch_goes_through_the_hook_and_changes_nothing(served, fdfo, graph):
    """DP attention runs an IDLE batch on a rank with nothing to run (SGLang's get_idle_batch:
    no requests, forward mode IDLE) through DllmAlgorithm.run, and hands its result to
    process_batch_result_idle, not to process_batch_result_dllm. Eager, its logits are None (the
    logits processor computes dLLM logits for DLLM_EXTEND only); replayed, zero rows. SGLang's own
    LowConfidence runs it in sync mode and from a graph (eager FDFO fails in SGLang's step itself);
    the hook passes it through, and serves the same batches as without it."""
    low_confidence = fake.SGL.algorithms["LowConfidence"](fake.config(BS, 12, fdfo=fdfo))
    batches = {}
    for idle in (True, False):
        handle = hooked(served[0], slots=6, k=2)
        try:
            scheduler, algorithm, runner = make_server(served, slots=6, max_running=12, fdfo=fdfo, graph=graph)
            steps = []
            while scheduler.waiting_queue or not scheduler.dllm_manager.is_empty():
                if idle and len(steps) % 3 == 1:
                    scheduler.idle_step(low_confidence, runner)
                batch = scheduler.step(algorithm, runner)
                steps.append([r.rid for r in batch.reqs] if batch else [])
            batches[idle] = steps
            assert handle.stats.idle == runner.idle_calls == (len(steps) + 1) // 3 * idle
            assert handle.stats.refined == handle.stats.finished == 40
        finally:
            handle.uninstall()
    assert batches[True] == batches[False]


def test_one_device_to_host_copy_per_step_and_none_without_a_first_denoising_round(served, tmp_path, monkeypatch):
    """Per step the hook (and the recorder it feeds) copies from the device once at most: the refined
    estimates, early signals and recorded rows of every request in its first denoising round
    together, and nothing in a step without one."""
    from dwise_predict.collectors.live import LiveRecorder, live_manifest

    copies = collections.Counter()
    watched = tuple(f"/serving/sglang/{part}.py" for part in ("hook", "step", "buffers", "requests", "signals", "surface",
                                                               "install")) + ("collectors/live.py",)

    def counting(name):
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(watched):
                copies[name] += 1
            return real(self, *args, **kwargs)
        return method

    for name in ("cpu", "tolist", "item", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    width = served[5].shape[1]
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, features=lambda req: req.features, every=16,
                            manifest=live_manifest({"name": "fake", "hidden_size": width}, "LowConfidence", {}, BS, BUDGET))
    handle = hooked(served[0], slots=6, k=2, recorder=recorder)
    per_step = []
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12)
        while scheduler.waiting_queue or not scheduler.dllm_manager.is_empty():
            before, refined = sum(copies.values()), handle.stats.refined
            scheduler.step(algorithm, runner)
            per_step.append((sum(copies.values()) - before, handle.stats.refined > refined))
    finally:
        handle.uninstall()
        recorder.close()
    assert handle.stats.refined == 40 and len(per_step) > 40
    assert [n for n, _ in per_step] == [int(first) for _, first in per_step]  # one copy, and only there
    assert handle.stats.host_transfers == sum(first for _, first in per_step) == copies["cpu"]
    assert len(load_traces(tmp_path / "t")) == 40


def test_an_oversized_request_is_aborted_with_a_message_and_its_batch_proceeds(served):
    handle = hooked(served[0], slots=4, k=2, kv_budget_tokens=300 * BS)  # every other request fits
    try:
        scheduler, algorithm, runner = make_server(served, slots=4, max_running=8)
        big = scheduler.waiting_queue[5]
        big.sampling_params = SP(10**6)
        finished = fake.serve(scheduler, algorithm, runner)
        assert handle.stats.oversized == 1
    finally:
        handle.uninstall()
    assert list(scheduler.aborted) == [big.rid] and "worst-case KV reservation" in scheduler.aborted[big.rid]
    assert len(finished) == 39 and big.rid not in finished


def test_an_oversized_request_is_aborted_alone_not_every_rid_it_prefixes(served):
    """SGLang's ``abort_request`` aborts every request whose rid starts with the one given (the fake's
    is that rule, as SGLang 0.5.23 writes it): the hook's abort of the oversized ``req-1`` also aborted
    ``req-10``, which fits. The hook now refuses the one request as SGLang refuses a queued request
    (``_abort_on_queued_limit``: out of the waiting queue, its client told why, HTTP 400)."""
    config = fake.config(BS, 8)
    handle = hooked(served[0], slots=4, k=2, kv_budget_tokens=300 * BS)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        for i, rid in enumerate(("req-1", "req-10", "req-2")):
            scheduler.waiting_queue.append(fake.Req(rid, prompt(i, 2 * BS), SP(10**6 if rid == "req-1" else BUDGET),
                                                    config, [2, 2], served[5][i], (1, 0, 2 * BS),
                                                    prompt_hidden=served[6][i]))
        finished = fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, served[5].shape[1]))
        assert (handle.stats.oversized, handle.stats.vanished) == (1, 0)
    finally:
        handle.uninstall()
    assert list(scheduler.aborted) == ["req-1"] and "worst-case KV reservation" in scheduler.aborted["req-1"]
    assert sorted(finished) == ["req-10", "req-2"]


class PessimisticRefinement(FixedAdmission):
    """Admission: each request's first feature; refinement: far more rounds than admitted, so a request
    that started falls behind every one that has not."""

    def refine(self, pooled, prompt_last, tokens, budget, signals):
        return torch.full((pooled.shape[0],), 1000.0)


def rows_served(served, max_running, attn_dp_size, steps, n=16):
    """``steps`` steps of one of ``attn_dp_size`` attention-DP workers of a server given
    ``--max-running-requests max_running`` (its rows: SGLang's ``resolve_max_num_reqs``), while ``n``
    one-block prompts arrive two a step, each admitted shorter than the one before. Returns the
    scheduler, the requests and whether each step ran a batch."""
    config = fake.config(BS, max_running)
    scheduler = fake.Scheduler(config, batch_capacity=8, max_total_num_tokens=10**9, attn_dp_size=attn_dp_size)
    reqs = [fake.Req(f"r{i}", prompt(i, BS), SP(), config, [2, 2], served[5][i], (100 - i, 0, BS),
                     prompt_hidden=served[6][i]) for i in range(n)]
    algorithm, runner = fake.FillAlgorithm(config), fake.ModelRunner(BS, served[5].shape[1])
    ran = []
    for step in range(steps):
        scheduler.waiting_queue += reqs[2 * step:2 * step + 2]
        ran.append(scheduler.step(algorithm, runner) is not None)
    return scheduler, reqs, ran


def test_a_resident_set_beyond_the_workers_request_rows_is_refused_not_stalled(served):
    """Under attention DP SGLang gives each worker ``--max-running-requests // dp`` request rows; a
    request holds one from its first forward to its end, and SGLang admits a request that has none only
    into a free row (``get_num_allocatable_reqs``). The hook held k*B to the flag: 8 residents on a
    worker of 4 rows. Once the 4 rows went to requests the policy then ranked behind ones that had not
    started, SGLang refused every pick and every backfill, and no batch ran again (5 batches, then
    empty steps, none of 16 finished). The first step now holds k*B to the worker's rows and says what
    to change; with the flag raised as it says, the same requests all finish."""
    handle = hooked(PessimisticRefinement(served[0]), slots=2, k=4)
    try:
        with pytest.raises(ConfigError, match=re.escape(
                "DWISE keeps up to k*B = 8 requests resident but this scheduler holds 4 request rows (SGLang's "
                "max_running_requests for this worker, from --max-running-requests 8): raise --max-running-requests "
                "to 8 times the attention-DP size")):
            scheduler, reqs, ran = rows_served(served, max_running=8, attn_dp_size=2, steps=400)
            assert scheduler.max_running_requests == scheduler.req_to_token_pool.size == 4
            pytest.fail(f"no refusal: {sum(ran)} batches ran, the last {ran[::-1].index(True)} steps empty; "
                        f"{sum(r.finished() for r in reqs)} of 16 finished")
    finally:
        handle.uninstall()
    handle = hooked(PessimisticRefinement(served[0]), slots=2, k=4)
    try:
        scheduler, reqs, ran = rows_served(served, max_running=16, attn_dp_size=2, steps=400)
    finally:
        handle.uninstall()
    assert all(r.finished() for r in reqs) and scheduler.req_to_token_pool.available_size() == 8


class CountedReconcile:
    """``RequestTable.reconcile`` wrapped: the steps whose admission walked SGLang's queues."""

    def __init__(self, reconcile):
        self.reconcile, self.rounds = reconcile, []

    def __call__(self, table, scheduler):
        self.rounds.append(table.stats.rounds)
        return self.reconcile(table, scheduler)


def test_a_duplicate_request_id_is_refused_at_once_not_walked_every_step(served, monkeypatch):
    """The hook keys requests by rid: a second request under an id it holds was never registered, and
    the waiting queue's count differed from the policy's every step after it came, so every step walked
    SGLang's queues (until the first one finished; then the second was registered and served under the
    same id). It is now refused at once with an exact abort saying why, and the walks stop."""
    from dwise_predict.serving.sglang.requests import RequestTable

    config = fake.config(BS, 8)
    handle = hooked(served[0], slots=2, k=2)
    counted = CountedReconcile(RequestTable.reconcile)
    monkeypatch.setattr(RequestTable, "reconcile", lambda table, scheduler: counted(table, scheduler))

    def req(rid, i, blocks):
        return fake.Req(rid, prompt(i, BS), SP(), config, [3] * blocks, served[5][i], (1, 0, BS),
                        prompt_hidden=served[6][i])
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        runner, algorithm = fake.ModelRunner(BS, served[5].shape[1]), fake.FillAlgorithm(config)
        scheduler.waiting_queue += [req("a", 0, 8), req("b", 1, 2)]
        for _ in range(3):
            scheduler.step(algorithm, runner)
        assert not counted.rounds
        again = req("a", 2, 1)  # another client's request, under an id the hook holds
        scheduler.waiting_queue.append(again)
        finished = fake.serve(scheduler, algorithm, runner)
    finally:
        handle.uninstall()
    assert len(counted.rounds) <= 1 and handle.stats.duplicates == 1
    assert scheduler.aborted == {"a": "dwise: request id a is already held by another request: send it under an "
                                      "id of its own"}
    assert sorted(finished) == ["a", "b"] and not again.output_ids  # the first a, served; the second never ran


def test_batch_budgets_that_override_dwise_order_are_counted(served):
    handle = hooked(served[0], slots=6, k=2)
    try:
        scheduler, algorithm, runner = make_server(served, slots=6, max_running=12, max_prefill_tokens=3 * BS)
        finished = fake.serve(scheduler, algorithm, runner)
        assert handle.stats.budget_overrides > 0
    finally:
        handle.uninstall()
    assert len(finished) == 40


# --- Why, units ------------------------------------------------------------------------------------------


def test_p_follows_the_prefix_match(served):
    config = fake.config(BS, 4)
    handle = install(None, slots=2, k=2, resolve=fake.resolve)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=2, max_total_num_tokens=10**9)
        a = fake.Req("a", prompt(0, 36, shared=24), SP(), config, [2, 2], np.zeros(4, np.float32), (1, 0, 36))
        scheduler.waiting_queue.append(a)
        runner, algorithm = fake.ModelRunner(BS, 4), fake.FillAlgorithm(config)
        while not a.finished():
            scheduler.step(algorithm, runner)
        b = fake.Req("b", prompt(1, 36, shared=24), SP(), config, [2], np.zeros(4, np.float32), (1, 0, 36))
        scheduler.waiting_queue.append(b)
        scheduler.step(algorithm, runner)  # b staged: SGLang matched 24 cached tokens (3 blocks)
        assert handle.state.policy.fields("b")["P"] == prefill_rounds(36, BS, 24) - 1 == 0
        assert handle.stats.prefix_blocks == 3
        before = runner.calls
        while not b.finished():
            scheduler.step(algorithm, runner)
        assert runner.calls - before + 1 == prefill_rounds(36, BS, 24) + 2  # 1 prompt block + 2 forwards
    finally:
        handle.uninstall()


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("prompt_cache", [4096, 0])
def test_without_a_prompt_block_of_its_own_prompt_last_is_the_same_block_or_the_leftover_rows(served, graph,
                                                                                              prompt_cache):
    """A prompt whose every full block a prefix hit served (SGLang never matches the last token, so
    leftover tokens remain) runs no prompt block of its own. Its ``prompt_last`` is the row an earlier
    request's forward computed for that same last block over the same tokens, kept by the hook: a's
    last prompt block for a repeat of a's prompt ("hit", in the fake a's prompt vector), the second
    output block's last forward for the next turn of a's chat ("turn": a's prompt and output plus 3
    tokens; "hit" decoded the same tokens after a, so the row is hit's: in the fake its hidden
    vector). Without those rows (``prompt_cache=0``), and for a prompt
    shorter than a block, it is the mean of its leftover prompt rows in the first denoising forward
    (in the fake, its own prompt vector), through graph replays too; a request that ran its prompt
    blocks gets its last one's rows."""
    config = fake.config(BS, 4)
    bundle = RecordingBundle(served[0])
    width = served[5].shape[1]
    rng = np.random.default_rng(0)
    names = ("a", "short", "hit", "turn")
    vectors = {rid: (rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32))
               for rid in names}  # (first-round vector, prompt vector)
    ids = {"a": prompt(0, 36, shared=36), "short": prompt(1, 5), "hit": prompt(2, 36, shared=36)}  # hit: a's prompt

    handle = hooked(bundle, slots=2, k=2, prompt_cache=prompt_cache)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=2, max_total_num_tokens=10**9)
        runner, algorithm = fake.ModelRunner(BS, width, cuda_graph=graph, max_bs=2), fake.FillAlgorithm(config)
        served_reqs = {}
        for rid in names:  # one at a time: each finds the earlier ones in the prefix cache
            if rid == "turn":
                a = served_reqs["a"]
                ids["turn"] = list(a.origin_input_ids) + list(a.output_ids) + [7, 8, 9]
            first, prompt_vector = vectors[rid]
            req = fake.Req(rid, ids[rid], SP(), config, [2, 2], first, (1, 0, len(ids[rid])),
                           prompt_hidden=prompt_vector)
            scheduler.waiting_queue.append(req)
            while not req.finished():
                scheduler.step(algorithm, runner)
            served_reqs[rid] = req
        assert len(ids["turn"]) == 51  # 36 prompt + 4 + 8 output tokens, six full blocks, all cached
        assert handle.stats.prefix_blocks == 4 + 6
        kept = prompt_cache > 0
        assert (handle.stats.prompt_from_cache, handle.stats.prompt_from_leftover) == ((2, 1) if kept else (0, 3))
    finally:
        handle.uninstall()
    assert handle.stats.refined == 4
    expected_prompt = {"a": vectors["a"][1], "short": vectors["short"][1],
                       "hit": vectors["a"][1] if kept else vectors["hit"][1],
                       # the latest forward over those 48 tokens: hit's (a's prompt, and the fake decodes
                       # the same output tokens for it), in the fake hit's hidden vector
                       "turn": vectors["hit"][0] if kept else vectors["turn"][1]}
    for i, rid in enumerate(names):
        first, prompt_vector = vectors[rid]
        leftover = len(ids[rid]) % BS
        pooled = (leftover * prompt_vector + (BS - leftover) * first) / BS  # the block mean: first_round
        np.testing.assert_allclose(bundle.seen[i][0].numpy(), pooled, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(bundle.seen_prompt[i][0].numpy(), expected_prompt[rid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_cache", [4, 0])
def test_a_block_aligned_prompt_cached_whole_gets_a_kept_row_or_the_training_mean(served, tmp_path, prompt_cache):
    """A dLLM request's fill ids end in a mask block, so SGLang's prefix match (bounded by the real
    tokens, floored to a block: ``Req._compute_max_prefix_len``) can cover a block-aligned prompt
    whole: no forward then computes any of its prompt rows, and it has no leftover rows either. The
    refinement gets the earlier request's kept row for that block, or without one the bundle's
    training mean of ``prompt_last`` (never zeros); the recorder leaves such a request out."""
    from dwise_predict.collectors.live import LiveRecorder, live_manifest

    config = fake.config(BS, 4)
    bundle = RecordingBundle(served[0])
    width = served[5].shape[1]
    rng = np.random.default_rng(1)
    vectors = {rid: (rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32))
               for rid in ("a", "again")}  # (first-round vector, prompt vector)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, features=lambda req: req.features, every=1,
                            manifest=live_manifest({"name": "fake", "hidden_size": width}, "LowConfidence", {}, BS, BUDGET))
    handle = hooked(bundle, slots=2, k=2, prompt_cache=prompt_cache, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=2, max_total_num_tokens=10**9)
        runner, algorithm = fake.ModelRunner(BS, width, max_bs=2), fake.FillAlgorithm(config)
        for rid in ("a", "again"):  # the same 32-token prompt, one after the other
            first, prompt_vector = vectors[rid]
            req = fake.Req(rid, prompt(0, 4 * BS, shared=4 * BS), SP(), config, [2, 2], first, (1, 0, 4 * BS),
                           prompt_hidden=prompt_vector)
            scheduler.waiting_queue.append(req)
            while not req.finished():
                scheduler.step(algorithm, runner)
        kept = prompt_cache > 0
        assert handle.stats.prefix_blocks == 4  # again ran none of its four prompt blocks
        assert (handle.stats.prompt_from_cache, handle.stats.prompt_from_leftover,
                handle.stats.prompt_from_training_mean) == ((1, 0, 0) if kept else (0, 0, 1))
    finally:
        handle.uninstall()
        recorder.close()
    want = vectors["a"][1] if kept else served[0].prompt_last_mean
    np.testing.assert_allclose(bundle.seen_prompt[1][0].numpy(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0.1  # not the zeros it used to get
    traces = load_traces(tmp_path / "t")
    assert sorted(traces.requests["request_id"]) == (["a", "again"] if kept else ["a"])
    assert traces.manifest["counts"].get("left_out_without_prompt_rows", 0) == (0 if kept else 1)
    if kept:
        again = int(np.flatnonzero(traces.requests["request_id"].to_numpy() == "again")[0])
        np.testing.assert_allclose(traces.prompt_last[again], vectors["a"][1], rtol=1e-5, atol=1e-5)


def test_prompt_rows_keep_the_most_recently_used_and_key_every_token_before_the_block_end():
    from dwise_predict.serving.sglang.buffers import _PromptRows, block_key

    rows = _PromptRows(2)
    rows.allocate(1, "cpu")
    for key, value in (("a", 1.0), ("b", 2.0)):
        rows.rows[rows.reserve(key)] = value
    assert float(rows.get("a")) == 1.0  # a is now the most recent: b leaves first
    rows.rows[rows.reserve("c")] = 3.0
    assert list(rows.slots) == ["a", "c"] and rows.get("b") is None and float(rows.get("c")) == 3.0

    class Req:
        def __init__(self, ids):
            self.origin_input_ids, self.output_ids = ids, []

    base = list(range(40))
    same, late, early = Req(base), Req(base[:39] + [99]), Req([7] + base[1:])
    keys = [block_key(Req(base), blocks, 8) for blocks in (1, 2, 3, 4)]
    assert len(set(keys)) == 4
    assert [block_key(same, blocks, 8) for blocks in (4, 1)] == [keys[3], keys[0]]  # any order, same keys
    assert block_key(late, 4, 8) == keys[3]  # a change after the block's end: same block
    assert block_key(early, 4, 8) != keys[3] and block_key(early, 1, 8) != keys[0]  # a change before it: another
    retracted = Req(base[:20])
    retracted.output_ids = base[20:]  # a retraction re-prefills its outputs: they count as prompt tokens
    assert block_key(retracted, 4, 8) == keys[3]


def test_refusals_are_one_clear_line(served):
    with pytest.raises(ConfigError, match="needs prompt features"):
        install(served[0], resolve=fake.resolve)
    handle = install(None, slots=8, k=8, resolve=fake.resolve)
    try:
        scheduler, algorithm, runner = make_server(served, slots=8, max_running=16)
        with pytest.raises(ConfigError, match="k\\*B = 64 requests resident but this scheduler holds 16 request rows "
                                              "\\(SGLang's max_running_requests for this worker, from "
                                              "--max-running-requests 16\\): raise --max-running-requests to 64 "):
            scheduler.get_new_batch_dllm(scheduler.running_batch)
    finally:
        handle.uninstall()
    handle = hooked(served[0], slots=2, k=1)
    try:
        config = fake.config(32, 4)
        scheduler = fake.Scheduler(config, 2, 10**9)
        scheduler.waiting_queue.append(fake.Req("x", prompt(0, 64), SP(64), config, [2], np.zeros(32, np.float32),
                                                (1, 0, 64)))
        with pytest.raises(BundleError, match=re.escape("(decoding.block_size = 8, model 'synthetic') but the served "
                                                        "one has block_size = 32: export a bundle")):
            scheduler.get_new_batch_dllm(scheduler.running_batch)
    finally:
        handle.uninstall()


@pytest.mark.parametrize("algorithm,params,refused", [
    ("LowConfidence", {}, None),  # SGLang's default threshold is the one the bundle's traces ran
    ("LowConfidence", {"threshold": 0.95, "vectorized_decoding": True, "unread": 1}, None),  # keys that decide nothing
    ("LowConfidence", {"threshold": 0.9}, "algorithm_config = {'threshold': 0.95}"),
    ("JointThreshold", {}, "algorithm = 'LowConfidence'"),
])
def test_a_bundle_is_held_to_the_decoding_sglang_serves(served, algorithm, params, refused):
    """Rounds of another algorithm or threshold are another unit: the hook compares the bundle's
    decoding with the server's ``DllmConfig`` before the first request is ranked."""
    bundle = RecordingBundle(served[0])
    raw = bundle.manifest.raw
    bundle.manifest = BundleManifest.from_dict({**raw, "decoding": {**raw["decoding"], "algorithm": "LowConfidence",
                                                                    "algorithm_config": {"threshold": 0.95}}}, "bundle.json")
    handle = hooked(bundle, slots=2, k=1)
    try:
        config = fake.config(BS, 4, algorithm=algorithm, algorithm_config=params)
        scheduler = fake.Scheduler(config, 2, 10**9)
        scheduler.waiting_queue.append(fake.Req("x", prompt(0, 16), SP(16), config, [2], np.zeros(served[5].shape[1],
                                                np.float32), (1, 0, 16)))
        if refused is None:
            scheduler.get_new_batch_dllm(scheduler.running_batch)
            assert handle.stats.rounds == 1
        else:
            with pytest.raises(BundleError, match=re.escape(f"built for another decoding (decoding.{refused}")):
                scheduler.get_new_batch_dllm(scheduler.running_batch)
    finally:
        handle.uninstall()


def test_logits_hook_pools_block_rows_into_the_buffer_allocated_at_install(served):
    handle = hooked(served[0], slots=2, k=1)
    try:
        buffer = handle.state.pooled
        assert buffer.shape == (2, served[0].hidden_size) and bool(torch.isnan(buffer).all())
        rows = torch.arange(2 * BS * 32, dtype=torch.float32).view(2 * BS, 32)
        fake.LogitsProcessor()._get_dllm_logits(rows, None, None)
        assert handle.state.pooled is buffer  # written in place: the address a CUDA graph captured
        torch.testing.assert_close(buffer[:2], rows.view(2, BS, 32).mean(dim=1))
        with pytest.raises(ConfigError, match="exceeds the pooling buffer's 2 rows"):
            fake.LogitsProcessor()._get_dllm_logits(torch.zeros(3 * BS, 32), None, None)
    finally:
        handle.uninstall()


def test_pooling_accumulates_bf16_hidden_states_in_fp32(served):
    """Issue 56: a bf16 model's block rows were pooled in bf16 (the weights cast to bf16, 1/3 among
    them, and the product rounded to bf16: ~1e-3 off ``collect``'s fp32 mean). The block mean and the
    mean of a request's 3 leftover prompt rows are now the fp32 means of the same bf16 values."""
    from dwise_predict.serving.sglang.step import Step, StepRun

    handle = hooked(served[0], slots=2, k=1)
    try:
        hook, width = handle.state, served[0].hidden_size
        hook.step, hook.step_run = Step(), StepRun()
        # (prompt tokens, budget, leftover prompt positions, own_last row): "short" pools its 3 leftover rows
        hook.step.first = {"short": (3, BUDGET, 3, -1), "own": (2 * BS, BUDGET, 0, 0)}
        hook.stage_rows(SimpleNamespace(rids=["short", "own"], batch_size=2))
        noise = torch.randn(2 * BS, width, generator=torch.Generator().manual_seed(0))
        hidden = (1.0 + 0.5 * noise).to(torch.bfloat16)  # away from zero: a relative error is an error
        fake.LogitsProcessor()._get_dllm_logits(hidden, None, None)
        exact = hidden.float().view(2, BS, width)
        buffers = hook.buffers
        assert buffers.pooled.dtype == torch.float32
        torch.testing.assert_close(buffers.pooled[:2], exact.mean(1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(buffers.leftover_pooled[0], exact[0, :3].mean(0), rtol=1e-6, atol=1e-6)
        assert not buffers.leftover_pooled[1].any()  # no leftover rows: nothing pooled
    finally:
        handle.uninstall()


@pytest.mark.slow
def test_two_tp_ranks_with_last_bit_different_estimates_build_the_same_batches(served, tmp_path):
    """Each TP rank runs its own scheduler and estimates on its own CPU and GPU; estimates that differ
    in the last bit break ties differently, and ranks that build different batches hang in their
    collectives. Two ranks in two processes, joined by a gloo group as SGLang's ``dp_tp_group``,
    estimate every tie one ulp apart: both run the first rank's estimates, and the same batches."""
    import json
    import os
    import subprocess

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}
    bundle_path = served_bundle()[0]
    ranks = [subprocess.Popen([sys.executable, str(tests / "tp_rank_child.py"), str(rank), str(tmp_path / "store"),
                               str(bundle_path), str(tmp_path / f"rank{rank}.json")], env=env) for rank in (0, 1)]
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    steps = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert steps[0]["refined"] == steps[1]["refined"] == 8
    assert steps[0]["steps"] == steps[1]["steps"]
    assert steps[0]["steps"][0] == ["r0", "r1"]  # the tie broken by arrival, as on the first rank
