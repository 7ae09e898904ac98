"""Leave-one-category-out on known-answer traces: the hidden state transfers, prompt features do not."""

import numpy as np
import pytest

from dwise_predict.errors import InputError
from dwise_predict.evaluation import loco
from dwise_predict.evaluation.evaluate import evaluate
from evaluate_helpers import fast_config, make_traces, write


@pytest.fixture(scope="module")
def traces_dir(loco_evaluation):
    return loco_evaluation[0]


@pytest.fixture(scope="module")
def evaluation(loco_evaluation):
    """``evaluate --loco`` of ``make_traces()`` (conftest: shared with test_evaluate_ablate)."""
    return loco_evaluation[1]


def test_refined_transfers_to_held_out_categories_and_admission_does_not(evaluation):
    table = evaluation.result["loco"]
    assert [r["category"] for r in table["rows"]] == ["chat", "code", "math", "mcq"]
    assert table["skipped"] == []
    mean = table["mean"]
    # z moves rounds through the hidden state only: within a held-out category the prompt features
    # order nothing, the first-round state still orders most of it.
    assert mean["refined"]["held_out"] > 0.35
    assert abs(mean["admission"]["held_out"]) < 0.2
    assert mean["refined"]["held_out"] - mean["admission"]["held_out"] > 0.3
    wins = sum(r["refined"]["held_out"] > r["admission"]["held_out"] + 0.1 for r in table["rows"])
    assert wins >= 3


def test_all_request_rho_with_mcq_held_out(evaluation):
    chosen = evaluation.result["loco"]["hold_out"]
    assert chosen["category"] == "mcq"  # the paper's example is picked by default
    assert chosen["refined"]["held_out"] > chosen["admission"]["held_out"] + 0.3
    # the in-training side is the main predictors' all-request rho
    assert chosen["refined"]["in_training"] == pytest.approx(evaluation.result["metrics"]["refined"]["spearman"])


@pytest.mark.slow  # starts two worker processes (spawn): ~10-25 s on a busy 2-core machine
def test_parallel_retraining_gives_the_same_numbers(traces_dir, evaluation):
    parallel = evaluate([traces_dir], hold_out="mcq", jobs=2, config=fast_config())
    sequential = evaluation.result
    assert parallel.result["loco"]["rows"] == [r for r in sequential["loco"]["rows"] if r["category"] == "mcq"]
    assert parallel.result["baselines"] == sequential["baselines"]  # incl. the retrained prompt-state row


def test_small_categories_are_skipped_with_a_reason(tmp_path):
    ds = make_traces()
    cats = ds.requests["category"].to_numpy()
    keep = (cats != "code") | (np.cumsum(cats == "code") <= 12)  # 12 code requests in all
    small = ds.subset(keep)
    tasks, skipped = loco.plan(small.split("train"), small.split("eval"), fast_config(), min_requests=10)
    assert [t.name for t in tasks] == ["chat", "math", "mcq"]
    assert len(skipped) == 1 and skipped[0]["category"] == "code"
    assert "evaluation requests, fewer than the minimum 10" in skipped[0]["reason"]
    # asked for explicitly, the same category is one clear error
    with pytest.raises(InputError, match="cannot hold out 'code': .* fewer than the minimum 10"):
        evaluate([write(small, tmp_path / "small")], hold_out="code", jobs=1, config=fast_config())


def test_unknown_hold_out_category_names_the_known_ones():
    ds = make_traces(n_requests=80)
    with pytest.raises(InputError, match="unknown category 'poetry'.*chat, code, math, mcq"):
        loco.plan(ds.split("train"), ds.split("eval"), None, ["poetry"])


def test_constant_prediction_gives_na_not_a_crash():
    ds = make_traces(n_requests=120).split("eval")
    n = len(ds)
    rng = np.random.default_rng(0)
    good = {"admission": rng.uniform(1, 50, n), "refined": rng.uniform(0, 50, n)}
    constant = {"admission": np.full(n, 7.0), "refined": rng.uniform(0, 50, n)}
    table = loco.table(ds, good, {"mcq": constant, "chat": good}, skipped=[])
    mcq = next(r for r in table["rows"] if r["category"] == "mcq")
    assert mcq["admission"]["held_out"] is None
    assert mcq["admission"]["in_training"] is not None
    assert mcq["notes"] == ["admission held out: n/a (prediction constant)"]
    assert mcq["overall"]["admission"]["held_out"] is None
    # the mean skips undefined cells instead of failing
    chat = next(r for r in table["rows"] if r["category"] == "chat")
    assert table["mean"]["admission"]["held_out"] == pytest.approx(chat["admission"]["held_out"])


def test_na_cells_render_in_the_report_and_plot():
    from dwise_predict.evaluation import plots
    from dwise_predict.evaluation.document import Document, Section, to_markdown
    from dwise_predict.evaluation.report import loco_tables

    ds = make_traces(n_requests=120).split("eval")
    n = len(ds)
    good = {"admission": np.arange(n, dtype=float), "refined": np.arange(n, dtype=float)}
    table = loco.table(ds, good, {"mcq": {"admission": np.zeros(n), "refined": np.arange(n, dtype=float)}}, [])
    md = to_markdown(Document("t", [], [Section("LOCO", "", loco_tables(table))]))
    assert "→ n/a" in md and "admission held out: n/a (prediction constant)" in md
    assert plots.loco_bars(table["rows"])[:4] == b"\x89PNG"


def test_the_held_out_mean_has_a_bootstrap_interval_over_the_evaluation_requests(evaluation):
    from dwise_predict.metrics import percentile_interval, stratified_indices, within_category

    ds = make_traces(n_requests=200).split("eval")
    cats = ds.requests["category"].astype(str).to_numpy()
    total = ds.requests["total_rounds"].to_numpy(float)
    rng = np.random.default_rng(0)
    perfect = {"admission": total, "refined": total - 1.0}
    noisy = {"admission": total + rng.normal(0, 20, total.size), "refined": total + rng.normal(0, 5, total.size)}
    table = loco.table(ds, perfect, {c: noisy for c in sorted(set(cats))}, [], n_boot=50, seed=3)
    ci = table["mean_ci"]["refined"]
    assert ci["in_training"] == [1.0, 1.0]  # a perfect ranker stays perfect in every resample
    lo, hi = ci["held_out"]
    assert lo < table["mean"]["refined"]["held_out"] < hi and hi - lo > 0.02
    # the same interval, one resample at a time with the plain per-category ρ
    idx = stratified_indices(cats, 50, 3)
    direct = [within_category(noisy["refined"][i], total[i] - 1.0, cats[i])[0] for i in idx]
    assert percentile_interval(np.array(direct)) == pytest.approx([lo, hi])
    plain = loco.table(ds, perfect, {"mcq": noisy}, [], n_boot=0)
    assert plain["mean_ci"]["refined"]["held_out"] is None
    # evaluate --loco reports it, and the report prints it beside the mean
    shipped = evaluation.result["loco"]
    lo, hi = shipped["mean_ci"]["refined"]["held_out"]
    assert lo <= shipped["mean"]["refined"]["held_out"] <= hi
    from dwise_predict.evaluation.document import Document, Section, to_markdown
    from dwise_predict.evaluation.report import loco_tables, summary

    md = to_markdown(Document("t", [], [Section("LOCO", "", loco_tables(shipped))]))
    assert f"[{lo:.3f}, {hi:.3f}]" in md and f"[{lo:.3f}, {hi:.3f}]" in " ".join(summary(evaluation.result))
    plain_md = to_markdown(Document("t", [], [Section("LOCO", "", loco_tables(plain))]))
    assert "resampled" not in plain_md and "[" not in plain_md.split("| mean |")[1].splitlines()[0]
