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
from dwise_predict.exports.manifest import read_bundle_manifest
from dwise_predict.files import FileLock, sha256_file
from dwise_predict.exports.zoo import find_entry, list_entries, publish, pull


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
    manifest = read_bundle_manifest(bundle)
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
    with pytest.raises(StoreError, match="already exists: choose another --out$"):
        pull(zoo, "tiny", tmp_path / "taken")
    with pytest.raises(InputError, match="no bundle named 'nope'"):
        pull(zoo, "nope", tmp_path / "x")
    with pytest.raises(InputError, match=r"published: 1\)"):
        pull(zoo, "tiny@7", tmp_path / "x")
    with pytest.raises(StoreError, match="no zoo at"):
        list_entries(tmp_path / "nowhere")


def test_held_lock_refuses_publish(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    with FileLock(zoo / ".lock", lambda pid: f"held by {pid}"):  # another publish holds the zoo
        with pytest.raises(StoreError, match=f"locked by another publish \\(pid {os.getpid()}\\)"):
            publish(bundle, zoo, verify=False)
    assert sorted(p.name for p in zoo.iterdir()) == [".lock"]


def test_lock_of_a_dead_publisher_does_not_block(bundle, tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / ".lock").write_text("12345")  # left by a publish that crashed: its flock went with it
    assert publish(bundle, zoo, verify=False)["version"] == "1"


def test_bad_version_string_is_refused(bundle, tmp_path):
    with pytest.raises(InputError, match="--version '../1'"):
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
