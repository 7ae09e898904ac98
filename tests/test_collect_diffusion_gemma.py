"""The real DiffusionGemma architecture (random small config) collected end to end on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collect_helpers import make_diffusion_gemma_dir
from dwise_predict.cli import main
from dwise_predict.collectors.backends import load_backend
from dwise_predict.collectors.backends.diffusion_gemma import request_seed
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.traces import load_traces

FLAGS = ["--limit", "6", "--budget", "24", "--batch-size", "2", "--threshold", "0.05"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_diffusion_gemma_dir(tmp_path_factory.mktemp("dg") / "model")


@pytest.fixture(scope="module")
def traces(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dg_traces") / "traces"
    assert main(["collect", "--model", str(model_dir), *FLAGS, "--out", str(out)]) == 0
    return load_traces(out)


def test_collect_diffusion_gemma_end_to_end(traces):
    req = traces.requests
    assert len(req) == 6 and traces.first_round.shape == (6, 32) and traces.prompt_last.shape == (6, 32)
    assert (req["block_size"] == 8).all() and (req["prompt_blocks"] == np.ceil(req["prompt_tokens"] / 8)).all()
    rounds = req["rounds_per_block"].map(list)
    assert all(1 <= r <= 6 for rs in rounds for r in rs)  # max_denoising_steps = 6
    assert len({r for rs in rounds for r in rs}) > 1, "round counts should vary per canvas"
    # a request decodes ceil(24 / 8) = 3 canvases unless a canvas holds EOS
    assert all(len(rs) == 3 or f == "eos" for rs, f in zip(rounds, req["finish"]))
    # generate()'s own count agrees: tokens_per_forward = valid tokens (the EOS among them, which
    # output_tokens leaves out, as contract 1 counts) / decoder forward passes
    forwards = np.where(req["finish"] == "eos", req["output_tokens"] + 1, 8 * rounds.map(len)) / req["tokens_per_forward"]
    np.testing.assert_allclose(forwards, req["total_rounds"], rtol=1e-5)
    assert ((req["mean_confidence"] > 0) & (req["mean_confidence"] <= 1)).all() and (req["mean_entropy"] > 0).all()
    m = traces.manifest
    assert m["decoding"]["algorithm"] == "transformers-EntropyBoundSampler" and m["decoding"]["block_size"] == 8
    assert m["decoding"]["engine_faithful"] is False
    assert m["decoding"]["params"]["max_denoising_steps"] == 6 and m["model"]["hidden_size"] == 32


def test_backend_captures_the_first_round_and_is_seeded_per_request(model_dir, traces):
    backend = load_backend(str(model_dir))
    row = traces.requests.iloc[0]
    ids = backend.tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    result, = backend.decode_requests([DecodeRequest(row["request_id"], ids, 24)], DecodingConfig(algorithm_config={"threshold": 0.05}))
    assert result.rounds_per_block == list(row["rounds_per_block"])  # same seed, alone instead of in a batch
    np.testing.assert_allclose(result.first_round_hidden, traces.first_round[0], atol=1e-6)

    # the captured first-round hidden state is the decoder's final layer over the first random canvas
    model = backend.model
    prompt = torch.tensor([ids])
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(request_seed(0, row["request_id"]))
        canvas = torch.randint(0, model.config.text_config.vocab_size, (1, 8))  # EntropyBoundSampler.initialize_canvas
        out = model.model(input_ids=prompt, decoder_input_ids=canvas)
    np.testing.assert_allclose(result.first_round_hidden, out.last_hidden_state[0].mean(0).numpy(), atol=1e-5)
    last_block = out.encoder_last_hidden_state[0, (len(ids) - 1) // 8 * 8:]
    np.testing.assert_allclose(result.prompt_last_hidden, last_block.mean(0).numpy(), atol=1e-5)


def test_diffusion_gemma_refuses_another_block_size(model_dir, tmp_path, capsys):
    assert main(["collect", "--model", str(model_dir), *FLAGS, "--block-size", "4", "--out", str(tmp_path / "o")]) == 1
    assert "canvases of 8 tokens" in capsys.readouterr().err


def test_diffusion_gemma_refuses_layers(model_dir, tmp_path, capsys):
    # its own generate loop exposes only the final layer of the first round
    assert main(["collect", "--model", str(model_dir), *FLAGS, "--layers", "0,-1", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--layers" in err and "drop --layers" in err


def test_diffusion_gemma_refuses_rounds_hidden(model_dir, tmp_path, capsys):
    # its own generate loop is watched at the first round only
    out = tmp_path / "o"
    assert main(["collect", "--model", str(model_dir), *FLAGS, "--rounds-hidden", "4", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "drop --rounds-hidden" in err and not out.exists()
