"""Backend selection and the SDPA path, on CPU.

* The SDPA path (masks, biases, softmax offsets as an extra key, GQA, rows without keys, thd)
  runs here through PyTorch's MATH kernel, pinned the way the GPU kernels are, and is held to
  the float64 oracle.
* ``get_attention_backend``'s filters are checked with a CUDA device pretended (capability
  9.0), and the module's cache, environment variables and debug logging on the CPU.
"""

from __future__ import annotations

import logging

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
from torch.nn.attention import SDPBackend

from transformer_engine.pytorch.attention.dot_product_attention import (
    DotProductAttention,
    backends,
    utils,
)
from transformer_engine.pytorch.attention.dot_product_attention import (
    dot_product_attention as dpa_module,
)
from transformer_engine.pytorch.attention.dot_product_attention.utils import (
    AttentionBackends,
    AttentionParams,
    SDPAKernel,
    get_attention_backend,
)


@pytest.fixture(autouse=True)
def fresh_backend_cache():
    dpa_module._attention_backends["choices"].clear()
    yield
    dpa_module._attention_backends["choices"].clear()


@pytest.fixture
def sdpa_math(monkeypatch):
    """Every call runs the SDPA path with PyTorch's MATH kernel; ``repeat_kv`` from the
    request parameter (K/V repeated to the query heads instead of ``enable_gqa``)."""

    def pin(repeat_kv=False):
        kernel = SDPAKernel(SDPBackend.MATH, repeat_kv)
        choice = AttentionBackends(False, None, True, kernel, False, [False, True, True])
        monkeypatch.setattr(dpa_module, "get_attention_backend", lambda *a, **k: choice)

    return pin


# --- the SDPA path against the oracle ----------------------------------------------------------
@pytest.mark.parametrize("repeat_kv", [False, True], ids=["enable_gqa", "repeat_kv"])
@pytest.mark.parametrize(
    "mask_type,window,softmax_type,bias_type",
    [
        ("causal", None, "vanilla", "no_bias"),
        ("causal_bottom_right", None, "vanilla", "no_bias"),
        ("padding_causal", None, "vanilla", "no_bias"),
        ("padding", (1, 1), "vanilla", "no_bias"),
        ("causal", None, "off-by-one", "no_bias"),
        ("padding_causal_bottom_right", None, "learnable", "post_scale_bias"),
        ("no_mask", None, "vanilla", "alibi"),
        ("causal", None, "learnable", "no_bias"),
    ],
)
def test_sdpa_path_against_oracle(sdpa_math, repeat_kv, mask_type, window, softmax_type, bias_type):
    sdpa_math(repeat_kv)
    b, sq, skv, h, g, d = 2, 5, 7, 4, 2, 8
    q, k, v = random_qkv(b, sq, skv, h, g, d, seed=31)
    lens_q, lens_kv = torch.tensor([5, 3]), torch.tensor([4, 7])
    padding = mask_type.startswith("padding")
    kwargs = {}
    if padding:
        q_pad = torch.arange(sq)[None, :] >= lens_q[:, None]
        kv_pad = torch.arange(skv)[None, :] >= lens_kv[:, None]
        kwargs["attention_mask"] = (q_pad.view(b, 1, 1, sq), kv_pad.view(b, 1, 1, skv))
    bias = None
    if bias_type == "post_scale_bias":
        bias = torch.randn(1, h, sq, skv)
        kwargs.update(core_attention_bias_type=bias_type, core_attention_bias=bias)
    elif bias_type == "alibi":
        kwargs.update(
            core_attention_bias_type="alibi", alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 1.0])
        )
        i, j = torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)
        bias = -torch.tensor([0.5, 0.25, 0.1, 1.0]).view(1, h, 1, 1) * (j - i - (skv - sq)).abs()
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format="bshd", attn_mask_type=mask_type,
                              window_size=window, softmax_type=softmax_type,
                              device=q.device)  # fmt: skip
    offset = None
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.tensor([0.3, -0.5, 1.0, 0.0]))
        offset = dpa.softmax_offset.detach().double().requires_grad_()
    elif softmax_type == "off-by-one":
        offset = 0.0
    out = dpa(q, k, v, **kwargs)
    keep = oracle_keep(
        b,
        sq,
        skv,
        mask_type=mask_type,
        window=window,
        lens_q=lens_q if padding else None,
        lens_kv=lens_kv if padding else None,
    )
    q_ref = q.detach().double().requires_grad_()
    expected = oracle_attention(bhsd(q_ref), bhsd(k), bhsd(v), keep=keep, bias=bias, offset=offset)
    torch.testing.assert_close(out.double(), oracle_output(expected, "bshd"), **FP32_TOL)
    grad = torch.randn(b, sq, h * d, dtype=torch.float64)
    out.backward(grad.float())
    oracle_output(expected, "bshd").backward(grad)
    torch.testing.assert_close(q.grad.double(), q_ref.grad, rtol=1e-4, atol=1e-5)
    if softmax_type == "learnable":
        torch.testing.assert_close(
            dpa.softmax_offset.grad.double(), offset.grad, rtol=1e-4, atol=1e-5
        )


def test_sdpa_path_thd_and_sbhd(sdpa_math):
    sdpa_math()
    h, d, lens = 2, 4, [3, 5]
    q, k, v = random_qkv(2, 5, 5, h, h, d, seed=32)
    pad = torch.arange(5)[None, :] >= torch.tensor(lens)[:, None]
    packed = [torch.cat([t[0, :3], t[1, :5]]).detach() for t in (q, k, v)]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    thd = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal")
    out = thd(*packed, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    keep = oracle_keep(2, 5, 5, mask_type="padding_causal", q_pad=pad, kv_pad=pad)
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "bshd")
    torch.testing.assert_close(
        out.double(), torch.cat([expected[0, :3], expected[1, :5]]), **FP32_TOL
    )
    sbhd = DotProductAttention(h, d, qkv_format="sbhd")
    out = sbhd(*(t.transpose(0, 1) for t in (q, k, v)))
    keep = oracle_keep(2, 5, 5, mask_type="causal")
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "sbhd")
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


def test_sdpa_path_dropout(sdpa_math):
    sdpa_math()
    s, p = 24, 0.5
    q, k, _ = random_qkv(1, s, s, 1, 1, s, seed=33)
    v = torch.eye(s).view(1, s, 1, s)
    dpa = DotProductAttention(1, s, qkv_format="bshd", attention_dropout=p)
    torch.manual_seed(1)
    out = dpa(q, k, v).detach().view(s, s).double()
    probs = oracle_attention(
        bhsd(q), bhsd(k), bhsd(v), keep=oracle_keep(1, s, s, mask_type="causal")
    )
    probs = probs.view(s, s)
    kept = out != 0
    torch.testing.assert_close(out[kept], probs[kept] / (1 - p), rtol=1e-4, atol=1e-6)
    torch.manual_seed(1)
    assert torch.equal(dpa(q, k, v).detach().view(s, s).double(), out)


# --- the filters (a CUDA device pretended) ------------------------------------------------------
@pytest.fixture
def pretend_hopper(monkeypatch):
    monkeypatch.setattr(utils.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(utils, "device_compute_capability", lambda device: (9, 0))
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)


def chosen(params) -> str:
    result = get_attention_backend(params)
    if result.use_flash_attention:
        return "flash"
    if result.use_fused_attention:
        return result.fused_attention_backend.sdp_backend.name
    return "unfused"


CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"attn_mask_type": "causal", "window_size": (-1, 0)}, "flash"),
        ({"attn_mask_type": "causal", "max_seqlen_q": 64}, "EFFICIENT_ATTENTION"),
        ({"attn_mask_type": "no_mask", "max_seqlen_q": 64}, "flash"),
        (
            {
                "attn_mask_type": "causal_bottom_right",
                "window_size": (-1, 0),
                "bottom_right_diagonal": True,
                "max_seqlen_q": 1,
            },
            "flash",
        ),
        (
            {
                "attn_mask_type": "causal_bottom_right",
                "window_size": (-1, 0),
                "bottom_right_diagonal": True,
                "max_seqlen_q": 200,
            },
            "EFFICIENT_ATTENTION",
        ),
        ({"attn_mask_type": "padding"}, "EFFICIENT_ATTENTION"),
        ({"attn_mask_type": "arbitrary"}, "EFFICIENT_ATTENTION"),
        ({"qkv_layout": "thd_thd_thd", "attn_mask_type": "padding"}, "EFFICIENT_ATTENTION"),
        ({"window_size": (4, 0), "attn_mask_type": "causal"}, "EFFICIENT_ATTENTION"),
        ({"core_attention_bias_type": "post_scale_bias"}, "EFFICIENT_ATTENTION"),
        ({"core_attention_bias_type": "alibi"}, "EFFICIENT_ATTENTION"),
        ({"softmax_type": "learnable"}, "EFFICIENT_ATTENTION"),
        ({"qkv_dtype": torch.float32}, "EFFICIENT_ATTENTION"),
        ({"head_dim_v": 32}, "EFFICIENT_ATTENTION"),
        ({"attention_dropout": 0.1, "attn_mask_type": "padding"}, "EFFICIENT_ATTENTION"),
        ({"return_max_logit": True}, "flash"),  # the maximum from a pass of its own
        ({"qkv_dtype": torch.float64}, "unfused"),
        ({"deterministic": True, "attn_mask_type": "padding"}, "unfused"),
        (
            {"deterministic": True, "is_training": False, "attn_mask_type": "padding"},
            "EFFICIENT_ATTENTION",
        ),
        ({"device": torch.device("cpu")}, "unfused"),
    ],
)
def test_filters(pretend_hopper, changes, expected):
    params = AttentionParams(device=CUDA, qkv_dtype=torch.bfloat16)._replace(**changes)
    assert chosen(params) == expected


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "flash"),
        ({"NVTE_FLASH_ATTN": "0"}, "EFFICIENT_ATTENTION"),
        ({"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"}, "unfused"),
        ({"NVTE_FUSED_ATTN": "0"}, "flash"),
    ],
)
def test_environment_excludes_backends(pretend_hopper, monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    params = AttentionParams(device=CUDA, attn_mask_type="causal", window_size=(-1, 0))
    assert chosen(params) == expected


def test_cudnn_kernel_never_chosen_automatically(pretend_hopper, monkeypatch, caplog):
    """Even where every other filter lets it through (flash excluded, causal, sq == skv), the
    automatic choice skips the cuDNN kernel and says why in the debug log."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    params = AttentionParams(device=CUDA, attn_mask_type="causal", window_size=(-1, 0))
    with caplog.at_level(logging.DEBUG, logger="transformer_engine.pytorch.attention"):
        result = get_attention_backend(params)
    assert result.use_fused_attention
    assert result.fused_attention_backend.sdp_backend == SDPBackend.EFFICIENT_ATTENTION
    assert "Disabling cudnn attention: " + utils.CUDNN_NOT_AUTOMATIC in caplog.text
    assert "wrong dq" in utils.CUDNN_NOT_AUTOMATIC


def test_no_backend_names_the_reasons(monkeypatch):
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="NVTE_UNFUSED_ATTN=0.*NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2"):
        dpa(q, q, q)
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "1")  # read on every call
    assert dpa(q, q, q).shape == (1, 3, 8)


def test_choice_cached_per_params(monkeypatch):
    calls = []
    real = dpa_module.get_attention_backend

    def counting(params, problem=None):
        calls.append(params)
        return real(params, problem)

    monkeypatch.setattr(dpa_module, "get_attention_backend", counting)
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    q = torch.randn(1, 3, 2, 4)
    dpa(q, q, q)
    dpa(q, q, q)
    assert len(calls) == 1
    dpa(q, q, q, attn_mask_type="no_mask")
    assert len(calls) == 2
    assert dpa_module._attention_backends["use_unfused_attention"] is True
    assert dpa_module._attention_backends["attention_params"].attn_mask_type == "no_mask"
    dpa_module._attention_backends["backend_selection_requires_update"] = True
    dpa(q, q, q)
    assert len(calls) == 3


def test_debug_logging(monkeypatch, caplog):
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    logger = logging.getLogger("transformer_engine.pytorch.attention")
    level = logger.level
    try:
        with caplog.at_level(logging.DEBUG, logger="transformer_engine.pytorch.attention"):
            dpa = DotProductAttention(2, 4, qkv_format="bshd")
            q = torch.randn(1, 3, 2, 4)
            dpa(q, q, q)
        text = caplog.text
        assert "Disabling flash attention" in text and "CUDA" in text
        assert "Running with Unfused backend" in text
    finally:
        logger.setLevel(level)


# --- the kernel pin ------------------------------------------------------------------------------
def sdp_flags():
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled())  # fmt: skip


@pytest.mark.parametrize(
    "kernel,inside",
    [("MATH", (False, False, True, False)), ("FLASH_ATTENTION", (True, False, False, False))],
)
def test_kernel_pinned_during_the_call_only(sdpa_math, monkeypatch, kernel, inside):
    sdpa_math()
    choice = AttentionBackends(
        False, None, True, SDPAKernel(getattr(SDPBackend, kernel)), False, []
    )
    monkeypatch.setattr(dpa_module, "get_attention_backend", lambda *a, **k: choice)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(sdp_flags())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = sdp_flags()
    torch.backends.cuda.enable_cudnn_sdp(False)  # a user's own setting survives the call
    try:
        dpa = DotProductAttention(2, 8, qkv_format="bshd")
        q = torch.randn(1, 4, 2, 8)
        dpa(q, q, q)
        assert seen == [inside]
        assert sdp_flags() == (*before[:3], False)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))  # fmt: skip
        with pytest.raises(RuntimeError, match="boom"):
            dpa(q, q, q)
        assert sdp_flags() == (*before[:3], False), "restored after an exception too"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[3])


@pytest.mark.parametrize("groups", [4, 2])
def test_bottom_right_causal_through_causal_lower_right(monkeypatch, groups):
    """The flash kernel takes a bottom-right causal mask (sq < skv) as ``causal_lower_right``
    (on the CPU, PyTorch's CPU flash kernel or its materialized fallback runs it)."""
    kernel = SDPAKernel(SDPBackend.FLASH_ATTENTION)
    choice = AttentionBackends(True, kernel, False, None, False, [True, False, True])
    monkeypatch.setattr(dpa_module, "get_attention_backend", lambda *a, **k: choice)
    seen = []
    real = backends.sdpa_inputs

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(type(result[3]).__name__)
        return result

    monkeypatch.setattr(backends, "sdpa_inputs", spy)
    b, sq, skv, h, d = 2, 3, 7, 4, 8
    q, k, v = random_qkv(b, sq, skv, h, groups, d, seed=34)
    dpa = DotProductAttention(h, d, num_gqa_groups=groups, qkv_format="bshd",
                              attn_mask_type="causal_bottom_right")  # fmt: skip
    out = dpa(q, k, v)
    assert seen[0] == "CausalBias"
    keep = oracle_keep(b, sq, skv, mask_type="causal_bottom_right")
    k_ref = k.detach().double().requires_grad_()
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k_ref), bhsd(v), keep=keep), "bshd")
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    grad = torch.randn_like(expected)
    out.backward(grad.float())
    expected.backward(grad)
    torch.testing.assert_close(k.grad.double(), k_ref.grad, rtol=1e-4, atol=1e-5)
