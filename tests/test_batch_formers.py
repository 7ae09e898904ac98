"""The DWISE paper's Tables 2, 4 and 12 in the scheduling lab: the published baselines on both batch
formers (``simulate --batch-former``), each row's ρ of its ranking with the work, and output length
versus work by subset (``simulate --subset``): schedules, ρ and latency deltas worked out by hand."""

import json
from dataclasses import fields

import numpy as np
import pytest

from dwise_predict.errors import ConfigError
from dwise_predict.simulation.schedulers import (
    ALL_SCHEDULERS,
    FORMER_STEPS,
    PREFILL_FIRST,
    SCHEDULERS,
    on_batch_former,
)
from dwise_predict.simulation.simulator import (
    SimConfig,
    SimRequests,
    available_policies,
    compare_arrivals,
    gain_decomposition,
    make_arrivals,
    sim_requests_from_traces,
    simulate,
)
from dwise_predict.simulation.work_ranking import (
    OUTPUT_LIGHTGBM,
    OUTPUT_TOKENS,
    latency_deltas,
    output_length_scores,
    ranking_accuracy,
    subset_table,
)

ONE_SECOND = SimConfig(slots=2, k=8, round_ms=1000.0, slot_ms=0.0)


def workload(P, rounds, admission=None, refined=None):
    n = len(P)
    return SimRequests(np.array([chr(ord("A") + i) for i in range(n)]), np.array(P), np.array(rounds),
                       np.array(rounds), np.full(n, 4),
                       admission=None if admission is None else np.array(admission, dtype=float),
                       refined=None if refined is None else np.array(refined, dtype=float))


def test_each_published_baseline_has_a_prefill_first_twin_that_differs_only_in_the_former():
    """The twins are derived from the registry: the phase barrier on, ranking, estimate, residency and
    admission as the original. FCFS has none: on the prefill-first former it is SGLang's default."""
    assert list(PREFILL_FIRST) == ["mlfq-pf", "ssjf-pf", "s3-pf", "ltr-pf", "trail-pf"]
    for name, twin in PREFILL_FIRST.items():
        base = SCHEDULERS[name.removesuffix("-pf")]
        assert twin.prefill_first and not base.prefill_first and twin.steps == ()
        same = [f.name for f in fields(twin) if f.name not in ("name", "prefill_first", "about", "adds", "steps")]
        assert all(getattr(twin, f) == getattr(base, f) for f in same), name
        assert twin.about.startswith(base.about) and "prefill-first" in twin.adds
    assert "fcfs-mixed-pf" not in ALL_SCHEDULERS and SCHEDULERS["sglang-default"].ranking == "arrival"
    assert FORMER_STEPS[1] == ("mixed former (ssjf)", "ssjf-pf", "ssjf")
    # the registry's order first lists SGLang's modes and the twins (Table 2), then the rest (Table 4)
    assert list(ALL_SCHEDULERS)[:7] == ["sglang-default", "sglang-sync", *PREFILL_FIRST]
    # in the plots a twin keeps its original's colour and marker, drawn dashed and crossed
    from dwise_predict.simulation.styles import policy_style

    for name in PREFILL_FIRST:
        twin, base = policy_style(name), policy_style(name.removesuffix("-pf"))
        assert (twin.colour, twin.marker) == (base.colour, base.marker) and twin.hatch == "xx"
        assert twin.linestyle != base.linestyle


def test_the_batch_former_picks_the_baselines_of_each_default_list():
    assert on_batch_former(["ssjf", "dwise-refined"], "mixed") == ["ssjf", "dwise-refined"]
    assert on_batch_former(["ssjf", "dwise-refined"], "prefill-first") == ["ssjf-pf", "dwise-refined"]
    assert on_batch_former(["dwise-oracle", "ssjf", "sglang-default"], "both") == [
        "sglang-default", "ssjf-pf", "ssjf", "dwise-oracle"]
    assert on_batch_former(["ltr-pf"], "prefill-first") == ["ltr-pf"]
    w = workload([0, 1], [2, 3])  # no bundle: the schedulers that need no predictions
    sglang = ["sglang-default", "sglang-sync"]
    assert available_policies(w) == [*sglang, "fcfs-mixed", "mlfq", "dwise-zero", "dwise-oracle"]
    assert available_policies(w, "prefill-first") == [*sglang, "mlfq-pf", "fcfs-mixed", "dwise-zero", "dwise-oracle"]
    assert available_policies(w, "both") == [*sglang, "mlfq-pf", "fcfs-mixed", "mlfq", "dwise-zero", "dwise-oracle"]
    with pytest.raises(ConfigError, match="`batch_former` must be one of mixed, prefill-first, both"):
        on_batch_former(["ssjf"], "sideways")


def test_a_prefill_round_stalls_every_resident_of_a_preemptive_baseline():
    """B = 2, k = 8, LTR keys fixed at P + r̂. A and B (P = 0, 4 rounds, key 4) arrive at t = 0, C
    (P = 1, 1 round, key 2) at t = 1 s, after round 1.
    Mixed: round 2 runs C's prompt block beside A (B, tied with A, arrived later: preempted), round 3
    C's denoising round (done) beside A, round 4 A (done) and B, rounds 5-6 B.
    Prefill-first: round 2 is C's prompt block alone (A and B stalled), so A finishes a round later."""
    w = workload([0, 0, 1], [4, 4, 1], admission=[4, 4, 1])
    arrivals = (np.arange(3), np.array([0.0, 0.0, 1.0]))
    mixed = simulate(w, "ltr", ONE_SECOND, arrivals, record=True)
    barrier = simulate(w, "ltr-pf", ONE_SECOND, arrivals, record=True)
    assert mixed.completion_round.tolist() == [4, 6, 3]
    assert [ids for ids, _ in mixed.run_log] == [["A", "B"], ["C", "A"], ["C", "A"], ["A", "B"], ["B"], ["B"]]
    assert barrier.completion_round.tolist() == [5, 6, 3]
    assert [ids for ids, _ in barrier.run_log] == [["A", "B"], ["C"], ["C", "A"], ["A", "B"], ["A", "B"], ["B"]]
    assert barrier.run_log[1][1] == [True]  # the stalling round is prefill-only
    assert barrier.metrics["prefill_only_rounds_pct"] == pytest.approx(100 / 6)


def test_ssjf_on_the_prefill_first_former_with_equal_keys_is_sglangs_default():
    """Equal prompts and equal estimates leave SSJF's order to arrival: on SGLang's former, with B
    residents, it is SGLang's default round for round; on the mixed former it is not."""
    rng = np.random.default_rng(0)
    rounds = rng.integers(1, 20, 24)
    w = workload(np.full(24, 2), rounds, admission=np.full(24, 5.0))
    cfg = SimConfig(slots=4, k=8, round_ms=1000.0, slot_ms=0.0)
    arrivals = make_arrivals(24, cfg)
    sglang = simulate(w, "sglang-default", cfg, arrivals).completion_round
    assert simulate(w, "ssjf-pf", cfg, arrivals).completion_round.tolist() == sglang.tolist()
    assert simulate(w, "ssjf", cfg, arrivals).completion_round.tolist() != sglang.tolist()


def test_rows_of_both_formers_carry_the_speedup_and_the_gain_of_the_mixed_former():
    rng = np.random.default_rng(1)
    rounds = rng.integers(1, 30, 40)
    w = workload(rng.integers(0, 6, 40), rounds, admission=rounds * rng.uniform(0.5, 2.0, 40))
    policies = on_batch_former(["sglang-default", "fcfs-mixed", "ssjf", "mlfq"], "both")
    rows = compare_arrivals(w, SimConfig(slots=4, k=4), ["burst"], policies=policies)
    mean = {r["policy"]: r["mean_latency_s"] for r in rows}
    assert [r["policy"] for r in rows] == ["sglang-default", "mlfq-pf", "ssjf-pf", "fcfs-mixed", "mlfq", "ssjf"]
    for r in rows:
        assert r["speedup_vs_default"] == pytest.approx(mean["sglang-default"] / mean[r["policy"]])
    gains = {g["step"]: g["gain"] for g in gain_decomposition(rows)}
    assert gains["mixed former (ssjf)"] == pytest.approx(mean["ssjf-pf"] / mean["ssjf"])
    assert gains["mixed former (mlfq)"] == pytest.approx(mean["mlfq-pf"] / mean["mlfq"])
    assert gains["mixed batching"] == pytest.approx(mean["sglang-default"] / mean["fcfs-mixed"])


def test_each_row_reports_rho_of_its_ranking_with_the_work():
    """P = 2, 0, 1 and T = 1, 5, 1: work 3, 5, 2 (ranks 2, 3, 1).
    dwise-zero ranks by P (ranks 3, 1, 2): d = 1, -2, 1, ρ = 1 - 6·6 / (3·8) = -0.5.
    ssjf ranks by P + r̂ = 5, 4, 2 with r̂ = 3, 4, 1 (ranks 3, 2, 1): d = 1, -1, 0, ρ = 0.5.
    s3 ranks by P + bucket(r̂) = 6, 4, 2: ρ = 0.5 too. Refined: P + 1 + (T - 1) is the work: ρ = 1.
    FCFS, SGLang and MLFQ rank by no estimate; the oracle ranks by the work itself."""
    w = workload([2, 0, 1], [1, 5, 1], admission=[3, 4, 1], refined=[0, 4, 0])
    rho = ranking_accuracy(w, ["sglang-default", "fcfs-mixed", "mlfq", "mlfq-pf", "dwise-zero", "ssjf", "ssjf-pf",
                               "s3", "dwise-admission", "dwise-refined", "dwise-oracle"])
    for name in ("sglang-default", "fcfs-mixed", "mlfq", "mlfq-pf"):
        assert rho[name] == {"rho_admission": None, "rho_refined": None}, name
    assert rho["dwise-zero"] == {"rho_admission": pytest.approx(-0.5), "rho_refined": None}
    assert rho["ssjf"] == rho["ssjf-pf"] == {"rho_admission": pytest.approx(0.5), "rho_refined": None}
    assert rho["s3"]["rho_admission"] == pytest.approx(0.5)
    assert rho["dwise-admission"] == {"rho_admission": pytest.approx(0.5), "rho_refined": None}
    assert rho["dwise-refined"] == {"rho_admission": pytest.approx(0.5), "rho_refined": pytest.approx(1.0)}
    assert rho["dwise-oracle"] == {"rho_admission": pytest.approx(1.0), "rho_refined": pytest.approx(1.0)}


def test_latency_deltas_weigh_each_category_by_its_requests():
    """sglang-default: mcq 2 requests at 10 s, chat 6 at 20 s (all: 17.5 s); ssjf: mcq 4 s, chat
    24 s (all: 19 s). Δ on mcq -6, on the others +4, on all +1.5 (the paper's pattern: a gain on
    the short subset paid for by the rest)."""
    tails = [{"arrival": "burst", "policy": p, "category": c, "requests": n, "mean_latency_s": s}
             for p, c, n, s in (("sglang-default", "mcq", 2, 10.0), ("sglang-default", "chat", 6, 20.0),
                                ("ssjf", "mcq", 2, 4.0), ("ssjf", "chat", 6, 24.0))]
    assert latency_deltas(tails, ["mcq"]) == [{"quantity": "Δ mean latency s, ssjf, burst", "subset": -6.0,
                                               "other": 4.0, "all": 1.5}]
    assert latency_deltas([t for t in tails if t["policy"] == "ssjf"], ["mcq"]) == []  # no reference: no Δ


@pytest.fixture(scope="module")
def anti_correlated():
    """Synthetic traces whose output tokens equal the work in mcq and hard_mcq (short requests) and
    fall as the work rises in the other categories (long ones): an output-length ranker orders the
    subset perfectly (ρ = 1), the others backwards (ρ = -1), and all of them well only because it
    puts the short subset first (ρ > 0)."""
    from dwise_predict.traces.synthetic import make_synthetic_traces

    categories = {"mcq": (0.3, 40, 1.0), "hard_mcq": (0.6, 40, 1.0), "chat": (3.0, 60, 1.0), "code": (3.5, 120, 8.0)}
    # a budget of 20,000 tokens leaves room for 10,000 - work output tokens (the rounds do not depend on it)
    ds = make_synthetic_traces(n_requests=400, hidden_size=8, categories=categories, budget=20_000, seed=2)
    req = ds.requests
    work = (req["prompt_blocks"] + req["total_rounds"]).to_numpy()
    inside = req["category"].isin(["mcq", "hard_mcq"]).to_numpy()
    req["output_tokens"] = np.where(inside, work, 10_000 - work)
    return ds


def test_table_12_output_length_misorders_the_work_outside_the_short_subset(anti_correlated):
    ds = anti_correlated
    eval_ds = ds.subset(ds.requests["split"].to_numpy() == "eval")
    ranked = sim_requests_from_traces(ds, "eval")
    scores = output_length_scores(ds, "eval", lambda message: None)
    assert set(scores) == {OUTPUT_TOKENS, OUTPUT_LIGHTGBM}
    assert scores[OUTPUT_TOKENS].tolist() == eval_ds.requests["output_tokens"].tolist()
    tails: list[dict] = []
    rows = compare_arrivals(ranked, SimConfig(slots=8, k=4), ["burst"], policies=["sglang-default", "dwise-oracle"],
                            tails=tails)
    table = subset_table(ranked, ["mcq", "hard_mcq"], ["sglang-default", "dwise-oracle"], tails, scores)
    by = {r["quantity"]: r for r in table["rows"]}
    assert table["columns"] == ["mcq, hard_mcq", "other", "all"] and "not by a predicted output length" in table["note"]
    inside = eval_ds.requests["category"].isin(["mcq", "hard_mcq"]).to_numpy()
    work = (eval_ds.requests["prompt_blocks"] + eval_ds.requests["total_rounds"]).to_numpy()
    assert by["requests %"]["subset"] == pytest.approx(100 * inside.mean())
    assert by["work %"]["subset"] == pytest.approx(100 * work[inside].sum() / work.sum())
    assert by["work %"]["subset"] < 15 < by["requests %"]["subset"]  # many requests, little work (the paper: 23 %, 3.1 %)
    tokens = by[f"ρ, {OUTPUT_TOKENS}"]
    assert tokens["subset"] == pytest.approx(1.0) and tokens["other"] == pytest.approx(-1.0) and tokens["all"] > 0.3
    assert by[f"ρ, {OUTPUT_LIGHTGBM}"]["other"] is not None
    oracle = by["ρ, dwise-oracle at admission"]
    assert (oracle["subset"], oracle["other"], oracle["all"]) == pytest.approx((1.0, 1.0, 1.0))
    assert "ρ, sglang-default at admission" not in by  # it ranks by no estimate
    delta = by["Δ mean latency s, dwise-oracle, burst"]
    mean = {r["policy"]: r["mean_latency_s"] for r in rows}
    assert delta["all"] == pytest.approx(mean["dwise-oracle"] - mean["sglang-default"])


def test_simulate_replays_both_formers_and_table_12_from_the_command_line(synthetic_traces, tmp_path, capsys):
    from dwise_predict.cli import main
    from dwise_predict.traces import write_traces

    traces = write_traces(synthetic_traces, tmp_path / "traces")
    args = ["simulate", str(traces), "--requests", "0", "--slots", "8", "--k", "4", "--arrival", "burst",
            "--policies", "sglang-default,fcfs-mixed,mlfq,dwise-oracle", "--batch-former", "both",
            "--subset", "mcq,hard_mcq"]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in printed["rows"]}
    assert list(rows) == ["sglang-default", "mlfq-pf", "fcfs-mixed", "mlfq", "dwise-oracle"]
    assert [r["batch_former"] for r in rows.values()] == ["prefill-first", "prefill-first", "mixed", "mixed", "mixed"]
    assert rows["mlfq-pf"]["rho_admission"] is None and rows["dwise-oracle"]["rho_refined"] == pytest.approx(1.0)
    assert rows["mlfq-pf"]["speedup_vs_default"] > 0
    quantities = [r["quantity"] for r in printed["subset_table"]["rows"]]
    assert quantities[:4] == ["requests %", "work %", f"ρ, {OUTPUT_TOKENS}", f"ρ, {OUTPUT_LIGHTGBM}"]
    assert "Δ mean latency s, mlfq-pf, burst" in quantities
    assert main([*args, "--out", str(tmp_path / "sim")]) == 0
    text = capsys.readouterr().out
    assert "batch former" in text and "prefill-first" in text and "(the DWISE paper's Table 12)" in text
    assert "mixed former (mlfq) (mlfq-pf → mlfq)" in text
    saved = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    assert saved["subset_table"] == printed["subset_table"]
    report = (tmp_path / "sim" / "report.md").read_text()
    assert "| ρ at admission | ρ after refinement |" in report and "| mlfq-pf | prefill-first |" in report
    assert "Table 12" in report


def test_the_former_and_rho_columns_show_only_where_rows_carry_them():
    """The quickstart's rows (compare_arrivals alone) carry neither, so its tables stay as they were;
    ``simulate``'s rows print "—" where a scheduler ranks by no estimate."""
    from rich.console import Console

    from dwise_predict.simulation.report import render_table, scheduler_table

    plain = [{"arrival": "burst", "policy": "mlfq", "mean_latency_s": 1.5}]
    assert "batch former" not in scheduler_table(plain, "arrival").columns
    assert "ρ at admission" not in scheduler_table(plain, "arrival").columns
    rows = [{**plain[0], "policy": "mlfq-pf", "batch_former": "prefill-first", "rho_admission": None,
             "rho_refined": None},
            {**plain[0], "policy": "ssjf", "batch_former": "mixed", "rho_admission": 0.5, "rho_refined": None}]
    report = scheduler_table(rows, "arrival")
    assert report.columns[:4] == ["arrival", "scheduler", "batch former", "mean s"]
    assert report.columns[-3:] == ["ρ at admission", "ρ after refinement", "adds"]
    assert report.rows[0][-3:-1] == ["—", "—"] and report.rows[1][-3:-1] == ["0.50", "—"]
    assert report.rows[0][-1] == "work-done levels (prefill-first)"
    console = Console(width=400, record=True)
    console.print(render_table(rows, "t"))
    line = next(x for x in console.export_text().splitlines() if "mlfq-pf" in x)
    assert "prefill-first" in line and line.count("—") == 2


def test_a_subset_of_ten_thousand_unknown_names_is_refused_in_a_short_line():
    from types import SimpleNamespace

    from dwise_predict.simulation.work_ranking import subset_masks

    workload = SimpleNamespace(categories=np.array(["chat", "code", "chat"]))
    with pytest.raises(ConfigError) as refused:
        subset_masks(workload, [f"x{i}" for i in range(10_000)])
    message = str(refused.value)
    assert "x0, x1, x2, x3, x4, x5, x6, x7 and 9,992 more" in message and "(they hold: chat, code)" in message
    assert len(message) < 200
