#!/usr/bin/env python
"""Peak memory and time of FP8 attention's emulation (``fp8_dpa``), forward + backward, against
BF16 attention (PyTorch's flash kernel) of the same shape, side by side in one run on one GPU.

The emulation computes the products in float32 in blocks of queries
(``score_blocks.SCORE_BLOCK_BYTES`` of scores each); ``one block`` sets that budget high
enough for the whole score matrix, which is what the emulation cost before it walked the queries
in blocks (a few score-sized float32 tensors). Causal self-attention, bshd, BF16 inputs;
the peak is ``torch.cuda.max_memory_allocated`` above what the inputs hold.

    python benchmarks/attention/fp8_emulation_memory.py [--batch 1] [--heads 16] [--seq 4096 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:  # the installed package (its native kernels); else the source tree
    import transformer_engine
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformer_engine  # noqa: F401

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from transformer_engine.pytorch.attention.dot_product_attention import (  # noqa: E402
    DotProductAttention,
    score_blocks,
)


def measure(dpa, recipe, q, k, v, dout, steps: int) -> tuple[float, float]:
    """(ms per forward + backward, peak GiB above the inputs)."""

    def step():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = dpa(q, k, v)
        out.backward(dout)

    step()  # warm-up (recipe state, kernels)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return start.elapsed_time(end) / steps, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    torch.manual_seed(0)
    budget = score_blocks.SCORE_BLOCK_BYTES
    print(f"{torch.cuda.get_device_name()}; block budget {budget >> 20} MiB of scores")
    print(f"{'seq':>6} {'configuration':<28} {'ms/step':>9} {'peak GiB':>9}")
    for seq in args.seq:
        b, h, d = args.batch, args.heads, args.head_dim
        q, k, v = (
            torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn(b, seq, h * d, device="cuda", dtype=torch.bfloat16)
        dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")
        score_bytes = 4 * b * h * seq * seq
        configs = [
            ("BF16 (flash)", None, budget),
            ("FP8 delayed, blocks", DelayedScaling(fp8_dpa=True), budget),
            ("FP8 current, blocks", Float8CurrentScaling(fp8_dpa=True), budget),
            ("FP8 current, one block", Float8CurrentScaling(fp8_dpa=True), score_bytes),
        ]
        for name, recipe, block_bytes in configs:
            score_blocks.SCORE_BLOCK_BYTES = block_bytes
            try:
                ms, peak = measure(dpa, recipe, q, k, v, dout, args.steps)
                print(f"{seq:>6} {name:<28} {ms:>9.2f} {peak:>9.2f}")
            except torch.OutOfMemoryError:
                print(f"{seq:>6} {name:<28} {'out of memory':>19}")
            finally:
                score_blocks.SCORE_BLOCK_BYTES = budget
                q.grad = k.grad = v.grad = None
                torch.cuda.empty_cache()
        print(f"{seq:>6} (one float32 score matrix: {score_bytes / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
