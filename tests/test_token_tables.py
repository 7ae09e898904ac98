"""Admission features from token ids (``features.token_tables``) equal decode-then-count: on the tiny
model's tokenizer over its workload, and on byte-level BPE, SentencePiece-style byte-fallback and
WordPiece (clean-up on) tokenizers built here, offline, over text with multi-byte characters,
Unicode whitespace, newlines and runs of spaces, and over random ids."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dwise_predict.dllm import TINY_MODEL_DIR
from dwise_predict.features.prompt import PromptFeaturizer, count_newlines, count_words
from dwise_predict.features.token_tables import FEW, JOINT, SPECIAL, TokenFeaturizer, TokenTables, text_counts

# the hard characters: split across byte-level tokens (3- and 4-byte UTF-8), whitespace that is not
# ASCII (str.split() splits on it: NBSP, U+3000, em space, NEL, line separator), combining marks
PIECES = ["hello", "world", "the", "cat's", "don't", "x=1;", "naïve", "café", "日本語", "中文文本", "テキスト", "😀",
          "👍🏽", "e\u0301", "Ω≈ç√", "ß", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\t", "\r\n", "\n", "\n\n\n",
          "  ", "    ", " ", ".", ",", "?", "!", "' ", " '", "(", ")", "»", "——", "1234", "<tag>"]
# never in the texts the tokenizers are trained on, so a byte-level one keeps each split over tokens:
# whitespace (medium mathematical space, en space, ogham space, narrow NBSP) and 4-byte characters
RARE = ["\u205f", "\u2002", "\u1680", "\u202f", "\U0001d518", "\U0001f9ea", "\u0d9e"]
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = ("{% for m in messages %}{{ '[' + m['role'] + ']' }}{{ m['content'] }}{{ '[/' + m['role'] + ']' }}"
                  "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def texts(n: int, seed: int, rare: bool = False) -> list[str]:
    """Random texts joined from :data:`PIECES` (and :data:`RARE`) with random separators (or none)."""
    rng = random.Random(seed)
    pieces = PIECES + RARE * 3 if rare else PIECES
    out = []
    for _ in range(n):
        parts = [rng.choice(pieces) + rng.choice(["", " ", " ", "  ", "\n", "\u3000"]) for _ in range(rng.randint(0, 30))]
        out.append("".join(parts))
    return out


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A Qwen-style byte-level BPE (ByteLevel pre-tokenizer and decoder), trained small so that CJK
    characters, emoji and U+3000 stay split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(texts(400, 1), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = QWEN_TEMPLATE
    return fast


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE: ``▁`` for spaces, the 256 ``<0xXX>`` byte tokens for what
    the vocabulary lacks, and Llama's decoder (``▁`` → space, byte fallback, fuse, strip one leading
    space)."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    base.train_from_iterator(texts(400, 2), trainer)
    vocab = base.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(pair) for pair in json.loads(base.to_str())["model"]["merges"]]  # pairs, as tokenizers 0.23 saves them
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = LLAMA_TEMPLATE
    return fast


def wordpiece_with_cleanup() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece whose decode cleans up spaces before punctuation (not local)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=400, show_progress=False, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(texts(400, 3), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)


TOKENIZERS = {"tiny": lambda: AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR)), "byte-level BPE": byte_level_bpe,
              "byte-fallback BPE": byte_fallback_bpe, "WordPiece, clean-up": wordpiece_with_cleanup}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def decoded_features(prompt: PromptFeaturizer, ids: list[int]) -> tuple[int, int, int]:
    """What the hook computed before: decode the user's ids (the whole input where the template
    cannot be stripped), count."""
    text = prompt.user_text(ids)
    text = prompt.tokenizer.decode(ids) if text is None else text
    return count_words(text), count_newlines(text), len(ids)


def test_token_tables_give_what_decoding_gives(tokenizer):
    featurizer, prompt = TokenFeaturizer(tokenizer), PromptFeaturizer(tokenizer)
    cases = []
    for text in texts(300, 7, rare=True):
        cases.append(tokenizer.encode(text, add_special_tokens=False))
        if tokenizer.chat_template:
            for turns in ([{"role": "user", "content": text}],
                          [{"role": "system", "content": "be\u3000brief\n"}, {"role": "user", "content": text}]):
                cases.append(list(tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True,
                                                                return_dict=False)))
    long = texts(400, 8)  # long inputs, where runs of joint tokens are decoded run by run (short ones whole)
    cases += [tokenizer.encode("".join(long[i:i + 8]), add_special_tokens=False) for i in range(0, 400, 8)]
    rng = np.random.default_rng(0)
    cases += [rng.integers(0, len(tokenizer) + 2, rng.integers(0, 40)).tolist() for _ in range(300)]  # any ids
    mismatched = [ids for ids in cases if featurizer(ids) != decoded_features(prompt, ids)]
    assert not mismatched, (len(mismatched), tokenizer.decode(mismatched[0]))
    assert featurizer([]) == (0, 0, 0)


def test_the_hard_cases_are_there_and_take_the_exact_path(monkeypatch):
    """The byte-level tokenizer splits U+205F (whitespace) over tokens that decode to U+FFFD alone:
    counted piece by piece they would join two words; the joint path decodes the run, alone in a
    long input, with the whole input in a short one (cheaper there)."""
    tokenizer = byte_level_bpe()
    tables = TokenTables.from_tokenizer(tokenizer)
    runs = []
    pieces = TokenTables._pieces
    monkeypatch.setattr(TokenTables, "_pieces", lambda self, found: runs.append(found) or pieces(self, found))
    ids = tokenizer.encode("hello\u205fworld", add_special_tokens=False)
    assert (tables.slow_[ids] == JOINT).sum() == 3  # its three bytes
    assert "\ufffd" in tokenizer.decode(ids[1:2])  # alone: a replacement character, which is no space
    assert tables.counts(np.asarray(ids)) == (2, 0) and not runs  # decoded whole
    ids = tokenizer.encode("hello world " * 10 + "hello\u205fworld", add_special_tokens=False)
    assert tables.counts(np.asarray(ids)) == (22, 0) and runs == [[ids[-4:-1]]]  # the run alone
    fallback = byte_fallback_bpe()
    ids = fallback.encode("ab\u205fcd\n\U0001d518 x", add_special_tokens=False)  # "b" and both rare ones as bytes
    assert sum(name.startswith("<0x") for name in fallback.convert_ids_to_tokens(ids)) == 8
    assert TokenTables.from_tokenizer(fallback).counts(np.asarray(ids)) == (4, 1)


def test_65536_slow_tokens_still_take_the_exact_path():
    """65,536 ids outside the vocabulary (slow: they decode to nothing), as many as once wrapped a
    16-bit count of slow tokens to 0, so that the fast path counted each as a word's piece."""
    tokenizer = byte_level_bpe()
    tables = TokenTables.from_tokenizer(tokenizer)
    words = tokenizer.encode("hello world\nagain", add_special_tokens=False)
    ids = np.asarray(words + [len(tables.slow_) - 1] * 65536 + words, dtype=np.int64)
    assert tables.slow_[ids].astype(bool).sum() == 65536
    assert tables.counts(ids) == (5, 2)  # "hello world\nagainhello world\nagain": the middle decodes to nothing


def test_the_tiny_models_workload_counts_as_decoding_it_does():
    from dwise_predict.collectors.workloads import load_workload

    tokenizer = TOKENIZERS["tiny"]()
    featurizer, prompt = TokenFeaturizer(tokenizer), PromptFeaturizer(tokenizer)
    requests = load_workload("tiny-default").requests
    assert len(requests) > 400
    for request in requests:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))
        assert prompt.user_span(ids) is not None  # the template is stripped, as collect counts
        assert featurizer(ids) == decoded_features(prompt, ids)
        assert featurizer(ids)[:2] == (count_words(request.prompt), count_newlines(request.prompt))


def test_a_few_ids_count_in_python_as_many_do_in_numpy():
    """Up to ``FEW`` ids are counted in plain Python: the same counts as numpy's path and as decoding,
    at every length; None (numpy's path then) wherever a token is not plain ("\\n\\n\\n": three
    newlines in one token) or an id is outside the vocabulary."""
    tokenizer = byte_level_bpe()
    tables = TokenTables.from_tokenizer(tokenizer)
    plain = tokenizer.encode("hello world\nthe cat's  naïve x=1; don't hello world the cat", add_special_tokens=False)
    special = tokenizer.encode("hello\n\n\nworld", add_special_tokens=False)
    assert len(plain) > FEW and tables.codes_[plain].max() < SPECIAL
    assert (tables.codes_[special] >= SPECIAL).sum() == 1
    for ids in (plain, special):
        for k in range(len(ids) + 1):
            want = text_counts(tokenizer.decode(ids[:k]))
            assert tables.counts(np.asarray(ids[:k], dtype=np.int64)) == want
            not_plain = k and tables.codes_[ids[:k]].max() >= SPECIAL
            assert tables.few_counts(ids[:k]) == (None if not_plain else want)
    assert tables.counts(np.asarray(special)) == (2, 3)
    assert tables.few_counts([0, len(tables.codes_)]) is None and tables.few_counts([-1]) is None
