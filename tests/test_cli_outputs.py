"""`simulate`, `profile-rounds` and `batch-timeout` never write over what is not theirs.

Each refusal is one line and exit 1, and leaves the victim (an evaluation, a characterization, a
trace dataset, any folder or file) byte-identical; a rerun onto the command's own output still works.
"""

import json
import shutil
from pathlib import Path

import pytest

from dwise_predict.cli import main
from dwise_predict.traces import write_traces
from dwise_predict.traces.synthetic import make_synthetic_traces

SIMULATE = ["--requests", "64", "--arrival", "burst", "--policies", "sglang-default,fcfs-mixed", "--slots", "8"]
PROFILE = ["--rows", "1,2", "--repeats", "1", "--context-blocks", "0"]
BATCH = ["--rhos", "0.5", "--requests", "200"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    ds = make_synthetic_traces(n_requests=120, hidden_size=8, seed=1, block_size=16)
    return write_traces(ds, tmp_path_factory.mktemp("traces") / "tr")


@pytest.fixture
def own_traces(traces, tmp_path):
    """A copy of the traces for a test that, were the refusal broken, would damage them."""
    return Path(shutil.copytree(traces, tmp_path / "tr"))


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"source": "a test GPU", "base_ms": 20, "prefill_block_ms": 0.2, "decode_block_ms": 0.5}))
    return path


def snapshot(path: Path) -> dict:
    """Every file under ``path`` (or the file itself) with its bytes: what must not change."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def refused(args: list[str], capsys, victim: Path, *phrases: str) -> None:
    before = snapshot(victim)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(p in err for p in phrases), err
    assert snapshot(victim) == before


def _evaluation(tmp_path: Path) -> Path:
    folder = tmp_path / "ev"
    folder.mkdir()
    for name, text in (("evaluation.json", "{}\n"), ("report.md", "# evaluation\n"), ("report.html", "<html>ev</html>")):
        (folder / name).write_text(text)
    return folder


def _characterization(tmp_path: Path) -> Path:
    folder = tmp_path / "char"
    folder.mkdir()
    (folder / "characterization.json").write_text("{}\n")
    (folder / "characterization.md").write_text("# rounds\n")
    return folder


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me\n")
    return folder


VICTIMS = {"evaluation": _evaluation, "characterization": _characterization, "folder": _folder}


# --- simulate --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(VICTIMS))
def test_simulate_never_replaces_a_folder_that_is_not_a_simulation(traces, tmp_path, capsys, kind):
    victim = VICTIMS[kind](tmp_path)
    refused(["simulate", str(traces), *SIMULATE, "--out", str(victim)], capsys, victim,
            "is not a simulation", "choose a new or empty --out")


@pytest.mark.parametrize("where", ["traces", "inside-traces", "profile"])
def test_simulate_out_never_aliases_an_input(own_traces, profile, capsys, where):
    out = {"traces": own_traces, "inside-traces": own_traces / "sim", "profile": profile}[where]
    victim = profile if where == "profile" else own_traces
    refused(["simulate", str(own_traces), *SIMULATE, "--round-profile", str(profile), "--out", str(out)], capsys, victim,
            "a command never writes over its inputs")


def test_simulate_out_that_is_a_file_is_refused(traces, tmp_path, capsys):
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me\n")
    refused(["simulate", str(traces), *SIMULATE, "--out", str(victim)], capsys, victim, "is a file")


def test_simulate_reruns_onto_its_own_output(traces, tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(traces), *SIMULATE, "--out", str(out)]) == 0
    first = (out / "simulate.json").read_bytes()
    assert main(["simulate", str(traces), *SIMULATE, "--seed", "3", "--out", str(out)]) == 0
    assert (out / "simulate.json").read_bytes() != first
    # a sweep into the same folder is the same command's output too
    assert main(["simulate", str(traces), "--ks", "1,2", *SIMULATE, "--out", str(out)]) == 0
    assert (out / "k_sweep.json").is_file() and (out / "simulate.json").is_file()


# --- profile-rounds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["manifest.json", "profile.json", "sub/profile.json"])
def test_profile_rounds_never_writes_into_a_trace_dataset(own_traces, capsys, name):
    refused(["profile-rounds", *PROFILE, "--out", str(own_traces / name)], capsys, own_traces,
            "lies inside a trace dataset", "write the profile outside it")


@pytest.mark.parametrize("content", [b"not json\n", b"[1, 2]\n", b'{"rows": 3}\n'])
def test_profile_rounds_never_overwrites_another_file(tmp_path, capsys, content):
    victim = tmp_path / "other.json"
    victim.write_bytes(content)
    refused(["profile-rounds", *PROFILE, "--out", str(victim)], capsys, victim, "is not a round profile")


def test_profile_rounds_out_that_is_a_directory_is_one_line(tmp_path, capsys):
    victim = _folder(tmp_path)
    refused(["profile-rounds", *PROFILE, "--out", str(victim)], capsys, victim, "is a directory")


def test_profile_rounds_reruns_onto_its_own_profile(profile, capsys):
    # a hand-written profile (coefficients only) is a round profile too: a measured one may replace it
    assert main(["profile-rounds", *PROFILE, "--out", str(profile)]) == 0
    first = json.loads(profile.read_text())
    assert "samples" in first
    assert main(["profile-rounds", *PROFILE, "--out", str(profile)]) == 0
    assert json.loads(profile.read_text())["samples"] != first["samples"]  # measured again, not kept


# --- batch-timeout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["traces", "inside-traces"])
def test_batch_timeout_out_never_aliases_its_traces(own_traces, profile, capsys, where):
    out = own_traces if where == "traces" else own_traces / "bt"
    refused(["batch-timeout", "--traces", str(own_traces), "--round-profile", str(profile), *BATCH, "--out", str(out)],
            capsys, own_traces, "a command never writes over its inputs")


@pytest.mark.parametrize("kind", list(VICTIMS))
def test_batch_timeout_never_writes_into_a_foreign_folder(tmp_path, capsys, kind):
    victim = VICTIMS[kind](tmp_path)
    refused(["batch-timeout", *BATCH, "--out", str(victim)], capsys, victim, "is not a batch-timeout study")


def test_batch_timeout_out_that_is_a_file_is_one_line(tmp_path, capsys):
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me\n")
    refused(["batch-timeout", *BATCH, "--out", str(victim)], capsys, victim, "is a file")


def test_batch_timeout_reruns_onto_its_own_output(tmp_path, capsys):
    out = tmp_path / "bt"
    assert main(["batch-timeout", *BATCH, "--out", str(out)]) == 0
    assert main(["batch-timeout", *BATCH, "--seed", "1", "--out", str(out)]) == 0
    assert json.loads((out / "batch_timeout.json").read_text())["settings"]["seed"] == 1
