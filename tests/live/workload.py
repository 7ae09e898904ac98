"""The requests the live tests send, and what the hook should make of them.

A burst of :data:`BURST` requests of distinct prompt lengths (:data:`LENGTHS`, no shared prefix),
sent in an order unrelated to their length (:func:`arrival_order`), while :data:`FILLERS` long
requests hold every request row: the burst queues whole before any of it is admitted, so the order
it finishes in is the scheduler's choice. With the ranking bundle (``live_bundle``) the hook admits
longest prompt first; SGLang alone admits in arrival order (this burst on stock SGLang 0.5.23 here:
finish position against arrival, Spearman 1.00; against the hook's rank key, -0.00).
"""

from __future__ import annotations

import time

import numpy as np
from scipy.stats import spearmanr

from tiny_sdar import BLOCK, words

BURST = 30
LENGTHS = tuple(10 + 4 * i for i in range(BURST))  # prompt tokens: 10..126, each its own prompt-block count
BUDGET = 16  # new tokens of a burst request: 5 output blocks, 23 forwards (module docstring of tiny_sdar)
# a filler runs 240 forwards, ~4.5 s on idle cores: the burst must arrive whole meanwhile, and on busy
# cores (CI beside other work) its 30 requests took more than the 1.5 s of 64 tokens
FILLER_TOKENS, FILLER_BUDGET = 8, 192
ARRIVAL_SEED = 0


def prompt(first_word: int, n_tokens: int) -> str:
    """``n_tokens`` words from id ``first_word`` on: prompts of different ``first_word`` share no prefix."""
    return words(range(first_word, first_word + n_tokens))


def arrival_order(seed: int = ARRIVAL_SEED) -> list[int]:
    """A fixed order of the burst's indices whose Spearman with their lengths is within ±0.05."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(BURST)
        if abs(spearmanr(np.arange(BURST), np.asarray(LENGTHS)[order]).statistic) < 0.05:
            return [int(i) for i in order]


def burst_rid(tag: str, i: int) -> str:
    return f"{tag}-burst-{i:02d}"


def send_burst(server, tag: str, fillers: int) -> list[str]:
    """``fillers`` filler requests, then the burst in :func:`arrival_order` (5 ms apart, so SGLang
    receives them in that order); waits for all. Returns the burst's rids in arrival order."""
    threads = [server.start_generate(prompt(100_000 + 100 * i, FILLER_TOKENS), FILLER_BUDGET, f"{tag}-filler-{i}")
               for i in range(fillers)]
    time.sleep(0.5)  # the fillers admitted and running before the burst arrives
    arrived = []
    for i in arrival_order():
        arrived.append(burst_rid(tag, i))
        threads.append(server.start_generate(prompt(1_000 + 200 * i, LENGTHS[i]), BUDGET, arrived[-1]))
        time.sleep(0.005)
    for thread in threads:
        thread.join()
    return arrived


def predicted_keys(bundle, lengths) -> np.ndarray:
    """The hook's rank key at arrival, ``R = P + r̂`` (prompt blocks plus the bundle's admission
    estimate of a prompt of ``n`` words ``w<i>``: words = tokens = n, no newline), per length."""
    from dwise_predict.bundles.load import load_bundle

    n = np.asarray(lengths, dtype=np.float32)
    estimate = load_bundle(bundle).admission(np.stack([n, np.zeros_like(n), n], axis=1))
    return n // BLOCK + np.asarray(estimate, dtype=np.float64)


def expected_rounds_per_block(prompt_tokens: int, budget: int) -> list[int]:
    """Forwards per output block for the random tiny model under LowConfidence: the first output
    block holds the prompt's leftover tokens and ``BLOCK - leftover`` masks, each later one
    ``BLOCK`` masks, until ``budget`` masks are laid out; a block takes one forward per mask (no
    token is ever confident) and one more that finds none left (SGLang's loop)."""
    masks, out = BLOCK - prompt_tokens % BLOCK, []
    laid = 0
    while laid < budget:
        out.append(masks + 1)
        laid += masks
        masks = BLOCK
    return out
