"""`evaluate --ablate inputs|train-size|seeds` and the "which predictor won" verdict.

Known answer: in the synthetic traces the difficulty is seen only by the first-round hidden state,
so within a category the rows without h1 rank near 0 and the rows with it well above.
"""

import dataclasses
import json

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.cli.app import INTERRUPTED
from dwise_predict.evaluation.ablate import ablate, score_rows
from dwise_predict.evaluation.baselines import WITHOUT_FIRST_ROUND
from dwise_predict.evaluation.pool import result_key
from dwise_predict.metrics import rank_scores, stratified_indices
from dwise_predict.training.candidates import NAMES as CANDIDATES
from evaluate_helpers import fast_config, fixed_config, make_traces, write


def test_paired_bootstrap_known_answers():
    rng = np.random.default_rng(0)
    cats = np.repeat(["a", "b", "c", "d"], 50)
    true = rng.gamma(2.0, 5.0, cats.size)
    preds = {"perfect": true.copy(), "same": true.copy(), "noise": rng.standard_normal(cats.size),
             "good": true + rng.normal(0, 2.0, cats.size)}
    rows = [{"name": n} for n in preds]
    table = score_rows(rows, preds, true, cats, "perfect", 300, 0)
    by = {r["name"]: r for r in table["rows"]}
    assert by["perfect"]["spearman"] == pytest.approx(1.0) and by["perfect"]["within_category_ci"] == [1.0, 1.0]
    assert by["same"]["delta_vs_reference"]["within_category_ci"] == [0.0, 0.0]
    noise = by["noise"]["delta_vs_reference"]
    assert noise["within_category_mean"] < -0.8 and noise["within_category_ci"][1] < 0  # clearly worse
    lo, hi = by["good"]["within_category_ci"]
    assert lo <= by["good"]["within_category_mean"] <= hi
    assert table["verdict"]["best"] in ("perfect", "same")
    # resampling stays inside each category
    idx = stratified_indices(cats, 20, 1)
    assert (cats[idx] == cats[None, :]).all()
    overall, within = rank_scores(preds["good"], true, cats)
    assert overall.shape == within.shape == (1,)


def test_train_size_and_seeds_ablations():
    ds = make_traces()
    train, ev = ds.split("train"), ds.split("eval")
    # in this process: that a pool of workers gives the same numbers as one process is
    # test_evaluate_loco::test_parallel_retraining_gives_the_same_numbers (the same run_tasks)
    sizes = ablate("train-size", train, ev, fast_config(), n_boot=100, jobs=1)
    rows = {r["name"]: r for r in sizes["rows"]}
    shipped = [rows[f"ridge-within+signals, {f} of train"] for f in ("25%", "50%", "100%")]
    assert shipped[0]["n_train"] < shipped[1]["n_train"] < shipped[2]["n_train"] == len(train)
    assert sizes["reference"] == "survival, 100% of train"
    # each size of the shipped candidate also retrains without each category: the synthetic work
    # transfers (one shared direction); the reference ensemble's rows skip it
    for r in shipped:
        assert set(r["held_out"]) == {"chat", "code", "math", "mcq"}
        assert r["held_out_mean"] == pytest.approx(np.mean(list(r["held_out"].values())))
    assert shipped[2]["held_out_mean"] > 0.5
    assert all("held_out" not in r for r in sizes["rows"] if r["candidate"] == "survival")
    seeds = ablate("seeds", train, ev, fast_config(), n_boot=100, jobs=1)
    summary = seeds["summary"]
    assert set(summary) == {"survival", "ridge", "auto"}
    assert summary["ridge"]["within_category_mean"]["sd"] == pytest.approx(0.0)  # ridge has no seed
    assert len(summary["auto"]["seeds"]) == 5
    assert all(s["chosen"] in ("survival", "ridge", "survival+ridge", "ridge-within", "survival-pca") for s in summary["auto"]["seeds"])
    assert "seeds" in seeds["verdict"]["text"]


def test_cli_ablate_inputs_finds_the_first_round_signal_and_names_the_winner(tmp_path, capsys):
    ds = make_traces()
    traces = write(ds, tmp_path / "t")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fast_config().to_dict(), "bootstrap": 100}))
    out = tmp_path / "eval"
    assert main(["evaluate", str(traces), "--out", str(out), "--config", str(config), "--jobs", "1",
                 "--ablate", "inputs"]) == 0
    capsys.readouterr()
    table = json.loads((out / "ablation_inputs.json").read_text())
    assert table["kind"] == "inputs" and len(table["rows"]) == 11  # 5 input sets x 2 candidates + Amin et al.'s
    rows = {r["name"]: r for r in table["rows"]}
    assert table["reference"] == "survival, h1 + last prompt block + prompt tokens + budget + early signals"
    # the synthetic traces' work lives in the first-round state (the last prompt block holds the
    # category only); their early signals are noise
    within = {label: rows[f"ridge-within+signals, {label}"]["within_category_mean"] for label in (
        "h1 + last prompt block + prompt tokens + budget + early signals", "h1 + prompt tokens + budget + early signals",
        "last prompt block + prompt tokens + budget + early signals", "prompt tokens + budget + early signals",
        "h1 + last prompt block + prompt tokens + budget")}
    both, h1_only, prompt_only, neither, no_signals = within.values()
    assert both > 0.5 and h1_only > 0.5 and no_signals > 0.5
    assert both > neither + 0.3 and both > prompt_only + 0.3
    assert rows["early signals (all four), LightGBM"]["bundle"] is False  # a tree ensemble: not a contract-2 graph
    for r in table["rows"]:
        assert r["n_train"] == len(ds.split("train"))
        if r["within_category_mean"] is not None:
            lo, hi = r["within_category_ci"]
            assert lo - 1e-9 <= r["within_category_mean"] <= hi + 1e-9
    verdict = table["verdict"]
    assert verdict["best"] in rows and rows[verdict["best"]]["bundle"]
    assert ("noise" in verdict["text"]) if verdict["best"] != table["reference"] else ("reference" in verdict["text"])
    assert (out / "ablations.md").is_file() and (out / "ablations.html").is_file()
    assert (out / "plots" / "ablation_inputs.png").stat().st_size > 1000
    result = json.loads((out / "evaluation.json").read_text())
    winner = result["winner"]
    assert winner["candidate"] == result["metrics"]["refine_candidate"]
    assert winner["within_category"]["best_baseline"] != "refinement predictor (shipped)"
    assert isinstance(winner["within_category"]["inside_interval"], bool)
    # the shipped recipe less the first-round state is reported beside the winner, never as the baseline to beat
    rows = {r["name"]: r for r in result["baselines"]}
    assert rows[WITHOUT_FIRST_ROUND]["kind"] == "ablation"
    assert WITHOUT_FIRST_ROUND not in (winner["within_category"]["best_baseline"], winner["overall"]["best_baseline"])
    ablation = winner["ablation"]["within_category"]
    assert ablation["ablation"] == pytest.approx(rows[WITHOUT_FIRST_ROUND]["within_category_mean"])
    assert ablation["margin"] == pytest.approx(winner["shipped"]["within_category_mean"] - ablation["ablation"])
    report = (out / "report.md").read_text()
    assert "the shipped refinement predictor (candidate" in report and "paired 95% interval" in report
    assert "Ablation: without the first-round hidden state" in report
    assert "Ablation: inputs" in report
    assert main(["evaluate", str(traces), "--out", str(out), "--ablate", "layers"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ablate layers" in err[0]


def test_cli_across_gives_one_row_per_trace_set_even_for_different_models(tmp_path, capsys):
    a = make_traces(seed=1)
    b = make_traces(seed=2)
    b.manifest["model"] = {**b.manifest["model"], "name": "other-model", "config_hash": "other"}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fast_config().to_dict(), "bootstrap": 50}))
    out = tmp_path / "table"
    args = ["evaluate", str(write(a, tmp_path / "a")), str(write(b, tmp_path / "b")), "--across", "--out", str(out),
            "--config", str(config), "--jobs", "1"]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in result["rows"]][1].startswith("other-model")
    assert len(result["rows"]) == 2 and (out / "across.md").is_file()
    for r in result["rows"]:
        assert r["candidate"] in CANDIDATES
        assert r["refined"]["within_category_mean"] > r["admission"]["within_category_mean"]  # h1 sees difficulty
        assert set(r["cv"]) == set(CANDIDATES)
    summary = result["summary"]
    assert summary["refined ρ"]["n"] == 2 and "held-out-cat ρ" not in summary
    assert summary["refined ρ"]["mean"] == pytest.approx(np.mean([r["refined"]["spearman"] for r in result["rows"]]))
    assert summary["refined ρ"]["sd"] == pytest.approx(np.std([r["refined"]["spearman"] for r in result["rows"]], ddof=1))
    # the baselines' within-category ρ sits beside the refinement's, averaged over the sets too
    ridge_within = [r["baselines"]["ridge on first-round state"]["within_category_mean"] for r in result["rows"]]
    assert summary["ridge within-cat ρ"]["mean"] == pytest.approx(np.mean(ridge_within))
    table = (out / "across.md").read_text()
    assert "mean ± sd over 2 sets" in table and "| early signals within-cat ρ |" in table
    header = next(line for line in table.splitlines() if line.startswith("| traces"))
    last = [line for line in table.splitlines() if line.startswith("| mean ± sd")][0]
    assert header.count("|") == last.count("|")
    column = header.split("|").index(" ridge within-cat ρ ")
    assert last.split("|")[column].strip() == f"{np.mean(ridge_within):.3f} ± {np.std(ridge_within, ddof=1):.3f}"
    assert main(args + ["--hold-out", "a"]) == 1
    assert "drop --hold-out" in capsys.readouterr().err
    # every non-oracle baseline of `evaluate`, with the values `evaluate` gives that set on its own
    assert main(["evaluate", str(tmp_path / "a"), "--out", str(tmp_path / "eval_a"), "--config", str(config),
                 "--jobs", "1"]) == 0
    capsys.readouterr()
    single = {r["name"]: r for r in json.loads((tmp_path / "eval_a" / "baselines.json").read_text())}
    expected = {n for n, r in single.items() if r["kind"] == "baseline"}
    assert "survival on prompt hidden state" in expected and "TRAIL-style probe" in expected
    first = result["rows"][0]
    assert set(first["baselines"]) == expected
    assert set(first["ablations"]) == {n for n, r in single.items() if r["kind"] == "ablation"} == {WITHOUT_FIRST_ROUND}
    for name in expected:
        for measure in ("spearman", "within_category_mean"):
            assert first["baselines"][name][measure] == pytest.approx(single[name][measure])
            assert first["ablations"][WITHOUT_FIRST_ROUND][measure] == pytest.approx(single[WITHOUT_FIRST_ROUND][measure])


def test_across_sets_the_shipped_predictor_against_every_baseline_paired_by_set():
    """The comparison over sets on known rows: paired margins, a Student-t interval of their mean
    (scipy's one-sample t-test interval as the reference), the best baseline and the count of sets."""
    from scipy import stats

    from dwise_predict.evaluation.across import across_document, versus_baselines
    from dwise_predict.evaluation.document import to_markdown

    shipped = [(0.90, 0.60), (0.86, 0.55), (0.88, 0.62), (0.84, 0.50)]
    strong = [(0.91, 0.58), (0.88, 0.50), (0.86, 0.61), (0.85, 0.49)]  # ahead overall, behind within
    weak = [(0.80, 0.40), (0.78, 0.35), (0.79, 0.45), (0.70, 0.30)]
    strong_name, weak_name = "ridge on first-round state", "early signal: all four"
    without_h1 = [(0.89, 0.61), (0.85, 0.56), (0.87, 0.60), (0.83, 0.52)]  # ahead of every baseline within
    rows = [{"refined": {"spearman": s[0], "within_category_mean": s[1]},
             "baselines": {strong_name: {"spearman": a[0], "within_category_mean": a[1]},
                           weak_name: {"spearman": b[0], "within_category_mean": b[1]}},
             "ablations": {WITHOUT_FIRST_ROUND: {"spearman": c[0], "within_category_mean": c[1]}}}
            for s, a, b, c in zip(shipped, strong, weak, without_h1)]
    versus = versus_baselines(rows)
    # the ablation is the shipped recipe minus an input, never the baseline to beat; its margins stand apart
    ablation = versus["ablations"][WITHOUT_FIRST_ROUND]["within_category_mean"]
    assert ablation["margin"]["mean"] == pytest.approx(-0.005) and ablation["sets_shipped_level_or_ahead"] == 1
    overall = versus["best"]["spearman"]
    margins = np.array([s[0] - a[0] for s, a in zip(shipped, strong)])  # -0.01, -0.02, +0.02, -0.01
    assert overall["baseline"] == strong_name and overall["margin"] == pytest.approx(margins.mean())
    reference = stats.ttest_1samp(margins, 0.0).confidence_interval(0.95)
    assert overall["margin_ci"] == pytest.approx([reference.low, reference.high])
    assert overall["inside_interval"] and overall["sets_shipped_level_or_ahead"] == 1 and overall["sets"] == 4
    within = versus["best"]["within_category_mean"]
    assert within["baseline"] == strong_name and within["margin"] == pytest.approx(0.0225)
    weak_within = versus["baselines"][weak_name]["within_category_mean"]
    assert weak_within["sets_shipped_level_or_ahead"] == 4 and weak_within["margin_ci"][0] > 0  # clearly ahead
    assert weak_within["sd"] == pytest.approx(np.std([b[1] for b in weak], ddof=1))
    text = to_markdown(across_document({"rows": [dict(r, path=f"s{i}", model="m", hidden_size=8, n_train=10,
                                                           n_eval=5, candidate="c", median_ratio_calibrated=1.0,
                                                           admission={"spearman": 0.5, "within_category_mean": 0.1},
                                                           refined=dict(r["refined"], spearman_ci=None))
                                                      for i, r in enumerate(rows)],
                                             "summary": {}, "versus": versus}))
    assert f"trails the best non-oracle baseline, {strong_name} (0.875), by -0.005" in text
    assert "level or ahead in 1 of 4 sets" in text and f"| {weak_name} |" in text
    assert ("Ablation over the 4 sets: without the first-round hidden state the same recipe reaches mean "
            "within-category ρ 0.573, so the first-round state adds -0.005") in text
    assert f"| {WITHOUT_FIRST_ROUND} | 0.573 ± " in text


def test_cli_across_with_loco_gives_each_sets_held_out_mean_and_the_spread(tmp_path, capsys):
    """Two draws of the synthetic workload: each row holds the mean of its per-category held-out ρ
    (the same numbers `evaluate --loco` gives that set), the last row their mean ± sd. One fixed
    candidate (the table's plumbing is under test; the candidate search across sets is
    test_cli_across_gives_one_row_per_trace_set_even_for_different_models)."""
    from dwise_predict.evaluation.evaluate import evaluate

    sets = [make_traces(seed=s) for s in (1, 2)]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fixed_config().to_dict(), "bootstrap": 50}))
    out = tmp_path / "draws"
    args = ["evaluate"] + [str(write(ds, tmp_path / f"d{i}")) for i, ds in enumerate(sets)] + [
        "--across", "--loco", "--out", str(out), "--config", str(config), "--jobs", "1", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    means = []
    for row in result["rows"]:
        held = row["held_out"]
        defined = [v for v in held["categories"].values() if v is not None]
        assert len(held["categories"]) >= 3 and held["mean"] == pytest.approx(np.mean(defined))
        assert held["mean"] > 0.3  # the synthetic difficulty lives in h1 the same way in every category
        means.append(held["mean"])
    alone = evaluate([tmp_path / "d0"], loco=True, jobs=1, config=dataclasses.replace(fixed_config(), bootstrap=50))
    alone = alone.result["loco"]
    assert result["rows"][0]["held_out"]["mean"] == pytest.approx(alone["mean"]["refined"]["held_out"])
    assert result["rows"][0]["held_out"]["categories"] == pytest.approx(
        {r["category"]: r["refined"]["held_out"] for r in alone["rows"]})
    stat = result["summary"]["held-out-cat ρ"]
    assert stat["mean"] == pytest.approx(np.mean(means)) and stat["sd"] == pytest.approx(np.std(means, ddof=1))
    assert "held-out-cat ρ" in (out / "across.md").read_text()
    # --min-requests reaches the held-out columns: above every category's count, none is held out
    from dwise_predict.evaluation.across import across_sets

    strict = across_sets([tmp_path / "d0"], fixed_config(), loco=True, jobs=1, min_requests=10_000)
    held = strict["rows"][0]["held_out"]
    assert held["mean"] is None and held["categories"] == {} and len(held["skipped"]) >= 3


def _snapshot(folder) -> dict:
    """Every file under ``folder`` (hidden ones included) -> its bytes."""
    from pathlib import Path

    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_cli_across_writes_only_a_table_of_its_own(tmp_path, capsys):
    traces = write(make_traces(n_requests=160, seed=1), tmp_path / "a")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fixed_config().to_dict(), "bootstrap": 50}))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = {"a": _snapshot(traces), "mine": _snapshot(mine)}
    for out, says in ((traces, "is the input TRACES"), (mine, "is not an across-set table")):
        assert main(["evaluate", str(traces), "--across", "--out", str(out), "--config", str(config)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert _snapshot(traces) == before["a"] and _snapshot(mine) == before["mine"]  # nothing written
    table = tmp_path / "table"
    assert main(["evaluate", str(traces), "--across", "--out", str(table), "--config", str(config), "--jobs", "1"]) == 0
    (table / "stray.txt").write_text("yours, put into an earlier table")
    capsys.readouterr()
    assert main(["evaluate", str(traces), "--across", "--out", str(table), "--config", str(config), "--jobs", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stray.txt" in err[0], err  # a file a table never holds is yours: kept, not replaced
    assert (table / "stray.txt").read_text() == "yours, put into an earlier table"
    (table / "stray.txt").unlink()
    (table / "across.md").write_text("an earlier table's file")
    assert main(["evaluate", str(traces), "--across", "--out", str(table), "--config", str(config), "--jobs", "1"]) == 0
    capsys.readouterr()
    names = {p.name for p in table.iterdir()}
    assert {"across.html", "across.json", "across.md"} <= names
    assert (table / "across.md").read_text() != "an earlier table's file"  # an earlier table is replaced
    assert not (tmp_path / ".table.kept").exists()  # what was kept for a resume goes once the table is there


def test_an_interrupted_across_table_resumes_from_the_next_set(tmp_path, monkeypatch):
    from dwise_predict.evaluation import across

    paths = [write(make_traces(n_requests=160, seed=s), tmp_path / f"d{s}") for s in (1, 2)]
    straight = across.across_sets(paths, fixed_config(), jobs=1)
    real_fit, fitted = across.fit_kept, []

    def fit_until(limit):
        def fit_kept(train, config, kept, log):
            if len(fitted) == limit:
                raise KeyboardInterrupt
            fitted.append(len(train))
            return real_fit(train, config, kept, log)
        return fit_kept

    kept = tmp_path / ".table.kept"
    monkeypatch.setattr(across, "fit_kept", fit_until(1))
    with pytest.raises(KeyboardInterrupt):  # stopped while training on the second set
        across.across_sets(paths, fixed_config(), jobs=1, finished=kept)
    assert len(list(kept.glob("*.json"))) == 1
    monkeypatch.setattr(across, "fit_kept", fit_until(None))
    logged = []
    resumed = across.across_sets(paths, fixed_config(), log=logged.append, jobs=1, finished=kept)
    assert len(fitted) == 2  # the rerun trained on the second set only
    assert any(str(paths[0]) in line and "evaluated before the interruption" in line for line in logged)
    as_json = lambda result: json.dumps(result, sort_keys=True, default=lambda v: v.tolist())  # noqa: E731
    assert as_json(resumed) == as_json(straight)
    # another option, another row: nothing kept is reused for it
    ds = make_traces(seed=1)
    key = result_key([ds], fixed_config(), loco=False, min_requests=10)
    assert key == result_key([make_traces(seed=1)], fixed_config(), loco=False, min_requests=10)
    assert key != result_key([ds], fixed_config(), loco=True, min_requests=10)
    assert key != result_key([ds], dataclasses.replace(fixed_config(), seed=1), loco=False, min_requests=10)
    assert key != result_key([make_traces(seed=2)], fixed_config(), loco=False, min_requests=10)
    censored = ds.requests.assign(censored=ds.requests.index % 7 == 0)  # an optional column counts too
    assert key != result_key([dataclasses.replace(ds, requests=censored)], fixed_config(), loco=False, min_requests=10)


def test_an_interrupted_evaluation_skips_the_retrainings_already_done(tmp_path, monkeypatch, capsys, loco_evaluation):
    from dwise_predict.evaluation import pool
    from dwise_predict.training import TrainConfig

    traces = write(make_traces(seed=1), tmp_path / "t")  # the traces of the conftest's loco_evaluation
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fast_config().to_dict(), "bootstrap": 50}))
    real, ran = pool.fit_predict, []

    def fit_predict_until(limit):
        def fit_predict(task, jobs=None):
            if len(ran) == limit:
                raise KeyboardInterrupt
            ran.append(task.name)
            return real(task, jobs)
        return fit_predict

    args = ["evaluate", str(traces), "--loco", "--out", str(tmp_path / "eval"), "--config", str(config), "--jobs", "1"]
    monkeypatch.setattr(pool, "fit_predict", fit_predict_until(2))
    assert main(args) == INTERRUPTED  # two held-out categories done, stopped in the third
    err = capsys.readouterr().err
    assert "interrupted: rerun the same command to resume" in err and "resuming" not in err
    kept = tmp_path / ".eval.kept"
    assert len(list(kept.glob("*.safetensors"))) == 2 and not (tmp_path / "eval").exists()
    monkeypatch.setattr(pool, "fit_predict", fit_predict_until(None))
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "resuming an interrupted evaluation" in err and f"kept in {kept}" in err
    assert "2 of" in err and len(ran) == len(set(ran))  # none of the first two again
    assert not kept.exists()  # gone with the evaluation written
    resumed = json.loads((tmp_path / "eval" / "loco.json").read_text())
    assert TrainConfig.from_file(config).to_dict() == fast_config().to_dict()  # what loco_evaluation ran with
    straight = loco_evaluation[1].result["loco"]
    assert json.dumps(resumed, sort_keys=True) == json.dumps(
        json.loads(json.dumps(straight, default=lambda v: v.tolist())), sort_keys=True)


def test_an_evaluation_interrupted_after_its_own_fit_does_not_fit_again(tmp_path, monkeypatch, capsys):
    """Without --run, evaluate fits both predictors first; that fit is kept (as a run directory) so
    the rerun of an evaluation interrupted in its retrainings loads it instead of fitting again."""
    from dwise_predict.evaluation import pool

    ds = make_traces(n_requests=160, seed=1)
    traces = write(ds, tmp_path / "t")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**fixed_config().to_dict(), "bootstrap": 50}))
    args = ["evaluate", str(traces), "--out", str(tmp_path / "eval"), "--config", str(config), "--jobs", "1"]
    assert main(args) == 0
    straight = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    real_fit, real_fit_predict, fits, retrainings = pool.fit, pool.fit_predict, [], []

    def counted_fit(train, config, jobs=None):
        fits.append(len(train))
        return real_fit(train, config, jobs)

    def interrupted(task, jobs=None):
        raise KeyboardInterrupt

    def counted_fit_predict(task, jobs=None):
        retrainings.append(task.name)
        return real_fit_predict(task, jobs)

    monkeypatch.setattr(pool, "fit", counted_fit)
    monkeypatch.setattr(pool, "fit_predict", interrupted)
    assert main(args) == INTERRUPTED  # the main fit done, stopped in the first retraining
    kept = tmp_path / ".eval.kept"
    assert fits == [len(ds.split("train"))] and len(list(kept.glob("*.run"))) == 1
    fits.clear()
    capsys.readouterr()
    monkeypatch.setattr(pool, "fit_predict", counted_fit_predict)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "fitted already (same requests, config and code: an earlier study or run): loaded from" in err
    assert len(fits) == len(retrainings) > 0  # the retrainings only: no second main fit
    assert not kept.exists()
    resumed = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    for key in ("metrics", "baselines", "winner", "loco"):  # the reloaded predictors score as the fitted ones
        assert json.dumps(resumed[key], sort_keys=True) == json.dumps(straight[key], sort_keys=True), key


def test_a_retraining_reused_within_one_command_is_not_called_interrupted(tmp_path):
    """`--ablate inputs --ablate train-size` share a retraining: the second finds it kept by the first.
    Nothing was interrupted, and the message says only what is true: done already, reused."""
    from dwise_predict.evaluation.pool import RetrainTask, run_tasks

    ds = make_traces(n_requests=160, seed=1)
    task = RetrainTask("full", ds.split("train"), ds.split("eval"), fixed_config())
    logged: list[str] = []
    first = run_tasks([task], jobs=1, kept=tmp_path / "kept", log=logged.append)
    assert logged == []  # nothing was there to reuse
    again = run_tasks([task, dataclasses.replace(task, name="other")], jobs=1, kept=tmp_path / "kept", log=logged.append)
    assert logged == [f"  2 of 2 retrainings already done on the same data and config: reused from {tmp_path / 'kept'}"]
    assert not any("interrupt" in line for line in logged)
    np.testing.assert_array_equal(again["full"]["refined"], first["full"]["refined"])
