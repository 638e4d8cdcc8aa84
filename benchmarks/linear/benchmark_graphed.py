#!/usr/bin/env python
"""te.Linear in FP8 graphed with te.make_graphed_callables against the same layer eager and
against torch.nn.Linear in BF16 eager, forward + backward at 1024x1024x1024, in one run.

At this shape an eager FP8 step is bound by host time (Python, autograd, launches): a replayed
graph issues the step's kernels with one launch per direction. Each implementation runs the
same training step (input gradient and parameter gradients, under ``te.autocast`` for FP8);
the graphed layer's input is a different tensor from its capture sample, so every replay pays
the copy into the static input, as a model would. Ratios are BF16 eager time / time (above 1:
faster than BF16). Interleaved rounds, median of each implementation's per-round medians.
Each implementation is timed in a pair with the BF16 baseline, its module freed before the next
pair's is built (every autocast exit updates every live delayed-scaling module, so one
implementation's steps would otherwise pay for another's modules, as no model built one way
does); the BF16 figure is printed with each pair.
Each FP8 recipe is graphed twice: with the replay's copies (input in, output gradient in,
parameter gradients out) made by the graphs themselves (the default), and issued eagerly as
separate copies (``NVTE_GRAPH_COPY_NODES=0``), which the target does not count. Also printed:
the host time a step takes to issue while the GPU is held busy (a sleep kernel queued first,
so nothing waits on the GPU; "n/a" if the GPU caught up), which decides these host-bound steps
and moves least with other work on the host.

    python benchmarks/linear/benchmark_graphed.py [--rounds 5] [--iters 20] [--json out.json]
        [--single-thread-backward]   # every implementation's backward on the calling thread
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_linear import time_steps  # noqa: E402

import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.graph import make_graphed_callables  # noqa: E402

SHAPE = (1024, 1024, 1024)
TARGET = 1.0  # graphed FP8 at least as fast as BF16 eager


def make_step(module, x, dy, recipe):
    params = list(module.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        y.backward(dy)

    return step


def host_time(step, steps: int = 20, trials: int = 5) -> float | None:
    """Host seconds to issue one step while the GPU is held busy (a sleep kernel queued
    first), so that nothing the host does waits on the GPU: the least of ``trials``. None if the
    GPU caught up before the host finished (the figure would include waiting). Few steps a
    trial: a full launch queue (about a thousand entries) would block the host too."""
    best = None
    for _ in range(trials):
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # ~0.15 s at the H200's clocks
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = (time.perf_counter() - start) / steps
        caught_up = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        if caught_up:
            return None
        best = elapsed if best is None else min(best, elapsed)
    return best


def time_pair(label, recipe, kind, baseline, x, dy, device, args):
    """Times one implementation against the BF16 eager baseline in interleaved rounds, then
    frees its module (why: the module doc). ``kind``: "eager", "graphed" (copies in the graphs)
    or "graphed, eager copies"."""
    m, k, n = SHAPE
    module = te.Linear(k, n, device=device, params_dtype=torch.bfloat16)
    if kind != "eager":
        os.environ["NVTE_GRAPH_COPY_NODES"] = "0" if kind == "graphed, eager copies" else "1"
        try:  # the variable is read at capture
            sample = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
            make_graphed_callables(module, (sample,), enabled=recipe is not None, recipe=recipe)
        finally:
            os.environ.pop("NVTE_GRAPH_COPY_NODES")
    steps = {"bf16 nn.Linear": make_step(baseline, x, dy, None),
             f"te {label} {kind}": make_step(module, x, dy, recipe)}  # fmt: skip
    per_round = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            per_round[name].append(time_steps(step, args.iters, args.warmup))
    times = {name: statistics.median(values) for name, values in per_round.items()}
    hosts = {name: host_time(step) for name, step in steps.items()}
    del steps, module
    gc.collect()  # a graphed module holds itself in a cycle (module.forward -> graph -> module)
    torch.cuda.empty_cache()
    return times, hosts, per_round


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--single-thread-backward",
        action="store_true",
        help="run backward on the calling thread (torch.autograd.set_multithreading_enabled)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_graphed.py needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    if args.single_thread_backward:
        torch.autograd.set_multithreading_enabled(False)
    print(f"graphed te.Linear on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    if args.single_thread_backward:
        print("backward on the calling thread (autograd multithreading disabled)")
    print(f"native: {transformer_engine.native_status()}")
    m, k, n = SHAPE
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    baseline = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    recipes = (("fp8 delayed", DelayedScaling()), ("fp8 current", Float8CurrentScaling()))
    kinds = ("eager", "graphed", "graphed, eager copies")
    groups = [("bf16", None, "graphed")]
    groups += [(label, recipe, kind) for label, recipe in recipes for kind in kinds]
    print(f"\n(M, K, N) = {SHAPE}, forward + backward, {args.rounds} interleaved rounds a pair")
    print(f"{'impl':>36} {'ms/step':>9} {'BF16 eager / impl':>18} {'host us/step':>13}")
    rows, passed = [], True
    for label, recipe, kind in groups:
        times, hosts, per_round = time_pair(label, recipe, kind, baseline, x, dy, device, args)
        bf16 = times["bf16 nn.Linear"]
        for name, seconds in times.items():
            host = "n/a" if hosts[name] is None else f"{hosts[name] * 1e6:.1f}"
            print(f"{name:>36} {seconds * 1e3:9.4f} {bf16 / seconds:17.2f}x {host:>13}")
            rows.append({"pair": f"te {label} {kind}", "impl": name, "seconds": seconds,
                         "vs_bf16": bf16 / seconds, "host_seconds": hosts[name],
                         "rounds": per_round[name]})  # fmt: skip
            if name.startswith("te fp8") and name.endswith("graphed"):
                passed = passed and bf16 / seconds >= TARGET
        print()
    print(
        f"target: graphed FP8 step at least as fast as BF16 eager: {'PASS' if passed else 'FAIL'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPE, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
