#!/usr/bin/env python
"""FP8 quantize / dequantize demo for transformer_engine's kernel API.

On each chosen device it:

1. builds a bfloat16 activation-like tensor with outliers (a few hot channels and spikes);
2. current scaling: ``amax = compute_amax(x)``, ``scale = compute_scale_from_amax(amax, fp8)``;
3. quantizes to E4M3 and E5M2, with the transposed (column-wise) copy, dequantizes, and
   prints format, scale, amax, max abs error, relative RMS error and bytes saved;
4. delayed scaling: for ``--steps`` steps quantizes a drifting input with the scale from the
   previous steps, accumulating amax into a history of length 16, then calls
   ``delayed_scaling_update`` (margin 0, algo 'max') and prints how the scale tracks the amax.

Finally it prints ``transformer_engine.native_status()``. CUDA tensors run the native
kernels (or the reference math when the library is not built); CPU tensors run the reference.

    python examples/pytorch/quantize_demo.py                 # CPU
    python examples/pytorch/quantize_demo.py --device all    # every visible CUDA GPU
    python examples/pytorch/quantize_demo.py --device cuda:1 --steps 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import transformer_engine
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformer_engine
from transformer_engine.pytorch.cpp_extensions import (
    compute_amax,
    compute_scale_from_amax,
    delayed_scaling_update,
    dequantize,
    quantize,
)

FORMATS = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
SHAPE = (1024, 2048)  # tokens x hidden
HISTORY_LEN = 16


def activations(step: int = 0, growth: float = 1.0) -> torch.Tensor:
    """Deterministic bf16 'activations' (made on the CPU, so every device sees the same data)."""
    gen = torch.Generator().manual_seed(1234 + step)
    x = torch.randn(SHAPE, generator=gen)
    x[:, ::256] *= 12.0  # a few hot channels, as in LLM activations
    x.view(-1)[torch.randint(0, x.numel(), (16,), generator=gen)] = 60.0  # isolated spikes
    return (x * growth).to(torch.bfloat16)


def current_scaling(device: torch.device) -> dict:
    x = activations().to(device)
    amax = compute_amax(x)  # one-element float32 tensor on `device`
    print(f"\n[{device}] current scaling, {SHAPE[0]}x{SHAPE[1]} bfloat16 input")
    print(
        f"  {'format':<6} {'scale':>10} {'amax':>8} {'max abs err':>12} {'rel RMS err':>12} "
        f"{'bytes saved':>18}  transpose  on"
    )
    summary = {}
    for name, fp8 in FORMATS.items():
        scale = compute_scale_from_amax(amax, fp8)  # fp8_max / amax
        q = quantize(x, scale, fp8, with_transpose=True)  # data, transpose, scale_inv
        y = dequantize(q.data, q.scale_inv, torch.float32)
        err = y - x.float()
        max_abs = err.abs().max().item()
        rel_rms = (err.pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt()).item()
        saved = x.numel() * x.element_size() - q.data.numel() * q.data.element_size()
        pct = 100 * saved / (x.numel() * x.element_size())
        t_ok = torch.equal(q.transpose.view(torch.uint8), q.data.view(torch.uint8).t())
        print(
            f"  {name:<6} {scale.item():>10.4f} {amax.item():>8.3f} {max_abs:>12.4f} "
            f"{rel_rms:>12.4%} {saved / 2**20:>8.2f} MiB ({pct:.0f}%)  "
            f"{'ok' if t_ok else 'WRONG':<9}  {q.data.device}"
        )
        summary[name] = q.data.view(torch.uint8).cpu()
    return summary


def drift(step: int) -> float:
    """Input magnitude at ``step``: grows 60% a step up to step 2, then shrinks 20% a step."""
    return 1.6 ** min(step, 2) * 0.8 ** max(step - 2, 0)


def delayed_scaling(device: torch.device, steps: int) -> torch.Tensor:
    fp8 = torch.float8_e4m3fn
    history = torch.zeros(HISTORY_LEN, 1, dtype=torch.float32, device=device)  # [L, slots]
    scale = torch.ones(1, dtype=torch.float32, device=device)
    print(f"\n[{device}] delayed scaling, E4M3, amax history {HISTORY_LEN}, margin 0, algo 'max'")
    print("  each step quantizes with the scale from earlier steps; the next scale is 448 / the")
    print(f"  max of the last {HISTORY_LEN} amaxes: it lags a growing input and holds after a peak")
    print(
        f"  {'step':>4} {'input amax':>11} {'window max':>11} {'scale used':>11} "
        f"{'clipped':>9} {'next scale':>11}"
    )
    for step in range(steps):
        x = activations(step, drift(step)).to(device)
        used = scale.item()
        # Quantize with the current (delayed) scale; max |x| accumulates into history row 0.
        q = quantize(x, scale, fp8, amax=history[0])
        clipped = (x.float().abs() * used > 448.0).float().mean().item()  # saturated elements
        this_amax = history[0].item()
        window = history.max().item()  # max of the last HISTORY_LEN amaxes, this one included
        delayed_scaling_update([history], [scale], fp8, margin=0.0, amax_compute_algo="max")
        print(
            f"  {step:>4} {this_amax:>11.3f} {window:>11.3f} {used:>11.4f} "
            f"{clipped:>9.4%} {scale.item():>11.4f}"
        )
    print(f"  final scale on {scale.device}, last FP8 tensor on {q.data.device}")
    return scale.cpu()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, cuda:N, or 'all' for every visible CUDA GPU",
    )
    p.add_argument("--steps", type=int, default=20, help="delayed-scaling steps (default 20)")
    args = p.parse_args()

    if args.device == "all":
        if not torch.cuda.is_available():
            print("--device all: no CUDA GPU is visible here; running on cpu instead")
            devices = [torch.device("cpu")]
        else:
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        devices = [torch.device(args.device)]
        if devices[0].type == "cuda" and not torch.cuda.is_available():
            sys.exit(f"--device {args.device}: no CUDA GPU is visible (torch {torch.__version__})")

    results = {}
    for device in devices:
        results[device] = (current_scaling(device), delayed_scaling(device, args.steps))

    if len(devices) > 1:  # the same inputs must give the same bits on every device
        first = results[devices[0]]
        same = all(
            torch.equal(first[1], r[1]) and all(torch.equal(first[0][k], r[0][k]) for k in FORMATS)
            for r in results.values()
        )
        print(f"\nresults identical on {', '.join(map(str, devices))}: {same}")

    print(f"\ntransformer_engine {transformer_engine.__version__}")
    print(f"native_status(): {transformer_engine.native_status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
