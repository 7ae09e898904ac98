"""The launcher installs the hook inside a ``spawn``-started scheduler process, as SGLang starts them."""

import multiprocessing as mp
import os

import pytest

import sglang_reference
from dwise_predict.errors import BundleError, ConfigError
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


@pytest.mark.parametrize("max_running_requests,want", [(None, 256), (1024, 1024)])
def test_the_pooling_buffer_holds_every_batch_the_server_can_run(tmp_path, max_running_requests, want):
    """The buffer must hold the largest batch SGLang captures a CUDA graph for (a capture with more
    rows than the buffer stops the server at start-up) and the largest eager batch. Those sizes are
    decisions of ``resolve_once``, recorded beside the raw flags: read through SGLang's own
    ``resolved_view``. The decision here is the memory hook's default on an H200 at tp 1 (decode
    graphs up to 256 requests: ``arg_groups/memory_hook.py``, ``cuda_graph_hook.py``)."""
    from types import SimpleNamespace

    from dwise_predict.serving.launcher import largest_forward

    sgl = sglang_reference.load_server_config()
    h200 = sgl.PhaseConfig(backend=sgl.Backend.FULL, max_bs=256, bs=[1, 2, 4, 8, 12, *range(16, 257, 8)])
    raw = SimpleNamespace(cuda_graph_config=sgl.CudaGraphConfig(), max_running_requests=max_running_requests,
                          tokenizer_path=None, model_path="m")
    raw._resolved_overrides = [("_handle_gpu_memory_settings", {"cuda_graph_config": sgl.CudaGraphConfig(decode=h200)})]
    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048, slots=64, k=4)
    assert resolved(config, sgl.resolved_view(raw)).max_batch == want
    if max_running_requests is None:  # the raw flags alone would size the buffer short of the graphs
        assert largest_forward(raw) == 0 and resolved(config, raw).max_batch == 64


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


@pytest.mark.parametrize("algorithm,config_text,refused", [
    ("LowConfidence", None, None),
    ("LowConfidence", "threshold: 0.95\nvectorized_decoding: true\n", None),
    ("LowConfidence", "threshold: 0.9\n", "algorithm_config"),
    ("LowConfidence", "block_size: 16\n", "block_size"),
    ("JointThreshold", "", "algorithm"),
])
def test_a_bundle_for_another_decoding_is_refused_before_sglang_loads_the_model(tmp_path, algorithm, config_text,
                                                                                refused):
    """`serve` reads the server's --dllm-algorithm and --dllm-algorithm-config file as SGLang will
    and refuses a bundle trained for other rounds in one line, before any weights load."""
    import json
    from types import SimpleNamespace

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"model": {"name": "m", "hidden_size": 16}, "decoding": {
        "algorithm": "LowConfidence", "algorithm_config": {"threshold": 0.95}, "block_size": 32}}))
    path = None
    if config_text is not None:
        path = tmp_path / "algorithm.yaml"
        path.write_text(config_text)
    server_args = SimpleNamespace(dllm_algorithm=algorithm, dllm_algorithm_config=None if path is None else str(path),
                                  model_path="m", tokenizer_path=None, max_running_requests=1024)
    config = HookConfig(bundle=str(bundle))
    if refused is None:
        assert resolved(config, server_args).block_size == 32
    else:
        with pytest.raises(BundleError, match=f"built for another decoding \\(decoding.{refused} = "):
            resolved(config, server_args)


def test_served_admission_features_equal_the_collected_ones():
    """SGLang's ``Req`` holds the chat-templated ids; the launcher's admission features count words
    and newlines over the user's text inside them, as `collect` counts them over the prompt, so a
    served request meets the admission model with the features it was trained on (decoding the
    whole input would count the template's markup too: two more words per request here)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from dwise_predict.collectors.workloads import load_workload
    from dwise_predict.dllm import TINY_MODEL_DIR
    from dwise_predict.features.prompt import count_newlines, count_words
    from dwise_predict.serving.launcher import _features

    features, tokenizer = _features(str(TINY_MODEL_DIR)), AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    requests = load_workload("tiny-default", seed=0).requests
    template_words = []
    for request in requests:  # what collect writes: contract_row(words=count_words(prompt), prompt_tokens=len(ids), ...)
        ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        req = SimpleNamespace(origin_input_ids=ids)
        assert features(req) == (count_words(request.prompt), count_newlines(request.prompt), len(ids)), request.request_id
        template_words.append(count_words(tokenizer.decode(ids)) - count_words(request.prompt))
    assert len(requests) == 480 and set(template_words) == {2}
    # a system prompt is not one user message in the template: the whole input is counted, markup included
    ids = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "two words"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert features(SimpleNamespace(origin_input_ids=ids))[0] == count_words(tokenizer.decode(ids)) > 2
