"""Run directories for the export tests: from `train_run` when it exists, else hand-built.

The hand-built run writes the files of the run-directory layout (config.json, metrics.json,
admission.txt/json, refine.safetensors/json, calibration.json) from untrained HazardMLPs and a small
LightGBM model on synthetic traces; its metrics.json holds the eager graph's Spearman rho on the
eval split, so a round trip can check that the exported graphs reproduce it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dwise_predict.names import EARLY_SIGNALS, HIDDEN_STATES, LENGTH_SCALE
from dwise_predict.metrics import spearman
from dwise_predict.traces.synthetic import make_synthetic_traces

HIDDEN = 32


def make_traces():
    return make_synthetic_traces(n_requests=400, hidden_size=HIDDEN, seed=0)


def refine_inputs(ds) -> tuple[np.ndarray, ...]:
    """The refinement graph's five inputs (first_round, prompt_last, prompt_tokens, budget, early_signals)."""
    r = ds.requests
    return (
        ds.first_round.astype(np.float32),
        ds.prompt_last.astype(np.float32),
        r["prompt_tokens"].to_numpy(np.float32),
        r["budget"].to_numpy(np.float32),
        ds.early_signals,
    )


def make_run(path: Path, seed: int = 0, traces=None) -> Path:
    """Write a complete run directory at ``path`` (hand-built; no training stack needed)."""
    import lightgbm
    from safetensors.torch import save_file

    from dwise_predict.survival.network import HazardMLP, build_refine_graph, refine_state

    ds = traces if traces is not None else make_traces()
    path.mkdir(parents=True, exist_ok=True)
    train, evaluation = ds.split("train"), ds.split("eval")
    features = ["words", "newlines", "prompt_tokens"]
    booster = lightgbm.train(
        {"objective": "regression", "num_leaves": 15, "verbose": -1, "seed": seed, "deterministic": True,
         "num_threads": 1},
        lightgbm.Dataset(train.requests[features].to_numpy(float), np.log1p(train.requests["total_rounds"].to_numpy())),
        num_boost_round=100,
    )
    booster.save_model(str(path / "admission.txt"))
    (path / "admission.json").write_text(json.dumps({"features": features, "target": "log1p(total_rounds)", "params": {}}))

    torch.manual_seed(seed)
    K = int(ds.requests["total_rounds"].max())
    hidden = ds.first_round.shape[1]  # HIDDEN for make_traces(); the tests of a live server pass their model's
    in_features = 2 * hidden + 2 + len(EARLY_SIGNALS)  # h1, h_prompt, prompt tokens, budget, early signals
    members = [HazardMLP(in_features, K, 256, 0.2).eval() for _ in range(3)]
    h, last, p, b, signals = refine_inputs(train)
    x = np.concatenate([h, last, p[:, None] / 100.0, b[:, None] / 256.0, signals], axis=1)
    mean, std = torch.tensor(x.mean(0)), torch.tensor(x.std(0) + 1e-3)
    state = refine_state(members, mean, std)
    save_file(state, str(path / "refine.safetensors"))
    spec = {"hidden_size": hidden, "early_signals": len(EARLY_SIGNALS), "in_features": in_features, "num_rounds": K, "width": 256, "dropout": 0.2,
            "members": 3, "seeds": [0, 1, 2], "prompt_norm": 100.0, "budget_norm": 256.0, "length_scale": LENGTH_SCALE,
            "hidden_states": list(HIDDEN_STATES),
            "target": "remaining_rounds = total_rounds - 1 (after the first denoising round)"}
    (path / "refine.json").write_text(json.dumps(spec))
    # a monotone map from raw estimates to remaining rounds through matched quantiles
    identity = build_refine_graph(state, spec, {"x": [0.0, 1.0], "y": [0.0, 1.0]})
    with torch.no_grad():
        raw = identity.raw(*map(lambda a: torch.from_numpy(np.array(a)), refine_inputs(train))).numpy()
    qs = np.linspace(0, 1, 9)
    calibration = {"x": np.unique(np.quantile(raw, qs)).tolist(), "fitted_on": "train"}
    calibration["y"] = np.sort(np.quantile(train.requests["total_rounds"] - 1, qs[: len(calibration["x"])])).tolist()
    (path / "calibration.json").write_text(json.dumps(calibration))

    graph = build_refine_graph(state, spec, calibration)
    with torch.no_grad():
        refined = graph(*map(lambda a: torch.from_numpy(np.array(a)), refine_inputs(evaluation))).numpy()
    admission = np.expm1(booster.predict(evaluation.requests[features].to_numpy(float)))
    truth = evaluation.requests["total_rounds"].to_numpy()
    metrics = {
        "n_train": len(train), "n_eval": len(evaluation),
        "admission": {"spearman": spearman(admission, truth), "within_category_mean": None},
        "refined": {"spearman": spearman(refined, truth - 1), "within_category_mean": None},
        "calibration": {"median_ratio_calibrated": float(np.median((refined + 1) / truth))},
    }
    (path / "metrics.json").write_text(json.dumps(metrics))
    config = {
        "seed": seed,
        "versions": {"torch": torch.__version__},
        "traces": {"path": "synthetic", "fingerprint": ds.data_hash(), "model": ds.manifest["model"],
                   "decoding": ds.manifest["decoding"], "hidden_size": hidden},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path
