"""Block-scaled FP8 casts: ``Float8BlockScaling`` (1x128 tiles or 128x128 blocks, float32 scales)
and MXFP8 (32-element blocks, E8M0 scales).

Each function validates its tensors, then runs the native kernel for CUDA tensors
(``nvte_block_scaled_quantize`` / ``nvte_mxfp8_quantize``: every requested copy and its scales in
one pass, on ``input.device``, in that device's current stream) or the reference
(:func:`reference_blocks.block_cast_1d`, :func:`reference_blocks.block_cast_2d`, :func:`reference_blocks.mxfp8_cast`)
otherwise; the two agree bit for bit. Outputs are the buffers the quantized tensors store
(layouts in ``tensor/storage/float8_blockwise_tensor_storage.py`` and
``tensor/storage/mxfp8_tensor_storage.py``): FP8 bytes as ``torch.uint8``, scales as float32
(Float8) or ``uint8`` E8M0 bytes (MXFP8), padding entries zero. They are allocated on the input's
device, or written in place into ``out``.

``noop_flag`` (with ``out``): a one-element float32 tensor; when it holds 1.0 nothing is written.
On CUDA it is read by the kernel (no host synchronisation, so the cast can be captured in a CUDA
graph); on the CPU it is read on the host.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import reference_blocks
from ..constants import HIGH_PRECISION_DTYPES, to_torch_fp8_dtype
from ..reference import transpose_last_dim_first
from ..utils import ceil_div
from ..utils import round_up_to_nearest_multiple as round_up
from ._routing import launch_args, native_for, tensor_arg
from ._validation import (
    check_dtype,
    check_fp32_scalar,
    check_output,
    check_tensor,
    check_tensors_on,
)

__all__ = [
    "BlockCastResult",
    "block_matrix_shape",
    "float8_block_scale_shape",
    "mxfp8_scale_shape",
    "float8_block_cast",
    "mxfp8_block_cast",
]

_BLOCK = reference_blocks.BLOCK_SCALING_BLOCK_LEN  # 128
_MX = reference_blocks.MXFP8_BLOCK_LEN  # 32
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class BlockCastResult(NamedTuple):
    """The buffers of a block-scaled cast; a copy that was not requested is ``None``."""

    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None


def block_matrix_shape(shape) -> tuple[int, int]:
    """``(M, K)``: the matrix a tensor of ``shape`` is cast as (``K`` its last extent; a 0-d
    tensor is ``(1, 1)``)."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def float8_block_scale_shape(shape, block_scaling_dim: int, columnwise: bool) -> tuple[int, int]:
    """Shape of one copy's float32 scale-inverses (GEMM_READY) for a tensor of ``shape``."""
    m, k = block_matrix_shape(shape)
    rows, cols = (k, m) if columnwise else (m, k)
    if block_scaling_dim == 2:
        return ceil_div(rows, _BLOCK), round_up(ceil_div(cols, _BLOCK), 4)
    return ceil_div(cols, _BLOCK), round_up(rows, 4)


def mxfp8_scale_shape(shape, columnwise: bool) -> tuple[int, int]:
    """Shape of one copy's (padded, compact) E8M0 scale bytes for a tensor of ``shape``."""
    m, k = block_matrix_shape(shape)
    if columnwise:
        return round_up(ceil_div(m, _MX), 4), round_up(k, 128)
    return round_up(m, 128), round_up(ceil_div(k, _MX), 4)


def _columnwise_shape(shape) -> tuple:
    shape = tuple(shape)
    return (shape[-1], *shape[:-1]) if shape else ()


# ---------------------------------------------------------------------------- validation


def _check_common(op: str, input, fp8_dtype, rowwise: bool, columnwise: bool, noop_flag, out):
    check_tensor(op, "input", input)
    check_dtype(op, "input", input, HIGH_PRECISION_DTYPES)
    fp8 = to_torch_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError(
            f"{op}: rowwise and columnwise are both False, so nothing would be produced; "
            "request at least one copy"
        )
    check_fp32_scalar(op, "noop_flag", noop_flag)
    if noop_flag is not None and out is None:
        raise ValueError(
            f"{op}: noop_flag needs out=: a skipped cast into new buffers would leave them "
            "uninitialised; pass the buffers to keep"
        )
    if out is not None and not isinstance(out, BlockCastResult):
        out = BlockCastResult(*out)
    return fp8, out


def _check_out(op: str, out: BlockCastResult | None, want: BlockCastResult, input, noop_flag):
    """``out``'s buffers against the expected ``(shape, dtypes)`` of each requested copy."""
    if out is None:
        check_tensors_on(op, "input", input, noop_flag=noop_flag)
        return
    buffers = {}
    for name, expected, given in zip(BlockCastResult._fields, want, out):
        if expected is None:
            continue
        if given is None:
            raise ValueError(f"{op}: out.{name} is None but that copy was requested")
        shape, dtypes = expected
        check_output(op, f"out.{name}", given, shape, dtypes)
        buffers[name] = given
    check_tensors_on(op, "input", input, noop_flag=noop_flag, **buffers)


# ---------------------------------------------------------------------------- Float8 blocks


def float8_block_cast(
    input: torch.Tensor,
    fp8_dtype,
    *,
    block_scaling_dim: int,
    rowwise: bool,
    columnwise: bool,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = True,
    out: BlockCastResult | None = None,
    noop_flag: torch.Tensor | None = None,
) -> BlockCastResult:
    """``Float8BlockScaling``'s cast of ``input`` (any shape, viewed as ``[M, K]``).

    Args:
        input: float32, float16 or bfloat16 tensor.
        fp8_dtype: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or the ``DType`` equivalent.
        block_scaling_dim: 1 (1x128 tiles; the column-wise copy is the transposed matrix cast
            with its own tiles along ``M``) or 2 (128x128 blocks shared by both copies).
        rowwise, columnwise: which copies to produce (column-wise bytes have shape
            ``(last, *leading)``).
        epsilon: lower bound of every block's amax (finite, >= 0).
        force_pow_2_scales: round every scale down to a power of 2.
        out: buffers to write in place (the requested copies'; contiguous, exact shapes).
        noop_flag: see the module docstring.
    """
    op = "float8_block_cast"
    fp8, out = _check_common(op, input, fp8_dtype, rowwise, columnwise, noop_flag, out)
    if isinstance(block_scaling_dim, bool) or block_scaling_dim not in (1, 2):
        raise ValueError(
            f"{op}: block_scaling_dim={block_scaling_dim!r} is not supported; pass 1 (1x128 "
            "tiles) or 2 (128x128 blocks)"
        )
    epsilon = float(epsilon)
    if not epsilon >= 0 or math.isinf(epsilon):
        raise ValueError(f"{op}: epsilon={epsilon!r} must be finite and >= 0")
    shape = tuple(input.shape)
    data_dtypes = (torch.uint8, fp8)
    want = BlockCastResult(
        (shape, data_dtypes) if rowwise else None,
        (float8_block_scale_shape(shape, block_scaling_dim, False), (torch.float32,))
        if rowwise
        else None,
        (_columnwise_shape(shape), data_dtypes) if columnwise else None,
        (float8_block_scale_shape(shape, block_scaling_dim, True), (torch.float32,))
        if columnwise
        else None,
    )
    _check_out(op, out, want, input, noop_flag)

    device = input.device
    native = native_for(op, device)
    if native is None:
        result = _float8_reference(input, fp8, block_scaling_dim, rowwise, columnwise, epsilon,
                                   force_pow_2_scales)  # fmt: skip
        return _deliver(result, out, noop_flag)
    input = input.contiguous()
    if out is None:
        out = _allocate(want, device)
    native.block_scaled_quantize(
        tensor_arg(input), _fp8_arg(out.rowwise_data, fp8), tensor_arg(out.rowwise_scale_inv),
        _fp8_arg(out.columnwise_data, fp8), tensor_arg(out.columnwise_scale_inv),
        block_scaling_dim, epsilon, bool(force_pow_2_scales), tensor_arg(noop_flag),
        *launch_args(device),
    )  # fmt: skip
    return out


def _float8_reference(input, fp8, dim, rowwise, columnwise, epsilon, pow2) -> BlockCastResult:
    """The reference's cast, in the stored layouts."""
    shape = tuple(input.shape)
    m, k = block_matrix_shape(shape)
    matrix = input.reshape(m, k)
    options = {
        "epsilon": epsilon,
        "force_pow_2_scales": pow2,
        # A scale too large for float32 becomes the input dtype's largest value.
        "value_for_inf": torch.finfo(input.dtype).max,
    }
    row = col = (None, None)
    if dim == 2:
        data, scale = reference_blocks.block_cast_2d(matrix, fp8, **options)
        if rowwise:
            row = data.view(torch.uint8).reshape(shape), scale
        if columnwise:
            # Symmetric blocks: the transposed bytes and scales are the column-wise cast.
            mb, kb = ceil_div(m, _BLOCK), ceil_div(k, _BLOCK)
            col_scale = torch.zeros(kb, round_up(mb, 4), dtype=torch.float32, device=input.device)
            col_scale[:, :mb] = scale[:mb, :kb].t()
            col_data = transpose_last_dim_first(data.view(torch.uint8)).reshape(
                _columnwise_shape(shape)
            )
            col = col_data, col_scale
        return BlockCastResult(*row, *col)
    if rowwise:
        data, scale = reference_blocks.block_cast_1d(matrix, fp8, **options)
        row = data.view(torch.uint8).reshape(shape), scale
    if columnwise:
        data, scale = reference_blocks.block_cast_1d_of_transpose(matrix, fp8, **options)
        col = data.view(torch.uint8).reshape(_columnwise_shape(shape)), scale
    return BlockCastResult(*row, *col)


# ---------------------------------------------------------------------------- MXFP8


def mxfp8_block_cast(
    input: torch.Tensor,
    fp8_dtype,
    *,
    rowwise: bool,
    columnwise: bool,
    two_d: bool = False,
    out: BlockCastResult | None = None,
    noop_flag: torch.Tensor | None = None,
) -> BlockCastResult:
    """MXFP8's cast of ``input`` (any shape, viewed as ``[M, K]``): 32-element blocks along
    ``K`` (row-wise) and along ``M`` (column-wise), both copies of ``input``'s shape; with
    ``two_d`` 32x32 blocks shared by both copies. Scales are E8M0 bytes (``uint8``).
    ``out`` and ``noop_flag`` as in :func:`float8_block_cast`."""
    op = "mxfp8_block_cast"
    fp8, out = _check_common(op, input, fp8_dtype, rowwise, columnwise, noop_flag, out)
    shape = tuple(input.shape)
    data_dtypes = (torch.uint8, fp8)
    want = BlockCastResult(
        (shape, data_dtypes) if rowwise else None,
        (mxfp8_scale_shape(shape, False), (torch.uint8,)) if rowwise else None,
        (shape, data_dtypes) if columnwise else None,
        (mxfp8_scale_shape(shape, True), (torch.uint8,)) if columnwise else None,
    )
    _check_out(op, out, want, input, noop_flag)

    device = input.device
    native = native_for(op, device)
    if native is None:
        result = _mxfp8_reference(input, fp8, rowwise, columnwise, bool(two_d))
        return _deliver(result, out, noop_flag)
    input = input.contiguous()
    if out is None:
        out = _allocate(want, device)
    native.mxfp8_quantize(
        tensor_arg(input), _fp8_arg(out.rowwise_data, fp8), tensor_arg(out.rowwise_scale_inv),
        _fp8_arg(out.columnwise_data, fp8), tensor_arg(out.columnwise_scale_inv), bool(two_d),
        tensor_arg(noop_flag), *launch_args(device),
    )  # fmt: skip
    return out


def _mxfp8_reference(input, fp8, rowwise, columnwise, two_d) -> BlockCastResult:
    """The reference's cast, in the stored layouts."""
    shape = tuple(input.shape)
    m, k = block_matrix_shape(shape)
    matrix = input.reshape(m, k)
    mb, kb = ceil_div(m, _MX), ceil_div(k, _MX)
    row = col = (None, None)

    def scales(columnwise):
        return torch.zeros(mxfp8_scale_shape(shape, columnwise), dtype=torch.uint8,
                           device=input.device)  # fmt: skip

    if two_d:
        data, e = reference_blocks.mxfp8_cast(matrix, fp8, two_d=True)  # e: [mb, kb]
        data = data.view(torch.uint8).reshape(shape)
        if rowwise:
            s = scales(False)
            s[:m, :kb] = e.repeat_interleave(_MX, dim=0)[:m]
            row = data, s
        if columnwise:
            s = scales(True)
            s[:mb, :k] = e.repeat_interleave(_MX, dim=1)[:, :k]
            col = data.clone(), s
        return BlockCastResult(*row, *col)
    if rowwise:
        data, e = reference_blocks.mxfp8_cast(matrix, fp8)
        s = scales(False)
        s[:m, :kb] = e
        row = data.view(torch.uint8).reshape(shape), s
    if columnwise:
        data, e = reference_blocks.mxfp8_cast(matrix, fp8, columnwise=True)  # e: [mb, k]
        s = scales(True)
        s[:mb, :k] = e
        col = data.view(torch.uint8).reshape(shape), s
    return BlockCastResult(*row, *col)


# ---------------------------------------------------------------------------- shared


def _fp8_arg(t: torch.Tensor | None, fp8: torch.dtype):
    """An FP8 output as the binding takes it (its bytes viewed as the FP8 format)."""
    return None if t is None else tensor_arg(t.view(fp8))


def _allocate(want: BlockCastResult, device: torch.device) -> BlockCastResult:
    """New buffers for the requested copies (data as uint8)."""

    def new(spec):
        if spec is None:
            return None
        shape, dtypes = spec
        return torch.empty(shape, dtype=dtypes[0], device=device)

    return BlockCastResult(*(new(spec) for spec in want))


def _deliver(result: BlockCastResult, out: BlockCastResult | None, noop_flag):
    """The reference's buffers, returned or written into ``out`` (unless ``noop_flag`` is 1.0:
    read on the host for CPU tensors; on a GPU, without the native library, a device-side
    select keeps the old values instead, so there is no synchronisation either)."""
    if out is None:
        return result
    skip = None
    if noop_flag is not None:
        if noop_flag.device.type == "cpu":
            if float(noop_flag.reshape(())) == 1.0:
                return out
        else:
            skip = noop_flag.reshape(()) == 1.0
    for new, dst in zip(result, out):
        if new is None:
            continue
        target = dst.view(torch.uint8) if dst.dtype in _FP8_DTYPES else dst  # bytes for FP8
        new = new.view(target.dtype)
        target.copy_(new if skip is None else torch.where(skip, target, new))
    return out
