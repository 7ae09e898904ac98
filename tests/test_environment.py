"""The environment (issue 51): results that survive any locale, a stdout that is closed or full, and
`--out` names no file system or file of ours can hold. Each is one line on stderr and exit 1, never
a traceback nor a success whose results went nowhere (dwise_predict/cli/streams.py; files.py's
refuse_unusable_path and derived names; the ENAMETOOLONG line in cli/app.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dwise_predict.cli import main
from dwise_predict.files import NAME_MAX, claim_output, output_lock
from evaluate_helpers import fixed_config, make_traces, write

CREATED = "2026-01-01T00:00:00+00:00"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.exports.zoo import publish
    from dwise_predict.training import train_run

    root = tmp_path_factory.mktemp("env")
    traces = write(make_traces(n_requests=160), root / "traces")
    train_run(traces, root / "run", fixed_config())
    publish(export_bundle(root / "run", root / "bundle", name="tiny", created=CREATED), root / "zoo", verify=False)
    return {"traces": traces, "run": root / "run", "zoo": root / "zoo"}


def _one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# --- locale: a stream that cannot encode ρ -----------------------------------------------------------

@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
@pytest.mark.parametrize("argv", [["zoo", "list", "--zoo", "{zoo}"], ["traces", "show", "{traces}"]])
def test_tables_print_on_a_stream_that_cannot_encode_them(encoding, argv, world, tmp_path, monkeypatch, capsys):
    """PYTHONIOENCODING=ascii / latin-1 (and LC_ALL=C without UTF-8 mode): ρ and … were a
    UnicodeEncodeError traceback; now each is a look-alike of the same width and the table stays whole."""
    path = tmp_path / "stdout"
    with open(path, "w", encoding=encoding) as stream:
        monkeypatch.setattr(sys, "stdout", stream)
        code = main([a.format(**world) for a in argv])
    text = path.read_bytes().decode(encoding)
    assert code == 0, capsys.readouterr().err
    assert "ρ" not in text and "Traceback" not in capsys.readouterr().err
    if argv[0] == "zoo":
        assert "r admission" in text and "r refined" in text and "tiny" in text
    else:
        assert "all" in text and "160" in text
    widths = {len(line) for line in text.splitlines() if line.startswith(("|", "+"))}
    assert len(widths) == 1, widths  # the look-alikes kept every row as wide as the border


def test_the_real_locale_c_without_utf8_mode_prints_the_table(world):
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    done = subprocess.run([sys.executable, "-m", "dwise_predict.cli", "zoo", "list", "--zoo", str(world["zoo"])],
                          capture_output=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == b"", done.stderr.decode()
    assert b"r admission" in done.stdout and done.stdout.isascii()


# --- stdout that cannot take the results -----------------------------------------------------------

def test_a_full_stdout_is_one_line_and_exit_1(world, monkeypatch, capsys):
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        code = main(["zoo", "list", "--zoo", str(world["zoo"])])
    assert code == 1
    assert _one_error(capsys) == ("error: cannot write the results to stdout (No space left on device): send them "
                                  "somewhere that takes them, or to /dev/null to discard them")


def test_a_closed_stdout_is_one_line_and_exit_1(world, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of fd 1 closed at start (`>&-`)
    assert main(["zoo", "list", "--zoo", str(world["zoo"])]) == 1
    assert "stdout is closed, so the results would be lost" in _one_error(capsys)


@pytest.mark.parametrize("redirect", [">&-", ">/dev/full"])
def test_the_real_process_reports_a_closed_or_full_stdout_and_fails(redirect, world):
    """`zoo list >&-` reported success; `>/dev/full` was a traceback, then Python's own complaint at exit."""
    done = subprocess.run(["sh", "-c", f'exec "$0" -m dwise_predict.cli zoo list --zoo "$1" {redirect}',
                           sys.executable, str(world["zoo"])], capture_output=False, stderr=subprocess.PIPE, timeout=120)
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert "stdout" in lines[0] and "Exception ignored" not in done.stderr.decode()


# --- --out names -----------------------------------------------------------------------------------

def test_a_legal_250_byte_out_is_written_and_its_lock_and_temp_names_fit(world, tmp_path, capsys):
    """Refused before: `.NAME.lock` and `.NAME.tmp-PID-old` passed 255 bytes. Now they are NAME's head
    and a hash; the export lands under the full name, and a second writer is still refused."""
    out = tmp_path / ("b" * 250)
    assert main(["export", str(world["run"]), "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / "bundle.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["b" * 250]  # no lock or temp debris
    lock = Path(output_lock(out).path)
    assert len(lock.name.encode()) <= NAME_MAX and lock.name.startswith(".bbbb") and lock.name.endswith(".lock")
    with claim_output(out, [], "a bundle", "bundle.json", replace=True):
        assert main(["export", str(world["run"]), "--out", str(out), "--force"]) == 1
    assert "is being written by another dwise-predict process" in _one_error(capsys)


# --- input directories whose names are not UTF-8 ---------------------------------------------------

def test_traces_runs_and_bundles_at_a_non_utf8_path_are_read(world, tmp_path, capsys):
    """A directory named in Latin-1 bytes (``\\xff``: Python holds it as the lone surrogate ``\\udcff``):
    safetensors and pyarrow take UTF-8 paths only, so its traces were "cannot read ...: collect it
    again" and its run "unreadable: re-run train"; the reports naming the path crashed on writing it.
    Now each file is read by descriptor and a report shows the byte as its escape."""
    import shutil

    latin = tmp_path / os.fsdecode(b"caf\xe9")
    for name in ("traces", "run"):
        shutil.copytree(world[name], latin / name)
    traces, run, bundle = str(latin / "traces"), str(latin / "run"), latin / "bundle"
    assert main(["traces", "show", traces]) == 0
    # an `--out` must stay UTF-8 (our files name it): the bundle is made elsewhere and moved in
    assert main(["export", run, "--out", str(tmp_path / "b"), "--created", CREATED]) == 0, capsys.readouterr().err
    shutil.move(tmp_path / "b", bundle)
    assert main(["evaluate", traces, "--run", run, "--out", str(tmp_path / "report")]) == 0, capsys.readouterr().err
    assert "caf\\udce9/run" in (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert main(["simulate", traces, "--bundle", str(bundle), "--requests", "24", "--out", str(tmp_path / "sim")]) == 0
    assert (tmp_path / "sim" / "report.html").is_file()
    assert "Traceback" not in capsys.readouterr().err
