"""Activation CPU offload (upstream's ``te.get_cpu_offload_context``): the tensors a layer's
forward saves for backward wait in pinned host memory instead of on the GPU, and come back just
before that layer's backward needs them.

Usage, one context and one sync call per layer::

    context, sync_function = te.get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for layer in layers:
        with context:
            x = layer(x)
        x = sync_function(x)

The context installs saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) for the
layer's forward; every saved tensor that qualifies (:func:`._offload_copies.offload_candidate`:
not a parameter, not tagged by :func:`mark_not_offload`, at least 64 KiB) is copied to host
memory on a side stream and its GPU memory given back, without a host synchronization (the
copies' ordering is in :mod:`._offload_copies`). Only the first ``num_layers`` layers of each
forward pass are offloaded; layers are counted by the sync calls, ``model_layers`` to a pass.
``sync_function`` returns its input unchanged; its backward, which autograd runs right before
the layer's own, starts the copy back of this layer's tensors (if not already under way) and
of the layer before it, so that copy overlaps this layer's backward.

With ``manual_synchronization=True`` nothing is copied on its own: the third value returned, a
:class:`ManualOffloadSynchronizer`, starts each layer's copy out, drops its GPU tensors and
starts its copy back when the caller says (``start_offload_layer``,
``release_activation_forward_gpu_memory``, ``start_reload_layer``); a saved tensor whose copy
back was not started is copied back when its backward needs it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ._offload_copies import OffloadedTensor, OffloadStreams, PinnedBufferPool, offload_candidate

__all__ = [
    "get_cpu_offload_context",
    "mark_not_offload",
    "start_offload",
    "is_cpu_offload_enabled",
    "OffloadableLayerState",
    "DefaultOffloadSynchronizer",
    "ManualOffloadSynchronizer",
]

_active_contexts = [0]  # offload contexts entered and not yet left, in this process


def is_cpu_offload_enabled() -> bool:
    """Whether a layer's forward is running inside an enabled CPU-offload context."""
    return _active_contexts[0] > 0


def mark_not_offload(*tensors) -> None:
    """Keep these tensors on the GPU when a layer saves them (upstream's ``_TE_do_not_offload``
    tag). A quantized tensor's buffers (the tensors among its attributes) are tagged too.
    ``None`` entries are skipped."""
    for tensor in tensors:
        if tensor is None:
            continue
        buffers = [
            value
            for value in getattr(tensor, "__dict__", {}).values()
            if isinstance(value, torch.Tensor)
        ]
        for item in (tensor, *buffers):
            item._TE_do_not_offload = True


def start_offload(*tensors, offload_base_tensor: bool = False) -> None:
    """Start the copy out of these tensors now, before the layer saves them (upstream's hook
    for a tensor produced early in a layer, such as attention's fused QKV): when the layer then
    saves one (or, with ``offload_base_tensor``, a view of one's base), it shares this copy.
    Outside an offloaded layer's forward this does nothing."""
    synchronizer = _OffloadContext.current
    if synchronizer is None:
        return
    for tensor in tensors:
        if tensor is None:
            continue
        if offload_base_tensor and tensor._base is not None:
            tensor = tensor._base
        handle = synchronizer.pack(tensor)
        if isinstance(handle, _OffloadedView):
            handle = handle.base
        if isinstance(handle, OffloadedTensor):
            handle.saves -= 1  # registered early, not saved: the saves that follow count


class OffloadableLayerState:
    """The saved tensors of one layer's forward pass that go to host memory.

    A tensor saved twice in one layer (by two operations, or once early through
    :func:`start_offload`) is copied once: the layer keeps each tensor it offloads, by
    identity, until its forward ends. A view of an offloaded base tensor is rebuilt from the
    base's copy.
    """

    def __init__(self, index: int, pool: PinnedBufferPool | None) -> None:
        self.index = index
        self.tensors: list[OffloadedTensor] = []
        self._by_id: dict[int, tuple[torch.Tensor, OffloadedTensor]] = {}
        self._pool = pool

    def add(self, tensor: torch.Tensor) -> OffloadedTensor | _OffloadedView:
        entry = self._by_id.get(id(tensor))
        if entry is not None:
            entry[1].saves += 1
            return entry[1]
        base = tensor._base
        if base is not None:
            base_entry = self._by_id.get(id(base))
            if base_entry is not None:
                base_entry[1].saves += 1
                return _OffloadedView(base_entry[1], tensor)
        handle = OffloadedTensor(tensor)
        self.tensors.append(handle)
        self._by_id[id(tensor)] = (tensor, handle)
        return handle

    def start_offload(self, streams: OffloadStreams) -> None:
        for position, handle in enumerate(self.tensors):
            if not handle.offload_started:
                host = None
                if self._pool is not None and handle.gpu is not None:
                    host = self._pool.take(self.index, position, handle.gpu)
                handle.start_offload(streams, host)

    def release(self) -> None:
        """Drop the GPU tensors whose copy out is queued (their memory returns to the
        allocator once the copies have run) and the identity table (the forward is over)."""
        for handle in self.tensors:
            handle.release()
        self._by_id.clear()

    def start_reload(self, streams: OffloadStreams) -> None:
        for handle in self.tensors:
            handle.start_reload(streams)


class _OffloadedView:
    """A saved view of a tensor this layer offloads: rebuilt from the base's copy."""

    __slots__ = ("base", "size", "stride", "offset")

    def __init__(self, base: OffloadedTensor, view: torch.Tensor) -> None:
        self.base = base
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def get(self, streams: OffloadStreams) -> torch.Tensor:
        base = self.base.get(streams)
        return base.as_strided(self.size, self.stride, self.offset)


class DefaultOffloadSynchronizer:
    """The layer bookkeeping and the copies' schedule: copies out start as tensors are saved,
    GPU tensors are dropped at the layer's sync call, copies back start from the sync calls'
    backward (this layer's, and the one before it in advance)."""

    manual = False

    def __init__(
        self,
        num_layers: int,
        model_layers: int,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers
        self.streams = OffloadStreams(offload_stream)
        self._pool = PinnedBufferPool() if retain_pinned_cpu_buffers else None
        # Manual synchronization: this forward pass's layers, by index (the caller names them).
        self.layers: dict[int, OffloadableLayerState] = {}
        self._next_layer = 0
        self._in_layer: OffloadableLayerState | None | bool = False  # False: between layers
        self._awaiting_sync = False
        self._previous: OffloadableLayerState | None = None

    # -- the context's side -------------------------------------------------------------
    def begin_layer(self) -> None:
        if self._awaiting_sync:
            raise RuntimeError(
                "CPU offload context entered again before sync_function was called on the "
                "previous layer's output; call `x = sync_function(x)` after each layer"
            )
        index = self._next_layer
        state = None
        if index < self.num_layers and torch.is_grad_enabled():  # without grad nothing is saved
            state = OffloadableLayerState(index, self._pool)
            if self.manual:
                self.layers[index] = state
        if index == 0:
            self._previous = None
        self._in_layer = state

    def end_layer(self) -> None:
        self._awaiting_sync = True

    def abort_layer(self) -> None:
        """The layer's forward raised, or ran without grad: forget it (no sync call needed;
        a layer that raised can run again)."""
        self._in_layer = False
        self._awaiting_sync = False

    def pack(self, tensor):
        state = self._in_layer
        if not state or not offload_candidate(tensor):
            return tensor
        handle = state.add(tensor)
        if not self.manual and isinstance(handle, OffloadedTensor):
            position = len(state.tensors) - 1
            if not handle.offload_started:
                host = None
                if self._pool is not None:
                    host = self._pool.take(state.index, position, tensor)
                handle.start_offload(self.streams, host)
        return handle

    def unpack(self, saved):
        if isinstance(saved, (OffloadedTensor, _OffloadedView)):
            return saved.get(self.streams)
        return saved

    # -- sync_function's side -----------------------------------------------------------
    def sync_forward(self) -> tuple[OffloadableLayerState | None, OffloadableLayerState | None]:
        """Close the layer: ``(its state, the previous layer's)`` for the backward. Without a
        layer to close (its forward ran without grad: nothing was saved) nothing changes."""
        if not self._awaiting_sync:
            return None, None
        state = self._in_layer or None
        previous = self._previous
        if state is not None and not self.manual:
            state.release()
        self._awaiting_sync = False
        self._in_layer = False
        self._next_layer = (self._next_layer + 1) % self.model_layers
        self._previous = state if self._next_layer else None
        return state, previous

    def sync_backward(self, state, previous) -> None:
        if self.manual:
            return
        if state is not None:
            state.start_reload(self.streams)
        if previous is not None:
            previous.start_reload(self.streams)


class ManualOffloadSynchronizer(DefaultOffloadSynchronizer):
    """CPU offload driven by the caller: the layers' saved tensors are recorded, and each
    layer's copies run when the methods below are called (layer indices count from 0 within a
    forward pass)."""

    manual = True

    def _layer(self, index: int) -> OffloadableLayerState | None:
        if not 0 <= index < self.model_layers:
            raise IndexError(f"layer {index} is outside 0..{self.model_layers - 1}")
        return self.layers.get(index)

    def start_offload_layer(self, index: int) -> None:
        """Queue the copies out of layer ``index``'s saved tensors."""
        state = self._layer(index)
        if state is not None:
            state.start_offload(self.streams)

    def release_activation_forward_gpu_memory(self, index: int) -> None:
        """Drop layer ``index``'s GPU tensors whose copies out are queued."""
        state = self._layer(index)
        if state is not None:
            state.release()

    def start_reload_layer(self, index: int) -> None:
        """Queue the copies back of layer ``index``'s released tensors."""
        state = self._layer(index)
        if state is not None:
            state.start_reload(self.streams)


class _OffloadContext:
    """What ``with context:`` does around one layer's forward: the saved-tensor hooks."""

    current: DefaultOffloadSynchronizer | None = None  # the synchronizer of the layer running

    def __init__(self, synchronizer: DefaultOffloadSynchronizer) -> None:
        self.synchronizer = synchronizer
        self._hooks = None
        self._outer = None

    def __enter__(self):
        sync = self.synchronizer
        sync.begin_layer()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(sync.pack, sync.unpack)
        self._hooks.__enter__()
        self._outer, _OffloadContext.current = _OffloadContext.current, sync
        _active_contexts[0] += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        _active_contexts[0] -= 1
        _OffloadContext.current = self._outer
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        if exc_type is None and torch.is_grad_enabled():
            self.synchronizer.end_layer()
        else:  # it raised, or ran without grad (evaluation): nothing to offload, no sync needed
            self.synchronizer.abort_layer()
        return False


class _LayerBoundary(torch.autograd.Function):
    """``sync_function``: the identity, closing a layer; its backward starts the copies back."""

    @staticmethod
    def forward(ctx, tensor, synchronizer):  # noqa: D102
        ctx.synchronizer = synchronizer
        ctx.states = synchronizer.sync_forward()
        return tensor.detach()  # shares the storage without being a view (in-place ops work)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        states, ctx.states = ctx.states, (None, None)  # the graph outlives this call
        ctx.synchronizer.sync_backward(*states)
        return grad, None


def _sync_function(synchronizer):
    def sync_function(tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"sync_function takes the layer's output tensor, got {type(tensor).__name__}"
            )
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _LayerBoundary.apply(tensor, synchronizer)
        synchronizer.sync_forward()
        return tensor

    return sync_function


def _identity(tensor):
    return tensor


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
):
    """``(context, sync_function)`` for activation CPU offload, plus the
    :class:`ManualOffloadSynchronizer` with ``manual_synchronization=True`` (upstream's
    signature; see the module's description for what each does).

    ``enabled=False`` gives ``(contextlib.nullcontext(), identity)`` (and ``None``).
    ``num_layers``: how many layers, counted from the first of each forward pass, are
    offloaded; ``model_layers``: how many layers a forward pass has (sync calls). Without manual
    synchronization the last layer is never offloaded (its backward comes first):
    ``num_layers > model_layers - 1`` raises ``ValueError``. ``offload_weights`` is deprecated
    and does nothing (parameters stay on the GPU); ``double_buffering`` is accepted and
    ignored. ``retain_pinned_cpu_buffers`` keeps the host buffers from step to step (no host
    allocation after the first step; CUDA graphs need fixed buffers). ``offload_stream`` (manual
    synchronization only) is the stream the copies run on, for its device.
    """
    if offload_weights:
        warnings.warn(
            "get_cpu_offload_context(offload_weights=True) is deprecated and does nothing: "
            "parameters stay on the GPU",
            DeprecationWarning,
            stacklevel=2,
        )
    if not enabled:
        if manual_synchronization:
            return contextlib.nullcontext(), _identity, None
        return contextlib.nullcontext(), _identity
    if not offload_activations:
        raise ValueError(
            "get_cpu_offload_context(enabled=True) with offload_activations=False has nothing "
            "to offload (weights are not offloaded); pass offload_activations=True or "
            "enabled=False"
        )
    if not isinstance(model_layers, int) or model_layers < 1:
        raise ValueError(f"model_layers must be a positive int, got {model_layers!r}")
    if not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    if offload_stream is not None and not manual_synchronization:
        raise ValueError(
            "offload_stream is for manual_synchronization=True only; without it the copies "
            "run on a stream of each device's own"
        )
    if not manual_synchronization:
        if num_layers > model_layers - 1:
            raise ValueError(
                f"num_layers={num_layers} with model_layers={model_layers}: at most "
                f"{model_layers - 1} layers can be offloaded (the last layer's backward comes "
                "first, so its activations are never offloaded)"
            )
        if num_layers == model_layers - 1 and num_layers > 0:
            warnings.warn(
                f"CPU offload of {num_layers} of {model_layers} layers: every layer but the "
                "last is offloaded",
                UserWarning,
                stacklevel=2,
            )
        synchronizer = DefaultOffloadSynchronizer(
            num_layers, model_layers, retain_pinned_cpu_buffers
        )
        return _OffloadContext(synchronizer), _sync_function(synchronizer)
    synchronizer = ManualOffloadSynchronizer(
        num_layers, model_layers, retain_pinned_cpu_buffers, offload_stream
    )
    return _OffloadContext(synchronizer), _sync_function(synchronizer), synchronizer
