"""The MLP activations as kernels: forward and backward in one pass each, optionally writing
FP8 (with the transposed copy and, in backward, the bias gradient) in the same pass.

:func:`activation_forward` and :func:`activation_backward` run ``nvte_activation`` /
``nvte_dactivation`` for CUDA tensors (on the tensor's device, in that device's current stream)
and fused PyTorch operations elsewhere. The formulas (``activation.h`` and
:mod:`transformer_engine.pytorch.functional.activation`
states them) are evaluated in float32 and rounded once.

A gated activation's input holds two halves; the *first* goes through the activation and the
second multiplies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import reference
from ..constants import HIGH_PRECISION_DTYPES
from ._routing import launch_args, native_for, tensor_arg
from .cast import (
    QuantizeResult,
    column_sum,
    dbias_workspace_elements,
    quantize_prevalidated,
    transposed_shape,
)

__all__ = [
    "ActivationSpec",
    "activation_spec",
    "activation_forward",
    "activation_backward",
    "activation_forward_fp8",
    "activation_backward_fp8",
    "activation_amax",
    "activation_backward_amax",
]

# name -> (native kind, gated); the kinds are activation.h's NVTEActivationKind.
_KINDS = {
    "gelu": (0, False),
    "geglu": (0, True),
    "qgelu": (1, False),
    "qgeglu": (1, True),
    "relu": (2, False),
    "reglu": (2, True),
    "srelu": (3, False),
    "sreglu": (3, True),
    "silu": (4, False),
    "swiglu": (4, True),
    "glu": (5, True),
    "clamped_swiglu": (6, True),
}
_QGELU_SLOPE = 1.702


@dataclass(frozen=True)
class ActivationSpec:
    """One activation: its name, native kind, gating and clamped-SwiGLU parameters."""

    name: str
    kind: int
    gated: bool
    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0

    def native_args(self) -> tuple:
        return (self.kind, self.gated, self.limit, self.alpha, self.glu_linear_offset)


def activation_spec(name: str, **params) -> ActivationSpec:
    """The :class:`ActivationSpec` of ``name`` (``params``: clamped SwiGLU's ``limit``,
    ``alpha``, ``glu_linear_offset``; checked by the caller)."""
    if name not in _KINDS:
        raise ValueError(
            f"activation {name!r} is not supported; use one of {', '.join(sorted(_KINDS))}"
        )
    kind, gated = _KINDS[name]
    spec = ActivationSpec(name, kind, gated, **{k: float(v) for k, v in params.items()})
    if not spec.limit >= 0:
        raise ValueError(f"{name}: limit={spec.limit!r} must be >= 0 (the clamp bound)")
    return spec


def _out_cols(spec: ActivationSpec, x: torch.Tensor) -> int:
    cols = x.shape[-1]
    if spec.gated and cols % 2:
        raise ValueError(
            f"{spec.name}: a gated activation needs an even last dimension (two halves), got {cols}"
        )
    return cols // 2 if spec.gated else cols


def _check_input(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES and x.dtype != torch.float64:
        raise TypeError(
            f"{op}: input has dtype {x.dtype}; expected float32, float16, bfloat16 or float64"
        )
    if x.dim() == 0:
        raise ValueError(f"{op}: input must have at least one dimension (the features)")


def _native(op: str, x: torch.Tensor):
    """The binding for ``x``'s device, or ``None`` for the PyTorch path (CPU, float64)."""
    if x.dtype == torch.float64:  # the kernels take float32/16 and bfloat16
        return None
    return native_for(op, x.device)


# --- The CPU path: fused PyTorch operations on float32 values --------------------------------
# The float32 values are computed in buffers the path allocated itself, in place where an
# operation allows it, and a 16-bit operand enters a float32 product as it is (the product
# promotes it exactly): on the CPU a fresh large tensor costs its page faults, so every buffer
# saved counts as much as the arithmetic. The operations and their order are those of the
# formulas in the module docstring, so the values are the same as computing each step into a
# new float32 tensor.


def _act_(name: str, u: torch.Tensor) -> torch.Tensor:
    """``act(u)`` written over ``u`` (a float32 or float64 buffer of the caller's)."""
    if name in ("gelu", "geglu"):
        return torch.ops.aten.gelu_(u, approximate="tanh")
    if name in ("qgelu", "qgeglu"):
        return u.mul_(torch.sigmoid(_QGELU_SLOPE * u))
    if name in ("relu", "reglu"):
        return u.relu_()
    if name in ("srelu", "sreglu"):
        return u.relu_().square_()
    if name in ("silu", "swiglu"):
        return F.silu(u, inplace=True)
    return u.sigmoid_()  # glu


def _dact(name: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``g * act'(u)``."""
    if name in ("gelu", "geglu"):
        return torch.ops.aten.gelu_backward(g, u, approximate="tanh")
    if name in ("silu", "swiglu"):
        return torch.ops.aten.silu_backward(g, u)
    if name in ("relu", "reglu"):
        return torch.where(u > 0, g, torch.zeros_like(g))
    if name in ("srelu", "sreglu"):
        return g * 2 * torch.relu(u)
    if name in ("qgelu", "qgeglu"):
        s = torch.sigmoid(_QGELU_SLOPE * u)
        return g * (s + _QGELU_SLOPE * u * s * (1 - s))
    s = torch.sigmoid(u)  # glu
    return g * s * (1 - s)


def _dact_into(name: str, g: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`_dact` written into ``out`` (a view of the caller's result, any strides). Into
    an ``out`` of the values' own dtype GELU's and SiLU's derivatives come straight from their
    kernels (no temporary); a 16-bit ``out`` takes the values through a copy, which rounds each
    once (a kernel writing another dtype than it computes in runs its slow casting loop)."""
    if out.dtype == u.dtype:
        if name in ("gelu", "geglu"):
            return torch.ops.aten.gelu_backward.grad_input(g, u, approximate="tanh", grad_input=out)
        if name in ("silu", "swiglu"):
            return torch.ops.aten.silu_backward.grad_input(g, u, grad_input=out)
    return out.copy_(_dact(name, g, u))


def _values_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the CPU path computes ``x``'s activation in."""
    return torch.promote_types(x.dtype, torch.float32)


def _forward_cpu(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """Float32 values of the activation (float64 stays float64)."""
    dtype = _values_dtype(x)
    if not spec.gated:
        return _act_(spec.name, x.to(dtype, copy=True))
    a, b = x.chunk(2, dim=-1)
    if spec.name == "clamped_swiglu":
        a = torch.clamp_max(a.to(dtype), spec.limit)
        b = torch.clamp(b.to(dtype), -spec.limit, spec.limit)
        return a * torch.sigmoid(spec.alpha * a) * (b + spec.glu_linear_offset)
    return _act_(spec.name, a.to(dtype, copy=True)).mul_(b)


def _backward_cpu(grad: torch.Tensor, x: torch.Tensor, spec: ActivationSpec, out=None):
    """The input's gradient: its float32 values (float64 for float64), or written (rounded once,
    for a 16-bit ``out``) into ``out``."""
    dtype = _values_dtype(x)
    g = grad.to(dtype)
    if not spec.gated:
        if out is None:
            return _dact(spec.name, g, x.to(dtype))
        return _dact_into(spec.name, g, x.to(dtype), out)
    a, b = x.chunk(2, dim=-1)
    if spec.name == "clamped_swiglu":
        limit = spec.limit
        a, b = a.to(dtype), b.to(dtype)
        ac = torch.clamp_max(a, limit)
        bc = torch.clamp(b, -limit, limit)
        s = torch.sigmoid(spec.alpha * ac)
        da = g * (bc + spec.glu_linear_offset) * (s + spec.alpha * ac * s * (1 - s))
        da = torch.where(a <= limit, da, torch.zeros_like(da))
        db = torch.where((b >= -limit) & (b <= limit), g * ac * s, torch.zeros_like(g))
        dx = torch.cat((da, db), dim=-1)
        return dx if out is None else out.copy_(dx)
    # Each half written straight into its place in the result (no temporary and copy).
    n = a.shape[-1]
    dx = torch.empty(x.shape, dtype=dtype, device=x.device) if out is None else out
    a = a.to(dtype, copy=True)
    _dact_into(spec.name, g * b, a, dx[..., :n])
    if dx.dtype == dtype:
        torch.mul(_act_(spec.name, a), g, out=dx[..., n:])
    else:
        dx[..., n:] = _act_(spec.name, a).mul_(g)
    return dx


# Rows of one block of the CPU entry points: about 256K input elements, so that each float32
# intermediate is at most 1 MiB. A fresh tensor of several MiB costs the CPU a page fault per
# 4 KiB page (the allocator hands such sizes back to the system when they are freed), which
# took longer than the arithmetic (swiglu's backward on 1024 x 2048 bf16: 5.0 ms whole, 1.5 ms
# in blocks of 128 rows); small blocks are reused from the heap and stay in cache from one
# operation to the next. The operations are elementwise, so blocks give the same values.
_CPU_BLOCK_ELEMENTS = 1 << 18


def _cpu_row_step(width: int) -> int:
    return max(1, _CPU_BLOCK_ELEMENTS // max(width, 1))


def _cpu_forward(x: torch.Tensor, spec: ActivationSpec, cols: int, out_dtype) -> torch.Tensor:
    """The activation's float32 values (float64 for float64 input), rounded once to
    ``out_dtype``, computed in blocks of rows."""
    out = torch.empty(*x.shape[:-1], cols, dtype=out_dtype, device=x.device)
    rows = x.shape[:-1].numel()
    rows_in, rows_out = x.reshape(rows, x.shape[-1]), out.view(rows, cols)
    step = _cpu_row_step(x.shape[-1])
    for r in range(0, rows, step):
        rows_out[r : r + step] = _forward_cpu(rows_in[r : r + step], spec)
    return out


def _cpu_backward(grad, x: torch.Tensor, spec: ActivationSpec, cols: int, out_dtype):
    """The input gradient's float32 values (float64 for float64 input), rounded once to
    ``out_dtype``, computed in blocks of rows."""
    dx = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.shape[:-1].numel()
    rows_in, rows_grad = x.reshape(rows, x.shape[-1]), grad.reshape(rows, cols)
    rows_out = dx.view(rows, x.shape[-1])
    step = _cpu_row_step(x.shape[-1])
    for r in range(0, rows, step):
        sl = slice(r, r + step)
        _backward_cpu(rows_grad[sl], rows_in[sl], spec, out=rows_out[sl])
    return dx


# --- Entry points ------------------------------------------------------------------------------


def activation_forward(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``act(x)`` in ``x``'s dtype, shape ``(..., cols)``."""
    op = "activation_forward"
    _check_input(op, x)
    cols = _out_cols(spec, x)
    native = _native(op, x)
    if native is None:
        return _cpu_forward(x, spec, cols, x.dtype)
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], cols, dtype=x.dtype, device=x.device)
    native.activation(
        tensor_arg(x), *spec.native_args(), tensor_arg(out), None, None, None, None,
        *launch_args(x.device),
    )  # fmt: skip
    return out


def activation_backward(grad: torch.Tensor, x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``d loss / d x`` from the output gradient ``grad``, in ``x``'s dtype and shape."""
    op = "activation_backward"
    _check_input(op, x)
    cols = _out_cols(spec, x)
    if grad.shape != (*x.shape[:-1], cols):
        raise ValueError(
            f"{op}: grad has shape {tuple(grad.shape)}; the activation's output has shape "
            f"{(*x.shape[:-1], cols)}"
        )
    grad = grad if grad.dtype == x.dtype else grad.to(x.dtype)
    native = _native(op, x)
    if native is None:
        return _cpu_backward(grad, x, spec, cols, x.dtype)
    x, grad = x.contiguous(), grad.contiguous()
    dx = torch.empty_like(x)
    native.dactivation(
        tensor_arg(grad), tensor_arg(x), *spec.native_args(), tensor_arg(dx), None, None, None,
        None, None, None, *launch_args(x.device),
    )  # fmt: skip
    return dx


def activation_forward_fp8(
    x: torch.Tensor,
    spec: ActivationSpec,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax: torch.Tensor | None,
    with_transpose: bool,
    values: torch.Tensor | None = None,
) -> QuantizeResult:
    """``act(x)`` cast to FP8 with ``scale`` (amax of the float32 values max-accumulated into
    ``amax``), with the transposed copy when asked: on CUDA in the activation's own pass.

    The caller (a delayed-scaling quantizer) has checked ``scale``/``amax`` (float32 scalars)
    and ``fp8_dtype`` (a torch FP8 dtype). ``values``: what :func:`activation_amax` returned
    for this ``x`` on the CPU (its float32 values, given up to this cast), so they are not
    computed twice.
    """
    op = "activation_forward_fp8"
    _check_input(op, x)
    cols = _out_cols(spec, x)
    native = _native(op, x)
    if native is None:
        # whole: one buffer, computed in place, and scaled in place
        y = values if values is not None else _forward_cpu(x, spec)
        y = y if y.dtype == torch.float32 else y.float()
        return quantize_prevalidated(
            y, scale, fp8_dtype, amax=amax, with_transpose=with_transpose, consume_input=True
        )
    x = x.contiguous()
    shape = (*x.shape[:-1], cols)
    out = torch.empty(shape, dtype=fp8_dtype, device=x.device)
    out_t = (
        torch.empty(transposed_shape(shape), dtype=fp8_dtype, device=x.device)
        if with_transpose
        else None
    )
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    native.activation(
        tensor_arg(x), *spec.native_args(), tensor_arg(out), tensor_arg(scale),
        tensor_arg(out_t), tensor_arg(amax), tensor_arg(scale_inv), *launch_args(x.device),
    )  # fmt: skip
    return QuantizeResult(out, out_t, scale_inv)


def activation_backward_fp8(
    grad: torch.Tensor,
    x: torch.Tensor,
    spec: ActivationSpec,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax: torch.Tensor | None,
    with_dbias: bool,
    values: torch.Tensor | None = None,
) -> tuple[QuantizeResult, torch.Tensor | None]:
    """``d loss / d x`` cast to FP8 with ``scale``, with its transposed copy and (``with_dbias``)
    its sum over the rows (the bias gradient of the layer that produced ``x``), in ``grad``'s
    dtype. Same caller contract as :func:`activation_forward_fp8` (``values``: what
    :func:`activation_backward_amax` returned on the CPU)."""
    op = "activation_backward_fp8"
    _check_input(op, x)
    cols = _out_cols(spec, x)
    if grad.shape != (*x.shape[:-1], cols) or grad.dtype != x.dtype:
        raise ValueError(
            f"{op}: grad has shape {tuple(grad.shape)} and dtype {grad.dtype}; expected "
            f"{(*x.shape[:-1], cols)} and {x.dtype}"
        )
    native = _native(op, x)
    if native is None:
        dx = values if values is not None else _cpu_backward(grad, x, spec, cols, _values_dtype(x))
        dx = dx if dx.dtype == torch.float32 else dx.float()
        dbias = column_sum(dx).to(grad.dtype) if with_dbias else None  # before dx is scaled
        res = quantize_prevalidated(
            dx, scale, fp8_dtype, amax=amax, with_transpose=True, consume_input=True
        )
        return res, dbias
    x, grad = x.contiguous(), grad.contiguous()
    device = x.device
    out = torch.empty(x.shape, dtype=fp8_dtype, device=device)
    out_t = torch.empty(transposed_shape(x.shape), dtype=fp8_dtype, device=device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    dbias = workspace = None
    if with_dbias:
        elements = dbias_workspace_elements(x) if x.shape[-1] else 0
        dbias = torch.empty(x.shape[-1], dtype=grad.dtype, device=device)
        workspace = torch.empty(max(elements, 1), dtype=torch.float32, device=device)
    native.dactivation(
        tensor_arg(grad), tensor_arg(x), *spec.native_args(), tensor_arg(out),
        tensor_arg(scale), tensor_arg(out_t), tensor_arg(amax), tensor_arg(scale_inv),
        tensor_arg(dbias), tensor_arg(workspace), *launch_args(device),
    )  # fmt: skip
    return QuantizeResult(out, out_t, scale_inv), dbias


def activation_amax(
    x: torch.Tensor, spec: ActivationSpec, amax: torch.Tensor
) -> torch.Tensor | None:
    """Overwrite the one-element float32 ``amax`` (on ``x``'s device) with ``max |act(x)|`` of
    the float32 values :func:`activation_forward_fp8` casts; nothing else is written. Returns
    those values on the CPU (computed anyway; ``activation_forward_fp8(values=...)`` casts them
    instead of computing them again), ``None`` on CUDA (its amax pass keeps nothing)."""
    op = "activation_amax"
    _check_input(op, x)
    _out_cols(spec, x)
    native = _native(op, x)
    if native is None:
        values = _forward_cpu(x, spec).float()
        amax.copy_(reference.amax(values).reshape(1))
        return values
    native.activation_amax(
        tensor_arg(x.contiguous()), *spec.native_args(), tensor_arg(amax), *launch_args(x.device)
    )


def activation_backward_amax(
    grad: torch.Tensor, x: torch.Tensor, spec: ActivationSpec, amax: torch.Tensor
) -> torch.Tensor | None:
    """The same for :func:`activation_backward_fp8`'s values: ``max |d loss / d x|`` (and, on
    the CPU, the float32 values for ``activation_backward_fp8(values=...)``)."""
    op = "activation_backward_amax"
    _check_input(op, x)
    cols = _out_cols(spec, x)
    native = _native(op, x)
    if native is None:
        values = _cpu_backward(grad, x, spec, cols, _values_dtype(x)).float()
        amax.copy_(reference.amax(values).reshape(1))
        return values
    native.dactivation_amax(
        tensor_arg(grad.contiguous()), tensor_arg(x.contiguous()), *spec.native_args(),
        tensor_arg(amax), *launch_args(x.device),
    )  # fmt: skip
