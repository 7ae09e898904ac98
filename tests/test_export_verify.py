"""verify: hashes first, then every artifact in a fresh process; tampering is refused, naming the file."""

import json
import pytest
from export_helpers import make_run

from dwise_predict.cli import main
from dwise_predict.errors import BundleError
from dwise_predict.exports.bundle import export_bundle
from dwise_predict.exports.manifest import read_bundle_manifest, seal_manifest, write_bundle_manifest
from dwise_predict.exports.verify import verify_bundle
from dwise_predict.serving.bundle import load_bundle

FILES = ["README.md", "admission.onnx", "admission.txt", "bundle.json", "calibration.json", "probes.safetensors",
         "refine.int8.onnx", "refine.onnx", "refine.pt", "refine.pt2", "refine.safetensors"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("run") / "run")
    return export_bundle(run, tmp_path_factory.mktemp("b") / "bundle", created="2026-01-01T00:00:00+00:00")


@pytest.fixture(scope="module")
def report(bundle):
    return verify_bundle(bundle)


def test_intact_bundle_passes_every_check(bundle, report):
    assert report.ok, report.failures()
    checks = {(r["artifact"], r["check"]) for r in report.rows}
    for expected in [
        ("refine.pt", "TorchScript vs eager"),
        ("refine.pt2", "torch.export vs eager"),
        ("refine.onnx", "onnxruntime vs eager"),
        ("admission.onnx", "onnxruntime vs LightGBM"),
        ("admission.txt", "LightGBM vs probes"),
        ("refine.safetensors", "rebuilt eager module vs probes"),
    ]:
        assert expected in checks
    hashed = {r["artifact"] for r in report.rows if r["check"] == "sha256 and size"}
    assert hashed == {p.name for p in bundle.iterdir()} - {"bundle.json"}
    assert hashed >= set(FILES) - {"bundle.json", "refine.int8.onnx"}
    for row in report.rows:
        if row["detail"].startswith("max rel err") and row["artifact"] != "admission.txt":
            error = float(row["detail"].split("max rel err ")[1].split(",")[0])
            assert error <= 1e-4 and "ranking identical" in row["detail"]


def test_worker_process_never_imports_the_training_stack(report):
    modules = set(report.modules)
    assert "onnxruntime" in modules and "torch" in modules  # it did load the artifacts
    for name in ("lightgbm", "sklearn", "pandas", "dwise_predict.training", "dwise_predict.admission"):
        assert name not in modules


def test_verify_cli_prints_table_and_exits_zero(bundle, capsys):
    assert main(["verify", str(bundle), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and len(out["rows"]) >= 15


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipping_any_byte_is_refused_by_verify_and_load(bundle, name, where, capsys):
    path = bundle / name
    if not path.exists():
        pytest.skip(f"{name} not kept in this bundle")
    original = path.read_bytes()
    offset = {"first": 0, "middle": len(original) // 2, "last": len(original) - 1}[where]
    path.write_bytes(original[:offset] + bytes([original[offset] ^ 0x01]) + original[offset + 1:])
    try:
        # verify: either the manifest itself is refused, or the file's row fails and the exit code is 1
        code = main(["verify", str(bundle)])
        captured = capsys.readouterr()
        assert code == 1
        assert name in (captured.err if name == "bundle.json" else captured.out)
        if name != "bundle.json":
            failed = [r for r in verify_bundle(bundle).failures() if r["check"] == "sha256 and size"]
            assert [r["artifact"] for r in failed] == [name]
        # the serving loader refuses too, naming the file
        with pytest.raises(BundleError, match=name.replace(".", r"\.")):
            load_bundle(bundle)
    finally:
        path.write_bytes(original)


def test_unlisted_file_fails_verify(bundle):
    extra = bundle / "payload.pkl"
    extra.write_bytes(b"x")
    try:
        failed = verify_bundle(bundle).failures()
        assert [r["artifact"] for r in failed][:1] == ["payload.pkl"]
    finally:
        extra.unlink()


def test_newer_schema_version_is_refused_in_one_line(bundle, tmp_path, capsys):
    import shutil

    newer = tmp_path / "newer"
    shutil.copytree(bundle, newer)
    manifest = read_bundle_manifest(newer)
    manifest["schema_version"] = 99
    write_bundle_manifest(newer, manifest)  # correctly sealed: only the version is wrong
    assert main(["verify", str(newer)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "schema 99" in err and "upgrade dwise-predict" in err


def test_edited_manifest_without_new_seal_is_refused(bundle, tmp_path):
    import shutil

    from dwise_predict.exports.manifest import canonical_json

    forged = tmp_path / "forged"
    shutil.copytree(bundle, forged)
    manifest = read_bundle_manifest(forged)
    assert (forged / "bundle.json").read_bytes() == seal_manifest(manifest)
    manifest["metrics"]["refined"]["spearman"] = 0.99  # a better-looking metric, old seal kept
    (forged / "bundle.json").write_bytes(canonical_json(manifest))
    with pytest.raises(BundleError, match="bundle.json does not match its manifest_sha256"):
        read_bundle_manifest(forged)


def test_a_tampered_torchscript_is_never_deserialised(bundle):
    """The hash check comes first: a flipped byte in refine.pt stops verify before any load."""
    path = bundle / "refine.pt"
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    try:
        rows = verify_bundle(bundle).rows
        assert rows[-1]["artifact"] == "(all)" and "skipped" in rows[-1]["detail"]
        assert not any(r["check"] == "TorchScript vs eager" for r in rows)
    finally:
        path.write_bytes(original)


def test_loader_refuses_a_bundle_for_another_model(bundle):
    manifest = read_bundle_manifest(bundle)
    hidden = manifest["inputs"]["refine"]["hidden_size"]
    with pytest.raises(BundleError, match="hidden_size"):
        load_bundle(bundle, expect_model={"hidden_size": hidden + 1})
    with pytest.raises(BundleError, match="config_hash"):
        load_bundle(bundle, expect_model={"config_hash": "another-model"})
    loaded = load_bundle(bundle, expect_model={"hidden_size": hidden, "config_hash": manifest["model"]["config_hash"]})
    assert loaded.hidden_size == hidden
