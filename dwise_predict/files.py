"""Writing files atomically (temp file beside the target + rename): a reader, or a rerun after an
interrupt, sees the old file or the new one, never half of one. Standard library only, so the
serving side may import it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(target: str | os.PathLike, write: Callable[[Path], None], durable: bool = False) -> Path:
    """Call ``write(tmp)`` on a temp path beside ``target``, then rename it over ``target``.

    durable : also fsync the file and its directory, so the rename survives a power loss (the
        collection store commits shards this way; reports and models don't need to).
    """
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
        if durable:
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def atomic_write_bytes(target: str | os.PathLike, data: bytes, durable: bool = False) -> Path:
    return atomic_write(target, lambda tmp: tmp.write_bytes(data), durable)


def atomic_write_text(target: str | os.PathLike, text: str) -> Path:
    return atomic_write(target, lambda tmp: tmp.write_text(text))


def _json_default(value):
    if hasattr(value, "tolist"):  # numpy scalars and arrays, without importing numpy
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(target: str | os.PathLike, value) -> Path:
    """``value`` as indented JSON (numpy scalars and arrays as plain numbers; NaN refused)."""
    text = json.dumps(value, indent=2, default=_json_default, allow_nan=False) + "\n"
    return atomic_write_text(target, text)
