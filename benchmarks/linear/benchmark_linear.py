#!/usr/bin/env python
"""te.Linear in FP8 (delayed and current scaling) against torch.nn.Linear in BF16, forward +
backward, side by side in one run on one CUDA GPU.

Reports TFLOP/s (3 GEMMs of 2*M*K*N flops each per step: fprop, dgrad, wgrad) and the ratio to
BF16 at the large shapes, plus the host time per forward call at a small shape (how long the
Python side takes to issue one call; the GPU work is not waited for). torchao's float8
training under torch.compile is measured too when torchao is installed.

    python benchmarks/linear/benchmark_linear.py [--json out.json] [--iters 20]
    python benchmarks/linear/benchmark_linear.py --recipes block --shapes 16384,4096,14336

``--recipes`` picks among ``delayed``, ``current`` (the default pair) and ``block``
(``Float8BlockScaling``, whose target at (16384, 4096, 14336) is 1.3x BF16).

``--queue-ahead N`` issues N untimed steps ahead of each trial of ten, without waiting, so that
a host faster than the GPU is ahead when the trial starts, as in a long training run (by
default each trial starts from an idle GPU, and its first steps wait on the host).

``--single-thread-backward`` runs every implementation's backward on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``) instead of autograd's per-device worker
thread. Where the host is the bottleneck (small layers) this shows how much of a step the
thread hand-off costs on the machine at hand (docs/performance.md, host overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
)

SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (8192, 8192, 8192)]
HOST_SHAPE = (1024, 1024, 1024)
TARGET = 1.65  # issue 14: at least 1.65x BF16 at the three large shapes, both recipes
BLOCK_TARGET = 1.3  # Float8BlockScaling


STEPS_PER_TRIAL = 10


def time_steps(step, iters: int, warmup: int, ahead: int = 0) -> float:
    """Median seconds per step over ``iters`` trials of back-to-back steps (CUDA events).

    Steps are issued back to back as in training, so the host prepares step i+1 while the GPU
    runs step i: a trial measures GPU throughput, plus host time only where the host cannot keep
    up. (Timing single steps with a sync after each would add the launch latency of an empty
    queue to every step.) Each trial starts from an idle GPU unless ``ahead`` > 0: that many
    untimed steps are issued first, without waiting, so that where the host is faster than the
    GPU it is already ahead when the trial starts, as in the steady state of a training run.
    """
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        for _ in range(ahead):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS_PER_TRIAL):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / STEPS_PER_TRIAL)
    return statistics.median(times)


def make_step(module, x, dy, recipe):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        if recipe is None:
            y = module(x)
        else:
            with te.autocast(recipe=recipe):
                y = module(x)
        y.backward(dy)

    return step


def torchao_step(m, k, n, device):
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: PLC0415
    except ImportError as err:
        return None, f"torchao not installed ({err.name})"
    model = torch.nn.Sequential(
        torch.nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16)
    )
    convert_to_float8_training(model)
    model = torch.compile(model)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return make_step(model, x, dy, None), ""


def print_kernel_profile(m, k, n, device, label, recipe) -> None:
    """GPU time per kernel over 5 FP8 steps: what a step spends besides the three GEMMs."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    module = te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
    step = make_step(module, x, dy, recipe)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"\nGPU kernels of 5 te fp8 {label} steps at {(m, k, n)}:")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json", default=None)
    parser.add_argument("--recipes", default="delayed,current",
                        help="comma-separated, from delayed, current, block")  # fmt: skip
    parser.add_argument("--shapes", default=None,
                        help="semicolon-separated M,K,N (default: the three large shapes)")  # fmt: skip
    parser.add_argument(
        "--single-thread-backward",
        action="store_true",
        help="run backward on the calling thread (torch.autograd.set_multithreading_enabled)",
    )
    parser.add_argument(
        "--queue-ahead",
        type=int,
        default=0,
        help="untimed steps issued before each trial without waiting (steady state; default: "
        "each trial starts from an idle GPU)",
    )
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="also print the GPU kernels of 5 FP8 (delayed) steps at the first shape",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_linear.py needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    if args.single_thread_backward:
        torch.autograd.set_multithreading_enabled(False)
    print(f"te.Linear benchmark on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"native: {transformer_engine.native_status()}")
    if args.single_thread_backward:
        print("backward on the calling thread (autograd multithreading disabled)")
    if args.queue_ahead:
        print(f"{args.queue_ahead} untimed steps queued ahead of each trial (steady state)")
    known = {
        "delayed": DelayedScaling,
        "current": Float8CurrentScaling,
        "block": Float8BlockScaling,
    }
    names = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in names if r not in known]
    if unknown or not names:
        parser.error(f"--recipes {args.recipes!r}: choose from {', '.join(known)}")
    recipes = {name: known[name]() for name in names}
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    rows, passed = [], True
    header = f"{'(M, K, N)':>22} {'impl':>14} {'ms/step':>9} {'TFLOP/s':>9} {'vs BF16':>8}"
    print(header)
    for m, k, n in shapes:
        flops = 3 * 2 * m * k * n
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        base = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        bf16 = time_steps(make_step(base, x, dy, None), args.iters, args.warmup, args.queue_ahead)
        results = {"bf16 nn.Linear": bf16}
        for label, recipe in recipes.items():
            module = te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
            results[f"te fp8 {label}"] = time_steps(
                make_step(module, x, dy, recipe), args.iters, args.warmup, args.queue_ahead
            )
        step, why = torchao_step(m, k, n, device)
        if step is not None:
            results["torchao compile"] = time_steps(step, args.iters, args.warmup, args.queue_ahead)
        for impl, seconds in results.items():
            ratio = bf16 / seconds
            print(
                f"{str((m, k, n)):>22} {impl:>14} {seconds * 1e3:9.3f} {flops / seconds / 1e12:9.1f} {ratio:8.2f}x"
            )
            rows.append({"shape": [m, k, n], "impl": impl, "seconds": seconds,
                         "tflops": flops / seconds / 1e12, "vs_bf16": ratio})  # fmt: skip
            want = BLOCK_TARGET if impl == "te fp8 block" else TARGET
            if impl.startswith("te fp8") and ratio < want:
                passed = False
        if why:
            print(f"{str((m, k, n)):>22} {'torchao':>14} skipped: {why}")

    if args.kernel_profile:
        for label, recipe in recipes.items():
            print_kernel_profile(*shapes[0], device, label, recipe)

    m, k, n = HOST_SHAPE
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    host = {}
    with torch.no_grad():
        for label, recipe in [("bf16 nn.Linear", None), *recipes.items()]:
            module = (
                torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
                if recipe is None
                else te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
            )
            for _ in range(10):
                module(x)
            torch.cuda.synchronize()
            calls = 200
            ctx = te.autocast(recipe=recipe) if recipe is not None else None
            start = time.perf_counter()
            if ctx is None:
                for _ in range(calls):
                    module(x)
            else:
                with ctx:
                    for _ in range(calls):
                        module(x)
            host[label] = (time.perf_counter() - start) / calls
            torch.cuda.synchronize()
    print(f"\nhost time per forward call at {HOST_SHAPE} (no_grad, GPU not awaited):")
    for label, seconds in host.items():
        print(f"  {label:>16}: {seconds * 1e6:8.1f} us")
    print(
        f"\ntarget: te FP8 >= {TARGET}x BF16 (block scaling {BLOCK_TARGET}x) at these shapes: {'PASS' if passed else 'FAIL'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "host_us": {k: v * 1e6 for k, v in host.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
