"""``_NormModule``: the module logic ``te.LayerNorm`` and ``te.RMSNorm`` share.

A subclass names its parameters, how each is initialized (``_norm_params``) and the functional
norm it calls (``_norm_fn``); everything else lives here: the constructor and its deprecated
aliases, the ``sequence_parallel`` attribute on the parameters, materialization of meta
parameters, the deprecated ``*_ln_sm_margin`` properties and the forward's input checks.
Messages name the concrete class (``type(self).__name__``). The argument rules the norm
operations share too live in ``functional/normalization.py``; the module-only ones are at the
end of this file.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from ..device import construction_device, first_storage_device, materialization_device
from ..extra_state import empty_extra_state
from ..functional.normalization import check_eps, normalized_dims

__all__ = ["_NormModule", "gamma_initial_value", "zero_initial_value"]


def gamma_initial_value(module: _NormModule) -> float:
    """The scale starts at 1: stored as 0 with ``zero_centered_gamma``, else as 1."""
    return 0.0 if module.zero_centered_gamma else 1.0


def zero_initial_value(module: _NormModule) -> float:
    """A shift starts at 0."""
    return 0.0


class _NormModule(torch.nn.Module):
    """Normalization over the trailing ``normalized_shape`` dimensions, with one parameter of
    that shape per entry of ``_norm_params``.

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
        shape = normalized_dims(owner, normalized_shape, hidden_size)
        dtype = resolve_params_dtype(owner, dtype, params_dtype)
        device = construction_device(owner, device)
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"{owner}: sequence_parallel must be a bool, got {sequence_parallel!r}")

        self.normalized_shape = shape
        self.eps = check_eps(owner, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = sequence_parallel
        self.sm_margin = check_sm_margin(owner, sm_margin)

        for name, _ in self._norm_params:
            param = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
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
        """Normalize ``inp`` over its trailing ``normalized_shape`` dimensions; same shape, dtype
        and device as ``inp``.

        Parameters
        ----------
        inp : torch.Tensor
            Input of shape ``(..., *normalized_shape)`` on the parameters' device.
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

    # -- checkpoints ---------------------------------------------------------------------------
    # Upstream's te.LayerNorm / te.RMSNorm are te.ops operations, whose state dict carries an
    # "_extra_state" entry; a normalization has no quantizers, so upstream always writes an empty
    # torch.uint8 tensor there. The same entry is written and read here, so state dicts load
    # strictly in both directions.
    def get_extra_state(self) -> torch.Tensor:
        """Upstream's "no state": an empty ``torch.uint8`` tensor (a norm has no FP8 state)."""
        return empty_extra_state()

    def set_extra_state(self, state) -> None:
        """Accept ``None`` or an empty tensor (what upstream's and this package's norms write);
        anything else is refused, since a normalization has no state it could restore."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        held = (
            f"a {state.dtype} tensor of {state.numel()} elements"
            if isinstance(state, torch.Tensor)
            else f"a {type(state).__name__}"
        )
        raise ValueError(
            f"{type(self).__name__}: the checkpoint's _extra_state is {held}, but a "
            "normalization has no extra state: expected None or an empty tensor (what upstream's "
            "te.LayerNorm / te.RMSNorm write); the entry may be another module's FP8 state, "
            "saved under this module's key"
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # The entry is optional on load: state dicts of torch.nn.LayerNorm / torch.nn.RMSNorm
        # and of earlier versions of these modules (parameters only) still load strictly.
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)


# --- Construction and forward rules of the norm modules ------------------------------------------


def resolve_params_dtype(
    owner: str, dtype: torch.dtype | None, params_dtype: torch.dtype | None
) -> torch.dtype:
    """The parameter dtype from ``dtype`` or its deprecated alias ``params_dtype``."""
    if params_dtype is not None:
        warnings.warn(
            f"{owner}: params_dtype is deprecated; pass dtype instead",
            DeprecationWarning,
            stacklevel=3,
        )
        if dtype is not None:
            raise TypeError(
                f"{owner}: got dtype={dtype} and params_dtype={params_dtype}; pass dtype only"
            )
        dtype = params_dtype
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}: dtype must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def materialize_parameter(param: torch.nn.Parameter, device: torch.device) -> torch.nn.Parameter:
    """A new, uninitialized parameter on ``device`` that replaces the meta ``param``.

    Attributes set on ``param`` (e.g. ``sequence_parallel``) carry over; ``requires_grad`` too.
    """
    new = torch.nn.Parameter(
        torch.empty(param.shape, dtype=param.dtype, device=device),
        requires_grad=param.requires_grad,
    )
    new.__dict__.update(param.__dict__)
    return new


def check_sm_margin(owner: str, sm_margin: int) -> int:
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int):
        raise TypeError(f"{owner}: sm_margin must be an int, got {sm_margin!r}")
    if sm_margin < 0:
        raise ValueError(f"{owner}: sm_margin must be non-negative, got {sm_margin}")
    return sm_margin


def check_module_input(owner: str, inp: torch.Tensor, weight: torch.Tensor) -> None:
    """A module's forward runs on its parameters' device, which must be the input's device."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{owner}: the input must be a torch.Tensor, got {type(inp).__name__}")
    if weight.is_meta:
        raise ValueError(
            f"{owner}: the parameters are on the meta device and hold no data; call "
            "reset_parameters() (or module.to_empty(device=...) and then reset_parameters()) "
            "before the forward"
        )
    if inp.is_meta:
        raise ValueError(
            f"{owner}: the input is a meta tensor and holds no data, but the parameters are on "
            f"{weight.device}; pass an input on {weight.device}"
        )
    if inp.device != weight.device:
        raise ValueError(
            f"{owner}: the input is on {inp.device} but the parameters are on {weight.device}; "
            f"move the input to {weight.device}, or the module to {inp.device} with "
            "module.to(...)"
        )
