"""An independent reader and writer of the extra-state format's version 2 bytes, written from
its documented layout (transformer_engine/pytorch/extra_state/bytes_format.py, docs/modules.md)
with :mod:`struct` and :mod:`json` only, so tests can check what the package writes and hand it
bytes (well formed or broken) it did not write itself. Also the small helpers the extra-state
tests share.
"""

from __future__ import annotations

import json
import math
import struct

import torch

MAGIC = b"\xffTEXS"
VERSION = 2
FORMAT_NAME = "transformer_engine/extra_state"


def state_tensors(n_fwd=3, n_bwd=2, length=5, seed=0) -> dict[str, torch.Tensor]:
    """Random delayed-scaling state: scales [N] and amax histories [L, N] of both directions."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "scale_fwd": torch.rand(n_fwd, generator=gen) * 100,
        "amax_history_fwd": torch.rand(length, n_fwd, generator=gen),
        "scale_bwd": torch.rand(n_bwd, generator=gen) * 1e4,
        "amax_history_bwd": torch.rand(length, n_bwd, generator=gen),
    }


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same float32 bit patterns (NaN payloads and -0.0 included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def float32_le_bytes(tensor: torch.Tensor) -> bytes:
    """A float32 tensor's values as little-endian bytes, through struct (bit patterns kept by
    going through int32)."""
    words = tensor.detach().cpu().contiguous().reshape(-1).view(torch.int32).tolist()
    return struct.pack(f"<{len(words)}i", *words)


def tensor_from_le_bytes(data: bytes, shape: list[int]) -> torch.Tensor:
    count = math.prod(shape)
    words = struct.unpack(f"<{count}i", data)
    return torch.tensor(words, dtype=torch.int32).view(torch.float32).reshape(shape)


def header_entries(tensors: dict[str, torch.Tensor]) -> list[dict]:
    entries, offset = [], 0
    for name, tensor in tensors.items():
        nbytes = 4 * tensor.numel()
        entries.append({"name": name, "dtype": "float32", "shape": list(tensor.shape),
                        "offset": offset, "nbytes": nbytes})  # fmt: skip
        offset += nbytes
    return entries


def build(header: dict, data: bytes, *, version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    """Raw v2 bytes from a header object (serialized as given) and a data section."""
    text = json.dumps(header).encode("utf-8")
    return magic + bytes([version]) + struct.pack("<I", len(text)) + text + data


def build_state(recipe: dict, tensors: dict[str, torch.Tensor], extra: dict) -> bytes:
    """The v2 bytes of a recipe dict, state tensors and extra values."""
    header = {"format": FORMAT_NAME, "version": VERSION, "recipe": recipe, "extra": extra,
              "tensors": header_entries(tensors)}  # fmt: skip
    return build(header, b"".join(float32_le_bytes(t) for t in tensors.values()))


def as_uint8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def parse(state: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor], bytes]:
    """``(header, tensors, data section)`` of v2 bytes held in a uint8 tensor."""
    data = bytes(state.detach().cpu().tolist())
    assert data[:5] == MAGIC, data[:8]
    assert data[5] == VERSION
    (length,) = struct.unpack("<I", data[6:10])
    header = json.loads(data[10 : 10 + length].decode("utf-8"))
    body = data[10 + length :]
    tensors = {
        e["name"]: tensor_from_le_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], e["shape"])
        for e in header["tensors"]
    }
    return header, tensors, body
