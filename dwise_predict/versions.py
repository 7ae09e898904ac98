"""Package versions recorded in every manifest, run directory, evaluation and bundle, and a
fingerprint of this package's own source (its version string stays 0.1.0 from commit to commit)."""

from __future__ import annotations

import functools
import hashlib
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SOURCE_KEY = "dwise-predict source"  # the versions entry holding source_fingerprint()
RECORDED_PACKAGES = (
    "dwise-predict", "torch", "transformers", "numpy", "pandas", "pyarrow", "safetensors", "lightgbm",
    "scikit-learn", "scipy", "onnx", "onnxruntime", "onnxscript", "onnxmltools",
)


def package_versions() -> dict[str, str | None]:
    """Python's version and each recorded package's (None where it is not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    found[SOURCE_KEY] = source_fingerprint()
    return found


# what decides results: the code and the presets shipped beside it (the tiny dLLM's weights have
# their own fingerprint in every manifest's ``model`` block)
SOURCE_SUFFIXES = (".py", ".toml")
PACKAGE_ROOT = Path(__file__).parent


@functools.cache
def source_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """sha256 over the package's source files under ``root`` (relative path and bytes, in path
    order): equal fingerprints ran the same code, whatever the version string says."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
