#!/usr/bin/env python
"""te.DotProductAttention against PyTorch's flash SDPA called directly, forward + backward,
side by side in one run on one CUDA GPU.

Causal self-attention, BF16, batch 4 x 4096 tokens x 32 heads x 128, in the sbhd and bshd
formats. The direct call gets the same tensors and returns the same layout as the module
(``[s, b, h*d]`` / ``[b, s, h*d]``), so both sides do the same copies; the ratio
``sdpa time / DotProductAttention time`` is printed per format (target: >= 0.9, within 10%).
It also reports the host time of one forward call at a small shape (the Python on top of the
kernel launch; the GPU work is not waited for), and which backend the module chose.

    python benchmarks/attention/benchmark_attention.py [--json out.json] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree, not an install

from transformer_engine.pytorch.attention.dot_product_attention import (  # noqa: E402
    DotProductAttention,
)
from transformer_engine.pytorch.attention.dot_product_attention import (  # noqa: E402
    dot_product_attention as dpa_module,
)

BATCH, SEQ, HEADS, HEAD_DIM = 4, 4096, 32, 128
HOST_SHAPE = (1, 128, 8, 64)
TARGET = 0.9
STEPS_PER_TRIAL = 10


def time_steps(step, iters: int, warmup: int) -> float:
    """Median seconds per step over ``iters`` trials of back-to-back steps (CUDA events)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS_PER_TRIAL):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / STEPS_PER_TRIAL)
    return statistics.median(times)


def inputs(fmt: str, shape, device):
    b, s, h, d = shape
    dims = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    return [torch.randn(dims, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)]  # fmt: skip


def direct_sdpa(fmt: str):
    """PyTorch's flash kernel on the same tensors, returning the module's output layout."""

    def attend(q, k, v):
        if fmt == "sbhd":
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, h, s, d = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        return out.transpose(1, 2).reshape(b, s, h * d)

    return attend


def make_step(attend, q, k, v, dy):
    def step():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(dy)

    return step


def host_time_per_call(attend, q, k, v, calls: int = 200) -> float:
    """Median host seconds per forward call (no grad, GPU work not waited for)."""
    samples = []
    with torch.no_grad():
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                attend(q, k, v)
            samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def chosen_backend() -> str:
    cache = dpa_module._attention_backends
    if cache["use_flash_attention"]:
        return "FlashAttention (SDPA FLASH_ATTENTION)"
    if cache["use_fused_attention"]:
        return f"FusedAttention (SDPA {cache['fused_attention_backend'].sdp_backend.name})"
    return "UnfusedDotProductAttention"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_attention.py needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    flops = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM / 2 * 3.5  # causal fwd (2 GEMMs) + bwd
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "shape": [BATCH, SEQ, HEADS, HEAD_DIM], "formats": {}}  # fmt: skip
    print(f"{results['device']}, torch {torch.__version__}; causal BF16 fwd+bwd "
          f"b={BATCH} s={SEQ} h={HEADS} d={HEAD_DIM}")  # fmt: skip
    for fmt in ("sbhd", "bshd"):
        q, k, v = inputs(fmt, (BATCH, SEQ, HEADS, HEAD_DIM), device)
        dy = torch.randn(
            (SEQ, BATCH, HEADS * HEAD_DIM) if fmt == "sbhd" else (BATCH, SEQ, HEADS * HEAD_DIM),
            device=device,
            dtype=torch.bfloat16,
        )
        dpa = DotProductAttention(HEADS, HEAD_DIM, qkv_format=fmt, attn_mask_type="causal")
        reference = direct_sdpa(fmt)
        steps = {"dpa": make_step(dpa, q, k, v, dy), "sdpa": make_step(reference, q, k, v, dy)}
        best = {name: float("inf") for name in steps}
        for _ in range(2):  # interleaved rounds, best of each: clocks and caches treat both alike
            for name, step in steps.items():
                best[name] = min(best[name], time_steps(step, args.iters, args.warmup))
        t_dpa, t_ref = best["dpa"], best["sdpa"]
        backend = chosen_backend()
        hq, hk, hv = inputs(fmt, HOST_SHAPE, device)
        small = DotProductAttention(HOST_SHAPE[2], HOST_SHAPE[3], qkv_format=fmt,
                                    attn_mask_type="causal")  # fmt: skip
        host_dpa = host_time_per_call(small, hq, hk, hv)
        host_ref = host_time_per_call(reference, hq, hk, hv)
        ratio = t_ref / t_dpa
        results["formats"][fmt] = {
            "dpa_ms": t_dpa * 1e3, "sdpa_ms": t_ref * 1e3, "ratio": ratio,
            "dpa_tflops": flops / t_dpa / 1e12, "sdpa_tflops": flops / t_ref / 1e12,
            "backend": backend, "host_us_dpa": host_dpa * 1e6, "host_us_sdpa": host_ref * 1e6,
        }  # fmt: skip
        verdict = "ok" if ratio >= TARGET else f"BELOW TARGET {TARGET}"
        print(f"  {fmt}: DotProductAttention {t_dpa * 1e3:.3f} ms ({backend}), direct flash SDPA "
              f"{t_ref * 1e3:.3f} ms, ratio {ratio:.3f} [{verdict}]; host per forward call "
              f"{host_dpa * 1e6:.1f} us vs {host_ref * 1e6:.1f} us")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
