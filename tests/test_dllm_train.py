"""The tiny dLLM's training recipe: masking, the two-stream objective, determinism, the saved directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dwise_predict.dllm.corpus import generate_examples
from dwise_predict.dllm.train import (
    CHECKPOINT_NAME,
    TinyTrainConfig,
    build_model_and_tokenizer,
    cap_batch,
    category_schedule,
    encode_example,
    make_batch,
    train_tiny,
)
from dwise_predict.errors import ConfigError, InputError

SMALL = {"hidden_size": 32, "n_layers": 1, "n_heads": 2, "batch_size": 4, "steps": 4, "warmup_steps": 2}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_model_and_tokenizer(TinyTrainConfig(**SMALL))


def _encoded(tokenizer, n=6):
    examples = generate_examples("math", n, seed=1) + generate_examples("mcq", 3, seed=1)
    return [encode_example(tokenizer, e, 8) for e in examples]


def test_answers_end_with_eos_up_to_the_end_of_a_grid_block(model_and_tokenizer):
    _, tok = model_and_tokenizer
    for ids, p in _encoded(tok):
        response = ids[p:]
        assert len(ids) % 8 == 0 and response[-1] == tok.eos_token_id  # blocks from the first token
        first_eos = response.index(tok.eos_token_id)
        assert all(t == tok.eos_token_id for t in response[first_eos:])
        assert ids[p - 1] == tok.convert_tokens_to_ids("<assistant>")


def test_every_output_block_is_masked_and_nothing_else(model_and_tokenizer):
    _, tok = model_and_tokenizer
    enc = _encoded(tok)
    batch = make_batch(enc, 8, tok.mask_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    masked, valid = batch["loss_mask"], batch["noisy_valid"]
    assert not (masked & ~valid).any()
    for i, (ids, p) in enumerate(enc):
        start = p // 8 * 8  # the first output block opens with the prompt's leftover tokens
        n_blocks = (len(ids) - start) // 8
        per_block = masked[i, : n_blocks * 8].view(n_blocks, 8).sum(-1)
        assert (per_block >= 1).all()
        assert not masked[i, : p - start].any()  # leftover prompt tokens stay clean (the prompt mask)
        assert torch.equal(batch["targets"][i, : len(ids) - start], torch.tensor(ids[start:]))
    assert (batch["noisy_ids"][masked] == tok.mask_token_id).all()
    assert (batch["noisy_ids"][~masked] == batch["targets"][~masked]).all()
    # ratios differ per block, so the masked fraction spans a wide range
    frac = masked.sum() / valid.sum()
    assert 0.2 < float(frac) < 0.8


def test_two_stream_objective_shows_each_noisy_block_what_the_decoder_shows_it(model_and_tokenizer):
    """Noisy block b in the one-pass objective == a plain block-causal pass over
    [clean blocks before it | noisy block b], the decoder's view while denoising block b."""
    model, tok = model_and_tokenizer
    enc = _encoded(tok)
    batch = make_batch(enc, 8, tok.mask_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       prompt_lengths=batch["prompt_lengths"], noisy_ids=batch["noisy_ids"],
                       noisy_mask=batch["noisy_valid"]).logits  # (B, R, V)
        for i, (ids, p) in enumerate(enc):
            start = p // 8 * 8
            for b in range((len(ids) - start) // 8):
                noisy_block = batch["noisy_ids"][i, 8 * b: 8 * b + 8]
                seq = torch.cat([torch.tensor(ids[: start + 8 * b]), noisy_block])[None]
                plain = model(seq).logits[0, -8:]
                torch.testing.assert_close(logits[i, 8 * b: 8 * b + 8], plain, atol=1e-5, rtol=1e-4)


def test_long_batches_are_capped_by_tokens(model_and_tokenizer):
    _, tok = model_and_tokenizer
    enc = [encode_example(tok, e, 8) for e in generate_examples("long_context", 32, seed=2)]
    capped = cap_batch(enc, 5120, 8)
    T = max(len(ids) for ids, _ in capped)
    R = max(len(ids) - p // 8 * 8 for ids, p in capped)
    assert 1 <= len(capped) < 32 and len(capped) * (T + R) <= 5120


def test_schedule_gives_every_category_its_share():
    order = category_schedule(["chat", "math", "mcq"], 30, seed=0)
    assert sorted(order) == sorted(["chat", "math", "mcq"] * 10)
    assert order == category_schedule(["chat", "math", "mcq"], 30, seed=0)
    weighted = category_schedule(["chat", "math", "mcq"], 50, seed=0, weights={"mcq": 3})
    assert [weighted.count(c) for c in ("chat", "math", "mcq")] == [10, 10, 30]


def test_bad_recipe_is_rejected_with_every_problem():
    with pytest.raises(ConfigError, match="steps.*`batch_size`|`batch_size`.*steps"):
        TinyTrainConfig(steps=0, batch_size=0)
    with pytest.raises(ConfigError, match="categories"):
        TinyTrainConfig(categories=["poetry"])
    with pytest.raises(ConfigError, match="precision.*drills.*weights"):
        TinyTrainConfig(precision="float16", drills=["poetry"], step_weights={"mcq": 0})


def test_training_is_deterministic_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    import dwise_predict.dllm  # noqa: F401  (registers the architecture)

    cfg = TinyTrainConfig(**SMALL)
    a = train_tiny(cfg, tmp_path / "a")
    train_tiny(cfg, tmp_path / "b")
    wa = load_file(tmp_path / "a" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.steps_done == 4 and a.parameters == sum(v.numel() for v in wa.values())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "training.json"):
        assert (tmp_path / "a" / name).is_file(), name
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert record["recipe"]["steps"] == 4 and len(record["versions"]) >= 3
    model = AutoModel.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.mask_token_id == tok.mask_token_id and model.config.vocab_size == len(tok)


def _stop_at(step: int):
    """A progress callback that interrupts training after ``step`` steps, as Ctrl-C would."""
    def progress(done, steps, loss):
        if done == step:
            raise KeyboardInterrupt
    return progress


def test_interrupted_training_resumes_to_the_same_weights_and_curve(tmp_path):
    cfg = TinyTrainConfig(**{**SMALL, "steps": 12})
    whole = train_tiny(cfg, tmp_path / "whole", checkpoint_every=5)
    assert whole.resumed_from == 0 and not (tmp_path / "whole" / CHECKPOINT_NAME).exists()

    with pytest.raises(KeyboardInterrupt):
        train_tiny(cfg, tmp_path / "cut", progress=_stop_at(8), checkpoint_every=5)
    assert (tmp_path / "cut" / CHECKPOINT_NAME).is_file()
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # no half-trained model passes as done
    resumed = train_tiny(cfg, tmp_path / "cut", checkpoint_every=5)

    assert resumed.resumed_from == 5 and resumed.steps_done == 12
    wa = load_file(tmp_path / "whole" / "model.safetensors")
    wb = load_file(tmp_path / "cut" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = (json.loads((tmp_path / d / "training.json").read_text()) for d in ("whole", "cut"))
    assert ra["loss_curve"] == rb["loss_curve"]  # one entry at step 12, its window spanning the resume
    assert rb["resumed_from_step"] == 5 and "resumed_from_step" not in ra
    assert not (tmp_path / "cut" / CHECKPOINT_NAME).exists()


def test_a_checkpoint_of_another_recipe_or_a_damaged_one_is_refused_and_kept(tmp_path):
    cfg = TinyTrainConfig(**{**SMALL, "steps": 12})
    with pytest.raises(KeyboardInterrupt):
        train_tiny(cfg, tmp_path / "m", progress=_stop_at(6), checkpoint_every=5)
    checkpoint = tmp_path / "m" / CHECKPOINT_NAME
    saved = checkpoint.read_bytes()
    with pytest.raises(ConfigError, match=r"another recipe \(differs in seed, lr\)"):
        train_tiny(TinyTrainConfig(**{**SMALL, "steps": 12, "seed": 1, "lr": 3e-3}), tmp_path / "m")
    assert checkpoint.read_bytes() == saved

    checkpoint.write_bytes(saved[: len(saved) // 2])
    with pytest.raises(InputError, match="not a readable training checkpoint.*delete it"):
        train_tiny(cfg, tmp_path / "m")


def test_a_run_stopped_by_its_time_cap_writes_a_model_and_a_rerun_trains_on(tmp_path):
    cfg = TinyTrainConfig(**{**SMALL, "steps": 6})
    capped = train_tiny(TinyTrainConfig(**{**SMALL, "steps": 6, "max_minutes": 1e-12}), tmp_path / "m")
    assert capped.steps_done == 0 and (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / CHECKPOINT_NAME).is_file()
    on = train_tiny(cfg, tmp_path / "m")  # the cap is when to stop, not what to train: resumes
    whole = train_tiny(cfg, tmp_path / "whole")
    assert on.steps_done == 6 and on.final_loss == whole.final_loss
    wa, wb = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "whole" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
