"""The zoo: publish never overwrites, pull checks the tar and extracts safely, bad input is one line."""

import io
import json
import os
import tarfile

import pytest
from export_helpers import make_run

from dwise_predict.cli import main
from dwise_predict.errors import BundleError, InputError, StoreError
from dwise_predict.exports.bundle import export_bundle
from dwise_predict.bundles.manifest import read_bundle_manifest
from dwise_predict.files import FileLock, sha256_file
from dwise_predict.bundles.zoo import find_entry, list_entries, pull
from dwise_predict.exports.zoo import publish


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("run") / "run")
    return export_bundle(run, tmp_path_factory.mktemp("b") / "bundle", name="tiny", created="2026-01-01T00:00:00+00:00")


def test_publish_list_show_pull(bundle, tmp_path, capsys):
    zoo = tmp_path / "zoo"
    assert main(["publish", str(bundle), "--zoo", str(zoo)]) == 0  # verifies first
    assert "published tiny@1" in capsys.readouterr().out
    second = publish(bundle, zoo, verify=False)
    assert second["version"] == "2"
    entries = list_entries(zoo)
    assert [(e["name"], e["version"]) for e in entries] == [("tiny", "1"), ("tiny", "2")]
    manifest = read_bundle_manifest(bundle).raw  # the index copies bundle.json's values as written
    entry = entries[0]
    assert entry["model"] == manifest["model"] and entry["metrics"] == manifest["metrics"]
    assert entry["hidden_size"] == manifest["inputs"]["refine"]["hidden_size"] and entry["K"] == manifest["K"]
    tar = zoo / entry["file"]
    assert entry["sha256"] == sha256_file(tar) and entry["bytes"] == tar.stat().st_size
    assert second["sha256"] == entry["sha256"]  # same bundle, byte-identical tar
    assert find_entry(zoo, "tiny")["version"] == "2" and find_entry(zoo, "tiny@1") == entry

    assert main(["zoo", "show", "tiny@1", "--zoo", str(zoo)]) == 0
    assert json.loads(capsys.readouterr().out)["sha256"] == entry["sha256"]
    assert main(["zoo", "list", "--zoo", str(zoo), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2

    out = tmp_path / "pulled"
    assert main(["zoo", "pull", "tiny@1", "--zoo", str(zoo), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in bundle.iterdir())
    for p in bundle.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()


def test_published_version_is_never_overwritten(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    first = publish(bundle, zoo, version="1.0", verify=False)
    before = (zoo / "index.json").read_bytes()
    with pytest.raises(StoreError, match="never overwritten"):
        publish(bundle, zoo, version="1.0", verify=False)
    assert (zoo / "index.json").read_bytes() == before
    assert sha256_file(zoo / first["file"]) == first["sha256"]


def test_a_zoo_is_never_made_inside_the_bundle_or_over_another_folder(bundle, tmp_path, capsys):
    """A zoo written into the bundle would break the bundle's own verification; one written over a
    folder of another kind (traces, notes) would mix with it: both are refused, nothing written."""
    import shutil

    copy = shutil.copytree(bundle, tmp_path / "b")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    snapshot = {p: p.read_bytes() for p in [*copy.rglob("*"), *notes.rglob("*")] if p.is_file()}
    for zoo, message in ((copy / "zoo", "--zoo .* lies inside the input BUNDLE"), (copy, "--zoo .* is the input BUNDLE"),
                         (tmp_path, "--zoo .* contains the input BUNDLE"), (notes, "holds files but is not a zoo")):
        assert main(["publish", str(copy), "--zoo", str(zoo)]) == 1, zoo
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and __import__("re").search(message, err), err
    assert {p: p.read_bytes() for p in [*copy.rglob("*"), *notes.rglob("*")] if p.is_file()} == snapshot
    assert main(["verify", str(copy)]) == 0


def test_invalid_index_is_one_line_and_nothing_is_published(bundle, tmp_path, capsys):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "index.json").write_text('{"bundles": [')
    assert main(["publish", str(bundle), "--zoo", str(zoo)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not valid JSON" in err
    # no tar, index untouched; the lock file stays, unlocked (the OS drops a flock with its holder)
    assert sorted(p.name for p in zoo.iterdir()) == [".lock", "index.json"]
    assert (zoo / "index.json").read_text() == '{"bundles": ['
    assert main(["zoo", "list", "--zoo", str(zoo)]) == 1


def test_truncated_tar_is_refused_and_nothing_extracted(bundle, tmp_path, capsys):
    zoo = tmp_path / "zoo"
    entry = publish(bundle, zoo, verify=False)
    tar = zoo / entry["file"]
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2])
    out = tmp_path / "pulled"
    assert main(["zoo", "pull", "tiny", "--zoo", str(zoo), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "truncated or corrupted" in err and entry["file"].split("/")[-1] in err
    assert not out.exists() and not list(tmp_path.glob(".pulled*"))


def _evil_zoo(tmp_path, member: tarfile.TarInfo, data: bytes = b"x"):
    """A zoo whose index correctly lists a tar holding one hostile member."""
    zoo = tmp_path / "zoo"
    (zoo / "bundles" / "evil").mkdir(parents=True)
    path = zoo / "bundles" / "evil" / "evil-1.tar"
    with tarfile.open(path, "w") as tar:
        member.size = len(data) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    entry = {"name": "evil", "version": "1", "file": "bundles/evil/evil-1.tar", "sha256": sha256_file(path),
             "bytes": path.stat().st_size}
    (zoo / "index.json").write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    return zoo


@pytest.mark.parametrize("name,kind", [("/etc/evil", tarfile.REGTYPE), ("../evil", tarfile.REGTYPE),
                                       ("sub/bundle.json", tarfile.REGTYPE), ("link", tarfile.SYMTYPE)])
def test_hostile_tar_members_are_refused(tmp_path, name, kind):
    member = tarfile.TarInfo(name)
    member.type = kind
    if kind == tarfile.SYMTYPE:
        member.linkname = "/etc/passwd"
    zoo = _evil_zoo(tmp_path, member)
    with pytest.raises(BundleError, match="not a plain file at the top level"):
        pull(zoo, "evil", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil").exists()
    assert not list(tmp_path.glob(".out*"))


def test_pull_refuses_existing_out_and_unknown_names(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    publish(bundle, zoo, verify=False)
    pull(zoo, "tiny", tmp_path / "taken")
    with pytest.raises(StoreError, match="already exists: choose another `out`$"):
        pull(zoo, "tiny", tmp_path / "taken")
    with pytest.raises(InputError, match="no bundle named 'nope'"):
        pull(zoo, "nope", tmp_path / "x")
    with pytest.raises(InputError, match=r"published: 1\)"):
        pull(zoo, "tiny@7", tmp_path / "x")
    with pytest.raises(StoreError, match="no zoo at"):
        list_entries(tmp_path / "nowhere")


def test_held_lock_refuses_publish_after_waiting(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    with FileLock(zoo / ".lock", lambda pid: f"held by {pid}"):  # another publish holds the zoo, too long
        with pytest.raises(StoreError, match=f"locked by another publish \\(pid {os.getpid()}\\), still after 0.2 s"):
            publish(bundle, zoo, verify=False, lock_wait_s=0.2)
    assert sorted(p.name for p in zoo.iterdir()) == [".lock"]


def test_lock_of_a_dead_publisher_does_not_block(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / ".lock").write_text("12345")  # left by a publish that crashed: its flock went with it
    assert publish(bundle, zoo, verify=False)["version"] == "1"


def test_bad_version_string_is_refused(bundle, tmp_path):
    with pytest.raises(InputError, match="`version` '../1'"):
        publish(bundle, tmp_path / "zoo", version="../1", verify=False)


def test_tampered_bundle_is_not_published(bundle, tmp_path):
    path = bundle / "refine.onnx"
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 0x01]))
    try:
        with pytest.raises(BundleError, match=r"fails verification \(refine\.onnx"):
            publish(bundle, tmp_path / "zoo")
    finally:
        path.write_bytes(original)
    assert not (tmp_path / "zoo").exists()


# --- issue 43: hostile indexes and tars, concurrent publishes ---------------------------------------

def _index(zoo, entries) -> None:
    zoo.mkdir(parents=True, exist_ok=True)
    (zoo / "index.json").write_text(json.dumps({"schema_version": 1, "bundles": entries}))


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name,version", [("../../evil", "1"), ("..", "1"), ("tiny", "../../x"), ("ABS", "1"),
                                          ("tiny", "ABS"), ("ev\u2028il", "1")])
def test_pull_with_a_hostile_name_or_version_writes_nothing(bundle, tmp_path, monkeypatch, capsys, name, version):
    """Issue 43: an index entry renamed to a path, its file still a real published tar with the right
    sha256: `zoo pull` with the default --out (./NAME-VERSION) wrote outside the current directory
    (ABS: an absolute path). Now the entry is refused and nothing is written anywhere."""
    zoo, work = tmp_path / "zoo", tmp_path / "work" / "here"
    publish(bundle, zoo, verify=False)
    name, version = (str(tmp_path / "abs") if v == "ABS" else v for v in (name, version))
    index = json.loads((zoo / "index.json").read_text())
    index["bundles"][0].update(name=name, version=version)
    (zoo / "index.json").write_text(json.dumps(index))
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    assert main(["zoo", "pull", f"{name}@{version}", "--zoo", str(zoo)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "entry 0" in err and "\u2028" not in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("kind", [tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE, tarfile.DIRTYPE])
def test_links_devices_and_directories_in_a_tar_are_refused(tmp_path, kind):
    member = tarfile.TarInfo("refine.onnx")
    member.type = kind
    member.linkname = "/etc/passwd" if kind == tarfile.LNKTYPE else ""
    zoo = _evil_zoo(tmp_path, member)
    with pytest.raises(BundleError, match="not a plain file at the top level"):
        pull(zoo, "evil", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_unknown_and_repeated_tar_members_are_refused(tmp_path):
    zoo = _evil_zoo(tmp_path, tarfile.TarInfo("payload.pkl"), b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(BundleError, match="'payload.pkl', which is not a file of a bundle"):
        pull(zoo, "evil", tmp_path / "out")
    tar_path = zoo / "bundles" / "evil" / "evil-1.tar"
    with tarfile.open(tar_path, "w") as tar:
        for data in (b"first", b"second"):
            info = tarfile.TarInfo("README.md")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    entry = {"name": "evil", "version": "1", "file": "bundles/evil/evil-1.tar", "sha256": sha256_file(tar_path)}
    _index(zoo, [entry])
    with pytest.raises(BundleError, match="holds 'README.md' twice"):
        pull(zoo, "evil", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index,message", [
    ('{"schema_version": 1, "bundles": ' + "[" * 3000 + "]" * 3000 + "}", "more than 64 deep"),
    ('{"schema_version": 1, "bundles": [{"name": "x", "version": "1", "file": "bundles/x/x-1.tar", "sha256": "0", '
     '"metrics": [1]}]}', "entry 0 has a metrics of type list"),
    ('{"schema_version": 1, "bundles": [{"name": "x", "version": "1", "file": "bundles/y/x-1.tar", "sha256": "0"}]}',
     "not where publish puts x@1"),
    ('{"schema_version": 1e400, "bundles": []}', "has schema inf"),
])
def test_a_hostile_index_is_one_line(tmp_path, capsys, index, message):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "index.json").write_text(index)
    for argv in (["zoo", "list", "--zoo", str(zoo)], ["zoo", "pull", "x", "--zoo", str(zoo), "--out", str(tmp_path / "o")],
                 ["zoo", "show", "x", "--zoo", str(zoo)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err


def test_zoo_list_shows_index_text_inert(bundle, tmp_path, capsys):
    """A model name holding a terminal escape sequence and Rich markup is printed escaped, on its line."""
    zoo = tmp_path / "zoo"
    publish(bundle, zoo, verify=False)
    index = json.loads((zoo / "index.json").read_text())
    index["bundles"][0]["model"]["name"] = "[red]x\x1b]0;owned\x07\u2028y"
    (zoo / "index.json").write_text(json.dumps(index))
    assert main(["zoo", "list", "--zoo", str(zoo)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u2028" not in out and "[red]x\\x1b" in out


def test_publish_of_a_bundle_with_a_unicode_line_separator_in_its_name_is_one_line(bundle, tmp_path, capsys):
    """Issue 43: bundle.json names the bundle with U+2028, which splits lines (str.splitlines, terminals)."""
    import shutil

    from dwise_predict.bundles.manifest import write_bundle_manifest

    copy = shutil.copytree(bundle, tmp_path / "b")
    manifest = read_bundle_manifest(copy).raw
    manifest["name"] = "tïny\u2028error: forged second line"
    write_bundle_manifest(copy, manifest)
    assert main(["publish", str(copy), "--zoo", str(tmp_path / "zoo")]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "'tïny\\u2028error: forged second line'" in err and "pass --name" in err
    assert not (tmp_path / "zoo").exists()


PUBLISH = """
import sys
import dwise_predict.exports.verify
from dwise_predict.cli import main
dwise_predict.exports.verify.require_verified = lambda bundle: None  # the lock is under test, not verify's worker
print("ready", flush=True)
sys.stdin.readline()  # both processes reach the zoo together
sys.exit(main(["publish", sys.argv[1], "--zoo", sys.argv[2], *sys.argv[3:]]))
"""


def _publish_together(bundle, zoo, *extra):
    """Two `dwise-predict publish` processes released at the same instant, once both have imported the
    package; (exit code, stderr) each."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", PUBLISH, str(bundle), str(zoo), *extra], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def test_concurrent_publishes_take_turns(bundle, tmp_path):
    """Issue 43: two publishes into one zoo at once. The zoo has one writer at a time (its lock): the
    second waits for the first, then takes the next free version; both tars are whole and indexed.
    With the same --version, exactly one succeeds and the other says why, in one line."""
    zoo = tmp_path / "zoo"
    results = _publish_together(bundle, zoo, "--version", "7")
    assert sorted(code for code, _ in results) == [0, 1], results
    err = next(err for code, err in results if code == 1).strip()
    assert "\n" not in err and "already in the zoo" in err
    results = _publish_together(bundle, zoo)
    assert [code for code, _ in results] == [0, 0], results
    entries = list_entries(zoo)
    assert sorted(e["version"] for e in entries) == ["7", "8", "9"]  # the next integers after 7
    for entry in entries:
        assert sha256_file(zoo / entry["file"]) == entry["sha256"]
    assert sorted(p.name for p in (zoo / "bundles" / "tiny").iterdir()) == ["tiny-7.tar", "tiny-8.tar", "tiny-9.tar"]


def test_a_publish_waits_for_the_one_holding_the_zoo(bundle, tmp_path):
    """Another process holds the zoo's lock for two seconds: publish waits, then publishes."""
    import subprocess
    import sys
    import time

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom dwise_predict.files import FileLock\n"
        f"with FileLock({str(zoo / '.lock')!r}, str):\n    print('held', flush=True)\n    time.sleep(2)\n")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    entry = publish(bundle, zoo, verify=False)
    assert holder.wait(timeout=60) == 0
    assert entry["version"] == "1" and time.monotonic() - start > 1.0


def test_links_planted_in_a_shared_zoo_are_refused(bundle, tmp_path, capsys):
    """A zoo on a shared mount may hold links someone else placed: a `.lock` link would make publish
    truncate the file it points at, a `bundles/NAME` link would make it write elsewhere, and a tar
    link to /dev/zero would make pull hash forever."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / ".lock").symlink_to(victim)
    assert main(["publish", str(bundle), "--zoo", str(zoo)]) == 1
    assert "is a symbolic link" in capsys.readouterr().err and victim.read_text() == "keep me"
    (zoo / ".lock").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (zoo / "bundles").mkdir()
    (zoo / "bundles" / "tiny").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="bundles/tiny is a symbolic link"):
        publish(bundle, zoo, verify=False)
    assert list(elsewhere.iterdir()) == []
    (zoo / "bundles" / "tiny").unlink()
    entry = publish(bundle, zoo, verify=False)
    (zoo / entry["file"]).unlink()
    (zoo / entry["file"]).symlink_to("/dev/zero")
    assert main(["zoo", "pull", "tiny", "--zoo", str(zoo), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tiny-1.tar is a symbolic link" in err and not (tmp_path / "out").exists()
