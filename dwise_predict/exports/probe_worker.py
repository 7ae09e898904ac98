"""Load every artifact of a bundle and compare it with the stored probes — in a process of its own.

Run as ``python -I -m dwise_predict.exports.probe_worker BUNDLE [PARENT_PID]`` (it dies with
``PARENT_PID``, default its parent); prints one JSON object on stdout: ``{"rows": [...], "modules":
[...], "pid": ...}``. ``verify`` runs it as a server instead (``--serve``,
:func:`serve`): one isolated interpreter that imports what loading needs once (about 4 s) and forks a
child per bundle, which answers as that fresh run would and exits. It imports only numpy, safetensors,
onnxruntime, torch, the stdlib manifest module and the torch-only ``survival/network.py`` — never
lightgbm, scikit-learn, pandas or the training code — so a pass shows the bundle loads on a serving
host without the training stack. Everything is checked here again before it is deserialised: each
file is read once, and its bytes are loaded only after their sha256 matches and their content passes
:mod:`dwise_predict.bundles.screen` (TorchScript and torch.export archives hold pickles and code).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

from dwise_predict.exports.refine_export import INPUT_NAMES, INT8_MIN_SPEARMAN
from dwise_predict.bundles.screen import open_bundle, read_calibration, read_checked

TOLERANCE = 1e-4  # max relative error against the eager outputs, and against the eager raw estimate
# modules whose presence would mean the bundle needs the training stack to load
FORBIDDEN_MODULES = ("lightgbm", "sklearn", "pandas", "xgboost", "dwise_predict.training", "dwise_predict.admission")
BATCHES = (1, 7, None)  # None: all probes; 1 and 7 exercise the dynamic batch axis
RAW_PROBE = "refine.raw_estimate"  # the eager raw estimate before calibration (absent from older bundles)
# what an answer imports beyond this module's imports (onnx for the screen; sympy, networkx and
# torch's tracer when torch.export deserialises): the server imports them once and every child
# inherits them, about 2 s of a fresh run's 5. Not onnxruntime: its import starts a thread (32 ms
# in the child instead).
SERVER_PRELOAD = ("onnx", "safetensors.numpy", "safetensors.torch", "dwise_predict.survival.network",
                  "torch._export.serde.serialize", "torch.export._trace")
# numpy's OpenBLAS starts its thread pool at import unless told otherwise: verify starts the server
# with this in its environment so that it stays single-threaded and may fork
SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1"}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def relative_error(expected: np.ndarray, got: np.ndarray) -> float:
    """max |got - expected| / max(|expected|, 1e-3): relative, with a floor for values near zero."""
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64).reshape(expected.shape)
    return float((np.abs(got - expected) / np.maximum(np.abs(expected), 1e-3)).max())


def calibrated_band(expected: np.ndarray, raw: np.ndarray | None, calibration: dict | None,
                    tolerance: float = TOLERANCE) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the interval an artifact's calibrated output may lie in: the calibration of any raw
    estimate within ``tolerance`` (relative) of the eager one, widened by ``tolerance`` relative to
    the eager output. Without ``raw`` (bundles exported before it was probed): eager output ± tolerance.

    The calibration is a monotone piecewise-linear map whose knots can lie close together (two knots
    0.02 apart mapping to 41 and 43 rounds: slope 100), so a float32 difference in the raw estimate
    that no one could call a bug (1e-6) can move the output by 1e-4. Comparing outputs alone would
    then fail sound bundles; the band asks instead whether the output is what the calibration makes
    of a raw estimate the artifact could have computed. Every pair of rows whose bands do not overlap
    is therefore ordered as the eager graph orders it.
    """
    expected = np.asarray(expected, np.float64)
    margin = tolerance * np.maximum(np.abs(expected), 1e-3)
    if raw is None:
        return expected - margin, expected + margin
    # the graph holds the knots in float32: interpolate through the same values
    knots_x = np.asarray(calibration["x"], np.float32).astype(np.float64)
    knots_y = np.asarray(calibration["y"], np.float32).astype(np.float64)
    raw = np.asarray(raw, np.float64)
    slack = tolerance * np.maximum(np.abs(raw), 1e-3)
    return np.interp(raw - slack, knots_x, knots_y) - margin, np.interp(raw + slack, knots_x, knots_y) + margin


def outside_band(got: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per row, whether ``got`` lies outside ``[lo, hi]`` (:func:`calibrated_band`); NaN is outside."""
    return ~((got >= lo) & (got <= hi))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho with average ranks for ties; NaN when a side is constant.

    Not :func:`dwise_predict.metrics.spearman`: that imports scipy, and this worker loads a bundle
    with only what a serving host has (numpy, onnxruntime, torch: see the module's docstring).
    """

    def ranks(x):
        x = np.asarray(x, np.float64).ravel()
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
        return (np.bincount(inverse, weights=r) / counts)[inverse]

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def compare(artifact: str, check: str, expected: np.ndarray, load, band: tuple[np.ndarray, np.ndarray] | None = None,
            min_spearman: float | None = None) -> dict:
    """``load()`` returns ``run(rows) -> outputs``; run it on prefixes of the probes, compare with
    ``expected`` and return one result row (a load or run failure is a failed row, not an exception).

    An exact artifact passes when every output lies inside its row's ``band`` (:func:`calibrated_band`;
    default: ``expected`` ± :data:`TOLERANCE` relative); a quantised one (``min_spearman`` given) needs
    Spearman rho >= ``min_spearman`` on all probes instead.
    """
    lo, hi = band if band is not None else calibrated_band(expected, None, None)
    inside = "every row inside its band" if band is not None else f"every row within {TOLERANCE:g}"
    try:
        run = load()
        worst, outside = 0.0, np.zeros(len(expected), dtype=bool)
        for size in BATCHES:
            rows = slice(0, size)
            got = np.asarray(run(rows))
            if got.shape != expected[rows].shape:
                raise ValueError(f"output shape {got.shape}, expected {expected[rows].shape}")
            worst = max(worst, relative_error(expected[rows], got))
            outside[rows] |= outside_band(got, lo[rows], hi[rows])
        batches = f"batch 1/7/{len(expected)}"
        if min_spearman is None:
            ok = not outside.any()
            where = inside if ok else f"{int(outside.sum())} of {len(expected)} rows OUTSIDE their band"
            detail = f"max rel err {worst:.1e}, {where}, {batches}"
        else:
            rho = spearman(expected, got)
            ok = rho >= min_spearman
            detail = f"Spearman rho {rho:.6f} (needs >= {min_spearman}), max rel err {worst:.1e}, {batches}"
    except Exception as err:
        ok, detail = False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {"artifact": artifact, "check": check, "ok": ok, "detail": detail}


def main(bundle: str) -> dict:
    import io

    import onnxruntime as ort
    import torch
    from safetensors.numpy import load

    torch.set_num_threads(1)
    root = Path(bundle)
    manifest = open_bundle(root)  # again, in this process: nothing is deserialised before it is checked

    def checked(name: str) -> bytes:
        return read_checked(root, manifest, name)

    probes = load(checked(manifest.probes))
    inputs = [probes[f"refine.{name}"] for name in INPUT_NAMES]
    expected = probes["refine.remaining_rounds"]
    calibration = read_calibration(checked("calibration.json"), str(root / "calibration.json"))
    band = calibrated_band(expected, probes.get(RAW_PROBE), calibration)
    files = manifest.files
    rows = []

    def torch_run(module):
        def run(part):
            with torch.no_grad():
                return module(*(torch.from_numpy(x[part]) for x in inputs)).numpy()

        return run

    def onnx_session(name):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        # from the checked bytes: no path inside the graph resolves against the bundle's directory
        return ort.InferenceSession(checked(name), options, providers=["CPUExecutionProvider"])

    def rebuild():
        from safetensors.torch import load as load_tensors

        from dwise_predict.survival.network import build_refine_graph

        return build_refine_graph(load_tensors(checked("refine.safetensors")), manifest.refine, calibration)

    def onnx_run(name, output, feeds):
        session = onnx_session(name)
        return lambda part: session.run([output], {n: x[part] for n, x in feeds.items()})[0]

    rows.append(compare("refine.safetensors", "rebuilt eager module vs probes", expected, lambda: torch_run(rebuild()), band))
    if "refine.pt" in files:
        rows.append(compare("refine.pt", "TorchScript vs eager", expected,
                            lambda: torch_run(torch.jit.load(io.BytesIO(checked("refine.pt")))), band))
    if "refine.pt2" in files:
        rows.append(compare("refine.pt2", "torch.export vs eager", expected,
                            lambda: torch_run(torch.export.load(io.BytesIO(checked("refine.pt2"))).module()), band))
    refine_feeds = dict(zip(INPUT_NAMES, inputs))
    rows.append(compare("refine.onnx", "onnxruntime vs eager", expected,
                        lambda: onnx_run("refine.onnx", "remaining_rounds", refine_feeds), band))
    if "refine.int8.onnx" in files:
        rows.append(compare("refine.int8.onnx", "int8 onnxruntime ranks like eager", expected,
                            lambda: onnx_run("refine.int8.onnx", "remaining_rounds", refine_feeds),
                            min_spearman=INT8_MIN_SPEARMAN))  # ours, not the manifest's: it could say -1
    rows.append(compare("admission.onnx", "onnxruntime vs LightGBM", probes["admission.total_rounds"],
                        lambda: onnx_run("admission.onnx", "total_rounds", {"features": probes["admission.features"]})))
    loaded = [m for m in FORBIDDEN_MODULES if m in sys.modules]
    rows.append({"artifact": "(process)", "check": "loads without the training stack", "ok": not loaded,
                 "detail": f"imported {', '.join(loaded)}" if loaded else "no lightgbm, sklearn, pandas, training code"})
    return {"rows": rows, "modules": sorted(sys.modules), "pid": os.getpid()}


def answer(bundle: str) -> None:
    """Print the JSON answer for ``bundle`` on stdout; a bundle refused in this process is an ``error``."""
    from dwise_predict.errors import DwiseError

    try:
        result = main(bundle)
    except DwiseError as err:
        result = {"error": str(err)}
    json.dump(result, sys.stdout)


def serve() -> None:
    """Answer requests from stdin until it closes, each in a process of its own.

    A request is one line, the JSON list ``[bundle, out, err]``: the process answering it writes what
    a fresh run would write on stdout and stderr into the files ``out`` and ``err``, and the server
    writes its exit code (negative: killed by that signal) as one line on stdout. The server itself
    loads no bundle and runs nothing but :data:`SERVER_PRELOAD`'s imports, so a child forked from it
    starts as a fresh run would, its imports done. It forks only while it has one thread: a child of
    a process with other threads inherits whatever locks they held at that instant, never released
    (a hang inside onnxruntime or OpenBLAS). Otherwise (started without :data:`SERVER_ENV`, or where
    there is no /proc to tell), each request gets a fresh run.
    """
    for name in SERVER_PRELOAD:
        with contextlib.suppress(ImportError):  # a speed-up only: a child imports whatever is missing
            importlib.import_module(name)
    for line in sys.stdin:
        bundle, out, err = json.loads(line)
        if threads_running() == 1:
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                _answer_in_child(bundle, out, err, server)
            code = wait_while_asked(pid)
        else:
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                fresh = subprocess.Popen([sys.executable, "-I", "-m", __spec__.name, bundle, str(os.getpid())], stdin=subprocess.DEVNULL,
                                         stdout=stdout, stderr=stderr)
            code = fresh.returncode = wait_while_asked(fresh.pid)
        print(code, flush=True)


def wait_while_asked(pid: int) -> int:
    """The exit code of the child ``pid`` (negative: killed by that signal), waited for while
    watching stdin: the verifying process writes nothing until it has the answer, so stdin turning
    readable means it closed, i.e. the process that asked died (SIGTERM, a crash). Then the child is
    killed and the server exits, so that nothing outlives it (a graph that runs for hours would
    otherwise keep a core until it ends)."""
    with selectors.DefaultSelector() as selector:
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
        try:  # readable when the child exits (Linux 5.3+); elsewhere, poll
            child = os.pidfd_open(pid)
        except (AttributeError, OSError):
            child = None
        else:
            selector.register(child, selectors.EVENT_READ)
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    return os.waitstatus_to_exitcode(status)
                events = selector.select(None if child is not None else 0.05)
                if any(key.fd == sys.stdin.fileno() for key, _ in events):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    os._exit(1)
        finally:
            if child is not None:
                os.close(child)


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when ``parent``, the process that started it, dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing: the server's stdin watch still kills it). A parent that
    died before the request was made is seen as this process's new parent: then exit at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def threads_running() -> int | None:
    """This process's threads (all of them, not only Python's), or None where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _answer_in_child(bundle: str, out: str, err: str, server: int) -> None:
    code = 1
    try:
        die_with_parent(server)  # a server killed mid-answer takes this child with it
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the child's to read
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        answer(bundle)
        code = 0
    except BaseException:  # as a fresh run would: the traceback on stderr, exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:  # BUNDLE [PARENT]: the server names itself, since it may die before this process gets here
        die_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid())
        answer(sys.argv[1])
