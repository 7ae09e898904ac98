"""The built-in tiny block-diffusion LM: model, tokenizer, training recipe and shipped weights.

Importing this package registers the model with the transformers Auto classes, so
``AutoModel.from_pretrained(TINY_MODEL_DIR)`` works in a fresh process.
"""

from __future__ import annotations

from pathlib import Path

from dwise_predict.dllm.model import (
    TinyDllmConfig,
    TinyDllmForBlockDiffusion,
    block_ids_for,
    register,
)

TINY_MODEL_DIR = Path(__file__).parent / "weights"


register()

__all__ = [
    "TINY_MODEL_DIR",
    "TinyDllmConfig",
    "TinyDllmForBlockDiffusion",
    "block_ids_for",
    "register",
]
