"""Version 2 of our extra-state format: one 1-D ``torch.uint8`` tensor of bytes, no pickle.

Why bytes in a tensor
---------------------
Hugging Face ``save_pretrained`` writes safetensors, which hold tensors only, and transformers,
accelerate and ``torch.distributed.checkpoint`` treat every state-dict value as a tensor.
Upstream Transformer Engine therefore keeps ``_extra_state`` a ``torch.uint8`` tensor (empty
when there is no FP8 state), but fills it with pickle bytes, which run code when read. Version 2
keeps upstream's container and replaces the pickle with data that is only ever parsed:

======================  =====================================================================
bytes                   content
======================  =====================================================================
0 .. 4                  :data:`MAGIC`, ``b"\\xffTEXS"``
5                       the format version, :data:`VERSION` (2)
6 .. 9                  ``H``: the header's length in bytes, unsigned 32-bit little-endian
10 .. 10+H              the header: UTF-8 JSON (below)
10+H ..                 the data: each tensor's raw little-endian bytes, back to back, in the
                        header's order
======================  =====================================================================

The header is one JSON object::

    {"format": "transformer_engine/extra_state", "version": 2,
     "recipe": <recipe_to_dict(recipe)>, "extra": {...},
     "tensors": [{"name": "scale_fwd", "dtype": "float32", "shape": [3],
                  "offset": 0, "nbytes": 12}, ...]}

``offset`` counts from the start of the data section. Non-finite floats in the recipe or in
``"extra"`` use JSON's common extension ``NaN``, ``Infinity`` and ``-Infinity`` (what Python's
:mod:`json` writes and reads by default), so they round-trip exactly; every other float is
written as its shortest round-tripping decimal, so it comes back bit for bit too. JSON has no
tuple: a tuple stored in ``"extra"`` comes back as a list.

The first byte, ``0xFF``, is not a pickle opcode (every pickle of protocol 2 or later starts
with ``0x80``, older ones with an opcode), so these bytes can never be mistaken for upstream's
pickled extra state, nor upstream's for ours; a pickle reader fails on them at the first byte.

This module only encodes and parses; :mod:`.format` validates the pieces (recipe, tensor set,
extra values) for both of its formats.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
from typing import Any

import torch

from .contents import ANOTHER_LAYOUT, FORMAT_NAME, TENSOR_NAMES

__all__ = ["MAGIC", "VERSION", "PREFIX_BYTES", "has_magic", "encode", "decode"]

MAGIC = b"\xffTEXS"  # 0xFF (never a pickle's first byte) + "Transformer Engine eXtra State"
VERSION = 2
_LENGTH = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + 1 + _LENGTH.size

_HEADER_KEYS = ("format", "version", "recipe", "extra", "tensors")
_ENTRY_KEYS = ("name", "dtype", "shape", "offset", "nbytes")
# The dtypes a v2 tensor entry may name; the state tensors are float32 (check_tensor_set).
_DTYPES = {"float32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

_WHAT = f"extra state ({FORMAT_NAME} version {VERSION} bytes)"


def _flip_to_little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``raw`` (native-order uint8 bytes of ``itemsize``-byte elements) in little-endian order.

    The same flip converts back; on little-endian hosts (every platform torch ships for) it is
    the identity.
    """
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(1).reshape(-1)


def _read_bytes(flat: torch.Tensor, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of the contiguous CPU uint8 tensor ``flat`` (torch alone)."""
    return ctypes.string_at(flat.data_ptr() + start, stop - start)


def has_magic(flat: torch.Tensor) -> bool:
    """Whether the non-empty 1-D CPU uint8 tensor ``flat`` starts with :data:`MAGIC` (or is
    cut off inside it: such bytes are ours, truncated, and :func:`decode` says so)."""
    head = _read_bytes(flat, 0, min(flat.numel(), len(MAGIC)))
    return MAGIC.startswith(head)


def encode(recipe: dict, tensors: dict[str, torch.Tensor], extra: dict) -> torch.Tensor:
    """The v2 bytes of already validated pieces, as a fresh 1-D CPU ``torch.uint8`` tensor.

    ``recipe`` is :func:`.recipe_dict.recipe_to_dict`'s output, ``tensors`` dense CPU tensors of
    the dtypes in ``_DTYPES``, ``extra`` plain values.
    """
    entries, chunks, offset = [], [], 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        raw = _flip_to_little_endian(raw, tensor.element_size())
        entries.append(
            {
                "name": name,
                "dtype": _DTYPE_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": raw.numel(),
            }
        )
        chunks.append(raw)
        offset += raw.numel()
    header = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "recipe": recipe,
        "extra": extra,
        "tensors": entries,
    }
    # allow_nan: non-finite floats as NaN / Infinity / -Infinity (documented above).
    text = json.dumps(header, allow_nan=True, ensure_ascii=False, separators=(",", ":"))
    encoded = text.encode("utf-8")
    prefix = MAGIC + bytes([VERSION]) + _LENGTH.pack(len(encoded))
    head = torch.frombuffer(bytearray(prefix + encoded), dtype=torch.uint8)
    return torch.cat([head, *chunks])


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"{_WHAT}: the header repeats the keys {duplicates}")
    return dict(pairs)


def _parse_header(flat: torch.Tensor) -> tuple[dict, int]:
    """The header object and where the data section starts."""
    total = flat.numel()
    if total < PREFIX_BYTES:
        raise ValueError(
            f"{_WHAT} is truncated: {total} bytes, fewer than the {PREFIX_BYTES}-byte prefix "
            f"(magic, version, header length)"
        )
    version = int(flat[len(MAGIC)])
    if version != VERSION:
        raise ValueError(
            f"extra state has the {FORMAT_NAME} magic with version {version}; this build reads "
            f"version {VERSION} bytes (and version 1 dicts); {ANOTHER_LAYOUT}"
        )
    (length,) = _LENGTH.unpack(_read_bytes(flat, len(MAGIC) + 1, PREFIX_BYTES))
    if length > total - PREFIX_BYTES:
        raise ValueError(
            f"{_WHAT} is truncated: the header is {length} bytes long but only "
            f"{total - PREFIX_BYTES} bytes follow the prefix"
        )
    data_start = PREFIX_BYTES + length
    try:
        text = _read_bytes(flat, PREFIX_BYTES, data_start).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{_WHAT}: the header is not UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{_WHAT}: the header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{_WHAT}: the header is a JSON {type(header).__name__}, not an object")
    unknown = sorted(set(header) - set(_HEADER_KEYS))
    missing = [key for key in _HEADER_KEYS if key not in header]
    if unknown or missing:
        raise ValueError(
            f"{_WHAT}: the header has unknown keys {unknown} and lacks {missing}; {ANOTHER_LAYOUT}"
        )
    if header["format"] != FORMAT_NAME or header["version"] != VERSION:
        raise ValueError(
            f"{_WHAT}: the header says format={header['format']!r}, "
            f"version={header['version']!r}, expected {FORMAT_NAME!r} and {VERSION}; "
            f"{ANOTHER_LAYOUT}"
        )
    return header, data_start


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _check_entry(entry: Any, index: int, seen: set[str], offset: int) -> tuple[str, list[int]]:
    """Validate ``tensors[index]`` of the header; returns its name and shape."""
    where = f"{_WHAT}: header tensors[{index}]"
    if not isinstance(entry, dict) or sorted(entry) != sorted(_ENTRY_KEYS):
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{where} is {keys}; expected an object with keys {list(_ENTRY_KEYS)}")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if name not in TENSOR_NAMES or name in seen:
        problem = "repeats" if name in seen else "has the unknown name"
        raise ValueError(f"{where} {problem} {name!r}; expected each of {list(TENSOR_NAMES)} once")
    if dtype not in _DTYPES:
        raise ValueError(f"{where} ({name}) has dtype {dtype!r}; expected one of {list(_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise ValueError(f"{where} ({name}) has shape {shape!r}; expected a list of sizes >= 0")
    itemsize = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    nbytes = math.prod(shape) * itemsize
    if not _is_count(entry["nbytes"]) or entry["nbytes"] != nbytes:
        raise ValueError(
            f"{where} ({name}) says nbytes={entry['nbytes']!r}, but shape {shape} of {dtype} "
            f"holds {nbytes} bytes"
        )
    if entry["offset"] != offset or not _is_count(entry["offset"]):
        raise ValueError(
            f"{where} ({name}) starts at offset {entry['offset']!r}; tensors lie back to back, "
            f"so it must start at {offset}"
        )
    return name, shape


def decode(flat: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """Parse v2 bytes into ``(recipe, tensors, extra)`` as stored.

    ``flat`` is a contiguous 1-D CPU uint8 tensor that :func:`has_magic`. The tensors are fresh
    CPU tensors; the recipe and extra are the header's JSON values, not yet validated.

    Raises
    ------
    ValueError
        Truncated bytes, an unknown version, a header that is not UTF-8 JSON of the layout
        above, a tensor entry with a wrong name, dtype, shape, size or offset, or data bytes
        that do not add up to the entries' sizes. The message names what is wrong.
    """
    header, data_start = _parse_header(flat)
    entries = header["tensors"]
    if not isinstance(entries, list):
        raise ValueError(f"{_WHAT}: header 'tensors' is {entries!r}, not a list")
    data_bytes = flat.numel() - data_start
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for index, entry in enumerate(entries):
        name, shape = _check_entry(entry, index, set(tensors), offset)
        stop = offset + entry["nbytes"]
        if stop > data_bytes:
            raise ValueError(
                f"{_WHAT} is truncated: tensor {name!r} needs data bytes [{offset}, {stop}) but "
                f"the data section holds {data_bytes}"
            )
        dtype = _DTYPES[entry["dtype"]]
        # clone(): a fresh, aligned buffer the dtype view can reinterpret.
        raw = flat[data_start + offset : data_start + stop].clone()
        raw = _flip_to_little_endian(raw, torch.empty((), dtype=dtype).element_size())
        tensors[name] = raw.view(dtype).reshape(shape)
        offset = stop
    if offset != data_bytes:
        raise ValueError(
            f"{_WHAT}: {data_bytes - offset} bytes follow the last tensor; the header's tensors "
            f"account for {offset} of the {data_bytes} data bytes"
        )
    return header["recipe"], tensors, header["extra"]
