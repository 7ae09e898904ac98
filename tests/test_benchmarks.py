"""Every benchmark's ``--smoke`` (its own code path on its smallest input), so that an API change that
breaks one fails the suite, and the table ``benchmarks/run_all.py`` (``make bench``) renders.

The benchmarks run in this process, ``main(["--smoke", "--json", PATH])`` each, once for the module:
torch, transformers and the training stack are imported once for all of them instead of once per
benchmark (10-20 s each on the busy 2-core machine). What they change in the process is put back:
torch's thread count here; ``collect_throughput`` takes its own timing wrappers off. The figures are
not held to their targets (a smoke run's sizes are not the targets'); what is asserted is that each
prints every figure beside its target with the verdict that figure earns, writes the same for the
table, and that the correctness figures hold (identical tables and values, identical tokens).
``hook_overhead`` starts SGLang's real server: its smoke is ``tests/live/test_hook_overhead_benchmark.py``.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402
from targets import MET, MISSED, NO_TARGET, Figure  # noqa: E402

LIVE = {"hook_overhead": ROOT / "tests" / "live" / "test_hook_overhead_benchmark.py"}
IN_PROCESS = tuple(name for name in run_all.BENCHMARKS if name not in LIVE)


@dataclass
class SmokeRun:
    printed: str
    record: dict | None
    error: str | None
    seconds: float


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, SmokeRun]:
    out = tmp_path_factory.mktemp("benchmarks")
    threads = torch.get_num_threads()
    runs = {}
    for name in IN_PROCESS:
        record, printed, error = out / f"{name}.json", io.StringIO(), None
        start = time.perf_counter()
        try:
            with redirect_stdout(printed):
                importlib.import_module(name).main(["--smoke", "--json", str(record)])
        except (Exception, SystemExit):  # argparse exits: one benchmark's failure is its own test's
            error = traceback.format_exc()
        finally:
            torch.set_num_threads(threads)
        found = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None
        runs[name] = SmokeRun(printed.getvalue(), found, error, time.perf_counter() - start)
    return runs


def figures(record: dict) -> list[Figure]:
    return [Figure(**{key: value for key, value in found.items() if key != "verdict"}) for found in record["figures"]]


def test_every_script_in_benchmarks_is_run_by_make_bench_or_is_a_helper():
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == set(run_all.BENCHMARKS) | set(run_all.HELPERS)


@pytest.mark.parametrize("name", sorted(LIVE))
def test_a_live_benchmark_takes_the_same_options_and_reports_its_figures(name):
    """Its smoke starts SGLang's real server (the live test runs it); here: its options and its report."""
    assert LIVE[name].is_file()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--smoke" in done.stdout and "--json PATH" in done.stdout, done.stdout
    assert f'report("{name}"' in (ROOT / "benchmarks" / f"{name}.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", IN_PROCESS)
def test_the_smoke_run_prints_each_figure_beside_its_target_and_writes_it(smoke_runs, name):
    run = smoke_runs[name]
    assert run.error is None, f"{name} --smoke failed:\n{run.error}\n{run.printed[-2000:]}"
    record = run.record
    assert record["benchmark"] == name and record["smoke"] is True
    found = figures(record)
    assert found and any(figure.target is not None for figure in found), record
    for figure, written in zip(found, record["figures"]):
        assert math.isfinite(figure.value) and figure.value >= 0, figure
        assert written["verdict"] == figure.verdict
        assert figure.verdict in ((MET, MISSED) if figure.target is not None else (NO_TARGET,))
        assert figure.line() in run.printed.splitlines(), f"{figure.line()!r} not printed:\n{run.printed}"
        if figure.unit == "rows":  # correctness figures (rows that differ where they must not): always 0
            assert figure.value == 0 and figure.verdict == MET, figure


def test_decoding_batched_gives_the_tokens_of_one_at_a_time(smoke_runs):
    details = smoke_runs["decode_throughput"].record["details"]
    assert details["identical_tokens"] is True
    assert (details["requests"], details["algorithm"], details["algorithm_config"]) == (8, None, {})


def test_per_request_dispatch_runs_one_decode_each_and_synchronized_one_forward_a_step(smoke_runs):
    """Known answers of the two modes (B = 1 and 2, both requests admitted at once): at B = 1 they are
    one decode; at B = 2 per-request dispatch issues each request's own forwards, and synchronized
    batching as many forwards as the longer request needs, one per round."""
    one, two = smoke_runs["dispatch_overhead"].record["details"]["modes"]
    assert (one["B"], two["B"]) == (1, 2)
    assert one["per_request_forwards"] == one["synchronized_forwards"]
    first, second = one["per_request_forwards"], two["per_request_forwards"] - one["per_request_forwards"]
    assert second > 0 and two["synchronized_forwards"] == max(first, second)
    assert one["tokens_differ"] == two["tokens_differ"] == 0


def test_the_table_renders_one_line_per_figure_between_the_markers(smoke_runs, tmp_path):
    rows = [{**run_all.new_row(name, True), "status": "ok", "figures": run.record["figures"]}
            for name, run in smoke_runs.items() if run.record is not None]
    rows.append({**run_all.new_row("hook_overhead", True), "status": "skipped", "note": "needs .venv-sglang"})
    docs = tmp_path / "results.md"
    docs.write_text(f"# Results\n\nbefore\n\n{run_all.render(None)}\n\nafter\n", encoding="utf-8")
    table = run_all.merged(tmp_path / "results.json", rows, smoke=True)
    assert [row["benchmark"] for row in table["benchmarks"]] == [
        name for name in run_all.BENCHMARKS if name in smoke_runs or name == "hook_overhead"]
    run_all.write_section(docs, run_all.render(table))
    once = docs.read_text(encoding="utf-8")
    run_all.write_section(docs, run_all.render(table))
    assert docs.read_text(encoding="utf-8") == once  # rendered, not appended
    assert once.startswith("# Results\n\nbefore\n\n" + run_all.BEGIN) and once.endswith(run_all.END + "\n\nafter\n")
    lines = once.splitlines()
    for row in rows:
        mine = [line for line in lines if line.startswith(f"| `{row['benchmark']}` |")]
        assert len(mine) == max(1, len(row["figures"])), (row["benchmark"], mine)
        for line, figure in zip(mine, row["figures"]):
            assert f"| {figure['verdict']} | {row['load_at_start']:.1f} |" in line, line
    assert "| `hook_overhead` | — | — | — | skipped: needs .venv-sglang |" in once
    assert "Smoke run" in once


def test_run_all_runs_a_benchmark_in_its_own_process_and_keeps_the_other_rows(tmp_path):
    results = tmp_path / "results.json"
    kept = {**run_all.new_row("train_time", True), "status": "failed", "note": "an earlier run"}
    results.write_text(json.dumps({"smoke": True, "benchmarks": [kept]}), encoding="utf-8")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--only",
                           "simulate_speed", "--results", str(results), "--docs", str(tmp_path / "results.md"),
                           "--logs", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    table = json.loads(results.read_text(encoding="utf-8"))
    assert [row["benchmark"] for row in table["benchmarks"]] == ["simulate_speed", "train_time"]
    ran = table["benchmarks"][0]
    assert ran["status"] == "ok" and ran["smoke"] is True and ran["details"]["requests"] == 128
    assert {key for key in ("machine", "commit", "date", "load_at_start", "wall_s") if ran.get(key) not in (None, "")} \
        == {"machine", "commit", "date", "load_at_start", "wall_s"}
    assert ran["figures"][0]["target"] == 10.0 and ran["figures"][0]["verdict"] in (MET, MISSED)
    assert (tmp_path / "results.md").read_text(encoding="utf-8") == run_all.render(table) + "\n"
    assert "target simulator, 26 runs, wall time <= 10 s (128 requests, B = 16): " in (
        tmp_path / "simulate_speed.log").read_text(encoding="utf-8")  # its output, kept beside the table


def test_the_docs_table_is_rendered_from_the_results_file_never_typed():
    text = run_all.DOCS.read_text(encoding="utf-8")
    start, end = text.index(run_all.BEGIN), text.index(run_all.END) + len(run_all.END)
    table = json.loads(run_all.RESULTS.read_text(encoding="utf-8")) if run_all.RESULTS.is_file() else None
    assert table is None or table["smoke"] is False  # a smoke run's figures never reach the docs
    assert text[start:end] == run_all.render(table)
