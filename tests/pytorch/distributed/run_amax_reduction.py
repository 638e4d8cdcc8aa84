"""Amax reduction across processes: every rank must end with identical delayed-scaling state.

Each rank owns two "modules" (delayed-scaling recipe states) on its device, feeds them
rank-dependent amaxes for several steps inside ``te.autocast`` with amax reduction, and saves
its final scales and histories. Run under torchrun (NCCL on GPUs, gloo on CPU):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_amax_reduction.py \
        --backend nccl --out /tmp/amax_out

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (used by the gloo test).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.quantization import (
    DelayedScalingRecipeState,
    FP8GlobalStateManager,
    autocast,
)

STEPS = 5


def rank_amax(rank: int, step: int, module: int, slot: int) -> float:
    """Rank-dependent amaxes, with some zero slots, so the MAX reduction matters."""
    if (step + slot) % 4 == 3:
        return 0.0
    return float(
        (rank + 1) * (module + 2) + step * 0.5 + slot * 0.25 + (7.0 if rank == step % 3 else 0)
    )


def expected_max(world_size: int, step: int, module: int, slot: int) -> float:
    return max(rank_amax(r, step, module, slot) for r in range(world_size))


def worker(rank: int, world_size: int, backend: str, out_dir: str, init_method: str = "env://"):
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)  # NCCL's process device; the library itself never asks
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        FP8GlobalStateManager.reset()
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, margin=1)
        metas = []
        for _ in range(2):
            state = DelayedScalingRecipeState(
                recipe, mode="forward", num_quantizers=3, device=device
            )
            metas.append({"recipe": recipe, "fp8_group": None, "scaling_fwd": state})
        for step in range(STEPS):
            with autocast(enabled=True, recipe=recipe):
                for m, meta in enumerate(metas):
                    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
                    values = [rank_amax(rank, step, m, i) for i in range(3)]
                    meta["scaling_fwd"].amax_history[0].copy_(torch.tensor(values))
        result = {
            f"module{m}": {
                "scale": meta["scaling_fwd"].scale.cpu(),
                "amax_history": meta["scaling_fwd"].amax_history.cpu(),
                "device": str(meta["scaling_fwd"].scale.device),
            }
            for m, meta in enumerate(metas)
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def expected_state(world_size: int):
    """The state a single process reaches when it sees each step's global maximum amaxes."""
    from transformer_engine.pytorch import reference

    histories = [torch.zeros(4, 3) for _ in range(2)]
    scales = [torch.ones(3) for _ in range(2)]
    for step in range(STEPS):
        for m in range(2):
            histories[m][0] = torch.tensor([expected_max(world_size, step, m, i) for i in range(3)])
        reference.delayed_scaling_update(histories, scales, torch.float8_e4m3fn, 1, "max")
    return histories, scales


def check_results(out_dir: str, world_size: int) -> None:
    """Every rank saved the same state, bitwise equal to :func:`expected_state`."""
    histories, scales = expected_state(world_size)
    for rank in range(world_size):
        result = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        for m in range(2):
            got = result[f"module{m}"]
            if not (
                torch.equal(got["scale"], scales[m])
                and torch.equal(got["amax_history"], histories[m])
            ):
                raise AssertionError(f"rank {rank} module {m}: {got} != expected {scales[m]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", type=int, metavar="WORLD_SIZE", help="only check saved results")
    args = parser.parse_args()
    if args.check:
        check_results(args.out, args.check)
        print(f"amax reduction: {args.check} ranks ended with identical, expected state")
        return 0
    os.makedirs(args.out, exist_ok=True)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    worker(rank, world_size, args.backend, args.out)
    print(f"rank {rank}: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
