"""Word-level fast tokenizer for the tiny dLLM, with a chat template.

The corpus writes every token separated by spaces (``dllm.corpus``), so a ``WordLevel`` model over
its vocabulary is lossless up to whitespace: spaces and tabs split, newlines are tokens of their own
(``"\\n"``, so the model sees line structure), punctuation is split off. Special tokens come first
and keep fixed ids: ``<pad>`` 0, ``<mask>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the role tokens.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<mask>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>"]
NEWLINE = "\n"

# "<system> text <user> text <assistant>" — role tokens as separators, no extra newlines (newlines
# are prompt features); the generation prompt is the bare assistant role token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
    "{{ '<' + message['role'] + '> ' + message['content'] + ' ' }}"
    "{% if message['role'] == 'assistant' %}{{ '<eos> ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Build the tokenizer over ``words`` (duplicates and special tokens are dropped).

    Parameters
    ----------
    words : every word of the corpus, e.g. ``dllm.corpus.vocabulary()``.

    Returns
    -------
    PreTrainedTokenizerFast with ``mask_token``, ``eos_token``, ``pad_token``, ``unk_token`` set and
    ``chat_template`` (saved as ``chat_template.jinja`` by ``save_pretrained``).
    """
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, NEWLINE, *words]:
        if token and not token.isspace() or token == NEWLINE:
            vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t\r]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        mask_token="<mask>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<system>", "<user>", "<assistant>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
