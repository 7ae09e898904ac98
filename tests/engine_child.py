"""An offline program that records under ``sglang.Engine`` through the DWISE plugin, for
``tests/test_serving_lifecycle.py``: ``DWISE_RECORD=OUT DWISE_... python engine_child.py``.

From the 0.5.23 wheel, as written: the plugin loader (``srt/plugins``, over this package's installed
entry point), ``Engine.shutdown`` and ``utils.kill_process_tree`` (compiled from their source by
``sglang_reference``). Stand-ins: the launch side of ``fakes/sglang_launch.py`` (``ServerArgs``, the
``Engine`` class the plugin's hooks are applied to), an ``Engine._launch_subprocesses`` that starts
one scheduler process as SGLang's ``_launch_scheduler_processes`` does (``spawn``, SGLang's scheduler
arguments and a pipe), and that scheduler (``recording_child.scheduler_main``: the CPU fake serving
12 requests through the hook the plugin's ``SchedulerEntry`` installed). Once the scheduler says it
is idle the program calls ``Engine.shutdown()`` and prints ``shut down``; the scheduler prints
``finished <rid>`` for each request it finished.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Optional

SCHEDULERS: list = []  # the pipe each started scheduler reports on


def sglang_shutdown():
    """SGLang 0.5.23's ``Engine.shutdown``, calling its own ``kill_process_tree`` (SIGKILL of every
    child process), compiled from the wheel."""
    import psutil

    import sglang_reference

    src = sglang_reference.source_root() / "sglang" / "srt"
    logger = logging.getLogger("sglang")
    kill = sglang_reference.compile_functions(
        src / "utils" / "common.py", ("kill_process_tree", "_wait_for_reap_or_raise", "_still_holding_resources"),
        {"psutil": psutil, "os": os, "sys": sys, "signal": signal, "time": time, "logger": logger,
         "Optional": Optional})["kill_process_tree"]
    methods = sglang_reference.compile_members(
        src / "entrypoints" / "engine.py", "Engine", ("shutdown",),
        namespace={"kill_process_tree": kill, "os": os, "logger": logger,
                   "TokenizerManager": type("TokenizerManager", (), {})})  # no tokenizer manager here
    return methods["EngineMethods"].shutdown


def launch_one_scheduler(cls, server_args, init_tokenizer_manager_func, run_scheduler_process_func,
                         run_detokenizer_process_func, port_args=None, placement_group=None):
    """``Engine._launch_subprocesses`` reduced to one scheduler process, started as SGLang starts them."""
    server_args.resolve_once()
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    mp.get_context("spawn").Process(target=run_scheduler_process_func,
                                    args=(server_args, None, 0, 0, 0, None, writer)).start()
    writer.close()
    SCHEDULERS.append(reader)
    return None, None, port_args, None, None, []


def main() -> None:
    from fakes import sglang_launch
    from recording_child import scheduler_main

    sglang_launch.install_entrypoints()
    engine = sglang_launch.Engine  # what sglang.srt.entrypoints.engine.Engine is here: the plugin hooks it
    engine._attached, engine.tokenizer_manager = False, None  # what Engine.__init__ sets before launching
    engine.shutdown = sglang_shutdown()
    engine._launch_subprocesses = classmethod(launch_one_scheduler)
    engine.run_scheduler_process_func = staticmethod(scheduler_main)
    llm = engine(dllm_algorithm="LowConfidence", max_running_requests=8)
    if not SCHEDULERS[0].poll(240):
        raise RuntimeError("the scheduler never became idle")
    assert SCHEDULERS[0].recv() == "idle"
    llm.shutdown()
    print("shut down", flush=True)


if __name__ == "__main__":
    main()
