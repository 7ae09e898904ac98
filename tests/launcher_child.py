"""Stand-in for SGLang's ``run_scheduler_process`` in the launcher's spawn test (runs in the child).

It serves a few requests through the fake scheduler (SGLang's own dLLM mixins) and reports, through
the pipe SGLang would use, whether the DWISE hook was active in this process and what it did.
"""

from __future__ import annotations

import os

import numpy as np


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    from fakes import sglang_fake as fake

    from dwise_predict.serving import launcher

    hooked = fake.SchedulerDllmMixin._fetch_waiting_reqs.__module__ == "dwise_predict.serving.sglang.install"
    config = fake.config(8, 4)
    scheduler = fake.Scheduler(config, batch_capacity=2, max_total_num_tokens=10**9)
    for i, n in enumerate([40, 8, 24]):
        scheduler.waiting_queue.append(fake.Req(f"r{i}", [100 * i + t + 1 for t in range(n)],
                                                type("SP", (), {"max_new_tokens": 64})(), config, [2, 3],
                                                np.zeros(4, np.float32), (1, 0, n)))
    order = fake.serve(scheduler, fake.FillAlgorithm(config), fake.ModelRunner(8, 4))
    stats = launcher.ACTIVE.stats if launcher.ACTIVE is not None else None
    pipe_writer.send({"pid": os.getpid(), "hooked": hooked, "finished": sorted(order, key=order.get),
                      "rounds": stats.rounds if stats else 0, "admitted": stats.admitted if stats else 0,
                      "gpu_id": gpu_id, "tp_rank": tp_rank,
                      "prompt_cache": launcher.ACTIVE.state.prompt_rows.capacity if launcher.ACTIVE else None})
    pipe_writer.close()
