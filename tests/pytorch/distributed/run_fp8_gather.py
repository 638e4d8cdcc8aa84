"""FP8 all-gather under sequence parallelism, over real processes.

Two oracles:

* ``gather_along_first_dim(x, group, quantizer=...)`` with a per-tensor FP8 quantizer against a
  high-precision ``all_gather`` followed by a cast of the whole gathered tensor with a fresh
  quantizer (delayed scaling: the same scale; current scaling: the scale of the whole tensor):
  the FP8 bytes, the transposed bytes and ``scale_inv`` must be identical, and what went over
  the wire must be ``uint8`` (one byte per value);
* the sequence-parallel models (a column -> row ``te.Linear`` pair, a ``te.LayerNormMLP``) run
  twice from the same parameters: once as built (FP8 gathers) and once with the FP8 gathers
  switched off (``_tensor_parallel.gathers_fp8`` patched to refuse every quantizer, so the input
  and the row layer's output gradient are gathered in high precision and cast afterwards, the
  path before the FP8 gathers existed).
  The math is the same, so the outputs, input gradients, parameter gradients and the recipe
  state (scales, amax histories) must be bitwise equal; and the gathers of the first run must
  have moved ``uint8`` bytes, those of the second the activation dtype.

Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_fp8_gather.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.tensor.float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
)

SEQ, BATCH, HIDDEN, FFN = 32, 2, 32, 64
STEPS = 2
MODEL_CASES = [
    (model, recipe, dtype)
    for model in ("pair", "mlp")
    for recipe in ("delayed", "current")
    for dtype in (torch.float32, torch.bfloat16)
]


@contextlib.contextmanager
def recorded_gathers():
    """Every all-gather of ``_tensor_parallel`` as ``(dtype, bytes sent by this rank)``."""
    original, log = tp._all_gather_dim0, []

    def recording(out, src, group=None, async_op=False):
        log.append((src.dtype, src.numel() * src.element_size()))
        return original(out, src, group=group, async_op=async_op)

    tp._all_gather_dim0 = recording
    try:
        yield log
    finally:
        tp._all_gather_dim0 = original


@contextlib.contextmanager
def high_precision_gather():
    """The gather before FP8 all-gathers: high precision, then the cast."""
    original = tp.gathers_fp8
    tp.gathers_fp8 = lambda quantizer: False
    try:
        yield
    finally:
        tp.gathers_fp8 = original


def make_quantizer(kind, device):
    if kind == "delayed":
        scale = torch.full((1,), 3.0, device=device)
        return Float8Quantizer(scale, torch.zeros(1, device=device), torch.float8_e4m3fn)
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn)


def check_direct_gather(group, device, failures) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for kind in ("delayed", "current"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(7)
            full = torch.randn(world * 8, 48, device=device).to(dtype)
            full[3, 5] = 9.0  # the whole tensor's amax lives on rank 0's rows only
            local = full.chunk(world)[rank].contiguous()
            q = make_quantizer(kind, device)
            q.set_usage(rowwise=True, columnwise=True)
            with recorded_gathers() as log:
                got, handle = tp.gather_along_first_dim(local, group, quantizer=q)
            oracle = make_quantizer(kind, device)
            oracle.set_usage(rowwise=True, columnwise=True)
            want = oracle.quantize(full)
            tag = f"direct {kind} {dtype}"
            if handle is not None:
                failures.append(f"{tag}: a synchronous gather returned a handle")
            if [d for d, _ in log] != [torch.uint8] or log[0][1] != local.numel():
                failures.append(f"{tag}: gathered {log}, expected one uint8 gather")
            for name in ("_data", "_transpose", "_scale_inv"):
                a, b = getattr(got, name), getattr(want, name)
                if a is None or b is None or not torch.equal(a.cpu(), b.cpu()):
                    failures.append(f"{tag}: {name} differs from the cast after a BF16 gather")
            if got.dtype != dtype or tuple(got.shape) != tuple(full.shape):
                failures.append(f"{tag}: result {got.dtype} {tuple(got.shape)}")
            if kind == "delayed" and float(q.amax) != float(local.abs().max().float()):
                failures.append(f"{tag}: the local amax was not recorded ({float(q.amax)})")
            if kind == "current" and q.with_amax_reduction:
                failures.append(f"{tag}: the quantizer's amax reduction was not restored")


def build(model, dtype, group, device):
    torch.manual_seed(1234)
    kw = dict(sequence_parallel=True, tp_group=group, params_dtype=dtype, device=device)
    if model == "pair":
        modules = [
            te.Linear(HIDDEN, FFN, parallel_mode="column", **kw),
            te.Linear(FFN, HIDDEN, parallel_mode="row", **kw),
        ]
    else:
        modules = [te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, **kw)]
    for m in modules:
        for p in m.parameters():
            with torch.no_grad():
                p.normal_(0, 0.1)
    return modules


def recipe_of(name):
    if name == "delayed":
        return DelayedScaling(amax_history_len=4, reduce_amax=True)
    return Float8CurrentScaling()


def run_steps(modules, recipe_name, dtype, group, device):
    """Outputs, input grads and parameter grads of STEPS steps, and the final recipe state."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    results = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
        g = torch.randn(SEQ, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
        x = x.contiguous().requires_grad_(True)
        for m in modules:
            m.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe_of(recipe_name), amax_reduction_group=group):
            out = x
            for m in modules:
                out = m(out)
        out.backward(g.contiguous())
        results.append(("out", out.detach()))
        results.append(("dx", x.grad))
        for i, m in enumerate(modules):
            results += [(f"{i}.{n}.grad", p.grad) for n, p in m.named_parameters()]
    for i, m in enumerate(modules):
        for key in ("scaling_fwd", "scaling_bwd"):
            meta = m.fp8_meta.get(key)
            if meta is not None and hasattr(meta, "scale"):
                results.append((f"{i}.{key}.scale", meta.scale))
                results.append((f"{i}.{key}.amax_history", meta.amax_history))
    return results


def check_model(model, recipe_name, dtype, group, device, failures) -> None:
    tag = f"{model} {recipe_name} {dtype}"
    fp8_modules = build(model, dtype, group, device)
    hp_modules = build(model, dtype, group, device)
    with recorded_gathers() as fp8_log:
        fp8 = run_steps(fp8_modules, recipe_name, dtype, group, device)
    with high_precision_gather(), recorded_gathers() as hp_log:
        hp = run_steps(hp_modules, recipe_name, dtype, group, device)
    # Per step: the forward gather of the column layer's input, its re-gather in backward for
    # the weight gradient (the saved FP8 shard) and the backward gather of the row layer's
    # output gradient: uint8 with the FP8 gathers, one byte per value; without them the two
    # gathers of before (the input, the gradient) in the activation dtype.
    values = SEQ * BATCH * HIDDEN // dist.get_world_size(group)
    hp_bytes = values * torch.tensor([], dtype=dtype).element_size()
    if fp8_log != [(torch.uint8, values)] * (3 * STEPS):
        failures.append(f"{tag}: FP8-gather run gathered {fp8_log}")
    if hp_log != [(dtype, hp_bytes)] * (2 * STEPS):
        failures.append(f"{tag}: high-precision run gathered {hp_log}")
    if [n for n, _ in fp8] != [n for n, _ in hp]:
        failures.append(f"{tag}: the runs produced different results lists")
        return
    for (name, a), (_, b) in zip(fp8, hp):
        if a is None or b is None:
            if a is not b:
                failures.append(f"{tag} {name}: one run has no value")
        elif not torch.equal(a.cpu(), b.cpu()):
            err = (a.double() - b.double()).abs().max().item()
            failures.append(f"{tag} {name}: not bitwise equal (max diff {err:.3e})")


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)  # NCCL's process device; the library never asks
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        failures: list[str] = []
        check_direct_gather(group, device, failures)
        for model, recipe_name, dtype in MODEL_CASES:
            check_model(model, recipe_name, dtype, group, device, failures)
        cases = 4 + len(MODEL_CASES)
        if out_dir is not None:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump({"failures": failures, "cases": cases}, f)
        print(f"FP8_GATHER_RESULT rank={rank} cases={cases} failures={len(failures)}")
        for line in failures[:20]:
            print(f"FP8_GATHER_FAILURE rank={rank} {line}")
        return failures
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    failed = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.backend, args.out)
    raise SystemExit(1 if failed else 0)
