"""Prompt features of the admission predictor: word count, newline count, prompt tokens.

``collect`` fills the ``words`` and ``newlines`` columns of contract 1 with :func:`count_words` and
:func:`count_newlines`, and ``prompt_tokens`` with the token count after the chat template; the
admission model, its ONNX export, the serving bundle and the simulator read them in the order of
:data:`FEATURE_NAMES`. :class:`PromptFeaturizer` computes the same three numbers from raw text at
admission time, fast enough for one request.

Standard library only: the serving side computes admission features from prompt text with numpy
and onnxruntime alone. The feature matrix of a whole request table (pandas) is
:func:`dwise_predict.admission.features.prompt_features`.
"""

from __future__ import annotations

from array import array

FEATURE_NAMES = ("words", "newlines", "prompt_tokens")


def count_words(text: str) -> int:
    """Whitespace-separated words in ``text`` (``str.split()`` with no argument)."""
    return len(text.split())


def count_newlines(text: str) -> int:
    """Newline characters (``\\n``) in ``text``."""
    return text.count("\n")


class PromptFeaturizer:
    """Raw prompt text -> the three admission features, for one request at a time.

    The chat template is rendered once around a placeholder at construction; a call then tokenises
    only the user text and adds the template's fixed token count. This equals
    ``len(apply_chat_template(...))`` whenever the template wraps the message between special tokens
    (so no merge crosses the boundary), which holds for the chat templates of the dLLMs we target;
    ``tests/test_train_admission.py`` checks it on the built-in tokenizer.

    Parameters
    ----------
    tokenizer : a transformers tokenizer, or None for a whitespace tokeniser (tokens = words; say so
        wherever its timings are reported). Without a chat template the text's own tokens count.
    """

    _PLACEHOLDER = "\u2063PROMPT\u2063"

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.template_tokens_ = 0
        self._wrapper: tuple[list[int], list[int]] | None = None  # the template's ids before and after the text
        # the Rust tokenizer directly where there is one: skips the Python wrapper's overhead
        self._encode = getattr(getattr(tokenizer, "backend_tokenizer", None), "encode", None)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": self._PLACEHOLDER}], tokenize=False, add_generation_prompt=True
            )
            prefix, _, suffix = rendered.partition(self._PLACEHOLDER)
            self._wrapper = (self._ids(prefix), self._ids(suffix))
            self.template_tokens_ = len(self._wrapper[0]) + len(self._wrapper[1])
        # the same as SGLang's ``Req`` holds ids: compared to a slice of one without a copy to a list
        self._wrapper_q = tuple(array("q", ids) for ids in self._wrapper) if self._wrapper else None

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        if self._encode is not None:
            return list(self._encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _count(self, text: str) -> int:
        return len(self._ids(text))

    def prompt_tokens(self, text: str) -> int:
        """Tokens of ``text`` after the chat template (words when no tokenizer was given)."""
        if self.tokenizer is None:
            return count_words(text)
        return self.template_tokens_ + self._count(text)

    def __call__(self, text: str) -> tuple[float, float, float]:
        """(words, newlines, prompt tokens) of one raw prompt."""
        return float(count_words(text)), float(count_newlines(text)), float(self.prompt_tokens(text))

    def user_span(self, input_ids) -> tuple[int, int] | None:
        """(start, stop) of the user's ids inside ``input_ids``, a model input as a server holds it
        (the chat template applied to one user message): what is left when the template's own ids
        are stripped from both ends. None where the ids are not one user message in this template
        (a system prompt, several turns) or there is no template to strip."""
        if self._wrapper is None:
            return None
        (prefix, suffix), n = self._wrapper, len(input_ids)
        if n < len(prefix) + len(suffix):
            return None
        head, tail = input_ids[:len(prefix)], input_ids[n - len(suffix):]
        if isinstance(head, array):
            if (head, tail) != self._wrapper_q:
                return None
        elif list(head) != prefix or list(tail) != suffix:
            return None
        return len(prefix), n - len(suffix)

    def user_text(self, input_ids) -> str | None:
        """The user's text inside ``input_ids`` (:meth:`user_span`), decoded. ``collect`` counts
        words and newlines over the user's text, not over the template's markup, so a server must
        too. None where there is no user message to strip the template from."""
        span = self.user_span(input_ids)
        if span is None:
            return None
        return self.tokenizer.decode(list(input_ids[span[0]:span[1]]))


def load_tokenizer(model: dict):
    """The tokenizer a trace manifest's model fingerprint names, or None when none is available.

    Looks at the fingerprint's ``path`` (a local model directory), then at the built-in tiny model's
    weights directory when the fingerprint names it. Never downloads.
    """
    from pathlib import Path

    candidates = []
    if model.get("path"):
        candidates.append(Path(model["path"]))
    builtin = Path(__file__).resolve().parent.parent / "dllm" / "weights"
    if str(model.get("name", "")).startswith("dwise-tiny") or model.get("builtin"):
        candidates.append(builtin)
    for directory in candidates:
        if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            # AutoTokenizer reads config.json too, and a model type it has no class for (the tiny
            # dLLM's, unless its backend registered it) draws a warning that concerns models only
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            except Exception:  # a broken or foreign tokenizer: fall back to whitespace, the caller says so
                return None
            finally:
                hf_logging.set_verbosity(verbosity)
    return None
