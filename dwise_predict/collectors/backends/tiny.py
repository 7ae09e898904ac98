"""The decoding interface for the built-in tiny dLLM, loaded the way a real model is loaded."""

from __future__ import annotations

from pathlib import Path

from dwise_predict.collectors.backends.base import DTYPES, LOAD_ERRORS, StepBatch, StepOutput, directory_fingerprint
from dwise_predict.errors import ModelError
from dwise_predict.files import read_json_object


class TinyBackend:
    """``BlockBackend`` over a ``TinyDllmForBlockDiffusion`` (in memory, or loaded from a directory)."""

    def __init__(self, model, tokenizer=None, path: Path | None = None, name: str = "dwise-tiny-dllm") -> None:
        config = model.config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.path = path
        self.name = name
        self.architecture = (config.architectures or ["TinyDllmForBlockDiffusion"])[0]
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.eos_token_id = config.eos_token_id
        self.eos_token_ids = (config.eos_token_id,)
        self.pad_token_id = config.pad_token_id
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.n_layers
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.cache = None

    @property
    def device(self):
        """The model's device (read live: callers may move the model after loading)."""
        return self.model.device

    def fingerprint(self) -> dict:
        return directory_fingerprint(self.path, self.name, self.model.config.to_dict(), self.hidden_size,
                                     self.vocab_size)

    def allocate(self, n_slots: int) -> None:
        cache = self.cache
        if (cache is not None and cache.n_slots == n_slots and cache.k[0].device == self.device
                and cache.k[0].dtype == self.model.dtype):
            # the last call's cache, emptied: a fresh one zeroes its positions again as forwards reach them;
            # its stale entries are finite and masked out, as a reused slot's always are (TinyKVCache)
            cache.lengths.zero_()
            return
        # room for a two-block chunk written past the longest allowed context
        self.cache = self.model.allocate_cache(n_slots, self.max_context + 2 * self.block_size)

    def reset_slot(self, slot: int) -> None:
        self.cache.reset(slot)

    def step(self, batch: StepBatch) -> StepOutput:
        logits, hidden, layers = self.model.forward_step(
            self.cache, batch.slots, batch.input_ids, batch.n_valid, batch.commit_len,
            batch.out_start, window=batch.window, with_layers=batch.all_layers, block_len=batch.block_len)
        return StepOutput(logits=logits, hidden=hidden, layers=layers)


def load_tiny_backend(path: str | Path | None = None, dtype: str = "float32") -> TinyBackend:
    """Load the tiny dLLM from ``path`` (default: the shipped weights) via ``AutoModel.from_pretrained``.

    Raises
    ------
    ModelError
        The directory is missing, has no ``config.json``, or holds a model that is not a tiny dLLM
        (another architecture, or no mask token).
    """
    from transformers import AutoModel, AutoTokenizer

    from dwise_predict.dllm import TINY_MODEL_DIR, register

    model_dir = Path(path) if path is not None else TINY_MODEL_DIR
    config_file = model_dir / "config.json"
    if not model_dir.is_dir():
        hint = ("the built-in weights are not installed: run `dwise-predict dllm train-tiny`"
                if path is None else "pass a directory holding config.json and model.safetensors")
        raise ModelError(f"model directory {model_dir} does not exist; {hint}")
    if not config_file.is_file():
        raise ModelError(f"{model_dir} has no config.json: pass a directory saved with save_pretrained")
    config = read_json_object(config_file, ModelError, fix="re-save the model")
    if config.get("mask_token_id") is None:
        raise ModelError(f"{model_dir} is not a block-diffusion LM: its config has no mask_token_id")
    if config.get("model_type") != "dwise_tiny_dllm":
        raise ModelError(f"{model_dir} holds a {config.get('model_type')!r} model, not the tiny dLLM "
                         "(model_type 'dwise_tiny_dllm'): use the backend for that architecture")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    from transformers.utils import logging as hf_logging

    register()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 27-tensor model needs no "Loading weights" bar on stderr
    try:
        model = AutoModel.from_pretrained(model_dir, dtype=DTYPES[dtype])
    except LOAD_ERRORS as exc:
        raise ModelError(f"cannot load the model in {model_dir}: {exc}") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    if tokenizer is not None and tokenizer.mask_token_id != model.config.mask_token_id:
        raise ModelError(f"{model_dir}: tokenizer mask token {tokenizer.mask_token_id} differs from the "
                         f"config's mask_token_id {model.config.mask_token_id}: re-save both together")
    return TinyBackend(model, tokenizer, path=model_dir)
