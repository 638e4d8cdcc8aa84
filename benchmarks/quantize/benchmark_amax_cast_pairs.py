#!/usr/bin/env python
"""Current scaling's two passes timed together, as a step runs them: an amax pass, then the cast
it scales, on one CUDA GPU, with L2 flushed before each pair.

Each case is timed with CUDA events around the pair (medians over ``--iters`` pairs, after a
512 MiB write that leaves none of the input in L2), so the time includes whatever the cast finds
of its input in L2 after the amax pass (the amax passes walk their input backwards for that:
docs/architecture.md). Cases:

* ``cast+T``: ``nvte_quantize_current_scaling`` (amax pass, scale, cast with the transposed
  copy), BF16 inputs of the Linear benchmark's and the MLP's shapes; ``cast+T+dbias`` the same
  with the bias gradient;
* ``<act> fwd``: the activation's amax pass, then its FP8 cast with the transposed copy
  (8192 x 16384 GELU, 8192 x 2 x 14336 SwiGLU), and ``<act> bwd`` the backward's pair with the
  bias gradient; ``<act> amax`` the forward's amax pass alone.

    python benchmarks/quantize/benchmark_amax_cast_pairs.py [--iters 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from transformer_engine.pytorch.cpp_extensions.activation import (
    activation_amax,
    activation_backward_amax,
    activation_backward_fp8,
    activation_forward_fp8,
    activation_spec,
)
from transformer_engine.pytorch.cpp_extensions.cast import quantize_current_scaling_prevalidated

FP8 = torch.float8_e4m3fn


def pair_time_us(fn, flush: torch.Tensor, iters: int) -> float:
    """Median microseconds of ``fn`` (after 5 untimed calls), L2 flushed before each."""
    times = []
    for i in range(iters + 5):
        flush.fill_(i & 0xFF)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cases(dev: torch.device) -> dict:
    scale = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev)
    out = {}

    def current_cast(x, with_dbias):
        return lambda: quantize_current_scaling_prevalidated(
            x, FP8, epsilon=0.0, force_pow_2_scales=False, with_transpose=True,
            with_dbias=with_dbias,
        )  # fmt: skip

    for shape in [(4096, 4096), (16384, 4096), (4096, 16384), (8192, 16384)]:
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        out[f"cast+T {shape[0]}x{shape[1]}"] = current_cast(x, False)
    for shape in [(16384, 4096), (16384, 14336)]:
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        out[f"cast+T+dbias {shape[0]}x{shape[1]}"] = current_cast(x, True)
    for name, cols in [("gelu", 16384), ("swiglu", 2 * 14336)]:
        spec = activation_spec(name)
        u = torch.randn(8192, cols, device=dev, dtype=torch.bfloat16)
        g = torch.randn(8192, cols // 2 if name == "swiglu" else cols, device=dev,
                        dtype=torch.bfloat16)  # fmt: skip

        def fwd(u=u, spec=spec):
            activation_amax(u, spec, amax)
            activation_forward_fp8(u, spec, scale, FP8, amax=None, with_transpose=True)

        def bwd(u=u, g=g, spec=spec):
            activation_backward_amax(g, u, spec, amax)
            activation_backward_fp8(g, u, spec, scale, FP8, amax=None, with_dbias=True)

        out[f"{name} fwd"] = fwd
        out[f"{name} bwd"] = bwd
        out[f"{name} amax"] = lambda u=u, spec=spec: activation_amax(u, spec, amax)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40, help="timed pairs per case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_amax_cast_pairs.py needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    print(f"amax pass + cast pairs on {torch.cuda.get_device_name(dev)}, L2 flushed before each")
    for name, fn in cases(dev).items():
        print(f"  {name:28s} {pair_time_us(fn, flush, args.iters):8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
