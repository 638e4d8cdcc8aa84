"""Construction of recipes and their parameter classes as upstream's pydantic dataclasses do it.

Upstream's ``Recipe`` subclasses, ``MMParams`` and ``QParams`` are pydantic dataclasses, whose
constructors drop keyword arguments that are not constructor fields (pydantic's default
``extra="ignore"``) and report a bad call (a missing or surplus argument) as a
``ValidationError``, a ``ValueError``. Code written against them, such as
``Float8CurrentScaling(fp8_quant_fwd_inp=QParams(...))`` (a class attribute there, not a field)
or ``DelayedScaling(some_old_option=...)``, must run here too. :class:`LenientInit`, the
metaclass of those classes, gives every subclass the same constructor behaviour:

- an unknown keyword argument is dropped, as upstream, but with a ``UserWarning`` naming the
  keyword and the class (and the argument it was probably meant to be), so a misspelt
  argument does not vanish without a trace;
- a call that does not fit the constructor raises :class:`RecipeTypeError` (a ``TypeError``
  and a ``ValueError``) naming the class.

Field values themselves are checked and converted by the per-field checks
(``_field_checks.py``) on every assignment, the constructor's included.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import warnings
import weakref
from typing import Any

from ._field_checks import RecipeTypeError

__all__ = ["LenientInit", "close_names", "warn_at_caller", "warn_if_misspelt_field"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Per class: its constructor signature (self left out) and the keyword names it takes, None
# where it takes any (a ``**kwargs`` parameter).
_SIGNATURES: weakref.WeakKeyDictionary[type, tuple[inspect.Signature, frozenset | None]] = (
    weakref.WeakKeyDictionary()
)


def _is_library_frame(frame) -> bool:
    code = frame.f_code
    # dataclass-generated methods are compiled from a string
    return code.co_filename.startswith(_PACKAGE_DIR) or (
        code.co_filename == "<string>" and code.co_name in ("__init__", "__post_init__")
    )


def warn_at_caller(message: str) -> None:
    """A ``UserWarning`` attributed to the first frame outside this package (the user's line
    that built or changed the recipe), however deep the recipe code that noticed it."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and _is_library_frame(frame):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, UserWarning, stacklevel=level)


def close_names(name: str, names) -> list[str]:
    """The names among ``names`` that ``name`` is probably a misspelling of."""
    return difflib.get_close_matches(name, list(names), n=2, cutoff=0.75)


def warn_if_misspelt_field(cls: type, name: str) -> None:
    """Warn when ``name``, set on a ``cls`` recipe but not one of its fields, looks like a
    misspelt field: the value is stored as a plain attribute and changes nothing."""
    guess = close_names(name, [f.name for f in dataclasses.fields(cls)])
    if guess:
        warn_at_caller(
            f"{cls.__name__}: {name!r} is not a field (did you mean "
            f"{' or '.join(map(repr, guess))}?); it is set as a plain attribute and changes "
            f"nothing"
        )


def _signature(cls: type) -> tuple[inspect.Signature, frozenset | None]:
    cached = _SIGNATURES.get(cls)
    if cached is None:
        full = inspect.signature(cls.__init__)
        params = list(full.parameters.values())[1:]  # drop self
        signature = full.replace(parameters=params)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            names = None
        else:
            names = frozenset(
                p.name
                for p in params
                if p.kind
                in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            )
        cached = _SIGNATURES[cls] = (signature, names)
    return cached


def _dropped_message(cls: type, name: str, names: frozenset) -> str:
    what = f"{cls.__name__}: keyword argument {name!r} is not a constructor argument"
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else ()
    if name in fields:
        what += (
            f" ({name} is derived from the other arguments; assign it on the recipe after "
            f"construction to change it)"
        )
    elif hasattr(cls, name) and not callable(getattr(cls, name)):
        what += (
            f" ({name} is a class attribute shared by every {cls.__name__}; assign it on the "
            f"recipe after construction to change it for that recipe)"
        )
    else:
        guess = close_names(name, names)
        if guess:
            what += f" (did you mean {' or '.join(map(repr, guess))}?)"
    return (
        f"{what}; it is ignored, as upstream Transformer Engine's pydantic recipes ignore it. "
        f"The constructor arguments are: {', '.join(sorted(names))}"
    )


class LenientInit(type):
    """Metaclass: unknown keyword arguments are dropped with a warning, and a call that does
    not fit the constructor raises :class:`RecipeTypeError` (see the module docstring)."""

    def __call__(cls, *args: Any, **kwargs: Any):
        signature, names = _signature(cls)
        if names is not None:
            unknown = [k for k in kwargs if k not in names]
            for name in unknown:
                warn_at_caller(_dropped_message(cls, name, names))
                del kwargs[name]
        try:
            return super().__call__(*args, **kwargs)
        except TypeError as exc:
            if isinstance(exc, RecipeTypeError):
                raise
            try:
                signature.bind(*args, **kwargs)
            except TypeError as bad_call:
                raise RecipeTypeError(
                    f"{cls.__name__}: {bad_call}; its arguments are, in order: "
                    f"{', '.join(signature.parameters)}"
                ) from None
            raise  # the arguments fit: a TypeError from inside the constructor itself

    @property
    def __signature__(cls) -> inspect.Signature:
        # inspect.signature(cls) would otherwise report __call__'s (*args, **kwargs).
        return _signature(cls)[0]
