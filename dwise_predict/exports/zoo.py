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

Reading a zoo (``read_index``, ``find_entry``, ``list_entries``, ``pull``: what they accept of an
index and a tar someone else wrote) is :mod:`dwise_predict.bundles.zoo`'s, which the CLI reads a zoo
and the serving hook follows one through.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

from dwise_predict.errors import InputError, LockHeldError, StoreError
from dwise_predict.bundles.manifest import BUNDLE_FILE, NAME_PATTERN, BundleManifest, printable, read_bundle_manifest
from dwise_predict.bundles.screen import open_bundle, screen_bundle
from dwise_predict.bundles.zoo import INDEX_FILE, read_index, refuse_links, tar_file
from dwise_predict.files import FileLock, atomic_write, atomic_write_text, refuse_aliasing, sha256_file, write_errors

LOCK_FILE = ".lock"
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
        relative = Path(tar_file(name, version))
        target = zoo / relative
        refuse_links(zoo, target)
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


def _write_index(zoo: Path, index: dict) -> None:
    atomic_write_text(zoo / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")


__all__ = ["LOCK_WAIT_S", "publish"]
