"""The tiny dLLM: block-causal attention, KV cache = full forward, save/load through the Auto classes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dwise_predict.dllm import TinyDllmConfig, TinyDllmForBlockDiffusion, block_ids_for

BS = 4


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return TinyDllmForBlockDiffusion(TinyDllmConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=2,
                                                    block_size=BS, max_position_embeddings=64)).eval()


def test_later_block_does_not_change_earlier_blocks(model):
    ids = torch.randint(8, 64, (2, 18))
    changed = ids.clone()
    changed[:, 12:] = 5  # blocks 3 and 4 (block size 4)
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :12], b[:, :12])
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3
    # inside a block attention is bidirectional: the first token of block 3 sees its last one
    with torch.no_grad():
        c = model(torch.cat([ids[:, :15], torch.full((2, 1), 5), ids[:, 16:]], dim=1)).logits
    assert (c[:, 12] - a[:, 12]).abs().max() > 1e-4


def test_padding_is_never_attended(model):
    ids = torch.randint(8, 64, (1, 10))
    padded = torch.cat([ids, torch.randint(8, 64, (1, 6))], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 6)], dim=1).long()
    with torch.no_grad():
        a = model(ids).logits
        b = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(a, b[:, :10], atol=1e-5, rtol=0)


def test_noisy_stream_sees_clean_earlier_blocks(model):
    plen, T = 6, 12  # grid blocks [0:4] prompt, [4:8] = 2 leftover prompt tokens + 2 outputs, [8:12]
    ids = torch.randint(8, 64, (2, T))
    noisy = ids[:, 4:].clone()  # (2, 8) noisy copy from the first output block on
    noisy[:, 2:4] = model.config.mask_token_id  # the output positions of output block 0
    noisy[:, 4:7] = model.config.mask_token_id  # in output block 1
    lengths = torch.tensor([plen, plen])
    with torch.no_grad():
        dual = model(ids, prompt_lengths=lengths, noisy_ids=noisy).logits  # (2, 8, V)
        # reference for output block 1: clean prompt and clean block 0, then noisy block 1
        ref = model(torch.cat([ids[:, :8], noisy[:, 4:]], dim=1)).logits
        ref0 = model(torch.cat([ids[:, :4], noisy[:, :4]], dim=1)).logits
    assert dual.shape == (2, 8, model.config.vocab_size)
    torch.testing.assert_close(dual[:, 4:], ref[:, 8:12], atol=1e-5, rtol=0)
    torch.testing.assert_close(dual[:, :4], ref0[:, 4:8], atol=1e-5, rtol=0)


def test_block_ids_follow_the_engines_grid():
    assert block_ids_for(14, BS)[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3]


def test_cached_rounds_equal_the_full_forward(model):
    T = 15  # prompt of 7: block [0:4], then [4:8] = 3 leftover prompt tokens + 1 output, [8:12], [12:15]
    ids = torch.randint(8, 64, (2, T))
    with torch.no_grad():
        full = model(ids)
    cache = model.allocate_cache(3)
    slots = torch.tensor([2, 0])  # any slots, in any order
    t = torch.tensor
    model.forward_step(cache, slots, ids[:, :4], t([4, 4]), t([4, 4]), t([0, 0]))  # the prompt block
    logits, h, _ = model.forward_step(cache, slots, ids[:, 4:8], t([4, 4]), t([0, 0]), t([0, 0]))
    torch.testing.assert_close(logits, full.logits[:, 4:8], atol=1e-5, rtol=0)
    torch.testing.assert_close(h, full.hidden_states[:, 4:8], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [4, 0, 4]
    # commit the finished block and run the next one in the same row
    logits, h, _ = model.forward_step(cache, slots, ids[:, 4:12], t([8, 8]), t([4, 4]), t([4, 4]))
    torch.testing.assert_close(logits, full.logits[:, 8:12], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [8, 0, 8]
    # a short last chunk (3 valid tokens of a 4-wide window)
    chunk = torch.zeros(2, 8, dtype=torch.long)
    chunk[:, :7] = ids[:, 8:15]
    logits, h, _ = model.forward_step(cache, slots, chunk, t([7, 7]), t([4, 4]), t([4, 4]))
    torch.testing.assert_close(logits[:, :3], full.logits[:, 12:15], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [12, 0, 12]


def test_output_head_is_tied_to_the_embeddings_unless_asked_not_to(tmp_path):
    from safetensors import safe_open

    tied = TinyDllmForBlockDiffusion(TinyDllmConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=2))
    assert tied.lm_head.weight is tied.embed.weight
    tied.save_pretrained(tmp_path / "tied")
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "embed.weight" in f.keys()
    untied = TinyDllmForBlockDiffusion(TinyDllmConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=2,
                                                      tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight


ROUNDTRIP = """
import sys, torch
from transformers import AutoConfig, AutoModel, AutoTokenizer
import dwise_predict.dllm  # registers the Auto classes
model = AutoModel.from_pretrained(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "what is 2 plus 3 ?"}],
                              add_generation_prompt=True, tokenize=True, return_dict=False)
with torch.no_grad():
    out = model(torch.tensor([ids])).logits
assert model.lm_head.weight is model.embed.weight  # still tied after loading
print(type(model).__name__, tok.mask_token_id == model.config.mask_token_id, ids, float(out.sum()))
"""


def test_save_and_load_in_a_fresh_process(tmp_path):
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tok = build_tokenizer(["what", "is", "plus", "?", "2", "3", "5"])
    torch.manual_seed(0)
    model = TinyDllmForBlockDiffusion(TinyDllmConfig(
        vocab_size=len(tok), hidden_size=32, n_layers=2, n_heads=2, block_size=BS,
        mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", "chat_template.jinja", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()}
    ids = tok.apply_chat_template([{"role": "user", "content": "what is 2 plus 3 ?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        expected = float(model(torch.tensor([ids])).logits.sum())
    proc = subprocess.run([sys.executable, "-c", ROUNDTRIP, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parts = proc.stdout.strip().split(" ")
    assert parts[0] == "TinyDllmForBlockDiffusion" and parts[1] == "True"
    assert ids == [tok.convert_tokens_to_ids("<user>"), *tok.convert_tokens_to_ids(
        ["what", "is", "2", "plus", "3", "?"]), tok.convert_tokens_to_ids("<assistant>")]
    assert float(parts[-1]) == pytest.approx(expected, rel=1e-5)


def test_backend_loads_a_saved_model_and_fingerprints_it(tmp_path):
    import hashlib

    from dwise_predict.collectors.backends.tiny import load_tiny_backend
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tok = build_tokenizer(["a", "b"])
    model = TinyDllmForBlockDiffusion(TinyDllmConfig(
        vocab_size=len(tok), hidden_size=16, n_layers=1, n_heads=2, block_size=BS, max_position_embeddings=32,
        mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    backend = load_tiny_backend(tmp_path)
    fp = backend.fingerprint()
    assert fp["weights_sha256"] == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert (fp["hidden_size"], fp["vocab_size"], backend.max_context, backend.block_size) == (16, len(tok), 32, BS)
    assert fp["config_hash"] == load_tiny_backend(tmp_path).fingerprint()["config_hash"]
    assert backend.tokenizer.mask_token_id == backend.mask_token_id == 1
    assert load_tiny_backend(tmp_path, dtype="bfloat16").model.dtype == torch.bfloat16
