"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a model of te modules.

Each rank trains the same small model (te.Linear, LayerNormMLP, LayerNormLinear and a
TransformerLayer), every te module and the root wrapped with ``fully_shard``, on its own slice
of a global batch, for a few optimizer steps; it saves its losses, the full parameters
(``DTensor.full_tensor()``) and the FP8 scaling state. :func:`reference_run` is the oracle:
one process, no sharding, no process group, the same model fed each rank's slice in turn
(gradient accumulation), the gradients divided by the world size as FSDP2's reduce-scatter
does. Run under torchrun (NCCL on GPUs, gloo on CPU):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_fsdp2.py \
        --backend nccl --recipe delayed --out /tmp/fsdp2_out

or through :func:`worker` (used by test_fsdp2_gloo.py).

Why the two runs agree bit for bit (the reduction order is the same):

* per rank, every GEMM and norm sees exactly the rows the reference gives it for that slice;
* FSDP2 divides each rank's gradient by 2 before summing (exact for 2 ranks: a power of two)
  and a two-term sum is commutative, so ``a/2 + b/2 == (b + a)/2`` bitwise;
* delayed scaling: the amaxes max-accumulate over the two slices in the reference, and are
  all-reduced (MAX, exact) across the ranks under FSDP2; the reference runs both slices'
  forwards in one autocast region and the backward of the first slice last, so each scale
  update sees both slices' amaxes, as the ranks' reduced update does;
* current scaling: each tensor's scale comes from its own slice in both runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.transformer import TransformerLayer

SEQ, BATCH_PER_RANK, HIDDEN, FFN, HEADS = 8, 2, 32, 64, 2
STEPS = 3
RECIPES = {"high_precision": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Model(torch.nn.Module):
    """``[seq, batch, hidden]`` in and out: Linear, LayerNormMLP, TransformerLayer,
    LayerNormLinear."""

    def __init__(self, dtype: torch.dtype, device: torch.device, fuse_qkv: bool = False) -> None:
        super().__init__()
        kw = {"params_dtype": dtype, "device": device}
        self.proj = te.Linear(HIDDEN, HIDDEN, **kw)
        self.mlp = te.LayerNormMLP(HIDDEN, FFN, **kw)
        self.layer = TransformerLayer(
            HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
            fuse_qkv_params=fuse_qkv, **kw,
        )  # fmt: skip
        self.head = te.LayerNormLinear(HIDDEN, HIDDEN, **kw)

    def te_modules(self) -> dict[str, torch.nn.Module]:
        """Every module with FP8 state (``fp8_meta``), by qualified name."""
        return {n: m for n, m in self.named_modules() if hasattr(m, "fp8_meta")}

    #: recompute the MLP in backward (te.distributed.checkpoint)
    recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        if self.recompute:
            x = x + te.distributed.checkpoint(self.mlp, x, use_reentrant=False)
        else:
            x = x + self.mlp(x)
        x = self.layer(x)
        return self.head(x)


def make_model(
    dtype: torch.dtype, device: torch.device, weights: str = "", recipe_name=""
) -> Model:
    """``weights="fp8_params"`` (or ``"fp8_params_no_reshard"``, ``"fp8_params_meta"``): built
    under ``te.quantized_model_init`` with the run's recipe (the weights are ``Float8Tensor``
    parameters; FSDP2 all-gathers their FP8 bytes). A ``weights`` ending in ``meta`` builds on
    the meta device (see :func:`train_sharded`); one ending in ``recompute`` recomputes the MLP
    in backward."""
    model = _build_model(dtype, device, weights, recipe_name)
    model.recompute = weights.endswith("recompute")
    return model


def _build_model(dtype, device, weights, recipe_name) -> Model:
    torch.manual_seed(1234)  # every rank and the reference build the same initial weights
    if not weights.startswith("fp8_params"):
        return Model(dtype, device)
    recipe = RECIPES[recipe_name]()
    if weights.endswith("_other_recipe"):
        # built under another recipe of the class than te.autocast's (a shorter amax history):
        # the first forward rebuilds the recipe state and rebinds the weights' quantizers
        recipe = RECIPES[recipe_name](amax_history_len=4)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        # one QKV weight: FP8 parameters cannot be split into query/key/value parameters
        return Model(dtype, device, fuse_qkv=True)


def global_batch(dtype: torch.dtype, world_size: int) -> list[torch.Tensor]:
    """One ``[SEQ, BATCH_PER_RANK * world_size, HIDDEN]`` batch per step (CPU)."""
    gen = torch.Generator().manual_seed(99)
    shape = (SEQ, BATCH_PER_RANK * world_size, HIDDEN)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(STEPS)]


def rank_slice(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[:, rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK].contiguous()


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def make_optimizer(model: torch.nn.Module, optimizer_name: str = "adam") -> torch.optim.Optimizer:
    if optimizer_name == "fused_adam":
        # te.optimizers.FusedAdam: elementwise foreach steps, the same on shards (DTensors)
        # and on full tensors
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam(model.parameters(), lr=1e-2)
    if optimizer_name == "fused_adam_master":
        # float32 master weights: the intended optimizer of FP8 parameters, which re-quantizes
        # each updated master into its parameter (each rank: its shard)
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    # foreach=False: the same per-parameter elementwise kernels on shards and on full tensors
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def fp8_state(model: Model) -> dict[str, torch.Tensor]:
    """Delayed-scaling scales and amax histories of every te module (CPU copies)."""
    out = {}
    for name, module in model.te_modules().items():
        for key in ("scaling_fwd", "scaling_bwd"):
            state = module.fp8_meta.get(key)
            delayed = state.delayed_scaling_state() if state is not None else None
            if delayed is not None:
                out[f"{name}.{key}.scale"] = delayed.scale.detach().cpu().clone()
                out[f"{name}.{key}.amax_history"] = delayed.amax_history.detach().cpu().clone()
    return out


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (a DTensor's shards gathered). An FP8 parameter gives its
    values (exactly its bytes times ``_scale_inv``) and, as ``<name>._scale_inv``, the scale
    its bytes were cast with (a shard's: every rank's must equal the unsharded one's)."""
    from torch.distributed.tensor import DTensor

    from transformer_engine.pytorch import QuantizedTensor

    out = {}
    for name, param in model.named_parameters():
        param = param.detach()
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, QuantizedTensor):
            out[f"{name}._scale_inv"] = local._scale_inv.detach().cpu().clone()
            if isinstance(param, DTensor):
                param = DTensor.from_local(
                    local.dequantize(), param.device_mesh, param.placements,
                    shape=param.shape, stride=param.stride(),
                )  # fmt: skip
            else:
                param = param.dequantize()
        full = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = full.cpu().clone()
    return out


def mixed_precision_policy():
    """``weights="mixed_precision"``: float32 parameters, BF16 compute, float32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard(
    model: Model, mesh, reshard_after_forward: bool = True, mp_policy=None, inner_units=False
) -> None:
    """``fully_shard`` each top-level block (the TransformerLayer as one unit, as training
    scripts wrap one per layer), then the root.

    ``inner_units``: first the TransformerLayer's own modules too (its attention projection,
    a unit of its own, and the attention around it, another, hand back copies of the
    projection's bias for the layer's later add).
    """
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if inner_units:
        attention = model.layer.self_attention
        for module in (attention.layernorm_qkv, attention.proj, model.layer.layernorm_mlp):
            fully_shard(module, mesh=mesh, **kw)
        fully_shard(attention, mesh=mesh, **kw)
    for module in (model.proj, model.mlp, model.layer, model.head):
        fully_shard(module, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def autocast_for(recipe_name: str):
    recipe_class = RECIPES[recipe_name]
    return te.autocast(enabled=recipe_class is not None, recipe=recipe_class and recipe_class())


def reference_run(
    recipe_name: str,
    dtype_name: str,
    world_size: int,
    device="cpu",
    slices=None,
    optimizer_name: str = "adam",
    weights: str = "",
) -> dict:
    """The unsharded single-process oracle (see the module docstring); ``slices``: which
    ranks' slices to feed (default all)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    dtype, device = DTYPES[dtype_name], torch.device(device)
    if weights == "mixed_precision":
        return _mixed_precision_reference(recipe_name, world_size, device, optimizer_name)
    model = make_model(dtype, device, weights, recipe_name)
    optimizer = make_optimizer(model, optimizer_name)
    step_slices = [
        [rank_slice(batch, r).to(device) for r in slices or range(world_size)]
        for batch in global_batch(dtype, world_size)
    ]
    losses = oracle_steps(
        model, optimizer, step_slices, lambda: autocast_for(recipe_name), world_size
    )
    return {"losses": losses, "params": full_parameters(model), **_fp8(model)}


def oracle_steps(model, optimizer, step_slices, autocast, world_size: int) -> torch.Tensor:
    """The unsharded oracle's training steps: per step, every rank's slice through the model
    (the forwards in one ``autocast()`` region), the backwards in reverse (slice 0's last: it
    completes the delayed-scaling update), the accumulated gradients divided by
    ``world_size``, an optimizer step. Returns the losses, ``[step, slice]``."""
    losses = []
    for slices in step_slices:
        with autocast():
            outs = [model(x) for x in slices]
        step_losses = [loss_of(out) for out in outs]
        for loss in reversed(step_losses):
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach().cpu() for loss in step_losses]))
    return torch.stack(losses)


def rank_steps(model, optimizer, batches, rank: int, world_size: int, autocast) -> list:
    """One rank's training steps: its slice (dim-0 chunk ``rank``) of each batch, the forward
    in ``autocast()``, backward, optimizer step. Returns the losses."""
    losses = []
    for x in batches:
        with autocast():
            loss = loss_of(model(x.chunk(world_size)[rank]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def check_ranks_equal_oracle(sharded_results, key, losses, params, atol: float = 0.0) -> None:
    """Every rank's ``results[key]`` (``losses``, ``params`` of :func:`full_parameters`) equals
    the oracle's (:func:`oracle_steps` losses, its ``full_parameters``) bitwise; ``atol``: the
    tolerance of the high-precision parameters only (FP8 values and scales stay bitwise)."""
    fp8 = {k.removesuffix("._scale_inv") for k in params if k.endswith("._scale_inv")}
    for rank, results in enumerate(sharded_results):
        got = results[key]
        for step, loss in enumerate(got["losses"]):
            assert torch.equal(loss, losses[step][rank]), f"rank {rank} step {step}"
        assert got["params"].keys() == params.keys()
        for name in params:
            if atol and name not in fp8 and not name.endswith("._scale_inv"):
                torch.testing.assert_close(got["params"][name], params[name], rtol=0, atol=atol)
            else:
                assert torch.equal(got["params"][name], params[name]), f"rank {rank} {name}"
    assert not torch.equal(losses[0][0], losses[-1][0])


def _mixed_precision_reference(recipe_name, world_size, device, optimizer_name) -> dict:
    """The oracle of ``mixed_precision_policy()``: float32 masters; each step a BF16 copy runs
    every slice (the forwards in one autocast, slice 0's backward last), and each slice's BF16
    gradient, in float32, is summed and divided by the world size (FSDP2's float32
    reduce-scatter of the ranks' gradients divided by 2: the same sum, exactly)."""
    master = make_model(torch.float32, device)
    working = make_model(torch.bfloat16, device)  # values copied from the masters every step
    optimizer = make_optimizer(master, optimizer_name)
    masters, copies = dict(master.named_parameters()), dict(working.named_parameters())
    losses = []
    for batch in global_batch(torch.float32, world_size):
        with torch.no_grad():
            for name, p in copies.items():
                p.copy_(masters[name])
        with autocast_for(recipe_name):
            outs = [working(rank_slice(batch, r).to(device).bfloat16()) for r in range(world_size)]
        step_losses = [loss_of(out) for out in outs]
        grads = {name: torch.zeros_like(p) for name, p in masters.items()}
        for loss in reversed(step_losses):
            loss.backward()
            with torch.no_grad():
                for name, p in copies.items():
                    grads[name] += p.grad.float()
                    p.grad = None
        for name, p in masters.items():
            p.grad = grads[name] / world_size
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach().cpu() for loss in step_losses]))
    return {"losses": torch.stack(losses), "params": full_parameters(master), **_fp8(working)}


def _fp8(model: Model) -> dict:
    return {"fp8_state": fp8_state(model)}


def _device_for(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)  # NCCL's process device; the library never asks
        return device
    return torch.device("cpu")


def train_sharded(
    recipe_name: str,
    dtype_name: str,
    rank: int,
    world_size: int,
    device,
    mesh,
    optimizer_name="adam",
    weights="",
):
    """This rank's FSDP2 run: ``(model, optimizer, result dict)``."""
    dtype = DTYPES[dtype_name]
    deferred = weights.endswith("meta")
    model = make_model(dtype, torch.device("meta") if deferred else device, weights, recipe_name)
    # "..._no_reshard": the unsharded weights stay from forward to backward (one all-gather)
    mixed = mixed_precision_policy() if weights == "mixed_precision" else None
    shard(model, mesh, not weights.endswith("_no_reshard"), mixed, weights.endswith("inner_units"))
    if deferred:
        # FSDP2's deferred initialization: sharded on meta, storage, then each block's reset
        # writes into the shards; the same random draws as building on the device
        model.to_empty(device=device)
        torch.manual_seed(1234)
        for block in (model.proj, model.mlp, model.layer, model.head):
            block.reset_parameters()
    optimizer = make_optimizer(model, optimizer_name)
    losses = []
    for batch in global_batch(dtype, world_size):
        with autocast_for(recipe_name):
            out = model(rank_slice(batch, rank).to(device))
        loss = loss_of(out)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local = loss.detach().reshape(1)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        losses.append(torch.cat(gathered).cpu())
    result = {"losses": torch.stack(losses), "params": full_parameters(model), **_fp8(model)}
    return model, optimizer, result


def worker(
    rank: int,
    world_size: int,
    backend: str,
    out_dir: str,
    runs: list[tuple],
    init_method: str = "env://",
    extras: bool = False,
) -> None:
    """Train one FSDP2 model per ``(recipe, dtype)`` or ``(recipe, dtype, optimizer)`` in
    ``runs`` (results keyed ``recipe-dtype[-optimizer]``); with ``extras``, also the checks of
    :mod:`fsdp2_fp8_checks` (FP8-parameter refusals, memory, the DCP round trip); save
    ``rank{r}.pt``."""
    from torch.distributed.device_mesh import init_device_mesh

    device = _device_for(backend, rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        results = {}
        for run in runs:
            _, _, result = train_sharded(*run[:2], rank, world_size, device, mesh, *run[2:])
            result["device"] = str(next(iter(result["params"].values())).device)
            results["-".join(run)] = result
        if extras:
            from fsdp2_fp8_checks import extra_results  # noqa: PLC0415 (imports this module)

            results.update(extra_results(rank, world_size, device, mesh, out_dir))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gloo_worker(rank, out_dir, init_file, mesh_shape, train, mesh_dim_names=None) -> None:
    """One spawned gloo process of a test: the process group (``init_file``), a CPU mesh of
    ``mesh_shape``, then ``train(mesh)``'s results saved as ``out_dir/rank{rank}.pt``."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = 1
    for extent in mesh_shape:
        world_size *= extent
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=mesh_dim_names)
        torch.save(train(mesh), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # Nothing of the run may keep a mesh's gloo subgroup alive past the destroy: the FP8
        # state holds amax-reduction groups, and freed modules may sit in reference cycles;
        # a gloo group destroyed at interpreter exit can abort the process ("terminate called
        # without an active exception": a 4-process HSDP run once died so, not reproduced;
        # tp_harness.run_worker clears the same state for the same reason).
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
        gc.collect()
        dist.destroy_process_group()


def compare(got: dict, expected: dict, label: str) -> None:
    """Bitwise equality of losses, parameters and FP8 state, naming the first difference."""
    for part in ("losses", "params", "fp8_state"):
        a, b = got[part], expected[part]
        if isinstance(a, torch.Tensor):
            a, b = {"": a}, {"": b}
        if a.keys() != b.keys():
            raise AssertionError(f"{label} {part}: keys {sorted(a)} != {sorted(b)}")
        for key in a:
            if not torch.equal(a[key], b[key]):
                diff = (a[key].double() - b[key].double()).abs().max().item()
                raise AssertionError(f"{label} {part} {key}: differs (max abs diff {diff:.3g})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--recipe", default="delayed", choices=sorted(RECIPES))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--weights", default="", choices=["", "fp8_params"],
        help="fp8_params: weights built under te.quantized_model_init, all-gathered in FP8",
    )  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = (args.recipe, args.dtype) + (("adam", args.weights) if args.weights else ())
    worker(rank, world_size, args.backend, args.out, [run], extras=True)
    if rank == 0:
        from fsdp2_fp8_checks import check_extras  # noqa: PLC0415 (imports this module)

        device = "cuda:0" if args.backend == "nccl" else "cpu"
        expected = reference_run(*run[:2], world_size, device, None, *run[2:])
        for r in range(world_size):
            got = torch.load(os.path.join(args.out, f"rank{r}.pt"))
            compare(got["-".join(run)], expected, f"rank {r}")
            check_extras(got, f"cuda:{r}" if args.backend == "nccl" else "cpu")
        print(f"fsdp2 {args.recipe} {args.dtype}: {world_size} ranks equal the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
