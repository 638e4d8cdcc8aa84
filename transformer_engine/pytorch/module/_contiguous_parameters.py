"""Parameters that live side by side in one buffer: the split weights (and biases) of a
``Linear`` / ``LayerNormLinear`` built with ``parameters_split``.

Upstream keeps such a split's parameters as row ranges of one tensor, so that the layer can use
them as one matrix without copying (and an optimizer or FSDP sees them adjacent). Here too: a
module lists its groups in ``_contiguous_parameter_groups`` (names in row order); whenever the
module gives its parameters new storage (``reset_parameters``, a device or dtype move) each
group's parameters become views of one fresh buffer, and :func:`as_one_tensor` hands a group of
at least :data:`VIEW_MIN_BYTES` to a GEMM as one tensor: a view of that buffer, no copy, whose
gradient is split back to the parameters. Smaller groups, and parameters given separate storage
by something else (a parameter assigned by hand, a framework that re-creates them), are
concatenated instead, as before.
"""

from __future__ import annotations

import torch

__all__ = ["as_one_tensor", "group_views", "repack_parameter_groups"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _back_to_back(parts) -> bool:
    """Whether ``parts`` are contiguous, same-dtype row ranges laid out one after the other in
    one storage (so that one view spans them all). Runs every forward: plain attribute reads."""
    first = parts[0]
    if type(first) not in _PLAIN or first.dim() == 0 or not first.is_contiguous():
        return False
    storage, trailing, dtype = first.untyped_storage().data_ptr(), first.shape[1:], first.dtype
    end = first.data_ptr() + first.numel() * first.element_size()
    for part in parts[1:]:
        if (
            type(part) not in _PLAIN
            or part.data_ptr() != end
            or part.dtype != dtype
            or part.shape[1:] != trailing
            or not part.is_contiguous()
            or part.untyped_storage().data_ptr() != storage
        ):
            return False
        end += part.numel() * part.element_size()
    return True


class _RowRangesAsOne(torch.autograd.Function):
    """``whole`` (a view spanning the back-to-back ``parts``) as the differentiable tensor of
    the parts: backward hands each part its rows of the gradient."""

    @staticmethod
    def forward(ctx, whole, *parts):
        ctx.rows = [part.shape[0] for part in parts]
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.split(ctx.rows, dim=0))


# Below this size the GEMM concatenates the parts even when they lie back to back: the copy
# then costs the GPU almost nothing and less host time than the view's autograd node (a Python
# autograd Function, about 20-40 us a forward + backward on a CPU where torch.cat takes 3-5 us),
# which a small, host-bound layer would pay every step. 16 MiB: a BF16 QKV weight of hidden
# size 1672 and up takes the view.
VIEW_MIN_BYTES = 16 << 20


def as_one_tensor(parts) -> torch.Tensor:
    """``torch.cat(parts)`` along dim 0, as a view without a copy when the parts lie back to
    back in one storage and together hold at least :data:`VIEW_MIN_BYTES` (gradients flow to
    each part either way)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    small = sum(part.numel() for part in parts) * first.element_size() < VIEW_MIN_BYTES
    if small or not _back_to_back(parts):
        return torch.cat(parts, dim=0)
    rows = sum(part.shape[0] for part in parts)
    # A view of the first part's storage, so it shares the parameters' version counter: an
    # in-place update between forward and backward is caught as for any saved tensor.
    whole = first.detach().as_strided((rows, *first.shape[1:]), first.stride())
    if not torch.is_grad_enabled() or not any(part.requires_grad for part in parts):
        return whole
    return _RowRangesAsOne.apply(whole, *parts)


def _groups(module):
    """``(names, parameters)`` of each of ``module``'s groups that one buffer can hold: every
    parameter present, at least 1-D, of one dtype and one row shape."""
    for names in getattr(module, "_contiguous_parameter_groups", ()):
        params = [module._parameters.get(name) for name in names]
        if any(p is None or p.dim() == 0 for p in params):
            continue
        first = params[0]
        if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in params):
            continue
        yield names, params


def group_views(module, device: torch.device) -> dict:
    """``{name: view}``: for each of ``module``'s parameter groups, uninitialized views of one
    new buffer on ``device``, one per parameter, shaped and typed as the parameter."""
    views = {}
    for names, params in _groups(module):
        rows = [p.shape[0] for p in params]
        buffer = torch.empty(
            (sum(rows), *params[0].shape[1:]), dtype=params[0].dtype, device=device
        )
        views.update(zip(names, buffer.split(rows, dim=0)))
    return views


def repack_parameter_groups(module) -> None:
    """After a move that gave each parameter of a group its own storage: put the group back
    into one buffer (values copied; the Parameter objects, and so optimizers' references to
    them, stay). Groups of other tensor types, or on the meta device, are left as they are."""
    for _, params in _groups(module):
        if any(type(p) is not torch.nn.Parameter for p in params):
            continue
        if len({p.device for p in params}) != 1 or params[0].device.type == "meta":
            continue
        if _back_to_back(params):
            continue
        with torch.no_grad():
            buffer = torch.cat([p.detach() for p in params], dim=0)
        for param, view in zip(params, buffer.split([p.shape[0] for p in params], dim=0)):
            param.data = view
