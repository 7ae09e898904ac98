"""One TP rank of a fake SGLang server with the DWISE hook, for the two-rank test in
``test_serving_sglang_adapter.py`` (run as ``python tp_rank_child.py RANK STORE BUNDLE OUT``).

Both ranks serve the same requests through the fake (SGLang's own dLLM mixins and adder), joined by a
real gloo process group as a scheduler's ``dp_tp_group``. Every request ties with every other
(same prompt blocks, same estimates) except in the last bit: on rank 1, as if its CPU and GPU
rounded differently, the admission and refinement estimates of odd-numbered requests are one unit
in the last place lower. The batch each step runs is written to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BS, N = 8, 8


class RankEstimates:
    """The served bundle's manifest and sizes, with every estimate 5 rounds (admission) or 3 (refined),
    lowered by one ulp on rank 1 for odd requests (an odd word count; an odd prompt length)."""

    def __init__(self, bundle, rank: int):
        self.manifest, self.hidden_size, self.prompt_last_mean = bundle.manifest, bundle.hidden_size, bundle.prompt_last_mean
        self.rank = rank

    def _nudged(self, value: float, odd):
        values = np.full(len(odd), value, dtype=np.float32)
        return np.where(odd & (self.rank == 1), np.nextafter(values, np.float32(0)), values)

    def admission(self, x):
        return self._nudged(5.0, np.asarray(x)[:, 0] % 2 == 1)

    def refine(self, pooled, prompt_last, tokens, budget, signals):
        return torch.from_numpy(self._nudged(3.0, tokens.numpy() % 2 == 1))


def main(rank: int, store: str, bundle_path: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from fakes import sglang_fake as fake

    from dwise_predict.bundles.load import load_bundle
    from dwise_predict.serving.sglang import install

    bundle = RankEstimates(load_bundle(bundle_path, backend="torch"), rank)
    handle = install(bundle, slots=2, k=2, resolve=fake.resolve, features=lambda r: r.features, block_size=BS,
                     device="cpu", max_batch=4)
    try:
        config = fake.config(BS, 4)
        scheduler = fake.Scheduler(config, batch_capacity=4, max_total_num_tokens=10**9)
        scheduler.dp_tp_group = fake.GroupCoordinator([0, 1], rank, torch.distributed.group.WORLD)
        sp = type("SP", (), {"max_new_tokens": 64})
        for i in range(N):  # 2 prompt blocks each; odd ones one leftover token more (an odd length)
            n = 2 * BS + i % 2
            scheduler.waiting_queue.append(fake.Req(f"r{i}", [100 * i + t + 1 for t in range(n)], sp(), config, [3, 3],
                                                    np.zeros(bundle.hidden_size, np.float32), (i, 0, n)))
        runner, algorithm = fake.ModelRunner(BS, bundle.hidden_size, max_bs=4), fake.FillAlgorithm(config)
        steps = []
        while scheduler.waiting_queue or not scheduler.dllm_manager.is_empty():
            batch = scheduler.step(algorithm, runner)
            steps.append([r.rid for r in batch.reqs] if batch else [])
        Path(out).write_text(json.dumps({"steps": steps, "refined": handle.stats.refined}))
    finally:
        handle.uninstall()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
