"""End-to-end `collect` throughput on the tiny default, and where the time outside the model goes.

    .venv/bin/python benchmarks/collect_throughput.py [--model tiny] [--limit 128] [--batch-size 16]

Runs :func:`dwise_predict.collectors.collect.collect` into a fresh temporary directory and times, by
wrapping them: the model forward (``backend.step``), the chat template, the store (shard writes and
consolidation) and the rest of the decoding loop (threshold update, bookkeeping, result assembly).
Prints requests/s end to end (model load included) and over the decoding phase, and the fraction of
decoding-phase time spent outside the model forward.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workload", default="tiny-default")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    start = time.perf_counter()
    import torch

    import dwise_predict.dllm  # noqa: F401  (torch + transformers + model registration: start-up cost)

    imports = time.perf_counter() - start
    torch.set_num_threads(args.threads)
    import dwise_predict.collectors.backends as backends
    import dwise_predict.collectors.collect as collect_mod
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.collectors.store import TraceStore

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    real_load = backends.load_backend

    def load(*a, **k):
        backend = timed("load model", real_load)(*a, **k)
        backend.step = timed("model forward", backend.step)
        return backend

    backends.load_backend = load
    collect_mod._decode_request = timed("chat template", collect_mod._decode_request)
    TraceStore.write_shard = timed("store", TraceStore.write_shard)
    TraceStore.consolidate = timed("store", TraceStore.consolidate)
    import dwise_predict.collectors.workloads as workloads

    workloads.load_workload = timed("workload", workloads.load_workload)
    phase = {}

    def progress(state):
        phase.setdefault("first", time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        out = collect_mod.collect(args.model, args.workload, Path(tmp) / "traces",
                                  DecodingConfig(batch_size=args.batch_size), limit=args.limit, progress=progress)
        end = time.perf_counter()
        total = end - start
        from dwise_predict.traces import load_traces

        traces = load_traces(out)
    decode_phase = end - phase["first"]  # from the first shard's chat template to the consolidated traces
    n = len(traces)
    rounds = int(traces.requests["total_rounds"].sum())
    print(f"model {args.model}, workload {args.workload}, {n} requests, batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"imports         : {imports:7.2f} s  (torch, transformers: paid once per process)")
    print(f"end to end      : {total:7.2f} s  {n / total:7.2f} requests/s  (model load and workload included)")
    print(f"decoding phase  : {decode_phase:7.2f} s  {n / decode_phase:7.2f} requests/s  "
          f"{rounds / decode_phase:7.1f} request-rounds/s")
    forward = spent["model forward"]
    outside = decode_phase - forward
    print(f"outside forward : {outside / decode_phase:7.1%} of the decoding phase")
    for name in ("model forward", "chat template", "store"):
        print(f"  {name:<14}: {spent[name]:7.3f} s  {spent[name] / decode_phase:6.1%}")
    rest = decode_phase - forward - spent["chat template"] - spent["store"]
    print(f"  {'decoder loop':<14}: {rest:7.3f} s  {rest / decode_phase:6.1%}  (threshold update, bookkeeping, rows)")
    print(f"  {'load model':<14}: {spent['load model']:7.3f} s  (before decoding)")
    print(f"  {'workload':<14}: {spent['workload']:7.3f} s  (before decoding)")


if __name__ == "__main__":
    main()
