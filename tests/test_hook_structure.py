"""The SGLang hook is built from small parts: no function in ``dwise_predict/serving/sglang/`` is
longer than 80 lines, and none is defined inside another (no closures: the hook's state lives in
its objects, where a reader and a test can see it)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dwise_predict" / "serving" / "sglang"
MAX_LINES = 80
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def long_functions(source: str) -> list[str]:
    """``name (N lines)`` of every function in ``source`` longer than :data:`MAX_LINES`, decorators,
    signature and docstring included."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, FUNCTIONS[:2]) and node.end_lineno - node.lineno + 1 > MAX_LINES]


def nested_functions(source: str) -> list[str]:
    """Every function or lambda defined inside a function of ``source``, as ``outer > inner`` (line)."""
    found = []
    for outer in ast.walk(ast.parse(source)):
        if isinstance(outer, FUNCTIONS[:2]):
            for inner in ast.walk(outer):
                if inner is not outer and isinstance(inner, FUNCTIONS):
                    found.append(f"{outer.name} > {getattr(inner, 'name', 'lambda')} (line {inner.lineno})")
    return found


MODULES = sorted(PACKAGE.glob("*.py"))


def test_the_package_has_its_parts():
    assert {p.name for p in MODULES} >= {"__init__.py", "surface.py", "buffers.py", "requests.py", "signals.py",
                                         "step.py", "hook.py", "install.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_is_longer_than_80_lines(path):
    assert long_functions(path.read_text()) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_defines_another(path):
    assert nested_functions(path.read_text()) == []


def test_the_checks_catch_a_long_function_and_a_closure():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def long():\n{body}\n") == [f"long ({MAX_LINES + 1} lines)"]
    assert long_functions(f"def short():\n{body[:-len(body.splitlines()[-1]) - 1]}\n") == []
    closure = ("def install(state):\n    def run(self):\n        return state\n"
               "    key = lambda r: state[r]\n    return run\n")
    assert nested_functions(closure) == ["install > run (line 2)", "install > lambda (line 4)"]
    assert nested_functions("class Hook:\n    def run(self):\n        return 1\n") == []
