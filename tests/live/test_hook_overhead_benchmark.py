"""``benchmarks/hook_overhead.py --smoke`` against SGLang's real server on this CPU.

One run for the module: both servers (the DWISE hook and the pass-through at the same patch points)
through the smoke phase. The figures are not asserted (the benchmark prints each beside its target,
with a verdict, and they follow the machine's load); what is asserted is that it prints every row
and line it promises, and that the workload made the DWISE hook do its per-step work in the steps
it measured: arrivals, first denoising rounds and finishes.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import live_server

BENCHMARK = live_server.ROOT / "benchmarks" / "hook_overhead.py"
RUN_TIMEOUT_S = 540  # two server starts (30-100 s each on the busy 2-core machine, started together) and 2 x 5 s
NUMBER = r"-?\d+(?:\.\d+)?"
ROW = re.compile(rf"^\s*(\d+)\s+(pass-through|dwise)\s+(\d+)\s+({NUMBER})\s+({NUMBER}|-)\s+({NUMBER}|-)\s+({NUMBER})"
                 rf"\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER}|-)\s*$", re.MULTILINE)
COLUMNS = ("rows", "server", "steps", "rows/step", "arrivals/step", "first/step", "finished/step", "period p50 ms",
           "period p99 ms", "hook p50 µs", "hook p99 µs", "µs/arrival")
TARGETS = (("hook host p50", 500), ("hook host p99", 2000), ("hook per arrival", 20))


@pytest.fixture(scope="module")
def printed(sglang_venv, tiny_model, ranking_bundle, tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("hook-overhead")
    done = subprocess.run([sys.executable, str(BENCHMARK), "--smoke", "--work", str(work), "--model", str(tiny_model),
                           "--bundle", str(ranking_bundle)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    logs = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in sorted(work.glob("*.log")))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}\n{logs}"
    return done.stdout


def rows(printed: str) -> dict:
    """server -> its row, column name -> the printed text."""
    return {match[1]: dict(zip(COLUMNS, match)) for match in ROW.findall(printed)}


def test_it_prints_one_row_per_server_with_steps_in_the_measured_window(printed):
    found = rows(printed)
    assert sorted(found) == ["dwise", "pass-through"], printed
    assert found["dwise"]["rows"] == found["pass-through"]["rows"]  # the same phase: requests kept in flight
    for row in found.values():
        assert int(row["steps"]) > 0 and float(row["rows/step"]) > 0 and float(row["period p50 ms"]) > 0, row
    assert float(found["dwise"]["rows/step"]) <= 4.0  # the smoke's B: the hook runs at most B a step


def test_the_dwise_hook_registered_arrivals_refined_first_rounds_and_saw_finishes(printed):
    dwise, passthrough = rows(printed)["dwise"], rows(printed)["pass-through"]
    assert float(dwise["arrivals/step"]) > 0 and float(dwise["first/step"]) > 0, dwise
    assert float(dwise["finished/step"]) > 0 and float(passthrough["finished/step"]) > 0
    assert float(dwise["µs/arrival"]) > 0 and float(dwise["hook p50 µs"]) > 0
    # the pass-through registers nothing and refines nothing: SGLang's own scheduling
    assert (passthrough["arrivals/step"], passthrough["first/step"], passthrough["µs/arrival"]) == ("-", "-", "-")


@pytest.mark.parametrize(("name", "target"), TARGETS)
def test_it_prints_each_target_beside_its_figure_with_a_verdict(printed, name, target):
    line = re.compile(rf"^target {name} <= {target} µs \(B = 4; the targets are for B = 128\): {NUMBER} µs, "
                      r"(met|MISSED)$", re.MULTILINE)
    assert len(line.findall(printed)) == 1, printed


def test_it_compares_the_loop_periods_and_says_where_the_hook_time_goes(printed):
    assert re.search(rf"^loop period, dwise vs pass-through \(B = 4.*\): p50 {NUMBER} %, p99 {NUMBER} %, mean "
                     rf"{NUMBER} %", printed.replace("+", ""), re.MULTILINE), printed
    assert re.search(rf"^the hook less its tensor work .*: p50 {NUMBER} µs, p99 {NUMBER} µs$", printed, re.MULTILINE)
    parts = re.search(r"^the DWISE hook's own time, mean µs per step: (.*)$", printed, re.MULTILINE)
    assert parts and "register" in parts[1] and "row_signals" in parts[1] and "refine" in parts[1], printed
    assert re.search(r"^SGLang's own time, mean µs per step, dwise \| pass-through: ModelRunner.forward \d+ \| \d+",
                     printed, re.MULTILINE), printed


def test_it_says_what_the_caches_the_forward_sweeps_cost_two_of_the_hooks_calls(printed):
    line = re.search(rf"^the caches: in this process, 15 requests' admission estimates take ({NUMBER}) µs warm and "
                     rf"({NUMBER}) µs right after reading 311 MB \(one step's logits at B = 128, .*\), a policy round "
                     rf"at B = 128 \(15 arrivals, schedule, 15 finishes\) ({NUMBER}) and ({NUMBER}) µs$",
                     printed, re.MULTILINE)
    assert line, printed
    assert all(float(value) > 0 for value in line.groups()), line.groups()
    ratio = re.search(rf"^figure hook calls, swept caches / warm \(admission and a policy round at B = 128, 311 MB "
                      rf"swept\): ({NUMBER})x \(no target\)$", printed, re.MULTILINE)
    admission_warm, admission_swept, policy_warm, policy_swept = map(float, line.groups())
    # the printed figure is the ratio of the printed times (each rounded to a microsecond)
    assert ratio and float(ratio[1]) == pytest.approx((admission_swept + policy_swept) / (admission_warm + policy_warm),
                                                      rel=0.02), printed

