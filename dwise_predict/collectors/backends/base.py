"""The interface a model family implements so the decoding loop can drive it unchanged.

A backend owns a KV cache of ``n_slots`` slots, one request per slot. The decoder calls ``step`` once
per round with one row per active slot; a row is a chunk placed right after the slot's committed
tokens:

- a **prefill row**: one prompt block (``commit_len == n_valid``: its keys/values are kept);
- a **denoising row**: the current output block with its masked positions (``commit_len == 0``);
- a **denoising row carrying a commit**: ``[finished block, clean | current block]``
  (``n_valid == 2 * block``, ``commit_len == block``): the finished block's clean keys/values are
  computed and kept in the same forward, block-causally (the finished block does not see the one
  after it), and the current block is read from the window at ``out_start == block``.

Inside a row the committed part is one block and the rest another; everything already committed is
visible. A backend for a real dLLM (LLaDA2.x, SDAR, Dream …) implements the same ``step`` over its
own cache; the decoder never looks inside the model.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError

from dwise_predict.errors import ModelError
from dwise_predict.files import sha256_file
from dwise_predict.names import config_hash

# What transformers' loaders raise for a damaged or hostile model directory: truncated, empty or
# garbage weights, shapes that do not fit the config, a pickle refused by weights-only loading.
LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)


def check_device(device: str) -> torch.device:
    """``--device`` as a torch device that exists here; :class:`ModelError` otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ModelError(f"`device` {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"`device` {device}: this machine (or this torch build) has no CUDA device; use `device` cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelError(f"`device` {device}: only {torch.cuda.device_count()} CUDA device(s) here; pick another index")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"`device` {device}: only cpu and cuda devices are supported")
    return dev

# the dtype names of DecodingConfig.dtype, as torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepBatch:
    """One round's input: row r belongs to slot ``slots[r]``.

    slots : LongTensor (n,), distinct slot indices.
    input_ids : LongTensor (n, L), padded chunks (L = block or 2 * block).
    n_valid : LongTensor (n,), real tokens per row.
    commit_len : LongTensor (n,), leading tokens per row whose keys/values are committed.
    out_start : LongTensor (n,), first position of the ``window``-token window returned per row.
    window : tokens per returned window (the decoding block size).
    all_layers : also return every layer's hidden rows of the windows (``StepOutput.layers``); the
        decoder asks only in a round holding a request's first denoising forward under `collect --layers`.
    block_len : 0 (every SGLang algorithm): the committed part of a row is one block and the rest the
        next. Above 0 (D2F's pipeline rows, :mod:`dwise_predict.collectors.d2f`): a row is consecutive
        blocks of ``block_len`` tokens from its first token, each seeing the ones before it
        (block-causal), committed ones included.
    """

    slots: torch.Tensor
    input_ids: torch.Tensor
    n_valid: torch.Tensor
    commit_len: torch.Tensor
    out_start: torch.Tensor
    window: int
    all_layers: bool = False
    block_len: int = 0


@dataclass
class StepOutput:
    """logits (n, window, V) and final-layer hidden rows (n, window, H) of each row's window; when the
    batch asked for ``all_layers``, ``layers`` (n, num_hidden_layers + 1, window, H) in transformers'
    ``output_hidden_states`` order: embedding output, each layer's output, the last one after the final
    norm (so ``layers[:, -1]`` equals ``hidden``)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: torch.Tensor | None = None


@runtime_checkable
class BlockBackend(Protocol):
    """What the decoding loop needs from a block-diffusion model family.

    A backend that also answers ``StepBatch.all_layers`` (for `collect --layers`) sets
    ``num_hidden_layers``, its transformer layers (``StepOutput.layers`` then holds that many + 1
    entries); one without it is refused ``--layers`` before decoding.
    """

    name: str
    block_size: int  # the model's own block size (the decoding default)
    mask_token_id: int
    eos_token_ids: tuple[int, ...]  # every id that ends a request (SGLang stops on any of them)
    pad_token_id: int
    hidden_size: int
    vocab_size: int
    max_context: int  # prompt + output tokens one slot can hold
    tokenizer: Any  # a transformers tokenizer with a chat template, or None
    device: torch.device  # where step() wants its inputs and leaves its outputs

    def fingerprint(self) -> dict:
        """name, path, weights_sha256, config_hash, hidden_size, vocab_size (contract 1 manifest)."""

    def allocate(self, n_slots: int) -> None:
        """(Re)allocate an empty KV cache of ``n_slots`` slots."""

    def reset_slot(self, slot: int) -> None:
        """Forget the committed tokens of ``slot`` (a new request takes it)."""

    def step(self, batch: StepBatch) -> StepOutput:
        """One batched forward: every row processes one chunk against its slot's cache."""


def directory_fingerprint(model_dir: Path | None, name: str, config: dict, hidden_size: int,
                          vocab_size: int) -> dict:
    """The model fingerprint of contract 1 for a model loaded from ``model_dir``.

    ``weights_sha256`` hashes the sha256 of every ``*.safetensors`` file in name order (one file: its
    own sha256); ``config_hash`` is :func:`~dwise_predict.names.config_hash` of the config. Without a
    directory (an in-memory model) ``weights_sha256`` is None.
    """
    weights_sha256 = None
    if model_dir is not None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        digests = [sha256_file(f) for f in files]
        weights_sha256 = digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()
    return {
        "name": name,
        "path": None if model_dir is None else str(model_dir),
        "weights_sha256": weights_sha256,
        "config_hash": config_hash(config),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
    }
