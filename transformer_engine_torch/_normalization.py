"""Upstream's norm entry points: ``layernorm_fwd``, ``layernorm_bwd``, ``rmsnorm_fwd``,
``rmsnorm_bwd``, ``rmsnorm_bwd_add``, positional arguments in upstream's order.

They run :mod:`transformer_engine.pytorch.cpp_extensions.normalization` (the float32 formulas,
on every device; a ``quantizer`` gives the forward's output quantized from the float32 values,
as upstream's fused norm-and-cast kernels do). Like upstream's C++ entry points, and unlike
``te.cpp_extensions``'s, they record nothing on the autograd tape: the outputs never carry a
``grad_fn``, whatever the inputs' ``requires_grad``.
"""

from __future__ import annotations

import torch

from transformer_engine.pytorch.cpp_extensions import normalization

__all__ = ["layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "rmsnorm_bwd_add"]


def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin,
                  zero_centered_gamma):  # fmt: skip
    """``[out, mu, rsigma]``: ``out`` of the input's shape (quantized with ``quantizer`` when
    given, else of type ``otype``, a ``DType``; into ``ln_out`` when given), ``mu`` and
    ``rsigma`` float32 ``[M]`` for :func:`layernorm_bwd`. ``bias`` may be None."""
    with torch.no_grad():
        return normalization.layernorm_fwd(
            input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma
        )


def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """``[out, None, rsigma]``, as :func:`layernorm_fwd` without mean or bias."""
    with torch.no_grad():
        return normalization.rmsnorm_fwd(
            input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma
        )


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """``[dx, dgamma, dbeta]`` from the forward's ``mu`` and ``rsigma``; ``dx`` of ``x``'s
    dtype, ``dgamma``/``dbeta`` of ``gamma``'s (the gradient of the stored weight)."""
    with torch.no_grad():
        return normalization.layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma)


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    """``[dx, dgamma]`` from the forward's ``rsigma``, as :func:`layernorm_bwd`."""
    with torch.no_grad():
        return normalization.rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)


def rmsnorm_bwd_add(dz, x, add, rsigma, gamma, sm_margin, zero_centered_gamma):
    """``[dx + add, dgamma]``: :func:`rmsnorm_bwd` with ``add`` (of ``x``'s shape) added to
    ``dx`` in float32 before its rounding."""
    with torch.no_grad():
        return normalization.rmsnorm_bwd_add(
            dz, x, add, rsigma, gamma, sm_margin, zero_centered_gamma
        )
