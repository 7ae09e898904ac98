"""The hook's admission features (``launcher.RequestFeatures``): from token ids with no decode on the
scheduler thread, and from the tokenizer SGLang's scheduler loads (its ``--revision`` and
``--trust-remote-code``, issue 56)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import sglang_reference
from transformers import AutoTokenizer

from dwise_predict.dllm import TINY_MODEL_DIR
from dwise_predict.features.prompt import count_newlines, count_words
from dwise_predict.serving import launcher
from dwise_predict.serving.launcher import RequestFeatures, option_fields


class CountedDecodes:
    """A tokenizer whose ``decode`` calls are counted (everything else is the wrapped one's)."""

    def __init__(self, tokenizer):
        self.wrapped, self.decodes = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def __len__(self):
        return len(self.wrapped)

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.wrapped.decode(*args, **kwargs)


def test_admission_features_decode_nothing_and_a_recording_keeps_the_prompt():
    from dwise_predict.collectors.workloads import load_workload

    tokenizer = CountedDecodes(AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR)))
    admission = launcher._features(tokenizer)
    recording = launcher._features(tokenizer, keep_text=True)
    built = tokenizer.decodes
    requests = load_workload("tiny-default", seed=0).requests
    for request in requests:
        ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = (count_words(request.prompt), count_newlines(request.prompt), len(ids))
        req = SimpleNamespace(origin_input_ids=ids)
        assert admission(req) == want and admission(req) == want
    assert tokenizer.decodes == built  # not one decode per arrival (the tables were built with some)
    for request in requests[:20]:
        ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        req = SimpleNamespace(origin_input_ids=ids)
        assert recording(req)[0] == count_words(request.prompt) and recording(req) is req._dwise_features
        assert req._dwise_text.split() == request.prompt.split()  # the traces' prompt column, for the recorder
    assert tokenizer.decodes == built + 20  # one per recorded request, kept on it
    assert RequestFeatures(None)(SimpleNamespace(origin_input_ids=[5, 6, 7])) == (0, 0, 3)


def test_the_tokenizer_is_loaded_as_sglangs_scheduler_loads_it(monkeypatch):
    """SGLang 0.5.23's scheduler loads its tokenizer with ``trust_remote_code`` and ``revision`` from
    its server arguments (``managers/scheduler.py``: ``get_tokenizer(tokenizer_path, ...,
    trust_remote_code=..., revision=...)``); the hook's goes through the same two."""
    loaded = []

    def from_pretrained(path, **kwargs):
        loaded.append((path, kwargs))
        return "tokenizer"

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    assert launcher._tokenizer("org/model", "v2", True) == "tokenizer"
    assert loaded == [("org/model", {"revision": "v2", "trust_remote_code": True})]
    assert launcher._tokenizer(None, "v2", True) is None
    names = {f.name for f in option_fields()}
    assert "tokenizer" in names and not names & {"tokenizer_revision", "trust_remote_code"}  # SGLang's flags set them


@pytest.fixture
def sglang_entrypoints(monkeypatch):
    if not sglang_reference.available():
        pytest.skip(sglang_reference.SKIP_REASON)
    from fakes import sglang_launch

    return sglang_launch.entrypoints(monkeypatch)


def test_serve_resolves_the_tokenizers_revision_and_trust_from_sglangs_arguments(tmp_path, capsys, sglang_entrypoints):
    from fakes.sglang_launch import write_model

    from dwise_predict.cli.app import main

    model = write_model(tmp_path / "llada2", architecture="LLaDA2MoeModelLM", hidden_size=2048)
    server = ["--model-path", str(model), "--dllm-algorithm", "LowConfidence", "--max-running-requests", "1024"]
    hook = ["serve", "--record", str(tmp_path / "t"), "--dry-run"]
    assert main([*hook, "--", *server, "--revision", "v2", "--trust-remote-code"]) == 0
    out = json.loads(capsys.readouterr().out)["hook"]
    assert (out["tokenizer"], out["tokenizer_revision"], out["trust_remote_code"]) == (str(model), "v2", True)
    assert main([*hook, "--", *server]) == 0  # SGLang's defaults
    out = json.loads(capsys.readouterr().out)["hook"]
    assert (out["tokenizer_revision"], out["trust_remote_code"]) == (None, False)
    # a tokenizer of the user's own: the model's revision is not its; trusting remote code stays the server's call
    assert main([*hook, "--tokenizer", "org/other", "--", *server, "--revision", "v2", "--trust-remote-code"]) == 0
    out = json.loads(capsys.readouterr().out)["hook"]
    assert (out["tokenizer"], out["tokenizer_revision"], out["trust_remote_code"]) == ("org/other", None, True)
