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
    block_size, mask_token_id, eos_token_ids, pad_token_id = BS, MASK, (EOS,), PAD
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
    """Positions unmasked before each denoising forward of each output block, read from the inputs
    seen. A block starts at the request's first denoising row or at a row carrying a commit."""
    blocks, prev = [], None
    for call in backend.calls:
        for row in call["rows"]:
            if row["slot"] != slot or row["prefill"]:
                continue
            masked = [p for p, t in enumerate(row["block"]) if t == MASK]
            if prev is None or row["commit"]:
                blocks.append([])
            else:
                blocks[-1].append(sorted(set(prev) - set(masked)))
            prev = masked
    return blocks


CONF = [0.95, 0.5, 0.92, 0.3, 0.99, 0.1, 0.6, 0.91]


def config(threshold, batch_size=1, algorithm="LowConfidence"):
    return DecodingConfig(algorithm=algorithm, algorithm_config={"threshold": threshold}, batch_size=batch_size)


def test_low_confidence_rule_leftover_prompt_and_the_forward_that_persists_a_block():
    tokens = [[3 + p for p in range(BS)]] * 4
    be = ScriptedBackend([CONF] * 4, tokens)
    # 10 prompt tokens: one full prompt block; tokens 11, 12 open the first output block under the prompt mask
    (res,) = decode(be, [DecodeRequest("a", list(range(3, 13)), budget=16)], config(0.9))
    assert res.prompt_tokens == 10 and res.prompt_blocks == 1
    # block 1: positions 2..7 masked; above 0.9 (strictly): 2, 4, 7; then one per step, most confident
    # first: 6, 3, 5; the fifth forward sees no mask and says done: 4 steps cost 5 forwards
    order = unmask_order(be)
    assert order[0] == [[2, 4, 7], [6], [3], [5]]
    assert order[1] == [[0, 2, 4, 7], [6], [1], [3], [5]]
    assert res.rounds_per_block == [5, 6, 6]
    # block 1 emits its 6 output positions, then 8 + 8 until the budget of 16 is reached and cut
    assert res.output_ids == (tokens[0][2:] + tokens[0] + tokens[0])[:16] and res.finish == "budget"
    # one prefill round, then every denoising forward; finished blocks ride along (no extra round)
    assert len(be.calls) == res.prompt_blocks + res.total_rounds == 18
    carried = [row for call in be.calls for row in call["rows"] if row["commit"] == BS and not row["prefill"]]
    assert len(carried) == 2
    # early signals of the first denoising forward over its 6 masked positions
    assert res.frac_over_threshold == pytest.approx(3 / 6)
    assert res.mean_confidence == pytest.approx(np.mean(CONF[2:]), abs=1e-6)
    ent = [-(c * math.log(c) + (1 - c) * math.log((1 - c) / (V - 2))) for c in CONF[2:]]
    assert res.mean_entropy == pytest.approx(np.mean(ent), abs=1e-4)
    # EOS is never the top token here: each masked position gives it (1 - c) / (V - 2)
    no_end = np.prod([1 - (1 - c) / (V - 2) for c in CONF[2:]])
    assert res.end_probability == pytest.approx(1 - no_end, abs=1e-5)
    assert np.all(res.first_round_hidden == 1.0) and np.all(res.prompt_last_hidden == -1.0)


def test_nothing_over_threshold_fills_one_per_step():
    be = ScriptedBackend([CONF] * 2, [[3] * BS] * 2)
    (res,) = decode(be, [DecodeRequest("a", [3, 4, 5], budget=8)], config(1.0))
    # a prompt shorter than a block: no prefill; its 3 tokens lead the first output block
    assert res.prompt_blocks == 0 and len(be.calls) == res.total_rounds
    assert unmask_order(be)[0] == [[4], [7], [6], [3], [5]]  # by confidence
    assert res.rounds_per_block == [6, BS + 1]  # 5 + 3 = 8 tokens reach the budget after block 2
    assert res.output_ids == [3] * 8 and res.frac_over_threshold == 0.0
    assert np.all(res.prompt_last_hidden == 1.0)  # the leftover prompt rows of the first forward


def test_eos_block_ends_generation_and_output_stops_before_eos():
    tokens = [[3] * BS, [4, 4, 4, EOS, 5, 5, 5, 5], [6] * BS]
    be = ScriptedBackend([[0.99] * BS] * 3, tokens)
    (res,) = decode(be, [DecodeRequest("a", [3] * 8, budget=64)], config(0.9))
    assert res.finish == "eos"
    assert res.rounds_per_block == [2, 2]  # one step fills the block, one more forward persists it
    assert res.output_ids == [3] * BS + [4, 4, 4]
    assert len(be.calls) == 1 + 4


def test_budget_counts_the_first_blocks_leftover_prompt():
    be = ScriptedBackend([[0.99] * BS] * 4, [[3] * BS] * 4)
    (res,) = decode(be, [DecodeRequest("a", [3] * 5, budget=20)], config(0.9))
    assert res.finish == "budget"
    assert res.rounds_per_block == [2, 2, 2, 2]  # 3 + 8 + 8 = 19 < 20: a fourth block
    assert res.output_tokens == 20


def test_joint_threshold_edits_and_finishes_when_nothing_changes():
    # position 0's top-1 is token 4 while it is masked, token 3 once it holds a token: one edit
    class Flip(ScriptedBackend):
        def step(self, batch):
            out = super().step(batch)
            for r in range(len(batch.slots)):
                start = int(batch.out_start[r])
                if int(batch.input_ids[r, start]) != MASK:
                    out.logits[r, 0] = out.logits[r, 0, [0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11]]
            return out

    tokens = [[4] + [3] * (BS - 1)] * 2
    be = Flip([[0.99] * BS] * 2, tokens)
    (res,) = decode(be, [DecodeRequest("a", [3] * 8, budget=8)], config(0.5, algorithm="JointThreshold"))
    # forward 1: fill all (position 0 gets 4); forward 2: edit 4 -> 3; forward 3: nothing changes, done
    assert res.rounds_per_block == [3] and res.output_ids == [3] * BS


def test_batched_rounds_equal_single_and_slots_refill():
    reqs = [DecodeRequest(f"r{i}", [3] * (1 + 5 * i), budget=8 * (1 + i % 3)) for i in range(6)]
    singles = {}
    for r in reqs:
        (res,) = decode(ScriptedBackend([CONF] * 4, [[3] * BS] * 4), [r], config(0.9))
        singles[r.request_id] = res
    be = ScriptedBackend([CONF] * 4, [[3] * BS] * 4)
    batched = {res.request_id: res for res in decode(be, reqs, config(0.9, batch_size=2))}
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
    cfg = config(0.9, batch_size=2)
    with pytest.raises(InputError, match="no requests"):
        decode(be, [], cfg)
    with pytest.raises(InputError, match="context of 256 tokens"):
        decode(be, [DecodeRequest("long", [3] * 250, budget=16)], cfg)
    with pytest.raises(InputError, match="empty prompt"):
        decode(be, [DecodeRequest("e", [], budget=16)], cfg)
    with pytest.raises(InputError, match="duplicate request id"):
        decode(be, [DecodeRequest("d", [3], budget=8), DecodeRequest("d", [4], budget=8)], cfg)
    with pytest.raises(ConfigError, match="declares delete_token_id and split_token_id") as err:
        decode(be, [DecodeRequest("a", [3], budget=8)], DecodingConfig(algorithm="JointThresholdInDel"))
    assert "\n" not in str(err.value)
    bad = [({"algorithm_config": {"threshold": 1.5}}, "threshold must be a number in"),
           ({"algorithm_config": {"edit_threshold": 0.1}}, "LowConfidence has no parameter edit_threshold"),
           ({"algorithm": "LowConfidance"}, "unknown algorithm 'LowConfidance'"),
           ({"algorithm": "Gemma4Renoise"}, "separate context-encoding pass"),
           ({"algorithm": "JointThreshold", "algorithm_config": {"max_post_edit_steps": -1}}, "integer >= 0"),
           ({"block_size": 0}, "`block_size`"), ({"block_size": -4}, "`block_size`")]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message) as err:
            DecodingConfig(**kwargs)
        assert "\n" not in str(err.value)
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
