"""The generic block loop over an HF model (random Llama with a mask token): masks, batching, collect."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collect_helpers import make_masked_llama_dir
from dwise_predict.cli import main
from dwise_predict.collectors.backends import load_backend
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.traces import load_traces


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_masked_llama_dir(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def backend(model_dir):
    return load_backend(str(model_dir))


def test_attention_is_block_causal(backend):
    base, changed = [5, 6, 7, 8, 9], [5, 6, 7, 40, 9]  # position 3 changes
    # blocks [0 0 1 1 2]: position 2 shares position 3's block and sees it; block 0 never does
    _, h, _ = backend._forward([base, changed], [[0, 0, 1, 1, 2]] * 2)
    torch.testing.assert_close(h[0, :2], h[1, :2], rtol=0, atol=0)
    assert not torch.allclose(h[0, 2], h[1, 2]) and not torch.allclose(h[0, 4], h[1, 4])
    # blocks [0 0 1 2 3]: position 2 is in an earlier block than position 3 and cannot see it
    _, h, _ = backend._forward([base, changed], [[0, 0, 1, 2, 3]] * 2)
    torch.testing.assert_close(h[0, :3], h[1, :3], rtol=0, atol=0)
    assert not torch.allclose(h[0, 4], h[1, 4])


def test_batched_rounds_match_one_at_a_time(backend):
    prompts = ["what is 2 + 2 ?", "name three colors .", "hi", "write a function total ."]
    requests = [
        DecodeRequest(str(i), backend.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False), 12)
        for i, p in enumerate(prompts)
    ]
    one = {r.request_id: r for r in decode(backend, requests, DecodingConfig(batch_size=1))}
    four = {r.request_id: r for r in decode(backend, requests, DecodingConfig(batch_size=4))}
    for rid in one:
        assert one[rid].rounds_per_block == four[rid].rounds_per_block
        assert one[rid].output_ids == four[rid].output_ids
        np.testing.assert_allclose(one[rid].first_round_hidden, four[rid].first_round_hidden, atol=1e-5)
        np.testing.assert_allclose(one[rid].prompt_last_hidden, four[rid].prompt_last_hidden, atol=1e-5)


def test_collect_through_the_block_loop(model_dir, tmp_path):
    out = tmp_path / "traces"
    assert main(["collect", "--model", str(model_dir), "--limit", "4", "--budget", "8", "--batch-size", "2",
                 "--out", str(out)]) == 0
    ds = load_traces(out)
    assert len(ds) == 4 and ds.first_round.shape == (4, 32)
    assert (ds.requests["block_size"] == 4).all() and ds.manifest["model"]["name"] == "model"
    assert (ds.requests["total_rounds"] == ds.requests["rounds_per_block"].map(sum)).all()


def test_the_block_loop_keeps_per_round_states(model_dir, tmp_path):
    from dwise_predict.traces.round_states import round_states

    out = tmp_path / "traces"
    assert main(["collect", "--model", str(model_dir), "--limit", "4", "--budget", "8", "--batch-size", "2",
                 "--rounds-hidden", "3", "--out", str(out)]) == 0
    ds = load_traces(out)
    rounds = round_states(ds)
    assert rounds.states.shape == (4, 3, 32) and ds.manifest["rounds_hidden"] == 3
    assert rounds.recorded.tolist() == np.minimum(ds.requests["total_rounds"], 3).tolist()
    np.testing.assert_array_equal(rounds.states[:, 0], ds.first_round)
    np.testing.assert_array_equal(rounds.signals[:, 0], ds.early_signals)
    assert (np.abs(rounds.states[:, 1]).sum(1) > 0).tolist() == (rounds.recorded >= 2).tolist()


def test_every_declared_end_of_sequence_id_stops_a_request_as_in_sglang(model_dir, tmp_path):
    """SGLang stops a request on any id that config.json or generation_config.json names as
    ``eos_token_id`` (``ModelConfig._get_hf_eos_token_id``, compiled from the wheel) or that the
    tokenizer does; Qwen-based checkpoints (SDAR) name a different one in each file."""
    import json
    import shutil
    from types import SimpleNamespace

    import sglang_reference

    sgl = sglang_reference.load()
    model = shutil.copytree(model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    generation_path = model / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    generation["eos_token_id"] = [config["eos_token_id"], 7]
    generation_path.write_text(json.dumps(generation))
    backend = load_backend(str(model))
    reference = sgl.ModelConfigStops()
    reference.hf_config, reference.hf_generation_config = SimpleNamespace(**config), SimpleNamespace(**generation)
    want = reference._get_hf_eos_token_id() | {backend.tokenizer.eos_token_id}
    assert set(backend.eos_token_ids) == want and 7 in want and len(want) == 2


def test_a_checkpoint_routed_per_block_is_collected_only_at_its_own_block_size(model_dir, tmp_path, capsys):
    """As SGLang serves it (``DllmConfig.from_server_args``; tests/test_engine_conformance.py)."""
    import json
    import shutil

    model = shutil.copytree(model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "expert_capacity": 8}))
    flags = ["collect", "--model", str(model), "--limit", "2", "--budget", "8"]
    assert main([*flags, "--block-size", "8", "--out", str(tmp_path / "o8")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "block_size 4, not 8" in err and "drop --block-size" in err
    assert not (tmp_path / "o8").exists()
    assert main([*flags, "--out", str(tmp_path / "o4")]) == 0
    assert (load_traces(tmp_path / "o4").requests["block_size"] == 4).all()


def test_autoregressive_model_is_refused(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    from dwise_predict.dllm.corpus import vocabulary
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tok = build_tokenizer(vocabulary()[:50])
    tok.mask_token = None
    tok.save_pretrained(tmp_path / "gpt2")
    assert main(["collect", "--model", str(tmp_path / "gpt2"), "--limit", "2", "--out", str(tmp_path / "o")]) == 1
    assert "not a block-diffusion LM" in capsys.readouterr().err
