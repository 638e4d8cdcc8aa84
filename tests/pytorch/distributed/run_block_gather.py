"""FP8 all-gather of block-scaled tensors (``Float8BlockScaling``, MXFP8) under sequence
parallelism, over real processes.

Oracles:

* the cast of the gathered tensor: ``gather_along_first_dim(x, group, quantizer=...)``,
  ``sequence_parallel_gemm_input`` + ``regather_fp8_shard`` and ``sequence_parallel_grad_output``
  against a fresh quantizer casting the whole tensor in one process. Row-wise and column-wise
  bytes and scales (every buffer, padding included) must be identical. When every rank's rows
  are a multiple of the block the copies travel as ``uint8``; when they are not, the copies
  whose blocks straddle ranks (column-wise, 2-D blocks) go back to the high-precision gather
  (then the activation dtype is on the wire) while row-wise-only gathers still move bytes;
* the path before these gathers: the sequence-parallel models (a column -> row ``te.Linear``
  pair, a ``te.LayerNormMLP``) run twice from the same parameters, once as built and once with
  ``_tensor_parallel.gathers_block_fp8`` patched to refuse every quantizer (gather in high
  precision, cast afterwards). Outputs, input gradients and parameter gradients must be
  bitwise equal; the first run's gathers all ``uint8``, the second's the activation dtype;
* memory: the column-parallel layer saves the local column-wise shard for backward instead of
  the gathered tensor's column-wise copy.

Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_block_gather.py \
        --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from tp_harness import compare_bitwise, main, recorded_gathers, run_worker

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling, MXFP8BlockScaling
from transformer_engine.pytorch import _tensor_parallel as tp
from transformer_engine.pytorch.functional.linear import LinearConfig
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

# kind -> (quantizer factory, rows one block spans along the tokens)
KINDS = {
    "float8_1x128": (lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True,
                                                  columnwise=True, block_scaling_dim=1), 128),
    "float8_128x128": (lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True,
                                                    columnwise=True, block_scaling_dim=2), 128),
    "mxfp8": (lambda: MXFP8Quantizer(torch.float8_e4m3fn), 32),
    "mxfp8_32x32": (lambda: MXFP8Quantizer(torch.float8_e5m2, with_2d_quantization=True), 32),
}  # fmt: skip
USAGES = ((True, False), (False, True), (True, True))
BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")
FEATURES = 200  # a partial 128 / 32 block at the end of every row

SEQ, BATCH, HIDDEN, FFN = 128, 2, 32, 64  # 128 local tokens on each of 2 ranks
STEPS = 2
RECIPES = {"float8_block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}
MODEL_CASES = [
    (model, recipe, dtype)
    for model in ("pair", "mlp")
    for recipe in RECIPES
    for dtype in (torch.bfloat16, torch.float32)
]
DIRECT_CASES = len(KINDS) * 2 * len(USAGES) + len(KINDS) * 2 * 2


@contextlib.contextmanager
def high_precision_block_gathers():
    """The path before block-scaled FP8 gathers: high precision, then the cast."""
    original = tp.gathers_block_fp8
    tp.gathers_block_fp8 = lambda quantizer: False
    try:
        yield
    finally:
        tp.gathers_block_fp8 = original


def full_and_local(group, device, dtype, local_rows):
    """The whole tensor ``[world * local_rows / 2, 2, FEATURES]`` and this rank's rows of
    it. Magnitudes change every 32 rows and 64 columns (and one large value sits in rank 0's
    rows), so neighbouring blocks get different scales and a misplaced one shows."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(11)
    rows = torch.arange(world * local_rows, device=device).reshape(-1, 2, 1)
    cols = torch.arange(FEATURES, device=device)
    magnitude = 2.0 ** ((rows // 32) % 5 + (cols // 64) % 3)
    full = torch.randn(world * local_rows // 2, 2, FEATURES, device=device) * magnitude
    full = full.to(dtype)
    full[0, 1, 3] = 300.0
    return full, full.chunk(world)[rank].contiguous()


def same_buffers(tag, got, want, names, failures) -> None:
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            shapes = [None if t is None else tuple(t.shape) for t in (a, b)]
            failures.append(f"{tag}: {name} differs from the whole cast ({shapes})")
    for name in set(BUFFERS) - set(names):
        if getattr(got, name) is not None:
            failures.append(f"{tag}: {name} present though not asked for")


def oracle_cast(kind, full, rowwise, columnwise):
    q = KINDS[kind][0]()
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    return q.quantize(full)


def names_of(rowwise, columnwise):
    return BUFFERS[:2] * rowwise + BUFFERS[2:] * columnwise


def exact(kind, local_rows, rowwise, columnwise) -> bool:
    """Whether no block of the copies asked for straddles two ranks (the test's own rule)."""
    block = KINDS[kind][1]
    spans = columnwise or kind.endswith(("128x128", "32x32"))
    return local_rows % block == 0 or (rowwise and not spans)


def check_direct_gather(group, device, failures) -> None:
    for kind, (make, block) in KINDS.items():
        for local_rows in (block * 2, 6):
            for rowwise, columnwise in USAGES:
                dtype = torch.bfloat16
                full, local = full_and_local(group, device, dtype, local_rows)
                q = make()
                q.set_usage(rowwise=rowwise, columnwise=columnwise)
                with recorded_gathers() as log:
                    got, handle = tp.gather_along_first_dim(local, group, quantizer=q)
                tag = f"direct {kind} rows={local_rows} row={rowwise} col={columnwise}"
                want = oracle_cast(kind, full, rowwise, columnwise)
                same_buffers(tag, got, want, names_of(rowwise, columnwise), failures)
                if type(got) is not type(want) or tuple(got.shape) != tuple(full.shape):
                    failures.append(f"{tag}: result {type(got).__name__} {tuple(got.shape)}")
                if handle is not None:
                    failures.append(f"{tag}: a synchronous gather returned a handle")
                data_gathers = [n for d, n in log if n == local.numel()]
                if exact(kind, local_rows, rowwise, columnwise):
                    if {d for d, _ in log} != {torch.uint8}:
                        failures.append(f"{tag}: gathered {log}, expected uint8 only")
                    if len(data_gathers) != rowwise + columnwise:
                        failures.append(f"{tag}: gathered {log}, expected one per copy")
                elif log != [(dtype, local.numel() * 2)]:
                    failures.append(f"{tag}: gathered {log}, expected the BF16 fallback")
                if (q.rowwise_usage, q.columnwise_usage) != (rowwise, columnwise):
                    failures.append(f"{tag}: the quantizer's usages were not restored")
                if rowwise and not columnwise and exact(kind, local_rows, True, False):
                    # Row-wise bytes only: the call may return before they arrive.
                    got, handle = tp.gather_along_first_dim(local, group, True, quantizer=q)
                    if handle is None:
                        failures.append(f"{tag}: async_op=True returned no handle")
                    else:
                        handle.wait()
                    same_buffers(f"{tag} async", got, want, BUFFERS[:2], failures)


def check_sequence_parallel(group, device, failures) -> None:
    """The column-parallel input's gather and re-gather, and the output gradient's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for kind, (make, block) in KINDS.items():
        for local_rows in (block * 2, 6):
            full, local = full_and_local(group, device, torch.bfloat16, local_rows)
            whole = full.reshape(-1, FEATURES)
            tag = f"sp input {kind} rows={local_rows}"
            config = LinearConfig(fp8=True, input_quantizer=make())
            with recorded_gathers() as log:
                gathered, leading, shard = tp.sequence_parallel_gemm_input(local, group, config)
                again = None if shard is None else tp.regather_fp8_shard(shard, group)
            if tuple(leading) != tuple(full.shape[:-1]):
                failures.append(f"{tag}: leading shape {leading}")
            if exact(kind, local_rows, True, True):
                want = oracle_cast(kind, whole, True, True)
                same_buffers(tag, gathered, want, BUFFERS[:2], failures)
                local_cast = oracle_cast(kind, local.reshape(-1, FEATURES), False, True)
                same_buffers(f"{tag} shard", shard, local_cast, BUFFERS[2:], failures)
                same_buffers(f"{tag} re-gather", again, want, BUFFERS[2:], failures)
                if {d for d, _ in log} != {torch.uint8}:
                    failures.append(f"{tag}: gathered {log}, expected uint8 only")
            elif shard is not None or not torch.equal(gathered, full):
                failures.append(f"{tag}: expected the high-precision gather, got {gathered!r}")

            for rowwise, columnwise in ((True, True), (True, False)):
                tag = f"sp grad {kind} rows={local_rows} row={rowwise} col={columnwise}"
                config = LinearConfig(fp8=True, grad_output_quantizer=make())
                with recorded_gathers() as log:
                    got = tp.sequence_parallel_grad_output(
                        local, group, config, rowwise=rowwise, columnwise=columnwise
                    )
                if exact(kind, local_rows, rowwise, columnwise):
                    want = oracle_cast(kind, whole, rowwise, columnwise)
                    same_buffers(tag, got, want, names_of(rowwise, columnwise), failures)
                    if {d for d, _ in log} != {torch.uint8}:
                        failures.append(f"{tag}: gathered {log}, expected uint8 only")
                elif not isinstance(got, torch.Tensor) or not torch.equal(got, full):
                    failures.append(f"{tag}: expected the high-precision gather")
    del rank, world


def build(model, dtype, group, device):
    torch.manual_seed(1234)
    kw = dict(sequence_parallel=True, tp_group=group, params_dtype=dtype, device=device)
    if model == "pair":
        modules = [
            te.Linear(HIDDEN, FFN, parallel_mode="column", **kw),
            te.Linear(FFN, HIDDEN, parallel_mode="row", **kw),
        ]
    else:
        modules = [te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, **kw)]
    for m in modules:
        for p in m.parameters():
            with torch.no_grad():
                p.normal_(0, 0.1)
    return modules


def model_input(dtype, group, device, step):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(100 + step)
    x = torch.randn(SEQ * world, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
    g = torch.randn(SEQ * world, BATCH, HIDDEN, device=device).to(dtype).chunk(world)[rank]
    return x.contiguous().requires_grad_(True), g.contiguous()


def run_steps(modules, recipe_name, dtype, group, device):
    results = []
    for step in range(STEPS):
        x, g = model_input(dtype, group, device, step)
        for m in modules:
            m.zero_grad(set_to_none=True)
        with te.autocast(recipe=RECIPES[recipe_name](), amax_reduction_group=group):
            out = x
            for m in modules:
                out = m(out)
        out.backward(g)
        results += [("out", out.detach()), ("dx", x.grad)]
        for i, m in enumerate(modules):
            results += [(f"{i}.{n}.grad", p.grad) for n, p in m.named_parameters()]
    return results


def check_model(model, recipe_name, dtype, group, device, failures) -> None:
    tag = f"{model} {recipe_name} {dtype}"
    fp8_modules = build(model, dtype, group, device)
    hp_modules = build(model, dtype, group, device)
    with recorded_gathers() as fp8_log:
        fp8 = run_steps(fp8_modules, recipe_name, dtype, group, device)
    with high_precision_block_gathers(), recorded_gathers() as hp_log:
        hp = run_steps(hp_modules, recipe_name, dtype, group, device)
    values = SEQ * BATCH * HIDDEN  # this rank's values of the input and of the gradient
    hp_bytes = values * torch.tensor([], dtype=dtype).element_size()
    # Per step, one gather per FP8 copy: the input's row-wise bytes (forward), the output
    # gradient's row-wise and column-wise bytes, the input shard's column-wise bytes
    # (re-gather); the rest of the uint8 gathers are their scales.
    data = [n for d, n in fp8_log if n == values]
    if {d for d, _ in fp8_log} != {torch.uint8} or len(data) != 4 * STEPS:
        failures.append(f"{tag}: FP8 run gathered {fp8_log}")
    if len(fp8_log) != 8 * STEPS:
        failures.append(f"{tag}: FP8 run made {len(fp8_log)} gathers, expected {8 * STEPS}")
    if hp_log != [(dtype, hp_bytes)] * (2 * STEPS):
        failures.append(f"{tag}: high-precision run gathered {hp_log}")
    compare_bitwise(tag, fp8, hp, failures)


def saved_bytes(model, recipe_name, group, device):
    """``(uint8 bytes, all bytes)`` saved for backward by one forward of the column layer."""
    modules = build(model, torch.bfloat16, group, device)[:1]
    x, _ = model_input(torch.bfloat16, group, device, 0)
    sizes = []

    def pack(t):
        sizes.append((t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=RECIPES[recipe_name](), amax_reduction_group=group):
            modules[0](x)
    return sum(n for d, n in sizes if d == torch.uint8), sum(n for _, n in sizes)


def check_saved_memory(group, device, failures) -> int:
    world = dist.get_world_size(group)
    cases = 0
    for model in ("pair", "mlp"):
        for recipe_name in RECIPES:
            cases += 1
            fp8_u8, fp8_all = saved_bytes(model, recipe_name, group, device)
            with high_precision_block_gathers():
                hp_u8, hp_all = saved_bytes(model, recipe_name, group, device)
            tag = f"saved memory {model} {recipe_name}"
            # The gathered column-wise copy (world * 128 tokens) becomes the local one (128
            # tokens): its bytes, and MXFP8's uint8 scales, shrink by world (whole blocks).
            saving = (hp_u8 - fp8_u8) * world == (world - 1) * hp_u8 if model == "pair" else True
            if not (fp8_all < hp_all and fp8_u8 < hp_u8 and saving):
                failures.append(
                    f"{tag}: saved {fp8_u8} uint8 / {fp8_all} bytes, {hp_u8} / {hp_all} with "
                    "the high-precision gather; expected the local shard's"
                )
    return cases


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    def checks(group, device):
        failures: list[str] = []
        check_direct_gather(group, device, failures)
        check_sequence_parallel(group, device, failures)
        for model, recipe_name, dtype in MODEL_CASES:
            check_model(model, recipe_name, dtype, group, device, failures)
        cases = DIRECT_CASES + len(MODEL_CASES) + check_saved_memory(group, device, failures)
        return failures, cases

    return run_worker(rank, world_size, backend, out_dir, init_method, "BLOCK_GATHER", checks)


if __name__ == "__main__":
    main(worker)
