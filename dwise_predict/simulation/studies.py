"""What the lab's two commands run, from inputs to written outputs: ``simulate``
(:func:`run_simulation`: traces and bundle loaded, every scheduler replayed, the outputs and the
report written) and ``batch-timeout`` (:func:`run_batch_timeout`: service times picked, the study,
its outputs). A command checks its flags, holds its ``--out``, calls one of these and prints what
comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dwise_predict.simulation import batch_timeout as bt
from dwise_predict.simulation.report import write_batch_timeout_outputs, write_outputs
from dwise_predict.simulation.simulator import (
    POLICIES,
    SimConfig,
    gain_decomposition,
    ranking_pays_from,
    replay,
    sim_requests_from_traces,
)
from dwise_predict.simulation.work_ranking import (
    annotate_rows,
    output_length_scores,
    ranking_accuracy,
    subset_masks,
    subset_table,
)


@dataclass
class SimulationRun:
    """What :func:`run_simulation` found: the metric rows (one per group and scheduler), the
    replayed request count, the refine-every table (or None), the gain decomposition (replays at one
    load), the rate from which ranking pays (load sweeps) and the files written."""

    rows: list[dict]
    requests: int
    policies: list[str]
    refine_table: dict | None = None
    subset_table: dict | None = None  # the DWISE paper's Table 12 (`subset_categories`), or None
    retrained: dict = field(default_factory=dict)  # the DWISE paper's Tables 14 and 7 replayed (`retrain`, .retrain)
    gains: list[dict] = field(default_factory=list)
    ranking_pays_from: float | None = None
    paths: list[Path] = field(default_factory=list)


def run_simulation(traces: Path, config: SimConfig, *, bundle: Path | None = None, backend: str = "onnx",
                   split: str = "eval", requests: int = 4096, policies: list[str] | None = None,
                   patterns: list[str] | None = None, rate: str | None = None, rates: str | None = None,
                   ks: list[float] | None = None, refine_every: list[int] | None = None, arrival_seeds: int = 1,
                   out: Path | None = None, log: Callable[[str], None] | None = None, batch_former: str = "mixed",
                   subset_categories: list[str] | None = None, retrain=None) -> SimulationRun:
    """Replay the ``split`` (``eval``, ``train`` or ``all``) of ``traces`` under every scheduler
    ``policies`` names (default: all the predictions allow), as
    :func:`~dwise_predict.simulation.simulator.replay` does: at each arrival pattern, or a load sweep
    over ``rates``, or a k sweep over ``ks``; ``requests`` drawn with replacement (0: the split as it
    is). With ``refine_every``, also the DWISE paper's Table 6
    (:func:`~dwise_predict.simulation.refine_every.replay_refine_every`). With ``out``,
    ``simulate.*`` (``sweep.*``, ``k_sweep.*``) and the report are written there.

    ``batch_former`` runs the published baselines on DWISE's mixed former, SGLang's prefill-first one
    or both (:func:`~dwise_predict.simulation.schedulers.on_batch_former`). Every row carries the ρ of
    its ranking with the work (:mod:`~dwise_predict.simulation.work_ranking`); with
    ``subset_categories``, the run also holds the DWISE paper's Table 12 for those categories. With
    ``retrain`` (a :class:`~dwise_predict.simulation.retrain.RetrainStudies`), also the budget sweep
    and the held-out categories, both predictors retrained (:func:`~.retrain.run_retrain_studies`).
    """
    log = log or (lambda message: None)
    ds, loaded = _load(traces, bundle, backend)
    if retrain is not None:  # refused here, before any replay or retraining
        from dwise_predict.simulation.retrain import StudyReplay, plan_retrain, run_retrain_studies

        retrain_plan = plan_retrain(ds, retrain, log)
    subset = None if split == "all" else split
    sim = sim_requests_from_traces(ds, subset, loaded)
    if refine_every:  # refused here, before any replay, when the traces hold no per-round states
        from dwise_predict.simulation.refine_every import round_estimates

        sim.round_refined = round_estimates(ds, loaded, subset)
    if split == "eval" and (policies is None or any(POLICIES[p].estimate == "probe" for p in policies if p in POLICIES)):
        sim.probe = trail_probe(ds, log)
    ranked = sim
    if subset_categories:  # refused here, before any replay, when the categories do not split the requests
        subset_masks(ranked, subset_categories)
    if requests:
        sim = sim.draw(requests, config.seed)
    tails: list = []
    rows, policies = replay(sim, config, policies, patterns, rate, rates, log=log, arrival_seeds=arrival_seeds,
                            tails=tails, ks=ks, batch_former=batch_former)
    annotate_rows(rows, ranking_accuracy(ranked, policies), batch_former != "mixed")
    run = SimulationRun(rows, len(sim), policies)
    if subset_categories:
        run.subset_table = subset_table(ranked, subset_categories, policies, tails,
                                        output_length_scores(ds, subset, log))
    if refine_every:
        from dwise_predict.simulation.refine_every import refine_call_us, replay_refine_every

        log(f"replaying refinement every {', '.join(map(str, refine_every))} rounds (the DWISE paper's Table 6)")
        run.refine_table = replay_refine_every(sim, config, refine_every, patterns, rate, ranked,
                                               call_us=lambda batch: refine_call_us(loaded, ds, batch))
    if retrain is not None:
        run.retrained = run_retrain_studies(retrain_plan, StudyReplay(
            config, patterns or ["burst", "burst-poisson"], rate, requests, arrival_seeds), log)
    if not rates and not ks:
        run.gains = gain_decomposition(rows)
    if rates:
        run.ranking_pays_from = ranking_pays_from(rows)
    if out is not None:
        settings = {**asdict(config), "round_cost": config.cost.as_dict(), "traces": str(traces),
                    "bundle": str(bundle) if bundle else None, "split": split, "policies": policies,
                    "requests": len(sim), "arrival_seeds": arrival_seeds}
        stem = "k_sweep" if ks else "sweep" if rates else "simulate"
        extra = {key: table for key, table in (("refine_every", run.refine_table), ("subset_table", run.subset_table))
                 if table is not None}
        extra.update(run.retrained)
        run.paths = write_outputs(rows, out, stem, settings, tails, extra or None, report=True)
        if retrain is not None:
            retrain.retraining.forget_kept()
    return run


def _load(traces: Path, bundle: Path | None, backend: str):
    """The trace dataset and, with ``bundle``, the bundle checked against the traces' model and decoding."""
    from dwise_predict.traces import load_traces

    ds = load_traces(traces)
    if bundle is None:
        return ds, None
    from dwise_predict.bundles.load import load_bundle

    return ds, load_bundle(bundle, backend=backend, expect_model=ds.model_fingerprint, expect_decoding=ds.decoding)


def trail_probe(ds, log: Callable[[str], None]):
    """The TRAIL-style probe of `evaluate` fitted on the train split, predicting the eval split (or
    None, said through ``log``, when the traces lack either split)."""
    split = ds.requests["split"].to_numpy()
    if not (split == "train").any() or not (split == "eval").any():
        log("no train split in the traces: scheduler trail is left out")
        return None
    from dwise_predict.evaluation.baselines import trail_probe as fit_trail_probe

    return fit_trail_probe(ds.subset(split == "train"), ds.subset(split == "eval"))


@dataclass
class BatchTimeoutStudy:
    """What :func:`run_batch_timeout` found: the service times used, one row per ``ρ`` and the
    settings recorded beside them."""

    service: bt.ServiceTimes
    rows: list[dict]
    settings: dict


def run_batch_timeout(rhos: list[float], *, service_times: Path | None = None, traces: Path | None = None,
                      round_profile: Path | None = None, batch_size: int | None = None, paper_mean: float = 8.74,
                      paper_cv: float = 0.266, timeout: float | None = None, requests: int = 20_000, seed: int = 0,
                      out: Path | None = None, log: Callable[[str], None] | None = None) -> BatchTimeoutStudy:
    """Amin et al.'s batch-timeout study (:func:`~dwise_predict.simulation.batch_timeout.timeout_study`)
    at each utilisation of ``rhos``, on service times from ``service_times`` (a file), from ``traces``
    timed by ``round_profile`` (synchronized batches of the eval split), else from the paper's summary
    (``paper_mean``, ``paper_cv``); ``batch_size`` defaults to the file's, else 8. With ``out``,
    ``batch_timeout.csv`` / ``.json`` / ``.png`` are written there."""
    if service_times is not None:
        service = bt.load_service_times(service_times, batch_size)
    elif traces is not None:
        from dwise_predict.simulation.round_cost import load_round_cost
        from dwise_predict.simulation.simulator import sync_batch_service_times
        from dwise_predict.traces import load_traces

        cost = load_round_cost(round_profile)
        sim = sim_requests_from_traces(load_traces(traces), "eval")
        service = sync_batch_service_times(sim, cost, batch_size or 8, seed=seed)
    else:
        service = bt.paper_service_times(mean_s=paper_mean, cv=paper_cv, batch_size=batch_size or 8)
    if log is not None:
        log(f"service times: {service.source} (S = {service.mean:.3g} s, CV = {service.cv:.3f}, B = {service.batch_size})")
    rows = bt.timeout_study(service, rhos, timeout, requests, seed)
    settings = {"source": service.source, "batch_size": service.batch_size, "mean_s": service.mean,
                "cv": service.cv, "samples": service.samples.tolist(), "requests": requests, "seed": seed,
                "timeout_s": timeout}
    if out is not None:
        write_batch_timeout_outputs(out, settings, rows, f"{service.source}")
    return BatchTimeoutStudy(service, rows, settings)
