"""DotProductAttention on CUDA: each SDPA kernel against the float64 oracle in BF16/FP16, the
automatic choice and the NVTE_*_ATTN variables, dropout RNG, recompute, no host syncs on the
common paths, and a module on cuda:1 while cuda:0 is current.

Tolerance rule (flash-attention's): the kernel's error against the float64 oracle must be at
most twice the error of a plain composition computed in the same low precision, plus a small
floor; a kernel that rounds like the inputs' dtype passes, a wrong mask or scale does not.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_dpa_numerics import bhsd, oracle_attention, oracle_keep, oracle_output
from utils import needs_cuda, needs_two_gpus

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.dot_product_attention import (
    dot_product_attention as dpa_module,
)
from transformer_engine.pytorch.attention.dot_product_attention.utils import (
    AttentionBackends,
    SDPAKernel,
)

pytestmark = needs_cuda


@pytest.fixture(autouse=True)
def fresh_backend_cache(monkeypatch):
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    dpa_module._attention_backends["choices"].clear()
    yield
    dpa_module._attention_backends["choices"].clear()


def low_precision_reference(q, k, v, keep, scale):
    """The plain composition in the inputs' dtype (bshd in, ``[b, h, sq, dv]`` out)."""
    q, k, v = bhsd(q), bhsd(k), bhsd(v)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    keep = keep.to(q.device)
    row_valid = keep.any(dim=-1, keepdim=True)  # rows without keys: zeros, not NaN
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~(keep | ~row_valid), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v) * row_valid


def assert_within_twice_baseline(actual, expected, baseline, what):
    actual, expected, baseline = (
        actual.double().cpu(),
        expected.double().cpu(),
        baseline.double().cpu(),
    )
    floor = 1e-3 * expected.pow(2).mean().sqrt().item()
    err = (actual - expected).abs().max().item()
    allowed = 2 * (baseline - expected).abs().max().item() + floor
    assert err <= allowed, (
        f"{what}: max error {err:.3g} > {allowed:.3g} (2x the plain composition's)"
    )


def make_inputs(b, sq, skv, h, g, d, dtype, device="cuda", seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(b, s, n, d, generator=gen) for s, n in ((sq, h), (skv, g), (skv, g))]
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def pin_kernel(monkeypatch, kernel_name):
    from torch.nn.attention import SDPBackend

    kernel = SDPAKernel(getattr(SDPBackend, kernel_name), False)
    flash = kernel_name == "FLASH_ATTENTION"
    choice = AttentionBackends(flash, kernel if flash else None, not flash,
                               None if flash else kernel, False, [flash, not flash, True])  # fmt: skip
    monkeypatch.setattr(dpa_module, "get_attention_backend", lambda *a, **k: choice)


def check_against_oracle(dpa, q, k, v, keep, fmt, what, **kwargs):
    """Forward and backward of ``dpa`` (bshd inputs converted to ``fmt``) against the oracle,
    with the plain low-precision composition as the error baseline."""
    qf, kf, vf = ((t.detach().transpose(0, 1) if fmt == "sbhd" else t.detach()).requires_grad_()
                  for t in (q, k, v))  # fmt: skip
    out = dpa(qf, kf, vf, **kwargs)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    expected = oracle_output(oracle_attention(bhsd(q64), bhsd(k64), bhsd(v64), keep=keep,
                                              scale=dpa.softmax_scale), fmt)  # fmt: skip
    baseline = oracle_output(low_precision_reference(q, k, v, keep, dpa.softmax_scale), fmt)
    assert_within_twice_baseline(out, expected, baseline, f"{what} output")
    grad = torch.randn(
        expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    out.backward(grad.to(out.device, out.dtype))
    expected.backward(grad)
    baseline.backward(grad.to(baseline.device, baseline.dtype))
    for name, mine, ref, base in (("dq", qf, q64, q), ("dk", kf, k64, k), ("dv", vf, v64, v)):
        got = mine.grad.transpose(0, 1) if fmt == "sbhd" else mine.grad
        assert_within_twice_baseline(got, ref.grad, base.grad, f"{what} {name}")


# --- each kernel against the oracle ------------------------------------------------------------
# Measured on an H200 (torch 2.11, CUDA 13): SDPA's cuDNN backward gave dq max errors of 2.02 and
# 4.03 (allowed 0.021-0.037) for bshd inputs (causal with GQA in bf16 and fp16, no mask in bf16);
# forward, dk and dv passed. The automatic choice skips the kernel for this reason. Not strict:
# a torch that fixes it shows up as XPASS.
CUDNN_DQ_XFAIL = pytest.mark.xfail(
    strict=False,
    reason="SDPA CUDNN_ATTENTION backward: dq max error up to 4.03 against an allowed 0.037 "
    "(bshd, H200, torch 2.11); not chosen automatically",
)


@pytest.mark.parametrize(
    "kernel",
    [
        "FLASH_ATTENTION",
        pytest.param("CUDNN_ATTENTION", marks=CUDNN_DQ_XFAIL),
        "EFFICIENT_ATTENTION",
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type,groups", [("causal", 4), ("no_mask", 4), ("causal", 2)])
def test_sdpa_kernel_against_oracle(monkeypatch, kernel, dtype, fmt, mask_type, groups):
    pin_kernel(monkeypatch, kernel)
    b, s, h, d = 2, 128, 4, 64
    q, k, v = make_inputs(b, s, s, h, groups, d, dtype, seed=3)
    dpa = DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask_type)
    keep = oracle_keep(b, s, s, mask_type=mask_type)
    try:
        check_against_oracle(dpa, q, k, v, keep, fmt, kernel)
    except RuntimeError as error:
        if "No available kernel" in str(error):
            pytest.skip(f"PyTorch's {kernel} does not run this configuration here: {error}")
        raise


# --- the automatic choice ----------------------------------------------------------------------
def chosen():
    cache = dpa_module._attention_backends
    if cache["use_flash_attention"]:
        return "flash"
    if cache["use_fused_attention"]:
        return cache["fused_attention_backend"].sdp_backend.name
    return "unfused"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, "flash"),
        ({"NVTE_FLASH_ATTN": "0"}, "fused"),
        ({"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"}, "unfused"),
    ],  # fmt: skip
)
def test_environment_selects_backend(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    b, s, h, d = 2, 128, 4, 64
    q, k, v = make_inputs(b, s, s, h, h, d, torch.bfloat16, seed=4)
    dpa = DotProductAttention(h, d, qkv_format="bshd")
    check_against_oracle(dpa, q, k, v, oracle_keep(b, s, s, mask_type="causal"), "bshd", str(env))
    got = chosen()
    # the cuDNN kernel is never chosen automatically (see CUDNN_DQ_XFAIL)
    assert got == ("EFFICIENT_ATTENTION" if expected == "fused" else expected)


@pytest.mark.parametrize(
    "mask_type,window,sq,skv",
    [("padding_causal", None, 96, 96), ("causal", (16, 0), 128, 128),
     ("causal_bottom_right", None, 32, 128), ("causal", None, 64, 128), ("no_mask", (8, 8), 64, 96)],
)  # fmt: skip
def test_masks_on_the_fused_kernels(mask_type, window, sq, skv):
    b, h, d = 2, 4, 64
    q, k, v = make_inputs(b, sq, skv, h, h, d, torch.bfloat16, seed=5)
    kwargs, lens_q, lens_kv = {}, None, None
    if mask_type.startswith("padding"):
        lens_q, lens_kv = torch.tensor([sq, sq // 2]), torch.tensor([skv - 5, skv])
        pad_q = (torch.arange(sq)[None] >= lens_q[:, None]).view(b, 1, 1, sq).cuda()
        pad_kv = (torch.arange(skv)[None] >= lens_kv[:, None]).view(b, 1, 1, skv).cuda()
        kwargs["attention_mask"] = (pad_q, pad_kv)
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type, window_size=window)
    keep = oracle_keep(
        b, sq, skv, mask_type=mask_type, window=window, lens_q=lens_q, lens_kv=lens_kv
    )
    check_against_oracle(dpa, q, k, v, keep, "bshd", mask_type, **kwargs)
    assert chosen() != "unfused"


def test_bias_and_learnable_softmax_on_gpu():
    b, s, h, d = 2, 64, 4, 64
    q, k, v = make_inputs(b, s, s, h, h, d, torch.bfloat16, seed=6)
    bias = torch.randn(1, h, s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dpa = DotProductAttention(h, d, qkv_format="bshd", softmax_type="learnable", device="cuda")
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.tensor([0.5, -1.0, 1.0, 0.0]))
    out = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    keep = oracle_keep(b, s, s, mask_type="causal")
    expected = oracle_attention(
        bhsd(q.cpu()),
        bhsd(k.cpu()),
        bhsd(v.cpu()),
        keep=keep,
        bias=bias.detach().cpu(),
        offset=dpa.softmax_offset.detach().cpu(),
    )
    torch.testing.assert_close(
        out.double().cpu(), oracle_output(expected, "bshd"), rtol=2e-2, atol=2e-2
    )
    out.sum().backward()
    assert bias.grad is not None and dpa.softmax_offset.grad is not None
    assert chosen() == "EFFICIENT_ATTENTION"


@pytest.mark.parametrize("checkpoint", [False, True], ids=["", "checkpoint_core_attention"])
@pytest.mark.parametrize("bias", [False, True])
def test_return_max_logit_runs_a_kernel_on_gpu(bias, checkpoint):
    # the output from flash (no bias) or the memory-efficient kernel, the maximum from a
    # blocked float32 pass over the scores; GQA, causal
    b, s, h, g, d, scale = 2, 96, 4, 2, 64, 0.125
    q, k, v = make_inputs(b, s, s, h, g, d, torch.bfloat16, seed=9)
    bias_t = torch.randn(1, h, s, s, device="cuda") if bias else None
    kwargs = {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": bias_t}
    dpa = DotProductAttention(h, d, num_gqa_groups=g, qkv_format="bshd", softmax_scale=scale,
                              return_max_logit=True, device="cuda")  # fmt: skip
    out, max_logit = dpa(q, k, v, checkpoint_core_attention=checkpoint, **(kwargs if bias else {}))
    assert chosen() == ("EFFICIENT_ATTENTION" if bias else "flash")
    qb, kb = bhsd(q.cpu()).double(), bhsd(k.cpu()).double().repeat_interleave(h // g, 1)
    scores = qb @ kb.transpose(-1, -2) * scale
    if bias:
        scores = scores + bias_t.cpu().double()
    keep = oracle_keep(b, s, s, mask_type="causal").expand_as(scores)
    expected = scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    assert max_logit.device == q.device and max_logit.dtype == torch.float32
    torch.testing.assert_close(max_logit.double().cpu(), expected, rtol=1e-5, atol=1e-5)
    reference = oracle_attention(bhsd(q.cpu()), bhsd(k.cpu()), bhsd(v.cpu()), keep=keep,
                                 bias=bias_t.cpu() if bias else None, scale=scale)  # fmt: skip
    torch.testing.assert_close(out.double().cpu(), oracle_output(reference, "bshd"),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_thd_on_gpu():
    h, d, lens = 4, 64, [40, 100, 7]
    q, k, v = make_inputs(3, 100, 100, h, h, d, torch.bfloat16, seed=7)
    cu = torch.tensor([0, 40, 140, 147], dtype=torch.int32, device="cuda")
    packed = [torch.cat([t[i, :n] for i, n in enumerate(lens)]).detach().requires_grad_()
              for t in (q, k, v)]  # fmt: skip
    dpa = DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal")
    out = dpa(*packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=100, max_seqlen_kv=100)
    expected = []
    for i, n in enumerate(lens):
        ref = oracle_attention(
            bhsd(q[i : i + 1, :n].cpu()),
            bhsd(k[i : i + 1, :n].cpu()),
            bhsd(v[i : i + 1, :n].cpu()),
            keep=oracle_keep(1, n, n, mask_type="causal"),
        )
        expected.append(oracle_output(ref, "bshd")[0])
    torch.testing.assert_close(out.double().cpu(), torch.cat(expected), rtol=2e-2, atol=2e-2)
    out.sum().backward()


# --- RNG, recompute, host syncs ----------------------------------------------------------------
class CudaRngTracker:
    """fork() runs its body on its own CUDA generator state (upstream's tracker interface)."""

    def __init__(self, seed, device="cuda"):
        outside = torch.cuda.get_rng_state(device)
        torch.cuda.manual_seed(seed)
        self.states = {"model-parallel-rng": torch.cuda.get_rng_state(device)}
        torch.cuda.set_rng_state(outside, device)
        self.device = device

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        outside = torch.cuda.get_rng_state(self.device)
        torch.cuda.set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(outside, self.device)

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = dict(states)


def test_dropout_rng_and_recompute_on_gpu():
    b, s, h, d = 2, 128, 4, 64
    q, k, v = make_inputs(b, s, s, h, h, d, torch.bfloat16, seed=8)
    holder = {}
    dpa = DotProductAttention(h, d, qkv_format="bshd", attention_dropout=0.3,
                              get_rng_state_tracker=lambda: holder["t"])  # fmt: skip
    results = []
    for recompute in (False, True):
        holder["t"] = CudaRngTracker(seed=11)
        for t in (q, k, v):
            t.grad = None
        out = dpa(q, k, v, checkpoint_core_attention=recompute)
        out.backward(torch.ones_like(out))
        results.append([out.detach().clone()] + [t.grad.clone() for t in (q, k, v)])
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_no_host_syncs(mask_type):
    b, s, h, d = 2, 128, 4, 64
    q, k, v = make_inputs(b, s, s, h, h, d, torch.bfloat16, seed=9)
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool, device="cuda")
    pad[1, ..., 100:] = True
    kwargs = {"attention_mask": pad} if mask_type.startswith("padding") else {}
    dpa = DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type=mask_type)
    qs, ks, vs = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k, v))
    dpa(qs, ks, vs, **kwargs).sum().backward()  # the first call chooses the backend
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dpa(qs, ks, vs, **kwargs)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --- placement ---------------------------------------------------------------------------------
@needs_two_gpus
def test_on_cuda1_with_cuda0_current():
    torch.cuda.set_device(0)
    b, s, h, d = 2, 64, 4, 64
    q, k, v = make_inputs(b, s, s, h, h, d, torch.bfloat16, device="cuda:1", seed=10)
    for softmax_type in ("vanilla", "learnable"):
        dpa = DotProductAttention(
            h, d, qkv_format="bshd", softmax_type=softmax_type, device="cuda:1"
        )
        out = dpa(q, k, v)
        out.sum().backward()
        assert out.device == torch.device("cuda", 1)
        assert torch.cuda.current_device() == 0
        keep = oracle_keep(b, s, s, mask_type="causal")
        expected = oracle_attention(
            bhsd(q.cpu()),
            bhsd(k.cpu()),
            bhsd(v.cpu()),
            keep=keep,
            offset=None if softmax_type == "vanilla" else 0.0,
        )
        torch.testing.assert_close(out.double().cpu(), oracle_output(expected, "bshd"),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip
    meta = DotProductAttention(h, d, qkv_format="bshd", softmax_type="learnable", device="meta")
    meta.to_empty(device="cuda:1")
    meta.reset_parameters()
    assert meta.softmax_offset.device == torch.device("cuda", 1)
    assert meta(q, k, v).device == torch.device("cuda", 1)


@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_forward_captures_in_a_cuda_graph(mask_type):
    """After a first (eager) call has chosen the backend, a forward issues no host-side work a
    CUDA graph cannot hold: it captures, and replays with new inputs like the eager call."""
    b, s, h, d = 2, 128, 4, 64
    q, k, v = (t.detach() for t in make_inputs(b, s, s, h, h, d, torch.bfloat16, seed=12))
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool, device="cuda")
    pad[1, ..., 90:] = True
    kwargs = {"attention_mask": pad} if mask_type.startswith("padding") else {}
    dpa = DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            dpa(q, k, v, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = dpa(q, k, v, **kwargs)
    new_q = torch.randn_like(q)
    q.copy_(new_q)
    graph.replay()
    with torch.no_grad():
        eager = dpa(new_q, k, v, **kwargs)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
