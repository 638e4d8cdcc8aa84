#!/usr/bin/env python
"""te.TransformerLayer forward + backward in BF16, FP8 DelayedScaling and FP8
Float8CurrentScaling, side by side in one run, with the speed ratios to BF16.

Default shape (issue 15): TransformerLayer(4096, 16384, 32 heads), causal self attention, on
4 sequences x 2048 tokens (sbhd), BF16 parameters, dropouts 0 (the GEMMs and the attention are
what is measured). Two configurations: ``default`` (upstream's defaults: LayerNorm, GELU,
``fuse_qkv_params=False``, so the QKV weight is three parameters) and ``fused_qkv``
(``fuse_qkv_params=True``: one QKV weight). The target is FP8 current scaling at least 1.3x the
BF16 speed (step time of BF16 / step time of FP8 current).

For each implementation: the median time of a forward + backward step and of a forward alone
(CUDA events, steps issued back to back as in training), and the peak memory of one step beyond
what was allocated before it. Implementations are timed in turns over several rounds, so clock
drift spreads over all of them. The layer is the same object for every implementation.

    python benchmarks/transformer/benchmark_transformer_layer.py [--configs default] [--json f]
    python benchmarks/transformer/benchmark_transformer_layer.py --device cpu --seq 16 \\
        --batch 2 --hidden 64 --ffn 128 --heads 4 --steps 1 --warmup 0 --rounds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# The installed package when it has TransformerLayer, else this source tree (not installed, or
# an older install).
_installed = importlib.util.find_spec("transformer_engine")
if _installed is None or not (Path(_installed.origin).parent / "pytorch/transformer.py").exists():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.transformer import TransformerLayer  # noqa: E402

CONFIGS = {"default": {"fuse_qkv_params": False}, "fused_qkv": {"fuse_qkv_params": True}}
IMPLEMENTATIONS = {
    "te bf16": None,
    "te fp8 delayed": DelayedScaling,
    "te fp8 current": Float8CurrentScaling,
}
TARGET = ("te fp8 current", 1.3)  # at least this many times the BF16 speed


class Candidate:
    """One implementation: its forward + backward step, its forward alone, and the times."""

    def __init__(self, name, layer, recipe, x, dy):
        self.name, self.layer, self.recipe, self.x, self.dy = name, layer, recipe, x, dy
        self.step_times: list[float] = []
        self.forward_times: list[float] = []
        self.peak_bytes: int | None = None
        self.skipped = ""

    def clear(self):
        self.x.grad = None
        for p in self.layer.parameters():
            p.grad = None

    def forward(self):
        with te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            return self.layer(self.x)

    def step(self):
        self.clear()
        self.forward().backward(self.dy)

    def forward_only(self):
        self.clear()
        self.forward()


def timed(fn, steps: int, cuda: bool) -> list[float]:
    """Seconds of each of ``steps`` calls: CUDA events between back-to-back steps, or the host
    clock on the CPU."""
    if not cuda:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]


def peak_step_bytes(candidate: Candidate) -> int:
    candidate.clear()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    candidate.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_config(name: str, args, device: torch.device) -> list[Candidate]:
    torch.manual_seed(0)
    layer = TransformerLayer(
        args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, device=device, **CONFIGS[name],
    )  # fmt: skip
    x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    candidates = []
    for impl, recipe in IMPLEMENTATIONS.items():
        candidate = Candidate(impl, layer, None if recipe is None else recipe(), x, dy)
        try:
            candidate.step()
        except (RuntimeError, NotImplementedError, ValueError) as err:
            candidate.skipped = f"{type(err).__name__}: {err}"
        candidates.append(candidate)
    running = [c for c in candidates if not c.skipped]
    cuda = device.type == "cuda"
    for _ in range(args.rounds):
        for c in running:
            for _ in range(args.warmup):
                c.step()
            c.step_times += timed(c.step, args.steps, cuda)
            c.forward_times += timed(c.forward_only, args.steps, cuda)
    if cuda:
        for c in running:
            c.peak_bytes = peak_step_bytes(c)
    return candidates


def report(name: str, candidates: list[Candidate], tokens: int) -> list[dict]:
    base = candidates[0]
    if base.skipped:
        print(f"  BF16 failed: {base.skipped}")
        return [{"config": name, "impl": base.name, "skipped": base.skipped}]
    base_step, base_fwd = statistics.median(base.step_times), statistics.median(base.forward_times)
    print(f"  {'impl':>15} {'fwd+bwd ms':>11} {'speed vs bf16':>13} {'fwd ms':>9} "
          f"{'speed vs bf16':>13} {'tokens/s':>11} {'peak GiB':>9}")  # fmt: skip
    rows = []
    for c in candidates:
        if c.skipped:
            print(f"  {c.name:>15} skipped: {c.skipped}")
            rows.append({"config": name, "impl": c.name, "skipped": c.skipped})
            continue
        step, fwd = statistics.median(c.step_times), statistics.median(c.forward_times)
        gib = None if c.peak_bytes is None else c.peak_bytes / 2**30
        print(f"  {c.name:>15} {step * 1e3:11.3f} {base_step / step:12.2f}x {fwd * 1e3:9.3f} "
              f"{base_fwd / fwd:12.2f}x {tokens / step:11,.0f} "
              f"{'n/a' if gib is None else f'{gib:.3f}':>9}")  # fmt: skip
        rows.append({
            "config": name, "impl": c.name, "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
            "step_speedup_vs_bf16": base_step / step, "forward_speedup_vs_bf16": base_fwd / fwd,
            "tokens_per_s": tokens / step, "peak_gib": gib, "step_samples": len(c.step_times),
        })  # fmt: skip
    target = next((r for r in rows if r["impl"] == TARGET[0] and "step_ms" in r), None)
    if target is not None:
        met = target["step_speedup_vs_bf16"] >= TARGET[1]
        print(f"  target {TARGET[0]} >= {TARGET[1]}x bf16: "
              f"{target['step_speedup_vs_bf16']:.2f}x, {'met' if met else 'NOT met'}")  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda:0", help="cpu: a smoke run, with small shapes")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if not names or any(n not in CONFIGS for n in names):
        parser.error(f"--configs {args.configs!r}: choose from {list(CONFIGS)}")
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                f"benchmark_transformer_layer.py needs a CUDA GPU for --device {args.device}; "
                "for a smoke run on the CPU pass --device cpu with small shapes",
                file=sys.stderr,
            )
            return 1
        torch.cuda.set_device(device)
        where = torch.cuda.get_device_name(device)
    else:
        where = "CPU (host clock; no memory figures)"
    tokens = args.seq * args.batch
    print(f"TransformerLayer benchmark on {where}, torch {torch.__version__}")
    print(f"native: {transformer_engine.native_status()}")
    print(f"TransformerLayer({args.hidden}, {args.ffn}, {args.heads}), {args.batch} x {args.seq} "
          f"tokens (sbhd), causal, BF16 parameters, dropout 0")  # fmt: skip
    print(f"medians of {args.rounds} rounds x {args.steps} steps, {args.warmup} warm-up per turn")
    rows = []
    for name in names:
        print(f"\n{name}: {CONFIGS[name]}")
        rows += report(name, run_config(name, args, device), tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
