"""A column-parallel GEMM's backward overlaps its collectives with its GEMMs, over real processes.

Every rank runs forward + backward of tensor-parallel layers (a column -> row ``te.Linear``
pair, a column ``te.LayerNormLinear``, a ``te.LayerNormMLP`` with ``set_parallel_mode`` (also
with its ``activation_fn`` replaced), a column ``te.ops.Linear``; with and without sequence parallelism; float32 and DelayedScaling)
and records, in the order the host issues them, the backward's collectives of
``_tensor_parallel`` (all-gathers, reduce-scatters, all-reduces: issued, and for the
asynchronous ones, waited for) and the linear core's GEMMs. Checked, per case:

* the column layer's input-gradient reduction (all-reduce; under sequence parallelism
  reduce-scatter) and, under sequence parallelism, its input's second all-gather are issued
  asynchronously;
* between the issue of every asynchronous collective and the wait for it the host issues a
  GEMM (the gather overlaps the input-gradient GEMM, the reduction the weight-gradient GEMM);
* every asynchronous collective is waited for before the backward returns;
* with ``_parallel_backward.OVERLAP = False`` (the benchmarks' baseline) no GEMM is issued while
  a collective is in flight.

The results themselves are checked against the single-process model by run_tensor_parallel.py
and run_ops_tensor_parallel.py. Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_backward_overlap.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from tp_harness import RecordedWork, case_checks, main, make_recipe, patched_attributes, run_worker

import transformer_engine.pytorch as te
from transformer_engine.pytorch import _parallel_backward as parallel_backward
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.functional import linear as core

SEQ, BATCH, HIDDEN, FFN = 16, 2, 32, 64
CASES = [
    (model, sp, recipe, True)
    for model in ("pair", "layernorm_linear", "mlp", "mlp-act", "ops")
    for sp in (False, True)
    for recipe in (None, "delayed")
]
# the benchmarks' baseline (``_parallel_backward.OVERLAP = False``): nothing in flight over a GEMM
CASES += [("pair", True, None, False), ("mlp", True, "delayed", False), ("ops", False, None, False)]


@contextlib.contextmanager
def recorded_backward_events():
    """``log``: ``("issue", name, async)``, ``("wait", name)`` and ``("gemm", kind)`` events."""
    log, counter = [], itertools.count()

    def collective(kind, original):
        def run(*args, async_op=False, **kwargs):
            name = f"{kind}#{next(counter)}"
            log.append(("issue", name, async_op))
            work = original(*args, async_op=async_op, **kwargs)
            return RecordedWork(work, name, log) if async_op and work is not None else work

        return run

    def gemm(kind, original):
        def run(*args, **kwargs):
            layout = kwargs.get("layout", "TN")
            log.append(("gemm", kind if kind != "fp8" else layout))
            return original(*args, **kwargs)

        return run

    hp = core.hp_gemm_cpu
    hp_stand_in = type("hp", (), {"matmul": staticmethod(gemm("dgrad", hp.matmul))})
    replacements = (
        (tp, "_all_gather_dim0", collective("all_gather", tp._all_gather_dim0)),
        (tp, "_reduce_scatter_dim0", collective("reduce_scatter", tp._reduce_scatter_dim0)),
        (dist, "all_reduce", collective("all_reduce", dist.all_reduce)),
        (core, "fp8_gemm_prevalidated", gemm("fp8", core.fp8_gemm_prevalidated)),
        (core, "_weight_gradient", gemm("wgrad", core._weight_gradient)),
        (core, "hp_gemm_cpu", hp_stand_in),
    )
    with patched_attributes(replacements):
        yield log


def build(model, sp, group, device):
    world = dist.get_world_size(group)
    torch.manual_seed(7)
    kw = {"tp_group": group, "sequence_parallel": sp, "device": device}
    if model == "pair":
        return [te.Linear(HIDDEN, FFN, parallel_mode="column", **kw),
                te.Linear(FFN, HIDDEN, parallel_mode="row", **kw)]  # fmt: skip
    if model == "layernorm_linear":
        return [te.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", **kw)]
    if model.startswith("mlp"):
        mlp = te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, tp_size=world, **kw)
        if model == "mlp-act":  # a replaced activation: FC1 runs as a node of its own
            mlp.activation_fn = lambda x: torch.nn.functional.gelu(x, approximate="tanh")
        return [mlp]
    return [te.ops.Sequential(te.ops.Linear(
        HIDDEN, FFN, tensor_parallel_mode="column", tensor_parallel_group=group,
        sequence_parallel=sp, device=device,
    ))]  # fmt: skip


def backward_events(modules, x, recipe):
    """The events of one backward (the forward runs unrecorded)."""
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = x
        for m in modules:
            out = m(out)
    grad = torch.ones_like(out)
    with recorded_backward_events() as log:
        out.backward(grad)
    return log


def check_events(label, log, sp, overlap=True) -> list[str]:
    failures = []
    issued = {e[1]: i for i, e in enumerate(log) if e[0] == "issue" and e[2]}
    waited = {}  # the first wait for each
    for i, e in enumerate(log):
        if e[0] == "wait":
            waited.setdefault(e[1], i)
    kinds = {name.split("#")[0] for name in issued}
    wanted = {"reduce_scatter", "all_gather"} if sp else {"all_reduce"}
    if not wanted <= kinds:
        failures.append(f"{label}: asynchronous collectives {sorted(kinds)}, want {sorted(wanted)}")
    for name, start in issued.items():
        if name not in waited:
            failures.append(f"{label}: {name} was never waited for")
            continue
        between = [e for e in log[start : waited[name]] if e[0] == "gemm"]
        if overlap and not between:
            failures.append(f"{label}: no GEMM runs while {name} is in flight: {log}")
        if not overlap and between:
            failures.append(f"{label}: without overlap a GEMM runs while {name} is in flight")
    return failures


def check_case(model, sp, recipe_name, overlap, group, device) -> list[str]:
    modules = build(model, sp, group, device)
    torch.manual_seed(11)
    seq = SEQ // dist.get_world_size(group) if sp else SEQ
    x = torch.randn(seq, BATCH, HIDDEN, device=device)
    parallel_backward.OVERLAP = overlap
    try:
        log = backward_events(modules, x, make_recipe(recipe_name))
    finally:
        parallel_backward.OVERLAP = True
    label = f"{model} sp={sp} recipe={recipe_name} overlap={overlap}"
    return check_events(label, log, sp, overlap)


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "BACKWARD_OVERLAP", checks)


if __name__ == "__main__":
    main(worker)
