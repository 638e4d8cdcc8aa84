"""Upstream-conformance probes of te.DotProductAttention, te.MultiheadAttention and
te.TransformerLayer on the CPU path, each against an expectation written from the formulas
(float64 PyTorch), not from the code under test."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import transformer_oracle as oracle
from test_multi_head_attention import randomize

import transformer_engine.pytorch as te

HIDDEN, FFN, HEADS, HEAD_DIM, BATCH = 32, 64, 4, 8, 2


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
@pytest.mark.parametrize(("sq", "skv"), [(0, 0), (4, 0), (0, 4)])
def test_zero_length_sequences(softmax_type, sq, skv):
    """A query over no keys attends to nothing: its output is zero (the convention for fully
    masked rows), and empty queries give an empty output; neither may raise."""
    dpa = te.DotProductAttention(
        HEADS,
        HEAD_DIM,
        qkv_format="bshd",
        attn_mask_type="no_mask",
        softmax_type=softmax_type,
        device="cpu",  # the learnable offset would go to the current CUDA device by default
    )
    q = torch.randn(BATCH, sq, HEADS, HEAD_DIM, requires_grad=True)
    k = torch.randn(BATCH, skv, HEADS, HEAD_DIM, requires_grad=True)
    v = torch.randn(BATCH, skv, HEADS, HEAD_DIM, requires_grad=True)
    out = dpa(q, k, v)
    assert out.shape == (BATCH, sq, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, torch.zeros(BATCH, sq, HEADS * HEAD_DIM))
    out.sum().backward()
    torch.testing.assert_close(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("sequences", [1, 3])
def test_thd_with_only_empty_sequences(sequences):
    """Packed (thd) input with zero tokens, all of its sequences empty: an empty output, and
    the backward runs (zero gradients of nothing)."""
    dpa = te.DotProductAttention(HEADS, HEAD_DIM, qkv_format="thd", attn_mask_type="padding_causal")
    cu_seqlens = torch.zeros(sequences + 1, dtype=torch.int32)
    q = torch.randn(0, HEADS, HEAD_DIM, requires_grad=True)
    out = dpa(q, q, q, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    assert out.shape == (0, HEADS * HEAD_DIM)
    out.sum().backward()
    assert q.grad.shape == q.shape

    layer = te.TransformerLayer(
        HIDDEN, FFN, HEADS, attn_input_format="thd", self_attn_mask_type="padding_causal",
        device="cpu",
    )  # fmt: skip
    x = torch.randn(0, HIDDEN, requires_grad=True)
    y = layer(x, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    assert y.shape == (0, HIDDEN)
    y.sum().backward()


def test_zero_length_max_logit_is_minus_infinity():
    """``return_max_logit`` over no scores: the max of nothing, ``-inf`` per head."""
    dpa = te.DotProductAttention(
        HEADS, HEAD_DIM, qkv_format="bshd", attn_mask_type="no_mask", return_max_logit=True
    )
    empty = torch.randn(BATCH, 0, HEADS, HEAD_DIM)
    out, max_logit = dpa(empty, empty, empty)
    assert out.shape == (BATCH, 0, HEADS * HEAD_DIM)
    torch.testing.assert_close(max_logit, torch.full((HEADS,), float("-inf")))


@pytest.mark.parametrize(
    ("fmt", "shape"), [("sbhd", (0, BATCH, HIDDEN)), ("bshd", (BATCH, 0, HIDDEN))]
)
def test_transformer_layer_on_an_empty_sequence(fmt, shape):
    """Zero tokens in, zero tokens out (the input's shape), and zero gradients."""
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, attn_input_format=fmt, device="cpu")
    x = torch.randn(shape, requires_grad=True)
    out = layer(x)
    assert out.shape == shape
    out.sum().backward()
    assert x.grad.shape == shape
    fc1_grad = layer.layernorm_mlp.fc1_weight.grad
    torch.testing.assert_close(fc1_grad, torch.zeros_like(fc1_grad))


@pytest.mark.parametrize("enc_dec_mask_type", ["no_mask", "padding"])
def test_decoder_layer_kv_cache_decoding_matches_the_oracle(enc_dec_mask_type):
    """A decoder layer decoding with a KV cache (a 3-token prompt, then one token a step)
    gives, at every position, the float64 full causal forward: the cross attention attends
    over the whole encoder_output each step (its keys must not enter the self attention's
    cache, which shares the layer_number)."""
    total, prompt, enc_len, groups = 6, 3, 5, 2
    layer = te.TransformerLayer(
        HIDDEN, FFN, HEADS, num_gqa_groups=groups, layer_type="decoder", layer_number=2,
        attn_input_format="bshd", enc_dec_attn_mask_type=enc_dec_mask_type, device="cpu",
    ).eval()  # fmt: skip
    randomize(layer)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, total, HIDDEN, generator=gen)
    enc = torch.randn(BATCH, enc_len, HIDDEN, generator=gen)
    enc_unpadded = torch.zeros(BATCH, 1, 1, enc_len, dtype=torch.bool)  # the oracle: no mask

    def enc_dec_mask(queries):
        if enc_dec_mask_type == "no_mask":
            return None
        return torch.zeros(BATCH, 1, 1, queries, dtype=torch.bool), enc_unpadded

    params = te.InferenceParams(BATCH, 8, groups, HIDDEN // HEADS, torch.float32, qkv_format="bshd")
    outputs = []
    for start, count in [(0, prompt)] + [(t, 1) for t in range(prompt, total)]:
        params.pre_step(OrderedDict((seq, count) for seq in range(BATCH)))
        outputs.append(
            layer(x[:, start : start + count], encoder_output=enc,
                  enc_dec_attn_mask=enc_dec_mask(count), self_attn_mask_type="padding_causal",
                  inference_params=params)
        )  # fmt: skip
    expected = oracle.transformer_layer(
        layer, x.double(), encoder_output=enc.double(), mask_type="causal"
    )  # fmt: skip
    torch.testing.assert_close(torch.cat(outputs, dim=1).double(), expected, rtol=1e-5, atol=1e-5)


def test_cross_attention_ignores_the_kv_cache():
    """A standalone cross-attention MultiheadAttention handed inference_params while decoding:
    each step's queries attend over the whole encoder_output (the float64 oracle), and the
    cache is neither allocated nor written for it."""
    total, prompt, enc_len = 5, 3, 4
    mha = te.MultiheadAttention(
        HIDDEN, HEADS, attention_type="cross", attn_mask_type="no_mask", layer_number=1,
        qkv_format="bshd", attention_dropout=0.0, input_layernorm=True, device="cpu",
    )  # fmt: skip
    randomize(mha)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(BATCH, total, HIDDEN, generator=gen)
    enc = torch.randn(BATCH, enc_len, HIDDEN, generator=gen)
    params = te.InferenceParams(BATCH, 8, HEADS, HIDDEN // HEADS, torch.float32)
    outputs = []
    for start, count in [(0, prompt)] + [(t, 1) for t in range(prompt, total)]:
        params.pre_step(OrderedDict((seq, count) for seq in range(BATCH)))
        outputs.append(
            mha(x[:, start : start + count], encoder_output=enc, inference_params=params)
        )
    expected, _, _ = oracle.mha(mha, x.double(), encoder_output=enc.double())
    torch.testing.assert_close(torch.cat(outputs, dim=1).double(), expected, rtol=1e-5, atol=1e-5)
    assert 1 not in params.cache_manager.cache


def test_backend_cache_importable_from_the_package():
    """Upstream's attention tests do ``from transformer_engine.pytorch.attention
    .dot_product_attention import DotProductAttention, _attention_backends`` and set
    ``_attention_backends["backend_selection_requires_update"] = True``: the name must be the
    module's cache itself, not a copy."""
    import importlib

    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends

    module = importlib.import_module(
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
    )
    assert _attention_backends is module._attention_backends
    assert "backend_selection_requires_update" in _attention_backends


def test_flash_attention_utils_reads_as_not_installed():
    """Upstream's attention tests import ``FlashAttentionUtils`` from
    ``dot_product_attention.utils`` and skip flash-attn-only cases on its flags and versions
    (compared with packaging's Version); this package never calls the flash-attn package."""
    from packaging.version import Version

    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    assert not FlashAttentionUtils.is_installed and not FlashAttentionUtils.v3_is_installed
    assert not FlashAttentionUtils.v2_plus and not FlashAttentionUtils.use_v3
    assert FlashAttentionUtils.version < Version("2.1.1") <= FlashAttentionUtils.version_required
    assert FlashAttentionUtils.fa3_version < Version("3.0.0b1")


def test_residual_add_skips_an_empty_bias():
    """Upstream's modules built with ``bias=False`` return an empty tensor as their bias
    (``return_bias``); the layer's residual add must skip it, as upstream's ``numel() != 0``
    check does, rather than broadcast ``[s, b, h] + [0]``."""
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, device="cpu")
    out, residual = torch.randn(3, BATCH, HIDDEN), torch.randn(3, BATCH, HIDDEN)
    added = layer._bias_dropout_add(out, torch.empty(0), residual, None, True)
    torch.testing.assert_close(added, residual + out)
