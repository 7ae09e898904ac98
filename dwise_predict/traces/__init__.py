"""Contract 1: the trace dataset (see docs in `dataset.py`)."""

from dwise_predict.traces.dataset import (
    HIDDEN_FILE,
    MANIFEST_FILE,
    REQUEST_COLUMNS,
    REQUESTS_FILE,
    SCHEMA_VERSION,
    TraceDataset,
    load_traces,
    write_traces,
)

__all__ = [
    "HIDDEN_FILE",
    "MANIFEST_FILE",
    "REQUEST_COLUMNS",
    "REQUESTS_FILE",
    "SCHEMA_VERSION",
    "TraceDataset",
    "load_traces",
    "write_traces",
]
