"""A ridge head on the standardised hidden states, written as a member of the survival graph family.

Ridge regression of ``log1p(remaining rounds)`` on the refinement input the ensemble already uses
(``[h1, h_prompt, prompt length, budget, early signals]``, lengths on a log scale, standardised with the same
mean and deviation), its L2 penalty chosen by exact leave-one-out error over a grid (closed form from one eigendecomposition,
on the training data only). On the tiny model's traces this kind of linear probe has ranked above
the survival ensemble, which is why it is a refinement *candidate*; docs/training.md has the
current figures of every candidate.

No new graph type: the linear score ``z = w·x + b`` becomes a :class:`HazardMLP` of width 2 (or a
wider one padded with zero units), because

    GELU(z) - GELU(-z) = z Φ(z) + z Φ(-z) = z          (exactly, Φ the normal CDF)

so ``fc1`` rows ``(w, b)`` and ``(-w, -b)`` followed by ``fc2`` weights ``(-1, +1)`` on every one of
the K outputs give the hazard logit ``-z`` in every round. The implied survival is geometric,
``S(j) = sigmoid(z)^(j + 1)``, and the expected remaining rounds ``sum_{j<K} S(j)`` is about
``exp(z) ≈ remaining + 1`` and strictly increasing in ``z``: the graph ranks requests exactly as the
ridge score does, and the isotonic calibration maps it to remaining rounds as it does for the
ensemble. Export, bundle contract 2 and the serving hook are therefore unchanged. The survival
curves of this member are the geometric law above, not a fitted distribution: use the ensemble when
survival curves matter (concordance, Brier score).

References
----------
Hastie, Tibshirani & Friedman (2009), *The Elements of Statistical Learning*, §3.4.1 and §7.10
(ridge via the SVD; leave-one-out residuals ``r_i / (1 - H_ii)``).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from dwise_predict.errors import InputError
from dwise_predict.names import HIDDEN_STATES
from dwise_predict.survival.ensemble import SurvivalEnsemble
from dwise_predict.survival.inputs import RefineInputs
from dwise_predict.survival.network import HazardMLP, expected_remaining

DEFAULT_ALPHAS: tuple[float, ...] = tuple(float(a) for a in np.logspace(-1, 5, 13))


class RidgeHead:
    """Ridge of ``log1p(remaining)`` on the standardised refinement input, L2 penalty by leave-one-out.

    Parameters
    ----------
    alphas : candidate L2 penalties (on standardised inputs); the one with the smallest exact
        leave-one-out squared error on the training requests is kept.
    """

    def __init__(self, alphas: tuple[float, ...] = DEFAULT_ALPHAS):
        self.alphas = tuple(alphas)

    def fit(self, inputs: RefineInputs, remaining, events=None, like: SurvivalEnsemble | None = None,
            groups=None, standardised: "Standardised | None" = None) -> "RidgeHead":
        """Fit on finished requests.

        Parameters
        ----------
        inputs : the N requests' refinement inputs; remaining, events : arrays of shape (N,).
        like : a fitted :class:`SurvivalEnsemble` on the same requests whose standardisation, K and
            norms to share (so the ridge member can join its graph); fitted here when None.
        groups : array of shape (N,), request categories, or None. Given, the fit has two stages
            (candidate ``ridge-within``): first a ridge on inputs and targets centred *within each
            category* — only the directions that order requests inside a category, which is what a
            category never seen in training can reuse — then a ridge of the residual on the raw
            inputs for the levels between categories, its penalty chosen by leaving one category
            out (the levels are for categories the fit has not seen); one such fit per hidden state,
            averaged. All of it is linear, so the result is one weight vector; serving needs no category.
        standardised : these requests' :class:`Standardised` (``like`` its ``base``), whose float64
            inputs and Gram decomposition the one-stage fit takes when every request is finished.
        """
        shared = standardised is not None and bool(_done(remaining, events).all())
        x, y = self._finished(inputs, remaining, events, standardised.base if standardised is not None else like,
                              standardised.x.numpy() if shared else None)
        base = self.base_
        self.within_ = groups is not None
        if not self.within_:
            basis = _Basis(x, y, standardised) if shared else None
            self.coef_, self.intercept_, self.alpha_, self.loo_mse_ = _ridge_loo(x, y, self.alphas, basis=basis)
            return self
        # one two-stage ridge per hidden state (its columns and the short inputs), scores averaged:
        # on 14 draws of the tiny model's traces this kept 0.03 more held-out-category rho than one
        # ridge over both states side by side, whose fit leans on whichever state orders the seen
        # categories best
        g = np.asarray(groups).astype(str)[_done(remaining, events)]
        per_state, short = base.hidden_size_ // len(HIDDEN_STATES), np.arange(base.hidden_size_, x.shape[1])
        self.coef_, self.intercept_, self.states_ = np.zeros(x.shape[1]), 0.0, {}
        for k, name in enumerate(HIDDEN_STATES):
            cols = np.concatenate([np.arange(k * per_state, (k + 1) * per_state), short])
            coef, intercept, self.states_[name] = _ridge_two_stage(x[:, cols], y, g, self.alphas)
            self.coef_[cols] += coef / len(HIDDEN_STATES)
            self.intercept_ += intercept / len(HIDDEN_STATES)
        return self

    def fit_held_out(self, inputs: RefineInputs, remaining, events, groups) -> np.ndarray:
        """Fit as :meth:`fit` does without groups, and return each request's predicted
        ``log1p(remaining)`` (N,) by this ridge refitted without its group (category), at the same
        penalty and standardisation: exact without refitting (:func:`ridge_held_out`), from the fit's
        own eigendecomposition; NaN for unfinished requests (``ridge`` candidate's held-out estimates)."""
        x, y = self._finished(inputs, remaining, events, None)
        basis = _Basis(x, y)
        self.within_ = False
        self.coef_, self.intercept_, self.alpha_, self.loo_mse_ = _ridge_loo(x, y, self.alphas, basis=basis)
        done = _done(remaining, events)
        out = np.full(len(remaining), np.nan)
        out[done] = ridge_held_out(basis, np.asarray(groups)[done], self.alpha_)
        return out

    def _finished(self, inputs: RefineInputs, remaining, events, like: SurvivalEnsemble | None,
                  standardised_x: np.ndarray | None = None):
        """The finished requests' standardised inputs (n, D) and ``log1p(remaining)`` (n,), float64;
        the standardisation (``base_``) is ``like``'s, or fitted here. ``standardised_x``: those inputs
        already made (``Standardised.x`` of ``like``'s requests, all finished)."""
        if not self.alphas or min(self.alphas) <= 0:
            raise InputError(f"ridge penalties must be > 0, got {self.alphas}")
        base = like if like is not None else SurvivalEnsemble(seeds=())
        if like is None:
            base.prepare(inputs, remaining, events)
        self.base_ = base
        done = _done(remaining, events)
        if done.sum() < 4:
            raise InputError(f"the ridge head needs at least 4 finished training requests, got {int(done.sum())}")
        x = base.standardise(inputs)[done].double().numpy() if standardised_x is None else standardised_x  # (n, D)
        return x, np.log1p(np.asarray(remaining, dtype=np.float64)[done])

    def member(self, width: int = 2) -> HazardMLP:
        """The fitted ridge as a :class:`HazardMLP` of ``width`` >= 2 (units beyond the first two are
        zero and add nothing: GELU(0) = 0)."""
        if width < 2:
            raise InputError(f"the ridge member needs width >= 2, got {width}")
        d, k = self.coef_.size, self.base_.num_rounds_
        net = HazardMLP.blank(d, k, width, 0.0)
        w = torch.as_tensor(self.coef_, dtype=torch.float32)
        with torch.no_grad():
            net.fc1.weight[0], net.fc1.weight[1] = w, -w
            net.fc1.bias[0], net.fc1.bias[1] = self.intercept_, -self.intercept_
            net.fc2.weight[:, 0], net.fc2.weight[:, 1] = -1.0, 1.0  # logit = -(GELU(z) - GELU(-z)) = -z
        return net.eval()

    def ensemble(self) -> SurvivalEnsemble:
        """The ridge alone as a one-member :class:`SurvivalEnsemble` (candidate ``"ridge"``, or
        ``"ridge-within"`` when fitted with groups)."""
        ensemble = self.base_.with_members([self.member(2)], seeds=(), width=2)
        ensemble.candidate = "ridge-within" if self.within_ else "ridge"
        return ensemble

    def score(self, inputs: RefineInputs) -> np.ndarray:
        """Predicted ``log1p(remaining)``, array of shape (N,) (the ranking the graph reproduces)."""
        x = self.base_.standardise(inputs).double().numpy()
        return x @ self.coef_ + self.intercept_

    def record(self) -> dict:
        if self.within_:
            return {"states": self.states_, "alphas": list(self.alphas)}
        return {"alpha": self.alpha_, "loo_mse": self.loo_mse_, "alphas": list(self.alphas)}


def _done(remaining, events) -> np.ndarray:
    """(N,) bool: the finished requests (all when ``events`` is None)."""
    return np.ones(len(remaining), dtype=bool) if events is None else np.asarray(events, dtype=bool)


def _ridge_two_stage(x: np.ndarray, y: np.ndarray, groups: np.ndarray, alphas) -> tuple[np.ndarray, float, dict]:
    """``ridge-within`` on ``x`` (n, d): a ridge on inputs and targets centred within each category,
    then a ridge of its residual on the raw inputs; one weight vector (d,), its intercept and the
    penalties chosen.

    The second stage learns each category's level. Its penalty is chosen by leaving one category out,
    not one request: with every category in the fit, leave-one-out rewards memorising the levels of
    the categories seen, and those directions only add noise to the order inside a category the fit
    has never seen. On 14 draws of the tiny model's traces, end to end through ``train``: held-out-
    category ρ 0.414 -> 0.428, within-category ρ +0.004, ρ over all requests 0.912 -> 0.904."""
    xc, yc = x.copy(), y.copy()
    for cat in np.unique(groups):
        rows = groups == cat
        xc[rows] -= x[rows].mean(axis=0)
        yc[rows] -= y[rows].mean()
    w1, _, alpha_within, loo_within = _ridge_loo(xc, yc, alphas)
    # one category: nothing to leave out, so leave one request out as in the first stage
    by = groups if np.unique(groups).size > 1 else None
    w2, intercept, alpha, error = _ridge_loo(x, y - x @ w1, alphas, groups=by)
    return w1 + w2, intercept, {"alpha_within": alpha_within, "loo_mse_within": loo_within, "alpha_between": alpha,
                                "cv_mse_between": error,
                                "cv_between": "leave-one-out" if by is None else "leave-one-category-out"}


def blend(ensemble: SurvivalEnsemble, ridge: RidgeHead) -> SurvivalEnsemble:
    """The survival members plus the ridge member (padded to their width) in one graph: the raw
    estimate is the mean of all members' expected remaining rounds (candidate ``"survival+ridge"``).
    ``ridge`` must have been fitted with ``like=ensemble``."""
    if ridge.base_ is not ensemble:
        raise InputError("blend needs the ridge head fitted with like=<that ensemble>")
    members = list(ensemble.members_) + [ridge.member(ensemble.width)]
    out = ensemble.with_members(members, seeds=ensemble.seeds, width=ensemble.width, history=ensemble.history_)
    out.candidate = "survival+ridge"
    return out


class SignalFeatureHead:
    """Ridges of ``log1p(remaining)`` on random GELU features of the short inputs: prompt tokens,
    budget and the early signals (not the hidden states), averaged over a bag of feature draws.

    Amin et al.'s early signals order requests within a category through a non-linear relation (on the
    tiny model's traces a small LightGBM on them reaches within-category ρ 0.62, a linear fit 0.37).
    A fixed random first layer, ``GELU(W x + c)`` with ``W, c ~ N(0, scale^2)`` on the standardised
    short inputs, followed by a ridge over its units (penalty by exact leave-one-out, as
    :class:`RidgeHead`) fits that relation in closed form: no optimiser, no epochs, deterministic for a
    seed (random-features regression; Rahimi & Recht 2007). ``bag`` such heads, each with its own
    draw and penalty, are averaged: on 14 draws of the tiny model's traces four of them kept 0.02 more
    held-out-category ρ than one (and than one ridge over all their units at once), at the same
    within-category ρ; four of 512 units ranked as four of 1,024 (ρ, within-category and held-out
    ρ equal to 0.002 over the draws) at an eighth of the eigendecomposition cost. Eight: how much
    held-out ρ depends on the seed falls with the number of random units (sd over seven seeds of a
    12-draw mean 0.017 with four, 0.010 with eight), and through ``train`` on the 14 draws held-out ρ
    rose by 0.007 ± 0.003 at the same within-category ρ. The fitted bag *is* a one-hidden-layer GELU
    network on the short inputs, so it joins the graph as the members' short units
    (:func:`blend_heads`). sklearn's ``MLPRegressor`` would fit such a network by gradient descent,
    but it has no GELU and needs thousands of epochs here.

    Parameters
    ----------
    width : random units per draw. scale : deviation of their weights and biases on standardised
    inputs. seed : seed of the random layers. bag : draws averaged. alphas : candidate L2 penalties.
    """

    def __init__(self, width: int = 512, scale: float = 3.0, seed: int = 0, bag: int = 8,
                 alphas: tuple[float, ...] = DEFAULT_ALPHAS):
        self.width, self.scale, self.seed, self.bag = int(width), float(scale), int(seed), int(bag)
        self.alphas = tuple(alphas)

    def fit(self, base: SurvivalEnsemble, inputs: RefineInputs, remaining, events=None) -> "SignalFeatureHead":
        """Fit on the finished requests; ``base`` is a prepared ensemble whose standardisation to share."""
        if self.width < 1 or self.scale <= 0 or self.bag < 1:
            raise InputError(f"signal features need width >= 1, scale > 0 and bag >= 1, got {self.width}, "
                             f"{self.scale} and {self.bag}")
        self.base_ = base
        short = int(base.input_mean_.numel()) - base.hidden_size_  # prompt tokens, budget, early signals
        draws = [np.random.default_rng([self.seed, k]) for k in range(self.bag)]
        self.fc1_weight_ = np.concatenate([rng.normal(0.0, self.scale, (self.width, short)) for rng in draws])
        self.fc1_bias_ = np.concatenate([rng.normal(0.0, self.scale, self.width) for rng in draws])
        done = np.ones(len(remaining), dtype=bool) if events is None else np.asarray(events, dtype=bool)
        units = self._units(inputs)[done]
        y = np.log1p(np.asarray(remaining, dtype=np.float64)[done])
        fits = [_ridge_loo(units[:, k * self.width:(k + 1) * self.width], y, self.alphas) for k in range(self.bag)]
        self.coef_ = np.concatenate([coef for coef, *_ in fits]) / self.bag  # (bag * width,): their mean
        self.intercept_ = float(np.mean([intercept for _, intercept, *_ in fits]))
        self.alphas_ = [alpha for *_, alpha, _ in fits]
        return self

    @property
    def units(self) -> int:
        """Random units over the whole bag."""
        return self.width * self.bag

    def score(self, inputs: RefineInputs) -> np.ndarray:
        """Predicted ``log1p(remaining)``, array of shape (N,)."""
        return self._units(inputs) @ self.coef_ + self.intercept_

    def _units(self, inputs: RefineInputs) -> np.ndarray:
        x = self.base_.standardise(inputs)[:, self.base_.hidden_size_:].double()
        pre = x @ torch.as_tensor(self.fc1_weight_).T + torch.as_tensor(self.fc1_bias_)
        return torch.nn.functional.gelu(pre).numpy()  # (N, bag * width)

    def record(self) -> dict:
        return {"width": self.width, "bag": self.bag, "scale": self.scale, "seed": self.seed, "alphas": self.alphas_}


def blend_heads(ridge: RidgeHead, features: SignalFeatureHead, weight: float) -> SurvivalEnsemble:
    """``weight * ridge + (1 - weight) * features`` on the log scale as ONE member (candidate
    ``"ridge-within+signals"``): units 0-1 carry the ridge score (``GELU(z) - GELU(-z) = z``), the
    short units are the feature heads' own, and ``fc2`` sums them with the blend weights, so the
    hazard logit is ``-(weight * z_ridge + (1 - weight) * z_features)`` in every round."""
    if ridge.base_ is not features.base_:
        raise InputError("blend_heads needs both heads fitted on one prepared ensemble")
    if not 0.0 <= weight <= 1.0:
        raise InputError(f"the blend weight must lie in [0, 1], got {weight}")
    base = ridge.base_
    d, k = int(base.input_mean_.numel()), base.num_rounds_
    net = HazardMLP.blank(d, k, 2, 0.0, short_features=d - base.hidden_size_, short_width=features.units)
    w = torch.as_tensor(ridge.coef_ * weight, dtype=torch.float32)
    with torch.no_grad():
        net.fc1.weight[0], net.fc1.weight[1] = w, -w
        net.fc1.bias[0], net.fc1.bias[1] = ridge.intercept_ * weight, -ridge.intercept_ * weight
        net.fc1_short.weight.copy_(torch.as_tensor(features.fc1_weight_, dtype=torch.float32))
        net.fc1_short.bias.copy_(torch.as_tensor(features.fc1_bias_, dtype=torch.float32))
        net.fc2.weight[:, 0], net.fc2.weight[:, 1] = -1.0, 1.0
        net.fc2.weight[:, 2:] = -torch.as_tensor(features.coef_ * (1.0 - weight), dtype=torch.float32)
        net.fc2.bias.fill_(-features.intercept_ * (1.0 - weight))
    ensemble = base.with_members([net.eval()], seeds=(), width=2, short_width=features.units)
    ensemble.candidate = "ridge-within+signals"
    return ensemble


def linear_raw(score, num_rounds: int) -> np.ndarray:
    """The raw estimate (N,) the graph of a linear head gives for its scores ``score`` (N,) and K =
    ``num_rounds``: the expected remaining rounds under the hazard logit ``-score`` in every round (a
    blend of heads is scored before its graph exists, as out-of-fold estimates are)."""
    score = torch.as_tensor(np.asarray(score, dtype=np.float64))
    return expected_remaining(-score[:, None].expand(-1, int(num_rounds))).numpy()


def _ridge_loo(x: np.ndarray, y: np.ndarray, alphas, groups=None,
               basis: "_Basis | None" = None) -> tuple[np.ndarray, float, float, float]:
    """Ridge with intercept; penalty by exact leave-one-out MSE, or, given ``groups`` (n,), by exact
    leave-one-group-out MSE. Returns (coef (D,), intercept, alpha, mse). ``basis``: ``_Basis(x, y)``
    when the caller has it.

    One eigendecomposition of the smaller Gram matrix serves every alpha: with the centred
    ``X = U diag(s) V^T``, the fit is ``U diag(s^2 / (s^2 + a)) U^T y`` and the hat matrix
    ``H = U diag(s^2 / (s^2 + a)) U^T + 1/n`` (the intercept is unpenalised). A request's
    leave-one-out residual is ``r_i / (1 - H_ii)``; a group's residuals when the fit leaves out the
    whole group are ``(I - H_gg)^{-1} r_g`` (the same Sherman-Morrison-Woodbury identity for a
    block), so grouped CV needs no refit either. The algebra runs in torch (float64, on the caller's
    torch thread count): numpy's OpenBLAS ``eigh`` of a 1,453 x 1,453 Gram matrix took 6.6 s on two
    busy cores against 0.9 s for torch's.
    """
    basis = _Basis(x, y) if basis is None else basis
    blocks = None if groups is None else _group_rows(groups)
    best = None
    for a in alphas:
        if blocks is None:
            resid, hat = basis.residuals(a), basis.u2 @ basis.shrink(a) + 1.0 / basis.n
            mse = float(torch.mean((resid / torch.clamp(1.0 - hat, min=1e-9)) ** 2))
        else:
            mse = float(torch.sum(basis.held_out_residuals(a, blocks) ** 2)) / basis.n
        if best is None or mse < best[1] - 1e-12:
            best = (float(a), mse)
    a, mse = best
    coef = basis.coef(a)
    return coef.numpy(), float(basis.y_mean - basis.x_mean @ coef), a, mse


def ridge_held_out(basis: "_Basis", groups, alpha: float) -> np.ndarray:
    """Each request's prediction (n,) by the ridge of penalty ``alpha`` (with intercept) on ``basis``'s
    data fitted without its group: exact, from the one eigendecomposition (``y - (I - H_gg)^{-1} r_g``
    per group, as :func:`_ridge_loo` scores groups)."""
    blocks = _group_rows(groups)
    return (basis.yt - basis.held_out_residuals(alpha, blocks)).numpy()


def _group_rows(groups) -> list[torch.Tensor]:
    groups = np.asarray(groups)
    return [torch.as_tensor(np.flatnonzero(groups == g)) for g in np.unique(groups)]


class _Basis:
    """The centred data's eigenbasis that every penalty of one ridge shares (see :func:`_ridge_loo`).
    ``shared``: the :class:`Standardised` whose ``x`` is ``x``, its centring and decomposition taken."""

    def __init__(self, x: np.ndarray, y: np.ndarray, shared: "Standardised | None" = None):
        self.n, d = x.shape
        self.yt = torch.as_tensor(y, dtype=torch.float64)
        self.small = self.n <= d
        if shared is None:
            xt = torch.as_tensor(x, dtype=torch.float64)
            self.x_mean = xt.mean(dim=0)
            xc = xt - self.x_mean
            lam, vecs = _gram_eigh(xc, self.small)  # (r,), (n or d, r)
        else:
            self.x_mean, xc = shared.mean, shared.xc
            lam, vecs = shared.gram_eigh(self.small)
        self.y_mean = self.yt.mean()
        self.yc = self.yt - self.y_mean
        keep = lam > max(float(lam.max()), 1e-300) * 1e-12
        self.lam = lam[keep]
        if self.small:
            self.u, self.xc = vecs[:, keep], xc  # (n, r)
        else:
            self.v = vecs[:, keep]  # (d, r)
            self.u = (xc @ self.v) / torch.sqrt(self.lam)  # (n, r)
        self.uty = self.u.T @ self.yc
        self.u2 = self.u * self.u

    def shrink(self, a: float) -> torch.Tensor:
        return self.lam / (self.lam + a)

    def residuals(self, a: float) -> torch.Tensor:
        """In-sample residuals (n,) of the fit at penalty ``a``."""
        return self.yc - self.u @ (self.shrink(a) * self.uty)

    def held_out_residuals(self, a: float, blocks: list[torch.Tensor]) -> torch.Tensor:
        """Residuals (n,) of each block's rows under the fit at penalty ``a`` that leaves the block out."""
        resid, f, out = self.residuals(a), self.shrink(a), torch.empty(self.n, dtype=torch.float64)
        for rows in blocks:
            ub = self.u[rows]
            held_out = torch.eye(len(rows), dtype=torch.float64) - (ub * f) @ ub.T - 1.0 / self.n
            out[rows] = torch.linalg.solve(held_out, resid[rows])
        return out

    def coef(self, a: float) -> torch.Tensor:
        """The weights (D,) at penalty ``a``."""
        if self.small:
            return self.xc.T @ (self.u @ (self.uty / (self.lam + a)))
        return self.v @ (torch.sqrt(self.lam) * self.uty / (self.lam + a))


def _gram_eigh(xc: torch.Tensor, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of ``xc @ xc.T`` (``rows``) or of ``xc.T @ xc``: eigenvalues ascending."""
    return torch.linalg.eigh(xc @ xc.T if rows else xc.T @ xc)


class Standardised:
    """Requests standardised once, for several heads fitted on exactly them: ``base`` (a prepared
    ``SurvivalEnsemble(seeds=())``: mean, deviation, K and norms), their standardised inputs in
    float64 (``x`` (N, D), its column ``mean`` and centred ``xc``) and the eigendecompositions of
    ``xc``'s Gram matrices (:meth:`gram_eigh`), each made once. The ridge's leave-one-out basis
    (:class:`RidgeHead`, every request finished) and survival-pca's principal directions
    (:func:`fit_pca_survival`) decompose the same matrix, the same numbers as each made it alone; the
    cross-validation fits both on each fold (``training.select``). Safe to share between threads: a
    decomposition two ask for is made by the first, the other waits for it."""

    def __init__(self, inputs: RefineInputs, remaining, events=None):
        self.inputs, self.remaining, self.events = inputs, remaining, events
        self.base = SurvivalEnsemble(seeds=())
        self.base.prepare(inputs, remaining, events)
        self.x = self.base.standardise(inputs).double()
        self.mean = self.x.mean(dim=0)
        self.xc = self.x - self.mean
        self._made: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def gram_eigh(self, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`_gram_eigh` of ``xc``, made on the first call."""
        with self._lock:
            if rows not in self._made:
                self._made[rows] = _gram_eigh(self.xc, rows)
            return self._made[rows]


def _top_directions(standardised: Standardised, k: int) -> torch.Tensor:
    """The top ``k`` principal directions of the centred ``standardised.xc`` (n, D) as columns (D, k),
    from one eigendecomposition of the smaller Gram matrix (:meth:`Standardised.gram_eigh`): the SVD of
    a 1,453 x 4,102 matrix took 4.9 s on one core, this 0.9 s. A direction's sign is arbitrary, as in
    an SVD."""
    xc = standardised.xc
    n, d = xc.shape
    if n >= d:
        return standardised.gram_eigh(False)[1].flip(1)[:, :k].contiguous()
    lam, u = standardised.gram_eigh(True)  # ascending
    lam, u = lam.flip(0)[:k], u.flip(1)[:, :k]
    return ((xc.T @ u) / torch.sqrt(torch.clamp(lam, min=1e-12))).contiguous()  # v = X^T u / s


def fit_pca_survival(make_ensemble, inputs: RefineInputs, remaining, events=None, components: int = 32,
                     progress=None, standardised: Standardised | None = None) -> SurvivalEnsemble:
    """The survival ensemble trained on the top ``components`` principal components of the standardised
    input, folded back into ordinary members on the full input (candidate ``"survival-pca"``).

    With a few hundred training requests and H in the hundreds or thousands, the first layer of the
    reference has far more weights than requests; projecting first is the classic remedy. The
    projection is linear, so it folds into ``fc1``: with ``z = P^T x_std`` standardised again by the
    inner ensemble (mean ``m``, deviation ``s``), ``fc1(z_std) = (W diag(1/s) P^T) x_std + (b - W m/s)``
    — a plain ``HazardMLP`` on the bundle's input, and the graph is unchanged. ``standardised``: these
    requests' :class:`Standardised`, whose standardisation and decomposition to take.
    """
    standardised = standardised or Standardised(inputs, remaining, events)
    base, x, xc = standardised.base, standardised.x, standardised.xc  # (N, D)
    # even: the inner ensemble reads the components as its two hidden states' columns
    k = max(2, min(components, *xc.shape) // 2 * 2)
    proj = _top_directions(standardised, k)  # (D, k)
    z = (x @ proj).float().numpy()  # (N, k)
    zeros = np.zeros(z.shape[0], dtype=np.float32)  # the projection already holds every other input
    projected = RefineInputs(z, zeros, zeros, np.zeros((z.shape[0], 0), np.float32))
    inner = make_ensemble().fit(projected, remaining, events, progress=progress)
    if inner.num_rounds_ != base.num_rounds_:
        raise InputError("internal error: the projected ensemble has another K than the full one")
    mean, std = inner.input_mean_[:k].double(), inner.input_std_[:k].double()
    members = []
    for m in inner.members_:
        w = m.fc1.weight.detach().double()[:, :k]  # (W, k); the two zero columns standardise to 0
        net = HazardMLP.blank(x.shape[1], inner.num_rounds_, inner.width, 0.0)
        with torch.no_grad():
            net.fc1.weight.copy_(((w / std) @ proj.T).float())
            net.fc1.bias.copy_((m.fc1.bias.detach().double() - w @ (mean / std)).float())
            net.fc2.load_state_dict(m.fc2.state_dict())
        members.append(net.eval())
    out = base.with_members(members, seeds=inner.seeds, width=inner.width, history=inner.history_)
    out.dropout = inner.dropout
    out.candidate = "survival-pca"
    out.projection_ = proj  # (D, k), for checks; not written (the folded fc1 holds it)
    out.inner_ = inner
    return out
