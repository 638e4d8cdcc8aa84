"""Grouped GEMM: one independent :func:`general_gemm` per group, with upstream's signature.

``general_grouped_gemm(A, B, out, ...)`` multiplies ``A[i]`` (the weights) with ``B[i]`` (the
inputs or output gradients) for every group ``i``, in the layout naming of
:mod:`~transformer_engine.pytorch.cpp_extensions.gemm` (``"TN"`` fprop, ``"NN"`` dgrad,
``"NT"`` wgrad). Each group is a separate GEMM call here (upstream launches them on several
streams); the numerics and shape rules of every group are exactly those of
:func:`general_gemm`: in FP8 a group may have any row count (in the wgrad GEMM the rows are
the reduction dimension, which ``general_gemm`` zero-pads), while N must be a multiple of 16.

Every group is computed before any output is written, so a group that is refused (a shape
mismatch, an FP8 N that is not a multiple of 16, ...) leaves every output untouched.
"""

from __future__ import annotations

import math
import operator

import torch

from ..device import check_same_device, reject_meta
from .float8_gemm_operand import is_float8_operand
from .gemm import general_gemm

__all__ = ["general_grouped_gemm"]

_OP = "general_grouped_gemm"


def _as_list(name: str, value, allow_none: bool = False) -> list:
    if value is None and allow_none:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{_OP}: {name} must be a list (one entry per group), got "
                        f"{type(value).__name__}")  # fmt: skip
    return list(value)


def _check_m_splits(m_splits, num_gemms: int, B: list) -> list[int] | None:
    if m_splits is None:
        return None
    splits = _as_list("m_splits", m_splits)
    if len(splits) != num_gemms:
        raise ValueError(
            f"{_OP}: m_splits has {len(splits)} entries but there are {num_gemms} groups; "
            "pass one row count per group"
        )
    result = []
    for i, (m, b) in enumerate(zip(splits, B, strict=True)):
        try:
            m = operator.index(m)
        except TypeError:
            raise TypeError(f"{_OP}: m_splits[{i}]={m!r} is not an int") from None
        rows = math.prod(tuple(b.shape)[:-1])
        if m < 0 or rows != m:
            raise ValueError(
                f"{_OP}: m_splits[{i}]={m} but B[{i}] has shape {tuple(b.shape)}, i.e. {rows} "
                "rows; each split must equal its group's row count"
            )
        result.append(m)
    return result


def _refuse_unsupported(quantization_params, num_gemms: int, gelu, D_dtype) -> None:
    if gelu:
        raise NotImplementedError(
            f"{_OP}: gelu=True asks for the fused GELU epilogue, which is not implemented; "
            "apply the activation to the outputs instead"
        )
    if D_dtype is not None:
        raise NotImplementedError(
            f"{_OP}: D_dtype={D_dtype!r} asks for a quantized (FP8) output, which is not "
            "implemented; leave D_dtype=None and pass out_dtype (float32, float16 or bfloat16)"
        )
    params = _as_list("quantization_params", quantization_params, allow_none=True)
    if params and len(params) != num_gemms:
        raise ValueError(
            f"{_OP}: quantization_params has {len(params)} entries but there are {num_gemms} "
            "groups; pass one (None) per group"
        )
    for i, q in enumerate(params):
        if q is not None:
            raise NotImplementedError(
                f"{_OP}: quantization_params[{i}] is a {type(q).__name__}: quantizing the "
                "outputs is not implemented; pass None for every group and quantize the "
                "outputs afterwards"
            )


def _grad_bias(i: int, b, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient of group ``i``: ``B[i]`` (the output gradient) summed over rows."""
    if is_float8_operand(b):
        raise NotImplementedError(
            f"{_OP}: grad=True with use_bias=True needs the bias gradient from B[{i}], which is "
            "FP8 here; compute it from the high-precision gradient (summed over rows) and call "
            "with use_bias=False"
        )
    return b.reshape(-1, b.shape[-1]).sum(dim=0, dtype=torch.float32).to(dtype)


def general_grouped_gemm(
    A,
    B,
    out,
    quantization_params,
    out_dtype,
    layout: str = "TN",
    m_splits=None,
    gelu: bool = False,
    grad: bool = False,
    accumulate: bool = False,
    bias=None,
    use_bias: bool = False,
    use_split_accumulator: bool = False,
    D_dtype=None,
    single_output: bool = False,
):
    """``out[i] = op(B[i]) @ op(A[i]) (+ bias[i])`` for every group, in ``layout``.

    Args:
        A, B: lists of the groups' operands, as :func:`general_gemm` takes them (plain
            float32/float16/bfloat16 tensors or FP8 operands). ``A`` holds the weights.
        out: list of output buffers, one per group, each of its GEMM's output shape; an entry
            may be None (a new tensor is returned in its place) unless ``accumulate``. With
            ``single_output=True``, a one-element list holding ``[sum(m_splits), N]``, which
            the groups fill in order, ``m_splits[i]`` rows each.
        quantization_params: one output quantizer per group; only None entries (or None) are
            accepted, quantized outputs are not implemented (``NotImplementedError``).
        out_dtype: the outputs' torch dtype; None takes it from ``out``.
        layout: ``"TN"``, ``"NN"`` or ``"NT"``, for every group.
        m_splits: rows of each group's ``B`` (checked against the shapes); needed with
            ``single_output``.
        gelu, D_dtype: the GELU epilogue and FP8 outputs; not implemented
            (``NotImplementedError`` when set).
        grad: with ``use_bias``, return the bias gradients (each ``B[i]`` summed over rows, in
            float32, cast to the output dtype) instead of adding a bias.
        accumulate: add each product into its ``out`` entry (one rounding, as
            :func:`general_gemm`).
        bias, use_bias: with ``use_bias=True`` and ``grad=False``, ``bias[i]`` (``[N]``) is added
            to group ``i``'s output. Without ``use_bias`` the list is ignored, as upstream does.
        use_split_accumulator: FP8 groups accumulate in full float32 (see :func:`general_gemm`).
        single_output: see ``out``; ``"TN"`` and ``"NN"`` only.

    Returns:
        ``(out, bias_or_grad_bias, gelu_input)``: the outputs (the ``out`` list, None entries
        filled); the bias gradients when ``grad and use_bias``, else ``bias`` when
        ``use_bias``, else a list of None; and a list of None (no GELU input is kept).
    """
    A, B = _as_list("A", A), _as_list("B", B)
    num_gemms = len(A)
    if len(B) != num_gemms:
        raise ValueError(f"{_OP}: A has {num_gemms} groups but B has {len(B)}; they must match")
    _refuse_unsupported(quantization_params, num_gemms, gelu, D_dtype)
    splits = _check_m_splits(m_splits, num_gemms, B)
    if not isinstance(out, list):
        out = _as_list("out", out)  # a tuple: the filled-in list is returned instead
    if single_output:
        if layout not in ("TN", "NN"):
            raise ValueError(
                f"{_OP}: single_output=True stacks the groups' rows, which needs layout 'TN' "
                f"or 'NN', got {layout!r}"
            )
        if splits is None:
            raise ValueError(f"{_OP}: single_output=True needs m_splits (rows per group)")
        if len(out) != 1 or not isinstance(out[0], torch.Tensor):
            raise ValueError(f"{_OP}: single_output=True needs out=[one tensor]")
        if out[0].dim() != 2 or out[0].shape[0] != sum(splits):
            raise ValueError(
                f"{_OP}: single_output needs out[0] of shape [sum(m_splits)={sum(splits)}, N], "
                f"got {tuple(out[0].shape)}"
            )
        targets = list(torch.split(out[0], splits, dim=0))
    else:
        if len(out) != num_gemms:
            raise ValueError(
                f"{_OP}: out has {len(out)} entries but there are {num_gemms} groups; pass "
                "one buffer (or None) per group"
            )
        targets = out
    for i, t in enumerate(targets):
        if t is None and accumulate:
            raise ValueError(f"{_OP}: accumulate=True adds into out, but out[{i}] is None")
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: out[{i}] must be a torch.Tensor or None, got "
                            f"{type(t).__name__}")  # fmt: skip
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{_OP}: out[{i}] must be contiguous; pass a contiguous buffer")
    given = [t for t in targets if t is not None]
    if out_dtype is None:
        if not given:
            raise ValueError(f"{_OP}: out_dtype is None and no output buffer gives a dtype")
        out_dtype = given[0].dtype
    for i, t in enumerate(targets):
        if t is not None and t.dtype != out_dtype:
            raise TypeError(f"{_OP}: out[{i}] has dtype {t.dtype} but out_dtype is {out_dtype}")
    biases = _as_list("bias", bias) if use_bias else []
    if use_bias and len(biases) != num_gemms:
        raise ValueError(f"{_OP}: bias has {len(biases)} entries for {num_gemms} groups")
    if given:
        reject_meta(_OP, **{f"out[{i}]": t for i, t in enumerate(targets) if t is not None})
        check_same_device(_OP, "out[0]", given[0], **{
            f"out[{i}]": t for i, t in enumerate(targets) if t is not None
        })  # fmt: skip

    # ---- every group computed before anything is written ----
    add_bias = use_bias and not grad
    results = []
    for i in range(num_gemms):
        # Accumulation adds a float32 product into out with one rounding, as general_gemm does.
        dtype = torch.float32 if accumulate else out_dtype
        result = general_gemm(
            A[i], B[i], dtype, layout=layout, bias=biases[i] if add_bias else None,
            use_split_accumulator=use_split_accumulator,
        )[0]  # fmt: skip
        t = targets[i]
        if t is not None:
            check_same_device(_OP, f"B[{i}]", result, **{f"out[{i}]": t})
        # single_output: the group's rows of out[0] are 2-D, a multi-dim B gives more dims.
        same = t is None or (
            result.numel() == t.numel() if single_output else result.shape == t.shape
        )
        if not same:
            where = f"group {i}'s rows of out[0]" if single_output else f"out[{i}]"
            raise ValueError(
                f"{_OP}: {where} has shape {tuple(t.shape)}; group {i} produces shape "
                f"{tuple(result.shape)}"
            )
        results.append(result)
    grad_biases = [_grad_bias(i, B[i], out_dtype) for i in range(num_gemms)] if (
        grad and use_bias) else None  # fmt: skip

    for i, (t, result) in enumerate(zip(targets, results, strict=True)):
        if t is None:
            out[i] = result
        elif accumulate and t.dtype == torch.float32:
            t.add_(result.reshape(t.shape))
        elif accumulate:
            t.copy_(t.float() + result.reshape(t.shape))
        else:
            t.copy_(result.reshape(t.shape))
    if grad_biases is not None:
        returned_bias = grad_biases
    else:
        returned_bias = biases if use_bias else [None] * num_gemms
    return out, returned_bias, [None] * num_gemms
