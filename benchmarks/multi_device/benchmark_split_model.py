#!/usr/bin/env python
"""A model split over two GPUs in one process against the same model on one GPU, and the cost of
the forward device guard when devices already match; both side by side in one run.

1. Split-model throughput. A stack of ``te.LayerNormMLP`` blocks trains in FP8
   (``DelayedScaling(HYBRID)``, forward + backward + SGD step) once with every block on
   ``cuda:0`` and once with the first half on ``cuda:0`` and the second half on ``cuda:1``
   (activations copied between the GPUs at the split, as ``accelerate.dispatch_model`` does;
   every block's FP8 state on its own GPU). Without pipelining the split model runs the same
   work one GPU at a time, so its tokens/s should match the single-GPU model: what it adds is one
   activation copy each way per step and the per-device FP8 bookkeeping (one amax update launch
   per device). Target: split tokens/s within 5% of single-GPU tokens/s. "Per GPU" is also
   printed (tokens/s divided by the GPUs the model occupies), which is what a user pays.

2. Device-guard cost. ``te.Linear`` forward + backward at a small, host-bound shape with the
   input on the current device, timed with the real guard and with the guard replaced by no-ops,
   in interleaved trials. Reported with the run-to-run noise (the spread between trials of the
   same configuration) and the cost of one enter/exit pair measured alone. Target: the
   difference is not above the noise.

    python benchmarks/multi_device/benchmark_split_model.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import device as te_device
from transformer_engine.pytorch.module import _linear_function
from transformer_engine.pytorch.module import base as module_base

SPLIT_TARGET = 0.95  # split tokens/s >= 95% of single-GPU tokens/s


# ------------------------------------------------------------------ split-model throughput


class Stack(torch.nn.Module):
    """``te.LayerNormMLP`` blocks with residuals; block i lives on ``devices[i]``."""

    def __init__(self, hidden: int, ffn: int, devices: list[torch.device]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            te.LayerNormMLP(hidden, ffn, device=d, params_dtype=torch.bfloat16) for d in devices
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x.to(block.fc1_weight.device)  # no-op on the block's own device
            x = x + block(x)
        return x


def build_stack(args, devices: list[torch.device]) -> Stack:
    torch.manual_seed(0)
    cpu = Stack(args.hidden, args.ffn, [torch.device("cpu")] * args.layers)
    model = Stack(args.hidden, args.ffn, devices)
    model.load_state_dict(cpu.state_dict())  # the same weights in both layouts
    return model


def train_steps(model: Stack, x: torch.Tensor, steps: int, devices: list[torch.device]) -> float:
    """Seconds for ``steps`` training steps, issued back to back and awaited on every device."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for d in set(devices):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for _ in range(steps):
        with te.autocast(recipe=recipe):
            out = model(x)
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for d in set(devices):
        torch.cuda.synchronize(d)
    return time.perf_counter() - start


def benchmark_split(args) -> dict:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    half = args.layers // 2
    layouts = {
        "single (cuda:0)": [cuda0] * args.layers,
        "split (cuda:0 | cuda:1)": [cuda0] * half + [cuda1] * (args.layers - half),
    }
    tokens = args.batch * args.seq
    models = {name: build_stack(args, devs) for name, devs in layouts.items()}
    x = torch.randn(args.batch, args.seq, args.hidden, device=cuda0, dtype=torch.bfloat16)
    for name, model in models.items():  # warm up: kernels, allocator, FP8 state, autotuning
        train_steps(model, x, args.warmup, layouts[name])
    per_step = {name: [] for name in layouts}
    for _ in range(args.trials):  # interleaved, so drift hits both layouts alike
        for name, model in models.items():
            per_step[name].append(train_steps(model, x, args.steps, layouts[name]) / args.steps)
    result = {}
    for name, times in per_step.items():
        median = statistics.median(times)
        gpus = len(set(layouts[name]))
        result[name] = {
            "ms_per_step": median * 1e3,
            "ms_spread": (max(times) - min(times)) * 1e3,
            "tokens_per_s": tokens / median,
            "tokens_per_s_per_gpu": tokens / median / gpus,
            "gpus": gpus,
        }
    single, split = result["single (cuda:0)"], result["split (cuda:0 | cuda:1)"]
    result["split_vs_single"] = split["tokens_per_s"] / single["tokens_per_s"]
    result["pass"] = result["split_vs_single"] >= SPLIT_TARGET
    return result


# ------------------------------------------------------------------ device-guard cost


def _no_enter(device):
    return None


def _no_exit():
    return None


@contextlib.contextmanager
def _no_guard(device):
    yield


@contextlib.contextmanager
def guard_replaced_by_noops():
    """te.Linear's two guard sites (module forward, linear core) without the guard."""
    saved = (module_base.enter_device, module_base.exit_device, _linear_function.device_guard)
    module_base.enter_device, module_base.exit_device = _no_enter, _no_exit
    _linear_function.device_guard = _no_guard
    try:
        yield
    finally:
        module_base.enter_device, module_base.exit_device, _linear_function.device_guard = saved


def host_seconds_per_step(module, x, dy, recipe, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        with te.autocast(recipe=recipe):
            y = module(x)
        y.backward(dy)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def benchmark_guard(args) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    m = k = n = args.guard_size
    torch.manual_seed(0)
    module = te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    recipe = DelayedScaling()
    host_seconds_per_step(module, x, dy, recipe, 50)
    with guard_replaced_by_noops():
        host_seconds_per_step(module, x, dy, recipe, 50)
    runs = {"guard": [], "no guard": [], "guard (repeat)": []}
    for _ in range(args.trials * 2):
        runs["guard"].append(host_seconds_per_step(module, x, dy, recipe, args.guard_steps))
        with guard_replaced_by_noops():
            runs["no guard"].append(host_seconds_per_step(module, x, dy, recipe, args.guard_steps))
        runs["guard (repeat)"].append(
            host_seconds_per_step(module, x, dy, recipe, args.guard_steps)
        )
    med = {name: statistics.median(v) * 1e6 for name, v in runs.items()}
    # noise: how far two identical configurations land apart, and the trial-to-trial spread
    noise_us = max(
        abs(med["guard"] - med["guard (repeat)"]),
        statistics.stdev([t * 1e6 for t in runs["no guard"]]),
    )
    cost_us = (med["guard"] + med["guard (repeat)"]) / 2 - med["no guard"]
    pairs = 100_000
    start = time.perf_counter()
    for _ in range(pairs):
        te_device.enter_device(device)
        te_device.exit_device()
    pair_ns = (time.perf_counter() - start) / pairs * 1e9
    return {
        "shape": [m, k, n],
        "us_per_step": med,
        "guard_cost_us": cost_us,
        "noise_us": noise_us,
        "enter_exit_pair_ns": pair_ns,
        "pass": cost_us <= noise_us,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="steps per timed trial")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--guard-size", type=int, default=1024)
    p.add_argument("--guard-steps", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("benchmark_split_model.py needs two CUDA GPUs", file=sys.stderr)
        return 1
    print(
        f"on {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}"
    )
    print(f"native: {transformer_engine.native_status()}")

    split = benchmark_split(args)
    print(
        f"\n1. {args.layers} x te.LayerNormMLP({args.hidden}, {args.ffn}), {args.batch}x{args.seq}"
        " tokens, FP8 DelayedScaling(HYBRID), fwd+bwd+SGD:"
    )
    print(f"{'layout':>24} {'ms/step':>9} {'spread':>8} {'tokens/s':>11} {'per GPU':>11}")
    for name in ("single (cuda:0)", "split (cuda:0 | cuda:1)"):
        r = split[name]
        print(
            f"{name:>24} {r['ms_per_step']:9.2f} {r['ms_spread']:8.2f} "
            f"{r['tokens_per_s']:11,.0f} {r['tokens_per_s_per_gpu']:11,.0f}"
        )
    print(
        f"split / single tokens/s: {split['split_vs_single']:.3f} "
        f"(target >= {SPLIT_TARGET}): {'PASS' if split['pass'] else 'FAIL'}"
    )

    guard = benchmark_guard(args)
    print(
        f"\n2. device guard, te.Linear{tuple(guard['shape'])} FP8 fwd+bwd, devices already match:"
    )
    for name, us in guard["us_per_step"].items():
        print(f"{name:>24}: {us:8.1f} us/step")
    print(
        f"guard cost {guard['guard_cost_us']:+.1f} us/step, run-to-run noise {guard['noise_us']:.1f} us;"
        f" one enter/exit pair alone {guard['enter_exit_pair_ns']:.0f} ns:"
        f" {'PASS' if guard['pass'] else 'FAIL'} (target: cost not above noise)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"split": split, "guard": guard, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
