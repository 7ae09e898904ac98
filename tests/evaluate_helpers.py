"""Small known-answer traces and a fast training config for the evaluation tests.

Four categories whose remaining rounds depend on a latent difficulty only the first-round hidden
state sees (``make_synthetic_traces``), strong enough (difficulty_scale 1.5) that a held-out
category's order is recoverable from the hidden state but not from the prompt features.
"""

from __future__ import annotations

from pathlib import Path

from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

CATEGORIES = {"chat": (2.8, 60, 1.0), "code": (3.3, 140, 12.0), "math": (3.0, 90, 2.0), "mcq": (1.2, 120, 6.0)}

# One small member trained for a few epochs: converges in well under a second on these traces.
FAST_CONFIG = dict(width=32, members=1, max_epochs=20, patience=3, lr=1e-2, batch_size=32, bootstrap=50,
                   num_threads=1)


def fast_config():
    from dwise_predict.training import TrainConfig

    return TrainConfig(**FAST_CONFIG)


def fixed_config():
    """``fast_config()`` with one refinement candidate, ridge, and no cross-validated choice (about 20
    times quicker per fit): for tests of what is written, killed and resumed, not of what wins."""
    import dataclasses

    return dataclasses.replace(fast_config(), refine="ridge")


def make_traces(n_requests: int = 320, seed: int = 1, **kwargs):
    kwargs.setdefault("categories", CATEGORIES)
    kwargs.setdefault("difficulty_scale", 1.5)
    return make_synthetic_traces(n_requests, 16, eval_fraction=0.35, seed=seed, **kwargs)


def write(ds, path: Path) -> Path:
    return write_traces(ds, path)
