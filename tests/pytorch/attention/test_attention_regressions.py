"""Regressions found by probing the attention stack on the CPU. Each test compares with the
same computation made another way (a run under no_grad, the module on each sequence alone,
the exact batch) or checks the error's message.

* A KV cache (and ``InferenceParams``' lengths) created under ``torch.inference_mode`` stays
  usable outside it: a prefill under inference mode followed by decoding under ``no_grad``.
* ``MultiheadAttention`` on ``thd`` with padding between sequences (``cu_seqlens_*_padded``)
  rotates by the padded offsets when ``pad_between_seqs`` is left at None (inferred), as the
  core attention places the sequences.
* ``MultiheadAttention`` decoding with RoPE accepts a batch with rows past the live
  sequences, and decodes ``thd`` inputs from the cache.
* Bad inputs are refused with messages naming the bad value: an arbitrary mask that does not
  broadcast, ``cu_seqlens`` of the wrong dtype or rank, ``thd`` sides of different batch sizes,
  ``MultiheadAttention`` inputs of the wrong rank for their ``qkv_format``, and a KV cache
  whose dtype differs from the inputs'.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

HIDDEN, HEADS, GROUPS = 16, 4, 2


def _decoding_params(paged: bool) -> InferenceParams:
    paging = dict(is_paged=True, page_size=2, total_num_pages=2 * 8 // 2) if paged else {}
    return InferenceParams(2, 8, GROUPS, HIDDEN // HEADS, torch.float32, qkv_format="bshd",
                           device="cpu", **paging)  # fmt: skip


def _decode(mha, params, prompt, tokens, prefill_context):
    """Prefill ``prompt`` under ``prefill_context``, then decode ``tokens`` one step at a time
    under ``no_grad``; the order of the two sequences swaps after the prefill (rows move)."""
    outputs = []
    params.pre_step(OrderedDict([(0, prompt.shape[1]), (1, prompt.shape[1])]))
    with prefill_context():
        outputs.append(mha(prompt, inference_params=params).clone())
    for step in range(tokens.shape[1]):
        params.pre_step(OrderedDict([(1, 1), (0, 1)]))  # swapped order: the cache rows move
        with torch.no_grad():
            outputs.append(mha(tokens[[1, 0], step : step + 1], inference_params=params))
    return outputs


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
@pytest.mark.parametrize("params_under_inference_mode", [False, True])
def test_kv_cache_made_under_inference_mode_decodes_outside_it(paged, params_under_inference_mode):
    """MultiheadAttention allocates its cache at its first forward; when that forward ran
    under torch.inference_mode, the cache was an inference tensor and the next step's
    in-place write outside inference mode failed ('Inplace update to inference tensor outside
    InferenceMode'). The same for InferenceParams built under inference mode (pre_step updates
    its lengths in place). Now the decoded outputs equal a run made entirely under no_grad."""
    torch.manual_seed(0)
    mha = MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                             attn_mask_type="padding_causal", qkv_format="bshd", device="cpu",
                             layer_number=1)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randn(2, 3, HIDDEN, generator=gen)
    tokens = torch.randn(2, 3, HIDDEN, generator=gen)
    expected = _decode(mha, _decoding_params(paged), prompt, tokens, torch.no_grad)
    if params_under_inference_mode:
        with torch.inference_mode():
            params = _decoding_params(paged)
    else:
        params = _decoding_params(paged)
    got = _decode(mha, params, prompt, tokens, torch.inference_mode)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# --- rotary embeddings with padding between thd sequences ---------------------------------------
@pytest.mark.parametrize("pad_between_seqs", [None, True])
def test_thd_rotary_follows_the_padded_offsets(pad_between_seqs):
    """Sequences of 3 and 5 tokens stored at offsets 0 and 4 (one padding token between):
    each sequence's output equals the module's bshd output on that sequence alone. With
    pad_between_seqs=None the rotary positions of the second sequence were counted from the
    unpadded offset 3, one token early, while the attention itself used the padded offsets."""
    torch.manual_seed(0)
    kwargs = dict(attention_dropout=0.0, device="cpu", input_layernorm=True)
    packed = MultiheadAttention(HIDDEN, HEADS, qkv_format="thd", attn_mask_type="padding_causal",
                                **kwargs)  # fmt: skip
    alone = MultiheadAttention(HIDDEN, HEADS, qkv_format="bshd", attn_mask_type="causal", **kwargs)
    with torch.no_grad():
        for p in packed.parameters():
            p.normal_(0.0, 0.5)  # large enough that one position of rotation shows
    alone.load_state_dict(packed.state_dict())
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 9], dtype=torch.int32)
    freqs = RotaryPositionEmbedding(HIDDEN // HEADS, device="cpu")(16)
    out = packed(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                 cu_seqlens_kv_padded=cu_padded, rotary_pos_emb=freqs,
                 pad_between_seqs=pad_between_seqs)  # fmt: skip
    for start, length in ((0, 3), (4, 5)):
        ref = alone(x[None, start : start + length], rotary_pos_emb=freqs)[0]
        torch.testing.assert_close(out[start : start + length], ref, rtol=1e-5, atol=1e-5)
    # the padding token between the sequences: zero attention, so the projection's bias
    torch.testing.assert_close(out[3], packed.proj.bias, rtol=0, atol=0)


# --- error messages ------------------------------------------------------------------------------
def test_arbitrary_mask_that_does_not_broadcast_is_named():
    """It failed in the mask arithmetic with torch's 'The size of tensor a (3) must match the
    size of tensor b (2) at non-singleton dimension 0'."""
    dpa = DotProductAttention(2, 8, attn_mask_type="arbitrary")
    x = torch.randn(5, 2, 2, 8)  # sbhd: b = 2, sq = skv = 5
    bad = torch.zeros(3, 1, 5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shape \(3, 1, 5, 5\).*\[2, 2, 5, 5\]"):
        dpa(x, x, x, attention_mask=bad)
    with pytest.raises(ValueError, match=r"shape \(2, 1, 4, 5\)"):
        dpa(x, x, x, attention_mask=torch.zeros(2, 1, 4, 5, dtype=torch.bool))
    for good in ((2, 2, 5, 5), (1, 1, 5, 5), (5, 5), (2, 1, 1, 5)):  # still accepted
        dpa(x, x, x, attention_mask=torch.zeros(good, dtype=torch.bool))


@pytest.mark.parametrize(
    "cu, got",
    [
        (torch.tensor([0, 2, 6]), r"torch.int64 \(3,\)"),
        (torch.tensor([[0, 2, 6]], dtype=torch.int32), r"torch.int32 \(1, 3\)"),
    ],
)
def test_cu_seqlens_error_names_what_was_passed(cu, got):
    dpa = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding")
    x = torch.randn(6, 2, 8)
    with pytest.raises(TypeError, match=f"cu_seqlens_q must be a 1-D int32 tensor.*got {got}"):
        dpa(x, x, x, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_thd_batch_mismatch_names_the_cu_seqlens():
    dpa = DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding")
    x = torch.randn(6, 2, 8)
    cu_q = torch.tensor([0, 6], dtype=torch.int32)
    cu_kv = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv must both have"):
        dpa(x, x, x, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_multihead_attention_input_rank_is_checked_against_qkv_format(fmt):
    """A 2-D input to an sbhd/bshd module (or a 3-D one to thd) was reported by
    DotProductAttention as the shape of an internal per-head view of the projection."""
    heads, mask = 2, ("padding" if fmt == "thd" else "no_mask")
    kwargs = dict(qkv_format=fmt, attn_mask_type=mask, device="cpu", attention_dropout=0.0)
    wrong = torch.randn(2, 5, HIDDEN) if fmt == "thd" else torch.randn(5, HIDDEN)
    right = torch.randn(5, HIDDEN) if fmt == "thd" else torch.randn(2, 5, HIDDEN)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32) if fmt == "thd" else None
    seqlens = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    self_attn = MultiheadAttention(HIDDEN, heads, **kwargs)
    with pytest.raises(ValueError, match=f"hidden_states has shape .*qkv_format='{fmt}' needs"):
        self_attn(wrong, **seqlens)
    assert self_attn(right, **seqlens).shape == right.shape
    cross = MultiheadAttention(HIDDEN, heads, attention_type="cross", **kwargs)
    with pytest.raises(ValueError, match=f"encoder_output has shape .*qkv_format='{fmt}'"):
        cross(right, encoder_output=wrong, **seqlens)
    assert cross(right, encoder_output=right, **seqlens).shape == right.shape


def test_kv_cache_dtype_mismatch_names_the_cache():
    """The cache casts new K/V to its dtype; the mismatch was then reported as 'query/key/value
    dtypes differ' between tensors the caller never passed."""
    params = InferenceParams(2, 8, 2, 8, torch.float32, qkv_format="bshd", device="cpu")
    params.allocate_memory(1)
    params.pre_step(OrderedDict([(0, 3), (1, 3)]))
    dpa = DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="padding_causal")
    x = torch.randn(2, 3, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"KV cache holds torch.float32.*dtype=torch.bfloat16"):
        dpa(x, x, x, inference_params=params)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_rotary_decoding_with_rows_past_the_live_batch(fmt):
    """InferenceParams.step accepts a batch with rows past the live sequences (a fixed batch
    whose sequence 1 has finished). With RoPE, MultiheadAttention handed apply_rotary_pos_emb
    one start position per live sequence, and the call was refused ('start_positions has shape
    (1,), expected (2,)'). Row 0 now equals the same decoding run with the exact batch."""
    torch.manual_seed(0)
    mha = MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                             attn_mask_type="padding_causal", qkv_format=fmt, device="cpu")  # fmt: skip
    freqs = RotaryPositionEmbedding(HIDDEN // HEADS, device="cpu")(8)
    gen = torch.Generator().manual_seed(1)
    prompt, tokens = (
        torch.randn(2, 3, HIDDEN, generator=gen),
        torch.randn(2, 2, HIDDEN, generator=gen),
    )
    to_fmt = (lambda t: t) if fmt == "bshd" else (lambda t: t.transpose(0, 1))
    runs = []
    for rows in (2, 1):  # padded batch of 2 rows, then exactly the live batch
        params = InferenceParams(2, 8, GROUPS, HIDDEN // HEADS, torch.float32, qkv_format=fmt,
                                 device="cpu")  # fmt: skip
        params.pre_step(OrderedDict([(0, 3), (1, 3)]))
        mha(to_fmt(prompt), inference_params=params, rotary_pos_emb=freqs)
        outputs = []
        for step in range(tokens.shape[1]):
            params.pre_step(OrderedDict([(0, 1)]))  # sequence 1 has finished
            x = to_fmt(tokens[:rows, step : step + 1])
            outputs.append(to_fmt(mha(x, inference_params=params, rotary_pos_emb=freqs))[0])
        runs.append(outputs)
    for padded, exact in zip(*runs):
        torch.testing.assert_close(padded, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_multihead_attention_decodes_thd_from_the_cache(paged):
    """MultiheadAttention refused inference_params with qkv_format='thd' outright, though the
    core attention decodes thd from the cache; only RoPE there stays refused (as upstream).
    Prompts of 2 and 5 tokens, then one token per step: each output equals the module's causal
    bshd output on that sequence alone."""
    torch.manual_seed(1)
    kwargs = dict(num_gqa_groups=GROUPS, attention_dropout=0.0, device="cpu", input_layernorm=True)
    packed = MultiheadAttention(HIDDEN, HEADS, qkv_format="thd", attn_mask_type="padding_causal",
                                **kwargs)  # fmt: skip
    alone = MultiheadAttention(HIDDEN, HEADS, qkv_format="bshd", attn_mask_type="causal", **kwargs)
    alone.load_state_dict(packed.state_dict())
    totals, x = [6, 8], torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(2))
    expected = [alone(x[i : i + 1, :n])[0] for i, n in enumerate(totals)]
    paging = dict(is_paged=True, page_size=4, total_num_pages=2 * 16 // 4) if paged else {}
    params = InferenceParams(2, 16, GROUPS, HIDDEN // HEADS, torch.float32, qkv_format="thd",
                             max_ctx_len=6, device="cpu", **paging)  # fmt: skip
    done, new = [0, 0], [2, 5]
    while done != totals:
        live = [i for i in range(2) if done[i] < totals[i]]
        params.pre_step(OrderedDict((i, new[i]) for i in live))
        out = packed(torch.cat([x[i, done[i] : done[i] + new[i]] for i in live]),
                     inference_params=params)  # fmt: skip
        start = 0
        for i in live:
            want = expected[i][done[i] : done[i] + new[i]]
            torch.testing.assert_close(out[start : start + new[i]], want, rtol=1e-5, atol=1e-5)
            start, done[i] = start + new[i], done[i] + new[i]
        new = [1, 1]
    freqs = RotaryPositionEmbedding(HIDDEN // HEADS, device="cpu")(16)
    params.pre_step(OrderedDict([(0, 1)]))
    with pytest.raises(NotImplementedError, match="rotary_pos_emb with inference_params"):
        packed(x[0, :1], inference_params=params, rotary_pos_emb=freqs)
