"""The amax registry: delayed-scaling state of every FP8 module, grouped by device.

Modules register their ``(amax_history, scale)`` pairs under an :class:`AmaxKey`: the
direction and the autocast (recipe and reduction group) whose update they take part in. At
update time (see docs/architecture.md):

* without reduction, the pairs are grouped by device and each group is updated on its own
  device, in place, with one fused launch: nothing is concatenated or copied across devices;
* with reduction, row 0 of every history is gathered in registration order onto the first
  registered device, reduced with one ``all_reduce(MAX)``, and each device receives its slice
  of the result for its fused update.

From a group's second update on, an unreduced CUDA update replays a CUDA graph of that launch
(update_graph.py), dropped with the grouping whenever the group changes.

Registration order is deterministic (the order in which modules first run), so every rank
lays out the reduction buffer identically. The per-device grouping is cached and rebuilt
whenever an entry is added or replaced (e.g. after a module moved to another device).

The registry holds the pairs weakly: a module that is freed is neither kept alive nor updated at
every later step (upstream's global buffers hold them for the life of the process). Its places
in the reduction buffer stay, as zeros, so the layout never depends on when a rank frees it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ...common.recipe import Recipe
from ..cpp_extensions._routing import native_for
from ..cpp_extensions.scaling import delayed_scaling_update_prevalidated
from . import update_graph
from .delayed_scaling_update import _amax_and_scale_update, split_and_copy
from .recipe_state import get_fp8_max, get_fp8_torch_dtype
from .update_graph import UpdateGraph, stream_is_capturing

__all__ = ["AmaxKey", "AmaxRegistry"]


@dataclass(frozen=True, eq=False)
class AmaxKey:
    """Which pairs are reduced and updated together: one direction of one autocast.

    Two keys are equal when they name the same direction, *equal* recipes and the *same*
    reduction group object. Recipes compare by value because a training loop commonly builds a
    new ``DelayedScaling()`` every step, and its modules must stay in one group. The hash
    leaves the recipe's field values out (only its type), so a key stays findable even if a
    recipe object is mutated after registration.
    """

    forward: bool
    recipe: Recipe
    group: Any = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AmaxKey):
            return NotImplemented
        return (
            self.forward == other.forward
            and self.group is other.group
            and (self.recipe is other.recipe or self.recipe == other.recipe)
        )

    def __post_init__(self) -> None:
        # Computed once: every update step looks keys up in the registry's dicts.
        object.__setattr__(self, "_hash", hash((self.forward, type(self.recipe), id(self.group))))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_hash"]  # a copy's group is another object: its hash is computed anew
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()


class _Entry:
    """A registered pair, held by weak references; ``on_free`` runs when either is freed."""

    def __init__(self, amax_history: torch.Tensor, scale: torch.Tensor, on_free) -> None:
        self._history = weakref.ref(amax_history, on_free)  # [L, N], float32
        self._scale = weakref.ref(scale, on_free)  # [N], float32
        self.slots = amax_history.shape[1]

    @property
    def amax_history(self) -> torch.Tensor | None:
        return self._history()

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale()

    @property
    def alive(self) -> bool:
        return self._history() is not None and self._scale() is not None

    @property
    def device(self) -> torch.device:
        return self.amax_history.device


# NVTE_UNFUSED_FP8_UPDATE=1: every update takes upstream's Python path. Read once, when the
# package is imported (an environment lookup per update costs host time every step).
UNFUSED_UPDATE = os.environ.get("NVTE_UNFUSED_FP8_UPDATE", "0") == "1"


def _all_reduce_max(buffer: torch.Tensor, group) -> None:
    """The one collective of an update step (a seam that tests replace)."""
    torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=group)


def _fused_update(histories, scales, fp8_dtype, margin, algo, reduction_buffer) -> None:
    """Update the pairs of one device, on that device (a seam that tests replace). The pairs
    were checked at registration, so the per-step update skips the argument checks."""
    delayed_scaling_update_prevalidated(
        histories, scales, fp8_dtype, margin, algo, reduction_buffer
    )


def _should_reduce(recipe, group) -> bool:
    if not recipe.reduce_amax:
        return False
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _check_pair(amax_history: torch.Tensor, scale: torch.Tensor) -> None:
    if amax_history.dim() != 2 or amax_history.dtype != torch.float32:
        raise ValueError(
            f"amax_history must be a float32 [amax_history_len, N] tensor, got "
            f"{amax_history.dtype} of shape {tuple(amax_history.shape)}"
        )
    if scale.shape != (amax_history.shape[1],) or scale.dtype != torch.float32:
        raise ValueError(
            f"scale must be a float32 tensor of shape ({amax_history.shape[1]},), got "
            f"{scale.dtype} of shape {tuple(scale.shape)}"
        )
    if scale.device != amax_history.device:
        raise ValueError(
            f"scale is on {scale.device} but amax_history is on {amax_history.device}; a recipe "
            "state keeps both on its owner's device"
        )


_SEEN, _EAGER = object(), object()  # markers in AmaxRegistry._update_graphs


class AmaxRegistry:
    """Registered delayed-scaling pairs per key, and their reduction and update."""

    def __init__(self) -> None:
        self._entries: dict[Any, list[_Entry | None]] = {}
        self._device_groups: dict[Any, list[tuple[torch.device, list[int]]]] = {}
        # per key, per device: _SEEN after the group's first update, then its UpdateGraph
        # (or _EAGER where none can be captured); dropped with the key's grouping
        self._update_graphs: dict[Any, dict[torch.device, Any]] = {}
        # bumped by every register, replace, unregister and clear: a caller that registered
        # at version v knows its pairs are still in place while the version is v
        self.version = 0
        # replaced by clear(): owners that registered under another token register anew
        self.token = object()

    def _regroup(self, key) -> None:
        """Drop the grouping of ``key`` and its update graphs (rebuilt at the next update)."""
        self._device_groups.pop(key, None)
        self._update_graphs.pop(key, None)
        self.version += 1

    def register(self, key, amax_history: torch.Tensor, scale: torch.Tensor) -> int:
        """Append a pair under ``key``; returns its position (its place in the reduction)."""
        _check_pair(amax_history, scale)
        entries = self._entries.setdefault(key, [])
        entries.append(_Entry(amax_history, scale, self._on_free(key)))
        self._regroup(key)
        return len(entries) - 1

    def _on_free(self, key):
        """The callback of an entry's weak references: the grouping of ``key`` is rebuilt
        without the freed pair at the next update."""
        groups, graphs = self._device_groups, self._update_graphs
        return lambda _ref: (groups.pop(key, None), graphs.pop(key, None))

    def replace(self, key, position: int, amax_history: torch.Tensor, scale: torch.Tensor):
        """Point an existing position at new tensors (same slot count), e.g. after a move."""
        _check_pair(amax_history, scale)
        entries = self._entries.get(key)
        if entries is None or not 0 <= position < len(entries) or entries[position] is None:
            raise KeyError(f"no amax registry entry {position} under {key!r}")
        if entries[position].slots != amax_history.shape[1]:
            raise ValueError(
                f"entry {position} under {key!r} has {entries[position].slots} slots; the "
                f"replacement has {amax_history.shape[1]} (register a new entry instead)"
            )
        entries[position] = _Entry(amax_history, scale, self._on_free(key))
        self._regroup(key)

    def unregister(self, key, position: int) -> None:
        """Retire a position (its owner moved to another key). The slot stays as a tombstone so
        the other positions, and the reduction layout every rank shares, do not shift. (A freed
        pair retires the same way by itself.)"""
        entries = self._entries.get(key)
        if entries is None or not 0 <= position < len(entries) or entries[position] is None:
            raise KeyError(f"no amax registry entry {position} under {key!r}")
        entries[position] = None
        self._regroup(key)
        if all(e is None for e in entries):
            # Every owner moved away (e.g. a recipe rebuilt with new callables each step): drop
            # the key so retired keys do not pile up. Only explicit unregisters, which every
            # rank makes alike, get here, so the reduction layouts stay identical across ranks.
            del self._entries[key]

    def entry(self, key, position: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pair at a position (``None``s once it was freed)."""
        e = self._entries[key][position]
        return e.amax_history, e.scale

    def keys(self) -> list:
        return list(self._entries)

    def __len__(self) -> int:
        """Live pairs."""
        return sum(e is not None and e.alive for v in self._entries.values() for e in v)

    def clear(self) -> None:
        self._entries.clear()
        self._device_groups.clear()
        self._update_graphs.clear()
        self.version += 1
        self.token = object()

    def device_groups(self, key) -> list[tuple[torch.device, list[int]]]:
        """``[(device, positions)]`` in order of each device's first registration."""
        groups = self._device_groups.get(key)
        if groups is None:
            by_device: dict[torch.device, list[int]] = {}
            for position, e in enumerate(self._entries.get(key, [])):
                if e is not None and e.alive:
                    by_device.setdefault(e.device, []).append(position)
            groups = list(by_device.items())
            self._device_groups[key] = groups
        return groups

    def reduce_and_update(self, key, recipe, *, forward: bool, group=None) -> None:
        """Reduce (if the recipe and the process group ask for it) and update every pair."""
        entries = self._entries.get(key)
        groups = self.device_groups(key)
        # Hold the pairs for the whole update: a pair whose owner is garbage (a reference
        # cycle) can be freed by a collection that any allocation below sets off.
        held = [(entries[p].amax_history, entries[p].scale) for _, ps in groups for p in ps]
        if any(h is None or s is None for h, s in held):  # freed since the grouping
            groups = self.device_groups(key)
            held = [(entries[p].amax_history, entries[p].scale) for _, ps in groups for p in ps]
        if not groups:
            return
        reduced = self._reduce(entries, groups, group) if _should_reduce(recipe, group) else {}

        # upstream's Python update: for callables, or forced by NVTE_UNFUSED_FP8_UPDATE=1
        if (
            callable(recipe.amax_compute_algo)
            or callable(recipe.scaling_factor_compute_algo)
            or UNFUSED_UPDATE
        ):
            fp8_max = get_fp8_max(recipe, forward)
            for device, positions in groups:
                if device in reduced:
                    rows = [entries[p].amax_history[0] for p in positions]
                    split_and_copy(reduced[device], rows, [entries[p].slots for p in positions])
                for p in positions:
                    _amax_and_scale_update(
                        entries[p].amax_history, entries[p].scale, fp8_max, recipe
                    )
            return

        config = (get_fp8_torch_dtype(recipe, forward), recipe.margin, recipe.amax_compute_algo)
        for device, positions in groups:
            buffer = reduced.get(device)
            if buffer is None and self._replayed(key, device, positions, entries, config):
                continue
            _fused_update(
                [entries[p].amax_history for p in positions],
                [entries[p].scale for p in positions],
                *config,
                buffer,
            )

    def _replayed(self, key, device, positions, entries, config) -> bool:
        """Make one device's unreduced update by replaying its graph, captured at the group's
        second update (update_graph.py). False: the caller launches it as a native call."""
        if not update_graph.GRAPH_SCALE_UPDATES or device.type != "cuda":
            return False
        graphs = self._update_graphs.setdefault(key, {})
        graph = graphs.get(device)
        if graph is None:  # the group's first update: a native call; capture at the next
            graphs[device] = _SEEN
            return False
        if graph is _EAGER or stream_is_capturing(device):
            return False
        if graph is _SEEN or graph.config != config:
            if native_for("delayed_scaling_update", device) is None:
                graphs[device] = _EAGER  # the reference path allocates: not captured
                return False
            if not any(entries[p].slots for p in positions):
                graphs[device] = _EAGER  # nothing to launch: a graph would be empty
                return False
            histories = [entries[p].amax_history for p in positions]
            scales = [entries[p].scale for p in positions]
            graph = graphs[device] = UpdateGraph(device, histories, scales, *config)
        graph.replay()
        return True

    @staticmethod
    def _reduce(entries, groups, group) -> dict[torch.device, torch.Tensor]:
        """Gather row 0 in registration order on the first device, all-reduce, split by device.

        A freed pair still has its place in the buffer, filled with zeros (neutral under MAX):
        when a module is freed depends on each rank's garbage collection, and the collective
        needs the same layout on every rank. Only ``unregister`` (an explicit call every rank
        makes) removes a place."""
        home = groups[0][0]
        pieces, offsets, start = [], {}, 0
        for position, e in enumerate(entries):
            if e is None:
                continue
            history = e.amax_history
            if history is None:
                pieces.append(torch.zeros(e.slots, dtype=torch.float32, device=home))
            else:
                pieces.append(history[0].to(home))
                offsets[position] = start
            start += e.slots
        gathered = torch.cat(pieces)
        _all_reduce_max(gathered, group)
        per_device = {}
        for device, positions in groups:
            pieces = [gathered[offsets[p] : offsets[p] + entries[p].slots] for p in positions]
            per_device[device] = torch.cat(pieces).to(device)
        return per_device
