"""``te.LayerNorm``: layer normalization over the last dimension."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ._normalization import (
    check_eps,
    check_module_input,
    check_sm_margin,
    layernorm,
    materialization_device,
    materialize_parameter,
    normalized_size,
    resolve_construction_device,
    resolve_params_dtype,
)

__all__ = ["LayerNorm"]


class LayerNorm(torch.nn.Module):
    r"""Layer normalization over the last dimension of the input.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \varepsilon}} \cdot \gamma + \beta

    Upstream Transformer Engine builds this module on the fusible-ops API (it subclasses
    ``te.ops.LayerNorm``); this project adds that API later, so for now it is a plain
    ``torch.nn.Module`` with the same constructor, parameters and forward.

    Parameters
    ----------
    normalized_shape : int or iterable of int
        Size of the normalized (last) dimension. Only one dimension can be normalized: an int
        or a one-element tuple, list or ``torch.Size``.
    eps : float, default = 1e-5
        Added to the variance for numerical stability.
    sequence_parallel : bool, optional
        Sets the attribute ``sequence_parallel`` on the parameters (used by Megatron-style
        gradient reductions). ``None`` sets nothing.
    params_dtype : torch.dtype, optional
        Deprecated alias of ``dtype``.
    zero_centered_gamma : bool, default = `False`
        Store :math:`\gamma - 1` in ``weight`` (initialized to 0) and scale by
        ``1 + weight``, so that weight decay pulls the scale towards 1.
    hidden_size : int, optional
        Deprecated alias of ``normalized_shape``.
    device : torch.device or str, optional
        Device of the parameters. ``None`` means the current CUDA device when CUDA is
        available, else the CPU; ``"cuda"`` without an index means the current CUDA device at
        construction. ``"meta"`` defers initialization: no storage is allocated until
        ``reset_parameters()`` (optionally after ``module.to_empty(device=...)``).
    dtype : torch.dtype, optional
        Parameter dtype; default ``torch.get_default_dtype()``.
    sm_margin : int, default = 0
        Number of SMs to leave free for concurrent communication kernels. Kept for
        compatibility: the PyTorch implementation launches no kernels of its own.

    Attributes
    ----------
    weight : torch.nn.Parameter
        :math:`\gamma` of shape ``(normalized_shape,)``, initialized to 1 (0 with
        ``zero_centered_gamma``).
    bias : torch.nn.Parameter
        :math:`\beta` of shape ``(normalized_shape,)``, initialized to 0.

    Notes
    -----
    The statistics and the affine transform are computed in float32 whatever the dtype of the
    input or the parameters; the output has the input's dtype. The forward runs on the input's
    device, which must be the parameters' device.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int] | None = None,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        hidden_size: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sm_margin: int = 0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        size = normalized_size(owner, normalized_shape, hidden_size)
        dtype = resolve_params_dtype(owner, dtype, params_dtype)
        device = resolve_construction_device(owner, device)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"{owner}: sequence_parallel must be a bool, got {sequence_parallel!r}")

        self.normalized_shape = (size,)
        self.eps = check_eps(owner, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = sequence_parallel
        self.sm_margin = check_sm_margin(owner, sm_margin)

        self.weight = torch.nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self._mark_sequence_parallel()
        if device.type != "meta":
            self.reset_parameters()

    def _mark_sequence_parallel(self) -> None:
        if self.sequence_parallel is None:
            return
        for param in (self.weight, self.bias):
            param.sequence_parallel = self.sequence_parallel

    def _apply(self, fn, recurse=True):
        # Moves that change the tensor type (meta -> cpu in to_empty, for one) replace the
        # Parameter objects and drop their attributes; put sequence_parallel back.
        module = super()._apply(fn, recurse)
        self._mark_sequence_parallel()
        return module

    def reset_parameters(self, defer_init: bool | None = None) -> None:
        """Materialize meta parameters and initialize ``weight`` and ``bias``.

        Meta parameters move to the device the other parameters already hold storage on (e.g.
        after ``module.to_empty(device=...)``), else to the current CUDA device when CUDA is
        available, else to the CPU. ``weight`` is set to 1 (0 with ``zero_centered_gamma``)
        and ``bias`` to 0.

        Parameters
        ----------
        defer_init : bool, optional
            Deprecated: build the module with ``device="meta"`` instead. ``True`` returns
            without doing anything.
        """
        if defer_init is not None:
            warnings.warn(
                "LayerNorm.reset_parameters: defer_init is deprecated; build the module with "
                "device='meta' to defer initialization",
                DeprecationWarning,
                stacklevel=2,
            )
            if defer_init:
                return
        device = materialization_device(self.weight, self.bias)
        if self.weight.is_meta:
            self.weight = materialize_parameter(self.weight, device)
        if self.bias.is_meta:
            self.bias = materialize_parameter(self.bias, device)
        self._mark_sequence_parallel()
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            self.bias.zero_()

    def reset_layer_norm_parameters(self) -> None:
        """Deprecated alias of :meth:`reset_parameters`."""
        warnings.warn(
            "LayerNorm.reset_layer_norm_parameters is deprecated; use reset_parameters",
            DeprecationWarning,
            stacklevel=2,
        )
        self.reset_parameters()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize ``inp`` over its last dimension; same shape, dtype and device as ``inp``.

        Parameters
        ----------
        inp : torch.Tensor
            Input of shape ``(..., normalized_shape)`` on the parameters' device.
        """
        check_module_input(type(self).__name__, inp, self.weight)
        return layernorm(inp, self.weight, self.bias, self.eps, self.zero_centered_gamma)

    @property
    def fwd_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        warnings.warn(
            "LayerNorm.fwd_ln_sm_margin is deprecated; use sm_margin",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sm_margin

    @property
    def bwd_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        warnings.warn(
            "LayerNorm.bwd_ln_sm_margin is deprecated; use sm_margin",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sm_margin

    @property
    def inf_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        warnings.warn(
            "LayerNorm.inf_ln_sm_margin is deprecated; use sm_margin",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sm_margin

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )
