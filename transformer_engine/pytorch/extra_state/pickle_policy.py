"""Deciding, without unpickling, whether an upstream extra-state pickle must be loaded.

Upstream Transformer Engine stores a module's FP8 state as pickle bytes. Only delayed scaling
has state worth restoring; stateless recipes (current scaling and the block-scaled ones) need
nothing from a checkpoint. So a payload is classified from what it *names* (its globals and
its string constants, read with :mod:`pickletools`, never executed):

* **ignored** (nothing to restore, safe to skip): empty bytes; a payload with no globals and
  none of the delayed-scaling tensor keys (e.g. ``pickle.dumps({})``); a payload with a
  ``"recipe"`` key whose recipe classes are all stateless or dynamic and which has no
  delayed-scaling keys;
* **needs an unsafe load**: everything else: no ``"recipe"`` key (TE 1.x, which only wrote
  delayed scaling), ``DelayedScaling`` named, delayed-scaling keys present, any global that is
  not a recipe-module name, or bytes that are not a well-formed pickle. Those are unpickled only
  when ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``.

This is upstream's policy (``transformer_engine.pytorch._extra_state`` re-exports it by its
upstream names); :mod:`.upstream_pickle` applies it when a module loads such a payload.

Environment variables
---------------------
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``
    Exactly ``"1"`` allows unpickling; any other value, or unset, refuses. Read at every call.
"""

from __future__ import annotations

import enum
import os
import pickletools
from typing import Any, NamedTuple

from ...common import recipe as _recipe_module
from .contents import TENSOR_NAMES

__all__ = [
    "UNSAFE_PICKLE_EXTRA_STATE_ENV",
    "unsafe_pickle_allowed",
    "PickleScan",
    "scan_pickle",
    "CheckpointExtraStatePolicy",
    "RECIPE_POLICIES",
    "recipe_extra_state_policy",
    "is_stateless_recipe",
    "payload_needs_unsafe_load",
    "should_load_extra_state_pickle",
]

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def unsafe_pickle_allowed() -> bool:
    """Whether ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` is exactly ``"1"``, read now."""
    return os.environ.get(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1"


class CheckpointExtraStatePolicy(enum.Enum):
    """What a recipe keeps in a checkpoint's extra state."""

    STATELESS = "stateless"  # nothing: scales come from each tensor
    STATEFUL_FP8_DELAYED_SCALING = "stateful_fp8_delayed_scaling"  # scales and amax histories
    DYNAMIC = "dynamic"  # depends on the user's quantizers (CustomRecipe)


_RECIPE_MODULE = "transformer_engine.common.recipe"

# Keyed by (module, class name), as a pickle names them, so upstream recipes this package does
# not build yet are still classified correctly when they appear in a checkpoint.
RECIPE_POLICIES: dict[tuple[str, str], CheckpointExtraStatePolicy] = {
    (_RECIPE_MODULE, "DelayedScaling"): CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING,
    (_RECIPE_MODULE, "Float8CurrentScaling"): CheckpointExtraStatePolicy.STATELESS,
    (_RECIPE_MODULE, "MXFP8BlockScaling"): CheckpointExtraStatePolicy.STATELESS,
    (_RECIPE_MODULE, "Float8BlockScaling"): CheckpointExtraStatePolicy.STATELESS,
    (_RECIPE_MODULE, "NVFP4BlockScaling"): CheckpointExtraStatePolicy.STATELESS,
    (_RECIPE_MODULE, "CustomRecipe"): CheckpointExtraStatePolicy.DYNAMIC,
}

# Other names of the recipe module that pickled recipes reference as plain data (the format
# enum and its value tuple, GEMM and quantization parameters, an option of older releases).
_RECIPE_DATA_NAMES = frozenset(
    ("Format", "_FormatHelper", "_FormatMaxima", "MMParams", "QParams", "_OverrideLinearPrecision")
)


def recipe_extra_state_policy(recipe: Any) -> CheckpointExtraStatePolicy | None:
    """The policy of ``recipe``'s exact class; ``None`` for anything else, subclasses included
    (a subclass may keep state its base does not, so it is never assumed stateless)."""
    cls = type(recipe)
    if getattr(_recipe_module, cls.__name__, None) is not cls:
        return None
    return RECIPE_POLICIES.get((_RECIPE_MODULE, cls.__name__))


def is_stateless_recipe(recipe: Any) -> bool:
    """Whether ``recipe`` (exact class) keeps nothing in a checkpoint."""
    return recipe_extra_state_policy(recipe) is CheckpointExtraStatePolicy.STATELESS


_STRING_PUSHES = frozenset(
    (
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "UNICODE",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
    )
)


class PickleScan(NamedTuple):
    """What a pickle names, found without running it: its globals and its string constants."""

    globals: list[str]
    strings: set[str]


def scan_pickle(payload: bytes) -> PickleScan:
    """The ``module.name`` globals a pickle would import, and the strings it pushes (dict keys
    among them), found without unpickling it.

    Any opcode that can reach a callable is reported: ``GLOBAL``/``INST`` (their argument is
    the name), ``STACK_GLOBAL`` (names pushed as strings just before, possibly through the memo;
    reported as ``<unresolved STACK_GLOBAL>`` when they cannot be followed), ``EXT1/2/4``
    (copyreg's extension registry) and persistent ids. Without any of these an unpickler can
    only build builtin scalars and containers.

    Raises
    ------
    ValueError
        ``payload`` is not a well-formed pickle.
    """
    found: list[str] = []
    strings: set[str] = set()
    pushed: list[Any] = []  # what recent opcodes pushed; None when it is not a string
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(payload):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                found.append(f"{module}.{qualname}")
                pushed.append(None)
            elif name == "STACK_GLOBAL":
                module, qualname = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
                if isinstance(module, str) and isinstance(qualname, str):
                    found.append(f"{module}.{qualname}")
                else:
                    found.append("<unresolved STACK_GLOBAL>")
                del pushed[-2:]
                pushed.append(None)
            elif name in ("EXT1", "EXT2", "EXT4"):
                found.append(f"<copyreg extension {arg}>")
                pushed.append(None)
            elif name in ("PERSID", "BINPERSID"):
                found.append("<persistent id>")
                pushed.append(None)
            elif name in _STRING_PUSHES:
                pushed.append(arg)
                if isinstance(arg, str):
                    strings.add(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = pushed[-1] if pushed else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(arg))
            else:
                pushed.append(None)
    except Exception as exc:  # genops raises ValueError, struct.error, UnicodeDecodeError, ...
        raise ValueError(f"extra state is not a well-formed pickle: {exc}") from exc
    return PickleScan(found, strings)


def payload_needs_unsafe_load(data: bytes) -> tuple[bool, list[str] | None]:
    """Classify extra-state pickle bytes: ``(needs_unsafe_load, globals)``.

    ``globals`` are the names the payload would import, or ``None`` when the bytes are not a
    well-formed pickle (which always needs the unsafe load: nothing about it can be known).
    """
    if not data:
        return False, []
    try:
        scan = scan_pickle(data)
    except ValueError:
        return True, None
    has_delayed_keys = any(name in scan.strings for name in TENSOR_NAMES)
    if not scan.globals:
        return has_delayed_keys, scan.globals
    if "recipe" not in scan.strings or has_delayed_keys:
        return True, scan.globals
    policies = []
    for name in scan.globals:
        module, _, qualname = name.rpartition(".")
        if module != _RECIPE_MODULE:
            return True, scan.globals  # e.g. builtins.object, a tensor rebuild, a callable
        if (module, qualname) in RECIPE_POLICIES:
            policies.append(RECIPE_POLICIES[(module, qualname)])
        elif qualname not in _RECIPE_DATA_NAMES:
            return True, scan.globals
    stateful = CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING
    needs = not policies or stateful in policies
    return needs, scan.globals


def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
    """Whether ``data`` (extra-state pickle bytes) must be unpickled, checked without doing so.

    ``False``: the payload holds nothing to restore; skip it. ``True``: it needs an unsafe load
    and ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` allows it. Otherwise ``RuntimeError`` naming
    ``context`` (e.g. the module class) and the environment variable.
    """
    needs, found = payload_needs_unsafe_load(bytes(data))
    if not needs:
        return False
    if unsafe_pickle_allowed():
        return True
    if found is None:
        content = "the bytes are not a well-formed pickle, so they cannot be inspected"
    else:
        unique = list(dict.fromkeys(found))
        content = f"it references {', '.join(unique[:8]) or 'no globals'}"
    raise RuntimeError(
        f"{context}: refusing to unpickle checkpoint extra state: unpickling runs code named in "
        f"the payload, so a tampered checkpoint can execute arbitrary code ({content}). If you "
        f"trust the checkpoint, set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 for one load, then save "
        f"the model again (the new checkpoint needs no opt-in)."
    )
