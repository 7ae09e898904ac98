"""Decoding throughput of the tiny dLLM: requests/s at batch 1 vs batch B (step-level batching).

Prints, per batch size: the median wall time of ``--repeats`` runs, requests/s, rounds, and where a
round's time goes (from one more, profiled run: the linear layers, attention, KV-cache reads/writes,
other tensor ops, and Python between ops — the model's and the decoder's; the profiler adds a few
µs to every op, which inflates "other ops" most), then the B-vs-1 ratio (target >= 6x on 2
cores). Uses the shipped weights and the built-in corpus prompts when present, else a randomly
initialised model on random prompts (said on stderr).

Steadiness: the B=1 and B=16 runs alternate (B=1, B=16, B=1, ...: a busy spell on the shared
machine slows both sides of a pair, not one batch size's every run), each pair gives a ratio, and
the figure is the median of the ``--repeats`` pairs' ratios (each printed). It was the best of 3
runs per batch size, all B=1 runs first, which swung by +-3 points from run to run.

Why the ratio stops near 4x in float32 on this 2-core machine (192 requests):
- a B=1 round takes ~1.2 ms, nearly all of it fixed cost (Python and hundreds of op dispatches); its
  arithmetic, one block of ~8-16 tokens, is ~0.1 ms;
- a B=16 round carries ~14 rows and ~120 tokens. It pays the same fixed cost, plus arithmetic that
  is already compute-bound: the linear layers run near the fp32 GEMM peak of both cores (~200
  GFLOPS), ~1.8 ms a round, and attention over each row's cached keys (padded to the longest row;
  67 % of them are real) ~0.5 ms; then ~1 ms more of small per-token ops and per-row Python.
Even with no per-row cost at all the ceiling would be 14 x 1.2 / (1.1 + 1.8 + 0.5) = 4.9x.
On this shared VM speeds drift between quiet and busy spells, so the ratio ranged 3.0x-5.2x over
14 runs; best of 5 in a quiet spell: 192 requests in 4.47 s at B=1 and 1.16 s at B=16, 3.9x.
With the CPU SDPA kernel that decoding attention used before, interleaved runs gave 3.1x-3.4x.
bfloat16 GEMMs (3-4x faster on AVX-512-BF16 cores) would lift it, but B=1 and B=16 then disagree
on ~5 % of requests (fp32 gives identical tokens, the batch-invariance guarantee), so they are
not used.

Decoding follows SGLang's algorithms (``dwise_predict/engine/algorithms.py``): ``--algorithm``
(default: the one SGLang serves the tiny model with, ``LowConfidence``) and ``--threshold`` (its
``threshold`` parameter; default: SGLang's, 0.95 for ``LowConfidence``).

    .venv/bin/python benchmarks/decode_throughput.py --requests 192 --batch-size 16 --threads 2
    .venv/bin/python benchmarks/decode_throughput.py --smoke      # 8 requests, B = 4: seconds
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dwise_predict.collectors.backends.tiny import TinyBackend, load_tiny_backend
from dwise_predict.collectors.decoder import decode
from dwise_predict.collectors.records import DecodeRequest, DecodingConfig
from dwise_predict.dllm import TINY_MODEL_DIR, TinyDllmConfig, TinyDllmForBlockDiffusion
from targets import Figure, add_options, report

TARGET_RATIO = 6.0  # B = 16 over B = 1, requests/s, on 2 cores


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


# aten ops by what they do in a round (self time, so nested ops are not counted twice)
OP_GROUPS = {"aten::mm": "linear", "aten::addmm": "linear", "aten::bmm": "attention",
             "aten::_softmax": "attention", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
             "aten::index": "kv cache", "aten::_index_put_impl_": "kv cache"}
GROUPS = ("linear", "attention", "kv cache", "other ops", "python")


class CountedRounds:
    """A backend that counts its rounds and profiles rounds ``skip`` to ``skip + n`` (0: none).

    Only a window is profiled: the op events of a whole B=1 run take gigabytes. The window runs from
    one round's end to another's, so the decoder's own work between forwards is inside it.
    """

    def __init__(self, backend, skip: int = 0, n: int = 0) -> None:
        self.backend, self.skip, self.n, self.rounds = backend, skip, n, 0
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if n else None
        self.window_s = 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step(self, batch):
        out = self.backend.step(batch)
        self.rounds += 1
        if self.n and self.rounds == self.skip:
            self.profiler.start()
            self.window_s = -time.perf_counter()
        elif self.n and self.rounds == self.skip + self.n:
            self.window_s += time.perf_counter()
            self.profiler.stop()
        return out

    def ms_per_round(self) -> dict[str, float]:
        """Milliseconds per round in each of ``GROUPS``, over the profiled window."""
        ms = dict.fromkeys(GROUPS, 0.0)
        for e in self.profiler.key_averages():
            if e.key.startswith("aten::"):
                ms[OP_GROUPS.get(e.key, "other ops")] += e.self_cpu_time_total / 1e3 / self.n
        ms["python"] = 1e3 * self.window_s / self.n - sum(ms.values())  # between ops: model and decoder code
        return ms


def run_once(backend, requests, config: DecodingConfig):
    w = time.perf_counter()
    results = list(decode(backend, requests, config))
    return time.perf_counter() - w, results


def interleaved(backend, requests, configs: list[DecodingConfig],
                repeats: int) -> tuple[list[list[float]], list, list[int]]:
    """``repeats`` timed runs of each config, alternating (one of each, then again): each config's wall
    times, its last run's results and its rounds per run."""
    counted = [CountedRounds(backend) for _ in configs]
    walls: list[list[float]] = [[] for _ in configs]
    results: list = [None] * len(configs)
    for _ in range(repeats):
        for k, config in enumerate(configs):
            wall, results[k] = run_once(counted[k], requests, config)
            walls[k].append(wall)
    return walls, results, [c.rounds // repeats for c in counted]


def measure(backend, requests, config: DecodingConfig, walls: list[float], results, rounds: int,
            profiled_rounds: int = 200) -> dict:
    """One batch size's row from its timed runs (``walls``: the median counts), then one run that
    profiles up to ``profiled_rounds`` steady-state rounds."""
    wall = statistics.median(walls)
    window = max(1, min(profiled_rounds, rounds // 2))
    profiled = CountedRounds(backend, skip=max(1, window // 4), n=window)
    run_once(profiled, requests, config)
    return {"B": config.batch_size, "wall_s": wall, "req_per_s": len(results) / wall, "rounds": rounds,
            "request_rounds": sum(r.prompt_blocks + r.total_rounds for r in results),
            "ms_per_round": 1e3 * wall / rounds, "ms": profiled.ms_per_round(),
            "tokens": sorted((r.request_id, r.output_ids) for r in results)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--algorithm", default=None, help="one of SGLang's dLLM algorithms (default: LowConfidence)")
    ap.add_argument("--threshold", type=float, default=None,
                    help="the algorithm's `threshold` parameter (default: SGLang's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the target is for 2 cores)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per batch size, alternating; the figure is the median pair's ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=TINY_MODEL_DIR, help="model directory (default: shipped)")
    add_options(ap, "8 requests, budget 16, B = 1 and 4, one timed run each, 8 rounds profiled, one thread: "
                    "a quick check")
    args = ap.parse_args(argv)
    if args.smoke:
        # one thread: two OpenMP threads on a busy machine wait at every barrier (195 ms a B=1 round at load 7)
        args.requests, args.batch_size, args.budget, args.repeats, args.threads = 8, 4, 16, 1, 1
    torch.set_num_threads(args.threads)
    backend, requests = workload(args.requests, args.budget, args.seed, args.model)
    params = {} if args.threshold is None else {"threshold": args.threshold}
    config = DecodingConfig(algorithm=args.algorithm, algorithm_config=params, batch_size=4)
    list(decode(backend, requests[:4], config))  # warm-up
    profiled = 8 if args.smoke else 200  # the profiler's events cost seconds to gather over dozens of rounds
    configs = [replace(config, batch_size=b) for b in (1, args.batch_size)]
    walls, results, rounds = interleaved(backend, requests, configs, max(1, args.repeats))
    rows = [measure(backend, requests, c, w, r, n, profiled) for c, w, r, n in zip(configs, walls, results, rounds)]
    print(f"{'B':>3} {'wall s':>7} {'req/s':>7} {'rounds':>7} {'req-rounds':>10} {'ms/round':>9}  "
          + " ".join(f"{g:>9}" for g in GROUPS) + "  (ms per round, profiled run)")
    for r in rows:
        print(f"{r['B']:>3} {r['wall_s']:>7.2f} {r['req_per_s']:>7.1f} {r['rounds']:>7} {r['request_rounds']:>10} "
              f"{r['ms_per_round']:>9.2f}  " + " ".join(f"{r['ms'][g]:>9.2f}" for g in GROUPS))
    one, many = rows
    ratios = [w1 / w16 for w1, w16 in zip(*walls)]  # the same requests: requests/s over requests/s
    ratio = statistics.median(ratios)
    same = one["tokens"] == many["tokens"]
    print(f"pairs' ratios: {', '.join(f'{r:.2f}x' for r in ratios)}; load {os.getloadavg()[0]:.1f}")
    print(f"ratio B={many['B']} / B=1: {ratio:.2f}x, the median pair's (target >= {TARGET_RATIO:g}x on 2 cores; "
          f"threads={args.threads}, "
          f"requests={len(requests)}, budget={args.budget}, {config.algorithm or 'LowConfidence'} "
          f"{config.algorithm_config or 'at its defaults'}); identical tokens: {same}")
    report("decode_throughput", [
        Figure(f"requests/s at B = {many['B']} over B = 1", ratio, "x", TARGET_RATIO, better="higher",
               context=f"{args.threads} torch thread(s)" + ("" if many["B"] == 16 else "; the target is for B = 16")),
    ], args, requests=len(requests), budget=args.budget, threads=args.threads, identical_tokens=same,
        algorithm=config.algorithm, algorithm_config=config.algorithm_config)


if __name__ == "__main__":
    main()
