"""The refinement predictor as a torch module: the piece training, export and serving share.

Imports only torch (and the standard-library ``names`` module), so the serving hook can rebuild it from ``refine.safetensors`` without the
training stack. The same arrays define the TorchScript and ONNX graphs.

Remaining rounds ``T`` (after the first denoising round) take values ``0..K``. Each member emits
``K`` hazard logits, ``h_j = P(T = j | T >= j)`` for ``j < K`` (``T = K`` closes the support), so

    S(j) = P(T > j) = prod_{i <= j} (1 - h_i)    and    E[T] = sum_{j < K} S(j).
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from dwise_predict.names import HIDDEN_STATES, LENGTH_SCALE


class HazardMLP(nn.Module):
    """Two-layer MLP: standardised input (D) -> width -> K hazard logits (GELU, dropout).

    ``short_width`` > 0 adds that many GELU units reading only the last ``short_features`` input
    columns (prompt length, budget, early signals), beside the ``width`` units reading all of them.
    The random-feature head of :mod:`dwise_predict.survival.linear` lives there: as ``fc1`` rows it
    would store ``short_width x H`` zeros, some 100 MB at H = 4,096.
    """

    def __init__(self, in_features: int, num_rounds: int, width: int = 256, dropout: float = 0.2,
                 short_features: int = 0, short_width: int = 0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, width)
        self.short_features = int(short_features)
        self.fc1_short = nn.Linear(short_features, short_width) if short_width > 0 else None
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(width + short_width, num_rounds)

    @classmethod
    def blank(cls, *args, **kwargs) -> "HazardMLP":
        """A member with every weight zero, for one whose weights are set rather than trained (a
        closed-form head, a file). Built on the meta device, so it draws nothing from any RNG, and given
        zero tensors in place of its meta ones (``to_empty`` makes them through torch's Python reference
        of ``empty_like``, whose first call imports sympy: 0.5 s of a train)."""
        with torch.device("meta"):
            net = cls(*args, **kwargs)
        zeros = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in net.state_dict().items()}
        net.load_state_dict(zeros, assign=True)
        return net

    @classmethod
    def drawn(cls, *args, generator: torch.Generator, **kwargs) -> "HazardMLP":
        """A member initialised as ``nn.Linear`` initialises itself, its draws taken from ``generator``
        rather than torch's global RNG: for a generator seeded with ``s``, the weights of ``cls(...)``
        after ``torch.manual_seed(s)`` (tested). Nothing is drawn from the global RNG, so members can
        be trained in several threads at once (with :meth:`forward_drawn`)."""
        net = cls.blank(*args, **kwargs)
        for layer in (net.fc1, net.fc1_short, net.fc2):
            if layer is not None:
                nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
                bound = 1.0 / math.sqrt(layer.in_features) if layer.in_features > 0 else 0.0
                nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
        return net

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, K)
        return self.fc2(self.drop(self.units(x)))

    def units(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, width + short_width), after the GELU
        units = self.fc1(x)
        if self.fc1_short is not None:
            units = torch.cat([units, self.fc1_short(x[:, x.shape[1] - self.short_features:])], dim=1)
        return F.gelu(units)

    def forward_drawn(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """:meth:`forward` with the dropout mask drawn from ``generator``: in training the same
        numbers as ``nn.Dropout`` draws from the global RNG in that state (ATen's CPU dropout is
        ``x * bernoulli(1 - p) / (1 - p)``; tested), in eval mode :meth:`forward`."""
        units, p = self.units(x), self.drop.p
        if not self.training or p == 0.0:
            return self.fc2(units)
        noise = torch.empty_like(units).bernoulli_(1.0 - p, generator=generator).div_(1.0 - p)
        return self.fc2(units * noise)


def survival_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, K) hazard logits -> (B, K) survival S(j) = P(T > j).

    1 - sigmoid(l) = sigmoid(-l), and the product becomes a sum of logs: numerically stable, no
    epsilon needed, and exportable (ONNX has no cumprod).
    """
    return torch.exp(torch.cumsum(F.logsigmoid(-logits), dim=1))


def expected_remaining(logits: torch.Tensor) -> torch.Tensor:
    """(B, K) hazard logits -> (B,) mean remaining rounds, sum_j S(j)."""
    return survival_from_logits(logits).sum(dim=1)


def isotonic_interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear map through increasing knots (xp, fp), clamped at both ends (= np.interp).

    The bucket is found by a comparison count rather than searchsorted, which ONNX cannot export.
    """
    if xp.numel() == 1:
        return fp.expand_as(x).clone()
    xc = torch.clamp(x, xp[0], xp[-1])
    idx = (xc.unsqueeze(-1) >= xp[1:-1]).sum(dim=-1)  # (B,) in [0, n-2]
    x0, x1 = xp[idx], xp[idx + 1]
    y0, y1 = fp[idx], fp[idx + 1]
    span = torch.where(x1 > x0, x1 - x0, torch.ones_like(x1))
    return y0 + (y1 - y0) * (xc - x0) / span


def refine_input(hidden: torch.Tensor, prompt_tokens: torch.Tensor, budget: torch.Tensor,
                 early_signals: torch.Tensor, prompt_norm: float, budget_norm: float) -> torch.Tensor:
    """(B, 2H), (B,), (B,), (B, S) raw inputs -> (B, 2H + 2 + S), the members' input before
    standardisation. ``hidden`` is the pooled states of :data:`~dwise_predict.names.HIDDEN_STATES`
    side by side (``first_round`` then ``prompt_last``).

    Prompt length and budget enter as ``log(1 + n) / log(1 + norm)``, ``norm`` the largest training
    value. On a linear scale a category of long prompts never seen in training (the tiny model's
    long-context prompts are 5-10 times longer than the others) sits some 30 deviations out: a linear
    head extrapolates its score past what float32 survival can resolve and gives every such request
    the same estimate, the horizon K. On the log scale they sit a few deviations out and keep their
    order. ``log(1 + n)`` rather than ``log1p``: the ONNX exporters map it to plain ops everywhere.

    A budget above ``budget_norm`` reads as ``budget_norm``. Traces are often collected at one budget,
    which leaves that column constant in training, so the weights reading it got no gradient; a
    server sends whatever ``max_new_tokens`` it has (SGLang fills in the context left when an OpenAI
    client sets none), and those weights would move every estimate. Up to the largest budget trained
    on, nothing changes.
    """
    budget = torch.clamp(budget, max=budget_norm)
    return torch.cat(
        [hidden, (torch.log(prompt_tokens + 1.0) / math.log(prompt_norm + 1.0)).unsqueeze(1),
         (torch.log(budget + 1.0) / math.log(budget_norm + 1.0)).unsqueeze(1), early_signals],
        dim=1,
    )


class RefineGraph(nn.Module):
    """Calibrated ensemble in one graph: raw inputs in, calibrated remaining rounds out.

    Inputs: ``first_round`` (B, H) the first denoising forward's pooled block rows (raw),
    ``prompt_last`` (B, H) the last prompt block's pooled rows (raw), ``prompt_tokens`` (B,),
    ``budget`` (B,), ``early_signals`` (B, S) the first round's early signals (raw).
    Output: (B,) remaining denoising rounds on the scale of actual rounds.
    """

    def __init__(
        self,
        members: list[HazardMLP],
        input_mean: torch.Tensor,
        input_std: torch.Tensor,
        prompt_norm: float,
        budget_norm: float,
        calib_x: torch.Tensor,
        calib_y: torch.Tensor,
    ):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.register_buffer("input_mean", input_mean.float())
        self.register_buffer("input_std", input_std.float())
        self.register_buffer("calib_x", calib_x.float())
        self.register_buffer("calib_y", calib_y.float())
        self.prompt_norm = float(prompt_norm)
        self.budget_norm = float(budget_norm)

    def raw(self, first_round: torch.Tensor, prompt_last: torch.Tensor, prompt_tokens: torch.Tensor,
            budget: torch.Tensor, early_signals: torch.Tensor) -> torch.Tensor:
        """(B,) ensemble mean of expected remaining rounds, before calibration."""
        hidden = torch.cat([first_round, prompt_last], dim=1)
        x = refine_input(hidden, prompt_tokens, budget, early_signals, self.prompt_norm, self.budget_norm)
        x = (x - self.input_mean) / self.input_std
        estimates = [expected_remaining(m(x)) for m in self.members]
        return torch.stack(estimates, dim=0).mean(dim=0)

    def forward(self, first_round: torch.Tensor, prompt_last: torch.Tensor, prompt_tokens: torch.Tensor,
                budget: torch.Tensor, early_signals: torch.Tensor) -> torch.Tensor:
        raw = self.raw(first_round, prompt_last, prompt_tokens, budget, early_signals)
        return isotonic_interp(raw, self.calib_x, self.calib_y)


def build_refine_graph(weights: dict[str, torch.Tensor], spec: dict, calibration: dict) -> RefineGraph:
    """Rebuild the calibrated ensemble from plain arrays: the run directory's (and bundle's)
    ``refine.safetensors`` (``member{i}.fc1.weight`` ..., ``input_mean``, ``input_std``), the
    ``refine.json`` spec (``in_features``, ``num_rounds``, ``width``, ``short_features``,
    ``short_width``, ``members``, ``prompt_norm``, ``budget_norm``, ``length_scale``,
    ``hidden_states``) and ``calibration.json`` (``x``, ``y``: increasing isotonic knots).

    Raises ``ValueError`` for a spec of another input scale or other hidden states (an older run or
    bundle)."""
    if spec.get("length_scale") != LENGTH_SCALE:
        raise ValueError(f"refine spec length_scale is {spec.get('length_scale')!r}, not {LENGTH_SCALE!r}: "
                         "it was trained by an older dwise-predict; retrain it")
    if tuple(spec.get("hidden_states", ("first_round",))) != HIDDEN_STATES:
        raise ValueError(f"refine spec takes the hidden states {spec.get('hidden_states', ['first_round'])}, not "
                         f"{list(HIDDEN_STATES)}: it was trained by an older dwise-predict; retrain it")
    members = []
    for i in range(int(spec["members"])):
        member = HazardMLP.blank(int(spec["in_features"]), int(spec["num_rounds"]), int(spec["width"]), 0.0,
                                 int(spec.get("short_features", 0)), int(spec.get("short_width", 0)))
        member.load_state_dict({k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith(f"member{i}.")})
        members.append(member)
    graph = RefineGraph(
        members,
        weights["input_mean"],
        weights["input_std"],
        spec["prompt_norm"],
        spec["budget_norm"],
        torch.tensor(calibration["x"], dtype=torch.float32),
        torch.tensor(calibration["y"], dtype=torch.float32),
    )
    return graph.eval()


def refine_state(members: list[HazardMLP], input_mean: torch.Tensor, input_std: torch.Tensor) -> dict[str, torch.Tensor]:
    """The flat tensor dict written to ``refine.safetensors`` (inverse of :func:`build_refine_graph`)."""
    state = {"input_mean": input_mean.float().contiguous(), "input_std": input_std.float().contiguous()}
    for i, member in enumerate(members):
        for name, tensor in member.state_dict().items():
            state[f"member{i}.{name}"] = tensor.detach().float().contiguous()
    return state
