#!/usr/bin/env python
"""Tensor-parallel te.LayerNormMLP on 2 GPUs (NCCL): a training step (forward + backward) of
LayerNormMLP(8192, 28672) on 8192 tokens, in BF16 and FP8 (delayed and current scaling), with
and without sequence parallelism, against the same step on one GPU.

The single-GPU time is measured first, on rank 0 alone, by this same script (the other rank
waits); then both ranks run the tensor-parallel module (FC1 column-parallel, FC2 row-parallel:
``set_parallel_mode=True``). Times are medians over rounds of back-to-back steps (CUDA events);
a tensor-parallel time is the slower rank's. Reported per configuration:

* parallel efficiency = single-GPU time / (2 x TP time)          (issue 17 target: >= 80%)
* FP8 vs BF16 at TP=2 = TP time in BF16 / TP time in FP8            (issue 17 target: >= 1.3x)
* with ``--overlap-baseline``: overlap gain = TP time with FC1's backward collectives waited
  for as soon as they are issued / TP time with them overlapping FC1's GEMMs (the default;
  ``transformer_engine.pytorch._parallel_backward``), timed in the same run
* with ``--ub`` (sequence parallelism): ub gain = TP time / TP time of the module built with
  the ``ub_*`` flags after ``te.initialize_ub`` (FC1's gather and FC2's reduce-scatter, and
  their backward twins, pipelined chunk by chunk with the GEMMs: ``_ring_gemm``), same run

Under sequence parallelism FC1's input is all-gathered in FP8 for the per-tensor FP8 recipes
(one byte per value) and FC2's output reduce-scattered in BF16.

Usage (2 processes x 1 GPU; NVLink multicast off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python -m torch.distributed.run --nproc-per-node 2 benchmarks/parallel/benchmark_tp_mlp.py
    ... benchmarks/parallel/benchmark_tp_mlp.py --tokens 4096 --steps 10 --json out.json
    ... benchmarks/parallel/benchmark_tp_mlp.py --overlap-baseline --ub

With fewer than 2 GPUs (or not launched by torch.distributed.run with 2 processes) it prints
why and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import _parallel_backward

PRECISIONS = ("bf16", "delayed", "current")
EFFICIENCY_TARGET, FP8_TARGET = 0.80, 1.3


def recipe_of(precision: str, reduce_amax: bool):
    if precision == "delayed":
        return DelayedScaling(amax_history_len=16, reduce_amax=reduce_amax)
    if precision == "current":
        return Float8CurrentScaling()
    return None


def build(args, device, group=None, sp=False, ub=False):
    kw = dict(params_dtype=torch.bfloat16, device=device)
    if group is not None:
        kw.update(set_parallel_mode=True, tp_group=group, sequence_parallel=sp)
    if ub:
        kw.update(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True)
    torch.manual_seed(0)
    return te.LayerNormMLP(args.hidden, args.ffn, **kw)


def time_steps(module, x, dy, recipe, group, args) -> float:
    """Median milliseconds of one forward + backward step."""

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        with te.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group):
            out = module(x)
        out.backward(dy)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / args.steps)
    return statistics.median(times)


def inputs(tokens, hidden, device):
    torch.manual_seed(1)
    x = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16)
    return x, dy


def single_gpu_times(args, device) -> dict:
    module = build(args, device)
    x, dy = inputs(args.tokens, args.hidden, device)
    # One process: no amax reduction (the other rank is not in this measurement).
    times = {p: time_steps(module, x, dy, recipe_of(p, False), None, args) for p in PRECISIONS}
    del module, x, dy
    torch.cuda.empty_cache()
    return times


def tp_time(args, device, group, precision, sp, overlap=True, ub=False) -> float:
    _parallel_backward.OVERLAP = overlap
    try:
        return _tp_time(args, device, group, precision, sp, ub)
    finally:
        _parallel_backward.OVERLAP = True


def _tp_time(args, device, group, precision, sp, ub) -> float:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    module = build(args, device, group, sp, ub)
    x, dy = inputs(args.tokens, args.hidden, device)
    if sp:
        x = x.detach().chunk(world)[rank].contiguous().requires_grad_(True)
        dy = dy.chunk(world)[rank].contiguous()
    dist.barrier(group)
    ms = time_steps(module, x, dy, recipe_of(precision, True), group, args)
    slowest = torch.tensor([ms], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    del module, x, dy
    torch.cuda.empty_cache()
    return float(slowest)


def refuse(message: str) -> int:
    print(f"benchmark_tp_mlp: {message}", file=sys.stderr)
    return 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    parser.add_argument(
        "--overlap-baseline", action="store_true",
        help="also time each TP configuration with the backward collectives unoverlapped",
    )  # fmt: skip
    parser.add_argument(
        "--ub", action="store_true",
        help="also time each sequence-parallel configuration with the ub_* overlap flags",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return refuse(f"needs 2 CUDA GPUs, found {count}; run it on a two-GPU machine")
    if int(os.environ.get("WORLD_SIZE", "0")) != 2 or "LOCAL_RANK" not in os.environ:
        return refuse(
            "launch it with 2 processes: python -m torch.distributed.run --nproc-per-node 2 "
            "benchmarks/parallel/benchmark_tp_mlp.py"
        )
    if args.tokens % 2:
        return refuse(f"--tokens={args.tokens} must be even (sequence parallelism splits it)")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        group = dist.new_group([0, 1])
        rank = dist.get_rank()
        if args.ub:
            te.initialize_ub([args.tokens, args.hidden], 2)
        single = single_gpu_times(args, device) if rank == 0 else None
        dist.barrier()
        results = []
        for sp in (False, True):
            for precision in PRECISIONS:
                tp = tp_time(args, device, group, precision, sp)
                result = {"precision": precision, "sequence_parallel": sp, "tp_ms": tp}
                if args.overlap_baseline:
                    result["unoverlapped_ms"] = tp_time(args, device, group, precision, sp, False)
                if args.ub and sp:
                    result["ub_ms"] = tp_time(args, device, group, precision, sp, ub=True)
                results.append(result)
        if rank == 0:
            report(args, single, results)
        return 0
    finally:
        dist.destroy_process_group()


def report(args, single: dict, results: list[dict]) -> None:
    tp_bf16 = {r["sequence_parallel"]: r["tp_ms"] for r in results if r["precision"] == "bf16"}
    print(f"LayerNormMLP({args.hidden}, {args.ffn}), {args.tokens} tokens, BF16 parameters, "
          "forward + backward; TP=2 over NCCL")  # fmt: skip
    print(f"{'precision':<9} {'SP':<5} {'1 GPU ms':>9} {'TP=2 ms':>8} {'efficiency':>10} "
          f"{'FP8 vs BF16':>11} {'overlap gain':>12} {'ub gain':>8}")  # fmt: skip
    for r in results:
        r["single_ms"] = single[r["precision"]]
        r["efficiency"] = r["single_ms"] / (2 * r["tp_ms"])
        fp8 = r["precision"] != "bf16"
        r["fp8_vs_bf16"] = tp_bf16[r["sequence_parallel"]] / r["tp_ms"] if fp8 else None
        ratio = f"{r['fp8_vs_bf16']:.2f}x" if fp8 else "-"
        gain = "-"
        if "unoverlapped_ms" in r:
            r["overlap_gain"] = r["unoverlapped_ms"] / r["tp_ms"]
            gain = f"{r['overlap_gain']:.3f}x"
        ub_gain = "-"
        if "ub_ms" in r:
            r["ub_gain"] = r["tp_ms"] / r["ub_ms"]
            ub_gain = f"{r['ub_gain']:.3f}x"
        print(f"{r['precision']:<9} {str(r['sequence_parallel']):<5} {r['single_ms']:>9.2f} "
              f"{r['tp_ms']:>8.2f} {100 * r['efficiency']:>9.1f}% {ratio:>11} "
              f"{gain:>12} {ub_gain:>8}")  # fmt: skip
    print(f"targets: efficiency >= {EFFICIENCY_TARGET:.0%}, FP8 vs BF16 at TP=2 >= "
          f"{FP8_TARGET}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
