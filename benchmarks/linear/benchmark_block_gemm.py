#!/usr/bin/env python
"""Block-scaled FP8 GEMM benchmark: the GEMMs of a te.Linear step under Float8BlockScaling, on
each route this package has, against the per-tensor FP8 and BF16 GEMMs, on one CUDA GPU, in one
run.

Routes, for ``out[M, N] = x[M, K] @ y[N, K]^T`` (FP8 E4M3, BF16 output):

* native 128x128 (y) x 1x128 (x)   ``nvte_block_scaled_gemm`` (cuBLASLt): fprop and dgrad
* native 1x128 x 1x128             the same call with 1x128 tiles on both: wgrad
* torch._scaled_mm 1x128 x 1x128   the fallback route (the only blockwise mode torch takes here)
* torch._scaled_mm per-tensor      the ceiling an FP8 GEMM reaches (DelayedScaling's)
* torch.mm BF16                    the baseline

Shapes: the three GEMMs of a (tokens, in, out) = (16384, 4096, 14336) te.Linear step (fprop,
dgrad, wgrad) and (8192, 8192, 8192). Times are medians of CUDA-event batches; figures are
TFLOP/s and the ratio to BF16. Before timing, each native case is checked against the float64
product of its dequantized operands.

    python benchmarks/linear/benchmark_block_gemm.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from transformer_engine.common.native import native_module
from transformer_engine.pytorch.cpp_extensions._routing import launch_args, tensor_arg
from transformer_engine.pytorch.cpp_extensions.block_gemm import _scaled_mm_scales
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quantize"))  # cuda_timing
from cuda_timing import time_us  # noqa: E402

SHAPES = {  # name: (M, N, K)
    "fprop (16384, 4096 -> 14336)": (16384, 14336, 4096),
    "dgrad (16384, 4096 -> 14336)": (16384, 4096, 14336),
    "wgrad (16384, 4096 -> 14336)": (14336, 4096, 16384),
    "8192^3": (8192, 8192, 8192),
}


def time_ms(fn, warmup: int, iters: int, batch: int) -> float:
    """Median per-call milliseconds over ``iters`` CUDA-event batches of ``batch`` calls."""
    return time_us(fn, warmup, iters * batch, batch) / 1e3


def operand(rows, k, two_d, device):
    q = Float8BlockQuantizer(
        torch.float8_e4m3fn, rowwise=True, columnwise=False, block_scaling_dim=2 if two_d else 1
    )
    t = q(torch.randn(rows, k, device=device, dtype=torch.bfloat16))
    values, scales, _ = t.block_float8_gemm_input(False)
    return t, values, scales


def bench_shape(native, name, m, n, k, device, workspace, timing) -> bool:
    """Times one GEMM shape on every route and prints a line each; True when a check failed."""
    failed = False
    xq, x, xs = operand(m, k, False, device)
    results = []
    for y2d in (True, False):
        yq, y, ys = operand(n, k, y2d, device)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)

        def call(y=y, ys=ys, y2d=y2d, out=out):
            return native.block_scaled_gemm(
                tensor_arg(x), tensor_arg(xs), False, tensor_arg(y), tensor_arg(ys), y2d, None,
                tensor_arg(out), tensor_arg(workspace), *launch_args(device),
            )  # fmt: skip

        if not call():
            print(f"{name}: cuBLASLt has no kernel (y 2-D: {y2d})")
            failed = True
            continue
        # the check: 256 rows of the product against float64
        ref = (
            xq.dequantize(dtype=torch.float32)[:256].double()
            @ yq.dequantize(dtype=torch.float32).double().t()
        )
        err = float((out[:256].double() - ref).abs().max() / ref.abs().max())
        if err > 1e-2:
            print(f"{name}: native product off by {err:.3g} of its largest magnitude")
            failed = True
        del ref
        results.append(("native 128x128 x 1x128" if y2d else "native 1x128 x 1x128",
                        time_ms(call, *timing)))  # fmt: skip
        if not y2d:
            sa, sb = _scaled_mm_scales(x, xs, False, y, ys, False)
            one = torch.ones((), device=device)
            for label, scale_a, scale_b in (("torch._scaled_mm 1x128 x 1x128", sa, sb),
                                            ("torch._scaled_mm per-tensor", one, one)):  # fmt: skip

                def scaled(y=y, scale_a=scale_a, scale_b=scale_b):
                    return torch._scaled_mm(x, y.t(), scale_a=scale_a, scale_b=scale_b,
                                            out_dtype=torch.bfloat16)  # fmt: skip

                results.append((label, time_ms(scaled, *timing)))
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    bf16 = time_ms(lambda: a @ b.t(), *timing)
    flop = 2.0 * m * n * k
    for label, ms in [*results, ("torch.mm BF16", bf16)]:
        print(f"{name:>44} {label:>34} {ms:8.3f} {flop / ms / 1e9:8.0f} {bf16 / ms:7.2f}x")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, default=5)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    native = native_module()
    if not torch.cuda.is_available() or native is None or not native.cublaslt_version():
        print("needs a CUDA GPU, the native library and cuBLASLt 12.9+", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    print(f"block GEMM benchmark on {torch.cuda.get_device_name(device)}, torch "
          f"{torch.__version__}, cuBLASLt {native.cublaslt_version()}")  # fmt: skip
    timing = (args.warmup, args.iters, args.batch)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    failed = False
    print(f"{'GEMM (M, N, K)':>44} {'route':>34} {'ms':>8} {'TFLOP/s':>8} {'vs BF16':>8}")
    for name, (m, n, k) in SHAPES.items():
        failed |= bench_shape(native, f"{name} {(m, n, k)}", m, n, k, device, workspace, timing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
