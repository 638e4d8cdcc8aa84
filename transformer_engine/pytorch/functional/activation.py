"""The activations of ``LayerNormMLP`` and the ``te.ops`` activation operations, as plain PyTorch
ops (autograd differentiates them).

Each function computes in float32 (float64 stays float64) and returns its input's dtype, like
the fused kernels upstream, which keep the math in float32 between an FP8/BF16 load and store.

Gated (GLU) variants take FC1's output of width ``2 * ffn`` and split it in halves: the
*first* half goes through the activation and the second half multiplies it (the opposite of
``torch.nn.functional.glu``, which gates with the second half).

``ACTIVATIONS`` maps each name to ``(fn, is_glu)``; every ``fn`` is ``fn(x, **params)``, and
only ``clamped_swiglu`` takes parameters (``limit``, ``alpha``, ``glu_linear_offset``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["ACTIVATIONS", "get_activation"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation, as upstream's kernels use.
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)  # derivative 0 at 0 (clamp_min would pass the gradient there)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(torch.relu(x))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _pointwise(act: Callable) -> Callable:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return act(_compute(x)).to(x.dtype)

    fn.__name__ = act.__name__.lstrip("_")
    return fn


def _halves(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(
            f"{name}: a gated activation needs an even last dimension (two halves), got "
            f"{x.shape[-1]}"
        )
    a, b = _compute(x).chunk(2, dim=-1)
    return a, b


def _gated(act: Callable) -> Callable:
    name = act.__name__.lstrip("_")

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x, name)
        return (act(a) * b).to(x.dtype)

    fn.__name__ = f"{name}_glu"
    return fn


def clamped_swiglu(
    x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0
) -> torch.Tensor:
    """SwiGLU with clamped halves (GPT-OSS): ``a * sigmoid(alpha a) * (b + offset)`` with
    ``a = min(x1, limit)`` and ``b = clamp(x2, -limit, limit)``."""
    a, b = _halves(x, "clamped_swiglu")
    a = torch.clamp_max(a, limit)
    b = torch.clamp(b, -limit, limit)
    return (a * torch.sigmoid(alpha * a) * (b + glu_linear_offset)).to(x.dtype)


ACTIVATIONS: dict[str, tuple[Callable, bool]] = {
    "gelu": (_pointwise(_gelu), False),
    "geglu": (_gated(_gelu), True),
    "glu": (_gated(torch.sigmoid), True),
    "qgelu": (_pointwise(_qgelu), False),
    "qgeglu": (_gated(_qgelu), True),
    "relu": (_pointwise(_relu), False),
    "reglu": (_gated(_relu), True),
    "srelu": (_pointwise(_srelu), False),
    "sreglu": (_gated(_srelu), True),
    "silu": (_pointwise(_silu), False),
    "swiglu": (_gated(_silu), True),
    "clamped_swiglu": (clamped_swiglu, True),
}

_PARAMETERS = {"clamped_swiglu": ("limit", "alpha", "glu_linear_offset")}


def get_activation(owner: str, name: str, params: dict | None) -> tuple[Callable, bool]:
    """``(fn, is_glu)`` for ``name``, with ``params`` bound; clear errors for unknown names or
    parameters."""
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{owner}: activation={name!r} is not supported; use one of "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    fn, is_glu = ACTIVATIONS[name]
    params = dict(params or {})
    allowed = _PARAMETERS.get(name, ())
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"{owner}: activation_params {unknown} are not parameters of {name!r} "
            f"(it takes {list(allowed) or 'none'})"
        )
    if not params:
        return fn, is_glu

    def bound(x: torch.Tensor) -> torch.Tensor:
        return fn(x, **params)

    return bound, is_glu
