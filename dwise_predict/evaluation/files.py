"""Writing result files atomically (temp file + rename), so an interrupted run never leaves half a file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


def atomic_write(target: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temp path beside ``target``, then rename it over ``target``."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(target: Path, value) -> Path:
    """``value`` as indented JSON (numpy scalars and arrays as plain numbers; NaN refused)."""
    text = json.dumps(value, indent=2, default=_json_default, allow_nan=False) + "\n"
    return atomic_write(target, lambda tmp: tmp.write_text(text))
