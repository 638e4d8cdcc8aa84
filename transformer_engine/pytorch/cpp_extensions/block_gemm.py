"""The block-scaled FP8 GEMM (``Float8BlockScaling``): cuBLASLt's blockwise kernels on Hopper
(through the native library, else ``torch._scaled_mm``), an exact emulation everywhere else.

Operands are read through one method, ``block_float8_gemm_input(columnwise)``, returning
``(values, scale_inv, is_2D_scaled)``: the FP8 matrix of one layout (``[rows, K]`` with the
reduction dimension innermost; row-wise ``[M, K]``, column-wise ``[K_last, leading]``), its
scale-inverses in the GEMM_READY layout (1x128 tiles: ``[ceil(K/128), roundup(rows, 4)]``;
128x128 blocks: ``[ceil(rows/128), roundup(ceil(K/128), 4)]``) and which of the two it is.
The layouts follow :mod:`.gemm` (TN fprop, NN dgrad, NT wgrad; ``X [M, K]`` from B and
``Y [N, K]`` from A, product ``X @ Y^T``): fprop takes x (1x128) by w (128x128), dgrad dy
(1x128) by w's column-wise copy (128x128), wgrad the column-wise copies of dy and x (both 1x128
along the tokens).

Paths:

* **native**: CUDA devices of compute capability 9.x, N a multiple of 16.
  First the native library's ``nvte_block_scaled_gemm``: cuBLASLt (the copy PyTorch loaded,
  12.9 or later) with the scales as they are, 1x128 tiles (``VEC128_32F``) and 128x128 blocks
  (``BLK128x128_32F``), so the weight keeps its 128x128 scales (fprop and dgrad about a third
  faster than the 1x128 by 1x128 kernel on an H200: ``benchmarks/linear/benchmark_block_gemm.py``);
  K not a multiple of 128 or M not a multiple of 4 on zero-padded copies of the FP8 operands.
  Without the native library or a usable cuBLASLt (K a multiple of 128 there):
  ``torch._scaled_mm``'s 1x128 by 1x128 blockwise kernel, with float32 scale tensors whose
  shapes select that mode (first operand ``[rows, ceil(K/128)]`` outer-dim-major, second
  ``[ceil(K/128), rows]``), which needs CUDA 12.9+ in PyTorch's build; a 128x128-block operand
  runs there as the 1x128 operand it equals (the same FP8 bytes, each row taking its block's
  scale: its ``[ceil(rows/128), kb]`` scales repeated 128 times along the rows), so every
  element is scaled exactly as in its block.
  (torch 2.11's own 128x128 mode returned wrong products on the H200 for every scale layout it
  accepts, so it is not used.) The first call of each kind that torch refuses (older torch or
  CUDA) is remembered per device and that kind takes the emulation from then on.
* **emulated**: each operand dequantized to float32 (FP8 values times FP32 scales are exact
  in float32) and multiplied by ``torch.mm`` in float32; bias and ``alpha`` applied in float32
  and the result rounded once. It differs from the native kernel by the accumulation order.
  With power-of-two scales (the recipe's default) every dequantized value is an FP8 value times
  a power of two, a BF16 number, so the CPU GEMM may run in oneDNN's BF16 math mode
  (:func:`.fp8_gemm_cpu.float32_product_of_fp8_values`: one Python thread only) with the same
  exactness, about 4x faster, when :func:`.fp8_gemm_cpu.bf16_math_is_exact` also rules out
  subnormal operands, products and sums (which BF16 math flushes to zero) and overflow.
"""

from __future__ import annotations

import threading

import torch

from ...common.native import native_module
from .. import reference_blocks
from ..device import device_compute_capability
from ._fp8_padding import zero_padded_fp8
from ._routing import launch_args, tensor_arg
from .block_cast import float8_block_scale_shape
from .fp8_gemm_cpu import bf16_math_is_exact, float32_product_of_fp8_values

__all__ = ["is_block_float8_operand", "block_general_gemm", "native_block_gemm_refusals"]

_OP = "general_gemm"
_BLOCK = reference_blocks.BLOCK_SCALING_BLOCK_LEN

# (device index, x 2-D, y 2-D, out dtype, bias fused) kinds torch._scaled_mm refused: emulated
# from then on.
_refused: set = set()
_refused_lock = threading.Lock()


def native_block_gemm_refusals() -> frozenset:
    """The kinds of block GEMM ``torch._scaled_mm`` refused in this process (for tests and
    diagnostics): ``(device index, x is 128x128, y is 128x128, out dtype, bias fused)``."""
    return frozenset(_refused)


def is_block_float8_operand(operand) -> bool:
    """Whether ``operand`` is a block-scaled FP8 operand (has ``block_float8_gemm_input``)."""
    return hasattr(operand, "block_float8_gemm_input")


def _dequantize(values, scale_inv, is_2d) -> torch.Tensor:
    if is_2d:
        return reference_blocks.block_dequantize_2d(values, scale_inv, torch.float32)
    return reference_blocks.block_dequantize_1d(values, scale_inv, torch.float32)


def _scale_exponents(scale_inv: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` binary exponents of the nonzero scale-inverses (zeros pad the GEMM_READY
    layouts), or ``None`` when one is not a normal power of two (or there are none).

    On the magnitude bits (sign cleared): a normal power of two has no mantissa bits, so the
    smallest and largest nonzero magnitudes carry the exponent range, and one mask test finds
    any mantissa; few torch operations, since this runs for both operands of every GEMM."""
    magnitude = scale_inv.view(torch.int32) & 0x7FFFFFFF
    largest = int(magnitude.max()) if magnitude.numel() else 0
    if largest == 0 or bool((magnitude & 0x7FFFFF).any()):
        return None
    smallest = int(torch.where(magnitude == 0, largest, magnitude).min())
    low, high = smallest >> 23, largest >> 23
    if low == 0 or high == 255:  # subnormal (no mantissa bits: zero, excluded) or Inf
        return None
    return low - 127, high - 127


def _bf16_math_is_exact(x, xs, y, ys) -> bool:
    """:func:`.fp8_gemm_cpu.bf16_math_is_exact` for two block-scaled operands: FP8 values
    ``x``, ``y`` ``[rows, K]`` and their scale-inverses (``None``: not all normal powers of
    two)."""
    x_exp, y_exp = _scale_exponents(xs), _scale_exponents(ys)
    if x_exp is None or y_exp is None:
        return False
    return bf16_math_is_exact(x.dtype, x_exp, y.dtype, y_exp, x.shape[1])


def _emulated_product(x, xs, x2d, y, ys, y2d) -> torch.Tensor:
    """``X @ Y^T`` in float32 from the dequantized operands (module docstring)."""
    xd, yd = _dequantize(x, xs, x2d), _dequantize(y, ys, y2d)
    if xd.device.type == "cpu" and _bf16_math_is_exact(x, xs, y, ys):
        return float32_product_of_fp8_values(xd, yd)
    return torch.mm(xd, yd.t())


def _rows_by_kblocks(scales, is_2d, rows, kb) -> torch.Tensor:
    """An operand's scales as ``[rows, kb]``: a 1x128 operand's ``[kb, roundup(rows, 4)]``
    transposed; a 128x128 operand's ``[ceil(rows/128), roundup(kb, 4)]`` with each block row
    repeated for its 128 rows (the 1x128 scaling that multiplies every element alike)."""
    if is_2d:
        return scales[: -(-rows // _BLOCK), :kb].repeat_interleave(_BLOCK, dim=0)[:rows]
    return scales[:kb, :rows].t()


def _scaled_mm_scales(x, xs, x2d, y, ys, y2d):
    """The float32 scale tensors ``torch._scaled_mm`` reads for the 1x128 by 1x128 blockwise
    ``x @ y^T``: ``[M, kb]`` outer-dim-major (M contiguous) and ``[kb, N]`` row-major."""
    m, k = x.shape
    n = y.shape[0]
    kb = k // _BLOCK
    scale_a = _rows_by_kblocks(xs, x2d, m, kb).t().contiguous().t()
    scale_b = _rows_by_kblocks(ys, y2d, n, kb).t().contiguous()
    return scale_a, scale_b


# cuBLASLt's scratch per block GEMM, from the caching allocator (stream-ordered, so safe on any
# stream and inside CUDA-graph capture); 32 MiB is what cuBLASLt's Hopper kernels may ask for.
_WORKSPACE_BYTES = 32 * 1024 * 1024


def _cublaslt_product(x, xs, x2d, y, ys, y2d, mm_dtype, bias):
    """The native library's cuBLASLt block GEMM (``nvte_block_scaled_gemm``), which takes a
    128x128-block operand as it is, or ``None`` when it does not run this problem (no native
    library, no usable cuBLASLt, an operand it does not take, or no cuBLASLt kernel).

    cuBLASLt takes K a multiple of 128 and (13.1, on an H200) M a multiple of 4; other problems
    (a mixture-of-experts GEMM's token count, say) run on zero-padded copies of the operands:
    zero rows and columns leave the product unchanged, and the GEMM_READY scales already cover
    them (their padding entries are zero), so only the FP8 bytes are copied."""
    native = native_module()  # no warning when absent: torch._scaled_mm takes the GEMM then
    if native is None or not _cublaslt_usable(native):
        return None
    m, k = x.shape
    n = y.shape[0]
    if (
        n % 16
        or (x2d and y2d)
        or xs.shape != float8_block_scale_shape(x.shape, 2 if x2d else 1, False)
        or ys.shape != float8_block_scale_shape(y.shape, 2 if y2d else 1, False)
        or not (xs.is_contiguous() and ys.is_contiguous())
    ):
        return None
    rows, depth = -(-m // 4) * 4, -(-k // _BLOCK) * _BLOCK
    x, y = zero_padded_fp8(x, rows, depth), zero_padded_fp8(y, n, depth)
    if (x.data_ptr() | y.data_ptr() | xs.data_ptr() | ys.data_ptr()) % 16:
        return None
    if bias is not None and (not bias.is_contiguous() or bias.data_ptr() % 16):
        bias = bias.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    out = torch.empty((rows, n), dtype=mm_dtype, device=x.device)
    workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=x.device)
    ran = native.block_scaled_gemm(
        tensor_arg(x), tensor_arg(xs), x2d, tensor_arg(y), tensor_arg(ys), y2d, tensor_arg(bias),
        tensor_arg(out), tensor_arg(workspace), *launch_args(x.device),
    )  # fmt: skip
    if not ran:
        return None
    return out if rows == m else out[:m]


_cublaslt_state: list = []  # [usable]: asked once per process


def _cublaslt_usable(native) -> bool:
    """Whether the native library has the block GEMM and found a cuBLASLt 12.9+ for it."""
    if not _cublaslt_state:
        version = getattr(native, "cublaslt_version", None)  # absent from older builds
        _cublaslt_state.append(version is not None and version() > 0)
    return _cublaslt_state[0]


def _native_product(x, xs, x2d, y, ys, y2d, mm_dtype, bias=None):
    """The product on a GPU kernel (``bias``, of ``mm_dtype``, added by its epilogue in float32
    before the one rounding): cuBLASLt's block GEMM through the native library, else
    ``torch._scaled_mm`` blockwise; ``None`` when neither runs this kind here."""
    device = x.device
    if device.type != "cuda" or x.shape[1] == 0 or x.shape[0] == 0 or y.shape[0] == 0:
        return None
    cc = device_compute_capability(device)
    if cc is None or cc[0] != 9:
        return None
    product = _cublaslt_product(x, xs, x2d, y, ys, y2d, mm_dtype, bias)
    if product is not None:
        return product
    key = (device.index, x2d, y2d, mm_dtype, bias is not None)
    # torch._scaled_mm's blockwise mode needs K % 128 == 0 and N % 16 == 0
    if key in _refused or x.shape[1] % _BLOCK or y.shape[0] % 16:
        return None
    scale_a, scale_b = _scaled_mm_scales(x, xs, x2d, y, ys, y2d)
    try:
        return torch._scaled_mm(
            x.contiguous(), y.contiguous().t(), scale_a=scale_a, scale_b=scale_b, bias=bias,
            out_dtype=mm_dtype, use_fast_accum=False,
        )  # fmt: skip
    except (RuntimeError, NotImplementedError, TypeError):
        # This torch build (or its CUDA) has no blockwise FP8 GEMM of this kind.
        with _refused_lock:
            _refused.add(key)
        return None


def _block_product(x_op, y_op, *, out_dtype, bias, alpha, to_fp32):
    """``alpha * X @ Y^T (+ bias)`` from two ``(values, scale_inv, is_2d)`` triples."""
    x, xs, x2d = x_op
    y, ys, y2d = y_op
    # The epilogue adds a 16-bit bias of the output dtype in float32 before rounding, as the
    # unfused float32 product + bias.float() does: no float32 output to write, add and round
    # again. (torch refuses a bias with a float32 output; that product adds it unfused.)
    fused = alpha == 1.0 and not to_fp32
    fused_bias = (
        bias
        if fused and bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
        else None
    )
    fused = fused and (bias is None or fused_bias is not None)
    mm_dtype = out_dtype if fused else torch.float32
    product = _native_product(x, xs, x2d, y, ys, y2d, mm_dtype, fused_bias)
    if product is not None and fused:
        return product
    if product is None and fused_bias is not None:  # no fused bias here: the unfused product
        product = _native_product(x, xs, x2d, y, ys, y2d, torch.float32)
    if product is None:
        product = _emulated_product(x, xs, x2d, y, ys, y2d)
    # The product is this call's own float32 buffer: scaled and biased in place (the same
    # roundings as the out-of-place forms; a fresh multi-MiB tensor costs the CPU page faults).
    if alpha != 1.0:
        product.mul_(alpha)
    if bias is not None:
        product.add_(bias.float())
    return product if to_fp32 else product.to(out_dtype)


def _layout_operand(name: str, operand, columnwise: bool, layout: str):
    got = operand.block_float8_gemm_input(columnwise)
    if got[0] is None:
        which = "columnwise" if columnwise else "rowwise"
        raise ValueError(
            f"{_OP}: layout {layout!r} reads {name} {which}, but {name} holds no {which} "
            f"block-scaled FP8 data (usages {operand.get_usages()}); quantize it with "
            f"{which} usage"
        )
    return got


def _logical(operand) -> torch.Tensor:
    """A plain or block-scaled operand as a float32 tensor of its logical shape."""
    if is_block_float8_operand(operand):
        return operand.dequantize(dtype=torch.float32)
    if hasattr(operand, "dequantize") and not isinstance(operand, torch.Tensor):
        return operand.dequantize(dtype=torch.float32)
    if hasattr(operand, "_dequantize_plain"):
        return operand._dequantize_plain(torch.float32)
    return operand.float()


def _out_shape(layout: str, a_shape, b_shape):
    if layout == "TN":
        return (*b_shape[:-1], a_shape[0])
    if layout == "NN":
        return (*b_shape[:-1], a_shape[1])
    return (b_shape[-1], a_shape[-1])


def block_general_gemm(
    A, B, out_dtype, *, layout, out, bias, accumulate, use_split_accumulator, alpha
):
    """:func:`.gemm.general_gemm` when at least one operand is block-scaled FP8.

    Both block-scaled: the block GEMM of the module docstring. One block-scaled and one plain
    (or per-tensor FP8) operand: both as float32 tensors and a float32 ``torch.mm``. Returns
    ``(out, None, None, None)`` like ``general_gemm``.
    """
    del use_split_accumulator  # block-scaled GEMMs always accumulate in full float32
    if layout not in ("TN", "NN", "NT"):
        raise ValueError(f"{_OP}: layout={layout!r} is not supported; use 'TN', 'NN' or 'NT'")
    if accumulate and out is None:
        raise ValueError(f"{_OP}: accumulate=True adds into out, so out must be given")
    a_shape, b_shape = tuple(A.shape), tuple(B.shape)
    if layout in ("TN", "NN") and len(a_shape) != 2:
        raise ValueError(f"{_OP}: layout {layout!r} needs a 2-D A (the weight), got {a_shape}")
    out_shape = _out_shape(layout, a_shape, b_shape)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.bfloat16
    alpha = float(alpha)
    if is_block_float8_operand(A) and is_block_float8_operand(B):
        x_op = _layout_operand("B", B, layout == "NT", layout)
        y_op = _layout_operand("A", A, layout != "TN", layout)
        if x_op[0].shape[1] != y_op[0].shape[1]:
            raise ValueError(
                f"{_OP}: K mismatch for layout {layout!r}: A shape {a_shape}, B shape {b_shape}"
            )
        if x_op[0].device != y_op[0].device:
            raise ValueError(
                f"{_OP}: A is on {y_op[0].device} but B on {x_op[0].device}; move them to one "
                "device"
            )
        if x_op[2] and y_op[2]:
            raise ValueError(
                f"{_OP}: both operands are 128x128-block-scaled; a block-scaled GEMM takes at "
                "most one (quantize one of them with block_scaling_dim=1)"
            )
        result = _block_product(
            x_op, y_op, out_dtype=out_dtype, bias=bias, alpha=alpha, to_fp32=accumulate
        )
    else:
        a, b = _logical(A), _logical(B)
        if layout == "TN":
            x, y = b.reshape(-1, a.shape[1]), a
        elif layout == "NN":
            x, y = b.reshape(-1, a.shape[0]), a.t()
        else:
            x, y = b.reshape(-1, b.shape[-1]).t(), a.reshape(-1, a.shape[-1]).t()
        result = alpha * (x @ y.t()) if alpha != 1.0 else x @ y.t()
        if bias is not None:
            result = result + bias.float()
        if not accumulate:
            result = result.to(out_dtype)
    result = result.reshape(out_shape)
    if accumulate:
        if out.dtype == torch.float32:
            out.add_(result)
        else:
            out.copy_(out.float() + result)
        return out, None, None, None
    if out is not None:
        out.copy_(result)
        return out, None, None, None
    return result, None, None, None
