"""A DWISE bundle for the tiny SDAR server whose admission ranking is known in advance.

Its traces are synthetic (``traces.synthetic``, the hidden states of a latent difficulty) with one
change: every request's rounds are set by its prompt length alone, *falling* as the prompt grows
(:func:`expected_rounds`). The admission model (LightGBM on words, newlines, prompt tokens) learns
that rule, so the hook ranks a burst longest prompt first: the opposite of what the prompt blocks
alone (a hook without a bundle) or the true work (longer prompts, more prefill rounds) would give,
and unrelated to arrival. A server that finishes a burst in that order ran the bundle's estimates.
The refinement graph is untrained (``export_helpers.make_run``): the live tests keep the resident
set at ``B`` (``k = 1``), where every resident runs every round and refinement orders nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dwise_predict.engine import ENGINE
from dwise_predict.engine.algorithms import served_decoding
from dwise_predict.traces.dataset import TraceDataset
from dwise_predict.traces.synthetic import make_synthetic_traces

ALGORITHM = "LowConfidence"
LONGEST_PROMPT = 160  # tokens: the training prompts span 1..LONGEST_PROMPT
CREATED = "2026-01-01T00:00:00+00:00"


def expected_rounds(prompt_tokens):
    """The rule the traces follow: total rounds for a prompt of ``prompt_tokens`` tokens."""
    return 1 + 3 * (LONGEST_PROMPT + 10 - np.asarray(prompt_tokens))


def served_model(model_dir: Path | None, hidden: int) -> dict:
    """The traces' model fingerprint: the checkpoint at ``model_dir`` as ``collect`` fingerprints it
    (the server checks a bundle's ``config_hash`` against the model it serves), or, without one, a
    model of width ``hidden`` that names no config, as a bundle trained on a live recording does."""
    if model_dir is None:
        return {"name": "live-recording", "path": None, "weights_sha256": None, "config_hash": None,
                "hidden_size": hidden, "vocab_size": 0}
    from transformers import AutoConfig

    from dwise_predict.collectors.backends.base import directory_fingerprint

    config = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    return directory_fingerprint(Path(model_dir), Path(model_dir).name, config, hidden, int(config["vocab_size"]))


def ranking_traces(model: dict, hidden: int, block_size: int, n: int = 400, seed: int = 0) -> TraceDataset:
    """Synthetic traces of ``model`` (:func:`served_model`) of width ``hidden`` for ``ALGORITHM`` at
    ``block_size`` whose rounds follow :func:`expected_rounds`."""
    base = make_synthetic_traces(n_requests=n, hidden_size=hidden, block_size=block_size, budget=256, seed=seed)
    tokens = np.random.default_rng(seed).integers(1, LONGEST_PROMPT + 1, n)
    rounds = expected_rounds(tokens)
    requests = base.requests.assign(
        prompt_tokens=tokens, words=tokens, newlines=0, prompt_blocks=tokens // block_size, total_rounds=rounds,
        rounds_per_block=[[int(r)] for r in rounds], output_tokens=block_size, finish="eos")
    manifest = dict(base.manifest)
    manifest["model"] = dict(model)
    manifest["decoding"] = {**served_decoding(ALGORITHM, {}, block_size), "budget": 256, "dtype": "bfloat16",
                            "batch_size": 1}
    return TraceDataset(requests, base.first_round, base.prompt_last, manifest)


def write_bundle(out: Path, model_dir: Path | None, hidden: int, block_size: int, seed: int = 0) -> Path:
    """Build the run (``export_helpers.make_run``) for the model at ``model_dir`` (None: a model of
    width ``hidden`` that names no config) and export it as a bundle at ``out``."""
    from export_helpers import make_run

    from dwise_predict.exports.bundle import export_bundle

    out = Path(out)
    run = make_run(out.parent / f"{out.name}-run", seed=seed, traces=ranking_traces(served_model(model_dir, hidden), hidden, block_size, seed=seed))
    return export_bundle(run, out, name=out.name, created=CREATED, n_probes=16, seed=seed)


STALE_RECIPE = dict(width=32, members=1, max_epochs=20, patience=3, lr=1e-2, batch_size=32, bootstrap=50,
                    refine="ridge", num_threads=1)  # light: the refresh retrains with the bundle's recipe


def stale_traces(model: dict, hidden: int, block_size: int, n: int = 400, seed: int = 0) -> TraceDataset:
    """Traces of a traffic mix in which a larger budget meant *fewer* rounds (long-budget requests that
    stopped early): total rounds ``1 + 1.25 * (44 - budget)`` for budgets 4..40. The tiny random model
    never stops early, so on its live traffic rounds *rise* with the budget: a bundle trained here
    ranks live requests backwards, and one retrained on a recording of them ranks them right."""
    base = ranking_traces(model, hidden, block_size, n=n, seed=seed)
    budgets = np.random.default_rng(seed + 1).integers(4, 41, n)
    rounds = np.round(1 + 1.25 * (44 - budgets)).astype(int)
    requests = base.requests.assign(budget=budgets, total_rounds=rounds, rounds_per_block=[[int(r)] for r in rounds])
    manifest = dict(base.manifest)
    # rounds in SGLang's units, as a recording of a server says (collectors.live.live_manifest): a bundle
    # refreshed from a recording is held to this
    manifest["decoding"] = {**manifest["decoding"], "engine": ENGINE, "engine_faithful": True}
    return TraceDataset(requests, base.first_round, base.prompt_last, manifest)


def write_stale_bundle(out: Path, model_dir: Path, hidden: int, block_size: int, seed: int = 0) -> Path:
    """Train (for real, :data:`STALE_RECIPE`) and export the stale bundle of :func:`stale_traces`."""
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.training import TrainConfig
    from dwise_predict.training.run import train_run

    out = Path(out)
    run = out.parent / f"{out.name}-run"
    traces = stale_traces(served_model(model_dir, hidden), hidden, block_size, seed=seed)
    train_run(traces, run, TrainConfig(seed=seed, **STALE_RECIPE))
    return export_bundle(run, out, name=out.name, created=CREATED, n_probes=16, seed=seed)
