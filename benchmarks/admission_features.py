"""Admission features per arrival on the scheduler thread: from token ids (token tables) vs decoding the
prompt and counting, for prompts of 2k and 8k tokens. Target: <= 20 µs per arrival (issue 56).

What the hook runs per arrival (``launcher._features``): SGLang's ``Req`` holds the chat-templated
input as an ``array('q')`` of ids; the features are (words, newlines, prompt tokens) of the user's text
inside it. ``tables`` is :class:`~dwise_predict.features.token_tables.TokenFeaturizer` on that list
(the array viewed as numpy without a copy, a gather per table); ``decode`` is what the hook did before:
``PromptFeaturizer.user_text`` (strip the template, ``tokenizer.decode``) and ``str.split``. Two
tokenizers: the tiny dLLM's (607 words, a chat template) and a word-level one of SDAR's vocabulary
size (151,680 ids, as the live tests serve), whose tables are as large as a real model's. Also the
cost per call on prompts of 2-11 ids (the first ids of each input), as short as ``hook_overhead.py``'s
arrivals: what is left there is the fixed cost of a call. Medians over repeated calls, one thread;
the machine's load moves them, so both paths run in one process.

    python benchmarks/admission_features.py [--repeats 300] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from array import array

import numpy as np

from targets import Figure, add_options, report

TARGET_US = 20.0
LENGTHS = (2048, 8192)
SMOKE_LENGTHS = (256, 1024)  # building 8k-token inputs alone re-templates a growing text for ~20 s
SHORT = range(2, 12)  # ids of the short prompts


def median_us(fn, inputs: list, repeats: int) -> float:
    from dwise_predict.admission.compare import median_time

    return median_time(fn, inputs, repeats) * 1e6


def decoded(prompt) -> callable:
    """The hook's features before: decode the user's ids, count."""
    from dwise_predict.features.prompt import count_newlines, count_words

    def features(ids):
        text = prompt.user_text(ids)
        text = prompt.tokenizer.decode(ids) if text is None else text
        return count_words(text), count_newlines(text), len(ids)

    return features


def sdar_sized_tokenizer(size: int):
    """A word-level tokenizer of ``size`` ids (``w<i>`` is id ``i``), as ``tests/live/tiny_sdar.py``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {("<unk>" if i == 0 else f"w{i}"): i for i in range(size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def tiny_inputs(tokenizer, length: int, n: int) -> list[list[int]]:
    """``n`` chat-templated inputs of about ``length`` ids: the tiny corpus's prompts, concatenated."""
    from dwise_predict.dllm.corpus import CATEGORIES, generate_examples

    prompts = [ex.prompt for c in CATEGORIES for ex in generate_examples(c, 40, seed=0)]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        text, ids = "", []
        while len(ids) < length:
            text += " " + prompts[int(rng.integers(len(prompts)))] + "\n"
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)
        out.append(array("q", ids))  # what SGLang's Req holds
    return out


def run(name: str, tokenizer, inputs: dict[int, list], repeats: int) -> tuple[float, float]:
    """Print both paths per prompt length; return the tables' slowest median and their median on
    short prompts (µs per arrival)."""
    from dwise_predict.features.prompt import PromptFeaturizer
    from dwise_predict.features.token_tables import TokenFeaturizer

    start = time.perf_counter()
    tables = TokenFeaturizer(tokenizer)
    built = time.perf_counter() - start
    decode = decoded(PromptFeaturizer(tokenizer))
    print(f"{name}: {len(tables.tables.counts_) - 1:,} ids, tables built in {built:.2f} s (once, at install)")
    slowest = 0.0
    for length, batch in inputs.items():
        assert all(tables(ids) == decode(ids) for ids in batch), "the tables disagree with decoding"
        fast = median_us(tables, batch, repeats)
        slow = median_us(decode, batch, max(repeats // 10, 5))
        tokens = np.mean([len(ids) for ids in batch])
        print(f"  {tokens:6.0f}-token prompt: tables {fast:8.1f} µs per arrival (target <= {TARGET_US:g} µs), decode {slow:8.1f} µs: {slow / fast:5.1f}x")
        slowest = max(slowest, fast)
    short = [ids[:n] for ids, n in zip(next(iter(inputs.values())) * len(SHORT), SHORT)]
    assert all(tables(ids) == decode(ids) for ids in short), "the tables disagree with decoding"
    short_us = median_us(tables, short, repeats)
    print(f"  {SHORT[0]}-{SHORT[-1]}-token prompts: tables {short_us:6.1f} µs per arrival (the fixed cost of a call)")
    return slowest, short_us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    add_options(parser, "few repeats, 2 prompts of 256 and 1,024 tokens, a 16k vocabulary: a quick check")
    args = parser.parse_args(argv)
    repeats = 10 if args.smoke else args.repeats
    n = 2 if args.smoke else 8
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    from transformers import AutoTokenizer

    from dwise_predict.dllm import TINY_MODEL_DIR

    tiny = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    tiny_us, tiny_short = run("tiny dLLM tokenizer", tiny, {length: tiny_inputs(tiny, length, n) for length in lengths},
                              repeats)
    size = 16_384 if args.smoke else 151_680
    big = sdar_sized_tokenizer(size)
    rng = np.random.default_rng(1)
    inputs = {length: [array("q", rng.integers(1, size, length).tolist()) for _ in range(n)] for length in lengths}
    big_us, big_short = run("word-level tokenizer of SDAR's vocabulary size", big, inputs, repeats)
    longest = f"slowest of {' and '.join(f'{n:,}' for n in lengths)}-token prompts"
    report("admission_features", [
        Figure("token-table features per arrival, tiny tokenizer", tiny_us, "µs", TARGET_US, context=longest),
        Figure(f"token-table features per arrival, {size:,}-id vocabulary", big_us, "µs", TARGET_US, context=longest),
        Figure("token-table features per short arrival, slower tokenizer", max(tiny_short, big_short), "µs",
               context=f"{SHORT[0]}-{SHORT[-1]}-token prompts: the fixed cost of a call"),
    ], args, repeats=repeats, prompts_per_length=n, vocabulary=size)


if __name__ == "__main__":
    main()
