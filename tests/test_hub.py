"""Bundles on the Hugging Face Hub, offline: ``zoo pull hf://...`` from a cache laid out by
huggingface_hub's own functions (HF_HUB_OFFLINE), ``publish --hub`` at the ``HfApi`` boundary.

Nothing here reaches the network: the pull reads a cache whose ``refs/``, ``snapshots/<commit>/`` and
``blobs/`` are written with the library's helpers and checked by its ``scan_cache_dir``; the push goes
to a stand-in ``HfApi`` that records each call and turns the uploaded folder into such a cache, so a
publish and a pull round-trip.
"""

import hashlib
import json
import os
import shutil

import pytest
from export_helpers import make_run
from huggingface_hub import constants
from huggingface_hub.file_download import _cache_commit_hash_for_specific_revision, repo_folder_name
from huggingface_hub.utils import scan_cache_dir
from hub_helpers import GITATTRIBUTES, cache_commit

from dwise_predict.bundles import hub as hub_module
from dwise_predict.bundles.hub import check_listing, pull_hub
from dwise_predict.cli import main
from dwise_predict.errors import BundleError, InputError, StoreError
from dwise_predict.exports.bundle import export_bundle
from dwise_predict.exports.hub import publish_hub

REPO = "my-org/tiny-predictor"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("run") / "run")
    return export_bundle(run, tmp_path_factory.mktemp("b") / "bundle", name="tiny", created="2026-01-01T00:00:00+00:00")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=tmp/hf (the constants huggingface_hub read at import)."""
    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def bundle_files(bundle) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(bundle.iterdir())}


def test_pull_resolves_tags_branches_and_commits_from_the_offline_cache(bundle, offline, tmp_path, capsys):
    files = bundle_files(bundle)
    cache_commit(offline, REPO, COMMIT_A, {**files, ".gitattributes": GITATTRIBUTES}, refs=["v1"])
    cache_commit(offline, REPO, COMMIT_B, {**files, "evil.pkl": b"cos\nsystem\n."}, refs=["main"])
    # the library itself reads this layout as a cached repo with its two revisions and refs
    (repo,) = scan_cache_dir(offline).repos
    assert repo.repo_id == REPO and {r.commit_hash for r in repo.revisions} == {COMMIT_A, COMMIT_B}
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {COMMIT_A: {"v1"}, COMMIT_B: {"main"}}

    out = tmp_path / "pulled"
    assert main(["zoo", "pull", f"hf://{REPO}@v1", "--out", str(out)]) == 0
    assert f"pulled hf://{REPO}@v1 -> {out}" in capsys.readouterr().out
    assert bundle_files(out) == files  # byte for byte; .gitattributes stays in the cache
    by_commit = pull_hub(f"hf://{REPO}@{COMMIT_A}", tmp_path / "by-commit")
    assert bundle_files(by_commit) == files
    # main points at the commit that holds a planted pickle: refused, nothing written
    with pytest.raises(BundleError, match="evil.pkl"):
        pull_hub(f"hf://{REPO}", tmp_path / "main")
    assert not (tmp_path / "main").exists()


@pytest.mark.parametrize("plant", ["extra-file", "link-outside", "folder", "oversized", "tampered"])
def test_hostile_repo_content_is_refused_and_nothing_written(bundle, offline, tmp_path, monkeypatch, plant):
    files = bundle_files(bundle)
    if plant == "tampered":  # a listed file changed after the seal: the same check as a local pull
        files["calibration.json"] = files["calibration.json"].replace(b"0", b"1", 1)
    snapshot = cache_commit(offline, REPO, COMMIT_A, files, refs=["main"])
    outside = tmp_path / "secret"
    outside.write_bytes(b"not yours")
    if plant == "extra-file":
        cache_commit(offline, REPO, COMMIT_A, {"model.joblib": b"x"})
    elif plant == "link-outside":
        (snapshot / "README.md").unlink()
        os.symlink(outside, snapshot / "README.md")
    elif plant == "folder":
        (snapshot / "sub").mkdir()
    elif plant == "oversized":
        monkeypatch.setattr(hub_module, "MAX_FILE_BYTES", 1000)
    word = {"extra-file": "model.joblib", "link-outside": "outside the cache", "folder": "sub",
            "oversized": "more than any bundle file", "tampered": "does not match its sha256"}[plant]
    with pytest.raises(BundleError, match=word):
        pull_hub(f"hf://{REPO}", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["hf", "secret"]


def test_online_listing_is_checked_before_anything_downloads(bundle, tmp_path, monkeypatch):
    """Online, a dry run lists the repo's files and sizes; a hostile list stops the pull there."""
    import huggingface_hub
    from huggingface_hub.file_download import DryRunFileInfo

    calls = []

    def stand_in(repo_id, revision=None, cache_dir=None, dry_run=False, allow_patterns=None):
        calls.append(dry_run)
        names = ["bundle.json", "README.md", ".gitattributes", "weights.pkl"]
        return [DryRunFileInfo(commit_hash=COMMIT_A, file_size=10, filename=n, local_path="", is_cached=False,
                               will_download=True) for n in names]

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", stand_in)
    with pytest.raises(BundleError, match="weights.pkl"):
        pull_hub(f"hf://{REPO}@v1", tmp_path / "out")
    assert calls == [True] and not (tmp_path / "out").exists()
    check_listing([("bundle.json", 10), (".gitattributes", 1 << 40)], "hf://x/y")  # .gitattributes is never read
    with pytest.raises(BundleError, match="more than any bundle file"):
        check_listing([("refine.onnx", (16 << 30) + 1)], "hf://x/y")


@pytest.mark.parametrize("ref, error, word", [
    ("hf://no-slash", InputError, "owner/name"),
    ("hf://a/b/c", InputError, "not a hugging face repo id"),
    ("hf://my-org/x..y", InputError, "not a hugging face repo id"),
    (f"hf://{REPO}@../../etc", InputError, "not a branch, tag or commit"),
    (f"hf://{REPO}@v9", StoreError, "not in the hugging face cache"),
])
def test_bad_references_are_one_clear_error(bundle, offline, tmp_path, ref, error, word):
    cache_commit(offline, REPO, COMMIT_A, bundle_files(bundle), refs=["main", "v1"])
    with pytest.raises(error) as raised:
        pull_hub(ref, tmp_path / "out")
    assert word in str(raised.value).lower() and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


class StandInApi:
    """``huggingface_hub.HfApi`` at its boundary: records each call; ``upload_folder`` keeps the
    uploaded files (``allow_patterns`` applied as the library applies them) and lays the commit out
    as the cache a later ``snapshot_download`` would leave, so a pull reads what was pushed."""

    def __init__(self, cache=None, tags=()):
        self.calls, self.cache, self.tags, self.commits = [], cache, list(tags), 0

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def list_repo_refs(self, repo_id, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(tags=[SimpleNamespace(name=t) for t in self.tags], branches=[])

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        from types import SimpleNamespace

        from huggingface_hub.utils import filter_repo_objects

        names = sorted(filter_repo_objects(os.listdir(kwargs["folder_path"]), allow_patterns=kwargs["allow_patterns"]))
        uploaded = {n: open(os.path.join(kwargs["folder_path"], n), "rb").read() for n in names}
        self.commits += 1
        oid = hashlib.sha1(str(self.commits).encode()).hexdigest()
        self.calls.append(("upload_folder", uploaded, kwargs))
        if self.cache is not None:
            cache_commit(self.cache, kwargs["repo_id"], oid, {**uploaded, ".gitattributes": GITATTRIBUTES},
                         refs=[kwargs["revision"]])
        return SimpleNamespace(oid=oid, commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/{oid}")

    def create_tag(self, repo_id, **kwargs):
        self.calls.append(("create_tag", repo_id, kwargs))
        self.tags.append(kwargs["tag"])
        if self.cache is not None:
            storage = self.cache / repo_folder_name(repo_id=repo_id, repo_type="model")
            _cache_commit_hash_for_specific_revision(str(storage), kwargs["tag"], kwargs["revision"])


def test_publish_commits_the_bundle_with_its_card_and_tags_the_version(bundle, offline, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    (bundle.parent / "stray").mkdir(exist_ok=True)
    shutil.copy(bundle / "bundle.json", bundle.parent / "stray" / "bundle.json")
    api = StandInApi(cache=offline)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    assert main(["publish", str(bundle), "--hub", REPO, "--version", "v1", "--revision", "exp"]) == 0  # verifies
    assert f"-> hf://{REPO}@v1 (commit " in capsys.readouterr().out
    kinds = [c[0] for c in api.calls]
    assert kinds == ["create_repo", "create_branch", "upload_folder", "create_tag"]
    _, uploaded, upload = api.calls[2]
    assert uploaded == bundle_files(bundle)  # bundle.json and exactly the files it lists
    card = uploaded["README.md"].decode()
    assert card.startswith("---\nlibrary_name: onnx\n") and "# tiny: workload predictors" in card
    assert upload["repo_id"] == REPO and upload["revision"] == "exp" and upload["repo_type"] == "model"
    assert upload["commit_message"] == "dwise-predict publish tiny@v1"
    assert "refine.pt" in upload["delete_patterns"]  # a previous bundle's optional files do not linger
    tag = api.calls[3][2]
    assert tag["tag"] == "v1" and tag["revision"] == hashlib.sha1(b"1").hexdigest()
    # what was pushed pulls back byte for byte, by tag and by branch
    assert bundle_files(pull_hub(f"hf://{REPO}@v1", tmp_path / "v1")) == bundle_files(bundle)
    assert bundle_files(pull_hub(f"hf://{REPO}@exp", tmp_path / "exp")) == bundle_files(bundle)


def test_publish_never_moves_a_tag_and_checks_names_before_any_call(bundle, tmp_path):
    api = StandInApi(tags=["v1"])
    with pytest.raises(InputError, match="never overwritten"):
        publish_hub(bundle, REPO, version="v1", verify=False, api=api)
    assert [c[0] for c in api.calls] == ["create_repo"]  # nothing uploaded
    for repo, version, word in [("no-slash", None, "OWNER/NAME"), (REPO, "../x", "not a branch")]:
        api = StandInApi()
        with pytest.raises(InputError, match=word):
            publish_hub(bundle, repo, version=version, verify=False, api=api)
        assert api.calls == []


def test_publish_usage_errors_are_one_line(bundle, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DWISE_ZOO", raising=False)
    cases = [(["--zoo", str(tmp_path / "z"), "--hub", REPO], "not both"),
             (["--zoo", str(tmp_path / "z"), "--revision", "exp"], "--revision is for the hub"),
             (["--hub", REPO, "--name", "x"], "--name is for a zoo")]
    for extra, word in cases:
        assert main(["publish", str(bundle), *extra]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert word in line.lower()
    assert not (tmp_path / "z").exists()


def test_traces_as_a_datasets_dataset_round_trip(synthetic_traces, tmp_path):
    """to_dataset(): the request table plus the two hidden matrices as list columns, values equal;
    requests.parquet reads as is through datasets.load_dataset("parquet", ...)."""
    import datasets
    import numpy as np

    from dwise_predict.traces.dataset import load_traces, write_traces

    path = write_traces(synthetic_traces, tmp_path / "traces")
    traces = load_traces(path)
    ds = traces.to_dataset()
    assert isinstance(ds, datasets.Dataset) and ds.num_rows == len(traces) == 480
    assert list(ds.column_names) == [*traces.requests.columns, "first_round", "prompt_last"]
    assert ds.features["first_round"] == datasets.List(datasets.Value("float32"), length=32)
    np.testing.assert_array_equal(ds.with_format("numpy")["first_round"], traces.first_round)
    np.testing.assert_array_equal(np.asarray(ds["prompt_last"], dtype=np.float32), traces.prompt_last)
    assert ds["total_rounds"] == traces.requests["total_rounds"].tolist()
    assert ds["rounds_per_block"] == [list(v) for v in traces.requests["rounds_per_block"]]
    assert ds["request_id"] == traces.requests["request_id"].tolist()
    assert json.loads(ds.info.description)["model"] == traces.manifest["model"]

    table = datasets.load_dataset("parquet", data_files=str(path / "requests.parquet"), split="train",
                                  cache_dir=str(tmp_path / "hf-datasets"))
    assert table.num_rows == 480 and table["total_rounds"] == ds["total_rounds"]
    assert table["rounds_per_block"] == ds["rounds_per_block"]
