"""A bundle on the Hugging Face Hub, read: ``hf://OWNER/NAME[@REVISION]`` pulled into a directory
with the same screen as a zoo pull (publishing is :mod:`dwise_predict.exports.hub`'s).

A Hub repository published by ``dwise-predict publish --hub`` holds one bundle, flat: ``bundle.json``,
the files it lists (its ``README.md``, the model card, is the repo's card) and the ``.gitattributes``
the Hub adds to every repository. Revisions are versions: a branch, a tag (``publish --version``) or a
commit hash. :func:`pull_hub` resolves the revision through ``huggingface_hub.snapshot_download``
(its cache, ``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` reads only that cache), then copies the snapshot's
files into a temporary directory beside ``out``, screens and checks the bundle there
(:mod:`dwise_predict.bundles.screen`) and only then renames it into place, as :func:`~dwise_predict.
bundles.zoo.pull` does with a tar. A repository (or a cached snapshot) holding any other name, a
sub-folder, a link leading outside the cache's ``blobs/`` or a file over
:data:`~dwise_predict.bundles.manifest.MAX_FILE_BYTES` is refused, naming it; online, the file list and
sizes are checked before a byte is downloaded (a dry run), and only bundle names are ever fetched.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from dwise_predict.errors import BundleError, InputError, StoreError
from dwise_predict.bundles.manifest import BUNDLE_ARTIFACTS, BUNDLE_FILE, MAX_FILE_BYTES, NAME_PATTERN, printable
from dwise_predict.bundles.screen import open_bundle, screen_bundle
from dwise_predict.files import atomic_dir, claim_output

SCHEME = "hf://"
HUB_FILES = (BUNDLE_FILE, *BUNDLE_ARTIFACTS)  # what a pull fetches of a repository
HUB_EXTRA = (".gitattributes",)  # what the Hub adds to every repository: never copied, never read
# a branch or tag: plain names joined by '/' (no '..', no leading '/'); or a commit hash
REVISION_PATTERN = re.compile(rf"{NAME_PATTERN.pattern}(?:/{NAME_PATTERN.pattern})*")
DEFAULT_REVISION = "main"


def is_hub_ref(ref: str) -> bool:
    """Whether ``ref`` names a Hub repository (``hf://...``) rather than a zoo entry."""
    return ref.startswith(SCHEME)


def parse_hub_ref(ref: str) -> tuple[str, str]:
    """``hf://OWNER/NAME[@REVISION]`` -> (repo id, revision, ``main`` by default); a repo id the Hub
    would refuse or a revision that is not a plain branch, tag or commit name is an :class:`InputError`."""
    repo_id, _, revision = ref.removeprefix(SCHEME).partition("@")
    check_repo_id(repo_id, f"{printable(ref)}: the repo id")
    revision = revision or DEFAULT_REVISION
    check_revision(revision, f"{printable(ref)}: the revision")
    return repo_id, revision


def check_repo_id(repo_id: str, what: str = "`repo_id`") -> None:
    """Refuse a repo id that ``huggingface_hub`` would refuse (its own validator) or that is not
    OWNER/NAME; ``what`` names the value in the message."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    fix = "write OWNER/NAME, e.g. hf://my-org/tiny-predictor"
    try:
        validate_repo_id(repo_id)
    except HFValidationError:  # its message names its own arguments (`repo_type`), not ours
        raise InputError(f"{what} {printable(repo_id)} is not a Hugging Face repo id: {fix}") from None
    if repo_id.count("/") != 1:
        raise InputError(f"{what} {printable(repo_id)} is not a Hugging Face repo id: {fix}")


def check_revision(revision: str, what: str) -> None:
    """A branch, tag or commit name: plain names joined by '/' (it becomes a path in the cache's refs/)."""
    if not REVISION_PATTERN.fullmatch(revision):
        raise InputError(f"{what} {printable(revision)} is not a branch, tag or commit name (letters, digits, '.', "
                         "'_', '-', parts joined by '/')")


def pull_hub(ref: str, out: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """Fetch the bundle of ``hf://OWNER/NAME[@REVISION]`` into the new directory ``out`` (default
    ``./NAME-REVISION``), through the ``huggingface_hub`` cache ``cache_dir`` (default: its own)."""
    repo_id, revision = parse_hub_ref(ref)
    out = Path(out) if out is not None else Path(f"{repo_id.split('/')[1]}-{revision.replace('/', '-')}")
    with claim_output(out, [], "a bundle", BUNDLE_FILE):
        snapshot = _snapshot(repo_id, revision, cache_dir)
        with atomic_dir(out) as tmp:
            _copy_snapshot(snapshot, tmp, ref)
            screen_bundle(tmp, open_bundle(tmp))  # a hostile bundle never reaches --out
    return out


def _snapshot(repo_id: str, revision: str, cache_dir) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision``, downloaded first unless offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (DryRunError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"hf://{repo_id}@{revision}"
    # the environment as it is now, not as huggingface_hub read it at import (a notebook, a test)
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    try:
        if not offline:
            try:
                listing = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, dry_run=True)
            except DryRunError:  # the Hub cannot be reached: the cache may still hold the revision
                listing = []
            check_listing([(f.filename, f.file_size) for f in listing], where)
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(HUB_FILES),
                                      local_files_only=offline))
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:  # "none, or private": one fix for both
        raise InputError(f"{where}: no such repository or revision on the Hub, or it is private "
                         f"({type(err).__name__}): check the name and `hf auth login`") from None
    except LocalEntryNotFoundError:
        raise StoreError(f"{where} is not in the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE}) and the "
                         "Hub cannot be reached (HF_HUB_OFFLINE=1, or no network): pull it once online, or name a "
                         "revision the cache holds; nothing was written") from None
    except (HfHubHTTPError, OSError) as err:
        raise StoreError(f"{where}: the Hub download failed ({type(err).__name__}: {printable(str(err), 200)}): "
                         "rerun the same command; nothing was written") from None


def check_listing(files: list[tuple[str, int]], where: str) -> None:
    """Refuse a repository whose file list (name, bytes) holds anything but a bundle's files (and
    the Hub's ``.gitattributes``) or a file over :data:`MAX_FILE_BYTES`, before anything downloads."""
    for name, size in files:
        if name in HUB_EXTRA:
            continue
        if name not in HUB_FILES:
            raise BundleError(f"{where} holds {printable(name)}, which is not a file of a bundle: a bundle repository "
                              "holds only bundle.json, the files it lists and .gitattributes; refusing to pull it")
        if size is not None and size > MAX_FILE_BYTES:
            raise BundleError(f"{where}: {printable(name)} holds {size:,} bytes, more than any bundle file "
                              f"({MAX_FILE_BYTES:,}); refusing to pull it")


def _copy_snapshot(snapshot: Path, dest: Path, ref: str) -> None:
    """Copy a cached snapshot's bundle files into ``dest``, refusing what :func:`check_listing`
    refuses and any entry that is not a regular file or a link into the cache's own ``blobs/``
    (``huggingface_hub`` stores every file once there and links it from ``snapshots/<commit>/``)."""
    blobs = (snapshot.parent.parent / "blobs").resolve()
    entries = sorted(os.scandir(snapshot), key=lambda e: e.name)
    check_listing([(e.name, None) for e in entries], ref)
    for entry in entries:
        if entry.name in HUB_EXTRA:
            continue
        path = snapshot / entry.name
        target = path.resolve() if entry.is_symlink() else path
        if entry.is_symlink() and target.parent != blobs:
            raise BundleError(f"{ref}: {entry.name} in the cache links to {printable(os.readlink(path))}, outside the "
                              "cache's blobs/: refusing to pull it; delete the cached repo and pull again")
        mode = os.stat(target, follow_symlinks=False).st_mode if target.exists() else 0
        if not stat.S_ISREG(mode):
            raise BundleError(f"{ref}: {entry.name} in the cache is not a regular file (a folder, device or broken "
                              "link): refusing to pull it; delete the cached repo and pull again")
        size = os.stat(target).st_size
        if size > MAX_FILE_BYTES:
            raise BundleError(f"{ref}: {entry.name} holds {size:,} bytes, more than any bundle file "
                              f"({MAX_FILE_BYTES:,}); refusing to pull it")
        shutil.copyfile(target, dest / entry.name)
