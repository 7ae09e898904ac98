"""D2F, our pipeline decoding (engine.d2f, collectors.d2f): hand-computed rounds on a scripted model,
Amin et al.'s tier arithmetic, the tiny dLLM's block-causal pipeline rows, the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dwise_predict.collectors.backends.base import StepBatch, StepOutput
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.engine.algorithms import comparable_decoding, make_rule
from dwise_predict.errors import BundleError, ConfigError

PAD, MASK, EOS = 0, 1, 2


class PipelineBackend:
    """Output block k, position p: top-1 token ``tokens[k][p]`` with probability ``conf[k][p]`` (the
    rest spread over the other non-mask tokens), whatever the input. Reads D2F's rows (``block_len``):
    ``[committed blocks | blocks in flight]``, and records each denoising row's blocks as it saw them."""

    name = "pipeline"
    mask_token_id, eos_token_ids, pad_token_id, tokenizer = MASK, (EOS,), PAD, None
    hidden_size, max_context = 4, 4096
    device = torch.device("cpu")

    def __init__(self, block, conf, tokens, vocab=64):
        self.block_size, self.conf, self.tokens, self.vocab_size = block, conf, tokens, vocab
        self.rows: list[dict] = []
        self.prefills: list[int] = []

    def fingerprint(self):
        return {"name": self.name}

    def allocate(self, n_slots):
        self.committed = 0

    def reset_slot(self, slot):
        self.committed = 0

    def step(self, batch: StepBatch) -> StepOutput:
        assert len(batch.slots) == 1 and batch.block_len == self.block_size
        n, commit, window = int(batch.n_valid[0]), int(batch.commit_len[0]), batch.window
        logits = torch.zeros(1, window, self.vocab_size)
        if commit == n:  # a prefill row: the prompt
            self.prefills.append(n)
            return StepOutput(logits=logits, hidden=torch.full((1, window, 4), -1.0))
        B = self.block_size
        self.rows.append({"commit": commit // B, "first": self.committed,
                          "blocks": batch.input_ids[0, :n].view(-1, B).tolist()})
        self.committed += commit // B
        for j in range(n // B - commit // B):
            k = self.committed + j
            for p in range(B):
                c = self.conf[k][p]
                probs = torch.full((self.vocab_size,), (1 - c) / (self.vocab_size - 2))
                probs[MASK] = 1e-9
                probs[self.tokens[k][p]] = c
                logits[0, j * B + p] = probs.log()
        hidden = torch.arange(window, dtype=torch.float32)[None, :, None].expand(1, window, 4).clone()
        return StepOutput(logits=logits, hidden=hidden)


def d2f(**params):
    return DecodingConfig(algorithm="D2F", algorithm_config=params)


def unmasked_per_round(backend):
    """For each denoising row after the first: the (block, position) pairs unmasked by the round before
    (a block finished then rides in this row's committed part)."""
    seen, out = {}, []
    for row in backend.rows:
        now = {row["first"] + j: {p for p, t in enumerate(b) if t == MASK} for j, b in enumerate(row["blocks"])}
        out.append(sorted((k, p) for k, masked in seen.items() if k in now for p in masked - now[k]))
        seen = now
    return out[1:]


def test_a_pipeline_of_three_blocks_by_hand():
    """B = 4, τ_add 0.25 (one position), τ_decode 0.75 (three), confidence threshold 0.9 (module doc of
    engine.d2f). Round 1: block 0 alone unmasks its 0.95. Round 2: block 1 joins (block 0 at 1/4); block 0
    takes its best (0.6), block 1, not activated, takes only its 0.97. Round 3: block 2 joins; block 0 takes
    0.5, block 1 waits, block 2 takes its 0.99, the EOS: no block joins again. Round 4: three blocks in
    flight; block 0 ends (0.4), block 1, activated by block 0's 3/4, takes 0.3. Round 5: block 0 committed in
    the forward; block 1 takes 0.2. Round 6: block 1 ends (0.1) and block 2, activated, takes position 0 (a
    tie, the first). Round 7: block 1 committed; rounds 7 and 8 fill block 2. Eight rounds."""
    conf = [[0.95, 0.5, 0.6, 0.4], [0.3, 0.97, 0.2, 0.1], [0.2, 0.2, 0.2, 0.99]]
    tokens = [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, EOS]]
    be = PipelineBackend(4, conf, tokens)
    (res,) = decode(be, [DecodeRequest("a", [3, 4, 5, 6, 7, 8], budget=16)],
                    d2f(add_threshold=0.25, decode_threshold=0.75, confidence_threshold=0.9))
    assert unmasked_per_round(be) == [[(0, 0)], [(0, 2), (1, 1)], [(0, 1), (2, 3)], [(0, 3), (1, 0)], [(1, 2)],
                                      [(1, 3), (2, 0)], [(2, 1)]]
    assert [len(r["blocks"]) - r["commit"] for r in be.rows] == [1, 2, 3, 3, 2, 2, 1, 1]  # in flight per forward
    assert [r["commit"] for r in be.rows] == [0, 0, 0, 0, 1, 0, 1, 0]  # finished blocks ride along once
    assert be.prefills == [4, 2]  # 6 prompt tokens: one block and a short one, then the output blocks
    assert res.prompt_blocks == 2 and res.total_rounds == 8
    assert res.rounds_per_block == [1, 1, 6]  # each round to the newest block: the block-start spacing
    assert res.extra["pipeline_depth"] == 3
    assert res.output_ids == tokens[0] + tokens[1] + tokens[2][:3] and res.finish == "eos"
    # the first round: block 0's four masked positions; one above τ_decode 0.75; its four rows pooled
    assert res.frac_over_threshold == pytest.approx(0.25)
    assert res.mean_confidence == pytest.approx(np.mean(conf[0]), abs=1e-6)
    assert res.first_round_hidden == pytest.approx(np.full(4, 1.5))  # rows 0..3 of the window
    assert res.prompt_last_hidden == pytest.approx(np.full(4, -1.0))


@pytest.mark.parametrize("blocks", [1, 2, 6, 16])
def test_amin_et_al_tiers_are_29n_plus_3_forwards_at_blocks_of_32(blocks):
    """Amin et al.'s setting (τ_add 0.5, τ_decode 0.9, confidence threshold 1.0: one position per round per
    activated block), blocks of 32, a 512-token budget: n blocks take 29 (n - 1) + 32 forwards, their
    178 + 29k loop iterations less one. The EOS is each request's most confident position of block n - 1,
    so no block joins after it; at n = 16 there is none and the budget ends the request."""
    B, n_max = 32, 16
    rng = np.random.default_rng(blocks)
    conf = [list(0.2 + 0.7 * rng.permutation(B) / B) for _ in range(n_max)]
    tokens = [[10 + (p % 40) for p in range(B)] for _ in range(n_max)]
    if blocks < n_max:
        tokens[blocks - 1][int(np.argmax(conf[blocks - 1]))] = EOS
    be = PipelineBackend(B, conf, tokens)
    (res,) = decode(be, [DecodeRequest("a", list(range(3, 40)), budget=512)], d2f())
    assert res.total_rounds == 29 * (blocks - 1) + 32 == 29 * blocks + 3
    assert len(res.rounds_per_block) == blocks
    assert res.rounds_per_block[1:-1] == [29] * (blocks - 2)  # the tier step between block starts
    assert res.extra["pipeline_depth"] == min(blocks, 2)
    assert res.finish == ("budget" if blocks == n_max else "eos")
    assert res.output_tokens == (512 if blocks == n_max else B * (blocks - 1) + int(np.argmax(conf[blocks - 1])))


def test_rule_parameters_are_checked_and_bundles_refused():
    rule = make_rule("D2F", MASK)
    assert rule.params == {"add_threshold": 0.5, "decode_threshold": 0.9, "confidence_threshold": 1.0}
    for bad in ({"add_threshold": 0}, {"add_threshold": 1.5}, {"decode_threshold": 0.0},
                {"confidence_threshold": -0.1}, {"add_threshold": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_rule("D2F", MASK, bad)
    with pytest.raises(ConfigError, match="D2F has no parameter threshold"):
        DecodingConfig(algorithm="D2F", algorithm_config={"threshold": 0.9})
    with pytest.raises(ConfigError, match="`rounds_hidden` does not fit D2F"):
        list(decode(PipelineBackend(4, [], []), [DecodeRequest("a", [3], 4)], d2f(), rounds_hidden=2))
    # SGLang serves no D2F: a bundle trained on its traces matches no server (serve, plugin, hook, follow)
    with pytest.raises(BundleError, match="trained on D2F traces.*SGLang 0.5.23 does not serve"):
        comparable_decoding("D2F", {"algorithm": "D2F", "algorithm_config": {}, "block_size": 8})
    from types import SimpleNamespace

    from dwise_predict.bundles.manifest import BundleIdentity
    from dwise_predict.serving.launcher import check_served_algorithm

    trained = BundleIdentity.of({"decoding": {"algorithm": "D2F", "algorithm_config": {}, "block_size": 8}})
    with pytest.raises(BundleError, match="trained on D2F traces"):  # before SGLang starts, whatever it runs
        check_served_algorithm(trained, "bundle/", SimpleNamespace())
    from dwise_predict.evaluation.characterize import D2F_ALGORITHM

    assert D2F_ALGORITHM == rule.name  # the name characterize looks for


@pytest.fixture(scope="module")
def tiny():
    from dwise_predict.collectors.backends.tiny import load_tiny_backend

    torch.set_num_threads(1)
    return load_tiny_backend()


def test_tiny_pipeline_rows_are_block_causal(tiny):
    """A row of three blocks (block_len 8): block 0's logits do not depend on the blocks after it, block
    1's do on block 0, and the logits of [A | B] equal those of A and B's rows in [A | B | C]."""
    model, B = tiny.model, tiny.block_size
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 600, (B,), generator=gen) for _ in range(3))

    def logits(*blocks, prompt=torch.arange(3, 3 + 2 * B)):
        cache = model.allocate_cache(1, 256)
        one = torch.ones(1, dtype=torch.long)
        model.forward_step(cache, torch.zeros(1, dtype=torch.long), prompt[None], one * len(prompt),
                           one * len(prompt), one * 0, block_len=B)
        row = torch.cat(blocks)[None]
        return model.forward_step(cache, torch.zeros(1, dtype=torch.long), row, one * row.shape[1], one * 0,
                                  one * 0, window=row.shape[1], block_len=B)[0][0]

    three, two = logits(a, b, c), logits(a, b)
    torch.testing.assert_close(three[:2 * B], two, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(a)[:B], two[:B], rtol=0, atol=1e-5)
    assert (logits(c, b)[B:] - two[B:]).abs().max() > 1e-3  # block 1 sees the block before it


def test_tiny_d2f_is_deterministic_and_on_tiers(tiny):
    """The tiny dLLM (blocks of 8) under D2F's defaults: τ_decode 0.9 needs all 8 positions of a block
    before the next activates, one position per round, so every request takes 8n rounds."""
    from dwise_predict.dllm.corpus import CATEGORIES, generate_examples

    tok = tiny.tokenizer
    prompts = [e.prompt for c in CATEGORIES for e in generate_examples(c, 1, seed=3)]
    requests = [DecodeRequest(f"r{i}", tok.apply_chat_template([{"role": "user", "content": p}],
                                                               add_generation_prompt=True, tokenize=True,
                                                               return_dict=False), budget=64)
                for i, p in enumerate(prompts)]
    first, again = (list(decode(tiny, requests, d2f())) for _ in range(2))
    for a, b in zip(first, again):
        assert (a.rounds_per_block, a.output_ids, a.finish) == (b.rounds_per_block, b.output_ids, b.finish)
        np.testing.assert_array_equal(a.first_round_hidden, b.first_round_hidden)
        assert a.total_rounds == 8 * len(a.rounds_per_block) and a.prompt_blocks == -(-a.prompt_tokens // 8)
        assert a.extra["pipeline_depth"] <= 2
    assert len({r.total_rounds for r in first}) > 1


def test_cli_collect_d2f_and_base_then_characterize(tmp_path, capsys):
    """`collect --algorithm D2F` and the base (LowConfidence, one at a time) on the same 8 prompts of the
    shipped tiny dLLM, then `characterize --split-decodings`: contract 1 holds, D2F's rounds sit on
    8n, and the report carries Amin et al.'s D2F-against-base table."""
    from dwise_predict.cli import main
    from dwise_predict.traces import load_traces

    flags = ["--limit", "8", "--budget", "64"]
    d2f_dir, base_dir, out = tmp_path / "d2f", tmp_path / "base", tmp_path / "char"
    assert main(["collect", "--algorithm", "D2F", "--out", str(d2f_dir), *flags]) == 0
    assert main(["collect", "--batch-size", "1", "--out", str(base_dir), *flags]) == 0
    d2f_traces, base_traces = load_traces(d2f_dir), load_traces(base_dir)
    decoding = d2f_traces.manifest["decoding"]
    assert decoding["algorithm"] == "D2F" and decoding["batch_size"] == 1
    assert decoding["algorithm_config"] == {"add_threshold": 0.5, "decode_threshold": 0.9, "confidence_threshold": 1.0}
    req = d2f_traces.requests
    assert (req["total_rounds"] % 8 == 0).all() and (req["pipeline_depth"] <= 2).all()
    assert (req["prompt_blocks"] == -(-req["prompt_tokens"] // 8)).all()
    assert req["request_id"].tolist() == base_traces.requests["request_id"].tolist()
    capsys.readouterr()
    assert main(["characterize", str(d2f_dir), str(base_dir), "--split-decodings", "--out", str(out)]) == 0
    assert "D2F against base on the same prompts" in capsys.readouterr().out
    [table] = json.loads((out / "characterization.json").read_text())["d2f_vs_base"]
    assert table["matched"] == 8 and table["base"] == "LowConfidence threshold=0.95, block 8"
    ours = table["rows"][0]
    assert ours["rounds"]["cv"] == pytest.approx(np.std(req["total_rounds"]) / np.mean(req["total_rounds"]))
    spacing = ours["discreteness"]["dominant_spacing"]
    assert spacing is None or spacing % 8 == 0  # counts on 8n: any gap between them is a multiple of 8
    assert "## D2F against base" in (out / "characterization.md").read_text()
    # one line for what D2F cannot record
    assert main(["collect", "--algorithm", "D2F", "--rounds-hidden", "2", "--out", str(tmp_path / "x"), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rounds-hidden does not fit D2F" in err[0]


def test_block_loop_sees_d2f_rows_as_blocks_after_the_prompt(tmp_path):
    """Through the generic block loop (a random Llama, blocks of 4, no KV cache), every forward of a D2F
    decode masks the whole sequence as D2F lays it out: 8 prompt tokens in blocks 0 and 1, output block j
    in block 2 + j, whatever a row commits or holds in flight."""
    from collect_helpers import make_masked_llama_dir
    from dwise_predict.collectors.backends import load_backend

    backend = load_backend(str(make_masked_llama_dir(tmp_path / "model")))
    seen, forward = [], backend._forward

    def spy(seqs, blocks, all_layers=False):
        seen.append(list(blocks[0]))
        return forward(seqs, blocks, all_layers)

    backend._forward = spy
    (res,) = decode(backend, [DecodeRequest("a", list(range(10, 18)), budget=16)], d2f(add_threshold=0.25))
    assert len(seen) == res.prompt_blocks + res.total_rounds and res.prompt_blocks == 2
    assert all(blocks == [p // 4 for p in range(len(blocks))] for blocks in seen)
    assert max(len(b) for b in seen) > 8 + 4  # some forward held more than one output block
