#!/usr/bin/env python
"""Bandwidth of the MLP block's elementwise kernels on one CUDA GPU, against a device copy.

For each activation (forward and backward, high precision and FP8 with the transposed copy),
the activation's amax pass (current scaling), the plain FP8 cast+transpose and amax pass, and
LayerNorm / RMSNorm forward and backward (PyTorch's kernels and the package's, the latter also
writing FP8 with the transposed copy), it reports the bytes a kernel must move (inputs read
once plus outputs written once), its time (CUDA events, median over batches) and that
bandwidth as a fraction of a device-to-device copy's, measured in the same run. Target (issue:
the MLP block): 80% of the copy for every fused activation and norm kernel.

    python benchmarks/mlp/benchmark_kernels.py                      # 8192 x 16384 bf16
    python benchmarks/mlp/benchmark_kernels.py --rows 16384 --cols 4096 --json out.json
    python benchmarks/mlp/benchmark_kernels.py --cols 14336 --activations swiglu gelu
    python benchmarks/mlp/benchmark_kernels.py --norm-shapes 8192x4096 16384x2048 --batch 10

The last lines summarise the fused activation kernels: the lowest fraction of the copy and the
kernels below the target.

    python benchmarks/mlp/benchmark_kernels.py --cols 14336 --activations swiglu --variants 1 2

--variants also times the FP8 backwards of the gated activations chosen under each listed
NVTE_CAST_TRANSPOSE_VARIANT (1: gated backwards on the base cast+transpose kernel, 2: on their
paired-halves kernel, the default; 0: the base kernel everywhere), each in a child process (the
library reads the variable once per process), after the main table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from transformer_engine.pytorch.cpp_extensions import compute_amax, norm_kernels, quantize
from transformer_engine.pytorch.cpp_extensions.activation import (
    activation_amax,
    activation_backward,
    activation_backward_fp8,
    activation_forward,
    activation_forward_fp8,
    activation_spec,
)

ACTIVATIONS = ["gelu", "swiglu", "relu", "silu", "qgelu", "srelu", "geglu", "clamped_swiglu"]
GATED = ("swiglu", "geglu", "clamped_swiglu")
TARGET = 0.80


def time_ms(fn, warmup: int, iters: int, batch: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / batch)
    return statistics.median(times)


def activation_cases(name, rows, cols, dtype, device, scale, amax):
    """(name, function, bytes moved) for one activation's five kernels."""
    e = torch.tensor([], dtype=dtype).element_size()
    spec = activation_spec(name)
    in_cols = 2 * cols if name in GATED else cols
    x = torch.randn(rows, in_cols, dtype=dtype, device=device)
    g = torch.randn(rows, cols, dtype=dtype, device=device)
    n_in, n_out = rows * in_cols, rows * cols
    short = str(dtype).removeprefix("torch.")
    return [
        (f"{name} fwd {short}", lambda: activation_forward(x, spec), (n_in + n_out) * e),
        (f"{name} fwd fp8+T", lambda: activation_forward_fp8(
            x, spec, scale, torch.float8_e4m3fn, amax=amax, with_transpose=True),
         n_in * e + 2 * n_out),
        (f"{name} fwd amax", lambda: activation_amax(x, spec, amax), n_in * e),
        (f"{name} bwd {short}", lambda: activation_backward(g, x, spec), (n_out + 2 * n_in) * e),
        (f"{name} bwd fp8+T+dbias", lambda: activation_backward_fp8(
            g, x, spec, scale, torch.float8_e5m2, amax=amax, with_dbias=True),
         (n_out + n_in) * e + 2 * n_in),
    ]  # fmt: skip


def other_cases(rows, cols, dtype, device, scale, amax):
    """The plain FP8 cast+transpose and amax pass (current scaling's casts), and the norms over
    a [rows, cols / 4] input (the MLP's hidden size is a quarter of its FFN size)."""
    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(rows, cols, dtype=dtype, device=device)
    return [
        (f"cast+T {rows}x{cols}", lambda: quantize(
            x, scale, torch.float8_e4m3fn, amax=amax, with_transpose=True), x.numel() * (e + 2)),
        (f"amax {rows}x{cols}", lambda: compute_amax(x, out=amax), x.numel() * e),
    ] + norm_cases(rows, cols // 4, dtype, device, scale, amax)  # fmt: skip


def norm_cases(rows, hidden, dtype, device, scale, amax):
    """LayerNorm / RMSNorm forward and backward over a [rows, hidden] input: PyTorch's kernels,
    then the package's."""
    e = torch.tensor([], dtype=dtype).element_size()
    h = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.ones(hidden, dtype=dtype, device=device)
    b = torch.zeros(hidden, dtype=dtype, device=device)
    out, mean, rstd = torch.native_layer_norm(h, (hidden,), w, b, 1e-5)
    dy = torch.randn_like(out)
    n = h.numel()
    return [
        (f"layer_norm fwd {rows}x{hidden}",
         lambda: torch.native_layer_norm(h, (hidden,), w, b, 1e-5), 2 * n * e),
        ("layer_norm bwd", lambda: torch.ops.aten.native_layer_norm_backward(
            dy, h, (hidden,), mean, rstd, w, b, [True, True, True]), 3 * n * e),
        ("rms_norm fwd", lambda: F.rms_norm(h, (hidden,), w, 1e-5), 2 * n * e),
    ] + native_norm_cases(h, w, b, dy, scale, amax)  # fmt: skip


def native_norm_cases(h, w, b, dy, scale, amax):
    """The package's LayerNorm / RMSNorm kernels on the same input as PyTorch's above; the
    high-precision forward and the backward through the entries the modules call (no Python
    argument checks, whose host time would rival the kernel's at the smaller shapes)."""
    e, n = h.element_size(), h.numel()
    cases = []
    for kind, rms, bias in (("native layer_norm", False, b), ("native rms_norm", True, None)):
        _, mean, rsigma = norm_kernels.norm_forward(h, w, bias, 1e-5, False, rms=rms)
        cases += [
            (
                f"{kind} fwd",
                lambda rms=rms, bias=bias: norm_kernels.norm_forward_prevalidated(
                    h, w, bias, 1e-5, False, rms=rms
                ),
                2 * n * e,
            ),
            (
                f"{kind} fwd fp8+T",
                lambda rms=rms, bias=bias: norm_kernels.norm_forward_fp8(
                    h,
                    w,
                    bias,
                    1e-5,
                    False,
                    rms=rms,
                    scale=scale,
                    fp8_dtype=torch.float8_e4m3fn,
                    amax=amax,
                    with_transpose=True,
                ),
                n * e + 2 * n,
            ),
            (
                f"{kind} amax",
                lambda rms=rms, bias=bias: norm_kernels.norm_amax(
                    h, w, bias, 1e-5, False, rms=rms, amax=amax
                ),
                n * e,
            ),
            (
                f"{kind} bwd",
                lambda rms=rms, bias=bias, mean=mean, rsigma=rsigma: (
                    norm_kernels.norm_backward_prevalidated(
                        dy, h, mean, rsigma, w, False, rms=rms, with_dbeta=bias is not None
                    )
                ),
                3 * n * e,
            ),
        ]
    return cases


def run_variant(args, gated, variant: int) -> list[dict]:
    """The gated FP8 backwards' rows, timed in a child process under
    NVTE_CAST_TRANSPOSE_VARIANT=variant (fractions of the child's own copy measurement)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--rows", str(args.rows), "--cols",
               str(args.cols), "--dtype", args.dtype, "--iters", str(args.iters), "--no-others",
               "--only", "bwd fp8", "--json", path, "--activations", *gated]  # fmt: skip
        env = dict(os.environ, NVTE_CAST_TRANSPOSE_VARIANT=str(variant))
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["kernels"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=16384, help="the activation's output width")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--activations", nargs="+", choices=ACTIVATIONS, default=ACTIVATIONS,
                   help="the activations to run (default: all)")  # fmt: skip
    p.add_argument("--no-others", action="store_true",
                   help="skip the plain cast+transpose and the norms")  # fmt: skip
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--only", help="run only the kernels whose name contains this")
    p.add_argument("--variants", nargs="+", type=int, default=[],
                   help="also time the gated FP8 backwards under these cast+transpose variants")  # fmt: skip
    p.add_argument("--norm-shapes", nargs="+", default=[], metavar="ROWSxHIDDEN",
                   help="time only the norms, at each of these shapes (e.g. 8192x4096)")  # fmt: skip
    p.add_argument("--batch", type=int, default=3, help="calls per timed batch")
    args = p.parse_args()
    try:
        norm_shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.norm_shapes]
    except ValueError:
        p.error(f"--norm-shapes {args.norm_shapes}: each must be ROWSxHIDDEN, e.g. 8192x4096")
    if any(len(shape) != 2 for shape in norm_shapes):
        p.error(f"--norm-shapes {args.norm_shapes}: each must be ROWSxHIDDEN, e.g. 8192x4096")
    if not torch.cuda.is_available():
        print("benchmark_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    src = torch.randn(args.rows, 2 * args.cols, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), 5, args.iters, 5)
    copy_gbs = 2 * src.numel() * src.element_size() / copy_ms / 1e6
    print(f"device copy: {copy_gbs:.0f} GB/s")
    print(f"{'kernel':>32} {'ms':>8} {'GB/s':>7} {'of copy':>8}")
    rows = []
    scale = torch.ones(1, device=device)
    amax = torch.zeros(1, device=device)
    if norm_shapes:
        cases = [case for r, h in norm_shapes
                 for case in norm_cases(r, h, dtype, device, scale, amax)]  # fmt: skip
    else:
        cases = [
            case
            for name in args.activations
            for case in activation_cases(name, args.rows, args.cols, dtype, device, scale, amax)
        ]
    fused = 0 if norm_shapes else len(cases)
    if not args.no_others and not norm_shapes:
        cases += other_cases(args.rows, args.cols, dtype, device, scale, amax)
    if args.only:
        fused = sum(args.only in case[0] for case in cases[:fused])
        cases = [case for case in cases if args.only in case[0]]
    for name, fn, nbytes in cases:
        ms = time_ms(fn, 3, args.iters, args.batch)
        gbs = nbytes / ms / 1e6
        frac = gbs / copy_gbs
        flag = "" if frac >= TARGET else "  < target"
        print(f"{name:>32} {ms:8.3f} {gbs:7.0f} {frac:8.2f}{flag}")
        rows.append({"kernel": name, "ms": ms, "GBps": gbs, "fraction_of_copy": frac})
    if fused:
        worst = min(rows[:fused], key=lambda row: row["fraction_of_copy"])
        below = [row["kernel"] for row in rows[:fused] if row["fraction_of_copy"] < TARGET]
        print(f"fused activation kernels: lowest {worst['fraction_of_copy']:.2f} of copy "
              f"({worst['kernel']}); {len(below)} of {fused} below {TARGET}")  # fmt: skip
    gated = [name for name in args.activations if name in GATED]
    for variant in args.variants if gated else []:
        for row in run_variant(args, gated, variant):
            print(f"{row['kernel'] + f' [variant {variant}]':>32} {row['ms']:8.3f} "
                  f"{row['GBps']:7.0f} {row['fraction_of_copy']:8.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_gbs, "kernels": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
