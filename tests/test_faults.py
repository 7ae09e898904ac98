"""Nothing lost, nothing hangs (issue 17): crashes at every atomic rename, a full or read-only disk,
concurrent writers, stale temporary files, and resuming after each.

The kill-on-rename harness (``tests/kill_on_rename.py``: a server per test process that forks each
command) SIGKILLs a command just before its N-th ``os.replace``; after each kill the output is either
the old one or the new one, complete, once the next writer of that output has swept the debris, and
rerunning the same command finishes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from collect_helpers import make_tiny_dir
from kill_on_rename import KillServer
from dwise_predict.cli import main
from dwise_predict.evaluation.pool import kept_results_dir
from dwise_predict.files import TMP_MARK, atomic_dir, atomic_write_text, claim_output, output_lock, sweep_stale
from evaluate_helpers import FAST_CONFIG, fast_config, fixed_config, make_traces, write

# what fixed_config() trains: what is killed here is the writing, not the candidate search
FAST_FLAGS = ["--members", "1", "--width", "32", "--max-epochs", "20", "--patience", "3", "--lr", "0.01",
              "--batch-size", "32", "--refine", "ridge"]
assert FAST_CONFIG["members"] == 1 and FAST_CONFIG["width"] == 32 and fixed_config().refine == "ridge"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    from dwise_predict.training import train_run

    root = tmp_path_factory.mktemp("small")
    traces = write(make_traces(n_requests=160), root / "traces")
    run = root / "run"
    train_run(traces, run, fixed_config())
    return {"traces": traces, "run": run}


_server: list[KillServer] = []  # started on first use, stopped with the module


@pytest.fixture(scope="module", autouse=True)
def _stop_the_kill_server():
    yield
    while _server:
        _server.pop().close()


def _harness(kill_at: int, argv: list, cwd: Path | None = None,
             stub: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    if not _server:
        _server.append(KillServer())
    return _server[0].run(kill_at, argv, cwd, stub)


def _count_renames(argv: list) -> int:
    """How many renames the command makes: run here, counted (nothing is killed)."""
    count = 0
    real_replace = os.replace

    def counting(src, dst, *args, **kwargs):
        nonlocal count
        count += 1
        return real_replace(src, dst, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", counting)
        assert main([str(a) for a in argv]) == 0
    return count


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _debris(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.glob(f".{path.name}{TMP_MARK}*"))


def _kill_points(argv: list[str], sample: int | None = None) -> list[int]:
    """1..K for a command making K renames; with ``sample``, the first, a middle one and the last two."""
    k = _count_renames(argv)
    assert k >= 2
    points = list(range(1, k + 1))
    if sample is not None and k > sample:
        points = sorted({1, k // 2, k - 1, k})
    return points


# --- kill before each rename, then resume --------------------------------------------------------

@pytest.mark.slow
def test_train_overwrite_killed_at_each_rename_keeps_a_whole_run(small, tmp_path):
    from dwise_predict.runs import load_run

    old = _files(small["run"])

    def argv(out):
        return ["train", small["traces"], "--out", out, "--overwrite", *FAST_FLAGS]

    scratch = tmp_path / "count" / "run"
    shutil.copytree(small["run"], scratch)
    for k in _kill_points(argv(scratch)):
        out = tmp_path / f"k{k}" / "run"
        shutil.copytree(small["run"], out)
        killed = _harness(k, argv(out))
        assert killed.returncode == -signal.SIGKILL, (k, killed.stderr[-2000:])
        sweep_stale(out)  # what the next writer of this run does first
        assert _debris(out) == [], k
        load_run(out)  # the old run or the new one, whole
        if _files(out) != old:
            assert (out / "metrics.json").is_file() and (out / "curves.png").is_file(), k
        assert main([str(a) for a in argv(out)]) == 0, k  # the rerun finishes
        load_run(out)
        assert _debris(out) == []


@pytest.mark.slow
def test_overwrite_killed_between_its_two_renames_is_restored_by_the_next_writer(small, tmp_path):
    """The swap moves the old run aside, then the new one in: a kill in between left no RUN at all."""
    from dwise_predict.runs import load_run

    argv = ["train", small["traces"], "--out", tmp_path / "count" / "run", "--overwrite", *FAST_FLAGS]
    shutil.copytree(small["run"], tmp_path / "count" / "run")
    k = _count_renames(argv)  # the last two renames are the swap
    out = tmp_path / "run"
    shutil.copytree(small["run"], out)
    argv[3] = out
    assert _harness(k, argv).returncode == -signal.SIGKILL
    assert not out.exists() and len(_debris(out)) == 2  # the old run aside, the new one not yet in place
    # the next writer of the run puts the old one back first, even when it then fails (missing traces)
    assert main(["train", str(tmp_path / "missing"), "--out", str(out), "--overwrite"]) == 1
    assert _files(out) == _files(small["run"]) and _debris(out) == []
    load_run(out)


@pytest.mark.slow
def test_evaluate_killed_at_renames_leaves_a_whole_report(small, tmp_path):
    from dwise_predict.evaluation.evaluate import EVALUATION_MARKER

    base = ["evaluate", small["traces"], "--run", small["run"]]
    first = tmp_path / "first"
    assert main([str(a) for a in [*base, "--out", first]]) == 0
    shutil.copytree(first, tmp_path / "count")  # count the renames of a replacing evaluation
    points = _kill_points([*base, "--out", tmp_path / "count"], sample=4)
    for k in points:
        out = tmp_path / f"k{k}"
        shutil.copytree(first, out)
        # the first rename keeps the first retraining's result while the pool still runs the second:
        # the harness returns only once every process holding its pipes is gone, so the pool's workers
        # exit with the killed evaluation instead of waiting for work forever. Past it the pool is done
        # and the same renames follow, so the later points retrain in process (no pool to start).
        jobs = [] if k == points[0] else ["--jobs", "1"]
        assert _harness(k, [*base, "--out", out, *jobs]).returncode == -signal.SIGKILL, k
        sweep_stale(out)
        for name in (EVALUATION_MARKER, "report.html", "report.md", "predictions.parquet"):
            assert (out / name).is_file(), (k, name)  # quickstart's report stage is done iff all exist
        assert _debris(out) == []
    assert main([str(a) for a in [*base, "--out", out]]) == 0


@pytest.mark.slow
def test_publish_killed_at_each_rename_resumes_and_leaves_no_lock_or_temp(small, tmp_path, monkeypatch):
    from dwise_predict.exports import verify
    from dwise_predict.exports.bundle import export_bundle
    from dwise_predict.bundles.zoo import list_entries

    bundle = export_bundle(small["run"], tmp_path / "bundle", name="tiny", created="2026-01-01T00:00:00+00:00")
    # publish verifies first (a fresh process loading every artifact, about 5 s) and only then writes:
    # the renames under test are publish's own, so verification is left to test_zoo and test_export_verify
    monkeypatch.setattr(verify, "require_verified", lambda bundle: None)
    stub = ("dwise_predict.exports.verify:require_verified",)
    for k in _kill_points(["publish", bundle, "--zoo", tmp_path / "count"]):
        zoo = tmp_path / f"zoo{k}"
        assert _harness(k, ["publish", bundle, "--zoo", zoo], stub=stub).returncode == -signal.SIGKILL, k
        assert not (zoo / "index.json").exists() or list_entries(zoo) == []  # nothing half-published
        assert main(["publish", str(bundle), "--zoo", str(zoo)]) == 0, k  # the lock died with its holder
        assert [e["version"] for e in list_entries(zoo)] == ["1"]
        assert not [p for p in zoo.rglob("*") if TMP_MARK in p.name], k  # the killed run's temp files swept


@pytest.mark.slow
def test_extending_a_finished_collect_reads_as_incomplete_until_it_finishes(tmp_path, capsys):
    from dwise_predict.errors import TraceError
    from dwise_predict.traces import load_traces

    model = make_tiny_dir(tmp_path / "model")
    flags = ["--model", model, "--batch-size", "4", "--budget", "24", "--requests-per-shard", "4"]
    base = tmp_path / "base"
    assert main([str(a) for a in ["collect", *flags, "--limit", "8", "--out", base]]) == 0
    capsys.readouterr()
    whole = tmp_path / "whole"
    assert main([str(a) for a in ["collect", *flags, "--limit", "12", "--out", whole]]) == 0
    capsys.readouterr()
    expected = load_traces(whole).requests["request_id"].tolist()

    count = tmp_path / "count"
    shutil.copytree(base, count)
    points = _kill_points(["collect", *flags, "--limit", "12", "--out", count])
    capsys.readouterr()
    for k in points[1:-1]:  # after the new manifest, before the consolidated manifest
        out = tmp_path / f"k{k}"
        shutil.copytree(base, out)
        assert _harness(k, ["collect", *flags, "--limit", "12", "--out", out]).returncode == -signal.SIGKILL, k
        with pytest.raises(TraceError, match="unfinished.*rerun the same `dwise-predict collect`"):
            load_traces(out)  # what train and evaluate read
        assert main(["traces", "show", str(out), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["complete"] is False, k
        assert main([str(a) for a in ["collect", *flags, "--limit", "12", "--out", out]]) == 0
        assert load_traces(out).requests["request_id"].tolist() == expected, k
        capsys.readouterr()


@pytest.mark.slow
def test_characterize_killed_at_each_rename_reruns_to_a_whole_report(small, tmp_path):
    """A characterization wrote its files into --out one by one: killed before its JSON, it left a
    folder the rerun refused as someone else's. Now it appears whole, like an evaluation."""
    argv = ["characterize", small["traces"]]
    points = _kill_points([*argv, "--out", tmp_path / "count"])
    reference = json.loads((tmp_path / "count" / "characterization.json").read_text())
    for k in (points[0], points[-1]):  # before its first file (the folder a rerun refused); its own rename
        out = tmp_path / f"k{k}"
        assert _harness(k, [*argv, "--out", out]).returncode == -signal.SIGKILL, k
        assert not out.exists() or (out / "characterization.html").is_file(), k  # none, or whole
        assert main([str(a) for a in [*argv, "--out", out]]) == 0, k
        assert json.loads((out / "characterization.json").read_text()) == reference
        assert _debris(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("command", [["simulate", "{traces}", "--requests", "16", "--policies", "fcfs-mixed"],
                                     ["batch-timeout", "--requests", "200"],
                                     ["compare-regressors", "{traces}", "--folds", "2", "--repeats", "1"]],
                         ids=lambda argv: argv[0])
def test_in_place_writers_killed_mid_write_rerun(command, small, tmp_path):
    """Commands that write their files into --out one by one: killed at the first renames, they left a
    dead process's temporary file (or a CSV without its JSON) that the rerun took for a folder of
    someone else's and refused."""
    argv = [str(a).format(traces=small["traces"]) for a in command]
    for k in (1, 2):
        out = tmp_path / f"k{k}"
        assert _harness(k, [*argv, "--out", out]).returncode == -signal.SIGKILL, k
        assert main([*argv, "--out", str(out)]) == 0, k
        assert not [p.name for p in out.iterdir() if TMP_MARK in p.name], k


@pytest.mark.slow
def test_across_killed_and_rerun_finishes_the_whole_table(tmp_path, capsys):
    """``evaluate --across`` keeps each finished set's row; a rerun after a kill anywhere reports the
    table of every set, equal to the uninterrupted one, never a part of it."""
    sets = [write(make_traces(n_requests=80, seed=seed), tmp_path / f"set{seed}") for seed in (1, 2)]
    config = tmp_path / "fast.json"
    config.write_text(json.dumps({**FAST_CONFIG, "refine": "ridge"}))  # no candidate search: the table is the point
    argv = ["evaluate", *sets, "--across", "--config", config, "--jobs", "1"]
    points = _kill_points([*argv, "--out", tmp_path / "reference"])
    reference = json.loads((tmp_path / "reference" / "across.json").read_text())
    for k in (points[len(points) // 2], points[-1]):  # the first set's row kept; the table's own rename
        out = tmp_path / f"k{k}"
        assert _harness(k, [*argv, "--out", out]).returncode == -signal.SIGKILL, k
        assert not (out / "across.json").exists()
        assert main([str(a) for a in [*argv, "--out", out]]) == 0, k
        assert json.loads((out / "across.json").read_text()) == reference, k
        assert not kept_results_dir(out).exists() and _debris(out) == []
    assert "evaluated before the interruption" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_directory_named_another_way_is_the_same_model(tmp_path, capsys):
    """A collection resumed with its --model spelled another way (relative, absolute, through a link),
    or characterized with one collected from a copy, is one model: the model's config hash used to
    hold the directory it was loaded from (transformers' ``_name_or_path``), so the rerun of a killed
    collect refused its own finished requests as another model's, and characterize refused the pair."""
    make_tiny_dir(tmp_path / "model")
    (tmp_path / "link").symlink_to(tmp_path / "model", target_is_directory=True)
    flags = ["--batch-size", "4", "--requests-per-shard", "4"]
    first = [*flags, "--budget", "24", "--limit", "8"]
    killed = _harness(5, ["collect", "--model", "model", *first, "--out", "c1"], cwd=tmp_path)  # after a shard
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert any((tmp_path / "c1" / "shards").glob("shard-*.parquet"))
    assert main(["collect", "--model", str(tmp_path / "model"), *first, "--out", str(tmp_path / "c1")]) == 0
    assert main(["collect", "--model", str(tmp_path / "link"), *flags, "--budget", "32", "--limit", "4",
                 "--out", str(tmp_path / "c2")]) == 0
    capsys.readouterr()
    assert main(["characterize", str(tmp_path / "c1"), str(tmp_path / "c2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["rounds"]["n"] == 12


def test_a_retraining_worker_killed_is_one_line_not_a_broken_pool(small):
    """The OOM killer (here: SIGKILL) takes a worker of the retraining pool: every pending task fails with
    concurrent.futures' BrokenProcessPool, which used to surface as a traceback."""
    import multiprocessing
    import threading
    import time

    from dwise_predict.errors import WorkerError
    from dwise_predict.evaluation.pool import RetrainTask, run_tasks
    from dwise_predict.traces import load_traces

    ds = load_traces(small["traces"])
    tasks = [RetrainTask(f"t{i}", ds.split("train"), ds.split("eval"), fast_config()) for i in range(3)]

    def kill_a_worker() -> None:
        while not multiprocessing.active_children():
            time.sleep(0.05)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)

    threading.Thread(target=kill_a_worker, daemon=True).start()
    with pytest.raises(WorkerError, match=r"worker process died .* of 3 retrainings: rerun the same command") as err:
        run_tasks(tasks, jobs=2)
    assert "\n" not in str(err.value)


# --- outputs named through a symbolic link ---------------------------------------------------------

def test_train_overwrite_through_a_link_replaces_the_run_it_names(small, tmp_path):
    """The rename used to land on the link itself: the link became a new run and the old one stayed,
    stale, under its own name."""
    real = tmp_path / "runs" / "2026-01"
    shutil.copytree(small["run"], real)
    (tmp_path / "latest").symlink_to(real, target_is_directory=True)
    assert main(["train", str(small["traces"]), "--out", str(tmp_path / "latest"), "--overwrite", *FAST_FLAGS,
                 "--seed", "5"]) == 0
    assert (tmp_path / "latest").is_symlink() and os.readlink(tmp_path / "latest") == str(real)
    assert json.loads((real / "config.json").read_text())["seed"] == 5
    assert sorted(p.name for p in real.parent.iterdir()) == ["2026-01"]  # no sibling left behind


def test_export_force_through_a_link_takes_the_lock_of_the_bundle_it_names(small, tmp_path, capsys):
    """Two exports to one bundle, one named through a link: each took the lock beside its own name,
    and both wrote at once."""
    from dwise_predict.exports.bundle import export_bundle

    real = export_bundle(small["run"], tmp_path / "bundle", name="tiny", created="2026-01-01T00:00:00+00:00")
    before = _files(real)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with output_lock(real):  # `export --force --out bundle` is running
        assert main(["export", str(small["run"]), "--out", str(tmp_path / "link"), "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"being written by another dwise-predict process (pid {os.getpid()})" in err
    assert _files(real) == before


# --- concurrent writers, stale temporary files ---------------------------------------------------

def test_a_second_writer_of_the_same_run_is_refused_at_once(small, tmp_path, capsys):
    out = tmp_path / "run"
    with output_lock(out):  # another `train --out run` (or export, evaluate) is running
        assert main(["train", str(small["traces"]), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"being written by another dwise-predict process (pid {os.getpid()})" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the lock file goes with its release
    (tmp_path / ".run.lock").write_text("12345")  # left by a holder killed with -9: its flock went with it
    with output_lock(out):
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo"])
def test_a_lock_file_planted_beside_the_output_is_refused_and_what_it_names_kept(small, tmp_path, capsys, planted):
    """A directory others write (a shared mount) may hold a `.NAME.lock` someone placed there: opened
    through a link, the lock truncated the file the link names and wrote a pid into it (a check before
    the open still raced). Every lock (an output's, a trace store's, a zoo's) opens through FileLock."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    lock = tmp_path / ".run.lock"
    {"symlink": lambda: lock.symlink_to(victim), "hardlink": lambda: os.link(victim, lock),
     "fifo": lambda: os.mkfifo(lock)}[planted]()
    assert main(["train", str(small["traces"]), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{lock} is" in err and "not a lock file" in err and "remove" in err, err
    assert victim.read_text() == "keep me" and not (tmp_path / "run").exists()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temp_files_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    target = tmp_path / "index.json"
    dead, live = tmp_path / f".index.json{TMP_MARK}{_dead_pid()}", tmp_path / f".index.json{TMP_MARK}{os.getppid()}"
    dead.write_text("debris")
    live.write_text("another process is writing")
    atomic_write_text(target, "{}")
    assert not dead.exists() and live.exists() and target.read_text() == "{}"
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_an_interrupted_swap_is_put_back_before_anything_else(tmp_path):
    out = tmp_path / "bundle"
    aside = tmp_path / f".bundle{TMP_MARK}{_dead_pid()}-old"
    aside.mkdir()
    (aside / "bundle.json").write_text("old")
    with claim_output(out, [], "a bundle", "bundle.json", replace=True, param="force"):
        assert (out / "bundle.json").read_text() == "old"
    assert not aside.exists()


def test_atomic_dir_publishes_readable_subdirectories(tmp_path):
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "plots").mkdir()
        (tmp / "plots" / "a.png").write_bytes(b"png")
    assert (tmp_path / "out" / "plots" / "a.png").read_bytes() == b"png"


def test_a_new_evaluation_leaves_no_file_of_the_old_one(small, tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "evaluation.json").write_text("{}")
    (out / "loco.json").write_text('{"stale": "another dataset"}')
    assert main(["evaluate", str(small["traces"]), "--run", str(small["run"]), "--out", str(out), "--json"]) == 0
    assert not (out / "loco.json").exists() and (out / "report.html").is_file()


def test_quickstart_stage_is_redone_unless_all_its_files_exist(tmp_path):
    from dwise_predict.quickstart import STAGE_FILES, _done, stage_paths

    paths = stage_paths(tmp_path)
    paths["report"].mkdir(parents=True)
    (paths["report"] / "evaluation.json").write_text("{}")  # killed before report.html was written
    assert not _done(paths, "report")
    for name in STAGE_FILES["report"]:
        (paths["report"] / name).write_text("x")
    assert _done(paths, "report")


def test_quickstart_stage_made_with_other_options_or_code_is_redone_with_every_later_one(tmp_path, monkeypatch):
    import dwise_predict.quickstart as qs

    paths = qs.stage_paths(tmp_path)
    for stage, names in qs.STAGE_FILES.items():
        paths[stage].mkdir(parents=True)
        for name in names:
            (paths[stage] / name).write_text("x")
    lines = []

    def stages(config=qs.QuickstartConfig(), traces="t" * 64):
        return qs._Stages(tmp_path, paths, config, traces, lines.append)

    first = stages()
    assert [first.redo(stage) for stage in qs.STAGE_OPTIONS] == [True, True, True]  # files but no stamps: an older out
    assert lines == [f"    {paths['run']} has no record of what made it (an older dwise-predict): redoing it and every later stage"]
    for stage in qs.STAGE_OPTIONS:
        first.finished(stage)
    assert [stages().redo(stage) for stage in qs.STAGE_OPTIONS] == [False, False, False]
    assert [stages(qs.QuickstartConfig(jobs=1, slots=4, k=2)).redo(s) for s in qs.STAGE_OPTIONS] == [False] * 3

    lines.clear()
    loco_changed = stages(qs.QuickstartConfig(loco=False))
    assert [loco_changed.redo(stage) for stage in qs.STAGE_OPTIONS] == [False, True, True]
    assert lines == [f"    {paths['report']} was made with loco=True (now False): redoing it and every later stage"]
    # the redone stages' stamps are gone at once: killed now, a rerun redoes them whatever its options
    assert sorted(json.loads((tmp_path / qs.STAMPS).read_text())) == ["run"]
    assert [stages().redo(stage) for stage in qs.STAGE_OPTIONS] == [False, True, True]

    lines.clear()
    assert stages(traces="u" * 64).redo("run") is True
    assert lines == [f"    {paths['run']} was made with different traces: redoing it and every later stage"]
    lines.clear()
    again = stages()
    for stage in qs.STAGE_OPTIONS:
        again.finished(stage)
    monkeypatch.setattr(qs, "source_fingerprint", lambda: "edited")
    assert stages().redo("run") is True
    assert lines == [f"    {paths['run']} was made with different code: redoing it and every later stage"]


# --- a full or read-only disk ---------------------------------------------------------------------

def _tmpfs(mount: Path, size: str):
    """Mount a tmpfs of ``size`` at ``mount`` (root only) and unmount it after; skipped where the
    machine does not allow mounting one."""
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: too small for any run or bundle."""
    yield from _tmpfs(tmp_path / "disk", "64k")


@pytest.fixture
def roomy_disk(tmp_path):
    """A 4 MiB tmpfs, for filling up to a chosen point."""
    yield from _tmpfs(tmp_path / "roomy", "4m")


def test_full_disk_at_train_and_export_is_one_line_and_leaves_nothing(small, small_disk, capsys):
    inputs = _files(small["traces"]) | {f"run/{k}": v for k, v in _files(small["run"]).items()}
    for argv in (["train", small["traces"], "--out", small_disk / "run", *FAST_FLAGS],
                 ["export", small["run"], "--out", small_disk / "bundle"]):
        assert main([str(a) for a in argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after train's stage lines (cli/progress.py)
        assert err.startswith("error: ") and "the disk is full" in err and "rerun the same command" in err, err
        assert not [p for p in small_disk.iterdir() if not p.name.endswith(".lock")]  # no half output, no temp dir
    assert _files(small["traces"]) | {f"run/{k}": v for k, v in _files(small["run"]).items()} == inputs


@pytest.fixture(scope="module")
def small_bundle(small, tmp_path_factory) -> Path:
    """``small``'s run exported by the CLI (read only: the sizes of its files)."""
    bundle = tmp_path_factory.mktemp("small-bundle") / "bundle"
    assert main(["export", str(small["run"]), "--out", str(bundle)]) == 0
    return bundle


@pytest.mark.parametrize("fails_at", ["refine.pt", "refine.pt2", "refine.onnx"])
def test_disk_full_inside_the_graph_writers_is_one_line(small, small_bundle, roomy_disk, fails_at, capsys):
    """The disk fills up exactly while a serialised graph is written (TorchScript and torch.export
    write through C++, which would report a bare RuntimeError): still one line, nothing left behind."""
    reference = small_bundle
    order = ["refine.safetensors", "calibration.json", "admission.txt", "admission.onnx", "refine.pt", "refine.pt2",
             "refine.onnx"]  # the order export writes them in
    page = os.statvfs(roomy_disk).f_frsize
    before = order[: order.index(fails_at)]
    room = sum(-(-(reference / f).stat().st_size // page) * page for f in before) + page
    assert (reference / fails_at).stat().st_size > 2 * page  # it cannot fit in the one page left
    stat = os.statvfs(roomy_disk)
    (roomy_disk / "filler").write_bytes(b"x" * (stat.f_bavail * stat.f_frsize - room))
    assert main(["export", str(small["run"]), "--out", str(roomy_disk / "bundle")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the disk is full" in err and "rerun the same command" in err, err
    assert sorted(p.name for p in roomy_disk.iterdir() if not p.name.endswith(".lock")) == ["filler"]


def test_full_disk_at_consolidation_is_one_line(small, small_disk, capsys):
    stat = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"x" * (stat.f_bavail * stat.f_frsize - 8192))  # 8 KiB left
    before = _files(small["traces"])
    assert main(["traces", "merge", str(small["traces"]), "--out", str(small_disk / "merged")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the disk is full" in err and "rerun the same command" in err, err
    assert not (small_disk / "merged" / "requests.parquet").exists()  # nothing that reads as complete
    assert _files(small["traces"]) == before


def test_full_disk_under_the_commands_that_write_in_place_is_one_line(small, small_disk, capsys):
    """characterize (now whole, by rename), simulate and compare-regressors (files beside earlier ones)."""
    inputs = _files(small["traces"])
    for argv in (["characterize", small["traces"], "--out", small_disk / "char"],
                 ["simulate", small["traces"], "--requests", "64", "--policies", "fcfs-mixed", "--out", small_disk / "sim"]):
        stat = os.statvfs(small_disk)
        (small_disk / "filler").write_bytes(b"x" * (stat.f_bavail * stat.f_frsize - 8192))  # 8 KiB left
        assert main([str(a) for a in argv]) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()  # progress lines (simulate's "replaying"), then one error
        assert [line for line in err if line.startswith("error:")] == err[-1:], err
        assert "the disk is full" in err[-1] and "rerun the same command" in err[-1], err
        (small_disk / "filler").unlink()
    assert not (small_disk / "char").exists()  # whole or nothing
    assert _files(small["traces"]) == inputs


def test_zoo_pull_onto_a_full_disk_blames_the_disk_not_the_tar(small_bundle, small_disk, tmp_path, capsys):
    """It said the good tar was "truncated or corrupted; re-publish it" (issue 51)."""
    from dwise_predict.exports.zoo import publish

    entry = publish(small_bundle, tmp_path / "zoo", verify=False)
    assert main(["zoo", "pull", entry["name"], "--zoo", str(tmp_path / "zoo"), "--out", str(small_disk / "b")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the disk is full" in err and "re-publish" not in err, err
    assert not [p for p in small_disk.iterdir() if not p.name.endswith(".lock")]


def test_read_only_disk_is_one_line(small, small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    assert main(["train", str(small["traces"]), "--out", str(small_disk / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot write next to" in err and "read-only" in err.lower(), err
