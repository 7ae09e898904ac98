"""Synthetic trace datasets in contract 1's format, with a known answer.

Each request has a latent difficulty ``z ~ N(0, 1)`` that only the hidden state sees: the first-round
hidden vector is ``z * direction + category embedding + noise``; prompt features (words, newlines,
tokens) are drawn independently of ``z``. Remaining rounds ``T`` after the first denoising round follow
a discrete Weibull law (Nakagawa & Osaki 1975) of scale ``s`` and shape ``hazard_shape``

    P(T >= t) = exp(-(t / s) ** hazard_shape),   s = 1 / log(1 + exp(-level)),
    level = base_log_rounds[category] * level_scale (around the categories' mean level)
            + difficulty_scale * z + length_scale * log(tokens)

capped where the budget stops generation. Its hazard after ``t`` rounds is
``1 - exp(-((t + 1) ** shape - t ** shape) / s ** shape)``: at ``hazard_shape = 1`` (the default) the
constant ``sigmoid(-level)``, so ``T ~ Geometric`` with mean ``exp(level)`` (right-skewed: its mean
sits above its median); above 1 it rises with the rounds done and ``T`` gathers around ``s ≈
exp(level)`` (median ``s · log(2) ** (1 / shape)``). ``level_scale`` sets how much of the work lies in
the categories' levels (between categories) against ``difficulty_scale``'s share inside them. The
oracle's expected remaining rounds under that law is stored in the extra column
``oracle_remaining``. Tests use this to check that a predictor recovers what the hidden state holds
and that prompt features cannot see it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dwise_predict.traces.dataset import TraceDataset

# category -> (base log-rounds, mean prompt tokens, newlines per 100 tokens)
DEFAULT_CATEGORIES: dict[str, tuple[float, float, float]] = {
    "chat": (2.8, 60, 1.0),
    "instruction": (2.5, 80, 3.0),
    "code": (3.3, 140, 12.0),
    "math": (3.0, 90, 2.0),
    "multilingual_math": (3.1, 100, 2.0),
    "mcq": (0.8, 120, 6.0),
    "hard_mcq": (1.2, 200, 6.0),
    "long_context": (2.0, 900, 8.0),
}


def make_synthetic_traces(
    n_requests: int = 512,
    hidden_size: int = 64,
    categories: dict[str, tuple[float, float, float]] | None = None,
    difficulty_scale: float = 0.7,
    length_scale: float = 0.15,
    noise: float = 0.5,
    level_scale: float = 1.0,
    hazard_shape: float = 1.0,
    eval_fraction: float = 0.3,
    budget: int = 256,
    block_size: int = 8,
    seed: int = 0,
) -> TraceDataset:
    """Build a trace dataset whose remaining rounds come from a known hidden-state hazard.

    Parameters
    ----------
    n_requests : total requests, spread evenly over the categories.
    hidden_size : width H of ``first_round`` and ``prompt_last``.
    difficulty_scale : how strongly the latent difficulty (seen only by the hidden state) moves the
        log of the expected remaining rounds.
    length_scale : how strongly log prompt tokens (seen by the admission features) moves it.
    noise : standard deviation of isotropic noise added to the hidden vectors.
    level_scale : multiplies the categories' base levels' spread around their mean: above 1 the
        levels between categories carry more of the work, below 1 the difficulty inside them does.
    hazard_shape : the discrete Weibull shape: 1 is a constant hazard (geometric rounds), above 1 a
        hazard that rises with the rounds done (less spread around ``exp(level)``).

    Returns
    -------
    TraceDataset with the contract-1 columns plus ``oracle_remaining`` (expected remaining rounds
    under the true hazard) and ``difficulty`` (the latent z).
    """
    categories = categories or DEFAULT_CATEGORIES
    # One generator feeds every stage below in a fixed order (prompts, difficulty, rounds, hidden
    # states, outputs): the same seed gives the same dataset only while that order stays.
    rng = np.random.default_rng(seed)
    names = list(categories)
    category = np.array([names[i % len(names)] for i in range(n_requests)])
    prompt_tokens, words, newlines = _prompts(categories, category, rng)
    z = rng.standard_normal(n_requests)

    base = np.array([categories[c][0] for c in category])
    mean_level = float(np.mean([categories[c][0] for c in names]))
    level = (base + (level_scale - 1.0) * (base - mean_level) + difficulty_scale * z
             + length_scale * np.log(prompt_tokens))
    max_rounds = budget // block_size * block_size  # every round unmasks >= 1 token
    remaining, oracle = _remaining_rounds(level, hazard_shape, max_rounds, rng)
    total_rounds = remaining + 1
    first_round, prompt_last = _hidden_states(z, category, names, hidden_size, noise, rng)

    columns = _contract_columns(category, prompt_tokens, words, newlines, total_rounds, budget, block_size,
                                eval_fraction, rng)
    requests = pd.DataFrame({**columns, "oracle_remaining": oracle, "difficulty": z})
    manifest = {
        "model": {"name": "synthetic", "path": None, "weights_sha256": None, "config_hash": f"synthetic-{seed}",
                  "hidden_size": hidden_size, "vocab_size": 0},
        "decoding": {"algorithm": "synthetic", "algorithm_config": {}, "block_size": block_size, "budget": budget,
                     "dtype": "float32", "batch_size": 1},
        "workload": {"name": "synthetic", "seed": seed, "n_requests": n_requests},
    }
    return TraceDataset(requests, first_round.astype(np.float32), prompt_last.astype(np.float32), manifest)


def _prompts(categories: dict[str, tuple[float, float, float]], category: np.ndarray,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt tokens, words and newlines of each request, drawn from its category's means alone (no
    trace of the difficulty: what the admission features see)."""
    mean_tokens = np.array([categories[c][1] for c in category])
    newline_rate = np.array([categories[c][2] for c in category])
    prompt_tokens = np.maximum(4, rng.lognormal(np.log(mean_tokens), 0.4)).astype(int)
    words = np.maximum(1, (prompt_tokens * rng.uniform(0.6, 0.8, len(category))).astype(int))
    newlines = rng.poisson(newline_rate * prompt_tokens / 100.0)
    return prompt_tokens, words, newlines


def _remaining_rounds(level: np.ndarray, hazard_shape: float, max_rounds: int,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Remaining rounds after the first denoising round under the discrete Weibull law of the module
    docstring, capped at ``max_rounds - 1``, and the oracle's expectation of that capped count."""
    hazard = 1.0 / (1.0 + np.exp(level))  # at shape 1 the hazard, and the mean (1 - h) / h is exp(level)
    q = 1.0 - hazard  # at shape 1, P(T >= t) = q ** t = exp(-t / s)
    scale = -1.0 / np.log(q)
    if hazard_shape == 1.0:
        remaining = rng.geometric(hazard) - 1  # rounds after the first denoising round, >= 0
    else:  # inverse CDF: P(floor(s * (-log U) ** (1 / shape)) >= t) = P(U <= exp(-(t / s) ** shape))
        remaining = np.floor(scale * (-np.log(rng.uniform(size=len(level)))) ** (1.0 / hazard_shape)).astype(int)
    remaining = np.minimum(remaining, max_rounds - 1)
    if hazard_shape == 1.0:  # mean of min(T, cap) = sum over t = 1..cap of P(T >= t), cap = max_rounds - 1
        oracle = q * (1.0 - q ** (max_rounds - 1)) / hazard
    else:
        steps = np.arange(1, max_rounds, dtype=np.float64)[None, :]
        oracle = np.exp(-(steps / scale[:, None]) ** hazard_shape).sum(axis=1)
    return remaining, oracle


def _hidden_states(z: np.ndarray, category: np.ndarray, names: list[str], hidden_size: int, noise: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``first_round`` (n, H): the difficulty along one direction plus the category's embedding and
    noise; ``prompt_last`` (n, H): the embedding and noise only, so only the first round sees ``z``."""
    n_requests = len(z)
    direction = rng.standard_normal(hidden_size)
    direction /= np.linalg.norm(direction)
    embeddings = {c: rng.standard_normal(hidden_size) for c in names}
    cat_emb = np.stack([embeddings[c] for c in category])
    first_round = z[:, None] * direction[None, :] * 3.0 + cat_emb + noise * rng.standard_normal(
        (n_requests, hidden_size)
    )
    prompt_last = cat_emb + noise * rng.standard_normal((n_requests, hidden_size))
    return first_round, prompt_last


def _contract_columns(category: np.ndarray, prompt_tokens: np.ndarray, words: np.ndarray, newlines: np.ndarray,
                      total_rounds: np.ndarray, budget: int, block_size: int, eval_fraction: float,
                      rng: np.random.Generator) -> dict:
    """The contract-1 columns: outputs, blocks, split and early signals drawn around the known rounds
    (the signals are noise here: the known answer lives in the hidden state)."""
    n_requests = len(category)
    output_tokens = np.minimum(budget, np.maximum(1, (total_rounds * rng.uniform(1.0, 3.0, n_requests)).astype(int)))
    n_blocks = np.maximum(1, -(-output_tokens // block_size))
    rounds_per_block = [_spread(int(t), int(b), rng) for t, b in zip(total_rounds, n_blocks)]
    finish = np.where(output_tokens >= budget, "budget", "eos")
    split = np.where(rng.uniform(size=n_requests) < eval_fraction, "eval", "train")
    return {
        "request_id": [f"syn-{i:06d}" for i in range(n_requests)],
        "split": split,
        "category": category,
        "source": "synthetic",
        "prompt": [" ".join(["word"] * int(w)) for w in words],
        "prompt_tokens": prompt_tokens,
        "words": words,
        "newlines": newlines,
        "budget": budget,
        "block_size": block_size,
        "prompt_blocks": prompt_tokens // block_size,
        "total_rounds": total_rounds,
        "rounds_per_block": rounds_per_block,
        "output_tokens": output_tokens,
        "finish": finish,
        "frac_over_threshold": rng.uniform(0.0, 1.0, n_requests),
        "mean_confidence": rng.uniform(0.3, 1.0, n_requests),
        "mean_entropy": rng.uniform(0.0, 2.0, n_requests),
        "end_probability": rng.uniform(0.0, 1.0, n_requests),
        "wall_s": total_rounds * 0.01,
    }


def _spread(total: int, n_blocks: int, rng: np.random.Generator) -> list[int]:
    """Split ``total`` rounds over at most ``n_blocks`` blocks, each taking at least one round."""
    n_blocks = max(1, min(n_blocks, total))
    cuts = np.sort(rng.choice(np.arange(1, total), size=n_blocks - 1, replace=False)) if n_blocks > 1 else []
    edges = np.concatenate([[0], cuts, [total]])
    return np.diff(edges).astype(int).tolist()
