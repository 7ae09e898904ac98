"""What the hook keeps on the model's device: the pooling buffers the forward writes, the rows it
keeps across steps, and the prompt-row cache.

The pooling buffer is allocated at install (block size and largest batch known then), so the copy
into it (``LogitsProcessor._get_dllm_logits``, wrapped) is captured in SGLang's CUDA graphs and
every replay writes it. ``DllmAlgorithm.run`` (wrapped) fills it with NaN before a step until the
first refinement has checked it: an unwritten buffer (a graph captured before install) is a
one-line :class:`~dwise_predict.errors.ConfigError` (:data:`UNWRITTEN`), never silent zeros.
Leftover prompt rows are pooled, like the block rows, into a second static buffer through per-row
masks and ``1/n`` scales written before each step; both means sum in fp32 whatever the model's dtype
(:meth:`PoolingBuffers.pool`), as ``collect`` pools. The rows' own inputs (which rows, prompt
tokens, budget, leftover positions) go to the device in one copy before the forward, through a
pinned buffer (:class:`_ToDevice`).

The refinement's ``prompt_last`` input is the pooled row of the request's last prompt block, kept on
the device (``own_last``). A request that runs no prompt block of its own after a prefix-cache hit
on every full block gets the row of the earlier request's forward that computed that same last block
over the same tokens, as a prompt block or as a finished request's last output block
(:class:`_PromptRows`, bounded).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque

import numpy as np

KEYS_PER_STEP = 256  # the most prompt-cache rows a scheduler step keys (_PromptRows: why it is bounded)
UNWRITTEN = (
    "the first refinement read a pooling buffer the forward never wrote (CUDA-graph replays skip "
    "Python): install the hook in the scheduler process before start-up (`dwise-predict serve`, or "
    "dwise_predict.serving.sglang.install(..., block_size=, max_batch=, device=) before the graphs are captured)"
)


class _PromptRows:
    """Pooled rows of the blocks recent requests completed — each prompt block's forward, and a
    finished request's last full block's last forward (the one over its final tokens, which SGLang
    caches) — keyed by every token up to the block's end: the ``prompt_last`` of a later request whose
    every full prompt block a prefix-cache hit served (a shared system prompt, a repeated prompt, the
    next turn of a chat: the previous prompt, its answer and fewer new tokens than a block after its
    last full block). Intermediate output blocks are not kept: only a prompt that branches off inside
    an earlier answer would end on one, and keying every block cost the scheduler a hash and a copy per
    row and step.

    A block's rows depend on its own tokens and those before it only (block-causal attention), so the
    row an earlier request computed for a block ending where the later request's last full block ends,
    over the same tokens, is the row that request's own forward would have computed — what ``collect``
    (no prefix cache) records. That needs SGLang to run a prompt block and an output block's forward
    alike: it gives both the forward mode DLLM_EXTEND, and nothing on its forward path reads a
    request's phase (checked against the wheel in ``test_serving_sglang_adapter.py``); algorithms that
    encode the context separately prefill as EXTEND, and for those no rows are keyed. Least recently
    used rows leave first once ``capacity`` are held (``capacity`` rows of H floats on the model's
    device, allocated at install; 0 keeps none).

    The scheduler keeps rows every step but looks one up only for a request that ran no prompt block
    of its own, so a kept row's key (a digest of its tokens, :func:`block_key`) is computed when a
    lookup comes (:meth:`reserve_tokens`, :meth:`get`), not on the step that keeps it: a server
    whose requests all run their own prompt blocks hashes nothing. Rows kept since the last lookup
    count as more recently used than every keyed row (a keyed row read after they were kept may leave
    before them).

    A scheduler step keys at most ``keys_per_step`` rows (:data:`KEYS_PER_STEP`), the newest first,
    so the first lookup after a long run without one costs at most that many hashes (about 3 µs each
    on a 2-core CPU), not one per row kept since (up to ``capacity``: 4,096, some 11 ms in one step).
    The rows it passes over stay, unkeyed: the lookups of later steps key them, newest first, the
    step's budget each, and once the cache is full they leave before any keyed row (a lookup
    preferred newer rows to them, and none was ever read). Bounding the pending rows instead (dropping
    the oldest unkeyed ones) would forget rows a later lookup could still find; keying them in the
    steps between lookups would hash on servers that never look one up. The price: a lookup finds a
    row kept before the newest ``keys_per_step`` unkeyed ones only once earlier lookups have keyed
    it, so a server that looks up rarely and keeps more rows than that between lookups finds fewer
    of its oldest rows than an unbounded lookup would; one that looks up at least once every
    ``keys_per_step`` kept rows (2 B at B = 128: every step keeps at most one row per request it
    runs) keys every row, as before.
    """

    def __init__(self, capacity: int, keys_per_step: int | None = None):
        self.capacity = max(0, int(capacity))
        self.keys_per_step = KEYS_PER_STEP if keys_per_step is None else int(keys_per_step)
        self.slots: OrderedDict = OrderedDict()  # key -> row of ``rows``, least recently used first
        self.pending: deque = deque()  # (its request's _BlockKeys, blocks, block size, row): kept, not yet keyed
        self.passed = 0  # the oldest rows of ``pending`` that a lookup passed over (its budget spent on newer ones)
        self.step, self.budget = None, 0  # the step of the last lookup, and the rows it may still key
        self.rows = None  # (capacity, H) on the model's device (``PoolingBuffers.hold_rows``, or ``allocate``)
        self.free = list(range(self.capacity))

    def allocate(self, width: int, device) -> None:
        import torch

        self.rows = torch.zeros((self.capacity, width), device=device)

    def reserve(self, key: bytes) -> int:
        """The row that holds ``key``'s pooled row from now on (the least recently used one's, once
        every row is taken); the caller writes it."""
        slot = self.slots.pop(key, None)
        if slot is None:
            slot = self._take()
        self.slots[key] = slot
        return slot

    def reserve_tokens(self, req, blocks: int, block_size: int) -> int:
        """:meth:`reserve` for the block of ``req`` ending at token ``blocks * block_size``, keyed by
        those tokens (:func:`block_key`) at the next lookup."""
        return self.reserve_blocks((req,), (blocks,), block_size)[0]

    def reserve_blocks(self, reqs, blocks, block_size: int) -> list:
        """:meth:`reserve_tokens` of each of ``reqs`` (``blocks``: each one's), in order: their rows."""
        free, take, keep = self.free, self._take, self.pending.append
        rows = []
        for req, n in zip(reqs, blocks):
            slot = free.pop() if free else take()
            keep((_block_keys(req), n, block_size, slot))
            rows.append(slot)
        return rows

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.passed:  # passed over by a lookup: older than every row it keyed, and never read
            self.passed -= 1
            return self.pending.popleft()[3]
        if self.slots:
            return self.slots.popitem(last=False)[1]
        return self.pending.popleft()[3]

    def get(self, key: bytes, step=None):
        """The row kept for ``key`` (:func:`block_key`), or None, after keying the newest unkeyed
        rows, at most ``keys_per_step`` in the scheduler step ``step`` (any value that names the step;
        None: a step of its own)."""
        if self.pending:
            if step is None or step != self.step:
                self.step, self.budget = step, self.keys_per_step
            if self.budget:
                self._key_newest()
        slot = self.slots.get(key)
        if slot is None:
            return None
        self.slots.move_to_end(key)
        return self.rows[slot]

    def _key_newest(self) -> None:
        """Key the newest unkeyed rows, as many as the step's budget allows; the rest were passed over."""
        pending, slots = self.pending, self.slots
        n = min(self.budget, len(pending))
        self.budget -= n
        newest = [pending.pop() for _ in range(n)]
        for keys, blocks, block_size, slot in reversed(newest):  # oldest first: a later row of the same tokens wins
            pending_key = keys.key(blocks, block_size)
            old = slots.pop(pending_key, None)
            if old is not None:
                self.free.append(old)
            slots[pending_key] = slot
        self.passed = len(pending)  # every row left is older than those keyed now


class _BlockKeys:
    """The keys of one request's leading blocks (:func:`block_key`): one running hash over its tokens
    (prompt, then output), fed block by block, so its keys cost one pass over its tokens however many
    blocks ask, in whatever order. It holds the request's token lists, not the request; its hash starts
    at the first key asked (most requests' kept rows are never looked up)."""

    __slots__ = ("origin", "output", "keys", "running", "hashed")

    def __init__(self, req):
        self.origin, self.output = req.origin_input_ids, req.output_ids
        self.keys: dict = {}  # blocks -> key
        self.running = None  # the running hash (blake2b), made by the first key
        self.hashed = 0  # blocks in the running hash

    def key(self, blocks: int, block_size: int) -> bytes:
        key = self.keys.get(blocks)
        if key is None:
            if self.running is None:
                self.running = hashlib.blake2b(digest_size=16)
            running, hashed = self.running, self.hashed
            if blocks < hashed:  # behind the running hash: hash those tokens afresh
                running, hashed = hashlib.blake2b(digest_size=16), 0
            else:
                self.hashed = blocks
            running.update(_token_bytes(self.origin, self.output, hashed * block_size, blocks * block_size))
            key = self.keys[blocks] = running.digest()
        return key


def _block_keys(req) -> _BlockKeys:
    """``req``'s :class:`_BlockKeys`, kept on the request (its token lists as they are now)."""
    keys = req.__dict__.get("_dwise_block_keys")
    if keys is None:
        keys = req._dwise_block_keys = _BlockKeys(req)
    else:
        keys.origin, keys.output = req.origin_input_ids, req.output_ids
    return keys


def block_key(req, blocks: int, block_size: int) -> bytes:
    """Digest of ``req``'s first ``blocks`` full blocks of tokens (prompt, then output: what a
    retraction put back into its prompt, or a finished request's answer): one hash over every token up
    to the block's end (:class:`_BlockKeys`)."""
    return _block_keys(req).key(blocks, block_size)


def _token_bytes(origin, output, start: int, stop: int):
    """Tokens ``[start, stop)`` of a request's prompt ``origin`` then its output, as int64 bytes."""
    n = len(origin)
    if stop <= n:
        tokens = origin[start:stop]
    else:
        tokens = array("q", origin[start:n]) if start < n else array("q")
        tokens.extend(output[max(0, start - n):stop - n])
    return tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)


class _ToDevice:
    """Host vectors (float32, or int64 indices; a list or an array) onto the model's device in one copy
    that does not block the host: a copy from pageable memory may synchronise the stream, so on CUDA it
    goes through a pinned buffer.
    One call per step and buffer: it is written again only after the step's own synchronisation
    (SGLang's, when it commits the step's tokens) has passed. On a CPU device no copy is made: the
    caller's vector, as one fresh array, becomes the tensor."""

    def __init__(self, device, capacity: int, dtype: str = "float32"):
        import torch

        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        on_host = self.device.type == "cpu"
        self.dtype = np.dtype(dtype)
        self.host = None if on_host else torch.empty(capacity, dtype=getattr(torch, dtype), pin_memory=self.pinned)

    def __call__(self, values):
        import torch

        if self.host is None:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=self.dtype))
        n = len(values)
        self.host[:n].numpy()[:] = values
        if not self.pinned:
            return self.host[:n].to(self.device, copy=True)
        return self.host[:n].to(self.device, non_blocking=True)


class PoolingBuffers:
    """The device buffers of pooling, all allocated here, at install, before SGLang captures its
    CUDA graphs (``torch`` is imported here, not at the package's import).

    width : the model's hidden size ``H``.
    rows : most requests in one forward (``max(max_batch, slots)``).
    resident : requests that may hold a prompt-block row at once (``floor(k * B)``).
    prompt_rows : the prompt-row cache (:class:`_PromptRows`), its rows placed after ``own_last``.
    prompt_mean : the bundle's training mean of ``prompt_last`` (host), or None without a bundle.
    """

    def __init__(self, width: int, rows: int, block_size: int, resident: int, prompt_rows: _PromptRows, device,
                 prompt_mean=None):
        import torch

        self.pooled2 = torch.full((rows, 2, width), math.nan, device=device)  # (rows, 2, H) static, written inside
        self.pooled = self.pooled2[:, 0]  # the forward: [:, 0] each row's mean over its block rows,
        self.leftover_pooled = self.pooled2[:, 1]  # [:, 1] the mean of its leftover prompt rows
        # static fp32 inputs of the pooling (pool): which rows each mean sums, 0/1 (exact in any dtype),
        # and the 1/n it is scaled by, in fp32 (1/3 is not exact in bf16): 1/block over every block row,
        # and 1/n over a row's n leftover prompt positions (mask zeros elsewhere)
        self.mask = torch.zeros((rows, 2, block_size), device=device)
        self.mask[:, 0] = 1.0
        self.scale = torch.zeros((rows, 2, 1), device=device)
        self.scale[:, 0] = 1.0 / block_size
        self.leftover_mask, self.leftover_scale = self.mask[:, 1], self.scale[:, 1]
        self.weights_set = False  # leftover_mask holds a nonzero row
        # a row's leftover mask and 1/n by its n leftover prompt positions (0 to block - 1), made once: a step
        # stages its rows' by one lookup each (DwiseHook.stage_rows). Python floats holding fp32 values, so
        # the staged fp32 vector is built from one list, in one conversion
        n = np.arange(block_size, dtype=np.float32)
        weights = np.empty((block_size, block_size + 1), dtype=np.float32)
        np.less(n, n[:, None], out=weights[:, :block_size])
        np.divide(np.float32(1.0), np.maximum(n, np.float32(1.0)), out=weights[:, block_size])
        self.leftover_weights = weights.tolist()
        self.views: dict = {}  # batch size -> (pooled[:size], leftover_pooled[:size]) (rows_of)
        self.to_device = _ToDevice(device, (5 + block_size) * rows)  # the step's per-row inputs
        self.to_device_kept = _ToDevice(device, 4 * rows, "int64")  # its own buffer: the next step's copy may be in flight
        self.prompt_rows = prompt_rows  # the same for recent blocks of any request, by tokens
        # own_last: (k*B, H) device rows, each request's latest prompt-block row until its first round (a
        # row is held from a request's first prompt block to its first round); kept_rows: own_last's rows,
        # then prompt_rows' (hold_rows)
        self.kept_rows = self.own_last = None
        self.hold_rows(torch.zeros((resident + prompt_rows.capacity, width), device=device), resident)
        self.own_free = list(range(resident - 1, -1, -1))  # rows of own_last no request holds
        self.prompt_mean = None  # the bundle's training mean of prompt_last on the device
        if prompt_mean is not None:
            self.prompt_mean = torch.as_tensor(prompt_mean, dtype=torch.float32, device=device)

    def pool(self, blocks) -> None:
        """Write the means of ``blocks`` (rows, block, H: each request's block rows, in the model's
        dtype) into ``pooled2[:rows]`` in fp32, as ``collect`` pools (its fp32 mean): the 0/1 mask's
        product, summed in fp32 with an fp32 result, then scaled by the fp32 ``1/n``. In place, on
        static buffers, no host sync: what a CUDA graph captures. On CUDA a bf16/fp16 GEMM sums in
        fp32 already, and ``out_dtype`` keeps its result in fp32 (no fp32 copy of the hidden states);
        elsewhere the hidden states are read as fp32 (no copy when they are fp32)."""
        import torch

        rows = blocks.shape[0]
        out, mask = self.pooled2[:rows], self.mask[:rows]
        if blocks.is_cuda and blocks.dtype in (torch.bfloat16, torch.float16):
            torch.bmm(mask.to(blocks.dtype), blocks, torch.float32, out=out)
        else:
            torch.bmm(mask, blocks.float(), out=out)
        out.mul_(self.scale[:rows])

    def rows_of(self, size: int) -> tuple:
        """``(pooled[:size], leftover_pooled[:size])``, the rows a forward of ``size`` requests writes:
        views of the static buffers, made once per size (a view is a tensor op, microseconds of the
        scheduler thread every step)."""
        views = self.views.get(size)
        if views is None:
            views = self.views[size] = (self.pooled[:size], self.leftover_pooled[:size])
        return views

    def hold_own(self, own_row: list, slot: int) -> int:
        """The row of ``own_last`` of the request in policy slot ``slot`` (``own_row``: the request
        table's row per slot, -1: none): its own, or a free row taken now (the buffer doubles if every
        row is held: more requests than the k*B resident ones it was sized for, which SGLang's queues
        should not allow)."""
        row = own_row[slot]
        if row < 0:
            if not self.own_free:
                import torch

                held = len(self.own_last)
                self.hold_rows(torch.cat([self.own_last, torch.zeros_like(self.own_last), self.prompt_rows.rows]), 2 * held)
                self.own_free.extend(range(2 * held - 1, held - 1, -1))
            row = own_row[slot] = self.own_free.pop()
        return row

    def hold_rows(self, rows, own: int) -> None:
        """``rows``: the device rows kept across steps, ``own_last`` (its first ``own`` rows) then the
        prompt-row cache's: one buffer, so a step keeps its rows of both in one device op."""
        self.kept_rows, self.own_last, self.prompt_rows.rows = rows, rows[:own], rows[own:]

    def release_own(self, own_row: list, slots) -> None:
        """The requests in ``slots`` no longer need their prompt-block rows (their first round ran)."""
        for slot in slots:
            if own_row[slot] >= 0:
                self.own_free.append(own_row[slot])
                own_row[slot] = -1
