"""Which decoding each input's requests ran under, and the inputs grouped by it.

A round count is a count of forwards under one decoding: the same prompts decoded with another
algorithm, another threshold or another block size take other counts, so ``characterize`` never pools
two decodings into one table. A decoding here is the manifest's decoding fields that change the
recorded rounds (:data:`dwise_predict.names.DECODING_KEYS`) but the output budget, which
``characterize`` pools on purpose and tabulates (its budget sweep), with the block size taken per
request from the contract column ``block_size``.

Inputs that differ only in block size are split by it (Amin et al.'s block-size sweep). Inputs that
differ in anything else (algorithm, its parameters, dtype, engine, sampling parameters) are refused
unless the caller asks for one section per decoding: comparing two algorithms is a choice, not
something to happen because two directories were named together. The parameters are compared as
the manifests record them: an old recording's ``{}`` and a newer one's explicit default read as two
decodings (``collect`` normalises both; this layer does not import the engine that knows the defaults).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from dwise_predict.errors import InputError
from dwise_predict.names import DECODING_KEYS, identity
from dwise_predict.traces import TraceDataset

# the decoding fields that make two groups of requests two decodings; the block size comes per request
SETTING_KEYS = tuple(k for k in DECODING_KEYS if k not in ("budget", "block_size"))
# the settings a section's label always names (others only where the groups differ in them)
LABEL_KEYS = ("algorithm", "algorithm_config")


@dataclass
class DecodingGroup:
    """The requests of every input decoded one way.

    ``settings`` holds :data:`SETTING_KEYS` as the manifests record them, ``parts`` one
    ``(trace path, requests)`` per input that has requests in this group, in input order.
    """

    settings: dict
    block_size: int
    parts: list[tuple[str | None, pd.DataFrame]] = field(default_factory=list)
    settings_label: str = ""  # the algorithm, its parameters and the settings in which groups differ
    label: str = ""  # settings_label and the block size

    @property
    def requests(self) -> pd.DataFrame:
        return pd.concat([frame for _, frame in self.parts], ignore_index=True)

    @property
    def decoding(self) -> dict:
        """The group's decoding as a report shows it: its settings and block size."""
        return {**self.settings, "block_size": self.block_size}

    @property
    def family(self) -> str:
        """What the group shares with groups of other block sizes (the settings, canonical JSON)."""
        return _canonical(self.settings)


def settings_of(ds: TraceDataset, keys: Sequence[str] = SETTING_KEYS) -> dict:
    """The manifest's decoding fields ``keys`` of ``ds`` (missing ones as None)."""
    return identity(ds.decoding, tuple(keys))


def first_difference(a: TraceDataset, b: TraceDataset, keys: Sequence[str] = SETTING_KEYS) -> str | None:
    """``"key: a's value vs b's value"`` for the first of ``keys`` whose decoding field differs, or None."""
    left, right = settings_of(a, keys), settings_of(b, keys)
    key = next((k for k in keys if _canonical(left[k]) != _canonical(right[k])), None)
    return None if key is None else f"{key}: {_shown(left[key])} vs {_shown(right[key])}"


def group_by_decoding(datasets: Sequence[TraceDataset], split_decodings: bool = False) -> list[DecodingGroup]:
    """The inputs' requests in one group per decoding, ordered by settings (inputs' order) then block size.

    Raises
    ------
    InputError : when the inputs differ in a setting other than the block size (and the budget) and
        ``split_decodings`` is false; it names the two inputs and the setting.
    """
    if not split_decodings:
        for other in datasets[1:]:
            diff = first_difference(datasets[0], other)
            if diff is not None:
                raise InputError(
                    f"traces {datasets[0].path} and {other.path} were decoded differently ({diff}): their rounds "
                    "are not one workload; characterize one decoding per call, or pass `split_decodings` for one "
                    "section per decoding")
    families: dict[str, dict[int, DecodingGroup]] = {}
    for ds in datasets:
        settings = settings_of(ds)
        blocks = families.setdefault(_canonical(settings), {})
        for block_size, frame in ds.requests.groupby("block_size", sort=True):
            group = blocks.setdefault(int(block_size), DecodingGroup(settings, int(block_size)))
            group.parts.append((str(ds.path) if ds.path else None, frame.reset_index(drop=True)))
    groups = [blocks[b] for blocks in families.values() for b in sorted(blocks)]
    _label(groups)
    return groups


def _label(groups: list[DecodingGroup]) -> None:
    """Name each group by its algorithm and parameters, every other setting in which the groups
    differ, and its block size."""
    varying = [k for k in SETTING_KEYS if k not in LABEL_KEYS
               and len({_canonical(g.settings[k]) for g in groups}) > 1]
    for g in groups:
        parts = [str(g.settings["algorithm"] or "unnamed algorithm")]
        config = g.settings["algorithm_config"]
        if isinstance(config, dict) and config:
            parts[0] += " " + " ".join(f"{k}={_shown(v)}" for k, v in sorted(config.items()))
        parts += [f"{k} {_shown(g.settings[k])}" for k in varying]
        g.settings_label = ", ".join(parts)
        g.label = f"{g.settings_label}, block {g.block_size}"


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _shown(value) -> str:
    return value if isinstance(value, str) else _canonical(value)
