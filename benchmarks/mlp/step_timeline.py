#!/usr/bin/env python
"""Where the time of a training step goes on one CUDA GPU: its kernels by kind, the GPU's idle
time between them, and the host time the step takes to issue, for te.LayerNormMLP and te.Linear
in BF16 and under each FP8 recipe.

For each configuration and implementation, after warm-up steps:

* ``wall``: ms per step of ``--steps`` steps issued back to back (CUDA events; one step is
  queued before the first event, so the GPU is busy when timing starts);
* ``host``: ms per step to issue up to 10 of those steps while a sleep kernel holds the GPU
  busy, so the host never waits on it: the step's Python, dispatch and launch time alone (10
  steps are a few hundred launches: a full launch queue would block the host). A host time
  near or above the kernel time means the GPU waits on the host;
* a ``torch.profiler`` trace of ``--profiled`` steps in the steady state (steps queued ahead of
  them, so the GPU is busy when they start, as in training): per step the kernel time (the union of the
  kernels' intervals: kernels launched with programmatic dependent launch may overlap) by kind
  (GEMMs, casts, amax passes, norms, activations, scale updates, memsets and copies, other),
  the GPU's idle time (the trace's span less that union), and the longest gaps with the kernels
  on either side.

Configurations: ``gelu`` (te.LayerNormMLP LayerNorm + tanh GELU, 8192 tokens, 4096 -> 16384,
as benchmark_mlp.py), ``swiglu`` (RMSNorm + SwiGLU, 4096 -> 2 x 14336), ``linear`` (te.Linear
4096 -> 4096 on 16384 tokens) and ``small`` (te.Linear 1024 -> 1024 on 1024 tokens, a step
bound by host time).

    python benchmarks/mlp/step_timeline.py [--configs gelu,linear] [--gaps 8]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

CONFIGS = {
    "gelu": ("mlp", 8192, 4096, 16384, "gelu", "LayerNorm"),
    "swiglu": ("mlp", 8192, 4096, 14336, "swiglu", "RMSNorm"),
    "linear": ("linear", 16384, 4096, 4096, None, None),
    "small": ("linear", 1024, 1024, 1024, None, None),
}
# Steps issued ahead of a busy GPU: a few hundred launches, short of filling the launch queue.
HOST_STEPS = 10
RECIPES = {
    "te bf16": None,
    "te fp8 delayed": DelayedScaling,
    "te fp8 current": Float8CurrentScaling,
}

# Kernel kinds, by the first pattern a kernel's name contains (lower case).
KINDS = (
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_")),
    ("scale update", ("delayed_scaling", "scale_from")),
    ("amax pass", ("amax",)),
    ("norm", ("norm_",)),
    ("activation", ("activation", "elementwise_kernel<transformer_engine")),
    ("cast", ("cast_", "quantize", "dbias", "scale_inv")),
    ("memset/copy", ("memset", "memcpy")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel (``KINDS``), ``"other"`` when no pattern matches."""
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def busy_time(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals (overlapping kernels count once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def gaps(kernels, count: int):
    """The ``count`` longest idle gaps of ``[(start, end, name)]`` (by start), longest first, as
    ``(gap, name before, name after)``; a gap starts where every earlier kernel has ended."""
    found, reach, last = [], None, None
    for start, end, name in sorted(kernels):
        if reach is not None and start > reach:
            found.append((start - reach, last, name))
        if reach is None or end >= reach:
            reach, last = end, name
    return sorted(found, key=lambda g: -g[0])[:count]


def make_step(config, recipe_cls, device):
    kind, tokens, hidden, out, activation, normalization = config
    torch.manual_seed(0)
    if kind == "mlp":
        module = te.LayerNormMLP(
            hidden, out, eps=1e-5, activation=activation, normalization=normalization,
            device=device, params_dtype=torch.bfloat16,
        )  # fmt: skip
        y_features = hidden
    else:
        module = te.Linear(hidden, out, device=device, params_dtype=torch.bfloat16)
        y_features = out
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, y_features, device=device, dtype=torch.bfloat16)
    recipe = recipe_cls() if recipe_cls is not None else None
    parameters = list(module.parameters())

    def step():
        x.grad = None
        for p in parameters:
            p.grad = None
        if recipe is None:
            y = module(x)
        else:
            with te.autocast(recipe=recipe):
                y = module(x)
        y.backward(dy)

    return step


def wall_ms(step, steps: int) -> float:
    step()  # queued first: the GPU is busy when the start event runs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def host_ms(step, steps: int) -> float:
    torch.cuda.synchronize()
    # About a second of GPU work ahead of the steps (far more than issuing them takes).
    torch.cuda._sleep(2_000_000_000)
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed * 1e3 / steps


def _profiled(run):
    """The sorted ``(start us, end us, name)`` of the GPU kernels and memory operations the
    profiler records while ``run()`` issues work (then awaits it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )


def trace(step, steps: int, ahead: int = 2):
    """``[(start us, end us, name)]`` of the GPU kernels and memory operations of ``steps``,
    traced in the steady state of back-to-back training: ``ahead`` steps are queued (not awaited)
    before the profiler starts, ``ahead + steps`` are issued under it, and only the last
    ``steps`` are kept, so the traced steps find the GPU busy as a training step does. (Traced
    from an idle GPU, the first step's forward waits on the host launching it: start-up idle
    time that no training step has.) A step's event count comes from one step traced alone."""
    torch.cuda.synchronize()
    per_step = len(_profiled(step))
    for _ in range(ahead):
        step()

    def run():
        for _ in range(ahead + steps):
            step()

    return steady_steps(_profiled(run), per_step, steps)


def steady_steps(events, per_step: int, kept: int):
    """The last ``kept`` steps of ``events`` (sorted by start; every step issues the same
    ``per_step`` kernels and copies): whatever the profiler caught of work queued before it
    started, and the leading steps, are dropped."""
    return events[len(events) - kept * per_step :]


def report(label: str, step, args) -> None:
    for _ in range(args.warmup):
        step()
    wall = wall_ms(step, args.steps)
    host = host_ms(step, min(args.steps, HOST_STEPS))
    kernels = trace(step, args.profiled)
    n = args.profiled
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    busy = busy_time((s, e) for s, e, _ in kernels)
    print(f"  {label}: wall {wall:.3f} ms/step, host {host:.3f} ms/step, kernels "
          f"{busy / n / 1e3:.3f} ms/step, GPU idle {(span - busy) / n / 1e3:.3f} ms/step")  # fmt: skip
    by_kind: dict[str, list] = {}
    for s, e, name in kernels:
        by_kind.setdefault(kernel_kind(name), []).append((s, e))
    for kind, spans in sorted(by_kind.items(), key=lambda kv: -busy_time(kv[1])):
        print(f"    {kind:>13} {busy_time(spans) / n:9.1f} us/step  ({len(spans) // n} a step)")
    for gap, before, after in gaps(kernels, args.gaps):
        print(f"    gap {gap:7.1f} us  after {before[:60]}  before {after[:60]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="gelu,linear", help=f"from {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=20, help="steps timed (wall and host)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=4, help="steps traced")
    parser.add_argument("--gaps", type=int, default=6, help="longest gaps listed")
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs {args.configs!r}: unknown {unknown}; choose from {list(CONFIGS)}")
    if min(args.steps, args.profiled) < 1 or min(args.warmup, args.gaps) < 0:
        parser.error("--steps and --profiled must be at least 1, --warmup and --gaps at least 0")
    if not torch.cuda.is_available():
        print("step_timeline.py needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"step timeline on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for name in names:
        print(f"{name}: {CONFIGS[name]}")
        for label, recipe_cls in RECIPES.items():
            report(label, make_step(CONFIGS[name], recipe_cls, device), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
