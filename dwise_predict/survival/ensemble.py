"""The refinement predictor's seed ensemble: fit several HazardMLPs, average their estimates.

Input of a request: ``[h1, h_prompt, log(1 + prompt_tokens) / log(1 + prompt_norm), log(1 + budget) /
log(1 + budget_norm), early signals]`` (``network.refine_input``; 2H + 2 + S values: the first
denoising forward's and the last prompt block's pooled states, ``names.HIDDEN_STATES``, and S = 4
early signals in the order of ``names.EARLY_SIGNALS``), standardised with the training split's mean and standard deviation.
Each member is trained with the logistic-hazard NLL, Adam and early stopping on a validation part
of the training split; the weights of its best validation epoch are kept. Fitted state is plain
tensors, the same ones ``network.refine_state`` writes and ``network.build_refine_graph`` reads.
"""

from __future__ import annotations

import numpy as np
import torch

from dwise_predict.errors import ConfigError, InputError
from dwise_predict.survival.adam import FusedAdam
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.labels import RemainingRoundsLabels, informative
from dwise_predict.survival.loss import logistic_hazard_nll
from dwise_predict.names import HIDDEN_STATES, LENGTH_SCALE
from dwise_predict.survival.network import (
    HazardMLP, RefineGraph, build_refine_graph, refine_input, refine_state, survival_from_logits,
)

_MIN_STD = 1e-6  # a constant input column (e.g. one output budget for all requests) is left unscaled


class SurvivalEnsemble:
    """Seed ensemble of discrete-time survival MLPs over the first-round hidden state.

    Parameters
    ----------
    width : hidden units of each MLP.
    dropout : dropout after the GELU, during training only.
    seeds : one member per seed (initialisation, batch order and dropout).
    max_epochs : upper bound on passes over the training part.
    patience : stop a member after this many epochs without a better validation loss.
    lr : Adam learning rate.
    weight_decay : Adam weight decay (L2).
    batch_size : requests per optimisation step.
    val_fraction : share of the training split held out for early stopping (fixed by ``split_seed``).
    split_seed : seed of the train/validation partition, shared by all members.

    ``candidate`` names the refinement candidate these members express (``"survival"``, the paper's
    ensemble; ``"ridge"`` and ``"survival+ridge"`` from :mod:`dwise_predict.survival.linear`); it is
    recorded in refine.json and changes nothing in the graph.
    """

    candidate: str = "survival"
    short_width: int = 0  # units reading only prompt length, budget and signals (network.HazardMLP)

    def __init__(
        self,
        width: int = 256,
        dropout: float = 0.2,
        seeds: tuple[int, ...] = (0, 1, 2),
        max_epochs: int = 100,
        patience: int = 10,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        batch_size: int = 256,
        val_fraction: float = 0.2,
        split_seed: int = 0,
    ):
        self.width = width
        self.dropout = dropout
        self.seeds = tuple(seeds)
        self.max_epochs = max_epochs
        self.patience = patience
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self._standardised: tuple[RefineInputs, torch.Tensor] | None = None  # the last standardise()

    # --- fit ----------------------------------------------------------------------------------

    def fit(self, inputs: RefineInputs, remaining, events=None, progress=None,
            like: "SurvivalEnsemble | None" = None) -> "SurvivalEnsemble":
        """Fit every member.

        Parameters
        ----------
        inputs : the N requests' refinement inputs (``training.fit.refine_inputs`` builds them from a
            trace dataset).
        remaining : array of shape (N,), remaining denoising rounds after the first (``total - 1``).
        events : array of shape (N,), 1 = finished, 0 = collection cut short (censored); all 1 if None.
        progress : optional callable ``(member, epoch, train_loss, val_loss)`` called after each epoch.
        like : a prepared ensemble on the same requests whose standardisation to take (:meth:`prepare`).
        """
        if not 0.0 < self.val_fraction < 1.0:
            raise InputError(f"val_fraction must lie in (0, 1), got {self.val_fraction}")
        if not self.seeds:
            raise InputError("the ensemble needs at least one seed (one member per seed)")
        x, idx, ev = self.prepare(inputs, remaining, events, like)

        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(self.split_seed))
        n_val = min(max(1, round(self.val_fraction * x.shape[0])), x.shape[0] - 1)
        val, tr = perm[:n_val], perm[n_val:]
        self.members_: list[HazardMLP] = []
        self.history_: list[dict] = []
        for m, seed in enumerate(self.seeds):
            member, history = self._fit_member(
                seed, x[tr], idx[tr], ev[tr], x[val], idx[val], ev[val],
                None if progress is None else (lambda *a, m=m: progress(m, *a)),
            )
            self.members_.append(member)
            self.history_.append({"seed": seed, **history})
        return self

    def prepare(self, inputs: RefineInputs, remaining, events=None, like: "SurvivalEnsemble | None" = None):
        """Fit K, the input norms and the standardisation on the informative requests; return their
        standardised inputs (n, 2H + 2 + S) and survival labels (idx (n,), event (n,)).

        Shared with :class:`~dwise_predict.survival.linear.RidgeHead`, so every refinement candidate
        standardises its input the same way (the graph's ``input_mean`` / ``input_std``). ``like``: an
        ensemble prepared on the same requests, whose norms and standardisation are taken instead of
        fitted again (the same numbers: the cross-validation's fits of a fold share one).
        """
        if len(remaining) != len(inputs):
            raise InputError(f"{len(inputs)} hidden rows but {len(remaining)} remaining-round counts")
        labels = RemainingRoundsLabels().fit(remaining, events)
        keep = informative(remaining, events)
        if keep.sum() < 4:
            raise InputError(f"survival model needs at least 4 informative training requests, got {int(keep.sum())}")
        self.num_rounds_ = labels.out_features
        self._standardised = None
        if like is not None:
            self.prompt_norm_, self.budget_norm_ = like.prompt_norm_, like.budget_norm_
            self.hidden_size_ = like.hidden_size_
            self.input_mean_, self.input_std_ = like.input_mean_, like.input_std_
            x = like.standardise(inputs)[keep]  # each value as below: the same elementwise steps
        else:
            self.prompt_norm_ = float(max(1.0, inputs.prompt_tokens.max()))
            self.budget_norm_ = float(max(1.0, inputs.budget.max()))
            self.hidden_size_ = inputs.hidden_size  # both states' columns: 2H
            x = self._assemble(*_as_tensors(inputs))[keep]  # (n, 2H + 2 + S)
            self.input_mean_ = x.mean(dim=0)
            std = x.std(dim=0, unbiased=False)
            self.input_std_ = torch.where(std > _MIN_STD, std, torch.ones_like(std))
            x = (x - self.input_mean_) / self.input_std_
        kept_events = None if events is None else np.asarray(events)[keep]
        idx, ev = (torch.from_numpy(a) for a in labels.transform(np.asarray(remaining)[keep], kept_events))
        return x, idx, ev

    def with_members(self, members: list[HazardMLP], seeds: tuple[int, ...] | None = None, width: int | None = None,
                     history: list[dict] | None = None, short_width: int = 0) -> "SurvivalEnsemble":
        """A fitted ensemble with this one's standardisation, K and norms but the given members (all of
        one width and short width): how the ridge head and the blend become the same graph family."""
        ensemble = SurvivalEnsemble(
            width=int(width if width is not None else members[0].fc1.out_features), dropout=self.dropout,
            seeds=self.seeds if seeds is None else tuple(seeds),
        )
        ensemble.members_ = list(members)
        ensemble.input_mean_, ensemble.input_std_ = self.input_mean_, self.input_std_
        ensemble.num_rounds_, ensemble.prompt_norm_, ensemble.budget_norm_ = self.num_rounds_, self.prompt_norm_, self.budget_norm_
        ensemble.hidden_size_ = self.hidden_size_
        ensemble.short_width = int(short_width)
        ensemble.history_ = list(history or [])
        ensemble.candidate = self.candidate
        return ensemble

    def _fit_member(self, seed, x, idx, ev, x_val, idx_val, ev_val, progress):
        """One member: Adam on the NLL, keep the weights of the best validation epoch.

        Its initialisation and dropout draw from a generator of its own seeded with ``seed``: the
        numbers ``torch.manual_seed(seed)`` gave them from the global RNG until 2026-12 (the same
        members, tested), without the global RNG, so the cross-validation fits members in two threads."""
        draws = torch.Generator().manual_seed(seed)
        net = HazardMLP.drawn(x.shape[1], self.num_rounds_, self.width, self.dropout, generator=draws)
        # fused: one kernel per step instead of four per tensor, ~3x faster epochs at H = 2048 on CPU;
        # torch.optim.Adam(fused=True)'s step without its torch._dynamo import (survival.adam)
        opt = FusedAdam(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        order_rng = torch.Generator().manual_seed(seed)
        best_loss, best_epoch, best_state = float("inf"), -1, None
        train_curve, val_curve = [], []
        for epoch in range(self.max_epochs):
            net.train()
            total = 0.0
            for batch in torch.randperm(x.shape[0], generator=order_rng).split(self.batch_size):
                # index_select: the rows x[batch] gives, ~3x faster at 4,102 columns
                loss = logistic_hazard_nll(net.forward_drawn(x.index_select(0, batch), draws), idx[batch], ev[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach()) * batch.numel()
            net.eval()
            with torch.no_grad():
                val_loss = float(logistic_hazard_nll(net(x_val), idx_val, ev_val))
            train_curve.append(total / x.shape[0])
            val_curve.append(val_loss)
            if progress is not None:
                progress(epoch, train_curve[-1], val_loss)
            if val_loss < best_loss:
                best_loss, best_epoch = val_loss, epoch
                best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
            elif epoch - best_epoch >= self.patience or not np.isfinite(train_curve[-1]):
                break  # no progress, or diverged: the best epoch so far is kept
        if best_state is None:
            raise ConfigError(f"the survival member with seed {seed} diverged (validation loss {val_loss:g} "
                              f"from the first epoch): lower the learning rate (`lr` {self.lr:g})")
        net.load_state_dict(best_state)
        net.eval()
        return net, {"train_loss": train_curve, "val_loss": val_curve, "best_epoch": best_epoch}

    # --- predict ------------------------------------------------------------------------------

    def spec(self) -> dict:
        """The refine.json dict of the run directory (layout: :mod:`dwise_predict.runs`, docs/training.md)."""
        return {
            "hidden_size": self.hidden_size_ // len(HIDDEN_STATES),  # per state: each graph input's width
            "hidden_states": list(HIDDEN_STATES),
            "early_signals": self.signal_count,
            "in_features": int(self.input_mean_.numel()),
            "num_rounds": self.num_rounds_,
            "width": self.width,
            "short_features": int(self.input_mean_.numel()) - self.hidden_size_,
            "short_width": self.short_width,
            "dropout": self.dropout,
            "members": len(self.members_),
            "seeds": list(self.seeds),
            "prompt_norm": self.prompt_norm_,
            "budget_norm": self.budget_norm_,
            "length_scale": LENGTH_SCALE,
            "target": "remaining_rounds = total_rounds - 1 (after the first denoising round)",
            "candidate": self.candidate,
        }

    @classmethod
    def from_state(cls, weights: dict[str, torch.Tensor], spec: dict) -> "SurvivalEnsemble":
        """Rebuild a fitted ensemble from refine.safetensors' tensors and refine.json's dict."""
        ensemble = cls(width=int(spec["width"]), dropout=float(spec["dropout"]), seeds=tuple(spec["seeds"]))
        graph = build_refine_graph(weights, spec, {"x": [0.0], "y": [0.0]})
        ensemble.members_ = list(graph.members)
        ensemble.input_mean_ = graph.input_mean.clone()
        ensemble.input_std_ = graph.input_std.clone()
        ensemble.num_rounds_ = int(spec["num_rounds"])
        ensemble.hidden_size_ = int(spec["hidden_size"]) * len(HIDDEN_STATES)
        ensemble.short_width = int(spec.get("short_width", 0))
        ensemble.prompt_norm_ = float(spec["prompt_norm"])
        ensemble.budget_norm_ = float(spec["budget_norm"])
        ensemble.history_ = []
        ensemble.candidate = str(spec.get("candidate", "survival"))
        return ensemble

    def state(self) -> dict[str, torch.Tensor]:
        """The flat tensor dict written to refine.safetensors."""
        return refine_state(self.members_, self.input_mean_, self.input_std_)

    def graph(self, calibration: dict | None = None) -> RefineGraph:
        """The exportable graph rebuilt from :meth:`state` and :meth:`spec` (as export and serving do).

        ``calibration`` is calibration.json's dict; without it the graph's forward is the identity
        map on the raw estimate over [0, K] (use ``graph.raw`` for raw estimates either way).
        """
        calibration = calibration or {"x": [0.0, float(self.num_rounds_)], "y": [0.0, float(self.num_rounds_)]}
        return build_refine_graph(self.state(), self.spec(), calibration)

    @property
    def signal_count(self) -> int:
        """S, the number of early-signal columns of the input."""
        return int(self.input_mean_.numel()) - self.hidden_size_ - 2

    def predict_raw(self, inputs: RefineInputs, batch_size: int = 1024) -> np.ndarray:
        """Ensemble mean of expected remaining rounds, array of shape (N,) float64 (uncalibrated)."""
        hidden, *rest = self._tensors(inputs)
        graph_inputs = (*hidden.tensor_split(len(HIDDEN_STATES), dim=1), *rest)  # one per state, as the graph's
        graph = self.graph()
        out = []
        with torch.no_grad():
            for s in range(0, len(inputs), batch_size):
                out.append(graph.raw(*(t[s : s + batch_size] for t in graph_inputs)))
        return torch.cat(out).double().numpy() if out else np.zeros(0)

    def predict_survival(self, inputs: RefineInputs) -> np.ndarray:
        """Ensemble survival curves, array of shape (N, K): mean over members of S(t) = P(T > t)."""
        x = self.standardise(inputs)
        with torch.no_grad():
            curves = torch.stack([survival_from_logits(m(x)) for m in self.members_]).mean(dim=0)
        return curves.double().numpy()

    def standardise(self, inputs: RefineInputs) -> torch.Tensor:
        """(N, 2H + 2 + S) standardised inputs, as the graph computes them before its members; not to be
        modified. The last result is kept: the closed-form heads that share this standardisation
        (``survival.linear``) ask for the same inputs several times in one fit. Safe from several threads
        (the cross-validation's fits of one fold share one standardisation, ``survival.linear.Standardised``):
        each call returns what it read or made, whatever another call keeps meanwhile."""
        kept = self._standardised
        if kept is None or kept[0] is not inputs:
            kept = (inputs, (self._assemble(*self._tensors(inputs)) - self.input_mean_) / self.input_std_)
            self._standardised = kept
        return kept[1]

    def _tensors(self, inputs: RefineInputs) -> tuple[torch.Tensor, ...]:
        """The inputs as tensors, once their sizes are this model's."""
        inputs.check_sizes(self.hidden_size_, self.signal_count)
        return _as_tensors(inputs)

    def _assemble(self, hidden: torch.Tensor, prompt_tokens: torch.Tensor, budget: torch.Tensor,
                  early_signals: torch.Tensor) -> torch.Tensor:
        """(N, 2H), (N,), (N,), (N, S) -> (N, 2H + 2 + S) in the column order RefineGraph.raw uses."""
        return refine_input(hidden, prompt_tokens, budget, early_signals, self.prompt_norm_, self.budget_norm_)


def _as_tensors(inputs: RefineInputs) -> tuple[torch.Tensor, ...]:
    """hidden, prompt tokens, budget and early signals as float32 tensors sharing the arrays' memory."""
    return tuple(torch.as_tensor(a) for a in (inputs.hidden, inputs.prompt_tokens, inputs.budget, inputs.early_signals))

