"""FP8 autocast, availability checks, and the process-wide quantization state.

The state is one small object (``FP8GlobalStateManager.quantization_state``) holding the
autocast flags and the amax registry; everything else lives in the modules that own it. The
registry is keyed by direction and autocast (recipe and reduction group) and groups its entries
by device (see :mod:`transformer_engine.pytorch._amax_registry`).

When scales update (delayed scaling):

* forward scales, when the outermost *enabled* autocast exits normally in grad mode;
* backward scales, when the backward of the first FP8 module of the autocast region ends
  (modules call :meth:`FP8GlobalStateManager.reduce_and_update_fp8_tensors` with
  ``forward=False``; the flag that says which module is first comes from
  :meth:`FP8GlobalStateManager.is_first_fp8_module`).

An autocast that exits because of an exception restores the state and performs no update.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..common.recipe import DelayedScaling, Float8CurrentScaling, Recipe
from ._amax_registry import AmaxRegistry
from ._delayed_scaling_python import (
    _amax_and_scale_update,
    _compute_amax_and_update_history,
    _compute_scaling_factor,
    _default_get_amax_and_update_history,
    _default_sf_compute,
    _update_amax_history,
    split_and_copy,
)
from ._recipe_state import (
    DelayedScalingRecipeState,
    Float8CurrentScalingRecipeState,
    RecipeState,
    get_fp8_max,
    get_fp8_te_dtype,
    get_fp8_torch_dtype,
)
from .device import device_compute_capability

__all__ = [
    "autocast",
    "fp8_autocast",
    "quantized_model_init",
    "fp8_model_init",
    "is_fp8_available",
    "check_fp8_support",
    "get_default_fp8_recipe",
    "get_default_recipe",
    "check_recipe_support",
    "get_align_size_for_quantization",
    "FP8GlobalStateManager",
    "FP8GlobalState",
    "RecipeState",
    "DelayedScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "get_fp8_torch_dtype",
    "get_fp8_te_dtype",
    "get_fp8_max",
    "_amax_and_scale_update",
    "_compute_amax_and_update_history",
    "_compute_scaling_factor",
    "_default_get_amax_and_update_history",
    "_default_sf_compute",
    "_update_amax_history",
    "split_and_copy",
    "BackwardScaleUpdate",
    "claim_backward_update",
]


# ---------------------------------------------------------------------------------------------
# Availability (per device; the CPU reference path always supports FP8)


@functools.cache
def _cuda_fp8_support(index: int) -> tuple[bool, str]:
    cc = device_compute_capability(torch.device("cuda", index))
    if cc >= (8, 9):
        return True, ""
    return False, (
        f"cuda:{index} has compute capability {cc[0]}.{cc[1]}; FP8 needs 8.9 (Ada) or newer"
    )


def check_fp8_support(device=None) -> tuple[bool, str]:
    """``(available, reason)`` for FP8 on ``device``.

    ``device=None`` checks every visible CUDA device (all must support FP8) or, without CUDA,
    the CPU reference path, which always does.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                raise ValueError(f"device={device} names no CUDA index; pass e.g. cuda:0")
            return _cuda_fp8_support(device.index)
        if device.type == "meta":
            return False, "meta tensors hold no data; FP8 needs a real device"
        return True, ""
    if torch.cuda.is_available():
        reasons = [
            r
            for ok, r in (_cuda_fp8_support(i) for i in range(torch.cuda.device_count()))
            if not ok
        ]
        return (not reasons, "; ".join(reasons))
    return True, ""


def is_fp8_available(return_reason: bool = False, device=None):
    """Whether FP8 works (on ``device``, or on every visible GPU, or on CPU without CUDA)."""
    available, reason = check_fp8_support(device)
    return (available, reason) if return_reason else available


def get_default_fp8_recipe() -> Recipe:
    """The recipe an autocast without ``recipe=`` uses: ``DelayedScaling()``."""
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe


def check_recipe_support(recipe: Recipe) -> None:
    """Refuse recipes this library does not implement, and delayed scaling under compile."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe={recipe!r} is not a transformer_engine Recipe")
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise NotImplementedError(
            f"recipe {type(recipe).__name__} is not implemented; use DelayedScaling or "
            "Float8CurrentScaling"
        )
    if isinstance(recipe, DelayedScaling) and torch.compiler.is_compiling():
        raise RuntimeError(
            "DelayedScaling keeps state across steps and cannot run under torch.compile; use "
            "Float8CurrentScaling"
        )


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """Alignment FP8 GEMMs need for this recipe's tensors (16 for per-tensor FP8)."""
    return 16


# ---------------------------------------------------------------------------------------------
# The process-wide state


@dataclass
class FP8GlobalState:
    """Autocast flags and the amax registry (the only process-wide quantization state)."""

    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Recipe | None = None
    fp8_distributed_group: Any = None
    fp8_parameters: bool = False
    high_precision_init_val: bool = False
    is_first_fp8_module: bool = False
    fp8_graph_capturing: bool = False
    autocast_depth: int = 0
    autocast_arguments: dict = field(default_factory=dict)
    amax_registry: AmaxRegistry = field(default_factory=AmaxRegistry)
    fp8_tensors_recompute_buffer: list = field(default_factory=list)


_AUTOCAST_FIELDS = (
    "fp8_enabled",
    "fp8_calibration",
    "fp8_recipe",
    "fp8_distributed_group",
    "is_first_fp8_module",
    "fp8_graph_capturing",
)


_recipe_reprs: dict[int, tuple[Recipe, str]] = {}


def _recipe_repr(recipe: Recipe | None) -> str:
    """``repr(recipe)``, remembered per recipe object (recipes are frozen): the autocast key is
    built several times per forward, and a recipe's repr walks all its fields."""
    if recipe is None:
        return "None"
    cached = _recipe_reprs.get(id(recipe))
    if cached is not None and cached[0] is recipe:
        return cached[1]
    if len(_recipe_reprs) > 256:  # recipes made per step (unusual) must not pile up
        _recipe_reprs.clear()
    text = repr(recipe)
    _recipe_reprs[id(recipe)] = (recipe, text)
    return text


class FP8GlobalStateManager:
    """Upstream's facade over :class:`FP8GlobalState` (same method names)."""

    quantization_state = FP8GlobalState()

    @classmethod
    def reset(cls) -> None:
        cls.quantization_state = FP8GlobalState()

    # -- flags --------------------------------------------------------------------------------
    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.quantization_state.fp8_calibration

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.quantization_state.fp8_parameters

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.quantization_state.high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.quantization_state.fp8_graph_capturing

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first FP8 module of an autocast region; reading clears the flag."""
        first = cls.quantization_state.is_first_fp8_module
        cls.quantization_state.is_first_fp8_module = False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.quantization_state.fp8_recipe or get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.quantization_state.fp8_distributed_group

    @classmethod
    def get_autocast_state(cls) -> tuple:
        s = cls.quantization_state
        return tuple(getattr(s, name) for name in _AUTOCAST_FIELDS)

    @classmethod
    def set_autocast_state(cls, autocast_state: tuple) -> None:
        for name, value in zip(_AUTOCAST_FIELDS, autocast_state, strict=True):
            setattr(cls.quantization_state, name, value)

    @staticmethod
    def is_fp8_available() -> tuple[bool, str]:
        return check_fp8_support()

    # -- registry keys ------------------------------------------------------------------------
    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        return "forward" if forward else "backward"

    @staticmethod
    def get_buffer_info() -> str:
        return "buffer_index_and_autocast_key"

    @staticmethod
    def get_unique_autocast_key(recipe: Recipe | None = None, group=None) -> str:
        return f"recipe={_recipe_repr(recipe)},group={id(group) if group is not None else None}"

    @classmethod
    def get_key_in_buffer(cls, forward: bool, recipe: Recipe, group) -> str:
        return f"{cls.get_fwd_bwd_key(forward)}_{cls.get_unique_autocast_key(recipe, group)}"

    @staticmethod
    def split_key_in_buffer(key: str) -> tuple[bool, str]:
        direction, autocast_key = key.split("_", 1)
        return direction == "forward", autocast_key

    # -- registry -----------------------------------------------------------------------------
    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """Register a module's delayed-scaling state (idempotent; re-points moved tensors).

        ``fp8_meta`` carries ``"recipe"``, optionally ``"fp8_group"``, and the states under
        ``"scaling_fwd"`` / ``"scaling_bwd"``. The first call appends the module's pairs and
        stores their positions under ``"buffer_index_and_autocast_key"``; later calls re-point
        the positions when the module's state tensors were replaced (a device move or a rebuilt
        state), which also rebuilds the registry's per-device grouping, and move the pairs to a
        new key when the recipe or the reduction group changed.
        """
        registry = cls.quantization_state.amax_registry
        recipe, group = fp8_meta["recipe"], fp8_meta.get("fp8_group")
        info_key = cls.get_buffer_info()
        registered = fp8_meta.get(info_key) or {}
        for forward in (True, False):
            state = fp8_meta.get(cls.get_meta_tensor_key(forward))
            if not isinstance(state, DelayedScalingRecipeState):
                continue
            key = cls.get_key_in_buffer(forward, recipe, group)
            old = registered.get(forward)
            if old is not None and old[0] != key:
                # the recipe or group changed: the pair must be updated under the new key only
                registry.unregister(*old)
                old = None
            if old is None:
                registered[forward] = (key, registry.register(key, state.amax_history, state.scale))
                continue
            history, scale = registry.entry(*old)
            if history is not state.amax_history or scale is not state.scale:
                registry.replace(old[0], old[1], state.amax_history, state.scale)
        fp8_meta[info_key] = registered

    @staticmethod
    def reduce_tensor_across_group_op_max(tensor: torch.Tensor, group) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Reduce and update every registered pair of one direction, per device."""
        state = cls.quantization_state
        for key in state.amax_registry.keys():
            is_forward, autocast_key = cls.split_key_in_buffer(key)
            if is_forward != forward:
                continue
            recipe, group = state.autocast_arguments[autocast_key]
            state.amax_registry.reduce_and_update(key, recipe, forward=forward, group=group)

    # -- autocast -----------------------------------------------------------------------------
    @classmethod
    def autocast_enter(
        cls,
        enabled: bool = False,
        calibrating: bool = False,
        fp8_recipe: Recipe | None = None,
        fp8_group=None,
        _graph: bool = False,
    ) -> None:
        s = cls.quantization_state
        recipe = fp8_recipe if fp8_recipe is not None else get_default_fp8_recipe()
        s.autocast_arguments[cls.get_unique_autocast_key(recipe, fp8_group)] = (recipe, fp8_group)
        s.fp8_enabled = enabled
        s.fp8_calibration = calibrating
        s.fp8_recipe = recipe
        s.fp8_distributed_group = fp8_group
        s.fp8_graph_capturing = _graph
        if s.autocast_depth == 0:
            s.is_first_fp8_module = True
        s.autocast_depth += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool, update: bool = True) -> None:
        s = cls.quantization_state
        s.autocast_depth -= 1
        if update and enabled and s.autocast_depth == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)

    # -- quantized_model_init -----------------------------------------------------------------
    @classmethod
    def get_model_init_state(cls) -> tuple:
        s = cls.quantization_state
        return s.fp8_parameters, s.fp8_recipe, s.high_precision_init_val

    @classmethod
    def set_model_init_state(cls, values: tuple) -> None:
        s = cls.quantization_state
        s.fp8_parameters, s.fp8_recipe, s.high_precision_init_val = values


class BackwardScaleUpdate:
    """The one owner of "the backward pass of this autocast region is complete: update the
    backward scales".

    The first FP8 module or fuser of an autocast region whose forward records a graph claims it
    (:func:`claim_backward_update`). Autograd runs backward in reverse order, so that module's
    backward is the region's last one; at its end the module (not the functional core, which
    touches no global state) calls :meth:`complete`. Nothing is updated while a CUDA graph is
    being captured (the graph helpers update outside the graph).
    """

    __slots__ = ()

    def complete(self) -> None:
        if not FP8GlobalStateManager.fp8_graph_capturing():
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def claim_backward_update() -> BackwardScaleUpdate | None:
    """A :class:`BackwardScaleUpdate` for the region's first FP8 module, ``None`` for every other.

    Claiming clears the region's first-module flag, so call it only once the caller knows it
    will quantize in backward (an FP8 forward in grad mode without ``backward_override``).
    """
    if FP8GlobalStateManager.is_first_fp8_module():
        return BackwardScaleUpdate()
    return None


class autocast:
    """Context manager that enables FP8 (or calibration) for TE modules run inside it.

    Parameters
    ----------
    enabled : bool, default True
        Run FP8 GEMMs and casts inside the region.
    calibrating : bool, default False
        Collect amaxes while computing in high precision.
    recipe : Recipe, optional
        ``DelayedScaling()`` when omitted.
    amax_reduction_group : torch.distributed.ProcessGroup, optional
        Group over which delayed-scaling amaxes are all-reduced (MAX) at updates.
    _graph : bool, default False
        Set by CUDA-graph capture helpers: skip the update at exit.

    Notes
    -----
    The outermost enabled autocast updates forward scales when it exits normally in grad
    mode. Every exit, including one caused by an exception, restores the autocast state of the
    enclosing region; an exception skips the scale update. An instance cannot be entered while
    it is active (nest with a new instance).
    """

    __slots__ = ("enabled", "calibrating", "recipe", "amax_reduction_group", "_graph", "_saved")

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Recipe | None = None,
        amax_reduction_group=None,
        _graph: bool = False,
    ) -> None:
        self.enabled = enabled
        self.calibrating = calibrating
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self._graph = _graph
        self._saved = None

    def __enter__(self) -> autocast:
        if self._saved is not None:
            raise RuntimeError(
                "this autocast instance is already active; nest a new te.autocast(...) instead"
            )
        recipe = self.recipe if self.recipe is not None else get_default_fp8_recipe()
        if self.enabled:
            # Hardware support is a property of a device, not of the region: it is checked
            # where tensors are quantized (is_fp8_available(device=...)), since one region may
            # span the CPU and several GPUs.
            check_recipe_support(recipe)
        saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(
            self.enabled, self.calibrating, recipe, self.amax_reduction_group, self._graph
        )
        self._saved = saved
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        saved, self._saved = self._saved, None
        FP8GlobalStateManager.set_autocast_state(saved)
        FP8GlobalStateManager.autocast_exit(self.enabled, self._graph, update=exc_type is None)


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group=None,
    _graph: bool = False,
) -> autocast:
    """Deprecated alias of :class:`autocast` (``fp8_recipe`` -> ``recipe``, ``fp8_group`` ->
    ``amax_reduction_group``)."""
    warnings.warn(
        "fp8_autocast is deprecated; use te.autocast(recipe=..., amax_reduction_group=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return autocast(
        enabled, calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph
    )


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """Modules constructed inside keep their weights as quantized (FP8) parameters.

    Parameters
    ----------
    enabled : bool, default True
    recipe : Recipe, optional
        The recipe those weights are quantized with (``DelayedScaling()`` when omitted).
    preserve_high_precision_init_val : bool, default False
        Keep a CPU copy of each weight's initial high-precision values.
    """
    if recipe is not None:
        check_recipe_support(recipe)
    saved = FP8GlobalStateManager.get_model_init_state()
    FP8GlobalStateManager.set_model_init_state(
        (
            enabled,
            recipe if recipe is not None else get_default_fp8_recipe(),
            preserve_high_precision_init_val,
        )
    )
    try:
        yield
    finally:
        FP8GlobalStateManager.set_model_init_state(saved)


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """Deprecated alias of :func:`quantized_model_init`."""
    warnings.warn(
        "fp8_model_init is deprecated; use te.quantized_model_init",
        DeprecationWarning,
        stacklevel=3,
    )
    with quantized_model_init(enabled, recipe, preserve_high_precision_init_val):
        yield
