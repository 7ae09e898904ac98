"""Measure how long a serving round takes for a model, as the simulator's round-cost profile.

Drives any :class:`~dwise_predict.collectors.backends.base.BlockBackend` (the tiny dLLM on this
CPU, or a real dLLM on a GPU) through rounds of the shapes SGLang 0.5.23 runs: ``p`` prefill rows
(one full prompt block each, committed to the cache) and ``d`` denoising rows (one masked output
block each, nothing committed), every row over a cached context of ``context_blocks`` blocks. Each
shape is timed ``repeats`` times after ``warmup`` untimed runs and the median kept. The result is
the profile JSON of :mod:`dwise_predict.simulation.round_cost`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dwise_predict.collectors.backends.base import StepBatch
from dwise_predict.errors import InputError
from dwise_predict.files import hold_output_lock, read_json, refuse_aliasing

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)


def round_shapes(rows=DEFAULT_ROWS) -> list[tuple[int, int]]:
    """(prefill rows, decode rows) to time: all-prefill and all-decode rounds (what SGLang's default
    runs) and half-and-half mixed rounds (what DWISE runs), for each total in ``rows``."""
    shapes = []
    for r in rows:
        shapes += [(r, 0), (0, r)]
        if r >= 2:
            shapes.append((r // 2, r - r // 2))
    return list(dict.fromkeys(shapes))


def _sync(device) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def measure_round_profile(backend, rows=DEFAULT_ROWS, context_blocks: int = 4, repeats: int = 5,
                          warmup: int = 2, seed: int = 0, progress=None) -> dict:
    """Time rounds of every shape of :func:`round_shapes`; returns the profile dict.

    Parameters
    ----------
    backend : a loaded BlockBackend.
    rows : totals of rows per round to time.
    context_blocks : cached blocks behind each row (the prompt a row has already prefilled).
    repeats, warmup : timed and untimed runs per shape (the median of the timed ones is kept).
    progress : optional callable(str) for a line per shape.
    """
    block = backend.block_size
    device = backend.device
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for p, d in round_shapes(rows):
        n = p + d
        backend.allocate(n)
        slots = torch.arange(n, device=device)
        full = torch.full((n,), block, dtype=torch.long, device=device)
        for _ in range(context_blocks):  # the context: committed prompt blocks
            ids = torch.randint(0, backend.vocab_size, (n, block), generator=gen).to(device)
            backend.step(StepBatch(slots, ids, full, full, torch.zeros_like(full), block))
        ids = torch.randint(0, backend.vocab_size, (n, block), generator=gen).to(device)
        ids[p:] = backend.mask_token_id  # denoising rows: a masked output block
        commit = torch.cat([full[:p], torch.zeros(d, dtype=torch.long, device=device)])
        batch = StepBatch(slots, ids, full, commit, torch.zeros_like(full), block)
        times = []
        for i in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            backend.step(batch)
            _sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
        ms = statistics.median(times)
        samples.append({"prefill_blocks": p, "decode_blocks": d, "ms": ms})
        if progress is not None:
            progress(f"prefill {p:3d} + decode {d:3d} rows: {ms:.2f} ms")
    where = f"{device}" if getattr(device, "type", "cpu") != "cpu" else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    return {
        "schema": 1,
        "source": f"measured: {backend.name} on {where}, block {block}, context {context_blocks} blocks, "
                  f"median of {repeats} (dwise-predict profile-rounds)",
        "block_size": block,
        "model": backend.fingerprint(),
        "device": str(device),
        "torch": torch.__version__,
        "samples": samples,
    }


def is_round_profile(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` holds a round profile: a JSON object with ``samples`` or with the
    three coefficients (the two forms :mod:`dwise_predict.simulation.round_cost` reads)."""
    try:
        profile = read_json(path, InputError)
    except (OSError, InputError):
        return False
    return isinstance(profile, dict) and (
        isinstance(profile.get("samples"), list) or {"base_ms", "prefill_block_ms", "decode_block_ms"} <= profile.keys())


@contextmanager
def claim_profile_out(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]]) -> Iterator[Path]:
    """Check the file ``out`` may take a round profile and hold its lock for the block.

    Refused: an ``out`` that aliases an input (:func:`dwise_predict.files.refuse_aliasing`), a
    directory, and an existing file that is not a round profile (:func:`is_round_profile`): only an
    earlier profile is replaced.
    """
    out = Path(out)
    refuse_aliasing(out, inputs)
    if out.is_dir():
        raise InputError(f"`out` {out} is a directory: give the profile's file path, e.g. {out / 'round_profile.json'}")
    if out.exists() and not is_round_profile(out):
        raise InputError(f"`out` {out} exists and is not a round profile (a JSON object with samples or base_ms, "
                         "prefill_block_ms and decode_block_ms): it is never replaced; choose a new `out`")
    with hold_output_lock(out):
        yield out
