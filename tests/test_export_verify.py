"""verify: hashes first, then every artifact in a process of its own; tampering is refused, naming the file."""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from export_helpers import make_run
from safetensors.numpy import load_file

from dwise_predict.cli import main
from dwise_predict.errors import BundleError
from dwise_predict.exports.bundle import export_bundle
from dwise_predict.bundles.manifest import read_bundle_manifest, seal_manifest, write_bundle_manifest
from dwise_predict.exports.probe_worker import RAW_PROBE, calibrated_band, relative_error
from dwise_predict.exports.verify import verify_bundle
from dwise_predict.bundles.load import load_bundle

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
            inside = "every row within 0.0001" if row["artifact"] == "admission.onnx" else "every row inside its band"
            assert error <= 1e-4 and inside in row["detail"]


def test_worker_process_never_imports_the_training_stack(report):
    modules = set(report.modules)
    assert "onnxruntime" in modules and "torch" in modules  # it did load the artifacts
    for name in ("lightgbm", "sklearn", "pandas", "dwise_predict.training", "dwise_predict.admission"):
        assert name not in modules


def test_verify_cli_prints_table_and_exits_zero(bundle, report, capsys, monkeypatch):
    """The command prints what verify_bundle found (the fixture's run of the worker: one fresh
    process is enough; the flipped-byte tests below and test_train_select run the command whole)."""
    from dwise_predict.exports import verify

    monkeypatch.setattr(verify, "verify_bundle", lambda path: report if path == bundle else None)
    assert main(["verify", str(bundle), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and len(out["rows"]) >= 15 and out["rows"] == report.rows
    assert main(["verify", str(bundle)]) == 0
    table = capsys.readouterr().out
    assert all(row["artifact"] in table for row in report.rows)


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


def test_unlisted_file_fails_verify(bundle, tmp_path):
    """A planted name is refused outright, before any file is read (tests/test_hostile_bundles.py);
    a bundle artifact that the manifest does not list fails its row."""
    extra = bundle / "payload.pkl"
    extra.write_bytes(b"x")
    try:
        with pytest.raises(BundleError, match=r"does not list \(payload\.pkl\)"):
            verify_bundle(bundle)
    finally:
        extra.unlink()
    unlisted = tmp_path / "unlisted"
    shutil.copytree(bundle, unlisted)
    manifest = read_bundle_manifest(unlisted).raw
    for key in ("files", "artifacts"):
        del manifest[key]["refine.pt2"]
    write_bundle_manifest(unlisted, manifest)
    failed = verify_bundle(unlisted).failures()
    assert [(r["artifact"], r["check"]) for r in failed][:1] == [("refine.pt2", "listed in bundle.json")]


def test_newer_schema_version_is_refused_in_one_line(bundle, tmp_path, capsys):
    import shutil

    newer = tmp_path / "newer"
    shutil.copytree(bundle, newer)
    manifest = read_bundle_manifest(newer).raw
    manifest["schema_version"] = 99
    write_bundle_manifest(newer, manifest)  # correctly sealed: only the version is wrong
    assert main(["verify", str(newer)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "schema 99" in err and "upgrade dwise-predict" in err


def test_edited_manifest_without_new_seal_is_refused(bundle, tmp_path):
    import shutil

    from dwise_predict.bundles.manifest import canonical_json

    forged = tmp_path / "forged"
    shutil.copytree(bundle, forged)
    manifest = read_bundle_manifest(forged).raw
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
    hidden = manifest.hidden_size
    assert hidden == manifest.raw["inputs"]["refine"]["hidden_size"] == 32
    with pytest.raises(BundleError, match="hidden_size"):
        load_bundle(bundle, expect_model={"hidden_size": hidden + 1})
    with pytest.raises(BundleError, match="config_hash"):
        load_bundle(bundle, expect_model={"config_hash": "another-model"})
    loaded = load_bundle(bundle, expect_model={"hidden_size": hidden, "config_hash": manifest.identity.model.config_hash})
    assert loaded.hidden_size == hidden


def test_band_allows_for_the_calibration_slope_and_nothing_more():
    """Row 0 sits on a knot pair 0.02 apart mapping 41 -> 43 (slope 100), row 1 on a slope below 1."""
    calibration = {"x": [0.0, 10.0, 10.02, 50.0], "y": [0.0, 41.0, 43.0, 80.0]}
    raw = np.array([10.01, 30.0])

    def calibrate(r):
        return np.interp(r, calibration["x"], calibration["y"])

    expected = calibrate(raw)
    lo, hi = calibrated_band(expected, raw, calibration)
    # a raw estimate 5e-5 off moves row 0's output by 1.2e-3 relative: inside the band, which says
    # what the calibration makes of raw estimates within 1e-4
    nudged = calibrate(raw * (1 + 5e-5))
    assert relative_error(expected[:1], nudged[:1]) > 1e-3
    assert ((nudged >= lo) & (nudged <= hi)).all()
    # 1e-3 off in the raw estimate is outside on both slopes
    off = calibrate(raw * (1 + 1e-3))
    assert not ((off >= lo) & (off <= hi)).any()
    # without the raw estimate (bundles exported before it was probed): the output's own 1e-4
    lo_plain, hi_plain = calibrated_band(expected, None, None)
    np.testing.assert_allclose(hi_plain - expected, 1e-4 * expected)
    assert not (nudged[0] <= hi_plain[0])


@pytest.fixture(scope="module")
def steep_bundle(bundle, tmp_path_factory):
    """A bundle whose calibration is a steep line through the probes' raw estimates: out = 1 + slope *
    (raw - just below the smallest), so a float32 rounding of 1e-7 in the raw estimate moves the
    smallest outputs by 1e-4 relative and more."""
    raw = np.sort(load_file(str(bundle / "probes.safetensors"))[RAW_PROBE].astype(np.float64))
    run = make_run(tmp_path_factory.mktemp("steep") / "run")
    calibration = json.loads((run / "calibration.json").read_text())
    low, high = raw[0] * (1 - 1e-6), raw[-1] * (1 + 1e-3)
    slope = 2000.0 / (high - low)
    top = float(read_bundle_manifest(bundle).K)
    calibration["x"] = [0.0, low, high, max(top, high + 1.0)]
    calibration["y"] = [0.0, 1.0, 1.0 + slope * (high - low), 1.0 + slope * (high - low) + 1.0]
    (run / "calibration.json").write_text(json.dumps(calibration))
    return export_bundle(run, tmp_path_factory.mktemp("steep_b") / "bundle", created="2026-01-01T00:00:00+00:00")


def test_steep_calibration_passes_verify(steep_bundle):
    """Measured on the 2-core build machine: onnxruntime's outputs differ from eager by 5e-4 relative
    here (the raw estimates by < 1e-6), which the output's own 1e-4 would have failed."""
    report = verify_bundle(steep_bundle)
    assert report.ok, report.failures()
    probes = load_file(str(steep_bundle / "probes.safetensors"))
    calibration = json.loads((steep_bundle / "calibration.json").read_text())
    band = calibrated_band(probes["refine.remaining_rounds"], probes[RAW_PROBE], calibration)
    plain = calibrated_band(probes["refine.remaining_rounds"], None, None)
    # the band is wider than the output's own 1e-4 by the slope (up to ~2,000 x raw / output here)
    assert ((band[1] - band[0]) / (plain[1] - plain[0])).max() > 100


def test_an_exporter_bug_fails_even_under_a_steep_calibration(steep_bundle, tmp_path):
    """refine.onnx rebuilt with its knots shifted by 3e-4 (as a raw estimate off by that much): the
    band is the calibration of raw estimates within 1e-4, so the file fails, named, and re-sealing
    the manifest does not help."""
    import torch
    from safetensors.torch import load_file as load_tensors

    from dwise_predict.exports.refine_export import FusedRefineGraph, export_onnx
    from dwise_predict.files import sha256_file
    from dwise_predict.survival.network import build_refine_graph

    broken = tmp_path / "broken"
    shutil.copytree(steep_bundle, broken)
    manifest = read_bundle_manifest(broken)
    calibration = json.loads((broken / "calibration.json").read_text())
    graph = build_refine_graph(load_tensors(str(broken / "refine.safetensors")), manifest.refine, calibration)
    fused = FusedRefineGraph(graph).eval()
    with torch.no_grad():
        fused.calib_x.mul_(1 + 3e-4)
    export_onnx(fused, manifest.hidden_size, broken / "refine.onnx")
    path = broken / "refine.onnx"
    manifest.raw["files"]["refine.onnx"] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    write_bundle_manifest(broken, manifest.raw)
    failed = verify_bundle(broken).failures()
    assert [r["artifact"] for r in failed] == ["refine.onnx"]
    assert "OUTSIDE their band" in failed[0]["detail"]


def test_a_bundle_without_the_raw_probe_is_held_to_the_output_alone(bundle, tmp_path):
    """Bundles exported before the raw estimate was probed still verify, against 1e-4 of the output."""
    from safetensors.numpy import save

    from dwise_predict.files import sha256_file

    older = tmp_path / "older"
    shutil.copytree(bundle, older)
    path = older / "probes.safetensors"
    probes = {k: v for k, v in load_file(str(path)).items() if k != RAW_PROBE}
    path.write_bytes(save(probes))
    manifest = read_bundle_manifest(older).raw
    manifest["files"]["probes.safetensors"] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    write_bundle_manifest(older, manifest)
    report = verify_bundle(older)
    assert report.ok, report.failures()
    assert RAW_PROBE in load_file(str(bundle / "probes.safetensors"))  # what export writes today


# --- the probe server: one per process, each bundle in a child of its own ---------------------------

def _server_pid() -> int:
    from dwise_predict.exports.verify import _ProbeServer

    return _ProbeServer.running.process.pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_later_verifications_fork_from_one_server_and_each_loads_in_a_child_of_its_own(bundle, report):
    """The fixture's verification started the server; the next ones use it, each answered by a new
    child (never by the server, which loads no bundle), and each answer equals the first."""
    from dwise_predict.exports.verify import _probe

    server = _server_pid()
    answers = [json.loads(_probe(bundle.resolve(), 300)[1]) for _ in range(2)]
    assert _server_pid() == server
    assert len({answer["pid"] for answer in answers} | {server}) == 3
    assert answers[0]["rows"] == answers[1]["rows"] == report.rows[-len(answers[0]["rows"]):]
    again = verify_bundle(bundle)
    assert again.rows == report.rows and again.ok
    assert "torch" in again.modules and "lightgbm" not in again.modules
    assert _children(server) == []  # the child that answered has exited; nothing is left under the server


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_server_has_one_thread_so_its_children_inherit_no_held_lock(bundle, report):
    """A fork copies only the calling thread: a lock another thread held at that instant stays held in
    the child forever. verify's server imports no thread pool (numpy's OpenBLAS is told so by its
    environment; onnxruntime is imported in the child)."""
    verify_bundle(bundle)
    assert len(os.listdir(f"/proc/{_server_pid()}/task")) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_with_threads_answers_with_a_fresh_run_instead_of_a_fork(bundle, report, tmp_path):
    """Started without SERVER_ENV (by hand, say), the server has OpenBLAS's thread and must not fork:
    it answers each request with a fresh run, which gives the same rows."""
    import subprocess
    import time

    from dwise_predict.exports.probe_worker import SERVER_ENV
    from dwise_predict.exports.verify import WORKER

    env = {**{k: v for k, v in os.environ.items() if k not in SERVER_ENV}, "OMP_NUM_THREADS": "2"}  # OpenBLAS reads both
    server = subprocess.Popen([*WORKER, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        out, err = tmp_path / "out", tmp_path / "err"
        server.stdin.write(json.dumps([str(bundle.resolve()), str(out), str(err)]) + "\n")
        server.stdin.flush()
        assert server.stdout.readline() == "0\n", err.read_text()
        assert len(os.listdir(f"/proc/{server.pid}/task")) > 1  # OpenBLAS's second thread, started at numpy's import
        answer = json.loads(out.read_text())
        assert answer["rows"] == report.rows[-len(answer["rows"]):]
    finally:
        server.stdin.close()
        assert server.wait(timeout=60) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe server forks")
def test_a_silent_or_dead_server_is_one_failed_row_and_the_next_verification_starts_another(bundle, report,
                                                                                             monkeypatch):
    """A server that does not answer in time is killed with its child (one failed row naming the
    time); one that dies says how, in one row; the next verification starts another and passes."""
    from dwise_predict.exports import verify
    from dwise_predict.exports.verify import _ProbeServer

    server = _server_pid()
    silent = verify_bundle(bundle, timeout_s=0.001)  # no child loads a bundle in 1 ms
    assert [(r["artifact"], r["detail"]) for r in silent.failures()] == [("(fresh process)", "no answer within 0 s")]
    assert _gone(server) and _ProbeServer.running is None  # killed, with its session
    # a server that dies (here at once, without the imports a real one takes seconds for)
    monkeypatch.setattr(verify, "WORKER", [sys.executable, "-c", "import sys; sys.exit('out of memory, say')"])
    died = verify_bundle(bundle)
    assert [(r["artifact"], r["detail"]) for r in died.failures()] == [("(fresh process)", "exit 1: out of memory, say")]
    assert _ProbeServer.running is None
    monkeypatch.undo()
    assert verify_bundle(bundle).rows == report.rows and _server_pid() != server


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe server forks")
def test_a_forked_child_does_not_use_or_stop_its_parents_server(bundle, report):
    import signal
    import time

    from dwise_predict.exports.verify import _ProbeServer

    server = _server_pid()
    pid = os.fork()
    if pid == 0:  # in the child of a process with threads: nothing but an attribute read, then out
        os._exit(0 if _ProbeServer.running is None else 1)
    deadline = time.monotonic() + 60
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    if not done[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    assert not _gone(server) and verify_bundle(bundle).rows == report.rows and _server_pid() == server
