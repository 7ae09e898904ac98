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


# --- schema 4: the per-round states cross-checked against the table and the manifest (issue 51) ---


@pytest.fixture(scope="module")
def rounds_dir(tmp_path_factory):
    """The synthetic traces with 8 per-round states each, written: round 1 of each request is its first
    round, later rounds random states and signals inside their ranges, zeros after its last round."""
    from dwise_predict.traces.dataset import TraceDataset

    traces, kept = make_synthetic_traces(96, 16, seed=5), 8
    n, h = traces.first_round.shape
    rng = np.random.default_rng(5)
    states = rng.standard_normal((n, kept, h)).astype(np.float32)
    signals = rng.uniform(0.0, 1.0, (n, kept, 4)).astype(np.float32)
    states[:, 0], signals[:, 0] = traces.first_round, traces.early_signals
    recorded = np.minimum(traces.requests["total_rounds"].to_numpy(), kept)
    empty = np.arange(kept)[None, :] >= recorded[:, None]
    states[empty], signals[empty] = 0.0, 0.0
    rounds = TraceDataset(traces.requests.assign(rounds_recorded=recorded), traces.first_round, traces.prompt_last,
                          {**traces.manifest, "rounds_hidden": kept}, None,
                          {"round_states": states, "round_signals": signals})
    return write_traces(rounds, tmp_path_factory.mktemp("r") / "t")


def _edit(src, dst, *, manifest=None, table=None, tensors=None):
    """A copy of trace directory ``src`` at ``dst`` with ``manifest`` / ``table`` / ``tensors`` edited in place."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if manifest:
        written = json.loads((dst / "manifest.json").read_text())
        manifest(written)
        (dst / "manifest.json").write_text(json.dumps(written))
    if table:
        requests = pd.read_parquet(dst / "requests.parquet")
        table(requests)
        requests.to_parquet(dst / "requests.parquet", index=False)
    if tensors:
        stored = load_file(str(dst / "hidden.safetensors"))
        tensors(stored)
        save_file(stored, str(dst / "hidden.safetensors"))
    return dst


def _short(tensors) -> int:
    """The first request whose rounds end before the tensors' last row (that row is padding)."""
    padding = ~tensors["round_signals"][:, 7].any(axis=1)
    assert padding.any()
    return int(np.argmax(padding))


CONTRACT_BREAKS = {
    "manifest depth": (dict(manifest=lambda m: m.update(rounds_hidden=4)),
                       r"the manifest in .* says rounds_hidden 4, but 'round_states' holds 8 rounds per request"),
    "manifest depth true": (dict(manifest=lambda m: m.update(rounds_hidden=True)), r"says rounds_hidden True, but"),
    "row 0 state": (dict(tensors=lambda t: t["round_states"].__setitem__((7, 0, 3), 0.5)),
                    r"request 'syn-000007' in .*: row 0 of 'round_states' is not its first_round .*re-collect"),
    "row 0 signal": (dict(tensors=lambda t: t["round_signals"].__setitem__((9, 0, 1), 0.0)),
                     r"request 'syn-000009' in .*: row 0 of 'round_signals' holds mean_confidence 0, but its column "
                     r"says 0\.\d+ \(row 0 holds the first round's signals\)"),
    "fractional count": (dict(table=lambda r: r.__setitem__("rounds_recorded", r["rounds_recorded"] + 0.5)),
                         r"request 'syn-000000' in .*: rounds_recorded is 8\.5, not a whole number of rounds"),
    "share of 1e6": (dict(tensors=lambda t: t["round_signals"].__setitem__((12, 2, 0), 1e6)),
                     r"request 'syn-000012' in .*: 'round_signals' holds frac_over_threshold 1e\+06 at round 3, "
                     r"outside \[0, 1\]: the traces are corrupt; re-collect them"),
    "probability over 1": (dict(tensors=lambda t: t["round_signals"].__setitem__((12, 1, 3), 1.5)),
                           r"'round_signals' holds end_probability 1\.5 at round 2, outside \[0, 1\]"),
    "negative entropy": (dict(tensors=lambda t: t["round_signals"].__setitem__((12, 1, 2), -0.25)),
                         r"'round_signals' holds mean_entropy -0\.25 at round 2, which must be finite and >= 0"),
    "infinite entropy": (dict(tensors=lambda t: t["round_signals"].__setitem__((12, 1, 2), np.inf)),
                         r"'round_signals' holds mean_entropy inf at round 2, which must be finite and >= 0: the traces are "
                         r"corrupt; re-collect them"),
    # the states themselves, not the signals: NaN or inf in a later round or in the zero rows after the last
    "nan state": (dict(tensors=lambda t: t["round_states"].__setitem__((12, 2, 5), np.nan)),
                  r"request 'syn-000012' in .*: 'round_states' holds NaN or inf at round 3: the traces are corrupt"),
    "inf state": (dict(tensors=lambda t: t["round_states"].__setitem__((12, 1, 0), -np.inf)),
                  r"request 'syn-000012' in .*: 'round_states' holds NaN or inf at round 2: the traces are corrupt"),
    "nan after the last round": (dict(tensors=lambda t: t["round_states"].__setitem__((_short(t), 7, 0), np.nan)),
                                 r"'round_states' holds NaN or inf at round 8: the traces are corrupt"),
    "nan signal": (dict(tensors=lambda t: t["round_signals"].__setitem__((12, 2, 1), np.nan)),
                   r"'round_signals' holds mean_confidence nan at round 3, outside \[0, 1\]"),
    "tensors lost": (dict(tensors=lambda t: [t.pop("round_states"), t.pop("round_signals")]),
                     r"hold the column rounds_recorded, the manifest's rounds_hidden but not 'round_states', "
                     r"'round_signals': the files come from different collections; re-collect"),
}


def test_rounds_fixture_is_whole_and_its_rows_are_where_the_breaks_expect(rounds_dir):
    from dwise_predict.traces.round_states import round_states

    ds = load_traces(rounds_dir)
    rounds = round_states(ds)
    assert rounds.rounds == 8 and ds.manifest["rounds_hidden"] == 8
    # the breaks above edit rows that hold those rounds
    assert rounds.recorded[0] == 8 and rounds.recorded[[7, 9, 12]].min() >= 3
    assert ds.requests["request_id"].iloc[[0, 7, 9, 12]].tolist() == ["syn-000000", "syn-000007", "syn-000009", "syn-000012"]


@pytest.mark.parametrize("case", list(CONTRACT_BREAKS))
def test_per_round_states_that_break_the_contract_are_one_line_on_load(rounds_dir, tmp_path, capsys, case):
    from dwise_predict.cli import main

    edits, message = CONTRACT_BREAKS[case]
    bad = _edit(rounds_dir, tmp_path / "bad", **edits)
    with pytest.raises(TraceError, match=message):
        load_traces(bad)
    assert main(["traces", "show", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error") and "collect" in err


def test_a_view_without_the_tensors_keeps_the_column(rounds_dir):
    """An ablation's view drops the per-round tensors but keeps the table: it is no broken file."""
    from dwise_predict.evaluation.baselines import keep_inputs
    from dwise_predict.traces.round_states import round_states

    view = keep_inputs(load_traces(rounds_dir), ("first_round",))
    assert view.extra_hidden == {} and "rounds_recorded" in view.requests.columns
    assert not view.prompt_last.any() and len(view) == 96
    with pytest.raises(TraceError, match="but not 'round_states', 'round_signals'"):
        round_states(view)


# --- the decoding a manifest records, checked by the engine's rules (issue 51) ---------------------
# The traces package may not import the engine: every command that reads traces checks the manifest's
# algorithm config through its TRACES argument (cli.options.checked_traces), by the rule `collect`
# decodes with (engine.algorithms.check_recorded_config).

D2F = {"add_threshold": 0.5, "decode_threshold": 0.9, "confidence_threshold": 1.0}


@pytest.fixture(scope="module")
def decoded_dir(tmp_path_factory):
    """Small synthetic traces whose manifest says LowConfidence at SGLang's default threshold."""
    traces = make_synthetic_traces(96, 16, seed=5)
    traces.manifest["decoding"].update(algorithm="LowConfidence", algorithm_config={"threshold": 0.95})
    return write_traces(traces, tmp_path_factory.mktemp("d") / "t")


def _decoding(algorithm, config=None, drop=()):
    """A manifest edit: the decoding's algorithm and config (its keys ``drop`` removed)."""
    def edit(manifest):
        manifest["decoding"].update(algorithm=algorithm, algorithm_config=config)
        for key in drop:
            manifest["decoding"].pop(key)
    return edit


# case -> (manifest edit, words of the one error line), which ends with the fix. NaN never reaches the
# rule: the JSON reader refuses it first (no file of ours holds NaN).
RULE_FIX = "the file was edited or damaged; collect the traces again, or correct its decoding block"
JSON_FIX = "is not valid JSON (NaN is not a JSON number): the trace dataset is damaged; collect it again"
BAD_DECODINGS = {
    "d2f string": (_decoding("D2F", {**D2F, "decode_threshold": "<script>"}),
                   "algorithm parameter decode_threshold must be a number in (0, 1], got '<script>'"),
    "d2f nan": (_decoding("D2F", {**D2F, "decode_threshold": float("nan")}), JSON_FIX),
    "d2f zero": (_decoding("D2F", {**D2F, "add_threshold": 0}), "add_threshold must be a number in (0, 1], got 0"),
    "d2f over 1": (_decoding("D2F", {**D2F, "confidence_threshold": 1.5}),
                   "confidence_threshold must be a number in [0.0, 1.0], got 1.5"),
    "d2f unknown key": (_decoding("D2F", {**D2F, "threshold": 0.9}),
                        "D2F has no parameter threshold: its parameters are add_threshold, decode_threshold, "
                        "confidence_threshold"),
    "d2f missing key": (_decoding("D2F", {"add_threshold": 0.5, "confidence_threshold": 1.0}),
                        "D2F's parameters lack decode_threshold: a manifest records every one (or none, for the defaults)"),
    "d2f list": (_decoding("D2F", {**D2F, "decode_threshold": [0.9]}), "decode_threshold must be a number in (0, 1], got [0.9]"),
    "low string": (_decoding("LowConfidence", {"threshold": "high"}),
                   "algorithm parameter threshold must be a number in [0.0, 1.0], got 'high'"),
    "low nan": (_decoding("LowConfidence", {"threshold": float("nan")}), JSON_FIX),
    "low negative": (_decoding("LowConfidence", {"threshold": -0.1}), "threshold must be a number in [0.0, 1.0], got -0.1"),
    "low bool": (_decoding("LowConfidence", {"threshold": True}), "threshold must be a number in [0.0, 1.0], got True"),
    "low unknown key": (_decoding("LowConfidence", {"threshold": 0.95, "edit_threshold": 0.1}),
                        "LowConfidence has no parameter edit_threshold: its parameters are threshold"),
    "low missing config": (_decoding("LowConfidence", drop=["algorithm_config"]),
                           "the algorithm config must be a JSON object of parameters, got none"),
    "low list config": (_decoding("LowConfidence", [0.95]), "the algorithm config must be a JSON object of parameters, got list"),
    "algorithm not a name": (_decoding(["LowConfidence"], {"threshold": 0.95}),
                             "the algorithm must be a name, got list ['LowConfidence']"),
}


@pytest.mark.parametrize("case", list(BAD_DECODINGS))
def test_a_decoding_the_engine_refuses_is_one_line_in_every_reader(decoded_dir, tmp_path, capsys, case):
    from dwise_predict.cli import main

    edit, words = BAD_DECODINGS[case]
    bad = _edit(decoded_dir, tmp_path / "bad", manifest=edit)
    for argv in (["traces", "show", str(bad)], ["characterize", str(bad)],
                 ["train", str(bad), "--out", str(tmp_path / "run")]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {bad / 'manifest.json'} "), err
        assert words in err and err.endswith((f"): {RULE_FIX}\n", f"{JSON_FIX}\n")), err
        assert "--" not in err, err  # a manifest's key is no flag
    assert not (tmp_path / "run").exists()


def test_the_manifest_check_is_collects_own_rule(decoded_dir):
    """The words of each parameter refusal are the ones `collect` gives for the same config: one rule set."""
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.engine.algorithms import check_recorded_config
    from dwise_predict.errors import ConfigError

    for algorithm, config, words in (("D2F", {**D2F, "decode_threshold": "<script>"}, "decode_threshold must be"),
                                     ("LowConfidence", {"threshold": float("nan")}, "got nan"),
                                     ("LowConfidence", {"threshold": 2}, "got 2"),
                                     ("LowConfidence", {"threshold": 0.9, "x": 1}, "no parameter x")):
        with pytest.raises(ConfigError) as recorded:
            check_recorded_config(algorithm, config)
        with pytest.raises(ConfigError) as collected:
            DecodingConfig(algorithm=algorithm, algorithm_config=config)
        assert str(recorded.value) == str(collected.value) and words in str(recorded.value)


def test_valid_decodings_still_load_and_show(decoded_dir, tmp_path, capsys):
    """Every parameter (what collect writes), none (a recording older than manifests with SGLang's
    defaults), and algorithms we run no rule for (synthetic, Gemma4Renoise) load as before."""
    from dwise_predict.cli import main

    for name, edit in (("low", None), ("d2f", _decoding("D2F", D2F)), ("old", _decoding("LowConfidence", {})),
                       ("renoise", _decoding("Gemma4Renoise", {"steps": 4})), ("synthetic", _decoding("synthetic", {}))):
        ok = _edit(decoded_dir, tmp_path / name, manifest=edit)
        assert len(load_traces(ok)) == 96
        assert main(["traces", "show", str(ok), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["categories"][-1]["category"] == "all" and shown["categories"][-1]["count"] == 96
        assert shown["decoding"]["algorithm_config"] == json.loads((ok / "manifest.json").read_text())["decoding"]["algorithm_config"]


def test_a_hostile_key_is_shown_escaped_and_merge_refuses_it(decoded_dir, tmp_path, capsys):
    from dwise_predict.cli import main

    bad = _edit(decoded_dir, tmp_path / "bad", manifest=_decoding("LowConfidence", {"threshold": 0.9, "\x1b]0;t\x07": 1}))
    assert main(["traces", "merge", str(bad), "--out", str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "LowConfidence has no parameter \\x1b]0;t\\x07" in err
    assert not (tmp_path / "merged").exists()


def test_a_recording_of_parameters_the_rule_refuses_is_refused_before_it_is_written():
    """The live recorder's manifest goes through the same rule: SGLang runs what it is given, but
    traces of it would be refused by every reader."""
    from dwise_predict.collectors.live import live_manifest
    from dwise_predict.errors import ConfigError

    assert live_manifest({}, "LowConfidence", {}, 8, 64)["decoding"]["algorithm_config"] == {"threshold": 0.95}
    for config, words in (({"threshold": 1.5}, "got 1.5"), ({"threshold": "high"}, "got 'high'")):
        with pytest.raises(ConfigError, match=f"cannot record SGLang's LowConfidence decoding: .*{words}"):
            live_manifest({}, "LowConfidence", config, 8, 64)
