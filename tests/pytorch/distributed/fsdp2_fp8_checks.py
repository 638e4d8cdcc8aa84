"""The FSDP2 checks beyond training equality (:mod:`run_fsdp2`'s ``extras``): FP8 parameters that
``fully_shard`` refuses or must check (a dim-1 split, shards re-quantized on their own), the
memory of FP8-parameter steps, and a DCP checkpoint round trip of a sharded model."""

from __future__ import annotations

import os

import torch
from run_fsdp2 import (
    HIDDEN,
    autocast_for,
    compare,
    fp8_state,
    full_parameters,
    global_batch,
    loss_of,
    make_model,
    make_optimizer,
    rank_slice,
    shard,
    train_sharded,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling


def extra_results(rank: int, world_size: int, device, mesh, out_dir: str) -> dict:
    """This rank's results of every check below, keyed as :func:`check_extras` reads them."""
    results = {}
    results["fp8_parameter_refusal"] = fp8_parameter_refusal(device, mesh)
    checkpoint_dir = os.path.join(out_dir, "dcp")
    results["checkpoint"] = checkpoint_round_trip(rank, world_size, device, mesh, checkpoint_dir)
    results["checkpoint_fused_adam"] = checkpoint_round_trip(
        rank, world_size, device, mesh, checkpoint_dir + "_fused_adam", "fused_adam"
    )
    results["checkpoint_fp8_params"] = checkpoint_round_trip(
        rank, world_size, device, mesh, checkpoint_dir + "_fp8_params",
        "fused_adam_master", "fp8_params",
    )  # fmt: skip
    results["fp8_scale_mismatch"] = fp8_parameter_scale_mismatch(device, mesh, rank)
    if device.type == "cuda":
        results["fp8_parameter_memory"] = fp8_parameter_memory(device, mesh)
    return results


def fp8_parameter_refusal(device, mesh) -> str:
    """The error of the first forward of a ``quantized_model_init`` model whose FP8 weight
    ``fully_shard`` splits along dim 1 (empty string: no error). FP8 all-gather takes dim-0
    shards; a dim-1 split of the weight yields high-precision shards, which the module
    refuses rather than train silently in another precision."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        module = te.Linear(HIDDEN, HIDDEN, device=device)
    fully_shard(module, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    return _first_forward_error(module, DelayedScaling(), device, NotImplementedError)


def fp8_parameter_scale_mismatch(device, mesh, rank: int) -> str:
    """The error of the first forward after each rank re-quantized its current-scaling FP8
    weight shard on its own (a scale of its own rows: rank 1's values are doubled) before any
    all-gather (empty string: no error)."""
    from torch.distributed.fsdp import fully_shard

    with te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling()):
        module = te.Linear(HIDDEN, HIDDEN, device=device)
    fully_shard(module, mesh=mesh)
    local = module.weight.to_local()
    with torch.no_grad():
        local.quantize_(local.dequantize() * (1 + rank))
    return _first_forward_error(module, Float8CurrentScaling(), device, RuntimeError)


def _first_forward_error(module, recipe, device, error_type) -> str:
    """The message of the ``error_type`` a forward of ``module`` under ``recipe`` raises
    (empty string: none)."""
    try:
        with te.autocast(recipe=recipe):
            module(torch.randn(16, HIDDEN, device=device))
    except error_type as error:
        return str(error)
    return ""


def fp8_parameter_memory(device, mesh, steps: int = 6) -> list[int]:
    """``torch.cuda.memory_allocated`` after each training step of a model of FP8 weights
    (current scaling, resharded after forward): the gathered weights, their transposes and
    the shards' re-quantizations must not accumulate from step to step."""
    from torch.distributed.fsdp import fully_shard

    with te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling()):
        model = torch.nn.Sequential(*(te.Linear(256, 256, device=device) for _ in range(3)))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model, "fused_adam_master")
    allocated = []
    for _ in range(steps):
        with te.autocast(recipe=Float8CurrentScaling()):
            loss = loss_of(model(torch.randn(64, 256, device=device)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        allocated.append(torch.cuda.memory_allocated(device))
    return allocated


def extra_state_sized_like(state_dict: dict, checkpoint_dir: str, prefix: str = "") -> dict:
    """``state_dict`` with every ``_extra_state`` entry replaced by an empty ``uint8`` tensor of
    the size saved in the checkpoint under ``prefix + key``: DCP loads in place and refuses a size mismatch, and a
    module that has not run in FP8 yet has an empty extra state."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    out = dict(state_dict)
    for key in state_dict:
        if key.endswith("._extra_state") and prefix + key in saved:
            out[key] = torch.empty(saved[prefix + key].size, dtype=torch.uint8)
    return out


def checkpoint_round_trip(
    rank, world_size, device, mesh, checkpoint_dir, optimizer_name="adam", weights=""
) -> dict:
    """Train under delayed scaling, save model and optimizer with DCP, load them into a fresh
    sharded model, and take one more step with both: results of the restored run
    (``weights="fp8_params"``: FP8 parameters, saved and restored as FP8 shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer, _ = train_sharded(
        "delayed", "float32", rank, world_size, device, mesh, optimizer_name, weights
    )
    saved = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(saved, checkpoint_id=checkpoint_dir)
    restored = make_model(torch.float32, device, weights, "delayed")
    with torch.no_grad():
        for p in restored.parameters():
            p.zero_()  # nothing of the original survives but what the checkpoint restores
    shard(restored, mesh)
    restored_optimizer = make_optimizer(restored, optimizer_name)
    model_sd = extra_state_sized_like(restored.state_dict(), checkpoint_dir, "model.")
    # get_optimizer_state_dict: a fresh Adam has no state yet; this one holds its slots
    state = {"model": model_sd, "optim": get_optimizer_state_dict(restored, restored_optimizer)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    restored.load_state_dict(state["model"])
    set_optimizer_state_dict(restored, restored_optimizer, state["optim"])
    result = {"restored_fp8_state": fp8_state(restored), "saved_fp8_state": fp8_state(model)}
    state_devices = [
        str(state.scale.device)
        for m in restored.te_modules().values()
        for state in (m.fp8_meta.get("scaling_fwd"),)
        if state is not None and state.delayed_scaling_state() is not None
    ]
    result["restored_devices"] = sorted(
        {str(p.to_local().device) for p in restored.parameters()} | set(state_devices)
    )
    batch = rank_slice(global_batch(torch.float32, world_size)[0], rank).to(device)
    for key, (net, opt) in {
        "original": (model, optimizer),
        "restored": (restored, restored_optimizer),
    }.items():
        with autocast_for("delayed"):
            loss = loss_of(net(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        result[f"{key}_loss"] = loss.detach().cpu()
        result[f"{key}_params"] = full_parameters(net)
        result[f"{key}_next_fp8_state"] = fp8_state(net)
    return result


def check_extras(results: dict, device: str, checkpoint_key: str = "checkpoint") -> None:
    """The FP8-parameter refusal names the problem; the DCP round trip (``checkpoint_key``:
    with torch's Adam, or ``checkpoint_fused_adam``) restored the FP8 state onto ``device`` and
    the next step of the restored model equals the original's bitwise."""
    message = results["fp8_parameter_refusal"]
    if "quantized_model_init" not in message or "fully_shard" not in message:
        raise AssertionError(f"FP8 parameters under fully_shard: unexpected refusal {message!r}")
    ck = results[checkpoint_key]
    if ck["restored_devices"] != [device]:
        raise AssertionError(f"restored onto {ck['restored_devices']}, expected [{device!r}]")
    compare_dicts(ck["restored_fp8_state"], ck["saved_fp8_state"], "restored FP8 state")
    if not ck["saved_fp8_state"]:
        raise AssertionError("the checkpointed model holds no delayed-scaling state")
    if not torch.equal(ck["restored_loss"], ck["original_loss"]):
        raise AssertionError(f"loss after restore {ck['restored_loss']} != {ck['original_loss']}")
    compare_dicts(ck["restored_params"], ck["original_params"], "params after restore")
    compare_dicts(ck["restored_next_fp8_state"], ck["original_next_fp8_state"], "FP8 state")


def compare_dicts(a: dict, b: dict, label: str) -> None:
    compare(
        {"losses": {}, "params": a, "fp8_state": {}},
        {"losses": {}, "params": b, "fp8_state": {}},
        label,
    )
