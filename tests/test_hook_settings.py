"""The hook's settings refused before anything starts (issue 51, "the plugin's settings"): every
:class:`HookConfig` field is checked once, in :meth:`HookConfig.problems`, and both ways of setting
it — the SGLang plugin's ``DWISE_*`` variables and ``dwise-predict serve``'s options — refuse a bad
value in one line naming the variable or the flag, with no traceback, before any buffer is
allocated, any directory written or SGLang started."""

from __future__ import annotations

import json

import pytest

from dwise_predict.cli import main
from dwise_predict.cli.options import as_flags
from dwise_predict.errors import ConfigError
from dwise_predict.serving import launcher
from dwise_predict.serving.launcher import MAX_ROWS, HookConfig
from dwise_predict.serving.plugin import as_variables, config_from_environ
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

# (HookConfig fields, the library's message: the CLI shows it as_flags, the plugin as_variables)
BAD = [
    ({"k": float("nan")}, "`k` must be a finite number, got nan"),
    ({"k": float("inf")}, "`k` must be a finite number, got inf"),
    ({"k": 0.5}, "`k` must be at least 1, got 0.5"),
    ({"slots": 10**12}, f"`slots` must be at most {MAX_ROWS:,} (B resident rows of H floats on the GPU), "
                        "got 1,000,000,000,000"),
    ({"slots": 1024, "k": 128.0}, f"`k` x `slots` (k*B, the resident requests: rows of H floats on the GPU, and "
                                  f"SGLang's --max-running-requests at least as many) must be at most {MAX_ROWS:,}, "
                                  "got 131,072"),
    ({"prompt_cache": 10**12}, f"`prompt_cache` must be at most {MAX_ROWS:,} (rows of H floats on the GPU), "
                               "got 1,000,000,000,000"),
    ({"prompt_cache": -1}, "`prompt_cache` must be 0 or more, got -1"),
    ({"kv_fraction": -0.5}, "`kv_fraction` must be a share of SGLang's KV pool in (0, 1], got -0.5"),
    ({"kv_fraction": 0.0}, "`kv_fraction` must be a share of SGLang's KV pool in (0, 1], got 0.0"),
    ({"kv_fraction": 1.5}, "`kv_fraction` must be a share of SGLang's KV pool in (0, 1], got 1.5"),
    ({"kv_fraction": float("nan")}, "`kv_fraction` must be a share of SGLang's KV pool in (0, 1], got nan"),
    ({"max_batch": -1}, "`max_batch` must be positive, got -1"),
    ({"max_batch": 0}, "`max_batch` must be positive, got 0"),
    ({"max_batch": 10**9}, f"`max_batch` must be at most {MAX_ROWS:,} (requests per forward, pooling rows of 2 x H "
                           "floats on the GPU), got 1,000,000,000"),
    ({"slack_blocks": -2}, "`slack_blocks` must be 0 or more, got -2"),
    ({"kv_budget_tokens": float("nan")}, "`kv_budget_tokens` must be a finite number > 0 (or unset: `kv_fraction` of "
                                         "SGLang's KV pool), got nan"),
    ({"kv_budget_tokens": float("inf")}, "`kv_budget_tokens` must be a finite number > 0 (or unset: `kv_fraction` of "
                                         "SGLang's KV pool), got inf"),
    ({"kv_budget_tokens": -5.0}, "`kv_budget_tokens` must be a finite number > 0 (or unset: `kv_fraction` of "
                                 "SGLang's KV pool), got -5.0"),
    ({"record_flush_s": float("inf")}, "`record_flush_s` must be a finite number of seconds > 0, got inf"),
    ({"record_flush_s": float("nan")}, "`record_flush_s` must be a finite number of seconds > 0, got nan"),
    ({"record_flush_s": 0.0}, "`record_flush_s` must be a finite number of seconds > 0, got 0.0"),
    ({"hidden_size": 10**9}, "`hidden_size` must be at most 65,536 (the model's width, floats per pooled row on the "
                             "GPU), got 1,000,000,000"),
    ({"block_size": 0}, "`block_size` must be positive, got 0"),
    ({"aging": float("nan")}, "`aging` must be a finite number >= 0 (0: no starvation guard), got nan"),
    ({"monitor_window": 8}, "`monitor_window` must be at least 32, got 8"),
    ({"monitor_window": 10**6}, f"`monitor_window` must be at most {MAX_ROWS:,} (finished requests ranked on SGLang's "
                                "scheduler thread), got 1,000,000"),
]


def _flags(fields: dict) -> list[str]:
    return [item for name, value in fields.items() for item in ("--" + name.replace("_", "-"), str(value))]


def _environ(fields: dict) -> dict:
    return {f"DWISE_{name.upper()}": str(value) for name, value in fields.items()}


@pytest.fixture
def nothing_starts(monkeypatch):
    """``serve``'s launcher calls, recorded instead of run (SGLang is never started here)."""
    calls = []
    monkeypatch.setattr(launcher, "serve", lambda config, argv: calls.append(("serve", config)))
    monkeypatch.setattr(launcher, "plan", lambda config, argv: calls.append(("plan", config)) or {})
    return calls


def _refused_by_serve(args: list[str], capsys, calls: list) -> str:
    """``serve ARGS -- --model-path m`` (and with ``--dry-run``): exit 1, one line on stderr, no
    traceback, nothing started; returns the line."""
    lines = []
    for mode in ([], ["--dry-run"]):
        assert main(["serve", *args, *mode, "--", "--model-path", "m"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        lines.append(err.strip())
    assert not calls and lines[0] == lines[1]
    return lines[0]


@pytest.mark.parametrize("fields, message", BAD, ids=[json.dumps(f) for f, _ in BAD])
def test_a_bad_setting_is_refused_in_one_line_by_the_plugin_and_by_serve(fields, message, tmp_path, capsys,
                                                                       nothing_starts):
    record = tmp_path / "rec"
    assert message in HookConfig(record=str(record), **fields).problems()
    with pytest.raises(ConfigError) as err:
        config_from_environ({"DWISE_RECORD": str(record), **_environ(fields)})
    assert as_variables(message) in str(err.value) and "\n" not in str(err.value)
    assert "`" not in as_variables(message)  # every parameter named as its variable
    line = _refused_by_serve(["--record", str(record), *_flags(fields)], capsys, nothing_starts)
    assert as_flags(message) in line
    assert not record.exists()  # nothing written


def test_the_bounds_admit_what_the_docs_serve():
    """The docs' server (B = 128, k = 8: 1,024 resident requests), the default prompt cache, the
    largest default CUDA-graph batch: no problem; the bounds themselves are allowed."""
    assert not HookConfig(record="t/", slots=128, k=8, max_batch=512, prompt_cache=4096).problems()
    assert not HookConfig(record="t/", slots=MAX_ROWS // 8, k=8, max_batch=MAX_ROWS, prompt_cache=MAX_ROWS,
                          kv_fraction=1.0, slack_blocks=0, kv_budget_tokens=1e9, hidden_size=MAX_ROWS).problems()


def test_a_setting_of_the_wrong_type_from_python_is_a_problem_not_a_traceback():
    problems = HookConfig(record="t/", slots=2.5, k="8", prompt_cache=True, resolver="no_colon").problems()
    assert "`slots` must be a whole number, got 2.5" in problems
    assert "`k` must be a finite number, got 8" in problems
    assert "`prompt_cache` must be a whole number, got True" in problems
    assert "`resolver` must be \"module:function\", got 'no_colon'" in problems


# --- where a recording may be written -----------------------------------------------------------


def _bundle(directory):
    directory.mkdir(parents=True)
    (directory / "bundle.json").write_text("{}")
    return directory


def _dataset(directory):
    """A trace dataset as `collect` writes one (not a recording)."""
    return write_traces(make_synthetic_traces(n_requests=8, hidden_size=4, seed=0), directory)


def _listing(directory) -> list:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.mark.parametrize("case", ["bundle", "inside-bundle", "holds-bundle", "dataset", "inside-dataset",
                                  "holds-collect-rank", "file"])
def test_a_recording_never_goes_into_the_bundle_or_a_trace_dataset(case, tmp_path, capsys, nothing_starts):
    bundle = _bundle(tmp_path / "work" / "bundle")
    record, want = {
        "bundle": (bundle, f"`record` {bundle} is the input `bundle` {bundle}: a command never writes over its inputs"),
        "inside-bundle": (bundle / "rec", f"`record` {bundle / 'rec'} lies inside the input `bundle` {bundle}"),
        "holds-bundle": (tmp_path / "work", f"`record` {tmp_path / 'work'} contains the input `bundle` {bundle}"),
        "dataset": (tmp_path / "traces", f"`record` {tmp_path / 'traces'} is a trace dataset: a recording writes a "
                                         "directory per DP rank (dp0/ ...) into a new or empty directory"),
        "inside-dataset": (tmp_path / "traces" / "sub", f"`record` {tmp_path / 'traces' / 'sub'} lies inside the "
                                                        f"trace dataset {tmp_path / 'traces'}"),
        "holds-collect-rank": (tmp_path / "ranks", f"`record` {tmp_path / 'ranks'} holds dp0/, a trace dataset that "
                                                   "no recording wrote (a `collect` output?)"),
        "file": (tmp_path / "a-file", f"`record` {tmp_path / 'a-file'} is a file: pass a new or empty directory"),
    }[case]
    _dataset(tmp_path / "traces")
    _dataset(tmp_path / "ranks" / "dp0")
    (tmp_path / "a-file").write_text("x")
    before = _listing(tmp_path)
    assert any(want in problem for problem in HookConfig(bundle=str(bundle), record=str(record)).problems())
    with pytest.raises(ConfigError) as err:
        config_from_environ({"DWISE_BUNDLE": str(bundle), "DWISE_RECORD": str(record)})
    assert as_variables(want) in str(err.value) and "\n" not in str(err.value)
    line = _refused_by_serve(["--bundle", str(bundle), "--record", str(record)], capsys, nothing_starts)
    assert as_flags(want) in line
    assert _listing(tmp_path) == before  # nothing written


def test_an_earlier_recording_is_a_valid_target_and_is_resumed(tmp_path, nothing_starts):
    """A restarted server resumes its recording: ``record`` holding ``dp<rank>/`` recordings (their
    manifest says the hook's recorder wrote them) is accepted on both paths."""
    from dwise_predict.collectors.live import LiveRecorder, live_manifest

    manifest = live_manifest({"name": "fake", "hidden_size": 4, "config_hash": "x", "weights_sha256": "y"},
                             "LowConfidence", {}, 8, 64)
    assert manifest["collection"]["recorder"] == launcher.RECORDER  # what the launcher recognises
    record = tmp_path / "rec"
    for rank in ("dp0", "dp1"):
        LiveRecorder(record / rank, block_size=8, every=1, manifest=manifest).close()
    assert (record / "dp0" / "manifest.json").is_file()
    assert not HookConfig(record=str(record)).problems()
    assert not HookConfig(record=str(tmp_path / "new")).problems()  # a new directory, too
    assert config_from_environ({"DWISE_RECORD": str(record)}).record == str(record)
    assert main(["serve", "--record", str(record), "--", "--model-path", "m"]) == 0
    assert [(what, config.record) for what, config in nothing_starts] == [("serve", str(record))]
