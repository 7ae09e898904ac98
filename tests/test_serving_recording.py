"""Recording mode: the hook writes contract-1 traces of live traffic (here: the fake SGLang server)."""

import numpy as np
import pytest

import sglang_reference

if not sglang_reference.available():
    pytest.skip(sglang_reference.SKIP_REASON, allow_module_level=True)

from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.collectors.store import merge  # noqa: E402
from dwise_predict.engine import ENGINE, prefill_rounds  # noqa: E402
from dwise_predict.serving.sglang_adapter import install  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402
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


def record(out, requests, fdfo=True, graph=False):
    config = fake.config(BS, 8, fdfo=fdfo)
    manifest = live_manifest({"name": "fake", "hidden_size": H, "config_hash": "x", "weights_sha256": "y"},
                             "LowConfidence", {"threshold": 0.95}, BS, 64)
    recorder = LiveRecorder(out, block_size=BS, features=lambda r: (len(r.origin_input_ids) // 2, 1, len(r.origin_input_ids)),
                            every=7, manifest=manifest)
    handle = install(None, slots=4, k=2, resolve=fake.resolve, block_size=BS, max_batch=4, device="cpu",
                     hidden_size=H, recorder=recorder)
    try:
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        sp = type("SP", (), {"max_new_tokens": 64})()
        reqs = [fake.Req(rid, ids, sp, config, forwards, hidden, None) for rid, ids, forwards, hidden in requests]
        scheduler.waiting_queue.extend(reqs)
        fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(BS, H, cuda_graph=graph, max_bs=4))
    finally:
        handle.uninstall()
        recorder.close()
    return reqs


def test_recorded_traces_are_the_servers_own_counts(tmp_path):
    requests = workload(30, seed=0)
    reqs = record(tmp_path / "t", requests)
    ds = load_traces(tmp_path / "t")  # contract 1, validated
    assert ds.manifest["decoding"]["engine"] == ENGINE and ds.manifest["schema_version"] == 2
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
