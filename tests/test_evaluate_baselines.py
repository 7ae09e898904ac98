"""Baselines on known-answer traces: hidden-state rows see the latent difficulty, early signals do not."""

import numpy as np
import pytest

from dwise_predict.evaluation.baselines import (PROMPT_HIDDEN_TASK, WITHOUT_FIRST_ROUND_TASK, baseline_predictions,
                                                baseline_table, remaining_rounds, table_tasks, trail_probe)
from dwise_predict.names import EARLY_SIGNALS
from dwise_predict.evaluation.characterize import output_vs_work
from evaluate_helpers import make_traces


@pytest.fixture(scope="module")
def split():
    ds = make_traces(n_requests=400, seed=3)
    return ds.split("train"), ds.split("eval")


@pytest.fixture(scope="module")
def rows(split):
    train, eval_ds = split
    n = len(eval_ds)
    admission = np.full(n, 10.0) + np.arange(n) % 3  # a weak admission estimate, total rounds
    refined = eval_ds.requests["oracle_remaining"].to_numpy()
    return {r["name"]: r for r in baseline_table(eval_ds, baseline_predictions(train, eval_ds, admission, refined, None,
                                                                              seed=0))}


def test_every_row_has_the_three_scores(rows):
    assert list(rows)[0] == "admission LightGBM"
    assert "survival on prompt hidden state" not in rows  # not given: left out, not faked
    for name, row in rows.items():
        assert set(row) == {"name", "input", "kind", "spearman", "kendall", "r2", "within_category_mean"}
        assert row["spearman"] is not None, name


def test_hidden_state_rows_recover_the_latent_difficulty(rows):
    oracle = rows["oracle: expected remaining (synthetic)"]["spearman"]
    assert oracle > 0.7
    for name in ("TRAIL-style probe", "ridge on first-round state"):
        assert rows[name]["spearman"] > 0.6, name
        assert rows[name]["within_category_mean"] > 0.5, name
        assert rows[name]["spearman"] <= oracle + 0.05


def test_early_signals_of_synthetic_traces_are_noise(rows):
    # make_synthetic_traces draws them independently of the rounds: Amin et al.'s finding, by construction
    for name in ("frac_over_threshold", "mean_confidence", "mean_entropy", "all four"):
        row = rows[f"early signal: {name}"]
        assert abs(row["spearman"]) < 0.25, name
        assert row["r2"] < 0.1, name


def test_oracle_rows(rows, split):
    truth = rows["oracle: actual remaining rounds"]
    assert truth["spearman"] == 1.0 and truth["kendall"] == 1.0 and truth["r2"] == 1.0
    tokens = rows["oracle: actual output tokens"]
    assert tokens["r2"] is None  # tokens are not rounds: R² would compare different units
    assert tokens["spearman"] > 0.9  # synthetic output tokens follow rounds


def test_the_prompt_state_baseline_sees_only_what_is_known_before_the_first_round(split):
    """The DWISE paper's prompt-hidden-state baseline reads the prompt (last prompt block, prompt tokens,
    budget); the ablation is the shipped input less the first-round state, round-1 signals kept."""
    train, eval_ds = split
    tasks = {t.name: t for t in table_tasks(train, eval_ds, config=None)}
    for name, signals_kept in ((PROMPT_HIDDEN_TASK, False), (WITHOUT_FIRST_ROUND_TASK, True)):
        for original, blanked in ((train, tasks[name].train), (eval_ds, tasks[name].eval)):
            assert not blanked.first_round.any() and blanked.first_round.shape == original.first_round.shape
            np.testing.assert_array_equal(blanked.prompt_last, original.prompt_last)
            for column in ("prompt_tokens", "budget", "category", "total_rounds", "split"):
                assert blanked.requests[column].equals(original.requests[column]), (name, column)
            for column in EARLY_SIGNALS:
                assert original.requests[column].nunique() > 1  # the blanking below is not vacuous
                kept = blanked.requests[column].equals(original.requests[column])
                assert kept if signals_kept else (blanked.requests[column] == 0.0).all(), (name, column)


def test_rows_say_what_they_are(split):
    train, eval_ds = split
    n = len(eval_ds)
    pred = np.arange(n, dtype=float)
    rows = baseline_table(eval_ds, baseline_predictions(train, eval_ds, np.full(n, 10.0), pred, {
        PROMPT_HIDDEN_TASK: pred[::-1].copy(), WITHOUT_FIRST_ROUND_TASK: pred + 1.0}))
    kinds = {r["name"]: r["kind"] for r in rows}
    assert kinds["survival on prompt hidden state"] == "baseline"
    assert kinds["refinement predictor (shipped)"] == "shipped"
    assert kinds["ablation: shipped recipe without the first-round state"] == "ablation"
    assert {k for n, k in kinds.items() if n.startswith("oracle")} == {"oracle"}
    by_name = {r["name"]: r for r in rows}  # each retraining's predictions land in its own row
    assert by_name["ablation: shipped recipe without the first-round state"]["spearman"] == pytest.approx(
        by_name["refinement predictor (shipped)"]["spearman"])
    assert by_name["survival on prompt hidden state"]["spearman"] == pytest.approx(
        -by_name["refinement predictor (shipped)"]["spearman"])


def test_trail_probe_predicts_within_the_training_range(split):
    train, eval_ds = split
    pred = trail_probe(train, eval_ds)
    y = remaining_rounds(train)
    assert pred.shape == (len(eval_ds),)
    assert (pred >= y.min()).all() and (pred <= y.max()).all()  # a mixture of bin means


def test_output_vs_work_per_category():
    ds = make_traces(n_requests=200)
    table = output_vs_work(ds.requests)
    assert table["overall"]["n"] == 200 and table["overall"]["request_share"] == 1.0
    assert [r["category"] for r in table["per_category"]] == ["chat", "code", "math", "mcq"]
    assert sum(r["work_share"] for r in table["per_category"]) == pytest.approx(1.0)
    chat = ds.requests[ds.requests["category"] == "chat"]
    per_token = chat["total_rounds"] / chat["output_tokens"]
    row = table["per_category"][0]
    assert row["rounds_per_token_p50"] == pytest.approx(float(np.median(per_token)))
    assert row["mean_rounds"] == pytest.approx(chat["total_rounds"].mean())
    # the synthetic output length is rounds times U(1, 3): at most one round per token
    assert 0 < row["rounds_per_token_p10"] <= row["rounds_per_token_p90"] <= 1.0
    cut = ds.requests[ds.requests["finish"] == "budget"]
    work = cut["prompt_blocks"] + cut["total_rounds"]
    assert table["overall"]["budget_share"] == pytest.approx(len(cut) / 200)
    assert table["overall"]["work_at_budget_p90"] == pytest.approx(float(np.percentile(work, 90)))
    req = ds.requests
    no_cut = output_vs_work(req[~((req["category"] == "mcq") & (req["finish"] == "budget"))])
    mcq = no_cut["per_category"][3]
    assert mcq["budget_share"] == 0.0 and mcq["work_at_budget_p10"] is None  # nothing to spread, no crash
