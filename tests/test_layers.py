"""`collect --layers` / `--pooling` (contract 1's optional first-round tensors) and
`evaluate --ablate layers|pooling`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from collect_helpers import make_masked_llama_dir
from dwise_predict.collectors.collect import collect
from dwise_predict.collectors.records import DecodingConfig
from dwise_predict.collectors.store import merge
from dwise_predict.errors import ConfigError, InputError, StoreError
from dwise_predict.traces import load_traces, write_traces

FULL = dict(layers="0,-1", pooling="mean,last,positions")
FINAL = 4  # the shipped tiny dLLM has 4 transformer layers: indices 0..4
DECODING = DecodingConfig(batch_size=3)


def _collect(out: Path, limit: int = 6, **kwargs) -> Path:
    return collect("tiny", "tiny-default", out, DECODING, limit=limit, requests_per_shard=3, **kwargs)


@pytest.fixture(scope="module")
def collections(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layers")
    return {"layers": _collect(root / "layers", **FULL), "default": _collect(root / "default")}


def test_layers_are_stored_under_documented_names_and_pool_the_first_round_rows(collections):
    tensors = load_file(str(collections["layers"] / "hidden.safetensors"))
    names = {f"first_round.layer{layer}.{pooling}" for layer in (0, FINAL) for pooling in ("mean", "last", "positions")}
    assert set(tensors) == {"first_round", "prompt_last"} | names  # -1 resolved to the concrete index
    n, h = tensors["first_round"].shape
    block = DECODING.block_size or 8
    for layer in (0, FINAL):
        mean, last = tensors[f"first_round.layer{layer}.mean"], tensors[f"first_round.layer{layer}.last"]
        positions = tensors[f"first_round.layer{layer}.positions"]
        assert mean.shape == last.shape == (n, h) and positions.shape == (n, block, h)
        np.testing.assert_allclose(positions.mean(axis=1), mean, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(last, positions[:, -1])
    # the final layer's mean is exactly what first_round pools; the embedding output is not
    np.testing.assert_array_equal(tensors[f"first_round.layer{FINAL}.mean"], tensors["first_round"])
    assert not np.allclose(tensors["first_round.layer0.mean"], tensors["first_round"], atol=1e-2)
    manifest = json.loads((collections["layers"] / "manifest.json").read_text())
    assert manifest["hidden_extra"] == {"layers": [0, FINAL], "pooling": ["mean", "last", "positions"],
                                        "final_layer": FINAL,
                                        "tensors": [f"first_round.layer{layer}.{pooling}" for layer in (0, FINAL)
                                                    for pooling in ("mean", "last", "positions")]}
    ds = load_traces(collections["layers"])
    assert set(ds.extra_hidden) == names
    eval_ds = ds.split("eval")
    np.testing.assert_array_equal(eval_ds.extra_hidden[f"first_round.layer{FINAL}.mean"], eval_ds.first_round)


def test_default_collection_is_unchanged_by_the_option(collections):
    tensors = load_file(str(collections["default"] / "hidden.safetensors"))
    assert set(tensors) == {"first_round", "prompt_last"}
    assert "hidden_extra" not in json.loads((collections["default"] / "manifest.json").read_text())
    layered = load_file(str(collections["layers"] / "hidden.safetensors"))
    # asking for more layers changes neither the decoding nor the default tensors
    np.testing.assert_array_equal(tensors["first_round"], layered["first_round"])
    np.testing.assert_array_equal(tensors["prompt_last"], layered["prompt_last"])
    a, b = load_traces(collections["default"]).requests, load_traces(collections["layers"]).requests
    assert a["total_rounds"].tolist() == b["total_rounds"].tolist()


def test_write_traces_round_trips_the_extra_tensors(collections, tmp_path):
    ds = load_traces(collections["layers"])
    again = load_traces(write_traces(ds.subset(np.arange(len(ds)) % 2 == 0), tmp_path / "copy"))
    assert set(again.extra_hidden) == set(ds.extra_hidden)
    for name, values in ds.extra_hidden.items():
        np.testing.assert_array_equal(again.extra_hidden[name], values[::2])


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_resume_with_another_spec_is_refused_and_keeps_the_files(collections, tmp_path):
    import shutil

    out = shutil.copytree(collections["layers"], tmp_path / "c")
    before = _snapshot(out)
    for other in (dict(layers="1,-1", pooling="mean,last,positions"), dict(layers="0,-1", pooling="mean"), {}):
        with pytest.raises(StoreError) as err:
            _collect(out, limit=9, **other)
        assert "\n" not in str(err.value) and "`layers`" in str(err.value), str(err.value)
    assert _snapshot(out) == before
    assert load_traces(_collect(out, limit=6, layers="-1,0,4", pooling="positions,last,mean")).path == out  # same spec


def test_shards_carry_the_tensors_through_merge_and_mixed_specs_are_refused(collections, tmp_path):
    parts = [_collect(tmp_path / f"p{i}", shard=f"{i}/2", **FULL) for i in range(2)]
    merged = load_traces(merge(parts, tmp_path / "merged"))
    whole = load_traces(collections["layers"])
    assert merged.requests["request_id"].tolist() == whole.requests["request_id"].tolist()
    for name, values in whole.extra_hidden.items():
        np.testing.assert_array_equal(merged.extra_hidden[name], values)
    assert json.loads((tmp_path / "merged" / "manifest.json").read_text())["hidden_extra"]["layers"] == [0, FINAL]
    plain = _collect(tmp_path / "plain", shard="1/2")
    with pytest.raises(StoreError, match="`layers`"):
        merge([parts[0], plain], tmp_path / "mixed")
    assert not (tmp_path / "mixed" / "requests.parquet").exists()


def test_layer_indices_are_checked_against_the_model(tmp_path):
    with pytest.raises(ConfigError, match=r"`layers` 99,-6: out of range; .* 0\.\.4"):
        _collect(tmp_path / "o", layers="99,-6,-5")
    with pytest.raises(ConfigError, match="`pooling`"):
        _collect(tmp_path / "o", layers="0", pooling="max")
    with pytest.raises(ConfigError, match="`pooling` needs `layers`"):
        _collect(tmp_path / "o", pooling="mean")


def test_block_loop_backend_keeps_every_layer(tmp_path):
    model = make_masked_llama_dir(tmp_path / "llama")
    out = collect(str(model), "tiny-default", tmp_path / "t", DecodingConfig(batch_size=2, budget=8), limit=3,
                  layers="0,1,-1", pooling="mean,last")
    ds = load_traces(out)
    assert ds.manifest["hidden_extra"]["layers"] == [0, 1, 2]
    np.testing.assert_array_equal(ds.extra_hidden["first_round.layer2.mean"], ds.first_round)
    assert not np.allclose(ds.extra_hidden["first_round.layer1.mean"], ds.first_round)


# --- the ablations -----------------------------------------------------------------------------------


def _with_layers(ds, seed: int = 0):
    """``ds`` with three stored layers: layer 1 a copy of first_round (carries the signal), layer 0 and
    the final layer 2 pure noise; poolings of layer 2: mean (noise) and last (the signal again)."""
    from dwise_predict.traces import TraceDataset

    rng = np.random.default_rng(seed)
    noise = lambda: rng.normal(size=ds.first_round.shape).astype(np.float32)  # noqa: E731
    extra = {"first_round.layer0.mean": noise(), "first_round.layer1.mean": ds.first_round.copy(),
             "first_round.layer2.mean": noise(), "first_round.layer2.last": ds.first_round.copy()}
    manifest = dict(ds.manifest, hidden_extra={"layers": [0, 1, 2], "pooling": ["mean", "last"], "final_layer": 2})
    return TraceDataset(ds.requests, ds.first_round, ds.prompt_last, manifest, None, extra)


def test_ablation_ranks_the_informative_layer_and_pooling_first():
    from dwise_predict.evaluation.ablate import ablate
    from evaluate_helpers import fast_config, make_traces

    ds = _with_layers(make_traces(n_requests=320))
    train, eval_ds = ds.split("train"), ds.split("eval")
    layers = ablate("layers", train, eval_ds, fast_config(), n_boot=50, jobs=1)
    by_name = {r["name"]: r for r in layers["rows"]}
    assert list(by_name) == ["first_round (default)", "layer 0, mean", "layer 1, mean", "layer 2, mean"]
    assert by_name["layer 1, mean"]["within_category_mean"] > 0.5
    for noise in ("layer 0, mean", "layer 2, mean"):
        assert by_name[noise]["within_category_mean"] < 0.3
        assert by_name[noise]["delta_vs_reference"]["within_category_ci"][1] < 0  # worse, outside the noise
    assert by_name["layer 1, mean"]["held_out_mean"] > by_name["layer 0, mean"]["held_out_mean"] + 0.3
    assert by_name["layer 1, mean"]["spearman"] == by_name["first_round (default)"]["spearman"]  # same input
    assert layers["verdict"]["best"] in ("first_round (default)", "layer 1, mean")
    # `evaluate --min-requests` reaches the held-out columns: above every category's count, none is held out
    strict = ablate("layers", train, eval_ds, fast_config(), n_boot=10, min_requests=len(eval_ds) + 1, jobs=1)
    assert all(r["held_out"] == {} and r["held_out_mean"] is None for r in strict["rows"])
    assert set(by_name["layer 1, mean"]["held_out"]) == set(eval_ds.requests["category"].astype(str))

    pooling = ablate("pooling", train, eval_ds, fast_config(), n_boot=50, jobs=1)
    rows = {r["name"]: r for r in pooling["rows"]}
    assert list(rows) == ["first_round (default)", "layer 2, mean", "layer 2, last"]
    assert rows["layer 2, last"]["within_category_mean"] > rows["layer 2, mean"]["within_category_mean"] + 0.3


def test_ablation_without_the_tensors_says_to_recollect():
    from dwise_predict.evaluation.ablate import ablate
    from evaluate_helpers import fast_config, make_traces

    ds = make_traces(n_requests=120)
    for kind in ("layers", "pooling"):
        with pytest.raises(InputError, match="collect --layers") as err:
            ablate(kind, ds.split("train"), ds.split("eval"), fast_config(), n_boot=10)
        assert "\n" not in str(err.value)
