"""Contract 1's optional first-round tensors (`collect --layers`): their names and manifest record.

A collection made with ``--layers`` keeps, next to ``first_round`` and ``prompt_last``, the first
denoising forward of each request's first output block (the rows ``first_round`` pools) at several
layers and poolings, in ``hidden.safetensors``:

- ``first_round.layer{L}.mean`` ``[N, H]`` — the mean of the block's rows at layer ``L``;
- ``first_round.layer{L}.last`` ``[N, H]`` — the block's last row at layer ``L``;
- ``first_round.layer{L}.positions`` ``[N, block_size, H]`` — every row of the block at layer ``L``.

Layer indices follow transformers' ``output_hidden_states`` tuple: ``0`` is the embedding output
(the first layer's input), ``L`` the output of transformer layer ``L``, and the last index
(``num_hidden_layers``) the final hidden state after the final norm — what the LM head reads and
what ``first_round`` pools, so ``first_round.layer{last}.mean`` equals ``first_round``. Names always
carry the concrete index (``-1`` is resolved when collecting).

The manifest records the spec under :data:`MANIFEST_KEY` (absent in a default collection)::

    "hidden_extra": {"layers": [0, 4], "pooling": ["mean", "last"], "final_layer": 4,
                     "tensors": ["first_round.layer0.mean", ...]}

Only research reads these: the serving hook and recording mode keep ``first_round`` alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST_KEY = "hidden_extra"
POOLINGS = ("mean", "last", "positions")  # canonical order: names and manifests list poolings in it
_NAME = re.compile(r"^first_round\.layer(\d+)\.(mean|last|positions)$")


def tensor_name(layer: int, pooling: str) -> str:
    """``first_round.layer{layer}.{pooling}``, the tensor's name in ``hidden.safetensors``."""
    return f"first_round.layer{layer}.{pooling}"


def parse_tensor_name(name: str) -> tuple[int, str] | None:
    """``(layer, pooling)`` of a name written by :func:`tensor_name`, or None for any other name."""
    match = _NAME.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))


@dataclass(frozen=True)
class HiddenExtra:
    """Which layers and poolings a collection keeps (resolved: concrete, sorted, distinct layers).

    layers : layer indices, 0 = embedding output, ``final_layer`` = the LM head's input.
    poolings : a subset of :data:`POOLINGS`, in that order.
    final_layer : the model's last index (its number of transformer layers).
    """

    layers: tuple[int, ...]
    poolings: tuple[str, ...]
    final_layer: int

    def names(self) -> list[str]:
        """Every tensor name this spec writes, layer by layer."""
        return [tensor_name(layer, pooling) for layer in self.layers for pooling in self.poolings]

    def to_manifest(self) -> dict:
        return {"layers": list(self.layers), "pooling": list(self.poolings), "final_layer": self.final_layer,
                "tensors": self.names()}
