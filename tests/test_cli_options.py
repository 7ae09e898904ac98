"""The CLI's one comma-list option type: :func:`comma_list` (and :func:`comma_items` beneath it) parse
every comma-list flag, so a new list option reads and refuses like the others."""

import ast
import math
from pathlib import Path

import pytest

from dwise_predict.cli.options import comma_items, comma_list

CLI = Path(__file__).resolve().parent.parent / "dwise_predict" / "cli"


def comma_splits(source: str) -> list[int]:
    """Line numbers of every ``<expr>.split(",")`` in ``source``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "split"
            and [getattr(arg, "value", None) for arg in node.args] == [","]]


def test_no_cli_module_splits_a_comma_list_by_hand():
    found = {path.name: lines for path in sorted(CLI.glob("*.py")) if path.name != "options.py"
             if (lines := comma_splits(path.read_text()))}
    assert found == {}


def test_the_scan_finds_a_hand_split():
    assert comma_splits('ks = [float(x) for x in text.split(",")]\nwords = text.split()\n') == [1]


def test_comma_items_skips_empty_items_and_lets_a_bad_item_raise():
    assert comma_items(" a, b ,,c ", str.strip) == ["a", "b", "c"]
    assert comma_items("1,2, 4", int) == [1, 2, 4]
    with pytest.raises(ValueError, match="'x'"):
        comma_items("1,x", int)


def test_comma_list_notes_each_problem_in_the_one_wording():
    problems = []
    assert comma_list("0.3, 0.5,", float, "--rhos", "numbers", problems) == [0.3, 0.5]
    assert comma_list("1,two", float, "--rhos", "numbers", problems) is None
    assert comma_list("", int, "--ks", "counts >= 1", problems, valid=lambda n: n >= 1) is None  # nothing given
    assert comma_list("2,0", int, "--ks", "counts >= 1", problems, valid=lambda n: n >= 1) is None
    assert comma_list("1,inf", float, "--ks", "finite numbers", problems, valid=math.isfinite) is None
    assert problems == ["--rhos must be a comma list of numbers, got '1,two'",
                        "--ks must be a comma list of counts >= 1, got ''",
                        "--ks must be a comma list of counts >= 1, got '2,0'",
                        "--ks must be a comma list of finite numbers, got '1,inf'"]
