"""The run directory: the output of ``dwise-predict train``, read by ``evaluate`` and ``export``.

One format, one reader (:func:`load_run`, raising :class:`InputError`) and one writer
(:func:`dwise_predict.training.run.write_run`). The format and its reader live here, below both
training and exports, because exports must not import the training stack::

    RUN/
      config.json         resolved TrainConfig, seed, package versions and the source fingerprint,
                          traces {path, fingerprint (the traces' data hash), model (fingerprint),
                          decoding, hidden_size}
      metrics.json        eval-split metrics (see training.fit.evaluate_predictors)
      admission.txt       LightGBM text model, target log1p(total_rounds), features words, newlines,
                          prompt_tokens
      admission.json      {"features", "target", "params"}
      refine.safetensors  network.refine_state(...): input_mean, input_std [2H+2+S] (H per hidden state, S early
                          signals), member{i}.fc1/fc2, member{i}.fc1_short when short_width > 0
      refine.json         {"hidden_size" (per state), "hidden_states", "early_signals", "in_features", "num_rounds",
                           "width", "short_features", "short_width", "dropout", "members", "seeds", "prompt_norm",
                           "budget_norm", "length_scale", "target", "candidate"}
      calibration.json    {"x": [...], "y": [...], "fitted_on": "train" or "train, out of fold", "statistic"}
      candidates.json     the refinement candidate search (training.select): CV scores, chosen candidate
      curves.json         per member: seed, train_loss, val_loss per epoch, best_epoch
      curves.png          training curves
      loco.json           optional: read when present (export copies it into bundle metrics), written by no command

Export reads only these files, never CLI flags, so a bundle is fully determined by its run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import InputError
from dwise_predict.files import read_json_object
from dwise_predict.names import LENGTH_SCALE

REQUIRED_FILES = (
    "config.json",
    "metrics.json",
    "admission.txt",
    "refine.safetensors",
    "refine.json",
    "calibration.json",
)
RUN_MARKER = "refine.json"  # a directory holding it is a run: `train --overwrite` may replace it
# what a run holds, by kind (the files above, and JSON records a newer version may add): a folder
# holding anything else is yours, never replaced with the run
RUN_CONTENTS = ("*.json", "admission.txt", "*.safetensors", "*.png")
REFINE_SPEC_KEYS = ("hidden_size", "early_signals", "in_features", "num_rounds", "width", "members", "prompt_norm",
                    "budget_norm")


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
    """Check a run directory holds everything evaluate and export need and parse its JSON files.

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
    if missing and (path / "manifest.json").is_file() and (path / "requests.parquet").is_file():
        raise InputError(f"{path} is a trace dataset, not a training run: train one first "
                         f"(`dwise-predict train {path} --out RUN`) and pass RUN")
    if missing:
        raise InputError(
            f"run {path} lacks {', '.join(missing)}: it is not a finished training run; "
            "re-run `dwise-predict train` to completion"
        )
    parsed = {name: _read_json(path / name) for name in ("config.json", "metrics.json", "refine.json", "calibration.json")}
    loco = _read_json(path / "loco.json") if (path / "loco.json").is_file() else None
    spec, calibration = parsed["refine.json"], parsed["calibration.json"]
    if "early_signals" not in spec:
        raise InputError(f"{path} was trained by an older dwise-predict whose refinement input lacks the early "
                         "signals: re-run `dwise-predict train` on its traces")
    if spec.get("length_scale") != LENGTH_SCALE:
        raise InputError(f"{path} was trained by an older dwise-predict whose refinement input takes prompt length "
                         "and budget on a linear scale: re-run `dwise-predict train` on its traces")
    absent = [key for key in REFINE_SPEC_KEYS if not _is_number(spec.get(key))]
    if absent:
        raise InputError(f"{path / 'refine.json'} lacks numbers {', '.join(absent)}: re-run `dwise-predict train`")
    xs, ys = calibration.get("x"), calibration.get("y")
    if (not isinstance(xs, list) or not isinstance(ys, list) or not xs or len(xs) != len(ys)
            or not all(map(_is_number, xs + ys))):
        raise InputError(
            f"{path / 'calibration.json'} needs equal-length non-empty lists of numbers 'x' and 'y': "
            "re-run `dwise-predict train`"
        )
    if any(b < a for a, b in zip(xs, xs[1:])):
        raise InputError(f"{path / 'calibration.json'}: knots 'x' must be increasing; re-run `dwise-predict train`")
    traces = parsed["config.json"].get("traces")
    if not isinstance(traces, dict) or not isinstance(traces.get("model"), dict):
        raise InputError(
            f"{path / 'config.json'} has no traces.model fingerprint: a bundle must name the dLLM it was trained "
            "for; re-run `dwise-predict train`"
        )
    return RunFiles(path, parsed["config.json"], parsed["metrics.json"], spec, calibration, loco)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_json(path: Path) -> dict:
    return read_json_object(path, InputError, fix="the run is corrupt; re-run `dwise-predict train`")
