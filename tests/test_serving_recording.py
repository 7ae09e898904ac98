"""Recording mode: the hook writes contract-1 traces of live traffic (here: the fake SGLang server)."""

import json
from pathlib import Path

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
from dwise_predict.names import EARLY_SIGNALS  # noqa: E402
from dwise_predict.serving.sglang import install  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
from dwise_predict.traces.dataset import SCHEMA_VERSION  # noqa: E402
from dwise_predict.training.config import TrainConfig  # noqa: E402
from dwise_predict.training.run import train_run  # noqa: E402
from fakes import sglang_fake as fake  # noqa: E402

BS, H = 8, 16


def workload(n_requests, seed, shared=0, width=H):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_requests):
        n = int(rng.integers(3, 40))
        ids = [1 + t % 50 for t in range(min(shared, n))] + [100 + 1000 * (i + 100 * seed) + t for t in range(n - min(shared, n))]
        forwards = [int(x) for x in rng.integers(2, 7, size=int(rng.integers(1, 4)))]
        forwards[0] = min(forwards[0], BS - n % BS + 1)  # at least one fill per step: r <= masked positions
        out.append((f"s{seed}-r{i:03d}", ids, forwards, rng.normal(size=width).astype(np.float32)))
    return out


def record(out, requests, fdfo=True, graph=False, algorithm="LowConfidence", algorithm_config=None, recorded=None,
           runs=None, slots=4, model=None, before_step=None, k=2):
    """Serve ``requests`` through the fake with SGLang's ``algorithm`` and ``algorithm_config`` (what its
    --dllm-algorithm-config file holds), recording what the launcher reads from those arguments, or the
    ``recorded`` decoding. ``runs``: the algorithm class that runs the steps (default ``fake.FillAlgorithm``);
    ``slots``: the hook's B; ``model``: the model runner class (default ``fake.ModelRunner``);
    ``before_step``: ``fake.serve``'s (arrivals, aborts); ``k``: the hook's (SGLang's
    ``--max-running-requests`` is 8, or k*B above that)."""
    config = fake.config(BS, max(8, slots * k), fdfo=fdfo, algorithm=algorithm, algorithm_config=algorithm_config)
    decoding = recorded or served_decoding(algorithm, algorithm_config or {}, BS)
    manifest = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                             decoding["algorithm"], decoding["algorithm_config"], BS, 64)
    recorder = LiveRecorder(out, block_size=BS, features=lambda r: (len(r.origin_input_ids) // 2, 1, len(r.origin_input_ids)),
                            every=7, manifest=manifest)
    handle = install(None, slots=slots, k=k, resolve=fake.resolve, block_size=BS, max_batch=4, device="cpu",
                     hidden_size=H, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": 64})()
        reqs = [fake.Req(rid, ids, sp, config, forwards, hidden, None) for rid, ids, forwards, hidden in requests]
        scheduler.waiting_queue.extend(reqs)
        fake.serve(scheduler, (runs or fake.FillAlgorithm)(config),
                   (model or fake.ModelRunner)(BS, H, cuda_graph=graph, max_bs=4), before_step=before_step)
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
    import time

    # the request clock only: the writer thread keeps the real one for its timer
    monkeypatch.setattr(live, "time", SimpleNamespace(perf_counter=lambda: now[0], monotonic=time.monotonic,
                                                      sleep=time.sleep))
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
    assert counts == {"left_out_client_stop": 3, "left_out_context_end": 1, "left_out_retracted": 1,
                      "left_out_without_prompt_rows": 0, "left_out_warmup": 0, "left_out_health_check": 0,
                      "left_out_aborted": 0, "left_out_without_first_round": 0, "left_out_duplicate": 0,
                      "left_out_in_flight": 0}
    assert ds.manifest["counts"]["dropped"] == 0
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


class ContextPass(fake.FillAlgorithm):
    """Gemma4Renoise's ``run`` (``dllm/algorithm/gemma4_renoise.py``): a batch that is not ``DLLM_EXTEND``
    (here: every row at a prompt block) is one ``model_runner.forward`` of its own, without
    ``DllmAlgorithm.run`` (which the hook wraps); the rest is ``super().run``, the hook's."""

    def run(self, model_runner, forward_batch, algo_states=None):
        if all(r.is_dllm_prefill() for r in forward_batch.reqs):
            out = model_runner.forward(forward_batch, pp_proxy_tensors=None)
            blocks = forward_batch.input_ids.view(forward_batch.batch_size, BS).tolist()  # prompt blocks, kept
            return out.logits_output, blocks, [1] * len(blocks), None, out.can_run_graph
        return super().run(model_runner, forward_batch, algo_states)


class ArriveAfter:
    """``fake.serve``'s ``before_step``: once ``first`` finished, ``requests`` arrive (fake ``Req``s,
    built with the scheduler's config)."""

    def __init__(self, first: str, requests: list):
        self.first, self.requests, self.arrived = first, requests, False

    def __call__(self, step, scheduler):
        batch = scheduler.last_batch
        if self.arrived or batch is None or not any(r.rid == self.first and r.finished() for r in batch.reqs):
            return
        config, sp = scheduler.dllm_config, type("SP", (), {"max_new_tokens": 64})()
        scheduler.waiting_queue.extend(fake.Req(rid, ids, sp, config, forwards, hidden, None)
                                       for rid, ids, forwards, hidden in self.requests)
        self.arrived = True


def test_a_result_without_a_hooked_run_reads_one_forward_not_the_last_runs(tmp_path):
    """A context-encoding pass (a result no wrapped ``run`` precedes) read the forwards and done lists of
    the run before it, another batch's: one request ran alone, then four arrived and their prompt
    blocks ran as one context pass, whose four rows were read from the one-row done list before it
    (an index error in the recording scheduler). It ran one forward of each row."""
    first = [("alone", [5, 6, 7], [2, 3], np.full(H, 9, np.float32))]  # a short prompt: denoising at once
    later = [(f"r{i}", [100 * i + t for t in range(BS + 3)], [2, 3], np.full(H, i, np.float32)) for i in range(4)]
    record(tmp_path / "t", first, runs=ContextPass, slots=4, before_step=ArriveAfter("alone", later))
    ds = load_traces(tmp_path / "t")
    rows = ds.requests.set_index("request_id")
    assert sorted(rows.index) == ["alone", "r0", "r1", "r2", "r3"]
    assert all(list(rows.loc[rid, "rounds_per_block"]) == [2, 3] for rid in rows.index)
    assert (rows.loc[["r0", "r1", "r2", "r3"], "prefill_rounds"] == 1).all()  # one context pass each


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


# --- the recorder's lifecycle: a writer thread, a bounded queue, a timer, counts, SGLang's own requests

MANIFEST = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                         "LowConfidence", {}, BS, 64)
FINISH = fake.SGL.finish  # SGLang's finish reasons (from the wheel)


def served(recorder, rid, ids=tuple(range(10, 22)), params=None, reason=None, outputs=10, prompt_row=None,
           first_row=None):
    """One request through the recorder as the hook reports it: arrival, a prompt block, a first
    denoising forward that commits its block, SGLang's finish (by default its own FINISH_MATCHED_TOKEN
    on the model's EOS)."""
    from types import SimpleNamespace

    req = SimpleNamespace(rid=rid, origin_input_ids=list(ids), output_ids=[],
                          sampling_params=params or sglang_reference.SamplingParams(64), finished_reason=None,
                          finished_len=None, eos_token_ids={2}, tokenizer=None, finished=lambda: True)
    recorder.arrived(req, BS)
    recorder.forward(req, True, np.ones(H, np.float32) if prompt_row is None else prompt_row, 1)
    req.output_ids = [7] * outputs
    req.finished_reason = reason or FINISH.FINISH_MATCHED_TOKEN(matched=2)
    req.finished_len = outputs
    recorder.forward(req, False, np.full(H, 2.0, np.float32) if first_row is None else first_row, 3,
                     signals=np.asarray([0.5, 0.6, 1.0, 0.1], np.float32))
    recorder.finished(req)
    return req


def test_finished_requests_are_written_off_the_scheduler_thread_and_dropped_rather_than_waited_for(tmp_path,
                                                                                                  monkeypatch):
    """A shard write (Parquet, safetensors, two fsyncs) never runs on the scheduler's thread: the
    writer thread does it. When the disk stalls and the writer falls ``queue_size`` requests behind,
    a finished request is dropped and counted, and the scheduler does not wait."""
    import threading
    import time

    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1, queue_size=3, manifest=MANIFEST)
    entered, release, threads = threading.Event(), threading.Event(), []
    write = recorder.store.write_shard

    def stalled_disk(*args, **kwargs):
        threads.append(threading.current_thread())
        entered.set()
        release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(recorder.store, "write_shard", stalled_disk)
    try:
        served(recorder, "r0")
        assert entered.wait(10)  # the writer took r0 and waits on the disk
        start = time.perf_counter()
        for i in range(1, 6):
            served(recorder, f"r{i}")
        assert time.perf_counter() - start < 2.0  # the scheduler's thread never waited for the 30 s write
        assert recorder.dropped == 2  # r1..r3 queued, r4 and r5 dropped
    finally:
        release.set()
        recorder.close()
    assert threads and all(t is not threading.main_thread() for t in threads)
    ds = load_traces(tmp_path / "t")
    assert sorted(ds.requests["request_id"]) == ["r0", "r1", "r2", "r3"]
    assert ds.manifest["counts"]["dropped"] == 2 and ds.manifest["counts"]["requests"] == 4


def test_a_timer_commits_without_more_traffic_and_the_manifest_counts_every_run(tmp_path):
    """With fewer finished requests than a shard holds and no more traffic, the writer still commits
    them ``flush_s`` seconds on, and rewrites the manifest's counts with them: what a process killed
    outright leaves. The counts cover every run of the directory: a restart adds to them."""
    import json
    import time

    from dwise_predict.collectors.store import read_shards

    stop = dict(params=sglang_reference.SamplingParams(64, stop_strs=["###"]), reason=FINISH.FINISH_MATCHED_STR(matched="###"))
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1000, flush_s=0.2, manifest=MANIFEST)
    try:
        for i in range(3):
            served(recorder, f"r{i}")
        served(recorder, "stopped", **stop)
        deadline = time.monotonic() + 20
        while sum(len(s.requests) for s in read_shards(tmp_path / "t")) < 3:
            assert time.monotonic() < deadline, "nothing committed without more traffic"
            time.sleep(0.05)
        deadline = time.monotonic() + 20
        while (counts := json.loads((tmp_path / "t" / "manifest.json").read_text()).get("counts", {})).get("requests") != 3:
            assert time.monotonic() < deadline, counts
            time.sleep(0.05)
        assert counts == {"requests": 3, "left_out_client_stop": 1, "left_out_context_end": 0, "left_out_retracted": 0,
                          "left_out_without_prompt_rows": 0, "left_out_warmup": 0, "left_out_health_check": 0,
                          "left_out_aborted": 0, "left_out_without_first_round": 0, "left_out_duplicate": 0,
                          "left_out_in_flight": 0, "dropped": 0, "lost_to_write_error": 0, "write_errors": 0,
                          "runs_unclosed": 0, "requests_recovered": 0, "requests_consolidated": 0}
    finally:
        recorder.close()
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1000, manifest=MANIFEST)  # a restart
    try:
        served(recorder, "stopped-again", **stop)
        served(recorder, "r0")  # recorded by the first run: skipped
    finally:
        recorder.close()
    counts = load_traces(tmp_path / "t").manifest["counts"]
    assert counts["requests"] == 3 and counts["left_out_client_stop"] == 2
    assert counts["left_out_duplicate"] == 1 and counts["requests_consolidated"] == 3  # r0 again: counted, not recorded


class HostOnly:
    """A host row seen only through the array protocol: ``.cpu()``, ``.tolist()``, ``.item()`` ... on a
    device tensor would be a GPU->host sync per request, which the hook's one per-step transfer replaces."""

    SYNCS = {"cpu", "tolist", "item", "numpy", "float", "to", "detach"}

    def __init__(self, values):
        self.values = values

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.values, dtype=dtype)

    def __getattr__(self, name):
        if name in self.SYNCS:
            raise AssertionError(f"the recorder called .{name}()")
        raise AttributeError(name)


def test_the_recorder_takes_host_rows_and_keeps_its_own_copies(tmp_path):
    """The hook hands the recorder host float32 rows out of one per-step transfer (a buffer the next
    step may reuse): the recorder reads them through the array protocol only and copies them; CPU
    tensors read the same way."""
    prompt, first = np.arange(H, dtype=np.float32), np.full(H, 2.0, np.float32)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1, manifest=MANIFEST)
    try:
        served(recorder, "host", prompt_row=HostOnly(prompt), first_row=first)
        first[:] = -1.0  # the next step reuses the host buffer
        served(recorder, "tensor", prompt_row=torch.arange(H, dtype=torch.float32), first_row=torch.full((H,), 3.0))
    finally:
        recorder.close()
    ds = load_traces(tmp_path / "t")
    rows = {rid: i for i, rid in enumerate(ds.requests["request_id"])}
    np.testing.assert_array_equal(ds.first_round[rows["host"]], np.full(H, 2.0))
    np.testing.assert_array_equal(ds.prompt_last[rows["host"]], prompt)
    np.testing.assert_array_equal(ds.first_round[rows["tensor"]], np.full(H, 3.0))
    np.testing.assert_allclose(ds.early_signals[rows["host"]], [0.5, 0.6, 1.0, 0.1], rtol=1e-6)


def sglang_warmup_request(skip_tokenizer_init: bool) -> dict:
    """The request SGLang 0.5.23's HTTP server sends itself at start-up: its own
    ``http_server._execute_server_warmup``, run over stand-ins for the server it talks to (a generation
    model without images, one DP rank, no disaggregation), returns the JSON body it POSTs."""
    from types import SimpleNamespace

    posted = []

    class Requests:
        exceptions = SimpleNamespace(RequestException=Exception)

        @staticmethod
        def get(url, **kwargs):
            return SimpleNamespace(status_code=200, json=lambda: {"is_generation": True, "has_image_understanding": False})

        @staticmethod
        def post(url, json=None, **kwargs):
            posted.append((url, json))
            return SimpleNamespace(status_code=200, text="")

    off = SimpleNamespace(get=lambda: 0)
    stand_ins = dict(
        requests=Requests, time=SimpleNamespace(sleep=lambda s: None), ssl_verify_of=lambda args: True,
        get_serving=lambda: SimpleNamespace(api_key=None, skip_tokenizer_init=skip_tokenizer_init),
        get_disagg=lambda: SimpleNamespace(language_only=False, language_model_only=False, disaggregation_mode="null"),
        get_exec=lambda: SimpleNamespace(features=SimpleNamespace(enable_encoder_swa_bounded_replay=False)),
        is_mps=lambda: False, get_parallel=lambda: SimpleNamespace(num_dp_ranks=1),
        get_observability=lambda: SimpleNamespace(debug_tensor_dump_input_file=None),
        get_model=lambda: SimpleNamespace(model_path="m", revision=None), envs=SimpleNamespace(SGLANG_WARMUP_TIMEOUT=off),
        _global_state=SimpleNamespace(tokenizer_manager=SimpleNamespace(server_status=None)),
        ServerStatus=SimpleNamespace(Up="up", UnHealthy="unhealthy"), logger=SimpleNamespace(info=print, error=print),
    )
    warmup = sglang_reference.compile_functions(sglang_reference.source_root() / "sglang" / "srt" / "entrypoints" /
                                                "http_server.py", ("_execute_server_warmup",), stand_ins)
    assert warmup["_execute_server_warmup"](SimpleNamespace(url=lambda: "http://server")) is True
    (url, body), = posted
    assert url == "http://server/generate"
    return body


def test_sglangs_own_requests_are_not_traces(tmp_path):
    """SGLang's HTTP server sends itself a warmup request at start-up (one per DP rank) and
    ``/health_generate`` sends probes: neither is traffic. Their shapes come from SGLang's own code:
    the warmup's body from running ``_execute_server_warmup`` (its text tokenised as the tokenizer
    manager tokenises it; its ids under ``--skip-tokenizer-init``), the probes' rid prefix from
    ``srt/constants.py``. They are counted, not recorded; the same text asking for more tokens is
    traffic."""
    import importlib
    import uuid

    from transformers import AutoTokenizer

    from dwise_predict.dllm import TINY_MODEL_DIR

    sglang_reference.load()
    prefix = importlib.import_module("sglang.srt.constants").HEALTH_CHECK_RID_PREFIX
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    text_warmup, ids_warmup = sglang_warmup_request(False), sglang_warmup_request(True)
    budget = text_warmup["sampling_params"]["max_new_tokens"]
    assert ids_warmup["sampling_params"]["max_new_tokens"] == budget
    text_ids = tokenizer(text_warmup["text"])["input_ids"]  # TokenizerManager: self.tokenizer(texts, ...)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1, manifest=MANIFEST, tokenizer=tokenizer)
    try:
        served(recorder, uuid.uuid4().hex, ids=text_ids, params=sglang_reference.SamplingParams(budget), outputs=budget)
        served(recorder, uuid.uuid4().hex, ids=ids_warmup["input_ids"], params=sglang_reference.SamplingParams(budget),
               outputs=budget)
        served(recorder, f"{prefix}_{uuid.uuid4().hex}", ids=[0], params=sglang_reference.SamplingParams(1), outputs=1)
        served(recorder, "user", ids=text_ids, params=sglang_reference.SamplingParams(2 * budget), outputs=budget)
    finally:
        recorder.close()
    ds = load_traces(tmp_path / "t")
    assert list(ds.requests["request_id"]) == ["user"]
    assert ds.manifest["counts"]["left_out_warmup"] == 2 and ds.manifest["counts"]["left_out_health_check"] == 1


# --- issue 56: every request accounted for, a failed write that stops recording and not the server,
# a run that never closed, the served model's identity


def running(recorder, rid, first_round=True):
    """A request the hook registered that ran its prompt block (and, by default, its first denoising
    round) and is still running."""
    from types import SimpleNamespace

    req = SimpleNamespace(rid=rid, origin_input_ids=list(range(10, 22)), output_ids=[],
                          sampling_params=sglang_reference.SamplingParams(64), finished_reason=None, finished_len=None,
                          eos_token_ids={2}, tokenizer=None, finished=lambda: False)
    recorder.arrived(req, BS)
    recorder.forward(req, True, np.ones(H, np.float32), 1)
    if first_round:
        recorder.forward(req, False, np.full(H, 2.0, np.float32), 1, signals=np.asarray([0.5, 0.6, 1.0, 0.1]))
    return req


def test_every_request_the_hook_reports_is_a_trace_or_counted_once(tmp_path):
    """Requests SGLang aborted (the client went away) stayed in the recorder's open set with their host
    rows, counted nowhere (10 of 10). Each way a request ends is now a trace or one count in the
    manifest: aborted while running (gone from every queue: ``left_unfinished``; or finished with an
    abort), aborted before the hook registered it (finished while waiting; refused by the hook),
    finished without a pooled first round, a repeated request id, still running at close."""
    from types import SimpleNamespace

    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=100, manifest=MANIFEST)
    try:
        served(recorder, "kept")
        gone = [running(recorder, f"gone-{i}") for i in range(10)]
        for req in gone:  # SGLang's abort_request popped them from every queue: the hook's reconcile says so
            recorder.left_unfinished(req, "aborted")
        assert recorder.open == {}  # their host rows freed
        recorder.left_unfinished("refused")  # the hook aborted it before registering it (KV over budget)
        aborted_running = running(recorder, "aborted-running")
        aborted_running.finished_reason = FINISH.FINISH_ABORT(message="client disconnected")
        recorder.finished(aborted_running)
        never_registered = SimpleNamespace(rid="aborted-waiting", finished_reason=FINISH.FINISH_ABORT())
        recorder.finished(never_registered)  # SGLang finished it while it waited, before the hook registered it
        no_round = running(recorder, "no-first-round", first_round=False)
        no_round.output_ids, no_round.finished_len = [7] * 4, 4
        no_round.finished_reason = FINISH.FINISH_MATCHED_TOKEN(matched=2)
        recorder.finished(no_round)
        served(recorder, "kept")  # a client reusing a recorded id
        running(recorder, "still-running")
        with pytest.raises(ValueError, match="no such reason 'gone'"):
            recorder.left_unfinished("still-running", "gone")
    finally:
        recorder.close()
    counts = load_traces(tmp_path / "t").manifest["counts"]
    assert list(load_traces(tmp_path / "t").requests["request_id"]) == ["kept"]
    assert (counts["left_out_aborted"], counts["left_out_without_first_round"], counts["left_out_duplicate"],
            counts["left_out_in_flight"]) == (13, 1, 1, 1)
    accounted = counts["requests"] + sum(v for k, v in counts.items() if k.startswith("left_out_")) \
        + counts["dropped"] + counts["lost_to_write_error"]
    assert accounted == 17  # kept, 10 gone, refused, 2 aborted, no-first-round, the repeat, still-running
    assert recorder.summary().startswith(f"dwise recording {tmp_path / 't'}: 1 requests (1 committed by this run); "
                                         "left out: aborted 13, without_first_round 1, duplicate 1, in_flight 1;")


class AbortRunning:
    """``fake.serve``'s ``before_step``: at ``step``, SGLang's ``abort_request`` (its client went away)
    for ``n`` of the requests the hook made resident that ran (they hold KV), and a request arrives
    that SGLang finished with an abort while it waited (the hook never registers it)."""

    def __init__(self, step: int, n: int):
        self.step, self.n, self.rids = step, n, []

    def __call__(self, step, scheduler):
        if step != self.step:
            return
        self.rids = [r.rid for r in scheduler.dllm_manager.waiting_queue if r.kv.holds_kv][: self.n]
        for rid in self.rids:
            scheduler.abort_request(fake.AbortReq(rid=rid))
        config, sp = scheduler.dllm_config, type("SP", (), {"max_new_tokens": 64})()
        waited = fake.Req("finished-waiting", [5, 6, 7], sp, config, [2], np.zeros(H, np.float32), None)
        waited.finished_reason = FINISH.FINISH_ABORT(message="waited too long")
        scheduler.waiting_queue.append(waited)


def test_requests_sglang_aborts_while_running_leave_the_recorder_and_are_counted(tmp_path):
    """Every request SGLang aborted (the client went away) stayed in the recorder's open set with its
    host rows until the server stopped, then counted as in flight (10 of 10), and one SGLang finished
    while it waited was counted nowhere. The hook's reconcile now tells the recorder when SGLang drops
    a request it holds: its rows are freed at once and it is counted as aborted, once (``close``
    counts what is still open as in flight: none is); the one finished while waiting is counted as
    the hook hands it to SGLang's own path."""
    abort = AbortRunning(step=5, n=10)
    record(tmp_path / "t", workload(30, seed=8), slots=12, k=1, before_step=abort)
    ds = load_traces(tmp_path / "t")
    counts = ds.manifest["counts"]
    assert len(abort.rids) == 10 and not set(abort.rids) & set(ds.requests["request_id"])
    assert (counts["left_out_aborted"], counts["left_out_in_flight"], counts["requests"]) == (11, 0, 20)


class AbortAndLook:
    """``fake.serve``'s ``before_step``: at ``step``, SGLang's ``abort_request`` for one resident
    request, then a look, before any further step, at whether the hook and the recorder still hold it."""

    def __init__(self, step: int, recorder):
        self.step, self.recorder, self.held = step, recorder, None

    def __call__(self, step, scheduler):
        if step != self.step:
            return
        rid = next(r.rid for r in scheduler.dllm_manager.waiting_queue if r.kv.holds_kv)
        scheduler.abort_request(fake.AbortReq(rid=rid))
        self.held = (rid in self.recorder.open, rid in ACTIVE_HOOK[0].state.table.reqs)


ACTIVE_HOOK: list = []


def test_an_abort_leaves_the_hook_and_the_recorder_at_once_not_at_a_step_that_may_never_come(tmp_path):
    """An abort was noticed only by the next step's count check: on a rank that runs no further step
    (idle after its last client went away, or stopping) the aborted request stayed open in the recorder
    and was counted as in flight at close, not as aborted (seen live: 2 of 3 disconnected clients
    counted). The hook wraps ``Scheduler.abort_request``: the request leaves both at once."""
    config = fake.config(BS, 8)
    manifest = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                             "LowConfidence", {}, BS, 64)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=7, manifest=manifest,
                            features=lambda r: (1, 1, len(r.origin_input_ids)))
    handle = install(None, slots=4, k=2, resolve=fake.resolve, block_size=BS, max_batch=4, device="cpu",
                     hidden_size=H, recorder=recorder)
    ACTIVE_HOOK[:] = [handle]
    look = AbortAndLook(step=3, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": 64})()
        scheduler.waiting_queue.extend(fake.Req(rid, ids, sp, config, forwards, hidden, None)
                                       for rid, ids, forwards, hidden in workload(8, seed=3))
        fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, H, max_bs=4), before_step=look)
    finally:
        handle.uninstall()
        ACTIVE_HOOK.clear()
        recorder.close()
    assert look.held == (False, False)
    counts = load_traces(tmp_path / "t").manifest["counts"]
    assert (counts["left_out_aborted"], counts["left_out_in_flight"], counts["requests"]) == (1, 0, 7)


def full_disk(monkeypatch):
    """Shard writes fail as on a full disk (ENOSPC, through the store's own error path); the manifest
    still writes, as a few bytes may where a shard's megabytes do not."""
    import errno

    from dwise_predict.collectors import store

    write = store.atomic_write_bytes

    def no_space(path, *args, **kwargs):
        if store.SHARDS_DIR in Path(path).parts:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, *args, **kwargs)

    monkeypatch.setattr(store, "atomic_write_bytes", no_space)


def test_a_failed_write_stops_recording_with_one_line_and_the_server_keeps_serving(tmp_path, monkeypatch, caplog):
    """A full disk used to stop the writer and re-raise on the scheduler's thread at the next request,
    killing the server. Now recording stops: one log line naming the directory and the error, a
    counter; the hook's calls keep returning, the scheduler finishes every request, nothing is held
    for requests that will never be written, and the manifest counts them."""
    import logging
    import time

    full_disk(monkeypatch)
    recorder = LiveRecorder(tmp_path / "t", block_size=BS, every=1, manifest=MANIFEST)
    handle = install(None, slots=4, k=2, resolve=fake.resolve, block_size=BS, max_batch=4, device="cpu", hidden_size=H,
                     recorder=recorder)
    config = fake.config(BS, 8)
    scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
    sp = type("SP", (), {"max_new_tokens": 64})()
    reqs = [fake.Req(rid, ids, sp, config, forwards, hidden, None) for rid, ids, forwards, hidden in workload(20, 6)]
    caplog.set_level(logging.INFO, logger="dwise_predict.collectors.live")
    try:
        scheduler.waiting_queue.extend(reqs[:10])
        fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, H, max_bs=4))
        deadline = time.monotonic() + 20
        while recorder.failure is None:
            assert time.monotonic() < deadline, "the writer never tried to commit"
            time.sleep(0.02)
        scheduler.waiting_queue.extend(reqs[10:])  # traffic goes on after the failure
        fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, H, max_bs=4))
        assert all(r.finished() for r in reqs) and recorder.open == {} and not recorder._queue
        assert recorder.flush() is False
    finally:
        handle.uninstall()
        recorder.close()
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert str(tmp_path / "t") in line and "the disk is full" in line and "\n" not in line
    counts = json.loads((tmp_path / "t" / "manifest.json").read_text())["counts"]
    assert (counts["requests"], counts["lost_to_write_error"], counts["write_errors"]) == (0, 20, 1)
    assert not list((tmp_path / "t").glob("shards/*.parquet"))
    assert recorder.summary().endswith("lost to a failed write 20; recording stopped by a failed write")


def abandoned(recorder: LiveRecorder) -> None:
    """What a SIGKILL leaves of a recorder: its shards and manifest as the writer left them, its lock
    released by the process's death, no close."""
    recorder.flush()
    recorder._stopping = True
    recorder._writer.join(10)
    recorder.store.__exit__(None, None, None)


def test_a_run_that_never_closed_is_consolidated_and_counted_by_the_next_start(tmp_path):
    """A SIGKILL runs nothing: its committed shards stay unconsolidated. The next start consolidates
    them and says so in the manifest: how many runs ended without closing and how many of the
    requests were recovered from them, over the directory's whole life."""
    first = LiveRecorder(tmp_path / "t", block_size=BS, every=100, manifest=MANIFEST)
    served(first, "a0")
    first.close()  # a clean run: 1 request consolidated
    for run, rids in enumerate((["b0", "b1", "b2"], ["c0", "c1"])):
        killed = LiveRecorder(tmp_path / "t", block_size=BS, every=100, manifest=MANIFEST)
        for rid in rids:
            served(killed, rid)
        abandoned(killed)
    assert not (tmp_path / "t" / "requests.parquet").exists()
    last = LiveRecorder(tmp_path / "t", block_size=BS, every=100, manifest=MANIFEST)  # the next start
    try:
        counts = load_traces(tmp_path / "t").manifest["counts"]  # consolidated before it records anything
        assert len(load_traces(tmp_path / "t")) == 6
        # the second killed run found the first one's shards and consolidated them; this start, the second's
        assert (counts["runs_unclosed"], counts["requests_recovered"], counts["requests_consolidated"]) == (2, 5, 6)
        served(last, "d0")
    finally:
        last.close()
    counts = load_traces(tmp_path / "t").manifest["counts"]
    assert (counts["requests"], counts["runs_unclosed"], counts["requests_recovered"]) == (7, 2, 5)


def test_a_live_recording_carries_the_served_models_identity_into_the_bundle(tmp_path, monkeypatch):
    """A bundle trained on a live recording had an empty ``model`` section: no check of it against a
    served model was possible. The launcher reads the served model from SGLang's arguments
    (``--model-path``, here the built-in tiny dLLM's directory), the recording's manifest holds the
    fingerprint ``collect`` records for that directory, and `train` + `export` carry it into the
    bundle."""
    from fakes import sglang_launch

    from dwise_predict.collectors.backends.tiny import load_tiny_backend
    from dwise_predict.dllm import TINY_MODEL_DIR
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.names import MODEL_KEYS
    from dwise_predict.serving import launcher

    collected = load_tiny_backend().fingerprint()  # what `collect` records for that directory
    width = collected["hidden_size"]
    monkeypatch.setattr(LiveRecorder, "close_on_exit", lambda self: None)  # no signal handlers in the test process
    monkeypatch.setattr(launcher, "ACTIVE", None)
    config = launcher.HookConfig(record=str(tmp_path / "rec"), block_size=BS, hidden_size=width, slots=4, k=2,
                                 max_batch=4, resolver="fakes.sglang_launch:resolve")
    handle = launcher.install_in_this_process(config, sglang_launch.ServerArgs(model_path=str(TINY_MODEL_DIR)))
    recorder = handle.state.recorder
    try:
        dllm = fake.config(BS, 8)
        scheduler = fake.Scheduler(dllm, batch_capacity=4, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": 64})()
        scheduler.waiting_queue.extend(fake.Req(rid, ids, sp, dllm, forwards, hidden, None)
                                       for rid, ids, forwards, hidden in workload(60, seed=7, width=width))
        fake.serve(scheduler, fake.FillAlgorithm(dllm), fake.ModelRunner(BS, width, max_bs=4))
    finally:
        handle.uninstall()
        recorder.close()
    recorded = load_traces(tmp_path / "rec" / "dp0").manifest["model"]
    assert recorded == dict(collected, name=TINY_MODEL_DIR.name)  # the directory's name, as for any served model
    config = TrainConfig(members=1, max_epochs=2, patience=1, width=16, bootstrap=10, admission_trees=5,
                         admission_min_child_samples=2)
    train_run(tmp_path / "rec" / "dp0", tmp_path / "run", config)
    bundle = json.loads((export_bundle(tmp_path / "run", tmp_path / "bundle") / "bundle.json").read_text())
    assert {k: bundle["model"][k] for k in MODEL_KEYS} == {k: collected[k] for k in MODEL_KEYS}
    assert all(bundle["model"][k] for k in MODEL_KEYS) and bundle["model"]["path"] == str(TINY_MODEL_DIR)
