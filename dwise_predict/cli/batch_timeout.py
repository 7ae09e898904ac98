"""Typer command `batch-timeout` (thin: check the flags, call simulation.studies.run_batch_timeout, print)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, SeedOption, checked_traces, comma_list, console, log
from dwise_predict.errors import ConfigError

# Monte Carlo sizes checked before anything is allocated (10**11 requests asked 745 GiB; a batch of
# 10**12 never filled and the run never ended)
MAX_REQUESTS = 10_000_000
MAX_BATCH_SIZE = 4096


def batch_timeout_command(
    service_times: Annotated[Optional[Path], typer.Option(help="Measured batch service times: JSON list, {\"batch_size\": B, \"service_s\": [...]}, or one number per line.")] = None,
    traces: Annotated[Optional[Path], typer.Option(help="Derive service times from these traces and --round-profile: synchronized batches of B requests drawn from the eval split.", callback=checked_traces)] = None,
    round_profile: Annotated[Optional[Path], typer.Option(help="Round-cost profile JSON (with --traces): `dwise-predict profile-rounds` or your GPU's.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="B, requests per batch (default: the file's, 8 for the paper's figures).")] = None,
    paper_mean: Annotated[float, typer.Option(help="Without a file or traces: mean batch service time S, s (Amin et al.: 8.74).")] = 8.74,
    paper_cv: Annotated[float, typer.Option(help="Without a file or traces: CV of the service time (Amin et al.: 0.266).")] = 0.266,
    rhos: Annotated[str, typer.Option(help="Utilisations ρ = λS/B to simulate, comma list.")] = "0.30,0.50,0.70,0.85,0.95",
    timeout: Annotated[Optional[float], typer.Option("--timeout", "-T", help="A batch timeout T (s) to judge at each ρ: stable or diverging.")] = None,
    requests: Annotated[int, typer.Option(help="Requests per Monte Carlo run (Amin et al.: 20,000).")] = 20_000,
    seed: SeedOption = 0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write batch_timeout.csv/.json/.png here.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Amin et al.'s batch-timeout rule for fixed-fill synchronized batching: T_min = S − 1/λ.

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
    from dwise_predict.simulation.report import BATCH_TIMEOUT_FILES, BATCH_TIMEOUT_JSON, render_batch_timeout_table
    from dwise_predict.simulation.studies import run_batch_timeout

    rho_list = _checked_rhos(rhos, service_times, traces, round_profile, batch_size, timeout, requests)
    inputs = [("--service-times", service_times), ("--traces", traces), ("--round-profile", round_profile)]
    claim = (claim_output(out, inputs, "a batch-timeout study", BATCH_TIMEOUT_JSON, replace=True,
                          contents=BATCH_TIMEOUT_FILES) if out else nullcontext())
    with claim:
        study = run_batch_timeout(rho_list, service_times=service_times, traces=traces, round_profile=round_profile,
                                  batch_size=batch_size, paper_mean=paper_mean, paper_cv=paper_cv, timeout=timeout,
                                  requests=requests, seed=seed, out=out, log=log)
        if out is not None:
            log(f"wrote {out / 'batch_timeout.csv'}, .json, .png")
    if json_out:
        typer.echo(json.dumps({"settings": study.settings, "rows": study.rows}, indent=2))
        return
    console(200).print(render_batch_timeout_table(study.rows, study.service, requests, timeout))
    best = min(study.rows, key=lambda r: r["mean_s"])
    typer.echo(f"lowest mean latency under fixed fill at ρ = {best['rho']:.2f} ({best['mean_s']:.2f} s); "
               "a timeout below T_min lets underfilled batches outrun the server and latency diverges")


def _checked_rhos(rhos: str, service_times, traces, round_profile, batch_size, timeout, requests) -> list[float]:
    """``--rhos`` as numbers, the other flags checked beside it; every problem at once, as one
    :class:`ConfigError`."""
    problems = []
    rho_list = comma_list(rhos, float, "--rhos", "numbers", problems)
    if rho_list is not None and (not rho_list or any(not r > 0 or not math.isfinite(r) for r in rho_list)):
        problems.append(f"--rhos must be positive numbers, got {rhos!r}")
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
    return rho_list
