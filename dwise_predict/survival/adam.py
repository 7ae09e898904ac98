"""Adam for the survival members: the step ``torch.optim.Adam(fused=True)`` takes, without its import cost.

``torch.optim.Optimizer`` wraps its methods (the constructor's ``add_param_group``, ``zero_grad``,
``step``) in ``torch._disable_dynamo``, which imports ``torch._dynamo`` (and sympy, mpmath: ~800
modules) on the first call: 1.3 s of CPU in every ``train`` process, paid inside the first survival
fit while the cross-validation's other thread waits on the import lock (2,048 x 2,048 benchmark,
docs/training.md "Speed"). :class:`FusedAdam` keeps the optimiser's state as ``Adam`` does (fp32 step
counters, zeroed moments) and calls the same fused kernel with the same arguments, so each step
writes the same bits (tested against ``torch.optim.Adam(fused=True)``).
"""

from __future__ import annotations

import torch


class FusedAdam:
    """Adam (L2 weight decay added to the gradient, no amsgrad) over ``params``, one fused kernel a step."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        self.params = list(params)
        self.lr, self.weight_decay, self.betas, self.eps = float(lr), float(weight_decay), betas, float(eps)
        self.exp_avgs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]

    def zero_grad(self) -> None:
        """Drop the gradients (``zero_grad(set_to_none=True)``)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter from its gradient (all must have one)."""
        torch._foreach_add_(self.steps, 1)
        torch._fused_adam_(self.params, [p.grad for p in self.params], self.exp_avgs, self.exp_avg_sqs, [],
                           self.steps, amsgrad=False, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                           weight_decay=self.weight_decay, eps=self.eps, maximize=False, grad_scale=None,
                           found_inf=None)
