"""Every knob of a predictor training run, reading them from a ``--config`` JSON file, and how many
workers the cores hold (:func:`default_jobs`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from dwise_predict.errors import ConfigError
from dwise_predict.files import read_json_object

_RECORD_KEYS = {"seeds", "versions", "traces"}  # what config.json records besides the options
# The largest seed any command takes: scikit-learn and numpy's legacy generator refuse seeds past
# 2**32 - 1 and torch's past 2**64 - 1, and seeds derived from it (ensemble members, ablation draws,
# arrival replays) add small offsets; 2**31 - 1 leaves them room.
MAX_SEED = 2**31 - 1
# Sizes past which a run cannot be meant, refused before anything is allocated: a width of 10**9 asked
# for 152 GB, 10**5 members never finished, 10**5 OpenMP threads crashed the process (a segfault, not
# an error). Each is far above any useful value (the paper: width 256, 3 members, 100 trees).
LIMITS = {"width": 16_384, "members": 32, "num_threads": 256, "admission_trees": 100_000,
          "admission_leaves": 131_072, "batch_size": 1 << 20, "cv_members": 32, "bootstrap": 100_000, "cv_folds": 100}


def _fits(value, default) -> bool:
    """Whether a JSON value has the type of an option's default (an int is a float; a bool is neither)."""
    if isinstance(value, bool):
        return isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, tuple):  # JSON has lists only
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def default_jobs(n_tasks: int, threads_per_task: int) -> int:
    """Workers used when the caller does not say: as many as the cores hold at ``threads_per_task``
    threads each, never more than tasks."""
    return max(1, min(n_tasks, (os.cpu_count() or 1) // max(1, threads_per_task)))


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
    # which refinement predictor to ship: "auto" picks among the candidates by grouped K-fold CV
    # (cv_folds) on the train split (training.select); or name one of them (training.candidates)
    refine: str = "auto"
    cv_folds: int = 3
    # members of each network candidate's fold fits in that cross-validation (survival, survival+ridge,
    # survival-pca: their first seeds; 0 = all `members`, the shipped ensemble's). 2 of 3 cut train's CPU
    # time by a quarter (median over 18 synthetic sets) and changed the choice on 4 of them
    # (docs/training.md, "Speed")
    cv_members: int = 0
    # categories left out of training (both predictors and the calibration); the eval split keeps them
    exclude: tuple[str, ...] = ()
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
        self.exclude = tuple(str(c) for c in self.exclude)
        self.seeds = tuple(self.seed + i for i in range(max(self.members, 0)))

    def check(self) -> None:
        """Raise ConfigError listing every option that cannot work."""
        problems = []
        positive = ("admission_trees", "admission_leaves", "admission_min_child_samples", "width", "members",
                    "max_epochs", "patience", "batch_size", "num_threads")
        problems += [f"{name} must be >= 1 (got {getattr(self, name)})" for name in positive if getattr(self, name) < 1]
        if self.admission_leaves < 2:
            problems.append(f"admission_leaves must be >= 2 (got {self.admission_leaves})")
        from dwise_predict.admission.model_text import MAX_TOTAL_LEAVES  # what evaluate and export will read

        if self.admission_trees * self.admission_leaves > MAX_TOTAL_LEAVES:
            problems.append(f"admission_trees x admission_leaves must be at most {MAX_TOTAL_LEAVES:,} (got "
                            f"{self.admission_trees} x {self.admission_leaves}): a larger model would not load")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must lie in [0, 1) (got {self.dropout})")
        if not 0.0 < self.val_fraction < 1.0:
            problems.append(f"val_fraction must lie in (0, 1) (got {self.val_fraction})")
        if not (self.lr > 0 and self.admission_learning_rate > 0 and self.weight_decay >= 0):
            problems.append("lr and admission_learning_rate must be > 0, weight_decay >= 0")
        if self.calibration not in ("median", "mean"):
            problems.append(f"calibration must be 'median' or 'mean' (got {self.calibration!r})")
        # "auto" (pick by cross-validation) or a registered candidate; imported here, where a fit is
        # near, so that reading the defaults does not import torch
        from dwise_predict.training.candidates import NAMES

        if self.refine not in ("auto", *NAMES):
            problems.append(f"`refine` must be one of {', '.join(('auto', *NAMES))} (got {self.refine!r})")
        if self.cv_members < 0:
            problems.append(f"cv_members must be >= 0, 0 for all members (got {self.cv_members})")
        if self.cv_folds < 2:
            problems.append(f"cv_folds must be >= 2 (got {self.cv_folds})")
        if self.bootstrap < 0:
            problems.append(f"bootstrap must be >= 0 (got {self.bootstrap})")
        if not 0 <= self.seed <= MAX_SEED:
            problems.append(f"seed must lie in [0, {MAX_SEED}] (got {self.seed})")
        problems += [f"{name} must be at most {most:,} (got {getattr(self, name):,})"
                     for name, most in LIMITS.items() if getattr(self, name) > most]
        if problems:
            raise ConfigError("; ".join(problems))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seeds": list(self.seeds), "exclude": list(self.exclude)}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """A config from a dict of options (a --config file, or a run's config.json, whose extra
        record keys are ignored); unknown options raise ConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names - _RECORD_KEYS)
        if unknown:
            raise ConfigError(f"unknown training options {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        wrong = [f"{f.name} must be {type(f.default).__name__}, got {data[f.name]!r}"
                 for f in dataclasses.fields(cls) if f.init and f.name in data and not _fits(data[f.name], f.default)]
        if wrong:
            raise ConfigError("; ".join(wrong))
        config = cls(**{k: v for k, v in data.items() if k in names})
        config.check()
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TrainConfig":
        """A config from a JSON file of options (e.g. a run's config.json); ConfigError names it as ``config``."""
        return cls.from_dict(read_json_object(path, ConfigError, name=f"`config` {path}", fix="give training options"))
