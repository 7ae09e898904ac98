"""Simulator speed: 4,096 requests x 2 arrival patterns x every scheduler (target: <= 10 s on 2 cores).

Synthetic traces (seeded) with known rounds stand in for a real collection; admission, refined and
probe estimates are the true rounds with log-normal / Gaussian noise, so all eleven schedulers run.
Rounds are timed by a round-cost model (--round-profile, else the flat default). Prints the wall
time of each scheduler under each pattern in the first pass, and the median of ``--repeats`` passes'
totals (each pass printed): this machine's speed moves one pass by 10 % from minute to minute.

    python benchmarks/simulate_speed.py [--requests 4096] [--block-size 8] [--slots 128] [--round-profile P] [--repeats 3]
    python benchmarks/simulate_speed.py --smoke     # 128 requests, B = 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dwise_predict.simulation.round_cost import load_round_cost
from dwise_predict.simulation.schedulers import SCHEDULERS as POLICIES  # the default rows, not the -pf twins
from dwise_predict.simulation.simulator import SimConfig, make_arrivals, service_rate, sim_requests_from_traces, simulate
from dwise_predict.traces.synthetic import make_synthetic_traces
from targets import Figure, add_options, report

TARGET_S = 10.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--k", type=float, default=8)
    parser.add_argument("--round-profile", default=None)
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes over every run; the figures are the median pass (a busy spell moves one pass)")
    add_options(parser, "128 requests, B = 16: a quick check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.slots, args.repeats = 128, 16, 1
    cost = load_round_cost(args.round_profile) if args.round_profile else None

    ds = make_synthetic_traces(n_requests=args.requests, hidden_size=8, eval_fraction=1.0, block_size=args.block_size, seed=0)
    workload = sim_requests_from_traces(ds, split=None)
    rng = np.random.default_rng(0)
    workload.admission = workload.total_rounds * np.exp(rng.normal(0.0, 0.8, len(workload)))
    workload.refined = np.maximum(workload.total_rounds - 1 + rng.normal(0.0, 3.0, len(workload)), 0.0)
    workload.probe = np.maximum(workload.total_rounds - 1 + rng.normal(0.0, 6.0, len(workload)), 0.0)
    workload.raw_refined = workload.refined * 1.3  # an uncalibrated scale, same order
    print(f"{len(workload)} requests, mean prompt blocks {workload.prompt_blocks.mean():.1f}, "
          f"mean denoising rounds {workload.total_rounds.mean():.1f}, B={args.slots}, k={args.k:g}")

    base = SimConfig(slots=args.slots, k=args.k, round_cost=cost)
    print(f"round cost: {base.cost.source}")
    rate = 1.5 * service_rate(workload, base)
    passes = [timed_pass(workload, args, cost, rate, show=i == 0) for i in range(max(1, args.repeats))]
    total, cpu = statistics.median(w for w, _ in passes), statistics.median(c for _, c in passes)
    print(f"\ntotal: {total:.2f} s wall ({cpu:.2f} s CPU of this process: the figure on a busy machine) "
          f"for {2 * len(POLICIES)} simulations, the median of {len(passes)} passes "
          f"({', '.join(f'{w:.2f}' for w, _ in passes)} s; target <= {TARGET_S:g} s)")
    at = f"{len(workload)} requests, B = {args.slots}" + (f", median of {len(passes)}" if len(passes) > 1 else "")
    report("simulate_speed", [
        Figure(f"simulator, {2 * len(POLICIES)} runs, wall time", total, "s", TARGET_S, context=at),
        Figure(f"simulator, {2 * len(POLICIES)} runs, CPU time", cpu, "s", context=at),
    ], args, requests=len(workload), slots=args.slots, k=args.k, round_cost=base.cost.source, repeats=len(passes))


def timed_pass(workload, args, cost, rate: float, show: bool) -> tuple[float, float]:
    """Every scheduler under both arrival patterns once: (wall s, CPU s), the simulations only; ``show``
    prints each run's time and metrics."""
    total = 0.0
    cpu_start = time.process_time()
    for arrival in ("burst", "burst-poisson"):
        cfg = SimConfig(slots=args.slots, k=args.k, arrival=arrival, rate=rate if arrival == "burst-poisson" else None,
                        round_cost=cost)
        arrivals = make_arrivals(len(workload), cfg)
        if show:
            print(f"\n{arrival}:")
        for policy in POLICIES:
            start = time.perf_counter()
            m = simulate(workload, policy, cfg, arrivals).metrics
            elapsed = time.perf_counter() - start
            total += elapsed
            if show:
                print(f"  {policy:16s} {elapsed:5.2f} s  rounds {m['rounds']:6d}  mean {m['mean_latency_s']:8.1f} s  "
                      f"p99 {m['p99_latency_s']:8.1f} s  prefill-only {m['prefill_only_time_pct']:5.1f} % of time  "
                      f"idle {m['idle_slots_pct']:5.1f} %")
    return total, time.process_time() - cpu_start

if __name__ == "__main__":
    main()
