"""Which fields of a manifest's ``model`` and ``decoding`` blocks decide compatibility.

One home for the names that traces and bundles must agree on: the key sets that the trace store (may two collections be merged or resumed into one
another?) and the serving bundle (was this predictor trained for the served model?) compare.
``path`` and ``name`` are left out on purpose: the same weights may sit in different directories
under different names on different machines. Standard library only (the serving side imports it).
"""

from __future__ import annotations

# the weights and architecture; hidden_size follows from config_hash, but a server may know only it
MODEL_KEYS = ("weights_sha256", "config_hash", "hidden_size")
# every decoding field that changes the recorded rounds (the batch size does not); ``engine`` names
# the serving engine whose units the rounds are in
DECODING_KEYS = ("algorithm", "algorithm_config", "block_size", "budget", "dtype", "params", "engine")
# what a predictor bundle must match: the algorithm, its parameters, the block size and the engine
# set the round units; the output budget is an input of the refinement predictor, so a bundle serves
# any budget, and the served dtype is the server's business
BUNDLE_DECODING_KEYS = ("algorithm", "algorithm_config", "block_size", "engine")
# the first denoising round's early signals: request columns of a trace (contract 1) and, in this
# order, the columns of the refinement graph's ``early_signals`` input (contract 2)
EARLY_SIGNALS = ("frac_over_threshold", "mean_confidence", "mean_entropy", "end_probability")
# the pooled hidden states the refinement graph takes, in this order (its first two inputs, each
# [B, hidden_size]; refine.json ``hidden_states``): the first denoising forward's block rows and the last
# prompt block's rows (bundle schema 5; trace tensors of the same names, contract 1)
HIDDEN_STATES = ("first_round", "prompt_last")
# how the refinement graph takes prompt length and budget: log(1 + n) / log(1 + norm) (refine.json and
# bundle.json inputs.refine ``length_scale``; bundle schema 3, see survival.network.refine_input)
LENGTH_SCALE = "log1p"


def identity(section: dict | None, keys: tuple[str, ...]) -> dict:
    """``{key: section.get(key)}`` for ``keys`` (missing keys as None)."""
    section = section or {}
    return {key: section.get(key) for key in keys}


# what a loaded model config says about the loading, not the model: where it was read from
# (``_name_or_path``: the same weights under another path, relative or copied, are the same model), the
# library version, the dtype it was loaded in (a decoding setting, compared apart)
LOAD_KEYS = ("_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype")


def config_hash(config: dict) -> str:
    """A model fingerprint's ``config_hash``: the sha256 of a model config (``PretrainedConfig.to_dict()``)
    as canonical JSON, without :data:`LOAD_KEYS`. What ``collect`` records and what the launcher
    compares a bundle's against, for the model it is about to serve."""
    import hashlib
    import json

    kept = {key: value for key, value in config.items() if key not in LOAD_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()
