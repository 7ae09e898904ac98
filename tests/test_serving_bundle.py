"""Serving-side bundle loader: parity of backends, input forms, refusals, and a lean import."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from dwise_predict.errors import BundleError, InputError
from dwise_predict.bundles.load import load_bundle
from fakes.serving_bundle import HIDDEN, served_bundle


@pytest.fixture(scope="module")
def bundle_and_traces():
    return served_bundle()


@pytest.fixture(scope="module")
def inputs(bundle_and_traces):
    _, ds = bundle_and_traces
    r = ds.requests.iloc[:40]
    return (ds.first_round[:40], ds.prompt_last[:40], r["prompt_tokens"].to_numpy(np.float32),
            r["budget"].to_numpy(np.float32), ds.early_signals[:40], r[["words", "newlines", "prompt_tokens"]].to_numpy(np.float32),
            r["prompt"].tolist())


def test_admission_matches_the_lightgbm_text_model(bundle_and_traces, inputs):
    import lightgbm

    path, _ = bundle_and_traces
    b = load_bundle(path, expect_model={"config_hash": "synthetic-0", "hidden_size": HIDDEN},
                    expect_decoding={"algorithm_config": {}, "block_size": 8})
    features = inputs[5]
    expected = np.expm1(lightgbm.Booster(model_file=str(path / "admission.txt")).predict(features.astype(float)))
    got = b.admission(features)
    assert got.shape == (40,) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_admission_from_text_needs_token_counts(bundle_and_traces, inputs):
    b = load_bundle(bundle_and_traces[0])
    _, _, prompt_tokens, _, _, _, prompts = inputs
    prompts = [p + "\n" * (i % 3) for i, p in enumerate(prompts)]
    features = np.array([[len(p.split()), p.count("\n"), t] for p, t in zip(prompts, prompt_tokens)], np.float32)
    expected = b.admission(features)
    np.testing.assert_allclose(b.admission(prompts, prompt_tokens=prompt_tokens), expected)
    ids = iter(prompt_tokens.tolist())  # the tokenizer is called once per prompt, in order
    np.testing.assert_allclose(b.admission(prompts, tokenizer=lambda t: [0] * int(next(ids))), expected)
    counts = iter(prompt_tokens.tolist())
    np.testing.assert_allclose(b.admission(prompts, tokenizer=lambda t: int(next(counts))), expected)
    with pytest.raises(InputError, match="pass prompt_tokens"):
        b.admission(prompts)


def test_refine_backends_agree_and_pool_block_rows(bundle_and_traces, inputs):
    path, _ = bundle_and_traces
    h, last, pt, bu, sig = inputs[:5]
    onnx = load_bundle(path).refine(h, last, pt, bu, sig)
    rebuilt = load_bundle(path, backend="torch")
    eager = rebuilt.refine(h, last, pt, bu, sig)
    scripted = load_bundle(path, backend="torch", torchscript=True).refine(h, last, pt, bu, sig)
    assert onnx.shape == (40,) and (onnx >= 0).all() and np.ptp(onnx) > 0
    np.testing.assert_allclose(eager, onnx, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scripted, onnx, rtol=1e-4, atol=1e-3)
    # (B, L, H) rows are mean-pooled: rows spread symmetrically around h pool back to h
    rows = np.stack([h - 1.0, h + 1.0, h], axis=1)  # (B, 3, H)
    np.testing.assert_allclose(rebuilt.refine(rows, last, pt, bu, sig), eager, rtol=1e-5, atol=1e-4)
    last_rows = np.stack([last + 2.0, last - 2.0], axis=1)  # (B, 2, H), the same for prompt_last
    np.testing.assert_allclose(rebuilt.refine(h, last_rows, pt, bu, sig), eager, rtol=1e-5, atol=1e-4)
    assert np.abs(rebuilt.refine(h, np.zeros_like(last), pt, bu, sig) - eager).max() > 1e-3  # prompt_last is read
    # tensors in -> tensor out on the same device, no numpy round trip; scalar budget broadcasts
    out = rebuilt.refine(torch.from_numpy(h), torch.from_numpy(last), torch.from_numpy(pt), 256.0, torch.from_numpy(sig))
    assert isinstance(out, torch.Tensor) and out.shape == (40,)
    np.testing.assert_allclose(out.numpy(), eager, rtol=1e-5, atol=1e-4)


def test_refine_rejects_the_wrong_hidden_size(bundle_and_traces):
    b = load_bundle(bundle_and_traces[0])
    good = np.zeros((2, HIDDEN), np.float32)
    with pytest.raises(InputError, match=f"first_round must be .*H = {HIDDEN}.*got shape \\(2, 16\\)"):
        b.refine(np.zeros((2, 16), np.float32), good, [1, 2], [8, 8], np.zeros((2, 4), np.float32))
    with pytest.raises(InputError, match=f"prompt_last must be .*B = 2, got shape \\(3, {HIDDEN}\\)"):
        b.refine(good, np.zeros((3, HIDDEN), np.float32), [1, 2], [8, 8], np.zeros((2, 4), np.float32))
    with pytest.raises(InputError, match=r"early_signals must be \(B, 4\) = \(2, 4\), got \(2, 2\)"):
        b.refine(good, good, [1, 2], [8, 8], np.zeros((2, 2), np.float32))


@pytest.mark.parametrize(
    "expect_model,expect_decoding,field",
    [
        ({"config_hash": "llada2-abc"}, None, "model.config_hash"),
        ({"hidden_size": 4096}, None, "model.hidden_size"),
        ({"weights_sha256": "f" * 64}, None, "model.weights_sha256"),
        (None, {"algorithm": "LowConfidence"}, "decoding.algorithm"),
        (None, {"algorithm_config": {"threshold": 0.95}}, "decoding.algorithm_config"),
        (None, {"engine": "sglang==0.5.23"}, "decoding.engine"),
        (None, {"block_size": 32}, "decoding.block_size"),
    ],
)
def test_refuses_a_bundle_for_another_model_or_decoding(bundle_and_traces, expect_model, expect_decoding, field):
    with pytest.raises(BundleError, match=f"built for another .*{field}") as err:
        load_bundle(bundle_and_traces[0], expect_model=expect_model, expect_decoding=expect_decoding)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["refine.onnx", "refine.pt", "README.md"])
def test_refuses_a_tampered_file_naming_it(bundle_and_traces, tmp_path, name):
    copy = tmp_path / "b"
    shutil.copytree(bundle_and_traces[0], copy)
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{name} does not match its sha256"):
        load_bundle(copy, backend="torch", torchscript=True)


def test_refuses_a_missing_manifest_and_unknown_backend(tmp_path, bundle_and_traces):
    with pytest.raises(BundleError, match="is not a bundle"):
        load_bundle(tmp_path)
    with pytest.raises(InputError, match="backend must be one of onnx, torch"):
        load_bundle(bundle_and_traces[0], backend="tensorrt")


def test_serving_imports_without_the_training_stack(bundle_and_traces):
    code = f"""
import sys, numpy as np
import dwise_predict.serving
from dwise_predict.bundles.load import load_bundle
from dwise_predict.serving.policy import DwisePolicy
from dwise_predict.serving import sglang, launcher
b = load_bundle({str(bundle_and_traces[0])!r}, backend="torch")
b.admission(np.ones((2, 3), np.float32)); b.refine(np.zeros((2, {HIDDEN}), np.float32), np.zeros((2, {HIDDEN}), np.float32), [5, 6], [64, 64], np.zeros((2, 4), np.float32))
heavy = [m for m in ("lightgbm", "sklearn", "xgboost", "pandas", "dwise_predict.training", "dwise_predict.evaluation") if m in sys.modules]
print(",".join(heavy))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"serving imported {out.stdout.strip()}"


def test_admission_from_prompt_text_needs_only_numpy_and_onnxruntime(bundle_and_traces):
    code = f"""
import sys
from dwise_predict.bundles.load import load_bundle
b = load_bundle({str(bundle_and_traces[0])!r}, backend="onnx")
est = b.admission(["two words", "a\\nthree line\\nprompt"], tokenizer=lambda text: text.split())
assert est.shape == (2,), est.shape
heavy = [m for m in ("pandas", "torch", "lightgbm", "sklearn", "xgboost", "transformers",
                     "dwise_predict.training", "dwise_predict.evaluation", "dwise_predict.admission.model",
                     "dwise_predict.admission.compare")
         if m in sys.modules]
print(",".join(heavy))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"admission from text imported {out.stdout.strip()}"
