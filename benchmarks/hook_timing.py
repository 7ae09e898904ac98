"""The scheduler-process side of ``benchmarks/hook_overhead.py``: SGLang's real server started with
the DWISE hook, or with a pass-through hook at the same patch points, and the hook's own wall
time and the scheduler loop's period timed inside SGLang's scheduler process.

Run by the benchmark (never by hand) from SGLang's environment::

    .venv-sglang/bin/python benchmarks/hook_timing.py --mode dwise --out steps.json \\
        --bundle B --slots 128 --k 2 -- SGLANG-SERVER-ARGS
    .venv-sglang/bin/python benchmarks/hook_timing.py --mode pass-through --out steps.json -- SGLANG-SERVER-ARGS

It starts SGLang's HTTP server as ``dwise-predict serve`` does (``launcher.server_arguments``,
``launcher.resolved``, ``http_server.launch_server``), with :class:`TimedSchedulerEntry` as the
scheduler's target. In the scheduler process that entry

1. wraps SGLang's own functions the hook calls (:data:`SGLANG_CALLS`, each algorithm's ``step``,
   ``ModelRunner.forward``) in a timer, *before* the hook is installed, so the hook resolves and
   calls the timed ones;
2. installs the hook: the DWISE hook through the launcher's own
   :class:`~dwise_predict.serving.launcher.SchedulerEntry` (bundle, tokenizer, admission features
   from token ids, as in production), or :class:`PassThroughHook`, whose methods call SGLang's
   originals straight (SGLang's own scheduling), patched with the same ``install.PATCHES`` table
   and the same descriptor;
3. wraps the patched entry points in the timer, and for the DWISE hook its per-step
   ``counted_forward``/``counted_step``, the early signals (``row_signals``), the bundle's
   ``refine`` and ``RequestTable.register`` (the arrivals: features, admission estimate, policy);
4. runs SGLang's ``run_scheduler_process``.

The timer (:class:`StepClock`) keeps each timed frame's *exclusive* wall time (``perf_counter``:
its own time less that of the timed frames it called), summed per label between the ends of two
consecutive ``process_batch_result_dllm`` calls: one scheduler step. The hook's own time in a step
is the sum over the hook's labels (:data:`HOOK_LABELS`); SGLang's own work it calls is not in it.
Nothing here is in the package's hot path: the timing is wrapped around it from outside.

The steps are written as JSON to ``--out`` when the scheduler process gets SIGUSR1 (the benchmark
sends it before stopping the server): SGLang's shutdown ends its schedulers with SIGKILL, so an
``atexit`` or SIGTERM writer would never run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
from operator import methodcaller
from pathlib import Path
from types import MethodType

from dwise_predict.serving import launcher
from dwise_predict.serving.sglang import hook as hook_module
from dwise_predict.serving.sglang.install import PATCHES, Installed, _Patched
from dwise_predict.serving.sglang.requests import RequestTable
from dwise_predict.serving.sglang.surface import ResolvedSglang

MODES = ("dwise", "pass-through")
_SCHED = "sglang.srt.dllm.mixin.scheduler"
# SGLang's own functions the hook (or SGLang's original at a patch point) calls: their time is SGLang's
SGLANG_CALLS = (
    (_SCHED, "SchedulerDllmMixin", "_fetch_waiting_reqs"),
    (_SCHED, "SchedulerDllmMixin", "_process_dllm_batches"),
    (_SCHED, "SchedulerDllmMixin", "process_batch_result_dllm"),
    (_SCHED, "SchedulerDllmMixin", "_process_batch_by_phase"),
    (_SCHED, "DllmManager", "add_waiting_reqs"),
    ("sglang.srt.dllm.algorithm.base", "DllmAlgorithm", "run"),
    ("sglang.srt.layers.logits_processor", "LogitsProcessor", "_get_dllm_logits"),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward"),
)
# the labels whose exclusive time is the hook's own: its entry points (by the hook's method
# names), the per-step forward and step it swaps in, and the parts timed apart
HOOK_LABELS = tuple(method for _, _, method in PATCHES) + ("counted_forward", "counted_step", "row_signals",
                                                          "refine", "register")
# the hook's parts that are tensor work (kernels launched, not run, on the scheduler thread of a GPU
# server): the early signals' softmax over the vocabulary, the refinement graph, the pooling product
TENSOR_LABELS = ("row_signals", "refine", "get_dllm_logits")
_finished = methodcaller("finished")


class StepClock:
    """Exclusive wall time per label, summed per scheduler step, and the steps so far.

    ``hook``: the DWISE hook (:class:`~dwise_predict.serving.sglang.hook.DwiseHook`: the first
    denoising rounds of a step are its step's ``first``), or None for the pass-through."""

    def __init__(self, out: Path | None = None):
        self.out = out
        self.restore: list = []  # (owner, name, what was there) of every wrap, in order
        self.stack: list[float] = []  # per open timed frame: the time of the timed frames it called
        self.spent: dict[str, float] = {}  # label -> exclusive seconds since the last step ended
        self.arrivals = 0  # requests registered since the last step ended
        self.hook = None
        self.steps: list[dict] = []

    def wrap(self, owner, name: str, label: str, timer=None) -> None:
        """Put ``owner.name`` (a class's method, an instance's or a module's attribute) under the clock."""
        real = getattr(owner, name)
        self.restore.append((owner, name, real))
        setattr(owner, name, (timer or Timed)(real, label, self))

    def undo(self, since: int = 0) -> None:
        """The wraps taken back, last first, down to the ``since``-th (``len(restore)`` when wrapping
        began): a hook's wraps must go before the hook uninstalls, or they put its methods back."""
        for owner, name, real in reversed(self.restore[since:]):
            setattr(owner, name, real)
        del self.restore[since:]

    def leave(self, label: str, elapsed: float) -> None:
        inner = self.stack.pop()
        self.spent[label] = self.spent.get(label, 0.0) + elapsed - inner
        if self.stack:
            self.stack[-1] += elapsed

    def first_rounds(self) -> int:
        """Requests of the step being processed in their first denoising round (0: pass-through)."""
        return len(self.hook.step.first) if self.hook is not None else 0

    def end_step(self, batch, first_rounds: int) -> None:
        """One step ended (``process_batch_result_dllm`` returned for ``batch``)."""
        self.steps.append({"t": time.monotonic(), "rows": len(batch.reqs),
                           "finished": sum(map(_finished, batch.reqs)), "arrivals": self.arrivals,
                           "first_rounds": first_rounds, "spent": self.spent})
        self.spent, self.arrivals = {}, 0

    def dump(self, signum=None, frame=None) -> None:
        """Write the steps to ``out`` (atomically: the benchmark waits for the file); a signal handler."""
        partial = self.out.with_suffix(".partial")
        partial.write_text(json.dumps({"pid": os.getpid(), "steps": self.steps}))
        partial.rename(self.out)


def step_figures(steps: list[dict], at) -> dict:
    """The figures of the steps ``steps[i]`` for ``i`` in ``at`` (each > 0: a step's period runs from
    the end of the one before): the loop period (ms) and the hook's own time (µs, also less its
    tensor work), their p50, p99 and mean; per step, rows, arrivals, first rounds and finishes;
    ``RequestTable.register``'s µs per arrival; and each label's mean µs per step (``parts``)."""
    import numpy as np

    at = np.asarray(at, dtype=np.int64)
    t = np.array([step["t"] for step in steps])
    chosen = [steps[i] for i in at]
    spent = [step["spent"] for step in chosen]
    hook = np.array([sum(s.get(label, 0.0) for label in HOOK_LABELS) for s in spent]) * 1e6
    host = hook - np.array([sum(s.get(label, 0.0) for label in TENSOR_LABELS) for s in spent]) * 1e6
    period = (t[at] - t[at - 1]) * 1e3
    arrivals = sum(step["arrivals"] for step in chosen)
    parts: dict = {}
    for s in spent:
        for label, seconds in s.items():
            parts[label] = parts.get(label, 0.0) + seconds * 1e6 / len(chosen)
    mean = {key: float(np.mean([step[key] for step in chosen])) for key in ("rows", "arrivals", "first_rounds", "finished")}
    return {"steps": len(chosen), **mean, "period_p50": np.percentile(period, 50),
            "period_p99": np.percentile(period, 99), "period_mean": period.mean(),
            "hook_p50": np.percentile(hook, 50), "hook_p99": np.percentile(hook, 99),
            "host_p50": np.percentile(host, 50), "host_p99": np.percentile(host, 99),
            "per_arrival": parts.get("register", 0.0) * len(chosen) / arrivals if arrivals else float("nan"),
            "parts": parts}


class Timed:
    """A function with its exclusive wall time kept by a :class:`StepClock` under ``label``. Set on a
    class it binds like a method (SGLang's ``self`` first); set on an instance or a module it is
    called as it is."""

    __slots__ = ("function", "label", "clock")

    def __init__(self, function, label: str, clock: StepClock):
        self.function, self.label, self.clock = function, label, clock

    def __get__(self, obj, owner=None):
        return self if obj is None else MethodType(self, obj)

    def __call__(self, *args, **kwargs):
        self.clock.stack.append(0.0)
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.clock.leave(self.label, time.perf_counter() - start)


class TimedStepEnd(Timed):
    """``process_batch_result_dllm`` timed, and the step it ends recorded (``(scheduler, batch, result)``)."""

    __slots__ = ()

    def __call__(self, scheduler, batch, result):
        first_rounds = self.clock.first_rounds()  # the hook starts a fresh step at the end of this call
        try:
            return Timed.__call__(self, scheduler, batch, result)
        finally:
            self.clock.end_step(batch, first_rounds)


class TimedArrivals(Timed):
    """``RequestTable.register`` timed, and the requests it registers counted (``(table, scheduler, reqs,
    version)``)."""

    __slots__ = ()

    def __call__(self, table, scheduler, reqs, *version):
        self.clock.arrivals += len(reqs)
        return Timed.__call__(self, table, scheduler, reqs, *version)


class PassThroughHook:
    """A hook that does nothing at the DWISE hook's patch points (``install.PATCHES``): each method calls SGLang's
    original (``originals``: the hook's method name -> SGLang's function), so the server runs
    SGLang's own scheduling through the same patched descriptors, and what the timer reads as
    "hook" for it is the patching's and the timer's own cost (the floor of every hook figure)."""

    def __init__(self, originals: dict):
        self.originals = originals

    def fetch_waiting_reqs(self, scheduler):
        return self.originals["fetch_waiting_reqs"](scheduler)

    def process_dllm_batches(self, scheduler, adder, running_batch):
        return self.originals["process_dllm_batches"](scheduler, adder, running_batch)

    def process_batch_result_dllm(self, scheduler, batch, result):
        return self.originals["process_batch_result_dllm"](scheduler, batch, result)

    def run(self, algorithm, model_runner, forward_batch, algo_states=None):
        return self.originals["run"](algorithm, model_runner, forward_batch, algo_states)

    def get_dllm_logits(self, processor, hidden_states, lm_head, logits_metadata):
        return self.originals["get_dllm_logits"](processor, hidden_states, lm_head, logits_metadata)

    def abort_request(self, scheduler, recv_req):
        return self.originals["abort_request"](scheduler, recv_req)

    def stop(self) -> None:
        """No thread runs beside it (``Installed.uninstall`` calls this)."""


def install_pass_through(resolve=importlib.import_module) -> Installed:
    """Patch SGLang with a :class:`PassThroughHook` where ``install`` patches the DWISE hook."""
    sglang = ResolvedSglang(resolve)
    hook, originals = PassThroughHook({}), []
    for owner_name, name, method in PATCHES:
        owner = getattr(sglang, owner_name)
        original = getattr(owner, name)
        originals.append((owner, name, original))
        hook.originals[method] = original
        setattr(owner, name, _Patched(getattr(hook, method)))
    return Installed(hook, originals)


def time_sglang(clock: StepClock, resolve=importlib.import_module, also=()) -> None:
    """Wrap SGLang's own functions that the hook calls (:data:`SGLANG_CALLS`, resolved through
    ``resolve``: tests and the GPU script pass a fake SGLang) and ``also`` (``(class, name)`` pairs:
    each algorithm's ``step``, a model runner's own ``forward``), before the hook resolves them."""
    for module, owner, name in SGLANG_CALLS:
        clock.wrap(getattr(resolve(module), owner), name, f"sglang.{owner}.{name}")
    for cls, name in also:
        clock.wrap(cls, name, f"sglang.{cls.__name__}.{name}")


def algorithm_steps() -> list:
    """``(class, "step")`` of every dLLM algorithm SGLang registers that defines its own ``step``
    (an inherited one is timed where it is defined)."""
    algorithms = importlib.import_module("sglang.srt.dllm.algorithm").algo_name_to_cls
    return [(cls, "step") for cls in set(algorithms.values()) if "step" in vars(cls)]


def time_hook(clock: StepClock, installed: Installed) -> None:
    """Wrap the patched entry points (the hook's, or the pass-through's) and, for the DWISE
    hook, the parts it runs per step outside them and the parts timed apart."""
    for (owner, name, _), (_, _, method) in zip(installed.originals, PATCHES):
        clock.wrap(owner, name, method, TimedStepEnd if method == "process_batch_result_dllm" else None)
    state = installed.state
    if isinstance(state, PassThroughHook):
        return
    clock.hook = state
    # the hook reads these two from itself on every run (hook.DwiseHook.run): instance attributes win
    clock.wrap(state, "counted_forward", "counted_forward")
    clock.wrap(state, "counted_step", "counted_step")
    clock.wrap(hook_module, "row_signals", "row_signals")
    if state.bundle is not None:
        clock.wrap(state.bundle, "refine", "refine")
    clock.wrap(RequestTable, "register", "register", TimedArrivals)


class TimedSchedulerEntry:
    """SGLang's scheduler target with the hook (``mode`` "dwise": the launcher's ``SchedulerEntry``
    with ``config``) or the pass-through installed, timed (module docstring); the steps go to
    ``out`` on SIGUSR1. Picklable: SGLang hands it to ``spawn``."""

    def __init__(self, mode: str, config: launcher.HookConfig | None, out: str):
        self.mode, self.config, self.out = mode, config, out

    def __call__(self, *args, **kwargs):
        clock = StepClock(Path(self.out))
        time_sglang(clock, also=algorithm_steps())
        target = _TimedTarget(clock)
        if self.mode == "dwise":
            return launcher.SchedulerEntry(self.config, target)(*args, **kwargs)
        target.installed = install_pass_through()
        return target(*args, **kwargs)


class _TimedTarget:
    """What runs after the hook is installed: wrap its entry points, arm SIGUSR1, run SGLang's scheduler."""

    def __init__(self, clock: StepClock):
        self.clock, self.installed = clock, None

    def __call__(self, *args, **kwargs):
        time_hook(self.clock, self.installed or launcher.ACTIVE)
        signal.signal(signal.SIGUSR1, self.clock.dump)
        return importlib.import_module("sglang.srt.managers.scheduler").run_scheduler_process(*args, **kwargs)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="SGLang's server with the DWISE or a pass-through hook, timed")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--out", required=True, help="JSON of the scheduler's steps, written on SIGUSR1")
    parser.add_argument("--bundle")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--k", type=float, default=2)
    ours, sglang_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(ours)
    http = importlib.import_module("sglang.srt.entrypoints.http_server")
    utils = importlib.import_module("sglang.srt.utils")
    server_args, view = launcher.server_arguments(sglang_argv, "benchmarks/hook_timing.py")
    config = None
    if args.mode == "dwise":
        config = launcher.resolved(launcher.HookConfig(bundle=args.bundle, slots=args.slots, k=args.k), view)
    try:
        http.launch_server(server_args, run_scheduler_process_func=TimedSchedulerEntry(args.mode, config, args.out))
    finally:
        utils.kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    # imported by name, not run as __main__: the entry must pickle as hook_timing.TimedSchedulerEntry for
    # SGLang's spawned scheduler (which gets this directory on its sys.path from multiprocessing's spawn)
    import hook_timing

    hook_timing.main(sys.argv[1:])
