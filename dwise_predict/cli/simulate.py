"""Typer command `simulate` (thin: check the flags, call simulation.studies.run_simulation, print)."""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import SEED_RANGE, JsonOption, checked_traces, comma_items, comma_list, console, log
from dwise_predict.errors import ConfigError
from dwise_predict.simulation.schedulers import PREFILL_FIRST, SCHEDULERS, needs_bundle
from dwise_predict.text import terminal
from dwise_predict.simulation.simulator import SimConfig

_DEFAULT = SimConfig()
_FROM_BUNDLE = [name for name, spec in SCHEDULERS.items() if needs_bundle(spec)]
# the help's closing section: every scheduler and what it models, from its spec
SCHEDULERS_HELP = "Schedulers (what --policies names) and what each models:\n\n" + "\n\n".join(
    f"{name}: {spec.about}" for name, spec in SCHEDULERS.items()) + (
    f"\n\n{', '.join(PREFILL_FIRST)}: the same baselines on SGLang's prefill-first batch former (--batch-former); "
    "FCFS on that former is sglang-default.")
# Bounds checked before anything is allocated: the replay holds arrays of --requests entries per
# scheduler and replays every arrival pattern --arrival-seeds times (10**11 requests asked 745 GiB).
MAX_REQUESTS = 1_000_000
MAX_ARRIVAL_SEEDS = 1_000


class Arrival(str, Enum):
    burst = "burst"
    burst_poisson = "burst-poisson"
    poisson = "poisson"
    both = "both"


class BatchFormer(str, Enum):
    mixed = "mixed"
    prefill_first = "prefill-first"
    both = "both"


class Split(str, Enum):
    eval = "eval"
    train = "train"
    all = "all"


def simulate_command(
    traces: Annotated[Path, typer.Argument(help="Trace directory (contract 1) to replay.", callback=checked_traces)],
    bundle: Annotated[Optional[Path], typer.Option(help=f"Predictor bundle: enables {', '.join(_FROM_BUNDLE[:-1])} and {_FROM_BUNDLE[-1]}.")] = None,
    policies: Annotated[Optional[str], typer.Option(help=f"Comma list of schedulers (default: all the predictions allow): {', '.join(SCHEDULERS)}.")] = None,
    arrival: Annotated[Arrival, typer.Option(help="Arrival pattern: burst, burst-poisson, poisson, or both (burst and burst-poisson).")] = Arrival.both,
    rate: Annotated[Optional[str], typer.Option(help="Poisson rate for burst-poisson / poisson: req/s, or a multiple of SGLang-default's service rate (its utilisation) like 0.8x (default: 1.5x).")] = None,
    rates: Annotated[Optional[str], typer.Option(help="Load sweep instead: Poisson arrivals at each rate of a comma list (req/s, or multiples of SGLang-default's service rate like 0.5x,1x,2x).")] = None,
    ks: Annotated[Optional[str], typer.Option(help="k sweep instead: every scheduler at each resident-set multiplier of a comma list (the DWISE paper's Fig. 10), under --arrival (burst unless poisson/burst-poisson).")] = None,
    refine_every: Annotated[Optional[str], typer.Option(help="Also replay the DWISE paper's Table 6: DWISE re-estimating r̂ every n denoising rounds, a comma list (e.g. 1,2,4,8), beside never and once, with ρ of the r̂ held; needs --bundle and traces collected with `collect --rounds-hidden N` (refinements stop after round N).")] = None,
    slots: Annotated[int, typer.Option(help="B: blocks per round (block slots).")] = _DEFAULT.slots,
    k: Annotated[float, typer.Option("--k", help="Resident-set multiplier: at most k*B requests hold KV.")] = _DEFAULT.k,
    kv_budget: Annotated[Optional[float], typer.Option(help="KV pool in blocks (default: unlimited).")] = _DEFAULT.kv_budget,
    kv_slack: Annotated[int, typer.Option(help="Extra blocks reserved per resident request.")] = _DEFAULT.kv_slack_blocks,
    round_ms: Annotated[float, typer.Option(help="Fixed cost of one round, ms.")] = _DEFAULT.round_ms,
    slot_ms: Annotated[float, typer.Option(help="Extra cost per block in a round, ms.")] = _DEFAULT.slot_ms,
    round_profile: Annotated[Optional[Path], typer.Option(help="Round-cost profile JSON (`dwise-predict profile-rounds`, or your GPU's): replaces --round-ms/--slot-ms.")] = None,
    aging: Annotated[float, typer.Option(help="Starvation guard of the DWISE schedulers: rounds of remaining work one round in the server is worth (0: off, Algorithm 1 as published; `serve` runs with its --aging).")] = _DEFAULT.aging,
    max_wait: Annotated[int, typer.Option(help="Wait cap of the DWISE schedulers, in rounds: a request waiting longer for admission is admitted first, and nobody else is admitted until it fits (0: off; the default is `serve`'s, chosen in docs/serving.md).")] = _DEFAULT.max_wait,
    requests: Annotated[int, typer.Option(help="Requests to replay, drawn with replacement from the split with --seed (0: the split as it is).")] = 4096,
    arrival_seeds: Annotated[int, typer.Option(help="Replay each arrival pattern under this many seeds; metrics get 95% bootstrap intervals.")] = 1,
    split: Annotated[Split, typer.Option(help="Which requests to replay.")] = Split.eval,
    seed: Annotated[int, typer.Option(**SEED_RANGE, help="Arrival order and Poisson times.")] = _DEFAULT.seed,
    backend: Annotated[str, typer.Option(help="Bundle backend for the predictions: onnx or torch.")] = "onnx",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write simulate.csv/.json/.png (or sweep.*) here.")] = None,
    json_out: JsonOption = False,
    batch_former: Annotated[BatchFormer, typer.Option(help="Batch former of the published baselines (mlfq, ssjf, s3, ltr, trail): mixed (DWISE's mixed-phase rounds, the DWISE paper's Table 4), prefill-first (SGLang's, as its Table 2 runs them: rows named <baseline>-pf; FCFS there is sglang-default) or both. SGLang's modes stay prefill-first, fcfs-mixed and DWISE mixed.")] = BatchFormer.mixed,
    subset: Annotated[Optional[str], typer.Option(help="Also the DWISE paper's Table 12 for a comma list of categories (e.g. mcq,hard_mcq) against the other requests and all: shares of requests and work, ρ of each ranking and of output length with the work, each scheduler's Δ mean latency vs sglang-default.")] = None,
    budget_sweep: Annotated[Optional[str], typer.Option(metavar="DIR[,DIR...]", help="Also the DWISE paper's Table 14 (e.g. simulate t256/ --bundle bundle/ --budget-sweep t512/,t1024/ --out sim/): trace directories of the same model, decoding and prompts at other output budgets; for TRACES and each, both predictors retrained on its train split (--bundle's recipe, else the defaults) and sglang-default and dwise-refined replayed on its eval split, a row per budget and arrival pattern. With --out an interrupted run resumes.")] = None,
    drop_category: Annotated[Optional[list[str]], typer.Option(metavar="CAT", help="Also the DWISE paper's Table 7 replayed (e.g. --drop-category mcq, or all): both predictors retrained on the train split without CAT (repeatable; all: each category in turn) against retrained on all of it with the same recipe (--bundle's, else the defaults); dwise-refined replayed with each. With --out an interrupted run resumes.")] = None,
) -> None:
    """Replay traces under SGLang's default scheduler, FCFS and DWISE variants; compare latency.

    Time is counted in rounds (one batched forward pass of B blocks) and in seconds by a round-cost
    model: fitted from --round-profile (prefill and denoising rows priced apart), else the flat
    round = --round-ms + --slot-ms x blocks. The model's source is printed and recorded. The bundle
    must match the traces' model and decoding. Rates given as multiples (2x) are relative to
    SGLang-default's service rate on these traces.

    Examples:

        dwise-predict simulate traces/ --bundle bundle/ --out sim/

        dwise-predict simulate traces/ --arrival burst --slots 64 --k 4 --kv-budget 20000

        dwise-predict simulate traces/ --bundle bundle/ --rates 0.25x,0.5x,1x,2x,4x --out sweep/

        dwise-predict simulate traces/ --bundle bundle/ --round-profile h200.json --arrival-seeds 5 --out sim/

        dwise-predict simulate traces-r8/ --bundle bundle/ --refine-every 1,2,4,8 --out sim/   # the DWISE paper's Table 6

        dwise-predict simulate traces/ --bundle bundle/ --batch-former both --subset mcq,hard_mcq   # Tables 2, 4, 12
    """
    from contextlib import nullcontext

    from dwise_predict.files import claim_output
    from dwise_predict.simulation.report import SIMULATE_CONTENTS
    from dwise_predict.simulation.studies import run_simulation

    chosen = comma_items(policies, str.strip) if policies else None
    subset_categories = _checked_subset(subset, rates, ks)
    config, k_list, every = _checked_config(
        chosen, rate=rate, rates=rates, ks=ks, refine_every=refine_every, bundle=bundle,
        requests=requests, arrival_seeds=arrival_seeds, round_profile=round_profile, backend=backend,
        server=dict(slots=slots, k=k, kv_budget=kv_budget, kv_slack_blocks=kv_slack, round_ms=round_ms,
                    slot_ms=slot_ms, seed=seed, aging=aging, max_wait=max_wait or None))  # --max-wait 0: off
    retrain = _checked_retrain(budget_sweep, drop_category, bundle=bundle, split=split, rates=rates, ks=ks, out=out)
    stem = "k_sweep" if ks else "sweep" if rates else "simulate"
    inputs = [("TRACES", traces), ("--bundle", bundle), ("--round-profile", round_profile),
              *(("--budget-sweep", path) for path in (retrain.budget_sweep if retrain else ()))]
    claim = (claim_output(out, inputs, "a simulation", _marker(out, stem), replace=True, contents=SIMULATE_CONTENTS)
             if out else nullcontext())
    with claim:
        run = run_simulation(traces, config, bundle=bundle, backend=backend, split=split.value, requests=requests,
                             policies=chosen, patterns=["burst", "burst-poisson"] if arrival is Arrival.both
                             else [arrival.value], rate=rate, rates=rates, ks=k_list, refine_every=every,
                             arrival_seeds=arrival_seeds, out=out, log=log, batch_former=batch_former.value,
                             subset_categories=subset_categories, retrain=retrain)
        for path in run.paths:
            log(f"wrote {path}")
    _print_run(run, config, ks, rates, json_out)


def _checked_subset(subset: str | None, rates: str | None, ks: str | None) -> list[str] | None:
    """The ``--subset`` categories (first-seen order), or None; refused in one line where empty or
    beside a sweep (Table 12 reads the per-category latencies of a replay at one load)."""
    if subset is None:
        return None
    categories = list(dict.fromkeys(comma_items(subset, str.strip)))
    if not categories:
        raise ConfigError("--subset is empty: give categories of the traces, e.g. mcq,hard_mcq, or leave it out")
    if rates or ks:
        raise ConfigError("--subset compares latencies at one load: drop --rates / --ks")
    return categories


def _checked_config(chosen: list[str] | None, *, rate, rates, ks, refine_every, bundle, requests, arrival_seeds,
                    round_profile, backend, server: dict) -> tuple[SimConfig, list[float], list[int]]:
    """The simulator's settings from the flags (``server``: :class:`SimConfig`'s), with the round-cost
    profile loaded, and the ``--ks`` and ``--refine-every`` lists ([] when absent; the periods in
    first-seen order); every problem with the flags at once, as one :class:`ConfigError`."""
    from dwise_predict.simulation.simulator import POLICIES

    problems = []
    unknown = [p for p in chosen or [] if p not in POLICIES]
    if unknown:
        problems.append(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})")
    if rates is not None and not rates.strip():
        problems.append("--rates is empty: give e.g. 0.5x,1x,2x or 4,8,16, or leave it out")
    if rates and rate:
        problems.append("--rate and --rates conflict: --rates sweeps several rates, --rate sets one")
    if ks and rates:
        problems.append("--ks and --rates conflict: sweep one thing at a time")
    k_list = [] if not ks else comma_list(
        ks, float, "--ks", "finite numbers >= 1", problems, valid=lambda x: 1 <= x < math.inf)
    if not math.isfinite(server["k"]):
        problems.append(f"--k must be a finite number (at most k x B requests hold KV), got {server['k']}")
    every = [] if refine_every is None else comma_list(
        refine_every, int, "--refine-every", "whole round counts >= 1 (e.g. 1,2,4,8)", problems, valid=lambda n: n >= 1)
    if every and bundle is None:
        problems.append("--refine-every needs --bundle: the refinements come from its graph")
    if every and (rates or ks):
        problems.append("--refine-every replays at one load: drop --rates / --ks")
    if requests < 0 or requests > MAX_REQUESTS:
        problems.append(f"--requests must lie in 0..{MAX_REQUESTS:,} (0: the split as it is), got {requests:,}")
    if arrival_seeds < 1 or arrival_seeds > MAX_ARRIVAL_SEEDS:
        problems.append(f"--arrival-seeds must lie in 1..{MAX_ARRIVAL_SEEDS:,}, got {arrival_seeds:,}")
    if round_profile is not None and not round_profile.is_file():  # a FIFO would block the read: refused too
        problems.append(f"--round-profile {round_profile} " + (
            "is not a regular file (a directory, a pipe or a device): give the profile's JSON file"
            if round_profile.exists() else "does not exist (measure one with `dwise-predict profile-rounds`)"))
    if backend not in ("onnx", "torch"):
        problems.append(f"--backend must be onnx or torch, got {backend!r}")
    try:
        config = SimConfig(**server)
    except ConfigError as err:
        problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))
    if round_profile is not None:
        from dataclasses import replace

        from dwise_predict.simulation.round_cost import load_round_cost

        config = replace(config, round_cost=load_round_cost(round_profile))
    return config, k_list, list(dict.fromkeys(every))


def _print_run(run, config: SimConfig, ks: str | None, rates: str | None, json_out: bool) -> None:
    """The rows as JSON, or the comparison table (by k, by rate or by arrival pattern), the
    refine-every tables, the gain decomposition and, for a load sweep, where ranking starts to pay."""
    from dwise_predict.simulation.report import render_refine_table, render_table

    if ks:
        group, title = "k", f"k sweep, {run.requests} requests, B={config.slots}"
    elif rates:
        group, title = "rate_rps", f"Load sweep, Poisson arrivals, B={config.slots}, k={config.k:g}"
    else:
        group, title = "arrival", f"Simulated serving, {run.requests} requests, B={config.slots}, k={config.k:g}"
    title += f"; round cost: {terminal(config.cost.source)}"  # a profile's source is the user's text
    tables = {key: table for key, table in (("refine_every", run.refine_table), ("subset_table", run.subset_table))
              if table is not None}
    tables.update(run.retrained)
    if json_out:
        typer.echo(json.dumps({"rows": run.rows, **tables} if tables else run.rows, indent=2))
        return
    console(240).print(render_table(run.rows, title, group))
    if run.refine_table is not None:
        for table in render_refine_table(run.refine_table, f"Refinement every n rounds (the DWISE paper's Table 6), "
                                         f"{run.requests} requests, refinements up to round "
                                         f"{run.refine_table['rounds_hidden']}; "
                                         "ρ: mean over rounds 1..N of ρ(r̂ held, rounds left)"):
            console(240).print(table)
    if run.subset_table is not None:
        from dwise_predict.simulation.report import SUBSET_TITLE, render_subset_table

        console(240).print(render_subset_table(run.subset_table, f"{SUBSET_TITLE}, {run.requests} requests replayed"))
    _print_retrained(run.retrained)
    for g in run.gains:
        typer.echo(f"{g['arrival']}: {g['step']} ({g['from']} → {g['to']}): {g['gain']:.2f}x")
    if group == "rate_rps":
        start = run.ranking_pays_from
        typer.echo("ranking never beats fcfs-mixed by 5 % at these rates" if start is None else
                   f"ranking beats fcfs-mixed by >= 5 % from {start:.3g} req/s up; below it ranking stops paying")


def _marker(out: Path, stem: str) -> str:
    """The JSON that makes ``out`` a simulate output: one already there (a replay, a load sweep and a k
    sweep may share a folder: each writes its own stem), else the one this run writes."""
    from dwise_predict.simulation.report import SIMULATE_JSONS

    return next((name for name in SIMULATE_JSONS if (out / name).is_file()), f"{stem}.json")


def _checked_retrain(budget_sweep: str | None, drop_category: list[str] | None, *, bundle: Path | None, split, rates,
                     ks, out: Path | None):
    """What ``--budget-sweep`` and ``--drop-category`` ask for (None: neither), with the recipe every
    retraining uses (``--bundle``'s, else the defaults) and, with ``--out``, the folder that keeps
    finished retrainings for a resume; every problem with the flags at once, as one :class:`ConfigError`."""
    if budget_sweep is None and not drop_category:
        return None
    problems = []
    paths = [] if budget_sweep is None else checked_traces(comma_items(budget_sweep, lambda item: Path(item.strip())))
    if budget_sweep is not None and not paths:
        problems.append("--budget-sweep is empty: give the trace directories of the other budgets, e.g. t512/,t1024/")
    problems += [f"--budget-sweep {path} is not a trace directory" for path in paths if not path.is_dir()]
    if out is not None and any(out.resolve() == path.resolve() for path in paths):
        problems.append(f"--out {out} is one of the --budget-sweep traces: write the simulation elsewhere")
    if drop_category and "all" in drop_category and len(set(drop_category)) > 1:
        problems.append("--drop-category all already holds out each category in turn: drop the other names")
    if split is not Split.eval:
        problems.append("--budget-sweep and --drop-category retrain on the train split and replay the eval split: "
                        "drop --split")
    if rates or ks:
        problems.append("--budget-sweep and --drop-category replay at one load: drop --rates / --ks")
    if problems:
        raise ConfigError("; ".join(problems))
    from dwise_predict.evaluation.pool import kept_results_dir
    from dwise_predict.simulation.retrain import Retraining, RetrainStudies

    config, source = _recipe(bundle)
    kept = None if out is None else kept_results_dir(out)
    if kept is not None and kept.is_dir():  # it goes once the output is written: only an interrupted run leaves it
        log(f"resuming an interrupted simulation: reusing the retrainings it finished, kept in {kept}")
    return RetrainStudies(Retraining(config, source, kept), tuple(paths), tuple(drop_category or ()))


def _recipe(bundle: Path | None):
    """The TrainConfig every retraining uses and where it comes from: the bundle's recipe (the
    defaults for a bundle that records none), else the defaults."""
    from dwise_predict.training import TrainConfig

    if bundle is None:
        return TrainConfig(), "the TrainConfig defaults (no --bundle)"
    from dwise_predict.bundles.manifest import read_bundle_manifest
    from dwise_predict.refresh import Serving, bundle_recipe

    return bundle_recipe(Serving(bundle, read_bundle_manifest(bundle), "", str(bundle)))


def _print_retrained(tables: dict) -> None:
    """The budget sweep's and the held-out categories' tables (:mod:`~dwise_predict.simulation.retrain`),
    and the categories not held out."""
    from dwise_predict.simulation.retrain_report import render_tables, skipped_lines

    for table in render_tables(tables):
        console(240).print(table)
    from dwise_predict.text import visible

    for line in skipped_lines(tables):
        typer.echo(visible(line))
