"""Step rules of SGLang 0.5.23's dLLM algorithms, and the forward accounting of its loop.

Each rule mirrors one class of ``sglang/srt/dllm/algorithm/`` by name, parameters and defaults, and
advances a batch of blocks by one denoising step exactly as that class's ``step`` does (same
comparisons, same tie-breaking ops), so the same logits give the same unmasking decisions, edits and
done flags; ``tests/test_engine_conformance.py`` checks this against the wheel's code.

What a round is (``DllmAlgorithm._run_sync``): the engine runs a forward, then asks the rule whether
the block is done; if not, it steps (fills or edits positions) and runs the next forward. A rule
decides *done* from the forward it has just seen:

- ``LowConfidence`` says done when the forward's input held no masked position. Its KV is kept, so
  the block's last fill must be persisted by one more forward: a block filled in r steps costs
  r + 1 forwards.
- ``JointThreshold`` says done when a step would change nothing (or the post-edit budget is spent);
  that forward already holds the final tokens' KV.

The engine caps a block at ``max_steps(block_size)`` steps; the forward after the last allowed step
ends the block whatever it holds (:func:`forwards_exhausted`). We apply that cap per request, as the
synchronous loop does for a batch of one; ``--dllm-fdfo`` has no cap (see ``docs/backends.md``).

Rules work on per-slot state tensors so a batch whose rows come and go (slot refill) steps in one
vectorised call: ``new_state`` allocates them, ``start_block`` resets the slots that begin a block.

One registered algorithm is ours, not SGLang's: ``D2F`` (:mod:`.d2f`, run by ``collectors.d2f``),
for Amin et al.'s measurements; its :class:`AlgorithmInfo` says SGLang does not serve it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from dwise_predict.errors import BundleError, ConfigError, TraceError


@dataclass
class StepRule:
    """Base of the step rules: parameters with SGLang's defaults, validated once.

    ``params`` holds every parameter with its resolved value (defaults filled in): it is what the
    trace manifest records as the algorithm config.
    """

    mask_id: int
    params: dict = field(default_factory=dict)

    name: ClassVar[str] = "StepRule"
    DEFAULTS: ClassVar[dict] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.params) - set(self.DEFAULTS))
        if unknown:
            accepted = ", ".join(self.DEFAULTS) or "none"
            # SGLang ignores such a key, so a typo there decodes with the default: refused here, named
            raise ConfigError(f"{self.name} has no parameter {', '.join(unknown)}: its parameters are {accepted} "
                              "(SGLang ignores other keys; remove it)")
        self.params = {**self.DEFAULTS, **self.params}
        self._validate()

    def _validate(self) -> None:
        """Check parameter types and ranges; raise ConfigError naming the parameter."""

    def bind(self, model) -> None:
        """Read what the rule needs from the model being decoded (a backend); most need nothing."""

    def max_steps(self, block_size: int) -> int:
        """``DllmAlgorithm.max_steps``: steps the synchronous loop allows one block."""
        return block_size + 1

    def new_state(self, n_slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    def start_block(self, state: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        """Reset the per-slot state of ``slots``, which begin a new block."""
        for tensor in state.values():
            tensor[slots] = 0

    def step(self, ids: torch.Tensor, logits: torch.Tensor, prompt_mask: torch.Tensor,
             state: dict[str, torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising step of ``n`` blocks.

        ids : LongTensor (n, block), the forward's input block of each row.
        logits : (n, block, V) of that forward (not modified).
        prompt_mask : BoolTensor (n, block), leftover prompt positions (never filled or edited).
        state, slots : the per-slot state and the slot of each row.

        Returns the next input blocks (n, block) and ``done`` (n,): the block is finished and this
        forward holds its final tokens.
        """
        raise NotImplementedError

    def step_lists(self, blocks: list[list[int]], prompt_rows: list[list[bool]], logits: torch.Tensor,
                   state: dict[str, torch.Tensor], slots: torch.Tensor | None,
                   logit_rows: list[int] | None = None) -> tuple[list[list[int]], list[bool]]:
        """:meth:`step` on host lists, the decoder's call: ``blocks`` and ``prompt_rows`` are ``ids`` and
        ``prompt_mask`` as lists, and the next blocks and ``done`` come back as lists; ``slots`` may be
        None for a rule that keeps no state; ``logit_rows``: the row of ``logits`` holding each block's
        (None: the block's own row). Through the tensors here; a rule that decides on the host
        (``LowConfidence``) skips them."""
        if logit_rows is not None:
            logits = logits.index_select(0, torch.tensor(logit_rows, dtype=torch.long, device=logits.device))
        ids = torch.from_numpy(np.array(blocks, dtype=np.int64)).to(logits.device)
        prompt_mask = torch.from_numpy(np.array(prompt_rows, dtype=np.bool_)).to(logits.device)
        new, done = self.step(ids, logits, prompt_mask, state, slots)
        return new.tolist(), done.tolist()


def _check_number(name: str, value, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value >= low and (high is None or value <= high)):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"algorithm parameter {name} must be a number in {span}, got {value!r}")


class LowConfidence(StepRule):
    """``sglang.srt.dllm.algorithm.low_confidence.LowConfidence``.

    Each step fills every masked position whose top-1 probability is strictly above ``threshold``;
    when none is, the single most confident masked position (first on ties). The top-1 token may be
    the mask token itself (the engine does not suppress it). Done when the input has no mask.
    The decisions are taken on the host from the masked positions' top-1 and probability, with the
    engine's float32 comparison and ``argmax``'s tie-breaking (first; a NaN first of all).
    """

    name = "LowConfidence"
    DEFAULTS = {"threshold": 0.95}

    def _validate(self) -> None:
        _check_number("threshold", self.params["threshold"], 0.0, 1.0)

    def step(self, ids, logits, prompt_mask, state, slots):
        new, done = self.step_lists(ids.tolist(), prompt_mask.tolist(), logits, state, slots)
        # through numpy: torch.tensor reads a nested list element by element, 2-3x slower
        return (torch.from_numpy(np.array(new, dtype=np.int64).reshape(ids.shape)).to(device=ids.device,
                                                                                      dtype=ids.dtype),
                torch.tensor(done, dtype=torch.bool, device=ids.device))

    def step_lists(self, blocks, prompt_rows, logits, state, slots, logit_rows=None):
        # decided on the host, row by row: a block of 8 to 32 positions takes a few list operations,
        # where the same decisions as tensor operations cost ~20 dispatches a step (collect's main
        # cost outside the forward); only the logits' work stays a tensor operation
        mask_id = self.mask_id
        masked = [[i for i, (token, prompt) in enumerate(zip(row, in_prompt)) if token == mask_id and not prompt]
                  for row, in_prompt in zip(blocks, prompt_rows)]  # each row's masked positions
        width = len(blocks[0]) if blocks else 0
        rows = logit_rows or range(len(blocks))
        at = [r * width + i for r, positions in zip(rows, masked) for i in positions]
        top, confidence = _masked_top(logits, at)
        # compared as the logits' dtype compares: `confidence > threshold` casts the threshold to it
        threshold = _as_dtype(self.params["threshold"], logits.dtype)
        new, k = [], 0
        for row, positions in zip(blocks, masked):
            n = len(positions)
            new.append(_fill_row(row, positions, top[k:k + n], confidence[k:k + n], threshold) if n else row)
            k += n
        return new, [not positions for positions in masked]


@functools.lru_cache(maxsize=None)
def _as_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (as a comparison with a tensor of that dtype casts it); cached:
    a tensor round trip every step cost two dispatches."""
    return torch.tensor(value, dtype=dtype).item()


def _masked_top(logits: torch.Tensor, at: list[int]) -> tuple[list[int], list[float]]:
    """The top-1 token and its probability at the flat positions ``at`` of ``logits`` (n, block, V).

    Only those rows go through argmax and softmax (4 in 10 of a block's positions while
    collecting): each position's softmax and argmax are its own, so they equal the whole block's."""
    if not at:
        return [], []
    # the top-1's probability is the largest, bit for bit: exp(0) over the sum every position shares,
    # and no other position's exp(logit - max) exceeds 1 (NaN rows stay NaN either way)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # on the host numpy gathers, takes the argmax (ties as torch breaks them: the first, a NaN first
        # of all; 8x faster) and reads the probability at it, with no index tensor or dispatch per call;
        # the softmax stays torch's, for its bits
        rows = logits.numpy().reshape(-1, logits.shape[-1])[at]
        top = rows.argmax(-1)
        probs = torch.from_numpy(rows).softmax(-1).numpy()
        return top.tolist(), probs[np.arange(len(top)), top].tolist()
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, torch.tensor(at, device=logits.device))
    return rows.argmax(dim=-1).tolist(), F.softmax(rows, dim=-1).amax(dim=-1).tolist()


def _fill_row(row: list[int], positions: list[int], top: list[int], confidence: list[float],
              threshold: float) -> list[int]:
    """One block after a ``LowConfidence`` step: its masked ``positions`` (at least one; ``top`` and
    ``confidence`` given for them, in order) above ``threshold`` take their top-1 token; if none is,
    the most confident one does (the first on ties, a NaN before any number, as ``argmax`` picks)."""
    out, filled = list(row), False
    for i, token, c in zip(positions, top, confidence):
        if c > threshold:
            out[i], filled = token, True
    if not filled:
        nan = [k for k, c in enumerate(confidence) if c != c]
        best = nan[0] if nan else confidence.index(max(confidence))  # max keeps the first of equals
        out[positions[best]] = top[best]
    return out


class JointThreshold(StepRule):
    """``sglang.srt.dllm.algorithm.joint_threshold.JointThreshold`` (its default per-row path).

    Mask-to-token: masked positions above ``threshold`` are filled (at least the most confident,
    ``topk`` tie-breaking). Token-to-token: any filled, non-prompt position whose top-1 differs from
    its token with probability above ``edit_threshold`` is rewritten. ``penalty_lambda`` lowers, at
    each position, the logit of the previous position's token. A block is done when a step changes
    nothing, or when it has had no mask for more than ``max_post_edit_steps`` steps.
    """

    name = "JointThreshold"
    DEFAULTS = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16, "penalty_lambda": 0.0}

    def _validate(self) -> None:
        _check_number("threshold", self.params["threshold"], 0.0, 1.0)
        _check_number("edit_threshold", self.params["edit_threshold"], 0.0, 1.0)
        _check_number("penalty_lambda", self.params["penalty_lambda"], 0.0)
        steps = self.params["max_post_edit_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"algorithm parameter max_post_edit_steps must be an integer >= 0, got {steps!r}")

    def max_steps(self, block_size: int) -> int:
        return block_size + self.params["max_post_edit_steps"] + 1

    def new_state(self, n_slots, device):
        return {"finished": torch.zeros(n_slots, dtype=torch.bool, device=device),
                "post_edit_steps": torch.zeros(n_slots, dtype=torch.long, device=device)}

    def step(self, ids, logits, prompt_mask, state, slots):
        n = len(ids)
        penalty = self.params["penalty_lambda"]
        if penalty > 0:  # out of place: the caller's logits stay as the forward produced them
            logits = logits.clone()
            previous = ids[:, :-1, None]
            logits[:, 1:, :].scatter_add_(2, previous, torch.full(previous.shape, -penalty, dtype=logits.dtype,
                                                                  device=logits.device))
        top = logits.argmax(dim=-1)
        p = F.softmax(logits, dim=-1).gather(-1, top.unsqueeze(-1)).squeeze(-1)

        finished = state["finished"][slots].clone()
        post_edit = state["post_edit_steps"][slots].clone()
        masked = (ids == self.mask_id) & ~prompt_mask
        has_mask = masked.any(dim=1)
        active = ~finished
        settling = active & ~has_mask  # no mask left: a post-edit step
        post_edit += settling.long()
        exhausted = settling & (post_edit > self.params["max_post_edit_steps"])
        finished |= exhausted
        eligible = active & ~exhausted

        confidence = torch.where(masked, p, float("-inf"))
        fill = (confidence > self.params["threshold"]) & (eligible & has_mask)[:, None]
        force = eligible & has_mask & ~fill.any(dim=1)
        best = confidence.topk(1, dim=1).indices.squeeze(1)
        fill[torch.arange(n, device=ids.device), best] |= force
        edit = (p > self.params["edit_threshold"]) & (ids != top) & ~masked & ~prompt_mask & eligible[:, None]
        change = fill | edit
        finished |= eligible & ~change.any(dim=1)

        state["finished"][slots] = finished
        state["post_edit_steps"][slots] = post_edit
        return torch.where(change, top, ids), finished


class JointThresholdInDel(StepRule):
    """``sglang.srt.dllm.algorithm.joint_threshold_indel.JointThresholdInDel``.

    ``JointThreshold`` plus structural edits for checkpoints trained with them: a predicted
    ``delete_token_id`` removes its position (the block is refilled with masks at the end), a
    ``split_token_id`` inserts a mask before the position's old token. While original masks remain,
    each step fills at least one more mask than the edits introduced; once none remain, a cumulative
    post-edit budget runs and a final cleanup fills every mask with a token that is neither mask nor
    edit token. A block state seen before is perturbed at its least confident changing position
    (anti-loop). Per row, in Python, like the engine; its state holds sets and histories.
    """

    name = "JointThresholdInDel"
    DEFAULTS = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}
    delete_token_id: int | None = None
    split_token_id: int | None = None

    def _validate(self) -> None:
        _check_number("threshold", self.params["threshold"], 0.0, 1.0)
        _check_number("edit_threshold", self.params["edit_threshold"], 0.0, 1.0)
        steps = self.params["max_post_edit_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"algorithm parameter max_post_edit_steps must be an integer >= 0, got {steps!r}")

    def bind(self, model) -> None:
        self.bind_tokens(getattr(model, "delete_token_id", None), getattr(model, "split_token_id", None),
                         model.vocab_size)

    def bind_tokens(self, delete_token_id, split_token_id, vocab_size: int) -> None:
        """The model's edit tokens (``DllmConfig.from_server_args`` requires both, distinct, in vocab)."""
        if delete_token_id is None or split_token_id is None:
            raise ConfigError("JointThresholdInDel needs a model whose config.json declares delete_token_id and "
                              "split_token_id (a checkpoint trained for insert/delete decoding); use JointThreshold")
        for name, token in (("delete_token_id", delete_token_id), ("split_token_id", split_token_id)):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ConfigError(f"{name} must be a token id in [0, {vocab_size}), got {token!r}")
        if len({self.mask_id, delete_token_id, split_token_id}) != 3:
            raise ConfigError("mask, delete and split token ids must be distinct, got "
                              f"{self.mask_id}, {delete_token_id}, {split_token_id}")
        self.delete_token_id, self.split_token_id = delete_token_id, split_token_id

    def max_steps(self, block_size: int) -> int:
        # regular updates, one final cleanup, one forward that persists the cleaned block
        return block_size + self.params["max_post_edit_steps"] + 2

    def new_state(self, n_slots, device):
        return {"rows": [None] * n_slots}

    def start_block(self, state, slots):
        for slot in slots.tolist():
            state["rows"][slot] = None  # built from the block's first input, as init_step_state does

    def step(self, ids, logits, prompt_mask, state, slots):
        new = ids.clone()
        done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        for j, slot in enumerate(slots.tolist()):
            row = state["rows"][slot]
            if row is None:
                row = state["rows"][slot] = {
                    "prompt_len": int(prompt_mask[j].sum()), "prompt_index": prompt_mask[j].clone(),
                    "is_orig_mask": (ids[j] == self.mask_id) & ~prompt_mask[j], "post_edit_steps": 0,
                    "num_update_steps": 0, "finished": False, "seen": set(), "sampled": {}}
            done[j] = self._step_row(new[j], logits[j].clone(), row)
        return new, done

    def _step_row(self, block: torch.Tensor, logits: torch.Tensor, row: dict) -> bool:
        """One row's step, in place on ``block``; returns done."""
        if row["finished"]:
            return True
        mask, delete, split = self.mask_id, self.delete_token_id, self.split_token_id
        size, max_post = len(block), self.params["max_post_edit_steps"]
        top = logits.argmax(dim=-1)
        probs = F.softmax(logits, dim=-1)
        p = probs.gather(-1, top.unsqueeze(-1)).squeeze(-1)
        prompt = row["prompt_index"]
        masked = (block == mask) & ~prompt
        original = row["is_orig_mask"] & masked
        n_original, n_masked = int(original.sum()), int(masked.sum())

        row["num_update_steps"] += 1
        if n_original == 0:
            row["post_edit_steps"] += 1
        cleanup = ((max_post > 0 and row["post_edit_steps"] >= max_post) or (max_post == 0 and n_original == 0)
                   or row["num_update_steps"] > size + max_post)
        if not cleanup:  # an unresolved original mask must not be "filled" with the mask itself
            stuck = (original & (top == mask)).nonzero().view(-1)
            if len(stuck):
                retry = logits[stuck].clone()
                retry[:, mask] = float("-inf")
                top[stuck] = retry.argmax(dim=-1)
                p[stuck] = probs[stuck, top[stuck]]

        fill = self._fill(masked & ~prompt if cleanup else masked, p, n_masked, 0 if cleanup else n_original)
        if max_post == 0 and n_original and not (original & ~fill).any():
            cleanup = True
            fill = masked & ~prompt
        edit = (p > self.params["edit_threshold"]) & (block != top) & ~masked & ~prompt
        write = (fill | edit).nonzero().view(-1)
        if len(write) == 0:
            row["finished"] = True
            return True

        if cleanup:  # the last update writes no mask or edit token
            forbidden = write[(top[write] == mask) | (top[write] == delete) | (top[write] == split)]
            if len(forbidden):
                retry = logits[forbidden].clone()
                retry[:, [mask, delete, split]] = float("-inf")
                top[forbidden] = retry.argmax(dim=-1)
        old = block.tolist()
        key = tuple(old)
        if key in row["seen"] and not cleanup:  # a state seen before: perturb the least confident change
            self._perturb(block, logits, top, p, write, original, row["sampled"])
        row["seen"].add(key)

        tokens, structural, changed = old.copy(), False, False
        for position, token in zip(write.tolist(), top[write].tolist()):
            row["sampled"].setdefault(position, set()).add(token)
            tokens[position] = token
            structural |= token in (delete, split)
            changed |= token != old[position]
        if structural:
            edited, orig = self._apply_edits(tokens, old, row["is_orig_mask"].tolist(), row["prompt_len"])
            block.copy_(torch.tensor(edited, dtype=block.dtype))
            row["is_orig_mask"] = torch.tensor(orig, dtype=torch.bool, device=block.device)
        else:
            block[write] = top[write]
        if cleanup:
            row["finished"] = True
            return not changed  # changed ids need one more forward to persist their KV
        return False

    def _fill(self, masked: torch.Tensor, p: torch.Tensor, n_masked: int, n_original: int) -> torch.Tensor:
        """The masked positions a step fills: all of ``masked`` in the cleanup step or when no original
        mask is left (``n_original`` 0), else those over the threshold if at least one more than the
        masks the edits introduced, else that many of the most confident."""
        if not n_masked or not n_original:
            return masked if n_masked else torch.zeros_like(masked)
        confidence = torch.where(masked, p, float("-inf"))
        needed = 1 + n_masked - n_original  # one more than the masks the edits introduced
        confident = (confidence > self.params["threshold"]) & masked
        if int(confident.sum()) >= needed:
            return confident
        fill = torch.zeros_like(masked)
        fill[confidence.topk(min(needed, n_masked)).indices] = True
        return fill

    def _perturb(self, block, logits, top, p, write, original, sampled: dict) -> None:
        """A state seen before: the least confident position about to change takes its best token not
        sampled there yet (never the mask at an original mask), in place on ``top``."""
        changing = write[top[write] != block[write]]
        if len(changing):
            position = int(changing[p[changing].argmin()])
            retry = logits[position].clone()
            for token in sampled.get(position, ()):
                retry[token] = float("-inf")
            if original[position]:
                retry[self.mask_id] = float("-inf")
            top[position] = retry.argmax()

    def _apply_edits(self, tokens: list[int], old: list[int], is_orig: list[bool], prompt_len: int):
        """DELETE drops a generated position, SPLIT puts a new mask before its old token; the block is
        cut or refilled with masks to its size (``JointThresholdInDel._apply_edit_operations``)."""
        size = len(old)
        out, out_orig = old[:prompt_len], is_orig[:prompt_len]
        for i in range(prompt_len, size):
            if tokens[i] == self.delete_token_id:
                continue
            if tokens[i] == self.split_token_id:
                out += [self.mask_id, old[i]]
                out_orig += [False, is_orig[i]]
            else:
                out.append(tokens[i])
                out_orig.append(is_orig[i])
        out, out_orig = out[:size], out_orig[:size]
        return out + [self.mask_id] * (size - len(out)), out_orig + [False] * (size - len(out_orig))


@dataclass(frozen=True)
class AlgorithmInfo:
    """What a user can name with ``--algorithm``: the rule, or why this decoder cannot run it;
    ``sglang`` False for a decoding of ours that SGLang 0.5.23 does not serve (D2F)."""

    rule: Callable[..., StepRule] | None
    unsupported: str | None = None
    sglang: bool = True


def _d2f(**kwargs) -> StepRule:
    """D2F's rule: ours, not SGLang's, in its own module (:mod:`.d2f`, which builds on this one)."""
    from dwise_predict.engine.d2f import D2F

    return D2F(**kwargs)


ALGORITHMS: dict[str, AlgorithmInfo] = {
    "LowConfidence": AlgorithmInfo(LowConfidence),
    "JointThreshold": AlgorithmInfo(JointThreshold),
    "JointThresholdInDel": AlgorithmInfo(JointThresholdInDel),
    "Gemma4Renoise": AlgorithmInfo(
        None, "Gemma4Renoise needs a separate context-encoding pass that only the DiffusionGemma "
              "backend runs; it is chosen automatically for DiffusionGemma models"),
    "D2F": AlgorithmInfo(_d2f, sglang=False),
}
DEFAULT_ALGORITHM = "LowConfidence"  # SGLang's documented choice for LLaDA2.x and SDAR
ARCHITECTURE_ALGORITHMS = {"DiffusionGemmaForBlockDiffusion": "Gemma4Renoise"}  # DllmConfig requires it


def default_algorithm(architecture: str | None) -> str:
    """The algorithm SGLang would serve ``architecture`` with (``DllmConfig.from_server_args``)."""
    return ARCHITECTURE_ALGORITHMS.get(architecture or "", DEFAULT_ALGORITHM)


def make_rule(name: str, mask_id: int, params: dict | None = None) -> StepRule:
    """The step rule ``name`` with ``params`` over SGLang's defaults; one-line ConfigError otherwise.

    Rules that need something of the model (``JointThresholdInDel``: its edit tokens) get it from
    :meth:`StepRule.bind`, which the decoder calls with its backend.
    """
    info = ALGORITHMS.get(name)
    if info is None:
        raise ConfigError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")
    if info.rule is None:
        raise ConfigError(info.unsupported)
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"`algorithm_config` must be a JSON object, got {type(params).__name__}")
    return info.rule(mask_id=mask_id, params=dict(params or {}))


def check_recorded_config(algorithm, config) -> None:
    """An algorithm config as a manifest records it (None: not recorded), checked by the rule of
    ``algorithm`` (:func:`make_rule`): a parameter the rule has not, a value of the wrong type or out
    of its range is refused in the words ``collect`` refuses it with (:class:`ConfigError`). A manifest
    holds every parameter (:attr:`StepRule.params`), or none where a recording was made before
    manifests carried SGLang's defaults (which SGLang then ran); some but not all, or no config at
    all, is an edited file. An algorithm we run no rule for (Gemma4Renoise, a backend's own sampler,
    synthetic traces) has no parameters known here: its config need only be a JSON object."""
    if algorithm is not None and not isinstance(algorithm, str):
        raise ConfigError(f"the algorithm must be a name, got {type(algorithm).__name__} {algorithm!r}")
    info = ALGORITHMS.get(algorithm or "")
    rule = None if info is None else info.rule
    if config is None and rule is None:
        return
    if not isinstance(config, dict):
        got = "none" if config is None else type(config).__name__
        raise ConfigError(f"the algorithm config must be a JSON object of parameters, got {got}")
    if rule is None:
        return
    missing = [key for key in make_rule(algorithm, mask_id=0, params=config).DEFAULTS if key not in config]
    if config and missing:
        raise ConfigError(f"{algorithm}'s parameters lack {', '.join(missing)}: a manifest records every one "
                          "(or none, for the defaults)")


def check_recorded_decoding(decoding, where: str) -> None:
    """Raise :class:`TraceError` when a trace manifest's ``decoding`` block (read from ``where``, the
    manifest's path) records an algorithm config that :func:`check_recorded_config` refuses, naming
    the file, the parameter, what is wrong and the fix. Called where the traces meet the engine's rules
    (the traces package may not import the engine: tests/test_layering.py)."""
    if not isinstance(decoding, dict):  # traces.check_manifest names that
        return
    try:
        check_recorded_config(decoding.get("algorithm"), decoding.get("algorithm_config"))
    except ConfigError as err:
        raise TraceError(f"{where} records a decoding that the engine's rules refuse ({err}): the file was edited or "
                         "damaged; collect the traces again, or correct its decoding block") from None


# Keys of SGLang's ``--dllm-algorithm-config`` that are not a step rule's parameters.
# ``block_size``: read by ``DllmConfig.from_server_args`` (it overrides the model's block size).
# ``vectorized_decoding`` (JointThreshold's batched step) and ``capture_input_preparation`` (CUDA-graph
# input preparation): how SGLang executes a step, not what it decides; tests/test_engine_conformance.py
# checks that JointThreshold's vectorized step decides exactly as its per-row step.
ENGINE_KEYS = ("block_size",)
EXECUTION_KEYS = ("vectorized_decoding", "capture_input_preparation")


@dataclass(frozen=True)
class AlgorithmConfig:
    """SGLang's ``--dllm-algorithm-config`` mapping, split as the engine reads it.

    params : the step rule's parameters (execution switches dropped: they change no decision).
    block_size : the mapping's ``block_size``, or None.
    """

    params: dict
    block_size: int | None = None

    @classmethod
    def from_mapping(cls, mapping, where: str = "`algorithm_config`") -> AlgorithmConfig:
        if not isinstance(mapping, dict):
            raise ConfigError(f"{where} must be a mapping of parameters, got {type(mapping).__name__}")
        block = mapping.get("block_size")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block <= 0):
            raise ConfigError(f"{where}: block_size must be a positive integer, got {block!r}")
        params = {k: v for k, v in mapping.items() if k not in ENGINE_KEYS + EXECUTION_KEYS}
        return cls(params=params, block_size=block)


def read_algorithm_file(path: str, option: str = "--dllm-algorithm-config") -> dict:
    """An algorithm config file read as SGLang reads ``--dllm-algorithm-config``:
    ``yaml.safe_load`` (JSON is YAML too), an empty file being no parameters."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{option}: cannot read {path} ({err.strerror}): pass the server's "
                          "--dllm-algorithm-config file") from None
    try:
        params = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        at = f" (line {mark.line + 1}: {problem})" if mark is not None and problem else ""
        raise ConfigError(f"{option} {path} is not valid YAML{at}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{option} {path} nests too deeply to be an algorithm config") from None
    if params is None:  # SGLang's `yaml.safe_load(f) or {}`
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{option} {path} must hold a mapping of parameters, got {type(params).__name__}")
    return params


def served_decoding(algorithm: str, algorithm_config: dict, block_size: int | None) -> dict:
    """A server's decoding (its ``DllmConfig``'s ``algorithm``, ``algorithm_config`` and
    ``block_size``, None where not known yet) as traces and bundles record it: as SGLang's algorithm
    reads it, the rule's parameters over its defaults, other keys ignored, nothing range-checked (the
    server runs what it was given). An algorithm this decoder cannot run keeps its parameters as given."""
    params = AlgorithmConfig.from_mapping(algorithm_config or {}, "SGLang's --dllm-algorithm-config").params
    if (rule := _mirrored_rule(algorithm)) is not None:
        params = {**rule.DEFAULTS, **{key: params[key] for key in params if key in rule.DEFAULTS}}
    return {"algorithm": algorithm, "algorithm_config": params,
            "block_size": None if block_size is None else int(block_size)}


def comparable_decoding(trained_algorithm: str | None, served: dict) -> dict:
    """What of a ``served`` decoding a bundle trained on ``trained_algorithm``'s traces must match:
    everything where this decoder mirrors the algorithm (its parameters then carry SGLang's
    defaults on both sides); the block size alone for traces of anything else (synthetic traces,
    DiffusionGemma's transformers sampler, a Gemma4Renoise recording, whose parameters have no
    defaults here to compare by). A decoding of ours that SGLang does not serve (D2F) matches no
    server: :class:`BundleError`."""
    info = ALGORITHMS.get(trained_algorithm or "")
    if info is not None and not info.sglang:
        raise BundleError(f"this bundle was trained on {trained_algorithm} traces, a decoding of dwise-predict's own "
                          "that SGLang 0.5.23 does not serve, so its rounds are no server's: train on "
                          "traces of an algorithm SGLang serves (LowConfidence, JointThreshold, JointThresholdInDel)")
    return served if _mirrored_rule(trained_algorithm) is not None else {"block_size": served["block_size"]}


def _mirrored_rule(algorithm: str | None):
    """The step rule class mirroring SGLang's ``algorithm``, or None where we run no such rule."""
    info = ALGORITHMS.get(algorithm or "")
    return None if info is None or not info.sglang else info.rule


def forwards_exhausted(rule: StepRule, forwards: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows whose block has had ``max_steps + 1`` forwards: the engine's loop ends them unstepped."""
    return forwards > rule.max_steps(block_size)
