"""KV-cache decoding through DotProductAttention + InferenceParams equals the full causal
forward: a prompt, then one token per step, for sequences of different lengths; bshd, sbhd
and thd queries; grouped-query attention; paged and non-paged caches (CPU)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_dpa_numerics import FP32_TOL, bhsd, oracle_attention, oracle_keep, oracle_output

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.inference import InferenceParams


def full_forward(q, k, v):
    """The reference: each sequence's causal attention over all of its tokens (float64)."""
    b, s = q.shape[:2]
    keep = oracle_keep(b, s, s, mask_type="causal")
    return oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "bshd")


def to_step_format(x, lengths, fmt):
    """The new tokens ``x`` ([b, s, h, d], sequence i's first ``lengths[i]`` real) in ``fmt``."""
    if fmt == "bshd":
        return x
    if fmt == "sbhd":
        return x.transpose(0, 1)
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def from_step_output(out, lengths, fmt):
    """Per-sequence outputs ``[n_i, h*d]`` of one step."""
    if fmt == "sbhd":
        out = out.transpose(0, 1)
    if fmt == "thd":
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        return [out[starts[i] : starts[i] + n] for i, n in enumerate(lengths)]
    return [out[i, :n] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
@pytest.mark.parametrize("groups", [4, 2])
def test_decoding_equals_full_forward(fmt, paged, groups):
    b, total, h, d = 2, 10, 4, 8
    prompts = [4, 6]  # sequence 1 starts with a longer prompt
    gen = torch.Generator().manual_seed(40)
    q = torch.randn(b, total, h, d, generator=gen)
    k = torch.randn(b, total, groups, d, generator=gen)
    v = torch.randn(b, total, groups, d, generator=gen)
    expected = full_forward(q, k, v)
    paging = {"is_paged": True, "page_size": 2, "total_num_pages": b * 12 // 2} if paged else {}
    params = InferenceParams(b, 12, num_heads_kv=groups, head_dim_k=d, dtype=torch.float32,
                             qkv_format=fmt, max_ctx_len=8 if fmt == "thd" else None,
                             device="cpu", **paging)  # fmt: skip
    layer = 3
    params.allocate_memory(layer)
    dpa = DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=fmt,
                              attn_mask_type="padding_causal", layer_number=layer)  # fmt: skip
    totals = [8, total]  # causal: sequence 0's outputs are the full forward's first 8 rows
    done = [0, 0]
    step_lengths = prompts
    while done != totals:
        live = [0, 1]
        params.pre_step(OrderedDict((i, step_lengths[i]) for i in live))
        width = max(step_lengths)
        new = []
        for t in (q, k, v):
            block = torch.zeros(b, width, *t.shape[2:])
            for i in live:
                block[i, : step_lengths[i]] = t[i, done[i] : done[i] + step_lengths[i]]
            new.append(to_step_format(block, step_lengths, fmt))
        out = dpa(*new, inference_params=params)
        for i, got in enumerate(from_step_output(out, step_lengths, fmt)):
            want = expected[i, done[i] : done[i] + step_lengths[i]]
            torch.testing.assert_close(got.double(), want, **FP32_TOL)
        done = [s + n for s, n in zip(done, step_lengths)]
        step_lengths = [1, 1]
    assert dpa.attention_type == "cross"


def test_kv_cache_needs_a_padding_mask_type():
    params = InferenceParams(1, 4, num_heads_kv=2, head_dim_k=4, dtype=torch.float32, device="cpu")
    params.allocate_memory(1)
    params.pre_step(OrderedDict({0: 2}))
    dpa = DotProductAttention(2, 4, qkv_format="bshd", attn_mask_type="causal")
    x = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="padding mask type"):
        dpa(x, x, x, inference_params=params)


@pytest.mark.parametrize("alibi", [False, True], ids=["window", "window_alibi"])
def test_padding_mask_keeps_its_bottom_right_diagonal_while_decoding(alibi):
    """``attn_mask_type="padding"`` keeps its bottom-right diagonal with a KV cache (only
    ``padding_causal`` is rewritten): a decoded token at position t with window (2, 0) sees
    keys t-2..t, and ALiBi counts distances from t, as in the full forward (a top-left diagonal
    would measure both from key 0 of the cache)."""
    b, total, prompt, h, d = 2, 7, 3, 4, 8
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(b, total, h, d, generator=gen) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0])
    keep = oracle_keep(b, total, total, mask_type="padding", window=(2, 0))
    pos = torch.arange(total, dtype=torch.float64)
    bias = -slopes.double().view(1, h, 1, 1) * (pos.view(-1, 1) - pos.view(1, -1)).abs()
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep, bias=bias if alibi else None)
    expected = oracle_output(expected, "bshd")
    extra = {"core_attention_bias_type": "alibi", "alibi_slopes": slopes} if alibi else {}
    params = InferenceParams(b, 8, num_heads_kv=h, head_dim_k=d, dtype=torch.float32, device="cpu")
    params.allocate_memory(1)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding", window_size=(2, 0))
    done = 0
    for step in [prompt] + [1] * (total - prompt):
        params.pre_step(OrderedDict((i, step) for i in range(b)))
        new = (t[:, done : done + step] for t in (q, k, v))
        out = dpa(*new, inference_params=params, **extra)
        want = expected[:, done : done + step]
        torch.testing.assert_close(out.double(), want, **FP32_TOL)
        done += step
