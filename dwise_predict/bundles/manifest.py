"""Reading, writing and checking a bundle's ``bundle.json`` with the standard library alone.

The serving hook and ``verify``'s fresh-process worker import this module, so it must not import
torch, lightgbm or the training code.

``bundle.json`` lists every other file of the bundle with its sha256 and size, and seals itself:
``manifest_sha256`` is the sha256 of the canonical JSON (sorted keys, two-space indent) of the
manifest without that key, and the file must be exactly the canonical JSON of the sealed manifest.
So a change to any byte of any bundle file, ``bundle.json`` included, is refused, naming the file.
(This detects corruption and tampering in transit; it is not a signature — trust comes from where
you pulled the bundle, and its hashes match the zoo index.)

Readers get a :class:`BundleManifest` (:func:`read_bundle_manifest`): the sealed object checked once
(schema version, ``files``, the required sections and the declared sizes) and read through typed
attributes; its ``raw`` dict is what is hashed and written. Adding a field to ``bundle.json``: the
writer (``exports/bundle.py`` ``_manifest``), an attribute here, the reader that uses it, a test.
The keys themselves are contract 2 (docs/bundles.md): public, never renamed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import BundleError
from dwise_predict.files import atomic_write_bytes, loads_json, sha256_file
from dwise_predict.names import EARLY_SIGNALS, HIDDEN_STATES

# What each older schema's refinement graph lacks; such a bundle is refused with a pointer to retrain:
# 2: the graph takes a fourth input, `early_signals` (B, 3);
# 3: prompt length and budget enter on a log scale (inputs.refine.length_scale, network.refine_input),
#    same inputs and output as 2 but another function of them;
# 4: `early_signals` gains a fourth column, end_probability (B, 4);
# 5: a second hidden-state input, `prompt_last` (B, H), after `first_round` (names.HIDDEN_STATES).
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
FIX = "re-export the bundle, or get it again from a source you trust"
MAX_FILE_BYTES = 16 << 30  # a refinement graph at H = 8,192 with 3 members is some 300 MB
MAX_HIDDEN = 1 << 17
MAX_ROUNDS = 1 << 20


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


def _section(manifest: dict, key: str) -> dict:
    value = manifest.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ModelFingerprint:
    """``model``: the model a bundle was trained on, as its traces recorded it. The attributes are the
    keys a server compares (:data:`~dwise_predict.names.MODEL_KEYS`) and the name its refusals show
    (``"?"`` where the section has none); ``fields`` is the section as written (the model card and the
    zoo index show it whole)."""

    fields: dict
    name: str
    hidden_size: int | None
    config_hash: str | None
    weights_sha256: str | None

    @classmethod
    def of(cls, section: dict) -> ModelFingerprint:
        return cls(section, section.get("name", "?"), section.get("hidden_size"), section.get("config_hash"),
                   section.get("weights_sha256"))


@dataclass(frozen=True)
class TrainedDecoding:
    """``decoding``: the decoding the bundle's rounds were counted under. The attributes are the keys a
    server is held to (:data:`~dwise_predict.names.BUNDLE_DECODING_KEYS`); ``fields`` is the section
    as written."""

    fields: dict
    algorithm: str | None
    algorithm_config: dict | None
    block_size: int | None
    engine: str | None

    @classmethod
    def of(cls, section: dict) -> TrainedDecoding:
        return cls(section, section.get("algorithm"), section.get("algorithm_config"), section.get("block_size"),
                   section.get("engine"))


@dataclass(frozen=True)
class BundleIdentity:
    """What a server holds a bundle to: the model, the decoding and the width of the hidden states its
    refinement graph takes (``inputs.refine.hidden_size``, else ``model.hidden_size``; None if neither).

    :meth:`of` reads them from any ``bundle.json`` object, checked or not, a section missing read as
    empty: the launcher reads this much of a bundle before SGLang loads the model, and the loader
    checks the whole bundle later (:class:`BundleManifest` holds the checked one's)."""

    model: ModelFingerprint
    decoding: TrainedDecoding
    hidden_size: int | None

    @classmethod
    def of(cls, manifest: dict) -> BundleIdentity:
        model = _section(manifest, "model")
        size = _section(_section(manifest, "inputs"), "refine").get("hidden_size") or model.get("hidden_size")
        return cls(ModelFingerprint.of(model), TrainedDecoding.of(_section(manifest, "decoding")),
                   int(size) if size else None)


@dataclass(frozen=True)
class BundleManifest:
    """A sealed ``bundle.json``, checked once (:meth:`from_dict`) and read through attributes.

    ``raw`` is the object as parsed, seal included: what :func:`canonical_json` and
    :func:`seal_manifest` hash, and what the model card and the zoo index copy sections from.
    ``refine`` is ``inputs.refine`` as written, its sizes checked against each other (the spec every
    artifact is held to, and what ``survival.network.build_refine_graph`` rebuilds the graph from);
    ``hidden_size`` its ``hidden_size``. ``artifacts``, ``int8`` and ``probes`` are read as written:
    :func:`~dwise_predict.bundles.screen.check_layout` holds them to the files the bundle lists.
    """

    raw: dict
    schema_version: int
    name: object  # a zoo name only once zoo.publish checks it (NAME_PATTERN)
    created: str | None
    identity: BundleIdentity
    refine: dict
    hidden_size: int
    K: int
    files: dict[str, dict]
    artifacts: object
    int8: dict
    probes: object
    metrics: dict | None
    training_data: dict | None
    recipe: dict | None  # the training options of the run (TrainConfig.to_dict()); None in older bundles

    @classmethod
    def from_dict(cls, manifest: dict, where: str) -> BundleManifest:
        """The typed manifest of the parsed ``bundle.json`` ``manifest`` (``where`` names it in errors).

        Raises :class:`BundleError` for another schema (:func:`check_schema`); ``files`` that is not
        a map of known artifact names to ``{sha256, bytes}`` of the right form; ``model`` or
        ``decoding`` that is not an object; an ``inputs.refine`` whose sizes contradict each other,
        ``K`` or ``model.hidden_size`` (:func:`_declared_refine`).
        """
        check_schema(manifest, where)
        files = _checked_files(manifest.get("files"), where)
        for section in ("model", "decoding"):
            if not isinstance(manifest.get(section), dict):
                raise BundleError(f"{where}: '{section}' is {printable(manifest.get(section))}, not an object: "
                                  f"the bundle is corrupt; {FIX}")
        refine = _declared_refine(manifest, where)
        return cls(raw=manifest, schema_version=manifest["schema_version"], name=manifest.get("name"),
                   created=manifest.get("created"), identity=BundleIdentity.of(manifest), refine=refine,
                   hidden_size=refine["hidden_size"], K=manifest["K"], files=files,
                   artifacts=manifest.get("artifacts"), int8=_section(manifest, "int8"), probes=manifest.get("probes"),
                   metrics=manifest.get("metrics"), training_data=manifest.get("training_data"),
                   recipe=manifest["recipe"] if isinstance(manifest.get("recipe"), dict) else None)


def _checked_files(files, where: str) -> dict[str, dict]:
    """``files``: each known artifact name mapped to its sha256 (64 hex digits) and size in bytes."""
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int
        for entry in files.values()
    ):
        raise BundleError(f"{where}: 'files' must map each file name to {{sha256, bytes}}: the bundle is corrupt; "
                          "re-export or re-pull it")
    for name, entry in files.items():
        if name not in BUNDLE_ARTIFACTS:
            raise BundleError(f"{where} lists {printable(name)}, which is not a file a bundle holds "
                              f"({', '.join(BUNDLE_ARTIFACTS)}): refusing to read the bundle; {FIX}")
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) or not 0 <= entry["bytes"] <= MAX_FILE_BYTES:
            raise BundleError(f"{where}: the entry of '{name}' has a malformed sha256 or a size out of range: {FIX}")
    return files


def _declared_refine(manifest: dict, where: str) -> dict:
    """``inputs.refine`` of a manifest, its sizes checked against each other and the manifest's
    ``K``, ``model.hidden_size`` and ``tensors``: the spec every artifact is held to."""
    inputs = manifest.get("inputs")
    spec = inputs.get("refine") if isinstance(inputs, dict) else None
    if not isinstance(spec, dict):
        raise BundleError(f"{where} has no inputs.refine object: {FIX}")
    hidden, rounds = spec.get("hidden_size"), spec.get("num_rounds")
    if type(hidden) is not int or not 1 <= hidden <= MAX_HIDDEN:
        raise BundleError(f"{where}: inputs.refine.hidden_size is {printable(hidden)}, not a size from 1 to "
                          f"{MAX_HIDDEN:,}: {FIX}")
    if type(rounds) is not int or not 1 <= rounds <= MAX_ROUNDS or manifest.get("K") != rounds:
        raise BundleError(f"{where}: K ({printable(manifest.get('K'))}) and inputs.refine.num_rounds "
                          f"({printable(rounds)}) must be one count of rounds from 1 to {MAX_ROUNDS:,}: {FIX}")
    width = hidden * len(HIDDEN_STATES) + 2 + SIGNAL_COUNT
    model_hidden = _section(manifest, "model").get("hidden_size")
    tensors = {state: ["B", hidden] for state in HIDDEN_STATES}
    tensors.update(prompt_tokens=["B"], budget=["B"], early_signals=["B", SIGNAL_COUNT])
    for field, have, want in (("inputs.refine.in_features", spec.get("in_features"), width),
                              ("inputs.refine.early_signals", spec.get("early_signals"), SIGNAL_COUNT),
                              ("inputs.refine.tensors", spec.get("tensors"), tensors),
                              ("model.hidden_size", model_hidden if model_hidden is not None else hidden, hidden)):
        if have != want:
            raise BundleError(f"{where}: {field} is {printable(have)}, but hidden size {hidden} makes it "
                              f"{printable(want)}: the manifest contradicts itself; {FIX}")
    return spec


def read_bundle_manifest(bundle: str | Path) -> BundleManifest:
    """Load ``bundle.json``: refuse a missing, unreadable, newer- or older-schema or unsealed manifest,
    then one that :meth:`BundleManifest.from_dict` refuses."""
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
    check_schema(manifest, str(path))  # before the seal: another schema's bundle is told to upgrade or retrain
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
    return BundleManifest.from_dict(manifest, str(path))


def check_schema(manifest: dict, where: str) -> None:
    """Refuse a manifest of another bundle schema than this dwise-predict reads, saying what to do."""
    version = manifest.get("schema_version")
    if not isinstance(version, int):
        raise BundleError(f"{where} has no integer schema_version: the bundle is corrupt")
    if version > BUNDLE_SCHEMA_VERSION:
        raise BundleError(
            f"{where} has bundle schema {version}, newer than this dwise-predict reads "
            f"({BUNDLE_SCHEMA_VERSION}): upgrade dwise-predict"
        )
    if version < BUNDLE_SCHEMA_VERSION:
        raise BundleError(
            f"{where} has bundle schema {version}, whose refinement graph {OLDER_SCHEMAS.get(version, 'is older')} "
            f"(this dwise-predict reads schema {BUNDLE_SCHEMA_VERSION}): retrain and re-export it "
            "(`dwise-predict train`, `dwise-predict export`)"
        )


def unlisted_files(bundle: str | Path, manifest: BundleManifest) -> list[str]:
    """Files in the bundle directory that ``bundle.json`` does not list (it should list all)."""
    listed = set(manifest.files) | {BUNDLE_FILE}
    return sorted(p.name for p in Path(bundle).iterdir() if p.name not in listed)


def check_files(bundle: str | Path, manifest: BundleManifest, names: list[str] | None = None,
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
    files = manifest.files
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
