"""Upstream's ``multi_tensor_*`` operations other than Adam's, on PyTorch's foreach kernels.

Each takes ``(chunk_size, noop_flag, tensor_lists, *args)`` as upstream's do (see
:mod:`.multi_tensor_apply`); ``chunk_size`` is unused. Arithmetic is in float32 whatever the
tensors' dtypes, each result rounded once to its destination's dtype. ``noop_flag`` is a
one-element integer tensor: :func:`multi_tensor_scale` sets it to 1 when it meets a non-finite
value (the overflow check of loss scaling), without a host synchronization. The Adam family is
in :mod:`._adam_math`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reference import scale_from_amax

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_compute_scale_and_scale_inv",
    "multi_tensor_sgd",
]


def check_lists(name: str, tensor_lists, counts: Sequence[int]) -> list[list[torch.Tensor]]:
    """``tensor_lists`` as lists, checked: ``len`` in ``counts``, equal lengths."""
    lists = [list(t) for t in tensor_lists]
    if len(lists) not in counts:
        raise ValueError(
            f"{name}: expected {' or '.join(str(c) for c in counts)} tensor lists, got {len(lists)}"
        )
    if len({len(t) for t in lists}) > 1:
        raise ValueError(
            f"{name}: the tensor lists have different lengths {[len(t) for t in lists]}"
        )
    for tensors in lists:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: tensor lists hold tensors, got a {type(t).__name__}")
    return lists


def as_float32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 values of ``tensors`` (the tensors themselves where already float32)."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def flag_nonfinite(noop_flag: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Set ``noop_flag`` to 1 if any of ``tensors`` holds an Inf or a NaN (no host sync)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    # A tensor's max-abs norm is non-finite exactly when one of its values is.
    norms = torch._foreach_norm(tensors, float("inf"))
    device = noop_flag.device
    bad = ~torch.isfinite(torch.stack([n.float().to(device) for n in norms])).all()
    noop_flag.copy_(torch.where(bad, torch.ones_like(noop_flag), noop_flag))


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = in * scale`` for ``tensor_lists = [inputs, outputs]`` (in place when an output is
    its input); ``noop_flag`` set to 1 when an input holds an Inf or a NaN."""
    del chunk_size
    sources, outputs = check_lists("multi_tensor_scale", tensor_lists, (2,))
    flag_nonfinite(noop_flag, sources)
    if all(s is o and s.dtype == torch.float32 for s, o in zip(sources, outputs)):
        torch._foreach_mul_(outputs, float(scale))
        return
    # One rounding: the product is formed in float32 and rounded to the output's dtype (a
    # foreach product of 16-bit tensors may round the scale to their dtype first).
    for out, value in zip(outputs, torch._foreach_mul(as_float32(sources), float(scale))):
        out.copy_(value)


def _norms(name: str, tensor_lists, per_tensor: bool, inv_scale=None):
    (tensors,) = check_lists(name, tensor_lists, (1,))
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float32)
        return torch.zeros(1, dtype=torch.float32), empty
    device = tensors[0].device
    norms = [n.to(device) for n in torch._foreach_norm(tensors, 2, dtype=torch.float32)]
    per = torch.stack(norms)
    if inv_scale is not None:
        per = per * inv_scale.to(device=device, dtype=torch.float32).reshape(())
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, (per if per_tensor else torch.zeros(0, dtype=torch.float32, device=device))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False, *args):
    """The L2 norm of all of ``tensor_lists[0]`` together, as a one-element float32 tensor,
    and each tensor's norm (``per_tensor=True``; an empty tensor otherwise)."""
    del chunk_size, noop_flag, args
    return _norms("multi_tensor_l2norm", tensor_lists, bool(per_tensor))


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False,
                                *args):  # fmt: skip
    """:func:`multi_tensor_l2norm` of the tensors times ``inv_scale`` (a one-element tensor: the
    norm of loss-scaled gradients, unscaled)."""
    del chunk_size, noop_flag, args
    if not isinstance(inv_scale, torch.Tensor):
        inv_scale = torch.tensor(float(inv_scale), dtype=torch.float32)
    return _norms("multi_tensor_unscale_l2norm", tensor_lists, bool(per_tensor), inv_scale)


def multi_tensor_compute_scale_and_scale_inv(
    chunk_size, noop_flag, tensor_lists, max_fp8, force_pow_2_scales=False, epsilon=0.0
):
    """Current scaling's scales from amaxes, in place: ``tensor_lists = [amaxes, scales,
    scale_invs]`` (one-element float32 tensors). ``a = max(amax, epsilon)``; a zero, infinite
    or NaN ``a`` gives scale 1, otherwise ``max_fp8 / a`` (+Inf becomes FLT_MAX), rounded down
    to a power of two with ``force_pow_2_scales``; ``scale_inv = 1 / scale``."""
    del chunk_size, noop_flag
    amaxes, scales, scale_invs = check_lists(
        "multi_tensor_compute_scale_and_scale_inv", tensor_lists, (3,)
    )
    for amax, scale, scale_inv in zip(amaxes, scales, scale_invs):
        value = scale_from_amax(amax, float(max_fp8), float(epsilon), bool(force_pow_2_scales))
        scale.copy_(value.reshape(scale.shape))
        scale_inv.copy_(torch.reciprocal(value).reshape(scale_inv.shape))


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening, lr,
                     nesterov, first_run, wd_after_momentum, scale=1.0):  # fmt: skip
    """One SGD step, in place: ``tensor_lists = [grads, params, momentum_buffers]``, or with a
    fourth list of model copies that receive the updated ``params`` (float32 masters) in their
    own dtype.

    ``g = grad * scale``; weight decay ``g += wd * p`` before the momentum (after it with
    ``wd_after_momentum``); ``buf = g`` on the ``first_run``, else ``momentum * buf + (1 -
    dampening) * g``; the step is ``g + momentum * buf`` with ``nesterov``, else ``buf``
    (``g`` itself when ``momentum`` is 0); ``p -= lr * step``.
    """
    del chunk_size, noop_flag
    lists = check_lists("multi_tensor_sgd", tensor_lists, (3, 4))
    grads, params, bufs = lists[0], lists[1], lists[2]
    copies = lists[3] if len(lists) == 4 else None
    g = torch._foreach_mul(as_float32(grads), float(scale))
    p = as_float32(params)
    wd, mom = float(weight_decay), float(momentum)
    if wd != 0.0 and not wd_after_momentum:
        torch._foreach_add_(g, p, alpha=wd)
    if mom != 0.0:
        b = as_float32(bufs)
        if first_run:
            b = [x.clone() for x in g]
        else:
            torch._foreach_mul_(b, mom)
            torch._foreach_add_(b, g, alpha=1.0 - float(dampening))
        for dst, value in zip(bufs, b):
            if dst is not value:
                dst.copy_(value)
        if nesterov:
            torch._foreach_add_(g, b, alpha=mom)
        else:
            g = b
    if wd != 0.0 and wd_after_momentum:
        g = torch._foreach_add(g, p, alpha=wd)
    torch._foreach_add_(p, g, alpha=-float(lr))
    for dst, value in zip(params, p):
        if dst is not value:
            dst.copy_(value)
    if copies is not None:
        for dst, value in zip(copies, p):
            dst.copy_(value)
