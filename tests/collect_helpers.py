"""Small, randomly initialised model directories for the collect tests (built in seconds on CPU)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_dir(path: Path, seed: int = 0, hidden_size: int = 32, block_size: int = 4) -> Path:
    """A random tiny dLLM (2 layers) with the real tokenizer, saved like the shipped weights.

    At initialisation the logits are nearly flat, so every round would unmask exactly one token;
    scaling the LM head sharpens them and round counts vary per request (4-16 over 16 tokens at
    threshold 0.9), which is what the resume and merge tests should compare. The head is untied from
    the embeddings so that the scaling sharpens the output only.
    """
    from dwise_predict.dllm.train import TinyTrainConfig, build_model_and_tokenizer

    model, tokenizer = build_model_and_tokenizer(
        TinyTrainConfig(hidden_size=hidden_size, n_layers=2, n_heads=2, block_size=block_size,
                    max_position_embeddings=1024, seed=seed, tie_embeddings=False)
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(150.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_diffusion_gemma_dir(path: Path, seed: int = 0, canvas_length: int = 8, max_denoising_steps: int = 6) -> Path:
    """A random small ``DiffusionGemmaForBlockDiffusion`` (the real architecture) with a word tokenizer.

    The text config sets the MoE and layer-type fields explicitly and the vision tower is shrunk (see
    NOTES.md). At random weights the predictive entropy sits near log(vocab) and every canvas would
    run all ``max_denoising_steps``; scaling the (tied) embeddings sharpens the logits and the stopping
    rule is set to "mean entropy below 4 nats", so round counts vary per canvas (3-5 here).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<user>", "<model>"] + [chr(c) for c in range(33, 127)]
    words += [f"w{i}" for i in range(64)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("", "isolated")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")
    tokenizer.chat_template = (
        "<bos>{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<model>{% endif %}"
    )
    config = DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
            max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        ),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8),
        canvas_length=canvas_length, boi_token_id=250, eoi_token_id=251, image_token_id=252,
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # tied with the decoder embeddings
    model.generation_config.max_denoising_steps = max_denoising_steps
    model.generation_config.stability_threshold = 0
    model.generation_config.confidence_threshold = 4.0
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_masked_llama_dir(path: Path, seed: int = 0, block_size: int = 4) -> Path:
    """A random small Llama given a ``mask_token_id`` and ``block_size``: a stand-in for remote-code dLLMs.

    It exercises the generic block loop's mechanics (4-D block-causal masks, commits, hidden capture);
    its answers mean nothing.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from dwise_predict.dllm.corpus import vocabulary
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(vocabulary())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    config.mask_token_id = tokenizer.mask_token_id
    config.block_size = block_size
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
