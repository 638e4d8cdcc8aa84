"""``te.optimizers.FusedSGD``: SGD with momentum over lists of tensors (upstream's signature).

The step is :func:`.multi_tensor_ops.multi_tensor_sgd` over each device's parameters: the same
update as ``torch.optim.SGD`` (weight decay, momentum with dampening, Nesterov), in float32,
with upstream's one extra option ``wd_after_momentum`` (the decay added to the step after the
momentum instead of to the gradient before it). Momentum buffers are kept in each parameter's
dtype as ``state[param]["momentum_buffer"]``, as torch's.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch.optim.optimizer import required

from ..quantized_tensor import QuantizedTensor
from .multi_tensor_ops import multi_tensor_sgd

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    """SGD with momentum, upstream's signature and ``torch.optim.SGD``'s update.

    Parameters
    ----------
    params : iterable of parameters or of parameter-group dicts
    lr : float
        Required.
    momentum, dampening, weight_decay, nesterov : as ``torch.optim.SGD``
        ``nesterov`` needs a positive ``momentum`` and zero ``dampening`` (``ValueError``).
    wd_after_momentum : bool, default False
        Add the weight decay to the step after the momentum update rather than to the gradient.
    materialize_master_grads : bool, default True
        Upstream's option for apex's mixed-precision master gradients; kept for its signature,
        it changes nothing here (gradients are read in their own dtype and widened to float32).
    set_grad_none : bool, optional
        Deprecated: ``zero_grad(set_to_none=...)`` decides.
    """

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=None):  # fmt: skip
        if lr is not required and not float(lr) >= 0.0:
            raise ValueError(f"FusedSGD: invalid learning rate {lr}; it must be >= 0")
        if not float(momentum) >= 0.0:
            raise ValueError(f"FusedSGD: invalid momentum {momentum}; it must be >= 0")
        if not float(weight_decay) >= 0.0:
            raise ValueError(f"FusedSGD: invalid weight_decay {weight_decay}; it must be >= 0")
        if nesterov and (float(momentum) <= 0.0 or float(dampening) != 0.0):
            raise ValueError(
                f"FusedSGD: Nesterov momentum needs momentum > 0 and dampening 0, got "
                f"momentum={momentum}, dampening={dampening}"
            )
        if set_grad_none is not None:
            warnings.warn(
                "FusedSGD(set_grad_none=...) is deprecated; pass set_to_none to zero_grad()",
                DeprecationWarning,
                stacklevel=2,
            )
        defaults = dict(lr=lr, momentum=float(momentum), dampening=float(dampening),
                        weight_decay=float(weight_decay), nesterov=bool(nesterov))  # fmt: skip
        super().__init__(params, defaults)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: ``None`` when ``set_to_none`` (default: ``set_grad_none`` if
        given, else True), zeros otherwise."""
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = []
        for group in self.param_groups:
            if group["lr"] is required:
                raise ValueError("FusedSGD: a parameter group has no learning rate (lr)")
            work = [p for p in group["params"] if p.grad is not None]
            for p in work:
                if p.grad.is_sparse:
                    raise RuntimeError("FusedSGD does not support sparse gradients")
                if isinstance(p, QuantizedTensor):
                    raise TypeError(
                        f"FusedSGD: a {type(p).__name__} parameter is not supported; keep "
                        "high-precision parameters (or use FusedAdam(master_weights=True))"
                    )
            plans.append((group, work))
        for group, work in plans:
            # One call per device and per first-step-or-not (a buffer starts as the gradient).
            calls = defaultdict(list)
            for p in work:
                first = group["momentum"] != 0.0 and "momentum_buffer" not in self.state[p]
                calls[(p.device, first)].append(p)
            for (_, first), params in calls.items():
                bufs = []
                for p in params:
                    if first:
                        self.state[p]["momentum_buffer"] = torch.empty_like(p)
                    buf = self.state[p].get("momentum_buffer")
                    bufs.append(buf if buf is not None else torch.empty(0, device=p.device))
                multi_tensor_sgd(
                    0, None, [[p.grad for p in params], [p.detach() for p in params], bufs],
                    group["weight_decay"], group["momentum"], group["dampening"], group["lr"],
                    group["nesterov"], first, self.wd_after_momentum, 1.0,
                )  # fmt: skip
        return loss
