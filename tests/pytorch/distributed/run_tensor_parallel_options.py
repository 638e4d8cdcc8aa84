"""Tensor / sequence parallelism of ``te.Linear`` with the options that change what its backward
reads or when it runs, over real processes, held to the single-process layers.

The column -> row ``te.Linear`` pair of run_tensor_parallel.py, both layers built with one of:
``save_original_input=True`` (the saved input is cast again in backward: under sequence
parallelism the column layer's high-precision shard is gathered again and re-quantized, its
amax reduced over the group); ``delay_wgrad_compute=True`` (the weight gradients run in
``backward_dw()`` after the backward, which reads the gathered input); ``fuse_wgrad_accumulation``
(the weight gradients accumulate into float32 ``main_grad``); a ``backward_override`` of
``"high_precision"`` or ``"dequantized"`` (the backward's GEMMs in high precision). With and
without sequence parallelism, under Float8CurrentScaling (and DelayedScaling where the option
allows it). Each rank checks the output, the input gradient and every weight and bias gradient
(shards gathered) against the single-process pair. Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 \
        tests/pytorch/distributed/run_tensor_parallel_options.py --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
Tolerances: ``tp_harness.compare`` (see run_tensor_parallel.py).
"""

from __future__ import annotations

import run_tensor_parallel as models  # this file's directory is on sys.path, as for tp_harness
import torch
from tp_harness import (
    case_checks,
    compare,
    compare_step,
    gather,
    main,
    run_worker,
    summed,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

SEQ, BATCH, HIDDEN = models.SEQ, models.BATCH, models.HIDDEN
STEPS = 2
OPTIONS = ("save_original_input", "delay_wgrad", "fuse_wgrad", "override_hp", "override_dq")
CASES = [(option, sp, recipe) for option in OPTIONS for sp in (False, True)
         for recipe in ("current", "delayed")
         if not (recipe == "delayed" and option in ("save_original_input", "override_hp",
                                                    "override_dq"))]  # fmt: skip


def make_recipe(option, name):
    if name == "delayed":
        return DelayedScaling(amax_history_len=4, reduce_amax=True)
    override = {"override_hp": "high_precision", "override_dq": "dequantized"}.get(option)
    return Float8CurrentScaling(backward_override=override)


def module_options(option):
    return {
        "save_original_input": {"save_original_input": True},
        "delay_wgrad": {"delay_wgrad_compute": True},
        "fuse_wgrad": {"fuse_wgrad_accumulation": True},
    }.get(option, {})


def build(option, device, group, sp):
    """The single-process pair and its tensor-parallel version (run_tensor_parallel.py's: the
    same weights, this rank's shards), both with ``option``'s arguments; under ``fuse_wgrad``
    each weight gets a float32 ``main_grad``."""
    kw = module_options(option)
    full = models.build_full("pair", device, **kw)
    par = models.build_parallel("pair", full, sp, group, device, **kw)
    if option == "fuse_wgrad":
        for m in full + par:
            m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32, device=device)
    return full, par


def run(pair, option, x, grad, recipe):
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(recipe=recipe):
        out = pair[1](pair[0](x))
    out.backward(grad)
    if option == "delay_wgrad":
        for m in pair:
            m.backward_dw()
    return out.detach(), x.grad


def weight_grads(pair, option):
    if option == "fuse_wgrad":
        grads = [m.weight.main_grad.clone() for m in pair]
        for m in pair:
            m.weight.main_grad.zero_()
        return grads
    return [m.weight.grad for m in pair]


def check_case(option, sp, recipe_name, group, device) -> list[str]:
    full, par = build(option, device, group, sp)
    failures: list[str] = []
    label = f"{option} sp={sp} recipe={recipe_name}"
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        for m in full + par:
            m.zero_grad(set_to_none=True)
        tag = f"{label} step {step}"
        compare_step(
            tag, lambda x, g: run(full, option, x, g, make_recipe(option, recipe_name)),
            lambda x, g: run(par, option, x, g, make_recipe(option, recipe_name)), x, grad, sp,
            group, True, failures,
        )  # fmt: skip
        (ref_w0, ref_w1), (w0, w1) = weight_grads(full, option), weight_grads(par, option)
        row_bias = summed(par[1].bias.grad, group) if sp else par[1].bias.grad
        for name, got, want in (
            ("0.weight", gather(w0, 0, group), ref_w0),
            ("0.bias", gather(par[0].bias.grad, 0, group), full[0].bias.grad),
            ("1.weight", gather(w1, 1, group), ref_w1),
            ("1.bias", row_bias, full[1].bias.grad),
        ):
            compare(f"{tag} {name} grad", got, want, True, failures)
    return failures


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "TP_OPTIONS", checks)


if __name__ == "__main__":
    main(worker)
