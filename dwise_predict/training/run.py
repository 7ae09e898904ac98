"""A training run: load traces, fit, evaluate, and write the run directory (the one writer).

The layout and its reader are in :mod:`dwise_predict.runs`. :func:`train_run` writes everything
into a hidden temporary directory next to ``RUN`` and renames it to ``RUN`` only at the end
(:func:`dwise_predict.files.atomic_dir`), so an interrupted or failed train never leaves a
directory that looks complete: rerunning the same command simply starts the run again (leftover
temporary directories of dead processes are removed). An existing ``RUN`` is never touched unless
``overwrite=True``, and then it is replaced only once the new run is complete, and only when it is a
run directory (a trace dataset or a foreign folder never is); an overwrite killed between its two
renames is put back by the rerun. ``RUN`` may not be, contain or lie inside the traces, and is
locked for the whole run, so a second ``train`` into the same ``RUN`` is refused at once.
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from dwise_predict.admission.model import AdmissionModel
from dwise_predict.errors import ConfigError, InputError, TraceError
from dwise_predict.files import atomic_dir, claim_output, read_json_object, utf8_name
from dwise_predict.runs import RUN_CONTENTS, RUN_MARKER, RunFiles, load_run
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.traces import TraceDataset, load_traces
from dwise_predict.training.config import TrainConfig
from dwise_predict.training.fit import Predictors, evaluate_predictors, fit_predictors, torch_threads
from dwise_predict.versions import package_versions


def train_run(
    traces: str | os.PathLike | TraceDataset,
    out: str | os.PathLike,
    config: TrainConfig | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int, float, float], None] | None = None,
    jobs: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Load traces, fit on their train split, evaluate on their eval split, write the run directory.
    ``jobs``: threads for the candidates' cross-validation (:func:`~.fit.fit_predictors`); ``log``:
    told as each stage starts (progress lines; the run does not depend on it).

    Returns the metrics dict (also written to ``out/metrics.json``). See the module docstring for the
    layout (:mod:`dwise_predict.runs`) and the interruption guarantee.
    """
    config = config or TrainConfig()
    config.check()
    source = traces.path if isinstance(traces, TraceDataset) else traces
    with claim_output(out, [("TRACES", source)], "a run directory", RUN_MARKER, replace=overwrite, param="overwrite",
                      contents=RUN_CONTENTS):
        ds = traces if isinstance(traces, TraceDataset) else load_traces(traces)
        train, eval_ds = ds.split("train"), ds.split("eval")
        if len(eval_ds) == 0:
            raise TraceError("the traces have no 'eval' split: collect with an eval fraction, or mark some requests eval")

        train = exclude_categories(ds, train, config.exclude)

        predictors = fit_predictors(train, config, progress, jobs, log)
        if log:
            log(f"scoring the eval split ({len(eval_ds)} requests)")
        # the training curves are drawn (matplotlib's import and the PNG, ~1 s) on the core the evaluation
        # leaves idle; a failure there is raised when write_run asks for the picture
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwise-curves") as pool:
            curves = pool.submit(_plot_curves, predictors.ensemble.history_)
            with torch_threads(config.num_threads):
                metrics = evaluate_predictors(predictors, eval_ds, config.bootstrap, config.seed)
            if config.exclude:
                metrics["excluded"] = _excluded_summary(metrics, config.exclude, len(ds.split("train")) - len(train))

            with atomic_dir(out) as tmp:
                write_run(tmp, ds, predictors, metrics, config, curves=curves.result)
    return metrics


def exclude_categories(ds: TraceDataset, train: TraceDataset, exclude) -> TraceDataset:
    """``train`` without the requests of the ``exclude`` categories (``train --exclude``); ConfigError
    names an unknown category (against every category of ``ds``) or an exclusion that leaves nothing."""
    if not exclude:
        return train
    known = sorted(set(ds.requests["category"].astype(str)))
    unknown = [c for c in exclude if c not in known]
    if unknown:
        raise ConfigError(f"`exclude` {', '.join(unknown)}: no such category in the traces; known: {', '.join(known)}")
    kept = train.subset(~train.requests["category"].astype(str).isin(list(exclude)).to_numpy())
    if len(kept) < 8:
        raise ConfigError(f"`exclude` {', '.join(exclude)} leaves {len(kept)} training requests: exclude fewer categories")
    return kept


def _excluded_summary(metrics: dict, exclude, n_removed: int) -> dict:
    """What the eval split says about the categories left out of training (held out: never seen)."""
    def mean(block: str):
        values = [metrics[block]["per_category"].get(c) for c in exclude]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "categories": list(exclude),
        "n_train_removed": int(n_removed),
        "admission_within_category_held_out": mean("admission"),
        "refined_within_category_held_out": mean("refined"),
    }


def write_run(run: Path, ds: TraceDataset, predictors: Predictors, metrics: dict, config: TrainConfig,
              curves: Callable[[], bytes] | None = None) -> None:
    """Write every file of the run directory format (:mod:`dwise_predict.runs`) into ``run``.
    ``curves``: returns curves.png's bytes when the caller drew them already (else drawn here)."""
    from safetensors.torch import save

    predictors.admission.save(run)
    (run / "refine.safetensors").write_bytes(save(predictors.ensemble.state()))  # a full disk: OSError, not SafetensorError
    _write_json(run / "refine.json", predictors.ensemble.spec())
    _write_json(run / "calibration.json", predictors.calibrator.to_json())
    _write_json(run / "candidates.json", predictors.selection)
    _write_json(run / "curves.json", {"members": predictors.ensemble.history_})
    (run / "curves.png").write_bytes(curves() if curves is not None else _plot_curves(predictors.ensemble.history_))
    _write_json(run / "metrics.json", metrics)
    _write_json(
        run / "config.json",
        {
            **config.to_dict(),
            "versions": package_versions(),
            "traces": {
                "path": str(ds.path) if ds.path else None,
                "fingerprint": ds.data_hash(),
                "model": ds.manifest.get("model"),
                "decoding": ds.manifest.get("decoding"),
                "hidden_size": ds.hidden_size,
            },
        },
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _plot_curves(history: list[dict]) -> bytes:
    """curves.png's bytes. Drawn on a bare ``Figure`` (no pyplot state), so it may run in any thread."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for m, h in enumerate(history):
        line = ax.plot(h["train_loss"], label=f"member {m} (seed {h['seed']}) train")[0]
        ax.plot(h["val_loss"], "--", color=line.get_color(), label=f"member {m} val")
        ax.axvline(h["best_epoch"], color=line.get_color(), alpha=0.3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("logistic-hazard NLL")
    ax.set_title("Survival ensemble training (vertical lines: kept epoch)")
    if history:  # the ridge candidate has no training curves
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, metadata={"Software": None})
    return png.getvalue()


def load_predictors(run: str | os.PathLike | RunFiles) -> Predictors:
    """Rebuild the fitted predictors from a run directory (a path, or what :func:`load_run` read)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    run = run if isinstance(run, RunFiles) else load_run(run)
    try:
        with utf8_name(run.path / "refine.safetensors") as name:
            weights = load_file(name)
    except (OSError, SafetensorError) as err:
        raise InputError(f"cannot read {run.path / 'refine.safetensors'} ({err}): re-run `dwise-predict train`") from None
    return Predictors(
        AdmissionModel.load(run.path),
        SurvivalEnsemble.from_state(weights, run.refine_spec),
        IsotonicCalibrator.from_json(run.calibration),
        int(run.metrics.get("n_train", 0)),
        _read_selection(run.path),
    )


def _read_selection(path: Path) -> dict:
    """candidates.json when the run has one (runs written before candidates existed do not)."""
    try:
        return read_json_object(path / "candidates.json", InputError)
    except (OSError, InputError):
        return {}
