"""The time of a serving round as a function of what it holds, fitted from a measured profile.

A round (one batched forward of the engine) holds ``p`` prefill rows — each one prompt block of
``block_size`` prompt tokens, the most SGLang 0.5.23 extends a request by per forward — and ``d``
denoising rows — each one output block of one request. Its time is modelled as

    ``ms = base_ms + prefill_block_ms * p + decode_block_ms * d``

(batch rows are ``p + d``; prompt tokens ``p * block_size``). The three coefficients are fitted by
least squares (non-negative) to a profile of measured rounds, and the model carries its
``source`` (which device, which model, which command) so every simulation result can say what its
seconds mean.

Profile JSON (``dwise-predict profile-rounds`` writes it for a local model; write your own from
a GPU server)::

    {"schema": 1, "source": "H200, LLaDA2.1-mini, sglang 0.5.23, bf16", "block_size": 32,
     "samples": [{"prefill_blocks": 0, "decode_blocks": 128, "ms": 95.1},
                 {"prefill_blocks": 16, "decode_blocks": 0, "ms": 41.0}, ...]}

``samples`` items may give ``prompt_tokens`` instead of ``prefill_blocks`` (converted with the
profile's ``block_size``). A profile may instead give the coefficients directly:
``{"source": ..., "base_ms": 50, "prefill_block_ms": 0.35, "decode_block_ms": 0.35}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dwise_predict.errors import ConfigError, InputError
from dwise_predict.files import read_json

PROFILE_SCHEMA = 1


@dataclass(frozen=True)
class RoundCost:
    """``ms = base_ms + prefill_block_ms * prefill_rows + decode_block_ms * decode_rows``.

    base_ms : fixed cost of a round (launch, sampling, scheduler), ms.
    prefill_block_ms : extra cost per prompt block (prefill row) in the round, ms.
    decode_block_ms : extra cost per denoising block (decode row) in the round, ms.
    source : where the numbers come from (recorded in every result).
    block_size : tokens per block of the profiled engine (None: not stated).
    fit_rmse_ms, samples : quality of the fit and how many rounds it saw (0: given, not fitted).
    """

    base_ms: float
    prefill_block_ms: float
    decode_block_ms: float
    source: str = "given"
    block_size: int | None = None
    fit_rmse_ms: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        values = (self.base_ms, self.prefill_block_ms, self.decode_block_ms)
        if not all(np.isfinite(values)) or min(values) < 0 or sum(values) <= 0:
            raise ConfigError(f"round cost needs finite non-negative coefficients, not all 0, got {values} ({self.source})")

    def seconds(self, prefill_rows, decode_rows):
        """Round time in seconds (scalars or arrays)."""
        return (self.base_ms + self.prefill_block_ms * prefill_rows + self.decode_block_ms * decode_rows) / 1000.0

    def as_dict(self) -> dict:
        return asdict(self)


def flat_round_cost(round_ms: float, slot_ms: float) -> RoundCost:
    """The simulator's original model, ``round_ms + slot_ms * blocks``, with no prefill/decode difference."""
    return RoundCost(round_ms, slot_ms, slot_ms, source=f"flags: --round-ms {round_ms:g} --slot-ms {slot_ms:g} (not measured)")


def fit_round_cost(prefill_rows, decode_rows, ms, source: str, block_size: int | None = None) -> RoundCost:
    """Least-squares fit of the three coefficients to measured rounds, clipped at 0 and refitted.

    Parameters
    ----------
    prefill_rows, decode_rows : arrays (n,), rows of each measured round.
    ms : array (n,), measured round time in milliseconds.

    Raises
    ------
    InputError
        Fewer than 3 rounds, non-finite or negative values, or rounds that cannot tell the
        coefficients apart (e.g. every round the same size).
    """
    p, d, y = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (prefill_rows, decode_rows, ms))
    if not len(p) == len(d) == len(y) or len(y) < 3:
        raise InputError(f"a round profile needs at least 3 rounds with prefill_blocks, decode_blocks and ms ({source})")
    if not (np.isfinite(p).all() and np.isfinite(d).all() and np.isfinite(y).all()) or min(p.min(), d.min(), y.min()) < 0:
        raise InputError(f"round profile values must be finite and >= 0 ({source})")
    X = np.column_stack([np.ones_like(p), p, d])
    keep = [0, 1, 2]
    for _ in range(3):  # non-negative least squares for three columns: drop negative ones, refit
        sub = X[:, keep]
        if np.linalg.matrix_rank(sub) < len(keep):
            raise InputError(f"round profile cannot separate the fixed, prefill and decode costs: vary both row counts ({source})")
        coef_sub, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if (coef_sub >= 0).all():
            break
        keep = [k for k, c in zip(keep, coef_sub) if c > 0]
        if not keep:
            raise InputError(f"round profile fits no positive cost ({source})")
    coef = np.zeros(3)
    coef[keep] = coef_sub
    rmse = float(np.sqrt(np.mean((X @ coef - y) ** 2)))
    return RoundCost(float(coef[0]), float(coef[1]), float(coef[2]), source=source, block_size=block_size,
                     fit_rmse_ms=rmse, samples=len(y))


def round_cost_from_profile(profile: dict, where: str = "profile") -> RoundCost:
    """A :class:`RoundCost` from a profile dict (samples to fit, or coefficients given)."""
    if not isinstance(profile, dict):
        raise InputError(f"{where}: a round profile is a JSON object")
    source = str(profile.get("source") or where)
    block = profile.get("block_size")
    if "samples" in profile:
        rows = profile["samples"]
        try:
            p = [r["prefill_blocks"] if "prefill_blocks" in r else r["prompt_tokens"] / block for r in rows]
            d = [r["decode_blocks"] for r in rows]
            ms = [r["ms"] for r in rows]
        except (KeyError, TypeError, ZeroDivisionError) as err:
            raise InputError(f"{where}: each sample needs prefill_blocks (or prompt_tokens with a block_size), "
                             f"decode_blocks and ms ({err!r} missing)") from None
        return fit_round_cost(p, d, ms, source, block)
    try:
        return RoundCost(float(profile["base_ms"]), float(profile["prefill_block_ms"]), float(profile["decode_block_ms"]),
                         source=source, block_size=block)
    except KeyError as err:
        raise InputError(f"{where}: give samples, or base_ms, prefill_block_ms and decode_block_ms ({err} missing)") from None


def load_round_cost(path: Path) -> RoundCost:
    """Read a round profile JSON file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"round profile {path} does not exist: measure one with `dwise-predict profile-rounds`")
    profile = read_json(path, InputError, name=f"round profile {path}",
                        fix="measure one with `dwise-predict profile-rounds`")
    return round_cost_from_profile(profile, str(path))
