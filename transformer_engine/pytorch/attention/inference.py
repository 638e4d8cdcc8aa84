"""KV cache for incremental decoding: ``InferenceParams`` and its cache managers.

One decoding iteration, for a model whose attention layers take ``inference_params``::

    inference_params.pre_step(OrderedDict({seq_id: new_tokens, ...}))   # once per iteration
    out = model(x, inference_params=inference_params)                   # every layer calls:
        inference_params.allocate_memory(layer_number)    # first time only (MultiheadAttention)
        k, v, cu_q, cu_kv, max_seqlen_kv, fmt = inference_params.step(layer_number, k_new,
                                                                        v_new, qkv_format)

``pre_step`` does the bookkeeping on the host: the live batch is the sequences of its argument,
in its order (a sequence missing from it has finished and leaves the cache; a new id starts at
length 0), and the cumulative lengths ``cu_seqlens_q`` (new tokens) and ``cu_seqlens_kv``
(cached plus new) are written, in place, into persistent int32 ``[max_batch_size + 1]`` tensors
on the cache's device (past the live batch they repeat the last value). ``step`` then copies
the layer's new K/V into its cache entirely on the device, from those tensors alone: no host
sync, fixed shapes, so a decoding step can be captured in a CUDA graph.

The cache is always bshd: non-paged ``[max_batch_size, max_sequence_length, heads, d]`` whose row
``i`` is the ``i``-th live sequence; paged ``[total_num_pages, page_size, heads, d]`` read through
``cache_manager.page_table`` (int32 ``[max_batch_size, max_sequence_length // page_size]``, row
``i`` the pages of the ``i``-th live sequence in order); ``convert_paged_to_nonpaged`` gathers
it into the non-paged layout. Positions past a sequence's length hold stale values: readers go
by ``cu_seqlens_kv``. See docs/kv_cache_and_rope.md.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Mapping

import torch

from ..device import DevicePlacementError, construction_device

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]

_FORMATS = ("bshd", "sbhd", "thd")


def _token_coordinates(new_k: torch.Tensor, qkv_format: str, cu_new: torch.Tensor):
    """For each token slot of ``new_k`` (in its flattened ``[-1, h, d]`` order): the live
    sequence it belongs to, its index among that sequence's new tokens, and whether it is a
    real token (padding slots, and sequences past the live batch, are not)."""
    device = new_k.device
    cu = cu_new.to(device=device, dtype=torch.int64)
    max_batch = cu.numel() - 1
    if qkv_format == "thd":
        token = torch.arange(new_k.shape[0], device=device)
        sequence = torch.searchsorted(cu[1:], token, right=True)
        real = sequence < max_batch
        sequence = sequence.clamp(max=max_batch - 1)
        return sequence, token - cu[sequence], real
    batch_dim, seq_dim = (0, 1) if qkv_format == "bshd" else (1, 0)
    batch, length = new_k.shape[batch_dim], new_k.shape[seq_dim]
    sequence = torch.arange(batch, device=device).unsqueeze(seq_dim)
    offset = torch.arange(length, device=device).unsqueeze(batch_dim)
    sequence, offset = torch.broadcast_tensors(sequence, offset)
    sequence, offset = sequence.reshape(-1), offset.reshape(-1)
    lengths = cu[1:] - cu[:-1]
    return sequence, offset, offset < lengths[sequence]


class KVCacheManager:
    """The interface ``InferenceParams`` drives; subclass it for a custom cache.

    ``cache`` maps a layer number to ``(k_cache, v_cache)``; ``sequences`` maps the live
    sequence ids, in batch order, to their lengths (cached plus new tokens). This base class
    keeps ``sequences``; a subclass owns the memory (``allocate_memory``) and the copy
    (``step``). ``InferenceParams`` builds a custom manager with the keyword arguments of
    :class:`NonPagedKVCacheManager` or :class:`PagedKVCacheManager` (plus ``device`` when its
    constructor accepts it) and checks ``pre_step``'s argument before passing it on.
    """

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: OrderedDict = OrderedDict()

    def reset(self) -> None:
        """Forget every sequence (the allocated memory stays)."""
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}.allocate_memory: a KVCacheManager subclass allocates the "
            "(k_cache, v_cache) of a layer"
        )

    def pre_step(self, step_dict: Mapping) -> OrderedDict:
        """Make the sequences of ``step_dict`` (id -> new tokens) the live batch, in its order,
        and return their new lengths."""
        previous = self.sequences
        self.sequences = OrderedDict(
            (seq_id, previous.get(seq_id, 0) + int(new)) for seq_id, new in step_dict.items()
        )
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """Write the new tokens; return ``(k_cache, v_cache, page_table or None)``."""
        raise NotImplementedError(
            f"{type(self).__name__}.step: a KVCacheManager subclass copies new K/V into its cache"
        )


class _DeviceCacheManager(KVCacheManager):
    """Storage shared by the two built-in managers: per layer a K and a V buffer of
    ``rows + 1`` token slots, the last a scratch slot that absorbs the writes of padding
    tokens (so every copy has a fixed shape); ``cache`` holds views without that slot."""

    def __init__(self, cache_shape, num_heads, head_dim_k, dtype, head_dim_v, device) -> None:
        super().__init__()
        self.cache_shape = tuple(cache_shape)  # leading dims of the cache: (rows, slots per row)
        self.num_heads, self.head_dim_k = num_heads, head_dim_k
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.dtype = dtype
        self.device = construction_device(type(self).__name__, device)
        self._stores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._written: set[int] = set()  # layers that received tokens (their placement is fixed)

    def allocate_memory(self, layer_number: int, device=None) -> None:
        """Zeroed caches for ``layer_number`` on ``device`` (default: the manager's device)."""
        device = self.device if device is None else torch.device(device)
        slots = self.cache_shape[0] * self.cache_shape[1]
        # Normal tensors even when a forward under torch.inference_mode allocates them (e.g.
        # MultiheadAttention's lazy allocation): later steps write them in place, which torch
        # refuses on inference tensors outside inference mode (a prefill under inference_mode
        # followed by decoding under no_grad failed).
        with torch.inference_mode(False):
            stores = tuple(
                torch.zeros(slots + 1, self.num_heads, d, dtype=self.dtype, device=device)
                for d in (self.head_dim_k, self.head_dim_v)
            )
        self._stores[layer_number] = stores
        self.cache[layer_number] = tuple(
            s[:slots].view(*self.cache_shape, *s.shape[1:]) for s in stores
        )
        self._written.discard(layer_number)

    def _layer_stores(self, layer_number: int, device: torch.device):
        if layer_number not in self._stores:
            raise ValueError(
                f"{type(self).__name__}.step: layer_number={layer_number} has no cache; call "
                f"allocate_memory({layer_number}) first"
            )
        stores = self._stores[layer_number]
        if stores[0].device != device:
            if layer_number in self._written:
                raise DevicePlacementError(
                    f"{type(self).__name__}.step: layer {layer_number}'s cache is on "
                    f"{stores[0].device} but its new K/V are on {device}; keep a layer on one "
                    "device while decoding"
                )
            # Nothing written yet: the cache follows the layer (a model split across GPUs).
            self.allocate_memory(layer_number, device)
            stores = self._stores[layer_number]
        self._written.add(layer_number)
        return stores

    def _slot_of(self, sequence, position, device):
        raise NotImplementedError

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        k_store, v_store = self._layer_stores(layer_number, new_k.device)
        for name, new, store in (("new_k", new_k, k_store), ("new_v", new_v, v_store)):
            if tuple(new.shape[-2:]) != tuple(store.shape[1:]):
                raise ValueError(
                    f"{type(self).__name__}.step: {name} has shape {tuple(new.shape)}; its last "
                    f"two dimensions must be (heads, head_dim) = {tuple(store.shape[1:])}"
                )
        sequence, offset, real = _token_coordinates(new_k, qkv_format, cu_new_seqlens)
        device = new_k.device
        cu_new = cu_new_seqlens.to(device=device, dtype=torch.int64)
        cu_cached = cu_cached_seqlens.to(device=device, dtype=torch.int64)
        # A sequence's new tokens follow the ones cached before this step.
        first_new = (cu_cached[1:] - cu_cached[:-1]) - (cu_new[1:] - cu_new[:-1])
        # Clamped so that padding slots index the page table in range; they go to the scratch.
        position = (first_new[sequence] + offset).clamp(0, self.max_seqlen - 1)
        scratch = k_store.shape[0] - 1
        slot = torch.where(real, self._slot_of(sequence, position, device), scratch)
        for store, new in ((k_store, new_k), (v_store, new_v)):
            store.index_copy_(0, slot, new.reshape(-1, *store.shape[1:]).to(store.dtype))
        return (*self.cache[layer_number], self._page_table_on(device))

    def _page_table_on(self, device):
        return None


class NonPagedKVCacheManager(_DeviceCacheManager):
    """One contiguous ``[max_batch_size, max_seqlen, heads, d]`` K and V cache per layer; row
    ``i`` belongs to the ``i``-th live sequence. When the live batch changes order (sequences
    finish or join), ``pre_step`` moves the continuing sequences' rows, on every layer."""

    def __init__(
        self, max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v=None,
        device=None,
    ) -> None:  # fmt: skip
        super().__init__((max_batch_size, max_seqlen), num_heads, head_dim_k, dtype, head_dim_v,
                         device)  # fmt: skip
        self.max_batch_size, self.max_seqlen = max_batch_size, max_seqlen

    def pre_step(self, step_dict: Mapping) -> OrderedDict:
        old_rows = {seq_id: row for row, seq_id in enumerate(self.sequences)}
        moves = [
            (old_rows[seq_id], row)
            for row, seq_id in enumerate(step_dict)
            if seq_id in old_rows and old_rows[seq_id] != row
        ]
        if moves:
            for caches in self.cache.values():
                device = caches[0].device
                source = torch.tensor([m[0] for m in moves], device=device)
                target = torch.tensor([m[1] for m in moves], device=device)
                for cache in caches:
                    cache[target] = cache[source]  # the gather copies first: overlaps are safe
        return super().pre_step(step_dict)

    def _slot_of(self, sequence, position, device):
        return sequence * self.max_seqlen + position


class PagedKVCacheManager(_DeviceCacheManager):
    """K and V caches of ``total_num_pages`` pages of ``page_size`` tokens per layer.

    A sequence gets pages as it grows and gives them back when it finishes;
    ``page_table[i, p]`` is the ``p``-th page of the ``i``-th live sequence (zero past its
    last page). A change of batch order rewrites the table, never the cache."""

    def __init__(
        self, total_num_pages, page_size, num_heads, head_dim_k, dtype, max_batch_size,
        max_seqlen, head_dim_v=None, device=None,
    ) -> None:  # fmt: skip
        super().__init__((total_num_pages, page_size), num_heads, head_dim_k, dtype, head_dim_v,
                         device)  # fmt: skip
        self.total_num_pages, self.page_size = total_num_pages, page_size
        self.max_batch_size, self.max_seqlen = max_batch_size, max_seqlen
        self.max_pages_per_seq = -(-max_seqlen // page_size)
        with torch.inference_mode(False):  # updated in place by every pre_step
            self.page_table = torch.zeros(
                max_batch_size, self.max_pages_per_seq, dtype=torch.int32, device=self.device
            )
        self._page_tables: dict[torch.device, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._free_pages = list(range(self.total_num_pages))
        self._pages: dict = {}
        self.page_table.zero_()
        self._page_tables.clear()

    def pre_step(self, step_dict: Mapping) -> OrderedDict:
        previous = self.sequences
        lengths = OrderedDict(
            (seq_id, previous.get(seq_id, 0) + int(new)) for seq_id, new in step_dict.items()
        )
        needed = sum(-(-n // self.page_size) for n in lengths.values())
        if needed > self.total_num_pages:
            raise RuntimeError(
                f"PagedKVCacheManager: the live sequences need {needed} pages of "
                f"{self.page_size} tokens but the cache has {self.total_num_pages}"
            )
        for seq_id in [s for s in self._pages if s not in lengths]:  # finished sequences
            self._free_pages.extend(self._pages.pop(seq_id))
        table = torch.zeros(self.page_table.shape, dtype=torch.int32)
        for row, (seq_id, length) in enumerate(lengths.items()):
            pages = self._pages.setdefault(seq_id, [])
            while len(pages) * self.page_size < length:
                pages.append(self._free_pages.pop(0))
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.page_table.copy_(table)  # in place: a captured graph keeps reading this tensor
        self._page_tables.clear()
        return super().pre_step(step_dict)

    def _page_table_on(self, device):
        if device == self.page_table.device:
            return self.page_table
        if device not in self._page_tables:
            self._page_tables[device] = self.page_table.to(device)
        return self._page_tables[device]

    def _slot_of(self, sequence, position, device):
        table = self._page_table_on(device).to(torch.int64)
        page = table[sequence, position // self.page_size]
        return page * self.page_size + position % self.page_size


def _accepts_device(manager_class) -> bool:
    try:
        parameters = inspect.signature(manager_class).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in parameters)


class InferenceParams:
    """KV caching for incremental decoding (the module docstring shows one iteration).

    Parameters
    ----------
    max_batch_size : int
        Most sequences decoded at once.
    max_sequence_length : int
        Most tokens (prompt plus generated) one sequence may hold.
    num_heads_kv, head_dim_k : int
        K/V heads and K head size (required, as upstream since 2.2).
    dtype : torch.dtype
        Of the caches (required); new K/V are cast to it.
    head_dim_v : int, optional
        V head size; default ``head_dim_k``.
    is_paged : bool, default False
        Paged cache; then ``page_size`` is required, ``max_sequence_length`` must be a multiple
        of it and ``total_num_pages == max_batch_size * max_sequence_length // page_size``.
    total_num_pages, page_size : int, optional
    max_ctx_len : int, optional
        Required with ``qkv_format="thd"``: the most new tokens one sequence brings in a step,
        ``1 <= max_ctx_len <= max_sequence_length``.
    qkv_format : {"bshd", "sbhd", "thd"}, default "bshd"
        Format of the new Q/K/V (``step`` may name another).
    custom_cache_manager : type, optional
        A :class:`KVCacheManager` subclass to build instead of the built-in managers.
    device : str or torch.device, optional (keyword only; not in upstream's signature)
        Where the caches and the cumulative lengths live: default the current CUDA device (as
        upstream), else the CPU. A layer whose first new K/V arrive on another device gets its
        cache there (a model split across GPUs); ``step`` returns that device's lengths.

    Upstream's argument checks raise ``AssertionError`` with upstream's conditions; other bad
    values raise ``ValueError`` naming the value.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: int | None = None,
        head_dim_k: int | None = None,
        dtype: torch.dtype | None = None,
        head_dim_v: int | None = None,
        is_paged: bool = False,
        total_num_pages: int | None = None,
        page_size: int | None = None,
        max_ctx_len: int | None = None,
        qkv_format: str = "bshd",
        custom_cache_manager: type | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if num_heads_kv is None or head_dim_k is None or dtype is None:
            raise AssertionError(
                "InferenceParams: num_heads_kv, head_dim_k and dtype are required (as in "
                f"Transformer Engine >= 2.2); got num_heads_kv={num_heads_kv}, "
                f"head_dim_k={head_dim_k}, dtype={dtype}"
            )
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_sequence_length", max_sequence_length),
                            ("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k)):  # fmt: skip
            if int(value) != value or value < 1:
                raise ValueError(f"InferenceParams: {name}={value!r} must be a positive integer")
        if qkv_format not in _FORMATS:
            raise ValueError(f"InferenceParams: qkv_format={qkv_format!r} is not one of {_FORMATS}")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.is_paged = is_paged
        self.device = construction_device("InferenceParams", device)
        shared = dict(num_heads=num_heads_kv, head_dim_k=head_dim_k, dtype=dtype,
                      head_dim_v=self.head_dim_v, max_batch_size=max_batch_size,
                      max_seqlen=max_sequence_length)  # fmt: skip
        if is_paged:
            if page_size is None:
                raise AssertionError("InferenceParams: a paged KV cache requires page_size")
            if max_sequence_length % page_size:
                raise AssertionError(
                    f"InferenceParams: a paged KV cache requires max_sequence_length "
                    f"({max_sequence_length}) % page_size ({page_size}) == 0"
                )
            pages = max_batch_size * (max_sequence_length // page_size)
            if total_num_pages != pages:
                raise AssertionError(
                    f"InferenceParams: a paged KV cache requires total_num_pages == "
                    f"max_batch_size * max_sequence_length // page_size = {pages}, got "
                    f"{total_num_pages}"
                )
            self.page_size, self.total_num_pages = page_size, total_num_pages
            manager_class = custom_cache_manager or PagedKVCacheManager
            shared.update(total_num_pages=total_num_pages, page_size=page_size)
        else:
            manager_class = custom_cache_manager or NonPagedKVCacheManager
        if _accepts_device(manager_class):
            shared["device"] = self.device
        self.cache_manager = manager_class(**shared)
        if qkv_format == "thd" and max_ctx_len is None:
            raise AssertionError("InferenceParams: max_ctx_len is required when qkv_format='thd'")
        if max_ctx_len is not None and not 1 <= max_ctx_len <= max_sequence_length:
            raise ValueError(
                f"InferenceParams: max_ctx_len={max_ctx_len} must lie in [1, "
                f"max_sequence_length={max_sequence_length}]"
            )
        self.max_ctx_len = max_ctx_len
        self.cache_qkv_format = "bshd"
        self._set_input_format(qkv_format)
        # Normal tensors even when built under torch.inference_mode: pre_step and reset update
        # them in place, also outside inference mode.
        with torch.inference_mode(False):
            self.cu_seqlens_q = torch.zeros(
                max_batch_size + 1, dtype=torch.int32, device=self.device
            )
            self.cu_seqlens_kv = torch.zeros_like(self.cu_seqlens_q)
            self._lengths_pre_step = torch.zeros(
                max_batch_size, dtype=torch.int32, device=self.device
            )
        self.reset()

    def _set_input_format(self, qkv_format: str) -> None:
        self.input_qkv_format = qkv_format
        same = qkv_format == self.cache_qkv_format
        self.output_qkv_format = qkv_format if same else f"{qkv_format}_2{self.cache_qkv_format}"

    def reset(self) -> None:
        """Forget every sequence; the caches stay allocated."""
        self.sequences: OrderedDict = OrderedDict()
        self.sequences_pre_step: OrderedDict = OrderedDict()
        self.batch_size = 0
        self._new_tokens: list[int] = []
        self._lengths_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cache_manager.reset()
        self.cu_seqlens_q.zero_()
        self.cu_seqlens_kv.zero_()
        self._lengths_pre_step.zero_()

    def allocate_memory(self, layer_number: int) -> None:
        """Allocate ``layer_number``'s K and V caches (zeroed)."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: Mapping) -> None:
        """Start an iteration: ``step_dict`` maps each live sequence id, in batch order, to the
        number of tokens it brings now (its prompt when new, usually 1 when generating)."""
        if not isinstance(step_dict, Mapping):
            raise TypeError(
                "InferenceParams.pre_step: step_dict must be an OrderedDict {seq_id: new_tokens}, "
                f"got {type(step_dict).__name__}"
            )
        if not 1 <= len(step_dict) <= self.max_batch_size:
            raise ValueError(
                f"InferenceParams.pre_step: {len(step_dict)} sequences; between 1 and "
                f"max_batch_size={self.max_batch_size} may be live at once"
            )
        for seq_id, new in step_dict.items():
            if isinstance(new, bool) or int(new) != new or new < 1:
                raise ValueError(
                    f"InferenceParams.pre_step: sequence {seq_id!r} brings {new!r} tokens; each "
                    "live sequence brings a positive whole number of tokens"
                )
            total = self.sequences.get(seq_id, 0) + int(new)
            if total > self.max_sequence_length:
                raise ValueError(
                    f"InferenceParams.pre_step: sequence {seq_id!r} would hold {total} tokens, "
                    f"more than max_sequence_length={self.max_sequence_length}"
                )
        self.sequences_pre_step = OrderedDict(
            (seq_id, self.sequences.get(seq_id, 0)) for seq_id in step_dict
        )
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.batch_size = len(step_dict)
        self._new_tokens = [int(n) for n in step_dict.values()]
        padding = [0] * (self.max_batch_size - self.batch_size)
        lengths = torch.tensor(
            [self._new_tokens + padding, list(self.sequences.values()) + padding]
        )
        cumulative = torch.cat([torch.zeros(2, 1, dtype=torch.int64), lengths.cumsum(1)], dim=1)
        # In place: a captured graph keeps reading these tensors.
        self.cu_seqlens_q.copy_(cumulative[0])
        self.cu_seqlens_kv.copy_(cumulative[1])
        before = list(self.sequences_pre_step.values()) + padding
        self._lengths_pre_step.copy_(torch.tensor(before, dtype=torch.int32))
        self._lengths_by_device = {}

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """int32 ``[batch_size]`` on the cache's device: each live sequence's length before
        this iteration's tokens (the rotary ``start_positions`` of its new tokens). A view of a
        persistent tensor that ``pre_step`` updates in place (graph capture keeps reading it)."""
        return self._lengths_pre_step[: self.batch_size]

    def _lengths_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device == self.cu_seqlens_q.device:
            return self.cu_seqlens_q, self.cu_seqlens_kv
        if device not in self._lengths_by_device:
            self._lengths_by_device[device] = (
                self.cu_seqlens_q.to(device),
                self.cu_seqlens_kv.to(device),
            )
        return self._lengths_by_device[device]

    def _check_new(self, name: str, new: torch.Tensor, head_dim: int, qkv_format: str) -> None:
        dims = 3 if qkv_format == "thd" else 4
        if new.dim() != dims or tuple(new.shape[-2:]) != (self.num_heads_kv, head_dim):
            raise ValueError(
                f"InferenceParams.step: {name} has shape {tuple(new.shape)}; qkv_format="
                f"{qkv_format!r} needs {dims} dimensions ending in (num_heads_kv, head_dim) = "
                f"({self.num_heads_kv}, {head_dim})"
            )
        if qkv_format == "thd":
            if new.shape[0] < sum(self._new_tokens):
                raise ValueError(
                    f"InferenceParams.step: {name} holds {new.shape[0]} tokens but pre_step "
                    f"announced {sum(self._new_tokens)}"
                )
            return
        batch, length = new.shape[:2] if qkv_format == "bshd" else new.shape[1::-1]
        if not self.batch_size <= batch <= self.max_batch_size or length < max(self._new_tokens):
            raise ValueError(
                f"InferenceParams.step: {name} has {batch} sequences of {length} tokens "
                f"({qkv_format}); pre_step announced {self.batch_size} sequences of up to "
                f"{max(self._new_tokens)} new tokens (at most max_batch_size="
                f"{self.max_batch_size} sequences)"
            )

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Copy this iteration's K/V of ``layer_number`` into its cache.

        ``new_k``/``new_v``: bshd ``[b, s, h, d]`` or sbhd ``[s, b, h, d]`` with sequence
        ``i``'s tokens first along ``s`` (the rest is padding), or thd ``[t, h, d]`` packed in
        batch order; ``b`` may exceed the live batch (extra rows are ignored).

        Returns the 6 values ``(k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv,
        max_sequence_length, output_qkv_format)``:

        * ``k_cache``, ``v_cache``: the layer's whole cache, bshd (see the module docstring;
          paged: ``[total_num_pages, page_size, h, d]`` with ``cache_manager.page_table``);
        * ``cu_seqlens_q``, ``cu_seqlens_kv``: int32 ``[max_batch_size + 1]`` on the cache's
          device, the new and the total (cached plus new) tokens per live sequence;
        * ``max_sequence_length``: the cache's sequence capacity (an upper bound of the KV
          lengths; no query maximum is returned);
        * ``output_qkv_format``: ``qkv_format`` when it is "bshd", else ``"<qkv_format>_2bshd"``.
        """
        if qkv_format not in _FORMATS:
            raise ValueError(
                f"InferenceParams.step: qkv_format={qkv_format!r} is not one of {_FORMATS}"
            )
        if not self._new_tokens:
            raise RuntimeError(
                "InferenceParams.step: call pre_step({seq_id: new_tokens, ...}) before the "
                "model's forward in each iteration"
            )
        if new_k.device != new_v.device:
            raise DevicePlacementError(
                f"InferenceParams.step: new_k is on {new_k.device} but new_v on {new_v.device}"
            )
        if qkv_format == "thd" and self.max_ctx_len is not None:
            if max(self._new_tokens) > self.max_ctx_len:
                raise ValueError(
                    f"InferenceParams.step: a sequence brings {max(self._new_tokens)} tokens, "
                    f"more than max_ctx_len={self.max_ctx_len}"
                )
        self._check_new("new_k", new_k, self.head_dim_k, qkv_format)
        self._check_new("new_v", new_v, self.head_dim_v, qkv_format)
        self._set_input_format(qkv_format)
        cu_q, cu_kv = self._lengths_on(new_k.device)
        k_cache, v_cache, _ = self.cache_manager.step(
            layer_number, new_k, new_v, cu_q, cu_kv, qkv_format
        )
        cu_q, cu_kv = self._lengths_on(k_cache.device)
        return k_cache, v_cache, cu_q, cu_kv, self.max_sequence_length, self.output_qkv_format

    def convert_paged_to_nonpaged(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer_number``'s K and V as ``[max_batch_size, max_sequence_length, h, d]``
        (row ``i`` the ``i``-th live sequence); a copy for a paged cache, the cache itself
        otherwise."""
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        if not self.is_paged:
            return k_cache, v_cache
        table = self.cache_manager.page_table.to(device=k_cache.device, dtype=torch.int64)
        return tuple(
            c[table].reshape(self.max_batch_size, -1, *c.shape[2:])[:, : self.max_sequence_length]
            for c in (k_cache, v_cache)
        )

    def __repr__(self) -> str:
        kind = f"paged, page_size={self.page_size}" if self.is_paged else "non-paged"
        return (
            f"InferenceParams(max_batch_size={self.max_batch_size}, max_sequence_length="
            f"{self.max_sequence_length}, {kind}, dtype={self.dtype}, device={self.device}, "
            f"sequences={dict(self.sequences)})"
        )
