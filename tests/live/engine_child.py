"""Run by the SGLang environment's Python: SGLang's offline ``sglang.Engine`` on the tiny model, with
the DWISE plugin configured by the ``DWISE_*`` variables it was given; a few requests, then
``Engine.shutdown()``, as a script using SGLang offline ends. Prints ``{"finished": [rid, ...]}``.

``python engine_child.py MODEL N``
"""

from __future__ import annotations

import json
import sys

from tiny_sdar import words


def main(model: str, n: int) -> None:
    import sglang

    engine = sglang.Engine(model_path=model, device="cpu", dllm_algorithm="LowConfidence", disable_cuda_graph=True,
                           attention_backend="torch_native", max_total_tokens=4096, dtype="float32",
                           max_running_requests=4, log_level="info")
    rids = [f"engine-{i}" for i in range(n)]
    prompts = [words(range(90_000 + 100 * i, 90_000 + 100 * i + 6 + i)) for i in range(n)]
    outputs = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0}, rid=rids)
    engine.shutdown()
    print(json.dumps({"finished": [out["meta_info"]["id"] for out in outputs]}), flush=True)


if __name__ == "__main__":  # SGLang spawns its schedulers: they import this file, and must not run it
    main(sys.argv[1], int(sys.argv[2]))
