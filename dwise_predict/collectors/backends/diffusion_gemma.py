"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``, shipped inside transformers 5.x), instrumented.

DiffusionGemma does not fit the mask-token threshold loop of :mod:`dwise_predict.collectors.decoder`:
it encodes the prompt in a separate pass into a KV cache, then denoises one large output *canvas*
(``canvas_length`` tokens, its block) that starts as uniform random tokens, accepting tokens by an
entropy bound and re-noising the rest, with self-conditioning on the previous step's logits, until a
stable-and-confident criterion or ``max_denoising_steps``. So this backend runs the model's own
``generate()`` — the algorithm exactly as shipped — one request at a time, and observes it.

Not in the engine's units: SGLang serves DiffusionGemma with ``Gemma4Renoise`` (its own sampler,
context pass and round accounting), which this backend does not reproduce; its traces record
``engine_faithful: false`` in the manifest and ``docs/backends.md`` says what differs.

- a **round** is one decoder forward pass over the canvas; ``rounds_per_block`` counts them per canvas
  (a canvas is a block; ``block_size`` = ``canvas_length``); canvases are delimited by the encoder calls
  that append each finished canvas to the cache;
- ``first_round_hidden`` is the decoder's final-layer (post-norm) hidden state of the first forward
  over the first canvas, mean-pooled over the canvas; ``prompt_last_hidden`` pools the encoder's final
  layer over the last ``canvas_length`` prompt tokens (the last prompt block);
- the early signals come from the first round's logits after soft-capping, before the temperature
  schedule (the model's own predictive distribution): the fraction of canvas positions whose top-1
  probability reaches the ``threshold`` of ``--algorithm-config`` (default 0.9), the mean top-1
  probability, the mean entropy (nats).

Sampling is random by design; each request runs under its own generator seed derived from the
collection seed and its request id, so results do not depend on order, batching, sharding or resume.
That threshold only feeds ``frac_over_threshold``; the model's ``generation_config.json``
(``max_denoising_steps``, ``sampler_config.entropy_bound``, ``t_min``/``t_max``, stopping thresholds)
decides decoding and is recorded in the manifest as the backend's decoding parameters. The output
budget rounds up to whole canvases, as ``generate`` does.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from dwise_predict.collectors.backends.base import LOAD_ERRORS
from dwise_predict.collectors.records import DecodeRequest, DecodeResult, DecodingConfig
from dwise_predict.engine.signals import SIGNAL_THRESHOLD
from dwise_predict.errors import ConfigError, ModelError

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
GENERATION_PARAMS = (
    "max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold",
)


def is_diffusion_gemma(config: dict) -> bool:
    """Whether a parsed ``config.json`` describes a DiffusionGemma model."""
    return config.get("model_type") == "diffusion_gemma" or ARCHITECTURE in (config.get("architectures") or [])


class DiffusionGemmaBackend:
    """A loaded DiffusionGemma model with its tokenizer, decoded through its own ``generate``.

    Parameters
    ----------
    path : local model directory (``config.json``, weights, tokenizer with a chat template).
    dtype : "float32", "bfloat16" or "float16".
    device : torch device string.
    """

    algorithm = "transformers-EntropyBoundSampler"  # not SGLang's Gemma4Renoise: see docs/backends.md
    engine_faithful = False
    runs_own_loop = True  # collect calls decode_requests instead of the engine-semantics decoder

    def __init__(self, path: str | Path, dtype: str = "float32", device: str = "cpu") -> None:
        import torch
        from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

        self.path = Path(path)
        self.device = torch.device(device)
        try:
            self.model = DiffusionGemmaForBlockDiffusion.from_pretrained(
                self.path, dtype=getattr(torch, dtype)
            ).to(self.device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        except LOAD_ERRORS as err:
            raise ModelError(f"cannot load DiffusionGemma from {self.path}: {err}") from None
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ModelError(f"the tokenizer in {self.path} has no chat template: add chat_template.jinja")
        text = self.model.config.text_config
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        self.block_size = int(self.model.config.canvas_length)
        eos = self.model.generation_config.eos_token_id
        eos = text.eos_token_id if eos is None else eos
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    def fingerprint(self) -> dict:
        """Contract 1's model fingerprint of the loaded directory."""
        from dwise_predict.collectors.backends.base import directory_fingerprint

        return directory_fingerprint(self.path, self.path.name, self.model.config.to_dict(), self.hidden_size,
                                     self.vocab_size)

    def decoding_params(self) -> dict:
        """The model's own generation settings that shape its round counts (recorded in the manifest)."""
        gen = self.model.generation_config
        defaults = gen._get_default_generation_params()  # what generate() falls back to for unset fields
        params = {k: getattr(gen, k, None) for k in GENERATION_PARAMS}
        params = {k: defaults[k] if v is None else v for k, v in params.items()}
        sampler = gen.sampler_config or defaults["sampler_config"]
        params["entropy_bound"] = float(sampler.entropy_bound)
        params["canvas_length"] = self.block_size
        return params

    def decode_requests(
        self,
        requests: Iterable[DecodeRequest],
        config: DecodingConfig,
        seed: int = 0,
        on_result: Callable[[DecodeResult], None] | None = None,
    ) -> Iterator[DecodeResult]:
        """Generate each request and yield what was measured, in input order."""
        if config.block_size is not None and config.block_size != self.block_size:
            raise ConfigError(
                f"DiffusionGemma decodes canvases of {self.block_size} tokens (canvas_length in config.json): "
                f"drop `block_size` or set it to {self.block_size}"
            )
        for request in requests:
            result = self._decode_one(request, config, seed)
            if on_result is not None:
                on_result(result)
            yield result

    def _decode_one(self, request: DecodeRequest, config: DecodingConfig, seed: int) -> DecodeResult:
        import torch

        probe = _Probe(self.model, threshold=config.algorithm_config.get("threshold", SIGNAL_THRESHOLD),
                       block_size=self.block_size, stop_ids=self.eos_ids)
        prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        cuda = [self.device] if self.device.type == "cuda" else []
        start = time.perf_counter()
        with probe, torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(request_seed(seed, request.request_id))
            out = self.model.generate(prompt, max_new_tokens=request.budget, logits_processor=probe.processors())
        wall_s = time.perf_counter() - start
        generated = out.sequences[0, prompt.shape[1]:].tolist()
        end = next((i for i, t in enumerate(generated) if t in self.eos_ids), None)
        output_ids = generated if end is None else generated[:end]  # contract 1: the tokens before the EOS
        n = len(request.prompt_ids)
        return DecodeResult(
            request_id=request.request_id,
            prompt_tokens=n,
            prompt_blocks=math.ceil(n / self.block_size),  # its own encoder pass, not engine units
            block_size=self.block_size,
            rounds_per_block=probe.rounds_per_block,
            output_ids=output_ids,
            finish="budget" if end is None else "eos",
            frac_over_threshold=probe.signals[0],
            mean_confidence=probe.signals[1],
            mean_entropy=probe.signals[2],
            end_probability=probe.signals[3],
            wall_s=wall_s,
            first_round_hidden=probe.first_round,
            prompt_last_hidden=probe.prompt_last,
            extra={"tokens_per_forward": float(out.tokens_per_forward[0])},
        )


def request_seed(seed: int, request_id: str) -> int:
    """A 63-bit generator seed from the collection seed and the request id (order-independent)."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _Probe:
    """Hooks that watch one ``generate`` call: encoder passes, decoder passes, first-round logits."""

    def __init__(self, model, threshold: float, block_size: int, stop_ids: set[int]) -> None:
        self.model = model
        self.stop_ids = sorted(stop_ids)
        self.threshold = threshold
        self.block_size = block_size
        self.rounds_per_block: list[int] = []
        self.first_round: np.ndarray | None = None  # (H,)
        self.prompt_last: np.ndarray | None = None  # (H,)
        self.signals: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # names.EARLY_SIGNALS order
        self._handles = []

    def __enter__(self) -> "_Probe":
        self._handles = [
            self.model.model.encoder.register_forward_hook(self._on_encoder),
            self.model.model.decoder.register_forward_hook(self._on_decoder),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def processors(self):
        from transformers import LogitsProcessorList

        return LogitsProcessorList([self._on_logits])

    def _on_encoder(self, module, args, output) -> None:
        # The first encoder pass is the prompt prefill; each later one appends a finished canvas,
        # so every encoder pass opens a new canvas.
        if self.prompt_last is None:
            hidden = output.last_hidden_state[0]  # (prompt_tokens, H)
            last_block = hidden[(hidden.shape[0] - 1) // self.block_size * self.block_size:]
            self.prompt_last = last_block.float().mean(0).cpu().numpy()
        self.rounds_per_block.append(0)

    def _on_decoder(self, module, args, output) -> None:
        self.rounds_per_block[-1] += 1
        if self.first_round is None:
            self.first_round = output.last_hidden_state[0].float().mean(0).cpu().numpy()  # (H,)

    def _on_logits(self, input_ids, scores):
        import torch

        if len(self.rounds_per_block) == 1 and self.rounds_per_block[0] == 1:
            probs = torch.softmax(scores[0].float(), dim=-1)  # (canvas, V)
            top1 = probs.max(dim=-1).values
            entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
            stop = probs[:, self.stop_ids].sum(-1).clamp(max=1.0 - 1e-7)
            self.signals = (
                float((top1 >= self.threshold).float().mean()),
                float(top1.mean()),
                float(entropy.mean()),
                float(-torch.expm1(torch.log1p(-stop).sum())),
            )
        return scores
