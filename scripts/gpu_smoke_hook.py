"""GPU smoke test of the SGLang hook: real CUDA graphs, a small random model, torch only (no SGLang).

Usage (one command, a few minutes on one GPU):

    python scripts/fetch_sglang.py          # once: SGLang 0.5.23's Python source (no install)
    PYTHONPATH=.:tests python scripts/gpu_smoke_hook.py

It drives the test fake (``tests/fakes/sglang_fake.py``: SGLang's own ``ReqDllmMixin``,
``SchedulerDllmMixin``, ``DllmManager``, ``PrefillAdder`` and ``DllmAlgorithm.run`` from the wheel)
with a model runner that runs a small random transformer on the GPU, either eagerly or through
``torch.cuda.CUDAGraph`` s captured at start-up *after* the hook was installed, one per batch size of
:data:`GRAPH_SIZES`, a batch replaying the smallest that holds it with its rows padded (as SGLang's
decode graph runner does) and a batch above the largest running eagerly; and checks:

1. graphs on and off record the same pooled first-round vectors, and both equal the mean of the
   model's final hidden rows over the first output block computed independently;
2. the same for batches of 3, 17 and 130 requests, which replay the graphs of 4, 24 and 136 with
   padding rows, and of 137, one above the largest graph, which runs eagerly;
3. the hook synchronises the GPU at most once per step, and only in steps with a first denoising
   round (``torch.cuda.set_sync_debug_mode``: every synchronising call from the hook's own code);
4. a graph captured *before* the hook is installed makes the first refinement fail loudly;
5. a request aborted mid-run leaves the policy (and everything else still finishes);
6. prompts sharing a prefix get P = prefill_rounds(n, block, cached prefix);

and prints the scheduler loop's period with the hook and with a pass-through hook at the same five
patch points (``benchmarks/hook_timing.py``'s ``PassThroughHook``: SGLang's own scheduling), mean and
p99, against the targets on a GPU (the hook's mean <= +1 %, p99 <= +3 % over the pass-through), with
the hook's own time per step (:func:`compare_loop_periods`). ``benchmarks/hook_overhead.py`` makes that
comparison in SGLang's real server on a CPU; SGLang cannot be installed on the GPU machine, so here it
is made as far as the fake goes: SGLang's own scheduler mixin, adder and algorithm loop from the
wheel around a random transformer of about 600 M parameters (:data:`PERIOD_LAYERS` layers of hidden
:data:`PERIOD_H` in bf16, B = 128 blocks of 32 a forward, replayed from a CUDA graph: a step of
milliseconds, not the tiny model's fraction of one; its forward time per step is printed, to scale
the percentages to a served model's step), a closed loop of requests (each one finished is replaced:
arrivals, first rounds and finishes every step), the hook recording (pooling, early signals, one
copy to the host per step with a first round) with no bundle (no refinement launch: building a
bundle needs the training stack, which this script does not assume), the fake's own result
processing (no KV pool, no streaming) and its one-column logits (no softmax over a real
vocabulary). The two schedules differ (SGLang's runs prompt blocks first), as in the real server;
rows per step are printed beside the periods. Timing lines, not checks: they do not fail the run.

``--bundle DIR`` refines with that bundle in the loop-period comparison (its launch, the admission model
on every arrival: what a served hook does); ``tests/live/live_bundle.py`` writes one of the right width.

Prints one line per check and exits 1 if any fails; a few minutes on one GPU (well under 10).
``--cpu`` runs the checks that need no GPU (eager pooling, padded batch sizes eagerly, abort,
prefix) on the CPU, to test the script itself (``tests/test_gpu_smoke_script.py`` runs its pieces).
"""

from __future__ import annotations

import collections
import itertools
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import hook_timing  # noqa: E402
import sglang_reference  # noqa: E402

if not sglang_reference.available():
    raise SystemExit(sglang_reference.SKIP_REASON)

from fakes import sglang_fake as fake  # noqa: E402

from dwise_predict.collectors.live import LiveRecorder, live_manifest  # noqa: E402
from dwise_predict.engine import prefill_rounds  # noqa: E402
from dwise_predict.errors import ConfigError  # noqa: E402
from dwise_predict.serving.sglang import UNWRITTEN, install  # noqa: E402
from dwise_predict.traces import load_traces  # noqa: E402

BS, H, V = 32, 256, 1024
# the decode CUDA-graph batch sizes captured at start-up (a few of SGLang's: 1, 2, 4, 8, 12, 16, 24, ... 256)
GRAPH_SIZES = (4, 8, 24, 136)
PADDED_BATCHES = (3, 17, 130, GRAPH_SIZES[-1] + 1)  # replay 4, 24, 136 with padding; one above the largest: eager
SYNC_SITES: collections.Counter = collections.Counter()  # the hook's synchronising calls, by file:line
MAX_BATCH = GRAPH_SIZES[-1] + 1  # the hook's buffer holds the largest graph and the largest eager batch
DEVICE = "cuda"
# the loop-period comparison (compare_loop_periods): a random model of about 600 M parameters in bf16
# (12 layers of hidden 2048), B = 128, k = 2, and the targets over the pass-through, in percent
PERIOD_H, PERIOD_LAYERS, PERIOD_SLOTS, PERIOD_K = 2048, 12, 128, 2
PERIOD_STEPS, PERIOD_WARMUP = 300, 50
PERIOD_MEAN_TARGET, PERIOD_P99_TARGET = 1.0, 3.0


class TinyModel(nn.Module):
    """A random bidirectional transformer (2 layers of width H unless told): ids (B, bs) -> final
    hidden rows (B*bs, hidden)."""

    def __init__(self, hidden=H, layers=2):
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(V, hidden)
        layer = nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        if hasattr(torch.backends, "mha"):  # plain kernels: the fused fast path is not what we test
            torch.backends.mha.set_fastpath_enabled(False)

    def forward(self, ids):
        return self.layers(self.embed(ids % V)).reshape(-1, self.hidden)  # (B*bs, hidden)


class DeviceFillAlgorithm(fake.FillAlgorithm):
    """The fake's ``FillAlgorithm.step`` as tensor ops on the forward's device with one host read a step
    (the rows' done flags), as SGLang's own ``step`` reads its results once: the fake's per-row loop
    reads every row's masks to the host, a synchronisation per row on a GPU."""

    def step(self, forward_batch, full_logits, states):
        ids = forward_batch.input_ids.view(forward_batch.batch_size, self.block_size)  # (B, bs), filled in place
        masked = ids == self.mask_id
        count = masked.sum(dim=1)
        # forwards left in the row's block (FillAlgorithm.step): fill ceil(masked / left) positions, in order
        left = torch.tensor([max(max(r.forwards_per_block[min(r.blocks_done, len(r.forwards_per_block) - 1)] - 1, 1)
                                 - r.fills, 1) for r in forward_batch.reqs], device=ids.device)
        take = (count + left - 1) // left
        ids.masked_fill_(masked & (masked.cumsum(dim=1) <= take[:, None]), fake.FILL)
        done = (count == 0).tolist()  # the step's one host read
        for req, finished in zip(forward_batch.reqs, done):
            req.fills += not finished
        return done


def padded_size(batch: int, sizes) -> int | None:
    """The captured graph a forward of ``batch`` requests replays: the smallest size that holds it
    (SGLang pads the batch's rows up to it), or None above the largest (the forward runs eagerly)."""
    return next((size for size in sorted(sizes) if size >= batch), None)


class GpuRunner(fake.ModelRunner):
    """The fake's model runner with a real model; ``cuda_graph`` captures model + logits path once per
    size of ``sizes`` (largest first, sharing one memory pool, as SGLang's graph runner does).
    ``sync``: wait for the forward before returning, as SGLang's host reads of its output do."""

    def __init__(self, model, cuda_graph, sizes=GRAPH_SIZES, sync=False):
        self.model, self.sync = model, sync
        super().__init__(BS, model.hidden, cuda_graph=False, max_bs=max(sizes))
        self.cuda_graph, self.graphs = cuda_graph, {}
        if cuda_graph:
            pool = torch.cuda.graph_pool_handle()
            for size in sorted(sizes, reverse=True):
                static_ids = torch.zeros(size, BS, dtype=torch.long, device=DEVICE)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.no_grad():  # warm-up, as SGLang's graph runner does
                    for _ in range(2):
                        self.logits_processor._get_dllm_logits(self.model(static_ids), None, None)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                    out = self.logits_processor._get_dllm_logits(self.model(static_ids), None, None)
                self.graphs[size] = (graph, static_ids, out)
        self.replayed: list = []  # the graph size each forward replayed (None: eager)

    @torch.no_grad()
    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, **kwargs):
        self.calls += 1
        # SGLang's ForwardBatch holds its input ids on the device (the fake's on the host): the algorithm's
        # step and the hook's early signals then read them where SGLang's do
        forward_batch.input_ids = forward_batch.input_ids.to(DEVICE)
        ids = forward_batch.input_ids.view(forward_batch.batch_size, BS)
        size = padded_size(forward_batch.batch_size, self.graphs) if self.cuda_graph else None
        self.replayed.append(size)
        if size is not None:
            graph, static_ids, out = self.graphs[size]
            static_ids.zero_()  # the padding rows: a replay computes (and pools) them too
            static_ids[: ids.shape[0]].copy_(ids)
            graph.replay()  # no Python hook runs here
            full = out.full_logits[: ids.shape[0] * BS]
            self.wait()
            return fake.SimpleNamespace(logits_output=fake.SimpleNamespace(full_logits=full), can_run_graph=True)
        out = self.logits_processor._get_dllm_logits(self.model(ids), None, None)
        self.wait()
        return fake.SimpleNamespace(logits_output=out, can_run_graph=False)

    def wait(self):
        if self.sync and DEVICE != "cpu":
            torch.cuda.synchronize()


def requests(n, shared=0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(5, 150))
        common = min(shared, length)
        ids = [1 + t % 50 for t in range(common)] + [100 + 1000 * i + t for t in range(length - common)]
        out.append((f"r{i:03d}", ids, [int(x) for x in rng.integers(2, 8, size=int(rng.integers(1, 4)))]))
    return out


def serve(model, reqs, graph, out, before_step=None, capture_first=False, slots=4, sizes=GRAPH_SIZES):
    """Serve ``reqs`` through the fake with the hook recording into ``out``; returns (handle, scheduler,
    runner, steps): per step, the synchronising CUDA calls made from the hook's own code and its
    device-to-host copies (``HookStats.host_transfers``)."""
    config = fake.config(BS, 2 * slots)
    manifest = live_manifest({"name": "tiny-random", "hidden_size": H}, "LowConfidence", {}, BS, 256)
    recorder = LiveRecorder(out, block_size=BS, every=16, manifest=manifest)
    runner = GpuRunner(model, graph, sizes) if capture_first else None
    handle = install(None, slots=slots, k=2, resolve=fake.resolve, block_size=BS, max_batch=MAX_BATCH, device=DEVICE,
                     hidden_size=H, recorder=recorder)
    syncs = []
    try:
        runner = runner or GpuRunner(model, graph, sizes)  # captured after install, as at SGLang start-up
        scheduler = fake.Scheduler(config, batch_capacity=slots, max_total_num_tokens=10**9)
        sp = fake.SimpleNamespace(max_new_tokens=256)
        scheduler.waiting_queue.extend(fake.Req(rid, ids, sp, config, f, None, None) for rid, ids, f in reqs)
        algorithm = DeviceFillAlgorithm(config)
        step = 0
        while scheduler.waiting_queue or not scheduler.dllm_manager.is_empty():
            if before_step is not None:
                before_step(step, scheduler)
            copies = handle.stats.host_transfers
            with hook_syncs() as caught:
                scheduler.step(algorithm, runner)
            syncs.append((len(caught), handle.stats.host_transfers - copies))
            SYNC_SITES.update(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
            step += 1
        return handle, scheduler, runner, syncs
    finally:
        handle.uninstall()
        recorder.close()


class hook_syncs:
    """The synchronising CUDA calls (``torch.cuda.set_sync_debug_mode``) made from the hook's code
    while in the block: a list of warnings (empty on the CPU, where nothing synchronises)."""

    def __enter__(self):
        self.caught = warnings.catch_warnings(record=True)
        found = self.caught.__enter__()
        warnings.simplefilter("always")
        if DEVICE != "cpu":
            torch.cuda.set_sync_debug_mode("warn")
        self.found = found
        self.hook = []
        return self.hook

    def __exit__(self, *exc):
        if DEVICE != "cpu":
            torch.cuda.set_sync_debug_mode(0)
        self.hook += [w for w in self.found if "/serving/sglang/" in w.filename]
        self.caught.__exit__(*exc)
        return False


def short_requests(n: int, seed: int) -> list:
    """``n`` prompts shorter than a block: every one runs its first denoising forward in the first step."""
    rng = np.random.default_rng(seed)
    return [(f"b{i:03d}", [100 + 1000 * i + t for t in range(int(rng.integers(3, BS - 1)))], [2]) for i in range(n)]


def check_padded_batches(model, check, tmp: Path, graphs: bool, batches=PADDED_BATCHES) -> None:
    """Batches landing on padded graph sizes, and one above the largest graph, pool the same rows as
    eager forwards, and those are the model's own first-round block means."""
    for batch in batches:
        reqs = short_requests(batch, seed=batch)
        _, _, eager_runner, _ = serve(model, reqs, False, tmp / f"pad{batch}-eager", slots=batch)
        eager = load_traces(tmp / f"pad{batch}-eager")
        got = eager
        if graphs:
            _, _, runner, _ = serve(model, reqs, True, tmp / f"pad{batch}-graph", slots=batch)
            got = load_traces(tmp / f"pad{batch}-graph")
            same = eager.requests["request_id"].tolist() == got.requests["request_id"].tolist()
            diff = float(np.abs(eager.first_round - got.first_round).max()) if same else float("inf")
            check(f"batch {batch} (graph {padded_size(batch, GRAPH_SIZES)}): graphs on/off pool the same rows",
                  same and diff < 1e-4 and runner.replayed[0] == padded_size(batch, GRAPH_SIZES),
                  f"(replayed {runner.replayed[0]}, max |diff| {diff:.2e})")
        want = np.stack([expected_first_round(model, dict((r, i) for r, i, _ in reqs)[rid])
                         for rid in got.requests["request_id"]])
        diff = float(np.abs(got.first_round - want).max())
        check(f"batch {batch}: pooled rows equal the model's block means", len(got) == batch and diff < 1e-3,
              f"({len(got)} rows, max |diff| {diff:.2e})")


def expected_first_round(model, ids):
    """Mean final hidden row of the first output block's first forward: leftover prompt + masks."""
    n = len(ids)
    block = ids[n // BS * BS:] + [fake.MASK] * (BS - n % BS)
    with torch.no_grad():
        return model(torch.tensor([block], device=DEVICE)).mean(dim=0).float().cpu().numpy()


def period_request(n: int, config) -> fake.Req:
    """The closed loop's ``n``-th request: one or two prompt blocks and up to 7 tokens more, ids of its
    own (no shared prefix), two output blocks of 3 forwards each; its admission features (words,
    newlines, prompt tokens) for a bundle."""
    ids = [100 + 1000 * n + t for t in range(BS + (7 * n) % (BS + 8))]
    features = np.array([len(ids), n % 3, len(ids)], np.float32)
    return fake.Req(f"p{n:05d}", ids, fake.SimpleNamespace(max_new_tokens=256), config, [3, 3], None, features)


def request_features(req) -> np.ndarray:
    """The admission features the hook reads for a request (the fake's requests carry theirs)."""
    return req.features


def period_run(model, mode: str, slots: int, steps: int, out: Path, bundle=None) -> list:
    """``steps`` scheduler steps through the fake with the hook (``mode`` "dwise": recording, as
    :func:`serve`, k = :data:`PERIOD_K`, refining with ``bundle`` when given) or the pass-through
    (SGLang's own scheduling, ``slots`` resident), timed by ``hook_timing`` (each step's end, the hook's
    own time); a closed loop keeps k·B + B/2 requests in the server. Returns the clock's steps."""
    clock = hook_timing.StepClock()
    hook_wraps = 0
    hook_timing.time_sglang(clock, fake.resolve, also=((GpuRunner, "forward"), (DeviceFillAlgorithm, "step")))
    recorder = handle = None
    try:
        if mode == "dwise":
            manifest = live_manifest({"name": "tiny-random", "hidden_size": model.hidden}, "LowConfidence", {}, BS, 256)
            recorder = LiveRecorder(out, block_size=BS, every=64, manifest=manifest)
            handle = install(bundle, features=request_features if bundle is not None else None, slots=slots, k=PERIOD_K,
                             resolve=fake.resolve, block_size=BS, max_batch=MAX_BATCH, device=DEVICE,
                             hidden_size=model.hidden, recorder=recorder)
        else:
            handle = hook_timing.install_pass_through(fake.resolve)
        hook_wraps = len(clock.restore)
        hook_timing.time_hook(clock, handle)
        runner = GpuRunner(model, DEVICE != "cpu", sync=True)  # captured after install, as at SGLang start-up
        config = fake.config(BS, PERIOD_K * slots if mode == "dwise" else slots)
        scheduler = fake.Scheduler(config, batch_capacity=PERIOD_K * slots, max_total_num_tokens=10**9)
        algorithm, sent = DeviceFillAlgorithm(config), itertools.count()
        scheduler.waiting_queue.extend(period_request(next(sent), config) for _ in range(PERIOD_K * slots + slots // 2))
        while len(clock.steps) < steps:
            batch = scheduler.step(algorithm, runner)
            done = sum(r.finished() for r in batch.reqs) if batch is not None else 0
            scheduler.waiting_queue.extend(period_request(next(sent), config) for _ in range(done))
        return clock.steps
    finally:
        clock.undo(since=hook_wraps)  # the hook's wraps first, so uninstalling leaves none of its methods
        if handle is not None:
            handle.uninstall()
        clock.undo()  # then SGLang's own functions back in place
        if recorder is not None:
            recorder.close()


def compare_loop_periods(model, tmp: Path, slots=PERIOD_SLOTS, steps=PERIOD_STEPS, warmup=PERIOD_WARMUP,
                         bundle=None) -> list[str]:
    """The loop period with the hook (refining with ``bundle`` when given) and with the pass-through
    (module docstring), ``steps`` steps after ``warmup``, and the targets' lines: the lines to print."""
    figures = {mode: hook_timing.step_figures(period_run(model, mode, slots, warmup + steps, tmp / f"period-{mode}",
                                                         bundle), range(warmup, warmup + steps))
               for mode in ("pass-through", "dwise")}
    where = "cpu" if DEVICE == "cpu" else torch.cuda.get_device_name()
    lines = [f"loop period, hook vs pass-through at the same patch points, on the fake with a random "
             f"{len(model.layers.layers)}-layer transformer (hidden {model.hidden}, {next(model.parameters()).dtype}) "
             f"on {where}{', CUDA graphs' if DEVICE != 'cpu' else ''}: B = {slots}, k = {PERIOD_K}, {steps} steps "
             f"after {warmup}, {'refining with a bundle' if bundle is not None else 'no bundle (no refinement)'}"]
    for mode, f in figures.items():
        first = f"{f['first_rounds']:5.1f}" if mode == "dwise" else f"{'-':>5}"  # the pass-through plans none
        lines.append(f"  {mode:<12} rows/step {f['rows']:6.1f}  first rounds/step {first}  "
                     f"period mean {f['period_mean']:8.3f} ms  p50 {f['period_p50']:8.3f} ms  p99 {f['period_p99']:8.3f} ms"
                     f"  hook p50 {f['hook_p50']:7.0f} µs  p99 {f['hook_p99']:7.0f} µs  model forward "
                     f"{f['parts'].get('sglang.GpuRunner.forward', 0.0) / 1e3:7.3f} ms/step")
    hook, base = figures["dwise"], figures["pass-through"]
    for name, key, target in (("mean", "period_mean", PERIOD_MEAN_TARGET), ("p99", "period_p99", PERIOD_P99_TARGET)):
        change = 100.0 * (hook[key] / base[key] - 1.0)
        lines.append(f"target loop period {name} <= +{target:g} % over the pass-through: {change:+.2f} %, "
                     f"{'met' if change <= target else 'MISSED'}")
    # the schedules differ (DWISE fills B rows a step, SGLang's runs prompt blocks apart): per row, and the
    # hook's own time as a share of its period, are the figures that compare like with like
    per_row = {mode: 1e3 * f["period_mean"] / f["rows"] for mode, f in figures.items()}
    hook_mean = sum(hook["parts"].get(label, 0.0) for label in hook_timing.HOOK_LABELS)
    lines.append(f"figure loop period per row: pass-through {per_row['pass-through']:.1f} µs, dwise "
                 f"{per_row['dwise']:.1f} µs ({100.0 * (per_row['dwise'] / per_row['pass-through'] - 1.0):+.1f} %); "
                 f"the hook's own time {hook_mean:.0f} µs a step, {hook_mean / (10.0 * hook['period_mean']):.1f} % "
                 f"of the dwise loop period")
    top = sorted(hook["parts"].items(), key=lambda item: -item[1])[:12]
    lines.append("dwise, mean µs per step by part: " + ", ".join(f"{label} {us:.0f}" for label, us in top))
    return lines


def period_bundle(argv: list[str]):
    """The bundle named by ``--bundle DIR`` (of width :data:`PERIOD_H`, block :data:`BS`, e.g.
    ``tests/live/live_bundle.py``'s ``write_bundle(DIR, None, 2048, 32)``), loaded for the GPU; None
    without one."""
    if "--bundle" not in argv:
        return None
    from dwise_predict.bundles.load import load_bundle

    return load_bundle(argv[argv.index("--bundle") + 1], device=DEVICE, backend="torch",
                       expect_decoding={"block_size": BS})


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
        _, _, _, steps = serve(model, reqs, True, tmp / "graph")
        graph = load_traces(tmp / "graph")
        extra = [found - copies for found, copies in steps]  # 1 once: the model's stop ids, on the first forward
        check("the hook synchronises once at most per step, only with a first denoising round",
              max(copies for _, copies in steps) <= 1 and max(extra) <= 1 and sum(e > 0 for e in extra) <= 1,
              f"(syncs per step {[found for found, _ in steps]}; at {dict(SYNC_SITES)})")
        same_rows = eager.requests["request_id"].tolist() == graph.requests["request_id"].tolist()
        diff = float(np.abs(eager.first_round - graph.first_round).max()) if same_rows else float("inf")
        check("graphs on/off record the same pooled vectors", same_rows and diff < 1e-4, f"(max |diff| {diff:.2e})")
    want = np.stack([expected_first_round(model, dict((r, i) for r, i, _ in reqs)[rid])
                     for rid in graph.requests["request_id"]])
    diff = float(np.abs(graph.first_round - want).max())
    check("pooled vectors equal the model's first-round block mean", diff < 1e-3, f"(max |diff| {diff:.2e})")

    check_padded_batches(model, check, tmp, graphs)

    if graphs:
        try:
            serve(model, reqs[:6], True, tmp / "early", capture_first=True)
            check("a graph captured before install fails loudly", False, "(no error)")
        except ConfigError as err:
            check("a graph captured before install fails loudly", str(err) == UNWRITTEN)

    victim = reqs[3][0]
    handle, scheduler, _, _ = serve(model, reqs, graphs, tmp / "abort",
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

    if graphs:  # timing lines, not checks (module docstring); the --cpu run leaves them to the test
        period_model = TinyModel(PERIOD_H, PERIOD_LAYERS).to(DEVICE, torch.bfloat16).eval()
        for line in compare_loop_periods(period_model, tmp, bundle=period_bundle(argv)):
            print(line)

    where = "cpu" if cpu else torch.cuda.get_device_name()
    print(f"{len(failures)} failed, {time.perf_counter() - started:.1f} s on {where}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
