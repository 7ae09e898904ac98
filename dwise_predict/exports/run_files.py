"""Reading a training run directory (the output of ``dwise-predict train``) for export.

The layout is agreed with ``train``: ``config.json``, ``metrics.json``, ``admission.txt``,
``admission.json``, ``refine.safetensors``, ``refine.json``, ``calibration.json`` (+ optional
``loco.json``, ``curves.json``, ``curves.png``). Export reads only these files, never CLI flags, so
a bundle is fully determined by its run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import InputError

REQUIRED_FILES = (
    "config.json",
    "metrics.json",
    "admission.txt",
    "refine.safetensors",
    "refine.json",
    "calibration.json",
)
REFINE_SPEC_KEYS = ("hidden_size", "in_features", "num_rounds", "width", "members", "prompt_norm", "budget_norm")


@dataclass
class RunFiles:
    """The parsed JSON pieces of a run directory plus its path (weights stay on disk until used)."""

    path: Path
    config: dict
    metrics: dict
    refine_spec: dict
    calibration: dict
    loco: dict | None

    @property
    def traces(self) -> dict:
        """``config.json``'s ``traces`` block: path, fingerprint, model, decoding, hidden_size."""
        return self.config.get("traces", {})


def load_run(path: str | Path) -> RunFiles:
    """Check a run directory holds everything a bundle needs and parse its JSON files.

    Raises
    ------
    InputError
        naming the missing or unreadable file and the command that writes it.
    """
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"no run directory at {path}: train one with `dwise-predict train TRACES --out {path}`")
    if not (path / "calibration.json").is_file() and (path / "refine.json").is_file():
        raise InputError(
            f"run {path} has no calibration.json: its refinement predictor is uncalibrated and a bundle needs "
            "the isotonic map; re-run `dwise-predict train` to completion"
        )
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise InputError(
            f"run {path} lacks {', '.join(missing)}: it is not a finished training run; "
            "re-run `dwise-predict train` to completion"
        )
    parsed = {name: _read_json(path / name) for name in ("config.json", "metrics.json", "refine.json", "calibration.json")}
    loco = _read_json(path / "loco.json") if (path / "loco.json").is_file() else None
    spec, calibration = parsed["refine.json"], parsed["calibration.json"]
    absent = [key for key in REFINE_SPEC_KEYS if key not in spec]
    if absent:
        raise InputError(f"{path / 'refine.json'} lacks {', '.join(absent)}: re-run `dwise-predict train`")
    xs, ys = calibration.get("x"), calibration.get("y")
    if not isinstance(xs, list) or not isinstance(ys, list) or not xs or len(xs) != len(ys):
        raise InputError(
            f"{path / 'calibration.json'} needs equal-length non-empty lists 'x' and 'y': re-run `dwise-predict train`"
        )
    if any(b < a for a, b in zip(xs, xs[1:])):
        raise InputError(f"{path / 'calibration.json'}: knots 'x' must be increasing; re-run `dwise-predict train`")
    if "model" not in parsed["config.json"].get("traces", {}):
        raise InputError(
            f"{path / 'config.json'} has no traces.model fingerprint: a bundle must name the dLLM it was trained "
            "for; re-run `dwise-predict train`"
        )
    return RunFiles(path, parsed["config.json"], parsed["metrics.json"], spec, calibration, loco)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not valid JSON ({err}): the run is corrupt; re-run `dwise-predict train`") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} must hold a JSON object: the run is corrupt; re-run `dwise-predict train`")
    return value
