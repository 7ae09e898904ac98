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


@pytest.fixture
def sglang_entrypoints(monkeypatch):
    """SGLang's launch side where the launcher imports it: the wheel's plugin loader and resolved view,
    stand-ins for what needs a GPU (``fakes/sglang_launch.py``: an H200's resolution)."""
    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    sglang_launch.install_entrypoints(monkeypatch.setitem)
    for name in ("LAUNCHED", "KILLED", "SHUT_DOWN"):
        monkeypatch.setattr(sglang_launch, name, [])
    return sglang_launch


def test_serve_dry_run_prints_what_the_server_will_use(tmp_path, capsys, sglang_entrypoints, monkeypatch):
    """``--dry-run`` resolves SGLang's arguments as the server will: the pooling buffer holds the decode
    graphs SGLang captures on this GPU (256 on an H200 at tp 1, beyond ``--slots``; all of
    ``--max-running-requests`` when that is larger) and admission reads the model's tokenizer, not
    ``max_batch = slots`` and no tokenizer. Without SGLang it says it needs it, in one line."""
    import json
    import sys

    from dwise_predict.cli.app import main
    from dwise_predict.dllm import TINY_MODEL_DIR

    flags = ["serve", "--record", str(tmp_path / "t"), "--block-size", "32", "--hidden-size", "2048", "--slots", "64",
             "--k", "4", "--prompt-cache", "256", "--dry-run", "--", "--model-path", str(TINY_MODEL_DIR), "--dllm-fdfo"]
    assert main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sglang_args"] == ["--model-path", str(TINY_MODEL_DIR), "--dllm-fdfo"]
    assert out["hook"]["max_batch"] == 256 and out["hook"]["tokenizer"] == str(TINY_MODEL_DIR)
    assert out["hook"]["block_size"] == 32 and out["hook"]["k"] == 4 and out["hook"]["prompt_cache"] == 256
    assert main(flags + ["--max-running-requests", "1024"]) == 0
    assert json.loads(capsys.readouterr().out)["hook"]["max_batch"] == 1024
    assert not sglang_entrypoints.LAUNCHED  # nothing started
    assert main(["serve", "--", "--model-path", "m"]) == 1
    assert capsys.readouterr().err.strip().startswith("error: nothing to do")
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", None)  # no SGLang here
    assert main(flags) == 1
    err = capsys.readouterr().err.strip()
    assert "--dry-run" in err and "needs sglang==0.5.23 installed" in err and len(err.splitlines()) == 1


def test_the_offline_engine_gets_its_hook_config_from_the_servers_resolved_arguments(tmp_path, sglang_entrypoints):
    """``launcher.engine()`` builds SGLang's server arguments as ``Engine.__init__`` does and resolves
    them before configuring the hook: a buffer of ``slots`` rows (64) would stop the server while SGLang
    captures its decode graphs up to 256 on an H200, and admission without a tokenizer counts over ""."""
    from dwise_predict.dllm import TINY_MODEL_DIR
    from dwise_predict.serving.launcher import engine

    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048, slots=64, k=4)
    llm = engine(config, model_path=str(TINY_MODEL_DIR), dllm_algorithm="LowConfidence")
    (server_args, entry), = sglang_entrypoints.LAUNCHED
    assert isinstance(entry, SchedulerEntry) and server_args is llm.server_args
    assert entry.config.max_batch == 256 and entry.config.tokenizer == str(TINY_MODEL_DIR)
    assert server_args.log_level == "error"  # Engine's own default, when it builds the arguments
    llm.shutdown()  # no recording process in this tree to stop; then SGLang's own shutdown
    assert sglang_entrypoints.SHUT_DOWN == [llm]


def test_serve_kills_the_process_tree_on_exit_as_sglangs_launcher_does(tmp_path, sglang_entrypoints, monkeypatch):
    """SGLang's launcher (``sglang/launch_server.py``, ``sglang serve``) runs the server inside ``try``
    and kills what is left of its process tree in ``finally``, the launcher itself spared; ``serve``
    does the same, after a launch that returns and after one that fails."""
    import ast
    import sys

    from dwise_predict.dllm import TINY_MODEL_DIR
    from dwise_predict.serving.launcher import serve

    for path in ("launch_server.py", "cli/serve.py"):
        tree = ast.parse((sglang_reference.source_root() / "sglang" / path).read_text())
        kills = [ast.unparse(node) for t in ast.walk(tree) if isinstance(t, ast.Try) for statement in t.finalbody
                 for node in ast.walk(statement) if isinstance(node, ast.Call) and ast.unparse(node.func) == "kill_process_tree"]
        assert kills == ["kill_process_tree(os.getpid(), include_parent=False)"], path
    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048)
    serve(config, ["--model-path", str(TINY_MODEL_DIR)])
    assert sglang_entrypoints.KILLED == [{"parent_pid": os.getpid(), "include_parent": False}]

    def failed_launch(*args, **kwargs):
        raise RuntimeError("a scheduler died at start-up")

    monkeypatch.setattr(sys.modules["sglang.srt.entrypoints.http_server"], "launch_server", failed_launch)
    with pytest.raises(RuntimeError):
        serve(config, ["--model-path", str(TINY_MODEL_DIR)])
    assert len(sglang_entrypoints.KILLED) == 2


@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
@pytest.mark.parametrize("tp,attn_dp,attn_cp", [(1, 1, 1), (2, 1, 1), (4, 2, 1), (4, 4, 1), (8, 2, 2), (8, 4, 1)])
def test_every_attention_dp_rank_records_once_where_sglang_places_it(tp, attn_dp, attn_cp):
    """Under attention DP each attention-DP group of the TP group schedules its own requests: one
    process of each group records them, into ``dp<its attention-DP rank>``, by SGLang's own placement
    (``compute_dp_attention_world_info``, which also gives the DP controller the rank it passes each
    scheduler). Not only TP rank 0. A later pipeline stage records nothing."""
    from fakes import sglang_launch as sgl

    from dwise_predict.serving.launcher import recording_directory

    server_args = sgl.ServerArgs(tp_size=tp, attn_dp_size=attn_dp, attn_cp_size=attn_cp)
    recorders = {}
    for tp_rank in range(tp):
        placed = sgl.compute_dp_attention_world_info(tp_rank, tp, attn_dp, attn_cp)  # attn_tp_rank, _, attn_dp_rank, _
        dp_rank = placed[2] if attn_dp > 1 else None  # data_parallel_controller.launch_tensor_parallel_group
        where = recording_directory(server_args, tp_rank, 0, dp_rank, sgl.resolve)
        if where is not None:
            assert placed[0] == 0 and where == f"dp{placed[2]}", (tp_rank, where)
            recorders[tp_rank] = where
        assert recording_directory(server_args, tp_rank, 1, dp_rank, sgl.resolve) is None
    assert sorted(recorders.values()) == [f"dp{i}" for i in range(attn_dp)]


@pytest.mark.skipif(not sglang_reference.available(), reason=sglang_reference.SKIP_REASON)
def test_the_dp_layout_is_read_resolved_and_external_replicas_record_apart(monkeypatch):
    """``--dp-size 4 --enable-dp-attention`` is SGLang's older spelling of ``--attn-dp-size 4``: read
    from the resolved arguments it records four ranks. A DP server launched on its own with
    ``SGLANG_DP_RANK`` (SGLang's scheduler takes its rank from there when the launcher passes none)
    records into that rank's directory, not ``dp0`` like every other replica; attention DP inside such
    a replica keeps both ranks in the name."""
    from fakes import sglang_launch as sgl

    from dwise_predict.serving.launcher import recording_directory

    monkeypatch.delenv("SGLANG_DP_RANK", raising=False)
    old = sgl.ServerArgs(tp_size=4, dp_size=4, enable_dp_attention=True)
    old.resolve_once()
    assert [recording_directory(old, r, 0, r, sgl.resolve) for r in range(4)] == ["dp0", "dp1", "dp2", "dp3"]
    single = sgl.ServerArgs()
    assert recording_directory(single, 0, 0, None, sgl.resolve) == "dp0"
    monkeypatch.setenv("SGLANG_DP_RANK", "3")
    assert sgl.resolve_spawn_dp_rank(None) == 3  # SGLang's own reading
    assert recording_directory(single, 0, 0, None, sgl.resolve) == "dp3"
    inside = sgl.ServerArgs(tp_size=2, attn_dp_size=2)
    assert [recording_directory(inside, r, 0, r, sgl.resolve) for r in range(2)] == ["dp3-0", "dp3-1"]


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
