"""What FP8 GEMMs see of their operands, from the reference path: for expected values in tests."""

import torch

from transformer_engine.pytorch import reference


def fake_quant(t, scale, fp8_dtype):
    """What an FP8 GEMM sees of ``t`` cast with ``scale``: dequantized values (float64)."""
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(1)
    data = reference.cast_to_fp8(t.detach(), scale, fp8_dtype)
    return reference.dequantize(data, reference.reciprocal(scale), torch.float32).double()


def current_scale(t, fp8_dtype):
    """Current scaling's scale for ``t``."""
    return reference.compute_scale_from_amax(reference.amax(t.detach()), fp8_dtype)
