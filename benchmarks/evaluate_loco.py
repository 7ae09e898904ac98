"""Wall time of `evaluate --loco` and how it scales with --jobs, on synthetic traces.

A full LOCO evaluation retrains both predictors once per category plus once for the
prompt-hidden-state baseline (8 + 1 with the default synthetic categories), on top of the main
training. This prints the wall time of each stage for jobs = 1 and jobs = N, checks that the LOCO
table is identical either way, and prints the table's means (refined vs admission, held out).

Usage::

    python benchmarks/evaluate_loco.py                        # default TrainConfig, 1024 requests, H = 256
    python benchmarks/evaluate_loco.py --fast --jobs 2        # a small config: ~1 minute on 2 cores
    python benchmarks/evaluate_loco.py --smoke                # 120 requests in 3 categories, H = 16, small config

No speed target is set for it; the target is that both runs give the same LOCO table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dwise_predict.evaluation.evaluate import evaluate
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import DEFAULT_CATEGORIES, make_synthetic_traces
from dwise_predict.training import TrainConfig
from targets import Figure, add_options, report

FAST = dict(width=64, members=1, max_epochs=20, patience=3, lr=1e-2, batch_size=32, bootstrap=100, num_threads=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=2, help="the parallel run's workers")
    parser.add_argument("--fast", action="store_true", help="a small training config instead of the default")
    add_options(parser, "120 requests in 3 categories, H = 16, the small config (--fast): a quick check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.hidden, args.fast = 120, 16, True
    # three categories, so that each keeps enough held-out requests for its LOCO row at 120 requests
    categories = dict(list(DEFAULT_CATEGORIES.items())[:3]) if args.smoke else None

    config = TrainConfig(**FAST) if args.fast else TrainConfig()
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = make_synthetic_traces(args.requests, args.hidden, categories, difficulty_scale=1.5, seed=0)
        traces = write_traces(synthetic, Path(tmp) / "traces")
        tables, totals = {}, {}
        for jobs in (1, args.jobs):
            marks = [("start", time.perf_counter())]
            result = evaluate([traces], loco=True, jobs=jobs, config=config,
                              log=lambda message: marks.append((message.strip(), time.perf_counter()))).result
            marks.append(("end", time.perf_counter()))
            tables[jobs] = result["loco"]
            total = totals[jobs] = marks[-1][1] - marks[0][1]
            print(f"jobs={jobs}: total {total:.1f} s (requests {args.requests}, H {args.hidden}, "
                  f"{'fast' if args.fast else 'default'} config, {config.num_threads} threads per training)")
            for (label, t0), (_, t1) in zip(marks[:-1], marks[1:]):
                print(f"  {t1 - t0:7.1f} s  until: {label}")
        one, many = tables[1]["rows"], tables[args.jobs]["rows"]
        differ = sum(a != b for a, b in zip(one, many)) + abs(len(one) - len(many))
        mean = tables[1]["mean"]
        print(f"LOCO table identical for jobs=1 and jobs={args.jobs}: {differ == 0}")
        print(f"mean within-category rho held out: admission {mean['admission']['held_out']:.3f}, "
              f"refined {mean['refined']['held_out']:.3f}")
    config_name = "fast" if args.fast else "default"
    report("evaluate_loco", [
        Figure(f"LOCO rows that differ between jobs=1 and jobs={args.jobs}", differ, "rows", 0.0),
        Figure(f"evaluate --loco wall time, jobs={args.jobs}", totals[args.jobs], "s",
               context=f"{args.requests} requests, H = {args.hidden}, {config_name} config"),
    ], args, requests=args.requests, hidden=args.hidden, jobs=args.jobs, config=config_name,
        wall_s={str(jobs): total for jobs, total in totals.items()})


if __name__ == "__main__":
    main()
