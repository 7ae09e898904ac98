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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_floats", [signals.CHUNK_FLOATS, 0])  # one chunk; chunks of 8 requests
def test_the_hooks_rows_in_a_reused_scratch_equal_the_rows_gathered_first(monkeypatch, dtype, chunk_floats):
    """The serving hook's path on a CPU: the signals of some batch rows (``rows``), computed in a
    SignalScratch kept from call to call, equal bit for bit those of the same rows gathered first and
    computed in fresh tensors; the scratch grows to the largest chunk once and is reused, inside
    torch's inference mode (SGLang's) and outside it."""
    from dwise_predict.serving.sglang.signals import SignalScratch, row_signals

    monkeypatch.setattr(signals, "CHUNK_FLOATS", chunk_floats)
    gen = torch.Generator().manual_seed(11)
    batch, block, vocab, mask_id = 29, 4, 30000, 0
    logits = (torch.randn(batch * block, vocab, generator=gen) * 4).to(dtype)
    ids = torch.randint(0, 3, (batch * block,), generator=gen)
    stop_ids = torch.tensor([1, vocab - 1])
    scratch, held = SignalScratch(), []
    for rows, inference in ((torch.tensor([28, 0, 5]), True), (torch.arange(0, batch, 2), False),
                            (torch.tensor([3, 4]), True), (torch.arange(batch - 1, -1, -1), False)):
        want = signals.early_signals(logits.view(batch, block, vocab).index_select(0, rows).reshape(-1, vocab),
                                     ids.view(batch, block).index_select(0, rows).reshape(-1), mask_id, block, 0.5,
                                     stop_ids)
        with torch.inference_mode(inference):
            got = row_signals(logits, ids, rows, mask_id, block, 0.5, stop_ids, scratch)
        assert got.shape == (len(rows), 4) and torch.equal(got, want)
        held.append(scratch.gathered.data_ptr())
    chunk = max(signals.CHUNK_REQUESTS, chunk_floats // (block * vocab))
    assert scratch.gathered.numel() == min(chunk, batch) * block * vocab
    if chunk >= batch:  # grown for 3 rows, then 15, then 29
        assert held[1] == held[2] != held[3]
    else:  # 8-request chunks: 3 rows, then 8 from the second call on
        assert held[1] == held[2] == held[3]
