"""Typer command `simulate` (thin: parse, call the simulator, print, write)."""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import SEED_RANGE, JsonOption, console, log
from dwise_predict.errors import ConfigError, StoreError
from dwise_predict.simulation.simulator import SimConfig

_DEFAULT = SimConfig()
OUTPUT_JSONS = ("simulate.json", "sweep.json", "k_sweep.json")  # what a replay, a load sweep, a k sweep always write
# every name a simulate output holds (the three stems' files, the report): a folder holding anything
# else is the user's, never written into
OUTPUT_CONTENTS = (*(f"{Path(name).stem}{part}.{ext}" for name in OUTPUT_JSONS for part, ext in
                     (("", "csv"), ("", "json"), ("", "png"), ("_categories", "csv"), ("_categories", "png"))),
                   "report.html", "report.md", "plots")
# Bounds checked before anything is allocated: the replay holds arrays of --requests entries per
# scheduler and replays every arrival pattern --arrival-seeds times (10**11 requests asked 745 GiB).
MAX_REQUESTS = 1_000_000
MAX_ARRIVAL_SEEDS = 1_000


class Arrival(str, Enum):
    burst = "burst"
    burst_poisson = "burst-poisson"
    poisson = "poisson"
    both = "both"


class Split(str, Enum):
    eval = "eval"
    train = "train"
    all = "all"


def simulate_command(
    traces: Annotated[Path, typer.Argument(help="Trace directory (contract 1) to replay.")],
    bundle: Annotated[Optional[Path], typer.Option(help="Predictor bundle: enables ssjf, s3, ltr, dwise-admission, dwise-raw and dwise-refined.")] = None,
    policies: Annotated[Optional[str], typer.Option(help="Comma list of schedulers (default: all the predictions allow): sglang-default, sglang-sync, fcfs-mixed, mlfq, ssjf, s3, ltr, trail, dwise-zero, dwise-admission, dwise-raw, dwise-refined, dwise-oracle.")] = None,
    arrival: Annotated[Arrival, typer.Option(help="Arrival pattern: burst, burst-poisson, poisson, or both (burst and burst-poisson).")] = Arrival.both,
    rate: Annotated[Optional[str], typer.Option(help="Poisson rate for burst-poisson / poisson: req/s, or a multiple of SGLang-default's service rate (its utilisation) like 0.8x (default: 1.5x).")] = None,
    rates: Annotated[Optional[str], typer.Option(help="Load sweep instead: Poisson arrivals at each rate of a comma list (req/s, or multiples of SGLang-default's service rate like 0.5x,1x,2x).")] = None,
    ks: Annotated[Optional[str], typer.Option(help="k sweep instead: every scheduler at each resident-set multiplier of a comma list (seed 000 Fig. 10), under --arrival (burst unless poisson/burst-poisson).")] = None,
    refine_every: Annotated[Optional[str], typer.Option(help="Also replay seed 000's Table 6: DWISE re-estimating r̂ every n denoising rounds, a comma list (e.g. 1,2,4,8), beside never and once, with ρ of the r̂ held; needs --bundle and traces collected with `collect --rounds-hidden N` (refinements stop after round N).")] = None,
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

        dwise-predict simulate traces-r8/ --bundle bundle/ --refine-every 1,2,4,8 --out sim/   # seed 000 Table 6
    """
    from contextlib import nullcontext
    from dataclasses import asdict

    from dwise_predict.files import claim_output
    from dwise_predict.simulation.report import render_table, write_outputs
    from dwise_predict.simulation.simulator import POLICIES, replay, sim_requests_from_traces
    from dwise_predict.traces import load_traces

    problems = []
    chosen = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    unknown = [p for p in chosen or [] if p not in POLICIES]
    if unknown:
        problems.append(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})")
    if rates is not None and not rates.strip():
        problems.append("--rates is empty: give e.g. 0.5x,1x,2x or 4,8,16, or leave it out")
    if rates and rate:
        problems.append("--rate and --rates conflict: --rates sweeps several rates, --rate sets one")
    if ks and rates:
        problems.append("--ks and --rates conflict: sweep one thing at a time")
    k_list = []
    if ks:
        try:
            k_list = [float(x) for x in ks.split(",") if x.strip()]
        except ValueError:
            k_list = []
        if not k_list or not all(1 <= x < math.inf for x in k_list):
            problems.append(f"--ks must be a comma list of finite numbers >= 1, got {ks!r}")
    if not math.isfinite(k):
        problems.append(f"--k must be a finite number (at most k x B requests hold KV), got {k}")
    every = _refine_periods(refine_every, problems)
    if every and bundle is None:
        problems.append("--refine-every needs --bundle: the refinements come from its graph")
    if every and (rates or ks):
        problems.append("--refine-every replays at one load: drop --rates / --ks")
    if requests < 0 or requests > MAX_REQUESTS:
        problems.append(f"--requests must lie in 0..{MAX_REQUESTS:,} (0: the split as it is), got {requests:,}")
    if arrival_seeds < 1 or arrival_seeds > MAX_ARRIVAL_SEEDS:
        problems.append(f"--arrival-seeds must lie in 1..{MAX_ARRIVAL_SEEDS:,}, got {arrival_seeds:,}")
    if round_profile is not None and not round_profile.is_file():
        problems.append(f"--round-profile {round_profile} does not exist (measure one with `dwise-predict profile-rounds`)")
    if backend not in ("onnx", "torch"):
        problems.append(f"--backend must be onnx or torch, got {backend!r}")
    base = dict(slots=slots, k=k, kv_budget=kv_budget, kv_slack_blocks=kv_slack, round_ms=round_ms,
                slot_ms=slot_ms, seed=seed, aging=aging, max_wait=max_wait or None)  # --max-wait 0: off
    try:
        config = SimConfig(**base)
    except ConfigError as err:
        problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))
    if round_profile is not None:
        from dataclasses import replace

        from dwise_predict.simulation.round_cost import load_round_cost

        config = replace(config, round_cost=load_round_cost(round_profile))
    stem = "k_sweep" if ks else "sweep" if rates else "simulate"
    inputs = [("TRACES", traces), ("--bundle", bundle), ("--round-profile", round_profile)]
    claim = (claim_output(out, inputs, "a simulation", _marker(out, stem), replace=True, contents=OUTPUT_CONTENTS)
             if out else nullcontext())
    with claim:
        ds = load_traces(traces)
        loaded = None
        if bundle is not None:
            from dwise_predict.bundles.load import load_bundle

            loaded = load_bundle(bundle, backend=backend, expect_model=ds.model_fingerprint, expect_decoding=ds.decoding)
        sim = sim_requests_from_traces(ds, None if split is Split.all else split.value, loaded)
        if every:  # refused here, before any replay, when the traces hold no per-round states
            from dwise_predict.simulation.refine_every import round_estimates

            sim.round_refined = round_estimates(ds, loaded, None if split is Split.all else split.value)
        if split is Split.eval and (chosen is None or "trail" in chosen):
            sim.probe = _trail_probe(ds)
        ranked = sim
        if requests:
            sim = sim.draw(requests, seed)
        patterns = ["burst", "burst-poisson"] if arrival is Arrival.both else [arrival.value]
        tails: list = []
        rows, chosen = replay(sim, config, chosen, patterns, rate, rates, log=log, arrival_seeds=arrival_seeds,
                              tails=tails, ks=k_list)
        refine_table = None
        if every:
            from dwise_predict.simulation.refine_every import refine_call_us, replay_refine_every

            log(f"replaying refinement every {', '.join(map(str, every))} rounds (seed 000 Table 6)")
            refine_table = replay_refine_every(sim, config, every, patterns, rate, ranked,
                                               call_us=lambda batch: refine_call_us(loaded, ds, batch))
        if out is not None:
            settings = {**asdict(config), "round_cost": config.cost.as_dict(), "traces": str(traces),
                        "bundle": str(bundle) if bundle else None, "split": split.value, "policies": chosen,
                        "requests": len(sim), "arrival_seeds": arrival_seeds}
            paths = write_outputs(rows, out, stem, settings, tails,
                                  None if refine_table is None else {"refine_every": refine_table})
            from dwise_predict.evaluation.simulation_report import write_simulation_report
            from dwise_predict.files import read_json_object

            saved = read_json_object(out / f"{stem}.json", StoreError, allow_nan=True)  # an undefined ρ is NaN
            paths += write_simulation_report(saved, {p.stem: p.read_bytes() for p in paths if p.suffix == ".png"}, out)
            for path in paths:
                log(f"wrote {path}")
    if ks:
        first, title = ("k", "k", "{:g}"), f"k sweep, {len(sim)} requests, B={slots}"
    elif rates:
        first, title = ("rate_rps", "rate req/s", "{:.2f}"), f"Load sweep, Poisson arrivals, B={slots}, k={k:g}"
    else:
        first, title = ("arrival", "arrival", "{}"), f"Simulated serving, {len(sim)} requests, B={slots}, k={k:g}"
    title += f"; round cost: {config.cost.source}"
    if json_out:
        typer.echo(json.dumps(rows if refine_table is None else {"rows": rows, "refine_every": refine_table}, indent=2))
    else:
        console(240).print(render_table(rows, title, first))
        if refine_table is not None:
            from dwise_predict.simulation.report import render_refine_table

            for table in render_refine_table(refine_table, f"Refinement every n rounds (seed 000 Table 6), {len(sim)} "
                                             f"requests, refinements up to round {refine_table['rounds_hidden']}; "
                                             "ρ: mean over rounds 1..N of ρ(r̂ held, rounds left)"):
                console(240).print(table)
        if not rates and not ks:
            from dwise_predict.simulation.simulator import gain_decomposition

            for g in gain_decomposition(rows):
                typer.echo(f"{g['arrival']}: {g['step']} ({g['from']} → {g['to']}): {g['gain']:.2f}x")
        if rates:
            from dwise_predict.simulation.simulator import ranking_pays_from

            start = ranking_pays_from(rows)
            typer.echo("ranking never beats fcfs-mixed by 5 % at these rates" if start is None else
                       f"ranking beats fcfs-mixed by >= 5 % from {start:.3g} req/s up; below it ranking stops paying")


def _refine_periods(text: str | None, problems: list[str]) -> list[int]:
    """``--refine-every 1,2,4,8`` as whole round counts >= 1 (a problem noted otherwise)."""
    if text is None:
        return []
    try:
        periods = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        periods = []
    if not periods or min(periods) < 1:
        problems.append(f"--refine-every must be a comma list of whole round counts >= 1 (e.g. 1,2,4,8), got {text!r}")
        return []
    return list(dict.fromkeys(periods))


def _marker(out: Path, stem: str) -> str:
    """The JSON that makes ``out`` a simulate output: one already there (a replay, a load sweep and a k
    sweep may share a folder: each writes its own stem), else the one this run writes."""
    return next((name for name in OUTPUT_JSONS if (out / name).is_file()), f"{stem}.json")


def _trail_probe(ds):
    """The TRAIL-style probe of `evaluate` fitted on the train split, predicting the eval split (or None)."""
    split = ds.requests["split"].to_numpy()
    if not (split == "train").any() or not (split == "eval").any():
        log("no train split in the traces: scheduler trail is left out")
        return None
    from dwise_predict.evaluation.baselines import trail_probe

    return trail_probe(ds.subset(split == "train"), ds.subset(split == "eval"))
