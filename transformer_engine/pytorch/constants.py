"""Public dtype constants shared by the Python API and the native binding.

The integer values are the ones the C ABI uses (``NVTEDType`` in
``transformer_engine/common/include/transformer_engine/transformer_engine.h``),
so a ``DType`` can be handed to the binding as a plain ``int``.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import torch

__all__ = [
    "DType",
    "TE_DType",
    "TE_DType_To_Torch",
    "FP8_DTYPES",
    "HIGH_PRECISION_DTYPES",
    "fp8_max",
    "to_torch_fp8_dtype",
    "FP8FwdTensorIdx",
    "FP8BwdTensorIdx",
    "AttnMaskTypes",
    "AttnTypes",
    "AttnBiasTypes",
    "LayerTypes",
    "QKVLayouts",
    "GemmParallelModes",
    "dist_group_type",
    "MXFP8_BLOCK_SCALING_SIZE",
    "NVFP4_BLOCK_SCALING_SIZE",
]


class DType(enum.IntEnum):
    """Element types understood by the native library (values mirror ``NVTEDType``)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10

    @classmethod
    def cast(cls, value) -> DType:
        """Normalise a ``DType``, an ``int`` or anything with an integer ``value``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, torch.dtype):
            try:
                return TE_DType[value]
            except KeyError:
                raise TypeError(f"torch dtype {value} has no transformer_engine DType") from None
        return cls(int(getattr(value, "value", value)))


TE_DType = {
    torch.uint8: DType.kByte,
    torch.float8_e4m3fn: DType.kFloat8E4M3,
    torch.float8_e5m2: DType.kFloat8E5M2,
    torch.int32: DType.kInt32,
    torch.float32: DType.kFloat32,
    torch.half: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
}

TE_DType_To_Torch = {v: k for k, v in TE_DType.items()}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Largest finite magnitudes; casts saturate to these.
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def to_torch_fp8_dtype(fp8_dtype) -> torch.dtype:
    """Accept ``torch.float8_*`` or ``DType.kFloat8*`` and return the torch dtype."""
    if isinstance(fp8_dtype, torch.dtype):
        if fp8_dtype in _FP8_MAX:
            return fp8_dtype
    else:
        try:
            dtype = TE_DType_To_Torch.get(DType.cast(fp8_dtype))
        except (TypeError, ValueError):
            dtype = None
        if dtype in _FP8_MAX:
            return dtype
    raise TypeError(
        f"fp8_dtype={fp8_dtype!r} is not an FP8 format; use torch.float8_e4m3fn, "
        "torch.float8_e5m2, DType.kFloat8E4M3 or DType.kFloat8E5M2"
    )


def fp8_max(fp8_dtype) -> float:
    """Largest finite value of an FP8 format: 448 for E4M3, 57344 for E5M2."""
    return _FP8_MAX[to_torch_fp8_dtype(fp8_dtype)]


# Quantizer slots of a module's recipe state (upstream's ``tex.FP8FwdTensors`` /
# ``tex.FP8BwdTensors`` numbering). Forward: three slots per GEMM, ``[input, weight, output]``;
# backward: two per GEMM, ``[grad_output, grad_input]``. Upstream's forward table has no
# GEMM3_INPUT / GEMM3_WEIGHT (only attention's third "GEMM" output uses slot 8), and neither has
# this one, so code written against upstream finds exactly the names it expects.
FP8FwdTensorIdx = SimpleNamespace(
    GEMM1_INPUT=0,
    GEMM1_WEIGHT=1,
    GEMM1_OUTPUT=2,
    GEMM2_INPUT=3,
    GEMM2_WEIGHT=4,
    GEMM2_OUTPUT=5,
    GEMM3_OUTPUT=8,
)
FP8BwdTensorIdx = SimpleNamespace(
    GRAD_OUTPUT1=0,
    GRAD_INPUT1=1,
    GRAD_OUTPUT2=2,
    GRAD_INPUT2=3,
    GRAD_OUTPUT3=4,
    GRAD_INPUT3=5,
)

# Upstream's name tables (the values its argument checks accept).
AttnMaskTypes = (
    "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
    "padding_causal_bottom_right", "arbitrary",
)  # fmt: skip
AttnTypes = ("self", "cross")
AttnBiasTypes = ("pre_scale_bias", "post_scale_bias", "no_bias", "alibi")
LayerTypes = ("encoder", "decoder")
# The layouts of q, k and v as attention names them: "3" packs q, k, v into one tensor, "2" packs
# k and v, "_"-separated parts are separate tensors; "paged_kv_" is a paged KV cache's.
QKVLayouts = (
    "sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
    "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd",
    "t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd",
    "sbhd_bshd_bshd", "bshd_sbhd_sbhd", "thd_bshd_bshd", "thd_sbhd_sbhd",
    "paged_kv_bshd_bshd_bshd", "paged_kv_bshd_sbhd_sbhd", "paged_kv_sbhd_bshd_bshd",
    "paged_kv_sbhd_sbhd_sbhd", "paged_kv_thd_bshd_bshd", "paged_kv_thd_sbhd_sbhd",
)  # fmt: skip
GemmParallelModes = ("row", "column", None)
# Elements per scale: MXFP8 (one E8M0 scale per 32 values), NVFP4 (one E4M3 scale per 16).
MXFP8_BLOCK_SCALING_SIZE = 32
NVFP4_BLOCK_SCALING_SIZE = 16
# The type of a process group argument (``tp_group``, ``amax_reduction_group``, ...).
dist_group_type = torch.distributed.ProcessGroup if torch.distributed.is_available() else object
