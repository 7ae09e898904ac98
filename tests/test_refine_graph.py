"""The shared refinement graph: survival maths and the isotonic lookup against NumPy references."""

import math

import numpy as np
import pytest
import torch

from dwise_predict.names import HIDDEN_STATES, LENGTH_SCALE
from dwise_predict.survival.network import (
    HazardMLP,
    build_refine_graph,
    expected_remaining,
    isotonic_interp,
    refine_state,
    survival_from_logits,
)


def test_survival_matches_cumulative_product():
    logits = torch.randn(5, 40, dtype=torch.float64) * 3
    reference = torch.cumprod(1 - torch.sigmoid(logits), dim=1)
    torch.testing.assert_close(survival_from_logits(logits), reference, rtol=1e-10, atol=1e-12)


def test_constant_hazard_mean_is_geometric_mean():
    # hazard h at every round, K large: E[T] = (1 - h) / h
    h = 0.2
    logits = torch.full((1, 400), float(np.log(h / (1 - h))), dtype=torch.float64)
    assert abs(expected_remaining(logits).item() - (1 - h) / h) < 1e-9


def test_isotonic_interp_equals_np_interp_including_clipping():
    xp = torch.tensor([0.5, 1.0, 4.0, 9.0, 20.0])
    fp = torch.tensor([0.0, 2.0, 3.0, 3.0, 50.0])
    x = torch.tensor([-3.0, 0.5, 0.7, 1.0, 2.5, 9.0, 15.0, 20.0, 99.0])
    np.testing.assert_allclose(isotonic_interp(x, xp, fp).numpy(), np.interp(x.numpy(), xp.numpy(), fp.numpy()), rtol=1e-6)


def test_build_from_state_reproduces_members():
    torch.manual_seed(0)
    members = [HazardMLP(13, 7, width=16, dropout=0.0).eval() for _ in range(3)]
    mean, std = torch.randn(13), torch.rand(13) + 0.5
    spec = dict(in_features=13, num_rounds=7, width=16, members=3, prompt_norm=100.0, budget_norm=64.0,
                length_scale=LENGTH_SCALE, hidden_states=list(HIDDEN_STATES))
    graph = build_refine_graph(refine_state(members, mean, std), spec, {"x": [0.0, 10.0], "y": [0.0, 10.0]})
    h, last = torch.randn(4, 4), torch.randn(4, 4)
    pt, b, sig = torch.tensor([10.0, 20, 30, 40]), torch.full((4,), 64.0), torch.rand(4, 3)
    # the states side by side, then lengths on the log scale, written out: log(1 + n) / log(1 + norm)
    lengths = [(torch.log(1 + pt) / math.log(101.0)).unsqueeze(1), (torch.log(1 + b) / math.log(65.0)).unsqueeze(1)]
    x = (torch.cat([h, last, *lengths, sig], 1) - mean) / std
    expected = torch.stack([expected_remaining(m(x)) for m in members]).mean(0)
    torch.testing.assert_close(graph(h, last, pt, b, sig), expected.detach())
    # a spec of an older run (one hidden state) is refused, not misread
    with pytest.raises(ValueError, match="hidden states \\['first_round'\\].*retrain"):
        build_refine_graph(refine_state(members, mean, std), {**spec, "hidden_states": ["first_round"]},
                           {"x": [0.0, 10.0], "y": [0.0, 10.0]})


def test_short_units_equal_dense_units_that_ignore_the_long_columns():
    """A member's short units read only the last columns: the same function as ``fc1`` rows that are
    zero on every other column, stored without those zeros."""
    torch.manual_seed(1)
    short = HazardMLP(10, 5, width=2, dropout=0.0, short_features=3, short_width=6).eval()
    dense = HazardMLP(10, 5, width=8, dropout=0.0).eval()
    with torch.no_grad():
        dense.fc1.weight.zero_()
        dense.fc1.weight[:2] = short.fc1.weight
        dense.fc1.weight[2:, 7:] = short.fc1_short.weight
        dense.fc1.bias.copy_(torch.cat([short.fc1.bias, short.fc1_short.bias]))
        dense.fc2.load_state_dict(short.fc2.state_dict())
    x = torch.randn(6, 10)
    torch.testing.assert_close(short(x), dense(x))
    assert sum(p.numel() for p in short.parameters()) < sum(p.numel() for p in dense.parameters())
