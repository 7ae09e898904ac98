"""D2F (Discrete Diffusion Forcing) decoding: OURS, not SGLang 0.5.23's.

SGLang 0.5.23 serves no such algorithm, so traces decoded with it are in no SGLang server's units:
a bundle trained on them is refused by ``serve``, the plugin and the hook
(:func:`~dwise_predict.engine.algorithms.comparable_decoding`). It is here for one reason: Amin et
al. characterised dLLM serving under D2F (LLaDA-8B-Instruct with the D2F LoRA adapter) and found its
round counts on discrete tiers (178 + 29k, 11 levels, GSM8K, blocks of 32) and its latency 2.7 times
as variable as the base model's (CV 0.272 against 0.100); ``collect --algorithm D2F`` lets
``characterize`` measure both on any model.

The rule, as D2F's public code runs it (its ``block_add_threshold``, ``decoded_token_threshold`` and
``skip_threshold``) and as Amin et al. ran it (0.5, 0.9 and 1.0):

- A request's output is a pipeline of blocks of ``block_size`` tokens, the first starting right
  after the prompt. A **round** is one forward of the request over every block in flight at once,
  block-causally (a block sees the prompt, the blocks before it and itself).
- **Adding a block** (``add_threshold``, τ_add): at the start of a round a new all-mask block joins
  when the newest block's completion (the share of its positions already unmasked) is at least
  τ_add; at most one per round, none once an end-of-sequence token has been unmasked or the output
  budget's blocks are all in.
- **Activation** (``decode_threshold``, τ_decode): a block is *fully activated* once its
  predecessor's completion is at least τ_decode (the first block always is: its predecessor is the
  prompt). A fully activated block unmasks at least its most confident masked position each round;
  a block that is not waits.
- **Unmasking** (``confidence_threshold``, D2F's ``skip_threshold``): in every block in flight, the
  masked positions whose top-1 probability is strictly above it take their top-1 token. At 1.0
  (Amin et al.'s setting, D2F's default) that never happens, so a fully activated block unmasks
  exactly one position per round.

Why τ_decode gates activation rather than a token's confidence: Amin et al.'s text calls τ_decode
the confidence at which a token unmasks, but the code they ran passes it as D2F's
``decoded_token_threshold``, the completion that activates the next block; only that reading gives
their tier spacing. With one position per round, block k + 1 starts when block k has unmasked
⌈τ_decode · B⌉ positions, so n blocks take ⌈τ_decode · B⌉ · (n − 1) + B forwards: 29n + 3 at
B = 32, τ_decode = 0.9. Amin et al. count D2F's loop iterations, one more than its forwards (the
last finds nothing to do): 29n + 4, which is 178 at n = 6 and 468 at n = 16 (a 512-token budget),
their 11 levels. ``tests/test_d2f.py`` checks the arithmetic on a scripted model.

Where ours differs from D2F's code, and why:

- Tokens are greedy (the top-1, ties to the lowest position or id), as every SGLang rule here; Amin
  et al. sampled at temperature 0.2, which changes which tokens are drawn, not the round arithmetic.
- The mask token is never written back as a fill: D2F's code could write it and stall a block; a
  trained dLLM gives it no probability, so nothing changes there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dwise_predict.engine.algorithms import StepRule, _check_number
from dwise_predict.errors import ConfigError


class D2F(StepRule):
    """D2F's pipeline rule (see the module docstring): when a block joins, when it is fully
    activated, which positions each round unmasks. The loop that runs it is
    :mod:`dwise_predict.collectors.d2f`."""

    name = "D2F"
    DEFAULTS = {"add_threshold": 0.5, "decode_threshold": 0.9, "confidence_threshold": 1.0}

    def _validate(self) -> None:
        for key in ("add_threshold", "decode_threshold"):
            value = self.params[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"algorithm parameter {key} must be a number in (0, 1], got {value!r}")
        _check_number("confidence_threshold", self.params["confidence_threshold"], 0.0, 1.0)

    @property
    def signal_threshold(self) -> float:
        """The early signal ``frac_over_threshold`` counts positions above τ_decode (Amin et al.'s
        "fraction of tokens past the confidence threshold", τ_decode in their reading)."""
        return float(self.params["decode_threshold"])

    def step(self, ids, logits, prompt_mask, state, slots):
        raise NotImplementedError("D2F advances several blocks per forward: collectors.d2f runs it, not the "
                                  "one-block step loop")

    def adds_block(self, newest_completion: float) -> bool:
        """A new block joins behind a newest block this complete (a share in [0, 1])."""
        return newest_completion >= self.params["add_threshold"]

    def activates(self, predecessor_completion: float) -> bool:
        """A block whose predecessor is this complete is fully activated."""
        return predecessor_completion >= self.params["decode_threshold"]

    def unmask(self, ids: torch.Tensor, logits: torch.Tensor,
               fully_active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One round's unmasking of a request's ``m`` blocks in flight.

        ids : LongTensor (m, B), the blocks as this forward saw them.
        logits : (m, B, V) of that forward.
        fully_active : BoolTensor (m,), the blocks activated at the start of the round.

        Returns the blocks after the round (m, B) and which positions were unmasked (m, B).
        """
        masked = ids == self.mask_id
        probs = F.softmax(logits.float(), dim=-1)
        top = probs.index_fill(-1, torch.tensor([self.mask_id], device=probs.device), -1.0).argmax(dim=-1)
        confidence = torch.where(masked, probs.gather(-1, top.unsqueeze(-1)).squeeze(-1), float("-inf"))
        fill = confidence > self.params["confidence_threshold"]
        best = F.one_hot(confidence.argmax(dim=1), ids.shape[1]).bool() & masked
        fill |= best & (fully_active & ~fill.any(dim=1))[:, None]
        return torch.where(fill, top, ids), fill
