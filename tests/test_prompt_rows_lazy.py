"""The prompt-row cache keys the rows a step keeps when the next lookup comes (``reserve_tokens``),
not on the step: the same rows are found under the same keys as when every row was keyed at once."""

from __future__ import annotations

import torch

from dwise_predict.serving.sglang.buffers import _BlockKeys, _PromptRows, block_key


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


KEYED: list = []  # the blocks each _BlockKeys.key call keyed, while counted
_KEY = _BlockKeys.key


def _counted_key(self, blocks, block_size):
    KEYED.append(blocks)
    return _KEY(self, blocks, block_size)


def test_a_lookup_after_a_long_run_keys_a_bounded_number_of_rows_and_later_lookups_find_the_rest(monkeypatch):
    """Issue 56: the first lookup after a run without one keyed every row kept since (up to the
    capacity, 4,096 blake2b hashes on the scheduler thread in one step). A step now keys at most
    256 rows, the newest first; the rows it passes over are keyed by the lookups of later steps."""
    n, bound = 4096, 256
    rows = _PromptRows(n)
    rows.allocate(1, "cpu")
    reqs = [Req(range(8 * i, 8 * i + 8)) for i in range(n)]  # one-block prompts, all different
    keys = [block_key(Req(r.origin_input_ids), 1, 8) for r in reqs]  # the lookups' own keys, not counted
    KEYED.clear()
    monkeypatch.setattr(_BlockKeys, "key", _counted_key)
    for value, req in enumerate(reqs):
        rows.rows[rows.reserve_tokens(req, 1, 8)] = float(value)
    assert not KEYED and len(rows.pending) == n  # keeping hashes nothing
    assert float(rows.get(keys[-1])) == n - 1  # the newest row is found ...
    assert len(KEYED) <= bound  # ... and the lookup keyed at most the bound
    assert rows.keys_per_step == bound
    KEYED.clear()
    assert float(rows.get(keys[n - bound], step=1)) == n - bound  # keyed by that lookup: found
    assert len(KEYED) == bound  # a new step keys the next 256 ...
    assert rows.get(keys[0], step=1) is None and len(KEYED) == bound  # ... and no more: the oldest waits
    found = [rows.get(keys[0], step=step) is not None for step in range(2, n // bound)]
    assert found == [False] * (n // bound - 3) + [True]  # the lookups of later steps reach it
    assert len(KEYED) <= bound * (n // bound - 1) and not rows.pending
    assert [float(rows.get(keys[i])) for i in (0, 1, n // 2, n - 1)] == [0.0, 1.0, n // 2, n - 1]


def test_rows_a_lookup_passed_over_leave_before_the_rows_it_keyed():
    rows = _PromptRows(4, keys_per_step=2)
    rows.allocate(1, "cpu")
    reqs = [Req(range(8 * i, 8 * i + 8)) for i in range(6)]
    for value, req in enumerate(reqs[:4]):
        rows.rows[rows.reserve_tokens(req, 1, 8)] = float(value)
    assert float(rows.get(block_key(reqs[3], 1, 8))) == 3.0  # keys 3 and 2; passes over 0 and 1
    for value, req in ((4.0, reqs[4]), (5.0, reqs[5])):
        rows.rows[rows.reserve_tokens(req, 1, 8)] = value  # full: the passed-over rows leave, oldest first
    got = [rows.get(block_key(req, 1, 8), step=9) for req in reqs]
    assert [None if row is None else float(row) for row in got] == [None, None, 2.0, 3.0, 4.0, 5.0]
