"""engine.signals.early_signals runs a small vocabulary's requests in one chunk (fewer tensor ops per
call on the serving hook's step); its values are those of the 8-request chunks it used before."""

from __future__ import annotations

import pytest
import torch

from dwise_predict.engine import signals


@pytest.mark.parametrize("vocab,block,chunk", [(1, 8, 1048576), (50, 8, 20971), (3000, 32, 87), (40000, 32, 8)])
def test_signals_in_larger_chunks_equal_the_eight_request_chunks(monkeypatch, vocab, block, chunk):
    gen = torch.Generator().manual_seed(vocab + block)
    batch, mask_id = 37, 0
    logits = torch.randn(batch * block, vocab, generator=gen) * 3
    ids = torch.randint(0, 3, (batch * block,), generator=gen)  # about a third masked (id 0)
    ids[:block] = 1  # a block without masks: zeros for it
    stop_ids = torch.tensor([min(1, vocab - 1)])
    assert max(signals.CHUNK_REQUESTS, signals.CHUNK_FLOATS // (block * vocab)) == chunk  # a large vocabulary: 8
    got = signals.early_signals(logits, ids, mask_id, block, 0.5, stop_ids)
    monkeypatch.setattr(signals, "CHUNK_FLOATS", 0)  # the 8-request chunks of the earlier version
    want = signals.early_signals(logits, ids, mask_id, block, 0.5, stop_ids)
    assert got.shape == (batch, 4)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    has_masks = (ids.view(batch, block) == mask_id).any(1)
    assert not has_masks[0] and torch.equal(got[0], torch.zeros(4))
    assert got[has_masks, 1].gt(0).all() and got[~has_masks].eq(0).all()  # mean confidence over masks; none: zeros
