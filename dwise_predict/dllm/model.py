"""The built-in tiny block-diffusion LM, read top to bottom: RoPE → attention → MLP → block → model.

A LLaDA2-style masked diffusion transformer: pre-norm (RMSNorm), rotary positions, a ``<mask>`` token,
and **block-causal attention** — a token sees every token of its own block (bidirectional) and every
token of earlier blocks (causal across blocks), never a later block.

Blocks of a sequence
--------------------
Blocks sit on a fixed grid from the first token, as SGLang lays out a dLLM request
(``dwise_predict.engine.layout``): position ``i`` is in block ``i // block_size``. The prompt fills
``prompt_tokens // block_size`` full blocks; its leftover tokens open the first output block, whose
remaining positions are the first output tokens. ``block_ids_for(seq_len, block_size)`` builds these
ids; the decoder's KV cache reproduces the same structure one block at a time.

Training forward (what ``dllm/train.py`` calls)
------------------------------------------------
``model(input_ids, attention_mask=None, prompt_lengths=None, noisy_ids=None, noisy_mask=None)``
returns ``TinyDllmOutput(logits, hidden_states)``.

- ``input_ids`` LongTensor (B, T): clean, right-padded sequences (prompt then response).
- ``attention_mask`` (B, T): 1 for real tokens, 0 for padding (padding is never attended to).
- ``prompt_lengths`` LongTensor (B,): prompt tokens per sequence (where the noisy stream starts);
  None = 0.
- ``noisy_ids`` LongTensor (B, R) or None.
  * None: one block-causal pass over ``input_ids``; ``logits`` (B, T, V).
  * given (the block-diffusion objective, every response block at once): a noisy copy of the R
    positions ``start + arange(R)`` from the start of the first output block,
    ``start = prompt_length // block_size * block_size`` (response tokens, some replaced by
    ``config.mask_token_id``; the leftover prompt tokens of that block stay clean),
    ``noisy_mask`` (B, R) marking its real tokens. One pass over ``[clean | noisy]`` (length T + R):
    a noisy token of output block b sees the noisy tokens of block b and the CLEAN tokens of blocks
    < b — exactly what the decoder shows it while denoising block b — and clean tokens see clean
    tokens block-causally. ``logits`` (B, R, V) are the noisy stream's, so the loss is
    ``cross_entropy(logits[masked], clean_response[masked])``.
- ``hidden_states`` is the final-layer hidden state after the final norm (the LM head's input), of
  the same rows as ``logits``.

Cached forward (what the decoder's backend calls)
-------------------------------------------------
``model.forward_step(cache, slots, input_ids, n_valid, commit_len, out_start)`` runs one block-sized
(or two-block) chunk per active cache slot against that slot's KV cache; see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput


class TinyDllmConfig(PretrainedConfig):
    """Hyper-parameters of the tiny dLLM; saved as ``config.json`` next to the weights.

    Parameters
    ----------
    vocab_size : tokens in the tokenizer (including special tokens).
    hidden_size : model width ``H``; ``intermediate_size`` defaults to ``4 * H``.
    n_layers, n_heads : transformer depth and attention heads (``hidden_size % n_heads == 0``).
    block_size : tokens per block (the diffusion unit and the attention unit).
    max_position_embeddings : the longest sequence (prompt + output) the model is meant for.
    mask_token_id, eos_token_id, pad_token_id : special token ids from the tokenizer.
    tie_word_embeddings : the LM head reuses the input embedding matrix. Copying a prompt token (a
        number, an option letter, a queried fact) then needs no separate output vector per token,
        which a small model learns far sooner.
    """

    model_type = "dwise_tiny_dllm"

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        intermediate_size: int | None = None,
        block_size: int = 8,
        max_position_embeddings: int = 1024,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        mask_token_id: int = 1,
        eos_token_id: int = 2,
        pad_token_id: int = 0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.block_size = block_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.mask_token_id = mask_token_id
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)


@dataclass
class TinyDllmOutput(ModelOutput):
    """logits (B, T, V); hidden_states (B, T, H), final layer after the final norm."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


def block_ids_for(seq_len: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Block index of every position on the engine's grid: ``arange(seq_len) // block_size`` (1, T)."""
    return (torch.arange(seq_len, device=device) // block_size)[None, :]


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape (B, 1, T, head_dim) for integer positions (B, T); computed, not buffered,
    so nothing position-dependent lives in the checkpoint."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by position (half-split convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Packing:
    """Which cells of a padded (n, L) chunk batch hold real tokens. Cached rounds run the
    position-wise layers (norms, projections, MLP) on the packed real tokens only, so padding costs
    nothing there; attention unpacks to (n, L) because it needs each row's keys."""

    def __init__(self, valid: torch.Tensor) -> None:
        self.shape = valid.shape  # (n, L)
        self.index = valid.reshape(-1).nonzero().squeeze(1)  # (N,) flat positions of real tokens

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(n, L, C) → (N, C)."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) → (n, L, C), zeros at padding."""
        out = x.new_zeros(self.shape[0] * self.shape[1], x.shape[-1])
        return out.index_copy_(0, self.index, x).view(*self.shape, x.shape[-1])


class KVWrite:
    """Where a cached forward puts this chunk's keys/values: cache tensors (S, heads, C, head_dim)
    of one layer, the slot of each row (n,) and the absolute position of each token (n, L)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, key_len: int, all_slots: bool, packing: Packing) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.slots, self.positions, self.key_len, self.all_slots = slots, positions, key_len, all_slots
        self.packing = packing

    def keys_values(self, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (n, heads, L, head_dim) at their positions; return the slots' keys/values
        (n, heads, key_len, head_dim), which include the chunk itself."""
        rows = self.slots[:, None]  # (n, 1), broadcast against positions (n, L)
        # advanced indices on dims 0 and 2 move to the front: target is (n, L, heads, head_dim)
        self.k_cache[rows, :, self.positions] = k.transpose(1, 2)
        self.v_cache[rows, :, self.positions] = v.transpose(1, 2)
        if self.all_slots:  # steady state: every slot active in order, a view and no copy
            return self.k_cache[:, :, : self.key_len], self.v_cache[:, :, : self.key_len]
        return self.k_cache[self.slots, :, : self.key_len], self.v_cache[self.slots, :, : self.key_len]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v for a decoding round: q (n, heads, L, d), k/v (n, heads, T_keys, d),
    bias (n, 1, L, T_keys) additive.

    Written out rather than through ``F.scaled_dot_product_attention``: a round has one or two blocks
    of queries per row against up to a few hundred cached keys, and at those shapes two batched
    matmuls around a softmax run ~25 % faster than the CPU SDPA kernel on two threads (the same on
    one), with results equal to ~1e-7. Training keeps SDPA (long queries, where its fused kernel wins).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(bias)
    return torch.matmul(scores.softmax(dim=-1), v)


class Attention(nn.Module):
    def __init__(self, config: TinyDllmConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.hidden_size // config.n_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, kv: KVWrite | None = None):
        """x (B, T, H), or packed (N, H) in a cached round; mask (B, 1, T, T_keys), bool (True = may
        attend) or additive float (0 or -inf)."""
        qkv = self.qkv(x)
        if kv is not None:
            qkv = kv.packing.unpack(qkv)  # (N, 3H) → (B, T, 3H)
        B, T, H = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(H, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, heads, T, head_dim)
        else:
            k, v = kv.keys_values(k, v)  # (B, heads, T_keys, head_dim)
            y = cached_attention(q, k, v, mask)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, H)  # (B, T, H)
        if kv is not None:
            y = kv.packing.pack(y)  # (N, H)
        return self.proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: TinyDllmConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TinyDllmConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, kv: KVWrite | None = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv)
        return x + self.mlp(self.mlp_norm(x))


# ---------------------------------------------------------------------------------------------
# KV cache over finished blocks
# ---------------------------------------------------------------------------------------------


class TinyKVCache:
    """Per-slot keys/values of finished (committed) blocks, padded to one capacity.

    ``k[layer]``, ``v[layer]``: (slots, heads, capacity, head_dim); ``lengths`` (slots,): committed
    tokens per slot. A cached forward writes its chunk right after a slot's committed tokens; only
    ``commit_len`` of them become part of the cache (``lengths`` advances), the rest is scratch that
    the next forward overwrites. ``reset(slot)`` frees a slot for a new request.

    Positions are zeroed when a forward first reads them (``finite_up_to``), not at allocation: stale
    or unwritten entries are masked out, but must be finite so that a zero attention weight times
    them stays zero, and a collection reads a few hundred of the ~1,000 positions (zeroing all
    ~70 MB up front was a `collect` shard's largest cost outside the forward).
    """

    def __init__(self, config: TinyDllmConfig, n_slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        head_dim = config.hidden_size // config.n_heads
        shape = (n_slots, config.n_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.capacity = capacity
        self.finite = 0  # positions [0, finite) of every slot hold finite values

    @property
    def n_slots(self) -> int:
        return self.lengths.shape[0]

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def finite_up_to(self, key_len: int) -> None:
        """Make positions ``[0, key_len)`` finite before a forward reads them: zero the part not yet
        zeroed, doubling it (at least 128 positions) so that a growing context zeroes a few times."""
        if key_len <= self.finite:
            return
        end = min(self.capacity, max(key_len, 2 * self.finite, 128))
        for tensor in (*self.k, *self.v):
            tensor[:, :, self.finite:end].zero_()
        self.finite = end


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class TinyDllmPreTrainedModel(PreTrainedModel):
    config_class = TinyDllmConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class TinyDllmForBlockDiffusion(TinyDllmPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "embed.weight"}  # applied when config.tie_word_embeddings

    def __init__(self, config: TinyDllmConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def head_dim(self) -> int:
        return self.config.hidden_size // self.config.n_heads

    def _trunk(self, input_ids, positions, mask, kv_writes=None, layer_states: list | None = None) -> torch.Tensor:
        """Embeddings through all layers and the final norm: (B, T) ids → (B, T, H) hidden, or
        packed (N, H) in a cached round (``kv_writes`` given).

        ``layer_states``, when a list, receives ``n_layers + 1`` states of the same shape in transformers'
        ``output_hidden_states`` order: the embedding output, the output of layers 1 .. n_layers - 1,
        and the final state after the norm (the returned tensor, what the LM head reads)."""
        x = self.embed(input_ids)  # (B, T, H)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.config.rope_theta, x.dtype)
        if kv_writes is not None:
            x = kv_writes[0].packing.pack(x)  # (N, H)
        for i, layer in enumerate(self.layers):
            if layer_states is not None:
                layer_states.append(x)
            x = layer(x, cos, sin, mask, None if kv_writes is None else kv_writes[i])
        x = self.norm(x)
        if layer_states is not None:
            layer_states.append(x)
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                prompt_lengths: torch.Tensor | None = None, noisy_ids: torch.Tensor | None = None,
                noisy_mask: torch.Tensor | None = None) -> TinyDllmOutput:
        """Full-sequence block-causal pass (training and reference); see the module docstring."""
        B, T = input_ids.shape
        device = input_ids.device
        if prompt_lengths is None:
            prompt_lengths = torch.zeros(B, dtype=torch.long, device=device)
        bs = self.config.block_size
        block = block_ids_for(T, bs, device).expand(B, T)  # (B, T)
        valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                 else attention_mask.bool())
        positions = torch.arange(T, device=device).expand(B, T)
        # clean stream: key j visible to query i iff block(j) <= block(i) and j is not padding
        clean_clean = (block[:, None, :] <= block[:, :, None]) & valid[:, None, :]  # (B, T, T)
        if noisy_ids is None:
            hidden = self._trunk(input_ids, positions, clean_clean[:, None])
            return TinyDllmOutput(logits=self.lm_head(hidden), hidden_states=hidden)
        R = noisy_ids.shape[1]
        offs = torch.arange(R, device=device)[None, :]  # (1, R)
        first_block = prompt_lengths[:, None] // bs  # (B, 1): the output block holding the leftover prompt
        noisy_block = first_block + offs // bs  # (B, R)
        noisy_valid = (torch.ones_like(noisy_ids, dtype=torch.bool) if noisy_mask is None
                       else noisy_mask.bool())
        # a noisy token of block b sees the clean tokens of blocks < b and the noisy tokens of block b;
        # clean tokens never see noisy ones
        noisy_clean = (block[:, None, :] < noisy_block[:, :, None]) & valid[:, None, :]  # (B, R, T)
        noisy_noisy = (noisy_block[:, None, :] == noisy_block[:, :, None]) & noisy_valid[:, None, :]  # (B, R, R)
        mask = torch.cat([
            torch.cat([clean_clean, torch.zeros(B, T, R, dtype=torch.bool, device=device)], dim=2),
            torch.cat([noisy_clean, noisy_noisy], dim=2),
        ], dim=1)[:, None]  # (B, 1, T+R, T+R)
        both = torch.cat([positions, first_block * bs + offs], dim=1)  # (B, T+R)
        hidden = self._trunk(torch.cat([input_ids, noisy_ids], dim=1), both, mask)[:, T:]  # (B, R, H)
        return TinyDllmOutput(logits=self.lm_head(hidden), hidden_states=hidden)

    def allocate_cache(self, n_slots: int, capacity: int | None = None) -> TinyKVCache:
        """A KV cache of ``n_slots`` slots; capacity defaults to max_position_embeddings plus room
        for a two-block chunk written past the committed tokens."""
        capacity = capacity or self.config.max_position_embeddings + 2 * self.config.block_size
        return TinyKVCache(self.config, n_slots, capacity, self.dtype, self.device)

    @torch.inference_mode()  # not no_grad: less bookkeeping per op, ~10 % off a one-request round
    def forward_step(self, cache: TinyKVCache, slots: torch.Tensor, input_ids: torch.Tensor,
                     n_valid: torch.Tensor, commit_len: torch.Tensor, out_start: torch.Tensor,
                     window: int | None = None, with_logits: bool = True, with_layers: bool = False,
                     block_len: int = 0):
        """One cached round: a chunk of up to L tokens per active slot.

        Row r belongs to slot ``slots[r]`` and holds ``n_valid[r]`` real tokens (the rest padding)
        placed right after that slot's committed tokens. Its first ``commit_len[r]`` tokens are
        clean and form their own block (a prompt block, or a finished output block); any tokens after
        them form the next block, which sees them (block-causal). After the pass the first
        ``commit_len[r]`` tokens' keys/values are committed to the cache.

        Parameters
        ----------
        cache : TinyKVCache from ``allocate_cache``.
        slots : LongTensor (n,), distinct slot indices.
        input_ids : LongTensor (n, L).
        n_valid, commit_len : LongTensor (n,), 0 <= commit_len <= n_valid <= L.
        out_start : LongTensor (n,), first position of the window returned per row.
        window : length of the returned window (default ``config.block_size``); ``out_start + window``
            must not exceed L.
        with_logits : also run the LM head over the window.
        with_layers : also return every layer's state over the window (see ``_trunk``).
        block_len : above 0, the chunk is instead consecutive blocks of ``block_len`` tokens from its
            first token, each seeing the ones before it (D2F's pipeline rows: several blocks per forward).

        Returns
        -------
        logits : (n, window, V), or None; hidden : (n, window, H), final layer after the final norm,
        for positions ``out_start[r] + arange(window)`` of each row; layers : (n, n_layers + 1, window, H)
        (``layers[:, -1]`` is ``hidden``), or None without ``with_layers``.
        """
        n, L = input_ids.shape
        device = input_ids.device
        offs = torch.arange(L, device=device)
        start = cache.lengths[slots]  # (n,)
        positions = start[:, None] + offs  # (n, L)
        key_len = int((start + L).max())
        cache.finite_up_to(key_len)
        keys = torch.arange(key_len, device=device)  # (T_k,)
        rel = keys[None, :] - start[:, None]  # (n, T_k) key position relative to the chunk
        if block_len:  # a chunk token is in block offs // block_len (D2F: a pipeline of blocks in one forward)
            q_block, k_block = (offs // block_len)[None, :].expand(n, L), rel.clamp_min(0) // block_len
        else:  # a chunk token is in block 0 (its clean commit part) or block 1 (the part after it)
            q_block = (offs[None, :] >= commit_len[:, None]).long()  # (n, L)
            k_block = (rel >= commit_len[:, None]).long()  # (n, T_k)
        k_cached = rel < 0
        k_chunk = (rel >= 0) & (rel < n_valid[:, None])
        visible = k_cached[:, None, :] | (
            k_chunk[:, None, :] & (k_block[:, None, :] <= q_block[:, :, None]))  # (n, L, T_k)
        all_slots = n == cache.n_slots and bool((slots == torch.arange(n, device=device)).all())
        packing = Packing(offs[None, :] < n_valid[:, None])
        writes = [KVWrite(cache.k[i], cache.v[i], slots, positions, key_len, all_slots, packing)
                  for i in range(self.config.n_layers)]
        # additive (0 or -inf), as cached_attention adds it to the scores
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=device).masked_fill_(~visible, float("-inf"))
        states: list | None = [] if with_layers else None
        hidden = packing.unpack(self._trunk(input_ids, positions, bias[:, None], writes, states))  # (n, L, H)
        window = out_start[:, None] + torch.arange(window or self.config.block_size, device=device)  # (n, W)
        hidden = hidden.gather(1, window[:, :, None].expand(-1, -1, hidden.shape[-1]))  # (n, W, H)
        layers = None
        if states is not None:
            layers = torch.stack([packing.unpack(s) for s in states], dim=1)  # (n, n_layers + 1, L, H)
            layers = layers.gather(2, window[:, None, :, None].expand(-1, layers.shape[1], -1, layers.shape[-1]))  # (n, n_layers + 1, W, H)
        cache.lengths[slots] = start + commit_len
        return (self.lm_head(hidden) if with_logits else None), hidden, layers


def register() -> None:
    """Register the config and model with the transformers Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel

    try:
        AutoConfig.register(TinyDllmConfig.model_type, TinyDllmConfig)
    except ValueError:  # already registered
        pass
    try:
        AutoModel.register(TinyDllmConfig, TinyDllmForBlockDiffusion)
    except ValueError:
        pass
