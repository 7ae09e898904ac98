"""What the SGLang hook costs SGLang 0.5.23's real server on this CPU: the scheduler loop's period
with the DWISE hook and with a pass-through hook at the same patch points, and the hook's own
wall time per step, against the targets at B = 128 (hook p50 <= 0.5 ms, p99 <= 2 ms, <= 20 µs per
arrival), which are held to the hook's host time: its time less its tensor work (below).

Both servers are SGLang's own HTTP server, launcher, scheduler and detokenizer processes, serving a
tiny random SDAR model (``tests/live/tiny_sdar.py``: hidden 64, block 4, vocabulary 151,680) on the
CPU as the live tests start it (``tests/live/live_server.py``: ``SGLANG_USE_CPU_ENGINE=1``, the
``sgl_kernel`` stand-in, ``--device cpu --disable-cuda-graph --attention-backend torch_native
--dtype float32``; here with one torch thread, :data:`TORCH_THREADS`), LowConfidence with FDFO
(SGLang's default: one forward a step). The DWISE hook runs with a bundle built for that model
(``tests/live/live_bundle.py``) and the admission features from token ids, as in production. The
pass-through (``benchmarks/hook_timing.py``) calls SGLang's originals at the hook's patch points: the
server runs SGLang's own scheduling. Both are timed inside the scheduler process by
``benchmarks/hook_timing.py`` (how, and what "the hook's own time" is: its docstring). Per step
(between two ends of ``process_batch_result_dllm``):

- **period**: the scheduler loop's period, p50 and p99;
- **hook**: the hook's own wall time (the arrivals with their features and admission estimate, the
  policy, batch formation, the first rounds' early signals, pooling, refinement and its copy to the
  host; the TP share where there is one), p50 and p99; for the pass-through the same figure is the
  patching's and the timer's own cost, the floor of every hook figure;
- **host** (printed after the table): the hook less its tensor work (``hook_timing.TENSOR_LABELS``:
  the early signals' softmax over the vocabulary, the refinement graph, the pooling product), p50 and
  p99: the figure the p50 and p99 targets are held to, and the hook's total is printed beside it;
- **µs/arrival**: ``RequestTable.register``'s time (features from token ids, the admission model,
  the policy's insert) over the requests it registered;
- **the caches** (printed last; in the benchmark's own process once both servers are stopped): two of
  the hook's per-step calls, the admission model and a policy round, warm and right after reading one
  B = 128 step's logits, as SGLang's CPU forward does before every hook step (:func:`cache_effect`).

Why the targets are held to the host time: the targets are for what the hook adds to the scheduler
thread of a served model, and on a GPU server its tensor work is kernels the scheduler thread
launches on the model's stream and does not run. On this CPU the same tensor work is computed on
the scheduler's core at a CPU's speed, as SGLang's own forward, softmax and algorithm step are: the
early signals cost about 2 ms of one core per first-round request (a softmax over 151,680 logits
for each of its 4 positions; SGLang's own ``LowConfidence.step`` pays the same per row of the
batch), dozens of milliseconds a step, which says how fast this CPU computes, not what the hook
costs a GPU server's scheduler thread. What the host time leaves out on a GPU: the launches of those
kernels (a few dozen a step) and their GPU time, which ``scripts/gpu_smoke_hook.py`` measures on a
GPU (loop period with the hook against the pass-through).

The DWISE server runs B = 128 with k = 2 (``--max-running-requests`` k·B); the pass-through's
``--max-running-requests`` is B, so neither runs more than B requests a forward. A closed loop of
clients keeps ``rows`` requests in flight: prompts of 2 to 11 tokens (no shared prefix) and 4 new
tokens, 5 to 10 forwards each on the random model; at B = 128, k·B + B/2 of them, more than the
resident set, so that requests arrive, take their first rounds and finish in every step. A phase is
measured for ``seconds`` after its first ``rows / 4`` replies; the phases run smallest first. The two
servers start together (a start is mostly imports) and each is stopped (SIGSTOP) once healthy until
its turn: an idle SGLang scheduler polls without sleeping and takes a core.

Reading the figures: the two servers run different schedules (SGLang's runs prompt blocks first,
DWISE mixes them), so their periods differ by more than the hook's time; rows per step are printed
beside them. On this CPU a step of B = 128 blocks (151,680 logits per token) costs half a second
to a second, so a phase holds a few dozen steps and p99 is close to their maximum. Other processes on
the 2 cores inflate every wall time: the load average is printed.

The earlier mode on the test fake with precomputed features is gone: it timed paths the server does
not run (no token-id features, the fake's own result processing) and this measures the ones it does.

Usage: python benchmarks/hook_overhead.py [--smoke] [--json PATH] [--work DIR] [--model DIR --bundle DIR]
(needs ``.venv-sglang``, ``make sglang-env``. A full run is about 3 minutes on 2 idle cores, more on a
busy machine; ``--smoke`` runs B = 4 through one 5-second phase, for the test that runs it:
``tests/live/test_hook_overhead_benchmark.py``, about 2 minutes, nearly all of it the two starts.)
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.monotonic()  # before the imports below (torch's among them): the wall time printed is the run's

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "live"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import hook_timing  # noqa: E402
import live_server  # noqa: E402
import tiny_sdar  # noqa: E402
from targets import Figure, add_options, report  # noqa: E402

TARGET_P50_US, TARGET_P99_US, TARGET_ARRIVAL_US = 500.0, 2000.0, 20.0
TARGET_B = 128
K = 2
MAX_TOTAL_TOKENS = 16384  # KV tokens: k·B requests of up to 6 blocks reserved, with room to spare
PROMPT_TOKENS = (2, 3, 5, 6, 7, 9, 10, 11)  # shorter than a block (a first round at once) to 2 prompt blocks
NEW_TOKENS = 4
TIMING = ROOT / "benchmarks" / "hook_timing.py"
MODES = ("pass-through", "dwise")  # measured in this order
ARRIVALS = FINISHES = 15  # per step at B = 128 in the full run (cache_effect's steady step)
DUMP_TIMEOUT_S = 60.0
# the hook's time per step by part, and SGLang's own for comparison (hook_timing's labels)
HOOK_PARTS = ("fetch_waiting_reqs", "register", "process_dllm_batches", "run", "counted_forward", "row_signals",
              "counted_step", "get_dllm_logits", "process_batch_result_dllm", "refine")
SGLANG_PARTS = ("ModelRunner.forward", "LowConfidence.step", "LogitsProcessor._get_dllm_logits",
                "SchedulerDllmMixin._process_batch_by_phase", "SchedulerDllmMixin.process_batch_result_dllm")
# one torch thread in the scheduler: the client, SGLang's tokenizer and detokenizer processes and the
# scheduler share 2 cores, and two OpenMP threads wait at every parallel region's barrier for a
# descheduled sibling (a 2-row refinement call took 43 to 112 ms at load 5 with two)
TORCH_THREADS = "1"


def note(message: str) -> None:
    """Progress, to stderr (the table goes to stdout)."""
    print(f"[{time.monotonic() - STARTED:5.0f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Phase:
    """``rows`` requests kept in flight, measured for ``seconds`` after ``rows // 4`` replies (the ramp)."""

    rows: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """``B`` and the phases each server runs, smallest first."""

    slots: int
    phases: tuple
    cache_pairs: int  # cache_effect's timed steps, each warm and swept


FULL = Plan(TARGET_B, (Phase(16, 10.0), Phase(K * TARGET_B + TARGET_B // 2, 30.0)), 100)
SMOKE = Plan(4, (Phase(K * 4 + 2, 5.0),), 10)


@dataclass
class ClosedLoop:
    """``concurrency`` client threads, each sending its next request when its last one returns."""

    server: live_server.LiveServer
    tag: str
    concurrency: int
    stop: threading.Event = field(default_factory=threading.Event)
    sent: itertools.count = field(default_factory=itertools.count)
    replies: int = 0
    threads: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> ClosedLoop:
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(self.concurrency)]
        for thread in self.threads:
            thread.start()
        return self

    def client(self) -> None:
        while not self.stop.is_set():
            n = next(self.sent)
            first = 1000 + (n * 16) % 150_000  # no two prompts share a first token: no prefix-cache hit
            text = tiny_sdar.words(range(first, first + PROMPT_TOKENS[n % len(PROMPT_TOKENS)]))
            try:
                self.server.generate(text, NEW_TOKENS, f"{self.tag}-{n}")
            except (OSError, ValueError, http.client.HTTPException, live_server.ServerFailed):
                return  # the server was stopped under it
            with self.lock:
                self.replies += 1

    def finish(self, timeout: float) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(max(0.0, timeout))


def build(work: Path) -> tuple[Path, Path]:
    """The tiny SDAR model and a bundle for it (reused when ``work`` already holds them)."""
    import live_bundle

    model, bundle = work / "tiny-sdar", work / "bundle"
    if not (model / "config.json").is_file():
        tiny_sdar.write_model(model)
    if not (bundle / "bundle.json").is_file():
        live_bundle.write_bundle(bundle, model_dir=model, hidden=tiny_sdar.HIDDEN, block_size=tiny_sdar.BLOCK)
    return model, bundle


def server_argv(mode: str, model: Path, bundle: Path, port: int, out: Path, slots: int) -> list[str]:
    """``hook_timing.py`` from SGLang's environment, with the hook's options and SGLang's own."""
    rows = K * slots if mode == "dwise" else slots
    hook = ["--bundle", str(bundle), "--slots", str(slots), "--k", str(K)] if mode == "dwise" else []
    sglang = live_server.sglang_args(model, port, "--max-running-requests", str(rows),
                                     "--max-total-tokens", str(MAX_TOTAL_TOKENS))  # the last one counts
    return [str(live_server.VENV / "bin" / "python"), str(TIMING), "--mode", mode, "--out", str(out), *hook, "--",
            *sglang]


def start(mode: str, plan: Plan, model: Path, bundle: Path, work: Path) -> tuple[live_server.LiveServer, Path]:
    """One server (its steps will be written to the path returned)."""
    port, out = live_server.free_port(), work / f"{mode}-steps.json"
    out.unlink(missing_ok=True)  # collect() waits for the scheduler to write it
    server = live_server.LiveServer(server_argv(mode, model, bundle, port, out, plan.slots),
                                    live_server.server_env(OMP_NUM_THREADS=TORCH_THREADS), work / f"{mode}.log", port)
    return server.start(), out


def pause(server: live_server.LiveServer, sig: int) -> None:
    """SIGSTOP or SIGCONT to the server's whole process group: an idle SGLang scheduler polls for
    requests without sleeping and takes a core, so a server waiting its turn is stopped."""
    os.killpg(server.process.pid, sig)


def run_all(plan: Plan, model: Path, bundle: Path, work: Path) -> dict:
    """Both servers, started together (a start is mostly imports: two at once take less wall time than
    one after the other) and each stopped once healthy; then each in turn through every phase of
    ``plan``: mode -> (its scheduler's steps, each phase's window)."""
    servers = {mode: start(mode, plan, model, bundle, work) for mode in MODES}
    try:
        for mode, (server, _) in servers.items():
            note(f"{mode}: healthy after {server.wait_healthy():.0f} s")
            pause(server, signal.SIGSTOP)
        runs = {}
        for mode, (server, out) in servers.items():
            pause(server, signal.SIGCONT)
            windows = [measure(server, f"{mode}-{phase.rows}", phase, last=i == len(plan.phases) - 1)
                       for i, phase in enumerate(plan.phases)]
            runs[mode] = collect(server, out), windows
            server.kill()
        return runs
    finally:
        for server, _ in servers.values():
            server.kill()


def measure(server: live_server.LiveServer, tag: str, phase: Phase, last: bool) -> tuple[float, float]:
    """Run one phase; its measured window (monotonic seconds, the scheduler's clock too). The last
    phase leaves its requests in flight (the server is stopped under them); others drain first."""
    clients = ClosedLoop(server, tag, phase.rows).start()
    ramp = time.monotonic()
    deadline = time.monotonic() + live_server.REQUEST_TIMEOUT_S
    while clients.replies < phase.rows // 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    start = time.monotonic()
    time.sleep(phase.seconds)
    end = time.monotonic()
    clients.finish(0.0 if last else live_server.REQUEST_TIMEOUT_S)
    note(f"{tag}: measured {end - start:.0f} s after a ramp of {start - ramp:.0f} s, {clients.replies} replies")
    return start, end


def collect(server: live_server.LiveServer, out: Path) -> dict:
    """SIGUSR1 to the scheduler process (``hook_timing`` writes its steps) and the steps it wrote."""
    for pid in server.scheduler_pids():
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + DUMP_TIMEOUT_S
    while not out.is_file():
        if time.monotonic() > deadline:
            raise live_server.ServerFailed(f"the scheduler wrote no {out.name}:\n{server.log_tail()}")
        time.sleep(0.2)
    return json.loads(out.read_text())


def summarize(dump: dict, window: tuple[float, float]) -> dict:
    """The figures (``hook_timing.step_figures``) of the steps that ended in ``window``."""
    t = np.array([step["t"] for step in dump["steps"]])
    at = np.flatnonzero((t >= window[0]) & (t <= window[1]) & (np.arange(len(t)) > 0))
    if not len(at):
        raise live_server.ServerFailed(f"no scheduler step ended in the measured window {window}")
    return hook_timing.step_figures(dump["steps"], at)


HEADER = (f"{'rows':>5}  {'server':<12} {'steps':>5} {'rows/step':>9} {'arrivals/step':>13} {'first/step':>10} "
          f"{'finished/step':>13} {'period p50 ms':>13} {'period p99 ms':>13} {'hook p50 µs':>11} {'hook p99 µs':>11} "
          f"{'µs/arrival':>10}")


def row(rows: int, mode: str, s: dict) -> str:
    dwise = mode == "dwise"
    arrivals = f"{s['arrivals']:13.1f}" if dwise else f"{'-':>13}"
    first = f"{s['first_rounds']:10.1f}" if dwise else f"{'-':>10}"
    per_arrival = f"{s['per_arrival']:10.1f}" if dwise else f"{'-':>10}"
    return (f"{rows:>5}  {mode:<12} {s['steps']:>5} {s['rows']:>9.1f} {arrivals} {first} {s['finished']:>13.1f} "
            f"{s['period_p50']:>13.1f} {s['period_p99']:>13.1f} {s['hook_p50']:>11.0f} {s['hook_p99']:>11.0f} "
            f"{per_arrival}")


@dataclass
class CacheEffect:
    """Two of the hook's per-step calls timed in this process, warm and after a sweep of the caches
    like the one SGLang's CPU forward makes before every hook step (:func:`cache_effect`): µs, medians."""

    admission_warm: float
    admission_swept: float
    policy_warm: float
    policy_swept: float
    sweep_mb: float


def cache_effect(bundle: Path, pairs: int) -> CacheEffect:
    """What the caches cost the hook on this CPU. Before every hook step SGLang's forward, on the
    scheduler's core, computes a softmax over a step's logits (B rows x block x vocabulary, fp32:
    311 MB at B = 128), which leaves none of the hook's code or data in any cache level; on a
    GPU server that work runs on the GPU. Here two of the hook's own per-step calls (the admission
    model on :data:`ARRIVALS` requests; a policy round at B = 128 and :data:`K`: those arrivals,
    ``schedule``, ``complete_slots`` with :data:`FINISHES` finishes, k·B + B/2 requests in flight) are
    timed ``pairs`` times each right after the same call (warm) and right after reading a buffer of
    that size (swept)."""
    from dwise_predict.bundles.load import load_bundle
    from dwise_predict.serving.policy import DwisePolicy

    loaded = load_bundle(bundle)
    sweep = np.ones(TARGET_B * tiny_sdar.BLOCK * tiny_sdar.VOCAB, dtype=np.float32)
    rng = np.random.default_rng(0)
    features = np.column_stack([rng.integers(1, 400, ARRIVALS), rng.integers(0, 8, ARRIVALS),
                                rng.integers(8, 2048, ARRIVALS)]).astype(np.float32)
    policy = DwisePolicy(TARGET_B, K)
    ids = itertools.count()

    def admission() -> float:
        start = time.perf_counter()
        loaded.admission(features)
        return time.perf_counter() - start

    def policy_round() -> float:
        arrived = [next(ids) for _ in range(ARRIVALS)]
        start = time.perf_counter()
        policy.add_many(arrived, [1] * ARRIVALS, rng.random(ARRIVALS) * 30.0, [64.0] * ARRIVALS)
        plan = policy.schedule()
        finished = np.zeros(len(plan.run), dtype=bool)
        finished[:FINISHES] = True
        policy.complete_slots(plan.run, plan.prompt, finished)
        return time.perf_counter() - start

    in_flight = [next(ids) for _ in range(K * TARGET_B + TARGET_B // 2)]  # as many as the full run's last phase
    policy.add_many(in_flight, [1] * len(in_flight), rng.random(len(in_flight)) * 30.0, [64.0] * len(in_flight))
    times: dict = {}
    for step in range(pairs + 5):  # the first 5 are not timed
        for name, call in (("admission", admission), ("policy", policy_round)):
            call()
            warm = call()  # right after the same call
            sweep.sum()
            swept = call()
            if step >= 5:
                times.setdefault((name, False), []).append(warm)
                times.setdefault((name, True), []).append(swept)
    median = {key: float(np.median(values)) * 1e6 for key, values in times.items()}
    return CacheEffect(median["admission", False], median["admission", True], median["policy", False],
                       median["policy", True], sweep.nbytes / 1e6)


def figures(slots: int, dwise: dict, cache: CacheEffect) -> list[Figure]:
    """The hook's figures against their targets (printed by ``targets.report``, after :func:`verdicts`):
    its host time (the module docstring says why) and per arrival; its total, tensor work included,
    and what the caches swept by the forward cost its calls (:func:`cache_effect`), beside them without a target."""
    at = f"B = {slots}" + ("" if slots == TARGET_B else f"; the targets are for B = {TARGET_B}")
    swept = (cache.admission_swept + cache.policy_swept) / (cache.admission_warm + cache.policy_warm)
    return [Figure(name, dwise[key], "µs", target, context=at)
            for name, key, target in (("hook host p50", "host_p50", TARGET_P50_US),
                                      ("hook host p99", "host_p99", TARGET_P99_US),
                                      ("hook per arrival", "per_arrival", TARGET_ARRIVAL_US),
                                      ("hook p50 with its tensor work", "hook_p50", None),
                                      ("hook p99 with its tensor work", "hook_p99", None))] + [
        Figure("hook calls, swept caches / warm", swept, "x",
               context=f"admission and a policy round at B = {TARGET_B}, {cache.sweep_mb:.0f} MB swept")]


def verdicts(slots: int, dwise: dict, passthrough: dict) -> list[str]:
    """The loop-period comparison and where the hook's time goes."""
    at = f"B = {slots}" + ("" if slots == TARGET_B else f"; the targets are for B = {TARGET_B}")
    lines = [f"the hook less its tensor work ({', '.join(hook_timing.TENSOR_LABELS)}: on a GPU, kernels launched, "
             f"not run, on the scheduler thread; the host time the p50 and p99 targets are held to): "
             f"p50 {dwise['host_p50']:.0f} µs, p99 {dwise['host_p99']:.0f} µs"]
    change = {key: 100.0 * (dwise[key] / passthrough[key] - 1.0) for key in ("period_p50", "period_p99", "period_mean")}
    lines.append(f"loop period, dwise vs pass-through ({at}): p50 {change['period_p50']:+.1f} %, p99 "
                 f"{change['period_p99']:+.1f} %, mean {change['period_mean']:+.1f} % (rows/step {dwise['rows']:.1f} vs "
                 f"{passthrough['rows']:.1f}: the schedules differ)")
    lines.append("the DWISE hook's own time, mean µs per step: " + ", ".join(
        f"{label} {dwise['parts'].get(label, 0.0):.0f}" for label in HOOK_PARTS))
    lines.append("SGLang's own time, mean µs per step, dwise | pass-through: " + ", ".join(
        f"{label} {dwise['parts'].get('sglang.' + label, 0.0):.0f} | {passthrough['parts'].get('sglang.' + label, 0.0):.0f}"
        for label in SGLANG_PARTS))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, "B = 4, one short phase (the test's run)")
    parser.add_argument("--work", type=Path, help="keep the model, bundle, logs and steps here (reused)")
    parser.add_argument("--model", type=Path, help="a tiny SDAR model written by tests/live/tiny_sdar.py (else built)")
    parser.add_argument("--bundle", type=Path, help="its bundle, written by tests/live/live_bundle.py (else built)")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.bundle is None):
        parser.error("pass --model and --bundle together (the bundle is built for the model)")
    if not live_server.venv_ready():
        raise SystemExit(live_server.MISSING)
    plan = SMOKE if args.smoke else FULL
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dwise-hook-overhead-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model, bundle = (args.model, args.bundle) if args.model else build(work)
        note(f"model {model}, bundle {bundle}")
        runs = run_all(plan, model, bundle, work)
        note("the caches' cost (both servers stopped)")
        cache = cache_effect(bundle, plan.cache_pairs)
    results = {(phase.rows, mode): summarize(dump, windows[i])
               for mode, (dump, windows) in runs.items() for i, phase in enumerate(plan.phases)}
    print(f"the DWISE hook in SGLang {live_server.SGLANG_VERSION}'s real server on this CPU ({os.cpu_count()} cores): "
          f"tiny random SDAR (hidden {tiny_sdar.HIDDEN}, block {tiny_sdar.BLOCK}, vocabulary {tiny_sdar.VOCAB:,}), "
          f"LowConfidence, FDFO")
    print(f"dwise: B = {plan.slots}, k = {K}, --max-running-requests {K * plan.slots}; pass-through: SGLang's own "
          f"scheduling, --max-running-requests {plan.slots}; load average {load:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    print(HEADER)
    for phase in plan.phases:
        for mode in MODES:
            print(row(phase.rows, mode, results[phase.rows, mode]))
    largest = plan.phases[-1].rows
    for line in verdicts(plan.slots, results[largest, "dwise"], results[largest, "pass-through"]):
        print(line)
    print(f"the caches: in this process, {ARRIVALS} requests' admission estimates take {cache.admission_warm:.0f} µs "
          f"warm and {cache.admission_swept:.0f} µs right after reading {cache.sweep_mb:.0f} MB (one step's logits at "
          f"B = {TARGET_B}, as SGLang's CPU forward sweeps the caches before every hook step; on a GPU server the "
          f"GPU computes them), a policy round at B = {TARGET_B} ({ARRIVALS} arrivals, schedule, {FINISHES} finishes) "
          f"{cache.policy_warm:.0f} and {cache.policy_swept:.0f} µs")
    print(f"wall time {time.monotonic() - STARTED:.0f} s")
    report("hook_overhead", figures(plan.slots, results[largest, "dwise"], cache), args, slots=plan.slots, k=K,
           sglang=live_server.SGLANG_VERSION, load_at_start=load)


if __name__ == "__main__":
    main()
