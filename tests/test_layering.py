"""Imports run down the pipeline only: a table of which package may import which, checked on every
import statement of the package (those inside functions too), and no cycle between packages.

A new arrow in this table is a design decision (DESIGN.md: serving and exports never import
training or evaluation; training never imports evaluation; nothing imports cli/). Top-level
modules (``metrics``, ``runs``, ``files`` ...) count as packages of their own.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dwise_predict"
ROOT = "dwise_predict"  # the package's own __init__ (its __version__)
BASE = {"errors", "files", "versions"}  # shared ground anyone may use

ALLOWED: dict[str, set[str]] = {
    ROOT: set(),
    "errors": set(),
    "versions": set(),
    "identity": set(),
    "metrics": set(),
    "files": {"errors"},
    # identity: a leaf of names the contracts share (the early signals' columns, the refinement
    # graph's length scale), which the graph, the run directory and the bundle must agree on
    "runs": {"errors", "files", "identity"},
    "features": {"errors"},
    "traces": BASE | {"identity"},
    "dllm": BASE,
    # the serving engine's semantics (layout: standard library; step rules: torch)
    "engine": BASE,
    "collectors": BASE | {"dllm", "traces", "features", "identity", "engine"},
    "admission": BASE | {"features", "metrics"},
    "survival": BASE | {"identity"},
    "training": BASE | {"admission", "survival", "features", "traces", "metrics", "runs"},
    "evaluation": BASE | {"training", "admission", "survival", "features", "traces", "metrics", "runs", "identity"},
    # the bundle contract: the manifest, the screen and the one loader. admission only for the check
    # of a LightGBM text model (admission.model_text) before LightGBM parses a bundle's; survival only
    # for the optional torch backend
    "bundles": BASE | {"admission", "survival", "features", "identity"},
    # exports read the run directory through `runs`, never through `training`, and write bundles
    # through `bundles`
    "exports": BASE | {"bundles", "runs", "survival", "features", "identity", "admission"},
    # the runtime, inside SGLang's scheduler: numpy + onnxruntime at serving time (features and identity are
    # standard library; survival only for the optional torch backend). collectors: recording mode
    # (traces from a live server) is a collector; the launcher imports collectors.live lazily, only in
    # a scheduler process started with --record. Never exports (a bundle is read through `bundles`)
    # nor the simulation lab.
    "serving": BASE | {"bundles", "survival", "features", "identity", "engine", "collectors"},
    # the scheduling lab replays traces under the policy the server runs (serving.policy); traces,
    # metrics: the --refine-every replay reads contract 1's per-round states and reports ρ of the r̂ it holds
    "simulation": BASE | {"serving", "bundles", "engine", "features", "identity", "traces", "metrics"},
    "quickstart": BASE | {"collectors", "traces", "training", "evaluation", "exports", "bundles", "serving", "simulation"},
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
