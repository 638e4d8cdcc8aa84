"""FP8 training across N processes x M devices per process, with amax reduction across processes.

Every process builds the same model (seeded): a stack of blocks of ``te`` modules
(``LayerNormLinear`` -> GELU -> ``Linear``, then ``LayerNormMLP``, each with a residual), block
``i`` on the process's device ``i % M``. Each rank feeds its own (rank-dependent) data and runs
``--iters`` FP8 forward/backward steps under ``te.autocast(recipe=DelayedScaling(HYBRID,
amax_history_len=8), amax_reduction_group=<world>)``; the gradients are averaged across ranks
(one ``all_reduce(SUM)`` of a flat buffer, divided by the world size) before an SGD step, so the
weights stay identical, and the amax reduction keeps the FP8 state identical. Every rank ends by
printing ``FINAL_HASH <sha256>`` over all weights and every module's scales and amax histories;
``check_hashes.py`` verifies that all ranks printed the same one.

Checked in every rank (a failed check makes the process exit non-zero):

* exactly one amax ``all_reduce`` per direction per step (the forward update at autocast exit,
  the backward update at the end of backward), counted by wrapping
  ``torch.distributed.all_reduce`` and the registry's collective seam
  (``_amax_registry._all_reduce_max``); each with ``MAX`` over the world group, on the
  process's first device (where the registry gathers), and its result equal to the elementwise
  maximum of every rank's local amaxes (a single process has nothing to reduce: the registry
  makes no amax collective then, and the harness expects none);
* no other collective during forward or backward;
* every module's FP8 state (scales and amax histories of both directions) on that module's
  device, and the registry grouping those states by the devices the blocks live on;
* on CUDA, ``torch.cuda.current_device()`` unchanged since the start (after every step and at
  the end), and the library's device-guard stack empty;
* all ranks started from the same weights and ended with the same hash (gathered in-process too).

Devices. ``--device-type cuda``: run one process per group of M GPUs. The process with local
rank ``r`` drives ``cuda:r*M`` ... ``cuda:r*M+M-1`` of the *visible* GPUs, and ``cuda:r*M`` is
its NCCL device (``torch.cuda.set_device`` and ``device_id``), so ``CUDA_VISIBLE_DEVICES`` must
list at least ``nproc_per_node * M`` GPUs, e.g. 2 processes x 2 GPUs::

    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nproc_per_node=2 \\
        tests/pytorch/distributed/run_multi_device_fp8.py --devices-per-process 2

``--device-type cpu`` (gloo): the M devices are all ``cpu``; the code path is the same::

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_multi_device_fp8.py \\
        --device-type cpu --devices-per-process 2

Output lines (one per rank each): ``rank R: ...`` progress, ``AMAX_ALL_REDUCE_COUNTS rank=R
steps=S forward_per_step=1,... backward_per_step=1,... forward_total=S backward_total=S
grad_all_reduce_total=S expected_per_step=1``, ``FINAL_HASH <hex>`` and ``HARNESS rank=R PASSED`` (or ``FAILED``
after ``CHECK FAILED`` lines).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import os
import sys

import torch

# Import torch._dynamo before any process group exists. Imported later (torch.optim imports it
# lazily), it keeps references to the default group that destroy_process_group does not drop
# (torch 2.13), so the group, and gloo's worker threads, live until interpreter exit; a worker
# still releasing a tensor of the last collective then cannot take the GIL and aborts the
# process ("terminate called without an active exception", exit code -6, about one gloo run in
# ten here).
import torch._dynamo  # noqa: F401, I001  (must precede init_process_group)
import torch.distributed as dist
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.quantization import amax_registry as _amax_registry

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def emit(line: str) -> None:
    """One write per line, so lines of concurrent ranks sharing a pipe never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ the model


class Block(torch.nn.Module):
    """``x + Linear(gelu(LayerNormLinear(x)))``, then ``x + LayerNormMLP(x)``, on one device."""

    def __init__(self, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.device = device
        self.ln_linear = te.LayerNormLinear(hidden, hidden, params_dtype=dtype, device=device)
        self.linear = te.Linear(hidden, hidden, params_dtype=dtype, device=device)
        self.mlp = te.LayerNormMLP(hidden, ffn, params_dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.linear(F.gelu(self.ln_linear(x)))
        return x + self.mlp(x)


class SplitModel(torch.nn.Module):
    """Block ``i`` on ``devices[i % len(devices)]``; activations move between blocks."""

    def __init__(self, blocks: int, hidden: int, ffn: int, devices, dtype: torch.dtype):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            Block(hidden, ffn, devices[i % len(devices)], dtype) for i in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x.to(block.device))
        return x


def te_modules(model: torch.nn.Module):
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, te.TransformerEngineBaseModule)
    ]


# ------------------------------------------------------------------ hashing


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a CPU copy of ``t`` (any dtype, any shape)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).tolist())


def state_hash(model: torch.nn.Module, with_fp8_state: bool = True) -> str:
    """sha256 over every weight and, optionally, every module's scales and amax histories."""
    h = hashlib.sha256()

    def add(label: str, t: torch.Tensor) -> None:
        h.update(f"{label}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))

    for name, p in model.named_parameters():
        add(name, p)
    if with_fp8_state:
        for name, m in te_modules(model):
            for key in ("scaling_fwd", "scaling_bwd"):
                state = m.fp8_meta[key]
                add(f"{name}.{key}.scale", state.scale)
                add(f"{name}.{key}.amax_history", state.amax_history)
    return h.hexdigest()


# ------------------------------------------------------------------ counting collectives


class CollectiveCounter:
    """Wraps ``torch.distributed.all_reduce`` and the amax registry's collective seam.

    Every call is recorded with the phase it happened in (``("forward", step)``: the autocast
    region and its exit; ``("backward", step)``: ``loss.backward()``; ``("grad_sync", step)``)
    and whether the amax registry made it. The amax calls also keep CPU copies of the buffer
    before (this rank's local amaxes) and after (the reduced amaxes) the collective.
    """

    def __init__(self, world_group) -> None:
        self.world_group = world_group
        self.phase = ("setup", -1)
        self.calls = []  # dicts: phase, amax, op, world_group, device, numel
        self.amax_buffers = []  # (phase, local CPU copy, reduced CPU copy)
        self._in_amax_seam = False
        self._original_all_reduce = dist.all_reduce
        self._original_seam = _amax_registry._all_reduce_max

    def install(self) -> None:
        dist.all_reduce = self._all_reduce
        _amax_registry._all_reduce_max = self._amax_seam

    def uninstall(self) -> None:
        dist.all_reduce = self._original_all_reduce
        _amax_registry._all_reduce_max = self._original_seam

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(
            {
                "phase": self.phase,
                "amax": self._in_amax_seam,
                "op": op,
                "world_group": group is self.world_group,  # no reference to the group kept
                "device": tensor.device,
                "numel": tensor.numel(),
            }
        )
        return self._original_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def _amax_seam(self, buffer: torch.Tensor, group) -> None:
        local = buffer.detach().to("cpu", copy=True)
        self._in_amax_seam = True
        try:
            self._original_seam(buffer, group)
        finally:
            self._in_amax_seam = False
        self.amax_buffers.append((self.phase, local, buffer.detach().to("cpu", copy=True)))

    def amax_calls(self, direction: str, step: int):
        return [c for c in self.calls if c["amax"] and c["phase"] == (direction, step)]


# ------------------------------------------------------------------ the run


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl with --device-type cuda, gloo with cpu",
    )
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=4, help="te blocks, placed round-robin")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    args = parser.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device_type == "cuda" else "gloo"
    if args.backend == "nccl" and args.device_type != "cuda":
        parser.error("--backend nccl needs --device-type cuda")
    if args.device_type == "cuda" and not cuda:
        parser.error("--device-type cuda but CUDA is not available; use --device-type cpu")
    if args.devices_per_process < 1 or args.iters < 1 or args.blocks < 1:
        parser.error("--devices-per-process, --iters and --blocks must be at least 1")
    for name in ("hidden", "ffn"):
        if getattr(args, name) % 16:
            parser.error(f"--{name} must be a multiple of 16 (FP8 GEMM shapes)")
    return args


def process_devices(args, local_rank: int, local_world_size: int) -> list[torch.device]:
    """This process's M devices: its slice of the visible GPUs, or M times ``cpu``."""
    m = args.devices_per_process
    if args.device_type == "cpu":
        return [torch.device("cpu")] * m
    visible = torch.cuda.device_count()
    if visible < local_world_size * m:
        raise SystemExit(
            f"{local_world_size} processes x {m} GPUs need {local_world_size * m} visible GPUs, "
            f"but {visible} are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    return [torch.device("cuda", local_rank * m + j) for j in range(m)]


def rank_batch(args, rank: int, step: int, dtype: torch.dtype):
    """This rank's input and target of ``step`` (CPU, then moved by the caller)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 1_009 + step)
    shape = (args.batch_size, args.seq_len, args.hidden)
    x = torch.randn(shape, generator=g) * (1.0 + rank)  # rank-dependent amaxes
    target = torch.randn(shape, generator=g)
    return x.to(dtype), target


def sync_gradients(model: torch.nn.Module, home: torch.device, world_size: int) -> None:
    """Average the gradients across ranks: one ``all_reduce(SUM)`` of a float32 buffer on the
    process's NCCL device (gradients on other devices are gathered there and scattered back)."""
    params = [p for p in model.parameters() if p.requires_grad]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(f"parameters without gradients: {missing}")
    flat = torch.cat([p.grad.detach().reshape(-1).to(home, torch.float32) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(world_size)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def check_fp8_state_placement(model: SplitModel, failures: list[str]) -> int:
    """Every module's scales and amax histories live on that module's (its block's) device."""
    checked = 0
    for block_name, block in model.named_children():
        for i, b in enumerate(block):
            for name, m in te_modules(b):
                where = f"{block_name}.{i}.{name}"
                param_device = next(m.parameters()).device
                if param_device != b.device:
                    failures.append(f"{where}: parameters on {param_device}, block on {b.device}")
                if not m.fp8:
                    failures.append(f"{where}: the last forward did not run in FP8")
                for key in ("scaling_fwd", "scaling_bwd"):
                    state = m.fp8_meta.get(key)
                    if state is None:
                        failures.append(f"{where}: no {key} state")
                        continue
                    for tname in ("scale", "amax_history"):
                        t = getattr(state, tname)
                        checked += 1
                        if t.device != b.device:
                            failures.append(f"{where}.{key}.{tname} on {t.device}, not {b.device}")
    return checked


def check_registry(model: SplitModel, home: torch.device, failures: list[str]) -> str:
    """The registry holds one key per direction, grouped by the devices the blocks use, the
    first group on the process's first device (where a reduction gathers)."""
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    keys = registry.keys()
    if len(keys) != 2:
        failures.append(f"amax registry keys: expected one per direction, got {keys}")
    expected = list(dict.fromkeys(b.device for b in model.blocks))
    layout = []
    for key in keys:
        devices = [device for device, _ in registry.device_groups(key)]
        direction = FP8GlobalStateManager.get_fwd_bwd_key(key.forward)
        layout.append(f"{direction}: {', '.join(str(d) for d in devices)}")
        if devices != expected:
            failures.append(f"registry key {key!r} groups devices {devices}, expected {expected}")
        if devices and devices[0] != home:
            failures.append(f"registry key {key!r} gathers on {devices[0]}, not on {home}")
    return "; ".join(layout)


def check_collectives(counter: CollectiveCounter, args, home, rank, world_size, failures) -> str:
    """One amax all_reduce per direction per step (MAX, world group, on ``home``); nothing else
    during forward/backward; one gradient all_reduce per step.

    A world of one process has nothing to reduce: the registry then makes no amax collective
    (it reduces only when the group has more than one rank), and none is expected.
    """
    expected = 1 if world_size > 1 else 0
    per_step = {"forward": [], "backward": []}
    for direction, counts in per_step.items():
        for step in range(args.iters):
            calls = counter.amax_calls(direction, step)
            counts.append(len(calls))
            for c in calls:
                if c["op"] != dist.ReduceOp.MAX:
                    failures.append(f"step {step} {direction}: amax all_reduce op {c['op']}")
                if not c["world_group"]:
                    failures.append(f"step {step} {direction}: amax group is not the world")
                if c["device"] != home:
                    failures.append(f"step {step} {direction}: amax buffer on {c['device']}")
        if counts != [expected] * args.iters:
            failures.append(
                f"{direction}: amax all_reduce calls per step {counts}, expected {expected} "
                f"per step in a world of {world_size}"
            )
    stray = [c for c in counter.calls if not c["amax"] and c["phase"][0] != "grad_sync"]
    if stray:
        failures.append(f"all_reduce calls outside the amax registry and grad sync: {stray}")
    grad_calls = [c for c in counter.calls if c["phase"][0] == "grad_sync"]
    if len(grad_calls) != args.iters:
        failures.append(f"{len(grad_calls)} gradient all_reduce calls for {args.iters} steps")
    seam_calls = len(counter.amax_buffers)
    amax_calls = sum(per_step["forward"]) + sum(per_step["backward"])
    if seam_calls != amax_calls:
        failures.append(f"{seam_calls} registry reductions made {amax_calls} all_reduce calls")
    return (
        f"AMAX_ALL_REDUCE_COUNTS rank={rank} steps={args.iters} "
        f"forward_per_step={','.join(map(str, per_step['forward']))} "
        f"backward_per_step={','.join(map(str, per_step['backward']))} "
        f"forward_total={sum(per_step['forward'])} backward_total={sum(per_step['backward'])} "
        f"grad_all_reduce_total={len(grad_calls)} expected_per_step={expected}"
    )


def check_reduced_amaxes(counter: CollectiveCounter, world_size: int, failures) -> None:
    """Across ranks: every reduction returned the elementwise MAX of all ranks' local amaxes,
    the same on every rank, and the ranks' local amaxes did differ (the data is per rank)."""
    mine = [(phase, local, reduced) for phase, local, reduced in counter.amax_buffers]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if any(len(theirs) != len(mine) for theirs in everyone):
        failures.append(f"ranks made different numbers of amax reductions: {everyone}")
        return
    differed = False
    for i, (phase, _, reduced) in enumerate(mine):
        locals_ = torch.stack([theirs[i][1] for theirs in everyone])
        differed = differed or any(not torch.equal(locals_[0], t) for t in locals_[1:])
        if not torch.equal(reduced, locals_.amax(dim=0)):
            failures.append(f"reduction {i} ({phase}): result is not the MAX over ranks")
        if any(not torch.equal(reduced, theirs[i][2]) for theirs in everyone):
            failures.append(f"reduction {i} ({phase}): ranks received different results")
    if world_size > 1 and mine and not differed:
        failures.append("the ranks' local amaxes never differed: the reduction was not tested")


def train(args, model, devices, rank, world_size, counter, failures) -> float:
    home, last = devices[0], model.blocks[-1].device
    dtype = DTYPES[args.dtype]
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    start_device = torch.cuda.current_device() if home.type == "cuda" else None
    loss_value = float("nan")
    for step in range(args.iters):
        x, target = rank_batch(args, rank, step, dtype)
        x, target = x.to(home), target.to(last)
        opt.zero_grad(set_to_none=True)
        counter.phase = ("forward", step)
        with te.autocast(enabled=True, recipe=recipe, amax_reduction_group=counter.world_group):
            out = model(x)
        loss = F.mse_loss(out.float(), target)
        counter.phase = ("backward", step)
        loss.backward()
        counter.phase = ("grad_sync", step)
        sync_gradients(model, home, world_size)
        counter.phase = ("optimizer", step)
        opt.step()
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            failures.append(f"step {step}: loss is {loss_value}")
        if start_device is not None and torch.cuda.current_device() != start_device:
            failures.append(
                f"step {step}: current device is cuda:{torch.cuda.current_device()}, "
                f"was cuda:{start_device} at the start"
            )
    counter.phase = ("done", args.iters)
    if guard_depth() != 0:
        failures.append(f"device guard stack left at depth {guard_depth()}")
    return loss_value


def run_and_check(args, devices, rank, world_size, counter) -> list[str]:
    """Build, train and check; returns the failed checks. The model lives only in here, so
    nothing that refers to the process group outlives this call (see :func:`run`)."""
    home = devices[0]
    start_device = torch.cuda.current_device() if home.type == "cuda" else None
    failures: list[str] = []
    torch.manual_seed(args.seed)  # the same model on every rank
    model = SplitModel(args.blocks, args.hidden, args.ffn, devices, DTYPES[args.dtype])
    init_hash = state_hash(model, with_fp8_state=False)
    emit(
        f"rank {rank}/{world_size}: backend {args.backend}, devices "
        f"{[str(d) for d in devices]}, {args.blocks} blocks -> "
        f"{[str(b.device) for b in model.blocks]}, {args.iters} FP8 steps"
    )
    loss = train(args, model, devices, rank, world_size, counter, failures)
    counter.phase = ("verify", args.iters)

    counts = check_collectives(counter, args, home, rank, world_size, failures)
    checked = check_fp8_state_placement(model, failures)
    layout = check_registry(model, home, failures)
    if start_device is not None and torch.cuda.current_device() != start_device:
        failures.append(
            f"current device is cuda:{torch.cuda.current_device()} at the end, "
            f"was cuda:{start_device} at the start"
        )
    final_hash = state_hash(model)
    emit(
        f"rank {rank}: last loss {loss:.6f}; {checked} FP8 state tensors checked; "
        f"amax registry devices: {layout}"
    )
    emit(counts)
    emit(f"FINAL_HASH {final_hash}")

    check_reduced_amaxes(counter, world_size, failures)
    hashes = [None] * world_size
    dist.all_gather_object(hashes, (init_hash, final_hash))
    if len({h[0] for h in hashes}) != 1:
        failures.append(f"ranks built different initial weights: {hashes}")
    if len({h[1] for h in hashes}) != 1:
        failures.append(f"ranks ended with different hashes: {[h[1] for h in hashes]}")
    return failures


def run(args) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    devices = process_devices(args, local_rank, local_world_size)
    home = devices[0]
    init_kwargs = {"timeout": datetime.timedelta(seconds=args.timeout_s)}
    if home.type == "cuda":
        torch.cuda.set_device(home)  # NCCL's device for this process; the library never asks
        if args.backend == "nccl":
            init_kwargs["device_id"] = home
    for device in dict.fromkeys(devices):
        available, reason = te.is_fp8_available(return_reason=True, device=device)
        if not available:
            raise SystemExit(f"rank {rank}: FP8 is not available on {device}: {reason}")

    dist.init_process_group(args.backend, rank=rank, world_size=world_size, **init_kwargs)
    counter = CollectiveCounter(dist.group.WORLD)
    counter.install()
    try:
        failures = run_and_check(args, devices, rank, world_size, counter)
    finally:
        counter.uninstall()
    # After an exception there is no barrier or teardown: the other ranks may be waiting in a
    # collective this rank never joins; torchrun stops them when this process exits non-zero.
    # Drop the references to the process group that outlive the model (the quantization state
    # remembers each autocast's amax_reduction_group; the torch._dynamo import at the top says
    # why the group must not outlive destroy_process_group), then leave together.
    counter.world_group = None
    FP8GlobalStateManager.reset()
    dist.barrier()
    dist.destroy_process_group()

    for failure in failures:
        emit(f"CHECK FAILED rank={rank}: {failure}")
    emit(f"HARNESS rank={rank} {'FAILED' if failures else 'PASSED'}")
    return 1 if failures else 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
