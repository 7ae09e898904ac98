"""Training recipe of the tiny dLLM: the block-diffusion objective on the project's own corpus.

Each step draws one category's examples from ``dllm.corpus`` (categories in a shuffled cycle, so
every category gets its weighted share of the steps and a batch never mixes a 300-token long-context
prompt with 20-token ones), lays each out as

    chat-templated prompt | answer | <eos> … up to the end of a block

on the serving engine's grid (blocks from the first token, so the prompt's leftover tokens open the
first output block, as SGLang lays a request out; at least one ``<eos>``, the decoder's stop signal),
and masks a random fraction ``t ~ U(0, 1)`` of the output positions of every output block (at least
one per block; leftover prompt tokens stay clean, as under SGLang's prompt mask). The model predicts the masked tokens from the rest of their block and the
CLEAN earlier blocks — every response block at once, through the model's two-stream training forward
(``noisy_ids``) — and the loss is the cross-entropy on masked positions only. AdamW, linear warm-up then
cosine decay, gradient clipping, fixed seeds.

Two training drills (``corpus.DRILLS``: copy the prompt's tokens; name the letter of the option that
says X) join the category cycle. They are not served categories; they isolate the retrieval that
MCQ, instruction and long-context answers need, and retrieval-heavy steps get larger shares of the
cycle (``step_weights``). What moved MCQ from chance to well above it, measured on MCQ + lookup only
(5,000 steps, 200 prompts each): the learning rate (3e-3 and 5e-4 stayed at chance, MCQ 0.22; 1e-3
reached 0.47) and the drill (MCQ alone for the same 2,500 MCQ steps: 0.30). In the full mix, a
uniform 11,000-step cycle still left MCQ at chance (0.23) while the weighted 12,500-step recipe
reaches 0.53 (40 prompts per category, ``tests/test_dllm_quality.py``). That result sits near a
tipping point: adding a third drill (long context's needles over a short context; MCQ's share 5 %
smaller) left MCQ at chance again (0.23) and long context at 0.00. Long-context retrieval is
further away than the budget: 6,000 steps on long context alone (contexts cut to 40-80 tokens) plus
the copy drill, ~4,500 of them long-context steps against ~700 in the full recipe, only began to
restate the queried keys (14 % of them when no two needles share a color or object, 3 % when they
do) and retrieved no number (0 of 100 prompts either way). Hard MCQ fails at its per-option checks
(the model restates the options and stops at its first "yes", but its parity, comparison and
membership verdicts are right for 69 % of the options it checks, where always saying "no" scores
67 %). A third drill stating those checks for every option, balanced yes/no (weight 2, hard MCQ's
own weight 1, 13,200 steps so the other shares stay put), lifted that to 74 %, left hard MCQ at 0.13
and cost MCQ its margin (0.33). The output head is tied to
the embeddings (``TinyDllmConfig.tie_word_embeddings``): instruction 0.03 → 0.12 and code 0.47 → 0.53
in an otherwise unchanged earlier recipe.

The forward runs under bfloat16 autocast (weights and optimiser state stay float32): on this
project's 2-core AMD EPYC machine, whose cores have AVX-512 BF16, a step is ~1.6x faster than in
float32. On CPUs without native bf16, ``--precision float32`` is the faster choice (the weights then
differ). Two torch threads by default; the thread count is part of the recipe, since float
reductions, and so the weights, depend on it. Under heavy load from other processes two threads slow
down far more than one (``--threads 1``). The default recipe (12,500 steps of 16 examples) ran
18.2 min on the idle 2-core machine (~0.09 s/step).

Every 250 steps the run's state (weights, AdamW moments, the masking generator, loss curve) goes to
``train-checkpoint.safetensors`` in the output directory; rerunning an interrupted run continues from
there to the same weights, byte for byte.

The result is a model directory (``config.json``, ``model.safetensors``, tokenizer files,
``chat_template.jinja``) that ``AutoModel.from_pretrained`` loads once ``dwise_predict.dllm`` is
imported, plus ``training.json`` with the resolved recipe, the loss curve and package versions.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dwise_predict.dllm.corpus import CATEGORIES, DRILLS, Example, generate_examples, vocabulary
from dwise_predict.errors import ConfigError, InputError
from dwise_predict.files import atomic_dir, atomic_write_bytes, loads_json
from dwise_predict.versions import package_versions

# Training examples use corpus seeds far from the small seeds workloads and tests use.
TRAIN_SEED_OFFSET = 1_000_000
# An interrupted run resumes from here (inside the model directory; removed once the run completes).
CHECKPOINT_NAME = "train-checkpoint.safetensors"
CHECKPOINT_FORMAT = "dwise-predict tiny-dllm training checkpoint 1"


@dataclass
class TinyTrainConfig:
    """The whole recipe; saved in ``training.json``. Defaults reproduce the shipped weights."""

    seed: int = 0
    steps: int = 12500
    batch_size: int = 16
    max_batch_tokens: int = 5120  # clean + noisy tokens per step: long-context steps take fewer examples
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    threads: int = 2
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    block_size: int = 8
    max_position_embeddings: int = 1024
    tie_embeddings: bool = True
    precision: str = "bfloat16"  # autocast dtype of the forward; weights and optimiser stay float32
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    drills: list[str] = field(default_factory=lambda: list(DRILLS))  # training-only exercises
    # steps per schedule cycle (1 if absent): option retrieval (MCQ and its drill) is the slowest skill
    # to appear; chat, long context (the costliest steps) and the second math language need fewer
    step_weights: dict[str, int] = field(default_factory=lambda: {
        "instruction": 2, "code": 2, "math": 2, "mcq": 3, "hard_mcq": 2, "option_lookup": 3})
    max_minutes: float | None = None  # wall-clock cap; stopping early makes the result machine-dependent

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "batch_size", "hidden_size", "n_layers", "n_heads", "block_size", "threads"):
            if getattr(self, name) <= 0:
                problems.append(f"`{name}` must be positive, got {getattr(self, name)}")
        if self.hidden_size % max(self.n_heads, 1):
            problems.append(f"hidden size {self.hidden_size} is not divisible by {self.n_heads} heads")
        if self.lr <= 0:
            problems.append(f"`lr` must be positive, got {self.lr}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            problems.append(f"`max_minutes` must be positive, got {self.max_minutes}")
        if self.precision not in ("float32", "bfloat16"):
            problems.append(f"`precision` must be float32 or bfloat16, got {self.precision!r}")
        if any(d not in DRILLS for d in self.drills):
            problems.append(f"drills must be a subset of {', '.join(DRILLS)}, got {self.drills}")
        if any(w < 1 for w in self.step_weights.values()) or set(self.step_weights) - {*CATEGORIES, *DRILLS}:
            problems.append(f"step weights must name categories or drills and be >= 1, got {self.step_weights}")
        unknown = [c for c in self.categories if c not in CATEGORIES]
        if unknown or not self.categories:
            problems.append(f"categories must be a non-empty subset of {', '.join(CATEGORIES)}, got {unknown}")
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass
class TrainResult:
    """What ``train_tiny`` did: where it wrote, steps reached, seconds (all runs together), last logged
    loss, parameter count, and where it resumed."""

    out_dir: Path
    steps_done: int
    wall_s: float
    final_loss: float
    parameters: int
    resumed_from: int = 0  # the step an earlier, interrupted run had reached (0: a fresh run)


# --- data --------------------------------------------------------------------------------------


def encode_example(tokenizer, example: Example, block_size: int) -> tuple[list[int], int]:
    """Token ids of ``prompt | answer | <eos>…`` and the prompt length.

    The prompt goes through the tokenizer's chat template with the generation prompt, exactly as the
    decoder sends it; the answer is followed by ``<eos>`` up to the end of its block on the engine's
    grid (blocks from the first token: the leftover prompt tokens share the first output block), at
    least one.
    """
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    n_eos = block_size - (len(prompt) + len(answer)) % block_size  # in 1..block_size
    return list(prompt) + answer + [tokenizer.eos_token_id] * n_eos, len(prompt)


def make_batch(encoded: list[tuple[list[int], int]], block_size: int, mask_id: int, pad_id: int,
               gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Pad a batch and mask every output block with its own ratio.

    Returns the clean stream ``input_ids`` (B, T) with ``attention_mask`` (B, T) and
    ``prompt_lengths`` (B,); the noisy stream of the output blocks only, left-aligned at the start of
    the first output block (``prompt_length // block_size * block_size``): ``noisy_ids`` (B, R),
    ``noisy_valid`` (B, R), ``targets`` (B, R) (the clean tokens) and ``loss_mask`` (B, R) bool, True
    where a token is masked. Leftover prompt tokens in the first output block are never masked (the
    engine's prompt mask). R is a multiple of ``block_size``.
    """
    B = len(encoded)
    T = max(len(ids) for ids, _ in encoded)
    starts = [p // block_size * block_size for _, p in encoded]
    R = max(len(ids) - s for (ids, _), s in zip(encoded, starts))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    targets = torch.full((B, R), pad_id, dtype=torch.long)
    noisy_valid = torch.zeros((B, R), dtype=torch.bool)
    maskable = torch.zeros((B, R), dtype=torch.bool)
    for i, ((ids, p), s) in enumerate(zip(encoded, starts)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        targets[i, : len(ids) - s] = torch.tensor(ids[s:])
        noisy_valid[i, : len(ids) - s] = True
        maskable[i, p - s: len(ids) - s] = True
    rblock = torch.arange(R)[None, :].expand(B, R) // block_size  # (B, R) output block of each token
    ratio = torch.rand((B, R // block_size), generator=gen).gather(1, rblock)  # (B, R): t of the block
    u = torch.rand((B, R), generator=gen)
    # at least one masked position per block: the maskable one with the lowest u
    u_maskable = torch.where(maskable, u, torch.full_like(u, 2.0))
    block_min = u_maskable.view(B, R // block_size, block_size).amin(-1).gather(1, rblock)  # (B, R)
    masked = ((u < ratio) | (u_maskable == block_min)) & maskable
    noisy = torch.where(masked, torch.full_like(targets, mask_id), targets)
    return {"input_ids": input_ids, "attention_mask": attention,
            "prompt_lengths": torch.tensor([p for _, p in encoded]),
            "noisy_ids": noisy, "noisy_valid": noisy_valid, "targets": targets, "loss_mask": masked}


def cap_batch(encoded: list[tuple[list[int], int]], max_tokens: int, block_size: int) -> list[tuple[list[int], int]]:
    """The longest prefix of ``encoded`` whose padded two-stream size ``k * (T + R)`` fits
    ``max_tokens`` (at least one example); R starts at each first output block (see make_batch)."""
    k, T, R = 0, 0, 0
    for ids, p in encoded:
        T, R = max(T, len(ids)), max(R, len(ids) - p // block_size * block_size)
        if k and (k + 1) * (T + R) > max_tokens:
            break
        k += 1
    return encoded[:k]


def category_schedule(categories: list[str], steps: int, seed: int,
                      weights: dict[str, int] | None = None) -> list[str]:
    """The category of every step: shuffled cycles in which each category appears ``weights[c]`` times
    (default 1), so it gets that share of the steps."""
    rng = random.Random(f"schedule:{seed}")
    order: list[str] = []
    while len(order) < steps:
        cycle = [c for c in categories for _ in range((weights or {}).get(c, 1))]
        rng.shuffle(cycle)
        order.extend(cycle)
    return order[:steps]


def lr_at(step: int, cfg: TinyTrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --- setup --------------------------------------------------------------------------------------


def build_model_and_tokenizer(cfg: TinyTrainConfig):
    """A freshly initialised tiny dLLM (seeded) and its tokenizer over the corpus vocabulary."""
    from dwise_predict.dllm.model import TinyDllmConfig, TinyDllmForBlockDiffusion
    from dwise_predict.dllm.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(vocabulary())
    config = TinyDllmConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        block_size=cfg.block_size,
        max_position_embeddings=cfg.max_position_embeddings,
        mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    torch.manual_seed(cfg.seed)
    return TinyDllmForBlockDiffusion(config), tokenizer


def _write_model_dir(model, tokenizer, out_dir: Path, record: dict) -> None:
    """Save into a temporary sibling directory, then move the files in: never a half-written model."""
    with atomic_dir(out_dir, merge=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")


# --- checkpoints -------------------------------------------------------------------------------
# One safetensors file holds everything a run needs to continue bit for bit: the float32 weights,
# AdamW's moments and step counts, the masking generator's state, and (as JSON metadata) the recipe,
# the step reached, the loss curve and the seconds spent. The corpus needs nothing: every step's
# examples are seeded by the step index. Written atomically, so a kill leaves the previous one whole.


def _named_parameters_in_optimizer_order(model, opt) -> list[tuple[str, torch.nn.Parameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for group in opt.param_groups for p in group["params"]]


def save_checkpoint(path: Path, model, opt, gen: torch.Generator, progress: dict) -> None:
    """Write the run's state at a step boundary (``progress``: recipe, steps_done, wall_s, loss_curve,
    window)."""
    from safetensors.torch import save


    tensors = {"masking_rng": gen.get_state()}
    for name, param in _named_parameters_in_optimizer_order(model, opt):
        tensors[f"param.{name}"] = param.detach()
        for key, value in opt.state.get(param, {}).items():
            tensors[f"adam.{name}.{key}"] = value.reshape(-1)  # "step" is a 0-d tensor
    metadata = {"format": CHECKPOINT_FORMAT, **{k: json.dumps(v) for k, v in progress.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata), durable=True)


def _read_checkpoint(path: Path, with_tensors: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()} if with_tensors else {}
        if metadata.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}")
        progress = {k: loads_json(v, InputError, f"its {k}", allow_nan=True)  # a diverged loss is NaN
                    for k, v in metadata.items() if k != "format"}
    except Exception as err:  # safetensors and json raise many types for a damaged file
        raise InputError(f"{path} is not a readable training checkpoint ({err}): delete it to train from "
                         "the start") from None
    return progress, tensors


def checkpoint_progress(path: Path, cfg: TinyTrainConfig) -> dict:
    """The progress saved in ``path`` (``steps_done``, ``wall_s``, ...), once it is known to belong to
    a run of ``cfg``.

    Raises
    ------
    ConfigError
        The checkpoint is of another recipe (the run to resume is not this one).
    InputError
        The file is damaged or not a training checkpoint.
    """
    progress, _ = _read_checkpoint(path, with_tensors=False)
    _check_same_recipe(path, progress, cfg)
    return progress


def _check_same_recipe(path: Path, progress: dict, cfg: TinyTrainConfig) -> None:
    saved, wanted = progress["recipe"], asdict(cfg)
    differ = [k for k in wanted if k != "max_minutes" and saved.get(k) != wanted[k]]
    if differ:
        raise ConfigError(f"{path.parent} holds an interrupted run of another recipe (differs in "
                          f"{', '.join(differ)}): rerun with its options to resume it, delete {path} to "
                          "start over, or choose another `out_dir`")


def load_checkpoint(path: Path, cfg: TinyTrainConfig, model, opt, gen: torch.Generator) -> dict:
    """Restore ``model``, ``opt`` and ``gen`` from ``path``; returns the saved progress. Raises as
    :func:`checkpoint_progress` does."""
    progress, tensors = _read_checkpoint(path, with_tensors=True)
    _check_same_recipe(path, progress, cfg)
    moments: dict[str, dict[str, torch.Tensor]] = {}  # parameter name -> AdamW state
    for key, value in tensors.items():
        if key.startswith("adam."):
            name, field_ = key.removeprefix("adam.").rsplit(".", 1)
            moments.setdefault(name, {})[field_] = value
    state = opt.state_dict()  # AdamW keys its state by the parameter's index in optimiser order
    with torch.no_grad():
        for i, (name, param) in enumerate(_named_parameters_in_optimizer_order(model, opt)):
            param.copy_(tensors[f"param.{name}"])
            if name in moments:
                state["state"][i] = {k: v.reshape(()) if k == "step" else v.view_as(param)
                                     for k, v in moments[name].items()}
    opt.load_state_dict(state)
    gen.set_state(tensors["masking_rng"])
    return progress


# --- the loop -----------------------------------------------------------------------------------


def train_tiny(cfg: TinyTrainConfig, out_dir: str | Path,
               progress: Callable[[int, int, float], None] | None = None,
               checkpoint_every: int = 250) -> TrainResult:
    """Train the tiny dLLM with ``cfg`` and write the model directory ``out_dir``.

    Resumable: every ``checkpoint_every`` steps (~20 s with the default recipe) the run's state goes
    to ``out_dir/train-checkpoint.safetensors``; calling again with the same recipe continues from
    there and ends with the same weights as an uninterrupted run. A run stopped by
    ``cfg.max_minutes`` writes its model and keeps the checkpoint, so a rerun trains on (each call
    gets ``max_minutes`` of its own). The checkpoint is deleted once all steps are done.

    Parameters
    ----------
    cfg : the recipe (``TinyTrainConfig()`` reproduces the shipped weights).
    out_dir : model directory to write; files of the same names in it are replaced.
    progress : called as ``progress(step, steps, loss)`` after every step (e.g. a progress bar).
    checkpoint_every : steps between checkpoints; does not change the result.

    Raises
    ------
    InputError
        ``out_dir`` is an existing file, or holds a damaged checkpoint.
    ConfigError
        ``out_dir`` holds the checkpoint of a run with another recipe.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"`out_dir` {out_dir} is a file: give a directory for the model")
    torch.set_num_threads(cfg.threads)
    model, tokenizer = build_model_and_tokenizer(cfg)  # seeds torch's global generator
    gen = torch.Generator().manual_seed(cfg.seed)  # masking; the corpus has its own seeded generators
    opt = _optimizer(model, cfg)
    checkpoint = out_dir / CHECKPOINT_NAME
    run = {"recipe": asdict(cfg), "steps_done": 0, "wall_s": 0.0,
           "loss_curve": [],  # [step, mean loss over the steps since the previous entry]
           "window": []}  # losses since the last curve entry
    if checkpoint.is_file():
        run = {**run, **load_checkpoint(checkpoint, cfg, model, opt, gen), "recipe": asdict(cfg)}
    resumed_from = run["steps_done"]
    schedule = category_schedule(cfg.categories + cfg.drills, cfg.steps, cfg.seed, cfg.step_weights)
    bs, mask_id, pad_id = cfg.block_size, tokenizer.mask_token_id, tokenizer.pad_token_id
    wall_before, t0 = run["wall_s"], time.perf_counter()
    model.train()
    for step in range(resumed_from, cfg.steps):
        if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            break
        examples = generate_examples(schedule[step], cfg.batch_size, TRAIN_SEED_OFFSET * (cfg.seed + 1) + step)
        encoded = cap_batch([encode_example(tokenizer, e, bs) for e in examples], cfg.max_batch_tokens, bs)
        loss = _train_step(model, opt, make_batch(encoded, bs, mask_id, pad_id, gen), step, cfg)
        _record_loss(run, step, loss, cfg.steps)
        run["wall_s"] = wall_before + time.perf_counter() - t0
        if run["steps_done"] % checkpoint_every == 0 and run["steps_done"] < cfg.steps:
            save_checkpoint(checkpoint, model, opt, gen, run)
        if progress is not None:
            progress(run["steps_done"], cfg.steps, loss)
    return _finish(model, tokenizer, opt, gen, run, cfg, out_dir, resumed_from)


def _optimizer(model, cfg: TinyTrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (biases, norms' gains and other vectors are not
    decayed)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def _train_step(model, opt, batch: dict[str, torch.Tensor], step: int, cfg: TinyTrainConfig) -> float:
    """One optimiser step on ``batch`` (see :func:`make_batch`); returns its loss, the cross-entropy
    on the masked positions."""
    with torch.autocast("cpu", dtype=getattr(torch, cfg.precision), enabled=cfg.precision != "float32"):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       prompt_lengths=batch["prompt_lengths"], noisy_ids=batch["noisy_ids"],
                       noisy_mask=batch["noisy_valid"]).logits  # (B, R, V)
    m = batch["loss_mask"]
    loss = F.cross_entropy(logits[m].float(), batch["targets"][m])
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item()


def _record_loss(run: dict, step: int, loss: float, steps: int) -> None:
    """Count ``step`` as done in ``run`` and add its loss to the curve: one entry, the mean of the
    window since the last, every 50 steps and at the last step."""
    run["steps_done"] = step + 1
    run["window"].append(loss)
    if run["steps_done"] % 50 == 0 or run["steps_done"] == steps:
        run["loss_curve"].append([run["steps_done"], sum(run["window"]) / len(run["window"])])
        run["window"] = []


def _finish(model, tokenizer, opt, gen: torch.Generator, run: dict, cfg: TinyTrainConfig, out_dir: Path,
            resumed_from: int) -> TrainResult:
    """Write the model directory with ``training.json``; keep a checkpoint while steps remain (a rerun
    continues from it), delete it once all are done."""
    checkpoint = out_dir / CHECKPOINT_NAME
    steps_done, wall = run["steps_done"], run["wall_s"]
    if steps_done < cfg.steps:  # stopped by the time cap: a rerun continues from here
        save_checkpoint(checkpoint, model, opt, gen, run)
    window = run["window"]
    losses = run["loss_curve"] + ([[steps_done, sum(window) / len(window)]] if window else [])
    final = losses[-1][1] if losses else float("nan")
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    record = {"recipe": asdict(cfg), "steps_done": steps_done, "wall_s": round(wall, 1), "final_loss": final,
              "parameters": n_params, "loss_curve": losses, "threads": cfg.threads,
              "versions": package_versions()}
    if resumed_from:
        record["resumed_from_step"] = resumed_from
    _write_model_dir(model, tokenizer, out_dir, record)
    if steps_done == cfg.steps:
        checkpoint.unlink(missing_ok=True)  # after the model is written: a kill in between only redoes the tail
    return TrainResult(out_dir, steps_done, wall, final, n_params, resumed_from)
