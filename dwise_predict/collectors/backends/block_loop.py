"""A generic ``BlockBackend`` for mask-token dLLMs loaded with ``AutoModel*.from_pretrained``.

For LLaDA2.x, SDAR, Dream and similar models that ship as remote code (``--trust-remote-code``): the
threshold decoder (:mod:`dwise_predict.collectors.decoder`) drives them through this backend exactly
as it drives the tiny model. The backend keeps, per slot, the committed tokens and their block ids,
and answers each ``step`` by running the model over ``committed + row`` with an explicit 4-D
block-causal attention mask (a token sees every committed token of an earlier or its own block, and
its own row part); it reads the final-layer hidden state as the input of the LM head (a forward
pre-hook on ``get_output_embeddings()``), which is the post-norm state for every HF causal LM. For
`collect --layers` it also asks the forward for ``output_hidden_states`` and keeps entries
``0 .. num_hidden_layers - 1`` of that tuple, the last entry being the LM head's input again (which is
what transformers puts there; remote code that does not is overruled, so the final index always
means what ``first_round`` pools).

Verified versus untested (see also ``docs/backends.md``):

- verified here: the mechanics (masking, commits, windows, hidden capture, resume/merge through
  `collect`) on a randomly initialised small Llama-architecture model given a ``mask_token_id``;
- untested on real weights: LLaDA2.x (block 32), SDAR (block 4), Dream. They load through
  ``trust_remote_code`` and must accept a 4-D additive float ``attention_mask`` and ``position_ids``
  in ``forward`` (LLaDA2's and SDAR's own generate loops pass such masks). Dream was trained with
  full bidirectional attention, not block-causal; decoding it block by block is a choice, recorded
  in the manifest as the decoding config.
- cost: there is no KV cache — every round recomputes the committed prefix, O(T^2) per row. Right for
  correctness checks and small collections; a serving-grade collection belongs in an engine hook
  (in SGLang's ``DllmAlgorithm._run_sync`` the first ``model_runner.forward`` is the first
  denoising round), as ``serve --record`` does inside SGLang.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dwise_predict.collectors.backends.base import DTYPES, LOAD_ERRORS, StepBatch, StepOutput, directory_fingerprint
from dwise_predict.engine.layout import routing_block_size_problem, tokenizer_stop_ids
from dwise_predict.errors import ModelError
from dwise_predict.files import read_json_object

# Block sizes of known architectures (SGLang's DllmConfig); a config's own block_size wins.
# The block size and mask id SGLang 0.5.23 serves each dLLM architecture with, whatever its config.json
# says (``DllmConfig.from_server_args``'s table in srt/dllm/config.py; only an algorithm-config
# ``block_size`` overrides the block size there, as `--block-size` does here). Checked against the
# wheel by tests/test_engine_conformance.py.
SGLANG_DLLM_PARAMS = {
    "LLaDA2MoeModelLM": {"block_size": 32, "mask_id": 156895},
    "SDARForCausalLM": {"block_size": 4, "mask_id": 151669},
    "SDARMoeForCausalLM": {"block_size": 4, "mask_id": 151669},
}

class BlockLoopBackend:
    """``BlockBackend`` over any HF model whose forward takes a 4-D attention mask (see module doc)."""

    def __init__(self, model, tokenizer, path: Path, block_size: int, mask_token_id: int,
                 eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.path = path
        self.name = path.name
        self.architecture = (getattr(model.config, "architectures", None) or [None])[0]
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.hidden_size = int(config.hidden_size)
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 4096))
        self.device = next(model.parameters()).device
        # insert/delete edit tokens of checkpoints trained for JointThresholdInDel (None otherwise)
        self.delete_token_id = getattr(config, "delete_token_id", None)
        self.split_token_id = getattr(config, "split_token_id", None)
        self._tokens: list[list[int]] = []
        self._blocks: list[list[int]] = []
        self._hidden: torch.Tensor | None = None
        model.get_output_embeddings().register_forward_pre_hook(self._capture)

    def _capture(self, module, args) -> None:
        self._hidden = args[0]

    def fingerprint(self) -> dict:
        return directory_fingerprint(self.path, self.name, self.model.config.to_dict(), self.hidden_size,
                                     self.vocab_size)

    def allocate(self, n_slots: int) -> None:
        self._tokens = [[] for _ in range(n_slots)]
        self._blocks = [[] for _ in range(n_slots)]

    def reset_slot(self, slot: int) -> None:
        self._tokens[slot], self._blocks[slot] = [], []

    def step(self, batch: StepBatch) -> StepOutput:
        seqs, blocks, starts = [], [], []
        for r, slot in enumerate(batch.slots.tolist()):
            n, commit = int(batch.n_valid[r]), int(batch.commit_len[r])
            row = batch.input_ids[r, :n].tolist()
            first = self._blocks[slot][-1] + 1 if self._blocks[slot] else 0
            # the committed part of a row is one block, the rest the next one (a prefill row is all commit);
            # a D2F row is blocks of block_len tokens throughout
            row_blocks = ([first + i // batch.block_len for i in range(n)] if batch.block_len
                          else [first] * commit + [first + (commit > 0)] * (n - commit))
            seqs.append(self._tokens[slot] + row)
            blocks.append(self._blocks[slot] + row_blocks)
            starts.append(len(self._tokens[slot]) + int(batch.out_start[r]))
            self._tokens[slot] += row[:commit]
            self._blocks[slot] += row_blocks[:commit]
        logits, hidden, layers = self._forward(seqs, blocks, batch.all_layers)
        window = batch.window
        out_logits = torch.zeros(len(seqs), window, logits.shape[-1])
        out_hidden = torch.zeros(len(seqs), window, hidden.shape[-1])
        out_layers = None if layers is None else torch.zeros(len(seqs), layers.shape[1], window, hidden.shape[-1])
        for r, (seq, start) in enumerate(zip(seqs, starts)):
            stop = min(start + window, len(seq))  # a short prefill row leaves the tail of its window empty
            out_logits[r, : stop - start] = logits[r, start:stop].float().cpu()
            out_hidden[r, : stop - start] = hidden[r, start:stop].float().cpu()
            if layers is not None:
                out_layers[r, :, : stop - start] = layers[r, :, start:stop].float().cpu()
        return StepOutput(logits=out_logits, hidden=out_hidden, layers=out_layers)

    @torch.no_grad()
    def _forward(self, seqs: list[list[int]], blocks: list[list[int]],
                 all_layers: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One padded forward; a position sees valid keys of its own or an earlier block. Returns logits
        (n, T, V), the LM head's input (n, T, H) and, with ``all_layers``, (n, num_hidden_layers + 1, T, H)."""
        length = max(map(len, seqs))
        n = len(seqs)
        ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        block_ids = torch.full((n, length), 1 << 30, dtype=torch.long)  # padding: a block after everything
        for r, (seq, blk) in enumerate(zip(seqs, blocks)):
            ids[r, : len(seq)] = torch.tensor(seq)
            block_ids[r, : len(blk)] = torch.tensor(blk)
        valid = block_ids < (1 << 30)
        allowed = (block_ids[:, None, :] <= block_ids[:, :, None]) & valid[:, None, :]  # (n, T, T)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(n, 1, length, length, dtype=dtype)
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)  # additive: 0 attend, min blocked
        positions = torch.arange(length).expand(n, length)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), use_cache=False,
                         **({"output_hidden_states": True} if all_layers else {}))
        if not all_layers:
            return out.logits, self._hidden, None
        states = getattr(out, "hidden_states", None)
        if states is None or len(states) != self.num_hidden_layers + 1:
            raise ModelError(f"{self.path}: the model's forward returned {0 if states is None else len(states)} "
                             f"hidden states for {self.num_hidden_layers} layers (want {self.num_hidden_layers + 1}): "
                             "it cannot be collected with `layers`; drop `layers`")
        return out.logits, self._hidden, torch.stack([*states[:-1], self._hidden], dim=1)


def load_block_loop_backend(path: Path, config: dict, trust_remote_code: bool = False, dtype: str = "float32",
                            device: str = "cpu", block_size: int | None = None) -> BlockLoopBackend:
    """Load a mask-token dLLM directory for the threshold decoder; refuse what cannot be one.

    Raises
    ------
    ModelError : no mask token (an autoregressive model), no known block size, remote code needed
        but not allowed, or a load failure.
    """
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    if config.get("auto_map") and not trust_remote_code:
        raise ModelError(f"{path} ships its own model code (auto_map in config.json): pass `trust_remote_code` "
                         "if you trust it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load the tokenizer in {path}: {err}") from None
    architecture = (config.get("architectures") or [""])[0]
    served = SGLANG_DLLM_PARAMS.get(architecture, {})
    mask_id = served.get("mask_id", config.get("mask_token_id", getattr(tokenizer, "mask_token_id", None)))
    if mask_id is None:
        raise ModelError(f"{path} is not a block-diffusion LM: neither config.json nor the tokenizer has a mask "
                         "token (autoregressive models cannot be collected)")
    block = served.get("block_size") or config.get("block_size") or config.get("block_length") or block_size
    if block is None:
        raise ModelError(f"{path}: unknown block size for {architecture or config.get('model_type')}: "
                         "pass `block_size`")
    if problem := routing_block_size_problem(config, block_size or block):
        raise ModelError(f"{path}: {problem}: drop `block_size` (or the algorithm config's block_size)")
    pad = config.get("pad_token_id")
    pad = tokenizer.pad_token_id if pad is None else pad
    last_error = None
    for auto in (AutoModelForCausalLM, AutoModelForMaskedLM):
        try:
            model = auto.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
            break
        except LOAD_ERRORS as err:
            last_error = err
    else:
        raise ModelError(f"cannot load the model in {path}: {last_error}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelError(f"the tokenizer in {path} has no chat template: add chat_template.jinja")
    return BlockLoopBackend(model.to(device), tokenizer, path, int(block), int(mask_id),
                            stop_token_ids(path, config, tokenizer), int(pad or 0))


def stop_token_ids(path: Path, config: dict, tokenizer) -> tuple[int, ...]:
    """The ids that end a request, as SGLang gathers them: ``eos_token_id`` of config.json and of
    generation_config.json, each an int or a list, united (``ModelConfig._get_hf_eos_token_id``), and
    the tokenizer's (:func:`engine.layout.tokenizer_stop_ids`). Qwen-based checkpoints such
    as SDAR name ``<|endoftext|>`` in one file and ``<|im_end|>`` in the other: keeping only the
    first would decode past a stop SGLang honours."""
    generation = path / "generation_config.json"
    declared = [config.get("eos_token_id"), sorted(tokenizer_stop_ids(tokenizer))]
    if generation.is_file():
        declared.append(read_json_object(generation, ModelError, fix="fix or remove it").get("eos_token_id"))
    ids = set()
    for value in declared:
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if not ids:
        raise ModelError(f"{path} names no eos_token_id (config.json, generation_config.json or the tokenizer): "
                         "a request could never stop before its budget; add one to config.json")
    return tuple(sorted(int(i) for i in ids))
