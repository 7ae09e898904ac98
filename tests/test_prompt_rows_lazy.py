"""The prompt-row cache keys the rows a step keeps when the next lookup comes (``reserve_tokens``),
not on the step: the same rows are found under the same keys as when every row was keyed at once."""

from __future__ import annotations

import torch

from dwise_predict.serving.sglang.buffers import _PromptRows, block_key


class Req:
    def __init__(self, ids, out=()):
        self.origin_input_ids, self.output_ids = list(ids), list(out)


def test_rows_kept_unkeyed_are_found_by_their_tokens_at_the_next_lookup():
    rows = _PromptRows(4)
    rows.allocate(1, "cpu")
    a, b = Req(range(24)), Req(list(range(16)) + [99] * 8)
    for req, blocks, value in ((a, 1, 1.0), (a, 2, 2.0), (b, 3, 3.0)):
        rows.rows[rows.reserve_tokens(req, blocks, 8)] = value
    assert len(rows.pending) == 3 and not rows.slots  # nothing hashed while keeping
    assert float(rows.get(block_key(Req(range(40)), 2, 8))) == 2.0  # a later prompt over the same 16 tokens
    assert not rows.pending and len(rows.slots) == 3
    assert float(rows.get(block_key(b, 3, 8))) == 3.0 and float(rows.get(block_key(a, 1, 8))) == 1.0
    assert rows.get(block_key(a, 3, 8)) is None  # a's third block was never kept


def test_the_same_block_kept_twice_holds_one_row_and_the_oldest_leave_first():
    rows = _PromptRows(3)
    rows.allocate(1, "cpu")
    same = [Req(range(8)), Req(range(8))]
    for value, req in zip((1.0, 2.0), same):
        rows.rows[rows.reserve_tokens(req, 1, 8)] = value
    rows.rows[rows.reserve_tokens(Req(range(100, 108)), 1, 8)] = 3.0
    assert float(rows.get(block_key(same[0], 1, 8))) == 2.0  # the later row of the same tokens wins
    assert len(rows.slots) == 2 and len(rows.free) == 1  # the earlier one's row is free again
    # full: keyed rows leave least recently used first, then unkeyed ones oldest first
    rows.rows[rows.reserve_tokens(Req(range(200, 208)), 1, 8)] = 4.0  # takes the free row
    rows.rows[rows.reserve_tokens(Req(range(300, 308)), 1, 8)] = 5.0  # evicts the other block (100..107)
    assert rows.get(block_key(Req(range(100, 108)), 1, 8)) is None
    values = sorted(float(rows.get(block_key(Req(range(s, s + 8)), 1, 8))) for s in (0, 200, 300))
    assert values == [2.0, 4.0, 5.0]
    assert torch.equal(rows.rows.sort(0).values.flatten(), torch.tensor([2.0, 4.0, 5.0]))
