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


def load_tiny_model(path: str | Path | None = None, dtype: str = "float32") -> TinyDllmForBlockDiffusion:
    """Load the tiny dLLM (shipped weights by default) through ``AutoModel.from_pretrained``.

    Raises ``ModelError`` when the directory is missing or holds no tiny dLLM.
    """
    from dwise_predict.collectors.backends.tiny import load_tiny_backend

    return load_tiny_backend(path, dtype=dtype).model


register()

__all__ = [
    "TINY_MODEL_DIR",
    "TinyDllmConfig",
    "TinyDllmForBlockDiffusion",
    "block_ids_for",
    "load_tiny_model",
    "register",
]
