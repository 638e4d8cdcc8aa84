"""General matrix multiply: FP8 x FP8 on ``torch._scaled_mm``, everything else on ``torch.mm``.

Layout names follow cuBLAS (column-major) as upstream Transformer Engine does: the first letter
is for ``A``, the second for ``B``. In row-major terms, with ``K`` always the reduction
dimension and the output of shape ``[M, N]`` (leading dimensions restored where noted):

========  ==========================  ============================  ==========================
layout    A                           B                             out
========  ==========================  ============================  ==========================
``"TN"``  ``[N, K]`` (weight)         ``[..., K]`` (input)          ``B @ A^T``: ``[..., N]``
``"NN"``  ``[K, N]`` (weight)         ``[..., K]`` (grad output)    ``B @ A``: ``[..., N]``
``"NT"``  ``[..., N]``, K = leading   ``[..., M]``, K = leading     ``B^T @ A``: ``[M, N]``
========  ==========================  ============================  ==========================

TN is fprop (``y = x W^T``), NN is dgrad (``dx = dy W``), NT is wgrad (``dW = dy^T x``).

FP8 operands are read through one method, ``float8_gemm_input(columnwise)``, which returns
plain torch tensors: the FP8 values of one layout and ``scale_inv`` (the interface is described
in :mod:`transformer_engine.pytorch.cpp_extensions.float8_gemm_operand`; ``Float8Tensor``,
``Float8TensorStorage`` and :class:`Float8GemmOperand` implement it). Hopper and Ada FP8 GEMMs
take only the "TN" form ``X @ Y^T`` with both ``X [M, K]`` and ``Y [N, K]`` row-major, so each
layout reads the operand layout that already has K innermost:

========  ==========================  ==========================
layout    X (from B)                  Y (from A)
========  ==========================  ==========================
``"TN"``  B rowwise (``data``)        A rowwise (``data``)
``"NN"``  B rowwise (``data``)        A columnwise (``transpose``)
``"NT"``  B columnwise (``transpose``)  A columnwise (``transpose``)
========  ==========================  ==========================

On devices whose FP8 GEMMs take non-TN layouts (data-center Blackwell) no transposed copy is
kept and the row-wise values serve columnwise usage: they are transposed here, which is exact
because the scale is per tensor.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..constants import HIGH_PRECISION_DTYPES
from ..device import check_same_device, reject_meta
from . import fp8_gemm_cpu, hp_gemm_cpu
from ._autocast_off import autocast_off
from ._fp8_padding import zero_padded_fp8
from ._validation import check_dtype, check_output, check_tensor
from .block_gemm import block_general_gemm, is_block_float8_operand
from .float8_gemm_operand import CheckedFloat8Operand, Float8GemmOperand, is_float8_operand
from .gemm_epilogues import gemm_with_epilogues, refuse_unbuilt_epilogues
from .mxfp8_gemm import is_mxfp8_operand, mxfp8_general_gemm
from .nvfp4_gemm import is_nvfp4_operand, nvfp4_general_gemm

__all__ = ["general_gemm", "fp8_gemm_prevalidated", "FP8_GEMM_DIM_MULTIPLE", "Float8GemmOperand"]

_OP = "general_gemm"
_LAYOUTS = ("TN", "NN", "NT")

# cuBLASLt FP8 GEMMs need the leading dimensions of their operands and output to be multiples
# of 16 (16-byte alignment of FP8 rows). With X [M, K], Y [N, K] and out [M, N] row-major the
# leading dimensions are K (X and Y) and N (out); M is never a leading dimension and may be
# anything. torch._scaled_mm on CUDA enforces exactly K % 16 and N % 16. K is made to fit by
# zero-padding both operands (see _fp8_gemm), so any K works; N is the output's row length and
# cannot be padded without a copy of the output, so it must be a multiple of 16. torch's CPU
# kernel enforces nothing, and the N rule is applied there too so a shape that works on CPU
# works on a GPU.
FP8_GEMM_DIM_MULTIPLE = 16


def _dims(layout: str, a_shape: tuple, b_shape: tuple) -> tuple[int, int, int, tuple]:
    """``(M, N, K, out_shape)`` of the GEMM, after checking that the operands agree on K."""
    if layout in ("TN", "NN"):
        if len(a_shape) != 2:
            raise ValueError(
                f"{_OP}: layout {layout!r} needs a 2-D A (the weight), got shape {a_shape}"
            )
        n, k_a = a_shape if layout == "TN" else (a_shape[1], a_shape[0])
        k_b = b_shape[-1]
        m = math.prod(b_shape[:-1])
        out_shape = (*b_shape[:-1], n)
        a_k_desc = f"A.shape[{1 if layout == 'TN' else 0}]"
        b_k_desc = "B.shape[-1]"
    else:
        n, k_a = a_shape[-1], math.prod(a_shape[:-1])
        m, k_b = b_shape[-1], math.prod(b_shape[:-1])
        out_shape = (m, n)
        a_k_desc = "the product of A's leading dims"
        b_k_desc = "the product of B's leading dims"
    if k_a != k_b:
        raise ValueError(
            f"{_OP}: K mismatch for layout {layout!r}: {a_k_desc} = {k_a} (A shape {a_shape}) "
            f"but {b_k_desc} = {k_b} (B shape {b_shape}); the reduction dimensions must match"
        )
    return m, n, k_a, out_shape


def _check_fp8_dims(layout: str, n: int) -> None:
    """N (the output's last dimension) must be a multiple of 16; K may be anything (the
    operands are zero-padded along K for ``torch._scaled_mm``, see :func:`_fp8_gemm`)."""
    if n % FP8_GEMM_DIM_MULTIPLE:
        raise ValueError(
            f"{_OP}: FP8 GEMM needs N (the output's last dimension) to be a multiple of "
            f"{FP8_GEMM_DIM_MULTIPLE}, got N={n} for layout {layout!r}; pad the operands or run "
            "this GEMM in high precision"
        )


def _fp8_matrices(
    layout: str, a: CheckedFloat8Operand, b: CheckedFloat8Operand, m: int, n: int, k: int
):
    """Row-major ``X [M, K]`` (from B) and ``Y [N, K]`` (from A) for ``X @ Y^T``."""
    if layout == "TN":
        x, y = b.rowwise(layout), a.rowwise(layout)
    elif layout == "NN":
        x, y = b.rowwise(layout), a.columnwise(layout)
    else:
        x, y = b.columnwise(layout), a.columnwise(layout)
    return x.reshape(m, k).contiguous(), y.reshape(n, k).contiguous()


def _fp8_gemm(
    x, y, x_scale_inv, y_scale_inv, *, out_dtype, bias, alpha, fast_accum, to_fp32, into=None
):
    """``alpha * (x * sx) @ (y * sy)^T (+ bias)``, rounded once to ``out_dtype`` (or float32).
    ``into``: a contiguous tensor of the result's shape and dtype that cuBLAS may write
    directly (the result is then ``into``; otherwise the caller copies)."""
    # torch._scaled_mm takes any one-element float32 scale for per-tensor scaling, so the
    # [1]-shaped scale_inv buffers go in as they are (no reshape: one dispatch less per operand).
    scale_a = x_scale_inv
    if alpha != 1.0:
        # Folding alpha into the scale keeps a single output rounding.
        scale_a = scale_a * alpha
    scale_b = y_scale_inv
    if x.device.type == "cpu" and not fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU:
        # Exact float32 emulation: torch._scaled_mm's CPU kernel is oneDNN's naive reference
        # except on AMX-FP16 CPUs (see fp8_gemm_cpu). torch.mm handles zero-size shapes.
        return fp8_gemm_cpu.fp8_gemm_emulated(
            x, y, scale_a, scale_b, bias=bias, out_dtype=torch.float32 if to_fp32 else out_dtype
        )
    m, n = x.shape[0], y.shape[0]
    # torch._scaled_mm (CUDA) takes a bias only for FP16/BF16 outputs of the same dtype; any
    # other bias is added here in float32 before the single rounding, as cuBLAS's epilogue does.
    fused_bias = (
        bias is not None
        and not to_fp32
        and out_dtype in (torch.float16, torch.bfloat16)
        and bias.dtype == out_dtype
    )
    mm_dtype = out_dtype if fused_bias or (bias is None and not to_fp32) else torch.float32
    if x.shape[1] == 0 or m == 0 or n == 0:
        # No reduction: the product is zero (cuBLASLt is not asked to handle k == 0); an empty
        # output needs no kernel (oneDNN's CPU matmul refuses m == 0).
        product = torch.zeros((m, n), dtype=mm_dtype, device=x.device)
        if fused_bias:
            product += bias
    else:
        pad = -x.shape[1] % FP8_GEMM_DIM_MULTIPLE
        if pad:
            # cuBLASLt needs 16-byte-aligned leading dimensions of FP8 operands: K (the row
            # length of X and Y) a multiple of 16. The wgrad GEMM reduces over the tokens, which
            # may be any count, so both operands get zero columns up to the next multiple: each
            # added term is 0 * 0 = +0.0, so the product is exactly unchanged.
            k = x.shape[1] + pad
            x, y = zero_padded_fp8(x, x.shape[0], k), zero_padded_fp8(y, y.shape[0], k)
        if (
            into is not None
            and mm_dtype == out_dtype == into.dtype
            and (bias is None or fused_bias)
        ):
            # straight into the caller's rows (a pipelined GEMM's chunk of its output)
            return torch._scaled_mm(
                x, y.t(), scale_a=scale_a, scale_b=scale_b, bias=bias if fused_bias else None,
                out_dtype=mm_dtype, use_fast_accum=fast_accum, out=into,
            )  # fmt: skip
        product = torch._scaled_mm(
            x,
            y.t(),
            scale_a=scale_a,
            scale_b=scale_b,
            bias=bias if fused_bias else None,
            out_dtype=mm_dtype,
            use_fast_accum=fast_accum,
        )
    if bias is not None and not fused_bias:
        product = product + bias.float()
    return product if to_fp32 or product.dtype == out_dtype else product.to(out_dtype)


def _hp_gemm(layout: str, a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int, *, dtype):
    """The row-major operands ``(X [M, K], W [K, N])`` of ``X @ W`` in ``dtype``."""
    a, b = a.to(dtype), b.to(dtype)
    if layout == "TN":
        return b.reshape(m, k), a.t()
    if layout == "NN":
        return b.reshape(m, k), a
    return b.reshape(k, m).t(), a.reshape(k, n)


def _layout_copies(A, B, layout: str):
    """``(A, B)`` with a hybrid operand (one format per copy, ``HybridQuantizedTensorStorage``)
    replaced by the copy ``layout`` reads (the module docstring's table: A column-wise for
    "NN" and "NT", B column-wise for "NT"); other operands as they are."""
    get_a = getattr(A, "hybrid_gemm_operand", None)
    if get_a is not None:
        A = _hybrid_copy("A", A, get_a, layout != "TN", layout)
    get_b = getattr(B, "hybrid_gemm_operand", None)
    if get_b is not None:
        B = _hybrid_copy("B", B, get_b, layout == "NT", layout)
    return A, B


def _hybrid_copy(name: str, operand, get, columnwise: bool, layout: str):
    part = get(columnwise)
    if part is None:
        which = "columnwise" if columnwise else "rowwise"
        raise ValueError(
            f"{_OP}: layout {layout!r} reads {name} {which}, but the hybrid operand {name} holds "
            f"no {which} copy (usages {operand.get_usages()}); quantize it with {which} usage"
        )
    return part


def general_gemm(
    A,
    B,
    out_dtype: torch.dtype | None = None,
    quantization_params=None,
    gelu: bool = False,
    gelu_in: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float | None = None,
    accumulate: bool = False,
    layout: str = "TN",
    out=None,
    bias: torch.Tensor | None = None,
    use_split_accumulator: bool = False,
    grad: bool = False,
    ub=None,
    ub_type=None,
    extra_output=None,
    bulk_overlap: bool = False,
):
    """``alpha * op(B) @ op(A) (+ bias) (+ beta * out)`` in cuBLAS layout naming (see the
    module docstring), with upstream's signature and argument order.

    Args:
        A, B: FP8 operands (anything with ``float8_gemm_input``, see the module docstring:
            ``Float8Tensor``, ``Float8TensorStorage``, :class:`Float8GemmOperand`), block-scaled
            FP8, MXFP8 or NVFP4 tensors, hybrid tensors (``HybridQuantizer``'s: the copy the
            layout reads is used), or plain float32, float16 or bfloat16 tensors.
        out_dtype: float32, float16 or bfloat16. Default: ``out.dtype`` when ``out`` is given,
            else bfloat16 for FP8 x FP8, else the high-precision operand's dtype. With
            ``quantization_params``, the quantized output's nominal type.
        quantization_params: ``None``, or the output quantizer: the product is formed in
            float32 and quantized once (as a fused FP8 epilogue rounds), into ``out`` (a
            quantized tensor of that quantizer's kind) when given.
        gelu, gelu_in: the GELU epilogues are not built (``gelu=True`` raises
            ``NotImplementedError``).
        alpha: scale applied to the product.
        beta: with ``accumulate``, the scale of the old ``out`` (default 1; the sum is rounded
            once to ``out``'s type); a non-zero ``beta`` without ``accumulate`` is refused.
        accumulate: ``out = beta * out + result`` (``out`` required). The product is formed in
            float32 and added to ``out`` before a single rounding to ``out``'s dtype (for a
            float32 ``out``, e.g. ``main_grad``, everything stays float32).
        layout: ``"TN"`` (fprop), ``"NN"`` (dgrad) or ``"NT"`` (wgrad).
        out: buffer of the output's shape and dtype. Receives the result, or with
            ``accumulate=True`` the result is added into it.
        bias: ``[N]`` tensor added to every output row (not scaled by ``alpha``). With
            ``grad=True`` a flag instead: no bias is added, and the bias gradient of the wgrad
            layout (``B``, the output gradient, summed over its rows, in the bias's dtype)
            comes back in slot 1.
        use_split_accumulator: FP8 only: accumulate in full float32 (slower on Hopper) instead
            of the fast FP8 accumulation mode. Ignored for high precision.
        grad: a backward GEMM (see ``bias``).
        ub, ub_type, extra_output, bulk_overlap: userbuffers communication overlap, not built:
            anything but the defaults raises ``NotImplementedError``.

    Returns:
        ``(out, bias_grad, gelu_input, extra_output)``: ``bias_grad`` as described under
        ``bias`` (else ``None``); the last two are always ``None``.

    Paths:
        * FP8 x FP8: ``torch._scaled_mm`` on the buffers listed in the module docstring. N must
          be a multiple of 16 (``ValueError``); M and K are free (a K that is not a multiple of
          16 is zero-padded to one for ``torch._scaled_mm``, which leaves the product unchanged;
          the CPU emulation takes any K as it is). At least one operand must be E4M3 (FP8
          GEMMs do not take E5M2 x E5M2).
        * both high precision: ``torch.mm``/``torch.addmm`` in the operands' common dtype, then
          cast to ``out_dtype``; in float32 (operands upcast) when the output is float32 or
          ``accumulate=True``, so the product is never rounded to a narrower type than the
          output and an accumulation rounds once; in float32 too, rounded once, for 16-bit
          operands on a CPU without 16-bit matrix math (:mod:`.hp_gemm_cpu`). A
          ``torch.autocast`` region changes none of these dtypes (it is off while the product
          runs), as it cannot change upstream's C++ GEMM.
        * mixed (one FP8, one plain tensor): the FP8 operand is dequantized to the other
          operand's dtype (from whichever buffer it holds) and the high-precision path runs.
        * the epilogues (output quantizer, ``beta``, bias gradient): :mod:`.gemm_epilogues`.

    Device: everything runs on the operands' device. Every tensor (operand buffers, scales,
    ``bias``, ``out``) must be on B's device; a mismatch or a meta tensor raises ``ValueError``
    before any work.
    """
    plain = (
        quantization_params is None
        and beta is None
        and not (grad and bias is not None)
        and not gelu
        and not bulk_overlap
        and ub is None
        and ub_type is None
        and extra_output is None
    )
    if plain:  # (_plain_gemm takes the hybrid operands' copies itself)
        return _plain_gemm(
            A, B, out_dtype, layout=layout, out=out, bias=bias, accumulate=accumulate,
            use_split_accumulator=use_split_accumulator, alpha=alpha,
        )  # fmt: skip
    overlap = {"ub": ub, "ub_type": ub_type, "extra_output": extra_output}
    refuse_unbuilt_epilogues(_OP, gelu=gelu, overlap=overlap, bulk_overlap=bulk_overlap)
    A, B = _layout_copies(A, B, layout)  # the epilogues read B (its bias gradient) directly
    result, bias_grad = gemm_with_epilogues(
        _OP, _plain_gemm, A, B, out_dtype, quantizer=quantization_params, alpha=alpha,
        beta=beta, accumulate=accumulate, layout=layout, out=out, bias=bias,
        bias_grad_dtype=None, use_split_accumulator=use_split_accumulator, grad=grad,
    )  # fmt: skip
    return result, bias_grad, None, None


def _plain_gemm(
    A,
    B,
    out_dtype: torch.dtype | None = None,
    *,
    layout: str = "TN",
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
    use_split_accumulator: bool = False,
    alpha: float = 1.0,
):
    """:func:`general_gemm` without its epilogues (arguments as there)."""
    # ---- validation: nothing is computed or allocated before all of it has passed ----
    if layout not in _LAYOUTS:
        raise ValueError(
            f"{_OP}: layout={layout!r} is not supported; use 'TN' (fprop), 'NN' (dgrad) or "
            "'NT' (wgrad)"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{_OP}: alpha must be a real number, got {type(alpha).__name__}")
    alpha = float(alpha)
    if out_dtype is not None and out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{_OP}: out_dtype={out_dtype} is not supported; use torch.float32, torch.float16 "
            "or torch.bfloat16"
        )
    if accumulate and out is None:
        raise ValueError(f"{_OP}: accumulate=True adds into out, so out must be given")
    A, B = _layout_copies(A, B, layout)

    if is_nvfp4_operand(A) or is_nvfp4_operand(B):
        # NVFP4 (NVFP4BlockScaling): emulated on every device (nvfp4_gemm.py).
        return nvfp4_general_gemm(
            A, B, out_dtype, layout=layout, out=out, bias=bias, accumulate=accumulate, alpha=alpha
        )
    if is_mxfp8_operand(A) or is_mxfp8_operand(B):
        # MXFP8 (MXFP8BlockScaling): emulated on every device (mxfp8_gemm.py).
        return mxfp8_general_gemm(
            A, B, out_dtype, layout=layout, out=out, bias=bias, accumulate=accumulate, alpha=alpha
        )
    if is_block_float8_operand(A) or is_block_float8_operand(B):
        # Block-scaled FP8 (Float8BlockScaling): its own GEMM (block_gemm.py).
        return block_general_gemm(
            A, B, out_dtype, layout=layout, out=out, bias=bias, accumulate=accumulate,
            use_split_accumulator=use_split_accumulator, alpha=alpha,
        )  # fmt: skip

    operands = {}
    tensors = {}
    for name, operand in (("A", A), ("B", B)):
        if is_float8_operand(operand):
            operands[name] = CheckedFloat8Operand(name, operand)
            tensors.update(operands[name].tensors())
        else:
            check_tensor(_OP, name, operand)
            check_dtype(_OP, name, operand, HIGH_PRECISION_DTYPES)
            if operand.dim() == 0:
                raise ValueError(f"{_OP}: {name} is 0-d; a GEMM operand needs at least one dim")
            operands[name] = operand
            tensors[name] = operand
    a, b = operands["A"], operands["B"]
    a_fp8, b_fp8 = isinstance(a, CheckedFloat8Operand), isinstance(b, CheckedFloat8Operand)
    if bias is not None:
        check_tensor(_OP, "bias", bias)
        check_dtype(_OP, "bias", bias, HIGH_PRECISION_DTYPES)
    if out is not None:
        check_tensor(_OP, "out", out)
    tensors.update(bias=bias, out=out)

    reject_meta(_OP, **tensors)
    anchor_name = "B.data" if b_fp8 and b.data is not None else "B.transpose" if b_fp8 else "B"
    anchor = tensors.pop(anchor_name)
    check_same_device(_OP, anchor_name, anchor, **tensors)
    device = anchor.device

    m, n, k, out_shape = _dims(layout, tuple(a.shape), tuple(b.shape))
    if a_fp8 and b_fp8:
        if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
            raise ValueError(
                f"{_OP}: A and B are both E5M2; FP8 GEMMs need at least one E4M3 operand "
                "(HYBRID uses E4M3 weights with E5M2 gradients)"
            )
        _check_fp8_dims(layout, n)
    elif not a_fp8 and not b_fp8 and a.dtype != b.dtype:
        raise TypeError(
            f"{_OP}: A is {a.dtype} but B is {b.dtype}; high-precision operands must share "
            "a dtype (cast one of them)"
        )
    if out_dtype is None:
        if out is not None:
            out_dtype = out.dtype
        elif a_fp8 and b_fp8:
            out_dtype = torch.bfloat16
        else:
            out_dtype = b.dtype if a_fp8 else a.dtype
    check_output(_OP, "out", out, out_shape, (out_dtype,))
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{_OP}: bias has shape {tuple(bias.shape)}; expected ({n},)")
    if a_fp8 and b_fp8:
        # Last check: raises if a buffer the layout reads is missing.
        x, y = _fp8_matrices(layout, a, b, m, n, k)

    # ---- compute, on the operands' device ----
    # No torch.cuda.device guard: torch._scaled_mm, torch.mm and torch.addmm are ATen ops whose
    # CUDA kernels switch to their tensor arguments' device themselves, and the cuBLAS(Lt)
    # handle and workspace PyTorch uses are looked up per device inside that switch. The GPU
    # tests run on cuda:1 while cuda:0 is current to pin this.
    if a_fp8 and b_fp8:
        result = _fp8_gemm(
            x,
            y,
            b.scale_inv,
            a.scale_inv,
            out_dtype=out_dtype,
            bias=bias,
            alpha=alpha,
            fast_accum=not use_split_accumulator,
            to_fp32=accumulate,
        )
    else:
        if a_fp8:
            a = a.dequantized(b.dtype)
        elif b_fp8:
            b = b.dequantized(a.dtype)
        compute_dtype = a.dtype
        if accumulate or out_dtype == torch.float32 or hp_gemm_cpu.runs_in_float32(a, b):
            compute_dtype = torch.float32
        x, w = _hp_gemm(layout, a, b, m, n, k, dtype=compute_dtype)
        with autocast_off(device.type):  # the compute dtype is chosen here, as upstream's GEMM
            if bias is not None:
                result = torch.addmm(bias.to(compute_dtype), x, w, alpha=alpha)
            elif alpha != 1.0:
                # beta=0 ignores the input entirely, so one rounding covers product and alpha.
                zero = torch.zeros((), dtype=compute_dtype, device=device)
                result = torch.addmm(zero, x, w, beta=0, alpha=alpha)
            else:
                result = torch.mm(x, w)
        if not accumulate:
            result = result.to(out_dtype)

    result = result.reshape(out_shape)
    if accumulate:
        if out.dtype == torch.float32:
            out.add_(result)
        else:
            out.copy_(out.float() + result)
    elif out is not None:
        out.copy_(result)
    else:
        out = result
    return out, None, None, None


def fp8_gemm_prevalidated(
    A,
    B,
    out_dtype: torch.dtype,
    *,
    layout: str,
    bias: torch.Tensor | None = None,
    use_split_accumulator: bool = False,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """:func:`general_gemm`'s FP8 x FP8 path for 2-D operands, without argument validation.

    For the linear core, which checks shapes (in and out features multiples of 16) and
    placement (the module's device checks) before it quantizes the operands: skipping the
    re-validation here saves tens of microseconds of host time per GEMM. Anything unusual (an
    operand that is not 2-D, a missing transposed copy, e.g. on GPUs with non-TN FP8 GEMMs)
    takes the validated :func:`general_gemm` path, which gives the same result.

    ``A`` and ``B`` are read only through ``float8_gemm_input`` (one layout each), whose
    implementations keep the typed views, so this path makes no view per call.

    An operand without that method (a plain tensor, e.g. what an ``IdentityQuantizer`` left in
    high precision) sends the call to :func:`general_gemm`'s high-precision or mixed path.
    """
    # try/except rather than a type check: free on the FP8 path (no per-call isinstance or
    # hasattr). A genuine AttributeError inside float8_gemm_input is not hidden: general_gemm
    # reads the operand through the same method and raises it again.
    try:
        if layout == "TN":
            x, x_scale_inv = B.float8_gemm_input(False)
            y, y_scale_inv = A.float8_gemm_input(False)
        elif layout == "NN":
            x, x_scale_inv = B.float8_gemm_input(False)
            y, y_scale_inv = A.float8_gemm_input(True)
        else:  # "NT"
            x, x_scale_inv = B.float8_gemm_input(True)
            y, y_scale_inv = A.float8_gemm_input(True)
    except AttributeError:
        x = None  # not both FP8: the validated general path below
    if x is None or y is None or x.dim() != 2 or y.dim() != 2:
        return _plain_gemm(
            A, B, out_dtype, layout=layout, bias=bias, out=out, accumulate=accumulate,
            use_split_accumulator=use_split_accumulator,
        )[0]  # fmt: skip
    into = out if out is not None and not accumulate and out.is_contiguous() else None
    result = _fp8_gemm(
        x,
        y,
        x_scale_inv,
        y_scale_inv,
        out_dtype=out_dtype,
        bias=bias,
        alpha=1.0,
        fast_accum=not use_split_accumulator,
        to_fp32=accumulate,
        into=into,
    )
    if accumulate:
        if out.dtype == torch.float32:
            return out.add_(result)
        return out.copy_(out.float() + result)
    if out is not None and result is not out:
        return out.copy_(result)
    return result
