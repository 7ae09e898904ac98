"""The launcher installs the hook inside a ``spawn``-started scheduler process, as SGLang starts them."""

import logging
import multiprocessing as mp
import os
import sys

import pytest

import sglang_reference
from dwise_predict.cli.options import as_flags
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
    message = str(err.value)  # the library names its parameters; `serve` names them as its flags
    assert "`slots` must be positive" in message and "`k` must be at least 1" in message
    assert "--slots must be positive" in as_flags(message) and "--k must be at least 1" in as_flags(message)
    assert "has no bundle.json" in message and "\n" not in message
    with pytest.raises(ConfigError, match="nothing to do"):
        resolved(HookConfig())
    with pytest.raises(ConfigError, match="needs `block_size` and `hidden_size`"):
        resolved(HookConfig(record=str(tmp_path / "t")))


@pytest.mark.parametrize("max_running_requests,want", [(128, 256), (1024, 1024)])
def test_the_pooling_buffer_holds_every_batch_the_server_can_run(tmp_path, max_running_requests, want):
    """The buffer must hold the largest batch SGLang captures a CUDA graph for (a capture with more
    rows than the buffer stops the server at start-up) and the largest eager batch. Those sizes are
    decisions of ``resolve_once``, recorded beside the raw flags: read through SGLang's own
    ``resolved_view``. The decision here is the memory hook's on an H200 at tp 1 given
    ``--cuda-graph-max-bs-decode 256`` (decode graphs up to 256 requests, beyond
    ``--max-running-requests``: ``arg_groups/memory_hook.py``, ``cuda_graph_hook.py``)."""
    from types import SimpleNamespace

    from dwise_predict.serving.launcher import largest_forward

    sgl = sglang_reference.load_server_config()
    h200 = sgl.PhaseConfig(backend=sgl.Backend.FULL, max_bs=256, bs=[1, 2, 4, 8, 12, *range(16, 257, 8)])
    raw = SimpleNamespace(cuda_graph_config=sgl.CudaGraphConfig(), max_running_requests=max_running_requests,
                          tokenizer_path=None, model_path="m", dllm_algorithm="LowConfidence")
    raw._resolved_overrides = [("_handle_gpu_memory_settings", {"cuda_graph_config": sgl.CudaGraphConfig(decode=h200)})]
    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048, slots=32, k=4)
    assert resolved(config, sgl.resolved_view(raw)).max_batch == want
    if max_running_requests < 256:  # the raw flags alone would size the buffer short of the graphs
        assert largest_forward(raw) == 128 and resolved(config, raw).max_batch == 128


@pytest.fixture
def sglang_entrypoints(monkeypatch):
    """SGLang's launch side where the launcher imports it: the wheel's plugin loader and resolved view,
    stand-ins for what needs a GPU (``fakes/sglang_launch.py``: an H200's resolution)."""
    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    return sglang_launch.entrypoints(monkeypatch)


@pytest.fixture
def llada2(tmp_path):
    """A model directory as SGLang would serve LLaDA2-mini (its architecture: dLLM block 32; hidden 2048)."""
    from fakes.sglang_launch import write_model

    return write_model(tmp_path / "llada2", architecture="LLaDA2MoeModelLM", hidden_size=2048)


def test_serve_dry_run_prints_what_the_server_will_use(tmp_path, capsys, sglang_entrypoints, monkeypatch, llada2):
    """``--dry-run`` resolves SGLang's arguments as the server will: the pooling buffer holds the decode
    graphs SGLang captures on this GPU (256 on an H200 at tp 1, beyond ``--slots``; all of
    ``--max-running-requests`` when that is larger) and admission reads the model's tokenizer, not
    ``max_batch = slots`` and no tokenizer. Without SGLang it says it needs it, in one line."""
    import json
    import sys

    from dwise_predict.cli.app import main

    server = ["--model-path", str(llada2), "--dllm-algorithm", "LowConfidence", "--dllm-fdfo", "--max-running-requests",
              "256", "--cuda-graph-max-bs-decode", "256"]
    flags = ["serve", "--record", str(tmp_path / "t"), "--block-size", "32", "--hidden-size", "2048", "--slots", "64",
             "--k", "4", "--prompt-cache", "256", "--dry-run", "--", *server]
    assert main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sglang_args"] == server
    assert out["hook"]["max_batch"] == 256 and out["hook"]["tokenizer"] == str(llada2)
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


def test_the_offline_engine_gets_its_hook_config_from_the_servers_resolved_arguments(tmp_path, sglang_entrypoints,
                                                                                    llada2):
    """``launcher.engine()`` builds SGLang's server arguments as ``Engine.__init__`` does and resolves
    them before configuring the hook: a buffer of ``slots`` rows (64) would stop the server while SGLang
    captures its decode graphs up to 256 on an H200, and admission without a tokenizer counts over ""."""
    from dwise_predict.serving.launcher import engine

    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048, slots=64, k=4)
    llm = engine(config, model_path=str(llada2), dllm_algorithm="LowConfidence", max_running_requests=256)
    (server_args, entry), = sglang_entrypoints.LAUNCHED
    assert isinstance(entry, SchedulerEntry) and server_args is llm.server_args
    assert entry.config.max_batch == 256 and entry.config.tokenizer == str(llada2)
    assert server_args.log_level == "error"  # Engine's own default, when it builds the arguments
    llm.shutdown()  # no recording process in this tree to stop; then SGLang's own shutdown
    assert sglang_entrypoints.SHUT_DOWN == [llm]


def test_serve_kills_the_process_tree_on_exit_as_sglangs_launcher_does(tmp_path, sglang_entrypoints, monkeypatch,
                                                                       llada2):
    """SGLang's launcher (``sglang/launch_server.py``, ``sglang serve``) runs the server inside ``try``
    and kills what is left of its process tree in ``finally``, the launcher itself spared; ``serve``
    does the same, after a launch that returns and after one that fails."""
    import ast
    import sys

    from dwise_predict.serving.launcher import serve

    for path in ("launch_server.py", "cli/serve.py"):
        tree = ast.parse((sglang_reference.source_root() / "sglang" / path).read_text())
        kills = [ast.unparse(node) for t in ast.walk(tree) if isinstance(t, ast.Try) for statement in t.finalbody
                 for node in ast.walk(statement) if isinstance(node, ast.Call) and ast.unparse(node.func) == "kill_process_tree"]
        assert kills == ["kill_process_tree(os.getpid(), include_parent=False)"], path
    config = HookConfig(record=str(tmp_path / "t"), block_size=32, hidden_size=2048)
    server = ["--model-path", str(llada2), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "1024"]
    serve(config, server)
    assert sglang_entrypoints.KILLED == [{"parent_pid": os.getpid(), "include_parent": False}]

    def failed_launch(*args, **kwargs):
        raise RuntimeError("a scheduler died at start-up")

    monkeypatch.setattr(sys.modules["sglang.srt.entrypoints.http_server"], "launch_server", failed_launch)
    with pytest.raises(RuntimeError):
        serve(config, server)
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


# --- the hook checked against the served model and server before SGLang loads the model (issue 56) ---


def _bundle(directory, hidden_size=2048, block_size=32, algorithm="LowConfidence", model=None):
    """A bundle's ``bundle.json`` (what the launcher reads of a bundle before the model loads)."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    model = {"name": "m", "hidden_size": hidden_size} if model is None else model
    (directory / "bundle.json").write_text(json.dumps({
        "model": model, "inputs": {"refine": {"hidden_size": hidden_size}},
        "decoding": {"algorithm": algorithm, "algorithm_config": {"threshold": 0.95}, "block_size": block_size}}))
    return str(directory)


def _dllm(model, *extra):
    return ["--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "1024", *extra]


def test_a_bundle_or_hidden_size_of_another_width_is_refused_before_the_model_loads(tmp_path, sglang_entrypoints,
                                                                                   llada2):
    """SGLang's warmup forward would die in the patched ``get_dllm_logits`` (size 32 vs 64) and the
    launcher exit 137. The width is read from the model's ``config.json`` (its text config's for a
    multimodal config such as DiffusionGemma's), and nothing starts."""
    from dwise_predict.serving.launcher import serve

    narrow = HookConfig(bundle=_bundle(tmp_path / "b", hidden_size=32), slots=16, k=4)
    with pytest.raises(BundleError) as err:
        serve(narrow, _dllm(llada2))
    message = str(err.value)
    assert "takes hidden states of width 32 but the served model" in message and "has hidden size 2048" in message
    assert "\n" not in message
    recording = HookConfig(record=str(tmp_path / "t"), hidden_size=32, slots=16, k=4)
    with pytest.raises(ConfigError, match="`hidden_size`=32 but the served model .* has hidden size 2048: leave "):
        serve(recording, _dllm(llada2))
    assert not sglang_entrypoints.LAUNCHED and len(sglang_entrypoints.KILLED) == 2
    # the width the launcher reads otherwise: a recording needs no --hidden-size or --block-size
    filled = resolved(HookConfig(record=str(tmp_path / "t"), slots=16, k=4),
                      sglang_entrypoints.prepare_server_args(_dllm(llada2)))
    assert (filled.hidden_size, filled.block_size) == (2048, 32)
    from dwise_predict.serving.checks import hidden_size

    gemma = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "hidden_size": 5,
             "text_config": {"hidden_size": 64, "canvas_length": 32}}
    assert hidden_size(gemma) == 64 and hidden_size({"hidden_size": 2048}) == 2048
    # a hub id is not fetched: no width to check before load, and the check says so
    from dwise_predict.serving.preflight import checked

    report = checked(narrow, sglang_entrypoints.prepare_server_args(_dllm("inclusionAI/LLaDA2.0-mini")))
    assert report["problems"] == [] and "no local model directory (not fetched)" in report["notes"][0]


BLOCK_CASES = [  # (architecture, --dllm-algorithm-config, the hook's block size, refused with)
    ("SDARForCausalLM", None, None, "built for another decoding (decoding.block_size = 32"),
    ("SDARForCausalLM", None, 32, "`block_size`=32 but SGLang runs SDARForCausalLM with block size 4"),
    ("TinyDllmForBlockDiffusion", None, None, "SGLang refuses this dLLM server: Unknown diffusion LLM"),
    ("LLaDA2MoeModelLM", None, None, None),
    ("SDARForCausalLM", "block_size: 32\n", None, None),  # SGLang's block size is the file's
]


def test_the_block_size_sglang_runs_for_the_model_is_checked_before_it_loads(tmp_path, sglang_entrypoints):
    """The block size is SGLang's own ``DllmConfig.from_server_args`` (the wheel's, over the model's
    config): 32 for LLaDA2, 4 for SDAR, ``--dllm-algorithm-config``'s ``block_size`` over either.
    A bundle trained at 32 served on SDAR was refused only after the model loaded (exit 137)."""
    from dwise_predict.errors import DwiseError
    from dwise_predict.serving.launcher import serve

    for i, (architecture, algorithm_config, hook_block, refused) in enumerate(BLOCK_CASES):
        model = sglang_entrypoints.write_model(tmp_path / f"m{i}", architecture=architecture, hidden_size=2048)
        extra = []
        if algorithm_config is not None:
            (tmp_path / "algorithm.yaml").write_text(algorithm_config)
            extra = ["--dllm-algorithm-config", str(tmp_path / "algorithm.yaml")]
        config = HookConfig(bundle=_bundle(tmp_path / "b", block_size=32), block_size=hook_block, slots=16, k=4)
        launched = len(sglang_entrypoints.LAUNCHED)
        if refused is None:
            serve(config, _dllm(model, *extra))
            assert sglang_entrypoints.LAUNCHED[-1][1].config.block_size == 32, architecture
        else:
            with pytest.raises(DwiseError) as err:
                serve(config, _dllm(model, *extra))
            assert refused in str(err.value) and "\n" not in str(err.value)
            assert len(sglang_entrypoints.LAUNCHED) == launched


def test_k_times_b_is_checked_against_the_rows_each_scheduler_gets(tmp_path, sglang_entrypoints, llada2):
    """Under attention DP each worker gets ``--max-running-requests // attn_dp_size`` request rows
    (SGLang's ``KVCacheConfigurator.resolve_max_num_reqs``, compiled from the wheel and compared here
    over a grid), at most half its KV tokens; without the flag ``DllmConfig`` runs a dLLM one request
    at a time. The hook checked ``k*B`` against the global flag, after the model loaded."""
    import logging
    from types import SimpleNamespace

    from dwise_predict.serving.launcher import serve

    config = HookConfig(record=str(tmp_path / "t"), slots=128, k=8)
    dp = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
    with pytest.raises(ConfigError) as err:
        serve(config, _dllm(llada2, *dp))
    assert as_flags(str(err.value)) == (  # as `serve` prints it
        "DWISE keeps up to k*B = 1024 requests resident in each scheduler (--slots=128 x --k=8) but each scheduler "
        "holds 512 (--max-running-requests 1024 // 2 attention-DP workers): pass --max-running-requests 2048, or "
        "lower --slots or --k")
    from dwise_predict.serving.checks import scheduler_rows

    schedule = SimpleNamespace(max_running_requests=None)
    methods = sglang_reference.compile_members(
        sglang_reference.source_root() / "sglang" / "srt" / "mem_cache" / "kv_cache_configurator.py",
        "KVCacheConfigurator", ("resolve_max_num_reqs",),
        namespace={"get_schedule": lambda: schedule, "logger": logging.getLogger("sglang")})["KVCacheConfiguratorMethods"]
    for requested in (1, 7, 64, 1000, 1024):
        for attn_dp in (1, 2, 4, 8):
            for max_total_tokens in (None, 600, 10**5):
                schedule.max_running_requests = requested
                worker = SimpleNamespace(model_config=SimpleNamespace(context_len=4096), attn_dp_size=attn_dp,
                                         mambaish_config=None)
                sglang_rows = methods.resolve_max_num_reqs(worker, max_total_tokens or 10**7)  # profiled: plenty
                view = SimpleNamespace(max_running_requests=requested, attn_dp_size=attn_dp,
                                       max_total_tokens=max_total_tokens)
                assert scheduler_rows(view)[0] == sglang_rows, (requested, attn_dp, max_total_tokens)
    no_flag = sglang_entrypoints.prepare_server_args(["--model-path", str(llada2), "--dllm-algorithm", "LowConfidence"])
    no_flag.resolve_once()
    dllm = sys.modules["sglang.srt.dllm.config"].DllmConfig.from_server_args(no_flag)
    assert scheduler_rows(no_flag)[0] == dllm.max_running_requests == 1
    with pytest.raises(ConfigError, match="holds 1 \\(SGLang's dLLM default without --max-running-requests: one "
                                          "request at a time\\): pass --max-running-requests 1024"):
        serve(config, ["--model-path", str(llada2), "--dllm-algorithm", "LowConfidence"])
    with pytest.raises(ConfigError, match="holds 300 \\(at most half of --max-total-tokens 600\\): raise "
                                          "--max-total-tokens to at least 2048"):
        serve(config, _dllm(llada2, "--max-total-tokens", "600"))
    with pytest.raises(ConfigError, match="without a dLLM algorithm, where the hook never runs: pass --dllm-algorithm"):
        serve(config, ["--model-path", str(llada2), "--max-running-requests", "1024"])
    assert not sglang_entrypoints.LAUNCHED
    serve(config, ["--model-path", str(llada2), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "2048",
                   *dp])
    assert len(sglang_entrypoints.LAUNCHED) == 1


def test_the_model_identity_is_checked_where_the_bundle_names_one(tmp_path, sglang_entrypoints, llada2):
    """A bundle's ``model.config_hash`` (what ``collect`` recorded) against the served config's, hashed
    the same way; a bundle trained on a live recording names no model: skipped, and said. The name is
    no identity (the same weights under another directory name)."""
    view = sglang_entrypoints.prepare_server_args(_dllm(llada2))
    other = HookConfig(bundle=_bundle(tmp_path / "other", model={"name": "llada2-moe", "config_hash": "0" * 64}),
                       slots=8)
    with pytest.raises(BundleError, match="trained on another model \\('llada2-moe', config hash 000000000000\\) than "):
        resolved(other, view)
    from transformers import AutoConfig

    from dwise_predict.names import config_hash
    from dwise_predict.serving.preflight import checked

    served = config_hash(AutoConfig.from_pretrained(str(llada2)).to_dict())
    same = HookConfig(bundle=_bundle(tmp_path / "same", model={"name": "elsewhere", "config_hash": served}), slots=8)
    report = checked(same, view)
    assert report["problems"] == [] and report["server"]["config_hash"] == served and report["hook"]["bundle"]
    live = HookConfig(bundle=_bundle(tmp_path / "live", model={}), slots=8)
    report = checked(live, view)
    assert report["problems"] == [] and any("names no model config" in note for note in report["notes"])


def test_each_scheduler_process_says_once_that_the_hook_engaged(tmp_path, caplog, monkeypatch):
    """The start-up line names the bundle, B, k, the request rows each scheduler holds and where it
    records; a scheduler process without it runs without the hook."""
    from fakes import sglang_launch

    from dwise_predict.serving import launcher

    monkeypatch.setattr(launcher, "ACTIVE", None)
    server_args = sglang_launch.ServerArgs(max_running_requests=1024, tp_size=2, dp_size=2, enable_dp_attention=True,
                                           dllm_algorithm="LowConfidence")
    server_args.resolve_once()
    config = HookConfig(slots=16, k=4, block_size=4, prompt_cache=16, resolver="fakes.sglang_launch:resolve")
    with caplog.at_level(logging.WARNING, logger="dwise_predict.serving.launcher"):
        installed = launcher.install_in_this_process(config, server_args, tp_rank=1, dp_rank=1)
    installed.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.name == "dwise_predict.serving.launcher"]
    assert len(lines) == 1 and lines[0] == (
        f"DWISE hook engaged in scheduler process {os.getpid()} (TP rank 1, DP rank 1): no bundle (r_hat = 0), B = 16, "
        "k = 4, k*B = 64 of 512 request rows per scheduler, block size 4; not recording")
    recording = launcher.engaged_line(HookConfig(bundle="b/", record=str(tmp_path), slots=8, k=2, block_size=32),
                                      None, 0, None, "dp0")
    assert "bundle b/, B = 8, k = 2, k*B = 16 of ? request rows" in recording
    assert recording.endswith(f"recording to {tmp_path / 'dp0'}")


@pytest.mark.parametrize("config_text,refused", [
    ("threshold: 0.95\n", None),
    (None, None),  # SGLang's defaults
    ("threshold: 1.5\n", "algorithm parameter threshold must be a number in"),
    ("threshold: high\n", "algorithm parameter threshold must be a number in"),
])
def test_recording_a_decoding_the_engine_refuses_is_refused_before_sglang_loads_the_model(tmp_path, config_text,
                                                                                          refused):
    """SGLang runs whatever parameters it is given; a recording of one our rules refuse would be refused
    by every reader of its traces, so `serve --record` refuses it in one line before the model loads
    (not as a scheduler crash when the recorder writes its manifest)."""
    from types import SimpleNamespace

    path = None
    if config_text is not None:
        path = tmp_path / "algorithm.yaml"
        path.write_text(config_text)
    server_args = SimpleNamespace(dllm_algorithm="LowConfidence", dllm_algorithm_config=None if path is None else str(path),
                                  model_path="m", tokenizer_path=None, max_running_requests=1024)
    config = HookConfig(record=str(tmp_path / "rec"), block_size=32, hidden_size=16)
    if refused is None:
        assert resolved(config, server_args).block_size == 32
    else:
        with pytest.raises(ConfigError, match=f"^cannot record SGLang's LowConfidence decoding: {refused}") as err:
            resolved(config, server_args)
        assert "\n" not in str(err.value) and "correct the algorithm config file" in str(err.value)
    assert not (tmp_path / "rec").exists()
