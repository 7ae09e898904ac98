"""Model families the decoder drives (the interface is ``base``) and what `collect --model` can name.

``load_backend(model)`` resolves

- ``tiny`` → the built-in tiny dLLM with its shipped weights (``dwise_predict/dllm/weights``);
- a local directory whose ``config.json`` has ``model_type`` ``dwise_tiny_dllm`` → the tiny backend;
- a local DiffusionGemma directory (``DiffusionGemmaForBlockDiffusion``) → :mod:`.diffusion_gemma`,
  which runs the model's own entropy-bound ``generate`` instrumented (verified on a randomly
  initialised small config of the real architecture);
- any other local directory of a mask-token dLLM (LLaDA2.x, SDAR, Dream, ... with
  ``trust_remote_code``) → :mod:`.block_loop`, the threshold block loop over ``AutoModel`` (see that
  module and ``docs/backends.md`` for what is verified and what is untested);
- anything else (a missing directory, a hub name, an autoregressive model) → :class:`ModelError`.
"""

from __future__ import annotations

from pathlib import Path

from dwise_predict.collectors.backends.base import check_device
from dwise_predict.errors import ModelError
from dwise_predict.files import read_json_object

TINY = "tiny"
TINY_MODEL_TYPE = "dwise_tiny_dllm"


def load_backend(model: str, trust_remote_code: bool = False, dtype: str = "float32", device: str = "cpu",
                 block_size: int | None = None):
    """Load the backend named by ``model`` (``tiny`` or a local directory) for decoding.

    ``block_size`` (``--block-size``) is only consulted where the model does not declare its own.

    Returns
    -------
    A backend with ``tokenizer``, ``hidden_size``, ``vocab_size``, ``block_size`` and ``fingerprint()``
    (contract 1's model fingerprint, see :func:`.base.directory_fingerprint`). Backends that run
    their own decoding loop set ``runs_own_loop`` and provide ``decode_requests``.
    """
    from dwise_predict.dllm import TINY_MODEL_DIR

    check_device(device)
    path = TINY_MODEL_DIR if model == TINY else Path(model).expanduser()
    config = read_config(path, model)
    # transformers draws its own progress bar while loading weights; ours owns stderr.
    from transformers.utils import logging

    logging.disable_progress_bar()
    if config.get("model_type") == TINY_MODEL_TYPE:
        from dwise_predict.collectors.backends.tiny import load_tiny_backend

        backend = load_tiny_backend(None if model == TINY else path, dtype=dtype)
        backend.model.to(device)
        return backend
    from dwise_predict.collectors.backends.diffusion_gemma import DiffusionGemmaBackend, is_diffusion_gemma

    if is_diffusion_gemma(config):
        return DiffusionGemmaBackend(path, dtype=dtype, device=device)
    from dwise_predict.collectors.backends.block_loop import load_block_loop_backend

    return load_block_loop_backend(path, config, trust_remote_code=trust_remote_code, dtype=dtype, device=device,
                                   block_size=block_size)


def read_config(path: Path, model: str) -> dict:
    """Parse ``path/config.json``; raise :class:`ModelError` saying what to do when it is missing."""
    if not path.exists():
        hint = (
            " (nothing is downloaded at run time: fetch it first, e.g. `hf download REPO --local-dir DIR`)"
            if "/" in model and not model.startswith(("/", ".", "~"))
            else ""
        )
        raise ModelError(f"no model directory at {model}{hint}; pass `model` tiny or a local model directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: it is not a transformers model directory")
    return read_json_object(path / "config.json", ModelError, fix="re-save the model (save_pretrained)")
