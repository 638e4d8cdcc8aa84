"""FP8 attention (``fp8_dpa``, emulated) under context parallelism: the sequence split in zig-zag
chunks over 2 and 3 gloo processes (CPU).

Oracle: the same module run on the whole sequence in one process. With delayed scaling's first
step every scale is 1, so Q, K, V, the softmax output and O round to the same values whichever
rows a rank holds, and with a high-precision backward nothing else is rounded: each rank's
output and the gradients of its rows must equal those rows of the whole-sequence run (float32
sums in another order). The dropout mask numbers a row by its position in the whole sequence,
so with the same seed the split run drops what the whole run drops. Current scaling takes a
rank's own amaxes (another scale per rank): close to the whole run, not equal.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from test_context_parallel_gloo import spawn_ranks, zigzag

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.attention.dot_product_attention import (
    DotProductAttention,
    score_blocks,
)

B, H, G, D, HALF = 2, 4, 2, 8, 3  # batch, heads, K/V groups, head dim, rows per chunk
SEED = torch.tensor([0x2468ACE0, 0x13579BDF], dtype=torch.int64)
# name: (qkv_format, attn_mask_type, window_size, attention_dropout, recipe, bf16_backward)
CASES = {
    "bshd-causal": ("bshd", "causal", None, 0.0, "DS", True),
    "sbhd-causal-window": ("sbhd", "causal", (2, 0), 0.0, "DS", True),
    "bshd-no-mask": ("bshd", "no_mask", None, 0.0, "DS", True),
    "bshd-causal-dropout": ("bshd", "causal", None, 0.25, "DS", True),
    "bshd-causal-current": ("bshd", "causal", None, 0.0, "CS", False),
}


def _inputs(cp: int, fmt: str, seed: int = 3):
    """Whole-sequence q, k, v in ``fmt`` and output weights ``[.., h * d]``."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * cp * HALF
    q, k, v = (torch.randn(B, s, n, D, generator=g) for n in (H, G, G))
    w = torch.randn(B, s, H * D, generator=g)
    if fmt == "sbhd":
        q, k, v, w = (t.transpose(0, 1).contiguous() for t in (q, k, v, w))
    return q, k, v, w


def _run(name, q, k, v, w, cp_group=None, cp=1):
    """One FP8 forward + backward of the case: ``(out, [dq, dk, dv])``."""
    fmt, mask_type, window, dropout, recipe, bf16_backward = CASES[name]
    dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt, attn_mask_type=mask_type,
                              window_size=window, attention_dropout=dropout, device="cpu")  # fmt: skip
    if cp_group is not None:
        dpa.set_context_parallel_group(cp_group, list(range(cp)), None, "p2p")
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    recipe = DelayedScaling(fp8_dpa=True) if recipe == "DS" else Float8CurrentScaling(fp8_dpa=True)
    real_seed = score_blocks.dropout_seed
    score_blocks.dropout_seed = lambda device, ctx: SEED.to(device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the emulation is announced once
            with te.autocast(recipe=recipe):
                out = dpa(q, k, v, bf16_backward=bf16_backward)
    finally:
        score_blocks.dropout_seed = real_seed
    (out * w).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _refused_thd(cp):
    dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd",
                              attn_mask_type="padding_causal", device="cpu")  # fmt: skip
    dpa.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "p2p")
    n = 2 * cp * HALF
    x = torch.randn(n, H, D)
    cu = torch.tensor([0, n], dtype=torch.int32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
                dpa(x, x[:, :G], x[:, :G], cu_seqlens_q=cu, cu_seqlens_kv=cu)
    except NotImplementedError as error:
        return str(error)
    return None


def _worker(rank, cp, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cp)
    try:
        results = {}
        for name, (fmt, *_) in CASES.items():
            seq = 0 if fmt == "sbhd" else 1
            q, k, v, w = (zigzag(t, seq, cp, rank) for t in _inputs(cp, fmt))
            results[name] = _run(name, q, k, v, w, dist.group.WORLD, cp)
        results["thd"] = _refused_thd(cp)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=["cp2", "cp3"])
def split_run(request, tmp_path_factory):
    return spawn_ranks(_worker, request.param, tmp_path_factory.mktemp(f"fp8cp{request.param}"))


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[4] == "DS"])
def test_rows_equal_the_whole_sequence_run(split_run, name):
    cp, results = split_run
    fmt = CASES[name][0]
    seq = 0 if fmt == "sbhd" else 1
    whole_out, whole_grads = _run(name, *_inputs(cp, fmt))
    for rank, result in enumerate(results):
        out, grads = result[name]
        torch.testing.assert_close(out, zigzag(whole_out, seq, cp, rank), rtol=1e-5, atol=1e-6)
        for label, got, ref in zip("qkv", grads, whole_grads):
            torch.testing.assert_close(got, zigzag(ref, seq, cp, rank), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, n=label: f"rank {r} d{n}: {m}")  # fmt: skip
    if CASES[name][3] > 0.0:  # the dropout did drop: the run without it differs
        q, k, v, w = _inputs(cp, fmt)
        CASES["_no_dropout"] = (*CASES[name][:3], 0.0, *CASES[name][4:])
        try:
            undropped, _ = _run("_no_dropout", q, k, v, w)
        finally:
            del CASES["_no_dropout"]
        assert not torch.allclose(undropped, whole_out)


def test_current_scaling_is_close_to_the_whole_sequence_run(split_run):
    cp, results = split_run
    whole_out, whole_grads = _run("bshd-causal-current", *_inputs(cp, "bshd"))
    for rank, result in enumerate(results):
        out, grads = result["bshd-causal-current"]
        torch.testing.assert_close(out, zigzag(whole_out, 1, cp, rank), rtol=0.15, atol=0.15)
        for got, ref in zip(grads, whole_grads):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, zigzag(ref, 1, cp, rank), rtol=0.3, atol=0.3)


def test_packed_sequences_are_refused_naming_fp8(split_run):
    _, results = split_run
    for result in results:
        assert result["thd"] is not None and "FP8 attention (fp8_dpa)" in result["thd"]
