"""`dwise-predict refresh` on synthetic traffic of known structure (dwise_predict.traces.synthetic).

The serving bundle (`tiny@1` in a zoo) is trained with a light recipe on regime A: remaining rounds
grow with a latent difficulty that only the first-round hidden state sees. Recordings of regime A
(fresh requests of the same law) give a candidate that cannot rank better: nothing is published.
Recordings of a shifted regime hold the same kind of prompts and states, but their rounds follow
the opposite rule (the outcomes handed out in reverse order of the difficulty): the serving bundle
ranks them backwards, a candidate trained on them ranks them forwards, wins beyond its interval and
is published as `tiny@2`, once, however often the refresh is rerun.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dwise_predict.cli import main
from dwise_predict.errors import BundleError
from dwise_predict.traces import TraceDataset, load_traces, write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

CATEGORIES = {"chat": (2.8, 60, 1.0), "code": (3.3, 140, 12.0), "math": (3.0, 90, 2.0), "mcq": (1.2, 120, 6.0)}
# a light recipe (one closed-form refinement candidate, 20 trees): what `refresh` must train again
RECIPE = dict(width=32, members=1, max_epochs=20, patience=3, lr=1e-2, batch_size=32, bootstrap=50, num_threads=1,
              refine="ridge", admission_trees=20)
OUTCOME = ["total_rounds", "rounds_per_block", "output_tokens", "finish", "oracle_remaining"]


def as_recording(ds: TraceDataset, prefix: str, manifest: dict) -> TraceDataset:
    """``ds`` as the recorder writes it: its own request ids, arrival order in ``workload_index``,
    the served model and decoding of ``manifest``."""
    requests = ds.requests.assign(request_id=[f"{prefix}-{i:05d}" for i in range(len(ds))],
                                  workload_index=np.arange(len(ds)))
    return TraceDataset(requests, ds.first_round, ds.prompt_last,
                        {**ds.manifest, "model": manifest["model"], "decoding": manifest["decoding"]})


def reversed_rounds(ds: TraceDataset) -> TraceDataset:
    """The same requests, each given the outcome (rounds, blocks, output) of the request at the
    mirrored place in difficulty order: the rounds now fall as the difficulty grows."""
    order = np.argsort(ds.requests["difficulty"].to_numpy())
    requests = ds.requests.copy()
    requests.loc[order, OUTCOME] = ds.requests.loc[order[::-1], OUTCOME].to_numpy()
    return TraceDataset(requests, ds.first_round, ds.prompt_last, ds.manifest)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.exports.zoo import publish
    from dwise_predict.training import TrainConfig, train_run

    root = tmp_path_factory.mktemp("refresh")
    regime_a = make_synthetic_traces(1000, 16, categories=CATEGORIES, difficulty_scale=1.5, eval_fraction=0.3, seed=1)
    rows = np.arange(len(regime_a))
    write_traces(regime_a.subset(rows < 400), root / "original")
    train_run(root / "original", root / "run", TrainConfig(**RECIPE))
    export_bundle(root / "run", root / "bundle", name="tiny", n_probes=16)
    publish(root / "bundle", root / "zoo", name="tiny", verify=False)  # screened; verify is export's own test
    manifest = regime_a.manifest
    write_traces(as_recording(regime_a.subset((rows >= 400) & (rows < 600)), "same", manifest), root / "same")
    write_traces(as_recording(reversed_rounds(regime_a.subset(rows >= 600)), "shift", manifest), root / "shift")
    return SimpleNamespace(root=root, original=root / "original", bundle=root / "bundle", zoo=root / "zoo",
                           same=root / "same", shift=root / "shift", manifest=manifest)


def zoo_copy(world, tmp_path: Path) -> Path:
    """A zoo of this test's own, holding tiny@1."""
    return Path(shutil.copytree(world.zoo, tmp_path / "zoo"))


def versions(zoo: Path) -> list[str]:
    from dwise_predict.bundles.zoo import list_entries

    return [e["version"] for e in list_entries(zoo) if e["name"] == "tiny"]


def error_line(err: str) -> str:
    """The one line a refused command prints on stderr, after any progress lines."""
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    return lines[-1]


def test_a_shifted_regime_publishes_a_candidate_once_and_a_rerun_resumes(world, tmp_path, capsys):
    from dwise_predict.bundles.manifest import read_bundle_manifest
    from dwise_predict.bundles.zoo import find_entry

    zoo, out = zoo_copy(world, tmp_path), tmp_path / "refresh"
    command = ["refresh", str(world.shift), "--zoo", str(zoo), "--name", "tiny", "--out", str(out), "--bootstrap", "300"]
    assert main(command) == 0
    printed = capsys.readouterr()
    assert "decision: published" in printed.out and "published as tiny@2" in printed.out
    record = json.loads((out / "refresh.json").read_text())
    serving, candidate = record["figures"]["serving"], record["figures"]["candidate"]
    assert serving["refined_rho"] < -0.4 and candidate["refined_rho"] > 0.4  # backwards, then forwards
    assert record["differences"]["refined_rho"]["interval"][0] > 0.5
    assert record["differences"]["within_category_rho"]["interval"][0] > 0.3
    assert record["differences"]["mean_latency_s"]["interval"][1] < 0  # the candidate schedules them faster
    assert candidate["mean_latency_s"] < serving["mean_latency_s"]
    assert 0.7 < candidate["calibration_ratio"] < 1.3
    assert record["serving"]["version"] == "1" and record["recipe"]["source"] == "the serving bundle's recipe"
    assert record["recipe"]["options"]["refine"] == "ridge" and record["recipe"]["options"]["admission_trees"] == 20
    assert record["window"]["requests"] == 400 and 50 < record["window"]["held_out"] < 110
    assert record["decision"] == "published" and record["published"]["version"] == "2"
    assert versions(zoo) == ["1", "2"]
    published = find_entry(zoo, "tiny")
    made = read_bundle_manifest(out / "candidate")
    assert published["created"] == made.created and made.recipe == read_bundle_manifest(world.bundle).recipe

    assert main(command) == 0  # rerun: nothing trained or published again, the same decision
    rerun = capsys.readouterr()
    assert "already trained" in rerun.err and "exporting" not in rerun.err
    assert versions(zoo) == ["1", "2"]
    again = json.loads((out / "refresh.json").read_text())
    assert again["published"] == record["published"] and again["serving"]["version"] == "1"
    assert again["figures"] == record["figures"]


def test_recordings_of_the_serving_regime_publish_nothing_and_say_why(world, tmp_path):
    from dwise_predict.refresh import RefreshConfig, Sources, refresh

    zoo = zoo_copy(world, tmp_path)
    sources = Sources((world.same,), zoo=zoo, name="tiny", traces=world.original)
    record = refresh(sources, tmp_path / "refresh", RefreshConfig(bootstrap=300))
    low, high = record["differences"]["refined_rho"]["interval"]
    assert low < 0 < high and abs(record["differences"]["refined_rho"]["difference"]) < 0.1
    assert record["figures"]["serving"]["refined_rho"] > 0.5 and record["figures"]["candidate"]["refined_rho"] > 0.5
    assert record["decision"] == "not published" and record["published"] is None and not record["candidate_wins"]
    assert "does not rank the held-out requests better" in record["why"]
    original = len(load_traces(world.original).split("train"))
    assert record["window"]["original_train"] == original and record["window"]["training"] == original + record["window"]["train"]
    assert json.loads((tmp_path / "refresh" / "refresh.json").read_text()) == record
    assert versions(zoo) == ["1"]


def test_a_window_too_small_to_judge_is_refused_and_says_how_many(world, tmp_path, capsys):
    out = tmp_path / "refresh"
    assert main(["refresh", str(world.shift), "--bundle", str(world.bundle), "--window", "100", "--out", str(out)]) == 1
    err = error_line(capsys.readouterr().err)
    assert err.startswith("error: too few requests to judge")
    assert "judging needs at least 30" in err and "--window" in err
    record = json.loads((out / "refresh.json").read_text())
    assert record["decision"] == "refused" and record["window"]["requests"] == 100 and record["published"] is None
    assert not (out / "run").exists() and not (out / "candidate").exists()


def _other_block_size(world, tmp_path: Path) -> list[str]:
    ds = make_synthetic_traces(200, 16, categories=CATEGORIES, block_size=4, seed=2)
    write_traces(as_recording(ds, "b4", {"model": world.manifest["model"], "decoding": ds.manifest["decoding"]}),
                 tmp_path / "b4")
    return [str(tmp_path / "b4"), "--out", str(tmp_path / "out")]


def _empty_recording(world, tmp_path: Path) -> list[str]:
    """A recording whose server never finished a request: its manifest and nothing else."""
    (tmp_path / "empty").mkdir()
    shutil.copy(world.shift / "manifest.json", tmp_path / "empty" / "manifest.json")
    return [str(tmp_path / "empty"), "--out", str(tmp_path / "out")]


def _out_is_a_recording(world, tmp_path: Path) -> list[str]:
    recording = Path(shutil.copytree(world.shift, tmp_path / "rec"))
    return [str(recording), "--out", str(recording)]


@pytest.mark.parametrize("args, says", [
    (_other_block_size, "decoding.block_size = 8"),
    (_empty_recording, "holds no shards and no readable traces"),
    (_out_is_a_recording, "is the input RECORDINGS"),
], ids=["mismatched-decoding", "empty-recording", "out-is-a-recording"])
def test_bad_inputs_are_one_line_and_change_nothing(world, tmp_path, capsys, args, says):
    zoo = zoo_copy(world, tmp_path)
    given = args(world, tmp_path)
    before = {p: p.read_bytes() for p in Path(given[0]).rglob("*") if p.is_file()}
    assert main(["refresh", *given, "--zoo", str(zoo), "--name", "tiny"]) == 1
    assert says in error_line(capsys.readouterr().err)
    assert versions(zoo) == ["1"]
    assert {p: p.read_bytes() for p in Path(given[0]).rglob("*") if p.is_file()} == before
    assert not (tmp_path / "out" / "candidate").exists()


def test_conflicting_sources_are_refused_naming_the_flags(world, tmp_path, capsys):
    assert main(["refresh", str(world.shift), "--out", str(tmp_path / "out")]) == 1
    assert "give the serving bundle: --bundle, or --zoo with --name" in capsys.readouterr().err
    assert main(["refresh", str(world.shift), "--bundle", str(world.bundle), "--publish", "--out", str(tmp_path / "o")]) == 1
    assert "--publish needs --zoo" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_the_recipe_comes_from_the_bundle_else_the_defaults_said_so(world):
    from dwise_predict.bundles.manifest import read_bundle_manifest
    from dwise_predict.refresh import bundle_recipe
    from dwise_predict.training import TrainConfig

    manifest = read_bundle_manifest(world.bundle)
    assert manifest.recipe == {**TrainConfig(**RECIPE).to_dict()}
    recipe, source = bundle_recipe(SimpleNamespace(manifest=manifest, path=world.bundle))
    assert recipe == TrainConfig(**RECIPE) and source == "the serving bundle's recipe"
    recipe, source = bundle_recipe(SimpleNamespace(manifest=SimpleNamespace(recipe=None), path=world.bundle))
    assert recipe == TrainConfig() and source.startswith("the TrainConfig defaults")
    with pytest.raises(BundleError, match="unknown training options warp"):
        bundle_recipe(SimpleNamespace(manifest=SimpleNamespace(recipe={"warp": 9}), path=world.bundle))


@pytest.mark.parametrize("rho, latency, wins, says", [
    ([0.10, 0.30], [-0.40, -0.10], True, "ranks the held-out requests better"),
    ([0.10, 0.30], [-0.10, 0.40], True, "schedules them no worse"),  # not slower beyond its interval
    ([0.10, 0.30], [0.20, 0.50], False, "schedules worse beyond its interval"),
    ([-0.01, 0.30], [-0.40, -0.10], False, "reaches 0"),
    (None, [-0.40, -0.10], False, "undefined"),
])
def test_the_rule_needs_the_refined_rho_interval_above_0_and_no_slower_schedule(rho, latency, wins, says):
    from dwise_predict.refresh import decide

    differences = {"refined_rho": {"difference": None if rho is None else sum(rho) / 2, "interval": rho},
                   "mean_latency_s": {"difference": sum(latency) / 2, "interval": latency}}
    won, why = decide(differences)
    assert won is wins and says in why
