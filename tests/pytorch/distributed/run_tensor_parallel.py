"""Tensor / sequence parallelism over real processes, held to the single-process model.

Every rank builds the same full model (a column -> row ``te.Linear`` pair, or a
``te.LayerNormMLP``, also with its ``activation_fn`` replaced) from one seed, then the
tensor-parallel model with ``tp_size`` ranks whose parameters are this rank's shards of the
full ones. Both run the same steps (float32,
DelayedScaling or Float8CurrentScaling), with and without sequence parallelism, and every
rank checks: the output, the input gradient, every weight / bias / norm gradient (shards
gathered, partial sums of ``sequence_parallel`` parameters all-reduced as a framework does) and,
under DelayedScaling, the forward and backward scales. Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_tensor_parallel.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).

Tolerances. float32: the tensor-parallel GEMMs add the same products in another order (a row
layer sums two partial products, then all-reduces), so results agree to a few float32 ulps of
the largest term: ``rtol=1e-5``, ``atol=1e-5 * max|reference|``. FP8: the weights are built so
that every shard holds the full tensor's largest magnitude, and split operands have their amax
reduced over the group, so every rank quantizes with the single-process scales; the only
differences are float32 summation order, which can move a value across an FP8 rounding
boundary (one E4M3 step, at most 2^-3 relative, on a single element). Hence: every element
within ``2^-3 * max|reference|`` and 98% of them within the float32 tolerance (on CUDA, whose
FP8 GEMMs accumulate with fewer bits, within ``2^-10 * max|reference|``:
``tp_harness.CUDA_FP8_REL_TO_MAX``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tp_harness import (
    case_checks,
    compare,
    compare_step,
    gather,
    main,
    make_recipe,
    run_worker,
    shard,
    spread_maxima,
    summed,
)

import transformer_engine.pytorch as te

SEQ, BATCH, HIDDEN, FFN = 32, 2, 32, 64
STEPS = 3
CASES = [
    (model, sp, recipe)
    for model in ("pair", "mlp", "mlp-act")
    for sp in (False, True)
    for recipe in (None, "delayed", "current")
]


def _tanh_gelu(x):
    """A replaced ``activation_fn`` (``"mlp-act"``): FC1 then runs as a node of its own."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def build_full(model, device, **pair_options):
    """The single-process model; ``pair_options``: more ``te.Linear`` arguments for both of
    the pair's layers (run_tensor_parallel_options.py)."""
    torch.manual_seed(1234)
    if model == "pair":
        modules = [te.Linear(HIDDEN, FFN, device=device, **pair_options),
                   te.Linear(FFN, HIDDEN, device=device, **pair_options)]  # fmt: skip
    else:
        modules = [te.LayerNormMLP(HIDDEN, FFN, device=device)]
        if model == "mlp-act":
            modules[0].activation_fn = _tanh_gelu
    for m in modules:
        for p in m.parameters():
            with torch.no_grad():
                p.normal_(0, 0.1)
            spread_maxima(p)
    return modules


def build_parallel(model, full, sp, group, device, **pair_options):
    """The tensor-parallel model holding this rank's shards of ``full``'s parameters."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if model == "pair":
        col = te.Linear(HIDDEN, FFN, parallel_mode="column", sequence_parallel=sp,
                        tp_group=group, device=device, **pair_options)  # fmt: skip
        row = te.Linear(FFN, HIDDEN, parallel_mode="row", sequence_parallel=sp,
                        tp_group=group, device=device, **pair_options)  # fmt: skip
        with torch.no_grad():
            col.weight.copy_(shard(full[0].weight, 0, rank, world))
            col.bias.copy_(shard(full[0].bias, 0, rank, world))
            row.weight.copy_(shard(full[1].weight, 1, rank, world))
            row.bias.copy_(full[1].bias)
        return [col, row]
    mlp = te.LayerNormMLP(HIDDEN, FFN, sequence_parallel=sp, set_parallel_mode=True,
                          tp_group=group, tp_size=world, device=device)  # fmt: skip
    if model == "mlp-act":
        mlp.activation_fn = _tanh_gelu
    ref = full[0]
    with torch.no_grad():
        mlp.layer_norm_weight.copy_(ref.layer_norm_weight)
        mlp.layer_norm_bias.copy_(ref.layer_norm_bias)
        mlp.fc1_weight.copy_(shard(ref.fc1_weight, 0, rank, world))
        mlp.fc1_bias.copy_(shard(ref.fc1_bias, 0, rank, world))
        mlp.fc2_weight.copy_(shard(ref.fc2_weight, 1, rank, world))
        mlp.fc2_bias.copy_(ref.fc2_bias)
    return [mlp]


def run(modules, x, grad, recipe):
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = x
        for m in modules:
            out = m(out)
    out.backward(grad)
    return out.detach(), x.grad


def parallel_grads(model, par, sp, group):
    """The tensor-parallel gradients as whole tensors, named as in the full model."""
    if model == "pair":
        col, row = par
        return {
            "0.weight": gather(col.weight.grad, 0, group),
            "0.bias": gather(col.bias.grad, 0, group),
            "1.weight": gather(row.weight.grad, 1, group),
            "1.bias": summed(row.bias.grad, group) if sp else row.bias.grad,
        }
    (m,) = par
    maybe_sum = (lambda t: summed(t, group)) if sp else (lambda t: t)
    return {
        "0.layer_norm_weight": maybe_sum(m.layer_norm_weight.grad),
        "0.layer_norm_bias": maybe_sum(m.layer_norm_bias.grad),
        "0.fc1_weight": gather(m.fc1_weight.grad, 0, group),
        "0.fc1_bias": gather(m.fc1_bias.grad, 0, group),
        "0.fc2_weight": gather(m.fc2_weight.grad, 1, group),
        "0.fc2_bias": maybe_sum(m.fc2_bias.grad),
    }


def check_case(model, sp, recipe_name, group, device) -> list[str]:
    full = build_full(model, device)
    par = build_parallel(model, full, sp, group, device)
    fp8 = recipe_name is not None
    failures: list[str] = []
    label = f"{model} sp={sp} recipe={recipe_name}"
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        for m in full + par:
            m.zero_grad(set_to_none=True)
        tag = f"{label} step {step}"
        compare_step(
            tag, lambda x, g: run(full, x, g, make_recipe(recipe_name)),
            lambda x, g: run(par, x, g, make_recipe(recipe_name)), x, grad, sp, group, fp8,
            failures,
        )  # fmt: skip
        ref_grads = {n: p.grad for n, p in torch.nn.ModuleList(full).named_parameters()}
        for name, g in parallel_grads(model, par, sp, group).items():
            compare(f"{tag} {name} grad", g, ref_grads[name], fp8, failures)
        if recipe_name == "delayed":
            for i, (p, f) in enumerate(zip(par, full)):
                for key in ("scaling_fwd", "scaling_bwd"):
                    got, want = p.fp8_meta[key].scale, f.fp8_meta[key].scale
                    if not torch.allclose(got, want, rtol=0, atol=0):
                        failures.append(f"{tag} module {i} {key} scales {got} != {want}")
    return failures


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "TP", checks)


if __name__ == "__main__":
    main(worker)
