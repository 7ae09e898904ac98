"""The shard store: atomic shards, resume bookkeeping, locking, identity checks, merge, disk errors."""

from __future__ import annotations

import errno
import json

import numpy as np
import pandas as pd
import pytest

from dwise_predict.collectors import store as store_mod
from dwise_predict.collectors.store import SHARDS_DIR, TraceStore, merge, read_shards
from dwise_predict.errors import StoreError
from dwise_predict.traces import load_traces
from dwise_predict.traces.dataset import SCHEMA_VERSION

H = 6


def _manifest(weights="w0", threshold=0.9, batch_size=4, shard=None):
    return {
        "model": {"name": "m", "weights_sha256": weights, "config_hash": "c0", "hidden_size": H},
        "decoding": {"algorithm": "LowConfidence", "algorithm_config": {"threshold": threshold}, "block_size": 4,
                     "budget": 16, "dtype": "float32", "batch_size": batch_size, "params": {},
                     "engine": "sglang==0.5.23"},
        "workload": {"name": "wl", "seed": 0, "shard": shard, "composition": {}},
    }


def _rows(indices):
    """Contract-1 rows whose values are functions of the workload index (so order is checkable)."""
    rows = pd.DataFrame({
        "request_id": [f"r{i:03d}" for i in indices],
        "split": ["train" if i % 3 else "eval" for i in indices],
        "category": ["math" if i % 2 else "code" for i in indices],
        "source": "src", "prompt": [f"prompt {i}" for i in indices],
        "prompt_tokens": [10 + i for i in indices], "words": 2, "newlines": 0, "budget": 16, "block_size": 4,
        "prompt_blocks": [(10 + i) // 4 for i in indices], "total_rounds": [4 + i % 5 for i in indices],
        "rounds_per_block": [[2, 2 + i % 5] for i in indices], "output_tokens": [8 for _ in indices],
        "finish": "eos", "frac_over_threshold": 0.5, "mean_confidence": 0.7, "mean_entropy": 1.0, "end_probability": 0.2, "wall_s": 0.1,
        "workload_index": list(indices),
    })
    hidden = np.array([[i + k / 10 for k in range(H)] for i in indices], dtype=np.float32)
    return rows, hidden, -hidden


def test_shards_consolidate_in_workload_order_and_load(tmp_path):
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([4, 5, 6, 7]))
        store.write_shard(*_rows([0, 1, 2, 3]))
        assert store.finished_ids() == {f"r{i:03d}" for i in range(8)}
        assert store.missing([f"r{i:03d}" for i in range(10)]) == ["r008", "r009"]
        store.consolidate({"requests": 8})
    ds = load_traces(tmp_path)
    assert ds.requests["workload_index"].tolist() == list(range(8))
    assert ds.first_round[:, 0].tolist() == list(range(8))  # hidden rows follow their request rows
    np.testing.assert_array_equal(ds.prompt_last, -ds.first_round)
    assert ds.manifest["counts"]["requests"] == 8 and ds.manifest["model"]["weights_sha256"] == "w0"
    assert sorted(p.name for p in (tmp_path / SHARDS_DIR).iterdir()) == [
        "shard-000000.parquet", "shard-000000.safetensors", "shard-000001.parquet", "shard-000001.safetensors"]


def test_manifest_is_written_at_start(tmp_path):
    with TraceStore(tmp_path, _manifest()):
        manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["decoding"]["algorithm_config"] == {"threshold": 0.9} and manifest["schema_version"] == SCHEMA_VERSION


def test_crash_between_the_two_files_leaves_no_half_shard(tmp_path):
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([0, 1]))
        # a kill after the safetensors file landed and before the Parquet file did:
        orphan = (tmp_path / SHARDS_DIR / "shard-000000.safetensors").read_bytes()
        (tmp_path / SHARDS_DIR / "shard-000001.safetensors").write_bytes(orphan)
        (tmp_path / SHARDS_DIR / ".shard-000002.parquet.tmp-123").write_bytes(b"partial")
        assert store.finished_ids() == {"r000", "r001"}
        store.write_shard(*_rows([2, 3]))  # takes the orphan's name and replaces it
        assert [len(s.requests) for s in read_shards(tmp_path)] == [2, 2]
        assert store.finished_ids() == {"r000", "r001", "r002", "r003"}


def test_mismatched_shard_pair_is_refused_naming_the_files(tmp_path):
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([0, 1]))
        store.write_shard(*_rows([2, 3]))
    shards = tmp_path / SHARDS_DIR
    (shards / "shard-000001.safetensors").write_bytes((shards / "shard-000000.safetensors").read_bytes())
    with pytest.raises(StoreError, match="shard-000001.parquet and shard-000001.safetensors disagree"):
        read_shards(tmp_path)


def test_second_writer_is_refused_with_one_line(tmp_path):
    with TraceStore(tmp_path, _manifest()):
        with pytest.raises(StoreError) as err:
            TraceStore(tmp_path, _manifest()).__enter__()
    assert "being written by another dwise-predict process" in str(err.value) and "\n" not in str(err.value)
    with TraceStore(tmp_path, _manifest()):  # released on exit
        pass


def test_other_model_or_decoding_config_is_refused_and_batch_size_is_not(tmp_path):
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([0, 1]))
    before = (tmp_path / "manifest.json").read_text()
    with pytest.raises(StoreError, match="another model"):
        TraceStore(tmp_path, _manifest(weights="w1")).__enter__()
    with pytest.raises(StoreError, match=r"another config \(algorithm_config \{'threshold': 0.9\} vs \{'threshold': 0.5\}\)"):
        TraceStore(tmp_path, _manifest(threshold=0.5)).__enter__()
    with pytest.raises(StoreError, match="workload shard None, this run asks for '0/2'"):
        TraceStore(tmp_path, _manifest(shard="0/2")).__enter__()
    assert (tmp_path / "manifest.json").read_text() == before  # nothing was touched
    with TraceStore(tmp_path, _manifest(batch_size=32)) as store:
        assert store.finished_ids() == {"r000", "r001"}


def test_parameters_are_compared_over_sglangs_defaults(tmp_path):
    """A recording made before manifests carried the defaults says LowConfidence ``{}``: the same
    decoding as ``{"threshold": 0.95}`` (SGLang's default), so a restart with today's manifest resumes
    it, and any other threshold is still refused."""
    old = _manifest()
    old["decoding"]["algorithm_config"] = {}
    with TraceStore(tmp_path, old) as store:
        store.write_shard(*_rows([0, 1]))
    with TraceStore(tmp_path, _manifest(threshold=0.95)) as store:
        assert store.finished_ids() == {"r000", "r001"}
    with pytest.raises(StoreError, match=r"another config \(algorithm_config \{'threshold': 0.95\} vs \{'threshold': 0.9\}\)"):
        TraceStore(tmp_path, _manifest(threshold=0.9)).__enter__()


def test_disk_full_is_one_line_and_earlier_shards_stay_readable(tmp_path, monkeypatch):
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([0, 1]))
        real = store_mod.atomic_write_bytes

        def full(target, data, durable=False):
            if target.suffix == ".parquet":
                raise OSError(errno.ENOSPC, "No space left on device", str(target))
            real(target, data, durable)

        monkeypatch.setattr(store_mod, "atomic_write_bytes", full)
        with pytest.raises(StoreError, match="disk is full") as err:
            store.write_shard(*_rows([2, 3]))
        assert "rerun the same command to resume" in str(err.value)
        monkeypatch.setattr(store_mod, "atomic_write_bytes", real)
        assert store.finished_ids() == {"r000", "r001"}  # the half-written shard does not count
        store.write_shard(*_rows([2, 3]))
        assert store.finished_ids() == {"r000", "r001", "r002", "r003"}


def test_unwritable_out_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot write to .*file/out"):
        TraceStore(blocker / "out", _manifest()).__enter__()


def _collection(path, indices, **manifest):
    with TraceStore(path, _manifest(**manifest)) as store:
        for chunk in np.array_split(np.array(indices), 2):
            store.write_shard(*_rows(chunk.tolist()))
    return path


def test_merge_interleaves_disjoint_shards_into_workload_order(tmp_path):
    whole = _collection(tmp_path / "whole", list(range(12)))
    with TraceStore(whole, _manifest()) as store:
        store.consolidate()
    a = _collection(tmp_path / "a", [0, 1, 2, 6, 7, 8], shard="0/2")
    b = _collection(tmp_path / "b", [3, 4, 5, 9, 10, 11], shard="1/2")
    merged = load_traces(merge([a, b], tmp_path / "merged"))
    expected = load_traces(whole)
    pd.testing.assert_frame_equal(merged.requests, expected.requests)
    np.testing.assert_array_equal(merged.first_round, expected.first_round)
    assert merged.data_hash() == expected.data_hash()
    assert merged.manifest["workload"]["shards"] == ["0/2", "1/2"]
    # the same directory twice: identical repeats are kept once
    assert len(load_traces(merge([a, a, b], tmp_path / "again"))) == 12


def test_merge_refuses_another_model_or_config(tmp_path):
    a = _collection(tmp_path / "a", [0, 1])
    other_model = _collection(tmp_path / "b", [2, 3], weights="w9")
    other_config = _collection(tmp_path / "c", [2, 3], threshold=0.5)
    with pytest.raises(StoreError, match="another model"):
        merge([a, other_model], tmp_path / "m1")
    with pytest.raises(StoreError, match="another config"):
        merge([a, other_config], tmp_path / "m2")
    assert not (tmp_path / "m1" / "requests.parquet").exists()


def test_traces_in_other_round_units_are_never_mixed(tmp_path):
    """A collection of schema 1 (before the engine's units) cannot be resumed, nor merged with or alone."""
    old = _collection(tmp_path / "old", [0, 1])
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 1}))
    new = _collection(tmp_path / "new", [2, 3])
    for inputs in ([new, old], [old, new], [old]):
        with pytest.raises(StoreError, match="schema 1, in other round units .* recollect them") as err:
            merge(inputs, tmp_path / "m")
        assert "\n" not in str(err.value)
    with pytest.raises(StoreError, match="schema 1, in other round units"):
        TraceStore(old, _manifest()).__enter__()
    assert not (tmp_path / "m").exists()


def test_merge_refuses_conflicting_repeats(tmp_path):
    a = _collection(tmp_path / "a", [0, 1])
    b = tmp_path / "b"
    with TraceStore(b, _manifest()) as store:
        rows, h1, h2 = _rows([1])
        rows.at[0, "rounds_per_block"] = [9, 9]
        store.write_shard(rows, h1, h2)
    with pytest.raises(StoreError, match="'r001' appears in more than one input with different results"):
        merge([a, b], tmp_path / "m")


def test_a_run_that_wrote_no_shard_binds_nothing(tmp_path):
    with TraceStore(tmp_path, _manifest(threshold=0.5)):
        pass  # e.g. stopped by a bad option before decoding anything
    with TraceStore(tmp_path, _manifest()) as store:
        store.write_shard(*_rows([0]))
    assert json.loads((tmp_path / "manifest.json").read_text())["decoding"]["algorithm_config"] == {"threshold": 0.9}


def test_requests_decoded_by_other_code_are_kept_and_named_in_the_manifest(tmp_path, monkeypatch, capsys):
    from dwise_predict.cli import main
    from dwise_predict.versions import source_fingerprint

    now = source_fingerprint()
    with TraceStore(tmp_path / "one", _manifest()) as store:  # one version of the code: nothing to say
        store.write_shard(*_rows([0, 1]))
        store.consolidate()
    assert "mixed_sources" not in load_traces(tmp_path / "one").manifest
    assert [s.source for s in read_shards(tmp_path / "one")] == [now]

    monkeypatch.setattr(store_mod, "source_fingerprint", lambda: "old" * 21 + "0")
    with TraceStore(tmp_path / "resumed", _manifest()) as store:
        store.write_shard(*_rows([0, 1, 2]))  # decoded before an upgrade ...
    monkeypatch.undo()
    with TraceStore(tmp_path / "resumed", _manifest()) as store:
        store.write_shard(*_rows([3]))  # ... and resumed after it
        capsys.readouterr()
        assert main(["traces", "show", str(tmp_path / "resumed"), "--json"]) == 0  # still collecting: from the shards
        assert json.loads(capsys.readouterr().out)["mixed_sources"] == {"old" * 21 + "0": 3, now: 1}
        store.consolidate()
    resumed = load_traces(tmp_path / "resumed")
    assert len(resumed) == 4 and resumed.manifest["mixed_sources"] == {"old" * 21 + "0": 3, now: 1}

    merged = load_traces(merge([tmp_path / "one", tmp_path / "resumed"], tmp_path / "merged"))
    # r000, r001 are in both inputs with the same results: the first input's copy (this code) is kept
    assert len(merged) == 4 and merged.manifest["mixed_sources"] == {"old" * 21 + "0": 1, now: 3}
    # a consolidated input that is itself mixed stays mixed, its rows no longer told apart
    assert load_traces(merge([tmp_path / "merged"], tmp_path / "remerged")).manifest["mixed_sources"] == {"several": 4}

    capsys.readouterr()
    assert main(["traces", "show", str(tmp_path / "resumed"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mixed_sources"] == {"old" * 21 + "0": 3, now: 1}
    counts = ", ".join(sorted([f"{now[:12]}: 1", "oldoldoldold: 3"]))  # listed in fingerprint order
    assert err.strip() == (f"note: {tmp_path / 'resumed'}'s requests were decoded by 2 versions of dwise-predict's "
                           f"code (source fingerprint: requests; {counts}); delete its shards and collect again for one")


def _collect_resumed(out, keep, damage=None):
    """One shard from an earlier run on disk, two written by this store (kept in memory when ``keep``),
    then consolidated; ``damage(shards_dir)`` runs just before the consolidation."""
    with TraceStore(out, _manifest()) as store:
        store.write_shard(*_rows([4, 5, 6, 7]))
    with TraceStore(out, _manifest(), keep_shards=keep) as store:
        store.write_shard(*_rows([0, 1, 2, 3]))
        store.write_shard(*_rows([8, 9]))
        if damage:
            damage(out / SHARDS_DIR)
        store.consolidate({"requests": 10})


def test_kept_shards_consolidate_to_the_bytes_a_fresh_read_gives(tmp_path):
    _collect_resumed(tmp_path / "read", keep=False)
    _collect_resumed(tmp_path / "kept", keep=True)
    for name in ("requests.parquet", "hidden.safetensors", "manifest.json"):
        assert (tmp_path / "read" / name).read_bytes() == (tmp_path / "kept" / name).read_bytes(), name


@pytest.mark.parametrize("suffix", [".parquet", ".safetensors"])
def test_a_kept_shard_damaged_on_disk_after_its_write_is_refused(tmp_path, suffix):
    def flip(shards):
        path = shards / f"shard-000001{suffix}"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    with pytest.raises(StoreError, match="shard-000001.parquet"):
        _collect_resumed(tmp_path, keep=True, damage=flip)
