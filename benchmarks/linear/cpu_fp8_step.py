#!/usr/bin/env python
"""FP8 training step on the CPU against the same step in BF16, and the FP8 GEMM's two CPU paths.

Times, in one run and interleaved (so the machine's load hits every variant alike), one
forward+backward step of ``te.LayerNormMLP(hidden, ffn)`` with BF16 parameters on ``tokens`` BF16
tokens:

* ``bf16``: no FP8;
* ``fp8 emulated``: FP8 under ``te.autocast`` (DelayedScaling), the GEMMs on the exact float32
  emulation (cpp_extensions.fp8_gemm_cpu);
* ``fp8 _scaled_mm``: the same step with the GEMMs on ``torch._scaled_mm`` (the only CPU path
  before the emulation);
* with ``--recipes``: the step under Float8CurrentScaling, Float8BlockScaling, MXFP8 or NVFP4
  (each on the library's own CPU route).

The script forces each route through ``fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU`` and prints the
one the library takes on this CPU.

and the bare GEMMs of that step (``torch._scaled_mm`` vs the emulation vs a BF16 ``torch.mm``).
``torch._scaled_mm``'s CPU speed depends on the CPU: oneDNN runs FP8 fast on CPUs with AMX-FP16
and otherwise falls back to a naive kernel, so report the CPU (``lscpu``) with the figures.
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX`` shows a Sapphire Rapids-class CPU's oneDNN on a newer one.

    PYTHONPATH=. python benchmarks/linear/cpu_fp8_step.py [--hidden 256 --ffn 1024 --tokens 1024]
        [--skip-scaled-mm-step --gemm-steps 1]   # where _scaled_mm is the slow reference kernel
"""

import argparse
import statistics
import time

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.pytorch.cpp_extensions import fp8_gemm_cpu


def scaled_mm_gemm(x, y, scale, out_dtype=torch.bfloat16):
    return torch._scaled_mm(x, y.t(), scale_a=scale, scale_b=scale, out_dtype=out_dtype)


# --recipes: the step under the other recipes (library route), beside DelayedScaling's.
OTHER_RECIPES = {
    "current": Float8CurrentScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}

# Variant name -> fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU while it runs.
GEMM_PATHS = {"fp8 emulated": False, "fp8 _scaled_mm": True}


def gemm_paths(xq, yq):
    """``X @ Y^T`` of FP8 ``xq``, ``yq`` on _scaled_mm, on the emulation, and in BF16 (warmed up)."""
    xb, yb, s = xq.to(torch.bfloat16), yq.to(torch.bfloat16), torch.ones(1)
    paths = (
        lambda: scaled_mm_gemm(xq, yq, s),
        lambda: fp8_gemm_cpu.fp8_gemm_emulated(xq, yq, s, s, bias=None, out_dtype=torch.bfloat16),
        lambda: torch.mm(xb, yb.t()),
    )
    for fn in paths:
        fn()
    return paths


# --clock: "wall" (time.perf_counter) or "cpu" (time.process_time, the CPU time of every
# thread of this process: with --threads 1 it is immune to other processes on a shared machine).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def median_ms(fn, steps):
    times = []
    for _ in range(steps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--gemm-steps", type=int, default=10, help="timed bare GEMMs per path")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall", help="see CLOCK")
    parser.add_argument(
        "--skip-scaled-mm-step",
        action="store_true",
        help="leave out the whole step on torch._scaled_mm (seconds per step where oneDNN has "
        "no FP8 kernel); its bare GEMMs are still timed",
    )
    parser.add_argument(
        "--recipes",
        default="",
        help="also time the emulated step under these other recipes, comma-separated: "
        f"{', '.join(OTHER_RECIPES)} (MXFP8 and NVFP4 warn once that their GEMMs are emulated)",
    )
    args = parser.parse_args()
    others = [r for r in args.recipes.split(",") if r]
    for name in others:
        if name not in OTHER_RECIPES:
            parser.error(f"unknown recipe {name!r}; choose from {', '.join(OTHER_RECIPES)}")
    global clock
    clock = CLOCK[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    mlp = te.LayerNormMLP(args.hidden, args.ffn, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    recipe = DelayedScaling()

    def bf16_step():
        mlp(x).sum().backward()

    def fp8_step():
        with te.autocast(recipe=recipe):
            y = mlp(x)
        y.sum().backward()

    def with_gemm(path):
        def step():
            fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU = GEMM_PATHS[path]
            try:
                fp8_step()
            finally:
                fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU = default_route

        return step

    default_route = fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU
    paths = [p for p in GEMM_PATHS if not (args.skip_scaled_mm_step and GEMM_PATHS[p])]
    variants = {"bf16": bf16_step, **{path: with_gemm(path) for path in paths}}

    def recipe_step(other):
        def step():
            with te.autocast(recipe=other):
                y = mlp(x)
            y.sum().backward()

        return step

    for name in others:
        variants[f"fp8 {name}"] = recipe_step(OTHER_RECIPES[name]())
    results = {name: [] for name in variants}
    for name, step in variants.items():  # warm-up: allocator, oneDNN kernels, FP8 history
        try:
            for _ in range(2):
                step()
        except RuntimeError as error:  # e.g. oneDNN without a kernel for an FP8 pair
            print(f"{name}: fails on this CPU: {str(error).splitlines()[0]}")
            results[name] = None
    for _ in range(args.rounds):
        for name, step in variants.items():
            if results[name] is not None:
                results[name].append(median_ms(step, args.steps))

    print(f"te.LayerNormMLP({args.hidden}, {args.ffn}) on {args.tokens} tokens, BF16 params, "
          f"{torch.get_num_threads()} threads, {args.clock} time; fwd+bwd step, median of medians")  # fmt: skip
    bf16 = statistics.median(results["bf16"])
    print(f"  library route on this CPU: {'_scaled_mm' if default_route else 'emulated'}")
    for name, times in results.items():
        if times is None:
            continue
        ms = statistics.median(times)
        print(f"  {name:15s} {ms:9.2f} ms   {ms / bf16:6.2f}x bf16")

    # The step's GEMM shapes (M, K, N) of X [M, K] @ Y [N, K]^T: fprop, dgrad and wgrad of FC1/FC2.
    t, h, f = args.tokens, args.hidden, args.ffn
    shapes = [(t, h, f), (t, f, h), (t, h, f), (t, f, h), (f, t, h), (h, t, f)]
    print("bare E4M3 GEMMs, ms: (M, K, N)  _scaled_mm  emulated  bf16 torch.mm")
    for m, k, n in dict.fromkeys(shapes):
        xq = torch.randn(m, k).to(torch.float8_e4m3fn)
        yq = torch.randn(n, k).to(torch.float8_e4m3fn)
        row = [median_ms(fn, args.gemm_steps) for fn in gemm_paths(xq, yq)]
        print(f"  ({m}, {k}, {n})  " + "  ".join(f"{ms:8.2f}" for ms in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
