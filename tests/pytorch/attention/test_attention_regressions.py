"""Regressions found by probing the attention stack on the CPU, each against an independent
float64 composition or against the same computation run the plain way.

* A KV cache (and ``InferenceParams``' lengths) created under ``torch.inference_mode`` stays
  usable outside it: a prefill under inference mode followed by decoding under ``no_grad``.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention

HIDDEN, HEADS, GROUPS = 16, 4, 2


def _decoding_params(paged: bool) -> InferenceParams:
    paging = dict(is_paged=True, page_size=2, total_num_pages=2 * 8 // 2) if paged else {}
    return InferenceParams(2, 8, GROUPS, HIDDEN // HEADS, torch.float32, qkv_format="bshd",
                           device="cpu", **paging)  # fmt: skip


def _decode(mha, params, prompt, tokens, prefill_context, build_context=None):
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
