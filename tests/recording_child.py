"""A recording scheduler process for the lifecycle tests (``tests/test_serving_lifecycle.py``).

The hook is installed as in one of SGLang's scheduler children (``launcher.install_in_this_process``,
its recorder's SIGTERM/SIGINT/exit handlers included), then the CPU fake (SGLang's own dLLM mixins)
serves a stream of requests. The process prints ``finished <rid>`` once SGLang has finished a request
(after the step that finished it), and with ``--stop-after N`` it stops adding requests after N,
serves the rest, prints ``idle`` and waits, as an idle scheduler does, until it is stopped.

    python recording_child.py OUT --flush-s 60 [--stop-after N]

:func:`scheduler_main` is the same scheduler as SGLang's ``run_scheduler_process`` is called, for an
``Engine`` that starts it (``tests/engine_child.py``): the hook already installed by the plugin's
``SchedulerEntry``, it serves :data:`ENGINE_REQUESTS` requests, reports ``idle`` through SGLang's
pipe and waits.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

BS, H = 8, 16
ENGINE_REQUESTS = 12


def serve_stream(stop_after: int, on_idle) -> None:
    """The CPU fake serving a stream of requests through the hook this process installed, six at a time;
    after ``stop_after`` requests (0: never) ``on_idle()`` once every one finished, then wait forever."""
    from fakes import sglang_fake as fake

    dllm = fake.config(BS, 8)
    scheduler = fake.Scheduler(dllm, batch_capacity=4, max_total_num_tokens=10**9)
    algorithm, runner = fake.FillAlgorithm(dllm), fake.ModelRunner(BS, H, max_bs=4)
    params = type("SP", (), {"max_new_tokens": 64})()
    rng = np.random.default_rng(0)
    live, added = [], 0
    while True:
        adding = not stop_after or added < stop_after
        while adding and len(live) < 6:
            n = int(rng.integers(3, 30))
            forwards = [int(x) for x in rng.integers(2, 5, size=int(rng.integers(1, 3)))]
            forwards[0] = min(forwards[0], BS - n % BS + 1)  # at least one fill per step
            req = fake.Req(f"r{added:05d}", [100 + 1000 * added + t for t in range(n)], params, dllm, forwards,
                           rng.normal(size=H).astype(np.float32), None)
            scheduler.waiting_queue.append(req)
            live.append(req)
            added += 1
        scheduler.step(algorithm, runner)
        for req in [r for r in live if r.finished()]:
            print(f"finished {req.rid}", flush=True)
            live.remove(req)
        if not adding and not live:
            on_idle()
            while True:
                time.sleep(0.05)


def scheduler_main(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    """``run_scheduler_process``'s place under an ``Engine`` (its arguments): serve, then say ``idle``."""
    serve_stream(ENGINE_REQUESTS, lambda: pipe_writer.send("idle"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--flush-s", type=float, default=60.0)
    parser.add_argument("--stop-after", type=int, default=0)
    args = parser.parse_args(argv)

    from fakes import sglang_launch

    from dwise_predict.serving.launcher import HookConfig, install_in_this_process

    # every=1000: no shard is committed by count here, only by the timer, a signal or the exit
    config = HookConfig(record=args.out, block_size=BS, hidden_size=H, slots=4, k=2, max_batch=4, record_every=1000,
                        record_flush_s=args.flush_s, resolver="fakes.sglang_launch:resolve")
    install_in_this_process(config, sglang_launch.ServerArgs(), gpu_id=0, tp_rank=0, pp_rank=0, dp_rank=None)
    serve_stream(args.stop_after, lambda: print("idle", flush=True))


if __name__ == "__main__":
    main(sys.argv[1:])
