"""te.optimizers.FusedAdam's step against torch.optim.AdamW (foreach and fused), one run.

Parameters: ``--tensors`` weight matrices of ``--shape`` in ``--dtype`` with random gradients.
Cases: float32 parameters (FusedAdam, AdamW foreach, AdamW fused), and bfloat16 parameters
with float32 master weights (FusedAdam ``master_weights=True``; with ``store_param_remainders``;
torch has no master-weight form, so AdamW runs on float32 copies there). Each case's median
step time (CUDA events over back-to-back steps) and its ratio to AdamW fused; the peak memory of
the optimizer state. Numbers belong in docs/optimizers.md as ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from transformer_engine.pytorch.optimizers import FusedAdam


def make_params(n, shape, dtype, device):
    params = [torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def time_step(opt, warmup, iters) -> float:
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(name, build, args, device):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    opt, params = build()
    base = torch.cuda.memory_allocated(device)
    ms = time_step(opt, args.warmup, args.iters)
    state = torch.cuda.max_memory_allocated(device) - base
    del opt, params
    return name, ms, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--shape", default="4096x4096")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    device = torch.device(args.device)
    n = args.tensors
    kw = dict(lr=1e-3, weight_decay=0.01)

    def fused(dtype, **extra):
        def build():
            params = make_params(n, shape, dtype, device)
            return FusedAdam(params, **kw, **extra), params

        return build

    def torch_adamw(dtype, **extra):
        def build():
            params = make_params(n, shape, dtype, device)
            return torch.optim.AdamW(params, **kw, **extra), params

        return build

    cases = [
        ("fp32 params: FusedAdam", fused(torch.float32)),
        ("fp32 params: AdamW foreach", torch_adamw(torch.float32, foreach=True)),
        ("fp32 params: AdamW fused", torch_adamw(torch.float32, fused=True)),
        ("bf16 params + fp32 master: FusedAdam", fused(torch.bfloat16, master_weights=True)),
        ("bf16 params + remainders: FusedAdam",
         fused(torch.bfloat16, master_weights=True, store_param_remainders=True)),
        ("bf16 params, bf16 moments: FusedAdam",
         fused(torch.bfloat16, master_weights=True, exp_avg_dtype=torch.bfloat16,
               exp_avg_sq_dtype=torch.bfloat16)),
    ]  # fmt: skip
    numel = n * shape[0] * shape[1]
    print(
        f"{n} tensors of {shape}: {numel / 1e6:.0f} M parameters, {torch.cuda.get_device_name(device)}"
    )
    results = [run_case(name, build, args, device) for name, build in cases]
    ref = next(ms for name, ms, _ in results if name == "fp32 params: AdamW fused")
    print(f"{'case':40s} {'ms/step':>9s} {'vs AdamW fused':>15s} {'GiB above params':>14s}")
    for name, ms, state in results:
        print(f"{name:40s} {ms:9.2f} {ms / ref:14.2f}x {state / 2**30:14.2f}")


if __name__ == "__main__":
    main()
