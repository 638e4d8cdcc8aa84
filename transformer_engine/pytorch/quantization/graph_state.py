"""FP8 state across CUDA-graph capture and replay (for ``te.make_graphed_callables``).

A captured graph bakes no scale into its kernels: the casts read the owners' ``scale`` and
write amaxes into row 0 of their ``amax_history``, tensors whose addresses never change. So
the graph helpers only have to keep the rest of the protocol eager, outside the graphs:

* warm-up and capture must not change any state: :class:`DelayedScalingSnapshot` saves it and
  writes it back in place (state that warm-up created is reset to a new state's values);
* during warm-up and capture nothing is registered or updated: ``autocast(_graph=True)`` does
  that for the forward, :func:`graph_capture_backward` for the backward passes;
* at each replay inside an enabled ``te.autocast`` :class:`GraphedFP8State` puts the captured
  owners' state into the amax registry (the forward update then runs at the outer autocast's
  exit) and claims the region's backward update for the graph's backward replay.

Owners are found by duck typing, so this layer needs no module import: a module keeps its
state in ``fp8_meta`` (with an ``fp8`` flag for its last forward), a fusible operation in
``_fp8_metas`` (one meta per direction) and registers it with ``register_recipe_state()``.
"""

from __future__ import annotations

import warnings

import torch

from .backward_update import BackwardScaleUpdate, claim_backward_update
from .context_managers import autocast
from .recipe_state import RecipeState
from .state import FP8GlobalStateManager
from .support import get_default_fp8_recipe

_WHO = "make_graphed_callables"


class CaptureAutocast:
    """The ``te.autocast`` each callable is warmed up and captured under, from
    ``make_graphed_callables``'s FP8 arguments (``args``: the names in :attr:`ARGUMENTS`).

    Upstream's old names map to the new ones with a ``DeprecationWarning`` (both given:
    ``ValueError``); ``enabled`` is one bool or one per callable; with any callable enabled the
    recipe defaults to ``get_default_recipe()``. Calling it with a callable's index gives its
    ``autocast(..., _graph=True)``: no registration, no scale update inside.
    """

    RENAMED = {
        "fp8_enabled": "enabled",
        "fp8_calibrating": "calibrating",
        "fp8_recipe": "recipe",
        "fp8_group": "amax_reduction_group",
        "fp8_weight_caching": "cache_quantized_params",
    }
    ARGUMENTS = (*RENAMED, *RENAMED.values())

    def __init__(self, n: int, args: dict) -> None:
        for old, new in self.RENAMED.items():
            if args[old] is not None:
                if args[new] is not None:
                    raise ValueError(
                        f"{_WHO}: {old} and {new} are the same argument ({old} is its "
                        f"deprecated name); pass only {new}"
                    )
                warnings.warn(f"{_WHO}: {old} is deprecated; use {new}", DeprecationWarning, 4)
                args[new] = args[old]
        enabled = False if args["enabled"] is None else args["enabled"]
        if isinstance(enabled, (tuple, list)):
            if len(enabled) != n or not all(isinstance(e, bool) for e in enabled):
                raise ValueError(f"{_WHO}: enabled={enabled!r} needs one bool per callable ({n})")
            self.enabled = tuple(enabled)
        elif isinstance(enabled, bool):
            self.enabled = (enabled,) * n
        else:
            raise TypeError(f"{_WHO}: enabled={enabled!r} must be a bool or a tuple of bools")
        for name in ("calibrating", "cache_quantized_params"):
            value = False if args[name] is None else args[name]
            if not isinstance(value, bool):
                raise TypeError(f"{_WHO}: {name}={value!r} must be a bool")
            setattr(self, name, value)
        recipe = args["recipe"]
        if recipe is None and any(self.enabled):
            recipe = get_default_fp8_recipe()
        self.recipe = recipe if any(self.enabled) or self.calibrating else None
        self.group = args["amax_reduction_group"]

    def __call__(self, index: int) -> autocast:
        return autocast(self.enabled[index], self.calibrating, self.recipe, self.group, _graph=True)


__all__ = [
    "CaptureAutocast",
    "graph_capture_backward",
    "delayed_scaling_states",
    "DelayedScalingSnapshot",
    "GraphedFP8State",
]


class graph_capture_backward:  # noqa: N801 (a context manager, named like autocast)
    """The backward passes of warm-up and capture: the backward scale update is skipped, as
    the forward's is inside ``autocast(_graph=True)`` (it runs after each replay instead)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        state = FP8GlobalStateManager.quantization_state
        self._saved, state.fp8_graph_capturing = state.fp8_graph_capturing, True

    def __exit__(self, *exc) -> None:
        FP8GlobalStateManager.quantization_state.fp8_graph_capturing = self._saved


class cast_cached_weights_in_graph:  # noqa: N801 (a context manager, named like autocast)
    """The forward capture of a callable graphed with ``cache_quantized_params``: one graph for
    both values of ``is_first_microbatch``. Inside, a module with a cached FP8 weight casts the
    weight into that cache again in place, the cast reading ``flag`` (the graph's own
    one-element float32 tensor on its device) as its no-op (1.0: the cache stays), and its weight
    gradient accumulates into ``main_grad``; the weights whose ``main_grad`` a first microbatch
    would overwrite instead are collected in :attr:`overwritten` (the replay zeroes them)."""

    __slots__ = ("_saved", "flag", "overwritten")

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag
        self.overwritten: list = []

    def __enter__(self):
        state = FP8GlobalStateManager.quantization_state
        self._saved = state.cached_weights_in_graph, state.recast_flag_in_graph
        state.cached_weights_in_graph, state.recast_flag_in_graph = [], self.flag
        return self

    def __exit__(self, *exc) -> None:
        state = FP8GlobalStateManager.quantization_state
        self.overwritten = list({id(p): p for p in state.cached_weights_in_graph}.values())
        state.cached_weights_in_graph, state.recast_flag_in_graph = self._saved


def _metas(m) -> list:
    metas = [m.fp8_meta] if isinstance(getattr(m, "fp8_meta", None), dict) else []
    op_metas = getattr(m, "_fp8_metas", None)
    if isinstance(op_metas, dict):
        metas += [meta for meta in op_metas.values() if isinstance(meta, dict)]
    return metas


def _delayed(meta: dict):
    for key in ("scaling_fwd", "scaling_bwd"):
        owner = meta.get(key)
        state = owner.delayed_scaling_state() if isinstance(owner, RecipeState) else None
        if state is not None:
            yield state


def delayed_scaling_states(module: torch.nn.Module):
    """Every delayed-scaling state of the modules and operations inside ``module``."""
    for m in module.modules():
        for meta in _metas(m):
            yield from _delayed(meta)


class DelayedScalingSnapshot:
    """The delayed-scaling scales and histories inside ``modules``, to write back in place."""

    def __init__(self, modules) -> None:
        self.modules = modules
        self.saved = {
            id(t): (t, t.clone())
            for module in modules
            for state in delayed_scaling_states(module)
            for t in (state.scale, state.amax_history)
        }

    def restore(self) -> None:
        """Saved tensors get their values back; tensors made since (state created by the
        first forward, or rebuilt for another recipe) get a new state's: scale 1, history 0."""
        with torch.no_grad():
            for module in self.modules:
                for state in delayed_scaling_states(module):
                    for t, fresh in ((state.scale, 1.0), (state.amax_history, 0.0)):
                        kept = self.saved.get(id(t))
                        if kept is None or kept[0] is not t:
                            t.fill_(fresh)
            for t, copy in self.saved.values():
                t.copy_(copy)


class GraphedFP8State:
    """What one graphed callable does with the quantization state around each replay.

    Built after capture from the owners whose last forward (the capture) ran in FP8 with
    delayed-scaling state. ``recipe`` is the capture's: the graph replays its casts, so a replay
    under another recipe is refused.
    """

    def __init__(self, module: torch.nn.Module, recipe, name: str) -> None:
        self.recipe, self.name, self.warned = recipe, name, False
        self.metas, self.ops = [], []
        self.registered, self.registered_version = None, -1  # see end_replay
        for m in module.modules():
            meta = getattr(m, "fp8_meta", None)
            if isinstance(meta, dict):
                if getattr(m, "fp8", False) and any(True for _ in _delayed(meta)):
                    self.metas.append(meta)
            elif callable(getattr(m, "register_recipe_state", None)):
                if any(True for meta in _metas(m) for _ in _delayed(meta)):
                    self.ops.append(m)

    def begin_replay(self, grad: bool) -> tuple[bool, BackwardScaleUpdate | None]:
        """``(in FP8, backward update)`` for a replay: whether an enabled ``te.autocast`` is
        active (with the capture's recipe), and the region's backward update if this is its
        first FP8 callable and the replay records a backward."""
        if not FP8GlobalStateManager.is_fp8_enabled():
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.name} was captured with FP8 enabled and is replayed outside an "
                    "enabled te.autocast: it still runs in FP8, but its delayed scales are not "
                    "updated; replay it inside te.autocast",
                    stacklevel=4,
                )
            return False, None
        active = FP8GlobalStateManager.get_fp8_recipe()
        if active is not self.recipe and active != self.recipe:
            raise ValueError(
                f"{self.name}: captured under {self.recipe!r} but replayed under {active!r}; "
                "the graph replays the captured recipe's casts: use that recipe, or capture again"
            )
        update = None
        if grad and getattr(self.recipe, "backward_override", None) is None:
            update = claim_backward_update()
        return True, update

    def end_replay(self) -> None:
        """Put the captured owners' state into the amax registry (idempotent). Skipped while
        the registry is the one of the last call here and unchanged since (its version): the
        captured owners' state tensors cannot change under a graph that points at them."""
        registry = FP8GlobalStateManager.quantization_state.amax_registry
        if self.registered is registry and self.registered_version == registry.version:
            return
        for meta in self.metas:
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
        for op in self.ops:
            op.register_recipe_state()
        self.registered, self.registered_version = registry, registry.version
