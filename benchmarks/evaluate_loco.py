"""Wall time of `evaluate --loco` and how it scales with --jobs, on synthetic traces.

A full LOCO evaluation retrains both predictors once per category plus once for the
prompt-hidden-state baseline (8 + 1 with the default synthetic categories), on top of the main
training. This prints the wall time of each stage for jobs = 1 and jobs = N, checks that the LOCO
table is identical either way, and prints the table's means (refined vs admission, held out).

Usage::

    python benchmarks/evaluate_loco.py                        # default TrainConfig, 1024 requests, H = 256
    python benchmarks/evaluate_loco.py --fast --jobs 2        # a small config: ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dwise_predict.evaluation.evaluate import evaluate
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces
from dwise_predict.training import TrainConfig

FAST = dict(width=64, members=1, max_epochs=20, patience=3, lr=1e-2, batch_size=32, bootstrap=100, num_threads=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=2, help="the parallel run's workers")
    parser.add_argument("--fast", action="store_true", help="a small training config instead of the default")
    args = parser.parse_args()

    config = TrainConfig(**FAST) if args.fast else TrainConfig()
    with tempfile.TemporaryDirectory() as tmp:
        traces = write_traces(make_synthetic_traces(args.requests, args.hidden, difficulty_scale=1.5, seed=0),
                              Path(tmp) / "traces")
        tables = {}
        for jobs in (1, args.jobs):
            marks = [("start", time.perf_counter())]
            result = evaluate([traces], loco=True, jobs=jobs, config=config,
                              log=lambda message: marks.append((message.strip(), time.perf_counter()))).result
            marks.append(("end", time.perf_counter()))
            tables[jobs] = result["loco"]
            total = marks[-1][1] - marks[0][1]
            print(f"jobs={jobs}: total {total:.1f} s (requests {args.requests}, H {args.hidden}, "
                  f"{'fast' if args.fast else 'default'} config, {config.num_threads} threads per training)")
            for (label, t0), (_, t1) in zip(marks[:-1], marks[1:]):
                print(f"  {t1 - t0:7.1f} s  until: {label}")
        same = tables[1]["rows"] == tables[args.jobs]["rows"]
        mean = tables[1]["mean"]
        print(f"LOCO table identical for jobs=1 and jobs={args.jobs}: {same}")
        print(f"mean within-category rho held out: admission {mean['admission']['held_out']:.3f}, "
              f"refined {mean['refined']['held_out']:.3f}")


if __name__ == "__main__":
    main()
