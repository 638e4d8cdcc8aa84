#!/usr/bin/env python
"""te.LayerNormMLP and te.LayerNormLinear (BF16, FP8 delayed, FP8 current) against the plain
PyTorch BF16 block on the same parameters, forward + backward, side by side in one run.

For each configuration and implementation: the median time of a forward + backward step and of a
forward alone (CUDA events; steps issued back to back as in training), and the peak memory of one
step beyond what was allocated before it (parameters, input and caches excluded: the step's own
activations, gradients and workspaces). Ratios are to the plain block of the same configuration.
Implementations are timed in turns over several rounds, each round starting with the next
implementation, so clock drift spreads over all of them (use as many rounds as implementations,
4, for a full rotation).

Configurations (issue 20):
  gelu       LayerNorm, FC1, tanh GELU, FC2: 8192 tokens, hidden 4096, FFN 16384
  swiglu     RMSNorm, FC1 (2 x FFN), SwiGLU (gate on FC1's first half), FC2: 8192 tokens,
             hidden 4096, FFN 14336
  ln_linear  te.LayerNormLinear: LayerNorm then one linear, 16384 tokens, 4096 -> 4096

    python benchmarks/mlp/benchmark_mlp.py [--configs gelu,swiglu] [--json out.json]
    python benchmarks/mlp/benchmark_mlp.py --device cpu --tokens 256 --hidden 128 --ffn 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

CONFIGS = {
    "gelu": {"kind": "mlp", "tokens": 8192, "hidden": 4096, "ffn": 16384,
             "activation": "gelu", "normalization": "LayerNorm"},
    "swiglu": {"kind": "mlp", "tokens": 8192, "hidden": 4096, "ffn": 14336,
               "activation": "swiglu", "normalization": "RMSNorm"},
    "ln_linear": {"kind": "ln_linear", "tokens": 16384, "hidden": 4096, "ffn": None,
                  "activation": None, "normalization": "LayerNorm"},
}  # fmt: skip
RECIPES = {"te fp8 delayed": DelayedScaling, "te fp8 current": Float8CurrentScaling}
EPS = 1e-5


def plain_norm(x, normalization, weight, bias):
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, EPS)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)


def plain_activation(h, activation):
    """tanh GELU, or SwiGLU gating FC1's first half as TE does."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def plain_forward(module, config):
    """The plain BF16 block as a function of the input, on ``module``'s own parameters."""
    norm, act = config["normalization"], config["activation"]
    ln_bias = getattr(module, "layer_norm_bias", None)

    if config["kind"] == "ln_linear":
        return lambda x: F.linear(
            plain_norm(x, norm, module.layer_norm_weight, ln_bias), module.weight, module.bias
        )

    def forward(x):
        ln = plain_norm(x, norm, module.layer_norm_weight, ln_bias)
        h = F.linear(ln, module.fc1_weight, module.fc1_bias)
        return F.linear(plain_activation(h, act), module.fc2_weight, module.fc2_bias)

    return forward


def te_module(config, device):
    if config["kind"] == "ln_linear":
        return te.LayerNormLinear(
            config["hidden"], config["hidden"], eps=EPS, normalization=config["normalization"],
            device=device, params_dtype=torch.bfloat16,
        )  # fmt: skip
    return te.LayerNormMLP(
        config["hidden"], config["ffn"], eps=EPS, normalization=config["normalization"],
        activation=config["activation"], device=device, params_dtype=torch.bfloat16,
    )  # fmt: skip


def te_forward(module, recipe):
    if recipe is None:
        return module

    def forward(x):
        with te.autocast(recipe=recipe):
            return module(x)

    return forward


class Candidate:
    """One implementation on one configuration: its forward + backward step, its forward alone,
    and the per-step times collected over the rounds."""

    def __init__(self, name, forward, parameters, x, dy):
        self.name, self.forward = name, forward
        self.parameters, self.x, self.dy = parameters, x, dy
        self.step_times: list[float] = []
        self.forward_times: list[float] = []
        self.peak_bytes: int | None = None
        self.skipped = ""

    def clear(self):
        """Drop the gradients, so every step allocates the same and the memory baseline holds
        no gradient."""
        self.x.grad = None
        for p in self.parameters:
            p.grad = None

    def step(self):
        self.clear()
        self.forward(self.x).backward(self.dy)

    def forward_only(self):
        self.clear()
        self.forward(self.x)


class Clock:
    """Per-step times: CUDA events recorded between the steps of a back-to-back run (the host
    queues step i+1 while the GPU runs step i), or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def times(self, fn, steps: int) -> list[float]:
        """Seconds of each of ``steps`` calls of ``fn``."""
        self.sync()
        if not self.cuda:
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return times
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]


def peak_step_bytes(candidate: Candidate) -> int:
    """Peak CUDA memory of one step beyond what was allocated before it: the baseline holds the
    parameters, input, grad output and caches (FP8 weight copies, scaling state), no gradient."""
    candidate.clear()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    candidate.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def resolve_config(name: str, args) -> dict:
    config = dict(CONFIGS[name])
    for key in ("tokens", "hidden", "ffn"):
        value = getattr(args, key)
        if value is not None and (key != "ffn" or config["kind"] == "mlp"):
            config[key] = value
    return config


def describe(name: str, config: dict) -> str:
    if config["kind"] == "ln_linear":
        shape = f"{config['tokens']} x {config['hidden']} -> {config['hidden']}"
        return f"{name}: te.LayerNormLinear {config['normalization']}, {shape}"
    shape = f"{config['tokens']} tokens, hidden {config['hidden']}, FFN {config['ffn']}"
    return f"{name}: te.LayerNormMLP {config['normalization']} {config['activation']}, {shape}"


def run_config(config: dict, args, device: torch.device, clock: Clock) -> list[Candidate]:
    torch.manual_seed(0)
    module = te_module(config, device)
    parameters = list(module.parameters())
    x = torch.randn(config["tokens"], config["hidden"], device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    plain = plain_forward(module, config)
    with torch.no_grad():
        reference = plain(x)
        error = (module(x) - reference).abs().max() / reference.abs().max()
    print(f"  te BF16 vs plain output: max |diff| / max |plain| = {error.item():.2e}")

    # One module serves every implementation: the same parameters throughout.
    candidates = [Candidate("plain bf16", plain, parameters, x, dy),
                  Candidate("te bf16", te_forward(module, None), parameters, x, dy)]  # fmt: skip
    for name, recipe in RECIPES.items():
        candidates.append(Candidate(name, te_forward(module, recipe()), parameters, x, dy))
    for candidate in candidates:
        try:
            candidate.step()
        except (RuntimeError, NotImplementedError, ValueError) as err:
            candidate.skipped = f"{type(err).__name__}: {err}"

    running = [c for c in candidates if not c.skipped]
    for round_index in range(args.rounds):
        # Each round starts with another implementation: on a power-capped GPU the one timed
        # right after the heaviest runs at lower clocks, and a fixed order would always put the
        # same one there.
        start = round_index % len(running) if running else 0
        for candidate in running[start:] + running[:start]:
            for _ in range(args.warmup):
                candidate.step()
            candidate.step_times += clock.times(candidate.step, args.steps)
            candidate.forward_times += clock.times(candidate.forward_only, args.steps)
    if device.type == "cuda":
        for candidate in running:
            candidate.peak_bytes = peak_step_bytes(candidate)
    return candidates


def ratio(value, base) -> str:
    return f"{value / base:6.2f}x" if value is not None and base else f"{'':7}"


def report(name: str, candidates: list[Candidate]) -> list[dict]:
    base = candidates[0]
    base_step = statistics.median(base.step_times)
    base_fwd = statistics.median(base.forward_times)
    print(f"  {'impl':>15} {'fwd+bwd ms':>11} {'vs plain':>8} {'fwd ms':>9} {'vs plain':>8} "
          f"{'peak GiB':>9} {'vs plain':>8}")  # fmt: skip
    rows = []
    for c in candidates:
        if c.skipped:
            print(f"  {c.name:>15} skipped: {c.skipped}")
            rows.append({"config": name, "impl": c.name, "skipped": c.skipped})
            continue
        step, fwd = statistics.median(c.step_times), statistics.median(c.forward_times)
        gib = c.peak_bytes / 2**30 if c.peak_bytes is not None else None
        gib_text = f"{gib:9.3f}" if gib is not None else f"{'n/a':>9}"
        print(f"  {c.name:>15} {step * 1e3:11.3f} {ratio(step, base_step):>8} {fwd * 1e3:9.3f} "
              f"{ratio(fwd, base_fwd):>8} {gib_text} {ratio(c.peak_bytes, base.peak_bytes):>8}")  # fmt: skip
        rows.append({
            "config": name, "impl": c.name, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
            "peak_gib": gib, "step_vs_plain": step / base_step, "forward_vs_plain": fwd / base_fwd,
            "peak_vs_plain": c.peak_bytes / base.peak_bytes if gib is not None else None,
            "step_samples": len(c.step_times),
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)}")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=None, help="override every config's")
    parser.add_argument("--hidden", type=int, default=None, help="override every config's")
    parser.add_argument("--ffn", type=int, default=None, help="override the MLP configs'")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before each turn")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cuda:0", help="cpu: a smoke run, with small shapes")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs {args.configs!r}: unknown {unknown}; choose from {list(CONFIGS)}")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                f"benchmark_mlp.py needs a CUDA GPU for --device {args.device}; for a smoke run "
                "on the CPU pass --device cpu with small --tokens/--hidden/--ffn",
                file=sys.stderr,
            )
            return 1
        torch.cuda.set_device(device)
        where = torch.cuda.get_device_name(device)
    else:
        where = "CPU (host clock; no memory figures)"
    print(f"MLP benchmark on {where}, torch {torch.__version__}")
    print(f"native: {transformer_engine.native_status()}")
    print(f"medians of {args.rounds} rounds x {args.steps} steps, {args.warmup} warm-up per turn")
    clock, rows = Clock(device), []
    for name in names:
        config = resolve_config(name, args)
        print(f"\n{describe(name, config)}")
        rows += report(name, run_config(config, args, device, clock))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
