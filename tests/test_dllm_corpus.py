"""The tiny dLLM's corpus: determinism, vocabulary closure, answer checking, and work that the
prompt's content (not its length) decides."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dwise_predict.dllm.corpus import (
    CATEGORIES,
    DRILLS,
    Example,
    check_answer,
    generate_examples,
    vocabulary,
)
from dwise_predict.errors import InputError

N = 400


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[Example]]:
    return {c: generate_examples(c, N, seed=3) for c in CATEGORIES}


def test_categories_are_the_eight_of_the_paper_mix():
    assert CATEGORIES == ("chat", "instruction", "code", "math", "multilingual_math", "mcq", "hard_mcq",
                          "long_context")


def test_same_seed_same_examples_and_prefix_stable():
    for c in CATEGORIES:
        a = generate_examples(c, 20, seed=5)
        assert a == generate_examples(c, 20, seed=5)
        assert a[:7] == generate_examples(c, 7, seed=5)
        assert a != generate_examples(c, 20, seed=6)


def test_every_token_is_in_the_vocabulary(corpus):
    vocab = vocabulary()
    assert len(vocab) == len(set(vocab))
    assert 300 <= len(vocab) <= 700
    words = set(vocab)
    for c, examples in corpus.items():
        for e in examples:
            unknown = set((e.prompt + " " + e.answer).split()) - words
            assert not unknown, (c, unknown)


def test_training_drills_are_in_vocabulary_and_answer_from_the_prompt():
    words = set(vocabulary())
    assert not set(DRILLS) & set(CATEGORIES)  # drills are never a served category
    copies = generate_examples("copy", 200, seed=2)
    lookups = generate_examples("option_lookup", 200, seed=2)
    for e in copies + lookups:
        assert not set((e.prompt + " " + e.answer).split()) - words, e
        assert check_answer(e, e.answer) is True
    for e in copies:
        assert e.prompt.split(" : ", 1)[1] == e.answer and len(e.answer.split()) == e.meta["count"]
    assert len({e.meta["count"] for e in copies}) >= 10
    for e in lookups:
        asked = e.prompt.split("\n")[0].split()[-2]  # "question : which option is X ?"
        line = next(row for row in e.prompt.split("\n")[1:] if row.startswith(e.meta["correct"] + " )"))
        assert line == f"{e.meta['correct']} ) {asked}" and e.answer.split()[0] == e.meta["correct"]
    assert {e.meta["correct"] for e in lookups} == set("abcde")


def _key(e: Example):
    """What decides correctness: the option letter, the result, the count of "name N", or the text."""
    if "correct" in e.meta:
        return e.meta["correct"]
    if e.meta.get("template") == "name":
        return e.meta["count"]
    if "result" in e.meta and e.meta["template"] != "down":
        return e.meta["result"]
    return e.answer


def test_reference_answers_pass_and_wrong_ones_fail(corpus):
    for c, examples in corpus.items():
        for e, other in itertools.pairwise(examples[:101]):
            verdict = check_answer(e, e.answer)
            if c == "chat":
                assert verdict is None
                continue
            assert verdict is True, (c, e)
            assert check_answer(e, "") is False
            if _key(other) != _key(e):  # another request's answer is wrong here
                assert check_answer(e, other.answer) is False, (c, e, other)


def test_check_answer_specifics():
    mcq = Example("mcq", "q", "b ) apple", {"correct": "b", "template": "member"})
    assert check_answer(mcq, "b ) apple") and not check_answer(mcq, "c ) apple")
    hard = Example("hard_mcq", "q", "a ) 3 is not even . b ) 4 is even . the answer is b .", {"correct": "b"})
    assert check_answer(hard, "a ) 3 is not even . the answer is b .")
    assert not check_answer(hard, "the answer is a .")
    lc = Example("long_context", "q", "", {"facts": [["red", "box", 4], ["blue", "cup", 17]]})
    assert check_answer(lc, "the blue cup is 17 . the red box is 4 .")
    assert not check_answer(lc, "the red box is 4 . the blue cup is 71 .")
    name = Example("instruction", "name two fruits .", "apple , pear",
                   {"template": "name", "count": 2, "members": ["apple", "pear", "plum"]})
    assert check_answer(name, "plum , apple")
    assert not check_answer(name, "plum , plum") and not check_answer(name, "plum , apple , pear")
    es = Example("multilingual_math", "q", "", {"template": "story", "result": 9})
    assert check_answer(es, "4 + 5 = 9 . la respuesta es 9 .") and not check_answer(es, "la respuesta es 8 .")


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(InputError, match="unknown category"):
        generate_examples("poetry", 3, 0)
    with pytest.raises(InputError, match=">= 0"):
        generate_examples("chat", -1, 0)
    assert generate_examples("chat", 0, 0) == []


def _rank_corr(a, b) -> float:
    ra = np.argsort(np.argsort(a))
    rb = np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_answer_length_varies_inside_every_category(corpus):
    for c, examples in corpus.items():
        lengths = [len(e.answer.split()) for e in examples]
        assert len(set(lengths)) >= 3, c
        assert np.percentile(lengths, 90) >= 2 * np.percentile(lengths, 10), c


def test_work_comes_from_what_the_prompt_says_not_its_length(corpus):
    """Inside a template, prompt length says (almost) nothing about answer length."""
    for c in ("instruction", "code", "math", "multilingual_math", "hard_mcq", "long_context"):
        by_template: dict[str, list[Example]] = {}
        for e in corpus[c]:
            by_template.setdefault(e.meta["template"], []).append(e)
        for template, examples in by_template.items():
            answer = [len(e.answer.split()) for e in examples]
            if len(set(answer)) < 3:
                continue  # fixed-length answers (e.g. code "if"): nothing to hide
            prompt = [len(e.prompt.split()) for e in examples]
            assert abs(_rank_corr(prompt, answer)) < 0.5, (c, template)


def test_counts_are_written_as_digits_and_as_words(corpus):
    repeat = [e for e in corpus["instruction"] if e.meta["template"] == "repeat"]
    said = [e.prompt.split()[4] for e in repeat]  # "repeat the word W <count> times ."
    assert any(s.isdigit() for s in said) and any(s.isalpha() for s in said)
    for e in repeat:
        assert len(e.answer.split()) == e.meta["count"]


def test_long_context_prompts_hold_hundreds_of_tokens_and_all_facts(corpus):
    for e in corpus["long_context"]:
        assert 120 <= len(e.prompt.split()) <= 450
        assert 2 <= e.meta["count"] <= 4 and len(e.meta["facts"]) == e.meta["count"]
        for color, obj, n in e.meta["facts"]:
            assert f"the secret number of the {color} {obj} is {n} ." in e.prompt


def test_chat_answers_vary_for_the_same_request(corpus):
    answers: dict[str, set[str]] = {}
    for e in corpus["chat"]:
        answers.setdefault(e.prompt, set()).add(e.answer)
    repeated = [a for a in answers.values() if len(a) > 1]
    assert repeated, "some chat prompt should come with different answers"
