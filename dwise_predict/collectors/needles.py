"""Synthetic multi-needle long-context prompts (the paper's long-context category).

Each prompt is a long document of distractor sentences with 2–4 *needles* hidden at random depths,
each of the form "The special magic number for <key> is <7 digits>.", followed by one question that
asks for every needle's number. The answers are automatically checkable: the reference is the JSON
list of the numbers in question order, and :func:`score_needles` gives the fraction an output holds.

Everything is drawn from one ``numpy`` generator, so a seed fixes every prompt exactly. Distractors
use a vocabulary disjoint from the needle keys and contain no digits, so a needle's key and number
appear in the document exactly once.

Prompt length is set in words; ``target_tokens`` converts with :data:`WORDS_PER_TOKEN` (about 0.75
English words per BPE token), so ``target_tokens=10_000`` gives prompts of roughly 10K tokens on a
real tokenizer — the setting of the paper's Table 1.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.files import loads_json

WORDS_PER_TOKEN = 0.75
MIN_WORDS = 150

_SUBJECTS = (
    "the committee", "a quiet librarian", "the old ferryman", "our neighbour", "the night shift",
    "a travelling painter", "the village council", "the head gardener", "a young engineer",
    "the museum guide", "the baker across the street", "a retired sailor", "the orchestra",
    "the school choir", "a patient teacher", "the weather station", "the lighthouse keeper",
    "a group of hikers", "the market vendors", "the city archivist", "a curious child",
    "the railway clerk", "the shepherd", "the research team", "a local historian",
)
_VERBS = (
    "repaired", "described", "painted", "carried", "measured", "discussed", "photographed",
    "cleaned", "rearranged", "catalogued", "admired", "inspected", "restored", "sketched",
    "collected", "visited", "ignored", "rediscovered", "moved", "counted",
)
_OBJECTS = (
    "the wooden bridge", "a box of letters", "the stone fountain", "an old map", "the garden wall",
    "a set of brass keys", "the harbour lamps", "the bell tower", "a basket of apples",
    "the winter coats", "a faded photograph", "the northern path", "the library shelves",
    "a broken clock", "the river stones", "a pile of firewood", "the chapel windows",
    "a bundle of maps", "the hill terraces", "the market stalls",
)
_PLACES = (
    "near the harbour", "behind the mill", "on the hillside", "by the old road", "in the square",
    "under the bridge", "beside the orchard", "at the edge of town", "in the valley",
    "along the canal", "past the quarry", "inside the town hall", "by the northern gate",
)
_TIMES = (
    "early in the morning", "before the rain", "after the festival", "late that autumn",
    "during the long winter", "one quiet afternoon", "at dusk", "the following spring",
    "over several weeks", "just before noon", "while the tide was low",
)
_CLAUSES = (
    "and nobody seemed surprised", "which took longer than expected", "as everyone had hoped",
    "although the weather turned", "and the work was noted in the ledger",
    "while a small crowd watched", "so the evening was calm again", "and then went home",
)
# Needle keys use words that never occur in distractors, so a key matches only its own needle.
_KEY_ADJECTIVES = (
    "amber", "cobalt", "crimson", "silent", "velvet", "frozen", "golden", "hidden", "lunar",
    "scarlet", "silver", "misty", "rapid", "gentle", "ivory", "jade", "copper", "violet",
)
_KEY_NOUNS = (
    "falcon", "harbor", "lantern", "meadow", "comet", "glacier", "orchid", "compass", "canyon",
    "willow", "ember", "beacon", "thicket", "summit", "otter", "prism", "cedar", "anchor",
)

_NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}  # spelled out: the needles' numbers are the only digits
_HEADER = (
    "Below is a long document. Hidden in it are special magic numbers for {n} keys. Read the whole "
    "document, then answer the question at the end."
)
_QUESTION = (
    "Question: What are the special magic numbers for {keys}? Answer with one line per key in the "
    "form `key: number`."
)


@dataclass(frozen=True)
class NeedlePrompt:
    """One multi-needle prompt with its answers.

    keys, answers : tuples of equal length (2–4), in the order the question lists them.
    words : whitespace-separated words in ``prompt``.
    """

    prompt: str
    keys: tuple[str, ...]
    answers: tuple[str, ...]
    depths: tuple[float, ...]  # position of each needle in the document, 0 = start, 1 = end
    words: int

    @property
    def reference(self) -> str:
        """The answers as a JSON list (the ``reference`` of a workload request)."""
        return json.dumps(list(self.answers))


def target_words(target_words: int | None = None, target_tokens: int | None = None) -> int:
    """Resolve a prompt length given in words or in approximate tokens to words."""
    if (target_words is None) == (target_tokens is None):
        raise InputError("multi_needle: give exactly one of target_words or target_tokens")
    words = target_words if target_words is not None else round(target_tokens * WORDS_PER_TOKEN)
    if words < MIN_WORDS:
        raise InputError(
            f"multi_needle: a prompt needs at least {MIN_WORDS} words (instructions, question and 4 "
            f"needles take ~100), got {words}; "
            "raise target_words or target_tokens"
        )
    return int(words)


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[rng.integers(len(options))]


def _distractor(rng: np.random.Generator) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _PLACES, _TIMES)
    sentence = " ".join(_pick(rng, options) for options in parts)
    if rng.random() < 0.4:
        sentence += f", {_pick(rng, _CLAUSES)}"
    return sentence[0].upper() + sentence[1:] + "."


def _join_keys(keys: tuple[str, ...]) -> str:
    return ", ".join(keys[:-1]) + f" and {keys[-1]}"


def make_needle_prompt(
    rng: np.random.Generator, words: int, min_needles: int = 2, max_needles: int = 4
) -> NeedlePrompt:
    """Draw one prompt of about ``words`` words (within one distractor sentence) from ``rng``."""
    n = int(rng.integers(min_needles, max_needles + 1))
    key_idx = rng.choice(len(_KEY_ADJECTIVES) * len(_KEY_NOUNS), size=n, replace=False)
    keys = tuple(
        f"{_KEY_ADJECTIVES[i // len(_KEY_NOUNS)]}-{_KEY_NOUNS[i % len(_KEY_NOUNS)]}" for i in key_idx
    )
    answers = tuple(str(v) for v in rng.choice(np.arange(1_000_000, 10_000_000), size=n, replace=False))
    needles = [f"The special magic number for {k} is {a}." for k, a in zip(keys, answers)]

    header = _HEADER.format(n=_NUMBER_WORDS[n])
    question = _QUESTION.format(keys=_join_keys(keys))
    budget = words - len(header.split()) - len(question.split()) - sum(len(s.split()) for s in needles)
    sentences: list[str] = []
    count = 0
    while count < budget or len(sentences) < n:
        sentences.append(_distractor(rng))
        count += len(sentences[-1].split())
    # Needles go at distinct random depths among the distractors (and may sit first or last).
    slots = np.sort(rng.choice(len(sentences) + 1, size=n, replace=False))[::-1]
    for slot, needle in zip(slots, needles[::-1]):
        sentences.insert(int(slot), needle)
    depths = tuple(sentences.index(s) / max(len(sentences) - 1, 1) for s in needles)

    # Paragraphs of 4–9 sentences, so newline counts vary like real documents.
    paragraphs, start = [], 0
    while start < len(sentences):
        stop = start + int(rng.integers(4, 10))
        paragraphs.append(" ".join(sentences[start:stop]))
        start = stop
    prompt = "\n\n".join([header, *paragraphs, question])
    return NeedlePrompt(prompt, keys, answers, depths, len(prompt.split()))


def generate_needle_prompts(
    n: int,
    seed: int,
    words: int,
    jitter: float = 0.1,
    min_needles: int = 2,
    max_needles: int = 4,
) -> list[NeedlePrompt]:
    """Generate ``n`` prompts deterministically from ``seed``.

    Parameters
    ----------
    words : target prompt length in words; each prompt's target is drawn uniformly from
        ``words * (1 ± jitter)`` so that prompt length varies inside the category.
    min_needles, max_needles : inclusive range of needles per prompt (2–4 in the paper).
    """
    if not 1 <= min_needles <= max_needles <= 4:
        raise InputError(
            f"multi_needle: need 1 <= min_needles <= max_needles <= 4, got {min_needles}..{max_needles}"
        )
    if not 0.0 <= jitter < 1.0:
        raise InputError(f"multi_needle: jitter must be in [0, 1), got {jitter}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        target = round(words * (1.0 + jitter * rng.uniform(-1.0, 1.0)))
        out.append(make_needle_prompt(rng, target, min_needles, max_needles))
    return out


def score_needles(reference: str, text: str) -> float:
    """Fraction of the reference numbers (a JSON list) that occur as whole numbers in ``text``."""
    answers = loads_json(reference, InputError, "a multi_needle reference", "give a JSON list of numbers")
    found = set(re.findall(r"\d+", text))
    return sum(a in found for a in answers) / len(answers)
