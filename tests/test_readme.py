"""The README as a new user reads it: short, its links resolve, and every `dwise-predict` line in its
code blocks names a command that exists with options that command takes (a renamed option would
otherwise leave the README's first steps failing)."""

import re
import shlex
from pathlib import Path

import typer.main

from dwise_predict.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _invocations(text: str) -> list[list[str]]:
    """Every `dwise-predict ...` command in the README's bash blocks, split into words, comments and
    `&&`-chained commands separated."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                if words and words[0] == "dwise-predict":
                    found.append(words[1:])
    return found


def _resolve(words: list[str]):
    """The click command the words name (descending through groups), and the words after it. Typer
    bundles its own click, so groups are told by their `commands`, not by a class."""
    command = typer.main.get_command(app)
    while hasattr(command, "commands") and words and words[0] in command.commands:
        command, words = command.commands[words[0]], words[1:]
    return command, words


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "quickstart"], ["make", "test"]]


def test_every_readme_command_and_option_exists():
    invocations = _invocations(README)
    assert len(invocations) >= 15, invocations  # the pipeline block was read, not skipped
    for words in invocations:
        command, rest = _resolve(words)
        assert not hasattr(command, "commands"), f"README names a group without a command: {words}"
        options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        ours = rest[: rest.index("--")] if "--" in rest else rest  # after `--`: SGLang's arguments
        for word in ours:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in options, f"dwise-predict {' '.join(words[:2])}: no option {word}"


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target


def test_readme_says_how_to_reach_the_command_after_the_two_set_up_commands():
    """`make quickstart` installs into .venv without activating it: the pipeline's `dwise-predict` lines
    only work as printed once the README has said how to reach the command."""
    set_up = README.split("## The pipeline", 1)[0]
    assert "source .venv/bin/activate" in set_up
    assert ".venv/bin/dwise-predict" in set_up


def test_readme_makes_every_trace_set_it_reads():
    """The `draw0/ draw1/ draw2/` sets the across-set evaluation reads are made by a README line
    (`collect --seed N`), before the line that reads them."""
    invocations = _invocations(README)
    across = next(i for i, words in enumerate(invocations) if "--across" in words)
    draws = [words for words in invocations[:across] if words[0] == "collect" and "--seed" in words]
    assert draws, "no `collect --seed N` line before the across-set evaluation"
    assert any(out.startswith("draw") for words in draws for out in words[words.index("--out") + 1:][:1])
    assert "draw0/ draw1/ draw2/" in README.split("--across", 1)[0]
