"""Tensor-parallel ``te.GroupedLinear`` over real processes, held to the single-process model.

Every rank builds the same full expert MLP (``GroupedLinear(G, H, F)`` -> GELU ->
``GroupedLinear(G, F, H)``, no bias, as upstream allows under TP) from one seed, then the
tensor-parallel one: FC1 ``parallel_mode="column"`` (each rank keeps ``F / tp`` rows of every
weight), FC2 ``"row"`` (``F / tp`` columns), with this rank's shards of the full weights.
GroupedLinear runs no collective on the activations (as upstream: the token dispatcher does),
so the test wires them as a caller does with ``te.distributed``'s regions: without sequence
parallelism the input enters through ``copy_to_tensor_parallel_region`` and FC2's partial sums
are all-reduced; with it the token shards are all-gathered before FC1 and FC2's output is
reduce-scattered. Checked on every rank: the output, the input gradient, every weight gradient
(shards gathered) and, under DelayedScaling, the forward and backward scales; in float32,
bfloat16 and under DelayedScaling / Float8CurrentScaling.

Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_grouped_linear_tp.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).

Tolerances: float32 and FP8 as in run_tensor_parallel.py (the weights hold their largest
magnitude in every shard, split operands have their amax reduced, so every rank casts with the
single-process scales). bfloat16: a row-parallel layer rounds each rank's partial sum to
bfloat16 before the reduction, so results agree to a few bfloat16 steps of the largest term:
every element within ``2^-5 * max|reference|``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tp_harness import case_checks, compare, gather, main, make_recipe, run_worker, spread_maxima

import transformer_engine.pytorch as te
from transformer_engine.pytorch import _tensor_parallel as tp

GROUPS, TOKENS, HIDDEN, FFN = 3, 64, 32, 64
SPLITS = [16, 32, 16]
STEPS = 2
CASES = [
    (sp, precision) for sp in (False, True) for precision in ("fp32", "bf16", "delayed", "current")
]


def build_full(dtype, device):
    torch.manual_seed(4321)
    fc1 = te.GroupedLinear(GROUPS, HIDDEN, FFN, bias=False, params_dtype=dtype, device=device)
    fc2 = te.GroupedLinear(GROUPS, FFN, HIDDEN, bias=False, params_dtype=dtype, device=device)
    for p in list(fc1.parameters()) + list(fc2.parameters()):
        with torch.no_grad():
            p.normal_(0, 0.1)
        spread_maxima(p)
    return fc1, fc2


def build_parallel(full, sp, dtype, group, device):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kw = dict(bias=False, sequence_parallel=sp, tp_group=group, params_dtype=dtype, device=device)
    fc1 = te.GroupedLinear(GROUPS, HIDDEN, FFN, parallel_mode="column", **kw)
    fc2 = te.GroupedLinear(GROUPS, FFN, HIDDEN, parallel_mode="row", **kw)
    with torch.no_grad():
        for i in range(GROUPS):
            getattr(fc1, f"weight{i}").copy_(getattr(full[0], f"weight{i}").chunk(world, 0)[rank])
            getattr(fc2, f"weight{i}").copy_(getattr(full[1], f"weight{i}").chunk(world, 1)[rank])
    return fc1, fc2


def forward(fc1, fc2, x, parallel, sp, group):
    if parallel:
        x = (
            tp.gather_from_sequence_parallel_region(x, group)
            if sp
            else tp.copy_to_tensor_parallel_region(x, group)
        )
    out = fc2(torch.nn.functional.gelu(fc1(x, SPLITS)), SPLITS)
    if parallel:
        out = (
            tp.reduce_scatter_to_sequence_parallel_region(out, group)
            if sp
            else tp.reduce_from_tensor_parallel_region(out, group)
        )
    return out


def check_case(sp, precision, group, device) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    recipe_name = precision if precision in ("delayed", "current") else None
    full = build_full(dtype, device)
    par = build_parallel(full, sp, dtype, group, device)
    failures: list[str] = []
    label = f"GroupedLinear sp={sp} {precision}"
    checks = "fp8" if recipe_name else precision
    for step in range(STEPS):
        torch.manual_seed(200 + step)
        x = torch.randn(TOKENS, HIDDEN, device=device).to(dtype)
        grad = torch.randn(TOKENS, HIDDEN, device=device).to(dtype)
        outs = []
        for modules, parallel in ((full, False), (par, True)):
            for m in modules:
                m.zero_grad(set_to_none=True)
            x_in = (x.chunk(world)[rank] if sp and parallel else x).clone().requires_grad_(True)
            g_in = grad.chunk(world)[rank] if sp and parallel else grad
            with te.autocast(enabled=recipe_name is not None, recipe=make_recipe(recipe_name)):
                out = forward(*modules, x_in, parallel, sp, group)
            out.backward(g_in.contiguous())
            out, dx = out.detach(), x_in.grad
            if sp and parallel:
                out, dx = gather(out, 0, group), gather(dx, 0, group)
            outs.append((out, dx))
        (ref_out, ref_dx), (out, dx) = outs
        tag = f"{label} step {step}"
        check(f"{tag} output", out, ref_out, checks, failures)
        check(f"{tag} input grad", dx, ref_dx, checks, failures)
        for i in range(GROUPS):
            for layer, dim in ((0, 0), (1, 1)):
                got = gather(getattr(par[layer], f"weight{i}").grad, dim, group)
                want = getattr(full[layer], f"weight{i}").grad
                check(f"{tag} fc{layer + 1}.weight{i} grad", got, want, checks, failures)
        if recipe_name == "delayed":
            for layer in range(2):
                for key in ("scaling_fwd", "scaling_bwd"):
                    got, want = par[layer].fp8_meta[key].scale, full[layer].fp8_meta[key].scale
                    if not torch.equal(got, want):
                        failures.append(f"{tag} fc{layer + 1} {key} scales {got} != {want}")
    return failures


def check(name, got, ref, checks, failures) -> None:
    if checks != "bf16":
        compare(name, got, ref, checks == "fp8", failures)
        return
    got, ref = got.double().cpu(), ref.double().cpu()
    scale = ref.abs().max().item() or 1.0
    err = (got - ref).abs().max().item()
    if got.shape != ref.shape or err > 2**-5 * scale:
        failures.append(f"{name}: max err {err:.3e} (scale {scale:.3e})")


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "GROUPED_TP", checks)


if __name__ == "__main__":
    main(worker)
