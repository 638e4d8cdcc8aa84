#!/usr/bin/env python
"""The Python (host) cost of one te.Linear FP8 training step, measured without a GPU.

The CUDA path's native calls are replaced by no-ops and the step runs on tiny CPU tensors, so
what remains is the Python and torch-dispatch work the host does per step on a GPU machine
(plus a little CPU math for torch._scaled_mm). Useful for work on host overhead where no GPU is
at hand; the absolute numbers depend on the CPU, so compare before/after on one machine. Also
prints Python function calls per step, which does not depend on the machine's load.

    python benchmarks/linear/host_overhead_without_gpu.py [--profile]
"""

import argparse
import cProfile
import pstats
import sys
import time
import types

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.cpp_extensions import cast, scaling

NATIVE_OPS = ("quantize", "quantize_dbias", "dequantize", "compute_amax", "compute_scale_from_amax",
              "delayed_scaling_update", "quantize_current_scaling")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile")
    parser.add_argument("--recipe", choices=("delayed", "current"), default="delayed")
    args = parser.parse_args()
    no_op = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in NATIVE_OPS})
    for module in (cast, scaling):  # route every kernel as if the tensors were on a GPU
        module.native_for = lambda op, device: no_op
        module.launch_args = lambda device: (0, 0)

    recipe = DelayedScaling() if args.recipe == "delayed" else Float8CurrentScaling()
    layer = te.Linear(16, 16, device="cpu")
    x = torch.randn(16, 16, requires_grad=True)

    def step():
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.sum().backward()

    for _ in range(50):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(
        f"host time per forward+backward step: {(time.perf_counter() - start) / args.steps * 1e6:.1f} us"
    )
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        step()
    profile.disable()
    stats = pstats.Stats(profile)
    print(f"Python function calls per step: {stats.total_calls / 200:.0f}")
    if args.profile:
        stats.sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
