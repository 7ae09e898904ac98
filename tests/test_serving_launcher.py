"""The launcher installs the hook inside a ``spawn``-started scheduler process, as SGLang starts them."""

import multiprocessing as mp
import os

import pytest

import sglang_reference
from dwise_predict.errors import ConfigError
from dwise_predict.serving.launcher import HookConfig, SchedulerEntry, resolved


@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
def test_the_hook_is_active_in_a_spawned_scheduler_process():
    ctx = mp.get_context("spawn")  # SGLang's start method (entrypoints/engine.py)
    reader, writer = ctx.Pipe(duplex=False)
    entry = SchedulerEntry(HookConfig(slots=2, k=2, record=None, bundle=None, block_size=8, prompt_cache=16,
                                      resolver="fakes.sglang_fake:resolve"),
                           target="launcher_child:run_scheduler_process")
    # the arguments SGLang passes: server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer
    child = ctx.Process(target=entry, args=(None, None, 0, 0, 0, None, writer))
    child.start()
    writer.close()
    try:
        assert reader.poll(120), "the scheduler child sent nothing"
        report = reader.recv()
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert report["pid"] != os.getpid() and report["hooked"] is True
    # DWISE order (R = P + 0): the 8-token prompt (P=1), then 24 (P=3), then 40 (P=5)
    assert report["finished"] == ["r1", "r2", "r0"]
    assert report["admitted"] == 3 and report["rounds"] > 0 and report["prompt_cache"] == 16


def test_hook_config_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolved(HookConfig(bundle=str(tmp_path), slots=0, k=0.5))
    message = str(err.value)
    assert "--slots must be positive" in message and "--k must be at least 1" in message
    assert "has no bundle.json" in message and "\n" not in message
    with pytest.raises(ConfigError, match="nothing to do"):
        resolved(HookConfig())
    with pytest.raises(ConfigError, match="needs --block-size and --hidden-size"):
        resolved(HookConfig(record=str(tmp_path / "t")))


def test_serve_command_passes_sglang_arguments_through_and_checks_its_own(tmp_path, capsys):
    import json

    from dwise_predict.cli.app import main

    code = main(["serve", "--record", str(tmp_path / "t"), "--block-size", "32", "--hidden-size", "2048",
                 "--slots", "64", "--k", "4", "--prompt-cache", "256", "--dry-run", "--", "--model-path", "m",
                 "--dllm-fdfo"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["sglang_args"] == ["--model-path", "m", "--dllm-fdfo"]
    assert out["hook"]["block_size"] == 32 and out["hook"]["max_batch"] == 64 and out["hook"]["k"] == 4
    assert out["hook"]["prompt_cache"] == 256
    assert main(["serve", "--", "--model-path", "m"]) == 1
    assert capsys.readouterr().err.strip().startswith("error: nothing to do")
