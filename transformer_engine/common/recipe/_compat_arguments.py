"""Constructor arguments of older Transformer Engine releases that clients still pass.

``DelayedScaling`` once had ``interval`` (how often scales were recomputed; unused even then)
and ``override_linear_precision`` (a ``(fprop, dgrad, wgrad)`` triple asking for some GEMMs in
high precision). Current upstream has neither field and silently drops both, yet real clients
still pass them: Megatron-LM builds ``DelayedScaling(..., override_linear_precision=(False,
False, not fp8_wgrad))`` and Hugging Face accelerate forwards ``interval`` when its user sets it.

They are accepted here as constructor-only arguments (not fields: they are not stored, compared,
printed or saved), so such code runs as it does upstream, with all GEMMs in FP8 and scales
updated every step. Unlike upstream, a value whose request this package does not carry out
(``interval`` other than 1, any GEMM asked for in high precision), or a value this package
cannot read, draws a ``UserWarning`` naming the argument, so nobody believes their wgrad runs in
high precision when it does not. Like upstream, no value raises: both arguments are ignored
whatever they hold.
"""

from __future__ import annotations

from typing import Any

from ._field_checks import lax_bool, lax_int
from ._lenient_init import warn_at_caller

__all__ = ["check_interval", "check_override_linear_precision"]

_GEMMS = ("fprop", "dgrad", "wgrad")


def check_interval(owner: str, interval: Any) -> None:
    """``interval``: None (not given) or an int >= 1; anything but 1 is warned about."""
    steps = None if interval is None else lax_int(interval)
    if interval is None or steps == 1:
        return
    if steps is None or steps < 1:
        warn_at_caller(
            f"{owner}: interval={interval!r} is not an int >= 1; it is ignored anyway, as in "
            f"upstream Transformer Engine (which removed it): leave it out"
        )
        return
    warn_at_caller(
        f"{owner}: interval={interval!r} is accepted for compatibility and ignored, as in "
        f"upstream Transformer Engine (which removed it): scales are recomputed every step"
    )


def check_override_linear_precision(owner: str, value: Any) -> None:
    """``override_linear_precision``: None or three bools ``(fprop, dgrad, wgrad)``; a True
    entry, or a value that is not three bools, is warned about (every GEMM still runs in
    FP8)."""
    if value is None:
        return
    flags = (
        [lax_bool(v) for v in value]
        if isinstance(value, (tuple, list)) and len(value) == len(_GEMMS)
        else [None]
    )
    if None in flags:
        warn_at_caller(
            f"{owner}: override_linear_precision={value!r} is not three bools (fprop, dgrad, "
            f"wgrad); it is ignored, as upstream Transformer Engine ignores the argument: "
            f"fprop, dgrad and wgrad run in FP8. Leave it out"
        )
        return
    high = [gemm for gemm, flag in zip(_GEMMS, flags, strict=True) if flag]
    if high:
        warn_at_caller(
            f"{owner}: override_linear_precision={tuple(value)} asks for the "
            f"{'/'.join(high)} GEMM in high precision; like current upstream Transformer "
            f"Engine, this package has no such option and runs fprop, dgrad and wgrad in FP8. "
            f"For a high-precision backward use "
            f"Float8CurrentScaling(backward_override='high_precision')"
        )
