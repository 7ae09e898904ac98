"""Imports run down the pipeline only: a table of which package may import which, checked on every
import statement of the package (those inside functions too), and no cycle between packages.

A new arrow in this table is a design decision (serving and exports never import
training or evaluation; training never imports evaluation; nothing imports cli/). Top-level
modules (``metrics``, ``runs``, ``files`` ...) count as packages of their own.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dwise_predict"
ROOT = "dwise_predict"  # the package's own __init__ (its __version__)
BASE = {"errors", "files", "versions", "text", "threads"}  # shared ground anyone may use

ALLOWED: dict[str, set[str]] = {
    ROOT: set(),
    "errors": set(),
    "versions": set(),
    "threads": set(),
    "names": set(),
    "metrics": set(),
    # text: data escaped for the medium it lands in (terminal, Markdown, CSV, a plot); standard library,
    # a leaf every sink may use (files: write_csv neutralises formula cells)
    "text": set(),
    "files": {"errors", "text"},
    # names: a leaf of the names the contracts share (the early signals' columns, the refinement
    # graph's length scale), which the graph, the run directory and the bundle must agree on
    "runs": {"errors", "files", "names"},
    "features": {"errors"},
    "traces": BASE | {"names"},
    "dllm": BASE,
    # the serving engine's semantics (layout: standard library; step rules: torch)
    "engine": BASE,
    "collectors": BASE | {"dllm", "traces", "features", "names", "engine"},
    "admission": BASE | {"features", "metrics"},
    "survival": BASE | {"names"},
    "training": BASE | {"admission", "survival", "features", "traces", "metrics", "runs"},
    "evaluation": BASE | {"training", "admission", "survival", "features", "traces", "metrics", "runs", "names"},
    # the bundle contract: the manifest, the screen and the one loader. admission only for the check
    # of a LightGBM text model (admission.model_text) before LightGBM parses a bundle's; survival only
    # for the optional torch backend
    "bundles": BASE | {"admission", "survival", "features", "names"},
    # exports read the run directory through `runs`, never through `training`, and write bundles
    # through `bundles`
    "exports": BASE | {"bundles", "runs", "survival", "features", "names", "admission"},
    # the runtime, inside SGLang's scheduler: numpy + onnxruntime at serving time (features and names are
    # standard library; survival only for the optional torch backend). collectors: recording mode
    # (traces from a live server) is a collector; the launcher imports collectors.live lazily, only in
    # a scheduler process started with --record. Never exports (a bundle is read through `bundles`)
    # nor the simulation lab. metrics: the live quality monitor (serving.monitor) ranks the served
    # estimates with the house's one Spearman.
    "serving": BASE | {"bundles", "survival", "features", "names", "engine", "collectors", "metrics"},
    # the scheduling lab replays traces under the policy the server runs (serving.policy); traces,
    # metrics: the --refine-every replay reads contract 1's per-round states and reports ρ of the r̂ it holds;
    # evaluation: the report's document (evaluation.document) and the TRAIL probe `trail` replays (evaluation.baselines)
    "simulation": BASE | {"serving", "bundles", "engine", "features", "names", "traces", "metrics", "evaluation"},
    "quickstart": BASE | {"collectors", "traces", "training", "evaluation", "exports", "bundles", "serving", "simulation"},
    # the loop's return (issue 55): recordings merged (collectors), a candidate trained with the serving
    # bundle's recipe, exported, judged against it (metrics, the simulation lab) and published (exports)
    "refresh": BASE | {"collectors", "traces", "training", "evaluation", "exports", "bundles", "engine", "simulation",
                       "metrics", "runs"},
}
ALLOWED["cli"] = {ROOT, *ALLOWED} - {"cli"}  # the top: parses, calls any stage, prints


def _unit(module: str) -> str:
    """``dwise_predict.training.fit`` -> ``training``; ``dwise_predict`` -> the root."""
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT
    return parts[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``dwise_predict`` module named by an import in ``source`` (at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from dwise_predict import metrics` names a module; `... import __version__` does not
            found |= {f"{base}.{a.name}" if (PACKAGE.parent / base.replace(".", "/") / a.name).exists()
                      or (PACKAGE.parent / (base.replace(".", "/") + f"/{a.name}.py")).exists() else base
                      for a in node.names}
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".")}


def dependency_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the modules whose imports draw that arrow."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        unit = _unit(module)
        for target in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if _unit(target) != unit:
                graph.setdefault(unit, {}).setdefault(_unit(target), []).append(module)
    return graph


def violations(graph: dict[str, dict[str, list[str]]], allowed: dict[str, set[str]]) -> list[str]:
    return [f"{', '.join(sorted(set(where)))} imports {target}: {unit} may import only "
            f"{', '.join(sorted(allowed.get(unit, ()))) or 'nothing of the package'}"
            for unit, targets in sorted(graph.items()) for target, where in sorted(targets.items())
            if target not in allowed.get(unit, ())]


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path of units, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_every_package_is_in_the_table():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(ALLOWED), f"add {sorted(units - set(ALLOWED))} to ALLOWED in {__file__}"


def test_imports_run_down_the_table():
    problems = violations(dependency_graph(), ALLOWED)
    assert not problems, "imports against the layering table:\n" + "\n".join(problems)


def test_no_cycle_between_packages():
    assert cycle(ALLOWED) is None, f"the table itself has a cycle: {cycle(ALLOWED)}"
    actual = {unit: set(targets) for unit, targets in dependency_graph().items()}
    assert cycle(actual) is None, f"import cycle between packages: {' -> '.join(cycle(actual))}"


@pytest.mark.parametrize("source, module, arrow", [
    ("def f():\n    from dwise_predict.evaluation import report\n", "dwise_predict.training.run", "evaluation"),
    ("import dwise_predict.training.fit\n", "dwise_predict.exports.bundle", "training"),
    ("from ..cli import app\n", "dwise_predict.bundles.load", "cli"),
    ("from dwise_predict import training\n", "dwise_predict.simulation.simulator", "training"),
])
def test_an_upward_import_is_caught(source, module, arrow):
    unit = _unit(module)
    graph = {unit: {_unit(m): [module] for m in imported_modules(source, module, False)}}
    assert [p for p in violations(graph, ALLOWED) if f"imports {arrow}:" in p]


def test_a_cycle_is_caught():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert cycle({"a": {"b"}, "b": {"c"}}) is None


# --- nothing outside cli/ names a command-line flag ----------------------------------------------
# Library messages name a parameter as a Python caller passes it, in backticks ("`slots` must be ...");
# the CLI prints its flag (cli/options.py FLAGS). Docstrings may describe the command line, and a
# whole command suggested to the user ("run `dwise-predict collect --out DIR` first", "`hf download
# REPO --local-dir DIR`") stays: it is a recipe to copy, valid from Python too.
FLAG = re.compile(r"--[a-z][a-z-]+")
COMMAND = re.compile(r"`(?:dwise-predict|hf) [^`]*`")
# SGLang's own server arguments: the user passes them to SGLang (after `serve --`), not to us
SGLANG_FLAGS = {"--max-running-requests", "--max-total-tokens", "--dllm-algorithm", "--dllm-algorithm-config",
                "--dllm-fdfo", "--no-dllm-fdfo", "--json-model-override-args", "--model-path"}
FLAG_ALLOWED = {
    # the probe worker's own command line: verify starts it as a subprocess server
    ("exports/probe_worker.py", "--serve"), ("exports/verify.py", "--serve"),
    # recorded in every run's selection record: a run's outputs stay byte-identical
    ("training/select.py", "--loco"),
    # recorded in the simulation's outputs (round_cost_source)
    ("simulation/round_cost.py", "--round-ms"), ("simulation/round_cost.py", "--slot-ms"),
    # names the parameter (allow_missing) and, in parentheses, the flag: both readers are served already
    ("collectors/workloads.py", "--allow-missing"),
    # the served model's SGLang arguments (recording runs inside SGLang's scheduler)
    ("collectors/live.py", "--revision"), ("collectors/live.py", "--trust-remote-code"),
    # the program name SGLang's argument parser prints in its own messages
    ("serving/launcher.py", "--dry-run"), ("serving/preflight.py", "--check"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def named_flags(source: str) -> list[tuple[int, str]]:
    """``(line, flag)`` for each command-line flag named in a string of ``source`` (docstrings and
    suggested commands aside); an f-string is read whole, its values as ``{}``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    inner = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip | inner:
            text = node.value
        else:
            continue
        found += [(node.lineno, flag) for flag in FLAG.findall(COMMAND.sub("", text))]
    return found


def test_nothing_outside_cli_names_a_flag():
    problems = [f"{path.relative_to(PACKAGE)}:{line} names {flag}"
                for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] != "cli"
                for line, flag in named_flags(path.read_text())
                if flag not in SGLANG_FLAGS and (path.relative_to(PACKAGE).as_posix(), flag) not in FLAG_ALLOWED]
    assert not problems, ("name the parameter in backticks (the CLI maps it to its flag in cli/options.py FLAGS):\n"
                          + "\n".join(problems))


def test_a_named_flag_is_caught():
    assert named_flags('raise ConfigError(f"--slots must be positive, got {slots}")\n') == [(1, "--slots")]
    assert named_flags('raise ConfigError("`slots` must be positive: run `dwise-predict collect --out D`")\n') == []
    assert named_flags('def f():\n    """Reads ``--slots``."""\n') == []


# --- README's package map is in the table's order --------------------------------------------------
README = PACKAGE.parent / "README.md"


def readme_package_map(text: str) -> list[str]:
    """The units README's package map names, top first: the backticked names that open each bullet
    (``- `runs.py`, `metrics.py`: ...`` names runs, then metrics)."""
    section = text.split("## Package map\n", 1)[1].split("\n## ", 1)[0]
    return [name.removesuffix("/").removesuffix(".py")
            for group in re.findall(r"^- ((?:`[^`]+`(?:, )?)+):", section, flags=re.M)
            for name in re.findall(r"`([^`]+)`", group)]


def map_order_problems(listed: list[str]) -> list[str]:
    """Each unit of ``listed`` (top first) that may import a unit listed above it."""
    return [f"{unit} is listed below {', '.join(sorted(ALLOWED[unit] & set(listed[:i])))}, which it may import"
            for i, unit in enumerate(listed) if ALLOWED[unit] & set(listed[:i])]


def test_readme_package_map_follows_the_table():
    listed = readme_package_map(README.read_text())
    assert sorted(listed) == sorted(set(ALLOWED) - {ROOT}), "README's package map must name every package once"
    assert not map_order_problems(listed), "README's package map, top first:\n" + "\n".join(map_order_problems(listed))


def test_a_map_out_of_order_is_caught():
    text = "## Package map\n\n- `cli/`: the app.\n- `errors.py`, `files.py`: errors; files.\n\n## Next\n- `x/`: not the map\n"
    assert readme_package_map(text) == ["cli", "errors", "files"]
    assert map_order_problems(["cli", "errors", "files"]) == ["files is listed below errors, which it may import"]
