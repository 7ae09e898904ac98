"""Write tests/fakes/sglang_surface.json: what the pinned SGLang source holds for the hook's SURFACE.

Usage:

    pip download --no-deps sglang==0.5.23 -d /tmp/sglang_wheel && unzip -q /tmp/sglang_wheel/*.whl -d /tmp/sglang_src
    python scripts/snapshot_sglang_surface.py /tmp/sglang_src

Reads the source with `ast` only (SGLang is never imported). Exits 1, listing the problems, when an
entry of the table is missing or has another signature in that source.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dwise_predict.serving.sglang import SGLANG_VERSION, read_surface, surface_problems

SNAPSHOT = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "sglang_surface.json"


def version_of(root: Path) -> str | None:
    """The version in the unpacked wheel's ``sglang-*.dist-info/METADATA`` (nothing is executed)."""
    for metadata in sorted(root.glob("sglang-*.dist-info/METADATA")):
        for line in metadata.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    if not (root / "sglang").is_dir():
        print(f"{root} has no sglang/ package: unpack the sglang=={SGLANG_VERSION} wheel there", file=sys.stderr)
        return 1
    found = read_surface(root)
    problems = surface_problems(found)
    for problem in problems:
        print(f"surface: {problem}", file=sys.stderr)
    snapshot = {"sglang_version": version_of(root), "surface": found}
    tmp = SNAPSHOT.with_name(SNAPSHOT.name + ".tmp")
    tmp.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    tmp.replace(SNAPSHOT)
    print(f"wrote {SNAPSHOT} ({len(found)} entries, {len(problems)} problems)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
