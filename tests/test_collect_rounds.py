"""`collect --rounds-hidden N`: the per-round states of contract 1 (schema 4) on the tiny dLLM, and
how they travel through shards, resume and `traces merge`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dwise_predict.cli import main
from dwise_predict.collectors.backends import load_backend
from dwise_predict.collectors.collect import collect
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.collectors.store import merge
from dwise_predict.collectors.workloads import load_workload
from dwise_predict.engine.signals import early_signals
from dwise_predict.errors import StoreError, TraceError
from dwise_predict.traces import load_traces, write_traces
from dwise_predict.traces.round_states import round_states

KEEP = 8
# tiny-default (seed 0) requests whose rounds were worked out once by decoding them: a one-block
# request that ends at its third forward, one whose second block starts at round 3 (after a
# two-forward first block), and one that runs past the kept rounds ([8, 3]: round 8 is the last
# forward of its first block)
HAND = {"mcq-tiny_mcq-00002-8735891a": [3], "code-tiny_code-00002-69659bf2": [2, 2],
        "math-tiny_math-00003-354a9204": [8, 3]}
DECODING = DecodingConfig(batch_size=3)


class SpyBackend:
    """The tiny backend, keeping each round's rows (one slot: batch size 1) for a hand check."""

    def __init__(self, backend):
        self._backend = backend
        self.rounds: list[list[dict]] = []  # per admitted request: its forwards in order

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def reset_slot(self, slot: int) -> None:
        self.rounds.append([])
        self._backend.reset_slot(slot)

    def step(self, batch):
        out = self._backend.step(batch)
        start = int(batch.out_start[0])
        self.rounds[-1].append({
            "prefill": int(batch.commit_len[0]) == int(batch.n_valid[0]),
            "ids": batch.input_ids[0, start:start + batch.window].clone(),
            "logits": out.logits[0].clone(), "pooled": out.hidden[0].float().mean(0).cpu().numpy()})
        return out


@pytest.fixture(scope="module")
def hand_decoded():
    backend = load_backend("tiny")
    workload = {r.request_id: r for r in load_workload("tiny-default", seed=0, limit=48).requests}
    requests = [DecodeRequest(rid, backend.tokenizer.apply_chat_template(
        workload[rid].messages, add_generation_prompt=True, tokenize=True, return_dict=False), 256) for rid in HAND]
    spy = SpyBackend(backend)
    results = list(decode(spy, requests, DecodingConfig(batch_size=1), rounds_hidden=KEEP))
    return backend, spy, results


def test_round_rows_are_the_decoders_forwards_worked_out_by_hand(hand_decoded):
    backend, spy, results = hand_decoded
    threshold = 0.95  # SGLang's LowConfidence default, what DecodingConfig() runs
    for result, forwards in zip(results, spy.rounds):
        assert result.rounds_per_block == HAND[result.request_id]
        denoising = [f for f in forwards if not f["prefill"]]
        assert len(denoising) == result.total_rounds  # every denoising forward of the request, across its blocks
        kept = min(KEEP, result.total_rounds)
        assert result.round_states.shape == (kept, backend.hidden_size) and result.round_signals.shape == (kept, 4)
        for k, forward in enumerate(denoising[:kept]):
            np.testing.assert_array_equal(result.round_states[k], forward["pooled"])
            signals = early_signals(forward["logits"], forward["ids"], backend.mask_token_id, 8, threshold,
                                    torch.tensor(backend.eos_token_ids))[0].numpy()
            np.testing.assert_array_equal(result.round_signals[k], signals)
        # round 1 is the first round's record, bit for bit
        np.testing.assert_array_equal(result.round_states[0], result.first_round_hidden)
        np.testing.assert_array_equal(result.round_signals[0], np.float32(
            [result.frac_over_threshold, result.mean_confidence, result.mean_entropy, result.end_probability]))
    by_id = {r.request_id: r for r in results}
    # a request that finishes at round 3 has exactly 3 rows
    assert len(by_id["mcq-tiny_mcq-00002-8735891a"].round_states) == 3
    # round 3 of the two-block request is the first forward of its second block: every position masked again
    two_blocks = spy.rounds[list(HAND).index("code-tiny_code-00002-69659bf2")]
    assert [int((f["ids"] == backend.mask_token_id).sum()) for f in two_blocks if not f["prefill"]][2] == 8
    assert by_id["code-tiny_code-00002-69659bf2"].round_signals[3, 0] == 0  # its last forward sees no mask left
    assert len(by_id["math-tiny_math-00003-354a9204"].round_states) == KEEP


def _collect(out: Path, limit: int = 6, **kwargs) -> Path:
    return collect("tiny", "tiny-default", out, DECODING, limit=limit, requests_per_shard=3, **kwargs)


@pytest.fixture(scope="module")
def collections(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rounds")
    return {"rounds": _collect(root / "rounds", rounds_hidden=KEEP), "default": _collect(root / "default")}


def test_collection_stores_the_rounds_under_documented_names(collections):
    ds = load_traces(collections["rounds"])
    assert ds.manifest["rounds_hidden"] == KEEP and ds.manifest["schema_version"] == 4
    rounds = round_states(ds)
    n, h = ds.first_round.shape
    assert rounds.states.shape == (n, KEEP, h) and rounds.signals.shape == (n, KEEP, 4)
    total = ds.requests["total_rounds"].to_numpy()
    assert rounds.recorded.tolist() == np.minimum(total, KEEP).tolist()
    assert (total < KEEP).any() and (total > KEEP).any()
    np.testing.assert_array_equal(rounds.states[:, 0], ds.first_round)
    np.testing.assert_array_equal(rounds.signals[:, 0], ds.early_signals)
    for i, kept in enumerate(rounds.recorded):  # rows past a request's last round hold nothing
        assert not rounds.states[i, kept:].any() and not rounds.signals[i, kept:].any()
        assert np.abs(rounds.states[i, :kept]).sum(axis=1).min() > 0


def test_default_collection_is_unchanged_by_the_option(collections):
    default, rounds = load_traces(collections["default"]), load_traces(collections["rounds"])
    assert default.extra_hidden == {} and "rounds_recorded" not in default.requests.columns
    assert "rounds_hidden" not in default.manifest
    np.testing.assert_array_equal(default.first_round, rounds.first_round)
    np.testing.assert_array_equal(default.prompt_last, rounds.prompt_last)
    assert default.data_hash() == rounds.data_hash()
    with pytest.raises(TraceError, match=r"no per-round states: collect them with `dwise-predict collect --rounds-hidden"):
        round_states(default)


def test_shards_merge_and_resume_carry_the_rounds(collections, tmp_path):
    whole = load_traces(collections["rounds"])
    parts = [_collect(tmp_path / f"part{i}", shard=f"{i}/2", rounds_hidden=KEEP) for i in range(2)]
    merged = load_traces(merge(parts, tmp_path / "merged"))
    resumed_dir = _collect(tmp_path / "resumed", limit=3, rounds_hidden=KEEP)
    resumed = load_traces(_collect(resumed_dir, limit=6, rounds_hidden=KEEP))  # a larger --limit resumes
    for ds in (merged, resumed, load_traces(write_traces(whole, tmp_path / "copy"))):
        assert ds.requests["request_id"].tolist() == whole.requests["request_id"].tolist()
        assert ds.requests["rounds_recorded"].tolist() == whole.requests["rounds_recorded"].tolist()
        for name in ("round_states", "round_signals"):
            np.testing.assert_array_equal(ds.extra_hidden[name], whole.extra_hidden[name])
    assert merged.manifest["rounds_hidden"] == KEEP and resumed.manifest["rounds_hidden"] == KEEP


def test_another_depth_is_refused_on_resume_and_merge(collections, tmp_path):
    with pytest.raises(StoreError, match="holds `rounds_hidden` 8, not `rounds_hidden` 4: rerun with the"):
        _collect(collections["rounds"], rounds_hidden=4)
    with pytest.raises(StoreError, match="holds no per-round states .*, not `rounds_hidden` 8: merge only"):
        merge([collections["rounds"], collections["default"]], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_schema_3_traces_load_and_merge_without_per_round_states(collections, tmp_path):
    old = tmp_path / "old"
    default = load_traces(collections["default"])
    write_traces(default.subset(np.arange(len(default)) < 3), old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 3}))
    ds = load_traces(old)
    assert ds.extra_hidden == {} and len(ds) > 0
    with pytest.raises(TraceError, match="collect --rounds-hidden"):
        round_states(ds)
    # schema 4 only added optional tensors: the old set still merges with a new one
    merged = load_traces(merge([old, collections["default"]], tmp_path / "merged"))
    assert merged.manifest["schema_version"] == 4 and len(merged) == len(default)


def test_corrupt_counts_are_named(collections, tmp_path):
    ds = load_traces(collections["rounds"])
    ds.requests.loc[0, "rounds_recorded"] = 99
    with pytest.raises(TraceError, match=r"rounds_recorded .* is 99, not min\(N, total_rounds\)"):
        round_states(ds)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_bad_depth_is_one_line(value, tmp_path, capsys):
    assert main(["collect", "--out", str(tmp_path / "o"), "--limit", "2", "--rounds-hidden", value]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--rounds-hidden must be from 1 to 256" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit", ["count", "tensor"])
def test_round_states_that_disagree_with_the_table_are_refused_on_load(collections, tmp_path, capsys, edit):
    """The one contract-1 validator checks schema 4's per-round tensors too (issue 43): a count edited
    in requests.parquet, or round_states of another request count, is one line at load, not a
    replay that reads zeros as rounds."""
    import shutil

    import pandas as pd
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(collections["rounds"], bad)
    if edit == "count":
        table = pd.read_parquet(bad / "requests.parquet")
        table.loc[0, "rounds_recorded"] = 99
        table.to_parquet(bad / "requests.parquet", index=False)
        message = r"rounds_recorded .* is 99, not min\(N, total_rounds\)"
    else:
        tensors = load_file(str(bad / "hidden.safetensors"))
        tensors["round_states"] = tensors["round_states"][:-1]
        save_file(tensors, str(bad / "hidden.safetensors"))
        message = "has shape .* but the table has"
    with pytest.raises(TraceError, match=message):
        load_traces(bad)
    assert main(["traces", "show", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "collect" in err and err.startswith("error")
