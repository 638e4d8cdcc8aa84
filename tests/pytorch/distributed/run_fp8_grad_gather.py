"""FP8 gathers in backward under sequence parallelism, over real processes: a row-parallel
layer's output gradient gathered as FP8 bytes, and a column-parallel layer's input kept as its
local FP8 shard and gathered again for the weight gradient.

Oracles:

* single process: ``sequence_parallel_grad_output`` (the gradient cast here, its bytes
  gathered) and ``regather_fp8_shard`` (the saved shard gathered again) against a fresh
  quantizer casting the whole tensor in one process (delayed scaling: the same scale; current
  scaling: the scale of the whole tensor): the FP8 bytes, the transposed bytes and
  ``scale_inv`` identical, ``uint8`` on the wire;
* the path before these gathers: every model runs twice from the same parameters, once as
  built and once with ``_tensor_parallel.gathers_fp8`` patched to refuse every quantizer (the
  input and the output gradient gathered in high precision and cast afterwards, the gathered
  input's transposed FP8 copy saved for the weight gradient). The math is the same, so the
  outputs, input gradients, parameter gradients (the row layer's bias gradient included) and
  the recipe state (scales, amax histories) must be bitwise equal; the first run's gathers
  must all be ``uint8``;
* memory: the bytes a column-parallel layer saves for backward (``saved_tensors_hooks``): the
  local FP8 shard, ``1 / world`` of the gathered transposed copy saved before.

Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_fp8_grad_gather.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tp_harness import (
    compare_bitwise,
    high_precision_gathers,
    main,
    make_recipe,
    recipe_state,
    recorded_gathers,
    run_worker,
)
from tp_harness import make_quantizer as harness_quantizer

import transformer_engine.pytorch as te
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.functional.linear import LinearConfig

SEQ, BATCH, HIDDEN, FFN = 32, 2, 32, 64
STEPS = 2
MODELS = ("row", "pair", "lnl_pair", "mlp", "mlp_checkpoint")
MODEL_CASES = [(m, r, torch.bfloat16) for m in MODELS for r in ("delayed", "current")] + [
    ("pair", r, torch.float32) for r in ("delayed", "current")
]
DIRECT_CASES = 2 * 2 * 3 + 2 * 2  # grad gathers (kind, dtype, usages) + shard re-gathers


def make_quantizer(kind, device):
    return harness_quantizer(kind, device, torch.float8_e5m2)


def full_and_local(group, device, dtype, features=48):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(7)
    full = torch.randn(world * 4, 2, features, device=device).to(dtype)
    full[1, 1, 5] = -9.0  # the whole tensor's amax lives on rank 0's rows only
    return full, full.chunk(world)[rank].contiguous()


def same(a, b) -> bool:
    return a is not None and b is not None and torch.equal(a.cpu(), b.cpu())


def check_grad_gather(group, device, failures) -> None:
    for kind in ("delayed", "current"):
        for dtype in (torch.float32, torch.bfloat16):
            for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                full, local = full_and_local(group, device, dtype)
                q = make_quantizer(kind, device)
                q.set_usage(rowwise=False, columnwise=True)
                config = LinearConfig(fp8=True, grad_output_quantizer=q)
                with recorded_gathers() as log:
                    got = tp.sequence_parallel_grad_output(
                        local, group, config, rowwise=rowwise, columnwise=columnwise
                    )
                oracle = make_quantizer(kind, device)
                oracle.set_usage(rowwise=True, columnwise=True)
                want = oracle.quantize(full.reshape(-1, full.shape[-1]))
                tag = f"grad gather {kind} {dtype} rowwise={rowwise} columnwise={columnwise}"
                if log != [(torch.uint8, local.numel())]:
                    failures.append(f"{tag}: gathered {log}, expected one uint8 gather")
                if rowwise and not same(got._data, want._data):
                    failures.append(f"{tag}: bytes differ from the single-process cast")
                if columnwise and got._transpose is not None:
                    if not same(got._transpose, want._transpose):
                        failures.append(f"{tag}: transposed bytes differ")
                if not rowwise and got._transpose is not None and got._data is not None:
                    failures.append(f"{tag}: row-wise bytes kept though not asked for")
                if not same(got._scale_inv, want._scale_inv):
                    failures.append(f"{tag}: scale_inv differs")
                if (q.rowwise_usage, q.columnwise_usage, q.internal) != (False, True, False):
                    failures.append(f"{tag}: the quantizer's usages were not restored")
                if kind == "current" and q.with_amax_reduction:
                    failures.append(f"{tag}: the quantizer's amax reduction was not restored")


def check_regather(group, device, failures) -> None:
    rank = dist.get_rank(group)
    for kind in ("delayed", "current"):
        for dtype in (torch.float32, torch.bfloat16):
            full, local = full_and_local(group, device, dtype)
            config = LinearConfig(fp8=True, input_quantizer=make_quantizer(kind, device))
            with recorded_gathers() as log:
                gathered, leading, shard = tp.sequence_parallel_gemm_input(local, group, config)
                again = tp.regather_fp8_shard(shard, group)
            oracle = make_quantizer(kind, device)
            oracle.set_usage(rowwise=True, columnwise=True)
            want = oracle.quantize(full.reshape(-1, full.shape[-1]))
            tag = f"shard re-gather {kind} {dtype}"
            if log != [(torch.uint8, local.numel())] * 2:
                failures.append(f"{tag}: gathered {log}, expected two uint8 gathers")
            if tuple(leading) != tuple(full.shape[:-1]):
                failures.append(f"{tag}: leading shape {leading}")
            if not same(gathered._data, want._data) or gathered._transpose is not None:
                failures.append(f"{tag}: the forward's gathered input is not the row-wise cast")
            if not same(shard._data, want._data.chunk(dist.get_world_size(group))[rank]):
                failures.append(f"{tag}: the shard is not this rank's rows of the cast")
            transposed = again._transpose if again._transpose is not None else again._data
            expected = want._transpose if again._transpose is not None else want._data
            if not same(transposed, expected):
                failures.append(f"{tag}: the re-gathered copy differs from the whole cast")
            if again._transpose is not None and again._data is not None:
                failures.append(f"{tag}: the re-gather kept row-wise bytes")
            if not same(again._scale_inv, want._scale_inv):
                failures.append(f"{tag}: scale_inv differs")


def build(model, dtype, group, device):
    torch.manual_seed(1234)
    kw = dict(sequence_parallel=True, tp_group=group, params_dtype=dtype, device=device)
    if model == "row":
        modules = [te.Linear(FFN, HIDDEN, parallel_mode="row", **kw)]
    elif model == "pair":
        modules = [
            te.Linear(HIDDEN, FFN, parallel_mode="column", **kw),
            te.Linear(FFN, HIDDEN, parallel_mode="row", **kw),
        ]
    elif model == "lnl_pair":
        modules = [
            te.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", **kw),
            te.Linear(FFN, HIDDEN, parallel_mode="row", **kw),
        ]
    else:
        checkpoint = model == "mlp_checkpoint"
        modules = [
            te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, checkpoint=checkpoint, **kw)
        ]
    for m in modules:
        for p in m.parameters():
            with torch.no_grad():
                p.normal_(0, 0.1)
    return modules


def model_input(model, dtype, group, device, step):
    """``(x, grad)``: the row layer alone takes the whole sequence with its share of the
    features; the others this rank's share of the sequence."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(100 + step)
    if model == "row":
        x = torch.randn(SEQ, BATCH, FFN, device=device).to(dtype).chunk(world, dim=-1)[rank]
    else:
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
    g = torch.randn(SEQ, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
    return x.contiguous().requires_grad_(True), g.contiguous()


def run_steps(model, modules, recipe_name, dtype, group, device):
    """Outputs, input grads and parameter grads of STEPS steps, and the final recipe state."""
    results = []
    for step in range(STEPS):
        x, g = model_input(model, dtype, group, device, step)
        for m in modules:
            m.zero_grad(set_to_none=True)
        with te.autocast(recipe=make_recipe(recipe_name), amax_reduction_group=group):
            out = x
            for m in modules:
                out = m(out)
        out.backward(g)
        results += [("out", out.detach()), ("dx", x.grad)]
        for i, m in enumerate(modules):
            results += [(f"{i}.{n}.grad", p.grad) for n, p in m.named_parameters()]
    return results + recipe_state(modules)


def expected_gathers(model, dtype, world):
    """Per step, ``(FP8 run, high-precision run)`` gathers: the column input's forward gather
    and backward re-gather, and the row layer's output-gradient gather."""
    values = SEQ * BATCH * HIDDEN // world
    hp = (dtype, values * torch.tensor([], dtype=dtype).element_size())
    fp8 = (torch.uint8, values)
    if model == "row":
        return [fp8], [hp]
    if model == "mlp_checkpoint":  # FC1's input is gathered outside the recomputed region
        return [hp, fp8], [hp, hp]
    return [fp8, fp8, fp8], [hp, hp]


def check_model(model, recipe_name, dtype, group, device, failures) -> None:
    tag = f"{model} {recipe_name} {dtype}"
    fp8_modules = build(model, dtype, group, device)
    hp_modules = build(model, dtype, group, device)
    with recorded_gathers() as fp8_log:
        fp8 = run_steps(model, fp8_modules, recipe_name, dtype, group, device)
    with high_precision_gathers(), recorded_gathers() as hp_log:
        hp = run_steps(model, hp_modules, recipe_name, dtype, group, device)
    want_fp8, want_hp = expected_gathers(model, dtype, dist.get_world_size(group))
    if fp8_log != want_fp8 * STEPS:
        failures.append(f"{tag}: FP8 run gathered {fp8_log}, expected {want_fp8} per step")
    if hp_log != want_hp * STEPS:
        failures.append(f"{tag}: high-precision run gathered {hp_log}")
    compare_bitwise(tag, fp8, hp, failures)


def saved_bytes(model, recipe_name, group, device):
    """``(uint8 bytes, all bytes)`` saved for backward by one forward of ``model``."""
    modules = build(model, torch.bfloat16, group, device)[:1]
    x, _ = model_input(model, torch.bfloat16, group, device, 0)
    sizes = []

    def pack(t):
        sizes.append((t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=make_recipe(recipe_name), amax_reduction_group=group):
            modules[0](x)
    return sum(n for d, n in sizes if d == torch.uint8), sum(n for _, n in sizes)


def check_saved_memory(group, device, failures) -> int:
    world = dist.get_world_size(group)
    gathered = SEQ * BATCH * HIDDEN  # the gathered input's FP8 bytes
    cases = 0
    for model in ("pair", "lnl_pair", "mlp"):
        for recipe_name in ("delayed", "current"):
            cases += 1
            fp8_u8, fp8_all = saved_bytes(model, recipe_name, group, device)
            with high_precision_gathers():
                hp_u8, hp_all = saved_bytes(model, recipe_name, group, device)
            tag = f"saved memory {model} {recipe_name}"
            saving = gathered - gathered // world
            if hp_u8 - fp8_u8 != saving or hp_all - fp8_all != saving:
                failures.append(
                    f"{tag}: saved {fp8_u8} uint8 / {fp8_all} bytes, {hp_u8} / {hp_all} "
                    f"before; expected {saving} bytes less"
                )
            if model == "pair" and fp8_u8 != gathered // world:
                failures.append(f"{tag}: saved {fp8_u8} FP8 bytes, not the local shard's")
    return cases


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    def checks(group, device):
        failures: list[str] = []
        check_grad_gather(group, device, failures)
        check_regather(group, device, failures)
        for model, recipe_name, dtype in MODEL_CASES:
            check_model(model, recipe_name, dtype, group, device, failures)
        cases = DIRECT_CASES + len(MODEL_CASES) + check_saved_memory(group, device, failures)
        return failures, cases

    return run_worker(rank, world_size, backend, out_dir, init_method, "FP8_GRAD_GATHER", checks)


if __name__ == "__main__":
    main(worker)
