"""`make test`'s work units (tests/work_units.py) name tests that exist, and map test ids as documented."""

import ast
from pathlib import Path

import work_units

TESTS = Path(__file__).parent


def _test_names(file_name: str) -> set[str]:
    tree = ast.parse((TESTS / file_name).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_member_and_every_first_unit_exists():
    """A renamed test or file would silently fall back to its file's unit and unbalance the workers."""
    for unit, members in work_units.UNITS.items():
        for member in members:
            file_name, _, test = member.partition("::")
            assert (TESTS / file_name).is_file(), (unit, member)
            assert not test or test in _test_names(file_name), (unit, member)
    files = {p.name for p in TESTS.rglob("test_*.py")}  # tests/live/ too
    for unit in work_units.FIRST:
        assert unit in work_units.UNITS or unit in files, unit
    assert len(set(work_units.FIRST)) == len(work_units.FIRST)


def test_a_test_joins_its_own_unit_else_its_files():
    evaluate_killed = "test_faults.py::test_evaluate_killed_at_renames_leaves_a_whole_report"
    unit = next(name for name, members in work_units.UNITS.items() if evaluate_killed in members)
    assert work_units.work_unit(f"tests/{evaluate_killed}") == unit
    assert work_units.work_unit(f"tests/{evaluate_killed}[with-params]") == unit  # parametrizations stay together
    assert work_units.work_unit("tests/test_faults.py::test_read_only_disk_is_one_line") == "test_faults.py"
    assert work_units.work_unit("tests/test_evaluate_loco.py::test_x") == work_units.work_unit(
        "tests/test_evaluate_ablate.py::test_y")  # joined: they share conftest's loco_evaluation
    assert work_units.work_unit("tests/test_metrics.py::test_x[a-b]") == "test_metrics.py"
    assert work_units.rank("tests/test_metrics.py::test_x") == len(work_units.FIRST)
    for place, unit in enumerate(work_units.FIRST):  # every member of a unit starts with it
        for member in work_units.UNITS.get(unit, ()):
            assert work_units.rank(f"tests/{member}::test_x" if "::" not in member else f"tests/{member}") == place
