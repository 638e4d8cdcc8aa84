"""DotProductAttention against an independent float64 oracle on CPU: every format, mask type,
GQA, window, bias/ALiBi and softmax type, thd against the same sequences padded, packed
inputs, gradients and the maximum logit.

The oracle (``oracle_keep`` / ``oracle_attention``) is written here from the definitions: the
visibility of every (query, key) pair decided by plain Python loops, then a float64 softmax
with the masked entries left out. Other test_dpa_* files import it from this module.
"""

from __future__ import annotations

import math

import pytest
import torch

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention

# --- the oracle ------------------------------------------------------------------------------


def oracle_keep(batch, sq, skv, *, mask_type, window=None, bottom_right=None, lens_q=None,
                lens_kv=None, q_pad=None, kv_pad=None):  # fmt: skip
    """Bool ``[b, 1, sq, skv]``, True where query i of sequence b may see key j.

    ``lens_*``: actual lengths (default full); ``q_pad``/``kv_pad``: ``[b, s]`` True = padded
    (default: the positions past the lengths). ``window=(left, right)``, -1 unbounded; causal
    types have right bound 0. The diagonal is bottom-right for ``*_bottom_right`` masks and,
    when ``bottom_right`` is None, for non-causal masks too (upstream's defaults).
    """
    causal = "causal" in mask_type
    if bottom_right is None or causal:
        bottom_right = mask_type.endswith("bottom_right") or (
            not causal and bottom_right is not False
        )
    left, right = window if window is not None else (-1, 0 if causal else -1)
    if causal:
        right = 0
    keep = torch.zeros(batch, 1, sq, skv, dtype=torch.bool)
    for b in range(batch):
        lq = sq if lens_q is None else int(lens_q[b])
        lkv = skv if lens_kv is None else int(lens_kv[b])
        offset = (lkv - lq) if bottom_right else 0
        for i in range(sq):
            if (q_pad is not None and q_pad[b, i]) or (q_pad is None and i >= lq):
                continue
            for j in range(skv):
                if (kv_pad is not None and kv_pad[b, j]) or (kv_pad is None and j >= lkv):
                    continue
                if right >= 0 and j > i + offset + right:
                    continue
                if left >= 0 and j < i + offset - left:
                    continue
                keep[b, 0, i, j] = True
    return keep


def oracle_attention(q, k, v, *, keep=None, bias=None, scale=None, offset=None):
    """float64 ``softmax(q k^T * scale + bias) v`` over the kept keys; ``q``:
    ``[b, hq, sq, d]``, ``k``/``v``: ``[b, hkv, skv, d]``. ``offset``: per-head extra
    denominator term ``exp(offset_h)`` (a ``[hq]`` tensor; 0.0 for off-by-one). Rows with no
    kept key give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    if keep is None:
        keep = torch.ones_like(scores, dtype=torch.bool)
    keep = keep.expand_as(scores)
    neg = torch.finfo(torch.float64).min
    row_max = scores.masked_fill(~keep, neg).amax(-1, keepdim=True)
    if offset is not None:
        off = torch.as_tensor(offset, dtype=torch.float64).reshape(-1)
        off = off.expand(q.shape[1]).view(1, -1, 1, 1)
        row_max = torch.maximum(row_max, off)
    row_max = row_max.detach()
    exps = torch.exp((scores - row_max).masked_fill(~keep, float("-inf")))
    denom = exps.sum(-1, keepdim=True)
    if offset is not None:
        denom = denom + torch.exp(off - row_max)
    probs = torch.where(denom > 0, exps / torch.where(denom > 0, denom, 1.0), 0.0)
    return probs @ v


def to_format(x_bshd, fmt):
    """A ``[b, s, h, d]`` tensor in ``fmt`` (``sbhd`` or ``bshd``), as a new leaf."""
    out = x_bshd.transpose(0, 1).contiguous() if fmt == "sbhd" else x_bshd.contiguous()
    return out.detach().requires_grad_(x_bshd.requires_grad)


def from_format(x, fmt):
    """The ``[b, s, ...]`` view of ``x`` in ``fmt``."""
    return x.transpose(0, 1) if fmt == "sbhd" else x


def oracle_output(out_bhsd, fmt):
    """``[b, h, s, d]`` oracle -> the module's output layout ``[s, b, h*d]`` / ``[b, s, h*d]``."""
    b, h, s, d = out_bhsd.shape
    merged = out_bhsd.transpose(1, 2).reshape(b, s, h * d)
    return merged.transpose(0, 1) if fmt == "sbhd" else merged


def random_qkv(b, sq, skv, hq, hkv, d, dv=None, dtype=torch.float32, seed=0):
    """bshd ``q, k, v`` with requires_grad."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, skv, hkv, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, skv, hkv, dv, generator=g).to(dtype).requires_grad_()
    return q, k, v


def bhsd(x_bshd):
    return x_bshd.transpose(1, 2)


FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}

# --- formats and mask types ------------------------------------------------------------------
MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right"]  # fmt: skip


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", MASKS)
@pytest.mark.parametrize("sq,skv", [(7, 7), (5, 9), (9, 5)], ids=["self", "sq<skv", "sq>skv"])
def test_formats_and_mask_types(fmt, mask_type, sq, skv):
    b, h, d = 2, 3, 8
    q, k, v = random_qkv(b, sq, skv, h, h, d, seed=sq * 10 + skv)
    lens_q, lens_kv = torch.tensor([sq, max(sq - 2, 1)]), torch.tensor([skv - 1, skv])
    kwargs = {}
    padding = mask_type.startswith("padding")
    if padding:
        q_pad = torch.arange(sq)[None, :] >= lens_q[:, None]
        kv_pad = torch.arange(skv)[None, :] >= lens_kv[:, None]
        kwargs["attention_mask"] = (q_pad.view(b, 1, 1, sq), kv_pad.view(b, 1, 1, skv))
    dpa = DotProductAttention(h, d, qkv_format=fmt, attn_mask_type=mask_type,
                              attention_type="cross")  # fmt: skip
    qf, kf, vf = (to_format(t, fmt) for t in (q, k, v))
    out = dpa(qf, kf, vf, **kwargs)
    keep = oracle_keep(b, sq, skv, mask_type=mask_type, lens_q=lens_q if padding else None,
                       lens_kv=lens_kv if padding else None)  # fmt: skip
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), fmt)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    # gradients against the oracle's
    grad = torch.randn_like(expected)
    out.backward(grad.float())
    expected.backward(grad)
    for mine, ref in ((qf, q), (kf, k), (vf, v)):
        torch.testing.assert_close(from_format(mine.grad, fmt).double(), ref.grad.double(),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_self_attention_padding_mask_single_tensor():
    """A self-attention padding mask is one ``[b, 1, 1, s]`` tensor, for queries and keys."""
    b, s, h, d = 3, 6, 2, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=3)
    lens = torch.tensor([6, 2, 4])
    pad = torch.arange(s)[None, :] >= lens[:, None]
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding_causal")
    out = dpa(q, k, v, attention_mask=pad.view(b, 1, 1, s))
    keep = oracle_keep(b, s, s, mask_type="padding_causal", lens_q=lens, lens_kv=lens)
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "bshd")
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    assert torch.all(out[1, 2:] == 0), "padded query rows are zeros"


def test_padding_from_cu_seqlens_in_bshd():
    b, s, h, d = 2, 5, 2, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    out = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    lens = torch.tensor([3, 5])
    keep = oracle_keep(b, s, s, mask_type="padding", lens_q=lens, lens_kv=lens)
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "bshd")
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


def test_arbitrary_mask():
    b, s, h, d = 2, 6, 2, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=5)
    g = torch.Generator().manual_seed(1)
    masked = torch.rand(b, h, s, s, generator=g) < 0.4  # True = masked
    masked[0, 0, 2] = True  # a row with nothing to attend to gives zeros
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="arbitrary")
    out = dpa(q, k, v, attention_mask=masked)
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=~masked)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)


# --- GQA / MQA, head dims, scale ---------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding_causal"])
def test_grouped_query_attention(groups, mask_type):
    b, s, h, d, dv = 2, 6, 4, 8, 4
    q, k, v = random_qkv(b, s, s, h, groups, d, dv=dv, seed=groups)
    lens = torch.tensor([6, 3])
    kwargs = {}
    if mask_type.startswith("padding"):
        pad = torch.arange(s)[None, :] >= lens[:, None]
        kwargs["attention_mask"] = pad.view(b, 1, 1, s)
    dpa = DotProductAttention(h, (d, dv), num_gqa_groups=groups, qkv_format="bshd",
                              attn_mask_type=mask_type, softmax_scale=0.3)  # fmt: skip
    out = dpa(q, k, v, **kwargs)
    padded = mask_type.startswith("padding")
    keep = oracle_keep(b, s, s, mask_type=mask_type, lens_q=lens if padded else None,
                       lens_kv=lens if padded else None)  # fmt: skip
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep, scale=0.3)
    assert out.shape == (b, s, h * dv)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)
    out.sum().backward()
    expected.sum().backward()
    assert k.grad is not None


# --- sliding windows ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask_type,window,bottom_right",
    [
        ("causal", (2, 0), None),
        ("causal_bottom_right", (1, 0), None),
        ("no_mask", (1, 2), None),
        ("no_mask", (1, 2), False),
        ("no_mask", (0, 0), True),
        ("padding", (2, 1), None),
        ("padding_causal", (3, 0), None),
        ("padding_causal_bottom_right", (2, 0), None),
    ],
)
@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 7)])
def test_sliding_window(mask_type, window, bottom_right, sq, skv):
    b, h, d = 2, 2, 4
    q, k, v = random_qkv(b, sq, skv, h, h, d, seed=7)
    padding = mask_type.startswith("padding")
    lens_q, lens_kv = torch.tensor([sq, sq - 1]), torch.tensor([skv - 2, skv])
    kwargs = {}
    if padding:
        q_pad = torch.arange(sq)[None, :] >= lens_q[:, None]
        kv_pad = torch.arange(skv)[None, :] >= lens_kv[:, None]
        kwargs["attention_mask"] = (q_pad.view(b, 1, 1, sq), kv_pad.view(b, 1, 1, skv))
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type,
                              window_size=window, bottom_right_diagonal=bottom_right)  # fmt: skip
    out = dpa(q, k, v, **kwargs)
    keep = oracle_keep(
        b,
        sq,
        skv,
        mask_type=mask_type,
        window=window,
        bottom_right=bottom_right,
        lens_q=lens_q if padding else None,
        lens_kv=lens_kv if padding else None,
    )
    expected = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)


def test_window_coercions_warn():
    with pytest.warns(UserWarning, match="right bound"):
        dpa = DotProductAttention(2, 4, attn_mask_type="causal", window_size=(-1, -1))
    assert dpa.window_size == (-1, 0)
    with pytest.warns(UserWarning, match="not"):
        dpa = DotProductAttention(2, 4, attn_mask_type="no_mask", window_size=(-1, 0))
    assert dpa.window_size == (-1, -1)
    with pytest.raises(ValueError, match="window_size"):
        DotProductAttention(2, 4, attn_mask_type="no_mask", window_size=(3, -1))


@pytest.mark.parametrize("window", [(-1, 4), (-1, -2), (-2, 0)])
def test_causal_window_without_a_left_bound_and_a_right_one_is_refused(window):
    """Causal types coerce only (-1, -1) and (w >= 0, r != 0); (-1, r) for another r (and any
    left bound below -1) is neither a window nor "no window"."""
    with pytest.raises(ValueError, match="window_size"):
        DotProductAttention(2, 4, attn_mask_type="causal", window_size=window)


def test_causal_window_with_both_bounds_drops_the_right_one():
    with pytest.warns(UserWarning, match="right bound"):
        dpa = DotProductAttention(2, 4, attn_mask_type="padding_causal", window_size=(3, 2))
    assert dpa.window_size == (3, 0)
