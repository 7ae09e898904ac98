"""Retraining both predictors on a subset of the training split, in parallel where cores allow.

Leave-one-category-out, the prompt-hidden-state baseline and every ablation row need the full
training recipe run again on different inputs. Each such run is a :class:`RetrainTask`; :func:`run_tasks` runs them in a
process pool and returns only the evaluation-split predictions, which is all the tables need. Every
task trains with its config's ``num_threads`` torch threads (as ``train`` does), so results do not
depend on ``jobs``. Tasks in a pool cross-validate in one thread each (the pool already fills the
cores); a task run here uses ``train``'s default (:func:`~dwise_predict.training.fit_predictors`).

A retraining's predictions depend only on its two datasets, its config and the code, so with
``kept`` set each one is kept as it finishes, under a key of those (:func:`result_key`), in a folder
beside the command's output (:func:`kept_results_dir`): an interrupted ``evaluate`` (LOCO, the
baselines, ablations; ``--across`` too) rerun with the same inputs skips the retrainings already done.
The command's own fit of both predictors is kept there too, as a run directory (:func:`fit_kept`).
The folder goes once the output is written. Stored as safetensors with the candidate's name in its
metadata: nothing is unpickled.

Workers are forked from multiprocessing's ``forkserver``: a fresh interpreter that imports the
retraining code once (:data:`WORKER_PRELOAD`) and runs nothing, so its children start in a few
milliseconds with everything imported. Forking the evaluating process itself could hang (a child of
a process whose OpenMP pool is already running, LightGBM's or torch's, can deadlock), and ``spawn``
made every worker import torch, LightGBM and scikit-learn again: about 3.5 s of CPU per worker and
per call, more than a retraining on a few hundred requests takes. The server lives as long as the
process, so later calls (LOCO, then the baselines, then each ablation) reuse it. Where there is no
forkserver (Windows), ``spawn``. Either way a Python script that calls this with ``jobs > 1`` needs
the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dwise_predict.errors import InputError, WorkerError
from dwise_predict.files import atomic_dir, atomic_write
from dwise_predict.traces import TraceDataset
from dwise_predict.traces.dataset import REQUEST_COLUMNS
from dwise_predict.training.config import default_jobs
from dwise_predict.versions import source_fingerprint

PREDICTIONS = ("admission", "refined", "refined_raw")  # the arrays of a task's result
# what the forkserver imports before it forks workers: the retraining code, LightGBM (imported on its
# first fit) and what torch imports on a model's first use (its graph tracer and symbolic shapes,
# about 1.3 s); a name a later torch no longer has is skipped by multiprocessing
WORKER_PRELOAD = ("dwise_predict.evaluation.pool", "dwise_predict.training.fit", "dwise_predict.training.select",
                  "lightgbm", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")


@dataclass
class RetrainTask:
    """Fit both predictors on ``train`` with ``config`` and predict ``eval``.

    ``name`` identifies the task in results (a held-out category, or a baseline's name).
    """

    name: str
    train: TraceDataset
    eval: TraceDataset
    config: Any


def fit(train: TraceDataset, config, jobs: int | None = None):
    """``fit_predictors(train, config, jobs=jobs)`` with torch on ``config.num_threads`` threads, as
    ``train`` runs it, so a retraining gives the same predictors whichever process or pool runs it."""
    from dwise_predict.training import fit_predictors, torch_threads

    with torch_threads(config.num_threads):
        return fit_predictors(train, config, jobs=jobs)


def fit_kept(train: TraceDataset, config, kept: str | os.PathLike | None = None,
             log: Callable[[str], None] | None = None):
    """``fit(train, config)``, kept in ``kept`` as a run directory (the format ``train`` writes and
    ``evaluate --run`` reads, :mod:`dwise_predict.runs`) under a key of ``train``, ``config`` and the
    code, so a command interrupted after its main fit reloads it on the rerun instead of fitting
    again. A kept run that cannot be read is fitted again; ``kept`` None keeps nothing."""
    from dwise_predict.training import load_predictors, write_run

    if kept is None:
        return fit(train, config)
    path = Path(kept) / f"{result_key([train], config, fitted='predictors')}.run"
    if path.is_dir():
        try:
            predictors = load_predictors(path)
        except InputError:
            pass
        else:
            if log:
                log(f"  fitted already (same requests, config and code: an earlier study or run): loaded from {kept}")
            return predictors
    predictors = fit(train, config)
    with atomic_dir(path) as tmp:
        write_run(tmp, train, predictors, {"n_train": predictors.n_train}, config)
    return predictors


def fit_predict(task: RetrainTask, jobs: int | None = None) -> dict[str, Any]:
    """Run one task: ``{"admission": total rounds, "refined": calibrated remaining, "refined_raw": ...}``,
    each an array of shape (n_eval,), and ``"candidate"``, the refinement candidate fitted (the CV's
    choice when the config says ``auto``)."""
    predictors = fit(task.train, task.config, jobs)
    return {
        "admission": np.asarray(predictors.admission_total(task.eval), dtype=float),
        "refined": np.asarray(predictors.refined_remaining(task.eval), dtype=float),
        "refined_raw": np.asarray(predictors.refined_raw(task.eval), dtype=float),
        "candidate": predictors.ensemble.candidate,
    }


def kept_results_dir(out: str | os.PathLike) -> Path:
    """Where a command writing ``out`` keeps finished retrainings until ``out`` is written:
    ``.NAME.kept`` beside it (hidden, like its lock), so ``out`` itself only ever holds a whole result."""
    out = Path(out)
    return out.with_name(f".{out.name}.kept")


def result_key(datasets: Sequence[TraceDataset], config, **options) -> str:
    """The name under which a result computed from ``datasets`` with ``config`` and ``options`` is
    kept: a digest of the data (:meth:`TraceDataset.data_hash`, plus the optional request columns
    such as ``censored``), the config, the options and the code."""
    digest = hashlib.sha256()
    for ds in datasets:
        digest.update(ds.data_hash().encode())
        optional = sorted(c for c in ds.requests.columns if c not in REQUEST_COLUMNS)
        digest.update(json.dumps(optional).encode())
        digest.update(pd.util.hash_pandas_object(ds.requests[optional].astype(str), index=False).to_numpy().tobytes())
    what = {"config": config.to_dict(), "options": options, "source": source_fingerprint()}
    digest.update(json.dumps(what, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def _keep(path: Path, result: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(result[name], dtype=np.float64) for name in PREDICTIONS}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"candidate": str(result["candidate"])}))


def _kept(path: Path) -> dict[str, Any] | None:
    """A kept result, or None when there is none (or it cannot be read: then the task runs again)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            result: dict[str, Any] = {name: f.get_tensor(name) for name in PREDICTIONS}
            result["candidate"] = (f.metadata() or {})["candidate"]
    except (OSError, KeyError, SafetensorError):
        return None
    return result


def run_tasks(
    tasks: Sequence[RetrainTask],
    jobs: int | None = None,
    on_done: Callable[[str], None] | None = None,
    kept: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every task and return ``{task.name: fit_predict(task)}``.

    Parameters
    ----------
    jobs : worker processes; None picks :func:`default_jobs`; 1 runs in this process (no pool).
        Each task uses its config's ``num_threads``, whatever ``jobs`` is, so results do not depend on it.
    on_done : called with a task's name when it finishes (progress reporting).
    kept : a folder where each finished task's result is kept, and found again by a later call
        (:func:`result_key`); None keeps nothing.
    log : told how many tasks were found kept.
    """
    paths = {} if kept is None else {
        task.name: Path(kept) / f"{result_key((task.train, task.eval), task.config)}.safetensors" for task in tasks}
    results: dict[str, dict[str, Any]] = {}
    for name, path in paths.items():
        if (found := _kept(path)) is not None:
            results[name] = found
    todo = [task for task in tasks if task.name not in results]
    if results and log:  # kept by an earlier step of this command (ablations share rows) or an interrupted run
        log(f"  {len(results)} of {len(tasks)} retrainings already done on the same data and config: reused from {kept}")

    def finished(name: str, result: dict[str, Any]) -> None:
        results[name] = result
        if name in paths:
            _keep(paths[name], result)
        if on_done:
            on_done(name)

    requested = jobs
    if jobs is None:
        jobs = default_jobs(len(todo), max((t.config.num_threads for t in todo), default=1))
    jobs = max(1, int(jobs))
    if jobs == 1 or len(todo) <= 1:
        cv_jobs = None if requested is None else jobs  # --jobs 1 means one core
        for task in todo:
            finished(task.name, fit_predict(task, cv_jobs))
    else:
        context = _worker_context()
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context,
                                 initializer=_exit_with_parent) as pool:
            futures = {pool.submit(fit_predict, task, 1): task.name for task in todo}
            try:
                for future in as_completed(futures):
                    finished(futures[future], future.result())
            except BrokenProcessPool:  # the OOM killer, or a user's kill, took a worker: every pending task fails
                kept_note = f"; the {len(results)} finished are kept" if kept is not None and results else ""
                raise WorkerError(f"a retraining worker process died (killed, or out of memory) after {len(results)} "
                                  f"of {len(tasks)} retrainings: rerun the same command, with fewer `jobs` if memory "
                                  f"is short{kept_note}") from None
    return {task.name: results[task.name] for task in tasks}


def _worker_context() -> multiprocessing.context.BaseContext:
    """The forkserver, with :data:`WORKER_PRELOAD` (see the module's docstring); spawn without one."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))  # read when the server starts: once per process
    return context


def _exit_with_parent() -> None:
    """In a pool worker: exit as soon as the evaluating process is gone. A worker holds both ends of
    the pool's task queue, so one whose parent was killed (SIGKILL, the OOM killer) would otherwise
    wait for work forever, an orphan holding a core's memory and the terminal's pipes."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
