#!/usr/bin/env python
"""Where the host time of one te.Linear call goes, on a CUDA GPU: times the pieces (a native
cast, an FP8 GEMM, a whole forward) at a tiny shape, then prints a cProfile of forwards.

    python benchmarks/linear/profile_host_overhead.py [--calls 300]
"""

import argparse
import cProfile
import pstats
import sys
import time

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.cpp_extensions import general_gemm, quantize


def per_call(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return elapsed * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    scale = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev)
    out = torch.empty(64, 64, device=dev, dtype=torch.uint8)
    module = te.Linear(64, 64, device=dev, params_dtype=torch.bfloat16)
    state = te.quantization.RecipeState.create(DelayedScaling(), mode="forward", device=dev)
    quantizer = state.make_quantizers()[0]
    w8 = quantizer.quantize_impl(x)

    def forward():
        with te.autocast(recipe=DelayedScaling()):
            module(x)

    rows = {
        "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "x.abs() (one torch op)": lambda: x.abs(),
        "cpp_extensions.quantize": lambda: quantize(
            x, scale, torch.float8_e4m3fn, amax=amax, out=out
        ),
        "quantizer.quantize_impl": lambda: quantizer.quantize_impl(x),
        "general_gemm FP8 TN": lambda: general_gemm(w8, w8, torch.bfloat16),
        "te.Linear forward (no_grad)": lambda: forward(),
    }
    with torch.no_grad():
        for label, fn in rows.items():
            print(f"{label:>32}: {per_call(fn, args.calls):8.1f} us/call")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            forward()
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
