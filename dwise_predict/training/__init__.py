"""Training the two predictors: options (``config``), fitting and scoring (``fit``), and a whole
run written to its directory (``run``; the directory format and its reader: :mod:`dwise_predict.runs`).

The names below load their module on first use (PEP 562), so reading :class:`TrainConfig`'s
defaults (the CLI's signatures do) does not import torch or LightGBM.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "TrainConfig": "config",
    "Predictors": "fit",
    "Targets": "fit",
    "evaluate_predictors": "fit",
    "fit_predictors": "fit",
    "refine_inputs": "fit",
    "torch_threads": "fit",
    "load_predictors": "run",
    "train_run": "run",
    "write_run": "run",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
