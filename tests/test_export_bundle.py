"""export: a run directory becomes a bundle with the contract-2 files, signature and manifest."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from export_helpers import HIDDEN, make_run

from dwise_predict.names import EARLY_SIGNALS, LENGTH_SCALE
from dwise_predict.cli import main
from dwise_predict.errors import BundleError, InputError, StoreError
from dwise_predict.exports.bundle import export_bundle
from dwise_predict.bundles.manifest import BUNDLE_SCHEMA_VERSION, read_bundle_manifest, sha256_file
from dwise_predict.exports.refine_export import FusedRefineGraph
from dwise_predict.survival.network import HazardMLP, build_refine_graph, refine_state

CREATED = "2026-01-01T00:00:00+00:00"
FILES = {"README.md", "admission.onnx", "admission.txt", "calibration.json", "probes.safetensors", "refine.onnx",
         "refine.pt", "refine.pt2", "refine.safetensors"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run") / "tiny-run")


@pytest.fixture(scope="module")
def bundle(run, tmp_path_factory):
    return export_bundle(run, tmp_path_factory.mktemp("b") / "bundle", created=CREATED)


def test_bundle_holds_every_file_with_its_hash(bundle):
    manifest = read_bundle_manifest(bundle)
    int8 = manifest.int8
    assert int8["kept"] == (int8["probe_spearman"] >= int8["min_spearman"] == 0.999)
    expected = FILES | ({"refine.int8.onnx"} if int8["kept"] else set())
    assert set(manifest.files) == expected == set(manifest.artifacts)
    assert {p.name for p in bundle.iterdir()} == expected | {"bundle.json"}
    for name, entry in manifest.files.items():
        assert entry["sha256"] == sha256_file(bundle / name)
        assert entry["bytes"] == (bundle / name).stat().st_size > 0
    assert not list(bundle.parent.glob(".bundle.*")), "temporary directory left behind"


def test_int8_weights_use_seven_bits_so_every_cpu_computes_them_exactly(bundle, tmp_path):
    # onnxruntime's u8 x s8 kernel without VNNI adds pairs of products in 16 bits: 255 * 64 * 2 fits,
    # 255 * 127 * 2 does not; with 7-bit weights the int8 graph ranks the same on every x86 CPU, and this
    # hand-built bundle's keeps its place (kept on a 2-core AVX2 machine, where full-range weights gave 0.989)
    import onnx
    from onnx import numpy_helper

    from dwise_predict.exports.refine_export import quantize_int8

    quantize_int8(bundle / "refine.onnx", tmp_path / "int8.onnx")
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "int8.onnx")).graph.initializer
               if t.data_type == onnx.TensorProto.INT8]
    assert sum(w.size for w in weights) >= 3 * 256 * (2 * HIDDEN + 2 + len(EARLY_SIGNALS))  # the members' first layers
    largest = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert 60 <= largest <= 64  # symmetric 7-bit range [-64, 64], used and not exceeded
    assert read_bundle_manifest(bundle).int8["kept"]


def test_manifest_shape_follows_contract(bundle, run):
    m = read_bundle_manifest(bundle).raw  # bundle.json's keys, as contract 2 (docs/bundles.md) names them
    spec = json.loads((run / "refine.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert m["schema_version"] == BUNDLE_SCHEMA_VERSION and m["name"] == "tiny-run" and m["created"] == CREATED
    assert m["model"] == config["traces"]["model"] and m["decoding"] == config["traces"]["decoding"]
    assert m["inputs"]["admission"] == {"features": ["words", "newlines", "prompt_tokens"], "dtype": "float32",
                                        "shape": ["B", 3], "output": {"total_rounds": ["B"]}}
    refine = m["inputs"]["refine"]
    for key in ("hidden_size", "in_features", "num_rounds", "width", "dropout", "members", "seeds", "prompt_norm",
                "budget_norm", "length_scale"):
        assert refine[key] == spec[key]
    assert refine["tensors"] == {"first_round": ["B", HIDDEN], "prompt_last": ["B", HIDDEN], "prompt_tokens": ["B"],
                                 "budget": ["B"], "early_signals": ["B", len(EARLY_SIGNALS)]}
    assert refine["hidden_states"] == ["first_round", "prompt_last"]
    assert refine["early_signal_columns"] == ["frac_over_threshold", "mean_confidence", "mean_entropy",
                                            "end_probability"]
    assert refine["output"] == {"remaining_rounds": ["B"]}
    assert m["K"] == spec["num_rounds"]
    assert m["metrics"] == json.loads((run / "metrics.json").read_text())
    assert m["training_data"] == {"fingerprint": config["traces"]["fingerprint"], "path": "synthetic"}
    assert m["recipe"] == {"seed": 0} == read_bundle_manifest(bundle).recipe  # config.json's options (make_run: the seed)
    assert m["probes"] == "probes.safetensors"
    assert m["artifacts"]["refine.pt"]["pickle"] and not m["artifacts"]["refine.onnx"]["pickle"]
    assert m["versions"]["export"]["onnxruntime"] == ort.__version__
    # the weights and calibration are the run's, byte for byte
    for name in ("refine.safetensors", "calibration.json", "admission.txt"):
        assert (bundle / name).read_bytes() == (run / name).read_bytes()


def test_the_typed_manifest_reads_what_bundle_json_holds(bundle, run):
    """Readers use BundleManifest's attributes; they are bundle.json's values, and the keys a server
    compares (names.MODEL_KEYS, BUNDLE_DECODING_KEYS) are attributes of its model and decoding."""
    from dwise_predict.names import BUNDLE_DECODING_KEYS, MODEL_KEYS

    m = read_bundle_manifest(bundle)
    config = json.loads((run / "config.json").read_text())
    assert (m.schema_version, m.name, m.created, m.hidden_size, m.K) == (BUNDLE_SCHEMA_VERSION, "tiny-run", CREATED,
                                                                         HIDDEN, m.raw["inputs"]["refine"]["num_rounds"])
    assert m.refine is m.raw["inputs"]["refine"] and m.files is m.raw["files"] and m.probes == "probes.safetensors"
    assert m.identity.model.fields == config["traces"]["model"] and m.identity.hidden_size == HIDDEN
    assert m.identity.decoding.fields == config["traces"]["decoding"]
    for section, keys in ((m.identity.model, MODEL_KEYS), (m.identity.decoding, BUNDLE_DECODING_KEYS)):
        assert {key: getattr(section, key) for key in keys} == {key: section.fields.get(key) for key in keys}
    assert m.identity.decoding.block_size == config["traces"]["decoding"]["block_size"] > 0


def test_onnx_signatures_have_dynamic_batch_and_contract_names(bundle):
    refine = ort.InferenceSession(str(bundle / "refine.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape, i.type) for i in refine.get_inputs()] == [
        ("first_round", ["B", HIDDEN], "tensor(float)"),
        ("prompt_last", ["B", HIDDEN], "tensor(float)"),
        ("prompt_tokens", ["B"], "tensor(float)"),
        ("budget", ["B"], "tensor(float)"),
        ("early_signals", ["B", len(EARLY_SIGNALS)], "tensor(float)"),
    ]
    assert [(o.name, o.shape, o.type) for o in refine.get_outputs()] == [("remaining_rounds", ["B"], "tensor(float)")]
    admission = ort.InferenceSession(str(bundle / "admission.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in admission.get_inputs()] == [("features", ["B", 3])]
    assert [(o.name, o.shape, o.type) for o in admission.get_outputs()] == [("total_rounds", ["B"], "tensor(float)")]
    import onnx

    opset = {o.domain: o.version for o in onnx.load(str(bundle / "refine.onnx")).opset_import}
    assert opset[""] >= 17


def test_admission_onnx_matches_lightgbm_in_rounds_not_log_space(bundle):
    import lightgbm

    booster = lightgbm.Booster(model_file=str(bundle / "admission.txt"))
    x = np.array([[10, 0, 14], [70, 3, 100], [300, 40, 900], [1, 0, 4]], dtype=np.float32)
    session = ort.InferenceSession(str(bundle / "admission.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"features": x})[0]
    expected = np.expm1(booster.predict(x.astype(np.float64)))
    assert got.shape == (4,) and expected.min() > 1.0  # total rounds, not log1p
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("short_width, one_logit", [(0, False), (5, False), (5, True)])
def test_fused_graph_equals_member_by_member_graph(short_width, one_logit):
    """``one_logit``: every round shares its hazard logit, as in the closed-form candidates; the fused
    graph then computes one column of the second layer and broadcasts it."""
    torch.manual_seed(3)
    members = [HazardMLP(13, 9, width=16, dropout=0.0, short_features=5, short_width=short_width).eval()
               for _ in range(3)]
    if one_logit:
        with torch.no_grad():
            for m in members:
                m.fc2.weight.copy_(m.fc2.weight[:1].expand_as(m.fc2.weight))
                m.fc2.bias.fill_(float(m.fc2.bias[0]))
    spec = dict(in_features=13, num_rounds=9, width=16, members=3, prompt_norm=50.0, budget_norm=64.0,
                length_scale=LENGTH_SCALE, hidden_states=["first_round", "prompt_last"], short_features=5,
                short_width=short_width)
    graph = build_refine_graph(refine_state(members, torch.randn(13), torch.rand(13) + 0.5), spec,
                               {"x": [0.5, 2.0, 4.0, 8.0], "y": [0.0, 1.0, 3.0, 9.0]})
    fused = FusedRefineGraph(graph)
    x = (torch.randn(33, 4), torch.randn(33, 4), torch.rand(33) * 200, torch.full((33,), 64.0), torch.rand(33, 3))
    with torch.no_grad():
        torch.testing.assert_close(fused.raw(*x), graph.raw(*x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused(*x), graph(*x), rtol=1e-6, atol=1e-6)
    assert fused.w1.shape == (48, 13) and fused.w2.shape == (3, 16 + short_width, 1 if one_logit else 9)
    assert fused.w1_short.shape == (3 * short_width, 5)


def test_model_card_has_hugging_face_front_matter(bundle):
    card = (bundle / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: onnx" in front and 'base_model: "synthetic"' in front
    assert "- spearmanr" in front and "model-index:" in front
    m = read_bundle_manifest(bundle)
    assert f"{m.metrics['refined']['spearman']}" in front
    assert "pickle" in body and "refine.onnx" in body and "dwise-predict verify" in body


def test_same_run_and_created_time_give_identical_bytes(run, bundle, tmp_path):
    again = export_bundle(run, tmp_path / "again", created=CREATED, name="tiny-run")
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in bundle.iterdir())
    for path in bundle.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_existing_out_is_refused_and_kept(run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in (False, True):  # a folder that is not a bundle is never replaced, not even with --force
        with pytest.raises(StoreError, match="is not a bundle.*never replaced"):
            export_bundle(run, out, force=force)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("missing", ["calibration.json", "refine.safetensors", "metrics.json", "admission.txt"])
def test_incomplete_run_is_refused_in_one_line_and_nothing_written(run, tmp_path, missing, capsys):
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(run, broken)
    (broken / missing).unlink()
    assert main(["export", str(broken), "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and missing in err
    if missing == "calibration.json":
        assert "uncalibrated" in err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


def test_failed_export_leaves_nothing(run, tmp_path, monkeypatch):
    import dwise_predict.exports.bundle as bundle_module

    def boom(*args, **kwargs):
        raise BundleError("ONNX export of the refinement graph failed: simulated")

    monkeypatch.setattr(bundle_module, "export_onnx", boom)
    with pytest.raises(BundleError, match="simulated"):
        export_bundle(run, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_run_with_other_hidden_size_is_refused(run, tmp_path):
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(run, broken)
    spec = json.loads((broken / "refine.json").read_text())
    spec["hidden_size"] = HIDDEN + 1
    (broken / "refine.json").write_text(json.dumps(spec))
    with pytest.raises(InputError, match="hidden size"):
        export_bundle(broken, tmp_path / "b")
