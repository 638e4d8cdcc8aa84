"""Activation operations (``GELU``, ``SwiGLU``, ...) on the fused activation kernels of
:mod:`transformer_engine.pytorch.functional.activation`: one pass forward, one pass backward
from the saved input (no float32 intermediates). Gated (GLU) variants split the last dimension
in halves and apply the activation to the *first* half (the opposite of
``torch.nn.functional.glu``).
"""

from __future__ import annotations

import torch

from ...functional.activation import (
    ActivationSpec,
    activation_backward,
    activation_forward,
    activation_spec,
)
from ...quantization import FP8GlobalStateManager
from ...tensor import Float8CurrentScalingQuantizer
from ..op import BasicOperation, OperationContext
from ._common import plain


def check_glu_interleave_size(owner: str, size) -> int | None:
    """``size`` as a positive int, or None; a clear error otherwise."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"{owner}: glu_interleave_size={size!r} must be a positive int (columns per block of "
            "the interleaved halves) or None (contiguous halves)"
        )
    return size


def glu_to_halves(owner: str, x: torch.Tensor, k: int | None) -> torch.Tensor:
    """``x`` with contiguous halves: blocks ``[G0:k, V0:k, Gk:2k, Vk:2k, ...]`` of the last
    dimension (upstream's interleaved GLU layout, which an FC1 weight reordered by
    :func:`transformer_engine.pytorch.interleave_glu_tensor` gives) reordered to ``[G, V]``;
    ``x`` itself when ``k`` is None."""
    if k is None:
        return x
    n = x.shape[-1]
    if n % (2 * k) != 0:
        raise ValueError(
            f"{owner}: the input's last dimension {n} is not a multiple of "
            f"2 * glu_interleave_size = {2 * k}; the interleaved layout holds whole pairs of "
            f"{k}-column blocks"
        )
    blocks = x.reshape(*x.shape[:-1], n // (2 * k), 2, k)
    return blocks.transpose(-3, -2).reshape(x.shape)


def glu_from_halves(g: torch.Tensor, k: int | None) -> torch.Tensor:
    """The inverse of :func:`glu_to_halves`."""
    if k is None:
        return g
    n = g.shape[-1]
    halves = g.reshape(*g.shape[:-1], 2, n // (2 * k), k)
    return halves.transpose(-3, -2).reshape(g.shape)


__all__ = [
    "ActivationOperation",
    "GELU",
    "GEGLU",
    "GLU",
    "QGELU",
    "QGEGLU",
    "QuickGELU",
    "ReLU",
    "ReGLU",
    "SReLU",
    "SReGLU",
    "SiLU",
    "SwiGLU",
    "ClampedSwiGLU",
]


class ActivationOperation(BasicOperation):
    """Base of the activation operations.

    Parameters
    ----------
    cache_quantized_input : bool, default False
        Inside ``te.autocast``, keep the input for the backward in FP8 (E4M3, current scaling)
        instead of high precision: less memory, a slightly less exact gradient.
    """

    _activation_name: str = ""
    # Gated kinds whose input may come with its halves interleaved (SwiGLU and its variants).
    glu_interleave_size: int | None = None

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        self.cache_quantized_input = cache_quantized_input

    def _spec(self) -> ActivationSpec:
        return activation_spec(self._activation_name)

    @property
    def fusible(self) -> bool:
        """Whether the fused activation ops may take this op's place: not with an interleaved
        input, as their kernels read the two halves contiguous."""
        return self.glu_interleave_size is None

    def to_halves(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with contiguous halves (see :func:`glu_to_halves`)."""
        return glu_to_halves(type(self).__name__, x, self.glu_interleave_size)

    def from_halves(self, g: torch.Tensor) -> torch.Tensor:
        """The input gradient back to the input's layout (see :func:`glu_from_halves`)."""
        return glu_from_halves(g, self.glu_interleave_size)

    def activation_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        """Apply the activation and save what :meth:`op_backward` needs into ``ctx``."""
        x = self.to_halves(plain(input_))
        output = activation_forward(x, self._spec())
        self.save_input(ctx, x)
        return output

    def save_input(self, ctx: OperationContext, x: torch.Tensor) -> None:
        """Keep the (plain) input ``x`` for :meth:`op_backward` when ``ctx`` needs a backward:
        as it is, or in FP8 with ``cache_quantized_input`` inside ``te.autocast``."""
        if not ctx.requires_grad:
            return
        saved = x
        if self.cache_quantized_input and FP8GlobalStateManager.is_fp8_enabled():
            quantizer = Float8CurrentScalingQuantizer(
                torch.float8_e4m3fn, device=x.device, rowwise=True, columnwise=False
            )
            quantizer.internal = True
            saved = quantizer.quantize_impl(x)
        ctx.save_for_backward(saved)

    def saved_input(self, ctx: OperationContext) -> torch.Tensor:
        """The input :meth:`save_input` kept, as a plain tensor (in backward)."""
        (saved,) = ctx.saved_tensors
        return plain(saved)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        return self.activation_forward(ctx, input_)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        x = self.saved_input(ctx)  # contiguous halves
        grad = plain(grad_output)
        return self.from_halves(activation_backward(grad.to(x.dtype), x, self._spec())), []


class GELU(ActivationOperation):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    _activation_name = "gelu"


class GEGLU(ActivationOperation):
    """Gated GELU: ``gelu(x1) * x2`` with ``x1, x2`` the halves of the last dimension."""

    _activation_name = "geglu"


class GLU(ActivationOperation):
    """Gated linear unit: ``sigmoid(x1) * x2`` (gates the *first* half)."""

    _activation_name = "glu"


class QGELU(ActivationOperation):
    """Quick GELU: ``x * sigmoid(1.702 x)``."""

    _activation_name = "qgelu"


QuickGELU = QGELU


class QGEGLU(ActivationOperation):
    """Gated quick GELU: ``qgelu(x1) * x2``."""

    _activation_name = "qgeglu"


class ReLU(ActivationOperation):
    """ReLU: ``max(x, 0)`` (derivative 0 at 0)."""

    _activation_name = "relu"


class ReGLU(ActivationOperation):
    """Gated ReLU: ``relu(x1) * x2``."""

    _activation_name = "reglu"


class SReLU(ActivationOperation):
    """Squared ReLU: ``relu(x)^2``."""

    _activation_name = "srelu"


class SReGLU(ActivationOperation):
    """Gated squared ReLU: ``relu(x1)^2 * x2``."""

    _activation_name = "sreglu"


class SiLU(ActivationOperation):
    """SiLU (swish): ``x * sigmoid(x)``."""

    _activation_name = "silu"


class SwiGLU(ActivationOperation):
    """Gated SiLU: ``silu(x1) * x2``.

    Parameters
    ----------
    cache_quantized_input : bool, default False
    glu_interleave_size : int, optional
        The input's halves interleaved in blocks of this many columns,
        ``[G0:k, V0:k, Gk:2k, Vk:2k, ...]`` (what an FC1 weight reordered by
        :func:`transformer_engine.pytorch.interleave_glu_tensor` produces); ``None``: contiguous
        halves ``[G, V]``. The input is reordered to contiguous halves for the kernels and the
        gradient back, so the op then runs outside the fused activation ops.
    """

    _activation_name = "swiglu"

    def __init__(
        self, *, cache_quantized_input: bool = False, glu_interleave_size: int | None = None
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.glu_interleave_size = check_glu_interleave_size(
            type(self).__name__, glu_interleave_size
        )


class ClampedSwiGLU(SwiGLU):
    """SwiGLU with clamped halves (GPT-OSS): ``a sigmoid(alpha a) (b + glu_linear_offset)`` with
    ``a = min(x1, limit)`` and ``b = clamp(x2, -limit, limit)``."""

    _activation_name = "clamped_swiglu"

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
    ) -> None:
        super().__init__(
            cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size
        )
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset

    def _spec(self) -> ActivationSpec:
        return activation_spec(
            "clamped_swiglu",
            limit=self.limit,
            alpha=self.alpha,
            glu_linear_offset=self.glu_linear_offset,
        )
