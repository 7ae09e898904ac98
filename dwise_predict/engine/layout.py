"""How SGLang 0.5.23's dLLM path lays out one request, and what its prompt costs.

Read from ``srt/dllm/mixin/req.py`` (``_init_fill_ids_for_dllm``, ``determine_dllm_phase``) and
``srt/managers/schedule_policy.py`` (``_get_dllm_extend_len``: a KV-keeping algorithm extends each
request by at most one block per forward):

- A prompt of ``n`` tokens holds ``n // block_size`` **full prompt blocks**. Each is one prefill
  forward (the request's ``STAGING_PREFILL`` / ``INCOMING_PREFILL`` phase), so the prompt work is
  ``P = n // block_size`` forwards, less the full blocks a cached prefix already covers.
- The ``n % block_size`` **leftover prompt tokens** open the first output block: its input is
  ``[leftover prompt | masks]`` and the leftover positions are held by the prompt mask (never
  unmasked, never emitted). That block therefore emits only ``block_size - leftover`` tokens; every
  later output block emits ``block_size``.
- The **first denoising round** is the first forward over that first output block. The serving hook
  sees the final-layer rows of the whole block there (fixed shape, CUDA-graph safe), so
  ``first_round_hidden`` pools all ``block_size`` rows, leftover prompt rows included.
- A request finishes after the block in which an EOS is emitted, or once its output reaches the
  budget (``max_new_tokens``): :func:`finish_after_block`, read from ``srt/managers/schedule_batch.py``
  (``Req.update_finish_state``, which ``srt/dllm/mixin/scheduler.py`` calls after every committed block).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

ENGINE = "sglang==0.5.23"  # the engine whose units traces are in (recorded in every manifest)
# Turn-final markers SGLang stops on wherever a checkpoint's tokenizer holds them, EOS metadata or not
# (``srt/utils/hf_transformers/common.py``: ``_ADDITIONAL_STOP_TOKEN_TEXTS``)
ADDITIONAL_STOP_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


@dataclass(frozen=True)
class BlockLayout:
    """Where a prompt of ``prompt_tokens`` tokens sits in blocks of ``block_size``.

    prompt_blocks : full prompt blocks, each one prefill forward without a prefix cache.
    leftover : prompt tokens at the start of the first output block (under the prompt mask).
    first_block_outputs : output positions of the first output block (``block_size - leftover``).
    """

    prompt_tokens: int
    block_size: int

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    @property
    def leftover(self) -> int:
        return self.prompt_tokens % self.block_size

    @property
    def first_block_outputs(self) -> int:
        return self.block_size - self.leftover

    def output_start(self, block_index: int) -> int:
        """First emitted position inside output block ``block_index`` (0-based)."""
        return self.leftover if block_index == 0 else 0

    def max_output_blocks(self, budget: int) -> int:
        """Output blocks that reach ``budget`` tokens when no EOS comes first."""
        beyond_first = max(0, budget - self.first_block_outputs)
        return 1 + -(-beyond_first // self.block_size)


def block_layout(prompt_tokens: int, block_size: int) -> BlockLayout:
    """The layout of a prompt; refuses sizes no engine could serve."""
    if prompt_tokens < 1 or block_size < 1:
        raise ValueError(f"need prompt_tokens >= 1 and block_size >= 1, got {prompt_tokens}, {block_size}")
    return BlockLayout(prompt_tokens, block_size)


def prefill_rounds(prompt_tokens: int, block_size: int, cached_prefix: int = 0) -> int:
    """P: the prefill forwards SGLang runs for a prompt whose first ``cached_prefix`` tokens are cached.

    The radix cache hands a dLLM request a prefix that ends on a block boundary
    (``_update_block_offset_for_dllm`` asserts it); a cached prefix covering every full prompt block
    leaves no prefill at all, and the request starts in its decode phase.
    """
    cached_blocks = max(0, cached_prefix) // block_size
    return max(0, prompt_tokens // block_size - cached_blocks)


def routing_block_size_problem(checkpoint_config: dict, block_size: int) -> str | None:
    """Why SGLang refuses to serve a checkpoint (``checkpoint_config``: its config.json) at
    ``block_size``, or None. A checkpoint that routes experts per block (``expert_capacity``: LLaDA2)
    runs only at its own ``block_size`` (``DllmConfig.from_server_args``)."""
    own = checkpoint_config.get("block_size")
    if checkpoint_config.get("expert_capacity") is not None and block_size != own:
        return (f"its experts are routed per block (expert_capacity in config.json), so SGLang serves it only at "
                f"the checkpoint's block_size {own}, not {block_size}")
    return None


def tokenizer_stop_ids(tokenizer) -> set[int]:
    """The ids a request stops on through its tokenizer, beside the model config's EOS ids
    (``Req._check_token_based_finish``): the tokenizer's ``eos_token_id`` and its
    ``additional_stop_token_ids`` — SGLang's tokenizers carry them
    (``attach_additional_stop_token_ids``); for any other, the ids of :data:`ADDITIONAL_STOP_TEXTS`
    in its added vocabulary, as that function finds them."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if hasattr(tokenizer, "additional_stop_token_ids"):
        extra = tokenizer.additional_stop_token_ids or ()
    else:
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        extra = [added[text] for text in ADDITIONAL_STOP_TEXTS if text in added]
    return ids | {int(i) for i in extra}


def finish_after_block(emitted_before: int, block_tokens: list[int], budget: int,
                       eos_ids: Collection[int]) -> tuple[str, int] | None:
    """How a request ends after committing ``block_tokens`` (the block's emitted tokens) behind
    ``emitted_before`` earlier output tokens: ``(finish, output_tokens)``, or None while it goes on.

    SGLang checks the new tokens for an EOS (any of the model's ``eos_ids``) before it checks the
    length, and its finished length counts the EOS: the first EOS, at output position ``p``, ends the request with finish ``"eos"`` when
    ``p + 1 <= budget``; past that, ``_cap_finished_len_at_max_new_tokens`` demotes it to a length
    finish at the budget (a block can run past the budget, and its EOS with it). Without an EOS the
    request ends once its output holds ``budget`` tokens (finish ``"budget"``). ``output_tokens``
    counts what the client receives before the EOS: ``p``, or ``budget``.
    """
    stop = next((i for i, token in enumerate(block_tokens) if token in eos_ids), None)
    if stop is not None:
        position = emitted_before + stop
        return ("eos", position) if position + 1 <= budget else ("budget", budget)
    if emitted_before + len(block_tokens) >= budget:
        return "budget", budget
    return None
