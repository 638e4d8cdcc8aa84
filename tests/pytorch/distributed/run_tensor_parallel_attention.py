"""Tensor / sequence parallelism of ``MultiheadAttention`` and ``TransformerLayer`` over real
processes, held to the single-process module built from the same full weights.

Every rank builds the same full module from one seed, then the tensor-parallel module
(``set_parallel_mode=True``, ``tp_size`` ranks) whose parameters are this rank's shards of the
full ones: a parameter marked ``tensor_model_parallel`` is the ``partition_dim`` chunk of the
full one, any other is a copy. Both run the same steps and every rank checks the output, the
input gradient and every parameter gradient (shards gathered along their ``partition_dim``;
under sequence parallelism the replicated parameters' gradients are partial sums over this
rank's tokens, all-reduced here as a training framework does). Under sequence parallelism the
input and the output gradient are split along dim 0 (sbhd) and the output gathered back.

Run under torchrun (NCCL on GPUs):

    torchrun --standalone --nproc_per_node=2 \\
        tests/pytorch/distributed/run_tensor_parallel_attention.py --backend nccl

or through ``worker(rank, world_size, backend, out_dir, init_method)`` (the gloo test).

Tolerances. float32: the parallel module computes every head exactly as the full one; only
the row-parallel projections (attention ``proj``, FC2) add two partial products and then
all-reduce them, and the column-parallel input gradients are likewise sums of per-rank parts,
so results agree to a few float32 ulps of the largest term: every element within
``1e-5 * |reference| + 2e-5 * max|reference| + 1e-6``. The absolute ``1e-6`` is for gradients
that are zero in exact arithmetic (a key bias shifts every score of a query row equally, so
the softmax ignores it): both modules compute them as cancellation noise of about 1e-7. FP8 (current scaling): the weights are built so
that every shard holds the full tensor's largest magnitude and split operands have their amax
reduced over the group (DelayedScaling: ``reduce_amax=True``), so every rank quantizes with
the single-process scales; summation
order can still move a value across an FP8 rounding boundary (one E4M3 step, 2^-3 relative),
hence every element within ``2^-3 * max|reference| + 1e-6`` and 95% within the float32 tolerance.
Under DelayedScaling every module's forward and backward scales must also equal the
single-process module's: exactly on the CPU, within 1e-5 relative on CUDA (whose kernels for
the sharded shapes round a few float32 ulps differently, and so do the amaxes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# This file's directory is on sys.path both under torchrun and from its test.
from tp_harness import case_checks, gather, main, make_recipe, run_worker, spread_maxima, summed
from tp_harness import compare as harness_compare

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.transformer import TransformerLayer

SEQ, BATCH, HIDDEN, HEADS, FFN = 16, 2, 64, 4, 128
STEPS = 2
# (module, sequence_parallel, recipe, extra constructor arguments)
CASES = [
    ("layer", False, None, {}),
    ("layer", True, None, {}),
    ("layer", True, None, {"num_gqa_groups": 2, "fuse_qkv_params": True}),
    ("layer", True, "current", {}),
    ("layer", True, "delayed", {}),
    ("mha", False, None, {"input_layernorm": True}),
    ("mha", True, None, {"input_layernorm": True, "num_gqa_groups": 2}),
    ("mha", True, None, {"fuse_qkv_params": True}),
    ("mha", False, None, {"attention_type": "cross", "input_layernorm": True}),
    ("mha", True, None, {"attention_type": "cross"}),
]


def build(kind, extra, device, **parallel):
    """The module under test: dropouts off, causal self attention (no mask for cross)."""
    if kind == "layer":
        return TransformerLayer(
            HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device=device,
            **extra, **parallel,
        )  # fmt: skip
    mask = "no_mask" if extra.get("attention_type") == "cross" else "causal"
    return MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, attn_mask_type=mask, device=device,
        **extra, **parallel,
    )  # fmt: skip


def build_full(kind, extra, device):
    torch.manual_seed(1234)
    full = build(kind, extra, device)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.1)
            spread_maxima(p)
    return full


def chunk(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank]


def build_parallel(kind, extra, full, sp, group, device):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    par = build(kind, extra, device, tp_group=group, tp_size=world, sequence_parallel=sp,
                set_parallel_mode=True)  # fmt: skip
    whole = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in par.named_parameters():
            src = whole[name]
            if getattr(p, "tensor_model_parallel", False):
                src = chunk(src, p.partition_dim, rank, world)
            p.copy_(src)
    return par


def run(module, x, grad, recipe, encoder):
    x = x.detach().clone().requires_grad_(True)
    kwargs = {} if encoder is None else {"encoder_output": encoder}
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = module(x, **kwargs)
    out.backward(grad)
    return out.detach(), x.grad


def compare(name, got, ref, fp8, failures):
    """The module docstring's tolerances: float32 within ``1e-5 * |reference| +
    2e-5 * max|reference| + 1e-6``, FP8 95% of the elements within it."""
    harness_compare(name, got, ref, fp8, failures, rel_to_max=2e-5, floor=1e-6, fp8_share=0.95)


def compare_scales(tag, full, par) -> list[str]:
    failures = []
    reference = dict(full.named_modules())
    for name, module in par.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict) or "scaling_fwd" not in meta:
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            got, want = meta[key].scale, reference[name].fp8_meta[key].scale
            # On CUDA the sharded GEMMs and norms run kernels chosen for their own shapes, which
            # round a few float32 ulps differently, and so do the amaxes the scales come from.
            same = (
                torch.equal(got, want)
                if got.device.type == "cpu"
                else torch.allclose(got, want, rtol=1e-5, atol=0)
            )
            if not same:
                failures.append(f"{tag} {name or 'module'} {key} scales {got} != {want}")
    return failures


def parallel_grads(par, sp, group):
    """The tensor-parallel gradients as whole tensors, named as in the full module."""
    grads = {}
    for name, p in par.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            grads[name] = gather(p.grad, p.partition_dim, group)
        else:
            grads[name] = summed(p.grad, group) if sp else p.grad
    return grads


def check_case(kind, sp, recipe_name, extra, group, device) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full = build_full(kind, extra, device)
    par = build_parallel(kind, extra, full, sp, group, device)
    fp8 = recipe_name is not None
    failures: list[str] = []
    label = f"{kind} sp={sp} recipe={recipe_name} {extra}"
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device=device)
        encoder = None
        if extra.get("attention_type") == "cross":
            encoder = torch.randn(SEQ // 2, BATCH, HIDDEN, device=device)
        for m in (full, par):
            m.zero_grad(set_to_none=True)
        recipe = make_recipe(recipe_name)
        ref_out, ref_dx = run(full, x, grad, recipe, encoder)
        x_in = chunk(x, 0, rank, world) if sp else x
        g_in = chunk(grad, 0, rank, world) if sp else grad
        enc_in = chunk(encoder, 0, rank, world) if sp and encoder is not None else encoder
        out, dx = run(par, x_in, g_in, recipe, enc_in)
        if sp:
            out, dx = gather(out, 0, group), gather(dx, 0, group)
        tag = f"{label} step {step}"
        compare(f"{tag} output", out, ref_out, fp8, failures)
        compare(f"{tag} input grad", dx, ref_dx, fp8, failures)
        ref_grads = {n: p.grad for n, p in full.named_parameters()}
        got_grads = parallel_grads(par, sp, group)
        if set(got_grads) != set(ref_grads):
            failures.append(f"{tag}: parameters {sorted(got_grads)} != {sorted(ref_grads)}")
        for name, g in got_grads.items():
            if name in ref_grads:
                compare(f"{tag} {name} grad", g, ref_grads[name], fp8, failures)
        if recipe_name == "delayed":
            failures += compare_scales(tag, full, par)
    return failures


def worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    checks = case_checks(CASES, check_case)
    return run_worker(rank, world_size, backend, out_dir, init_method, "TP_ATTN", checks)


if __name__ == "__main__":
    main(worker)
