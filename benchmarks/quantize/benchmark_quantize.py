#!/usr/bin/env python
"""FP8 quantize benchmark: Transformer Engine's native cast vs PyTorch, on one CUDA GPU.

Measures, side by side in one run (CUDA events, median over timed batches):

* TE native cast+amax            ``quantize(x, scale, fp8, amax=, out=, scale_inv=)``
* TE native cast+amax+transpose  the same with ``out_transpose=`` (shape ``(cols, *leading)``)
* PyTorch eager, both variants   ``abs().amax()``, ``(x.float()*scale).clamp().to(fp8)``
* torch.compile of that eager code, both variants (skipped with a reason if it fails)
* device-to-device copy of the input, the memory-bandwidth ceiling

Bandwidth counts bytes read plus bytes written: cast = in + 1 B/element,
cast+transpose = in + 2 B/element, copy = 2 * in. Targets: TE cast+amax reaches
>= 80% of copy GB/s, cast+amax+transpose >= 70% (reported as PASS/FAIL). Before
timing, TE's output is checked bitwise against the eager baseline; the exit status
is 1 when that check fails (or no CUDA GPU / native library is available), else 0.

    python benchmarks/quantize/benchmark_quantize.py                 # 16384x8192 bf16 -> e4m3
    python benchmarks/quantize/benchmark_quantize.py --fp8 e5m2 --dtype fp16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cuda_timing, also under python -P
from cuda_timing import (  # noqa: E402
    DTYPES,
    add_input_and_timing_args,
    check_input_and_timing_args,
    time_us,
)

try:
    import transformer_engine
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformer_engine
from transformer_engine.pytorch.cpp_extensions import quantize

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
TARGETS = {"cast+amax": 0.80, "cast+amax+transpose": 0.70}  # fraction of copy GB/s


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_input_and_timing_args(p, shape="16384x8192", shape_help="tensor shape", fp8=FP8)
    add = p.add_argument
    add("--no-compile", action="store_true", help="skip the torch.compile baselines")
    add(
        "--allow-reference",
        action="store_true",
        help="run without the native library (TE rows then time the slow reference path)",
    )
    add("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    check_input_and_timing_args(p, args, example="16384x8192", ndim=None)
    return args


def make_eager(fp8_dtype, fp8_max: float, transpose: bool):
    """The PyTorch baseline: amax, scaled saturating cast, amax accumulation (+ transposed copy)."""

    def eager(x, scale, amax):
        a = x.abs().amax().float()
        q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
        amax.copy_(torch.maximum(amax, a))
        if not transpose:
            return q, None
        t = q.view(torch.uint8).reshape(-1, q.shape[-1]).t().contiguous()  # FP8 transpose via uint8
        return q, t

    return eager


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "benchmark_quantize.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})."
        )
    status = transformer_engine.native_status()
    if not status.available and not args.allow_reference:
        sys.exit(
            f"benchmark_quantize.py needs TE's native library: {status}\n"
            "Build it, or pass --allow-reference to time the pure-PyTorch reference path."
        )

    device = torch.device(args.device)
    if device.type != "cuda":
        sys.exit(f"--device must be a CUDA device, got {args.device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)  # events and default streams belong to this device
    in_dtype, (fp8_dtype, fp8_max) = DTYPES[args.dtype], FP8[args.fp8]
    shape, numel = args.shape, torch.Size(args.shape).numel()
    t_shape = (shape[-1], *shape[:-1])

    # Inputs (randn: NaN-free, so TE and eager must agree bit for bit) and preallocated outputs.
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(in_dtype)
    scale = (fp8_max / x.abs().amax().float()).reshape(1)  # current scaling, on the device
    amax = torch.zeros(1, dtype=torch.float32, device=device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    out = torch.empty(shape, dtype=fp8_dtype, device=device)
    out_t = torch.empty(t_shape, dtype=fp8_dtype, device=device)
    out_copy = torch.empty_like(x)

    # Correctness, once, before timing: TE vs eager, bitwise through uint8 views.
    te_amax, ref_amax = torch.zeros_like(amax), torch.zeros_like(amax)
    quantize(x, scale, fp8_dtype, amax=te_amax, out=out, scale_inv=scale_inv, out_transpose=out_t)
    ref_q, ref_t = make_eager(fp8_dtype, fp8_max, True)(x, scale, ref_amax)
    checks = {
        "data": torch.equal(out.view(torch.uint8), ref_q.view(torch.uint8)),
        "transpose": torch.equal(out_t.view(torch.uint8).reshape(ref_t.shape), ref_t),
        "amax": torch.equal(te_amax, ref_amax),
        "scale_inv": torch.equal(scale_inv, torch.ones_like(scale) / scale),
    }
    check_ok = all(checks.values())
    del ref_q, ref_t

    # The cases: (implementation, variant, fn). TE writes into the preallocated buffers.
    def te(**kw):
        return lambda: quantize(x, scale, fp8_dtype, amax=amax, out=out, scale_inv=scale_inv, **kw)

    te_label = "TE native" if status.available else "TE reference"  # what the TE rows time
    variants = (("cast+amax", False), ("cast+amax+transpose", True))
    cases = [
        (te_label, "cast+amax", te()),
        (te_label, "cast+amax+transpose", te(out_transpose=out_t)),
    ]
    for variant, tr in variants:
        eager = make_eager(fp8_dtype, fp8_max, tr)
        cases.append(("PyTorch eager", variant, lambda f=eager: f(x, scale, amax)))
    compile_notes = []
    for variant, tr in () if args.no_compile else variants:
        try:  # compilation is lazy: call once here so that failures surface now
            compiled = torch.compile(make_eager(fp8_dtype, fp8_max, tr))
            compiled(x, scale, amax)
            torch.cuda.synchronize()
            cases.append(("torch.compile", variant, lambda f=compiled: f(x, scale, amax)))
        except Exception as err:  # noqa: BLE001 - any failure only skips this baseline
            reason = (str(err).strip().splitlines() or [""])[0]
            note = f"torch.compile ({variant}) skipped: {type(err).__name__}: {reason}"
            compile_notes.append(note)
            print(note)
    cases.append(("D2D copy", "copy", lambda: out_copy.copy_(x)))

    # Timing; bandwidth counts bytes read + bytes written.
    in_b = x.element_size()
    bytes_per_elem = {"cast+amax": in_b + 1, "cast+amax+transpose": in_b + 2, "copy": 2 * in_b}
    rows = []
    for impl, variant, fn in cases:
        us = time_us(fn, args.warmup, args.iters, args.batch)
        gbps = bytes_per_elem[variant] * numel / (us * 1e-6) / 1e9
        rows.append({"impl": impl, "variant": variant, "time_us": us, "gb_per_s": gbps})
    copy_gbps = next(r["gb_per_s"] for r in rows if r["variant"] == "copy")
    eager_us = {r["variant"]: r["time_us"] for r in rows if r["impl"] == "PyTorch eager"}
    for r in rows:
        r["vs_copy"] = r["gb_per_s"] / copy_gbps
        base = eager_us.get(r["variant"])
        r["speedup_vs_eager"] = base / r["time_us"] if base is not None else None

    # Report.
    gpu = torch.cuda.get_device_name(device)
    print(f"\nFP8 quantize benchmark on {gpu} ({device}), torch {torch.__version__}")
    print(
        f"shape {'x'.join(map(str, shape))} {args.dtype} -> {args.fp8}, amax accumulation, "
        f"scale on device; warmup {args.warmup}, {args.iters} timed calls in batches of "
        f"{args.batch}, median per call"
    )
    print(f"TE: {status}" + ("" if status.available else "  [TE rows time the REFERENCE path]"))
    detail = ", ".join(f"{k}={'ok' if v else 'DIFF'}" for k, v in checks.items())
    print(f"check TE vs eager (bitwise): {'PASS' if check_ok else 'FAIL'} ({detail})")
    print(
        f"\n{'implementation':<15} {'variant':<21} {'time (us)':>10} {'GB/s':>9} "
        f"{'% of copy':>10} {'vs eager':>9}"
    )
    for r in rows:
        sp = "-" if r["speedup_vs_eager"] is None else f"{r['speedup_vs_eager']:.2f}x"
        print(
            f"{r['impl']:<15} {r['variant']:<21} {r['time_us']:>10.1f} {r['gb_per_s']:>9.1f} "
            f"{100 * r['vs_copy']:>9.1f}% {sp:>9}"
        )
    print(f"\ntargets: {te_label} GB/s as a fraction of copy GB/s")
    verdicts = {}
    te_vs_copy = {r["variant"]: r["vs_copy"] for r in rows if r["impl"] == te_label}
    for variant, target in TARGETS.items():
        got = te_vs_copy[variant]
        verdicts[variant] = {"target": target, "achieved": got, "pass": got >= target}
        print(
            f"  {variant:<21} >= {100 * target:.0f}%: {100 * got:5.1f}%  "
            f"{'PASS' if got >= target else 'FAIL'}"
        )

    if args.json:
        result = {
            "device": gpu,
            "torch": torch.__version__,
            "te_native": str(status),
            "native_available": status.available,
            "shape": list(shape),
            "dtype": args.dtype,
            "fp8": args.fp8,
            "warmup": args.warmup,
            "iters": args.iters,
            "batch": args.batch,
            "correctness": {"pass": check_ok, **checks},
            "compile_notes": compile_notes,
            "results": rows,
            "targets": verdicts,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if check_ok else 1


if __name__ == "__main__":
    sys.exit(main())
