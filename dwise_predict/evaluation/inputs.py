"""Reading the traces an evaluation or characterization is asked about, with the checks users need.

Several trace directories may be given in one call (collections of the same model run at different
times or budgets). They must come from the same model: mixing models would mix two different
workload laws in one table, so that is refused with one line naming both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dwise_predict.errors import InputError
from dwise_predict.names import MODEL_KEYS, identity
from dwise_predict.traces import TraceDataset, load_traces


def model_identity(ds: TraceDataset) -> dict:
    """What says which model produced ``ds``: the fingerprint fields the trace store and the bundle
    compare too (``names.MODEL_KEYS``; not the name or path, which the same weights may change)."""
    return identity(ds.model_fingerprint, MODEL_KEYS)


def model_label(ds: TraceDataset) -> str:
    """Short human name of the model behind ``ds`` for messages and reports."""
    model = ds.model_fingerprint
    name = model.get("name") or model.get("path") or "unnamed model"
    digest = model.get("weights_sha256") or model.get("config_hash") or ""
    return f"{name} ({str(digest)[:12]})" if digest else str(name)


def check_same_model(datasets: Sequence[TraceDataset]) -> None:
    """Raise :class:`InputError` when the datasets were collected from different models."""
    first = datasets[0]
    for other in datasets[1:]:
        if model_identity(other) != model_identity(first):
            raise InputError(
                f"traces {first.path} and {other.path} come from different models "
                f"({model_label(first)} vs {model_label(other)}): evaluate or characterize one model per call"
            )


def load_many(paths: Sequence[str | os.PathLike]) -> list[TraceDataset]:
    """Load every trace directory in ``paths`` and check they share one model."""
    if not paths:
        raise InputError("no trace directory given: pass at least one TRACES path")
    datasets = [load_traces(p) for p in paths]
    check_same_model(datasets)
    return datasets


def concat(datasets: Sequence[TraceDataset]) -> TraceDataset:
    """One dataset holding the rows of all ``datasets`` (same model; manifest of the first).

    Request ids must stay unique across the inputs; :class:`TraceDataset` validation says so when
    they do not (the same collection given twice).
    """
    if len(datasets) == 1:
        return datasets[0]
    check_same_model(datasets)
    columns = [c for c in datasets[0].requests.columns if all(c in d.requests.columns for d in datasets)]
    requests = pd.concat([d.requests[columns] for d in datasets], ignore_index=True)
    # `collect --layers` tensors that every input holds, in one shape (the same spec), stay together
    extra = [name for name, values in datasets[0].extra_hidden.items()
             if all(name in d.extra_hidden and d.extra_hidden[name].shape[1:] == values.shape[1:] for d in datasets)]
    return TraceDataset(
        requests,
        np.concatenate([d.first_round for d in datasets]),
        np.concatenate([d.prompt_last for d in datasets]),
        datasets[0].manifest,
        datasets[0].path,
        {name: np.concatenate([d.extra_hidden[name] for d in datasets]) for name in extra},
    )
