"""`make bench`: every benchmark in full, one after another, and one table of their figures.

    .venv/bin/python benchmarks/run_all.py                 # all of them: benchmarks/results.json, docs/results.md
    .venv/bin/python benchmarks/run_all.py --only train_time --only collect_throughput
    .venv/bin/python benchmarks/run_all.py --smoke         # `make bench SMOKE=1`: out/bench-smoke/, docs untouched
    .venv/bin/python benchmarks/run_all.py --render        # the docs section again, from results.json

Each benchmark runs in its own process (``--json PATH``: its figures, see ``targets.py``), its output
in ``out/bench/<name>.log``. The table (``benchmarks/results.json``) holds, per benchmark, its
figures beside their targets and verdicts, the machine, the load average when it started, the commit
and the date; a run of some benchmarks (``--only``) replaces their rows and keeps the others'. The
section of ``docs/results.md`` between :data:`BEGIN` and :data:`END` is rendered from it, never typed.
Smoke runs (the smallest inputs: they say the code runs, not how fast) go to ``out/bench-smoke/``
unless told otherwise, and are never merged with full runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from targets import Figure, number, with_unit

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
BENCHMARKS = ("admission_features", "admission_latency", "collect_throughput", "decode_throughput", "dispatch_overhead",
              "evaluate_loco", "hook_overhead", "refine_latency", "signal_cost", "simulate_speed", "train_time")
HELPERS = ("hook_timing", "targets", "run_all")  # the other modules here: no benchmark, no figures
# what a benchmark needs beyond the project's environment: (path, how to get it); without it the row says so
NEEDS = {"hook_overhead": (ROOT / ".venv-sglang" / "bin" / "python", "make sglang-env")}
RESULTS, DOCS = HERE / "results.json", ROOT / "docs" / "results.md"
SMOKE_DIR = ROOT / "out" / "bench-smoke"
BEGIN = ("<!-- benchmarks: rendered by `make bench` (benchmarks/run_all.py) from benchmarks/results.json; "
         "do not edit -->")
END = "<!-- end of benchmarks -->"
NOT_RUN = ("_`make bench` has not been run on this machine yet: it runs every benchmark in full and renders "
           "its table here._")
TIMEOUT_S = 3600.0  # per benchmark: a hung one must not hold `make bench` for ever


def machine() -> str:
    """CPU model, cores and memory (what the timings depend on; no host name)."""
    model = platform.processor() or platform.machine()
    memory = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                     model)
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError, IndexError):
        pass  # not Linux: the model name from platform, no memory
    return f"{model}, {os.cpu_count()} cores{memory}"


def commit() -> str:
    """The checked-out commit, ``+`` when tracked files differ from it (``unknown`` outside git)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # `git status` would otherwise refresh the index
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def new_row(name: str, smoke: bool) -> dict:
    """A benchmark's row before it runs: where, when, at what load; no figures yet."""
    return {"benchmark": name, "smoke": smoke, "machine": machine(), "commit": commit(), "date": now(),
            "load_at_start": round(os.getloadavg()[0], 2), "figures": [], "details": {}}


def run_benchmark(name: str, smoke: bool, logs: Path) -> dict:
    """Run one benchmark in its own process; its row of the table (figures empty unless it ran)."""
    row = new_row(name, smoke)
    needed = NEEDS.get(name)
    if needed and not needed[0].exists():
        return {**row, "status": "skipped", "note": f"needs {needed[0].relative_to(ROOT)} ({needed[1]})"}
    record = logs / f"{name}.json"
    record.unlink(missing_ok=True)
    log = logs / f"{name}.log"
    command = [sys.executable, str(HERE / f"{name}.py"), *(["--smoke"] if smoke else []), "--json", str(record)]
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
            failure = None if done.returncode == 0 else f"exit status {done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {TIMEOUT_S:.0f} s"
    row["wall_s"] = round(time.perf_counter() - start, 1)
    if failure is None and record.is_file():
        found = json.loads(record.read_text(encoding="utf-8"))
        return {**row, "status": "ok", "figures": found["figures"], "details": found["details"]}
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or [""]
    return {**row, "status": "failed", "note": f"{failure or 'no figures written'}: {tail[0][:200]}"}


def merged(path: Path, rows: list[dict], smoke: bool) -> dict:
    """The table at ``path`` with ``rows`` replacing its rows of the same benchmarks, in BENCHMARKS order."""
    kept = {}
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("smoke") == smoke:
            kept = {row["benchmark"]: row for row in old["benchmarks"]}
    kept.update({row["benchmark"]: row for row in rows})
    return {"smoke": smoke, "benchmarks": [kept[name] for name in BENCHMARKS if name in kept]}


def cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def table_rows(row: dict) -> list[str]:
    """One markdown line per figure of ``row`` (one line saying why, when it has none)."""
    lead = f"| `{row['benchmark']}` |"
    tail = f" {row['load_at_start']:.1f} | {row['date'][:10]} | `{row['commit']}` |"
    if row["status"] != "ok":
        return [f"{lead} — | — | — | {row['status']}: {cell(row.get('note', ''))} |{tail}"]
    lines = []
    for found in row["figures"]:
        figure = Figure(**{key: found[key] for key in ("name", "value", "unit", "target", "better", "context")})
        name = figure.name + (f" ({figure.context})" if figure.context else "")
        target = figure.bound or "—"
        lines.append(f"{lead} {cell(name)} | {with_unit(number(figure.value), figure.unit)} | {target} | "
                     f"{figure.verdict} |{tail}")
    return lines


def render(results: dict | None) -> str:
    """The docs section, markers included: ``NOT_RUN`` without results."""
    if results is None:
        return f"{BEGIN}\n{NOT_RUN}\n{END}"
    rows = results["benchmarks"]
    machines = "; ".join(sorted({row["machine"] for row in rows}))
    lines = [BEGIN]
    if results["smoke"]:
        lines.append("_Smoke run (`--smoke`): the smallest inputs; these figures say the code runs, not how fast._")
    lines += [f"Machine: {machines}. Load is the 1-minute load average when the benchmark started: above the "
              "core count its timings are contended.", "",
              "| benchmark | figure | measured | target | verdict | load at start | date | commit |",
              "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines += table_rows(row)
    return "\n".join([*lines, END])


def write_section(path: Path, section: str) -> None:
    """Replace the text between the markers in ``path`` (the whole file: the section, when it does not exist)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(section + "\n", encoding="utf-8")
        return
    text = path.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no benchmark section: add the two marker lines\n{BEGIN}\n{END}")
    path.write_text(text[:start] + section + text[end + len(END):], encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="each benchmark's --smoke (the table and its rendering go to out/bench-smoke/)")
    parser.add_argument("--only", action="append", choices=BENCHMARKS, metavar="NAME",
                        help="run this benchmark only (repeatable); the table keeps the others' rows")
    parser.add_argument("--results", type=Path, help=f"the table (default: {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--docs", type=Path, help=f"the markdown it renders into (default: {DOCS.relative_to(ROOT)})")
    parser.add_argument("--logs", type=Path, help="each benchmark's output and figures (default: out/bench/)")
    parser.add_argument("--render", action="store_true", help="run nothing: render the docs section from the table")
    args = parser.parse_args(argv)
    results_path = args.results or (SMOKE_DIR / "results.json" if args.smoke else RESULTS)
    docs_path = args.docs or (SMOKE_DIR / "results.md" if args.smoke else DOCS)
    if not args.render:
        logs = args.logs or (SMOKE_DIR if args.smoke else ROOT / "out" / "bench")
        logs.mkdir(parents=True, exist_ok=True)
        rows = []
        for i, name in enumerate(args.only or BENCHMARKS, 1):
            print(f"[{i}/{len(args.only or BENCHMARKS)}] {name} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            rows.append(run_benchmark(name, args.smoke, logs))
            print("\n".join(table_rows(rows[-1])), flush=True)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(merged(results_path, rows, args.smoke), indent=1) + "\n", encoding="utf-8")
    results = json.loads(results_path.read_text(encoding="utf-8")) if results_path.is_file() else None
    write_section(docs_path, render(results))
    print(f"table: {results_path}; rendered into {docs_path}")


if __name__ == "__main__":
    main()
