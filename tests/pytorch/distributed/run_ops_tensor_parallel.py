"""Tensor / sequence parallelism of the fusible operations (``te.ops.BasicLinear``, ``Bias``,
``te.ops.Linear``) over real processes, held to the single-process operations.

Every rank builds the same full ``te.ops.Sequential`` from one seed, then the tensor-parallel
one whose parameters are this rank's shards: a column-parallel linear, an activation, a
row-parallel linear (``"pair"``: ``te.ops.Linear`` with biases and GELU; ``"basic"``: two
``BasicLinear`` with nothing between; ``"norm"``: a LayerNorm first; ``"residual"``: the pair
inside a residual connection, ``"scaled"``: the same without biases, the row output scaled
before the residual add), with and without sequence parallelism, in float32,
DelayedScaling or Float8CurrentScaling. Each rank checks the output, the input gradient, every
weight and bias gradient (shards gathered; the row bias's gradient is whole on every rank, the
operation summing it over the group under sequence parallelism) and, under DelayedScaling,
every linear's scales. Then the construction errors and attributes. Run under torchrun (NCCL
on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_ops_tensor_parallel.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
Tolerances: those of ``run_tensor_parallel.py`` (``tp_harness.compare``): the weights put the
whole tensor's largest magnitude in every shard and split operands have their amax reduced, so
every rank casts with the single-process scales; only float32 summation order differs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tp_harness import (
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
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

SEQ, BATCH, HIDDEN, FFN = 32, 2, 32, 64
STEPS = 3
CASES = [
    (model, sp, recipe)
    for model in ("pair", "basic", "norm")
    for sp in (False, True)
    for recipe in (None, "delayed", "current")
]
# residual branches around the pair: the add and scale fusions with tensor-parallel linears
CASES += [
    (model, sp, recipe)
    for model in ("residual", "scaled")
    for sp in (False, True)
    for recipe in (None, "delayed", "current")
]
# FP8 weights (te.quantized_model_init): each rank quantizes its own shard
CASES += [("pair-fp8-weights", False, "delayed"), ("pair-fp8-weights", True, "current")]


def build(model, device, group=None, sp=False, recipe=None):
    """The model; with ``group``, its tensor-parallel version (column, then row); FP8 weights
    quantized for ``recipe`` for the ``-fp8-weights`` models."""
    fp8_weights = model.endswith("-fp8-weights")
    with te.quantized_model_init(enabled=fp8_weights, recipe=recipe):
        return _build(model.removesuffix("-fp8-weights"), device, group, sp)


class _Residual(torch.nn.Module):
    """``second(first(x))`` where ``first`` hands its input on as an extra output (in place)
    and ``second`` adds it to its output (in place): a residual connection around the pair."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        y, skip = self.first(x)
        return self.second(y, skip)


def _build(model, device, group, sp):
    # the norm model leaves the group at its default, the world group (all ranks here)
    tp_group = None if model == "norm" else group
    col = (
        {} if group is None else dict(tensor_parallel_mode="column", tensor_parallel_group=tp_group)
    )
    row = {} if group is None else dict(tensor_parallel_mode="row", tensor_parallel_group=tp_group)
    if group is not None:
        col["sequence_parallel"] = row["sequence_parallel"] = sp
    if model == "scaled":  # no biases: the row linear is followed by the scale
        return _Residual(
            ops.Sequential(
                ops.MakeExtraOutput(in_place=True), ops.BasicLinear(HIDDEN, FFN, device=device, **col)
            ),
            ops.Sequential(
                ops.GELU(), ops.BasicLinear(FFN, HIDDEN, device=device, **row),
                ops.ConstantScale(0.5), ops.AddExtraInput(in_place=True),
            ),
        )  # fmt: skip
    if model == "residual":
        return _Residual(
            ops.Sequential(
                ops.MakeExtraOutput(in_place=True), ops.Linear(HIDDEN, FFN, device=device, **col)
            ),
            ops.Sequential(
                ops.GELU(), ops.Linear(FFN, HIDDEN, device=device, **row),
                ops.AddExtraInput(in_place=True),
            ),
        )  # fmt: skip
    if model == "basic":
        return ops.Sequential(
            ops.BasicLinear(HIDDEN, FFN, device=device, **col),
            ops.BasicLinear(FFN, HIDDEN, device=device, **row),
        )
    pair = [
        ops.Linear(HIDDEN, FFN, device=device, **col),
        ops.GELU(),
        ops.Linear(FFN, HIDDEN, device=device, **row),
    ]
    if model == "norm":  # the norm runs on this rank's tokens under sequence parallelism
        return ops.Sequential(ops.LayerNorm(HIDDEN, device=device), *pair)
    return ops.Sequential(*pair)


def roles(model):
    """How each operation's parameters are split: ``{name prefix: "column" | "row" |
    "whole"}``."""
    if model.startswith("basic"):
        return {"0": "column", "1": "row"}
    if model.startswith("norm"):
        return {"0": "whole", "1": "column", "3": "row"}
    if model in ("residual", "scaled"):
        return {"first.1": "column", "second.1": "row"}
    return {"0": "column", "2": "row"}


def role_of(model, name):
    """``"column"``, ``"row"``, ``"row bias"`` (whole, after the reduction) or ``"whole"``."""
    (role,) = [r for prefix, r in roles(model).items() if name.startswith(prefix + ".")]
    return "row bias" if role == "row" and name.endswith("bias") else role


# The fused operations each FP8 model's passes hold under tensor parallelism: the ones whose
# collectives stay in place (docs/ops.md); under sequence parallelism the norm's FP8 output is
# all-gathered as it is.
def expected_fusions(model, sp):
    if model.startswith("basic"):
        return set(), set()
    if model == "scaled":  # the add and scale fusions take a linear of any placement
        return {"ForwardActivationCast", "ForwardLinearScaleAdd"}, {
            "BackwardLinearAdd",
            "BackwardLinearScale",
        }
    if model == "residual":  # (the row bias has its gradient summed: no BackwardLinearBias)
        forward = {"ForwardLinearBiasActivation", "ForwardActivationCast", "ForwardLinearBiasAdd"}
        return forward, {"BackwardLinearAdd"}
    forward = {"ForwardLinearBiasActivation", "ForwardActivationCast"}
    if model == "norm":
        forward.add("ForwardNormCast")
    return forward, {"BackwardActivationCast"}


def linears(model):
    return [op for op in model.modules() if isinstance(op, ops.BasicLinear)]


def load_shards(model, full, par, rank, world):
    """``par``'s parameters: this rank's shards of ``full``'s (column linear's weight rows and
    bias, row linear's weight columns; the row bias and the norm whole)."""
    with torch.no_grad():
        for (name, p), (_, q) in zip(full.named_parameters(), par.named_parameters()):
            role = role_of(model, name)
            if role == "column":
                q.copy_(shard(p, 0, rank, world))  # output features
            elif role == "row":
                q.copy_(shard(p, 1, rank, world))  # input features
            else:
                q.copy_(p)


def run(model, x, grad, recipe):
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x)
    # a copy: an in-place residual's backward may add into the gradient it is given
    out.backward(grad.clone())
    return out.detach(), x.grad


def parallel_grads(model, par, sp, group):
    """The tensor-parallel gradients as whole tensors, named as the full model's: shards
    gathered; the row bias is whole on every rank (the operation sums it over the group under
    sequence parallelism); the norm's, a partial sum over this rank's tokens under sequence
    parallelism, summed as a framework does."""
    grads = {}
    for name, p in par.named_parameters():
        role = role_of(model, name)
        if role == "column":
            grads[name] = gather(p.grad, 0, group)
        elif role == "row":
            grads[name] = gather(p.grad, 1, group)
        elif role == "whole" and sp:
            grads[name] = summed(p.grad, group)
        else:
            grads[name] = p.grad
    return grads


def fused_names(model, which):
    """The fused operations (class names) of the ``which`` pass of ``model``'s
    ``Sequential`` (or of both of a residual model's)."""
    names = set()
    for seq in model.modules():
        if isinstance(seq, ops.Sequential):
            (fuser,) = seq._get_module_groups()
            names |= {type(op).__name__ for op, _ in getattr(fuser, f"_{which}_ops")} - {
                type(op).__name__ for op in fuser._basic_ops
            }
    return names


def check_case(model, sp, recipe_name, group, device) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1234)
    values = build(model.removesuffix("-fp8-weights"), device)  # high-precision parameters
    for p in values.parameters():
        with torch.no_grad():
            p.normal_(0, 0.1)
        spread_maxima(p)
    full = build(model, device, recipe=make_recipe(recipe_name))
    with torch.no_grad():
        for p, v in zip(full.parameters(), values.parameters()):
            p.copy_(v)  # an FP8 weight quantizes the values
    par = build(model, device, group, sp, make_recipe(recipe_name))
    load_shards(model, values, par, rank, world)
    fp8_weights = [isinstance(op.weight, QuantizedTensor) for op in linears(full) + linears(par)]
    if fp8_weights != [model.endswith("-fp8-weights")] * len(fp8_weights):
        return [f"{model}: FP8 weights {fp8_weights}"]
    fp8 = recipe_name is not None
    failures: list[str] = []
    label = f"ops {model} sp={sp} recipe={recipe_name}"
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        full.zero_grad(set_to_none=True)
        par.zero_grad(set_to_none=True)
        tag = f"{label} step {step}"
        compare_step(
            tag, lambda x, g: run(full, x, g, make_recipe(recipe_name)),
            lambda x, g: run(par, x, g, make_recipe(recipe_name)), x, grad, sp, group, fp8,
            failures,
        )  # fmt: skip
        ref_grads = {n: p.grad for n, p in full.named_parameters()}
        for name, g in parallel_grads(model, par, sp, group).items():
            compare(f"{tag} {name} grad", g, ref_grads[name], fp8, failures)
        if fp8 and step == 0:
            got = (fused_names(par, "forward"), fused_names(par, "backward"))
            if got != expected_fusions(model, sp):
                failures.append(f"{tag} fusions {got} != {expected_fusions(model, sp)}")
        if recipe_name == "delayed":
            for i, (p, f) in enumerate(zip(linears(par), linears(full))):
                for mode in ("forward", "backward"):
                    got, want = p.recipe_state(mode).scale, f.recipe_state(mode).scale
                    if not torch.equal(got, want):
                        failures.append(f"{tag} linear {i} {mode} scales {got} != {want}")
    return failures


def _expect(failures, kind, text, fn) -> None:
    try:
        fn()
    except kind as exc:
        if text not in str(exc):
            failures.append(f"{kind.__name__} without {text!r}: {exc}")
        return
    failures.append(f"no {kind.__name__} ({text!r})")


def check_construction(group, device) -> list[str]:
    """Local sizes, attributes, and the errors that name the fix."""
    failures: list[str] = []
    world = dist.get_world_size(group)
    col = ops.Linear(HIDDEN, FFN, tensor_parallel_mode="column", tensor_parallel_group=group,
                     sequence_parallel=True, device=device)  # fmt: skip
    row = ops.Linear(FFN, HIDDEN, tensor_parallel_mode="row", tensor_parallel_group=group,
                     sequence_parallel=True, device=device)  # fmt: skip
    basic = col.basic_ops[0]
    want = {
        "column weight": (tuple(col.weight.shape), (FFN // world, HIDDEN)),
        "column bias": (tuple(col.bias.shape), (FFN // world,)),
        "row weight": (tuple(row.weight.shape), (HIDDEN, FFN // world)),
        "row bias": (tuple(row.bias.shape), (HIDDEN,)),
        "local sizes": (
            (
                basic.in_features,
                basic.out_features,
                basic.local_in_features,
                basic.local_out_features,
            ),
            (HIDDEN, FFN, HIDDEN, FFN // world),
        ),  # fmt: skip
        "partition dims": ((col.weight.partition_dim, row.weight.partition_dim), (0, 1)),
        # its gradient is summed over the group by the operation: nothing left to the framework
        "row bias sequence_parallel": (getattr(row.bias, "sequence_parallel", None), None),
        "sequence_parallel": ((basic.sequence_parallel, basic.tensor_parallel_size), (True, world)),
    }
    for name, (got, expected) in want.items():
        if got != expected:
            failures.append(f"{name}: {got} != {expected}")
    _expect(failures, ValueError, "not divisible by tp_size", lambda: ops.BasicLinear(
        HIDDEN, FFN + 1, tensor_parallel_mode="column", tensor_parallel_group=group,
        device=device))  # fmt: skip
    _expect(failures, ValueError, "Bias: size", lambda: ops.Bias(
        FFN + 1, tensor_parallel=True, tensor_parallel_group=group, device=device))  # fmt: skip
    wrong = torch.randn(4, FFN, device=device)  # the row linear takes FFN / world features
    _expect(failures, ValueError, f"in_features={FFN // world}", lambda: row(wrong))
    # under DelayedScaling, sequence parallelism needs the amaxes reduced over the group
    x = torch.randn(SEQ // world, BATCH, HIDDEN, device=device)
    no_reduce = DelayedScaling(reduce_amax=False)

    def delayed_without_reduction():
        with te.autocast(recipe=no_reduce):
            col(x)

    _expect(failures, RuntimeError, "reduce_amax=True", delayed_without_reduction)
    return failures


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    def checks(group, device):
        failures = check_construction(group, device)
        for model, sp, recipe_name in CASES:
            failures += check_case(model, sp, recipe_name, group, device)
        return failures, len(CASES) + 1

    return run_worker(rank, world_size, backend, out_dir, init_method, "OPS_TP", checks)


if __name__ == "__main__":
    main(worker)
