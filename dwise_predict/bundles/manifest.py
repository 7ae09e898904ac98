"""Reading, writing and checking a bundle's ``bundle.json`` with the standard library alone.

The serving hook and ``verify``'s fresh-process worker import this module, so it must not import
torch, lightgbm or the training code.

``bundle.json`` lists every other file of the bundle with its sha256 and size, and seals itself:
``manifest_sha256`` is the sha256 of the canonical JSON (sorted keys, two-space indent) of the
manifest without that key, and the file must be exactly the canonical JSON of the sealed manifest.
So a change to any byte of any bundle file, ``bundle.json`` included, is refused, naming the file.
(This detects corruption and tampering in transit; it is not a signature — trust comes from where
you pulled the bundle, and its hashes match the zoo index.)
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from dwise_predict.errors import BundleError
from dwise_predict.files import atomic_write_bytes, loads_json, sha256_file
from dwise_predict.identity import EARLY_SIGNALS

# What each older schema's refinement graph lacks; such a bundle is refused with a pointer to retrain:
# 2: the graph takes a fourth input, `early_signals` (B, 3);
# 3: prompt length and budget enter on a log scale (inputs.refine.length_scale, network.refine_input),
#    same inputs and output as 2 but another function of them;
# 4: `early_signals` gains a fourth column, end_probability (B, 4);
# 5: a second hidden-state input, `prompt_last` (B, H), after `first_round` (identity.HIDDEN_STATES).
OLDER_SCHEMAS = {
    1: "lacks the early_signals input",
    2: "takes prompt length and budget on a linear scale",
    3: "takes three early signals, not four (no end_probability)",
    4: "lacks the prompt_last input (the last prompt block's pooled state)",
}
BUNDLE_SCHEMA_VERSION = 5
SIGNAL_COUNT = len(EARLY_SIGNALS)  # columns of the refinement graph's `early_signals` input
BUNDLE_FILE = "bundle.json"
SEAL_KEY = "manifest_sha256"
PROBES_FILE = "probes.safetensors"
# Every file a bundle may hold besides bundle.json (exports/bundle.py ARTIFACTS says what each is).
# Loaders refuse any other name (bundles/screen.py), so nothing planted, a .pkl or an .npy, is read.
BUNDLE_ARTIFACTS = ("refine.safetensors", "calibration.json", "refine.onnx", "refine.pt", "refine.pt2",
                    "refine.int8.onnx", "admission.txt", "admission.onnx", PROBES_FILE, "README.md")
# what every export writes; TorchScript, torch.export and the int8 graph are optional
REQUIRED_ARTIFACTS = ("refine.safetensors", "calibration.json", "refine.onnx", "admission.txt", "admission.onnx",
                      PROBES_FILE, "README.md")
MANIFEST_MAX_BYTES = 16 << 20  # ours are a few kB; the metrics of a LOCO run add a few more
# a bundle name or zoo version: use fullmatch (``$`` would also accept a trailing newline)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def printable(value, limit: int = 80, quoted: bool = True) -> str:
    """A value from someone else (a name in a manifest, a zoo index, a tar) as a message shows it:
    as ``repr`` writes it (a string quoted, control characters and line separators escaped, so the
    message stays one line), cut at ``limit``; ``quoted=False`` drops a string's quotes."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 2] + "…" + text[0]
    return text[1:-1] if not quoted and isinstance(value, str) else text


def canonical_json(manifest: dict) -> bytes:
    """The one byte form of a manifest: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def seal_manifest(manifest: dict) -> bytes:
    """Add ``manifest_sha256`` (hash of the manifest without it) and return the file's bytes."""
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    return canonical_json({**body, SEAL_KEY: hashlib.sha256(canonical_json(body)).hexdigest()})


def write_bundle_manifest(bundle: str | Path, manifest: dict) -> Path:
    """Write the sealed ``bundle.json`` into ``bundle`` atomically (temp file + rename)."""
    return atomic_write_bytes(Path(bundle) / BUNDLE_FILE, seal_manifest(manifest))


def read_bundle_manifest(bundle: str | Path) -> dict:
    """Load ``bundle.json``; refuse a missing, unreadable or newer-schema manifest."""
    path = Path(bundle) / BUNDLE_FILE
    if path.is_symlink():
        raise BundleError(f"{path} is a symbolic link: a bundle holds only regular files; re-export or re-pull it")
    if not path.is_file():
        raise BundleError(f"{bundle} is not a bundle: it has no {BUNDLE_FILE} (create one with `dwise-predict export`)")
    if path.stat().st_size > MANIFEST_MAX_BYTES:  # refused before it is read into memory
        raise BundleError(f"{path} holds {path.stat().st_size:,} bytes, more than the {MANIFEST_MAX_BYTES:,} a "
                          "manifest may: the bundle is corrupt; re-export or re-pull it")
    raw = path.read_bytes()
    manifest = loads_json(raw, BundleError, str(path), "the bundle is corrupt; re-export or re-pull it",
                          max_bytes=MANIFEST_MAX_BYTES)
    if not isinstance(manifest, dict):
        raise BundleError(f"{path} does not hold a JSON object: the bundle is corrupt; re-export or re-pull it")
    version = manifest.get("schema_version")
    if not isinstance(version, int):
        raise BundleError(f"{path} has no integer schema_version: the bundle is corrupt")
    if version > BUNDLE_SCHEMA_VERSION:
        raise BundleError(
            f"{path} has bundle schema {version}, newer than this dwise-predict reads "
            f"({BUNDLE_SCHEMA_VERSION}): upgrade dwise-predict"
        )
    if version < BUNDLE_SCHEMA_VERSION:
        raise BundleError(
            f"{path} has bundle schema {version}, whose refinement graph {OLDER_SCHEMAS.get(version, 'is older')} "
            f"(this dwise-predict reads schema {BUNDLE_SCHEMA_VERSION}): retrain and re-export it "
            "(`dwise-predict train`, `dwise-predict export`)"
        )
    if SEAL_KEY not in manifest:
        raise BundleError(
            f"{path} has no {SEAL_KEY} seal: write it with dwise_predict.bundles.manifest.write_bundle_manifest "
            "(or re-export the bundle)"
        )
    try:
        sealed = seal_manifest(manifest)
    except ValueError:  # NaN/inf smuggled in: not canonical JSON
        sealed = b""
    if raw != sealed:
        raise BundleError(f"{path} does not match its {SEAL_KEY} seal: the file was modified or corrupted")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int
        for entry in files.values()
    ):
        raise BundleError(f"{path}: 'files' must map each file name to {{sha256, bytes}}: the bundle is corrupt; "
                          "re-export or re-pull it")
    return manifest


def unlisted_files(bundle: str | Path, manifest: dict) -> list[str]:
    """Files in the bundle directory that ``bundle.json`` does not list (it should list all)."""
    listed = set(manifest.get("files", {})) | {BUNDLE_FILE}
    return sorted(p.name for p in Path(bundle).iterdir() if p.name not in listed)


def check_files(bundle: str | Path, manifest: dict, names: list[str] | None = None,
                refuse_unlisted: bool = True) -> None:
    """Check size and sha256 of the named files (default: every file in the manifest), and that the
    directory holds no file the manifest does not list (``verify`` reports those in its own row).

    Raises :class:`BundleError` naming the first file that is missing, has the wrong size or hash,
    or is not listed.
    """
    bundle = Path(bundle)
    extra = unlisted_files(bundle, manifest) if refuse_unlisted else []
    if extra:
        raise BundleError(f"{bundle} holds files that its {BUNDLE_FILE} does not list ({', '.join(extra)}): they were "
                          "added after export; re-export or re-pull the bundle")
    files = manifest.get("files", {})
    for name in names if names is not None else sorted(files):
        entry = files.get(name)
        if entry is None:
            raise BundleError(f"{bundle}/{BUNDLE_FILE} lists no '{name}': the bundle is incomplete; re-export it")
        if Path(name).name != name or name in (".", ".."):
            raise BundleError(
                f"{bundle}/{BUNDLE_FILE} lists '{name}', which is not a plain file name: the bundle is unsafe"
            )
        path = bundle / name
        if path.is_symlink():  # it could point anywhere, and change after this check
            raise BundleError(f"{path} is a symbolic link: a bundle holds only regular files; re-export or re-pull it")
        if not path.is_file():
            raise BundleError(f"{path} is missing: the bundle is incomplete; re-export or re-pull it")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path} does not match its sha256 in {BUNDLE_FILE}: the file was modified or corrupted")
