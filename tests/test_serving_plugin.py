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
from dwise_predict.serving.plugin import VARIABLES, config_from_environ, engaged

TESTS = Path(__file__).resolve().parent
ADAPTER = "dwise_predict.serving.sglang_adapter"


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
    Under attention DP a scheduler of the second group records into ``dp1``."""
    from dwise_predict.dllm import TINY_MODEL_DIR

    options = {"record": str(tmp_path / "rec"), "block_size": 32, "hidden_size": 64, "slots": 8, "k": 2.0,
               "record_flush_s": 2.0, "resolver": "fakes.sglang_launch:resolve"}
    environ = {f"DWISE_{name.upper()}": str(value) for name, value in options.items()}
    serve_options = dict(options, record=str(tmp_path / "served"))
    sglang_argv = ["--model-path", str(TINY_MODEL_DIR), "--max-running-requests", "64", "--tp-size", "2",
                   "--dp-size", "2", "--enable-dp-attention"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DWISE_")}
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
    assert plugin["config"]["max_batch"] == 64 and plugin["config"]["tokenizer"] == str(TINY_MODEL_DIR)
    reports = plugin["report"], served["report"]
    assert all(r["hooked"] for r in reports) and reports[0]["pid"] != reports[1]["pid"]
    assert len(reports[0]["patched"]) == 5 and all(p.endswith("=" + ADAPTER) for p in reports[0]["patched"])
    for key in ("patched", "slots", "k", "block_size", "pooled_rows", "prompt_cache", "every", "flush_s"):
        assert reports[0][key] == reports[1][key], key
    assert reports[0]["pooled_rows"] == 64 and reports[0]["flush_s"] == 2.0
    # tp 2, attention DP 2: the plugin's scheduler ran as TP rank 0 (group 0), serve's as TP rank 1 (group 1)
    assert reports[0]["recording"] == str(tmp_path / "rec" / "dp0")
    assert reports[1]["recording"] == str(tmp_path / "served" / "dp1")


def test_the_plugin_reads_its_own_variables_only():
    """No plugin variable: nothing (the package's other ``DWISE_*`` settings do not engage it). Every
    ``HookConfig`` field has its variable, read as ``serve`` reads the option; problems are named by
    variable, all at once; a misspelt variable is refused, not ignored."""
    assert not engaged({"DWISE_DEBUG": "1", "DWISE_ZOO": "zoo/", "DWISE_REQUIRE_SGLANG": "1", "HOME": "/root"})
    assert config_from_environ({"DWISE_DEBUG": "1"}) is None
    assert sorted(VARIABLES) == sorted(f"DWISE_{name.upper()}" for name in (
        "bundle", "slots", "k", "kv_budget_tokens", "kv_fraction", "slack_blocks", "block_size", "max_batch",
        "hidden_size", "tokenizer", "record", "record_every", "record_flush_s", "prompt_cache", "aging", "resolver"))
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
