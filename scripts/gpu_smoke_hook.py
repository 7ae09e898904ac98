"""GPU smoke test of the SGLang hook: real CUDA graphs, a small random model, torch only (no SGLang).

Usage (one command, a few minutes on one GPU):

    python scripts/fetch_sglang.py          # once: SGLang 0.5.23's Python source (no install)
    PYTHONPATH=.:tests python scripts/gpu_smoke_hook.py

It drives the test fake (``tests/fakes/sglang_fake.py``: SGLang's own ``ReqDllmMixin``,
``SchedulerDllmMixin``, ``DllmManager`` and ``DllmAlgorithm.run`` from the wheel) with a model
runner that runs a small random transformer on the GPU, either eagerly or through a
``torch.cuda.CUDAGraph`` captured at start-up *after* the hook was installed (as SGLang's graph
runner does), and checks:

1. graphs on and off record the same pooled first-round vectors, and both equal the mean of the
   model's final hidden rows over the first output block computed independently;
2. a graph captured *before* the hook is installed makes the first refinement fail loudly;
3. a request aborted mid-run leaves the policy (and everything else still finishes);
4. prompts sharing a prefix get P = prefill_rounds(n, block, cached prefix).

Prints one line per check and exits 1 if any fails. ``--cpu`` runs the checks that need no GPU
(eager pooling, abort, prefix) on the CPU, to test the script itself.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import sglang_reference  # noqa: E402

if not sglang_reference.available():
    raise SystemExit(sglang_reference.SKIP_REASON)

from fakes import sglang_fake as fake  # noqa: E402

from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.engine import prefill_rounds  # noqa: E402
from dwise_predict.errors import ConfigError  # noqa: E402
from dwise_predict.serving.sglang_adapter import UNWRITTEN, install  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402

BS, H, V, MAX_BS = 32, 256, 1024, 8
DEVICE = "cuda"


class TinyModel(nn.Module):
    """A random 2-layer bidirectional transformer: ids (B, bs) -> final hidden rows (B*bs, H)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        layer = nn.TransformerEncoderLayer(H, 4, 4 * H, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        if hasattr(torch.backends, "mha"):  # plain kernels: the fused fast path is not what we test
            torch.backends.mha.set_fastpath_enabled(False)

    def forward(self, ids):
        return self.layers(self.embed(ids % V)).reshape(-1, H)  # (B*bs, H)


class GpuRunner(fake.ModelRunner):
    """The fake's model runner with a real model; ``cuda_graph`` captures model + logits path once."""

    def __init__(self, model, cuda_graph):
        self.model = model
        super().__init__(BS, H, cuda_graph=False, max_bs=MAX_BS)
        self.cuda_graph = cuda_graph
        if cuda_graph:
            self.static_ids = torch.zeros(MAX_BS, BS, dtype=torch.long, device=DEVICE)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():  # warm-up, as SGLang's graph runner does
                for _ in range(2):
                    self.logits_processor._get_dllm_logits(self.model(self.static_ids), None, None)
            torch.cuda.current_stream().wait_stream(side)
            self.cuda_graph_obj = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.cuda_graph_obj), torch.no_grad():
                self.static_out = self.logits_processor._get_dllm_logits(self.model(self.static_ids), None, None)

    @torch.no_grad()
    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, **kwargs):
        self.calls += 1
        ids = forward_batch.input_ids.view(forward_batch.batch_size, BS).to(DEVICE)
        if self.cuda_graph and forward_batch.batch_size <= MAX_BS:
            self.static_ids.zero_()
            self.static_ids[: ids.shape[0]].copy_(ids)
            self.cuda_graph_obj.replay()  # no Python hook runs here
            full = self.static_out.full_logits[: ids.shape[0] * BS]
            return fake.SimpleNamespace(logits_output=fake.SimpleNamespace(full_logits=full), can_run_graph=True)
        out = self.logits_processor._get_dllm_logits(self.model(ids), None, None)
        return fake.SimpleNamespace(logits_output=out, can_run_graph=False)


def requests(n, shared=0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(5, 150))
        common = min(shared, length)
        ids = [1 + t % 50 for t in range(common)] + [100 + 1000 * i + t for t in range(length - common)]
        out.append((f"r{i:03d}", ids, [int(x) for x in rng.integers(2, 8, size=int(rng.integers(1, 4)))]))
    return out


def serve(model, reqs, graph, out, before_step=None, capture_first=False, slots=4):
    config = fake.config(BS, 2 * slots)
    manifest = live_manifest({"name": "tiny-random", "hidden_size": H}, "LowConfidence", {}, BS, 256)
    recorder = LiveRecorder(out, block_size=BS, every=16, manifest=manifest)
    runner = GpuRunner(model, graph) if capture_first else None
    handle = install(None, slots=slots, k=2, resolve=fake.resolve, block_size=BS, max_batch=MAX_BS, device=DEVICE,
                     hidden_size=H, recorder=recorder)
    try:
        runner = runner or GpuRunner(model, graph)  # captured after install, as at SGLang start-up
        scheduler = fake.Scheduler(config, batch_capacity=slots, max_total_num_tokens=10**9)
        sp = fake.SimpleNamespace(max_new_tokens=256)
        scheduler.waiting_queue.extend(fake.Req(rid, ids, sp, config, f, None, None) for rid, ids, f in reqs)
        fake.serve(scheduler, fake.FillAlgorithm(config), runner, before_step=before_step)
        return handle, scheduler
    finally:
        handle.uninstall()
        recorder.close()


def expected_first_round(model, ids):
    """Mean final hidden row of the first output block's first forward: leftover prompt + masks."""
    n = len(ids)
    block = ids[n // BS * BS:] + [fake.MASK] * (BS - n % BS)
    with torch.no_grad():
        return model(torch.tensor([block], device=DEVICE)).mean(dim=0).float().cpu().numpy()


def main(argv: list[str]) -> int:
    global DEVICE
    cpu = "--cpu" in argv
    if cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: this script checks CUDA-graph behaviour and needs a GPU (--cpu: the rest only)",
              file=sys.stderr)
        return 2
    graphs = not cpu
    torch.manual_seed(0)
    model = TinyModel().to(DEVICE).eval()
    failures = []
    tmp = Path(tempfile.mkdtemp(prefix="dwise-gpu-smoke-"))
    started = time.perf_counter()

    def check(name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
        if not ok:
            failures.append(name)

    reqs = requests(24)
    serve(model, reqs, False, tmp / "eager")
    eager = graph = load_traces(tmp / "eager")
    if graphs:
        serve(model, reqs, True, tmp / "graph")
        graph = load_traces(tmp / "graph")
        same_rows = eager.requests["request_id"].tolist() == graph.requests["request_id"].tolist()
        diff = float(np.abs(eager.first_round - graph.first_round).max()) if same_rows else float("inf")
        check("graphs on/off record the same pooled vectors", same_rows and diff < 1e-4, f"(max |diff| {diff:.2e})")
    want = np.stack([expected_first_round(model, dict((r, i) for r, i, _ in reqs)[rid])
                     for rid in graph.requests["request_id"]])
    diff = float(np.abs(graph.first_round - want).max())
    check("pooled vectors equal the model's first-round block mean", diff < 1e-3, f"(max |diff| {diff:.2e})")

    if graphs:
        try:
            serve(model, reqs[:6], True, tmp / "early", capture_first=True)
            check("a graph captured before install fails loudly", False, "(no error)")
        except ConfigError as err:
            check("a graph captured before install fails loudly", str(err) == UNWRITTEN)

    victim = reqs[3][0]
    handle, scheduler = serve(model, reqs, graphs, tmp / "abort",
                              before_step=lambda step, s: step == 4 and s.abort_request(fake.AbortReq(rid=victim)))
    check("a request aborted mid-run leaves the policy",
          victim in scheduler.aborted and victim not in handle.state.policy._slot_of and handle.stats.vanished == 1
          and handle.state.policy.n_resident == 0)

    # every prompt is 96 shared tokens (3 blocks) + its own tail; one at a time, so the first to run
    # caches the prefix and every later one gets P = prefill_rounds(n, block, 96)
    rng = np.random.default_rng(1)
    shared = [(f"p{i}", [1 + t % 50 for t in range(96)] + [100 + 1000 * i + t for t in range(int(rng.integers(5, 60)))],
               [3]) for i in range(8)]
    serve(model, shared, graphs, tmp / "prefix", slots=1)
    rows = load_traces(tmp / "prefix").requests.set_index("request_id")
    got = [int(rows.loc[rid, "prefill_rounds"]) for rid, _, _ in shared]
    hit = [prefill_rounds(len(ids), BS, 96) for _, ids, _ in shared]
    cold = [prefill_rounds(len(ids), BS) for _, ids, _ in shared]
    ok = sum(g == h for g, h in zip(got, hit)) == len(shared) - 1 and sum(g == c for g, c in zip(got, cold)) == 1
    check("prompts sharing a prefix get P from the cached prefix", ok, f"(P {got}; cached {hit}; cold {cold})")

    where = "cpu" if cpu else torch.cuda.get_device_name()
    print(f"{len(failures)} failed, {time.perf_counter() - started:.1f} s on {where}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
