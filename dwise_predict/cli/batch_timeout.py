"""Typer command `batch-timeout` (thin: pick the service times, call simulation.batch_timeout, print, write)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, SeedOption, console, log
from dwise_predict.errors import ConfigError

OUTPUT_JSON = "batch_timeout.json"  # always written: a folder holding it is a study the next run may replace
OUTPUT_FILES = ("batch_timeout.csv", OUTPUT_JSON, "batch_timeout.png")  # all a study's --out holds
# Monte Carlo sizes checked before anything is allocated (10**11 requests asked 745 GiB; a batch of
# 10**12 never filled and the run never ended)
MAX_REQUESTS = 10_000_000
MAX_BATCH_SIZE = 4096


def batch_timeout_command(
    service_times: Annotated[Optional[Path], typer.Option(help="Measured batch service times: JSON list, {\"batch_size\": B, \"service_s\": [...]}, or one number per line.")] = None,
    traces: Annotated[Optional[Path], typer.Option(help="Derive service times from these traces and --round-profile: synchronized batches of B requests drawn from the eval split.")] = None,
    round_profile: Annotated[Optional[Path], typer.Option(help="Round-cost profile JSON (with --traces): `dwise-predict profile-rounds` or your GPU's.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="B, requests per batch (default: the file's, 8 for the paper's figures).")] = None,
    paper_mean: Annotated[float, typer.Option(help="Without a file or traces: mean batch service time S, s (seed 001: 8.74).")] = 8.74,
    paper_cv: Annotated[float, typer.Option(help="Without a file or traces: CV of the service time (seed 001: 0.266).")] = 0.266,
    rhos: Annotated[str, typer.Option(help="Utilisations ρ = λS/B to simulate, comma list.")] = "0.30,0.50,0.70,0.85,0.95",
    timeout: Annotated[Optional[float], typer.Option("--timeout", "-T", help="A batch timeout T (s) to judge at each ρ: stable or diverging.")] = None,
    requests: Annotated[int, typer.Option(help="Requests per Monte Carlo run (seed 001: 20,000).")] = 20_000,
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write batch_timeout.csv/.json/.png here.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Seed 001's batch-timeout rule for fixed-fill synchronized batching: T_min = S − 1/λ.

    Prints, per utilisation ρ, the closed-form minimum safe timeout, the exact one with the batch
    cap B, and Monte Carlo latency percentiles under pure fixed fill (mean latency is U-shaped in
    ρ); with --timeout, whether that T keeps the queue stable at each ρ.

    Examples:

        dwise-predict batch-timeout --timeout 8

        dwise-predict batch-timeout --service-times b8_service.json --out bt/

        dwise-predict batch-timeout --traces traces/ --round-profile profile.json --batch-size 8
    """
    from contextlib import nullcontext

    from dwise_predict.files import claim_output
    from dwise_predict.simulation import batch_timeout as bt

    problems = []
    try:
        rho_list = [float(x) for x in rhos.split(",") if x.strip()]
        if not rho_list or any(not r > 0 or not math.isfinite(r) for r in rho_list):
            problems.append(f"--rhos must be positive numbers, got {rhos!r}")
    except ValueError:
        problems.append(f"--rhos must be a comma list of numbers, got {rhos!r}")
    if service_times is not None and traces is not None:
        problems.append("--service-times and --traces conflict: give one source of service times")
    if (traces is None) != (round_profile is None):
        problems.append("--traces and --round-profile go together")
    if batch_size is not None and not 1 <= batch_size <= MAX_BATCH_SIZE:
        problems.append(f"--batch-size must lie in 1..{MAX_BATCH_SIZE:,}, got {batch_size:,}")
    if timeout is not None and not timeout >= 0:
        problems.append(f"--timeout must be >= 0 seconds, got {timeout}")
    if not 100 <= requests <= MAX_REQUESTS:
        problems.append(f"--requests must lie in 100..{MAX_REQUESTS:,}, got {requests:,}")
    if problems:
        raise ConfigError("; ".join(problems))

    inputs = [("--service-times", service_times), ("--traces", traces), ("--round-profile", round_profile)]
    claim = (claim_output(out, inputs, "a batch-timeout study", OUTPUT_JSON, replace=True, contents=OUTPUT_FILES)
             if out else nullcontext())
    with claim:
        if service_times is not None:
            service = bt.load_service_times(service_times, batch_size)
        elif traces is not None:
            from dwise_predict.simulation.round_cost import load_round_cost
            from dwise_predict.simulation.simulator import sim_requests_from_traces, sync_batch_service_times
            from dwise_predict.traces import load_traces

            cost = load_round_cost(round_profile)
            sim = sim_requests_from_traces(load_traces(traces), "eval")
            service = sync_batch_service_times(sim, cost, batch_size or 8, seed=seed)
        else:
            service = bt.paper_service_times(mean_s=paper_mean, cv=paper_cv, batch_size=batch_size or 8)
        log(f"service times: {service.source} (S = {service.mean:.3g} s, CV = {service.cv:.3f}, B = {service.batch_size})")
        rows = bt.timeout_study(service, rho_list, timeout, requests, seed)
        settings = {"source": service.source, "batch_size": service.batch_size, "mean_s": service.mean,
                    "cv": service.cv, "samples": service.samples.tolist(), "requests": requests, "seed": seed,
                    "timeout_s": timeout}
        if out is not None:
            from dwise_predict.files import atomic_write_bytes, write_csv, write_errors
            from dwise_predict.simulation.report import batch_timeout_plot

            with write_errors(out, "free space or fix permissions and rerun the same command"):
                out.mkdir(exist_ok=True)
                # the JSON first: it marks the folder as a study, so a rerun after a kill replaces it
                atomic_write_bytes(out / OUTPUT_JSON, json.dumps({"settings": settings, "rows": rows}, indent=2).encode())
                write_csv(out / "batch_timeout.csv", rows)
                atomic_write_bytes(out / "batch_timeout.png", batch_timeout_plot(rows, f"{service.source}"))
            log(f"wrote {out / 'batch_timeout.csv'}, .json, .png")
    if json_out:
        typer.echo(json.dumps({"settings": settings, "rows": rows}, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"Fixed-fill batching, B={service.batch_size}, S={service.mean:.3g} s, CV={service.cv:.3f}, {requests} requests")
    columns = ["ρ", "λ req/s", "T_min s", "T_min (cap B) s", "mean s", "p50 s", "p95 s", "p99 s", "max s"]
    if timeout is not None:
        columns += [f"T={timeout:g}: verdict", "mean at T s"]
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        cells = [f"{r['rho']:.2f}", f"{r['rate_rps']:.3f}", f"{r['t_min_s']:.2f}", f"{r['t_min_capped_s']:.2f}",
                 f"{r['mean_s']:.2f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}", f"{r['p99_s']:.2f}", f"{r['max_s']:.2f}"]
        if timeout is not None:
            word = "stable" if r["stable"] else "UNSTABLE"
            if r["stable"] == r["mc_diverging"]:
                word += " (MC disagrees)"
            cells += [word, f"{r['mean_at_timeout_s']:.3g}"]
        table.add_row(*cells)
    console(200).print(table)
    best = min(rows, key=lambda r: r["mean_s"])
    typer.echo(f"lowest mean latency under fixed fill at ρ = {best['rho']:.2f} ({best['mean_s']:.2f} s); "
               "a timeout below T_min lets underfilled batches outrun the server and latency diverges")
