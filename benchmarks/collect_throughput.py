"""End-to-end `collect` throughput on the tiny default, and where the time outside the model goes.

    .venv/bin/python benchmarks/collect_throughput.py [--model tiny] [--limit 128] [--batch-size 16]
    .venv/bin/python benchmarks/collect_throughput.py --smoke [--json PATH]     # 8 requests at B = 4

Runs :func:`dwise_predict.collectors.collect.collect` into a fresh temporary directory and times, by
wrapping them: the model forward (``backend.step``), the chat template, the store (shard writes and
consolidation) and the rest of the decoding loop (threshold update, bookkeeping, result assembly).
Prints requests/s end to end (model load included) and over the decoding phase, and the fraction of
decoding-phase time spent outside the model forward (target: <= 5 % at B = 16 on the tiny default).
The wrappers are taken off when the run ends, so ``main`` can run inside another process (the test).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

from targets import Figure, add_options, report

TARGET_OUTSIDE_PCT = 5.0


class Stopwatch:
    """Wall time per label of the functions it wraps, and when the decoding phase began."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.first: float | None = None

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[name] += time.perf_counter() - start
        return timed

    def loader(self, load_backend):
        """``load_backend`` timed, its backend's ``step`` (the model forward) timed too."""
        def load(*a, **k):
            backend = self.wrap("load model", load_backend)(*a, **k)
            backend.step = self.wrap("model forward", backend.step)
            return backend
        return load

    def progress(self, state) -> None:
        if self.first is None:
            self.first = time.perf_counter()


def timed_collect(args, watch: Stopwatch):
    """``collect`` into a temporary directory with ``watch`` around its parts: (traces, seconds in all, end)."""
    import dwise_predict.collectors.backends as backends
    import dwise_predict.collectors.collect as collect_mod
    import dwise_predict.collectors.workloads as workloads
    from dwise_predict.collectors.records import DecodingConfig
    from dwise_predict.collectors.store import TraceStore
    from dwise_predict.traces import load_traces

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as patches:
        for owner, name, wrapper in (
                (backends, "load_backend", watch.loader(backends.load_backend)),
                (collect_mod, "_decode_request", watch.wrap("chat template", collect_mod._decode_request)),
                (TraceStore, "write_shard", watch.wrap("store", TraceStore.write_shard)),
                (TraceStore, "consolidate", watch.wrap("store", TraceStore.consolidate)),
                (workloads, "load_workload", watch.wrap("workload", workloads.load_workload))):
            patches.enter_context(mock.patch.object(owner, name, wrapper))
        start = time.perf_counter()
        out = collect_mod.collect(args.model, args.workload, Path(tmp) / "traces",
                                  DecodingConfig(batch_size=args.batch_size), limit=args.limit,
                                  progress=watch.progress)
        end = time.perf_counter()
        return load_traces(out), end - start, end


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workload", default="tiny-default")
    parser.add_argument("--limit", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    add_options(parser, "8 requests at B = 4: a quick check")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.batch_size = 8, 4

    start = time.perf_counter()
    import torch

    import dwise_predict.dllm  # noqa: F401  (torch + transformers + model registration: start-up cost)

    imports = time.perf_counter() - start
    torch.set_num_threads(args.threads)
    watch = Stopwatch()
    traces, total, end = timed_collect(args, watch)
    spent = watch.spent
    decode_phase = end - watch.first  # from the first shard's chat template to the consolidated traces
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
    report("collect_throughput", [
        Figure("decoding time outside the model forward", 100 * outside / decode_phase, "%", TARGET_OUTSIDE_PCT,
               context=f"B = {args.batch_size}" + ("" if args.batch_size == 16 else "; the target is for B = 16")),
        Figure("collect throughput, decoding phase", n / decode_phase, "requests/s"),
    ], args, model=args.model, workload=args.workload, requests=n, batch_size=args.batch_size,
        threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
