"""Typer command `serve` (thin: build the hook config, call the launcher)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dwise_predict.cli.options import as_flags, log
from dwise_predict.errors import ConfigError
from dwise_predict.serving.launcher import HookConfig

_DEFAULT = HookConfig()


def serve_command(
    sglang_args: Annotated[Optional[list[str]], typer.Argument(help="SGLang's own server arguments, after `--` (as for `sglang serve` / `python -m sglang.launch_server`).")] = None,
    bundle: Annotated[Optional[Path], typer.Option(help="Predictor bundle (`dwise-predict export`): schedule with DWISE.")] = None,
    record: Annotated[Optional[Path], typer.Option(help="Recording mode: write contract-1 traces of the finished requests here (one subdirectory per DP rank; join them with `traces merge`).")] = None,
    slots: Annotated[int, typer.Option(help="B: requests per round (match SGLang's batch capacity).")] = _DEFAULT.slots,
    k: Annotated[float, typer.Option("--k", help="Resident-set multiplier; SGLang's --max-running-requests must be at least k*B.")] = _DEFAULT.k,
    kv_budget_tokens: Annotated[Optional[float], typer.Option(help="KV tokens for reservations (default: --kv-fraction of SGLang's pool).")] = None,
    kv_fraction: Annotated[float, typer.Option(help="Share of SGLang's KV pool DWISE reserves from.")] = _DEFAULT.kv_fraction,
    slack_blocks: Annotated[int, typer.Option(help="Extra blocks reserved per resident request.")] = _DEFAULT.slack_blocks,
    block_size: Annotated[Optional[int], typer.Option(help="SGLang's dLLM block size (default: the bundle's).")] = None,
    hidden_size: Annotated[Optional[int], typer.Option(help="The model's hidden size (recording without a bundle).")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Largest batch of one forward (default: the larger of --slots and the server's largest CUDA-graph batch or --max-running-requests).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer for the prompt features (default: SGLang's --tokenizer-path or --model-path).")] = None,
    record_every: Annotated[int, typer.Option(help="Most finished requests per committed trace shard.")] = _DEFAULT.record_every,
    record_flush_s: Annotated[float, typer.Option("--record-flush-s", help="Seconds after which a finished request is committed whatever the traffic: the most a scheduler process killed outright loses.")] = _DEFAULT.record_flush_s,
    prompt_cache: Annotated[int, typer.Option(help="Block rows kept (H floats each, on the GPU) for requests a prefix-cache hit leaves without a prompt block of their own; 0: none.")] = _DEFAULT.prompt_cache,
    aging: Annotated[float, typer.Option(help="Starvation guard: rounds of remaining work one round in the server is worth, so a long request cannot wait forever behind a stream of shorter ones (0: off; default chosen in docs/serving.md).")] = _DEFAULT.aging,
    max_wait: Annotated[int, typer.Option(help="Wait cap, in rounds: a request waiting longer for admission is admitted first, whatever its rank, and nobody else is admitted until it fits (0: off; default chosen in docs/serving.md). With SGLANG_REQ_WAITING_TIMEOUT set, requests waiting half that timeout are admitted first too.")] = _DEFAULT.max_wait,
    follow: Annotated[Optional[str], typer.Option(help="Hot swap: a bundle name in --follow-zoo (its latest version), or without --follow-zoo a bundle directory to watch; each scheduler serves a new bundle that fits the server from a step boundary on, no restart (needs --bundle to start from).")] = None,
    follow_zoo: Annotated[Optional[Path], typer.Option(help="The zoo --follow names a bundle in.")] = None,
    follow_poll_s: Annotated[float, typer.Option("--follow-poll-s", help="Seconds between two looks at --follow.")] = _DEFAULT.follow_poll_s,
    rollback_after: Annotated[int, typer.Option(help="Finished requests of a new version the live monitor compares with the old one's before keeping it (0: never roll back).")] = _DEFAULT.rollback_after,
    rollback_margin: Annotated[float, typer.Option(help="How far a new version's refined rank correlation may fall below the old one's before it is rolled back.")] = _DEFAULT.rollback_margin,
    monitor_window: Annotated[int, typer.Option(help="Finished requests the live quality monitor ranks (with --bundle): rank correlation of the served estimates, within-category correlation and calibration, on SGLang's /metrics under --enable-metrics and in a recording's manifest.")] = _DEFAULT.monitor_window,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the options, resolve SGLang's arguments as the server will (needs sglang), print the hook config it would run as JSON, start nothing; refuses in one line what serve would refuse (see --check).")] = False,
    check: Annotated[bool, typer.Option("--check", help="Resolve SGLang's arguments as the server will (needs sglang) and run every check the hook can pass before the model loads: the bundle against the served model (hidden size, block size, algorithm, config hash), k*B against the request rows of each scheduler, SGLang's scheduler surface, and, with DWISE_* variables set, whether SGLang's plugin loader would engage the plugin. Prints every problem as JSON, starts nothing, exits 1 on any.")] = False,
) -> None:
    """Run SGLang's HTTP server with the DWISE hook installed in every scheduler process.

    Serve in FDFO mode (--dllm-fdfo, SGLang's default: a scheduler step is then one round) with
    --max-running-requests at least k*B. Needs sglang==0.5.23 (CUDA) in this environment.

    Examples:

        dwise-predict serve --bundle bundle/ -- --model-path inclusionAI/LLaDA2.0-mini --dllm-algorithm LowConfidence --dllm-fdfo --max-running-requests 1024

        dwise-predict serve --bundle bundle/ --record traces/live -- --model-path ... --dllm-fdfo --dp-size 4

        dwise-predict serve --bundle bundle/ --check -- --model-path ... --dllm-algorithm LowConfidence --max-running-requests 1024

        dwise-predict serve --bundle pulled/ --follow tiny --follow-zoo zoo/ -- --model-path ... --dllm-fdfo

    With SGLang's own launcher instead, the same hook through its plugin (docs/serving.md):

        DWISE_BUNDLE=bundle/ python -m sglang.launch_server --model-path ... --dllm-fdfo
    """
    from dwise_predict.serving.launcher import plan, serve

    config = HookConfig(
        bundle=None if bundle is None else str(bundle), slots=slots, k=k, kv_budget_tokens=kv_budget_tokens,
        kv_fraction=kv_fraction, slack_blocks=slack_blocks, block_size=block_size, max_batch=max_batch,
        hidden_size=hidden_size, tokenizer=tokenizer, record=None if record is None else str(record),
        record_every=record_every, record_flush_s=record_flush_s, prompt_cache=prompt_cache, aging=aging,
        max_wait=max_wait, monitor_window=monitor_window, follow=follow,
        follow_zoo=None if follow_zoo is None else str(follow_zoo), follow_poll_s=follow_poll_s,
        rollback_after=rollback_after, rollback_margin=rollback_margin,
    )
    if check and dry_run:
        raise ConfigError("--check and --dry-run conflict: --check resolves and prints as --dry-run does, and checks more")
    asked = bundle is not None or record is not None
    problems = config.problems() if asked or not check else []  # --check alone: the plugin's DWISE_* config
    if problems:
        raise ConfigError("; ".join(problems))
    if bundle is not None:  # a hostile or broken bundle is refused here, before SGLang starts
        from dwise_predict.bundles.screen import open_bundle, screen_bundle

        screen_bundle(bundle, open_bundle(bundle))
    if check:
        _check(config if asked else None, list(sglang_args or []))
        return
    if dry_run:
        typer.echo(json.dumps(plan(config, list(sglang_args or [])), indent=2))
        return
    log(f"dwise-predict serve: SGLang with the DWISE hook ({'bundle ' + str(bundle) if bundle else 'r_hat = 0'}"
        f"{', following ' + follow if follow else ''}{', recording to ' + str(record) if record else ''})")
    serve(config, list(sglang_args or []))


def _check(config: HookConfig | None, sglang_args: list[str]) -> None:
    """``serve --check``: the report as JSON on stdout, each problem on stderr, exit 1 on any."""
    from dwise_predict.serving.preflight import check as check_server
    from dwise_predict.serving.preflight import report_problems

    report = check_server(config, sglang_args)
    if report["serve"] is not None:  # serve's own problems name its parameters: as its flags here
        report["serve"]["problems"] = [as_flags(problem) for problem in report["serve"]["problems"]]
    typer.echo(json.dumps(report, indent=2))
    for problem in report_problems(report):
        log(f"problem: {problem}")
    if not report["ok"]:
        raise typer.Exit(1)
