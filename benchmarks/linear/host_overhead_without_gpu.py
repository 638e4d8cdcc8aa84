#!/usr/bin/env python
"""The Python (host) cost of one training step of te.Linear / te.LayerNormMLP, without a GPU.

The CUDA path's native calls (casts, scaling, norms, activations) are replaced by no-ops,
``torch._scaled_mm`` by an allocation of its output, and the step runs on tiny CPU tensors (one
torch thread) routed as CUDA tensors are, so what remains is the Python and torch-dispatch work
the host does per step on a GPU machine. Useful for work on host overhead where no GPU is at
hand; the absolute numbers depend on the CPU and its load, so compare
before/after in one run on one machine (each configuration reports the best of ``--rounds``
rounds, the one least disturbed by other processes). Also prints Python function calls per step
(cProfile), which does not depend on the machine's load.

It also counts, per step, the torch operators dispatched (``aten ops``, seen by a
``TorchDispatchMode``) and the native kernel calls the stubs stand in for (``native``): on a GPU
each is a kernel launch or a copy, a CUDA driver call of 15-35 us of host time on the H200 hosts
of issue 14, so they are a proxy for the launches a step pays. (Ops on metadata only, such as
views, launch nothing; the count includes them.)

Configurations: ``linear-delayed``, ``linear-current``, ``linear-block`` (te.Linear under
te.autocast with DelayedScaling / Float8CurrentScaling / Float8BlockScaling; the block recipe at
128 features, its block size), ``linear-bf16`` (te.Linear without FP8), ``mlp-delayed``,
``mlp-current``, ``mlp-bf16`` (te.LayerNormMLP, GELU, with each recipe and without FP8; its norm
and activation kernels stubbed too; BF16 parameters under FP8) and ``ops-delayed``
(``te.ops.Sequential(te.ops.Linear)``, the fuser's path to the same GEMMs, DelayedScaling).

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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import (  # noqa: E402
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
)
from transformer_engine.pytorch.cpp_extensions import (  # noqa: E402
    activation,
    block_cast,
    block_gemm,
    cast,
    fp8_gemm_cpu,
    norm_kernels,
    scaling,
)
from transformer_engine.pytorch.functional import _fused_norms  # noqa: E402

NATIVE_OPS = ("quantize", "quantize_dbias", "dequantize", "compute_amax", "compute_scale_from_amax",
              "delayed_scaling_update", "quantize_current_scaling", "compute_current_scale",
              "block_scaled_quantize",
              "mxfp8_quantize", "activation", "dactivation", "activation_amax",
              "dactivation_amax", "norm_forward", "norm_amax", "norm_forward_from_stats",
              "norm_backward")  # fmt: skip
CONFIGS = ("linear-delayed", "linear-current", "linear-block", "linear-bf16", "mlp-delayed",
           "mlp-current", "mlp-bf16", "ops-delayed")  # fmt: skip
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}
native_calls = [0]  # native kernel calls made through the stubs


def _count_native(*args, **kwargs) -> None:
    native_calls[0] += 1


def stub_kernels() -> None:
    """Route every kernel as if the tensors were on a GPU, and make each one a counted no-op."""
    no_op = types.SimpleNamespace(**{name: _count_native for name in NATIVE_OPS})
    # The norm backward's workspace size, as the library gives it for an H200 (132 SMs).
    no_op.norm_backward_workspace_elements = lambda rows, hidden, index: 2 * hidden * min(rows, 264)
    for module in (cast, scaling, block_cast, activation, norm_kernels):
        module.native_for = lambda op, device: no_op
        module.launch_args = lambda device: (0, 0)

    # The norms take the native kernels for CUDA inputs only: here, for any input.
    def native_norm_operands(x, weight, bias):
        hidden = weight.numel()
        flat_bias = None if bias is None else bias.view(hidden)
        return x.reshape(-1, hidden), weight.view(hidden), flat_bias

    _fused_norms._native_operands = native_norm_operands
    # The GPU route of the FP8 GEMM (torch._scaled_mm), whose host cost on a GPU is one dispatch:
    # stood in for by the allocation of its output (the CPU kernel would dominate the timing).
    fp8_gemm_cpu.SCALED_MM_IS_NATIVE_ON_CPU = True

    def scaled_mm_output(a, b, *, out_dtype=None, **kwargs):
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)

    torch._scaled_mm = scaled_mm_output

    # The block-scaled GEMM's GPU route (an H200's): the native library's cuBLASLt call, a
    # counted no-op that reports it ran, after the route's own checks and allocations.
    def block_gemm_ran(*args, **kwargs) -> bool:
        _count_native()
        return True

    block_gemm.native_module = lambda: types.SimpleNamespace(
        block_scaled_gemm=block_gemm_ran, cublaslt_version=lambda: 130100
    )
    block_gemm.launch_args = lambda device: (0, 0)

    def native_block_product(x, xs, x2d, y, ys, y2d, mm_dtype, bias=None):
        return block_gemm._cublaslt_product(x, xs, x2d, y, ys, y2d, mm_dtype, bias)

    block_gemm._native_product = native_block_product


def make_step(config: str):
    """One forward + backward of the configuration's module on a 16-token batch (128 tokens and
    features for the block recipe, whose blocks are 128 wide)."""
    fp8 = not config.endswith("bf16")
    recipe = RECIPES[config.split("-")[1]]() if fp8 else None
    width = 128 if config.endswith("block") else 16
    dtype = torch.float32
    if config.startswith("mlp"):
        # FP8: BF16 parameters, as on a GPU (a float32 bias is added after an FP8 GEMM instead of
        # in it). Without FP8 the GEMMs really run, on the CPU, where float32 is the fast dtype.
        dtype = torch.bfloat16 if fp8 else torch.float32
        layer = te.LayerNormMLP(16, 32, device="cpu", params_dtype=dtype)
    elif config.startswith("ops"):
        layer = te.ops.Sequential(te.ops.Linear(width, width, device="cpu"))
    else:
        layer = te.Linear(width, width, device="cpu")
    x = torch.randn(width, width, dtype=dtype, requires_grad=True)

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


class _OpCounter(TorchDispatchMode):
    def __init__(self, names: dict | None) -> None:
        super().__init__()
        self.count, self.names = 0, names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if self.names is not None:
            self.names[str(func)] = self.names.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(step, steps: int, show: bool) -> tuple[float, float]:
    """Torch operators dispatched and native kernel calls, per step."""
    names = {} if show else None
    counter = _OpCounter(names)
    native_calls[0] = 0
    with counter:
        for _ in range(steps):
            step()
    if show:
        for name, n in sorted(names.items(), key=lambda item: -item[1]):
            print(f"    {n / steps:6.1f}  {name}")
    return counter.count / steps, native_calls[0] / steps


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {CONFIGS}")
    parser.add_argument("--profile", action="store_true",
                        help="print the top of a cProfile and the torch operators per step")  # fmt: skip
    args = parser.parse_args()
    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}; choose from {CONFIGS}")
    torch.set_num_threads(1)  # the host work of a GPU step is one thread
    stub_kernels()
    header = f"{'configuration':<16} {'host us/step':>12} {'Python calls/step':>18}"
    print(f"{header} {'aten ops/step':>14} {'native/step':>12}")
    for config in configs:
        step = make_step(config)
        micros = measure(step, args.steps, args.rounds)
        calls = count_calls(step, min(args.steps, 100), args.profile)
        ops, native = count_ops(step, 20, args.profile)
        print(f"{config:<16} {micros:12.1f} {calls:18.0f} {ops:14.0f} {native:12.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
