"""Decoding throughput of the tiny dLLM: requests/s at batch 1 vs batch B (step-level batching).

Prints, per batch size: wall and CPU seconds, requests/s, rounds, and where the time goes (the
backend's forward vs the decoder's own per-round work), then the B-vs-1 ratio. Uses the shipped
weights and the built-in corpus prompts when present, else a randomly initialised model on random
prompts (said on stderr). CPU time is reported because this machine is shared: on a busy box the
wall-clock ratio is noisy, the CPU-time ratio much less so.

    .venv/bin/python benchmarks/decode_throughput.py --requests 64 --batch-size 16 --threads 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from dwise_predict.collectors.backends.tiny import TinyBackend, load_tiny_backend
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.dllm import TINY_MODEL_DIR, TinyDllmConfig, TinyDllmForBlockDiffusion


class TimedBackend:
    """Wraps a backend's ``step`` to time the forward passes apart from the decoding loop."""

    def __init__(self, backend) -> None:
        self.backend, self.step_wall, self.step_cpu, self.rounds = backend, 0.0, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step(self, batch):
        w, c = time.perf_counter(), time.process_time()
        out = self.backend.step(batch)
        self.step_wall += time.perf_counter() - w
        self.step_cpu += time.process_time() - c
        self.rounds += 1
        return out


def workload(n: int, budget: int, seed: int, model_dir: Path):
    if (model_dir / "config.json").is_file():
        from dwise_predict.dllm.corpus import CATEGORIES, generate_examples

        backend = load_tiny_backend(model_dir)
        tok = backend.tokenizer
        per = -(-n // len(CATEGORIES))
        prompts = [e.prompt for c in CATEGORIES for e in generate_examples(c, per, seed=seed)][:n]
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for p in prompts]
        source = f"weights in {model_dir}, corpus prompts over {len(CATEGORIES)} categories"
    else:
        torch.manual_seed(seed)
        model = TinyDllmForBlockDiffusion(TinyDllmConfig(vocab_size=600))
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)  # spread the confidences like a trained model's
        backend = TinyBackend(model)
        rng = random.Random(seed)
        ids = [[rng.randrange(8, 600) for _ in range(rng.randrange(10, 120))] for _ in range(n)]
        source = f"NO weights in {model_dir}: random model, random prompts"
    print(source, file=sys.stderr)
    return backend, [DecodeRequest(f"r{i}", p, budget) for i, p in enumerate(ids)]


def measure(backend, requests, batch_size: int, threshold: float) -> dict:
    timed = TimedBackend(backend)
    cfg = DecodingConfig(threshold=threshold, batch_size=batch_size)
    w, c = time.perf_counter(), time.process_time()
    results = list(decode(timed, requests, cfg))
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    work = sum(r.prompt_blocks + r.total_rounds for r in results)
    return {"B": batch_size, "wall_s": wall, "cpu_s": cpu, "req_per_s": len(results) / wall,
            "req_per_cpu_s": len(results) / cpu, "rounds": timed.rounds, "request_rounds": work,
            "ms_per_round": 1e3 * cpu / timed.rounds, "forward_share": timed.step_cpu / cpu,
            "loop_ms_per_round": 1e3 * (cpu - timed.step_cpu) / timed.rounds,
            "tokens": sorted((r.request_id, r.output_ids) for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=TINY_MODEL_DIR, help="model directory (default: shipped)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend, requests = workload(args.requests, args.budget, args.seed, args.model)
    list(decode(backend, requests[:4], DecodingConfig(threshold=args.threshold, batch_size=4)))  # warm-up
    rows = [measure(backend, requests, b, args.threshold) for b in (1, args.batch_size)]
    print(f"{'B':>3} {'wall s':>8} {'cpu s':>8} {'req/s':>8} {'req/cpu-s':>10} {'rounds':>7} "
          f"{'req-rounds':>10} {'ms/round':>9} {'forward':>8} {'loop ms/round':>13}")
    for r in rows:
        print(f"{r['B']:>3} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r['req_per_s']:>8.1f} "
              f"{r['req_per_cpu_s']:>10.1f} {r['rounds']:>7} {r['request_rounds']:>10} "
              f"{r['ms_per_round']:>9.2f} {r['forward_share']:>7.0%} {r['loop_ms_per_round']:>13.2f}")
    one, many = rows
    print(f"ratio B={many['B']} / B=1: {many['req_per_s'] / one['req_per_s']:.2f}x wall, "
          f"{many['req_per_cpu_s'] / one['req_per_cpu_s']:.2f}x cpu "
          f"(threads={args.threads}, requests={len(requests)}, budget={args.budget}, "
          f"threshold={args.threshold}); identical tokens: {one['tokens'] == many['tokens']}")


if __name__ == "__main__":
    main()
