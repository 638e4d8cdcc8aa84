"""The activations of ``LayerNormMLP`` and the ``te.ops`` activation operations.

Each activation is one autograd node over the fused kernels of
:mod:`transformer_engine.pytorch.cpp_extensions.activation`: the forward reads its input once
and writes its output once (computing in float32 registers, rounding once to the input's
dtype), and the backward keeps only that input, from which one pass computes the gradient. No
float32 intermediate is materialized or kept for backward.

Gated (GLU) variants take FC1's output of width ``2 * ffn`` and split it in halves: the
*first* half goes through the activation and the second half multiplies it (the opposite of
``torch.nn.functional.glu``, which gates with the second half).

``ACTIVATIONS`` maps each name to ``(fn, is_glu)``; every ``fn`` is ``fn(x, **params)``, and
only ``clamped_swiglu`` takes parameters (``limit``, ``alpha``, ``glu_linear_offset``).
The formulas, with ``u`` the activated input:

* gelu: ``0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))`` (the tanh approximation);
* qgelu: ``u sigmoid(1.702 u)``; relu: ``max(u, 0)`` (derivative 0 at 0); srelu:
  ``relu(u)^2``; silu: ``u sigmoid(u)``; glu: ``sigmoid(u) * v``;
* clamped_swiglu (GPT-OSS): ``a sigmoid(alpha a) (b + glu_linear_offset)`` with
  ``a = min(u, limit)`` and ``b = clamp(v, -limit, limit)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..cpp_extensions.activation import (
    ActivationSpec,
    activation_backward,
    activation_forward,
    activation_spec,
)
from ._once_differentiable import once_differentiable

__all__ = [
    "ACTIVATIONS",
    "ActivationSpec",
    "activation_spec",
    "activation_forward",
    "activation_backward",
    "get_activation",
    "get_activation_spec",
    "apply_activation",
]


class _Activation(torch.autograd.Function):
    """One fused activation: saves its input only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: ActivationSpec):  # noqa: D102
        ctx.save_for_backward(x)
        ctx.spec = spec
        return activation_forward(x, spec)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (x,) = ctx.saved_tensors
        return activation_backward(grad, x, ctx.spec), None


def apply_activation(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``spec``'s activation of ``x`` (same dtype), differentiable in grad mode."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Activation.apply(x, spec)
    return activation_forward(x, spec)


_PARAMETERS = {"clamped_swiglu": ("limit", "alpha", "glu_linear_offset")}
_GATED = ("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")
_NAMES = ("gelu", "qgelu", "relu", "srelu", "silu", *_GATED)


def _make(name: str) -> Callable:
    default = activation_spec(name)

    def fn(x: torch.Tensor, **params) -> torch.Tensor:
        return apply_activation(x, activation_spec(name, **params) if params else default)

    fn.__name__ = name
    return fn


ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    name: (_make(name), name in _GATED) for name in _NAMES
}


def get_activation_spec(owner: str, name: str, params: dict | None) -> ActivationSpec:
    """The kernel description of ``name`` with ``params``; clear errors for unknown names or
    parameters."""
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{owner}: activation={name!r} is not supported; use one of "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    params = dict(params or {})
    allowed = _PARAMETERS.get(name, ())
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"{owner}: activation_params {unknown} are not parameters of {name!r} "
            f"(it takes {list(allowed) or 'none'})"
        )
    for key, value in params.items():
        try:
            float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"{owner}: activation_params[{key!r}]={value!r} must be a number"
            ) from None
    return activation_spec(name, **params)


def get_activation(owner: str, name: str, params: dict | None) -> tuple[Callable, bool]:
    """``(fn, is_glu)`` for ``name``, with ``params`` bound; clear errors for unknown names or
    parameters."""
    spec = get_activation_spec(owner, name, params)
    # A partial, not a closure: the module keeps it, and torch.save of a whole model pickles it.
    bound = functools.partial(apply_activation, spec=spec)
    bound.__name__ = name
    return bound, spec.gated
