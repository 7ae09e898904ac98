"""Package versions recorded in every manifest, run directory, evaluation and bundle."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

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
    return found
