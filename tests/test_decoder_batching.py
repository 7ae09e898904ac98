"""Batch invariance of the step-level-batched decoder on the tiny dLLM (float32, CPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dwise_predict.collectors.backends.tiny import TinyBackend, load_tiny_backend
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.dllm import TINY_MODEL_DIR, TinyDllmConfig, TinyDllmForBlockDiffusion

N_REQUESTS = 96


@pytest.fixture(scope="module")
def backend_and_requests():
    torch.set_num_threads(1)
    if (TINY_MODEL_DIR / "config.json").is_file():
        from dwise_predict.dllm.corpus import CATEGORIES, generate_examples

        backend = load_tiny_backend()
        tok = backend.tokenizer
        prompts = [e.prompt for c in CATEGORIES for e in generate_examples(c, N_REQUESTS // len(CATEGORIES), seed=7)]
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for p in prompts]
        budget = 64
    else:  # before the weights ship: a random model with a sharpened head so confidences spread
        torch.manual_seed(0)
        model = TinyDllmForBlockDiffusion(TinyDllmConfig(vocab_size=300, max_position_embeddings=256))
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)
        backend = TinyBackend(model)
        rng = random.Random(0)
        ids = [[rng.randrange(8, 300) for _ in range(rng.randrange(2, 70))] for _ in range(N_REQUESTS)]
        budget = 32
    rng = random.Random(1)
    requests = [DecodeRequest(f"r{i}", p, budget=rng.choice([budget // 2, budget])) for i, p in enumerate(ids)]
    return backend, requests


def run(backend, requests, batch_size):
    cfg = DecodingConfig(algorithm_config={"threshold": 0.9}, batch_size=batch_size)
    return {r.request_id: r for r in decode(backend, requests, cfg)}


def test_b1_and_b16_agree(backend_and_requests):
    backend, requests = backend_and_requests
    single, batched = run(backend, requests, 1), run(backend, requests, 16)
    assert set(single) == set(batched) == {r.request_id for r in requests}
    same = [single[k].rounds_per_block == batched[k].rounds_per_block
            and single[k].output_ids == batched[k].output_ids for k in single]
    assert sum(same) == len(same), f"{len(same) - sum(same)} of {len(same)} requests differ"
    for k in single:
        a, b = single[k], batched[k]
        assert a.finish == b.finish and a.prompt_blocks == b.prompt_blocks
        np.testing.assert_allclose(a.first_round_hidden, b.first_round_hidden, atol=1e-4)
        np.testing.assert_allclose(a.prompt_last_hidden, b.prompt_last_hidden, atol=1e-4)
        assert a.mean_confidence == pytest.approx(b.mean_confidence, abs=1e-5)
        assert a.end_probability == pytest.approx(b.end_probability, abs=1e-5)
        assert a.frac_over_threshold == b.frac_over_threshold
    rounds = [r.total_rounds for r in single.values()]
    assert len(set(rounds)) > 3, "rounds do not vary: the test would not notice a decoding change"
    # slots were refilled: 96 requests through 16 slots, later admissions mid-run
    admits = sorted(r.extra["admit_round"] for r in batched.values())
    assert admits[16] > 0 and len(set(admits)) > 3


def early_signals(result) -> tuple:
    return result.frac_over_threshold, result.mean_confidence, result.mean_entropy, result.end_probability


def test_first_rounds_computed_early_at_the_cap_keep_their_bits(backend_and_requests, monkeypatch):
    # the early signals and pooled rows of first rounds wait for a finish, or for the cap on how many
    # wait (each holds its block's logits): computed at every round instead, every bit is the same
    from dwise_predict.collectors import decoder

    backend, requests = backend_and_requests
    waited = run(backend, requests[:32], 16)
    monkeypatch.setattr(decoder, "MAX_PENDING_FIRST_ROUNDS", 1)
    capped = run(backend, requests[:32], 16)
    assert set(waited) == set(capped) and len(capped) == 32
    for k in waited:
        assert early_signals(waited[k]) == early_signals(capped[k])
        assert waited[k].first_round_hidden.tobytes() == capped[k].first_round_hidden.tobytes()
