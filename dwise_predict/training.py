"""Training: fit both predictors on a trace dataset's train split, evaluate on its eval split, and
write a run directory.

Three layers, each usable on its own:

- :func:`fit_predictors` — no file I/O: admission LightGBM + survival ensemble + isotonic calibration
  fitted on one :class:`~dwise_predict.traces.TraceDataset` (leave-one-category-out evaluation calls it
  once per category);
- :func:`evaluate_predictors` — the metrics.json dict on another dataset;
- :func:`train_run` — load traces, fit, evaluate, write the run directory.

Run directory (the contract with ``export`` and ``evaluate``)::

    RUN/
      config.json         resolved TrainConfig, seed, package versions, traces {path, fingerprint,
                          model, decoding, hidden_size}
      metrics.json        eval-split metrics (see evaluate_predictors)
      admission.txt       LightGBM text model, target log1p(total_rounds), features words, newlines,
                          prompt_tokens
      admission.json      {"features", "target", "params"}
      refine.safetensors  network.refine_state(...): input_mean, input_std [H+2], member{i}.fc1/fc2
      refine.json         {"hidden_size", "in_features", "num_rounds", "width", "dropout", "members",
                           "seeds", "prompt_norm", "budget_norm", "target"}
      calibration.json    {"x": [...], "y": [...], "fitted_on": "train", "statistic"}
      curves.json         per member: seed, train_loss, val_loss per epoch, best_epoch
      curves.png          training curves

``train_run`` writes everything into a hidden temporary directory next to ``RUN`` and renames it to
``RUN`` only at the end, so an interrupted or failed train never leaves a directory that looks
complete: rerunning the same command simply starts the run again (leftover temporary directories of
dead processes are removed). An existing ``RUN`` is never touched unless ``overwrite=True``, and
then it is replaced only once the new run is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dwise_predict.admission.model import AdmissionModel
from dwise_predict.errors import ConfigError, StoreError, TraceError
from dwise_predict.evaluation import metrics as M
from dwise_predict.features.prompt import prompt_features
from dwise_predict.survival.calibration import IsotonicCalibrator
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.traces import TraceDataset, load_traces
from dwise_predict.versions import package_versions

CENSORED_COLUMN = "censored"
_RECORD_KEYS = {"seeds", "versions", "traces"}  # what config.json records besides the options


@dataclass
class TrainConfig:
    """Every knob of a training run (saved whole in config.json).

    Member seeds are ``seed, seed + 1, ..., seed + members - 1``; the validation split and the
    bootstrap use ``seed`` too, so one number fixes the run.
    """

    seed: int = 0
    # admission predictor (LightGBM)
    admission_trees: int = 100
    admission_leaves: int = 15
    admission_learning_rate: float = 0.1
    admission_min_child_samples: int = 20
    # refinement predictor (survival ensemble)
    width: int = 256
    dropout: float = 0.2
    members: int = 3
    max_epochs: int = 100
    patience: int = 10
    lr: float = 1e-3
    weight_decay: float = 1e-4
    batch_size: int = 256
    val_fraction: float = 0.2
    # calibration: "median" (centred isotonic median regression) or "mean" (squared-error isotonic)
    calibration: str = "median"
    # evaluation
    bootstrap: int = 1000
    # threads for torch and LightGBM, fixed so that results do not depend on the machine's core count.
    # 1 by default: on 2 shared cores a 2-thread OpenMP fit ran ~20x slower than 1 thread (126 s vs
    # 5.6 s for the 2,048 x 2,048 benchmark) because its threads wait on each other at every barrier.
    num_threads: int = 1
    seeds: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.seeds = tuple(self.seed + i for i in range(max(self.members, 0)))

    def check(self) -> None:
        """Raise ConfigError listing every option that cannot work."""
        problems = []
        positive = ("admission_trees", "admission_leaves", "admission_min_child_samples", "width", "members",
                    "max_epochs", "patience", "batch_size", "num_threads")
        problems += [f"{name} must be >= 1 (got {getattr(self, name)})" for name in positive if getattr(self, name) < 1]
        if self.admission_leaves < 2:
            problems.append(f"admission_leaves must be >= 2 (got {self.admission_leaves})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must lie in [0, 1) (got {self.dropout})")
        if not 0.0 < self.val_fraction < 1.0:
            problems.append(f"val_fraction must lie in (0, 1) (got {self.val_fraction})")
        if not (self.lr > 0 and self.admission_learning_rate > 0 and self.weight_decay >= 0):
            problems.append("lr and admission_learning_rate must be > 0, weight_decay >= 0")
        if self.calibration not in ("median", "mean"):
            problems.append(f"calibration must be 'median' or 'mean' (got {self.calibration!r})")
        if self.bootstrap < 0:
            problems.append(f"bootstrap must be >= 0 (got {self.bootstrap})")
        if problems:
            raise ConfigError("; ".join(problems))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seeds": list(self.seeds)}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """A config from a dict of options (a --config file, or a run's config.json, whose extra
        record keys are ignored); unknown options raise ConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names - _RECORD_KEYS)
        if unknown:
            raise ConfigError(f"unknown training options {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        config = cls(**{k: v for k, v in data.items() if k in names})
        config.check()
        return config


@dataclass
class Targets:
    """What a dataset says about each request's work: total rounds, remaining after the first, finished?"""

    total: np.ndarray  # (N,) float64, total denoising rounds
    remaining: np.ndarray  # (N,) int64, total - 1
    events: np.ndarray  # (N,) bool, False where collection was cut short (censored)

    @classmethod
    def of(cls, ds: TraceDataset) -> "Targets":
        total = ds.requests["total_rounds"].to_numpy(dtype=np.float64)
        if (total < 1).any():
            raise TraceError("total_rounds must be >= 1 (every request has a first denoising round): fix those rows")
        events = np.ones(len(ds), dtype=bool)
        if CENSORED_COLUMN in ds.requests.columns:
            censored = ds.requests[CENSORED_COLUMN]
            if censored.isna().any():
                raise TraceError(f"column '{CENSORED_COLUMN}' holds missing values: use true/false")
            events = ~censored.to_numpy().astype(bool)
        return cls(total, (total - 1).astype(np.int64), events)


@dataclass
class Predictors:
    """Both fitted predictors plus the calibration; predictions for any trace dataset of the same model."""

    admission: AdmissionModel
    ensemble: SurvivalEnsemble
    calibrator: IsotonicCalibrator
    n_train: int

    def admission_total(self, ds: TraceDataset) -> np.ndarray:
        """(N,) predicted total denoising rounds from the prompt features."""
        return self.admission.predict(prompt_features(ds.requests))

    def refined_raw(self, ds: TraceDataset) -> np.ndarray:
        """(N,) ensemble mean of remaining rounds after the first denoising round, uncalibrated."""
        return self.ensemble.predict_raw(*_refine_inputs(ds))

    def refined_remaining(self, ds: TraceDataset) -> np.ndarray:
        """(N,) calibrated remaining rounds (on the scale of actual remaining rounds)."""
        return self.calibrator.predict(self.refined_raw(ds))

    def predict_survival(self, ds: TraceDataset) -> np.ndarray:
        """(N, K) ensemble survival curves S(t) = P(remaining > t), t = 0..K-1."""
        return self.ensemble.predict_survival(*_refine_inputs(ds))

    def refine_graph(self):
        """The calibrated ensemble as one torch graph (``network.RefineGraph``), as export builds it."""
        return self.ensemble.graph(self.calibrator.to_json())


def fit_predictors(
    train: TraceDataset,
    config: TrainConfig | None = None,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> Predictors:
    """Fit the admission model, the survival ensemble and the calibration on ``train`` (no file I/O).

    Parameters
    ----------
    train : the requests to fit on (all of them; pass ``ds.split("train")`` for the train split).
    config : the knobs; defaults to ``TrainConfig()``.
    progress : optional ``(member, epoch, train_loss, val_loss)`` callback after each epoch.

    Raises
    ------
    TraceError / InputError / ConfigError for unusable data or options.
    """
    config = config or TrainConfig()
    config.check()
    if len(train) < 8:
        raise TraceError(f"training needs at least 8 requests, got {len(train)}: collect more traces")
    targets = Targets.of(train)
    features = prompt_features(train.requests)
    admission = AdmissionModel(
        n_estimators=config.admission_trees,
        num_leaves=config.admission_leaves,
        learning_rate=config.admission_learning_rate,
        min_child_samples=config.admission_min_child_samples,
        seed=config.seed,
        num_threads=config.num_threads,
    ).fit(features[targets.events], targets.total[targets.events])
    with _torch_threads(config.num_threads):
        ensemble, calibrator = _fit_refinement(train, targets, config, progress)
    return Predictors(admission, ensemble, calibrator, len(train))


def _fit_refinement(train: TraceDataset, targets: Targets, config: TrainConfig, progress) -> tuple:
    """The survival ensemble and its calibration."""
    ensemble = SurvivalEnsemble(
        width=config.width,
        dropout=config.dropout,
        seeds=config.seeds,
        max_epochs=config.max_epochs,
        patience=config.patience,
        lr=config.lr,
        weight_decay=config.weight_decay,
        batch_size=config.batch_size,
        val_fraction=config.val_fraction,
        split_seed=config.seed,
    ).fit(*_refine_inputs(train), targets.remaining, targets.events, progress=progress)
    # Calibrate on every finished training request (as seed 000 does). Measured on synthetic traces:
    # with 3,000 training requests the eval median ratio lands at 0.96-1.03; fitting only on the
    # validation part (never seen by the weights) was noisier there (0.89-1.05), though with ~700
    # training requests the in-sample fit is biased by the network's optimism (0.85-1.16).
    done = targets.events
    raw = ensemble.predict_raw(*(a[done] for a in _refine_inputs(train)))
    calibrator = IsotonicCalibrator(statistic=config.calibration, fitted_on="train").fit(raw, targets.remaining[done])
    return ensemble, calibrator


@contextmanager
def _torch_threads(n: int):
    """Run torch with ``n`` threads inside the block, restoring the caller's setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def evaluate_predictors(predictors: Predictors, eval_ds: TraceDataset, bootstrap: int = 1000, seed: int = 0) -> dict:
    """The metrics.json dict of ``predictors`` on ``eval_ds``.

    Rank metrics and ratios use the finished (uncensored) requests; the survival metrics use all,
    with their event flags. Admission ρ is against total rounds, refined ρ against remaining rounds
    (``total - 1``, the same ranking). ``None`` marks an undefined value (a constant side).
    """
    if len(eval_ds) == 0:
        raise TraceError("no evaluation requests: the traces need an 'eval' split (collect with an eval fraction)")
    targets = Targets.of(eval_ds)
    done = targets.events
    categories = eval_ds.requests["category"].astype(str).to_numpy()
    admission = predictors.admission_total(eval_ds)
    raw = predictors.refined_raw(eval_ds)
    calibrated = predictors.calibrator.predict(raw)
    survival = predictors.predict_survival(eval_ds)

    refined = M.rank_summary(calibrated[done], targets.remaining[done], categories[done], bootstrap, seed)
    refined["concordance_td"] = M.concordance_td(survival, targets.remaining, targets.events)
    last = min(survival.shape[1] - 1, int(targets.remaining.max()))
    refined["integrated_brier"] = (
        M.integrated_brier(survival, targets.remaining, targets.events, np.arange(last + 1)) if last >= 1 else None
    )
    return {
        "n_train": int(predictors.n_train),
        "n_eval": int(len(eval_ds)),
        "admission": M.rank_summary(admission[done], targets.total[done], categories[done], bootstrap, seed),
        "refined": refined,
        "refined_raw": {
            "spearman": M.spearman(raw[done], targets.remaining[done]),
            "within_category_mean": M.within_category(raw[done], targets.remaining[done], categories[done])[0],
        },
        "calibration": {
            "median_ratio_admission": M.median_ratio(admission[done], targets.total[done]),
            "median_ratio_raw": M.median_ratio(raw[done], targets.remaining[done]),
            "median_ratio_calibrated": M.median_ratio(calibrated[done], targets.remaining[done]),
        },
    }


def train_run(
    traces: str | os.PathLike | TraceDataset,
    out: str | os.PathLike,
    config: TrainConfig | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> dict:
    """Load traces, fit on their train split, evaluate on their eval split, write the run directory.

    Returns the metrics dict (also written to ``out/metrics.json``). See the module docstring for the
    layout and the interruption guarantee.
    """
    config = config or TrainConfig()
    config.check()
    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out} already exists: choose another --out or pass --overwrite to replace it")
    ds = traces if isinstance(traces, TraceDataset) else load_traces(traces)
    train, eval_ds = ds.split("train"), ds.split("eval")
    if len(eval_ds) == 0:
        raise TraceError("the traces have no 'eval' split: collect with an eval fraction, or mark some requests eval")

    predictors = fit_predictors(train, config, progress)
    with _torch_threads(config.num_threads):
        metrics = evaluate_predictors(predictors, eval_ds, config.bootstrap, config.seed)

    tmp = _fresh_tmp_dir(out)
    try:
        _write_run(tmp, ds, predictors, metrics, config)
        old = tmp.with_name(tmp.name + "-old")
        if out.exists():  # move the old run aside first: it goes only once the new one is in place
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return metrics


def _refine_inputs(ds: TraceDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        ds.first_round,
        ds.requests["prompt_tokens"].to_numpy(dtype=np.float32),
        ds.requests["budget"].to_numpy(dtype=np.float32),
    )


def _write_run(run: Path, ds: TraceDataset, predictors: Predictors, metrics: dict, config: TrainConfig) -> None:
    from safetensors.torch import save_file

    predictors.admission.save(run)
    save_file(predictors.ensemble.state(), str(run / "refine.safetensors"))
    _write_json(run / "refine.json", predictors.ensemble.spec())
    _write_json(run / "calibration.json", predictors.calibrator.to_json())
    _write_json(run / "curves.json", {"members": predictors.ensemble.history_})
    _plot_curves(predictors.ensemble.history_, run / "curves.png")
    _write_json(run / "metrics.json", metrics)
    _write_json(
        run / "config.json",
        {
            **config.to_dict(),
            "versions": package_versions(),
            "traces": {
                "path": str(ds.path) if ds.path else None,
                "fingerprint": ds.fingerprint(),
                "model": ds.manifest.get("model"),
                "decoding": ds.manifest.get("decoding"),
                "hidden_size": ds.hidden_size,
            },
        },
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _plot_curves(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, h in enumerate(history):
        line = ax.plot(h["train_loss"], label=f"member {m} (seed {h['seed']}) train")[0]
        ax.plot(h["val_loss"], "--", color=line.get_color(), label=f"member {m} val")
        ax.axvline(h["best_epoch"], color=line.get_color(), alpha=0.3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("logistic-hazard NLL")
    ax.set_title("Survival ensemble training (vertical lines: kept epoch)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _fresh_tmp_dir(out: Path) -> Path:
    """A new hidden directory next to ``out``; removes leftovers of processes that no longer run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except OSError as err:
        raise StoreError(f"cannot write next to {out}: {err.strerror}") from None
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_predictors(run: str | os.PathLike) -> Predictors:
    """Rebuild the fitted predictors from a run directory written by :func:`train_run`."""
    from safetensors.torch import load_file

    run = Path(run)
    needed = ("admission.txt", "refine.safetensors", "refine.json", "calibration.json")
    missing = [name for name in needed if not (run / name).is_file()]
    if missing:
        raise StoreError(f"{run} is not a complete run directory (no {', '.join(missing)}): run `dwise-predict train`")
    try:
        spec = json.loads((run / "refine.json").read_text())
        calibration = json.loads((run / "calibration.json").read_text())
        metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else {}
        weights = load_file(str(run / "refine.safetensors"))
    except (json.JSONDecodeError, OSError, ValueError) as err:
        raise StoreError(f"cannot read the run directory {run}: {err}") from None
    return Predictors(
        AdmissionModel.load(run),
        SurvivalEnsemble.from_state(weights, spec),
        IsotonicCalibrator.from_json(calibration),
        int(metrics.get("n_train", 0)),
    )
