"""FP8 attention (the recipe's ``fp8_dpa`` / ``fp8_mha``), emulated in the unfused backend.

Oracle: float64 attention written here with the FP8 roundings upstream's fused kernels apply
(Q, K, V with one scale; the softmax output; O where the recipe writes it in FP8; in backward
dO, the score gradient and dQ, dK, dV with one scale), each rounding done by the independent
cast oracle (``utils.fake_quant``) with scales computed from the oracle's own amaxes
(``utils.current_scale``), and the recipe state's scales after a step against
``fp8_max / amax`` of the oracle's tensors.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from utils import current_scale, fake_quant, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch.attention.dot_product_attention import (
    DotProductAttention,
    score_blocks,
)
from transformer_engine.pytorch.custom_recipes.quantizer_factories import (
    current_scaling_factory,
    mxfp8_factory,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
B, S, HQ, HKV, D = 2, 8, 4, 2, 16


@pytest.fixture(autouse=True)
def _quiet_and_clean(monkeypatch):
    for name in ("NVTE_DPA_FP8_RECIPE", "NVTE_FP8_DPA_BWD", "NVTE_DPA_FP8CS_O_in_F16"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation is announced once
        yield


@pytest.fixture(params=["one block", "blocks of 3 rows"])
def blocks(request, monkeypatch):
    """The products in one block, or in blocks of 3 query rows (S = 8: blocks of 3, 3 and 2),
    which must give the same roundings (one scale per slot over all blocks)."""
    if request.param != "one block":
        monkeypatch.setattr(score_blocks, "SCORE_BLOCK_BYTES", 3 * 4 * B * HQ * S)
    return request.param


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, HQ, D, generator=g)
    k = torch.randn(B, S, HKV, D, generator=g)
    v = torch.randn(B, S, HKV, D, generator=g)
    dout = torch.randn(B, S, HQ * D, generator=g)
    return q, k, v, dout


def _round(t, dtype, scale=None):
    """float64 FP8 values of ``t`` (current scaling unless ``scale`` is given)."""
    t = t.float()
    return fake_quant(t, current_scale(t, dtype) if scale is None else scale, dtype)


def _round_together(tensors, dtype, scale=None):
    joint = torch.cat([t.reshape(-1) for t in tensors]).float()
    scale = current_scale(joint, dtype) if scale is None else scale
    return [_round(t, dtype, scale) for t in tensors]


def oracle(q, k, v, dout, *, round_o, scales=None, causal=True):
    """float64 FP8 attention forward and backward (bshd in, bshd out), the roundings of the
    module docstring; ``scales``: fixed scales per slot (delayed scaling), else current."""
    sc = scales or {}
    q8, k8, v8 = _round_together([q, k, v], E4M3, sc.get("qkv"))
    qb, kb, vb = (t.transpose(1, 2) for t in (q8, k8, v8))  # [b, h, s, d]
    kb, vb = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
    scale = 1.0 / math.sqrt(D)
    scores = qb @ kb.transpose(-2, -1) * scale
    if causal:
        keep = torch.ones(S, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p8 = _round(p, E4M3, sc.get("s"))
    o = p8 @ vb
    out = _round(o, E4M3, sc.get("o")) if round_o else o
    # backward (dout in bshd with heads merged)
    do = dout.reshape(B, S, HQ, D).transpose(1, 2).double()
    do8 = _round(do, E5M2, sc.get("do"))
    dv = p8.transpose(-2, -1) @ do8
    dp = do8 @ vb.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    ds8 = _round(ds, E5M2, sc.get("dp"))
    dq = ds8 @ kb * scale
    dk = ds8.transpose(-2, -1) @ qb * scale
    fold = lambda t: t.reshape(B, HKV, HQ // HKV, S, D).sum(2)  # noqa: E731
    dk, dv = fold(dk), fold(dv)
    grads = _round_together([dq, dk, dv], E5M2, sc.get("dqkv"))
    bshd = [g.transpose(1, 2) for g in grads]
    amaxes = {"qkv": max(float(t.abs().max()) for t in (q, k, v)), "s": float(p.abs().max()),
              "o": float(o.abs().max()), "do": float(do.abs().max()),
              "dp": float(ds.abs().max()), "dqkv": max(float(g.abs().max()) for g in (dq, dk, dv))}  # fmt: skip
    merged = out.transpose(1, 2).reshape(B, S, HQ * D)
    return merged, bshd, amaxes


def _run(recipe, q, k, v, dout, device="cpu", **kwargs):
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                              attn_mask_type="causal", device=device)  # fmt: skip
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    with te.autocast(recipe=recipe):
        out = dpa(q, k, v, **kwargs)
    out.backward(dout.to(device))
    return dpa, out.cpu(), [q.grad.cpu(), k.grad.cpu(), v.grad.cpu()]


def _assert_matches(got, expected):
    """Within float32 error of the oracle, but for at most 1% of the elements, which may sit one
    E4M3 step away: the module forms its products in float32 and the oracle in float64, so a
    value within a float32 ulp of an FP8 tie can round the other way (seen for a rounded
    output: 2 elements in 1024)."""
    got, expected = got.double(), expected.double()
    err = (got - expected).abs()
    tight = err <= 1e-5 + 1e-5 * expected.abs()
    step = err <= 2**-3 * expected.abs() + 1e-5
    assert bool(step.all()) and tight.double().mean().item() >= 0.99, (
        f"max err {err.max().item():.3e}; {100 * (1 - tight.double().mean().item()):.2f}% "
        "of the elements off the float32 tolerance"
    )


def e5m2_gradients_factory(role):
    """Current scaling with E5M2 for the attention's gradient slots (HYBRID's backward)."""
    if role is not None and role.tensor_type in ("do", "dp", "dqkv"):
        return te.Float8CurrentScalingQuantizer(E5M2)
    return current_scaling_factory(role)


@pytest.mark.parametrize("factory", [None, e5m2_gradients_factory], ids=["CS", "Custom"])
def test_current_scaling_matches_the_oracle(blocks, factory):
    q, k, v, dout = _inputs()
    recipe = (
        Float8CurrentScaling(fp8_dpa=True)
        if factory is None
        else CustomRecipe(qfactory=factory, fp8_dpa=True)
    )
    _, out, grads = _run(recipe, q, k, v, dout)
    ref_out, ref_grads, _ = oracle(q, k, v, dout, round_o=False)
    _assert_matches(out, ref_out)
    for got, expected in zip(grads, ref_grads):
        _assert_matches(got, expected)


@needs_cuda
@pytest.mark.parametrize("recipe", ["DS", "CS"])
def test_matches_the_oracle_on_cuda(blocks, recipe):
    # the native casts (and their amaxes) on the GPU; cuda:0 as the module's device
    q, k, v, dout = _inputs(8)
    if recipe == "CS":
        _, out, grads = _run(Float8CurrentScaling(fp8_dpa=True), q, k, v, dout, device="cuda")
        ref_out, ref_grads, _ = oracle(q, k, v, dout, round_o=False)
    else:
        ds = DelayedScaling(fp8_dpa=True)
        _, out, grads = _run(ds, q, k, v, dout, device="cuda")
        ones = dict.fromkeys(("qkv", "s", "o", "do", "dp", "dqkv"), 1.0)
        ref_out, ref_grads, _ = oracle(q, k, v, dout, round_o=True, scales=ones)
    _assert_matches(out, ref_out)
    for got, expected in zip(grads, ref_grads):
        _assert_matches(got, expected)


def test_current_scaling_rounds_o_when_asked(blocks, monkeypatch):
    monkeypatch.setenv("NVTE_DPA_FP8CS_O_in_F16", "0")
    q, k, v, dout = _inputs(1)
    _, out, _ = _run(Float8CurrentScaling(fp8_dpa=True), q, k, v, dout)
    _assert_matches(out, oracle(q, k, v, dout, round_o=True)[0])


def test_delayed_scaling_rounds_with_the_state_and_updates_it(blocks):
    q, k, v, dout = _inputs(2)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=1)
    dpa, out, grads = _run(recipe, q, k, v, dout)
    # first step: every scale is 1; O is rounded (the fused kernel writes it in FP8)
    ones = dict.fromkeys(("qkv", "s", "o", "do", "dp", "dqkv"), 1.0)
    ref_out, ref_grads, amax = oracle(q, k, v, dout, round_o=True, scales=ones)
    _assert_matches(out, ref_out)
    for got, expected in zip(grads, ref_grads):
        _assert_matches(got, expected)
    # the forward scales updated at the autocast exit, the backward ones after the backward
    fwd, bwd = dpa.fp8_meta["scaling_fwd"].scale, dpa.fp8_meta["scaling_bwd"].scale
    for slot, key in ((2, "qkv"), (3, "o"), (8, "s")):
        assert math.isclose(fwd[slot].item(), 448.0 / amax[key], rel_tol=1e-5), key
    for slot, key in ((0, "dqkv"), (3, "do"), (5, "dp")):
        assert math.isclose(bwd[slot].item(), 57344.0 / amax[key], rel_tol=1e-5), key
    assert fwd[0].item() == 1.0 and bwd[1].item() == 1.0  # the unused slots stay
    # the second step rounds with those scales
    q, k, v, dout = _inputs(3)
    scales = {key: (448.0 if key in ("qkv", "s", "o") else 57344.0) / amax[key] for key in amax}
    with te.autocast(recipe=recipe):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = dpa(qq, kk, vv)
    out.backward(dout)
    ref_out, ref_grads, _ = oracle(q, k, v, dout, round_o=True, scales=scales)
    _assert_matches(out, ref_out)
    for got, expected in zip((qq.grad, kk.grad, vv.grad), ref_grads):
        _assert_matches(got, expected)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_high_precision_backward(blocks, monkeypatch, how):
    q, k, v, dout = _inputs(4)
    kwargs = {"bf16_backward": True} if how == "argument" else {}
    if how == "env":
        monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    _, out, grads = _run(Float8CurrentScaling(fp8_dpa=True), q, k, v, dout, **kwargs)
    # the forward's FP8 values, differentiated without rounding the gradients
    qkv8 = [t.requires_grad_() for t in _round_together([q, k, v], E4M3)]
    qb, kb, vb = (t.transpose(1, 2) for t in qkv8)
    kb, vb = kb.repeat_interleave(2, 1), vb.repeat_interleave(2, 1)
    scores = (qb @ kb.transpose(-2, -1) / math.sqrt(D)).masked_fill(
        ~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf")
    )
    p = torch.softmax(scores, -1)
    p8 = p + (_round(p.detach(), E4M3) - p.detach())  # rounded forward, straight-through
    o = (p8 @ vb).transpose(1, 2).reshape(B, S, HQ * D)
    o.backward(dout.double())
    _assert_matches(out, o.detach())
    for got, t in zip(grads, qkv8):
        _assert_matches(got, t.grad)


def test_fp8_output_is_a_float8_tensor():
    q, k, v, _ = _inputs(5)
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd", device="cpu")
    with te.autocast(recipe=Float8CurrentScaling(fp8_dpa=True)):
        out = dpa(q, k, v, fp8_output=True)
    assert isinstance(out, te.Float8Tensor) and out.shape == (B, S, HQ * D)
    expected = oracle(q, k, v, torch.zeros(B, S, HQ * D), round_o=True)[0]
    _assert_matches(out.dequantize(dtype=torch.float32), expected)


def test_fp8_mha_implies_fp8_dpa_and_runs_in_layers():
    recipe = DelayedScaling(fp8_mha=True)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.float32, device="cpu")  # fmt: skip
    x = torch.randn(8, 2, 64, requires_grad=True)
    with pytest.warns(UserWarning, match="fp8_mha=True implies fp8_dpa=True"):
        with te.autocast(recipe=recipe):
            out = layer(x)
    assert recipe.fp8_dpa is True
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    attention = layer.self_attention.core_attention
    assert attention.fp8_meta["scaling_fwd"].scale[2].item() != 1.0  # QKV slot updated


def test_refusals():
    q, k, v, _ = _inputs(6)
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd", device="cpu")
    with pytest.raises(NotImplementedError, match="MXFP8BlockScaling is not built"):
        with te.autocast(recipe=MXFP8BlockScaling(fp8_dpa=True)):
            dpa(q, k, v)
    with pytest.raises(TypeError, match="per-tensor FP8 quantizer"):
        with te.autocast(recipe=CustomRecipe(qfactory=mxfp8_factory, fp8_dpa=True)):
            dpa(q, k, v)
    logits = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                                 return_max_logit=True, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="return_max_logit"):
        with te.autocast(recipe=Float8CurrentScaling(fp8_dpa=True)):
            logits(q, k, v)


@pytest.mark.parametrize("how", ["te.checkpoint", "checkpoint_core_attention"])
def test_recompute_gives_the_same_step(how):
    # A recompute rounds with the scales of the original forward (te.checkpoint swaps them
    # in); checkpoint_core_attention keeps the FP8 operands instead of recomputing them.
    results = []
    for recompute in (False, True):
        q, k, v, dout = _inputs(7)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd", device="cpu")
        recipe = DelayedScaling(fp8_dpa=True, amax_history_len=2)
        grads = []
        for _ in range(2):  # the second step has scales != 1
            with te.autocast(recipe=recipe):
                if recompute and how == "te.checkpoint":
                    out = te.checkpoint(dpa, q, k, v)
                else:
                    out = dpa(q, k, v, checkpoint_core_attention=recompute)
            out.backward(dout)
            grads.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
        results.append((out.detach(), grads, dpa.fp8_meta["scaling_fwd"].scale.clone()))
    (out_a, grads_a, scale_a), (out_b, grads_b, scale_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(scale_a, scale_b)
    for step_a, step_b in zip(grads_a, grads_b):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)


def test_a_failed_call_hands_the_first_module_flag_back():
    q, k, v, _ = _inputs(9)
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd", device="cpu")
    state = te.FP8GlobalStateManager.quantization_state
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
        assert state.is_first_fp8_module
        with pytest.raises(ValueError):  # the mask type needs a mask: raised after the setup
            dpa(q, k, v, attn_mask_type="arbitrary")
        assert state.is_first_fp8_module  # the next module still claims the backward update
        with pytest.raises(ValueError):  # a head count the module does not have: likewise
            dpa(q[:, :, :2], k, v)
        assert state.is_first_fp8_module


# -- the products in query blocks: masks, biases, the learnable softmax, dropout, memory ------
class _RoundGradient(torch.autograd.Function):
    """Identity; the gradient rounded to E5M2 (current scaling), as a float64 oracle step."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _round(grad, E5M2)


class _RoundValue(torch.autograd.Function):
    """The E4M3 values (current scaling); the gradient passes through."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        return _round(x, E4M3)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad


def hashed_keep(seed, shape, p):
    """The documented dropout mask, written independently with numpy's wrapping uint64
    arithmetic: kept where mix(mix(lo32(i) ^ seed0) ^ hi32(i) ^ seed1) >= p * 2**32 for the
    element's flat index i, mix being xor-shift 16, * 0x7feb352d, xor-shift 15, * 0x846ca68b,
    xor-shift 16 (mod 2**32)."""
    low = np.uint64(0xFFFFFFFF)

    def mix(x):
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & low
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x846CA68B)) & low
        return x ^ (x >> np.uint64(16))

    index = np.arange(math.prod(shape), dtype=np.uint64)
    s0, s1 = (np.uint64(int(v)) for v in seed)
    x = mix(mix((index & low) ^ s0) ^ (index >> np.uint64(32)) ^ s1)
    return torch.from_numpy(x >= np.uint64(int(p * 2**32))).reshape(shape)


def feature_oracle(q, k, v, dout, bias, offset, masked, keep, p):
    """float64 current-scaling FP8 attention with a post-scale bias, a learnable softmax
    offset, an arbitrary mask (``masked`` True = excluded) and dropout (``keep``): the output,
    dQ, dK, dV, and the gradients of the bias (the unrounded score gradient) and the offset."""
    qkv8 = [t.detach().requires_grad_() for t in _round_together([q, k, v], E4M3)]
    qb, kb, vb = (t.transpose(1, 2) for t in qkv8)
    kb, vb = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
    bias = bias.detach().double().requires_grad_()
    offset = offset.detach().double().requires_grad_()
    scores = _RoundGradient.apply(qb @ kb.transpose(-2, -1) / math.sqrt(D)) + bias
    scores = scores.masked_fill(masked, float("-inf"))
    off = offset.view(1, HQ, 1, 1)
    shift = torch.maximum(scores.amax(-1, keepdim=True), off).detach()
    exps = torch.exp(scores - shift)
    probs = exps / (exps.sum(-1, keepdim=True) + torch.exp(off - shift))
    probs = _RoundValue.apply(probs * keep / (1 - p))
    out = _RoundGradient.apply(probs @ vb).transpose(1, 2).reshape(B, S, HQ * D)
    out.backward(dout.double())
    grads = _round_together([t.grad for t in qkv8], E5M2)
    return out.detach(), grads, bias.grad, offset.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_masks_bias_learnable_softmax_and_dropout_match_the_oracle(blocks, device, monkeypatch):
    q, k, v, dout = _inputs(10)
    g = torch.Generator().manual_seed(11)
    bias = torch.randn(1, HQ, S, S, generator=g)
    offset = torch.randn(HQ, generator=g)
    masked = torch.rand(B, 1, S, S, generator=g) < 0.3
    masked &= ~torch.eye(S, dtype=torch.bool)  # every query keeps a key
    seed = torch.tensor([0x12345678, 0x9ABCDEF0], dtype=torch.int64)
    monkeypatch.setattr(score_blocks, "dropout_seed", lambda dev, ctx: seed.to(dev))
    p = 0.25
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd", device=device,
                              attn_mask_type="arbitrary", attention_dropout=p,
                              softmax_type="learnable")  # fmt: skip
    with torch.no_grad():
        dpa.softmax_offset.copy_(offset)
    qd, kd, vd, bd = (t.to(device).requires_grad_() for t in (q, k, v, bias))
    with te.autocast(recipe=Float8CurrentScaling(fp8_dpa=True)):
        out = dpa(qd, kd, vd, attention_mask=masked.to(device),
                  core_attention_bias_type="post_scale_bias", core_attention_bias=bd)  # fmt: skip
    out.backward(dout.to(device))
    keep = hashed_keep(seed, (B, HQ, S, S), p)
    assert 0 < keep.double().mean().item() < 1
    ref_out, ref_grads, ref_dbias, ref_doffset = feature_oracle(
        *(t.detach() for t in (q, k, v, dout, bias, offset)), masked, keep, p
    )
    _assert_matches(out.detach().cpu(), ref_out)
    for got, expected in zip((qd.grad, kd.grad, vd.grad), ref_grads):
        _assert_matches(got.cpu(), expected)
    torch.testing.assert_close(bd.grad.cpu().double(), ref_dbias, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dpa.softmax_offset.grad.cpu().double(), ref_doffset,
                               rtol=1e-4, atol=1e-6)  # fmt: skip


def test_the_dropout_mask_keeps_one_minus_p_and_does_not_depend_on_blocks():
    seed = torch.tensor([7, 2**32 - 1], dtype=torch.int64)
    shape = (2, 3, 64, 1000)
    whole = score_blocks.dropout_keep(seed, shape, slice(0, 64), 0.1)
    assert abs(whole.double().mean().item() - 0.9) < 0.003
    assert torch.equal(score_blocks.dropout_keep(seed, shape, slice(5, 9), 0.1),
                       whole[:, :, 5:9])  # fmt: skip
    assert torch.equal(whole, hashed_keep(seed, shape, 0.1))
    other = score_blocks.dropout_keep(seed + 1, shape, slice(0, 64), 0.1)
    assert (other != whole).double().mean().item() > 0.1


def test_the_backward_keeps_no_score_matrix(monkeypatch):
    # 64 queries in blocks of 8 rows: nothing saved for backward is as big as one score matrix
    s = 64
    monkeypatch.setattr(score_blocks, "SCORE_BLOCK_BYTES", 8 * 4 * B * HQ * s)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, s, h, D, generator=g).requires_grad_() for h in (HQ, HKV, HKV))
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                              attn_mask_type="causal", attention_dropout=0.1, device="cpu")  # fmt: skip
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=Float8CurrentScaling(fp8_dpa=True)):
            out = dpa(q, k, v)
    out.sum().backward()
    assert saved and max(saved) <= B * HQ * s * D < B * HQ * s * s, sorted(saved)[-4:]
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_thd_equals_bshd_with_a_padding_mask(blocks):
    # Packed sequences and the same sequences padded (the padding masked) make one attention
    # problem: equal FP8 results, forward and backward, also in blocks
    lens, s = [5, 8], S
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(B, s, h, D, generator=g) for h in (HQ, HKV, HKV))
    for t in (q, k, v):
        for i, n in enumerate(lens):
            t[i, n:] = 0.0  # padding: no values that could count in an amax
    dout = torch.randn(B, s, HQ * D, generator=g)
    recipe = Float8CurrentScaling(fp8_dpa=True)
    padded = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.arange(s).view(1, 1, 1, s) >= torch.tensor(lens).view(B, 1, 1, 1)
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                              attn_mask_type="padding_causal", device="cpu")  # fmt: skip
    with te.autocast(recipe=recipe):
        out_bshd = dpa(*padded, attention_mask=mask)
    for i, n in enumerate(lens):
        dout[i, n:] = 0.0
    out_bshd.backward(dout)
    packed = [torch.cat([t[i, :n] for i, n in enumerate(lens)]).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    thd = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="thd",
                              attn_mask_type="padding_causal", device="cpu")  # fmt: skip
    with te.autocast(recipe=recipe):
        out_thd = thd(*packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    out_thd.backward(torch.cat([dout[i, :n] for i, n in enumerate(lens)]))
    unpack = lambda t: torch.cat([t[i, :n] for i, n in enumerate(lens)])  # noqa: E731
    torch.testing.assert_close(out_thd, unpack(out_bshd), rtol=1e-6, atol=1e-6)
    for got, ref in zip(packed, padded):
        torch.testing.assert_close(got.grad, unpack(ref.grad), rtol=1e-6, atol=1e-6)
    assert not torch.equal(out_thd, torch.zeros_like(out_thd))


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
def test_kv_cache_prefill_equals_the_call_without_a_cache_and_decoding_runs(paged):
    # fp8_dpa with a KV cache (upstream runs it; fp8_mha with one has no backend): the
    # prefill reads the prompt's K/V from the cache, its unused slots zero and masked, so it
    # rounds as the call without a cache does; each decoded token then attends to the cache
    from collections import OrderedDict

    from transformer_engine.pytorch.attention.inference import InferenceParams

    prompt, total = 5, 8
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(B, total, h, D, generator=g) for h in (HQ, HKV, HKV))
    recipe = Float8CurrentScaling(fp8_dpa=True)
    plain = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                                attn_mask_type="causal", device="cpu")  # fmt: skip
    with torch.no_grad(), te.autocast(recipe=recipe):
        expected = plain(q[:, :prompt], k[:, :prompt], v[:, :prompt])
        full = plain(q, k, v)
    paging = {"is_paged": True, "page_size": 2, "total_num_pages": B * 5} if paged else {}
    params = InferenceParams(B, 10, num_heads_kv=HKV, head_dim_k=D, dtype=torch.float32,
                             qkv_format="bshd", device="cpu", **paging)  # fmt: skip
    params.allocate_memory(1)
    dpa = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                              attn_mask_type="padding_causal", layer_number=1, device="cpu")  # fmt: skip
    params.pre_step(OrderedDict((i, prompt) for i in range(B)))
    with torch.no_grad(), te.autocast(recipe=recipe):
        out = dpa(q[:, :prompt], k[:, :prompt], v[:, :prompt], inference_params=params)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for t in range(prompt, total):
        params.pre_step(OrderedDict((i, 1) for i in range(B)))
        step = slice(t, t + 1)
        with torch.no_grad(), te.autocast(recipe=recipe):
            out = dpa(q[:, step], k[:, step], v[:, step], inference_params=params)
        # its own roundings (this step's amaxes), close to the FP8 call over all tokens
        torch.testing.assert_close(out, full[:, step], rtol=0.1, atol=0.1)
    mha = DotProductAttention(HQ, D, num_gqa_groups=HKV, qkv_format="bshd",
                              attn_mask_type="padding_causal", layer_number=1, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="fp8_mha with a KV cache"):
        with te.autocast(recipe=Float8CurrentScaling(fp8_mha=True)):
            mha(q[:, :1], k[:, :1], v[:, :1], inference_params=params)
