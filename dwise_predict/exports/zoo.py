"""A model zoo on a plain directory (local disk or a shared mount): publish, list, show, pull.

Layout::

    ZOO/index.json                          {"schema_version": 1, "bundles": [entry, ...]}
    ZOO/bundles/NAME/NAME-VERSION.tar       one bundle, flat, deterministic tar (mtime 0, root-owned)

An entry holds ``name``, ``version``, ``file``, ``sha256`` and ``bytes`` of the tar, ``published``,
and from the bundle: ``created``, ``bundle_schema_version``, ``model`` fingerprint, ``decoding``,
``hidden_size``, ``K``, ``metrics``.
A published (name, version) is never overwritten. ``publish`` verifies the bundle first, holds
a lock on ``ZOO/.lock`` while it writes (released by the OS if the publisher dies; a second publish
waits for it, up to :data:`LOCK_WAIT_S`, then takes the next free version), moves the finished tar
into place and only then replaces the index (temp file + rename), so an interrupted publish leaves
the index as it was.

An index and its tars may come from someone else: ``read_index`` accepts an entry only when its
name and version are plain names (:data:`~dwise_predict.bundles.manifest.NAME_PATTERN`: no ``/``,
no ``..``) and its file is exactly ``bundles/NAME/NAME-VERSION.tar``, so no entry leads outside the
zoo and the default ``--out`` of ``pull`` (``./NAME-VERSION``) stays in the current directory.
``pull`` checks the tar's sha256 against the index, extracts only regular files named as bundle
artifacts (no absolute paths, no ``..``, no links, devices, sparse or repeated members) into a
temporary directory, checks and screens the bundle there (:mod:`dwise_predict.bundles.screen`) and
only then renames it into place.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from dwise_predict.errors import BundleError, InputError, LockHeldError, StoreError
from dwise_predict.bundles.manifest import (
    BUNDLE_ARTIFACTS,
    BUNDLE_FILE,
    NAME_PATTERN,
    BundleManifest,
    printable,
    read_bundle_manifest,
)
from dwise_predict.bundles.screen import open_bundle, screen_bundle
from dwise_predict.files import (FileLock, atomic_dir, atomic_write, atomic_write_text, claim_output, read_json,
                                  refuse_aliasing, sha256_file, write_errors)

INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
ZOO_SCHEMA_VERSION = 1
ENTRY_KEYS = ("name", "version", "file", "sha256")  # what list, show, pull and publish read of an entry
# what else list and show read of an entry, when it is there: name -> the types it may have
ENTRY_FIELDS = {"bytes": (int,), "published": (str,), "created": (str,), "bundle_schema_version": (int,),
                "model": (dict,), "decoding": (dict,), "hidden_size": (int,), "K": (int,), "metrics": (dict,)}
INDEX_MAX_BYTES = 256 << 20  # some 100,000 entries
LOCK_WAIT_S = 300.0  # how long a publish waits for another one to finish writing (a tar and the index)


def publish(bundle: str | Path, zoo: str | Path, name: str | None = None, version: str | None = None,
            verify: bool = True, lock_wait_s: float = LOCK_WAIT_S) -> dict:
    """Publish ``bundle`` into ``zoo`` as ``name@version``; return the new index entry.

    ``name`` defaults to the bundle's name, ``version`` to one more than the largest integer
    version published under that name (``1`` for a new name). ``verify`` runs the full
    ``dwise-predict verify`` first; a bundle that fails is not published (without it, the bundle's
    hashes and contents are still checked). Publishes into one zoo run one at a time: while another
    holds the zoo's lock this one waits, up to ``lock_wait_s`` seconds, and then picks its version.
    """
    bundle, zoo = Path(bundle), Path(zoo)
    refuse_aliasing(zoo, [("BUNDLE", bundle)], param="zoo")
    if zoo.exists() and not zoo.is_dir():
        raise InputError(f"`zoo` {zoo} is a file: give a directory (a zoo, or a new or empty one)")
    # a publish killed before its first index leaves bundles/ and dot-files: its rerun resumes there
    if zoo.is_dir() and not (zoo / INDEX_FILE).is_file() and any(
            p.name != "bundles" and not p.name.startswith(".") for p in zoo.iterdir()):
        raise StoreError(f"`zoo` {zoo} holds files but is not a zoo (no {INDEX_FILE}): a zoo is never made inside "
                         "another folder; choose a new or empty directory, or an existing zoo")
    manifest = read_bundle_manifest(bundle)
    if name is None:
        name = manifest.name
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InputError(f"{bundle}/{BUNDLE_FILE} names the bundle {printable(name)}, which is not a zoo name (1-100 "
                             "letters, digits, '.', '_' or '-', starting with a letter or digit): pass `name`")
    for param, value in (("name", name), ("version", version)):
        if value is not None and not NAME_PATTERN.fullmatch(value):
            raise InputError(
                f"`{param}` {printable(value)} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
    if verify:
        from dwise_predict.exports.verify import require_verified

        require_verified(bundle)
    else:
        screen_bundle(bundle, open_bundle(bundle))
    with write_errors(zoo, "nothing was published; free space or fix permissions and rerun the same command"):
        return _publish(bundle, zoo, manifest, name, version, lock_wait_s)


@contextmanager
def _zoo_lock(zoo: Path, wait_s: float):
    """Hold the zoo's lock, waiting up to ``wait_s`` while another publish holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock = FileLock(zoo / LOCK_FILE, lambda holder: (
                f"the zoo {zoo} is locked by another publish (pid {holder}), still after {wait_s:g} s: wait for it "
                "to finish and rerun the same command")).__enter__()
            break
        except LockHeldError:  # a lock file that is a link, say, is refused at once
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
    try:
        yield
    finally:
        lock.__exit__()


def _publish(bundle: Path, zoo: Path, manifest: BundleManifest, name: str, version: str | None, lock_wait_s: float) -> dict:
    zoo.mkdir(parents=True, exist_ok=True)
    with _zoo_lock(zoo, lock_wait_s):
        index = read_index(zoo, missing_ok=True)
        taken = [e["version"] for e in index["bundles"] if e["name"] == name]
        version = version or str(max([int(v) for v in taken if v.isdigit()], default=0) + 1)
        if version in taken:
            raise StoreError(
                f"{name}@{version} is already in the zoo {zoo}: published versions are never overwritten; "
                "pass another `version`"
            )
        relative = Path(_tar_path(name, version))
        target = zoo / relative
        _refuse_links(zoo, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        # an unindexed tar at the target is debris of an interrupted publish: replacing it is safe
        atomic_write(target, lambda tmp: _write_tar(bundle, manifest, tmp))
        entry = {
            "name": name,
            "version": version,
            "file": relative.as_posix(),
            "sha256": sha256_file(target),
            "bytes": target.stat().st_size,
            "published": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
            "created": manifest.created,
            "bundle_schema_version": manifest.schema_version,
            "model": manifest.identity.model.fields,
            "decoding": manifest.identity.decoding.fields,
            "hidden_size": manifest.hidden_size,
            "K": manifest.K,
            "metrics": manifest.metrics,
        }
        try:
            _write_index(zoo, {**index, "bundles": index["bundles"] + [entry]})
        except BaseException:
            target.unlink(missing_ok=True)
            raise
    return entry


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
        if entry["file"] != _tar_path(entry["name"], entry["version"]):
            raise StoreError(f"zoo index {path}: entry {i} points at {printable(entry['file'])}, not where publish "
                             f"puts {entry['name']}@{entry['version']} ({_tar_path(entry['name'], entry['version'])}): {fix}")
        for key, types in ENTRY_FIELDS.items():
            if entry.get(key) is not None and (not isinstance(entry[key], types) or isinstance(entry[key], bool)):
                raise StoreError(f"zoo index {path}: entry {i} has a {key} of type {type(entry[key]).__name__}: {fix}")
    return index


def _tar_path(name: str, version: str) -> str:
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


def _refuse_links(zoo: Path, path: Path) -> None:
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
    _refuse_links(zoo, tar_path)
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


def _write_tar(bundle: Path, manifest: BundleManifest, path: Path) -> None:
    """A flat tar of bundle.json and the files it lists, byte-identical for identical bundles."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in [BUNDLE_FILE, *sorted(manifest.files)]:
            data = (bundle / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))


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
        raise BundleError(
            f"{tar_path} is not a readable tar ({err}): it is truncated or corrupted; re-publish it"
        ) from None


def _write_index(zoo: Path, index: dict) -> None:
    atomic_write_text(zoo / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
