#!/usr/bin/env python
"""te.ops.Sequential(te.ops.Linear) in FP8 with its backward fused (``BackwardLinearBias``: the
bias gradient from the grad-output cast's own pass) and unfused (``BasicLinear`` then ``Bias``,
a second pass over the gradient for the bias gradient), and te.Linear, forward + backward side
by side in one run on one CUDA GPU.

Reports ms per step (medians of trials of back-to-back steps, as benchmark_linear.py times
them) and each one's ratio to the unfused chain's time.

    python benchmarks/linear/benchmark_ops_linear.py [--shapes 16384,4096,4096;...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_linear import make_step, time_steps  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch import ops  # noqa: E402
from transformer_engine.pytorch.ops.fused import fuse_backward_linear_bias  # noqa: E402
from transformer_engine.pytorch.ops.fuser import OperationFuser  # noqa: E402

SHAPES = [(16384, 4096, 4096), (8192, 8192, 8192), (4096, 4096, 4096)]
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


@contextlib.contextmanager
def without_linear_bias_fusion():
    """The fuser without BackwardLinearBias (plans are made at a model's first forward)."""
    saved = OperationFuser.backward_fusion_functions
    OperationFuser.backward_fusion_functions = [
        f for f in saved if f is not fuse_backward_linear_bias
    ]
    try:
        yield
    finally:
        OperationFuser.backward_fusion_functions = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--shapes", default=None, help="semicolon-separated M,K,N")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    device = torch.device("cuda:0")
    print(f"{'recipe':<8} {'(M, K, N)':<20} {'unfused ms':>11} {'fused ms':>9} {'ratio':>6}"
          f" {'te.Linear ms':>13} {'ratio':>6}")  # fmt: skip
    for name, recipe_cls in RECIPES.items():
        for m, k, n in shapes:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            times = {}
            for label in ("unfused", "fused", "te.Linear"):
                if label == "te.Linear":
                    model = te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
                else:
                    model = ops.Sequential(ops.Linear(k, n, device=device, dtype=torch.bfloat16))
                step = make_step(model, x, dy, recipe_cls())
                off = label == "unfused"
                with without_linear_bias_fusion() if off else contextlib.nullcontext():
                    times[label] = time_steps(step, args.iters, args.warmup)
                del model, step
            base = times["unfused"]
            print(
                f"{name:<8} {str((m, k, n)):<20} {base * 1e3:11.3f} {times['fused'] * 1e3:9.3f}"
                f" {times['fused'] / base:6.3f} {times['te.Linear'] * 1e3:13.3f}"
                f" {times['te.Linear'] / base:6.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
