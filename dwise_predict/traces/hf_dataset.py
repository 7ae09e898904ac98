"""A trace dataset as one ``datasets.Dataset`` (Hugging Face ``datasets``), for tools of that ecosystem.

One row per request: every column of ``requests.parquet`` as written (``rounds_per_block`` a list of
ints), then ``first_round`` and ``prompt_last``, each a fixed-length list of ``hidden_size`` float32
(the rows of ``hidden.safetensors``, row i with request i). The optional tensors of ``collect
--layers`` / ``--rounds-hidden`` (:attr:`~dwise_predict.traces.dataset.TraceDataset.extra_hidden`)
stay out: read them from ``hidden.safetensors``. The manifest (model fingerprint, decoding) rides
in the dataset's ``info.description`` as JSON. The table alone needs no dwise-predict:
``datasets.load_dataset("parquet", data_files="TRACES/requests.parquet", split="train")``.
The trace contract itself (:mod:`dwise_predict.traces.dataset`) is unchanged: this is a view of it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from dwise_predict.traces.dataset import HIDDEN_TENSORS

if TYPE_CHECKING:
    import datasets

    from dwise_predict.traces.dataset import TraceDataset


def to_dataset(ds: "TraceDataset") -> "datasets.Dataset":
    """The request table and the two hidden-state matrices of ``ds`` as one ``datasets.Dataset``."""
    import datasets
    import pyarrow as pa

    table = pa.Table.from_pandas(ds.requests, preserve_index=False)
    for name in HIDDEN_TENSORS:
        matrix = np.ascontiguousarray(getattr(ds, name), dtype=np.float32)
        flat = pa.array(matrix.reshape(-1), type=pa.float32())
        table = table.append_column(name, pa.FixedSizeListArray.from_arrays(flat, matrix.shape[1]))
    table = table.replace_schema_metadata(None)  # pandas' index metadata: the row order is the index
    info = datasets.DatasetInfo(description=json.dumps(ds.manifest, sort_keys=True))
    return datasets.Dataset(datasets.table.InMemoryTable(table), info=info)
