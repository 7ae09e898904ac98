"""Typer command `simulate` (thin: parse, call the simulator, print, write)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, console, log
from dwise_predict.errors import ConfigError
from dwise_predict.serving.simulator import SimConfig

_DEFAULT = SimConfig()


class Arrival(str, Enum):
    burst = "burst"
    burst_poisson = "burst-poisson"
    both = "both"


class Split(str, Enum):
    eval = "eval"
    train = "train"
    all = "all"


def simulate_command(
    traces: Annotated[Path, typer.Argument(help="Trace directory (contract 1) to replay.")],
    bundle: Annotated[Optional[Path], typer.Option(help="Predictor bundle: enables dwise-admission and dwise-refined.")] = None,
    policies: Annotated[Optional[str], typer.Option(help="Comma list of policies [default: all the bundle allows]: sglang-default, fcfs-mixed, dwise-zero, dwise-admission, dwise-refined, dwise-oracle.")] = None,
    arrival: Annotated[Arrival, typer.Option(help="Arrival pattern: burst, burst-poisson or both.")] = Arrival.both,
    rate: Annotated[Optional[str], typer.Option(help="Poisson rate for burst-poisson: req/s, or a multiple of SGLang-default's service rate like 1.5x [default: 1.5x].")] = None,
    rates: Annotated[Optional[str], typer.Option(help="Load sweep instead: Poisson arrivals at each rate of a comma list (req/s, or multiples of SGLang-default's service rate like 0.5x,1x,2x).")] = None,
    slots: Annotated[int, typer.Option(help="B: blocks per round (block slots).")] = _DEFAULT.slots,
    k: Annotated[float, typer.Option("--k", help="Resident-set multiplier: at most k*B requests hold KV.")] = _DEFAULT.k,
    kv_budget: Annotated[Optional[float], typer.Option(help="KV pool in blocks [default: unlimited].")] = _DEFAULT.kv_budget,
    kv_slack: Annotated[int, typer.Option(help="Extra blocks reserved per resident request.")] = _DEFAULT.kv_slack_blocks,
    round_ms: Annotated[float, typer.Option(help="Fixed cost of one round, ms.")] = _DEFAULT.round_ms,
    slot_ms: Annotated[float, typer.Option(help="Extra cost per block in a round, ms.")] = _DEFAULT.slot_ms,
    split: Annotated[Split, typer.Option(help="Which requests to replay.")] = Split.eval,
    seed: Annotated[int, typer.Option(help="Arrival order and Poisson times.")] = _DEFAULT.seed,
    backend: Annotated[str, typer.Option(help="Bundle backend for the predictions: onnx or torch.")] = "onnx",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write simulate.csv/.json/.png (or sweep.*) here.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Replay traces under SGLang's default scheduler, FCFS and DWISE variants; compare latency.

    Time is counted in rounds (one batched forward pass of B blocks) and in seconds by the model
    round = --round-ms + --slot-ms x blocks. The bundle must match the traces' model and decoding.
    Rates given as multiples (2x) are relative to SGLang-default's service rate on these traces.

    Examples:

        dwise-predict simulate traces/ --bundle bundle/ --out sim/

        dwise-predict simulate traces/ --arrival burst --slots 64 --k 4 --kv-budget 20000

        dwise-predict simulate traces/ --bundle bundle/ --rates 0.25x,0.5x,1x,2x,4x --out sweep/
    """
    from dataclasses import asdict

    from dwise_predict.serving.report import render_table, write_outputs
    from dwise_predict.serving.simulator import POLICIES, replay, sim_requests_from_traces
    from dwise_predict.files import refuse_aliasing
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
    if backend not in ("onnx", "torch"):
        problems.append(f"--backend must be onnx or torch, got {backend!r}")
    base = dict(slots=slots, k=k, kv_budget=kv_budget, kv_slack_blocks=kv_slack, round_ms=round_ms,
                slot_ms=slot_ms, seed=seed)
    try:
        config = SimConfig(**base)
    except ConfigError as err:
        problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))
    if out is not None:
        refuse_aliasing(out, [("TRACES", traces), ("--bundle", bundle)])

    ds = load_traces(traces)
    loaded = None
    if bundle is not None:
        from dwise_predict.serving.bundle import load_bundle

        loaded = load_bundle(bundle, backend=backend, expect_model=ds.model_fingerprint, expect_decoding=ds.decoding)
    requests = sim_requests_from_traces(ds, None if split is Split.all else split.value, loaded)
    patterns = ["burst", "burst-poisson"] if arrival is Arrival.both else [arrival.value]
    rows, chosen = replay(requests, config, chosen, patterns, rate, rates, log=log)
    if rates:
        stem, first = "sweep", ("rate_rps", "rate req/s", "{:.2f}")
        title = f"Load sweep, Poisson arrivals, B={slots}, k={k:g}"
    else:
        stem, first = "simulate", ("arrival", "arrival", "{}")
        title = f"Simulated serving, {len(requests)} requests, B={slots}, k={k:g}"
    if out is not None:
        settings = {**asdict(config), "traces": str(traces), "bundle": str(bundle) if bundle else None,
                    "split": split.value, "policies": chosen}
        for path in write_outputs(rows, out, stem, settings):
            log(f"wrote {path}")
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
    else:
        console(200).print(render_table(rows, title, first))
