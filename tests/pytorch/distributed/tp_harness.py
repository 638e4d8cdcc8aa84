"""What the tensor-parallel workers of this folder and their tests share.

Worker side (the ``run_*.py`` scripts, one process per rank):

* ``run_worker``: pick the rank's device (NCCL: ``LOCAL_RANK``'s GPU; gloo: the CPU), join the
  process group, run the checks on a group of every rank, write ``rank<r>.json`` and print the
  ``<LABEL>_RESULT`` / ``<LABEL>_FAILURE`` lines, leave the group;
* ``main``: the torchrun entry point (``--backend``, ``--out``; exit 1 on any failure);
* ``RecordedWork``, ``patched_attributes``: a work object that logs the wait for it, and
  attributes replaced for a block (the overlap workers' event logs);
* ``recorded_gathers`` / ``high_precision_gathers``: log what ``_tensor_parallel``'s all-gathers
  send, and switch the FP8 gathers off (the path before them: gather, then cast);
* ``make_recipe``, ``make_quantizer``, ``spread_maxima``, ``shard``, ``gather``, ``summed``,
  ``compare``, ``compare_step``, ``compare_bitwise``, ``recipe_state``: recipes, per-tensor FP8
  quantizers, weights whose every shard holds the whole tensor's amax, a rank's shard and the
  collectives that rebuild whole tensors, and the comparisons against the single-process run.

Test side: ``check_gloo_run`` spawns the worker on 2 gloo processes and checks every rank's
result file; ``run_torchrun`` runs a worker script on 2 GPUs under torchrun (NCCL).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.tensor.float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
)

HERE = Path(__file__).resolve().parent

# --- worker side ---------------------------------------------------------------------------------


# A gloo process group whose ranks all compute on cuda:0: the workers' checks with the native
# kernels on a machine of one GPU (gloo carries the CUDA tensors through host memory).
GLOO_ON_ONE_GPU = "gloo-on-one-gpu"


def run_worker(rank, world_size, backend, out_dir, init_method, label, checks):
    """Run ``checks(group, device) -> (failures, cases)`` on this rank and report the result;
    returns the failures. ``backend``: ``"nccl"`` (a GPU a rank), ``"gloo"`` (the CPU) or
    :data:`GLOO_ON_ONE_GPU`."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)  # NCCL's process device; the library never asks
    elif backend == GLOO_ON_ONE_GPU:
        device, backend = torch.device("cuda", 0), "gloo"
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        failures, cases = checks(group, device)
        if out_dir is not None:
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump({"failures": failures, "cases": cases}, f)
        print(f"{label}_RESULT rank={rank} cases={cases} failures={len(failures)}")
        for line in failures[:20]:
            print(f"{label}_FAILURE rank={rank} {line}")
        return failures
    finally:
        # No process group outlives the run in the package's state or in dead modules (a gloo
        # group destroyed at interpreter finalization can abort the process).
        FP8GlobalStateManager.reset()
        gc.collect()
        dist.destroy_process_group()


class RecordedWork:
    """An asynchronous collective's work object that logs the wait for it in ``log`` (the
    overlap workers' event logs)."""

    def __init__(self, work, name, log):
        self.work, self.name, self.log = work, name, log

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.name))
        return self.work.wait(*args, **kwargs)


@contextlib.contextmanager
def patched_attributes(replacements):
    """Set ``(owner, name, value)`` attributes for the ``with`` block, then restore them (in
    reverse order) whatever happens: the overlap workers' recording wrappers."""
    originals = []
    try:
        for owner, name, value in replacements:
            originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def case_checks(cases, check_case):
    """The ``checks`` of :func:`run_worker` that runs ``check_case(*case, group, device) ->
    failures`` for every case of ``cases`` and reports ``len(cases)`` cases."""

    def checks(group, device):
        failures = []
        for case in cases:
            failures += check_case(*case, group, device)
        return failures, len(cases)

    return checks


def main(worker):
    """The torchrun entry point of a worker script."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    failed = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.backend, args.out)
    raise SystemExit(1 if failed else 0)


@contextlib.contextmanager
def recorded_gathers():
    """Every all-gather of ``_tensor_parallel`` as ``(dtype, bytes sent by this rank)``."""
    original, log = tp._all_gather_dim0, []

    def recording(out, src, group=None, async_op=False):
        log.append((src.dtype, src.numel() * src.element_size()))
        return original(out, src, group=group, async_op=async_op)

    tp._all_gather_dim0 = recording
    try:
        yield log
    finally:
        tp._all_gather_dim0 = original


@contextlib.contextmanager
def high_precision_gathers():
    """The gathers before FP8 gathers: high precision, then the cast."""
    original = tp.gathers_fp8
    tp.gathers_fp8 = lambda quantizer: False
    try:
        yield
    finally:
        tp.gathers_fp8 = original


def make_recipe(name):
    """``"delayed"`` (amaxes reduced over the group, as sequence parallelism needs),
    ``"current"``, or ``None`` for high precision."""
    if name == "delayed":
        return DelayedScaling(amax_history_len=4, reduce_amax=True)
    if name == "current":
        return Float8CurrentScaling()
    return None


def make_quantizer(kind, device, fp8_dtype):
    """A per-tensor FP8 quantizer: ``"delayed"`` (scale 3) or ``"current"`` scaling."""
    if kind == "delayed":
        scale = torch.full((1,), 3.0, device=device)
        return Float8Quantizer(scale, torch.zeros(1, device=device), fp8_dtype)
    return Float8CurrentScalingQuantizer(fp8_dtype)


def spread_maxima(w: torch.Tensor) -> None:
    """Put the tensor's largest magnitude in every half along each dimension, so every
    tensor-parallel shard has the same amax as the whole tensor."""
    with torch.no_grad():
        idx = [[0, s // 2] if s > 1 else [0] for s in w.shape]
        if w.dim() == 1:
            for i in idx[0]:
                w[i] = 0.5
        else:
            for i in idx[0]:
                for j in idx[1]:
                    w[i, j] = 0.5


def gather(t, dim, group):
    """The whole tensor from every rank's shard along ``dim``."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard(t, dim, rank, world):
    """Rank ``rank``'s block of ``t`` along ``dim`` (a copy)."""
    return t.chunk(world, dim=dim)[rank].clone()


def compare_step(tag, run_full, run_parallel, x, grad, sp, group, fp8, failures) -> None:
    """One step of the single-process model and its tensor-parallel version on the same data:
    ``run_*(x, grad) -> (output, input gradient)``; the parallel one takes this rank's rows
    under sequence parallelism (``sp``), gathered again before the comparison."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ref_out, ref_dx = run_full(x, grad)
    if sp:
        x, grad = shard(x, 0, rank, world), shard(grad, 0, rank, world)
    out, dx = run_parallel(x, grad)
    if sp:
        out, dx = gather(out, 0, group), gather(dx, 0, group)
    compare(f"{tag} output", out, ref_out, fp8, failures)
    compare(f"{tag} input grad", dx, ref_dx, fp8, failures)


def summed(t, group):
    """The sum over the group of every rank's ``t`` (``t`` itself unchanged)."""
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


# FP8 GEMMs on a GPU (cuBLAS; the forward in fast-accumulation mode) keep fewer bits than
# float32 while they accumulate, so a GEMM split over the ranks rounds its partial sums
# differently from the whole one: both ranks of the tensor-parallel runs on one H200 (gloo)
# differed from the single-process model by up to 1.3e-4 of the largest value, where the CPU's
# exact emulation differs by float32 ulps. On CUDA the FP8 cases' close share is measured
# against this bound instead of the float32 tolerance (a scale mismatch between ranks, the
# failure it exists to catch, moves values by percents).
CUDA_FP8_REL_TO_MAX = 2**-10


def compare(name, got, ref, fp8, failures, *, rel_to_max=1e-5, floor=0.0, fp8_share=0.98):
    """float32: every element within ``rel_to_max * max|ref| + 1e-5 * |ref| + floor``; FP8:
    every element within ``2^-3 * max|ref| + floor`` and ``fp8_share`` of them within that tolerance
    (on CUDA with ``rel_to_max`` at least ``CUDA_FP8_REL_TO_MAX``). A miss is appended to
    ``failures``."""
    if fp8 and got.device.type == "cuda":
        rel_to_max = max(rel_to_max, CUDA_FP8_REL_TO_MAX)
    got, ref = got.double().cpu(), ref.double().cpu()
    if got.shape != ref.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        return
    scale = ref.abs().max().item() or 1.0
    err = (got - ref).abs()
    tight = err <= rel_to_max * scale + 1e-5 * ref.abs() + floor
    if fp8:
        # ``floor`` also bounds the hard limit: a gradient that is zero in exact arithmetic is
        # noise whose own maximum says nothing about the FP8 rounding of the others.
        hard = bool((err <= 2**-3 * scale + floor).all())
        ok = hard and tight.double().mean().item() >= fp8_share
    else:
        ok = bool(tight.all())
    if not ok:
        failures.append(
            f"{name}: max err {err.max().item():.3e} (scale {scale:.3e}), "
            f"{100 * tight.double().mean().item():.1f}% within {rel_to_max:.1e} of it"
        )


def compare_bitwise(tag, got, want, failures) -> None:
    """Two runs' ``(name, tensor or None)`` lists must name the same values, bitwise equal."""
    if [n for n, _ in got] != [n for n, _ in want]:
        failures.append(f"{tag}: the runs produced different results lists")
        return
    for (name, a), (_, b) in zip(got, want):
        if a is None or b is None:
            if a is not b:
                failures.append(f"{tag} {name}: one run has no value")
        elif not torch.equal(a.cpu(), b.cpu()):
            err = (a.double() - b.double()).abs().max().item()
            failures.append(f"{tag} {name}: not bitwise equal (max diff {err:.3e})")


def recipe_state(modules):
    """``(name, tensor)`` for every module's delayed-scaling scales and amax histories."""
    state = []
    for i, m in enumerate(modules):
        for key in ("scaling_fwd", "scaling_bwd"):
            meta = m.fp8_meta.get(key)
            if meta is not None and hasattr(meta, "scale"):
                state.append((f"{i}.{key}.scale", meta.scale))
                state.append((f"{i}.{key}.amax_history", meta.amax_history))
    return state


# --- test side -----------------------------------------------------------------------------------


def _gloo_rank(rank, worker, world_size, out_dir, init_file, backend):
    worker(rank, world_size, backend, out_dir, init_method=f"file://{init_file}")


def check_gloo_run(worker, tmp_path, cases, world_size=2, backend="gloo") -> None:
    """Spawn ``worker`` on ``world_size`` gloo processes (``backend``: ``"gloo"`` on the CPU,
    or :data:`GLOO_ON_ONE_GPU`); every rank must have run ``cases`` cases without a failure."""
    args = (worker, world_size, str(tmp_path), str(tmp_path / "init"), backend)
    mp.spawn(_gloo_rank, args=args, nprocs=world_size, join=True)
    for rank in range(world_size):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["cases"] == cases, f"rank {rank} ran {result['cases']} cases, not {cases}"
        assert result["failures"] == [], "\n".join(result["failures"])


def run_torchrun(script, out_dir=None, world_size=2) -> subprocess.CompletedProcess:
    """Run ``script`` of this folder under torchrun with NCCL; it must exit 0 and, with
    ``out_dir``, every rank's result file must list no failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world_size}", str(HERE / script), "--backend", "nccl"]  # fmt: skip
    if out_dir is not None:
        cmd += ["--out", str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if out_dir is not None:
        for rank in range(world_size):
            result = json.loads((Path(out_dir) / f"rank{rank}.json").read_text())
            assert result["failures"] == [], "\n".join(result["failures"])
    return proc
