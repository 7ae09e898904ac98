"""`simulate --budget-sweep` (the DWISE paper's Table 14) and `--drop-category` (its Table 7, replayed)
on synthetic traces with known answers (dwise_predict.traces.synthetic): a set at twice the budget
whose every request takes exactly twice the rounds and tokens, and a category whose difficulty the
first-round state shows along a direction of its own, which predictors trained without it never see."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.errors import InputError
from dwise_predict.simulation.retrain import Retraining, RetrainStudies, StudyReplay, plan_retrain, run_retrain_studies
from dwise_predict.simulation.simulator import SimConfig
from dwise_predict.traces import TraceDataset, load_traces, write_traces
from evaluate_helpers import fixed_config, make_traces

REPLAY = StudyReplay(SimConfig(), ["burst", "burst-poisson"], None, 1000, 1)
OWN = "code"  # the category given a structure of its own


def at_budget_times(ds: TraceDataset, factor: int) -> TraceDataset:
    """The same requests collected at ``factor`` times the budget, each taking exactly ``factor``
    times the rounds (every block's) and tokens: the known answer of the sweep's columns."""
    req = ds.requests.copy()
    req["total_rounds"] *= factor
    req["rounds_per_block"] = [[r * factor for r in rounds] for rounds in req["rounds_per_block"]]
    req["output_tokens"] *= factor
    req["budget"] *= factor
    decoding = {**ds.decoding, "budget": ds.decoding["budget"] * factor}
    return TraceDataset(req, ds.first_round, ds.prompt_last, {**ds.manifest, "decoding": decoding})


def own_structure(ds: TraceDataset, category: str) -> TraceDataset:
    """``ds`` with ``category``'s difficulty moved, in its first-round state, from the direction every
    category shares onto one orthogonal to it, of the same length: a linear head fitted with the
    category reads both; fitted without it, it reads only the shared one."""
    cats, z = ds.requests["category"].to_numpy(), ds.requests["difficulty"].to_numpy()
    state = ds.first_round.astype(np.float64)
    z_c, state_c = z.copy(), state.copy()
    for c in set(cats):  # within-category centring: the embeddings drop out of the direction's estimate
        m = cats == c
        z_c[m] -= z[m].mean()
        state_c[m] -= state[m].mean(axis=0)
    shared = z_c @ state_c / (z_c @ z_c)
    own = np.random.default_rng(0).standard_normal(state.shape[1])
    own -= (own @ shared) / (shared @ shared) * shared
    own *= np.linalg.norm(shared) / np.linalg.norm(own)
    m = cats == category
    state[m] += np.outer(z[m], own - shared)
    return TraceDataset(ds.requests, state.astype(np.float32), ds.prompt_last, ds.manifest)


def studies(sweep=(), drop=(), kept=None) -> RetrainStudies:
    return RetrainStudies(Retraining(fixed_config(), "the test's recipe", kept, jobs=1), tuple(sweep), tuple(drop))


@pytest.fixture(scope="module")
def budget_sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    ds = make_traces()
    return write_traces(ds, root / "b256"), write_traces(at_budget_times(ds, 2), root / "b512")


def test_twice_the_budget_doubles_rounds_and_tokens_and_keeps_the_ranking(budget_sets):
    small, large = budget_sets
    plan = plan_retrain(load_traces(small), studies(sweep=[large]))
    assert [t.name for t in plan.tasks] == ["the train split, every category", "budget set 1"]
    table = run_retrain_studies(plan, REPLAY)["budget_sweep"]
    rows = table["rows"]
    assert [(r["arrival"], r["budget"]) for r in rows] == [("burst", 256), ("burst", 512), ("burst-poisson", 256),
                                                          ("burst-poisson", 512)]
    for a, b in (rows[:2], rows[2:]):
        assert b["mean_rounds"] == pytest.approx(2 * a["mean_rounds"])  # exactly: the same requests, doubled
        assert b["mean_output_tokens"] == pytest.approx(2 * a["mean_output_tokens"])
        # the hidden state ranks the work the same at both budgets (retrained on each: same order, scaled)
        assert a["refined_rho"] > 0.6 and b["refined_rho"] == pytest.approx(a["refined_rho"], abs=0.03)
        # twice the denoising: DWISE's latency grows with it, SGLang's far less (its time is prefill-first
        # rounds, set by the prompts), as the paper's Table 14 finds: the speed-up shrinks but stays
        assert b["dwise_mean_latency_s"] > 1.4 * a["dwise_mean_latency_s"]
        assert b["sglang_mean_latency_s"] / a["sglang_mean_latency_s"] < b["dwise_mean_latency_s"] / a["dwise_mean_latency_s"]
        assert a["speedup"] > b["speedup"] > 2.0 and b["p99_speedup"] > 1.0
    assert table["rate_rps"] > 0 and table["recipe"] == "the test's recipe"  # one Poisson rate for every budget


def test_a_category_with_its_own_structure_loses_its_rho_and_latency_when_held_out():
    ds = own_structure(make_traces(n_requests=400), OWN)
    table = run_retrain_studies(plan_retrain(ds, studies(drop=["all"])), StudyReplay(SimConfig(), ["burst"], None, 1000))
    rows = {(r["category"], r["predictors"]): r for r in table["drop_category"]["rows"]}
    assert sorted({c for c, _ in rows}) == ["chat", "code", "math", "mcq"] and table["drop_category"]["skipped"] == []
    seen, held = rows[(OWN, "seen")], rows[(OWN, "held out")]
    # seen: the head reads the category's own direction; held out, it reads only the shared one
    assert seen["refined_rho_category"] > 0.5 and held["refined_rho_category"] < 0.2
    assert held["dwise_mean_latency_category_s"] > 1.15 * seen["dwise_mean_latency_category_s"]
    assert held["dwise_mean_latency_s"] > seen["dwise_mean_latency_s"] and held["speedup"] < seen["speedup"]
    assert held["refined_rho_all"] < seen["refined_rho_all"] - 0.1
    for other in ("chat", "math", "mcq"):  # the shared structure transfers
        assert rows[(other, "held out")]["refined_rho_category"] > 0.35
        assert rows[(other, "seen")]["refined_rho_category"] - rows[(other, "held out")]["refined_rho_category"] < 0.15
    # both sides replay the same SGLang run: only the predictors differ
    assert seen["sglang_mean_latency_s"] == held["sglang_mean_latency_s"]


def test_the_retrainings_are_deterministic_and_kept_for_a_resume(tmp_path, budget_sets):
    ds = load_traces(budget_sets[0])
    fresh = run_retrain_studies(plan_retrain(ds, studies(drop=["mcq"])), REPLAY)
    lines: list[str] = []
    kept = tmp_path / ".sim.kept"
    first = run_retrain_studies(plan_retrain(ds, studies(drop=["mcq"], kept=kept)), REPLAY, lines.append)
    assert first == fresh and len(list(kept.glob("*.safetensors"))) == 2
    lines.clear()
    again = run_retrain_studies(plan_retrain(ds, studies(drop=["mcq"], kept=kept)), REPLAY, lines.append)
    assert again == fresh
    assert any("2 of 2 retrainings already done" in line for line in lines) and not any("retrained:" in l for l in lines)
    studies(kept=kept).retraining.forget_kept()
    assert not kept.exists()


@pytest.mark.parametrize("other, says", [
    (lambda ds: at_budget_times(make_traces(block_size=4), 2), "differ in decoding (block_size: 8 vs 4)"),
    (lambda ds: at_budget_times(make_traces(seed=2), 2), "come from different models"),
    (lambda ds: ds, "share the output budget 256"),
    (lambda ds: at_budget_times(ds.split("train"), 2), "hold no eval split"),
])
def test_budget_sets_that_differ_in_more_than_the_budget_are_refused(tmp_path, budget_sets, other, says):
    ds = load_traces(budget_sets[0])
    path = write_traces(other(ds), tmp_path / "other")
    with pytest.raises(InputError, match=re.escape(says)):
        plan_retrain(ds, studies(sweep=[path]))


def test_held_out_categories_that_cannot_be_are_refused(budget_sets):
    ds = load_traces(budget_sets[0])
    with pytest.raises(InputError, match="unknown category 'poetry'.*pass one of those to `drop_category`"):
        plan_retrain(ds, studies(drop=["poetry"]))
    cats = ds.requests["category"].to_numpy()
    few = ds.subset((cats != "mcq") | (np.cumsum(cats == "mcq") <= 12))
    with pytest.raises(InputError, match="cannot hold out 'mcq': .*fewer than the minimum 10"):
        plan_retrain(few, studies(drop=["mcq"]))
    plan = plan_retrain(few, studies(drop=["all"]))  # asked for all, it is skipped and said so
    assert [t.name for t in plan.drops] == ["without chat", "without code", "without math"]
    assert plan.skipped[0]["category"] == "mcq"


def test_cli_writes_both_tables_into_the_report_and_resumes(tmp_path, budget_sets, capsys):
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.training import train_run

    small, large = budget_sets
    train_run(small, tmp_path / "run", fixed_config())
    bundle = export_bundle(tmp_path / "run", tmp_path / "bundle", name="tiny", n_probes=8)
    out = tmp_path / "sim"
    argv = ["simulate", str(small), "--bundle", str(bundle), "--budget-sweep", str(large), "--drop-category", "mcq",
            "--requests", "400", "--arrival", "burst", "--policies", "sglang-default,dwise-refined", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "retraining both predictors 3 times with the serving bundle's recipe" in captured.err
    assert "Output budgets (the DWISE paper's Table 14)" in captured.out and "Held-out category" in captured.out
    saved = json.loads((out / "simulate.json").read_text())
    assert [r["budget"] for r in saved["budget_sweep"]["rows"]] == [256, 512]
    assert [(r["category"], r["predictors"]) for r in saved["drop_category"]["rows"]] == [("mcq", "seen"),
                                                                                         ("mcq", "held out")]
    report = (out / "report.md").read_text()
    assert "## The DWISE paper's Table 14 (budgets)" in report and "## Held-out category, scheduling" in report
    assert not (tmp_path / ".sim.kept").exists()  # the kept retrainings go once the output is written
    assert main([*argv, "--json"]) == 0  # a rerun gives the same numbers (fixed seeds), as one JSON document
    again = json.loads(capsys.readouterr().out)
    assert again["budget_sweep"] == saved["budget_sweep"] and again["drop_category"] == saved["drop_category"]
