"""Typer command `refresh`: retrain on recent recordings, publish only a winner (thin over dwise_predict.refresh)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import JsonOption, SeedOption, checked_traces, console, log, table
from dwise_predict.evaluation.document import fmt, fmt_interval
from dwise_predict.refresh import RefreshConfig
from dwise_predict.text import terminal

_DEFAULT = RefreshConfig()
_LABELS = {"admission_rho": "admission ρ", "refined_rho": "refined ρ", "within_category_rho": "within-category ρ (refined)",
           "calibration_ratio": "calibration (median refined / actual)", "mean_latency_s": "simulated mean latency (s)"}


def refresh_command(
    recordings: Annotated[list[Path], typer.Argument(help="Recordings of live traffic (`serve --record` directories, one per DP rank: merged), or trace directories of recent requests.", callback=checked_traces)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Refresh directory: candidate/, run/, refresh.json (rerun to resume).")],
    bundle: Annotated[Optional[Path], typer.Option(help="The serving bundle (instead of --zoo/--name).")] = None,
    zoo: Annotated[Optional[Path], typer.Option(help="Zoo directory: the serving bundle is --name's latest version there, and a winner is published there.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Bundle name in --zoo (with --bundle: the name to publish under; default: the bundle's own).")] = None,
    traces: Annotated[Optional[Path], typer.Option(help="The original training traces: their train split joins the window's.", callback=checked_traces)] = None,
    window: Annotated[Optional[int], typer.Option(min=1, help="Take the N most recent recorded requests (default: all).")] = None,
    round_profile: Annotated[Optional[Path], typer.Option(help="The server's round-cost profile (`dwise-predict profile-rounds`) for the simulated latency (default: the simulator's cost).")] = None,
    slots: Annotated[int, typer.Option(min=1, help="Simulated server: B block slots per round.")] = _DEFAULT.slots,
    k: Annotated[float, typer.Option(min=1.0, help="Simulated server: at most k·B resident requests.")] = _DEFAULT.k,
    seed: SeedOption = _DEFAULT.seed,
    bootstrap: Annotated[int, typer.Option(min=100, help="Paired bootstrap resamples behind every interval.")] = _DEFAULT.bootstrap,
    publish: Annotated[Optional[bool], typer.Option("--publish/--no-publish", help="Publish a winning candidate into --zoo as --name's next version (default: publish when --zoo is given).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Retrain the predictor on recent live traffic with the serving bundle's recipe, judge the
    candidate against the serving bundle on held-out recorded requests, and publish it only when it wins.

    The window's requests are split by request id (20 % held out, never trained on). Both bundles are
    scored there side by side: admission, refined and within-category ρ, calibration, and the mean
    latency DWISE reaches when each one's estimates schedule the held-out requests as a burst, each
    difference with a paired bootstrap interval. The candidate is published when the refined-ρ
    difference's interval lies above 0 and its simulated latency is not worse beyond its interval;
    OUT/refresh.json records the figures, the decision and why. Too few requests to judge is refused.
    Interrupt it and rerun the same command: it resumes, and never publishes one candidate twice.

    Examples:

        dwise-predict refresh rec/dp0 rec/dp1 --zoo zoo/ --name tiny --out refresh/

        dwise-predict refresh rec/ --zoo zoo/ --name tiny --traces traces/ --window 2000 --round-profile h200.json --out refresh/

        dwise-predict refresh rec/ --bundle bundle/ --out refresh/ --json
    """
    from dwise_predict.refresh import Sources, refresh

    config = RefreshConfig(window=window, seed=seed, bootstrap=bootstrap, slots=slots, k=k, publish=publish)
    sources = Sources(tuple(recordings), bundle=bundle, zoo=zoo, name=name, traces=traces, round_profile=round_profile)
    record = refresh(sources, out, config, log=log)
    if json_out:
        typer.echo(json.dumps(record, indent=2))
    else:
        _print_refresh(record, out)


def _print_refresh(record: dict, out: Path) -> None:
    """The side-by-side table, the decision and why, and what was written."""
    serving, window = record["serving"], record["window"]
    title = (f"refresh: candidate vs serving {terminal(str(serving['name']))} {terminal(serving['version'])} on "
             f"{window['held_out']} held-out requests (trained on {window['training']})")
    summary = table(title, ("measure", "serving", "candidate", "candidate − serving", "95% interval"))
    for key, label in _LABELS.items():
        difference = record["differences"][key]
        summary.add_row(label, fmt(record["figures"]["serving"][key]), fmt(record["figures"]["candidate"][key]),
                        fmt(difference["difference"]), fmt_interval(difference["interval"]))
    screen = console()
    screen.print(summary)
    screen.print(f"decision: {record['decision']}: {terminal(record['why'])}")
    screen.print(f"recipe: {terminal(record['recipe']['source'])}; round cost: "
                 f"{terminal(record['simulation']['round_cost']['source'])}")
    screen.print(f"written: {terminal(str(out / 'refresh.json'))}, candidate bundle {terminal(record['candidate'])}")
