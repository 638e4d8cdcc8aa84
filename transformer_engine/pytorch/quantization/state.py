"""The process-wide quantization state and its manager (upstream's ``FP8GlobalStateManager``).

The state is one small object (``FP8GlobalStateManager.quantization_state``) holding the
autocast flags and the amax registry. The registry is keyed by :class:`AmaxKey` objects
(direction, recipe, reduction group): the forward and backward updates read the recipe and the
group straight off each key. Upstream's string keys (:meth:`FP8GlobalStateManager.get_key_in_buffer`
and friends) are still produced for callers that print or compare them, but nothing here parses
them.
"""

from __future__ import annotations

import atexit
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.recipe import Recipe
from ..device import default_device
from .amax_registry import AmaxKey, AmaxRegistry
from .recipe_state import RecipeState
from .support import (
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    get_default_fp8_recipe,
)

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
    # device -> one-element float32 flag (upstream keeps one process-wide tensor on whichever
    # device was current when it was first set; here each device has its own).
    skip_fp8_weight_update_tensors: dict = field(default_factory=dict)
    # While make_graphed_callables captures one graph for both values of is_first_microbatch:
    # the weights whose main_grad a first microbatch overwrites (the graph accumulates; the
    # replay zeroes them first). None otherwise. See graph_state.cast_cached_weights_in_graph.
    cached_weights_in_graph: list | None = None
    # ... and the flag that graph's weight casts read as their no-op (the graph's own).
    recast_flag_in_graph: Any = None


# Where an fp8_meta keeps its queue's index in fp8_tensors_recompute_buffer (upstream's key).
_RECOMPUTE_POSITION = "global_fp8_buffer_pos_fwd_recompute"
# Where an fp8_meta keeps the token of the registry its positions are in (AmaxRegistry.token).
_REGISTRY_TOKEN = "_amax_registry_token"

_AUTOCAST_FIELDS = (
    "fp8_enabled",
    "fp8_calibration",
    "fp8_recipe",
    "fp8_distributed_group",
    "is_first_fp8_module",
    "fp8_graph_capturing",
)
_read_autocast_fields = operator.attrgetter(*_AUTOCAST_FIELDS)


def _current_stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing (False without CUDA, or before CUDA is
    initialized in this process: nothing can be capturing then)."""
    return (
        torch.cuda.is_available()
        and torch.cuda.is_initialized()
        and torch.cuda.is_current_stream_capturing()
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
        """Whether a CUDA graph is being captured: ``te.make_graphed_callables``' capture, or
        (as upstream answers) any capture on the current CUDA stream. The package's own modules
        and ops test only the first (``quantization_state.fp8_graph_capturing``): in a graph
        captured by hand with ``torch.cuda.graph`` they register their state and capture the
        backward scale update, so replays keep delayed scaling's scales moving."""
        return cls.quantization_state.fp8_graph_capturing or _current_stream_capturing()

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
        return _read_autocast_fields(cls.quantization_state)

    @classmethod
    def set_autocast_state(cls, autocast_state: tuple) -> None:
        # Every autocast enter and exit runs these two: one attrgetter and one unpacking (in
        # _AUTOCAST_FIELDS order; a tuple of another length raises ValueError before anything
        # is assigned) instead of a generator and a setattr per field.
        s = cls.quantization_state
        (
            s.fp8_enabled,
            s.fp8_calibration,
            s.fp8_recipe,
            s.fp8_distributed_group,
            s.is_first_fp8_module,
            s.fp8_graph_capturing,
        ) = autocast_state

    @staticmethod
    def is_fp8_available() -> tuple[bool, str]:
        return check_fp8_support()

    @staticmethod
    def is_mxfp8_available() -> tuple[bool, str]:
        """``(available, reason)`` for native MXFP8 (compute capability 10.x/11.x); elsewhere the
        recipe runs on an emulated GEMM (see ``check_mxfp8_support``)."""
        return check_mxfp8_support()

    @staticmethod
    def is_fp8_block_scaling_available() -> tuple[bool, str]:
        """``(available, reason)`` for ``Float8BlockScaling`` (see
        ``check_fp8_block_scaling_support``)."""
        return check_fp8_block_scaling_support()

    @staticmethod
    def is_nvfp4_available() -> tuple[bool, str]:
        """``(available, reason)`` for native NVFP4 (compute capability 10.0+); elsewhere the
        recipe runs on an emulated GEMM (see ``check_nvfp4_support``)."""
        return check_nvfp4_support()

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
        if fp8_meta.get(_REGISTRY_TOKEN) is not registry.token:
            # positions in a registry that reset() replaced or clear() emptied, or a copy's
            # (a deep copy or pickle copies the token too, as another object): register anew
            fp8_meta.pop(info_key, None)
            fp8_meta[_REGISTRY_TOKEN] = registry.token
        registered = fp8_meta.get(info_key) or {}
        for forward in (True, False):
            owner = fp8_meta.get(cls.get_meta_tensor_key(forward))
            state = owner.delayed_scaling_state() if isinstance(owner, RecipeState) else None
            if state is None:
                continue
            # a CustomRecipe state's delayed part is updated by the DelayedScaling rules its
            # requests named (state.recipe), not by the CustomRecipe
            key_recipe = recipe if owner is state else state.recipe
            old = registered.get(forward)
            # Every forward comes here: with the recipe and group objects it registered under
            # (the usual case) no key is built and no recipe compared by value.
            if old is None or old[0].recipe is not key_recipe or old[0].group is not group:
                key = AmaxKey(forward, key_recipe, group)
                if old is not None and old[0] != key:
                    # the recipe or group changed: the pair is updated under the new key only
                    registry.unregister(*old)
                    old = None
                if old is None:
                    position = registry.register(key, state.amax_history, state.scale)
                    registered[forward] = (key, position)
                    continue
            history, scale = registry.entry(*old)
            if history is not state.amax_history or scale is not state.scale:
                registry.replace(old[0], old[1], state.amax_history, state.scale)
        fp8_meta[info_key] = registered

    @classmethod
    def remove_fp8_tensors_from_global_buffer(cls, fp8_meta: dict) -> None:
        """Retire the registry positions ``fp8_meta`` holds (its owner stopped using delayed
        scaling); nothing to do for positions in a registry that ``reset()`` replaced or
        ``clear()`` emptied since, or a copy's (another token, see
        :meth:`add_fp8_tensors_to_global_buffer`)."""
        info = fp8_meta.pop(cls.get_buffer_info(), None) or {}
        registry = cls.quantization_state.amax_registry
        if fp8_meta.pop(_REGISTRY_TOKEN, None) is not registry.token:
            return
        for key, position in info.values():
            registry.unregister(key, position)

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

    # -- activation recompute (upstream's fp8_meta-level API) -----------------------------------
    # The modules here stash per module (module/base.py); these serve code that drives
    # upstream's protocol itself on an ``fp8_meta`` dict. Values are swapped in place, so the
    # quantizers and the amax registry keep pointing at the state's own tensors.
    @classmethod
    def _recompute_state(cls, fp8_meta: dict):
        """The forward delayed-scaling tensors of ``fp8_meta`` (None: nothing persistent)."""
        owner = fp8_meta.get(cls.get_meta_tensor_key(forward=True))
        return owner.delayed_scaling_state() if isinstance(owner, RecipeState) else None

    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """Original forward: queue copies of the forward scales and amax history."""
        state = cls._recompute_state(fp8_meta)
        if state is None:
            return  # nothing persistent to keep (current scaling)
        buffers = cls.quantization_state.fp8_tensors_recompute_buffer
        position = fp8_meta.get(_RECOMPUTE_POSITION)
        if position is None or position >= len(buffers):
            position = len(buffers)
            buffers.append(deque())
            fp8_meta[_RECOMPUTE_POSITION] = position
        buffers[position].append((state.amax_history.clone(), state.scale.clone()))

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta: dict) -> None:
        """Recompute: keep the current values aside and cast with the oldest queued copies."""
        state = cls._recompute_state(fp8_meta)
        if state is None:
            return
        position = fp8_meta.get(_RECOMPUTE_POSITION)
        buffers = cls.quantization_state.fp8_tensors_recompute_buffer
        if position is None or position >= len(buffers) or not buffers[position]:
            raise RuntimeError(
                "get_old_fp8_meta_tensors_for_recompute: no forward values were queued for "
                "this fp8_meta; call copy_forward_fp8_meta_tensors_for_recompute in the "
                "original forward first"
            )
        history, scale = buffers[position].popleft()
        fp8_meta["updated_amax_history_fwd"] = state.amax_history.clone()
        fp8_meta["updated_scale_fwd"] = state.scale.clone()
        with torch.no_grad():
            state.amax_history.copy_(history)
            state.scale.copy_(scale)

    @classmethod
    def restore_fp8_meta_tensors(cls, fp8_meta: dict) -> None:
        """After a recompute: back to the values kept aside (the recompute's amaxes are
        dropped)."""
        state = cls._recompute_state(fp8_meta)
        if state is None:
            return
        if "updated_amax_history_fwd" not in fp8_meta:
            raise RuntimeError(
                "restore_fp8_meta_tensors: nothing to restore; call "
                "get_old_fp8_meta_tensors_for_recompute before the recompute"
            )
        with torch.no_grad():
            state.amax_history.copy_(fp8_meta.pop("updated_amax_history_fwd"))
            state.scale.copy_(fp8_meta.pop("updated_scale_fwd"))

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

    # -- weight re-cast flag (CUDA graphs) ------------------------------------------------------
    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool, device=None) -> None:
        """Set the device flag that tells weight casts to skip (1.0) or run (0.0).

        Upstream's captured weight casts read it on the device as their ``noop_flag``, so that
        one graph skips re-casting cached FP8 weights on later microbatches. Here each graph
        captured with ``cache_quantized_params`` reads a flag of its own (written on the stream
        it replays on), and its replays set this one as upstream's do, for code that reads
        it. There is one flag per device: ``device=None`` means the current CUDA device
        (the CPU where CUDA is not available; the CPU reference casts take the flag too). The
        tensor is made on the first call for a device and then only written (``fill_``), so a
        graph that captured it keeps reading the same memory.
        """
        if not isinstance(skip, (bool, int)) or skip not in (0, 1):
            raise TypeError(
                f"set_skip_fp8_weight_update_tensor: skip={skip!r} must be a bool (True skips "
                "the weight casts, False runs them)"
            )
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            raise ValueError(
                f"set_skip_fp8_weight_update_tensor: device={device} names no CUDA index; pass "
                "e.g. the weight's device (cuda:N), whose casts read the flag"
            )
        flags = cls.quantization_state.skip_fp8_weight_update_tensors
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.empty(1, dtype=torch.float32, device=device)
        flag.fill_(float(skip))

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls, device=None) -> torch.Tensor | None:
        """The flag :meth:`set_skip_fp8_weight_update_tensor` made for ``device`` (``None``: the
        current CUDA device, or the CPU without CUDA), or ``None`` if it was never set there."""
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            raise ValueError(
                f"get_skip_fp8_weight_update_tensor: device={device} names no CUDA index; pass "
                "the device whose flag you want (cuda:N)"
            )
        return cls.quantization_state.skip_fp8_weight_update_tensors.get(device)

    # -- quantized_model_init -----------------------------------------------------------------
    @classmethod
    def get_model_init_state(cls) -> tuple:
        s = cls.quantization_state
        return s.fp8_parameters, s.fp8_recipe, s.high_precision_init_val

    @classmethod
    def set_model_init_state(cls, values: tuple) -> None:
        s = cls.quantization_state
        s.fp8_parameters, s.fp8_recipe, s.high_precision_init_val = values


def _release_at_exit() -> None:
    """Drop what the process-wide state holds (the registry's keys hold the amax reduction
    groups) while the interpreter is still whole: a gloo process group that lives on until
    interpreter finalization can abort the process there ("terminate called without an active
    exception") after the script has finished."""
    FP8GlobalStateManager.reset()


atexit.register(_release_at_exit)
