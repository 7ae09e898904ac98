"""Typer commands of the built-in tiny dLLM: the ``dwise-predict dllm`` group.

Commands are thin: they validate options, call one library function and print a summary (stdout);
progress goes to stderr. Heavy imports stay inside the bodies so ``--help`` is fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from dwise_predict.cli.options import SEED_RANGE, JsonOption

dllm_app = typer.Typer(
    name="dllm",
    help="The built-in tiny block-diffusion LM: train it, inspect it.",
    no_args_is_help=True,
)


@dllm_app.command("train-tiny")
def train_tiny_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Model directory to write (config, weights, tokenizer).")],
    seed: Annotated[int | None, typer.Option("--seed", **SEED_RANGE, help="Seed of initialisation, data and masking (default: the recipe's, 0).")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimiser steps (default: the shipped recipe's).")] = None,
    minutes: Annotated[
        float | None,
        typer.Option(help="Stop after this many minutes even if steps remain (the result then depends on "
                          "the machine's speed; the step count reached is recorded in training.json). "
                          "Rerunning trains on from there."),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads (default: the recipe's, 2; the weights depend on it).")
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(help="Autocast dtype of the forward pass, bfloat16 (the recipe's) or float32 (for CPUs "
                          "without native bf16 instructions, where bfloat16 runs slower; the weights differ)."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Train the tiny dLLM on the project's generated corpus (block-diffusion objective) and save it
    as a model directory that `AutoModel.from_pretrained` loads after `import dwise_predict.dllm`.

    With the defaults this reproduces the shipped weights (`dwise_predict/dllm/weights/`).
    Interrupt it and rerun the same command: it resumes from its last checkpoint (at most 250
    steps back) and ends with the same weights.

    Examples:

        dwise-predict dllm train-tiny --out models/tiny --seed 0

        dwise-predict dllm train-tiny --out /tmp/tiny-quick --steps 300 --minutes 2
    """
    from dwise_predict.dllm.train import CHECKPOINT_NAME, TinyTrainConfig, checkpoint_progress, train_tiny

    fields = {"max_minutes": minutes}
    for name, value in (("seed", seed), ("steps", steps), ("threads", threads), ("precision", precision)):
        if value is not None:
            fields[name] = value
    cfg = TinyTrainConfig(**fields)
    if (out / CHECKPOINT_NAME).is_file():
        done = checkpoint_progress(out / CHECKPOINT_NAME, cfg)["steps_done"]
        print(f"resuming the interrupted run in {out} at step {done} of {cfg.steps}", file=sys.stderr)
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("training", total=cfg.steps)
            result = train_tiny(cfg, out, progress=lambda step, _, loss: bar.update(
                task, completed=step, description=f"training, loss {loss:.3f}"))
    else:
        result = train_tiny(cfg, out, progress=_log_line)
    summary = {"out": str(result.out_dir), "steps": result.steps_done, "wall_s": round(result.wall_s, 1),
               "final_loss": round(result.final_loss, 4), "parameters": result.parameters,
               "resumed_from_step": result.resumed_from}
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tiny dLLM training")
    table.add_column("field")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key, str(value))
    Console().print(table)


def _log_line(step: int, steps: int, loss: float) -> None:
    """Progress without a terminal: one line on stderr every 500 steps."""
    if step % 500 == 0 or step == steps:
        print(f"step {step}/{steps} loss {loss:.3f}", file=sys.stderr, flush=True)
