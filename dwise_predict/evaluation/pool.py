"""Retraining both predictors on a subset of the training split, in parallel where cores allow.

Leave-one-category-out, the prompt-hidden-state baseline and every ablation row need the full
training recipe run again on different inputs. Each such run is a :class:`RetrainTask`; :func:`run_tasks` runs them in a
process pool and returns only the evaluation-split predictions, which is all the tables need. Every
task trains with its config's ``num_threads`` torch threads (as ``train`` does), so results do not
depend on ``jobs``. Tasks in a pool cross-validate in one thread each (the pool already fills the
cores); a task run here uses ``train``'s default (:func:`~dwise_predict.training.fit_predictors`).

Workers are started with ``spawn``: a forked child of a process whose OpenMP pool is already running
(LightGBM, torch) can hang, and spawn behaves the same on every platform. As with any spawn pool, a
Python script that calls this with ``jobs > 1`` needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

from dwise_predict.traces import TraceDataset
from dwise_predict.training.config import default_jobs


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


def run_tasks(
    tasks: Sequence[RetrainTask],
    jobs: int | None = None,
    on_done: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every task and return ``{task.name: fit_predict(task)}``.

    Parameters
    ----------
    jobs : worker processes; None picks :func:`default_jobs`; 1 runs in this process (no pool).
        Each task uses its config's ``num_threads``, whatever ``jobs`` is, so results do not depend on it.
    on_done : called with a task's name when it finishes (progress reporting).
    """
    requested = jobs
    if jobs is None:
        jobs = default_jobs(len(tasks), max((t.config.num_threads for t in tasks), default=1))
    jobs = max(1, int(jobs))
    results: dict[str, dict[str, Any]] = {}
    if jobs == 1 or len(tasks) <= 1:
        cv_jobs = None if requested is None else jobs  # --jobs 1 means one core
        for task in tasks:
            results[task.name] = fit_predict(task, cv_jobs)
            if on_done:
                on_done(task.name)
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context) as pool:
        futures = {pool.submit(fit_predict, task, 1): task.name for task in tasks}
        for future in as_completed(futures):
            name = futures[future]
            results[name] = future.result()
            if on_done:
                on_done(name)
    return {task.name: results[task.name] for task in tasks}
