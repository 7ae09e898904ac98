"""Fetch SGLang 0.5.23's wheel and unpack its Python source for the conformance tests.

Usage:

    python scripts/fetch_sglang.py            # prints the source root; a second run reuses it

The tests in ``tests/test_engine_conformance.py`` and ``tests/test_sglang_surface.py`` import
SGLang's own dLLM code from this source (with small stand-ins for its GPU-only imports) and compare
our engine semantics with it. ``pip download --no-deps`` fetches the wheel alone (about 39 MB);
nothing is installed, and only ``*.py`` files and the wheel's METADATA are unpacked. The root is
``$DWISE_SGLANG_SRC`` when set, else ``~/.cache/dwise-predict/sglang-0.5.23``.

Exits 1 with one line on stderr when the wheel cannot be fetched (no network, say); the tests then
skip with a reason that names this script, except under ``DWISE_REQUIRE_SGLANG=1`` (CI), where the
test session refuses to start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.5.23"


def source_root() -> Path:
    """Where the unpacked source lives (the tests look in the same place)."""
    env = os.environ.get("DWISE_SGLANG_SRC")
    return Path(env) if env else Path.home() / ".cache" / "dwise-predict" / f"sglang-{VERSION}"


def is_complete(root: Path) -> bool:
    return (root / "sglang" / "srt" / "dllm" / "algorithm" / "base.py").is_file() and any(
        root.glob(f"sglang-{VERSION}.dist-info/METADATA"))


def fetch(root: Path) -> Path:
    if is_complete(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        download = Path(tmp) / "wheel"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             f"sglang=={VERSION}", "-d", str(download)], capture_output=True, text=True)
        wheels = sorted(download.glob(f"sglang-{VERSION}-*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SystemExit(f"error: cannot download sglang=={VERSION} ({last}); the conformance tests will skip")
        unpacked = Path(tmp) / "src"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist()
                       if (m.startswith("sglang/") and m.endswith(".py")) or m.endswith(".dist-info/METADATA")]
            wheel.extractall(unpacked, members)
        if root.exists():  # an incomplete earlier attempt
            shutil.rmtree(root)
        unpacked.rename(root)  # atomic: a half-unpacked tree is never seen as complete
    return root


def main() -> int:
    print(fetch(source_root()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
