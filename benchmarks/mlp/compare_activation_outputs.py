#!/usr/bin/env python
"""Are two builds' activation kernels bit for bit the same? Run once per build, then compare.

A rewrite of the kernels' structure (loops, dispatch, launch shape) must not change one bit of
their results; the kernel tests only check them against float64 within a tolerance. This
records every activation's results on one CUDA GPU, for each dtype, on shapes that take the
vectorised and the element-wise paths: forward and backward in high precision, FP8 without and
with the transposed copy, the backward's bias gradient, and both amax passes.

    python benchmarks/mlp/compare_activation_outputs.py --dump /tmp/before.pt   # build A
    python benchmarks/mlp/compare_activation_outputs.py --dump /tmp/after.pt    # build B
    python benchmarks/mlp/compare_activation_outputs.py --compare /tmp/before.pt /tmp/after.pt

--compare prints each differing result (and the count of differing elements) and exits 1 if
any differ. Results of more than 2^20 elements are kept as a SHA-256 of their bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from transformer_engine.pytorch.cpp_extensions.activation import (
    activation_amax,
    activation_backward,
    activation_backward_amax,
    activation_backward_fp8,
    activation_forward,
    activation_forward_fp8,
    activation_spec,
)

NAMES = ["gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu",
         "swiglu", "glu", "clamped_swiglu"]  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (rows, input width): vectorised (widths a multiple of 16), a partial tile and odd rows, and
# widths that are not a multiple of 8 (element-wise loads).
SHAPES = [(3001, 2048), (2100, 528), (1030, 74), (7, 2)]


def results(
    name: str, dtype: torch.dtype, shape: tuple[int, int], device: str
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * NAMES.index(name) + SHAPES.index(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype).to(device)
    spec = activation_spec(name)
    out_cols = shape[1] // 2 if spec.gated else shape[1]
    grad = (3 * torch.randn(shape[0], out_cols, generator=g)).to(dtype).to(device)
    scale = torch.tensor([0.5], device=device)
    out = {"fwd": activation_forward(x, spec), "bwd": activation_backward(grad, x, spec)}
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        tag = str(fp8).split("_")[-1]
        for with_t in (False, True):
            amax = torch.zeros(1, device=device)
            res = activation_forward_fp8(x, spec, scale, fp8, amax=amax, with_transpose=with_t)
            out[f"fwd_{tag}_t{int(with_t)}"] = res.data.view(torch.uint8)
            if with_t:
                out[f"fwd_{tag}_T"] = res.transpose.view(torch.uint8)
            out[f"fwd_{tag}_t{int(with_t)}_amax"] = amax
        amax = torch.zeros(1, device=device)
        res, dbias = activation_backward_fp8(grad, x, spec, scale, fp8, amax=amax, with_dbias=True)
        out[f"bwd_{tag}"] = res.data.view(torch.uint8)
        out[f"bwd_{tag}_T"] = res.transpose.view(torch.uint8)
        out[f"bwd_{tag}_amax"] = amax
        out[f"bwd_{tag}_dbias"] = dbias
    amax = torch.zeros(1, device=device)
    activation_amax(x, spec, amax)
    out["fwd_amax_pass"] = amax
    amax = torch.zeros(1, device=device)
    activation_backward_amax(grad, x, spec, amax)
    out["bwd_amax_pass"] = amax.clone()
    return {k: v.cpu() for k, v in out.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaNs compare equal to themselves."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def record(t: torch.Tensor) -> torch.Tensor | str:
    """The result itself, or the digest of its bytes when large (keeps the file small)."""
    if t.numel() <= 2**20:
        return t
    return hashlib.sha256(bits(t.contiguous()).numpy().tobytes()).hexdigest()


def dump(path: str, device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--dump needs a CUDA GPU to record the native kernels' results (or --device cpu "
                 "for a smoke run of the reference path)")  # fmt: skip
    table = {}
    for name in NAMES:
        for dname, dtype in DTYPES.items():
            for shape in SHAPES:
                for key, value in results(name, dtype, shape, device).items():
                    table[f"{name}/{dname}/{shape[0]}x{shape[1]}/{key}"] = record(value)
    torch.save(table, path)
    print(f"{len(table)} results written to {path}")


def compare(path_a: str, path_b: str) -> int:
    a, b = torch.load(path_a), torch.load(path_b)
    if a.keys() != b.keys():
        print(f"different result sets: {sorted(a.keys() ^ b.keys())[:10]}")
        return 1
    bad = 0
    for key in a:
        if isinstance(a[key], str) or isinstance(b[key], str):
            if a[key] != b[key]:
                print(f"{key}: the SHA-256 of the bytes differs")
                bad += 1
            continue
        if a[key].shape != b[key].shape or a[key].dtype != b[key].dtype:
            print(f"{key}: shape/dtype {tuple(a[key].shape)}/{a[key].dtype} vs "
                  f"{tuple(b[key].shape)}/{b[key].dtype}")  # fmt: skip
            bad += 1
            continue
        diff = (bits(a[key]) != bits(b[key])).sum().item()
        if diff:
            print(f"{key}: {diff} of {a[key].numel()} elements differ")
            bad += 1
    print(f"{len(a) - bad} of {len(a)} results bit for bit equal")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--dump", metavar="FILE", help="record this build's results")
    group.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two records")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the reference path")
    args = p.parse_args()
    if args.dump:
        dump(args.dump, args.device)
        return 0
    return compare(*args.compare)


if __name__ == "__main__":
    sys.exit(main())
