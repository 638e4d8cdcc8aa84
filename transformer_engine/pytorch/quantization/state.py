"""The process-wide quantization state and its manager (upstream's ``FP8GlobalStateManager``).

The state is one small object (``FP8GlobalStateManager.quantization_state``) holding the
autocast flags and the amax registry. The registry is keyed by :class:`AmaxKey` objects
(direction, recipe, reduction group): the forward and backward updates read the recipe and the
group straight off each key. Upstream's string keys (:meth:`FP8GlobalStateManager.get_key_in_buffer`
and friends) are still produced for callers that print or compare them, but nothing here parses
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.recipe import Recipe
from .amax_registry import AmaxKey, AmaxRegistry
from .recipe_state import DelayedScalingRecipeState
from .support import check_fp8_support, get_default_fp8_recipe

__all__ = ["FP8GlobalState", "FP8GlobalStateManager"]


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
        """Where ``fp8_meta`` keeps a direction's recipe state."""
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        return "forward" if forward else "backward"

    @staticmethod
    def get_buffer_info() -> str:
        """Where ``fp8_meta`` keeps its registry positions: ``{forward: (AmaxKey, position)}``."""
        return "buffer_index_and_autocast_key"

    @staticmethod
    def get_unique_autocast_key(recipe: Recipe | None = None, group=None) -> str:
        """Upstream's printable name of an autocast (kept for callers; the registry itself is
        keyed by :class:`AmaxKey`)."""
        return f"recipe={recipe!r},group={id(group) if group is not None else None}"

    @classmethod
    def get_key_in_buffer(cls, forward: bool, recipe: Recipe, group) -> str:
        """Upstream's printable registry key (see :meth:`get_unique_autocast_key`)."""
        return f"{cls.get_fwd_bwd_key(forward)}_{cls.get_unique_autocast_key(recipe, group)}"

    @staticmethod
    def split_key_in_buffer(key: str) -> tuple[bool, str]:
        """Inverse of :meth:`get_key_in_buffer`, for callers holding upstream's strings."""
        direction, autocast_key = key.split("_", 1)
        return direction == "forward", autocast_key

    # -- registry -----------------------------------------------------------------------------
    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """Register a module's delayed-scaling state (idempotent; re-points moved tensors).

        ``fp8_meta`` carries ``"recipe"``, optionally ``"fp8_group"``, and the states under
        ``"scaling_fwd"`` / ``"scaling_bwd"``. The first call appends the module's pairs and
        stores their ``(AmaxKey, position)`` under ``"buffer_index_and_autocast_key"``; later
        calls re-point the positions when the module's state tensors were replaced (a device
        move or a rebuilt state), which also rebuilds the registry's per-device grouping, and
        move the pairs to a new key when the recipe (by value) or the reduction group (by
        identity) changed.
        """
        registry = cls.quantization_state.amax_registry
        recipe, group = fp8_meta["recipe"], fp8_meta.get("fp8_group")
        info_key = cls.get_buffer_info()
        registered = fp8_meta.get(info_key) or {}
        for forward in (True, False):
            state = fp8_meta.get(cls.get_meta_tensor_key(forward))
            if not isinstance(state, DelayedScalingRecipeState):
                continue
            key = AmaxKey(forward, recipe, group)
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
        """Reduce and update every registered pair of one direction, per device, with the
        recipe and reduction group each key names."""
        registry = cls.quantization_state.amax_registry
        for key in registry.keys():
            if key.forward == forward:
                registry.reduce_and_update(key, key.recipe, forward=forward, group=key.group)

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
        s.fp8_enabled = enabled
        s.fp8_calibration = calibrating
        s.fp8_recipe = fp8_recipe if fp8_recipe is not None else get_default_fp8_recipe()
        s.fp8_distributed_group = fp8_group
        s.fp8_graph_capturing = _graph
        if s.autocast_depth == 0:
            s.is_first_fp8_module = True
        s.autocast_depth += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool, update: bool = True) -> None:
        """Leave a region; the outermost enabled region that exits normally in grad mode
        updates the forward scales."""
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
