"""Recording mode: the hook writes contract-1 traces of live traffic (here: the fake SGLang server)."""

import numpy as np
import pytest
import torch

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.collectors.store import merge  # noqa: E402
from dwise_predict.engine import ENGINE, prefill_rounds  # noqa: E402
from dwise_predict.engine.algorithms import served_decoding  # noqa: E402
from dwise_predict.errors import ConfigError, StoreError  # noqa: E402
from dwise_predict.identity import EARLY_SIGNALS  # noqa: E402
from dwise_predict.serving.sglang_adapter import install  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
from dwise_predict.traces.dataset import SCHEMA_VERSION  # noqa: E402
from dwise_predict.training.config import TrainConfig  # noqa: E402
from dwise_predict.training.run import train_run  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402

BS, H = 8, 16


def workload(n_requests, seed, shared=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_requests):
        n = int(rng.integers(3, 40))
        ids = [1 + t % 50 for t in range(min(shared, n))] + [100 + 1000 * (i + 100 * seed) + t for t in range(n - min(shared, n))]
        forwards = [int(x) for x in rng.integers(2, 7, size=int(rng.integers(1, 4)))]
        forwards[0] = min(forwards[0], BS - n % BS + 1)  # at least one fill per step: r <= masked positions
        out.append((f"s{seed}-r{i:03d}", ids, forwards, rng.normal(size=H).astype(np.float32)))
    return out


def record(out, requests, fdfo=True, graph=False, algorithm="LowConfidence", algorithm_config=None, recorded=None,
           runs=None, slots=4, model=None):
    """Serve ``requests`` through the fake with SGLang's ``algorithm`` and ``algorithm_config`` (what its
    --dllm-algorithm-config file holds), recording what the launcher reads from those arguments, or the
    ``recorded`` decoding. ``runs``: the algorithm class that runs the steps (default ``fake.FillAlgorithm``);
    ``slots``: the hook's B; ``model``: the model runner class (default ``fake.ModelRunner``)."""
    config = fake.config(BS, 8, fdfo=fdfo, algorithm=algorithm, algorithm_config=algorithm_config)
    decoding = recorded or served_decoding(algorithm, algorithm_config or {}, BS)
    manifest = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                             decoding["algorithm"], decoding["algorithm_config"], BS, 64)
    recorder = LiveRecorder(out, block_size=BS, features=lambda r: (len(r.origin_input_ids) // 2, 1, len(r.origin_input_ids)),
                            every=7, manifest=manifest)
    handle = install(None, slots=slots, k=2, resolve=fake.resolve, block_size=BS, max_batch=4, device="cpu",
                     hidden_size=H, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": 64})()
        reqs = [fake.Req(rid, ids, sp, config, forwards, hidden, None) for rid, ids, forwards, hidden in requests]
        scheduler.waiting_queue.extend(reqs)
        fake.serve(scheduler, (runs or fake.FillAlgorithm)(config),
                   (model or fake.ModelRunner)(BS, H, cuda_graph=graph, max_bs=4))
    finally:
        handle.uninstall()
        recorder.close()
    return reqs


def test_recorded_traces_are_the_servers_own_counts(tmp_path):
    requests = workload(30, seed=0)
    reqs = record(tmp_path / "t", requests)
    ds = load_traces(tmp_path / "t")  # contract 1, validated
    assert ds.manifest["decoding"]["engine"] == ENGINE and ds.manifest["schema_version"] == SCHEMA_VERSION
    rows = ds.requests.set_index("request_id")
    assert sorted(rows.index) == sorted(r[0] for r in requests)
    for (rid, ids, forwards, hidden), req in zip(requests, reqs):
        row = rows.loc[rid]
        assert list(row["rounds_per_block"]) == forwards and row["total_rounds"] == sum(forwards)
        assert row["prompt_blocks"] == len(ids) // BS == row["prefill_rounds"] == prefill_rounds(len(ids), BS)
        assert row["output_tokens"] == len(req.output_ids) and row["finish"] == "eos"
        i = ds.requests.index[ds.requests["request_id"] == rid][0]
        np.testing.assert_allclose(ds.first_round[i], hidden, rtol=1e-6)  # the pooled first-round rows
    assert set(ds.requests["split"]) == {"train", "eval"}


def test_a_recording_is_in_the_decoding_the_server_runs_and_resumes_only_under_it(tmp_path):
    """A server runs JointThreshold from its algorithm config file: the traces say so, with SGLang's
    defaults; a restart under another decoding is refused before it serves, and a recorder that
    names another decoding than the server's stops on the first step, writing nothing."""
    from types import SimpleNamespace

    from dwise_predict.serving.launcher import served_algorithm

    requests = workload(8, seed=5)
    path = tmp_path / "algorithm.yaml"
    path.write_text("threshold: 0.7\nvectorized_decoding: true\n")
    decoding = served_algorithm(SimpleNamespace(dllm_algorithm="JointThreshold", dllm_algorithm_config=str(path)), BS)
    assert decoding == {"algorithm": "JointThreshold", "block_size": BS, "algorithm_config": {
        "threshold": 0.7, "edit_threshold": 0.0, "max_post_edit_steps": 16, "penalty_lambda": 0.0}}
    record(tmp_path / "t", requests[:4], algorithm="JointThreshold",
           algorithm_config={"threshold": 0.7, "vectorized_decoding": True}, recorded=decoding)
    assert load_traces(tmp_path / "t").manifest["decoding"]["algorithm_config"] == decoding["algorithm_config"]
    before = sorted(p.name for p in (tmp_path / "t" / "shards").iterdir())
    with pytest.raises(StoreError, match="decoded with another config \\(algorithm 'JointThreshold' vs 'LowConfidence'"):
        record(tmp_path / "t", requests[4:])  # restarted as LowConfidence
    with pytest.raises(ConfigError, match="the recording says the server decodes with .*JointThreshold.* but SGLang "
                                          "runs .*LowConfidence"):
        record(tmp_path / "other", requests[4:], recorded=decoding)
    assert sorted(p.name for p in (tmp_path / "t" / "shards").iterdir()) == before
    assert len(load_traces(tmp_path / "t")) == 4 and not (tmp_path / "other" / "shards").exists()


def test_graph_replays_and_sync_mode_record_the_same_traces(tmp_path):
    requests = workload(12, seed=1)
    record(tmp_path / "eager", requests)
    record(tmp_path / "graph", requests, graph=True)
    record(tmp_path / "sync", requests, fdfo=False)
    a, b, c = (load_traces(tmp_path / d) for d in ("eager", "graph", "sync"))
    cols = ["request_id", "rounds_per_block", "prompt_blocks", "output_tokens"]
    for other in (b, c):
        assert a.requests[cols].astype(str).equals(other.requests[cols].astype(str))
        np.testing.assert_allclose(a.first_round, other.first_round)


def test_prefix_hits_lower_the_prefill_forwards_recorded(tmp_path):
    requests = workload(10, seed=2, shared=24)
    record(tmp_path / "t", requests)
    rows = load_traces(tmp_path / "t").requests
    long = rows[rows["prompt_tokens"] >= 24]
    assert (long["prefill_rounds"] < long["prompt_blocks"]).any()  # later ones found 3 blocks cached
    assert (long["prefill_rounds"] >= long["prompt_blocks"] - 24 // BS).all()


def test_a_restart_resumes_and_dp_ranks_merge_into_traces_train_accepts(tmp_path):
    first, second = workload(40, seed=3), workload(40, seed=4)
    record(tmp_path / "dp0", first[:20])
    record(tmp_path / "dp0", first[20:] + first[:5])  # a restarted server; 5 ids it already recorded
    record(tmp_path / "dp1", second)
    merged = load_traces(merge([tmp_path / "dp0", tmp_path / "dp1"], tmp_path / "all"))
    assert len(merged) == 80 and merged.requests["request_id"].is_unique
    config = TrainConfig(members=1, max_epochs=2, patience=1, width=16, bootstrap=10, admission_trees=5,
                         admission_min_child_samples=2)
    metrics = train_run(tmp_path / "all", tmp_path / "run", config)
    assert (tmp_path / "run" / "metrics.json").is_file() and isinstance(metrics, dict)


class TinyModelRunner(fake.ModelRunner):
    """The shipped tiny dLLM behind the fake's model runner (one request at a time): each forward is
    one backend step over the request's block, the previous finished block committed in front of a
    new block's first forward, as the collector's decoder does. The hook sees the window's final
    hidden rows; the algorithm sees the model's logits."""

    def __init__(self, backend):
        super().__init__(backend.block_size, backend.hidden_size, eos_ids=(backend.eos_token_id,))
        from dwise_predict.collectors.backends.base import StepBatch

        self.backend, self.batch = backend, StepBatch
        self.rid, self.context, self.last = None, None, None
        backend.allocate(1)

    def _step(self, ids, commit, out_start):
        t = lambda v: torch.tensor([v])  # noqa: E731
        return self.backend.step(self.batch(slots=t(0), input_ids=ids[None], n_valid=t(len(ids)), commit_len=t(commit),
                                            out_start=t(out_start), window=self.block_size))

    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, **kwargs):
        self.calls += 1
        (req,) = forward_batch.reqs
        if req.rid != self.rid:
            self.backend.reset_slot(0)
            self.rid, self.context, self.last = req.rid, None, None
        ids = forward_batch.input_ids.clone()
        if req.is_dllm_prefill():
            out = self._step(ids, self.block_size, 0)
        elif self.last is not None and req.prefix_len != self.context:  # a new block: commit the last one
            out = self._step(torch.cat([self.last, ids]), self.block_size, self.block_size)
        else:
            out = self._step(ids, 0, 0)
        if not req.is_dllm_prefill():
            self.context, self.last = req.prefix_len, ids
        self.logits_processor._get_dllm_logits(out.hidden[0].float(), None, None)  # what the hook pools
        return fake.SimpleNamespace(logits_output=fake.SimpleNamespace(full_logits=out.logits[0].float()),
                                    can_run_graph=False)


def test_recording_equals_collect_on_the_same_requests(tmp_path):
    """The tiny dLLM served by the fake (SGLang's own LowConfidence loop) and recorded by the hook
    gives the traces `collect` writes for the same requests."""
    from dwise_predict.collectors.backends import load_backend
    from dwise_predict.collectors.collect import collect
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.collectors.workloads import load_workload

    budget = 40
    collect("tiny", "tiny-default", tmp_path / "collected", DecodingConfig(algorithm="LowConfidence", budget=budget,
                                                                           batch_size=1), limit=8)
    want = load_traces(tmp_path / "collected")
    backend = load_backend("tiny")
    sgl = sglang_reference.load()
    config = fake.DllmConfig(algorithm="LowConfidence", algorithm_config={}, block_size=backend.block_size,
                             mask_id=backend.mask_token_id, max_running_requests=1)
    algorithm = sgl.algorithms["LowConfidence"](config)  # SGLang's own class
    manifest = live_manifest({"name": "tiny", "hidden_size": backend.hidden_size}, "LowConfidence", {},
                             backend.block_size, budget)
    recorder = LiveRecorder(tmp_path / "recorded", block_size=backend.block_size, every=4, manifest=manifest)
    handle = install(None, slots=1, k=1, resolve=fake.resolve, block_size=backend.block_size, max_batch=1,
                     device="cpu", hidden_size=backend.hidden_size, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=1, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": budget})()
        for r in load_workload("tiny-default", seed=0, limit=8).requests:
            ids = backend.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)
            scheduler.waiting_queue.append(fake.Req(r.request_id, ids, sp, config, [], None, None,
                                                    eos_token_id=backend.eos_token_id))
        fake.serve(scheduler, algorithm, TinyModelRunner(backend))
    finally:
        handle.uninstall()
        recorder.close()
    got = load_traces(tmp_path / "recorded")
    a = want.requests.set_index("request_id").sort_index()
    b = got.requests.set_index("request_id").sort_index()
    assert list(a.index) == list(b.index) and len(a) == 8
    for col in ("prompt_tokens", "prompt_blocks", "total_rounds", "finish", "output_tokens", "budget", "block_size"):
        assert a[col].tolist() == b[col].tolist(), col
    assert (b["output_tokens"] <= budget).all()  # SGLang's finished_len, not the blocks it appended
    assert [list(x) for x in a["rounds_per_block"]] == [list(x) for x in b["rounds_per_block"]]
    order_a = np.argsort(want.requests["request_id"].to_numpy())
    order_b = np.argsort(got.requests["request_id"].to_numpy())
    np.testing.assert_allclose(want.first_round[order_a], got.first_round[order_b], rtol=1e-4, atol=1e-5)
    # the refinement's second state: the last prompt block's rows (the leftover rows for a short prompt)
    np.testing.assert_allclose(want.prompt_last[order_a], got.prompt_last[order_b], rtol=1e-4, atol=1e-5)
    for col in EARLY_SIGNALS:  # end_probability too: the hook's stop ids are the served model's
        np.testing.assert_allclose(a[col].to_numpy(float), b[col].to_numpy(float), rtol=1e-4, atol=1e-5, err_msg=col)


def test_requests_not_ended_by_the_model_or_its_budget_are_left_out_and_counted(tmp_path, monkeypatch):
    """`collect` ends a request at the model's own stop ids or at its budget. A live request that the
    client's stop conditions ended, that the context cut short, or that SGLang retracted and re-encoded
    would be a round count no input explains: left out, counted by reason. Finish reasons are SGLang's
    own classes (from the wheel); ``wall_s`` runs from the first forward, not from arrival."""
    from types import SimpleNamespace

    from dwise_predict.collectors import live

    finish = sglang_reference.load().finish
    SP = sglang_reference.SamplingParams
    cases = {  # rid -> sampling params, finish reason, output tokens, finished_len (None: SGLang set none)
        "eos": (SP(64), finish.FINISH_MATCHED_TOKEN(matched=2), 10, 10),
        "budget": (SP(16), finish.FINISH_LENGTH(length=16), 16, 16),
        "client-lists-the-eos": (SP(64, stop_token_ids={2}), finish.FINISH_MATCHED_TOKEN(matched=2), 10, 10),
        "stop-string": (SP(64, stop_strs=["###"]), finish.FINISH_MATCHED_STR(matched="###"), 12, 12),
        "client-id": (SP(64, stop_token_ids={9}), finish.FINISH_MATCHED_TOKEN(matched=9), 12, 12),
        "ignore-eos": (SP(16, ignore_eos=True), finish.FINISH_LENGTH(length=16), 16, 16),
        "context-end": (SP(64), finish.FINISH_LENGTH(length=24), 24, None),
        "retracted": (SP(64), finish.FINISH_MATCHED_TOKEN(matched=2), 10, 10),
        "requeued-before-it-ran": (SP(64), finish.FINISH_MATCHED_TOKEN(matched=2), 10, 10),
    }
    now = [0.0]
    monkeypatch.setattr(live, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    manifest = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                             "LowConfidence", {}, BS, 64)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=100, manifest=manifest)
    for rid, (params, reason, outputs, finished_len) in cases.items():
        req = SimpleNamespace(rid=rid, origin_input_ids=list(range(10, 22)), output_ids=[], sampling_params=params,
                              finished_reason=None, finished_len=None, eos_token_ids={2}, tokenizer=None,
                              finished=lambda: True)
        recorder.arrived(req, BS)
        now[0] += 5.0  # queued for 5 s
        if rid == "requeued-before-it-ran":
            recorder.arrived(req, BS)  # sent back before any forward: no work lost
        recorder.forward(req, True, torch.ones(H), 1)
        if rid == "retracted":
            recorder.arrived(req, BS)  # the hook registers a retracted request again
        req.output_ids, req.finished_reason, req.finished_len = [7] * outputs, reason, finished_len
        recorder.forward(req, False, torch.full((H,), 2.0), 3, signals=[0.5, 0.6, 1.0, 0.1])
        now[0] += 2.0  # ran for 2 s
        recorder.finished(req)
    recorder.close()
    ds = load_traces(tmp_path / "t")
    assert sorted(ds.requests["request_id"]) == ["budget", "client-lists-the-eos", "eos", "requeued-before-it-ran"]
    counts = {k: v for k, v in ds.manifest["counts"].items() if k.startswith("left_out_")}
    assert counts == {"left_out_client_stop": 3, "left_out_context_end": 1, "left_out_retracted": 1}
    rows = ds.requests.set_index("request_id")
    assert rows.loc["budget", "finish"] == "budget" and rows.loc["budget", "output_tokens"] == 16
    assert rows.loc["eos", "finish"] == "eos" and rows.loc["eos", "output_tokens"] == 9  # the EOS not counted
    assert (ds.requests["wall_s"] == 2.0).all()


def test_a_pass_around_the_hooked_run_leaves_no_rows_for_the_next_batch(tmp_path):
    """Gemma4Renoise runs its context-encoding pass straight through ``model_runner.forward``, not
    through ``DllmAlgorithm.run``, which the hook wraps to pool rows. Such a pass must find no pooled
    rows, not those of the batch before it (another request's): every recorded ``prompt_last`` is the
    request's own, and a request with none of its prompt rows pooled is left out, counted."""
    class ContextPass(fake.FillAlgorithm):
        def run(self, model_runner, forward_batch, algo_states=None):
            if all(r.is_dllm_prefill() for r in forward_batch.reqs):  # as Gemma4Renoise.run's non-dLLM pass
                out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
                blocks = forward_batch.input_ids.view(forward_batch.batch_size, BS).tolist()  # prompt blocks, kept
                return out.logits_output, blocks, [1] * len(blocks), None, out.can_run_graph
            return super().run(model_runner, forward_batch, algo_states)

    requests = workload(24, seed=3)
    record(tmp_path / "t", requests, runs=ContextPass, slots=1)  # one request a batch: its prompt blocks run alone
    ds = load_traces(tmp_path / "t")
    own = {rid: hidden for rid, _, _, hidden in requests}
    for i, rid in enumerate(ds.requests["request_id"]):
        np.testing.assert_allclose(ds.prompt_last[i], own[rid], rtol=1e-6, err_msg=rid)
    aligned = sum(len(ids) % BS == 0 for _, ids, _, _ in requests)  # no leftover prompt rows of their own
    assert aligned > 0 and len(ds) == len(requests) - aligned
    assert ds.manifest["counts"]["left_out_without_prompt_rows"] == aligned


def test_an_algorithm_without_a_threshold_counts_over_the_collectors(tmp_path):
    """Gemma4Renoise has no ``threshold``; the DiffusionGemma collector counts the first round's
    positions over 0.9 (``engine.signals.SIGNAL_THRESHOLD``). The hook counts over the same, not over
    0 (every position): a model whose top-1 probability is 0.7 everywhere gives 0, and 1 where the
    top-1 is 0.95."""
    from types import SimpleNamespace

    from dwise_predict.engine.signals import SIGNAL_THRESHOLD

    assert not hasattr(fake.FillAlgorithm(fake.config(BS, 8)), "threshold")

    def runner_with_top1(p):
        class TwoTokens(fake.ModelRunner):  # logits over two ids: the stop id 0 and a token at probability p
            def forward(self, forward_batch, *args, **kwargs):
                out = super().forward(forward_batch, *args, **kwargs)
                rows = out.logits_output.full_logits.shape[0]
                logits = torch.zeros(rows, 2)
                logits[:, 1] = float(np.log(p / (1 - p)))
                return SimpleNamespace(logits_output=SimpleNamespace(full_logits=logits), can_run_graph=out.can_run_graph)
        return TwoTokens

    frac = EARLY_SIGNALS.index("frac_over_threshold")
    for p, share in ((0.7, 0.0), (0.95, 1.0)):
        assert (p > SIGNAL_THRESHOLD) == bool(share)
        record(tmp_path / str(p), workload(6, seed=4), model=runner_with_top1(p))
        ds = load_traces(tmp_path / str(p))
        np.testing.assert_allclose(ds.early_signals[:, frac], share)
        np.testing.assert_allclose(ds.early_signals[:, EARLY_SIGNALS.index("mean_confidence")], p, rtol=1e-5)
