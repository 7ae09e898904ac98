"""Contract 1: write, read back, fingerprint, and the errors a broken dataset raises."""

import json

import numpy as np
import pandas as pd
import pytest

from dwise_predict.errors import TraceError
from dwise_predict.traces import REQUEST_COLUMNS, load_traces, write_traces
from dwise_predict.traces.dataset import SCHEMA_VERSION
from dwise_predict.traces.synthetic import make_synthetic_traces


def test_roundtrip_keeps_rows_hidden_and_fingerprint(tmp_path, synthetic_traces):
    write_traces(synthetic_traces, tmp_path / "t")
    back = load_traces(tmp_path / "t")
    assert len(back) == 480 and back.hidden_size == 32
    assert back.data_hash() == synthetic_traces.data_hash()
    np.testing.assert_array_equal(back.first_round, synthetic_traces.first_round)
    assert list(back.requests.columns[: len(REQUEST_COLUMNS)]) == list(REQUEST_COLUMNS)
    # outside tools read the files with pandas alone
    table = pd.read_parquet(tmp_path / "t" / "requests.parquet")
    assert table["total_rounds"].sum() == synthetic_traces.requests["total_rounds"].sum()
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["counts"]["requests"] == 480 and manifest["schema_version"] == SCHEMA_VERSION


def test_same_seed_same_traces_other_seed_differs():
    a, b, c = (make_synthetic_traces(64, 8, seed=s) for s in (3, 3, 4))
    assert a.data_hash() == b.data_hash() != c.data_hash()
    # a re-collection differs only in its clock: same fingerprint; a changed round count is new data
    b.requests["wall_s"] = b.requests["wall_s"] * 1.7 + 0.01
    assert b.data_hash() == a.data_hash()
    b.requests.loc[0, "total_rounds"] += 1
    assert b.data_hash() != a.data_hash()


def test_synthetic_remaining_rounds_follow_the_oracle(synthetic_traces):
    from scipy.stats import spearmanr

    r = synthetic_traces.requests
    rho = spearmanr(r["oracle_remaining"], r["total_rounds"] - 1).statistic
    assert rho > 0.5  # geometric noise keeps it well below 1, but the signal is there


def test_missing_column_is_named(tmp_path, synthetic_traces):
    write_traces(synthetic_traces, tmp_path / "t")
    table = pd.read_parquet(tmp_path / "t" / "requests.parquet").drop(columns=["prompt_blocks"])
    table.to_parquet(tmp_path / "t" / "requests.parquet")
    with pytest.raises(TraceError, match="lack columns prompt_blocks"):
        load_traces(tmp_path / "t")


def test_row_mismatch_and_nan_are_refused(synthetic_traces):
    with pytest.raises(TraceError, match="has shape"):
        type(synthetic_traces)(synthetic_traces.requests, synthetic_traces.first_round[:-1], synthetic_traces.prompt_last)
    bad = synthetic_traces.requests.copy()
    bad.loc[3, "words"] = np.nan
    with pytest.raises(TraceError, match="'words'"):
        type(synthetic_traces)(bad, synthetic_traces.first_round, synthetic_traces.prompt_last)


def test_missing_directory_and_newer_schema(tmp_path, synthetic_traces):
    with pytest.raises(TraceError, match="no trace directory"):
        load_traces(tmp_path / "nowhere")
    write_traces(synthetic_traces, tmp_path / "t")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="upgrade dwise-predict"):
        load_traces(tmp_path / "t")
