"""Constructor arguments of older Transformer Engine releases that clients still pass.

``DelayedScaling`` once had ``interval`` (how often scales were recomputed; unused even then)
and ``override_linear_precision`` (a ``(fprop, dgrad, wgrad)`` triple asking for some GEMMs in
high precision). Current upstream has neither field and silently drops both, yet real clients
still pass them: Megatron-LM builds ``DelayedScaling(..., override_linear_precision=(False,
False, not fp8_wgrad))`` and Hugging Face accelerate forwards ``interval`` when its user sets it.

They are accepted here as constructor-only arguments (not fields: they are not stored, compared,
printed or saved), so such code runs as it does upstream, with all GEMMs in FP8 and scales
updated every step. Unlike upstream, a value whose request this package does not carry out
(``interval`` other than 1, any GEMM asked for in high precision) draws a ``UserWarning``
naming the argument, so nobody believes their wgrad runs in high precision when it does not.
A value of the wrong type is refused like any other bad recipe argument.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

__all__ = ["check_interval", "check_override_linear_precision"]

_GEMMS = ("fprop", "dgrad", "wgrad")
# From the check, through the recipe's __post_init__ and the dataclass __init__, to the caller.
_CALLER = 4


def check_interval(owner: str, interval: Any) -> None:
    """``interval``: None (not given) or an int >= 1; anything but 1 is warned about."""
    if interval is None:
        return
    if isinstance(interval, bool) or not isinstance(interval, numbers.Integral):
        raise TypeError(
            f"{owner}: interval must be an int >= 1, got {interval!r} "
            f"({type(interval).__name__}); it is ignored anyway: leave it out"
        )
    if interval < 1:
        raise ValueError(f"{owner}: interval must be >= 1, got {interval!r}; leave it out")
    if interval != 1:
        warnings.warn(
            f"{owner}: interval={interval} is accepted for compatibility and ignored, as in "
            f"upstream Transformer Engine (which removed it): scales are recomputed every step",
            UserWarning,
            stacklevel=_CALLER,
        )


def check_override_linear_precision(owner: str, value: Any) -> None:
    """``override_linear_precision``: None or three bools ``(fprop, dgrad, wgrad)``; a True
    entry is warned about (the GEMM still runs in FP8)."""
    if value is None:
        return
    if (
        not isinstance(value, (tuple, list))
        or len(value) != len(_GEMMS)
        or not all(isinstance(v, bool) for v in value)
    ):
        raise TypeError(
            f"{owner}: override_linear_precision must be three bools (fprop, dgrad, wgrad), "
            f"got {value!r}; it has no effect here: leave it out"
        )
    high = [gemm for gemm, flag in zip(_GEMMS, value, strict=True) if flag]
    if high:
        warnings.warn(
            f"{owner}: override_linear_precision={tuple(value)} asks for the "
            f"{'/'.join(high)} GEMM in high precision; like current upstream Transformer "
            f"Engine, this package has no such option and runs fprop, dgrad and wgrad in FP8. "
            f"For a high-precision backward use "
            f"Float8CurrentScaling(backward_override='high_precision')",
            UserWarning,
            stacklevel=_CALLER,
        )
