"""The SGLang plugin path: ``DWISE_* python -m sglang.launch_server ...`` engages the hook as ``serve`` does.

SGLang's own plugin loader (``sglang/srt/plugins``, from the wheel) runs over this package's installed
``sglang.srt.plugins`` entry point (``pip install -e .`` registers it), in a launching process of its
own; the GPU-bound entry points are the stand-ins of ``fakes/sglang_launch.py``.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import sglang_reference
from dwise_predict.errors import ConfigError
from dwise_predict.serving.launcher import RUN_SCHEDULER_PROCESS
from dwise_predict.serving.sglang.install import PATCHES
from dwise_predict.serving.plugin import VARIABLES, config_from_environ, engaged

TESTS = Path(__file__).resolve().parent
ADAPTER = "dwise_predict.serving.sglang.install"


def test_the_entry_point_is_installed_in_sglangs_plugin_group():
    found = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "dwise" in found, "reinstall the package (pip install -e .): its sglang.srt.plugins entry point is missing"
    assert found["dwise"].value == "dwise_predict.serving.plugin:register" and found["dwise"].dist.name == "dwise-predict"


@pytest.mark.slow
@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
def test_sglangs_plugin_loader_engages_the_hook_as_serve_does(tmp_path):
    """One launching process, as ``python -m sglang.launch_server`` is one: SGLang's ``load_plugins``
    finds the entry point, the hook config comes from ``DWISE_*`` and SGLang's resolved arguments
    (``max_batch`` from the decode graphs, the model's tokenizer), and the scheduler SGLang would
    spawn runs inside a ``SchedulerEntry`` that installs the same patched methods with the same
    settings as ``dwise-predict serve``'s entry (``serve`` in the same process keeps its own entry).
    Under attention DP a scheduler of the second group records into ``dp1``. Each scheduler process
    says, in one line, that the hook engaged there, with the rows it holds and where it records."""
    from fakes.sglang_launch import write_model

    model = write_model(tmp_path / "llada2", architecture="LLaDA2MoeModelLM", hidden_size=64)
    options = {"record": str(tmp_path / "rec"), "block_size": 32, "hidden_size": 64, "slots": 8, "k": 2.0,
               "record_flush_s": 2.0, "resolver": "fakes.sglang_launch:resolve"}
    environ = {f"DWISE_{name.upper()}": str(value) for name, value in options.items()}
    serve_options = dict(options, record=str(tmp_path / "served"))
    sglang_argv = ["--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "64",
                   "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    # the plugin's own variables only: DWISE_SGLANG_SRC (where the wheel's source is) stays
    env = {k: v for k, v in os.environ.items() if not engaged({k: v})}
    env.update(environ, PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", "import sys; from fakes import sglang_launch; sglang_launch.main(sys.argv[1:])",
                          "--serve", json.dumps(serve_options), *sglang_argv], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    plugin, served = out["plugin"], out["serve"]
    assert plugin["entry"] == served["entry"] == "SchedulerEntry"
    assert plugin["target"] == "report_scheduler"  # what SGLang would have run, wrapped
    assert served["target"] == RUN_SCHEDULER_PROCESS and served["killed"]["include_parent"] is False
    assert plugin["config"] == dict(served["config"], record=options["record"])
    assert plugin["config"]["max_batch"] == 64 and plugin["config"]["tokenizer"] == str(model)
    reports = plugin["report"], served["report"]
    assert all(r["hooked"] for r in reports) and reports[0]["pid"] != reports[1]["pid"]
    assert len(reports[0]["patched"]) == len(PATCHES) and all(p.endswith("=" + ADAPTER) for p in reports[0]["patched"])
    for key in ("patched", "slots", "k", "block_size", "pooled_rows", "prompt_cache", "every", "flush_s"):
        assert reports[0][key] == reports[1][key], key
    assert reports[0]["pooled_rows"] == 64 and reports[0]["flush_s"] == 2.0
    # tp 2, attention DP 2: the plugin's scheduler ran as TP rank 0 (group 0), serve's as TP rank 1 (group 1)
    assert reports[0]["recording"] == str(tmp_path / "rec" / "dp0")
    assert reports[1]["recording"] == str(tmp_path / "served" / "dp1")
    engaged_lines = sorted(line for line in run.stderr.splitlines() if line.startswith("DWISE hook engaged"))
    assert len(engaged_lines) == 2, run.stderr[-3000:]
    for line, rank, where in zip(engaged_lines, (0, 1), (tmp_path / "rec" / "dp0", tmp_path / "served" / "dp1")):
        assert f"(TP rank {rank}, DP rank {rank}): no bundle (r_hat = 0), B = 8, k = 2, k*B = 16 of 32 request " \
               f"rows per scheduler, block size 32; recording to {where}" in line


def test_the_plugin_reads_its_own_variables_only():
    """No plugin variable: nothing (the package's other ``DWISE_*`` settings do not engage it). Every
    ``HookConfig`` field has its variable, read as ``serve`` reads the option; problems are named by
    variable, all at once; a misspelt variable is refused, not ignored."""
    assert not engaged({"DWISE_DEBUG": "1", "DWISE_ZOO": "zoo/", "DWISE_REQUIRE_SGLANG": "1", "HOME": "/root"})
    assert config_from_environ({"DWISE_DEBUG": "1"}) is None
    assert sorted(VARIABLES) == sorted(f"DWISE_{name.upper()}" for name in (
        "bundle", "slots", "k", "kv_budget_tokens", "kv_fraction", "slack_blocks", "block_size", "max_batch",
        "hidden_size", "tokenizer", "record", "record_every", "record_flush_s", "prompt_cache", "aging", "max_wait",
        "monitor_window", "follow", "follow_zoo", "follow_poll_s", "rollback_after", "rollback_margin", "resolver"))
    config = config_from_environ({"DWISE_RECORD": "traces/", "DWISE_SLOTS": "64", "DWISE_K": "4",
                                  "DWISE_KV_BUDGET_TOKENS": "1e6", "DWISE_TOKENIZER": "", "DWISE_DEBUG": "1"})
    assert (config.record, config.slots, config.k, config.kv_budget_tokens, config.tokenizer) == (
        "traces/", 64, 4.0, 1e6, None)
    with pytest.raises(ConfigError) as err:
        config_from_environ({"DWISE_BUNDEL": "b/", "DWISE_SLOTS": "0", "DWISE_K": "many"})
    message = str(err.value)
    assert "DWISE_BUNDEL is no DWISE plugin variable: did you mean DWISE_BUNDLE?" in message
    assert "DWISE_K must be a number, got 'many'" in message and "DWISE_SLOTS must be positive, got 0" in message
    assert "\n" not in message


@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
def test_a_bad_variable_stops_the_launch_not_the_plugin(monkeypatch):
    """SGLang logs an exception a plugin raises and serves without it. The plugin raises nothing when
    SGLang loads it; the launch it wraps stops with the one-line error instead."""
    from fakes import sglang_launch

    from dwise_predict.serving.plugin import launch_with_hook

    monkeypatch.setenv("DWISE_SLOTS", "0")
    original = sglang_launch.Engine.__dict__["_launch_subprocesses"].__func__
    monkeypatch.setattr(sglang_launch, "LAUNCHED", [])
    with pytest.raises(ConfigError, match="DWISE_SLOTS must be positive"):
        launch_with_hook(original, sglang_launch.Engine, server_args=sglang_launch.ServerArgs(model_path="m"),
                         init_tokenizer_manager_func=None, run_scheduler_process_func=sglang_launch.report_scheduler,
                         run_detokenizer_process_func=None)
    assert not sglang_launch.LAUNCHED


@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
def test_the_plugin_wraps_what_sglang_0_5_23_launches_through():
    """What the plugin and the stand-ins rely on, read from the wheel's source: every path that starts
    schedulers calls ``Engine._launch_subprocesses`` (a classmethod taking the scheduler function by
    that keyword), the stand-in ``Engine`` takes the same parameters, and each scheduler process loads
    the plugins first thing (so the entry point runs in every process SGLang starts)."""
    import ast
    import inspect

    from fakes import sglang_launch

    src = sglang_reference.source_root() / "sglang" / "srt"
    engine = ast.parse((src / "entrypoints" / "engine.py").read_text())
    cls = next(n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    launch = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_launch_subprocesses")
    assert [ast.unparse(d) for d in launch.decorator_list] == ["classmethod"]
    params = [a.arg for a in launch.args.args]
    stand_in = list(inspect.signature(sglang_launch.Engine.__dict__["_launch_subprocesses"].__func__).parameters)
    assert params[:5] == stand_in[:5] == ["cls", "server_args", "init_tokenizer_manager_func",
                                          "run_scheduler_process_func", "run_detokenizer_process_func"]

    def calls(tree, name):
        return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name)]

    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    http = ast.parse((src / "entrypoints" / "http_server.py").read_text())
    launch_server = next(n for n in http.body if isinstance(n, ast.FunctionDef) and n.name == "launch_server")
    for where, tree in (("Engine.__init__", init), ("launch_server", launch_server)):
        found = calls(tree, "._launch_subprocesses")
        assert len(found) == 1 and "run_scheduler_process_func" in {k.arg for k in found[0].keywords}, where
    scheduler = ast.parse((src / "managers" / "scheduler.py").read_text())
    run = next(n for n in scheduler.body if isinstance(n, ast.FunctionDef) and n.name == "run_scheduler_process")
    assert ast.unparse(run.body[0]) == "load_plugins()"
    assert "resolve_spawn_dp_rank(dp_rank)" in ast.unparse(run)


# --- the plugin's start-up checks, named by its variables (issue 56) --------------------------------


@pytest.fixture
def launch(monkeypatch):
    """Run the plugin's wrapper around the stand-in ``Engine._launch_subprocesses`` for SGLang's
    arguments ``argv``, with ``DWISE_*`` from ``variables`` (every other plugin variable unset)."""
    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    from dwise_predict.serving.plugin import launch_with_hook

    sglang_launch.entrypoints(monkeypatch)
    for name in list(os.environ):
        if engaged({name: ""}):
            monkeypatch.delenv(name)

    def run(argv, **variables):
        for name, value in variables.items():
            monkeypatch.setenv(f"DWISE_{name.upper()}", str(value))
        original = sglang_launch.Engine.__dict__["_launch_subprocesses"].__func__
        return launch_with_hook(original, sglang_launch.Engine, server_args=sglang_launch.prepare_server_args(argv),
                                init_tokenizer_manager_func=None, run_scheduler_process_func=sglang_launch.report_scheduler,
                                run_detokenizer_process_func=None)

    run.module = sglang_launch
    return run


def test_plugin_errors_name_its_variables_and_leave_sglangs_flags_as_flags(tmp_path, launch):
    """Without ``DWISE_BLOCK_SIZE`` (a hub id: nothing to read it from) the error named ``--block-size``, a
    flag the plugin path has no way to pass; a ``k*B`` that the scheduler cannot hold was refused only
    after the model loaded. Both now refuse before launch, naming ``DWISE_*`` for the hook's settings
    and SGLang's own flag for the server's."""
    from dwise_predict.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        launch(["--model-path", "inclusionAI/LLaDA2.0-mini", "--dllm-algorithm", "LowConfidence",
                "--max-running-requests", "256"], record=tmp_path / "t", slots=64, k=8)
    message = str(err.value)
    assert message.startswith("DWISE plugin: ") and "\n" not in message
    assert "(DWISE_SLOTS=64 x DWISE_K=8) but each scheduler holds 256 (--max-running-requests 256): pass " \
           "--max-running-requests 512, or lower DWISE_SLOTS or DWISE_K" in message
    assert "the hook needs DWISE_BLOCK_SIZE and DWISE_HIDDEN_SIZE" in message and "--block-size" not in message
    assert not launch.module.LAUNCHED


def test_the_plugin_refuses_a_bundle_of_another_width_before_sglang_loads_the_model(tmp_path, launch):
    """A bundle (or ``DWISE_HIDDEN_SIZE``) narrower than the model went through, and SGLang's warmup
    forward died in the patched ``get_dllm_logits``: now the launch stops, in one line."""
    from dwise_predict.errors import BundleError, ConfigError

    model = launch.module.write_model(tmp_path / "sdar", hidden_size=64)  # SDAR: block 4
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"model": {}, "inputs": {"refine": {"hidden_size": 32}},
                                                    "decoding": {"algorithm": "LowConfidence", "block_size": 4}}))
    argv = ["--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "64"]
    with pytest.raises(BundleError, match=f"^DWISE plugin: bundle {bundle} takes hidden states of width 32 but the "
                                          f"served model {model} has hidden size 64"):
        launch(argv, bundle=bundle, slots=16, k=4)
    with pytest.raises(ConfigError, match="DWISE_HIDDEN_SIZE=32 but the served model .* has hidden size 64: leave "
                                          "DWISE_HIDDEN_SIZE out"):
        launch(argv, bundle="", record=tmp_path / "t", hidden_size=32)
    assert not launch.module.LAUNCHED
    launch(argv, hidden_size="")  # read from the model: 64, and SGLang's block size 4
    (_, entry), = launch.module.LAUNCHED
    assert (entry.config.hidden_size, entry.config.block_size) == (64, 4)


def test_serve_check_says_when_sglang_would_not_engage_the_plugin(tmp_path, launch, monkeypatch, capsys):
    """SGLang's plugin loader skips a plugin an ``SGLANG_PLUGINS`` whitelist leaves out, and logs the
    exception of one that fails to import and serves on: the hook silently absent, no code of ours
    running to say so. ``serve --check`` runs SGLang's loader with this environment and says why."""
    from dwise_predict.cli.app import main

    model = launch.module.write_model(tmp_path / "sdar", hidden_size=64)
    check = ["serve", "--check", "--", "--model-path", str(model), "--dllm-algorithm", "LowConfidence",
             "--max-running-requests", "64"]
    monkeypatch.setenv("DWISE_RECORD", str(tmp_path / "t"))
    monkeypatch.setenv("DWISE_SLOTS", "16")
    monkeypatch.setenv("DWISE_K", "4")
    monkeypatch.setenv("SGLANG_PLUGINS", "other,another")
    assert main(check) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["plugin"] == {"asked": True, "engaged": False, "problems": [
        "SGLANG_PLUGINS=other,another leaves out 'dwise': SGLang will not load the DWISE plugin and serves without "
        "the hook; add dwise to it"]} and report["serve"] is None
    monkeypatch.setenv("SGLANG_PLUGINS", "other,dwise")
    assert main(check) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["plugin"]["engaged"] and report["plugin"]["hook"]["block_size"] == 4
    assert report["plugin"]["hook"]["hidden_size"] == 64 and report["surface"] == []
    monkeypatch.setitem(sys.modules, "dwise_predict.serving.plugin", None)  # its import fails
    assert main(check) == 1
    captured = capsys.readouterr()
    problem, = json.loads(captured.out)["plugin"]["problems"]
    assert problem.startswith("the DWISE plugin does not import (ModuleNotFoundError") and "problem: the DWISE" in captured.err
    assert not launch.module.LAUNCHED
