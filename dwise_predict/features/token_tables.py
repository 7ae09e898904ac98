"""Admission features from token ids, without decoding text: per-vocabulary tables.

A server holds a request's prompt as token ids (SGLang's ``Req.origin_input_ids``). Decoding them
to count words and newlines costs 0.5–3 ms per 2k tokens on the scheduler thread
(``benchmarks/admission_features.py``). Both counts are sums over the decoded text, so they can be
summed over the tokens instead, from tables built once per tokenizer:

* each token's *piece*: the text it adds to a decoded sequence, taken in context — the token
  decoded between two copies of an *anchor* token (a plain letter) with the anchor's own text cut
  off both ends, so a piece carries the leading space a decoder gives a token that is not first
  (SentencePiece's ``▁``, WordPiece's joining space) and any clean-up the decoder applies there;
* per token: the newlines of its piece, its words (``str.split``), whether it starts and whether
  it ends with a non-whitespace character.

The words of a sequence are then the sum of its tokens' words less one for each pair of
neighbours where a word runs across the boundary (the first ends, the second starts, with a
non-whitespace character); the newlines are a plain sum. One gather of a byte per id and three
vectorised passes over those bytes (:meth:`TokenTables.counts`), plain Python for a few ids; no text.

Where this is not exact, and what is done there (the *slow* tokens, decoded after all):

* byte-level BPE (GPT-2, Qwen, Llama 3) and SentencePiece byte fallback (``<0xE3>``) tokens that
  hold part of a UTF-8 character: alone they decode to U+FFFD, in sequence to the character, which
  may be whitespace (U+3000, U+00A0). Such tokens are *joint*: each run of neighbouring joint
  tokens is decoded together, with the anchor around it. That is exact: a token that decodes alone
  without U+FFFD is whole UTF-8, so no character crosses its edges, and a run's bytes decode the
  same alone as in the sequence. (A token whose text really contains U+FFFD is taken as joint too:
  slower, still exact.) A run costs a few µs; where there is more than one run per 16 ids (text
  of rare characters that the vocabulary spells byte by byte) the whole sequence is decoded
  instead, so such a prompt costs what decoding it costs.
* a piece that decodes to nothing (ids past the vocabulary, which decoders skip): dropped before
  the boundaries are counted.
* a token whose decoding depends on its right neighbour or changes its left one (the anchored
  decode does not start and end with the anchor's text: the clean-up of ``" ' "`` in tokenizers
  that clean up spaces): the whole sequence is decoded and counted.

A decoder that strips the first character of the whole text (SentencePiece's leading ``▁``)
changes only the first token's piece, where it changes neither count. What is left is decoders
whose output for a token depends on neighbours other than through bytes, spaces and the clean-up
above; ``tests/test_token_tables.py`` compares against decode-then-count on the built-in tiny
model's tokenizer and on byte-level, byte-fallback and WordPiece tokenizers built offline, on
text with multi-byte characters, Unicode whitespace, newlines and runs of spaces, and on random
ids. Standard library and numpy; the tokenizer is used only through ``decode`` (its Rust
backend's ``decode_batch`` where that is what ``decode`` runs: to build the tables and for runs of
joint tokens), ``convert_ids_to_tokens``, ``get_vocab`` and ``encode``.
"""

from __future__ import annotations

import re
from array import array

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.features.prompt import PromptFeaturizer, count_newlines, count_words

LEAD, TRAIL = 1, 2  # flag bits: the piece starts / ends with a non-whitespace character
JOINT, EMPTY, ALONE = 1, 2, 3  # why a token is slow: not countable alone (see the module docstring)
# a piece's words and newlines in one int64, fields of 24 bits (a prompt would need 16M words to overflow)
NEWLINES_SHIFT, FIELD = 24, (1 << 24) - 1
# each token's *code*, one byte, all the fast path gathers (see TokenTables.counts): bits 0-3 are read
# of a token itself, bits 4-7 of the token before it (its code shifted right by 4 meets the next one's)
INNER, NEWLINE = 0x02, 0x04  # bit 0 is LEAD; a word starts inside the piece; the piece holds one newline
OPEN, ALWAYS, SLOW, SPECIAL = 0x10, 0x20, 0x40, 0x80  # ends with whitespace; set in every code; slow; not plain
FEW = 16  # ids up to which plain Python counts faster than numpy (each of whose calls costs about a µs)
RUNS_PER_DECODE = 16  # ids per run of joint tokens above which decoding the whole sequence is cheaper
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")  # SentencePiece's byte fallback tokens
ANCHORS = ("a", "x", "e", "0", "the")  # texts tried as the anchor token, then the vocabulary in order


def text_counts(text: str) -> tuple[int, int]:
    """(words, newlines) of ``text``, as :func:`~dwise_predict.features.prompt.count_words` and
    :func:`~dwise_predict.features.prompt.count_newlines` count them."""
    return count_words(text), count_newlines(text)


def _flags(text: str) -> int:
    return (LEAD if text and not text[0].isspace() else 0) | (TRAIL if text and not text[-1].isspace() else 0)


def _packed(text: str) -> int:
    words, newlines = text_counts(text)
    return words + (newlines << NEWLINES_SHIFT)


def _fields(total: int, flags: np.ndarray) -> tuple[int, int]:
    """(words, newlines) of a sequence of pieces from the sum of their packed counts and their flags: a
    word runs across a boundary where the left piece ends and the right one starts with a non-space."""
    joins = int(np.count_nonzero((flags[:-1] >> 1) & flags[1:]))  # TRAIL of the left, LEAD of the right
    return (total & FIELD) - joins, (total >> NEWLINES_SHIFT) & FIELD


class TokenTables:
    """What each token id adds to the words and newlines of a decoded sequence.

    Attributes
    ----------
    counts_ : int64 array (V + 1,), ``words + (newlines << 24)`` of each token's piece (0 for a slow
        token); the last row stands for every id outside the vocabulary.
    flags_ : uint8 array (V + 1,), ``LEAD | TRAIL`` bits of each piece.
    slow_ : int8 array (V + 1,), why a slow token is slow (``JOINT``, ``EMPTY``, ``ALONE``), else 0.
    codes_ : uint8 array (V + 1,), each token's code (:meth:`counts`).
    extra_ : int64 array (V + 1, 2), what a token that is not plain adds to the word starts the codes
        count (its words less ``LEAD``), and its newlines.
    anchor_ : the anchor token id; ``prefix_``, ``suffix_``: its text before and after a piece.
    """

    def __init__(self, tokenizer, counts, flags, slow, anchor: int, prefix: str, suffix: str):
        self.tokenizer = tokenizer
        self.counts_, self.flags_, self.slow_ = counts, flags, slow
        self.anchor_, self.prefix_, self.suffix_ = anchor, prefix, suffix
        self.codes_, self.extra_ = _codes(counts, flags, slow)
        self._code_list = self.codes_.tolist()  # for :meth:`few_counts`

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenTables":
        """Build the tables of ``tokenizer`` (a transformers tokenizer): one decode of each token
        between anchors (2 s for a vocabulary of 150k on this project's 2-core CPU).

        Raises
        ------
        InputError
            No token decodes to a plain letter or digit that could serve as the anchor.
        """
        size = max(tokenizer.get_vocab().values()) + 1
        anchor, prefix, suffix = _anchor(tokenizer, size)
        decoded = _decode_all(tokenizer, [[anchor, token, anchor] for token in range(size)])
        names = tokenizer.convert_ids_to_tokens(list(range(size)))
        counts = np.zeros(size + 1, dtype=np.int64)
        flags = np.zeros(size + 1, dtype=np.uint8)
        slow = np.zeros(size + 1, dtype=np.int8)
        inner = slice(len(prefix), -len(suffix) if suffix else None)
        for token, (text, name) in enumerate(zip(decoded, names)):
            if not (text.startswith(prefix) and text.endswith(suffix) and len(text) >= len(prefix) + len(suffix)):
                slow[token] = ALONE
                continue
            piece = text[inner]
            if "\ufffd" in piece or (name is not None and BYTE_TOKEN.match(name)):
                slow[token] = JOINT
            elif not piece:
                slow[token] = EMPTY
            counts[token] = _packed(piece)
            flags[token] = _flags(piece)
        slow[size] = EMPTY  # ids outside the vocabulary decode to nothing
        counts[slow != 0] = 0
        return cls(tokenizer, counts, flags, slow, anchor, prefix, suffix)

    def counts(self, ids: np.ndarray) -> tuple[int, int]:
        """(words, newlines) of ``tokenizer.decode(ids)``; ``ids`` an int64 array (n,) or a buffer of
        int64 (a memoryview of an ``array('q')``: numpy's ``take`` reads it without a copy).

        The words are counted as their starts: a token's piece adds one where a word starts inside
        it (after whitespace) and one at its first character where that is no space (``LEAD``) and
        the piece before it ends with whitespace or there is none (``OPEN``). A *plain* token (at
        most one word and one newline, not slow) adds at most one start, so one gather of the codes
        and two passes count them all: ``code[t - 1] >> 4 & code[t]`` is nonzero exactly where token
        ``t`` adds a start (bit 0: ``OPEN`` before, ``LEAD`` here; bit 1: ``ALWAYS`` before,
        ``INNER`` here; bit 2 only where a token is slow, bit 3 never); a third pass counts the
        newlines, a fourth (the codes' maximum) finds any other token. Such a token is ``SPECIAL``: its
        code says only whether a start comes at its edges, and what more it adds is read from
        ``extra_`` at its position (few are); a slow one sends the whole input to the exact path.
        """
        codes = self.codes_.take(ids, mode="clip")
        if not len(codes):
            return 0, 0
        first = codes.item(0)  # no token before it: a start at its first character wherever that is no space
        starts = codes[:-1] >> 4
        starts &= codes[1:]  # in place: one array fewer to allocate
        words = int(np.count_nonzero(starts)) + (first & LEAD) + (first & INNER) // INNER
        newlines = int(np.count_nonzero(codes & NEWLINE))
        if np.maximum.reduce(codes) < SPECIAL:  # the ufunc itself: ndarray.max adds a Python-level call
            return words, newlines
        special, ids = np.flatnonzero(codes >= SPECIAL), np.asarray(ids)
        if (codes[special] & SLOW).any():
            return self._slow_counts(ids)
        more_words, more_newlines = self.extra_.take(ids[special], axis=0, mode="clip").sum(axis=0).tolist()
        return words + more_words, newlines + more_newlines

    def few_counts(self, ids) -> tuple[int, int] | None:
        """:meth:`counts` of a few ids (a list or an ``array('q')``) in plain Python, where numpy's cost
        per call would be most of the time; None where a token is not plain or an id is outside the
        vocabulary (:meth:`counts` then)."""
        table = self._code_list
        try:
            codes = [table[token] for token in ids]
        except IndexError:  # past the vocabulary
            return None
        if not codes:
            return 0, 0
        if max(codes) >= SPECIAL or min(ids) < 0:  # numpy clips a negative id to 0, a list counts from its end
            return None
        first = codes[0]
        words = sum(1 for before, code in zip(codes, codes[1:]) if before >> 4 & code)
        return words + (first & LEAD) + (first & INNER) // INNER, sum(code & NEWLINE for code in codes) // NEWLINE

    def _slow_counts(self, ids: np.ndarray) -> tuple[int, int]:
        """:meth:`counts` where some token is slow: each run of joint tokens decoded as one piece,
        empty pieces dropped; the whole sequence decoded where a token cannot be taken alone."""
        slow = self.slow_.take(ids, mode="clip")
        joint = np.flatnonzero(slow == JOINT)
        starts = joint[np.r_[True, np.diff(joint) > 1]].tolist() if len(joint) else []
        # a run costs a decode of its own (a few µs): past one run in RUNS_PER_DECODE ids, one decode of
        # the whole sequence is cheaper
        if (slow == ALONE).any() or len(starts) * RUNS_PER_DECODE > len(ids):
            return text_counts(self.tokenizer.decode(ids.tolist()))
        counts = self.counts_.take(ids, mode="clip")
        flags = self.flags_.take(ids, mode="clip")
        keep = slow != EMPTY
        if starts:
            ends = (joint[np.r_[np.diff(joint) > 1, True]] + 1).tolist()
            pieces = self._pieces([ids[start:end].tolist() for start, end in zip(starts, ends)])
            if pieces is None:
                return text_counts(self.tokenizer.decode(ids.tolist()))
            for start, end, piece in zip(starts, ends, pieces):
                counts[start] = _packed(piece)
                flags[start] = _flags(piece)
                keep[start + 1:end] = False
                keep[start] = bool(piece)
        return _fields(int(counts[keep].sum()), flags[keep])

    def _pieces(self, runs: list[list[int]]) -> list[str] | None:
        """The text each run adds to a sequence, decoded between anchors (one batch); None where the
        anchors' own text does not come back around one of them."""
        texts = _decode_all(self.tokenizer, [[self.anchor_, *run, self.anchor_] for run in runs])
        cut = slice(len(self.prefix_), -len(self.suffix_) if self.suffix_ else None)
        if not all(t.startswith(self.prefix_) and t.endswith(self.suffix_) for t in texts):
            return None
        return [t[cut] for t in texts]


def _codes(counts: np.ndarray, flags: np.ndarray, slow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's code and what a special one adds (see :meth:`TokenTables.counts`)."""
    words, newlines = counts & FIELD, (counts >> NEWLINES_SHIFT) & FIELD
    lead = (flags & LEAD).astype(np.int64)
    plain = (slow == 0) & (words <= 1) & (newlines <= 1)
    codes = lead | np.where(flags & TRAIL, 0, OPEN) | ALWAYS
    codes |= np.where(plain, np.where(words > lead, INNER, 0) | np.where(newlines == 1, NEWLINE, 0),
                      SPECIAL | np.where(slow != 0, SLOW, 0))
    extra = np.where(plain[:, None], 0, np.stack([words - lead, newlines], axis=1))
    return codes.astype(np.uint8), extra.astype(np.int64)


def _decode_all(tokenizer, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.decode`` of each sequence. A transformers fast tokenizer that does not clean up
    spaces decodes with its Rust backend alone (``PreTrainedTokenizerFast._decode``), which decodes
    a batch at once (seconds saved on a vocabulary of 150k); any other, one by one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch(sequences, skip_special_tokens=False)
    return [tokenizer.decode(sequence) for sequence in sequences]


def _anchor(tokenizer, size: int) -> tuple[int, str, str]:
    """A token that decodes to a plain letter or digit, alone and after itself, and its text before
    and after a piece: (id, the text of ``[anchor]``, what a second anchor adds after it)."""
    candidates = []
    for text in ANCHORS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            candidates.append(int(ids[0]))
    candidates += range(min(size, 4096))
    for token in candidates:
        alone = tokenizer.decode([token])
        twice = tokenizer.decode([token, token])
        if alone.isalnum() and alone.isascii() and twice.startswith(alone) and twice[len(alone):].strip() == alone:
            return token, alone, twice[len(alone):]
    raise InputError("no token of this tokenizer decodes to a plain letter or digit: the admission features need "
                     "one as the anchor of the token tables (decode the prompt instead)")


class TokenFeaturizer:
    """A model input's token ids -> (words, newlines, prompt tokens), as decoding gives them.

    The chat template's own ids are stripped from both ends as
    :meth:`~dwise_predict.features.prompt.PromptFeaturizer.user_text` strips them, and the words and
    newlines of the user's ids counted from :class:`TokenTables` (those of the whole input where
    the template cannot be stripped: a system prompt, several turns). ``prompt tokens`` is the
    input's length. Exactly what ``PromptFeaturizer.user_text`` (or ``decode``) and
    :func:`~dwise_predict.features.prompt.count_words` /
    :func:`~dwise_predict.features.prompt.count_newlines` give, where the module docstring says.

    Parameters
    ----------
    tokenizer : a transformers tokenizer (the one the server tokenises prompts with).
    """

    def __init__(self, tokenizer):
        self.prompt = PromptFeaturizer(tokenizer)
        self.tables = TokenTables.from_tokenizer(tokenizer)

    def __call__(self, input_ids) -> tuple[int, int, int]:
        """(words, newlines, prompt tokens) of ``input_ids`` (a list of ints, as a server holds them)."""
        n = len(input_ids)
        span = self.prompt.user_span(input_ids)
        start, stop = span if span is not None else (0, n)
        found = self.tables.few_counts(input_ids[start:stop]) if stop - start <= FEW else None
        if found is not None:
            return (*found, n)
        if isinstance(input_ids, array) and input_ids.typecode in "ql":  # SGLang's Req holds array('q'): no copy
            ids = memoryview(input_ids)[start:stop]  # cheaper than a numpy view, which take makes itself
        else:
            ids = np.fromiter(input_ids[start:stop], dtype=np.int64, count=stop - start)  # one C-level pass
        return (*self.tables.counts(ids), n)

    def text(self, input_ids) -> str:
        """The text the counts are of (decoded: for a recording, never on the admission path)."""
        text = self.prompt.user_text(input_ids)
        return self.prompt.tokenizer.decode(list(input_ids)) if text is None else text
