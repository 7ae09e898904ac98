"""The shared refinement graph: survival maths and the isotonic lookup against NumPy references."""

import math

import numpy as np
import torch

from dwise_predict.identity import LENGTH_SCALE
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
                length_scale=LENGTH_SCALE)
    graph = build_refine_graph(refine_state(members, mean, std), spec, {"x": [0.0, 10.0], "y": [0.0, 10.0]})
    h, pt, b, sig = torch.randn(4, 8), torch.tensor([10.0, 20, 30, 40]), torch.full((4,), 64.0), torch.rand(4, 3)
    # lengths on the log scale, written out: log(1 + n) / log(1 + norm)
    lengths = [(torch.log(1 + pt) / math.log(101.0)).unsqueeze(1), (torch.log(1 + b) / math.log(65.0)).unsqueeze(1)]
    x = (torch.cat([h, *lengths, sig], 1) - mean) / std
    expected = torch.stack([expected_remaining(m(x)) for m in members]).mean(0)
    torch.testing.assert_close(graph(h, pt, b, sig), expected.detach())
