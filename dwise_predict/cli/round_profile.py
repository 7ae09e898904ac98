"""Typer command `profile-rounds` (thin: load a model, time its rounds, fit, write the profile)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dwise_predict.cli.options import JsonOption, comma_list, log
from dwise_predict.errors import ConfigError, InputError


def profile_rounds_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write (read by simulate --round-profile).")] = Path("round_profile.json"),
    model: Annotated[str, typer.Option(help="`tiny` (built-in dLLM) or a local model directory.")] = "tiny",
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1 ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    rows: Annotated[str, typer.Option(help="Row totals per round to time, comma list.")] = "1,2,4,8,16,32,64",
    context_blocks: Annotated[int, typer.Option(help="Cached blocks behind every row.")] = 4,
    repeats: Annotated[int, typer.Option(help="Timed runs per round shape (the median is kept).")] = 5,
    threads: Annotated[int, typer.Option(help="torch CPU threads.")] = 1,
    json_out: JsonOption = False,
) -> None:
    """Measure a model's round time against prefill and denoising rows; write the simulator's round-cost profile.

    The fit `ms = base + prefill_block_ms x prefill rows + decode_block_ms x decode rows` is printed
    and the profile (raw samples, source, device, model fingerprint) is written for
    `dwise-predict simulate --round-profile`. On a GPU server, run it there, or write the same JSON
    from your own measurements of SGLang (docs/serving.md).

    Examples:

        dwise-predict profile-rounds --out tiny_cpu_profile.json

        dwise-predict profile-rounds --model /models/sdar-1.7b --device cuda --dtype bfloat16 --out sdar_h200.json
    """
    problems = []
    row_list = comma_list(rows, int, "--rows", "integers", problems)
    if row_list is not None and (not row_list or min(row_list) < 1):
        problems.append(f"--rows must be positive integers, got {rows!r}")
    for flag, value, low in (("--context-blocks", context_blocks, 0), ("--repeats", repeats, 1), ("--threads", threads, 1)):
        if value < low:
            problems.append(f"{flag} must be >= {low}, got {value}")
    if problems:
        raise ConfigError("; ".join(problems))
    _refuse_inside_an_output(out)

    import torch

    from dwise_predict.collectors.backends import TINY, load_backend
    from dwise_predict.collectors.round_profile import claim_profile_out, measure_round_profile
    from dwise_predict.files import atomic_write_bytes, write_errors
    from dwise_predict.simulation.round_cost import round_cost_from_profile

    with claim_profile_out(out, [("--model", None if model == TINY else model)]):
        torch.set_num_threads(threads)
        backend = load_backend(model, dtype=dtype, device=device)
        profile = measure_round_profile(backend, row_list, context_blocks, repeats, progress=log)
        cost = round_cost_from_profile(profile)
        profile["fit"] = cost.as_dict()
        with write_errors(out, "free space or fix permissions and rerun the same command"):
            atomic_write_bytes(out, json.dumps(profile, indent=2).encode())
    log(f"wrote {out}")
    if json_out:
        typer.echo(json.dumps(profile["fit"], indent=2))
    else:
        typer.echo(f"round ms = {cost.base_ms:.3f} + {cost.prefill_block_ms:.3f} x prefill rows + "
                   f"{cost.decode_block_ms:.3f} x decode rows (rmse {cost.fit_rmse_ms:.3f} ms over {cost.samples} shapes)")
        typer.echo(f"source: {cost.source}")


def _refuse_inside_an_output(out: Path) -> None:
    """A profile dropped into a trace dataset, a run or a bundle is not theirs: the next rewrite of
    that directory loses it, and a checker of its files may take it for damage."""
    from dwise_predict.bundles.manifest import BUNDLE_FILE
    from dwise_predict.runs import RUN_MARKER
    from dwise_predict.traces.dataset import MANIFEST_FILE, REQUESTS_FILE

    kinds = {"a trace dataset": (MANIFEST_FILE, REQUESTS_FILE), "a run directory": (RUN_MARKER,),
             "a bundle": (BUNDLE_FILE,)}
    for folder in Path(out).resolve().parents:
        for what, markers in kinds.items():
            if all((folder / m).is_file() for m in markers):
                raise InputError(f"--out {out} lies inside {what} ({folder}): write the profile outside it")
