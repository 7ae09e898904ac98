"""How well each scheduler's ranking orders the requests' work, and where it misorders it.

Work is what a request costs the server, its prompt blocks and its denoising rounds, ``P + T`` (the
``R = P + r̂`` the schedulers rank by, with the true rounds). Each row of ``simulate`` reports the
Spearman ρ (:func:`dwise_predict.metrics.spearman`) between the key a scheduler ranks a request by
and that work (:func:`ranking_accuracy`):

- ``rho_admission``: the key at admission, ``P + r̂₀`` (S³: the power-of-two bucket of ``r̂₀``), for
  the schedulers that rank by an estimate; FCFS, SGLang's modes and MLFQ (a level of the work done,
  not an estimate of the work) rank by none (None, printed "—");
- ``rho_refined``: after the first denoising round, ``P + 1 + r̂₁`` (the round done and the refined
  remaining rounds), for those that refine (DWISE raw and calibrated, TRAIL's probe, the oracle);
  the oracle's are 1.

:func:`subset_table` is the DWISE paper's Table 12 on the user's traces: a subset of categories (the
paper's "(Hard) MCQ") against the other requests and all of them: shares of requests and of work,
ρ of each ranking, and each scheduler's change of mean latency against SGLang's default on each.

Our ``ssjf``, ``s3`` and ``ltr`` rank by the admission predictor's estimate of denoising rounds, not by
a predicted output length as the paper's do (their ``about`` says so), so their ρ is not the paper's.
The paper's point (output length is not work) is measured directly by two output-length rankings:
the traces' own output tokens (a perfect output-length predictor) and a LightGBM on the admission
features fitted to output tokens on the train split (what a prompt-only output-length predictor learns).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dwise_predict.errors import ConfigError
from dwise_predict.metrics import spearman
from dwise_predict.simulation.schedulers import ALL_SCHEDULERS, PREFILL_FIRST, SchedulerSpec, batch_former, bucket
from dwise_predict.text import first_names

RHO_KEYS = ("rho_admission", "rho_refined")
SUBSET_COLUMNS = ("subset", "other", "all")  # the columns of the DWISE paper's Table 12, in its order
OUTPUT_TOKENS = "output tokens (a perfect output-length ranker)"
OUTPUT_LIGHTGBM = "LightGBM output length (admission features, train split)"
REFERENCE = "sglang-default"
TABLE_NOTE = (
    "work = prompt blocks + denoising rounds; shares and ρ on the split's requests (each once), Δ mean latency "
    "(s, > 0: slower than sglang-default) on the replayed requests, first arrival seed. Our ssjf, s3 and ltr rank "
    "by the admission predictor's denoising-round estimate, not by a predicted output length as the DWISE paper's "
    "do: the output-length rows measure the paper's point directly.")


def work(workload) -> np.ndarray:
    """Each request's work, ``P + T`` (prompt blocks + denoising rounds)."""
    return (workload.prompt_blocks + workload.total_rounds).astype(np.float64)


def ranking_scores(workload, spec: SchedulerSpec) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The work ``spec`` ranks each request by: at admission and after the first denoising round
    (None where it ranks by no estimate, or never refines)."""
    if spec.ranking in ("arrival", "mlfq"):
        return None, None
    admission, refined = workload.estimates(spec.estimate)
    if spec.bucket_key:
        admission = bucket(admission)
    prompt = workload.prompt_blocks.astype(np.float64)
    return prompt + admission, None if refined is None else prompt + 1.0 + refined


def ranking_accuracy(workload, policies: list[str]) -> dict[str, dict]:
    """``{policy: {"rho_admission": ρ, "rho_refined": ρ}}``: Spearman ρ of each ranking with the work
    (None where the scheduler ranks by no estimate, never refines, or ρ is undefined)."""
    truth = work(workload)
    out = {}
    for name in policies:
        scores = ranking_scores(workload, ALL_SCHEDULERS[name])
        out[name] = {key: None if s is None else spearman(s, truth) for key, s in zip(RHO_KEYS, scores)}
    return out


def annotate_rows(rows: list[dict], accuracy: dict[str, dict], with_former: bool) -> None:
    """Add each row's ρ (:func:`ranking_accuracy`) and, ``with_former``, its ``batch_former``."""
    for row in rows:
        if with_former:
            row["batch_former"] = batch_former(ALL_SCHEDULERS[row["policy"]])
        row.update(accuracy.get(row["policy"], dict.fromkeys(RHO_KEYS)))


def subset_masks(workload, subset: list[str]) -> dict[str, np.ndarray]:
    """The requests of each column of :data:`SUBSET_COLUMNS`: in ``subset`` (categories), not, all.

    Raises
    ------
    ConfigError
        The requests carry no categories, ``subset`` names one they lack, or it takes them all.
    """
    if workload.categories is None:
        raise ConfigError("the traces carry no request categories: a subset of categories cannot be compared")
    categories = np.asarray(workload.categories).astype(str)
    held = sorted(set(categories.tolist()))
    held_set = set(held)
    unknown = [c for c in subset if c not in held_set]
    if unknown:
        raise ConfigError(f"`subset_categories` names categories the replayed requests lack: {first_names(unknown)} "
                          f"(they hold: {first_names(held)})")
    inside = np.isin(categories, subset)
    if inside.all():
        raise ConfigError(f"`subset_categories` ({first_names(subset)}) holds every category of the replayed requests: "
                          "no other requests are left to compare it with")
    return {"subset": inside, "other": ~inside, "all": np.ones(len(inside), dtype=bool)}


def subset_table(workload, subset: list[str], policies: list[str], tails: list[dict],
                 output_scores: dict[str, np.ndarray]) -> dict:
    """The DWISE paper's Table 12: rows of (quantity, subset, other, all).

    ``workload``: the split's requests (each once); ``tails``: per-category latencies of the replay
    (:func:`~dwise_predict.simulation.simulator.category_tails` rows with their ``arrival``);
    ``output_scores``: output-length rankings of the same requests by name (:func:`output_length_scores`).
    Rows: the shares of requests and of work (%), ρ of each output-length ranking and of each
    replayed scheduler's ranking (:func:`ranking_scores`; the ``-pf`` twins rank as their mixed
    originals and are left out) with the work, and each scheduler's Δ mean latency (s) against
    ``sglang-default`` per arrival pattern.
    """
    masks = subset_masks(workload, subset)
    truth = work(workload)
    rows = [_row("requests %", {c: float(100.0 * m.mean()) for c, m in masks.items()}),
            _row("work %", {c: float(100.0 * truth[m].sum() / truth.sum()) for c, m in masks.items()})]
    rankings = [(f"ρ, {name}", score) for name, score in output_scores.items()]
    for name in (p for p in policies if p not in PREFILL_FIRST):
        for when, score in zip(("at admission", "after refinement"), ranking_scores(workload, ALL_SCHEDULERS[name])):
            if score is not None:
                rankings.append((f"ρ, {name} {when}", score))
    rows += [_row(label, {c: spearman(score[m], truth[m]) for c, m in masks.items()}) for label, score in rankings]
    rows += latency_deltas(tails, subset)
    return {"subset": list(subset), "columns": [", ".join(subset), "other", "all"], "rows": rows, "note": TABLE_NOTE}


def _row(quantity: str, values: dict) -> dict:
    return {"quantity": quantity, **{c: values[c] for c in SUBSET_COLUMNS}}


def latency_deltas(tails: list[dict], subset: list[str]) -> list[dict]:
    """Rows of each scheduler's mean latency minus ``sglang-default``'s (s) on the subset, the other
    requests and all, per arrival pattern, from per-category tails (means weighted by their counts);
    none without ``sglang-default``."""
    means: dict[tuple[str, str], dict[str, float]] = {}
    for key in dict.fromkeys((t["arrival"], t["policy"]) for t in tails):
        mine = [t for t in tails if (t["arrival"], t["policy"]) == key]
        groups = {"subset": [t for t in mine if t["category"] in subset],
                  "other": [t for t in mine if t["category"] not in subset], "all": mine}
        means[key] = {c: sum(t["requests"] * t["mean_latency_s"] for t in g) / sum(t["requests"] for t in g)
                      if g else None for c, g in groups.items()}
    rows = []
    for (arrival, policy), mean in means.items():
        base = means.get((arrival, REFERENCE))
        if policy == REFERENCE or base is None:
            continue
        rows.append(_row(f"Δ mean latency s, {policy}, {arrival}",
                         {c: None if mean[c] is None or base[c] is None else mean[c] - base[c] for c in SUBSET_COLUMNS}))
    return rows


def output_length_scores(ds, split: str | None, log: Callable[[str], None]) -> dict[str, np.ndarray]:
    """Output-length rankings of the ``split`` requests of ``ds`` (None: all), in their order: the
    traces' output tokens, and with a train split beside an eval one, a LightGBM on the admission
    features fitted to the train split's output tokens (else left out, said through ``log``)."""
    labels = ds.requests["split"].to_numpy()
    rows = np.ones(len(labels), dtype=bool) if split is None else labels == split
    scores = {OUTPUT_TOKENS: ds.requests["output_tokens"].to_numpy(dtype=np.float64)[rows]}
    if split != "eval" or not (labels == "train").any():
        log("the output-length LightGBM is fitted on the train split and ranks the eval split: left out here")
        return scores
    from dwise_predict.evaluation.baselines import output_length_lightgbm

    scores[OUTPUT_LIGHTGBM] = output_length_lightgbm(ds.subset(labels == "train"), ds.subset(rows))
    return scores
