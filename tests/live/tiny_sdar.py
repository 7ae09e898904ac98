"""A tiny random SDAR checkpoint and a word-level tokenizer, written at test time for SGLang's CPU server.

SGLang 0.5.23 serves a dLLM only for the architectures its ``srt/dllm/config.py`` names; SDAR
(``SDARForCausalLM``, a Qwen3 body) is the smallest: block 4, mask id 151,669, so the vocabulary must
hold that id. Weights are random bf16 from a fixed seed (nothing is read from a hub): no guess of
the model is ever confident, so LowConfidence unmasks one token per forward and an output block
takes one forward per mask and one more (``workload.expected_rounds_per_block``); the greedy output
of the tests' prompts never meets EOS (one id of 151,680). The tokenizer maps the word ``w<i>`` to
id ``i``: a prompt of ``n`` such words is ``n`` tokens, with no special token added.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 151_680
HIDDEN = 64
BLOCK = 4  # SDAR's dLLM block (srt/dllm/config.py)
MASK_ID = 151_669
UNK_ID, EOS_ID = 0, 1
SPECIAL = {UNK_ID: "<unk>", EOS_ID: "<eos>", MASK_ID: "<|MASK|>"}


def words(ids) -> str:
    """The prompt text whose tokens are ``ids`` (each an ordinary word id, not a special one)."""
    return " ".join(f"w{int(i)}" for i in ids)


def write_tokenizer(out: Path) -> None:
    """A ``PreTrainedTokenizerFast`` (``tokenizer.json`` + its config) of :data:`VOCAB` words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[UNK_ID]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with a space, as they came in
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=SPECIAL[UNK_ID], eos_token=SPECIAL[EOS_ID],
                                        pad_token=SPECIAL[EOS_ID], mask_token=SPECIAL[MASK_ID])
    tokenizer.save_pretrained(str(out))


def write_model(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint (``config.json`` + ``model.safetensors``) and the tokenizer to ``out``.

    Every parameter is drawn from one generator seeded with ``seed`` in name order (norm weights 1):
    the same seed gives the same bytes whatever transformers initialises by default."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.save_pretrained(str(out))
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["architectures"] = ["SDARForCausalLM"]  # SGLang picks its model class (and the dLLM's block) by this name
    saved["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(saved, indent=2))
    write_tokenizer(out)
    return out
