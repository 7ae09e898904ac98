"""Reading and checking a bundle's ``bundle.json`` with the standard library alone.

The serving hook imports this module, so it must not import torch, lightgbm or the training code.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dwise_predict.errors import BundleError

BUNDLE_SCHEMA_VERSION = 1
BUNDLE_FILE = "bundle.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_bundle_manifest(bundle: str | Path) -> dict:
    """Load ``bundle.json``; refuse a missing, unreadable or newer-schema manifest."""
    path = Path(bundle) / BUNDLE_FILE
    if not path.is_file():
        raise BundleError(f"{bundle} is not a bundle: it has no {BUNDLE_FILE} (create one with `dwise-predict export`)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{path} is not valid JSON ({err}): the bundle is corrupt; re-export or re-pull it") from None
    version = manifest.get("schema_version")
    if not isinstance(version, int):
        raise BundleError(f"{path} has no integer schema_version: the bundle is corrupt")
    if version > BUNDLE_SCHEMA_VERSION:
        raise BundleError(
            f"{bundle} has bundle schema {version}, newer than this dwise-predict reads "
            f"({BUNDLE_SCHEMA_VERSION}): upgrade dwise-predict"
        )
    return manifest


def check_files(bundle: str | Path, manifest: dict, names: list[str] | None = None) -> None:
    """Check size and sha256 of the named files (default: every file in the manifest).

    Raises :class:`BundleError` naming the first file that is missing, has the wrong size or hash.
    """
    bundle = Path(bundle)
    files = manifest.get("files", {})
    for name in names if names is not None else sorted(files):
        entry = files.get(name)
        if entry is None:
            raise BundleError(f"{bundle}/{BUNDLE_FILE} lists no '{name}': the bundle is incomplete; re-export it")
        path = bundle / name
        if not path.is_file():
            raise BundleError(f"{path} is missing: the bundle is incomplete; re-export or re-pull it")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path} does not match its sha256 in {BUNDLE_FILE}: the file was modified or corrupted")
