"""``LayerNorm`` and ``RMSNorm`` operations on the normalization functions the modules use
(``functional/normalization.py``: float32 statistics, output in the input's dtype).

The forward keeps the input, the effective scale and the per-row statistics; the backward
runs the same kernels as autograd through those functions (no recomputed forward), so both
give the same bits.
"""

from __future__ import annotations

import torch

from ...device import construction_device, materialization_device
from ...functional.normalization import (
    check_eps,
    norm_backward,
    norm_forward_fp8_with_state,
    norm_forward_with_state,
    normalized_dims,
)
from ..op import BasicOperation, OperationContext
from ._common import check_params_dtype, plain

__all__ = ["LayerNorm", "RMSNorm"]


def _replace_meta(op: BasicOperation, name: str, device) -> torch.nn.Parameter:
    old = getattr(op, name)
    new = torch.nn.Parameter(
        torch.empty(old.shape, dtype=old.dtype, device=materialization_device(device)),
        requires_grad=old.requires_grad,
    )
    for attr, value in vars(old).items():
        if not isinstance(value, torch.Tensor):
            setattr(new, attr, value)
    setattr(op, name, new)
    return new


class _Normalization(BasicOperation):
    _param_names: tuple[str, ...] = ()

    def __init__(self, owner, normalized_shape, eps, device, dtype, zero_centered_gamma, sm_margin):
        super().__init__()
        if isinstance(sm_margin, dict):
            sm_margin = dict(sm_margin)
        elif isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
            raise ValueError(f"{owner}: sm_margin={sm_margin!r} must be an int >= 0 (or a dict)")
        self.normalized_shape = normalized_dims(owner, normalized_shape, None)
        self.eps = check_eps(owner, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sm_margin = sm_margin  # SM reservation of the CUDA kernels; no effect here
        dtype = check_params_dtype(owner, dtype)
        device = construction_device(owner, device)
        for name in self._param_names:
            self.register_parameter(
                name,
                torch.nn.Parameter(torch.empty(self.normalized_shape, dtype=dtype, device=device)),
            )
        if device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self, device=None) -> None:
        """Weight to one (zero with ``zero_centered_gamma``), bias to zero. Meta parameters
        are materialized first (on ``device`` if given, else the current CUDA device, else the
        CPU); parameters with storage are reset in place."""
        for name in self._param_names:
            param = getattr(self, name)
            if param.is_meta:
                param = _replace_meta(self, name, device)
            with torch.no_grad():
                if name == "weight" and not self.zero_centered_gamma:
                    param.fill_(1.0)
                else:
                    param.zero_()

    _rms = False

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        self._check_input(input_)
        x = plain(input_)
        params = [getattr(self, name) for name in self._param_names]
        bias = params[1] if len(params) > 1 else None
        y, tensors, state = norm_forward_with_state(
            x, params[0], bias, self.eps, self.zero_centered_gamma, rms=self._rms
        )
        self._save(ctx, tensors, state, params)
        return y

    def op_forward_fp8(self, ctx: OperationContext, input_: torch.Tensor, quantizer, *,
                       columnwise: bool):  # fmt: skip
        """:meth:`op_forward` with the output cast by ``quantizer`` (a per-tensor FP8 quantizer
        that takes produced tensors) as internal storage with the row-wise bytes and, with
        ``columnwise``, the transposed copy: written by the norm kernel itself where the native
        kernels run, the bytes of the norm followed by that cast. The last dimension of the
        input must be the whole normalized size."""
        self._check_input(input_)
        x = plain(input_)
        params = [getattr(self, name) for name in self._param_names]
        bias = params[1] if len(params) > 1 else None
        internal, quantizer.internal = quantizer.internal, True
        try:
            out, tensors, state = norm_forward_fp8_with_state(
                x, params[0], bias, self.eps, self.zero_centered_gamma, rms=self._rms,
                quantizer=quantizer, columnwise=columnwise,
            )  # fmt: skip
        finally:
            quantizer.internal = internal
        self._save(ctx, tensors, state, params)
        return out

    @staticmethod
    def _save(ctx, tensors, state, params) -> None:
        if ctx.requires_grad:
            ctx.save_for_backward(*tensors)
            ctx.norm_state = state
            ctx.param_requires_grad = [p.requires_grad for p in params]

    def _check_input(self, input_) -> None:
        trailing = tuple(input_.shape[max(input_.dim() - len(self.normalized_shape), 0) :])
        if trailing != self.normalized_shape:
            raise ValueError(
                f"{type(self).__name__}: the input has shape {tuple(input_.shape)}, whose "
                f"trailing dimensions must be normalized_shape={self.normalized_shape}"
            )

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        x = ctx.saved_tensors[0]
        grad_output = plain(grad_output).to(x.dtype)
        wanted = [ctx.input_requires_grad, *ctx.param_requires_grad]
        needs = (*wanted, False)[:3]
        dx, dweight, dbias = norm_backward(grad_output, ctx.saved_tensors, ctx.norm_state, needs)
        return dx, [dweight, dbias][: len(self._param_names)]


class LayerNorm(_Normalization):
    """Layer normalization over the trailing ``normalized_shape`` dimensions (together):
    ``(x - mean) / sqrt(var + eps) * w + b``, with ``w`` and ``b`` of that shape.

    Parameters
    ----------
    normalized_shape : int or sequence of ints
    eps : float, default 1e-5
    device : torch.device or str, optional
        ``"meta"`` defers initialization (materialized on the first forward onto the input's
        device, or by ``reset_parameters()``).
    dtype : torch.dtype, optional
    zero_centered_gamma : bool, default False
        ``weight`` stores ``gamma - 1`` (starts at zero; the norm scales by ``1 + weight``).
    sm_margin : int or dict, default 0
        SMs left free by the CUDA kernels upstream; accepted, no effect here.
    """

    _param_names = ("weight", "bias")

    def __init__(
        self,
        normalized_shape,
        *,
        eps: float = 1e-5,
        device=None,
        dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        sm_margin=0,
    ) -> None:
        super().__init__(
            "LayerNorm", normalized_shape, eps, device, dtype, zero_centered_gamma, sm_margin
        )


class RMSNorm(_Normalization):
    """Root-mean-square normalization over the trailing ``normalized_shape`` dimensions:
    ``x / sqrt(mean(x^2) + eps) * w``.

    Parameters are those of :class:`LayerNorm` (there is no bias).
    """

    _param_names = ("weight",)
    _rms = True

    def __init__(
        self,
        normalized_shape,
        *,
        eps: float = 1e-5,
        device=None,
        dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        sm_margin: int = 0,
    ) -> None:
        super().__init__(
            "RMSNorm", normalized_shape, eps, device, dtype, zero_centered_gamma, sm_margin
        )
