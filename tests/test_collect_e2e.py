"""`collect` end to end on a small random tiny dLLM: contract 1, resume, --shard + merge, bad input."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest

from collect_helpers import make_tiny_dir
from dwise_predict.cli import main
from dwise_predict.collectors.collect import collect, collect_threads, plan_shards
from dwise_predict.collectors.records import DecodingConfig
from dwise_predict.collectors.store import TraceStore
from dwise_predict.traces import REQUEST_COLUMNS, load_traces

LIMIT = 24
DECODING = DecodingConfig(batch_size=4, budget=16)
FLAGS = ["--limit", str(LIMIT), "--batch-size", "4", "--budget", "16", "--requests-per-shard", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "traces"
    collect(str(tiny_dir), "tiny-default", out, DECODING, limit=LIMIT, requests_per_shard=4)
    return load_traces(out)


def _same_traces(a, b):
    for col in ("request_id", "split", "category", "prompt", "prompt_tokens", "total_rounds", "output_tokens",
                "finish", "output_text"):
        assert a.requests[col].tolist() == b.requests[col].tolist(), col
    assert [list(v) for v in a.requests["rounds_per_block"]] == [list(v) for v in b.requests["rounds_per_block"]]
    np.testing.assert_array_equal(a.first_round, b.first_round)
    np.testing.assert_array_equal(a.prompt_last, b.prompt_last)


def test_collect_fills_contract_one_in_workload_order(reference, tiny_dir):
    from dwise_predict.collectors.workloads import load_workload

    req = reference.requests
    assert list(req.columns[: len(REQUEST_COLUMNS)]) == list(REQUEST_COLUMNS)
    assert req["request_id"].tolist() == [r.request_id for r in load_workload("tiny-default", 0, LIMIT).requests]
    assert req["workload_index"].tolist() == list(range(LIMIT))
    assert reference.first_round.shape == (LIMIT, 32) and reference.prompt_last.shape == (LIMIT, 32)
    assert (req["prompt_blocks"] == req["prompt_tokens"] // 4).all()  # full prompt blocks: the prefill forwards
    assert (req["total_rounds"] == req["rounds_per_block"].map(sum)).all()
    assert (req["words"] == req["prompt"].str.split().map(len)).all()
    assert set(req["finish"]) <= {"eos", "budget"} and (req["output_tokens"] <= 16).all()
    assert req["total_rounds"].nunique() > 3  # rounds vary per request
    assert req["correct"].isna().sum() == (req["category"] == "chat").sum()  # chat is not checkable
    m = reference.manifest
    assert m["model"]["path"] == str(tiny_dir) and len(m["model"]["weights_sha256"]) == 64
    assert m["decoding"] == {**DECODING.to_dict(), "algorithm": "LowConfidence", "algorithm_config": {"threshold": 0.95},
                             "block_size": 4, "params": {}, "engine": "sglang==0.5.23", "engine_faithful": True}
    assert m["counts"]["requests"] == LIMIT and m["workload"]["name"] == "tiny-default"
    assert sum(n for c in m["workload"]["composition"].values() for n in c.values()) == LIMIT


def test_traces_load_in_one_line_with_pandas_and_datasets(reference):
    from datasets import Dataset

    table = pd.read_parquet(reference.path / "requests.parquet")
    ds = Dataset.from_parquet(str(reference.path / "requests.parquet"))
    assert len(table) == len(ds) == LIMIT
    assert ds["total_rounds"] == reference.requests["total_rounds"].tolist()


def test_rerun_resumes_everything_and_decodes_nothing(reference, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "again"
    shutil.copytree(reference.path, out)
    import dwise_predict.collectors.decoder as decoder

    monkeypatch.setattr(decoder, "decode", lambda *a, **k: pytest.fail("a finished request was decoded again"))
    seen = []
    collect(reference.manifest["model"]["path"], "tiny-default", out, DECODING, limit=LIMIT, requests_per_shard=4,
            progress=seen.append)
    assert seen[-1].resumed == seen[-1].done == seen[-1].total == LIMIT
    _same_traces(load_traces(out), reference)


def test_the_servers_algorithm_config_file_is_the_same_decoding_as_the_flags(reference, tmp_path, monkeypatch, capsys):
    """A server's ``--dllm-algorithm-config`` YAML holding the defaults the reference ran with (and
    an execution switch) resumes that collection without decoding; another threshold is refused."""
    import shutil

    import dwise_predict.collectors.decoder as decoder

    out = tmp_path / "again"
    shutil.copytree(reference.path, out)
    monkeypatch.setattr(decoder, "decode", lambda *a, **k: pytest.fail("a finished request was decoded again"))
    block = reference.manifest["decoding"]["block_size"]
    flags = ["collect", "--model", reference.manifest["model"]["path"], "--out", str(out), *FLAGS]
    server = tmp_path / "server.yaml"
    server.write_text(f"threshold: 0.95\nblock_size: {block}\nvectorized_decoding: true\n")
    assert main([*flags, "--algorithm-config", str(server)]) == 0
    _same_traces(load_traces(out), reference)
    server.write_text("threshold: 0.9\n")
    assert main([*flags, "--algorithm-config", str(server)]) == 1
    assert "{'threshold': 0.95} vs {'threshold': 0.9}" in capsys.readouterr().err


def test_a_resumed_collection_may_grow_but_not_shrink(reference, tmp_path, capsys):
    """Rerun with a smaller --limit, the finished requests beyond it would be consolidated under a
    manifest that plans fewer: refused, nothing changed; a larger --limit extends the collection."""
    import shutil

    out = tmp_path / "again"
    shutil.copytree(reference.path, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")}
    model = reference.manifest["model"]["path"]
    flags = ["collect", "--model", model, "--out", str(out), "--batch-size", "4", "--budget", "16",
             "--requests-per-shard", "4"]
    assert main([*flags, "--limit", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"holds {LIMIT - 8} finished requests" in err and f"--limit {LIMIT}" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")} == before
    assert main([*flags, "--limit", str(LIMIT + 4)]) == 0
    grown = load_traces(out)
    assert len(grown) == LIMIT + 4 and grown.manifest["workload"]["limit"] == LIMIT + 4
    assert grown.requests["request_id"].tolist()[:LIMIT] == reference.requests["request_id"].tolist()


def test_shards_merged_equal_the_unsharded_run(reference, tiny_dir, tmp_path, capsys):
    assert [list(r) for r in plan_shards(10, 4, (1, 2))] == [[4, 5, 6, 7]]
    for i in (0, 1):
        assert main(["collect", "--model", str(tiny_dir), *FLAGS, "--shard", f"{i}/2", "--out", str(tmp_path / f"p{i}")]) == 0
    parts = [load_traces(tmp_path / f"p{i}") for i in (0, 1)]
    assert [len(p) for p in parts] == [12, 12]
    assert main(["traces", "merge", str(tmp_path / "p0"), str(tmp_path / "p1"), "--out", str(tmp_path / "all")]) == 0
    merged = load_traces(tmp_path / "all")
    _same_traces(merged, reference)
    assert "all " in capsys.readouterr().out  # the summary table's total row
    # a second collection of the same requests: a new clock, one data fingerprint (runs carry over)
    assert not merged.requests["wall_s"].equals(reference.requests["wall_s"])
    assert merged.data_hash() == reference.data_hash()


def test_merge_refuses_another_models_shards(reference, tmp_path, capsys):
    other = make_tiny_dir(tmp_path / "other", seed=1)
    collect(str(other), "tiny-default", tmp_path / "o", DECODING, limit=4, requests_per_shard=4)
    capsys.readouterr()
    assert main(["traces", "merge", str(reference.path), str(tmp_path / "o"), "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "holds traces of another model" in err and err.count("\n") == 1


def test_out_holding_another_models_traces_is_refused(reference, tmp_path, capsys):
    import shutil

    out = tmp_path / "ref"
    shutil.copytree(reference.path, out)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    other = make_tiny_dir(tmp_path / "other", seed=1)
    assert main(["collect", "--model", str(other), *FLAGS, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "another model" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_second_concurrent_writer_is_refused(reference, tiny_dir, tmp_path, capsys):
    out = tmp_path / "busy"
    with TraceStore(out, reference.manifest):
        assert main(["collect", "--model", str(tiny_dir), *FLAGS, "--out", str(out)]) == 1
    assert "being written by another dwise-predict process" in capsys.readouterr().err


def test_malformed_jsonl_names_file_and_line(tiny_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "what is two plus two ?"}\n{"prompt": "broken\n{"prompt": "fine"}\n')
    spec = tmp_path / "spec.toml"
    spec.write_text(f'name = "mine"\n[[sources]]\ntype = "jsonl"\npath = "{data}"\ncategory = "chat"\ncount = 2\n')
    assert main(["collect", "--model", str(tiny_dir), "--workload", str(spec), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"{data}:2 is not valid JSON" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # nothing is created before the workload is known to be good


def test_bad_flags_are_reported_together(tmp_path, capsys):
    code = main(["collect", "--out", str(tmp_path / "o"), "--threshold", "1.5", "--batch-size", "0",
                 "--shard", "2/2", "--limit", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    for flag in ("threshold", "--batch-size", "--shard", "--limit"):
        assert flag in err


def test_missing_model_directory_is_one_line(tmp_path, capsys):
    assert main(["collect", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--limit", "2"]) == 1
    err = capsys.readouterr().err
    assert "no model directory" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # a refused collection leaves no directory (nor its lock) behind
    assert main(["collect", "--layers", "99", "--out", str(tmp_path / "o"), "--limit", "2"]) == 1
    assert not (tmp_path / "o").exists()
    (tmp_path / "mine").mkdir()  # a directory that was there stays
    assert main(["collect", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "mine"), "--limit", "2"]) == 1
    assert (tmp_path / "mine").is_dir()


def test_traces_show_json_matches_the_table(reference, capsys):
    assert main(["traces", "show", str(reference.path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    total = summary["categories"][-1]
    rounds = reference.requests["total_rounds"]
    assert total["category"] == "all" and total["count"] == LIMIT and summary["complete"]
    assert total["rounds_max"] == rounds.max() and total["rounds_p50"] == rounds.median()
    assert total["eos"] + total["budget"] == LIMIT
    assert [c["category"] for c in summary["categories"][:-1]] == sorted(reference.requests["category"].unique())


def test_traces_show_reads_a_collection_still_in_progress(reference, tmp_path, capsys):
    import shutil

    out = tmp_path / "partial"
    shutil.copytree(reference.path, out)
    (out / "requests.parquet").unlink()
    (out / "hidden.safetensors").unlink()
    for table in sorted((out / "shards").glob("*.parquet"))[2:]:
        table.unlink()
    assert main(["traces", "show", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["complete"] is False and summary["categories"][-1]["count"] == 8  # 2 shards of 4


def test_defaults_collect_the_builtin_model_and_workload(tmp_path, capsys):
    from dwise_predict.dllm import TINY_MODEL_DIR

    assert main(["collect", "--out", str(tmp_path / "t"), "--limit", "16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    ds = load_traces(tmp_path / "t")
    assert ds.manifest["model"]["path"] == str(TINY_MODEL_DIR) and ds.manifest["workload"]["name"] == "tiny-default"
    assert ds.manifest["decoding"]["block_size"] == 8 and ds.manifest["decoding"]["budget"] == 256
    assert ds.requests["category"].nunique() == 8 and summary["categories"][-1]["count"] == 16
    assert ds.requests["total_rounds"].nunique() > 4 and (ds.requests["finish"] == "eos").mean() > 0.5


def test_allow_missing_collects_the_sources_that_exist(tiny_dir, tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text(
        'name = "partial"\n'
        f'[[sources]]\ntype = "jsonl"\npath = "{tmp_path / "absent.jsonl"}"\ncategory = "chat"\ncount = 4\n'
        '[[sources]]\ntype = "multi_needle"\ncategory = "long_context"\ncount = 6\ntarget_words = 160\n'
    )
    args = ["collect", "--model", str(tiny_dir), "--workload", str(spec), "--budget", "16"]
    assert main([*args, "--out", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "absent.jsonl" in err and err.count("\n") == 1

    assert main([*args, "--out", str(tmp_path / "o"), "--allow-missing"]) == 0
    ds = load_traces(tmp_path / "o")
    assert len(ds) == 6 and set(ds.requests["category"]) == {"long_context"}
    assert "absent.jsonl" in " ".join(ds.manifest["workload"]["plan"]["missing"])


def test_collect_without_a_terminal_logs_progress_lines(tiny_dir, tmp_path, capsys):
    """Under nohup, CI or Slurm stderr is no terminal and the bar is not drawn: progress comes as lines
    instead, at start, every tenth of the requests (or 30 s), and at the end."""
    assert main(["collect", "--model", str(tiny_dir), "--out", str(tmp_path / "t"), *FLAGS]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("collect: ")]
    assert lines[0].startswith(f"collect: 0/{LIMIT} requests (0%)")
    assert lines[-1].startswith(f"collect: {LIMIT}/{LIMIT} requests (100%)") and "req/s" in lines[-1]
    done = [int(line.split()[1].split("/")[0]) for line in lines]
    assert done == sorted(set(done)) and len(lines) >= 6  # a line per tenth (2.4 requests: every 2)
    assert main(["collect", "--model", str(tiny_dir), "--out", str(tmp_path / "t"), *FLAGS]) == 0  # all resumed
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("collect: ")]
    assert len(lines) == 1 and lines[0].startswith(f"collect: {LIMIT}/{LIMIT} requests") and f"({LIMIT} resumed)" in lines[0]


def test_collect_progress_lines_come_every_30_seconds_between_tenths(monkeypatch, capsys):
    from dwise_predict.cli import collect as cli_collect
    from dwise_predict.collectors.collect import CollectProgress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with cli_collect.CollectProgressBar() as bar:
        for done, elapsed in ((0, 0.0), (1, 10.0), (2, 29.0), (3, 31.0), (4, 40.0), (5, 61.5), (1000, 90.0)):
            bar.update(CollectProgress(total=1000, done=done, rounds=7 * done, elapsed_s=elapsed))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["0/1000", "3/1000", "5/1000", "1000/1000"]
    assert lines[1] == "collect: 3/1000 requests (0%)  0.10 req/s  0.7 rounds/s  ETA 2:51:42"  # 997 left at 3/31 s


def test_collect_allow_network_reaches_the_workload_as_workload_show_passes_it(monkeypatch, tmp_path):
    """`--allow-network` means in `collect` what it means in `workload show`: hub datasets may download
    (True); without it the workload spec's own allow_network decides (None)."""
    from dwise_predict.collectors import workloads
    from dwise_predict.errors import InputError

    asked = []

    def load_workload(spec, seed=0, limit=None, *, allow_missing=False, allow_network=None):
        asked.append(allow_network)
        raise InputError("stop here: the spy saw what it needed")

    monkeypatch.setattr(workloads, "load_workload", load_workload)
    for command in (["collect", "--out", str(tmp_path / "t")], ["workload", "show"]):
        assert main([*command, "--allow-network"]) == 1
        assert main(command) == 1
    assert asked == [True, None, True, None]


def test_torch_runs_one_thread_per_shard_worker_else_every_core_and_the_callers_setting_is_kept(tiny_dir, tmp_path,
                                                                                              monkeypatch):
    import os

    import torch

    import dwise_predict.collectors.collect as collect_mod

    cores = len(os.sched_getaffinity(0))
    assert collect_threads(None) is None  # conftest sets OMP_NUM_THREADS=1: an explicit choice is kept
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert collect_threads(None) == collect_threads((0, 1)) == cores and collect_threads((1, 4)) == 1
    seen, decode = [], collect_mod._decode

    def watched(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return decode(*args, **kwargs)

    monkeypatch.setattr(collect_mod, "_decode", watched)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        collect(str(tiny_dir), "tiny-default", tmp_path / "part", DECODING, limit=8, requests_per_shard=4, shard="1/2")
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        collect(str(tiny_dir), "tiny-default", tmp_path / "all", DECODING, limit=4)
        assert seen == [1, 3] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
