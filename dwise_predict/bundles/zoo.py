"""A model zoo, read: its index, an entry, a pull (the side a serving process needs; publishing is
:mod:`dwise_predict.exports.zoo`'s, which writes the layout below).

Layout::

    ZOO/index.json                          {"schema_version": 1, "bundles": [entry, ...]}
    ZOO/bundles/NAME/NAME-VERSION.tar       one bundle, flat, deterministic tar (mtime 0, root-owned)

An index and its tars may come from someone else: :func:`read_index` accepts an entry only when its
name and version are plain names (:data:`~dwise_predict.bundles.manifest.NAME_PATTERN`: no ``/``,
no ``..``) and its file is exactly ``bundles/NAME/NAME-VERSION.tar``, so no entry leads outside the
zoo and the default ``--out`` of ``pull`` (``./NAME-VERSION``) stays in the current directory.
:func:`pull` checks the tar's sha256 against the index, extracts only regular files named as bundle
artifacts (no absolute paths, no ``..``, no links, devices, sparse or repeated members) into a
temporary directory, checks and screens the bundle there (:mod:`dwise_predict.bundles.screen`) and
only then renames it into place. Here, not in ``exports``, because the serving hook follows a zoo
(:mod:`dwise_predict.serving.sglang.follow`) and the runtime never imports ``exports``.
"""

from __future__ import annotations

import errno
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from dwise_predict.errors import BundleError, InputError, StoreError
from dwise_predict.bundles.manifest import BUNDLE_ARTIFACTS, BUNDLE_FILE, MANIFEST_MAX_BYTES, NAME_PATTERN, printable
from dwise_predict.bundles.screen import open_bundle, screen_bundle
from dwise_predict.files import atomic_dir, claim_output, read_json, sha256_file

INDEX_FILE = "index.json"
ZOO_SCHEMA_VERSION = 1
ENTRY_KEYS = ("name", "version", "file", "sha256")  # what list, show, pull and publish read of an entry
# what else list and show read of an entry, when it is there: name -> the types it may have
ENTRY_FIELDS = {"bytes": (int,), "published": (str,), "created": (str,), "bundle_schema_version": (int,),
                "model": (dict,), "decoding": (dict,), "hidden_size": (int,), "K": (int,), "metrics": (dict,)}
INDEX_MAX_BYTES = 256 << 20  # some 100,000 entries


def read_index(zoo: str | Path, missing_ok: bool = False) -> dict:
    """The zoo's ``index.json``; a missing zoo, invalid JSON or newer schema is a :class:`StoreError`."""
    zoo = Path(zoo)
    path = zoo / INDEX_FILE
    if not path.is_file():
        if missing_ok:
            return {"schema_version": ZOO_SCHEMA_VERSION, "bundles": []}
        raise StoreError(f"no zoo at {zoo} (no {INDEX_FILE}): publish a bundle there first with `dwise-predict publish`")
    fix = "restore it from a backup; nothing was changed"
    index = read_json(path, StoreError, f"zoo index {path}", fix, max_bytes=INDEX_MAX_BYTES)  # size checked before reading
    if not isinstance(index, dict) or not isinstance(index.get("bundles"), list):
        raise StoreError(f"zoo index {path} has no 'bundles' list: restore it from a backup; nothing was changed")
    if not isinstance(index.get("schema_version"), int) or index["schema_version"] > ZOO_SCHEMA_VERSION:
        raise StoreError(f"zoo index {path} has schema {index.get('schema_version')!r}, newer than this "
                         f"dwise-predict reads ({ZOO_SCHEMA_VERSION}): upgrade dwise-predict")
    for i, entry in enumerate(index["bundles"]):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ENTRY_KEYS):
            raise StoreError(f"zoo index {path}: entry {i} is not an object with string {', '.join(ENTRY_KEYS)}: "
                             "restore the index from a backup; nothing was changed")
        file = PurePosixPath(entry["file"])
        if file.is_absolute() or ".." in file.parts or "\\" in entry["file"]:
            # publish writes bundles/NAME/NAME-VERSION.tar; anything leaving the zoo is a damaged or hostile index
            raise StoreError(f"zoo index {path}: entry {i} points outside the zoo ({printable(entry['file'])}): "
                             "restore the index from a backup; nothing was changed")
        # a name or version is a directory and file name of the zoo, and pull's default --out
        for key in ("name", "version"):
            if not NAME_PATTERN.fullmatch(entry[key]):
                raise StoreError(f"zoo index {path}: entry {i} has the {key} {printable(entry[key])}, which is not a "
                                 f"plain name (letters, digits, '.', '_', '-'): {fix}")
        if entry["file"] != tar_file(entry["name"], entry["version"]):
            raise StoreError(f"zoo index {path}: entry {i} points at {printable(entry['file'])}, not where publish "
                             f"puts {entry['name']}@{entry['version']} ({tar_file(entry['name'], entry['version'])}): {fix}")
        for key, types in ENTRY_FIELDS.items():
            if entry.get(key) is not None and (not isinstance(entry[key], types) or isinstance(entry[key], bool)):
                raise StoreError(f"zoo index {path}: entry {i} has a {key} of type {type(entry[key]).__name__}: {fix}")
    return index


def tar_file(name: str, version: str) -> str:
    """Where publish puts ``name@version``, relative to the zoo."""
    return f"bundles/{name}/{name}-{version}.tar"


def list_entries(zoo: str | Path) -> list[dict]:
    """Every published bundle, in publication order."""
    return list(read_index(zoo)["bundles"])


def find_entry(zoo: str | Path, ref: str) -> dict:
    """Entry for ``NAME@VERSION``, or the latest published version of ``NAME``."""
    name, _, version = ref.partition("@")
    entries = [e for e in list_entries(zoo) if e["name"] == name]
    if not entries:
        raise InputError(f"no bundle named {printable(name)} in the zoo {zoo}: see `dwise-predict zoo list --zoo {zoo}`")
    if not version:
        return entries[-1]
    for entry in entries:
        if entry["version"] == version:
            return entry
    versions = ", ".join(e["version"] for e in entries)
    raise InputError(f"'{name}' has no version {printable(version)} in the zoo {zoo} (published: {versions})")


def pull(zoo: str | Path, ref: str, out: str | Path | None = None) -> Path:
    """Fetch ``NAME[@VERSION]`` from the zoo into the new directory ``out`` (default ``./NAME-VERSION``)."""
    zoo = Path(zoo)
    entry = find_entry(zoo, ref)
    out = Path(out) if out is not None else Path(f"{entry['name']}-{entry['version']}")
    with claim_output(out, [("`zoo`", zoo)], "a bundle", BUNDLE_FILE):
        return _pull(zoo, entry, out)


def refuse_links(zoo: Path, path: Path) -> None:
    """Refuse a link on the way from ``zoo`` to ``path`` (a shared zoo may hold one someone planted):
    through it a publish would write, or a pull read, outside the zoo (or hang on /dev/zero)."""
    parts = path.relative_to(zoo).parts
    for depth in range(1, len(parts) + 1):
        step = zoo.joinpath(*parts[:depth])
        if step.is_symlink():
            raise StoreError(f"{step} is a symbolic link: a zoo holds only plain directories and files; remove "
                             "the link (and check who placed it)")


def _pull(zoo: Path, entry: dict, out: Path) -> Path:
    tar_path = zoo / entry["file"]
    refuse_links(zoo, tar_path)
    if not tar_path.is_file():
        raise StoreError(
            f"{tar_path} is missing from the zoo: the index lists it; re-publish {entry['name']}@{entry['version']}"
        )
    if sha256_file(tar_path) != entry["sha256"]:
        raise BundleError(
            f"{tar_path} does not match its sha256 in {zoo / INDEX_FILE}: the tar is truncated or corrupted; "
            "re-publish it"
        )
    with atomic_dir(out) as tmp:
        _extract_flat(tar_path, tmp)
        screen_bundle(tmp, open_bundle(tmp))  # a hostile bundle never reaches --out
    return out



def _extract_flat(tar_path: Path, dest: Path) -> None:
    """Extract only regular files named as bundle artifacts; refuse anything else, naming the member.

    Stricter than tarfile's ``data`` filter, which would still write sub-directories and links
    inside ``dest``: a bundle is flat, so a tar member is a regular file with a known name, written
    once. A sparse member is refused too: its header may claim far more bytes than the tar holds.
    """
    allowed = {BUNDLE_FILE, *BUNDLE_ARTIFACTS}
    try:
        with tarfile.open(tar_path, "r:") as tar:
            for member in tar:
                name = member.name
                if not member.isfile() or Path(name).name != name or name in ("", ".", "..") or name.startswith("/"):
                    raise BundleError(
                        f"{tar_path} holds {printable(name)}, which is not a plain file at the top level: refusing to extract"
                    )
                if name not in allowed or member.issparse():
                    raise BundleError(f"{tar_path} holds {printable(name)}, which is not a file of a bundle "
                                      "(or is stored sparse): refusing to extract")
                target = dest / name
                if target.exists():
                    raise BundleError(f"{tar_path} holds {printable(name)} twice: refusing to extract")
                source = tar.extractfile(member)
                with open(target, "wb") as f:
                    shutil.copyfileobj(source, f)
    except (tarfile.TarError, EOFError, OSError) as err:
        if _writing_failed(err, dest):
            raise  # the disk under `out`, not the tar: atomic_dir says so (re-publishing a good tar would not help)
        raise BundleError(
            f"{tar_path} is not a readable tar ({err}): it is truncated or corrupted; re-publish it"
        ) from None


def _writing_failed(err: BaseException, dest: Path) -> bool:
    """Whether ``err`` came from writing into ``dest`` (a full, read-only or forbidden disk), not from
    reading the tar."""
    if not isinstance(err, OSError):
        return False
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return True
    return err.filename is not None and Path(err.filename).parent == dest


def published_manifest(zoo: str | Path, entry: dict) -> bytes | None:
    """The ``bundle.json`` bytes inside the tar of ``entry`` (its first member, as publish writes it),
    read without extracting the rest; None when the tar's first member is not one. Not checked
    against the index's sha256: only for telling which published version a bundle at hand is
    (sealed manifests are canonical, so equal bytes are the same bundle); :func:`pull` checks all."""
    zoo = Path(zoo)
    path = zoo / entry["file"]
    refuse_links(zoo, path)
    try:
        with tarfile.open(path, "r:") as tar:
            member = tar.next()
            if member is None or member.name != BUNDLE_FILE or not member.isfile() or member.size > MANIFEST_MAX_BYTES:
                return None
            return tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError):
        return None
