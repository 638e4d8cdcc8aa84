"""Communication/GEMM overlap (the modules' ``ub_*`` flags after ``te.initialize_ub``) over real
processes.

Every rank builds two tensor-parallel models under sequence parallelism from the same
parameters: one with every ``ub_*`` flag on (``ub_overlap_ag``, ``ub_overlap_rs``,
``ub_overlap_rs_dgrad``, ``ub_bulk_dgrad``, ``ub_bulk_wgrad``), one without (its collectives are
checked against the single-process model by run_tensor_parallel.py). Models: a column -> row
``te.Linear`` pair, a column ``te.LayerNormLinear`` followed by a row ``te.Linear``, a
``te.LayerNormMLP`` (``set_parallel_mode``; also with its ``activation_fn`` replaced), a
``te.ops.Sequential`` of a column ``BasicLinear``, GELU and a row ``BasicLinear``
(``userbuffers_options``), a ``te.TransformerLayer`` (``ub_tp_comm_overlap``); float32,
DelayedScaling and Float8CurrentScaling; two steps. Checked, per case:

* the output, the input gradient and every parameter gradient equal the plain model's (the
  pipelined reduce-scatter adds the ranks' partial sums in another order: float32 within
  ``1e-5 * max|reference|``, parameter gradients within that plus 1e-6 (the key bias's is zero
  in exact arithmetic: rounding noise), FP8 with run_tensor_parallel.py's FP8 tolerance);
* the forward issues no all-gather or reduce-scatter collective (the column input's gather and
  the row output's reduce-scatter run as point-to-point exchanges, ``world - 1`` per
  pipelined GEMM), the backward no reduce-scatter (the column input gradient's runs with its
  GEMM) and only the column layers' all-gathers of their saved input (the bulk overlap);
* while every exchange is in flight the host issues a GEMM (a chunk's GEMM runs while the
  next chunk travels), and every exchange is waited for.

Run with 2 or 3 ranks (3: the ring's next and previous ranks differ). Under torchrun (NCCL):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_comm_gemm_overlap.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from tp_harness import (
    RecordedWork,
    case_checks,
    compare,
    main,
    make_recipe,
    patched_attributes,
    run_worker,
    spread_maxima,
)

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch import _ring_gemm as ring
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.functional import linear as core

SEQ, BATCH, HIDDEN, FFN = 24, 2, 96, 192
HEADS = 6  # divisible by 2 and 3 ranks
STEPS = 2
CASES = [
    (model, recipe)
    for model in ("pair", "layernorm_linear", "mlp", "mlp-act", "ops", "layer")
    for recipe in (None, "delayed", "current")
]
# operands that do not travel by chunks (block-scaled ones; the column input of an FP8 GEMM
# whose backward runs in high precision): those GEMMs keep their one collective, same results
FALLBACK_RECIPES = {
    "mxfp8": MXFP8BlockScaling,
    "float8_block": Float8BlockScaling,
    "current-hp-backward": lambda: Float8CurrentScaling(backward_override="high_precision"),
}
CASES += [("pair", "mxfp8"), ("mlp", "float8_block"), ("pair", "current-hp-backward")]
UB_FLAGS = dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True,
                ub_bulk_dgrad=True, ub_bulk_wgrad=True)  # fmt: skip


def build(model, group, device, ub: bool):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # every rank its own shards (and below its own rows): chunks a ring mixes up differ
    torch.manual_seed(4321 + rank)
    kw = dict(sequence_parallel=True, tp_group=group, device=device)
    flags = UB_FLAGS if ub else {}
    if model == "pair":
        modules = [
            te.Linear(HIDDEN, FFN, parallel_mode="column", ub_name="qkv" if ub else None,
                      **kw, **flags),
            te.Linear(FFN, HIDDEN, parallel_mode="row", ub_name="proj" if ub else None,
                      **kw, **flags),
        ]  # fmt: skip
    elif model == "layernorm_linear":
        modules = [
            te.LayerNormLinear(HIDDEN, FFN, parallel_mode="column",
                               ub_name="qkv" if ub else None, **kw, **flags),
            te.Linear(FFN, HIDDEN, parallel_mode="row", ub_name="proj" if ub else None,
                      **kw, **flags),
        ]  # fmt: skip
    elif model == "layer":  # ub_tp_comm_overlap hands the flags to QKV, proj, FC1 and FC2
        ub_kw = dict(ub_tp_comm_overlap=True, ub_overlap_rs_dgrad=True) if ub else {}
        modules = [te.TransformerLayer(
            HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, tp_group=group,
            tp_size=world, set_parallel_mode=True, sequence_parallel=True, seq_length=SEQ,
            device=device, **ub_kw,
        )]  # fmt: skip
    elif model == "ops":
        opts = dict(tensor_parallel_group=group, sequence_parallel=True, device=device)
        modules = [te.ops.Sequential(
            te.ops.BasicLinear(HIDDEN, FFN, tensor_parallel_mode="column", **opts,
                               userbuffers_options={"comm_name": "fc1"} if ub else None),
            te.ops.GELU(),
            te.ops.BasicLinear(FFN, HIDDEN, tensor_parallel_mode="row", **opts,
                               userbuffers_options={"comm_name": "fc2"} if ub else None),
        )]  # fmt: skip
    else:
        mlp = te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, tp_size=world, **kw, **flags)
        if model == "mlp-act":  # a replaced activation: FC1 and FC2 run as nodes of their own
            mlp.activation_fn = lambda x: torch.nn.functional.gelu(x, approximate="tanh")
        modules = [mlp]
    for m in modules:
        for p in m.parameters():
            with torch.no_grad():
                p.normal_(0, 0.1)
            spread_maxima(p)
    return modules


@contextlib.contextmanager
def recorded_events():
    """``log``: ``("issue", name)`` for every collective and point-to-point exchange,
    ``("wait", name)``, ``("gemm",)``."""
    log, counter = [], itertools.count()

    def collective(kind, original):
        def run(*args, **kwargs):
            name = f"{kind}#{next(counter)}"
            log.append(("issue", name))
            work = original(*args, **kwargs)
            if isinstance(work, list):
                return [RecordedWork(w, name, log) for w in work]
            return RecordedWork(work, name, log) if work is not None else work

        return run

    def gemm(original):
        def run(*args, **kwargs):
            log.append(("gemm",))
            return original(*args, **kwargs)

        return run

    hp = core.hp_gemm_cpu
    hp_stand_in = type(
        "hp", (), {"matmul": staticmethod(gemm(hp.matmul)), "linear": staticmethod(gemm(hp.linear))}
    )
    replacements = (
        (tp, "_all_gather_dim0", collective("all_gather", tp._all_gather_dim0)),
        (tp, "_reduce_scatter_dim0", collective("reduce_scatter", tp._reduce_scatter_dim0)),
        (ring.dist, "batch_isend_irecv", collective("p2p", dist.batch_isend_irecv)),
        (core, "fp8_gemm_prevalidated", gemm(core.fp8_gemm_prevalidated)),
        (core, "_weight_gradient", gemm(core._weight_gradient)),
        (core, "hp_gemm_cpu", hp_stand_in),
    )
    with patched_attributes(replacements):
        yield log


def check_events(tag, log, world, *, pipelined, allowed) -> list[str]:
    """``pipelined``: the number of GEMMs that exchange by chunks; ``allowed``: the collective
    kinds that may still run as one collective."""
    failures = []
    names = [e[1] for e in log if e[0] == "issue"]
    p2p = [n for n in names if n.startswith("p2p")]
    if len(p2p) != pipelined * (world - 1):
        failures.append(f"{tag}: {len(p2p)} exchanges, want {pipelined * (world - 1)}")
    extra = sorted({n.split("#")[0] for n in names} - {"p2p", *allowed})
    if extra:
        failures.append(f"{tag}: collectives {extra} ran (pipelined ones expected)")
    for name in p2p:
        start = log.index(("issue", name))
        waits = [i for i, e in enumerate(log) if e == ("wait", name)]
        if not waits:
            failures.append(f"{tag}: {name} was never waited for")
            continue
        if not any(e[0] == "gemm" for e in log[start : waits[0]]):
            failures.append(f"{tag}: no GEMM runs while {name} is in flight")
    return failures


def run_forward(modules, x, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = x
        for m in modules:
            out = m(out)
    return out


def run(modules, x, grad, recipe, log_events=False):
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        with recorded_events() if log_events else contextlib.nullcontext([]) as forward_log:
            out = x
            for m in modules:
                out = m(out)
    with recorded_events() if log_events else contextlib.nullcontext([]) as backward_log:
        out.backward(grad)
    return out.detach(), x.grad, forward_log, backward_log


def _raises(failures, label, error, match, call) -> None:
    try:
        call()
    except error as e:
        if match not in str(e):
            failures.append(f"{label}: {error.__name__} without {match!r}: {e}")
    else:
        failures.append(f"{label}: no {error.__name__}")


def check_setup_errors(piped, world, device) -> list[str]:
    """``initialize_ub``'s checks and a forward that needs it (``destroy_ub`` undoes it)."""
    from transformer_engine.pytorch.module.base import get_ub

    failures: list[str] = []
    x = torch.randn(SEQ // world, BATCH, HIDDEN, device=device)

    def forward():
        out = x
        for m in piped:
            out = m(out)

    _raises(failures, "forward before initialize_ub", RuntimeError, "initialize_ub", forward)
    shape = [SEQ * BATCH, HIDDEN]
    _raises(failures, "tp_size", ValueError, "does not divide",
            lambda: te.initialize_ub(shape, world + 1))  # fmt: skip
    _raises(failures, "shape", ValueError, "multiple of tp_size",
            lambda: te.initialize_ub([SEQ * BATCH + 1, HIDDEN], world))  # fmt: skip
    _raises(failures, "method", ValueError, "['method']='ring'",
            lambda: te.initialize_ub(shape, world, ub_cfgs={"fc1_fprop": {"method": "ring"}}))  # fmt: skip
    te.initialize_ub(shape, 1, ub_cfgs={"qkv_fprop": {"method": "bulk", "num_sm": 4}})
    _raises(failures, "twice", RuntimeError, "destroy_ub", lambda: te.initialize_ub(shape, 1))
    if get_ub("qkv_fprop").method != "bulk" or get_ub("qkv_fprop").options != {"num_sm": 4}:
        failures.append(f"ub_cfgs not recorded: {get_ub('qkv_fprop')}")
    if (get_ub("fc1_fprop").method, get_ub("proj_fprop").method) != ("ring_exchange", "pipeline"):
        failures.append("default methods differ from upstream's")
    _raises(failures, "tp_size mismatch", RuntimeError, "tp_size=1", forward)
    te.destroy_ub()
    return failures


def recipe_of(name):
    return FALLBACK_RECIPES[name]() if name in FALLBACK_RECIPES else make_recipe(name)


def check_case(model, recipe_name, group, device) -> list[str]:
    world = dist.get_world_size(group)
    plain, piped = build(model, group, device, False), build(model, group, device, True)
    failures: list[str] = []
    if model == "pair" and recipe_name is None:
        failures += check_setup_errors(piped, world, device)
    te.initialize_ub([SEQ * BATCH, HIDDEN], world)
    fp8 = recipe_name is not None
    try:
        for step in range(STEPS):
            torch.manual_seed(100 + step + 1000 * dist.get_rank(group))
            x = torch.randn(SEQ // world, BATCH, HIDDEN, device=device)
            grad = torch.randn(SEQ // world, BATCH, HIDDEN, device=device)
            tag = f"{model} recipe={recipe_name} step {step}"
            for m in plain + piped:
                m.zero_grad(set_to_none=True)
            want = run(plain, x, grad, recipe_of(recipe_name))
            got = run(piped, x, grad, recipe_of(recipe_name), log_events=step == 0)
            compare(f"{tag} output", got[0], want[0], fp8, failures)
            if step == 0 and recipe_name != "delayed":  # (delayed: inference moves no scale)
                with torch.no_grad():  # the inference path of each node
                    inference = run_forward(piped, x, recipe_of(recipe_name))
                compare(f"{tag} output without grad", inference, want[0], fp8, failures)
            compare(f"{tag} input grad", got[1], want[1], fp8, failures)
            named = dict(torch.nn.ModuleList(plain).named_parameters())
            for name, p in torch.nn.ModuleList(piped).named_parameters():
                # floor: the key bias's gradient is zero in exact arithmetic (softmax ignores a
                # shift of a row's scores), so both runs hold rounding noise of about 1e-7
                # whose own maximum is no scale for the other's
                compare(f"{tag} {name} grad", p.grad, named[name].grad, fp8, failures,
                        floor=1e-6)  # fmt: skip
            if step == 0 and recipe_name in FALLBACK_RECIPES:
                # block-scaled operands cannot be split by rows: every collective stays one;
                # with the high-precision backward the row GEMM's per-tensor FP8 input and
                # both backward gradients still can (the column input is gathered at once)
                hp_backward = recipe_name == "current-hp-backward"
                for log, pipes in ((got[2], int(hp_backward)), (got[3], 2 * hp_backward)):
                    failures += check_events(f"{tag}", log, world, pipelined=pipes,
                                             allowed=("all_gather", "reduce_scatter"))  # fmt: skip
            elif step == 0:
                pairs = 2 if model == "layer" else 1  # (attention, MLP)
                # forward: the column gathers and the row reduce-scatters, one each a pair
                failures += check_events(f"{tag} forward", got[2], world, pipelined=2 * pairs,
                                         allowed=())  # fmt: skip
                # backward: the row gradients' gathers and the column gradients' reductions
                # by chunks; the column inputs gathered again for their weight gradient
                failures += check_events(f"{tag} backward", got[3], world, pipelined=2 * pairs,
                                         allowed=("all_gather",))  # fmt: skip
    finally:
        te.destroy_ub()
    return failures


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "UB_OVERLAP", checks)


if __name__ == "__main__":
    main(worker)
