"""The shipped tiny dLLM denoises for real: round counts vary across and inside categories for content
reasons, and answers on the deterministic categories are right far above chance.

Decodes 8 x 40 generated prompts (corpus seed 7, disjoint from the training stream) with the
package's own decoder at its defaults (SGLang's LowConfidence, threshold 0.95), block size 8, batch 48. Run with ``-s`` to see
the per-category table (rounds p10/p50/p90, accuracy).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from dwise_predict.dllm import TINY_MODEL_DIR
from dwise_predict.dllm.corpus import (
    CATEGORIES,
    check_answer,
    generate_examples,
    vocabulary,
)

N_PER_CATEGORY = 40
SEED = 7

# Accuracy the shipped weights reach (seed-7 prompts, 12,500-step recipe on the engine's block grid,
# SGLang's LowConfidence at 0.95, measured 2026-11-30): code 0.85, mcq 0.53 (chance 0.25), instruction
# 0.53, math 0.35 (a two-digit answer: chance ~0.01), multilingual_math 0.03, hard_mcq 0.23 (chance
# 0.20), long_context 0.00. The bars below pin what holds, a few requests under the measured figure;
# the known gaps are strict xfails.
REQUIRED = {"code": 0.7, "mcq": 0.45, "instruction": 0.4, "math": 0.25}
KNOWN_GAPS = {"hard_mcq": 0.4, "long_context": 0.25}  # 2x chance for 5 options; any real retrieval


def test_shipped_weights_are_small_and_complete():
    files = {p.name: p.stat().st_size for p in TINY_MODEL_DIR.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "training.json"):
        assert name in files, name
    assert sum(files.values()) <= 20 * 2**20


def test_shipped_tokenizer_covers_the_corpus():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    vocab = tok.get_vocab()
    assert all(w in vocab for w in vocabulary())
    assert tok.mask_token is not None and tok.eos_token is not None


@pytest.fixture(scope="module")
def decoded():
    """One row per request: category, total rounds, correct (None for chat), the prompt's count."""
    from dwise_predict.collectors.backends.tiny import load_tiny_backend
    from dwise_predict.collectors.decoder import decode
    from dwise_predict.collectors.records import DecodeRequest, DecodingConfig

    backend = load_tiny_backend()
    tok = backend.tokenizer
    examples, requests = {}, []
    for c in CATEGORIES:
        for i, e in enumerate(generate_examples(c, N_PER_CATEGORY, seed=SEED)):
            rid = f"{c}-{i}"
            examples[rid] = e
            ids = tok.apply_chat_template([{"role": "user", "content": e.prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            requests.append(DecodeRequest(rid, list(ids), budget=128))
    rows = []
    for r in decode(backend, requests, DecodingConfig(batch_size=48, budget=128)):
        e = examples[r.request_id]
        rows.append({"category": e.category, "rounds": r.total_rounds, "count": e.meta["count"],
                     "correct": check_answer(e, tok.decode(r.output_ids)), "finish": r.finish})
    _print_table(rows)
    return rows


def _by_category(rows, key):
    out: dict[str, list] = {c: [] for c in CATEGORIES}
    for row in rows:
        out[row["category"]].append(row[key])
    return out


def _print_table(rows) -> None:
    rounds, correct = _by_category(rows, "rounds"), _by_category(rows, "correct")
    print("\ncategory            rounds p10  p50  p90  accuracy")
    for c in CATEGORIES:
        p10, p50, p90 = np.percentile(rounds[c], [10, 50, 90])
        checks = [x for x in correct[c] if x is not None]
        acc = f"{np.mean(checks):.2f}" if checks else "n/a"
        print(f"{c:20s}       {p10:4.0f} {p50:4.0f} {p90:4.0f}  {acc}")
    allr = [row["rounds"] for row in rows]
    print(f"overall p90/p10 = {np.percentile(allr, 90) / np.percentile(allr, 10):.1f}")


def test_total_rounds_spread_overall(decoded):
    rounds = np.array([row["rounds"] for row in decoded])
    assert np.percentile(rounds, 90) / np.percentile(rounds, 10) >= 4
    assert all(row["finish"] == "eos" for row in decoded)


def test_no_category_has_constant_rounds_and_medians_differ(decoded):
    rounds = _by_category(decoded, "rounds")
    for c, values in rounds.items():
        assert len(set(values)) >= 3, (c, sorted(set(values)))
    medians = [float(np.median(v)) for v in rounds.values()]
    assert len(set(medians)) >= 4 and max(medians) >= 3 * min(medians)


def test_rounds_follow_the_work_the_prompt_asks_for(decoded):
    """Inside a category, more requested work (the count the prompt states) means more rounds."""
    rounds, counts = _by_category(decoded, "rounds"), _by_category(decoded, "count")
    for c in ("math", "multilingual_math", "hard_mcq", "long_context"):
        rho = spearmanr(counts[c], rounds[c])[0]
        assert rho > 0.3, (c, rho)


def test_instruction_rounds_do_not_follow_its_output_length(decoded):
    """Instruction prompts ask for a run of consecutive numbers: the longer runs come out longer but
    are filled many positions per step, so rounds barely follow the requested count (measured ρ 0.11
    against 0.33 for output tokens). Output length misorders work here (the DWISE paper, Table 12)."""
    rounds, counts = _by_category(decoded, "rounds"), _by_category(decoded, "count")
    assert abs(spearmanr(counts["instruction"], rounds["instruction"])[0]) < 0.3


def test_accuracy_on_deterministic_categories_is_far_above_chance(decoded):
    correct = _by_category(decoded, "correct")
    assert all(x is None for x in correct["chat"])
    for c, need in REQUIRED.items():
        acc = float(np.mean([bool(x) for x in correct[c]]))
        assert acc >= need, (c, acc)


@pytest.mark.parametrize("category", sorted(KNOWN_GAPS))
@pytest.mark.xfail(strict=True, reason="known gap of the shipped weights: hard MCQ near chance (0.23 vs "
                   "0.20) and no multi-needle retrieval (0.00) within the 20-minute CPU recipe")
def test_known_gaps_hard_mcq_and_long_context(decoded, category):
    correct = _by_category(decoded, "correct")
    assert float(np.mean([bool(x) for x in correct[category]])) >= KNOWN_GAPS[category]
