"""``dwise-predict verify``: check a bundle's hashes, then load and run every artifact.

1. ``bundle.json`` must match its seal; the directory hold only the artifacts a bundle may hold, as
   regular files (:func:`~dwise_predict.bundles.screen.check_layout`: refused outright, in one line);
   every listed file its sha256 and size; no unlisted files.
2. Only when all hashes match: every file's content is screened without deserialising it
   (:func:`~dwise_predict.bundles.screen.screen_bundle`: pickles, code, ONNX external data, declared
   shapes; a hostile file is refused outright, in one line). Then a process of its own, forked from an
   isolated interpreter that has imported what loading needs and loaded nothing (``python -I -m
   dwise_predict.exports.probe_worker --serve``, kept for this process's later verifications; a fresh
   ``python -I`` run where there is no fork), loads every artifact without the training stack and compares
   TorchScript, torch.export and ONNX with the eager outputs stored in ``probes.safetensors``
   (inside the calibration of a raw estimate within 1e-4 of eager, see ``probe_worker.calibrated_band``),
   and ONNX admission with LightGBM.
3. Here, LightGBM re-predicts the probes from ``admission.txt`` (the stored reference itself).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import BundleError
from dwise_predict.bundles.manifest import BundleManifest, read_bundle_manifest, unlisted_files
from dwise_predict.exports.probe_worker import SERVER_ENV, TOLERANCE, relative_error
from dwise_predict.bundles.screen import check_layout, read_checked, screen_bundle
from dwise_predict.files import loads_json, sha256_file


@dataclass
class VerifyReport:
    """One row per check: ``{"artifact", "check", "ok", "detail"}``; ``modules``: what the worker imported."""

    bundle: Path
    rows: list[dict]
    modules: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(row["ok"] for row in self.rows)

    def failures(self) -> list[dict]:
        return [row for row in self.rows if not row["ok"]]

    def failed_artifacts(self) -> str:
        """Comma-separated names of the failed files (process-level rows only when no file failed)."""
        names = sorted({row["artifact"] for row in self.failures()})
        files = [n for n in names if not n.startswith("(")]
        return ", ".join(files or names)


def verify_bundle(bundle: str | Path, timeout_s: float = 600.0) -> VerifyReport:
    """Verify ``bundle``; a manifest that cannot be trusted at all, and a file that must not be read
    (a link, a planted name, a pickle or code outside our exports'), raise :class:`BundleError`."""
    bundle = Path(bundle)
    manifest = read_bundle_manifest(bundle)
    check_layout(bundle, manifest)
    rows = [{"artifact": "bundle.json", "check": "seal and schema", "ok": True,
             "detail": f"schema {manifest.schema_version}"}]
    rows += _hash_rows(bundle, manifest)
    if not all(row["ok"] for row in rows):
        rows.append({"artifact": "(all)", "check": "load and compare", "ok": False,
                     "detail": "skipped: nothing is deserialised until every hash matches"})
        return VerifyReport(bundle, rows, [])
    screen_bundle(bundle, manifest)
    rows.append(_lightgbm_row(bundle, manifest))
    worker_rows, modules = _run_worker(bundle, timeout_s)
    return VerifyReport(bundle, rows + worker_rows, modules)


def _hash_rows(bundle: Path, manifest: BundleManifest) -> list[dict]:
    rows = []
    for name, entry in sorted(manifest.files.items()):
        path = bundle / name
        if Path(name).name != name:
            ok, detail = False, "not a plain file name: unsafe manifest"
        elif not path.is_file():
            ok, detail = False, "missing"
        elif path.stat().st_size != entry.get("bytes"):
            ok, detail = False, f"{path.stat().st_size} bytes, manifest says {entry.get('bytes')}: modified or truncated"
        elif sha256_file(path) != entry.get("sha256"):
            ok, detail = False, "sha256 differs from bundle.json: modified or corrupted"
        else:
            ok, detail = True, f"sha256 {entry['sha256'][:12]}…, {entry['bytes']:,} bytes"
        rows.append({"artifact": name, "check": "sha256 and size", "ok": ok, "detail": detail})
    for name in unlisted_files(bundle, manifest):
        rows.append({"artifact": name, "check": "listed in bundle.json", "ok": False,
                     "detail": "file not in bundle.json: added after export"})
    return rows


def _lightgbm_row(bundle: Path, manifest: BundleManifest) -> dict:
    from safetensors.numpy import load

    from dwise_predict.exports.admission_export import load_booster, predict_total_rounds

    try:
        probes = load(read_checked(bundle, manifest, manifest.probes))
        booster = load_booster(bundle / "admission.txt", read_checked(bundle, manifest, "admission.txt"))
        predicted = predict_total_rounds(booster, probes["admission.features"])
        error = relative_error(probes["admission.total_rounds"], predicted)
        ok, detail = error <= TOLERANCE, f"max rel err {error:.1e} against the probes"
    except Exception as err:  # a failed load is a failed row
        ok, detail = False, f"{type(err).__name__}: {err}"
    return {"artifact": "admission.txt", "check": "LightGBM vs probes", "ok": ok, "detail": detail}


def _run_worker(bundle: Path, timeout_s: float) -> tuple[list[dict], list[str]]:
    """Load and compare every artifact in a process of its own and read its JSON answer."""
    try:
        returncode, stdout, stderr = _probe(bundle.resolve(), timeout_s)
    except TimeoutError:
        return [_worker_failure(f"no answer within {timeout_s:.0f} s")], []
    try:
        answer = loads_json(stdout, BundleError, "the probe worker's answer", allow_nan=True)  # NaN: a broken graph
    except BundleError:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return [_worker_failure(f"exit {returncode}: {tail}")], []
    if "error" in answer:
        return [_worker_failure(answer["error"])], []
    return answer["rows"], answer["modules"]


WORKER = [sys.executable, "-I", "-m", "dwise_predict.exports.probe_worker"]


def _probe(bundle: Path, timeout_s: float) -> tuple[int, str, str]:
    """The probe worker's exit code, stdout and stderr for ``bundle``: from a child of this process's
    probe server, or from a fresh run where there is no fork (Windows)."""
    if not hasattr(os, "fork"):
        try:
            done = subprocess.run([*WORKER, str(bundle), str(os.getpid())], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
        return done.returncode, done.stdout, done.stderr
    with _ProbeServer.lock:
        if _ProbeServer.running is None:
            _ProbeServer.running = _ProbeServer()
        return _ProbeServer.running.probe(bundle, timeout_s)


class _ProbeServer:
    """``probe_worker --serve`` (:func:`~dwise_predict.exports.probe_worker.serve`), started by this
    process's first verification and kept for its later ones: each bundle is still loaded in a process
    of its own, a child of the server, and a fresh run's imports (about 4 of its 5 s) are paid once.
    A server that dies or does not answer in time is killed with its child and started again by the
    next verification; it is stopped when this process exits, and ends by itself when its stdin closes."""

    lock = threading.Lock()
    running: _ProbeServer | None = None

    def __init__(self):
        # removed by stop() alone (not a TemporaryDirectory: a forked child dropping it would remove it)
        self.scratch = Path(tempfile.mkdtemp(prefix="dwise-probe-"))
        self.log = self.scratch / "server.err"
        with open(self.log, "wb") as log:
            # a session of its own: a kill reaches the child it is running too
            self.process = subprocess.Popen([*WORKER, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, bufsize=0, start_new_session=True,
                                            env={**os.environ, **SERVER_ENV})

    def probe(self, bundle: Path, timeout_s: float) -> tuple[int, str, str]:
        out, err = self.scratch / "answer.out", self.scratch / "answer.err"
        for path in (out, err):  # a child that cannot write its answer must not leave the last one's
            path.unlink(missing_ok=True)
        try:
            self.process.stdin.write((json.dumps([str(bundle), str(out), str(err)]) + "\n").encode())
            line = self._read_line(time.monotonic() + timeout_s)
        except TimeoutError:
            self.stop()
            raise
        except OSError:  # it died before the request (a broken pipe)
            line = b""
        if not line:  # it died: its own exit code and stderr
            log = self.log.read_text(errors="replace")
            self.stop()
            return self.process.returncode, "", log
        return int(line), *(path.read_text(errors="replace") if path.exists() else "" for path in (out, err))

    def _read_line(self, deadline: float) -> bytes:
        """The server's next line (b"" when it closed its stdout), or TimeoutError at ``deadline``."""
        fd, line = self.process.stdout.fileno(), b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                if not selector.select(max(deadline - time.monotonic(), 0.0)):
                    raise TimeoutError
                chunk = os.read(fd, 64)
                if not chunk:
                    return b""
                line += chunk
        return line

    def stop(self) -> None:
        """Kill the server and the child it may be running; the next verification starts another."""
        if _ProbeServer.running is self:
            _ProbeServer.running = None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _stop_probe_server() -> None:
    if _ProbeServer.running is not None:
        _ProbeServer.running.stop()


def _forget_probe_server() -> None:
    """In a forked child: the server is the parent's to use and stop, not the child's."""
    _ProbeServer.running = None
    _ProbeServer.lock = threading.Lock()


atexit.register(_stop_probe_server)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_probe_server)


def _worker_failure(detail: str) -> dict:
    return {"artifact": "(fresh process)", "check": "load every artifact", "ok": False, "detail": detail}


def require_verified(bundle: str | Path) -> VerifyReport:
    """Verify and raise :class:`BundleError` naming the failed artifacts (for ``publish``)."""
    report = verify_bundle(bundle)
    if not report.ok:
        raise BundleError(
            f"{bundle} fails verification ({report.failed_artifacts()}): run `dwise-predict verify {bundle}` for details"
        )
    return report

