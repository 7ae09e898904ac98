"""The serving engine's semantics: what a request costs in the units SGLang 0.5.23 runs.

The serving engine is the source of truth (docs/backends.md, "The engine's units"). This package
is the one place that says how SGLang's dLLM path lays out a request, what counts as a round, and
how each decoding algorithm advances a block; the decoder (``collectors``), the simulator and the
serving hook all read it from here, and ``tests/test_engine_conformance.py`` checks it against
SGLang's own code from its wheel.

- :mod:`.layout` — block layout of a prompt (full prompt blocks, leftover tokens under the prompt
  mask in the first output block), prefill rounds with and without a cached prefix, the output
  positions of each block, which hidden rows the first denoising round pools, how a request
  ends after a block (EOS or budget), and which of its tokenizer's ids stop it.
- :mod:`.algorithms` — per-algorithm step rules mirroring ``srt/dllm/algorithm/*.py`` by name,
  parameters and defaults, and the forward-pass accounting of SGLang's loop.
- :mod:`.reference` — the SGLang names we mirror (module, class, attribute, default), in one list
  that the conformance test checks against the wheel.

The package root exports the layout only (standard library: the serving side uses it without
torch); the step rules are in :mod:`.algorithms`, which needs torch.
"""

from dwise_predict.engine.layout import (
    ENGINE,
    BlockLayout,
    block_layout,
    finish_after_block,
    prefill_rounds,
    tokenizer_stop_ids,
)

__all__ = ["ENGINE", "BlockLayout", "block_layout", "finish_after_block", "prefill_rounds", "tokenizer_stop_ids"]
