"""Typer commands `collect`, `traces merge|show` and `workload show` (thin: parse, call the library, print)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import SEED_RANGE, JsonOption, checked_traces
from dwise_predict.cli.progress import ProgressLines
from dwise_predict.collectors.records import DecodingConfig
from dwise_predict.engine.algorithms import read_algorithm_file
from dwise_predict.errors import ConfigError
from dwise_predict.files import loads_json
from dwise_predict.text import terminal, visible

_DEFAULT = DecodingConfig()


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


OutOption = Annotated[Path, typer.Option("--out", "-o", help="Output trace directory (created, or resumed).")]


def collect_command(
    out: OutOption,
    model: Annotated[str, typer.Option(help="`tiny` (built-in dLLM) or a local model directory.")] = "tiny",
    workload: Annotated[str, typer.Option(help="Preset (tiny-default, dwise-paper) or a workload spec file.")] = "tiny-default",
    limit: Annotated[Optional[int], typer.Option(help="Take only the first N requests (a quick try).")] = None,
    seed: Annotated[int, typer.Option(**SEED_RANGE, help="Workload sampling / split seed (also seeds sampling backends).")] = 0,
    batch_size: Annotated[Optional[int], typer.Option(help=f"Requests decoded together (slots; default: {_DEFAULT.batch_size}). D2F decodes one at a time.")] = None,
    algorithm: Annotated[Optional[str], typer.Option(help="SGLang dLLM algorithm: LowConfidence, JointThreshold or JointThresholdInDel (default: what SGLang serves the model with); or D2F, our pipeline of blocks for Amin et al.'s measurements, which SGLang does not serve (parameters add_threshold 0.5, decode_threshold 0.9, confidence_threshold 1.0; one request at a time; docs/backends.md).")] = None,
    algorithm_config: Annotated[Optional[str], typer.Option(help='The algorithm\'s parameters as a JSON object (e.g. \'{"threshold": 0.9}\') or a file read as SGLang reads --dllm-algorithm-config (YAML or JSON; its block_size sets the block size; vectorized_decoding and capture_input_preparation change no decision and are dropped; a key the algorithm does not read is refused, where SGLang ignores it).')] = None,
    threshold: Annotated[Optional[float], typer.Option(help="Shorthand for the algorithm's threshold parameter.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Tokens per block (default: the model's).")] = None,
    budget: Annotated[int, typer.Option(help="Output budget in tokens (unless the workload sets one).")] = _DEFAULT.budget,
    dtype: Annotated[Dtype, typer.Option(help="Model dtype.")] = Dtype(_DEFAULT.dtype),
    device: Annotated[str, typer.Option(help="torch device (cpu, cuda, cuda:1, ...).")] = "cpu",
    shard: Annotated[Optional[str], typer.Option(help="i/N: decode only part i of N (merge with `traces merge`). Parts are meant to run side by side: each runs torch on one thread (an unsharded run uses every core it may run on).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model directory's own Python code (LLaDA2, SDAR, Dream).")] = False,
    requests_per_shard: Annotated[Optional[int], typer.Option(help="Requests per committed shard (default: 8 x batch size).")] = None,
    allow_missing: Annotated[bool, typer.Option(help="Collect the sources that are available when some of the workload's datasets are missing (they are listed in the manifest).")] = False,
    allow_network: Annotated[bool, typer.Option(help="Let hub datasets download (default: local cache only, or what the workload spec's allow_network says).")] = False,
    layers: Annotated[Optional[str], typer.Option(help="Also keep the first round at these layers, comma-separated: 0 = embedding output, -1 = the final hidden state first_round pools (transformers' output_hidden_states order); tensors first_round.layer{L}.{pooling} in hidden.safetensors, for `evaluate --ablate layers|pooling`.")] = None,
    pooling: Annotated[Optional[str], typer.Option(help="Poolings of the --layers rows, comma-separated (default: mean): mean, last (the block's last row), positions (every row of the block).")] = None,
    rounds_hidden: Annotated[Optional[int], typer.Option(help="Also keep the pooled state and early signals of each request's first N denoising rounds (tensors round_states, round_signals; column rounds_recorded), for `simulate --refine-every`.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Decode a workload with an instrumented dLLM into a trace dataset (resumable).

    Rerunning the same command resumes: finished requests are kept, only missing ones are decoded.

    Torch threads: every core this process may run on, one per --shard part; OMP_NUM_THREADS, when set, wins (threads change no result).

    Examples:

        dwise-predict collect --out traces/

        dwise-predict collect --model ./my-llada --trust-remote-code --workload dwise-paper --device cuda --out traces/

        dwise-predict collect --out part0/ --shard 0/2   # and --shard 1/2, then: dwise-predict traces merge part0 part1 --out traces/

        dwise-predict collect --out traces/ --layers 0,2,-1 --pooling mean,last,positions

        dwise-predict collect --out traces/ --rounds-hidden 8   # then: simulate --refine-every 1,2,4,8

        dwise-predict collect --algorithm D2F --out d2f/   # then: characterize d2f/ base/ --split-decodings
    """
    from dwise_predict.collectors.collect import check_rounds_hidden, collect, parse_shard
    from dwise_predict.collectors.workloads import MAX_LIMIT
    from dwise_predict.collectors.layers import parse_layer_request

    problems = _d2f_batch_problem(algorithm, batch_size)
    batch_size = _DEFAULT.batch_size if batch_size is None else batch_size
    try:
        params = _algorithm_config(algorithm_config)
        if threshold is not None:
            params["threshold"] = threshold
        decoding = DecodingConfig(algorithm=algorithm, algorithm_config=params, block_size=block_size,
                                  budget=budget, dtype=dtype.value, batch_size=batch_size)
    except ConfigError as err:
        problems.append(str(err))
    for check in (lambda: parse_shard(shard), lambda: parse_layer_request(layers, pooling),
                  lambda: check_rounds_hidden(rounds_hidden)):
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    if limit is not None and not 0 < limit <= MAX_LIMIT:
        problems.append(f"--limit must be a whole number of requests from 1 to {MAX_LIMIT:,}, got {limit}")
    if requests_per_shard is not None and requests_per_shard <= 0:
        problems.append(f"--requests-per-shard must be positive, got {requests_per_shard}")
    if problems:
        raise ConfigError("; ".join(problems))

    with CollectProgressBar() as bar:
        path = collect(model, workload, out, decoding, seed=seed, limit=limit, shard=shard, progress=bar.update,
                       device=device, trust_remote_code=trust_remote_code, requests_per_shard=requests_per_shard,
                       allow_missing=allow_missing, allow_network=allow_network or None, layers=layers,
                       pooling=pooling, rounds_hidden=rounds_hidden)
    _print_summary(path, json_out)


def _d2f_batch_problem(algorithm: str | None, batch_size: int | None) -> list[str]:
    """D2F's loop decodes one request at a time: a --batch-size other than 1 with it is refused, never ignored."""
    from dwise_predict.engine.d2f import D2F

    if algorithm != D2F.name or batch_size in (None, 1):
        return []
    return [f"--batch-size {batch_size} does not apply to --algorithm D2F, which decodes one request at a time "
            "(each request's own latency, as Amin et al. measured it): drop --batch-size"]


def _algorithm_config(value: str | None) -> dict:
    """``--algorithm-config``: a JSON object given inline, or a file read as SGLang reads its
    ``--dllm-algorithm-config`` (YAML; JSON is YAML too)."""
    if value is None:
        return {}
    if not value.lstrip().startswith("{"):
        if not Path(value).is_file():
            raise ConfigError(f"--algorithm-config {value!r} is neither a JSON object nor a file: pass e.g. "
                              "'{\"threshold\": 0.9}' or the server's --dllm-algorithm-config file")
        return read_algorithm_file(value, "--algorithm-config")
    params = loads_json(value, ConfigError, "--algorithm-config")
    if not isinstance(params, dict):
        raise ConfigError(f"--algorithm-config must be a JSON object, got {type(params).__name__}")
    return params


def merge_command(
    dirs: Annotated[list[Path], typer.Argument(help="Collection directories (e.g. one per --shard).", callback=checked_traces)],
    out: OutOption,
    json_out: JsonOption = False,
) -> None:
    """Combine collection directories into one trace dataset (same model and decoding config only).

    Examples:

        dwise-predict traces merge part0/ part1/ --out traces/
    """
    from dwise_predict.collectors.store import merge

    _print_summary(merge(dirs, out), json_out)


def show_command(
    path: Annotated[Path, typer.Argument(help="A trace directory (consolidated, or still collecting).", callback=checked_traces)],
    json_out: JsonOption = False,
) -> None:
    """Summarise a trace dataset per category: rounds, output tokens, finish reasons, accuracy.

    Examples:

        dwise-predict traces show traces/

        dwise-predict traces show traces/ --json | jq '.categories[-1]'
    """
    _print_summary(path, json_out)


traces_app = typer.Typer(help="Inspect and combine trace datasets.", no_args_is_help=True)
traces_app.command("merge")(merge_command)
traces_app.command("show")(show_command)


workload_app = typer.Typer(
    help="Inspect workload presets and spec files.\n\nExamples:\n\n    dwise-predict workload show dwise-paper --allow-missing",
    no_args_is_help=True,
)


@workload_app.command("show")
def workload_show_command(
    spec: Annotated[str, typer.Argument(help="Preset (tiny-default, dwise-paper) or a .toml/.yaml spec file.")] = "tiny-default",
    seed: Annotated[int, typer.Option(**SEED_RANGE, help="Workload sampling / split seed.")] = 0,
    limit: Annotated[Optional[int], typer.Option(help="Take only the first N requests.")] = None,
    head: Annotated[int, typer.Option(help="Also list the first N requests (id, split, prompt start).")] = 0,
    allow_missing: Annotated[bool, typer.Option(help="Show the sources that are here instead of failing on missing ones.")] = False,
    allow_network: Annotated[bool, typer.Option(help="Let hub datasets download (default: local cache only, or what the workload spec's allow_network says).")] = False,
    json_out: JsonOption = False,
) -> None:
    """Load a workload and print its composition per source, category and split.

    Examples:

        dwise-predict workload show

        dwise-predict workload show dwise-paper --allow-missing

        dwise-predict workload show my-mix.toml --seed 1 --head 5 --json
    """
    from rich.console import Console
    from rich.table import Table

    from dwise_predict.collectors.workloads import load_workload

    workload = load_workload(spec, seed=seed, limit=limit, allow_missing=allow_missing,
                             allow_network=allow_network or None)
    comp = workload.composition()
    if json_out:
        comp["head"] = [
            {"request_id": r.request_id, "split": r.split, "prompt": r.prompt} for r in workload.requests[:head]
        ]
        typer.echo(json.dumps(comp, indent=2))
        return
    table = Table(title=f"workload {terminal(comp['name'])} (seed {comp['seed']})")
    for column in ("source", "type", "category", "train", "eval"):
        table.add_column(column, justify="right" if column in ("train", "eval") else "left")
    for name, entry in comp["sources"].items():
        table.add_row(*map(terminal, (name, entry.get("type", ""), entry.get("category", ""))), str(entry["train"]),
                      str(entry["eval"]))
    table.add_section()
    table.add_row("total", "", f"{len(comp['categories'])} categories", str(comp["train"]), str(comp["eval"]))
    console = Console()
    console.print(table)
    for line in comp["missing"]:
        console.print(f"[yellow]missing[/yellow] {terminal(line)}", highlight=False)
    for r in workload.requests[:head]:
        console.print(f"{visible(r.request_id)}  {r.split:5}  {r.prompt[:70]!r}", highlight=False, markup=False)


def _print_summary(path: Path, json_out: bool) -> None:
    from dwise_predict.collectors.store import MIXED_SOURCES, mixed_sources_note
    from dwise_predict.collectors.summary import read_for_summary, summarize

    requests, manifest, complete = read_for_summary(path)
    rows = summarize(requests)
    model = manifest.get("model", {})
    decoding = manifest.get("decoding", {})
    if note := mixed_sources_note(path, manifest):  # a resume or merge across versions of this package
        typer.echo(note, err=True)
    if json_out:
        typer.echo(json.dumps({"path": str(path), "complete": complete, "model": model, "decoding": decoding,
                               "categories": rows, MIXED_SOURCES: manifest.get(MIXED_SOURCES)}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    params = ", ".join(f"{k} {v}" for k, v in (decoding.get("algorithm_config") or {}).items())
    rule = f"{decoding.get('algorithm')} ({params})" if params else str(decoding.get("algorithm"))
    title = (f"{path}: {len(requests)} requests, model {model.get('name')}, "
             f"{rule}, block {decoding.get('block_size')}, "
             f"budget {decoding.get('budget')}" + ("" if complete else " (still collecting: shards only)"))
    table = Table(title=terminal(title), title_justify="left")
    for name in ("category", "count", "train/eval", "rounds p10", "p50", "p90", "max", "out tokens", "eos/budget", "accuracy"):
        table.add_column(name, justify="left" if name == "category" else "right")
    for r in rows:
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.1%} ({r['checked']})"
        table.add_row(terminal(r["category"]), str(r["count"]), f"{r['train']}/{r['eval']}", f"{r['rounds_p10']:.0f}",
                      f"{r['rounds_p50']:.0f}", f"{r['rounds_p90']:.0f}", str(r["rounds_max"]),
                      f"{r['output_tokens_mean']:.1f}", f"{r['eos']}/{r['budget']}", accuracy,
                      end_section=r is rows[-2])
    Console(width=max(120, Console().width)).print(table)


class CollectProgressBar:
    """Collection progress on stderr (requests/s, rounds/s, ETA): a rich bar when stderr is a terminal,
    else a line at start, at the end and every so often between (:class:`~dwise_predict.cli.progress.ProgressLines`)."""

    def __enter__(self) -> "CollectProgressBar":
        self.progress = None
        self.task = None
        self.lines = ProgressLines("collect")
        if not self.lines.on:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("collect"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rates]}"), console=Console(stderr=True), transient=False,
            )
            self.progress.start()
        return self

    def update(self, state) -> None:
        rates = _rates(state)
        if self.progress is None:
            share = state.done / state.total if state.total else 1.0
            self.lines.count(state.done, state.total, f"{state.done}/{state.total} requests ({share:.0%})  {rates}",
                             state.elapsed_s)
        elif self.task is None:
            self.task = self.progress.add_task("collect", total=state.total, completed=state.done, rates=rates)
        else:
            self.progress.update(self.task, completed=state.done, rates=rates)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def _rates(state) -> str:
    fresh = state.done - state.resumed
    rate = fresh / state.elapsed_s if state.elapsed_s > 0 else 0.0
    eta = (state.total - state.done) / rate if rate > 0 else None
    return (f"{rate:.2f} req/s  {state.rounds / max(state.elapsed_s, 1e-9):.1f} rounds/s  "
            f"ETA {_clock(eta)}" + (f"  ({state.resumed} resumed)" if state.resumed else ""))


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
