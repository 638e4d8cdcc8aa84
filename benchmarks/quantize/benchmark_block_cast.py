#!/usr/bin/env python
"""Block-scaled cast benchmark: Transformer Engine's native Float8BlockScaling and MXFP8 casts
against the device's copy bandwidth, on one CUDA GPU, in one run.

Cases (each writes into preallocated buffers through ``cpp_extensions.block_cast``):

* Float8 1x128, row-wise only             data + float32 scales
* Float8 1x128, both copies               row-wise + transposed column-wise (own tiles along M)
* Float8 128x128, both copies             row-wise + transposed bytes, shared block scales
* MXFP8 32-element blocks, both copies    row-wise + column-wise (E8M0 scales)
* device-to-device copy of the input      the memory-bandwidth ceiling

Bandwidth counts bytes read plus bytes written (input once, every data byte and scale
written). Target (issue 16): Float8BlockScaling casts at least 70% of the copy's GB/s (PASS /
FAIL per Float8 case; MXFP8 is reported without a target). Before timing, each case's output
for a smaller input is checked bitwise against the CPU reference; the exit status is 1 when a
check fails (or there is no GPU / native library), else 0.

    python benchmarks/quantize/benchmark_block_cast.py                 # 8192x8192 bf16 -> e4m3
    python benchmarks/quantize/benchmark_block_cast.py --dtype fp32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cuda_timing, also under python -P
from cuda_timing import (  # noqa: E402
    DTYPES,
    add_input_and_timing_args,
    check_input_and_timing_args,
    time_us,
)

try:
    import transformer_engine
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformer_engine
from transformer_engine.pytorch.cpp_extensions.block_cast import (
    BlockCastResult,
    float8_block_cast,
    mxfp8_block_cast,
)

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TARGET = 0.70  # Float8BlockScaling casts, fraction of copy GB/s
CHECK_SHAPE = (4112, 2200)  # partial tiles on both sides; more tiles than resident blocks


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_input_and_timing_args(p, shape="8192x8192", shape_help="M x K", fp8=FP8)
    add = p.add_argument
    add("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    check_input_and_timing_args(p, args, example="8192x8192", ndim=2)
    return args


def cases(fp8):
    """``(name, is_float8, cast(x, out=None) -> BlockCastResult)``."""

    def f8(dim, rowwise, columnwise):
        return lambda x, out=None: float8_block_cast(
            x, fp8, block_scaling_dim=dim, rowwise=rowwise, columnwise=columnwise, out=out
        )

    def mx(x, out=None):
        return mxfp8_block_cast(x, fp8, rowwise=True, columnwise=True, out=out)

    return [
        ("float8 1x128 rowwise", True, f8(1, True, False)),
        ("float8 1x128 both", True, f8(1, True, True)),
        ("float8 128x128 both", True, f8(2, True, True)),
        ("mxfp8 both", False, mx),
    ]


def bytes_moved(x: torch.Tensor, out: BlockCastResult) -> int:
    return x.numel() * x.element_size() + sum(
        t.numel() * t.element_size() for t in out if t is not None
    )


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmark_block_cast.py needs a CUDA GPU: torch.cuda.is_available() is False.")
    status = transformer_engine.native_status()
    if not status.available:
        sys.exit(f"benchmark_block_cast.py needs TE's native library: {status}")
    device = torch.device(args.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    dtype, fp8 = DTYPES[args.dtype], FP8[args.fp8]

    torch.manual_seed(0)
    x = torch.randn(args.shape, device=device).to(dtype)
    small = torch.randn(CHECK_SHAPE, device=device).to(dtype)
    out_copy = torch.empty_like(x)

    rows, checks = [], {}
    for name, is_float8, cast in cases(fp8):
        got, want = cast(small), cast(small.cpu())
        checks[name] = all(
            (g is None and w is None) or torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))
            for g, w in zip(got, want)
        )
        out = cast(x)  # preallocated buffers, reused by every timed call
        us = time_us(lambda c=cast, o=out: c(x, out=o), args.warmup, args.iters, args.batch)
        rows.append({"case": name, "float8": is_float8, "time_us": us,
                     "gb_per_s": bytes_moved(x, out) / (us * 1e-6) / 1e9})  # fmt: skip
    us = time_us(lambda: out_copy.copy_(x), args.warmup, args.iters, args.batch)
    copy_gbps = 2 * x.numel() * x.element_size() / (us * 1e-6) / 1e9
    rows.append({"case": "D2D copy", "float8": False, "time_us": us, "gb_per_s": copy_gbps})
    for r in rows:
        r["vs_copy"] = r["gb_per_s"] / copy_gbps
    check_ok = all(checks.values())

    gpu = torch.cuda.get_device_name(device)
    print(f"\nBlock-scaled cast benchmark on {gpu} ({device}), torch {torch.__version__}")
    print(
        f"shape {'x'.join(map(str, args.shape))} {args.dtype} -> {args.fp8}; warmup "
        f"{args.warmup}, {args.iters} timed calls in batches of {args.batch}, median per call"
    )
    print(f"TE: {status}")
    detail = ", ".join(f"{k}={'ok' if v else 'DIFF'}" for k, v in checks.items())
    print(f"check native vs CPU reference at {CHECK_SHAPE} (bitwise): "
          f"{'PASS' if check_ok else 'FAIL'} ({detail})")  # fmt: skip
    print(f"\n{'case':<22} {'time (us)':>10} {'GB/s':>9} {'% of copy':>10}")
    for r in rows:
        print(
            f"{r['case']:<22} {r['time_us']:>10.1f} {r['gb_per_s']:>9.1f} "
            f"{100 * r['vs_copy']:>9.1f}%"
        )
    print(f"\ntarget: Float8BlockScaling casts >= {100 * TARGET:.0f}% of copy GB/s")
    verdicts = {}
    for r in rows:
        if r["float8"]:
            ok = r["vs_copy"] >= TARGET
            verdicts[r["case"]] = {"target": TARGET, "achieved": r["vs_copy"], "pass": ok}
            print(f"  {r['case']:<22} {100 * r['vs_copy']:5.1f}%  {'PASS' if ok else 'FAIL'}")

    if args.json:
        result = {
            "device": gpu,
            "torch": torch.__version__,
            "te_native": str(status),
            "shape": list(args.shape),
            "dtype": args.dtype,
            "fp8": args.fp8,
            "correctness": {"pass": check_ok, **checks},
            "results": rows,
            "targets": verdicts,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if check_ok else 1


if __name__ == "__main__":
    sys.exit(main())
