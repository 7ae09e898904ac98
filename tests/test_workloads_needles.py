"""The synthetic multi-needle long-context generator: deterministic, answers present, length on target."""

import json
import re

import pytest

from dwise_predict.collectors.needles import (
    WORDS_PER_TOKEN,
    generate_needle_prompts,
    score_needles,
    target_words,
)
from dwise_predict.errors import InputError


def test_same_seed_same_prompts_and_other_seed_differs():
    a = generate_needle_prompts(5, seed=3, words=400)
    b = generate_needle_prompts(5, seed=3, words=400)
    c = generate_needle_prompts(5, seed=4, words=400)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.answers for p in a] == [p.answers for p in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, c))


def test_every_needle_hidden_once_and_every_key_queried():
    prompts = generate_needle_prompts(40, seed=0, words=300)
    counts = {len(p.keys) for p in prompts}
    assert counts == {2, 3, 4}  # 2–4 needles, each count drawn
    for p in prompts:
        document, question = p.prompt.rsplit("\n\n", 1)
        assert question.startswith("Question:")
        for key, answer in zip(p.keys, p.answers):
            assert document.count(f"The special magic number for {key} is {answer}.") == 1
            assert p.prompt.count(key) == 2  # once in its needle, once in the question
            assert key in question
        # Distractors carry no digits: the only numbers are the needles' answers.
        assert sorted(re.findall(r"\d+", document)) == sorted(p.answers)
        assert json.loads(p.reference) == list(p.answers)
        assert all(0.0 <= d <= 1.0 for d in p.depths)


def test_prompt_length_hits_the_target_in_words_and_tokens():
    prompts = generate_needle_prompts(10, seed=1, words=2000, jitter=0.0)
    for p in prompts:
        assert 2000 <= p.words <= 2000 + 30  # at most one distractor sentence over
        assert p.words == len(p.prompt.split())
    assert target_words(target_tokens=10_000) == round(10_000 * WORDS_PER_TOKEN) == 7500
    jittered = [p.words for p in generate_needle_prompts(30, seed=2, words=1000, jitter=0.2)]
    assert 800 <= min(jittered) < 950 and 1050 < max(jittered) <= 1230  # spread, inside ±20 %


def test_score_needles_counts_whole_numbers_only():
    ref = json.dumps(["1234567", "7654321", "1111111"])
    assert score_needles(ref, "a: 1234567\nb: 7654321\nc: 1111111") == 1.0
    assert score_needles(ref, "a: 1234567 b: 76543210") == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of target_words or target_tokens"),
        ({"target_words": 100, "target_tokens": 100}, "exactly one"),
        ({"target_words": 40}, "at least 150 words"),
    ],
)
def test_bad_lengths(kwargs, message):
    with pytest.raises(InputError, match=message):
        target_words(**kwargs)


def test_bad_needle_range():
    with pytest.raises(InputError, match="min_needles"):
        generate_needle_prompts(1, seed=0, words=300, min_needles=3, max_needles=5)
