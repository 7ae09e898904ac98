"""Hostile bundles (issue 42, and the bundle cases of issue 43): every reading command refuses them,
in one line naming the file and the reason, and nothing planted in them runs.

One valid bundle per process (``fakes.serving_bundle``); each case copies it, plants its payload,
and reseals ``bundle.json`` exactly as the exporter does (:func:`reseal`): the attacker controls the
manifest, so its hashes match. Each case runs through every reader: ``verify``, ``publish``, ``zoo
pull`` (of a zoo whose index correctly lists the hostile tar), ``simulate --bundle``, ``serve
--dry-run`` and ``load_bundle`` (ONNX, torch, TorchScript). Payloads would create a marker file;
:func:`test_the_payloads_run_when_loaded_naively` shows that they do when the files are loaded the
way torch and pickle load them, so the markers' absence elsewhere means something.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from fakes.serving_bundle import HIDDEN, served_bundle

from dwise_predict.cli import main
from dwise_predict.errors import BundleError
from dwise_predict.bundles.manifest import BUNDLE_ARTIFACTS, write_bundle_manifest
from dwise_predict.files import sha256_file


# --- building hostile variants -------------------------------------------------------------------

def reseal(bundle: Path, listed: dict | None = None) -> None:
    """Recompute ``files`` (every entry of the directory but bundle.json, as exports/bundle.py does,
    plus ``listed``), describe each in ``artifacts``, and seal the manifest: hashes then all match."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(bundle.iterdir()) if p.name != "bundle.json" and p.is_file()}
    manifest["files"] = {**files, **(listed or {})}
    manifest["artifacts"] = {name: manifest["artifacts"].get(name, {"role": "x", "format": "x", "pickle": False})
                             for name in manifest["files"]}
    write_bundle_manifest(bundle, manifest)


def edit_manifest(bundle: Path, edit) -> None:
    manifest = json.loads((bundle / "bundle.json").read_text())
    edit(manifest)
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    reseal(bundle)


def rewrite_zip(path: Path, edit=lambda name, data: data, add: dict | None = None, deflate=lambda name: False) -> None:
    """Rewrite a zip archive member by member: ``edit(name, data)`` returns new bytes; ``add`` more;
    members for which ``deflate(name)`` holds are compressed."""
    with zipfile.ZipFile(path) as source:
        members = [(info, source.read(info.filename)) for info in source.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as target:
        for info, data in members:
            if deflate(info.filename):
                info.compress_type = zipfile.ZIP_DEFLATED
            target.writestr(info, edit(info.filename, data))
        for name, data in (add or {}).items():
            target.writestr(name, data)
    path.write_bytes(buffer.getvalue())


def system(marker: Path) -> bytes:
    """A protocol-0 pickle calling ``os.system("touch MARKER")``."""
    return f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()


def opener(marker: Path) -> bytes:
    """A protocol-0 pickle calling ``builtins.open(MARKER, "w")``: creates the marker without a shell."""
    return f"cbuiltins\nopen\n(S'{marker}'\nS'w'\ntR.".encode()


def pt2_pickled_weight(b, marker):
    """The issue's attack: the first weight marked use_pickle, its bytes a pickle calling os.system."""
    def edit(name, data):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            return json.dumps(config).encode()
        return system(marker) if name.endswith("data/weights/weight_0") else data
    rewrite_zip(b / "refine.pt2", edit)


def pt2_pickled_constant(b, marker):
    def edit(name, data):
        if name.endswith("model_constants_config.json"):
            return json.dumps({"config": {"c": {"path_name": "tensor_0", "is_param": False, "use_pickle": True,
                                                "tensor_meta": None}}}).encode()
        return data
    rewrite_zip(b / "refine.pt2", edit, add={"archive/data/constants/tensor_0": opener(marker)})


def pt2_opaque_constant(b, marker):
    """An opaque constant: torch.export.load hands its bytes to pickle.loads."""
    def edit(name, data):
        if name.endswith("model_constants_config.json"):
            return json.dumps({"config": {"c": {"path_name": "opaque_obj_0", "is_param": False,
                                                "use_pickle": False}}}).encode()
        return data
    rewrite_zip(b / "refine.pt2", edit, add={"archive/data/constants/opaque_obj_0": opener(marker)})


def pt2_sample_inputs(b, marker):
    """Sample inputs: torch.load tries weights_only=True, then falls back to weights_only=False."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + system(marker))
        z.writestr("archive/version", b"3\n")
    rewrite_zip(b / "refine.pt2", lambda name, data: inner.getvalue() if name.endswith("sample_inputs/model.pt") else data)


def _edit_program(b, edit):
    def rewrite(name, data):
        if name.endswith("models/model.json"):
            program = json.loads(data)
            edit(program)
            return json.dumps(program).encode()
        return data
    rewrite_zip(b / "refine.pt2", rewrite)


def pt2_guard_code(b, marker):
    """A guard: torch compiles the program's guards as Python and runs them on every call."""
    _edit_program(b, lambda p: p["guards_code"].append(f"__import__('os').system('touch {marker}') == 0"))


def pt2_sympy_expression(b, marker):
    """A symbolic size: torch.export.load evaluates it with sympy.sympify (eval)."""
    def edit(program):
        sizes = program["graph_module"]["graph"]["tensor_values"]["first_round"]["sizes"]
        sizes[0]["as_expr"]["expr_str"] = f"__import__('os').system('touch {marker}')"
    _edit_program(b, edit)


def pt2_file_operator(b, marker):
    """A graph node calling an operator that reads a file (aten::from_file)."""
    def edit(program):
        program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.from_file.default"
    _edit_program(b, edit)


def pt2_pytree_import(b, marker):
    """An input spec whose defaultdict names a module: torch.export.load imports it (runs its top level)."""
    context = json.dumps({"default_factory_module": "os", "default_factory_name": "system", "dict_context": []})
    spec = json.dumps([1, {"type": "collections.defaultdict", "context": context, "children_spec": []}])
    _edit_program(b, lambda p: p["graph_module"]["module_call_graph"][0]["signature"].update(in_spec=spec))


def pt2_extra_member(b, marker):
    rewrite_zip(b / "refine.pt2", add={"archive/data/aotinductor/model.so": b"\x7fELF"})


def pt_data_pkl_global(b, marker):
    """TorchScript's data.pkl with a GLOBAL to os.system (torch's C++ unpickler refuses it too)."""
    rewrite_zip(b / "refine.pt", lambda name, data: b"\x80\x02" + system(marker) if name.endswith("/data.pkl") else data)


def pt_code_writes_a_file(b, marker):
    """TorchScript code calling torch.save (aten::save): it writes a file whenever the module runs."""
    def edit(name, data):
        if name.endswith("exports/refine_export.py"):
            return data.decode().replace("    return _0(raw, calib_x, calib_y, )",
                                         f"    torch.save(raw, \"{marker}\")\n    return _0(raw, calib_x, calib_y, )").encode()
        return data
    rewrite_zip(b / "refine.pt", edit)


def pt_code_custom_op(b, marker):
    def edit(name, data):
        if name.endswith("survival/network.py"):
            return data.decode().replace("torch.clamp(budget, None, budget_norm)",
                                         "ops.debugprims.load_tensor(\"x\", [1], [1], dtype=6, device=\"cpu\")").encode()
        return data
    rewrite_zip(b / "refine.pt", edit)


def pt_tensor_data_deflated(b, marker):
    """Tensor data compressed: torch inflates whatever size the header claims (ours are stored)."""
    rewrite_zip(b / "refine.pt", deflate=lambda name: name.endswith("/data/0"))


def onnx_external_data(b, marker):
    """refine.onnx with its first weight stored outside the bundle ('../outside.bin', planted beside it)."""
    import onnx

    model = onnx.load(str(b / "refine.onnx"))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    (b.parent / "outside.bin").write_bytes(tensor.raw_data)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../outside.bin"), ("offset", "0"), ("length", str(len(tensor.raw_data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.ClearField("raw_data")
    (b / "refine.onnx").write_bytes(model.SerializeToString())


def planted(name: str, payload):
    def plant(b, marker):
        (b / name).write_bytes(payload(marker))
    return plant


def npy_with_pickle(marker):
    """An object array: numpy.load(allow_pickle=True) unpickles what follows its header."""
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }".ljust(117) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + system(marker)


def admission_text(edit):
    def change(b, marker):
        text = (b / "admission.txt").read_text()
        (b / "admission.txt").write_text(edit(text))
    return change


def huge_field(text):
    """A threshold line of 2 MB: LightGBM's parser allocates and parses whatever a line holds."""
    return text.replace("threshold=", "threshold=" + "1" * (2 << 20) + " ", 1)


def child_out_of_range(text):
    """A child index past the tree's nodes: LightGBM would read outside its arrays."""
    return re.sub(r"left_child=(-?\d+)", "left_child=9999", text, count=1)


def symlinked_artifact(b, marker):
    """Issue 43: a link in place of an artifact, to a file of the same bytes outside the bundle."""
    outside = b.parent / "admission.onnx"
    shutil.move(b / "admission.onnx", outside)
    (b / "admission.onnx").symlink_to(outside)


def fifo_artifact(b, marker):
    """A named pipe in place of the model card: hashing it would block forever."""
    (b / "README.md").unlink()
    os.mkfifo(b / "README.md")


def directory_artifact(b, marker):
    (b / "refine.pt").unlink()
    (b / "refine.pt").mkdir()


def edited_hidden_size(manifest):
    """Issue 43: hidden_size edited alone."""
    manifest["inputs"]["refine"]["hidden_size"] = 64


def consistent_hidden_size(manifest):
    """hidden_size, in_features, tensors and the model's hidden size all edited to agree: only the
    artifacts' real shapes can tell."""
    refine = manifest["inputs"]["refine"]
    refine.update(hidden_size=64, in_features=2 * 64 + 6)
    refine["tensors"].update(first_round=["B", 64], prompt_last=["B", 64])
    manifest["model"]["hidden_size"] = 64


def swapped_onnx(b, marker):
    """Issue 43: refine.onnx of another hidden size (16) in this bundle (32): same inputs and output
    by name, remaining_rounds = the row sums of first_round (a few nodes, built in milliseconds)."""
    import onnx
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in (
        ("first_round", ["B", 16]), ("prompt_last", ["B", 16]), ("prompt_tokens", ["B"]), ("budget", ["B"]),
        ("early_signals", ["B", 4]))]
    output = helper.make_tensor_value_info("remaining_rounds", TensorProto.FLOAT, ["B"])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    node = helper.make_node("ReduceSum", ["first_round", "axes"], ["remaining_rounds"], keepdims=0)
    graph = helper.make_graph([node], "other", inputs, [output], [axes])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(b / "refine.onnx"))


def calibration(knots):
    def write(b, marker):
        (b / "calibration.json").write_text(knots)
    return write


def probes_of_another_width(b, marker):
    from safetensors.numpy import load_file, save_file

    probes = load_file(str(b / "probes.safetensors"))
    probes["refine.first_round"] = probes["refine.first_round"][:, :16].copy()
    save_file(probes, str(b / "probes.safetensors"))


def int8_declared_but_absent(b, marker):
    (b / "refine.int8.onnx").unlink(missing_ok=True)
    edit_manifest(b, lambda m: m["int8"].update(kept=True))


def deep_manifest(manifest):
    manifest["metrics"]["deep"] = json.loads("[" * 200 + "]" * 200)


def huge_number(b, marker):
    """A number of 5,000 digits (Python refuses to parse more than 4,300 with a ValueError)."""
    text = (b / "bundle.json").read_text()
    (b / "bundle.json").write_text('{"big": ' + "1" * 5000 + ", " + text.lstrip()[1:])


def json_array(b, marker):
    (b / "bundle.json").write_text("[]")


# case -> (how to make it, a regex the one-line refusal matches)
# A case whose maker takes (bundle, marker) changes files, one that takes a manifest edits bundle.json.
CASES = {
    "pt2-pickled-weight": (pt2_pickled_weight, r"refine\.pt2.*stored as a pickle"),
    "pt2-pickled-constant": (pt2_pickled_constant, r"refine\.pt2.*stored as a pickle"),
    "pt2-opaque-constant": (pt2_opaque_constant, r"refine\.pt2.*never writes|refine\.pt2.*not a tensor file"),
    "pt2-sample-inputs-pickle": (pt2_sample_inputs, r"refine\.pt2 \(sample inputs\).*would import 'os system'"),
    "pt2-guard-code": (pt2_guard_code, r"refine\.pt2.*guard holds '__import__'"),
    "pt2-sympy-expression": (pt2_sympy_expression, r"refine\.pt2.*symbolic size holds '__import__'"),
    "pt2-file-operator": (pt2_file_operator, r"refine\.pt2.*calls 'torch\.ops\.aten\.from_file\.default'"),
    "pt2-pytree-import": (pt2_pytree_import, r"refine\.pt2.*pytree spec holds the node 'collections\.defaultdict'"),
    "pt2-extra-member": (pt2_extra_member, r"refine\.pt2.*member 'archive/data/aotinductor/model\.so'"),
    "pt-data-pkl-global": (pt_data_pkl_global, r"refine\.pt \(archive/data\.pkl\).*would import 'os system'"),
    "pt-code-torch-save": (pt_code_writes_a_file, r"refine\.pt .*refers to 'torch\.save'"),
    "pt-code-custom-op": (pt_code_custom_op, r"refine\.pt .*refers to 'ops\.debugprims\.load_tensor'"),
    "pt-tensor-data-deflated": (pt_tensor_data_deflated, r"refine\.pt: archive member 'archive/data/0' is encrypted "
                                                        r"or compressed"),
    "onnx-external-data": (onnx_external_data, r"refine\.onnx.*outside the file .*'\.\./outside\.bin'"),
    "planted-pkl": (planted("weights.pkl", system), r"'weights\.pkl'"),
    "planted-joblib": (planted("model.joblib", opener), r"'model\.joblib'"),
    "planted-npy": (planted("state.npy", npy_with_pickle), r"'state\.npy'"),
    "lightgbm-oversized-field": (admission_text(huge_field), r"admission\.txt.*a line of 2,09\d,\d{3} characters"),
    "lightgbm-child-out-of-range": (admission_text(child_out_of_range), r"admission\.txt.*tree 0.*child 9999"),
    "lightgbm-nan-threshold": (admission_text(lambda t: re.sub(r"threshold=[^ ]+", "threshold=nan", t, count=1)),
                               r"admission\.txt.*tree 0: threshold holds NaN"),
    "symlinked-artifact": (symlinked_artifact, r"admission\.onnx.*(symbolic link|not a plain file)"),
    "fifo-artifact": (fifo_artifact, r"README\.md.*(device, pipe|not a plain file)"),
    "directory-artifact": (directory_artifact, r"refine\.pt.*(is a directory|not a plain file)"),
    "edited-hidden-size": (edited_hidden_size, r"bundle\.json: inputs\.refine\.in_features is 70, but hidden size 64"),
    "consistent-hidden-size": (consistent_hidden_size, r"(refine|probes).* declares .*64"),
    "swapped-onnx": (swapped_onnx, r"refine\.onnx: input 'first_round' has shape \['B', 16\], but bundle\.json "
                                   r"declares \['B', 32\]"),
    "calibration-nan": (calibration('{"x": [0, NaN], "y": [0, 1]}'), r"calibration\.json is not valid JSON \(NaN"),
    "calibration-decreasing": (calibration('{"x": [0, 2, 1], "y": [0, 1, 2]}'), r"calibration\.json: 'x' decreases"),
    "calibration-deep": (calibration("[" * 5000 + "]" * 5000), r"calibration\.json nests .* more than 64 deep"),
    "probes-other-width": (probes_of_another_width, r"probes\.safetensors: tensor 'refine\.first_round' is F32 "
                                                    r"\[64, 16\], but bundle\.json declares F32 \[64, 32\]"),
    "int8-declared-absent": (int8_declared_but_absent, r"bundle\.json: int8\.kept is True, but refine\.int8\.onnx "
                                                      r"is not listed"),
    "deep-manifest": (deep_manifest, r"bundle\.json nests arrays or objects more than 64 deep"),
    "huge-number": (huge_number, r"bundle\.json is not valid JSON \(Exceeds the limit"),
    "bundle-json-array": (json_array, r"bundle\.json does not hold a JSON object"),
    "manifest-lists-planted-name": (lambda m: m["files"].update({"x.npy": m["files"]["README.md"]}),
                                    r"bundle\.json lists 'x\.npy', which is not a file a bundle holds"),
}


# cases that write their files whole (no reseal: the manifest is what they break), or list a file
# the directory does not hold as a regular file
UNSEALED = {"huge-number", "bundle-json-array", "int8-declared-absent", "manifest-lists-planted-name"}
FAKE_ENTRIES = {"directory-artifact": "refine.pt", "fifo-artifact": "README.md"}


def _make(case: str, root: Path) -> tuple[Path, Path]:
    """The case's hostile bundle under ``root`` (built once) and its marker path."""
    bundle, marker = root / "bundle", root / "MARKER"
    if bundle.exists():
        return bundle, marker
    shutil.copytree(served_bundle()[0], bundle)
    make = CASES[case][0]
    if make.__code__.co_argcount == 1:  # an edit of the manifest
        manifest = json.loads((bundle / "bundle.json").read_text())
        make(manifest)
        (bundle / "bundle.json").write_text(json.dumps(manifest))
    else:
        make(bundle, marker)
    if case in FAKE_ENTRIES:
        reseal(bundle, {FAKE_ENTRIES[case]: {"sha256": "0" * 64, "bytes": 0}})
    elif case == "manifest-lists-planted-name":
        write_bundle_manifest(bundle, json.loads((bundle / "bundle.json").read_text()))
    elif case not in UNSEALED:
        reseal(bundle)
    return bundle, marker


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return lambda case: _make(case, root / case)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from dwise_predict.traces import write_traces

    return write_traces(served_bundle()[1], tmp_path_factory.mktemp("traces") / "tr")


def _zoo_of(bundle: Path) -> Path:
    """A zoo beside ``bundle`` (built once) whose index correctly lists a tar of the bundle as it is
    (links stay links, pipes pipes)."""
    zoo = bundle.parent / "zoo"
    if zoo.exists():
        return zoo
    tar_path = zoo / "bundles" / "evil" / "evil-1.tar"
    tar_path.parent.mkdir(parents=True)
    with tarfile.open(tar_path, "w") as tar:
        for path in sorted(bundle.iterdir()):
            tar.add(path, arcname=path.name, recursive=False)
    entry = {"name": "evil", "version": "1", "file": "bundles/evil/evil-1.tar", "sha256": sha256_file(tar_path),
             "bytes": tar_path.stat().st_size}
    (zoo / "index.json").write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    return zoo


COMMANDS = ["verify", "publish", "zoo-pull", "simulate", "serve-dry-run", "load-onnx", "load-torch", "load-torchscript"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_reader_refuses_every_hostile_bundle(cases, traces, case, command, tmp_path, capsys):
    bundle, marker = cases(case)
    pattern = CASES[case][1]
    if command.startswith("load-"):
        from dwise_predict.bundles.load import load_bundle

        backend = "onnx" if command == "load-onnx" else "torch"
        with pytest.raises(BundleError) as refused:
            load_bundle(bundle, backend=backend, torchscript=command == "load-torchscript")
        message = str(refused.value)
    else:
        argv = {"verify": ["verify", str(bundle)],
                "publish": ["publish", str(bundle), "--zoo", str(tmp_path / "zoo")],
                "zoo-pull": ["zoo", "pull", "evil", "--zoo", str(_zoo_of(bundle)), "--out", str(tmp_path / "out")],
                "simulate": ["simulate", str(traces), "--bundle", str(bundle), "--requests", "64"],
                "serve-dry-run": ["serve", "--bundle", str(bundle), "--dry-run"]}[command]
        assert main(argv) == 1
        captured = capsys.readouterr()
        message = captured.err.strip()
        assert message.startswith("error: ") and "\n" not in message, captured.err
    assert "\n" not in message and re.search(pattern, message), message
    assert not marker.exists(), f"the payload of {case} ran under {command}"
    if command == "publish":
        assert not (tmp_path / "zoo" / "index.json").exists()
    if command == "zoo-pull":
        assert list(tmp_path.iterdir()) == []  # nothing extracted, not even a temporary directory


def test_the_payloads_run_when_loaded_naively(cases, tmp_path):
    """Without the screen, torch.export.load runs the pickled weight's os.system, a TorchScript
    module running its code writes a file with torch.save, and pickle runs a planted .pkl: the
    markers above are not vacuous."""
    pt2, pt2_marker = cases("pt2-pickled-weight")
    pt, pt_marker = cases("pt-code-torch-save")
    pkl, pkl_marker = cases("planted-pkl")
    script = f"""
import io, pickle, torch
try:
    torch.export.load({str(pt2 / 'refine.pt2')!r})
except Exception:
    pass  # the program fails to build, after the pickle ran
module = torch.jit.load({str(pt / 'refine.pt')!r})
module(torch.zeros(2, {HIDDEN}), torch.zeros(2, {HIDDEN}), torch.ones(2), torch.ones(2), torch.zeros(2, 4))
pickle.loads(open({str(pkl / 'weights.pkl')!r}, "rb").read())
"""
    markers = (pt2_marker, pt_marker, pkl_marker)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [m.exists() for m in markers] == [True, True, True]
    finally:
        for m in markers:
            m.unlink(missing_ok=True)


def test_the_probe_worker_screens_what_it_loads(cases, tmp_path):
    """verify's fresh process checks again before it deserialises (a file swapped after the parent's
    checks): the hostile archives fail their rows, unloaded, and nothing else does."""
    bundle, marker = cases("pt-code-torch-save")
    shutil.copy(cases("pt2-pickled-weight")[0] / "refine.pt2", bundle / "refine.pt2")
    reseal(bundle)
    done = subprocess.run([sys.executable, "-I", "-m", "dwise_predict.exports.probe_worker", str(bundle)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    rows = {row["artifact"]: row for row in json.loads(done.stdout)["rows"]}
    assert "refers to 'torch.save'" in rows["refine.pt"]["detail"] and not rows["refine.pt"]["ok"]
    assert "stored as a pickle" in rows["refine.pt2"]["detail"] and not rows["refine.pt2"]["ok"]
    assert [name for name, row in rows.items() if not row["ok"]] == ["refine.pt", "refine.pt2"]
    assert not marker.exists() and not cases("pt2-pickled-weight")[1].exists()


def test_every_exported_artifact_is_known_to_the_screen():
    from dwise_predict.exports.bundle import ARTIFACTS
    from dwise_predict.bundles.manifest import REQUIRED_ARTIFACTS

    assert sorted(ARTIFACTS) == sorted(BUNDLE_ARTIFACTS)
    exported = {p.name for p in served_bundle()[0].iterdir()}
    assert set(REQUIRED_ARTIFACTS) | {"bundle.json"} <= exported <= set(BUNDLE_ARTIFACTS) | {"bundle.json"}


def test_export_refuses_an_empty_name(tmp_path, capsys):
    """Issue 43: `export --name ""` exported under the run's name; an empty name is refused."""
    run = served_bundle()[0].parent / "run"
    assert main(["export", str(run), "--out", str(tmp_path / "b"), "--name", ""]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --name '' must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
    assert not (tmp_path / "b").exists()


def test_an_archive_member_that_inflates_past_the_limit_is_refused(cases, tmp_path, monkeypatch, capsys):
    """A zip bomb in refine.pt: a code member deflated to a few kB that inflates past the limit on
    what is read of an archive (64 MB; 1 MB here, to keep the test small) is refused, not inflated."""
    from dwise_predict.bundles import screen

    monkeypatch.setattr(screen, "MAX_READ", 1 << 20)
    bundle = shutil.copytree(served_bundle()[0], tmp_path / "bomb")
    rewrite_zip(bundle / "refine.pt", lambda name, data: b"#" * (2 << 20) if name.endswith("survival/network.py") else data,
                deflate=lambda name: name.endswith("survival/network.py"))
    reseal(bundle)
    with zipfile.ZipFile(bundle / "refine.pt") as archive:
        bomb = next(i for i in archive.infolist() if i.filename.endswith("survival/network.py"))
    assert bomb.compress_size < 16 << 10 and bomb.file_size == 2 << 20
    assert main(["verify", str(bundle)]) == 1
    err = capsys.readouterr().err.strip()
    assert re.search(r"refine\.pt: archive member '.*network\.py' inflates past 1,048,576 bytes", err), err


# --- the screen's readers, case by case -------------------------------------------------------------

def test_stack_global_names_are_read_without_running_the_pickle():
    """Protocol 4 names globals through STACK_GLOBAL: pickletools gives the names when they were pushed
    as literals; a name computed at load time (here: the result of a call) is refused outright."""
    import pickle

    from dwise_predict.bundles.screen import TENSOR_GLOBALS, check_pickle, pickle_globals

    assert pickle_globals(pickle.dumps(os.system, protocol=4), "x") == ["posix system"]
    with pytest.raises(BundleError, match="would import 'posix system'"):
        check_pickle(pickle.dumps(os.system, protocol=4), "x", TENSOR_GLOBALS)
    computed = b"\x80\x04cbuiltins\nstr\n)R\x8c\x06system\x93."  # str() then 'system': STACK_GLOBAL('', 'system')
    with pytest.raises(BundleError, match="names a computed global"):
        pickle_globals(computed, "x")
    with pytest.raises(BundleError, match="malformed pickle"):
        pickle_globals(b"\x80\x04\x8c", "x")


def chain_model(leaves: int) -> str:
    """A LightGBM text model of one tree whose nodes form a chain: as deep as it has leaves, less one."""
    left = [i + 1 if i < leaves - 2 else -leaves for i in range(leaves - 1)]

    def ones(n: int) -> str:
        return " ".join(["1"] * n)

    tree = ["Tree=0", f"num_leaves={leaves}", "num_cat=0", "split_feature=" + " ".join(["0"] * (leaves - 1)),
            "split_gain=" + ones(leaves - 1), "threshold=" + " ".join(f"{i}.5" for i in range(leaves - 1)),
            "decision_type=" + " ".join(["2"] * (leaves - 1)), "left_child=" + " ".join(map(str, left)),
            "right_child=" + " ".join(str(-1 - i) for i in range(leaves - 1)),
            "leaf_value=" + " ".join(f"{0.01 * i}" for i in range(leaves)), "leaf_weight=" + ones(leaves),
            "leaf_count=" + ones(leaves), "internal_value=" + " ".join(["0"] * (leaves - 1)),
            "internal_weight=" + ones(leaves - 1), "internal_count=" + ones(leaves - 1), "is_linear=0", "shrinkage=1"]
    header = ["tree", "version=v4", "num_class=1", "num_tree_per_iteration=1", "label_index=0", "max_feature_idx=2",
              "objective=regression", "feature_names=Column_0 Column_1 Column_2", "feature_infos=[0:99] [0:1] [0:1]"]
    return "\n".join(header + [""] + tree + ["", "end of trees", "", "pandas_categorical:null", ""])


def test_a_tree_too_deep_for_the_compiler_is_refused_before_lightgbm_reads_it(tmp_path):
    """A chain of 120 leaves is a model LightGBM accepts, but the compiled single-request path nests
    one `if` per level and Python stops at 100: IndentationError, a traceback. The check refuses it
    first (depth 64 at most), in one line, for a run directory as for a bundle; 60 leaves load."""
    import lightgbm
    import numpy as np

    from dwise_predict.admission.model import AdmissionModel, compile_trees, flatten_trees
    from dwise_predict.errors import InputError

    deep = chain_model(120)
    with pytest.raises(IndentationError):
        compile_trees(flatten_trees(lightgbm.Booster(model_str=deep).dump_model()))
    (tmp_path / "admission.txt").write_text(deep)
    with pytest.raises(InputError, match=r"admission\.txt: tree 0 is deeper than 64 levels: refusing to read it"):
        AdmissionModel.load(tmp_path)
    (tmp_path / "admission.txt").write_text(chain_model(60))
    model = AdmissionModel.load(tmp_path)
    x = np.array([[30.0, 0.0, 0.0], [58.9, 1.0, 2.0]])
    assert [model.predict_one(*row) for row in x] == model.predict(x).tolist()
