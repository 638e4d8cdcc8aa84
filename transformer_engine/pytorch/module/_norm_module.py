"""``_NormModule``: the module logic ``te.LayerNorm`` and ``te.RMSNorm`` share.

A subclass names its parameters, how each is initialized (``_norm_params``) and the functional
norm it calls (``_norm_fn``); everything else lives here: the constructor and its deprecated
aliases, the ``sequence_parallel`` attribute on the parameters, materialization of meta
parameters, the deprecated ``*_ln_sm_margin`` properties and the forward's input checks.
Messages name the concrete class (``type(self).__name__``). The argument rules themselves are
the stateless helpers in ``_normalization.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from ..device import construction_device, first_storage_device, materialization_device
from ._normalization import (
    check_eps,
    check_module_input,
    check_sm_margin,
    materialize_parameter,
    normalized_size,
    resolve_params_dtype,
)

__all__ = ["_NormModule", "gamma_initial_value", "zero_initial_value"]


def gamma_initial_value(module: _NormModule) -> float:
    """The scale starts at 1: stored as 0 with ``zero_centered_gamma``, else as 1."""
    return 0.0 if module.zero_centered_gamma else 1.0


def zero_initial_value(module: _NormModule) -> float:
    """A shift starts at 0."""
    return 0.0


class _NormModule(torch.nn.Module):
    """Normalization over the last dimension with one 1-D parameter per entry of ``_norm_params``.

    Subclasses set:

    ``_norm_params``
        ``(name, initial_value)`` pairs, in registration order; ``initial_value(module)`` is the
        value ``reset_parameters`` fills the parameter with. The first one is the scale
        (``weight``), whose device the forward checks the input against.
    ``_norm_fn``
        The functional norm (a ``staticmethod``), called as
        ``_norm_fn(inp, *params, eps, zero_centered_gamma)`` with the parameters in
        ``_norm_params`` order.

    Subclasses inherit the constructor rather than wrap it, so that the deprecation warnings of
    the argument helpers (``stacklevel=3``) keep pointing at the caller's line.
    """

    _norm_params: ClassVar[tuple[tuple[str, Callable[[_NormModule], float]], ...]]
    _norm_fn: ClassVar[Callable[..., torch.Tensor]]

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
        device = construction_device(owner, device)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"{owner}: sequence_parallel must be a bool, got {sequence_parallel!r}")

        self.normalized_shape = (size,)
        self.eps = check_eps(owner, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = sequence_parallel
        self.sm_margin = check_sm_margin(owner, sm_margin)

        for name, _ in self._norm_params:
            param = torch.nn.Parameter(torch.empty(size, device=device, dtype=dtype))
            setattr(self, name, param)
        self._mark_sequence_parallel()
        if device.type != "meta":
            self.reset_parameters()

    def _norm_parameters(self) -> list[torch.nn.Parameter]:
        return [getattr(self, name) for name, _ in self._norm_params]

    def _mark_sequence_parallel(self) -> None:
        if self.sequence_parallel is None:
            return
        for param in self._norm_parameters():
            param.sequence_parallel = self.sequence_parallel

    def _apply(self, fn, recurse=True):
        # Moves that change the tensor type (meta -> cpu in to_empty, for one) replace the
        # Parameter objects and drop their attributes; put sequence_parallel back.
        module = super()._apply(fn, recurse)
        self._mark_sequence_parallel()
        return module

    def _warn_deprecated(self, name: str, replacement: str) -> None:
        # stacklevel=3: past this helper and the deprecated method, to the caller's line.
        warnings.warn(
            f"{type(self).__name__}.{name} is deprecated; use {replacement}",
            DeprecationWarning,
            stacklevel=3,
        )

    def reset_parameters(self, defer_init: bool | None = None) -> None:
        """Materialize meta parameters and initialize them.

        Meta parameters move to the device the other parameters already hold storage on (e.g.
        after ``module.to_empty(device=...)``), else to the current CUDA device when CUDA is
        available, else to the CPU. ``weight`` is set to 1 (0 with ``zero_centered_gamma``)
        and ``bias``, on modules that have one, to 0.

        Parameters
        ----------
        defer_init : bool, optional
            Deprecated: build the module with ``device="meta"`` instead. ``True`` returns
            without doing anything.
        """
        if defer_init is not None:
            warnings.warn(
                f"{type(self).__name__}.reset_parameters: defer_init is deprecated; build the "
                "module with device='meta' to defer initialization",
                DeprecationWarning,
                stacklevel=2,
            )
            if defer_init:
                return
        device = materialization_device(first_storage_device(*self._norm_parameters()))
        for name, _ in self._norm_params:
            param = getattr(self, name)
            if param.is_meta:
                setattr(self, name, materialize_parameter(param, device))
        self._mark_sequence_parallel()
        with torch.no_grad():
            for name, initial_value in self._norm_params:
                getattr(self, name).fill_(initial_value(self))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize ``inp`` over its last dimension; same shape, dtype and device as ``inp``.

        Parameters
        ----------
        inp : torch.Tensor
            Input of shape ``(..., normalized_shape)`` on the parameters' device.
        """
        check_module_input(type(self).__name__, inp, self.weight)
        return self._norm_fn(inp, *self._norm_parameters(), self.eps, self.zero_centered_gamma)

    @property
    def fwd_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        self._warn_deprecated("fwd_ln_sm_margin", "sm_margin")
        return self.sm_margin

    @property
    def bwd_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        self._warn_deprecated("bwd_ln_sm_margin", "sm_margin")
        return self.sm_margin

    @property
    def inf_ln_sm_margin(self) -> int:
        """Deprecated: use ``sm_margin``."""
        self._warn_deprecated("inf_ln_sm_margin", "sm_margin")
        return self.sm_margin

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )
