"""Forward fusion: ``LayerNorm`` / ``RMSNorm`` whose output is written in FP8 for the next
``BasicLinear``.

The norm's output is cast with the linear's input quantizer: in the norm kernel's own pass
with the package's norm kernels (``functional.normalization.norm_kernels_write_fp8``; delayed
scaling: one pass; current scaling: the kernel's amax pass, then the pass that writes the
bytes), else right after PyTorch's norm kernel, whose high-precision output goes before the
GEMM runs; either way in the layouts the linear reads. The linear takes the FP8
tensor as it is (no second cast) and keeps only the transposed copy for its weight gradient;
the norm keeps its input and statistics, as it does alone. ``te.LayerNormLinear`` and
``te.LayerNormMLP`` do the same.
"""

from __future__ import annotations

from ...functional.normalization import norm_kernels_write_fp8
from ...functional.produced_fp8 import cast_for_linear
from ..basic._common import plain
from ..basic.basic_linear import BasicLinear, fusible_linear
from ..basic.normalization import LayerNorm, RMSNorm
from ._producer import ForwardProducerFusion, replace_under_per_tensor_fp8
from ._rewrite import op_at

__all__ = ["ForwardNormCast", "fuse_forward_norm_cast"]

_NORMS = (LayerNorm, RMSNorm)


class ForwardNormCast(ForwardProducerFusion):
    """Forward of a ``LayerNorm`` or ``RMSNorm`` whose output goes into a ``BasicLinear`` in FP8.

    Parameters
    ----------
    norm : LayerNorm or RMSNorm
        The operation this fused operation covers.
    linear : BasicLinear
        The operation right after it (alone or first in a fused linear); read, not covered:
        its input quantizer casts the norm's output, its weight decides whether the transposed
        copy is made.

    Same bits as the chain in every dtype: the norm kernel rounds each value to the norm's
    dtype before the linear's cast, as the chain does. Where the linear's input quantizer is not a
    per-tensor FP8 one, the norm's dtype differs from the linear's compute dtype, or FP8 is
    off, the norm runs alone.
    """

    def __init__(self, *, norm, linear: BasicLinear) -> None:
        if type(norm) not in _NORMS or type(linear) is not BasicLinear:
            raise TypeError(
                "ForwardNormCast: needs a LayerNorm or RMSNorm and a BasicLinear, got "
                f"{type(norm).__name__} and {type(linear).__name__}"
            )
        super().__init__(norm, linear)

    def produce_forward(self, norm, ctx, input_, linear, quantizer):
        x = plain(input_)
        if not (
            self.casts_for(linear, quantizer, x)
            and x.dim() > 0
            and x.shape[-1] == linear.local_in_features
            and len(norm.normalized_shape) == 1
        ):
            return norm.op_forward(ctx, input_)
        needs_wgrad = self.check_linear_shapes(ctx, linear)
        if norm_kernels_write_fp8():
            return norm.op_forward_fp8(ctx, input_, quantizer, columnwise=needs_wgrad)
        y = norm.op_forward(ctx, input_)
        out = cast_for_linear(quantizer, y, rowwise=True, columnwise=needs_wgrad)
        del y  # the high-precision output goes before the GEMM
        return out


def fuse_forward_norm_cast(ops, *, recipe=None):
    """Replace each ``LayerNorm`` / ``RMSNorm`` directly followed by a ``BasicLinear`` by a
    :class:`ForwardNormCast` (under delayed or current scaling only; the linear stays in the
    list for the fusions that follow).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_under_per_tensor_fp8(ops, recipe, _match_forward_norm_cast)


def _match_forward_norm_cast(ops, i):
    op, linear = ops[i], op_at(ops, i + 1)
    # before a sequence-parallel column linear the FP8 bytes are all-gathered as they are
    if type(op) in _NORMS and fusible_linear(linear, ("column", "column+sp")):
        return ForwardNormCast(norm=op, linear=linear), 1
    return None
