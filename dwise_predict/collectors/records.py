"""What goes into and comes out of the instrumented decoder, shared by every backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from dwise_predict.engine.algorithms import DEFAULT_ALGORITHM, AlgorithmConfig, make_rule
from dwise_predict.errors import ConfigError


@dataclass(frozen=True)
class DecodingConfig:
    """How requests are decoded; recorded in every trace manifest and every bundle.

    algorithm : one of SGLang's dLLM algorithms (:data:`dwise_predict.engine.ALGORITHMS`); ``None``
        means the one SGLang serves the model's architecture with (:func:`engine.default_algorithm`).
    algorithm_config : the algorithm's parameters (``--algorithm-config``, as SGLang's
        ``--dllm-algorithm-config``); missing ones take SGLang's defaults. Read as SGLang reads that
        file: its ``block_size`` sets ``block_size``, and its execution switches
        (:data:`engine.algorithms.EXECUTION_KEYS`) are dropped, as they change no decision.
    block_size : tokens per block; ``None`` means the model's own.
    budget : output budget in tokens (``max_new_tokens``: a request stops at the block that reaches it).
    """

    algorithm: str | None = None
    algorithm_config: dict = field(default_factory=dict)
    block_size: int | None = None
    budget: int = 256
    dtype: str = "float32"
    batch_size: int = 16

    def __post_init__(self) -> None:
        problems = []
        if self.block_size is not None and self.block_size <= 0:
            problems.append(f"`block_size` must be positive, got {self.block_size}")
        if self.budget <= 0:
            problems.append(f"`budget` must be positive, got {self.budget}")
        if self.batch_size <= 0:
            problems.append(f"`batch_size` must be positive, got {self.batch_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"`dtype` must be float32, bfloat16 or float16, got {self.dtype}")
        try:  # the algorithm's name and parameters, checked before any model is loaded
            split = AlgorithmConfig.from_mapping(self.algorithm_config)
            if split.block_size is not None and self.block_size not in (None, split.block_size):
                problems.append(f"`block_size` {self.block_size} and the algorithm config's block_size "
                                f"{split.block_size} disagree: give one")
            # frozen: the split is written once, here, so what the manifest records is what runs
            object.__setattr__(self, "algorithm_config", split.params)
            object.__setattr__(self, "block_size", self.block_size or split.block_size)
            make_rule(self.algorithm or DEFAULT_ALGORITHM, mask_id=0, params=self.algorithm_config)
        except ConfigError as err:
            problems.append(str(err))
        if problems:
            raise ConfigError("; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeRequest:
    """One request for the decoder: its id, its prompt ids after the chat template, its budget."""

    request_id: str
    prompt_ids: list[int]
    budget: int


@dataclass
class DecodeResult:
    """Everything the decoder measured for one request (one row of contract 1 plus hidden rows)."""

    request_id: str
    prompt_tokens: int
    prompt_blocks: int
    block_size: int
    rounds_per_block: list[int]
    output_ids: list[int]
    finish: str  # "eos" | "budget"
    frac_over_threshold: float
    mean_confidence: float
    mean_entropy: float
    end_probability: float
    wall_s: float
    first_round_hidden: np.ndarray  # (H,) mean of the final-layer rows of the first output block, first round
    prompt_last_hidden: np.ndarray  # (H,) mean of the final-layer rows of the last prompt tokens processed
    extra: dict = field(default_factory=dict)
    # `collect --layers`: tensor name (traces.hidden_extra) -> (H,) or (block, H) rows of the first round
    first_round_layers: dict[str, np.ndarray] = field(default_factory=dict)
    # `collect --rounds-hidden N` (traces.round_states): (k, H) pooled rows and (k, 4) early signals of the
    # request's first k = min(N, total_rounds) denoising forwards; None when not asked for
    round_states: np.ndarray | None = None
    round_signals: np.ndarray | None = None

    @property
    def total_rounds(self) -> int:
        return int(sum(self.rounds_per_block))

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)
