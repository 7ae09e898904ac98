"""``dwise-predict export``: turn a training run directory into a predictor bundle (contract 2).

Everything is written into a temporary sibling directory and renamed into place at the end, so a
failed export leaves nothing behind and an existing bundle is never half-overwritten.

Bundle files (all listed with sha256 and size in the sealed ``bundle.json``):

===================  ============================================================  ======
file                 what                                                          pickle
===================  ============================================================  ======
refine.safetensors   the run's weights, unchanged (rebuild with build_refine_graph)  no
calibration.json     the isotonic knots                                              no
refine.onnx          calibrated ensemble, one graph, dynamic batch (opset 18)        no
refine.pt            the same graph as TorchScript                                   yes
refine.pt2           the same graph as a torch.export program                        yes
refine.int8.onnx     refine.onnx with int8 weights, kept only if it ranks like fp32   no
admission.txt        LightGBM text model (log1p target)                              no
admission.onnx       the same trees, output mapped back to total rounds              no
probes.safetensors   probe inputs, eager raw and calibrated / LightGBM outputs        no
README.md            model card (Hugging Face front matter)                          no
===================  ============================================================  ======
"""

from __future__ import annotations

import datetime as dt
import math
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from dwise_predict.errors import BundleError, InputError
from dwise_predict.exports.admission_export import (
    ONNX_OPSET as ADMISSION_OPSET,
    admission_to_onnx,
    load_booster,
    predict_total_rounds,
)
from dwise_predict.bundles.manifest import (
    BUNDLE_FILE,
    BUNDLE_SCHEMA_VERSION,
    NAME_PATTERN,
    PROBES_FILE,
    SIGNAL_COUNT,
    BundleManifest,
    printable,
    write_bundle_manifest,
)
from dwise_predict.exports.model_card import model_card
from dwise_predict.exports.probe_worker import RAW_PROBE, TOLERANCE, calibrated_band, outside_band
from dwise_predict.features.prompt import FEATURE_NAMES
from dwise_predict.files import atomic_dir, claim_output, sha256_file, utf8_name
from dwise_predict.names import EARLY_SIGNALS, HIDDEN_STATES
from dwise_predict.exports.refine_export import (
    ONNX_OPSET as REFINE_OPSET,
    INPUT_NAMES,
    INT8_MIN_SPEARMAN,
    FusedRefineGraph,
    export_onnx,
    export_program,
    export_torchscript,
    quantize_int8,
)
from dwise_predict.runs import RunFiles, load_run
from dwise_predict.survival.network import isotonic_interp
from dwise_predict.versions import package_versions

# the fused graph against the eager one, relative (probe_worker.calibrated_band): half of verify's
# tolerance, leaving the other half to the runtimes that execute the fused graph (TorchScript, ONNX Runtime)
EXPORT_TOLERANCE = TOLERANCE / 2
# What each artifact is, for loaders choosing a path: pickle-bearing files load only after their hash
# matches and their content passes bundles/screen.py. Its names are manifest.BUNDLE_ARTIFACTS, the
# only files a loader reads (tests/test_hostile_bundles.py holds the two together).
ARTIFACTS = {
    "refine.safetensors": {"role": "refine weights", "format": "safetensors", "pickle": False},
    "calibration.json": {"role": "refine calibration", "format": "json", "pickle": False},
    "refine.onnx": {"role": "refine graph", "format": "onnx", "opset": REFINE_OPSET, "pickle": False},
    "refine.pt": {"role": "refine graph", "format": "torchscript", "pickle": True},
    "refine.pt2": {"role": "refine graph", "format": "torch.export", "pickle": True},
    "refine.int8.onnx": {"role": "refine graph, int8 weights (faster, approximate)", "format": "onnx",
                         "opset": REFINE_OPSET, "pickle": False, "min_spearman": INT8_MIN_SPEARMAN},
    "admission.txt": {"role": "admission model", "format": "lightgbm-text", "pickle": False},
    "admission.onnx": {"role": "admission model", "format": "onnx", "opset": ADMISSION_OPSET, "pickle": False},
    PROBES_FILE: {"role": "verification probes", "format": "safetensors", "pickle": False},
    "README.md": {"role": "model card", "format": "markdown", "pickle": False},
}

def export_bundle(
    run: str | Path,
    out: str | Path,
    *,
    name: str | None = None,
    created: str | None = None,
    force: bool = False,
    n_probes: int = 64,
    seed: int = 0,
) -> Path:
    """Export run directory ``run`` as a bundle directory ``out``; return ``out``.

    Parameters
    ----------
    name : bundle name for the zoo (default: the run directory's name); letters, digits, ``._-``.
    created : ISO-8601 creation time recorded in ``bundle.json`` (default: now, UTC). Pass a fixed
        value for byte-identical ``bundle.json`` files across exports of the same run.
    force : replace an existing bundle at ``out`` (the old one stays intact until the new one is
        complete); anything else at ``out`` (a run, traces, a foreign folder) is never replaced, and
        ``out`` may not be, contain or lie inside ``run``.
    n_probes, seed : how many probe rows ``verify`` compares on, drawn from the run's input
        statistics with this seed.
    """
    out = Path(out)
    if name is None:
        name = _sanitise(Path(run).resolve().name)
    if not NAME_PATTERN.fullmatch(name):
        raise InputError(f"`name` {printable(name)} must be 1-100 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit")
    if created is None:
        created = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    else:
        try:
            dt.datetime.fromisoformat(created)
        except ValueError:
            raise InputError(f"`created` '{created}' is not an ISO-8601 time (e.g. 2026-01-01T00:00:00+00:00)") from None
    with claim_output(out, [("RUN", run)], "a bundle", BUNDLE_FILE, replace=force, param="force"):
        run_files = load_run(run)
        _export(run_files, out, name, created, n_probes, seed)
    return out


def _export(run_files: RunFiles, out: Path, name: str, created: str, n_probes: int, seed: int) -> None:
    graph = _rebuild_graph(run_files)
    fused = FusedRefineGraph(graph).eval()

    with atomic_dir(out) as tmp:
        for file in ("refine.safetensors", "calibration.json", "admission.txt"):
            shutil.copyfile(run_files.path / file, tmp / file)
        # the run's files read from the run, so that an error names them there, not their temporary copy
        admission_to_onnx(run_files.path / "admission.txt", tmp / "admission.onnx")
        hidden = int(run_files.refine_spec["hidden_size"])
        export_torchscript(fused, tmp / "refine.pt")
        export_program(fused, hidden, tmp / "refine.pt2")
        export_onnx(fused, hidden, tmp / "refine.onnx")
        _write_probes(graph, fused, load_booster(run_files.path / "admission.txt"), run_files, tmp / PROBES_FILE, n_probes, seed)
        int8 = {"probe_spearman": _quantise_if_ranking_holds(tmp), "min_spearman": INT8_MIN_SPEARMAN,
                "kept": (tmp / "refine.int8.onnx").exists()}
        artifacts = {k: v for k, v in ARTIFACTS.items() if (tmp / k).exists() or k == "README.md"}
        manifest = _manifest(run_files, name, created, artifacts, int8)
        # checked as every reader checks it; the card is written before any file is hashed (it is one of them)
        (tmp / "README.md").write_text(model_card(BundleManifest.from_dict(manifest, str(out / BUNDLE_FILE))))
        manifest["files"] = {
            p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())
        }
        write_bundle_manifest(tmp, manifest)


def _rebuild_graph(run: RunFiles):
    """The run's calibrated ensemble as eager :class:`RefineGraph`, shapes checked against the spec."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dwise_predict.survival.network import build_refine_graph

    path = run.path / "refine.safetensors"
    try:
        with utf8_name(path) as name:
            weights = load_file(name)
    except (SafetensorError, OSError) as err:
        raise InputError(f"{path} is not a readable safetensors file ({err}): re-run `dwise-predict train`") from None
    spec = run.refine_spec
    hidden = int(spec["hidden_size"])
    width = hidden * len(HIDDEN_STATES) + 2 + SIGNAL_COUNT
    traces_hidden = run.traces.get("hidden_size", hidden)
    if int(spec["early_signals"]) != SIGNAL_COUNT:
        raise InputError(f"{run.path}: refine.json says {spec['early_signals']} early signals, bundles take "
                         f"{SIGNAL_COUNT}: re-run `dwise-predict train`")
    if int(spec["in_features"]) != width or int(traces_hidden) != hidden:
        raise InputError(
            f"{run.path}: refine.json says hidden size {hidden} / in_features {spec['in_features']} but the traces "
            f"had hidden size {traces_hidden}; the run is inconsistent, re-run `dwise-predict train`"
        )
    if tuple(weights.get("input_mean", torch.empty(0)).shape) != (width,):
        raise InputError(f"{path} lacks input_mean of shape ({width},): re-run `dwise-predict train`")
    try:
        return build_refine_graph(weights, spec, run.calibration)
    except (RuntimeError, KeyError, ValueError) as err:
        first_line = str(err).splitlines()[0]
        raise InputError(f"{path} does not fit refine.json ({first_line}): re-run `dwise-predict train`") from None


def _write_probes(graph, fused, booster, run: RunFiles, path: Path, n: int, seed: int) -> None:
    """Probe inputs drawn around the run's input statistics, with the eager and LightGBM outputs.

    The exported graph (fused) must agree with the eager ensemble before anything is written: a
    disagreement here is a bug in the exporter, not in the user's run.
    """
    from safetensors.numpy import save

    spec = run.refine_spec
    hidden = int(spec["hidden_size"])
    gen = torch.Generator().manual_seed(seed)
    states = hidden * len(HIDDEN_STATES)  # the input's hidden columns: first_round, then prompt_last
    x = graph.input_mean + graph.input_std * torch.randn(n, states + 2 + SIGNAL_COUNT, generator=gen)
    first_round, prompt_last = (x[:, k * hidden:(k + 1) * hidden].contiguous() for k in range(len(HIDDEN_STATES)))
    # the graph's length columns are log(1 + n) / log(1 + norm) (network.refine_input): invert them
    prompt_tokens = torch.expm1(x[:, states] * math.log1p(float(spec["prompt_norm"]))).clamp(min=1).round()
    budget = torch.expm1(x[:, states + 1] * math.log1p(float(spec["budget_norm"]))).clamp(min=1).round()
    early_signals = x[:, states + 2:].contiguous()
    inputs = (first_round, prompt_last, prompt_tokens, budget, early_signals)
    with torch.no_grad():
        raw, fused_out = graph.raw(*inputs), fused(*inputs)
    expected = isotonic_interp(raw, graph.calib_x, graph.calib_y)  # = graph(*inputs), without a second pass
    lo, hi = calibrated_band(expected.numpy(), raw.numpy(), run.calibration, tolerance=EXPORT_TOLERANCE)
    outside = outside_band(fused_out.numpy(), lo, hi)
    if outside.any():
        error = ((fused_out - expected).abs() / expected.abs().clamp(min=1e-3)).max().item()
        raise BundleError(f"internal error: the fused refinement graph differs from the eager one by {error:.2e} "
                          f"({int(outside.sum())} of {n} probes beyond what the calibration makes of a raw "
                          f"estimate within {EXPORT_TOLERANCE:g})")
    words = (prompt_tokens * (0.6 + 0.2 * torch.rand(n, generator=gen))).round()
    newlines = (prompt_tokens * 0.1 * torch.rand(n, generator=gen)).round()
    features = torch.stack([words, newlines, prompt_tokens], dim=1).numpy().astype(np.float32)
    tensors = {
        "refine.first_round": first_round.numpy(),
        "refine.prompt_last": prompt_last.numpy(),
        "refine.prompt_tokens": prompt_tokens.numpy(),
        "refine.budget": budget.numpy(),
        "refine.early_signals": early_signals.numpy(),
        "refine.remaining_rounds": expected.numpy(),
        RAW_PROBE: raw.numpy(),
        "admission.features": features,
        "admission.total_rounds": predict_total_rounds(booster, features).astype(np.float32),
    }
    path.write_bytes(save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}))  # a full disk: OSError


def _quantise_if_ranking_holds(bundle: Path) -> float:
    """Write ``refine.int8.onnx`` when its Spearman rho against the eager probe outputs is at least
    :data:`INT8_MIN_SPEARMAN`; return that rho (the file is removed when it falls short)."""
    import onnxruntime as ort
    from safetensors.numpy import load_file

    from dwise_predict.exports.probe_worker import spearman

    quantize_int8(bundle / "refine.onnx", bundle / "refine.int8.onnx")
    probes = load_file(str(bundle / PROBES_FILE))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle / "refine.int8.onnx"), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {n: probes[f"refine.{n}"] for n in INPUT_NAMES})[0]
    rho = spearman(probes["refine.remaining_rounds"], got)
    if not rho >= INT8_MIN_SPEARMAN:
        (bundle / "refine.int8.onnx").unlink()
    return round(rho, 6) if np.isfinite(rho) else None


def _manifest(run: RunFiles, name: str, created: str, artifacts: dict, int8: dict) -> dict:
    """``bundle.json`` content with no ``files`` yet (they are listed once every file is written) and
    without the seal (added by :func:`write_bundle_manifest`)."""
    spec = {k: v for k, v in run.refine_spec.items()}
    hidden = int(spec["hidden_size"])
    metrics = dict(run.metrics)
    if run.loco is not None:
        metrics["loco"] = run.loco
    return {
        "schema_version": BUNDLE_SCHEMA_VERSION,
        "name": name,
        "created": created,
        "model": run.traces["model"],
        "decoding": run.traces.get("decoding", {}),
        "inputs": {
            "admission": {"features": list(FEATURE_NAMES), "dtype": "float32", "shape": ["B", 3],
                          "output": {"total_rounds": ["B"]}},
            "refine": {
                **spec,
                "dtype": "float32",
                "tensors": {"first_round": ["B", hidden], "prompt_last": ["B", hidden], "prompt_tokens": ["B"],
                            "budget": ["B"], "early_signals": ["B", SIGNAL_COUNT]},
                "early_signal_columns": list(EARLY_SIGNALS),
                "output": {"remaining_rounds": ["B"]},
            },
        },
        "K": int(spec["num_rounds"]),
        "metrics": _json_safe(metrics),
        "training_data": {"fingerprint": run.traces.get("fingerprint"), "path": run.traces.get("path")},
        # the training options, so that `refresh` retrains with what made this bundle (an optional key:
        # readers ignore keys they do not use, so no schema change; absent in older bundles)
        "recipe": {k: v for k, v in run.config.items() if k not in ("versions", "traces")},
        "artifacts": artifacts,
        "int8": int8,
        "versions": {"export": package_versions(), "train": run.config.get("versions", {})},
        "probes": PROBES_FILE,
        "files": {},
    }


def _json_safe(value):
    """NaN and inf (which strict JSON cannot hold) become null, as metrics.json uses for "n/a"."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _sanitise(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    return cleaned[:100] or "bundle"
