"""DotProductAttention on CPU against the float64 oracle of test_dpa_numerics: thd (packed
variable-length sequences) against each sequence alone and against the same sequences padded,
biases and ALiBi, softmax types, packed qkv/kv inputs, the maximum logit."""

from __future__ import annotations

import pytest
import torch
from test_dpa_numerics import (
    FP32_TOL,
    bhsd,
    oracle_attention,
    oracle_keep,
    oracle_output,
    random_qkv,
)

from transformer_engine.pytorch.attention.dot_product_attention import (
    DotProductAttention,
    score_blocks,
)
from transformer_engine.pytorch.attention.dot_product_attention.problem import AttentionProblem


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# --- thd -----------------------------------------------------------------------------------------
def pack_thd(x_bshd, lengths, starts, total):
    """Tokens ``[:len]`` of each sequence at ``starts[b]`` of a ``[total, h, d]`` tensor (the
    gaps hold garbage, which must not leak into the result)."""
    out = torch.full((total, *x_bshd.shape[2:]), 1e3, dtype=x_bshd.dtype)
    for b, (n, start) in enumerate(zip(lengths, starts)):
        out[start : start + n] = x_bshd[b, :n]
    return out.detach().requires_grad_()


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("between", [False, True], ids=["dense", "pad_between_seqs"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_thd_against_each_sequence(mask_type, between, cross):
    h, d = 2, 4
    lens_q = [3, 5, 1]
    lens_kv = [4, 2, 6] if cross else lens_q
    smax, kvmax = max(lens_q), max(lens_kv)
    q, k, v = random_qkv(3, smax, kvmax, h, h, d, seed=11)
    gap = 2 if between else 0
    starts_q = [0, 3 + gap, 8 + 2 * gap]
    starts_kv = [0, 4 + gap, 6 + 2 * gap] if cross else starts_q
    total_q = starts_q[-1] + lens_q[-1] + gap
    total_kv = starts_kv[-1] + lens_kv[-1] + gap
    q_thd = pack_thd(q, lens_q, starts_q, total_q)
    k_thd = pack_thd(k, lens_kv, starts_kv, total_kv)
    v_thd = pack_thd(v, lens_kv, starts_kv, total_kv)
    cu_q, cu_kv = cu(lens_q), cu(lens_kv)
    pad_q = torch.tensor([*starts_q, total_q], dtype=torch.int32)
    pad_kv = torch.tensor([*starts_kv, total_kv], dtype=torch.int32)
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type=mask_type)
    out = dpa(
        q_thd, k_thd, v_thd, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=pad_q if between else None,
        cu_seqlens_kv_padded=pad_kv if between else None,
        max_seqlen_q=None if cross else smax, pad_between_seqs=between,
    )  # fmt: skip
    assert out.shape == (total_q, h * d)
    expected = torch.zeros(total_q, h * d, dtype=torch.float64)
    for b in range(3):
        nq, nkv = lens_q[b], lens_kv[b]
        keep = oracle_keep(1, nq, nkv, mask_type=mask_type)
        ref = oracle_attention(bhsd(q[b : b + 1, :nq]), bhsd(k[b : b + 1, :nkv]),
                               bhsd(v[b : b + 1, :nkv]), keep=keep)  # fmt: skip
        expected[starts_q[b] : starts_q[b] + nq] = oracle_output(ref, "bshd")[0]
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    out.backward(torch.ones_like(out))
    assert torch.all(k_thd.grad[lens_kv[0] : starts_kv[1]] == 0), "gap tokens get no gradient"


def test_thd_equals_padded_bshd():
    h, d, lens = 2, 8, [4, 6, 2]
    q, k, v = random_qkv(3, 6, 6, h, h, d, seed=12)
    pad = torch.arange(6)[None, :] >= torch.tensor(lens)[:, None]
    bshd = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding_causal")
    out_padded = bshd(q, k, v, attention_mask=pad.view(3, 1, 1, 6))
    starts = [0, 4, 10]
    thd = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal")
    tensors = [pack_thd(t, lens, starts, 12) for t in (q, k, v)]
    out_thd = thd(*tensors, cu_seqlens_q=cu(lens), cu_seqlens_kv=cu(lens))
    for b, (n, start) in enumerate(zip(lens, starts)):
        torch.testing.assert_close(out_thd[start : start + n], out_padded[b, :n], **FP32_TOL)


def test_thd_needs_cu_seqlens():
    dpa = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="padding")
    t = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        dpa(t, t, t)


# --- biases and ALiBi ----------------------------------------------------------------------------
@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
@pytest.mark.parametrize("shape", ["1hss", "bhss", "b1ss", "11ss"])
def test_core_attention_bias(bias_type, shape):
    b, s, h, d, scale = 2, 5, 3, 4, 0.7
    q, k, v = random_qkv(b, s, s, h, h, d, seed=13)
    dims = [b if c == "b" else h if c == "h" else s for c in "bhss"]
    dims = [1 if shape[i] == "1" else n for i, n in enumerate(dims)]
    bias = torch.randn(*dims, generator=torch.Generator().manual_seed(2)).requires_grad_()
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal", softmax_scale=scale)
    out = dpa(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
    ref_bias = bias.double() * (scale if bias_type == "pre_scale_bias" else 1.0)
    keep = oracle_keep(b, s, s, mask_type="causal")
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep, bias=ref_bias, scale=scale)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)
    bias_ref = bias.detach().double().requires_grad_()
    ref_bias = bias_ref * (scale if bias_type == "pre_scale_bias" else 1.0)
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep, bias=ref_bias, scale=scale)
    grad = torch.randn(b, s, h * d, dtype=torch.float64)
    out.backward(grad.float())
    oracle_output(expected, "bshd").backward(grad)
    torch.testing.assert_close(bias.grad.double(), bias_ref.grad, rtol=1e-4, atol=1e-5)


def reference_alibi_slopes(n):
    """The ALiBi paper's slopes, written from its description."""

    def power_of_two(m):
        start = 2 ** (-8 / m)
        return [start ** (i + 1) for i in range(m)]

    if (n & (n - 1)) == 0:
        return power_of_two(n)
    closest = 2 ** (n.bit_length() - 1)
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("slopes_kind", ["default", "h", "bh"])
@pytest.mark.parametrize("mask_type,sq,skv", [("causal", 6, 6), ("no_mask", 4, 7),
                                              ("causal_bottom_right", 4, 7)])  # fmt: skip
@pytest.mark.parametrize("heads", [3, 4])
def test_alibi(slopes_kind, mask_type, sq, skv, heads):
    b, d = 2, 4
    q, k, v = random_qkv(b, sq, skv, heads, heads, d, seed=14)
    if slopes_kind == "default":
        slopes, ref = None, torch.tensor(reference_alibi_slopes(heads)).view(1, heads, 1, 1)
    elif slopes_kind == "h":
        slopes = torch.rand(heads)
        ref = slopes.view(1, heads, 1, 1)
    else:
        slopes = torch.rand(b, heads)
        ref = slopes.view(b, heads, 1, 1)
    bottom_right = mask_type != "causal"
    offset = skv - sq if bottom_right else 0
    i, j = torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)
    bias = -ref.double() * (j - i - offset).abs().double()
    dpa = DotProductAttention(heads, d, qkv_format="bshd", attn_mask_type=mask_type)
    out = dpa(q, k, v, core_attention_bias_type="alibi", alibi_slopes=slopes)
    keep = oracle_keep(b, sq, skv, mask_type=mask_type)
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep, bias=bias)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)


def test_bias_errors():
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="needs core_attention_bias"):
        dpa(q, q, q, core_attention_bias_type="post_scale_bias")
    with pytest.raises(ValueError, match="broadcast"):
        dpa(q, q, q, core_attention_bias_type="post_scale_bias",
            core_attention_bias=torch.zeros(1, 3, 3, 3))  # fmt: skip
    with pytest.raises(ValueError, match="core_attention_bias_type"):
        dpa(q, q, q, core_attention_bias_type="bogus")
    with pytest.raises(ValueError, match="alibi_slopes"):
        dpa(q, q, q, core_attention_bias_type="alibi", alibi_slopes=torch.ones(3))


# --- softmax types -------------------------------------------------------------------------------
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("mask_type", ["causal", "padding"])
def test_softmax_types(softmax_type, mask_type):
    b, s, h, d = 2, 5, 3, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=15)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type,
                              softmax_type=softmax_type, device=q.device)  # fmt: skip
    lens = torch.tensor([5, 2])
    pad = (torch.arange(s)[None, :] >= lens[:, None]).view(b, 1, 1, s)
    kwargs = {"attention_mask": pad} if mask_type == "padding" else {}
    if softmax_type == "learnable":
        assert torch.equal(dpa.softmax_offset.detach(), torch.zeros(h)), "zero init"
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0]))
        offset = dpa.softmax_offset.detach().double().requires_grad_()
    else:
        offset = 0.0
    out = dpa(q, k, v, **kwargs)
    padded = mask_type == "padding"
    keep = oracle_keep(b, s, s, mask_type=mask_type, lens_q=lens if padded else None,
                       lens_kv=lens if padded else None)  # fmt: skip
    q_ref = q.detach().double().requires_grad_()
    expected = oracle_attention(bhsd(q_ref), bhsd(k), bhsd(v), keep=keep, offset=offset)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)
    grad = torch.randn(b, s, h * d, dtype=torch.float64)
    out.backward(grad.float())
    oracle_output(expected, "bshd").backward(grad)
    torch.testing.assert_close(q.grad.double(), q_ref.grad, rtol=1e-4, atol=1e-5)
    if softmax_type == "learnable":
        torch.testing.assert_close(dpa.softmax_offset.grad.double(), offset.grad, rtol=1e-4,
                                   atol=1e-5)  # fmt: skip


# --- packed inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleave_dim", [-3, -2])
def test_packed_qkv_layer(fmt, interleave_dim):
    b, s, h, d = 2, 4, 2, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=16)
    stack = torch.stack([q, k, v], dim=interleave_dim).detach()  # [b, s, 3, h, d] / [b, s, h, 3, d]
    mask_type = "padding_causal" if fmt == "thd" else "causal"
    kwargs = {}
    if fmt == "sbhd":
        packed = stack.transpose(0, 1).contiguous()
    elif fmt == "bshd":
        packed = stack
    else:
        packed = stack.reshape(b * s, *stack.shape[2:])
        kwargs = {"cu_seqlens_q": cu([s, s]), "cu_seqlens_kv": cu([s, s])}
    dpa = DotProductAttention(h, d, qkv_format=fmt, attn_mask_type=mask_type)
    out = dpa(qkv_layer=packed.requires_grad_(), qkv_interleave_dim=interleave_dim, **kwargs)
    keep = oracle_keep(b, s, s, mask_type="causal")
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "bshd")
    if fmt == "sbhd":
        expected = expected.transpose(0, 1)
    elif fmt == "thd":
        expected = expected.reshape(b * s, -1)
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    out.sum().backward()
    assert packed.grad.shape == packed.shape


def test_packed_kv_layer():
    b, sq, skv, h, d = 2, 3, 5, 2, 4
    q, k, v = random_qkv(b, sq, skv, h, h, d, seed=17)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="no_mask",
                              attention_type="cross")  # fmt: skip
    out = dpa(q, kv_layer=torch.stack([k, v], dim=2).detach())
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v))
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)
    with pytest.raises(ValueError, match="kv_layer goes with query_layer"):
        dpa(q, k, kv_layer=torch.stack([k, v], dim=2))
    with pytest.raises(ValueError, match="qkv_interleave_dim"):
        dpa(qkv_layer=torch.stack([q, q, q], dim=2), qkv_interleave_dim=-2)


# --- maximum logit -------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_max_logit_in_blocks(monkeypatch, rows):
    # the pass that serves return_max_logit beside a kernel's output, in blocks of `rows`
    # queries: GQA, a materialized mask with a fully masked row, a bias without a batch dim
    b, sq, skv, h, g, d, scale = 2, 7, 9, 4, 2, 8, 0.3
    q, k, _ = random_qkv(b, sq, skv, h, g, d, seed=21)
    bias = torch.randn(h, sq, skv)
    keep = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(22)) < 0.6
    keep[1, 0, 2] = False  # a query without keys
    monkeypatch.setattr(score_blocks, "SCORE_BLOCK_BYTES", rows * 4 * b * h * skv)
    problem = AttentionProblem(bhsd(q), bhsd(k), bhsd(k), keep=keep, bias=bias, scale=scale)
    got = score_blocks.max_logit_in_blocks(problem)
    kb = bhsd(k).double().repeat_interleave(h // g, 1)
    scores = bhsd(q).double() @ kb.transpose(-1, -2) * scale + bias.double()
    expected = scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got.double(), expected, **FP32_TOL)


def test_return_max_logit():
    b, s, h, d, scale = 2, 5, 3, 4, 0.5
    q, k, v = random_qkv(b, s, s, h, h, d, seed=18)
    bias = torch.randn(1, h, s, s)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal",
                              softmax_scale=scale, return_max_logit=True)  # fmt: skip
    out, max_logit = dpa(q, k, v, core_attention_bias_type="post_scale_bias",
                         core_attention_bias=bias)  # fmt: skip
    scores = bhsd(q).double() @ bhsd(k).double().transpose(-1, -2) * scale + bias.double()
    keep = oracle_keep(b, s, s, mask_type="causal").expand_as(scores)
    expected = scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    assert max_logit.shape == (h,) and max_logit.dtype == torch.float32
    torch.testing.assert_close(max_logit.double(), expected, **FP32_TOL)
    assert out.shape == (b, s, h * d)
