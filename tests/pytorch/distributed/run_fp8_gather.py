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

import torch
import torch.distributed as dist

# The sequence-parallel models and their steps are run_fp8_grad_gather's (the same sizes, seeds
# and inputs; its model list is a superset of this file's "pair" and "mlp").
from run_fp8_grad_gather import BATCH, HIDDEN, SEQ, STEPS, build, run_steps
from tp_harness import compare_bitwise, high_precision_gathers, main, recorded_gathers, run_worker
from tp_harness import make_quantizer as harness_quantizer

from transformer_engine.pytorch import _tensor_parallel as tp

MODEL_CASES = [
    (model, recipe, dtype)
    for model in ("pair", "mlp")
    for recipe in ("delayed", "current")
    for dtype in (torch.float32, torch.bfloat16)
]


def make_quantizer(kind, device):
    return harness_quantizer(kind, device, torch.float8_e4m3fn)


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


def check_model(model, recipe_name, dtype, group, device, failures) -> None:
    tag = f"{model} {recipe_name} {dtype}"
    fp8_modules = build(model, dtype, group, device)
    hp_modules = build(model, dtype, group, device)
    with recorded_gathers() as fp8_log:
        fp8 = run_steps(model, fp8_modules, recipe_name, dtype, group, device)
    with high_precision_gathers(), recorded_gathers() as hp_log:
        hp = run_steps(model, hp_modules, recipe_name, dtype, group, device)
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
    compare_bitwise(tag, fp8, hp, failures)


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    def checks(group, device):
        failures: list[str] = []
        check_direct_gather(group, device, failures)
        for model, recipe_name, dtype in MODEL_CASES:
            check_model(model, recipe_name, dtype, group, device, failures)
        return failures, 4 + len(MODEL_CASES)

    return run_worker(rank, world_size, backend, out_dir, init_method, "FP8_GATHER", checks)


if __name__ == "__main__":
    main(worker)
