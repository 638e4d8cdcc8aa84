"""What the quantize benchmarks of this folder share: the command-line options for the input,
the FP8 format and the timing loop, and the CUDA-event timer."""

from __future__ import annotations

import argparse
import statistics

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_input_and_timing_args(p: argparse.ArgumentParser, *, shape: str, shape_help: str, fp8):
    """``--shape`` (default ``shape``), ``--dtype``, ``--fp8`` (choices: ``fp8``'s keys),
    ``--warmup``, ``--iters``, ``--batch`` and ``--device``."""
    add = p.add_argument
    add("--shape", default=shape, help=f"{shape_help}, e.g. {shape} (default %(default)s)")
    add("--dtype", choices=DTYPES, default="bf16", help="input dtype (default %(default)s)")
    add("--fp8", choices=fp8, default="e4m3", help="FP8 format (default %(default)s)")
    add("--warmup", type=int, default=10, help="untimed calls per case (default %(default)s)")
    add("--iters", type=int, default=50, help="timed calls per case (default %(default)s)")
    add("--batch", type=int, default=5, help="calls per CUDA-event pair (default %(default)s)")
    add("--device", default="cuda:0", help="CUDA device (default %(default)s)")


def check_input_and_timing_args(
    p: argparse.ArgumentParser, args: argparse.Namespace, *, example: str, ndim=None
) -> None:
    """Parse ``args.shape`` into a tuple of positive ints (``ndim`` of them when given) and
    check the timing counts; a bad value exits through ``p.error`` naming it."""
    try:
        args.shape = tuple(int(s) for s in args.shape.lower().split("x"))
        assert args.shape and (ndim is None or len(args.shape) == ndim)
        assert all(s > 0 for s in args.shape)
    except (ValueError, AssertionError):
        p.error(f"--shape must look like {example}, got {args.shape!r}")
    if min(args.iters, args.batch, args.warmup + 1) < 1:
        p.error("--iters and --batch must be >= 1, --warmup >= 0")


def time_us(fn, warmup: int, iters: int, batch: int) -> float:
    """Median per-call time in microseconds: ``iters`` calls timed in batches of ``batch``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(max(1, iters // batch)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 / batch for s, e in events)
