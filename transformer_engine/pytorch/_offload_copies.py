"""The copies behind activation CPU offload (:mod:`.cpu_offload`): which saved tensors leave the
GPU, the copy out to pinned host memory and the copy back, each on a side stream of the tensor's
own device.

Ordering, without a host synchronization anywhere:

- Out: the offload stream first waits for the tensor's stream as it stands when the tensor is
  saved (everything that produced the values is queued before that point), then copies. The
  GPU tensor is marked as used by the offload stream (``record_stream``), so when the last
  reference to it goes the caching allocator hands its memory to later work only after the
  copy has run: the memory is given back without waiting for the copy.
- Back: the destination is allocated from the offload stream's memory and the copy runs there
  after the copy out has finished; the reading stream waits for the copy back (an event) and is
  recorded on the tensor, so its memory is reused only after the reader is done with it.

Every stream and allocation is taken for the tensor's device, never the current one: a layer on
``cuda:1`` offloads correctly while ``cuda:0`` is current.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["OffloadedTensor", "offload_candidate", "OffloadStreams", "MIN_OFFLOAD_BYTES"]

#: Saved tensors smaller than this stay where they are: a copy each way costs more in launches
#: than the memory is worth (scales, norms' statistics, bias-sized vectors).
MIN_OFFLOAD_BYTES = 1 << 16

#: The device types whose tensors are offloaded. Tests of the bookkeeping add ``"cpu"`` (the
#: copies then are plain host copies, with no streams), so that it runs without a GPU.
OFFLOAD_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

_DO_NOT_OFFLOAD = "_TE_do_not_offload"  # upstream's tag, set by mark_not_offload


def offload_candidate(tensor) -> bool:
    """Whether a tensor autograd saves may be offloaded: a plain (not subclassed) tensor of an
    offloaded device type, not a parameter, not tagged by ``mark_not_offload``, and at least
    :data:`MIN_OFFLOAD_BYTES` large. Parameters stay (the module holds them anyway, so a copy
    would free nothing), and so do tensor subclasses (their own storage layout decides what a
    copy means)."""
    if type(tensor) is not torch.Tensor or tensor.device.type not in OFFLOAD_DEVICE_TYPES:
        return False
    if getattr(tensor, _DO_NOT_OFFLOAD, False):
        return False
    base = tensor._base
    if base is not None and getattr(base, _DO_NOT_OFFLOAD, False):
        return False
    return tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES


class OffloadStreams:
    """One side stream per CUDA device for the copies (or the caller's stream, for its device)."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        if stream is not None:
            self._streams[stream.device] = stream

    def for_device(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream


class PinnedBufferPool:
    """Host buffers kept from one step to the next (``retain_pinned_cpu_buffers``): the n-th
    tensor a layer offloads reuses the n-th buffer when its size and dtype match, so a step
    allocates no host memory once the first has run (and CUDA graphs see fixed addresses)."""

    def __init__(self) -> None:
        self._buffers: dict[int, list[torch.Tensor]] = {}

    def take(self, layer: int, position: int, like: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers.setdefault(layer, [])
        if position < len(buffers):
            buffer = buffers[position]
            if buffer.dtype == like.dtype and buffer.numel() == like.numel():
                return buffer.view(like.shape)
            buffers[position] = buffer = _host_buffer(like)
            return buffer
        buffer = _host_buffer(like)
        buffers.append(buffer)
        return buffer


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    pinned = like.device.type == "cuda"  # pinned memory is what makes the copies asynchronous
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)


class OffloadedTensor:
    """A saved tensor on its way to host memory and back (what the pack hook returns).

    :meth:`start_offload` queues the copy out; :meth:`release` drops the reference to the device
    tensor (its memory returns to the allocator once the copy has run); :meth:`start_reload`
    queues the copy back; :meth:`get` gives the device tensor to the stream that reads it, the
    host copy staying for a second backward (``retain_graph=True``).
    """

    __slots__ = ("device", "shape", "dtype", "gpu", "host", "saves", "_offloaded", "_reloaded",
                 "_back", "_held", "_gets")  # fmt: skip

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.gpu: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self._offloaded = None  # event (CUDA) or True (CPU) once the copy out is queued
        self._reloaded = None  # the device tensor being copied back, and its event
        self.saves = 1  # saved-tensor slots holding this object (a tensor saved twice: 2)
        self._back = None  # weak reference to the tensor get() returned
        self._held = None  # ... held until every slot has had it
        self._gets = 0

    @property
    def offload_started(self) -> bool:
        return self._offloaded is not None

    def start_offload(self, streams: OffloadStreams, host: torch.Tensor | None = None) -> None:
        if self._offloaded is not None or self.gpu is None:
            return
        tensor = self.gpu
        stream = streams.for_device(self.device)
        if host is None:
            host = _host_buffer(tensor)
        if stream is None:
            host.copy_(tensor)
            self.host, self._offloaded = host, True
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        tensor.record_stream(stream)
        self.host, self._offloaded = host, event

    def release(self) -> None:
        """Forget the device tensor once its copy out is queued (before that, keep it: it is
        the only copy)."""
        if self._offloaded is not None:
            self.gpu = None

    def start_reload(self, streams: OffloadStreams) -> None:
        if self.gpu is not None or self._reloaded is not None:
            return  # still on the device, or already on its way back
        if self._back is not None and self._back() is not None:
            return  # back, and still in use
        stream = streams.for_device(self.device)
        if stream is None:
            self._reloaded = (self.host.clone(), None)
            return
        # The destination comes from the offload stream's own memory, so the copy waits for
        # nothing but the copy out; the reader is recorded on it in get().
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(self._offloaded)
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            out.copy_(self.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._reloaded = (out, event)

    def get(self, streams: OffloadStreams) -> torch.Tensor:
        """The device tensor, ready for the current stream of its device to read.

        A tensor saved in several slots is copied back once: this object holds it until each
        slot has had it, then only autograd does, so its memory goes when the last backward
        that needs it is done (a second backward, ``retain_graph=True``, copies back again).
        """
        if self.gpu is not None:
            return self.gpu
        self._gets += 1
        back = self._back() if self._back is not None else None
        if back is None:
            back = self._copy_back(streams)
            self._back = weakref.ref(back)
            self._held = back
        if self._gets % max(self.saves, 1) == 0:
            self._held = None
        return back

    def _copy_back(self, streams: OffloadStreams) -> torch.Tensor:
        if self._reloaded is None:
            self.start_reload(streams)
        out, event = self._reloaded
        self._reloaded = None
        if event is not None:
            reader = torch.cuda.current_stream(self.device)
            reader.wait_event(event)
            out.record_stream(reader)
        return out
