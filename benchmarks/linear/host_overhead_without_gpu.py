#!/usr/bin/env python
"""The Python (host) cost of one training step of te.Linear / te.LayerNormMLP, without a GPU.

The CUDA path's native calls are replaced by no-ops, ``torch._scaled_mm`` by an allocation of its
output, and the step runs on tiny CPU tensors (one torch thread), so what remains is the Python
and torch-dispatch work the host does per step on a GPU machine. Useful for work on host
overhead where no GPU is at hand; the absolute numbers depend on the CPU and its load, so compare
before/after in one run on one machine (each configuration reports the best of ``--rounds``
rounds, the one least disturbed by other processes). Also prints Python function calls per step
(cProfile), which does not depend on the machine's load.

Configurations: ``linear-delayed``, ``linear-current`` (te.Linear under te.autocast with
DelayedScaling / Float8CurrentScaling), ``linear-bf16`` (te.Linear without FP8) and
``mlp-delayed`` (te.LayerNormMLP, DelayedScaling).

    python benchmarks/linear/host_overhead_without_gpu.py [--configs linear-delayed,...] [--profile]
"""

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree, not an install

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.cpp_extensions import cast, fp8_gemm_cpu, scaling  # noqa: E402

NATIVE_OPS = ("quantize", "quantize_dbias", "dequantize", "compute_amax", "compute_scale_from_amax",
              "delayed_scaling_update", "quantize_current_scaling")  # fmt: skip
CONFIGS = ("linear-delayed", "linear-current", "linear-bf16", "mlp-delayed")


def stub_kernels() -> None:
    """Route every kernel as if the tensors were on a GPU, and make each one a no-op."""
    no_op = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in NATIVE_OPS})
    for module in (cast, scaling):
        module.native_for = lambda op, device: no_op
        module.launch_args = lambda device: (0, 0)
    # The GPU route of the FP8 GEMM (torch._scaled_mm), whose host cost on a GPU is one dispatch:
    # stood in for by the allocation of its output (the CPU kernel would dominate the timing).
    fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU = True

    def scaled_mm_output(a, b, *, out_dtype=None, **kwargs):
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)

    torch._scaled_mm = scaled_mm_output


def make_step(config: str):
    """One forward + backward of the configuration's module on a 16-token batch."""
    recipe = Float8CurrentScaling() if config.endswith("current") else DelayedScaling()
    fp8 = not config.endswith("bf16")
    if config.startswith("mlp"):
        layer = te.LayerNormMLP(16, 32, device="cpu")
    else:
        layer = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)

    def step():
        with te.autocast(enabled=fp8, recipe=recipe) if fp8 else contextlib.nullcontext():
            y = layer(x)
        y.sum().backward()

    return step


def measure(step, steps: int, rounds: int) -> float:
    """Best per-step host (CPU) time over ``rounds`` rounds of ``steps`` steps, in microseconds."""
    for _ in range(50):
        step()
    best = float("inf")
    for _ in range(rounds):
        # The thread's CPU time, not wall time: on a shared machine, time spent descheduled
        # would otherwise count as host work.
        start = time.thread_time()
        for _ in range(steps):
            step()
        best = min(best, (time.thread_time() - start) / steps)
    return best * 1e6


def count_calls(step, steps: int, show: bool) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile)
    if show:
        stats.sort_stats("tottime").print_stats(30)
    return stats.total_calls / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {CONFIGS}")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile")
    args = parser.parse_args()
    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}; choose from {CONFIGS}")
    torch.set_num_threads(1)  # the host work of a GPU step is one thread
    stub_kernels()
    print(f"{'configuration':<16} {'host us/step':>12} {'Python calls/step':>18}")
    for config in configs:
        step = make_step(config)
        micros = measure(step, args.steps, args.rounds)
        calls = count_calls(step, min(args.steps, 100), args.profile)
        print(f"{config:<16} {micros:12.1f} {calls:18.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
