"""`simulate --budget-sweep` and `simulate --drop-category`: both predictors retrained, then replayed.

**The DWISE paper's Table 14 (budgets).** For each output budget the paper retrains both predictors
with the unchanged pipeline on traces collected at that budget, then replays SGLang's default and
DWISE. :func:`plan_retrain` and :func:`run_retrain_studies` do the same for trace sets of one model,
one decoding and the same prompts that differ only in the output budget: each set's train split
retrains both predictors with one recipe, its eval split is replayed under ``sglang-default`` and
``dwise-refined``; a row per budget and arrival pattern holds the paper's columns (mean output
tokens, mean rounds, both mean latencies, the speed-up and the p99 speed-up, refined ρ) and the share
of requests the budget cut (the paper's 57 % at 256 tokens): a budget no request reaches replays the
same requests. The Poisson rate is resolved once, on the first set, and held in req/s for every
budget ("all other settings match"): a rate given as a multiple (``1.5x``) is of SGLang's service
rate on the first set.

**Held-out category, scheduling (the DWISE paper's Table 7, "Generalization to unseen
categories").** The paper retrains without MCQ and replays: DWISE's mean latency rises 47.3 → 50.9 s.
Here both sides are retrained with the same recipe, on the whole train split ("seen") and on the
train split without the category ("held out", :func:`dwise_predict.evaluation.loco.plan`), so only the
category differs (a bundle's own graphs would differ by the export too). Rows: DWISE's mean latency
over all requests and on the category's, SGLang's, the speed-up, admission and refined ρ on the
category (:func:`dwise_predict.evaluation.loco.table`) and over all requests.

The retrainings run in :func:`dwise_predict.evaluation.pool.run_tasks` (a process pool; every
result depends only on its data, the recipe and the code, so a fixed recipe seed gives the same
numbers), kept as they finish in :attr:`Retraining.kept` when given: an interrupted run resumes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dwise_predict.errors import InputError
from dwise_predict.evaluation import loco
from dwise_predict.evaluation.decodings import first_difference
from dwise_predict.evaluation.inputs import model_identity, model_label
from dwise_predict.evaluation.pool import RetrainTask, run_tasks
from dwise_predict.metrics import spearman
from dwise_predict.names import DECODING_KEYS
from dwise_predict.simulation.simulator import SimConfig, compare_arrivals, parse_rates, sim_requests_from_traces

ALL_CATEGORIES = "all"  # every category in turn
POLICIES = ("sglang-default", "dwise-refined")  # what both studies replay, as the paper's tables compare
# what must match between the sets of a budget sweep: every decoding field but the budget
SWEEP_KEYS = tuple(k for k in DECODING_KEYS if k != "budget")
SEEN = "the train split, every category"  # the retraining on the whole train split (the first budget set's)
SEEN_LABEL, HELD_LABEL = "seen", "held out"


@dataclass(frozen=True)
class Retraining:
    """How the studies retrain: ``config`` (a :class:`~dwise_predict.training.TrainConfig`, the recipe),
    ``source`` (where it came from, for the report), ``kept`` (a folder keeping finished retrainings
    for a resume; None keeps nothing) and ``jobs`` (worker processes; None: as the cores allow)."""

    config: Any
    source: str
    kept: Path | None = None
    jobs: int | None = None

    def forget_kept(self) -> None:
        """Remove the kept retrainings, once the output they were kept for is written."""
        if self.kept is not None:
            shutil.rmtree(self.kept, ignore_errors=True)


@dataclass(frozen=True)
class StudyReplay:
    """How each retrained set is replayed: the server settings, the arrival patterns, the Poisson
    rate (req/s or a multiple like ``1.5x``; None: ``1.5x``), the requests drawn (0: the eval split as
    it is) and the arrival seeds, as ``simulate`` replays."""

    config: SimConfig
    patterns: list[str]
    rate: str | None = None
    requests: int = 4096
    arrival_seeds: int = 1


@dataclass(frozen=True)
class RetrainStudies:
    """What to run and how: the retraining, the other budgets' trace directories (the sweep's first
    set is the replayed traces) and the categories to hold out (``["all"]``: each in turn; fewer than
    ``min_requests`` train or eval requests: skipped); an empty one is not run."""

    retraining: Retraining
    budget_sweep: tuple[Path, ...] = ()
    drop_category: tuple[str, ...] = ()
    min_requests: int = loco.MIN_REQUESTS


@dataclass
class RetrainPlan:
    """The studies checked and planned, nothing trained yet: the replayed traces ``ds``, the budget
    sets (``ds`` first; empty without a sweep), every retraining and the held-out categories skipped."""

    ds: Any
    studies: RetrainStudies
    sets: list
    tasks: list[RetrainTask]
    drops: list[RetrainTask]
    skipped: list[dict]


def plan_retrain(ds, studies: RetrainStudies, log: Callable[[str], None] | None = None) -> RetrainPlan:
    """Check every input of the studies on the traces ``ds`` (refused before anything is trained or
    replayed) and plan the retrainings: the whole train split of ``ds`` (the sweep's first budget and
    the held-out study's "seen" side), each other budget's train split, each held-out category."""
    from dwise_predict.traces import load_traces

    config = studies.retraining.config
    _check_splits(ds)
    sets = [ds, *(load_traces(p) for p in studies.budget_sweep)] if studies.budget_sweep else []
    check_budget_sweep(sets, log or (lambda message: None))
    drops, skipped = plan_drops(ds, studies, config)
    tasks = [RetrainTask(SEEN, ds.split("train"), ds.split("eval"), config)]
    tasks += [RetrainTask(_set_name(i), s.split("train"), s.split("eval"), config) for i, s in
              enumerate(sets[1:], start=1)]
    return RetrainPlan(ds, studies, sets, tasks + drops, drops, skipped)


def run_retrain_studies(plan: RetrainPlan, replay: StudyReplay, log: Callable[[str], None] | None = None) -> dict:
    """Every retraining of ``plan`` in one pool, then the replays. Returns ``{"budget_sweep": ...,
    "drop_category": ...}`` (those asked for)."""
    log = log or (lambda message: None)
    retraining, ds = plan.studies.retraining, plan.ds
    log(f"retraining both predictors {len(plan.tasks)} times with {retraining.source}: "
        + ", ".join(t.name for t in plan.tasks))
    done = run_tasks(plan.tasks, retraining.jobs, on_done=lambda name: log(f"  retrained: {name}"),
                     kept=retraining.kept, log=log)
    done = {name: _predictions(result) for name, result in done.items()}
    rate = _poisson_rate(ds, done[SEEN], replay)
    tables = {}
    if plan.sets:
        log(f"replaying {len(plan.sets)} budgets (the DWISE paper's Table 14)")
        predictions = [done[SEEN], *(done[_set_name(i)] for i in range(1, len(plan.sets)))]
        tables["budget_sweep"] = budget_table(plan.sets, predictions, replay, rate, retraining.source)
    if plan.studies.drop_category:
        log(f"replaying {len(plan.drops)} held-out categories (the DWISE paper's Table 7, scheduling)")
        held = {task.name.removeprefix("without "): done[task.name] for task in plan.drops}
        tables["drop_category"] = drop_table(ds, done[SEEN], held, plan.skipped, replay, rate, retraining.source)
    return tables


def _set_name(i: int) -> str:
    return f"budget set {i}"


def _predictions(result: dict) -> dict[str, np.ndarray]:
    """A retraining's eval-split estimates as the replay reads them (clamped at zero, as a bundle's are)."""
    return {key: np.maximum(np.asarray(result[key], dtype=np.float64), 0.0) for key in ("admission", "refined")}


def _check_splits(ds) -> None:
    split = ds.requests["split"].to_numpy()
    missing = [name for name in ("train", "eval") if not (split == name).any()]
    if missing:
        raise InputError(f"traces {ds.path} hold no {' and no '.join(missing)} split: retraining needs a train "
                         "split to fit on and an eval split to replay")


def check_budget_sweep(sets: Sequence, log: Callable[[str], None]) -> None:
    """Refuse sets of a budget sweep that are not one model, one decoding but the budget, one budget
    each and a different one per set, with a train and an eval split; say where their prompts differ."""
    budgets = []
    for ds in sets:
        _check_splits(ds)
        if model_identity(ds) != model_identity(sets[0]):
            raise InputError(f"traces {sets[0].path} and {ds.path} come from different models ({model_label(sets[0])} "
                             f"vs {model_label(ds)}): a budget sweep compares one model's traces")
        differ = first_difference(sets[0], ds, SWEEP_KEYS)
        if differ is not None:
            raise InputError(f"traces {sets[0].path} and {ds.path} differ in decoding ({differ}): a budget sweep varies "
                             "the output budget alone")
        held = sorted(set(ds.requests["budget"].astype(int).tolist()))
        if len(held) != 1:
            raise InputError(f"traces {ds.path} mix output budgets ({', '.join(map(str, held))}): a budget sweep "
                             "needs one budget per trace set")
        if held[0] in budgets:
            raise InputError(f"traces {sets[budgets.index(held[0])].path} and {ds.path} share the output budget "
                             f"{held[0]}: give one trace set per budget")
        budgets.append(held[0])
    for ds in sets[1:]:  # said once every set is accepted
        extra = set(ds.requests["prompt"]) - set(sets[0].requests["prompt"])
        if extra:
            log(f"note: {len(extra)} prompts of {ds.path} are not in {sets[0].path}: its row replays other requests")


def plan_drops(ds, studies: RetrainStudies, config) -> tuple[list[RetrainTask], list[dict]]:
    """The held-out retrainings (:func:`dwise_predict.evaluation.loco.plan`, each named ``without CAT``)
    and the categories skipped with the reason; a category asked for by name that cannot be held out
    is refused."""
    if not studies.drop_category:
        return [], []
    every = ALL_CATEGORIES in studies.drop_category
    train, eval_ds = ds.split("train"), ds.split("eval")
    names = None if every else list(dict.fromkeys(studies.drop_category))
    if names is not None:
        loco.check_categories(train, eval_ds, names, param="`drop_category`")
    tasks, skipped = loco.plan(train, eval_ds, config, names, studies.min_requests)
    if not every and skipped:
        raise InputError(f"cannot hold out {skipped[0]['category']!r}: {skipped[0]['reason']}")
    return [replace(task, name=f"without {task.name}") for task in tasks], skipped


def _poisson_rate(ds, seen: dict, replay: StudyReplay) -> str | None:
    """The Poisson rate of every replay, req/s as text (None: burst arrivals only), resolved on ``ds``'s
    eval split so that a multiple (``1.5x``) means the same load in every row."""
    if all(p == "burst" for p in replay.patterns):
        return None
    sim = _replayed_requests(ds, seen, replay)
    return repr(parse_rates(replay.rate or "1.5x", sim, replay.config, "`rate`")[0])


def _replayed_requests(ds, predictions: dict, replay: StudyReplay):
    """``ds``'s eval split with ``predictions`` as its estimates, drawn as ``simulate`` draws."""
    sim = sim_requests_from_traces(ds, "eval")
    sim.admission, sim.refined = predictions["admission"], predictions["refined"]
    return sim.draw(replay.requests, replay.config.seed) if replay.requests else sim


def _replay(ds, predictions: dict, replay: StudyReplay, rate: str | None, policies: Sequence[str],
            tails: list | None = None) -> dict[tuple[str, str], dict]:
    """The metric rows of ``policies`` on ``ds``'s eval split, by (arrival pattern, policy)."""
    sim = _replayed_requests(ds, predictions, replay)
    rows = compare_arrivals(sim, replay.config, replay.patterns, rate or "1.5x", list(policies),
                            replay.arrival_seeds, tails)
    return {(r["arrival"], r["policy"]): r for r in rows}


def _rhos(ds, predictions: dict, mask: np.ndarray | None = None) -> dict[str, float | None]:
    """Admission ρ (against total rounds) and refined ρ (against the rounds left after the first) on
    ``ds``'s eval split, or on its requests where ``mask`` holds."""
    total = ds.split("eval").requests["total_rounds"].to_numpy(dtype=np.float64)
    keep = np.ones(len(total), bool) if mask is None else mask
    return {"admission_rho": spearman(predictions["admission"][keep], total[keep]),
            "refined_rho": spearman(predictions["refined"][keep], total[keep] - 1.0)}


def budget_table(sets: Sequence, predictions: Sequence[dict], replay: StudyReplay, rate: str | None,
                 source: str) -> dict:
    """The DWISE paper's Table 14 on ``sets`` (one per budget), each replayed with its own retrained
    ``predictions``: ``{"rows", "recipe", "rate_rps", "policies"}``, rows by arrival pattern then budget."""
    rows = []
    for ds, preds in zip(sets, predictions):
        eval_req = ds.split("eval").requests
        measured = _replay(ds, preds, replay, rate, POLICIES)
        for pattern in replay.patterns:
            sglang, dwise = measured[(pattern, POLICIES[0])], measured[(pattern, POLICIES[1])]
            rows.append({"arrival": pattern, "budget": int(eval_req["budget"].iloc[0]), "traces": str(ds.path),
                         "requests_train": int((ds.requests["split"] == "train").sum()), "requests_eval": len(eval_req),
                         "mean_output_tokens": float(eval_req["output_tokens"].mean()),
                         "at_budget_pct": float(100.0 * (eval_req["finish"] == "budget").mean()),
                         "mean_rounds": float(eval_req["total_rounds"].mean()),
                         "sglang_mean_latency_s": sglang["mean_latency_s"], "dwise_mean_latency_s": dwise["mean_latency_s"],
                         "speedup": _ratio(sglang["mean_latency_s"], dwise["mean_latency_s"]),
                         "p99_speedup": _ratio(sglang["p99_latency_s"], dwise["p99_latency_s"]),
                         **_rhos(ds, preds)})
    rows.sort(key=lambda r: (replay.patterns.index(r["arrival"]), r["budget"]))
    return {"rows": rows, "recipe": source, "rate_rps": None if rate is None else float(rate), "policies": list(POLICIES)}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def drop_table(ds, seen: dict, held: dict[str, dict], skipped: list[dict], replay: StudyReplay, rate: str | None,
               source: str) -> dict:
    """Held-out categories replayed: per category and arrival pattern a ``seen`` row (retrained on the
    whole train split) and a ``held out`` row (retrained without it). ``{"rows", "skipped", "recipe",
    "rate_rps"}``; the per-category latencies are the first arrival seed's (:func:`~.simulator.category_tails`)."""
    tails: list[dict] = []
    base = _replay(ds, seen, replay, rate, POLICIES, tails)
    cats = ds.split("eval").requests["category"].astype(str).to_numpy()
    rho_table = loco.table(ds.split("eval"), seen, held, skipped, n_boot=0)
    rows = []
    for cat, preds in held.items():
        held_tails: list[dict] = []
        out = _replay(ds, preds, replay, rate, POLICIES[1:], held_tails)
        rhos = next(r for r in rho_table["rows"] if r["category"] == cat)
        for pattern in replay.patterns:
            sglang = base[(pattern, POLICIES[0])]
            common = {"category": cat, "arrival": pattern, "requests_category": int((cats == cat).sum()),
                      "sglang_mean_latency_s": sglang["mean_latency_s"],
                      "sglang_mean_latency_category_s": _category_mean(tails, pattern, POLICIES[0], cat)}
            for label, dwise, side, pool in ((SEEN_LABEL, base, "in_training", tails), (HELD_LABEL, out, "held_out",
                                                                                      held_tails)):
                mean = dwise[(pattern, POLICIES[1])]["mean_latency_s"]
                rows.append({**common, "predictors": label, "dwise_mean_latency_s": mean,
                             "dwise_mean_latency_category_s": _category_mean(pool, pattern, POLICIES[1], cat),
                             "speedup": _ratio(sglang["mean_latency_s"], mean),
                             **{f"{key}_rho_category": rhos[key][side] for key in ("admission", "refined")},
                             **{f"{key}_rho_all": rhos["overall"][key][side] for key in ("admission", "refined")}})
    return {"rows": rows, "skipped": skipped, "recipe": source, "rate_rps": None if rate is None else float(rate),
            "policies": list(POLICIES)}


def _category_mean(tails: list[dict], pattern: str, policy: str, cat: str) -> float | None:
    return next((t["mean_latency_s"] for t in tails
                 if t["arrival"] == pattern and t["policy"] == policy and t["category"] == cat), None)

