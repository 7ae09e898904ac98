"""Wall time of a full `train` (both predictors, calibration, evaluation, run directory) on 2,048
synthetic requests with hidden size 2,048 (the LLaDA2 shape), the candidate choice on. Target: <= 20 s on 2 idle
cores (issue 52; default: 1 torch thread, see TrainConfig.num_threads, and the candidates' cross-validation in 2
threads, see training.select). Others' work on the cores shows in the wall time, not much in the CPU time beside it.

Usage: python benchmarks/train_time.py [--requests 2048] [--hidden 2048] [--threads 1] [--jobs 2] [--cv-members 2]
       python benchmarks/train_time.py --smoke     # 192 requests, H = 16, 3 epochs
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from dwise_predict.traces.synthetic import make_synthetic_traces
from dwise_predict.training import TrainConfig, train_run
from targets import Figure, add_options, report

TARGET_S = 20.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=None, help="CV threads (default: train's, 2 on 2+ cores)")
    parser.add_argument("--cv-members", type=int, default=0,
                        help="members of the network candidates' CV fold fits (TrainConfig.cv_members; 0: all)")
    add_options(parser, "192 requests, H = 16, at most 3 epochs, 50 bootstrap draws: a quick check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.hidden = 192, 16

    ds = make_synthetic_traces(args.requests, args.hidden, seed=0)
    epochs: dict[int, int] = {}
    config = TrainConfig(num_threads=args.threads, cv_members=args.cv_members,
                         **(dict(max_epochs=3, bootstrap=50) if args.smoke else {}))
    load = os.getloadavg()[0]  # others' work on the cores shows in the wall time: printed beside it
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = train_run(ds, Path(tmp) / "run", config,
                            progress=lambda member, epoch, *_: epochs.__setitem__(member, epoch + 1), jobs=args.jobs)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"requests {args.requests} (train {metrics['n_train']}, eval {metrics['n_eval']}), hidden {args.hidden}, "
          f"threads {args.threads}, CV jobs {args.jobs or 'default'}, CV fold members {args.cv_members or 'all'}")
    print(f"epochs per member: {[epochs[m] for m in sorted(epochs)]} (max {config.max_epochs}, patience {config.patience})")
    print(f"full train wall time: {elapsed:.1f} s (target <= {TARGET_S:g} s); CPU time {cpu:.1f} s; "
          f"load {load:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"refined rho {metrics['refined']['spearman']:.3f}, admission rho {metrics['admission']['spearman']:.3f}, "
          f"calibrated median ratio {metrics['calibration']['median_ratio_calibrated']:.3f}")
    report("train_time", [
        Figure("full train wall time", elapsed, "s", TARGET_S,
               context=f"{args.requests} requests, H = {args.hidden}, {args.threads} torch thread(s)"
                       + (f", {args.cv_members} CV fold members" if args.cv_members else "")),
        Figure("full train CPU time", cpu, "s"),
    ], args, requests=args.requests, hidden=args.hidden, threads=args.threads, jobs=args.jobs, cv_members=args.cv_members,
        refined_rho=metrics["refined"]["spearman"], admission_rho=metrics["admission"]["spearman"])


if __name__ == "__main__":
    main()
