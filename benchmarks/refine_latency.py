"""Latency of the calibrated refinement ensemble: eager vs TorchScript vs ONNX Runtime.

Hidden size 2,048, K ~ 256, batch 1 / 16 / 128, 2 threads (torch and onnxruntime). The
weights come from a quick ``train_run`` on synthetic traces of that hidden size (``--random`` for
untrained weights), because int8 quantisation must be judged on trained weights: it is kept only
if its ranking holds (Spearman rho >= 0.999 against fp32 on the eval split).

Rows:
- eager / eager fused            RefineGraph (member by member) and FusedRefineGraph (one GEMM)
- torchscript fused              the bundle's refine.pt
- ort unfused / ort fused        onnxruntime, default graph optimisations (ORT_ENABLE_ALL)
- ort fused basic-opt            onnxruntime with ORT_ENABLE_BASIC only
- ort fused int8                 the bundle's refine.int8.onnx: quantize_dynamic (int8 weights) of the fused graph

Usage::

    python benchmarks/refine_latency.py            # ~2-3 minutes on 2 cores
    python benchmarks/refine_latency.py --random --repeats 50
    python benchmarks/refine_latency.py --refine ridge-within+signals   # one candidate, no search
    python benchmarks/refine_latency.py --smoke    # H = 32, 300 requests, 2 epochs, 1 thread: seconds

Targets (2 cores, ``docs/bundles.md``): the bundle's ``refine.onnx`` (ort fused) <= 0.2 ms at batch 1
and <= 4 ms at batch 128, the minimum over the timed calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dwise_predict.names import EARLY_SIGNALS, HIDDEN_STATES, LENGTH_SCALE
from dwise_predict.exports.refine_export import (
    INPUT_NAMES,
    FusedRefineGraph,
    export_onnx,
    export_torchscript,
    quantize_int8,
)
from dwise_predict.metrics import spearman
from targets import Figure, add_options, report

BATCHES = (1, 16, 128)
TARGET_MS = {1: 0.2, 128: 4.0}  # ort fused (the bundle's refine.onnx), minimum over the timed calls


@dataclass(frozen=True)
class Size:
    """What a run measures on: hidden size, synthetic requests, training epochs, torch/ORT threads."""

    hidden: int = 2048
    requests: int = 1600
    epochs: int = 20
    threads: int = 2


FULL, SMOKE = Size(), Size(hidden=32, requests=300, epochs=2, threads=1)


def build_graph(random: bool, workdir: Path, size: Size, seed: int = 0, refine: str = "auto"):
    """(eager RefineGraph, eval inputs as numpy) from a quick training run or random weights."""
    from dwise_predict.traces.synthetic import make_synthetic_traces

    traces = make_synthetic_traces(n_requests=size.requests, hidden_size=size.hidden, budget=256, block_size=8,
                                   seed=seed)  # K <= 256
    evaluation = traces.split("eval")
    inputs = (
        evaluation.first_round.astype(np.float32),
        evaluation.prompt_last.astype(np.float32),
        evaluation.requests["prompt_tokens"].to_numpy(np.float32),
        evaluation.requests["budget"].to_numpy(np.float32),
        evaluation.early_signals,
    )
    if random:
        from dwise_predict.survival.network import HazardMLP, build_refine_graph, refine_state

        torch.manual_seed(seed)
        in_features = 2 * size.hidden + 2 + len(EARLY_SIGNALS)  # h1, h_prompt, prompt tokens, budget, early signals
        members = [HazardMLP(in_features, 256).eval() for _ in range(3)]
        state = refine_state(members, torch.zeros(in_features), torch.ones(in_features))
        spec = dict(in_features=in_features, num_rounds=256, width=256, members=3, prompt_norm=100.0, budget_norm=256.0,
                    length_scale=LENGTH_SCALE, hidden_states=list(HIDDEN_STATES))
        return build_refine_graph(state, spec, {"x": [0.0, 50.0, 256.0], "y": [0.0, 40.0, 255.0]}), inputs, "random"
    from safetensors.torch import load_file

    from dwise_predict.survival.network import build_refine_graph
    from dwise_predict.training import TrainConfig, train_run

    run = workdir / "run"
    train_run(traces, run, TrainConfig(max_epochs=size.epochs, bootstrap=0, num_threads=size.threads, seed=seed,
                                       refine=refine))
    spec = json.loads((run / "refine.json").read_text())
    graph = build_refine_graph(load_file(str(run / "refine.safetensors")), spec,
                               json.loads((run / "calibration.json").read_text()))
    rho = json.loads((run / "metrics.json").read_text())["refined"]["spearman"]
    return graph, inputs, f"trained, candidate {spec['candidate']} (eval rho {rho:.3f})"


def time_call(fn, repeats: int) -> tuple[float, float]:
    """(min, median) milliseconds of ``fn()`` after a warm-up.

    On a shared machine the median carries other processes' load; the minimum is the best estimate
    of the uncontended latency, so both are printed."""
    for _ in range(max(5, repeats // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples), statistics.median(samples)


def ort_session(path: Path, threads: int, level: str = "all"):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def torch_fn(module, x):
    def run():
        with torch.inference_mode():
            return module(*x)

    return run


def ort_fn(session, x):
    feeds = dict(zip(INPUT_NAMES, x))
    return lambda: session.run(None, feeds)[0]


def print_accuracy(graph, fused, scripted, sessions: dict, inputs) -> None:
    """Every path on the whole eval split against eager fp32: largest relative error and Spearman rho."""
    full_t = tuple(torch.from_numpy(a) for a in inputs)
    with torch.inference_mode():
        reference = graph(*full_t).numpy()
    outputs = {
        "eager fused": torch_fn(fused, full_t)().numpy(),
        "torchscript fused": torch_fn(scripted, full_t)().numpy(),
        **{name: ort_fn(s, inputs)() for name, s in sessions.items()},
    }
    print(f"{'path':<22} {'max rel err':>12} {'rho vs fp32':>12}")
    for name, out in outputs.items():
        rel = float((np.abs(out - reference) / np.maximum(np.abs(reference), 1e-3)).max())
        print(f"{name:<22} {rel:>12.2e} {spearman(out, reference):>12.6f}")


def print_latencies(rows: dict, inputs, repeats: int) -> dict[str, dict[int, float]]:
    """Time every path at every batch size; print min (median) ms; return path -> batch -> min ms."""
    print(f"\n{'path':<22}" + "".join(f"{f'batch {b} ms min (median)':>26}" for b in BATCHES))
    best_ms: dict[str, dict[int, float]] = {}
    for name, model in rows.items():
        cells = []
        for batch in BATCHES:
            x = tuple(np.ascontiguousarray(a[:batch]) for a in inputs)
            fn = ort_fn(model, x) if name.startswith("ort") else torch_fn(model, tuple(map(torch.from_numpy, x)))
            best, median = time_call(fn, repeats if batch < 128 else max(20, repeats // 4))
            best_ms.setdefault(name, {})[batch] = best
            cells.append(f"{best:8.3f} ({median:8.3f})")
        print(f"{name:<22}" + "".join(f"{c:>26}" for c in cells), flush=True)
    return best_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", action="store_true", help="untrained weights (no training run)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per row and batch size")
    parser.add_argument("--refine", default="auto", help="refinement candidate to train (default: the CV's pick)")
    add_options(parser, "H = 32, 300 requests, 2 epochs, 1 thread, 10 repeats: a quick check")
    args = parser.parse_args(argv)
    size, repeats = (SMOKE, 10) if args.smoke else (FULL, args.repeats)
    torch.set_num_threads(size.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        graph, inputs, origin = build_graph(args.random, tmp, size, refine=args.refine)
        graph.eval()
        fused = FusedRefineGraph(graph).eval()
        K = int(graph.members[0].fc2.out_features)
        export_onnx(graph, size.hidden, tmp / "unfused.onnx")
        export_onnx(fused, size.hidden, tmp / "fused.onnx")
        export_torchscript(fused, tmp / "fused.pt")
        quantize_int8(tmp / "fused.onnx", tmp / "fused_int8.onnx")
        scripted = torch.jit.load(str(tmp / "fused.pt"))
        sessions = {
            "ort unfused": ort_session(tmp / "unfused.onnx", size.threads),
            "ort fused": ort_session(tmp / "fused.onnx", size.threads),
            "ort fused basic-opt": ort_session(tmp / "fused.onnx", size.threads, "basic"),
            "ort fused int8": ort_session(tmp / "fused_int8.onnx", size.threads),
        }
        load = os.getloadavg()[0]
        print(f"load average before timing: {load:.1f} (2 cores; timings are contended above ~2)")
        print(f"weights: {origin}; H={size.hidden}, K={K}, members={len(graph.members)}, threads={size.threads}, "
              f"eval rows={len(inputs[0])}")
        print_accuracy(graph, fused, scripted, sessions, inputs)
        rows = {"eager": graph, "eager fused": fused, "torchscript fused": scripted, **sessions}
        best_ms = print_latencies(rows, inputs, repeats)
    at = f"H = {size.hidden}, {size.threads} thread(s)"
    report("refine_latency", [
        Figure(f"refinement, ort fused (refine.onnx), batch {batch}", best_ms["ort fused"][batch], "ms", target,
               context=at + ("" if size == FULL else f"; the target is for H = {FULL.hidden}, {FULL.threads} threads"))
        for batch, target in TARGET_MS.items()
    ], args, hidden=size.hidden, K=K, members=len(graph.members), threads=size.threads, weights=origin,
        load_before_timing=load)


if __name__ == "__main__":
    main()
