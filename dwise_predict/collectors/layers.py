"""`collect --layers` / `--pooling`: read the request, resolve it against a model, pool a forward's layers.

Names, index convention and the manifest record are contract 1's (:mod:`dwise_predict.traces.hidden_extra`):
layer 0 is the embedding output, the last index (``-1``) the final hidden state the LM head reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dwise_predict.errors import ConfigError
from dwise_predict.traces.hidden_extra import POOLINGS, HiddenExtra, tensor_name

DEFAULT_POOLING = ("mean",)


@dataclass(frozen=True)
class LayerRequest:
    """What the user asked for, before a model is loaded: layer indices as given (negative ones count
    from the end, as in Python) and poolings in :data:`POOLINGS` order."""

    layers: tuple[int, ...]
    poolings: tuple[str, ...]


def parse_layer_request(layers: str | Sequence[int] | None,
                        pooling: str | Sequence[str] | None = None) -> LayerRequest | None:
    """``--layers 0,2,-1`` and ``--pooling mean,last,positions`` (default ``mean``) as a
    :class:`LayerRequest`; None when no layers are asked for. Raises :class:`ConfigError` naming the flag."""
    if layers is None:
        if pooling is not None:
            raise ConfigError("`pooling` needs `layers` (e.g. `layers` 0,-1 `pooling` mean,last)")
        return None
    items = [s.strip() for s in layers.split(",")] if isinstance(layers, str) else [str(i) for i in layers]
    try:
        indices = tuple(int(s) for s in items)
    except ValueError:
        raise ConfigError(f"`layers` takes comma-separated layer indices (e.g. 0,2,-1), got {layers!r}") from None
    if not indices:
        raise ConfigError("`layers` needs at least one layer index (e.g. `layers` -1)")
    names = DEFAULT_POOLING if pooling is None else (
        [s.strip() for s in pooling.split(",")] if isinstance(pooling, str) else list(pooling))
    unknown = [p for p in names if p not in POOLINGS]
    if unknown or not names:
        raise ConfigError(f"`pooling` {','.join(unknown) or pooling!r}: choose from {', '.join(POOLINGS)}")
    return LayerRequest(indices, tuple(p for p in POOLINGS if p in names))


def resolve_layers(request: LayerRequest | None, backend) -> HiddenExtra | None:
    """The request against ``backend``'s layers: concrete, sorted, distinct indices.

    Raises :class:`ConfigError` for an index out of range (naming the valid range) or a backend that
    cannot return every layer of its first denoising forward (one that runs its own decoding loop).
    """
    if request is None:
        return None
    name = getattr(backend, "name", "the model")
    if getattr(backend, "runs_own_loop", False) or getattr(backend, "num_hidden_layers", None) is None:
        raise ConfigError("`layers`: this model decodes with its own loop, which exposes only the final layer of the "
                          "first round: drop `layers`")
    last = int(backend.num_hidden_layers)
    bad = [i for i in request.layers if not -(last + 1) <= i <= last]
    if bad:
        raise ConfigError(f"`layers` {','.join(map(str, bad))}: out of range; {name} has layers 0..{last} "
                          f"(0 = embedding output, {last} or -1 = the final hidden state the LM head reads)")
    layers = sorted({i % (last + 1) for i in request.layers})
    return HiddenExtra(tuple(layers), request.poolings, last)


def pool_first_round(states: torch.Tensor, spec: HiddenExtra) -> dict[str, np.ndarray]:
    """The tensors of one request's first denoising forward.

    Parameters
    ----------
    states : (num_hidden_layers + 1, block, H), every layer's rows of the first output block (the rows
        ``first_round`` pools, leftover prompt rows included).

    Returns
    -------
    tensor name -> float32 array: (H,) for ``mean`` and ``last``, (block, H) for ``positions``.
    """
    out = {}
    for layer in spec.layers:
        rows = states[layer].float()  # (block, H)
        pooled = {"mean": rows.mean(0), "last": rows[-1], "positions": rows}  # mean as first_round is pooled
        for pooling in spec.poolings:
            out[tensor_name(layer, pooling)] = pooled[pooling].cpu().numpy().astype(np.float32)
    return out
