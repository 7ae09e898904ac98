"""Admission predictor: features, LightGBM fit, the compiled single-request path, save/load, comparison."""

import numpy as np
import pandas as pd
import pytest

from dwise_predict.admission.features import prompt_features
from dwise_predict.admission.model import AdmissionModel
from dwise_predict.errors import InputError, TraceError
from dwise_predict.features.prompt import FEATURE_NAMES, PromptFeaturizer, count_newlines, count_words
from dwise_predict.traces.synthetic import make_synthetic_traces


@pytest.fixture(scope="module")
def traces():
    return make_synthetic_traces(600, 8, seed=3)


def test_counts_and_feature_matrix(traces):
    assert count_words("  two words\n\tand three  ") == 4
    assert count_newlines("a\nb\n\nc") == 3
    x = prompt_features(traces.requests)
    assert x.shape == (600, 3) and x.dtype == np.float32
    assert FEATURE_NAMES == ("words", "newlines", "prompt_tokens")
    np.testing.assert_array_equal(x[:, 2], traces.requests["prompt_tokens"].to_numpy(np.float32))


def test_bad_feature_tables_raise_one_line():
    with pytest.raises(TraceError, match="lacks feature columns newlines"):
        prompt_features(pd.DataFrame({"words": [1], "prompt_tokens": [2]}))
    with pytest.raises(TraceError, match="'prompt_tokens' holds NaN"):
        prompt_features(pd.DataFrame({"words": [1, 2], "newlines": [0, 1], "prompt_tokens": [3, np.inf]}))


def test_compiled_path_is_bit_identical_to_lightgbm(traces, tmp_path):
    x = prompt_features(traces.requests)
    model = AdmissionModel(seed=0).fit(x, traces.requests["total_rounds"])
    assert model.booster_.num_trees() == 100
    assert max(t["num_leaves"] for t in model.booster_.dump_model()["tree_info"]) <= 15
    batch = model.predict(x)
    one = np.array([model.predict_one(*row) for row in x])
    np.testing.assert_array_equal(one, batch)
    # points exactly on split thresholds and at zero take the same branch as LightGBM
    thresholds = model.trees_["threshold"][model.trees_["feature"] >= 0]
    probe = np.column_stack([thresholds, np.zeros_like(thresholds), thresholds[::-1]])
    np.testing.assert_array_equal([model.predict_one(*r) for r in probe], model.predict(probe))

    model.save(tmp_path)
    loaded = AdmissionModel.load(tmp_path)
    np.testing.assert_array_equal(loaded.predict(x), batch)
    assert loaded.predict_one(*x[7]) == batch[7]
    # log-space target: predictions sit in the range of observed totals
    total = traces.requests["total_rounds"].to_numpy()
    assert total.min() - 1 <= batch.min() and batch.max() <= total.max()


def test_same_seed_same_bytes(traces, tmp_path):
    x = prompt_features(traces.requests)
    for name in ("a", "b"):
        AdmissionModel(seed=5).fit(x, traces.requests["total_rounds"]).save(tmp_path / name)
    for f in ("admission.txt", "admission.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_bad_admission_inputs():
    model = AdmissionModel()
    with pytest.raises(InputError, match=r"shape \(N, 3\)"):
        model.fit(np.ones((5, 2)), np.ones(5))
    with pytest.raises(InputError, match="NaN or inf"):
        model.fit(np.array([[1.0, 2.0, np.nan]] * 5), np.ones(5))
    with pytest.raises(InputError, match="5 feature rows but 4"):
        model.fit(np.ones((5, 3)), np.ones(4))
    with pytest.raises(InputError, match="no admission.txt"):
        AdmissionModel.load("/nonexistent-run")


def test_featurizer_whitespace_and_tiny_tokenizer():
    plain = PromptFeaturizer(None)
    assert plain("solve this\nnow please") == (4.0, 1.0, 4.0)
    from dwise_predict.dllm.corpus import vocabulary
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tok = build_tokenizer(vocabulary())
    featurizer = PromptFeaturizer(tok)
    for text in ("repeat the word cat three times .", "name two animals .\nthen stop", ""):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
        assert featurizer.prompt_tokens(text) == len(ids)
        assert featurizer(text)[:2] == (count_words(text), count_newlines(text))


def test_compare_regressors_rows_and_fold_check(traces):
    from dwise_predict.admission.compare import CANDIDATES, COMPILED, compare_regressors, to_markdown

    rows = compare_regressors(traces, folds=3, seed=0, repeats=3)
    assert [r["name"] for r in rows] == list(CANDIDATES) + [COMPILED]
    for r in rows:
        assert -1.0 <= r["rho"] <= 1.0 and r["ms_from_text"] > 0 and r["us_model_only"] > 0
    by_name = {r["name"]: r for r in rows}
    assert by_name["LightGBM (100, 15 leaves)"]["rho"] > 0.2  # prompt length carries the category signal
    assert by_name[COMPILED]["us_model_only"] < by_name["LightGBM (100, 15 leaves)"]["us_model_only"]
    assert "| Ridge |" in to_markdown(rows, 3, "whitespace")
    with pytest.raises(InputError, match="cannot fill 5 folds"):
        compare_regressors(traces.subset(np.arange(len(traces)) < 9), folds=5)
