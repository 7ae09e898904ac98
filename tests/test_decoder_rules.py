"""Threshold decoding rules on a hand-built backend whose logits are known exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dwise_predict.collectors.backends.base import BlockBackend, StepBatch, StepOutput
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.errors import ConfigError, InputError, ModelError

V, H, BS = 12, 4, 8
PAD, MASK, EOS = 0, 1, 2


class ScriptedBackend:
    """Output block k, position p: top-1 token ``tokens[k][p]`` with probability ``conf[k][p]``
    (the rest spread evenly over the other non-mask tokens), whatever the input. Records every
    round's rows so a test can see what was unmasked when."""

    name = "scripted"
    block_size, mask_token_id, eos_token_id, pad_token_id = BS, MASK, EOS, PAD
    hidden_size, vocab_size, max_context, tokenizer = H, V, 256, None
    device = torch.device("cpu")

    def __init__(self, conf, tokens):
        self.conf, self.tokens = conf, tokens
        self.calls: list[dict] = []

    def fingerprint(self):
        return {"name": self.name}

    def allocate(self, n_slots):
        self.blocks_done = [0] * n_slots  # output blocks committed per slot
        self.in_output = [False] * n_slots

    def reset_slot(self, slot):
        self.blocks_done[slot], self.in_output[slot] = 0, False

    def step(self, batch: StepBatch) -> StepOutput:
        n = len(batch.slots)
        logits = torch.zeros(n, batch.window, V)
        hidden = torch.zeros(n, batch.window, H)
        rows = []
        for r, s in enumerate(batch.slots.tolist()):
            n_valid, commit = int(batch.n_valid[r]), int(batch.commit_len[r])
            start = int(batch.out_start[r])
            prefill = commit == n_valid
            if not prefill:
                if commit:  # a finished block rides along
                    self.blocks_done[s] += 1
                k = self.blocks_done[s]
                for p in range(BS):
                    c = self.conf[k][p]
                    probs = torch.full((V,), (1 - c) / (V - 2))
                    probs[MASK] = 1e-9
                    probs[self.tokens[k][p]] = c
                    logits[r, p] = probs.log()
                hidden[r] = float(k + 1)
            else:
                hidden[r] = -1.0
            rows.append({"slot": s, "prefill": prefill, "commit": commit,
                         "block": batch.input_ids[r, start:start + BS].tolist()})
        self.calls.append({"rows": rows})
        return StepOutput(logits=logits, hidden=hidden)


def unmask_order(backend, slot=0):
    """Positions unmasked in each denoising round of each block, read from the inputs seen."""
    blocks, prev = [], None
    for call in backend.calls:
        for row in call["rows"]:
            if row["slot"] != slot or row["prefill"]:
                continue
            masked = [p for p, t in enumerate(row["block"]) if t == MASK]
            if len(masked) == BS:
                blocks.append([])
            elif prev is not None:
                blocks[-1].append(sorted(set(prev) - set(masked)))
            prev = masked
    return blocks


CONF = [0.95, 0.5, 0.92, 0.3, 0.99, 0.1, 0.6, 0.91]


def test_threshold_rule_then_single_most_confident_fallback():
    tokens = [[3 + p for p in range(BS)]] * 4
    be = ScriptedBackend([CONF] * 4, tokens)
    (res,) = decode(be, [DecodeRequest("a", list(range(3, 13)), budget=16)],
                    DecodingConfig(threshold=0.9, batch_size=1))
    # round 1: every position >= 0.9; then one per round, most confident first: 6, 1, 3, 5
    assert res.rounds_per_block == [5, 5]
    # the last round's unmasking is seen in the next block's carried commit; check the first block
    order = unmask_order(be)
    assert order[0] == [[0, 2, 4, 7], [6], [1], [3]]
    assert order[1][0] == [0, 2, 4, 7]
    assert res.output_ids == tokens[0] * 2 and res.finish == "budget"
    assert res.prompt_tokens == 10 and res.prompt_blocks == 2
    # rounds: 2 prefill + 10 denoising, the commit of block 1 carried in round 8 (no extra round)
    assert len(be.calls) == res.prompt_blocks + res.total_rounds == 12
    carried = [row for call in be.calls for row in call["rows"] if row["commit"] == BS and not row["prefill"]]
    assert len(carried) == 1
    # early signals of the first denoising round over its 8 masked positions
    assert res.frac_over_threshold == pytest.approx(4 / 8)
    assert res.mean_confidence == pytest.approx(np.mean(CONF), abs=1e-6)
    ent = [-(c * math.log(c) + (1 - c) * math.log((1 - c) / (V - 2))) for c in CONF]
    assert res.mean_entropy == pytest.approx(np.mean(ent), abs=1e-4)
    assert np.all(res.first_round_hidden == 1.0) and np.all(res.prompt_last_hidden == -1.0)


def test_nothing_over_threshold_unmasks_one_per_round():
    be = ScriptedBackend([CONF] * 2, [[3] * BS] * 2)
    (res,) = decode(be, [DecodeRequest("a", [3, 4, 5], budget=8)], DecodingConfig(threshold=1.0, batch_size=1))
    assert res.rounds_per_block == [BS]
    assert unmask_order(be)[0] == [[4], [0], [2], [7], [6], [1], [3]]  # by confidence
    assert res.frac_over_threshold == 0.0


def test_eos_block_ends_generation_and_output_stops_before_eos():
    tokens = [[3] * BS, [4, 4, 4, EOS, 5, 5, 5, 5], [6] * BS]
    be = ScriptedBackend([[0.99] * BS] * 3, tokens)
    (res,) = decode(be, [DecodeRequest("a", [3] * 8, budget=64)], DecodingConfig(threshold=0.9, batch_size=1))
    assert res.finish == "eos"
    assert res.rounds_per_block == [1, 1]
    assert res.output_ids == [3] * BS + [4, 4, 4]
    assert len(be.calls) == 1 + 2


def test_budget_stops_at_the_block_that_reaches_it():
    be = ScriptedBackend([[0.99] * BS] * 4, [[3] * BS] * 4)
    (res,) = decode(be, [DecodeRequest("a", [3] * 5, budget=20)], DecodingConfig(threshold=0.9, batch_size=1))
    assert res.finish == "budget"
    assert res.rounds_per_block == [1, 1, 1]  # ceil(20 / 8) blocks
    assert res.output_tokens == 20


def test_batched_rounds_equal_single_and_slots_refill():
    conf_sets = {0.99: [[0.99] * BS] * 4, 0.5: [CONF] * 4}
    reqs = [DecodeRequest(f"r{i}", [3] * (1 + 5 * i), budget=8 * (1 + i % 3)) for i in range(6)]
    singles = {}
    for r in reqs:
        (res,) = decode(ScriptedBackend(conf_sets[0.5], [[3] * BS] * 4), [r], DecodingConfig(threshold=0.9, batch_size=1))
        singles[r.request_id] = res
    be = ScriptedBackend(conf_sets[0.5], [[3] * BS] * 4)
    batched = {res.request_id: res for res in decode(be, reqs, DecodingConfig(threshold=0.9, batch_size=2))}
    for rid, res in singles.items():
        assert batched[rid].rounds_per_block == res.rounds_per_block
        assert batched[rid].output_ids == res.output_ids
    # 6 requests through 2 slots: later requests were admitted after earlier ones left
    assert sorted(r.extra["admit_round"] for r in batched.values())[2] > 0
    assert len(be.calls) < sum(r.prompt_blocks + r.total_rounds for r in singles.values())
    mixed = [c for c in be.calls if len({row["prefill"] for row in c["rows"]}) == 2]
    assert mixed, "no round mixed a prefill block with a denoising step"


def test_bad_input_is_one_clear_error():
    be = ScriptedBackend([CONF], [[3] * BS])
    cfg = DecodingConfig(threshold=0.9, batch_size=2)
    with pytest.raises(InputError, match="no requests"):
        decode(be, [], cfg)
    with pytest.raises(InputError, match="context of 256 tokens"):
        decode(be, [DecodeRequest("long", [3] * 250, budget=16)], cfg)
    with pytest.raises(InputError, match="empty prompt"):
        decode(be, [DecodeRequest("e", [], budget=16)], cfg)
    with pytest.raises(InputError, match="duplicate request id"):
        decode(be, [DecodeRequest("d", [3], budget=8), DecodeRequest("d", [4], budget=8)], cfg)
    for kwargs in ({"threshold": 0.0}, {"threshold": 1.5}, {"block_size": 0}, {"block_size": -4}):
        with pytest.raises(ConfigError):
            DecodingConfig(**kwargs)
    assert isinstance(be, BlockBackend)


def test_bad_model_directory(tmp_path):
    from dwise_predict.collectors.backends.tiny import load_tiny_backend

    with pytest.raises(ModelError, match="does not exist"):
        load_tiny_backend(tmp_path / "nope")
    with pytest.raises(ModelError, match="no config.json"):
        load_tiny_backend(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelError, match="not a block-diffusion LM"):
        load_tiny_backend(tmp_path)
