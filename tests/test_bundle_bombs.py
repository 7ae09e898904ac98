"""Sealed bundles that exhaust or mislead (issue 51): graphs that loop for ever, allocate gigabytes or
square the batch, estimates that are NaN or of the wrong shape, a safetensors header that lies about
its data, a LightGBM model too large to compile, a huge manifest field, and a probe that outlives
the ``verify`` that started it.

Every bomb here is a few kB on disk (a Loop's trip count, a ConstantOfShape's shape and a tensor's
dims are numbers), and nothing here allocates what the bombs ask for: each is refused, in one line
naming the file and the reason, before anything runs it. The reader matrix is
``tests/test_hostile_bundles.py``'s (:func:`reseal` seals a variant as the exporter does).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fakes.serving_bundle import HIDDEN, served_bundle
from test_hostile_bundles import _zoo_of, reseal

from dwise_predict.cli import main
from dwise_predict.errors import BundleError

# --- hostile graphs, built node by node ------------------------------------------------------------

REFINE_INPUTS = (("first_round", ["B", HIDDEN]), ("prompt_last", ["B", HIDDEN]), ("prompt_tokens", ["B"]),
                 ("budget", ["B"]), ("early_signals", ["B", 4]))


def write_graph(path: Path, nodes, initializers=(), admission: bool = False) -> None:
    """A graph with the signature the bundle declares (so only its body can be refused) whose last
    node writes the output."""
    import onnx
    from onnx import TensorProto, helper

    inputs = [("features", ["B", 3])] if admission else REFINE_INPUTS
    output = "total_rounds" if admission else "remaining_rounds"
    graph = helper.make_graph(nodes, "bomb", [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["B"])], list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def ints(name, values):
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def loop_of(trips: int, admission: bool = False):
    """A Loop of ``trips`` iterations adding 1 to the prompt tokens (the admission features) each time."""
    def make(b, marker):
        from onnx import TensorProto, helper

        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
            "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                     helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                     helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["B"])],
            [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["B"])],
            [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
        loop = helper.make_node("Loop", ["trips", "true", "features" if admission else "prompt_tokens"],
                                ["total_rounds" if admission else "remaining_rounds"], body=body)
        constants = [helper.make_tensor("trips", TensorProto.INT64, [], [trips]),
                     helper.make_tensor("true", TensorProto.BOOL, [], [True])]
        write_graph(b / ("admission.onnx" if admission else "refine.onnx"), [loop], constants, admission)
    return make


def constant_of_shape(numbers: int):
    """ConstantOfShape of ``numbers`` floats (800M: 3.2 GB), summed into the output."""
    def make(b, marker):
        from onnx import helper

        write_graph(b / "refine.onnx", [helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
                                        helper.make_node("ReduceSum", ["zeros"], ["total"], keepdims=0),
                                        helper.make_node("Add", ["prompt_tokens", "total"], ["remaining_rounds"])],
                    [ints("shape", [numbers])])
    return make


def declared_initializer(numbers: int, held: int):
    """An initializer whose dims say ``numbers`` floats and whose data holds ``held`` (onnxruntime
    allocates by the dims: 300M is 1.2 GB from a file of a few bytes)."""
    def make(b, marker):
        from onnx import TensorProto, helper

        weight = helper.make_tensor("w", TensorProto.FLOAT, [held], [0.0] * held)
        weight.dims[0] = numbers
        write_graph(b / "refine.onnx", [helper.make_node("ReduceSum", ["w"], ["total"], keepdims=0),
                                        helper.make_node("Add", ["prompt_tokens", "total"], ["remaining_rounds"])],
                    [weight])
    return make


def expand_bomb(b, marker):
    """Expand (an operator the exporter writes) of each request's prompt tokens to 800M columns."""
    from onnx import helper

    write_graph(b / "refine.onnx", [helper.make_node("Unsqueeze", ["prompt_tokens", "axis1"], ["column"]),
                                    helper.make_node("Expand", ["column", "wide"], ["wide_rows"]),
                                    helper.make_node("ReduceSum", ["wide_rows", "axis1"], ["remaining_rounds"],
                                                     keepdims=0)],
                [ints("axis1", [1]), ints("wide", [1, 800_000_000])])


def expand_by_values(b, marker):
    """Expand to as many numbers as the largest budget asks (the probes' inputs are the bundle's own)."""
    from onnx import TensorProto, helper

    write_graph(b / "refine.onnx", [helper.make_node("Cast", ["budget"], ["budget_int"], to=TensorProto.INT64),
                                    helper.make_node("ReduceMax", ["budget_int"], ["length"], keepdims=1),
                                    helper.make_node("Expand", ["one", "length"], ["wide"]),
                                    helper.make_node("ReduceSum", ["wide"], ["total"], keepdims=0),
                                    helper.make_node("Add", ["prompt_tokens", "total"], ["remaining_rounds"])],
                [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])


def reshape_then_expand(b, marker):
    """first_round [B, 32] reshaped to [-1, 1] (32 B rows), then each row expanded 5,000 wide: 160,000
    numbers per request from a per-row size that looks small."""
    from onnx import helper

    write_graph(b / "refine.onnx", [helper.make_node("Reshape", ["first_round", "column"], ["flat"]),
                                    helper.make_node("Expand", ["flat", "wide"], ["wide_rows"]),
                                    helper.make_node("ReduceSum", ["wide_rows"], ["total"], keepdims=0),
                                    helper.make_node("Add", ["prompt_tokens", "total"], ["remaining_rounds"])],
                [ints("column", [-1, 1]), ints("wide", [1, 5000])])


def batch_squared(b, marker):
    """[B, 1] + [1, B]: B x B numbers from operators the exporter writes."""
    from onnx import helper

    write_graph(b / "refine.onnx", [helper.make_node("Unsqueeze", ["prompt_tokens", "axis1"], ["column"]),
                                    helper.make_node("Unsqueeze", ["budget", "axis0"], ["row"]),
                                    helper.make_node("Add", ["column", "row"], ["square"]),
                                    helper.make_node("ReduceSum", ["square", "axis1"], ["remaining_rounds"],
                                                     keepdims=0)],
                [ints("axis0", [0]), ints("axis1", [1])])


def nan_refinement(b, marker):
    """A refinement graph the screen passes (bounded, our operators) whose every estimate is NaN."""
    from onnx import TensorProto, helper

    write_graph(b / "refine.onnx", [helper.make_node("ReduceSum", ["first_round", "axis1"], ["summed"], keepdims=0),
                                    helper.make_node("Mul", ["summed", "nan"], ["remaining_rounds"])],
                [ints("axis1", [1]), helper.make_tensor("nan", TensorProto.FLOAT, [], [math.nan])])


def nan_admission(b, marker):
    """The exported admission graph, exp(trees) - 1, with its 1 made NaN."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(b / "admission.onnx"))
    one = next(t for t in model.graph.initializer if t.name == "one")
    one.CopyFrom(numpy_helper.from_array(np.array(math.nan, np.float32), "one"))
    onnx.save(model, str(b / "admission.onnx"))


def twice_the_rows(b, marker):
    """Declares [B] and returns 2B estimates: the prompt tokens, twice."""
    from onnx import helper

    write_graph(b / "refine.onnx", [helper.make_node("Concat", ["prompt_tokens", "prompt_tokens"],
                                                     ["remaining_rounds"], axis=0)])


def short_safetensors_offsets(b, marker):
    """refine.safetensors whose input_mean is F32 [70] but whose data_offsets span 4 bytes."""
    data = (b / "refine.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    start = header["input_mean"]["data_offsets"][0]
    header["input_mean"]["data_offsets"] = [start, start + 4]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    (b / "refine.safetensors").write_bytes(data[:8] + text + data[8 + size:])


def chained_trees(trees: int, leaves: int) -> str:
    """A LightGBM text model of ``trees`` chain-shaped trees of ``leaves`` leaves each."""
    from test_hostile_bundles import chain_model

    one = chain_model(leaves)
    head, _, rest = one.partition("Tree=0")
    block, _, tail = rest.partition("end of trees")
    return head + "".join(f"Tree={i}{block}" for i in range(trees)) + "end of trees" + tail


def too_many_leaves(b, marker):
    """1,025 trees of 64 leaves: 65,600 leaves, each tree within the per-tree limits."""
    (b / "admission.txt").write_text(chained_trees(1025, 64))


# case -> (how to make it, a regex the one-line refusal matches, the readers that must refuse it)
SCREENED = ("verify", "publish", "zoo-pull", "simulate", "serve-dry-run", "load-onnx", "load-torch", "load-torchscript")
CASES = {
    "refine-loop-2^62": (loop_of(1 << 62), r"refine\.onnx: it calls the operator 'Loop', which our exported graphs "
                                           r"never do: refusing to run it", SCREENED),
    "admission-loop-2^62": (loop_of(1 << 62, admission=True), r"admission\.onnx: it calls the operator 'Loop'",
                            SCREENED),
    "constant-of-shape-800M": (constant_of_shape(800_000_000), r"refine\.onnx: 'zeros' would hold 800,000,000 "
                                                               r"numbers, more than the [\d,]+ this bundle's declared "
                                                               r"sizes allow", SCREENED),
    "constant-of-shape-2^40": (constant_of_shape(1 << 40), r"refine\.onnx: 'zeros' would hold 1,099,511,627,776 numbers",
                               SCREENED),
    "expand-by-input-values": (expand_by_values, r"refine\.onnx: 'wide' has an axis whose size depends on the values "
                                                 r"it is given", SCREENED),
    "reshape-rows-then-expand": (reshape_then_expand, r"refine\.onnx: 'flat' has an axis whose size depends on the "
                                                      r"values it is given", SCREENED),
    "initializer-1.2GB": (declared_initializer(300_000_000, 4), r"refine\.onnx: tensor 'w' \[300000000\] brings its "
                                                                r"constants to 300,000,000 numbers, more than the "
                                                                r"[\d,]+ this bundle's weights hold", SCREENED),
    "initializer-dims-lie": (declared_initializer(100, 4), r"refine\.onnx: tensor 'w' declares \[100\] \(100 numbers\) "
                                                           r"but holds 4", SCREENED),
    "expand-800M-per-request": (expand_bomb, r"refine\.onnx: 'wide_rows' would hold 800,000,000 numbers per request",
                                SCREENED),
    "batch-squared": (batch_squared, r"refine\.onnx: 'square' has 2 batch-sized axes \(a batch times a batch\)",
                      SCREENED),
    "safetensors-short-offsets": (short_safetensors_offsets, r"refine\.safetensors: tensor 'input_mean' is 'F32' "
                                                             r"\[70\] \(70 numbers\) but its data_offsets span 4 bytes",
                                  SCREENED),
    "lightgbm-65,600-leaves": (too_many_leaves, r"admission\.txt: more than 65,536 leaves over its first 1,025 trees",
                               SCREENED),
    # bounded graphs whose estimates are not estimates: every loader that runs them refuses them
    # (the torch backend runs the graph rebuilt from refine.safetensors, not refine.onnx; verify
    # fails their rows: test_verify_fails_what_the_loader_refuses)
    "refine-nan": (nan_refinement, r"refinement graph gives NaN or infinite estimates for 64 of 64",
                   ("simulate", "load-onnx")),
    "admission-nan": (nan_admission, r"admission\.onnx gives NaN or infinite estimates for 64 of 64",
                      ("simulate", "load-onnx", "load-torch", "load-torchscript")),
    "refine-2B-rows": (twice_the_rows, r"refine\.onnx returned \(128,\) estimates for 64 requests, not one per request",
                       ("simulate", "load-onnx")),
}


def _make(case: str, root: Path) -> Path:
    bundle = root / "bundle"
    if not bundle.exists():
        shutil.copytree(served_bundle()[0], bundle)
        CASES[case][0](bundle, root / "MARKER")
        reseal(bundle)
    return bundle


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bombs")
    return lambda case: _make(case, root / case)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from dwise_predict.traces import write_traces

    return write_traces(served_bundle()[1], tmp_path_factory.mktemp("traces") / "tr")


def test_every_bomb_is_a_few_kilobytes(cases):
    for case in CASES:
        bundle = cases(case)
        sizes = {p.name: p.stat().st_size for p in bundle.iterdir()}
        assert sum(sizes.values()) < 8 << 20, (case, sizes)


def refusal(command: str, bundle: Path, traces: Path, tmp_path: Path, capsys) -> str:
    """The one-line error of ``command`` on ``bundle`` (a CLI exit 1, or a loader's BundleError)."""
    if command.startswith("load-"):
        from dwise_predict.bundles.load import load_bundle

        backend = "onnx" if command == "load-onnx" else "torch"
        with pytest.raises(BundleError) as refused:
            load_bundle(bundle, backend=backend, torchscript=command == "load-torchscript")
        return str(refused.value)
    argv = {"verify": ["verify", str(bundle)],
            "publish": ["publish", str(bundle), "--zoo", str(tmp_path / "zoo")],
            "zoo-pull": ["zoo", "pull", "evil", "--zoo", str(_zoo_of(bundle)), "--out", str(tmp_path / "out")],
            "simulate": ["simulate", str(traces), "--bundle", str(bundle), "--requests", "64"],
            "serve-dry-run": ["serve", "--bundle", str(bundle), "--dry-run"]}[command]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err.strip()


@pytest.mark.parametrize("case,command", [(case, command) for case, (_, _, readers) in CASES.items()
                                          for command in readers])
def test_every_reader_refuses_every_bomb(cases, traces, case, command, tmp_path, capsys):
    started = time.monotonic()
    message = refusal(command, cases(case), traces, tmp_path, capsys)
    assert "\n" not in message and re.search(CASES[case][1], message), message
    assert time.monotonic() - started < 120  # refused, not run to the end (or the machine's)
    if command == "publish":
        assert not (tmp_path / "zoo" / "index.json").exists()


@pytest.mark.parametrize("case", ["refine-nan", "refine-2B-rows"])
def test_verify_fails_what_the_loader_refuses(cases, case, capsys):
    """verify runs the graph on its probes and fails its row (NaN lies outside every band; a shape
    other than the probes' is named)."""
    from dwise_predict.exports.verify import verify_bundle

    report = verify_bundle(cases(case))
    assert [row["artifact"] for row in report.failures()] == ["refine.onnx"]
    detail = report.failures()[0]["detail"]
    assert ("64 of 64 rows OUTSIDE their band" in detail if case == "refine-nan"
            else "output shape (2,), expected (1,)" in detail), detail


def test_the_loop_bomb_would_run_unscreened(cases):
    """The refused Loop is a real one: onnxruntime runs it as written (a few iterations here)."""
    import onnx
    import onnxruntime as ort

    bundle = cases("refine-loop-2^62")
    model = onnx.load(str(bundle / "refine.onnx"))
    trips = next(t for t in model.graph.initializer if t.name == "trips")
    trips.int64_data[0] = 5
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"first_round": np.zeros((2, HIDDEN), np.float32), "prompt_last": np.zeros((2, HIDDEN), np.float32),
             "prompt_tokens": np.array([1.0, 2.0], np.float32), "budget": np.ones(2, np.float32),
             "early_signals": np.zeros((2, 4), np.float32)}
    assert session.run(None, feeds)[0].tolist() == [6.0, 7.0]


def test_what_the_exporter_writes_passes_the_graph_bounds():
    """The operator lists are what the exporters write (the served bundle, int8 graph included)."""
    import onnx

    from dwise_predict.bundles.graph_bounds import ADMISSION_OPS, REFINE_OPS

    bundle = served_bundle()[0]
    written = {name: {node.op_type for node in onnx.load(str(bundle / name)).graph.node}
               for name in ("refine.onnx", "refine.int8.onnx", "admission.onnx") if (bundle / name).exists()}
    assert "refine.int8.onnx" in written
    assert written["refine.onnx"] | written["refine.int8.onnx"] <= REFINE_OPS
    assert written["admission.onnx"] <= ADMISSION_OPS
    assert {"Loop", "If", "Scan", "Range", "NonZero"}.isdisjoint(REFINE_OPS | ADMISSION_OPS)


# --- the serving policy: a NaN that gets past the loader --------------------------------------------

def test_the_policy_keeps_the_admission_estimate_for_a_non_finite_refinement():
    from dwise_predict.serving.policy import DwisePolicy

    policy = DwisePolicy(slots=4, k=2)
    slots = policy.add_many(["a", "b", "c"], [0, 0, 0], [10.0, 20.0, 30.0])
    policy.schedule()
    policy.complete_slots(slots, [False] * 3, refined=[math.nan, 5.0, math.inf])
    assert [policy.fields(r)["r_hat"] for r in "abc"] == [9.0, 5.0, 29.0]  # NaN and inf: admission, less a round
    policy.refine(slots, [math.nan, 2.0, -math.inf])
    assert [policy.fields(r)["r_hat"] for r in "abc"] == [9.0, 2.0, 29.0]


# --- LightGBM, the manifest ---------------------------------------------------------------------------

def test_train_refuses_an_admission_model_that_would_not_load():
    from dwise_predict.errors import ConfigError
    from dwise_predict.training.config import TrainConfig

    with pytest.raises(ConfigError, match=r"admission_trees x admission_leaves must be at most 65,536 \(got 4000 x 256\)"):
        TrainConfig(admission_trees=4000, admission_leaves=256).check()
    TrainConfig().check()  # the default, 100 x 15


def test_a_lightgbm_model_of_4000_trees_of_256_leaves_is_refused_before_it_is_compiled(tmp_path):
    """The issue's model: within the old per-tree and tree-count limits, minutes in the tree compiler."""
    from dwise_predict.admission.model import AdmissionModel
    from dwise_predict.admission.model_text import check_model_text
    from dwise_predict.errors import InputError

    text = chained_trees(4000, 64)  # as many trees; 64-leaf chains keep the test's text small
    started = time.monotonic()
    with pytest.raises(InputError, match=r"admission\.txt: more than 65,536 leaves over its first 1,025 trees"):
        check_model_text(text, "admission.txt", InputError)
    assert time.monotonic() - started < 30
    (tmp_path / "admission.txt").write_text(text)
    with pytest.raises(InputError, match="more than 65,536 leaves"):
        AdmissionModel.load(tmp_path)


def test_a_15_mib_manifest_field_does_not_stall_zoo_list(tmp_path, capsys):
    """A field of 15 MiB (under the 16 MiB manifest cap) reaches the zoo index: its pre-parse depth
    count took seconds per MiB, one regex alternation per character."""
    from dwise_predict.files import _json_depth

    text = json.dumps({"model": {"name": "a" * (15 << 20)}, "x": ['\\"[' * 1000]})
    started = time.monotonic()
    json.loads(text)
    parse = time.monotonic() - started
    started = time.monotonic()
    assert _json_depth(text, 64) == 2
    assert time.monotonic() - started < max(30 * parse, 1.0)  # was ~100x the parse
    entry = {"name": "x", "version": "1", "file": "bundles/x/x-1.tar", "sha256": "0" * 64,
             "model": {"name": "a" * (15 << 20)}}
    (tmp_path / "index.json").write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    assert main(["zoo", "list", "--zoo", str(tmp_path)]) == 0
    assert "aaaa…" in capsys.readouterr().out


# --- the probe worker dies with whoever asked -------------------------------------------------------

def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _kill(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stuck_probe(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A probe server whose child is stuck (its answer file is a pipe no one reads: opening it blocks
    for ever, as a graph that never ends would keep it busy)."""
    fifo = tmp_path / "answer.out"
    os.mkfifo(fifo)
    server = subprocess.Popen([sys.executable, "-I", "-m", "dwise_predict.exports.probe_worker", "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"}, start_new_session=True)
    server.stdin.write((json.dumps([str(served_bundle()[0]), str(fifo), str(tmp_path / "answer.err")]) + "\n").encode())
    server.stdin.flush()
    deadline = time.monotonic() + 120
    while not _children(server.pid):
        assert time.monotonic() < deadline and server.poll() is None, "the server never forked"
        time.sleep(0.1)
    return server, _children(server.pid)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stuck_probe_dies_when_the_process_that_asked_dies(tmp_path):
    """verify killed by SIGTERM closes the server's stdin: the server kills its child and exits."""
    server, child = _stuck_probe(tmp_path)
    try:
        server.stdin.close()  # what the death of the verifying process does
        assert server.wait(timeout=30) == 1
        assert _gone(child, 10), "the probe outlived the server"
    finally:
        _kill(server.pid, child)
        server.wait()
        server.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc")
def test_a_stuck_probe_dies_with_a_killed_server(tmp_path):
    """The child asks the kernel to kill it with its parent (PR_SET_PDEATHSIG)."""
    server, child = _stuck_probe(tmp_path)
    try:
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        assert _gone(child, 10), "the probe outlived its server"
    finally:
        _kill(server.pid, child)
        server.wait()
        server.stdin.close()
        server.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_verify_killed_by_sigterm_leaves_no_process(tmp_path):
    """The whole path: a `verify` process killed while its probe runs leaves nothing running."""
    bundle = served_bundle()[0]
    script = "import sys\nfrom dwise_predict.cli import main\nsys.exit(main(['verify', sys.argv[1]]))\n"
    process = subprocess.Popen([sys.executable, "-c", script, str(bundle)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline, server = time.monotonic() + 120, None
    while time.monotonic() < deadline and process.poll() is None:
        servers = _children(process.pid)
        if servers and _children(servers[0]):
            server = servers[0]
            break
        time.sleep(0.02)
    if server is None:
        process.wait(timeout=60)
        pytest.skip("the probe finished before it could be caught running")
    probe = _children(server)[0]
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert _gone(server, 30) and _gone(probe, 30)
