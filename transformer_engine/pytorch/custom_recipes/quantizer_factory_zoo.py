"""``CustomRecipe`` factories that mix formats: by tensor (:class:`HybridQuantizer`) or by
layer kind.

A tensor's row-wise copy feeds the forward GEMM (and, for the output gradient, dgrad); its
column-wise copy feeds the backward GEMMs (the weight's dgrad, wgrad). A factory that answers a
forward slot with a :class:`HybridQuantizer` therefore chooses the forward format and the
backward format of that tensor independently.
"""

from __future__ import annotations

import torch

from ..quantization import QuantizerRole
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer
from ..tensor.hybrid_tensor import HybridQuantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer
from .quantizer_factories import mxfp8_factory, nvfp4_factory

__all__ = ["mxfp8_fwd_nvfp4_bwd_factory", "nvfp4_linear_fp8_dpa_factory"]

_FORWARD_OPERANDS = ("input", "weight")
_ATTENTION_GRADIENTS = ("dqkv", "do", "dp")


def mxfp8_fwd_nvfp4_bwd_factory(
    role: QuantizerRole | None,
) -> HybridQuantizer | MXFP8Quantizer | NVFP4Quantizer:
    """The forward GEMM in MXFP8, the backward GEMMs in NVFP4.

    * ``input`` and ``weight`` slots: a :class:`HybridQuantizer` whose row-wise copy is MXFP8
      (E4M3, :func:`~.quantizer_factories.mxfp8_factory`) and whose column-wise copy is what
      :func:`~.quantizer_factories.nvfp4_factory` gives the slot (weights of linear owners in
      16x16 blocks, inputs with the random Hadamard transform);
    * ``grad_output`` slots: ``nvfp4_factory``'s quantizer (the transform, the amax after it,
      stochastic rounding), both copies NVFP4: dgrad multiplies it with the weight's NVFP4
      column-wise copy, wgrad with the input's;
    * every other slot (boundary slots, ``None``; other tensor types): MXFP8, as the forward.
    """
    tensor_type = None if role is None else role.tensor_type
    if tensor_type in _FORWARD_OPERANDS:
        return HybridQuantizer(
            rowwise_quantizer=mxfp8_factory(role), columnwise_quantizer=nvfp4_factory(role)
        )
    if tensor_type == "grad_output":
        return nvfp4_factory(role)
    return mxfp8_factory(role)


def nvfp4_linear_fp8_dpa_factory(
    role: QuantizerRole | None,
) -> NVFP4Quantizer | Float8CurrentScalingQuantizer:
    """NVFP4 for the linear layers, FP8 for attention (with ``CustomRecipe(...,
    fp8_dpa=True)``).

    * attention slots (``module_type="dpa"``): current scaling, E5M2 for the gradients
      (``dqkv``, ``do``, ``dp``) and E4M3 for the rest (``qkv``, ``o``, ``s``), as
      ``Float8CurrentScaling()`` gives them;
    * every other slot (boundary slots included): :func:`~.quantizer_factories.nvfp4_factory`.
    """
    if role is not None and role.module_type == "dpa":
        grad = role.tensor_type in _ATTENTION_GRADIENTS
        return Float8CurrentScalingQuantizer(torch.float8_e5m2 if grad else torch.float8_e4m3fn)
    return nvfp4_factory(role)
