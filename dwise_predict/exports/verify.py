"""``dwise-predict verify``: check a bundle's hashes, then load and run every artifact.

1. ``bundle.json`` must match its seal; the directory hold only the artifacts a bundle may hold, as
   regular files (:func:`~dwise_predict.exports.screen.check_layout`: refused outright, in one line);
   every listed file its sha256 and size; no unlisted files.
2. Only when all hashes match: every file's content is screened without deserialising it
   (:func:`~dwise_predict.exports.screen.screen_bundle`: pickles, code, ONNX external data, declared
   shapes; a hostile file is refused outright, in one line). Then a fresh interpreter (``python -I -m
   dwise_predict.exports.probe_worker``) loads every artifact without the training stack and compares
   TorchScript, torch.export and ONNX with the eager outputs stored in ``probes.safetensors``
   (inside the calibration of a raw estimate within 1e-4 of eager, see ``probe_worker.calibrated_band``),
   and ONNX admission with LightGBM.
3. Here, LightGBM re-predicts the probes from ``admission.txt`` (the stored reference itself).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import BundleError
from dwise_predict.exports.manifest import read_bundle_manifest, unlisted_files
from dwise_predict.exports.probe_worker import TOLERANCE, relative_error
from dwise_predict.exports.screen import check_layout, read_checked, screen_bundle
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
             "detail": f"schema {manifest['schema_version']}"}]
    rows += _hash_rows(bundle, manifest)
    if not all(row["ok"] for row in rows):
        rows.append({"artifact": "(all)", "check": "load and compare", "ok": False,
                     "detail": "skipped: nothing is deserialised until every hash matches"})
        return VerifyReport(bundle, rows, [])
    screen_bundle(bundle, manifest)
    rows.append(_lightgbm_row(bundle, manifest))
    worker_rows, modules = _run_worker(bundle, timeout_s)
    return VerifyReport(bundle, rows + worker_rows, modules)


def _hash_rows(bundle: Path, manifest: dict) -> list[dict]:
    rows = []
    for name, entry in sorted(manifest.get("files", {}).items()):
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


def _lightgbm_row(bundle: Path, manifest: dict) -> dict:
    from safetensors.numpy import load

    from dwise_predict.exports.admission_export import load_booster, predict_total_rounds

    try:
        probes = load(read_checked(bundle, manifest, manifest["probes"]))
        booster = load_booster(bundle / "admission.txt", read_checked(bundle, manifest, "admission.txt"))
        predicted = predict_total_rounds(booster, probes["admission.features"])
        error = relative_error(probes["admission.total_rounds"], predicted)
        ok, detail = error <= TOLERANCE, f"max rel err {error:.1e} against the probes"
    except Exception as err:  # a failed load is a failed row
        ok, detail = False, f"{type(err).__name__}: {err}"
    return {"artifact": "admission.txt", "check": "LightGBM vs probes", "ok": ok, "detail": detail}


def _run_worker(bundle: Path, timeout_s: float) -> tuple[list[dict], list[str]]:
    """Run the probe worker in a fresh isolated interpreter and read its JSON answer."""
    command = [sys.executable, "-I", "-m", "dwise_predict.exports.probe_worker", str(bundle.resolve())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [_worker_failure(f"no answer within {timeout_s:.0f} s")], []
    try:
        answer = loads_json(done.stdout, BundleError, "the probe worker's answer", allow_nan=True)  # NaN: a broken graph
    except BundleError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [_worker_failure(f"exit {done.returncode}: {tail}")], []
    if "error" in answer:
        return [_worker_failure(answer["error"])], []
    return answer["rows"], answer["modules"]


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

