"""te.MultiheadAttention against a plain-PyTorch float64 composition of the same weights
(transformer_oracle.py): self and cross attention, the QKV parameter layouts, input norms, GQA,
rotary embeddings, QK norms, outputs, state-dict keys, constructor errors, meta init,
checkpoints, BF16 and the FP8 recipes on CPU, and GPU placement."""

from __future__ import annotations

import io

import pytest
import torch
import transformer_oracle as oracle
from utils import autocast_by_name, materialization_device, needs_cuda, needs_two_gpus

from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention

HIDDEN, HEADS, SEQ, BATCH = 32, 4, 8, 2


def make(**kwargs):
    kwargs.setdefault("attention_dropout", 0.0)
    kwargs.setdefault("device", "cpu")
    return MultiheadAttention(
        kwargs.pop("hidden_size", HIDDEN), kwargs.pop("heads", HEADS), **kwargs
    )


def randomize(module, seed=0):
    """Non-trivial values everywhere (norm weights and biases included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5)
                + (p.dim() == 1) * 0.2
            )
    return module


def inputs(fmt="sbhd", dtype=torch.float32, seed=1, seq=SEQ, hidden=HIDDEN, device="cpu"):
    shape = (seq, BATCH, hidden) if fmt == "sbhd" else (BATCH, seq, hidden)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()


def rms(t):
    return t.detach().double().cpu().pow(2).mean().sqrt().item()


def rel_rms(actual, expected, scale=None):
    """RMS of the error over the RMS of the expected values (or over ``scale`` when that is
    larger: a gradient that is zero in exact arithmetic, like the key bias's, is compared with
    the size of the other gradients)."""
    error = rms(actual.detach().double().cpu() - expected.detach().double().cpu())
    return error / max(rms(expected), scale or 0.0)


def output_grad(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)


def check_against_oracle(module, x, tol, encoder_output=None, grad_tol=None, **oracle_kwargs):
    """Forward and backward of ``module`` against the oracle: output, input gradient(s) and
    every parameter gradient, within ``tol`` (gradients: ``grad_tol``, default ``tol``)
    relative RMS error."""
    grad_tol = grad_tol or tol
    call = {k: v for k, v in oracle_kwargs.items() if k != "freqs"}
    if "freqs" in oracle_kwargs:
        call["rotary_pos_emb"] = oracle_kwargs["freqs"]
    out = module(x, encoder_output=encoder_output, **call)
    out = out[0] if isinstance(out, tuple) else out
    grad = output_grad(out)
    out.backward(grad)
    with oracle.differentiable(module) as leaves:
        x64 = x.detach().double().cpu().requires_grad_()
        enc64 = None
        if encoder_output is not None:
            enc64 = encoder_output.detach().double().cpu().requires_grad_()
        ref, ref_bias, _ = oracle.mha(module, x64, encoder_output=enc64, **oracle_kwargs)
        ref.backward(grad.double().cpu())
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_rms(out, ref) < tol, ("output", rel_rms(out, ref))
    assert rel_rms(x.grad, x64.grad) < grad_tol, ("input grad", rel_rms(x.grad, x64.grad))
    if enc64 is not None:
        assert rel_rms(encoder_output.grad, enc64.grad) < grad_tol
    for name, p in module.named_parameters():
        if module.return_bias and name == "proj.bias":
            continue  # not used by the output (returned separately)
        assert p.grad is not None, name
        # a bias gradient sums over the tokens: its scale grows with their square root
        scale = rms(x64.grad) * (x.numel() / x.shape[-1]) ** (0.5 if p.dim() == 1 else 0)
        error = rel_rms(p.grad, leaves[name].grad, scale=scale)
        assert error < grad_tol, (name, error)
    return out


F32 = 1e-5  # float32 against float64: a few float32 roundings


# --- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fuse_qkv_params, interleaved", [(False, True), (True, False), (True, True)]
)
@pytest.mark.parametrize("groups", [HEADS, 2, 1])
@pytest.mark.parametrize("input_layernorm", [True, False])
def test_self_attention_layouts_match_oracle(fuse_qkv_params, interleaved, groups, input_layernorm):
    m = randomize(
        make(fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=interleaved,
             num_gqa_groups=groups, input_layernorm=input_layernorm)
    )  # fmt: skip
    assert m.qkv_weight_interleaved == (interleaved and fuse_qkv_params)
    check_against_oracle(m, inputs(), F32)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
@pytest.mark.parametrize(
    "normalization, zero_centered_gamma", [("LayerNorm", True), ("RMSNorm", False)]
)
def test_formats_masks_norms(fmt, mask_type, normalization, zero_centered_gamma):
    m = randomize(
        make(qkv_format=fmt, attn_mask_type=mask_type, input_layernorm=True,
             normalization=normalization, zero_centered_gamma=zero_centered_gamma)
    )  # fmt: skip
    check_against_oracle(m, inputs(fmt), F32)


def test_arbitrary_mask_and_forward_mask_type_override():
    m = randomize(make(input_layernorm=True))  # built causal, run arbitrary
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=gen) < 0.3
    mask[..., 0] = False  # every query sees at least one key
    check_against_oracle(m, inputs(), F32, attention_mask=mask, attn_mask_type="arbitrary")


def test_sliding_window():
    m = randomize(make(attn_mask_type="causal", window_size=(2, 0)))
    check_against_oracle(m, inputs(), F32)


@pytest.mark.parametrize(
    "fuse_qkv_params, interleaved", [(False, False), (True, False), (True, True)]
)
@pytest.mark.parametrize("groups", [HEADS, 2])
def test_cross_attention_matches_oracle(fuse_qkv_params, interleaved, groups):
    m = randomize(
        make(attention_type="cross", attn_mask_type="no_mask", input_layernorm=True,
             fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=interleaved,
             num_gqa_groups=groups)
    )  # fmt: skip
    enc = inputs(seed=5, seq=SEQ + 4)  # a longer encoder sequence
    check_against_oracle(m, inputs(), F32, encoder_output=enc)


def rotary_freqs(seq, dim, base=10000.0, interleaved=False):
    """``[seq, 1, 1, dim]`` fp32 frequencies, written out (not RotaryPositionEmbedding)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    full = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)
    return full.float().view(seq, 1, 1, dim)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("as_tuple", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_rotary_embedding(interleaved, as_tuple, fmt):
    d = HIDDEN // HEADS
    m = randomize(make(rotary_pos_interleaved=interleaved, qkv_format=fmt, num_gqa_groups=2))
    freqs = rotary_freqs(SEQ, d, interleaved=interleaved)
    if as_tuple:  # different frequencies for K: only the tuple form can say so
        freqs = (freqs, rotary_freqs(SEQ, d, base=100.0, interleaved=interleaved))
    check_against_oracle(m, inputs(fmt), F32, freqs=freqs)


def test_partial_rotary_dimension_passes_the_rest_through():
    m = randomize(make())
    check_against_oracle(m, inputs(), F32, freqs=rotary_freqs(SEQ, 4))


@pytest.mark.parametrize("kind", ["L2Normalization", "RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("before_rope", [False, True])
def test_qk_norm(kind, before_rope):
    m = randomize(make(qk_norm_type=kind, qk_norm_before_rope=before_rope, input_layernorm=True))
    if kind == "L2Normalization":
        assert m.q_norm is m.k_norm
    else:
        assert m.q_norm is not m.k_norm and m.q_norm.weight.shape == (HIDDEN // HEADS,)
    check_against_oracle(m, inputs(), F32, freqs=rotary_freqs(SEQ, HIDDEN // HEADS))


def test_kv_channels_different_from_hidden_over_heads():
    m = randomize(make(kv_channels=16, num_gqa_groups=2))  # 4 heads x 16 = 64 != 32
    assert m.proj.weight.shape == (HIDDEN, 64)
    check_against_oracle(m, inputs(), F32)


def test_no_bias():
    m = randomize(make(bias=False, input_layernorm=True))
    assert not any(n.endswith("bias") and "layer_norm" not in n for n, _ in m.named_parameters())
    check_against_oracle(m, inputs(), F32)


# --- outputs -------------------------------------------------------------------------------------
def test_return_bias_and_layernorm_output():
    m = randomize(make(input_layernorm=True, return_bias=True, return_layernorm_output=True))
    x = inputs()
    out, bias, ln_out = m(x)
    ref, ref_bias, ref_ln = oracle.mha(m, x)
    assert bias.shape == (HIDDEN,) and ln_out.shape == x.shape
    assert (
        rel_rms(out, ref) < F32 and rel_rms(bias, ref_bias) < F32 and rel_rms(ln_out, ref_ln) < F32
    )
    out_only = make(input_layernorm=True, return_layernorm_output=True)(x)
    assert len(out_only) == 2
    assert isinstance(make()(x), torch.Tensor)
    assert isinstance(make(return_layernorm_output=True)(x), torch.Tensor)  # no input norm


# --- parameters ----------------------------------------------------------------------------------
def shapes(module):
    """Parameter shapes by state-dict key (the ``_extra_state`` entries are checked apart)."""
    return {
        k: tuple(v.shape)
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def test_state_dict_names_and_shapes_per_layout():
    h, g, d = HEADS, 2, 8
    split = make(num_gqa_groups=g, input_layernorm=True)
    assert shapes(split) == {
        "layernorm_qkv.layer_norm_weight": (HIDDEN,), "layernorm_qkv.layer_norm_bias": (HIDDEN,),
        "layernorm_qkv.query_weight": (h * d, HIDDEN), "layernorm_qkv.key_weight": (g * d, HIDDEN),
        "layernorm_qkv.value_weight": (g * d, HIDDEN), "layernorm_qkv.query_bias": (h * d,),
        "layernorm_qkv.key_bias": (g * d,), "layernorm_qkv.value_bias": (g * d,),
        "proj.weight": (HIDDEN, h * d), "proj.bias": (HIDDEN,),
    }  # fmt: skip
    keys = set(split.state_dict())
    assert {
        "layernorm_qkv._extra_state",
        "core_attention._extra_state",
        "proj._extra_state",
    } <= keys
    fused = make(
        num_gqa_groups=g, fuse_qkv_params=True, normalization="RMSNorm", input_layernorm=True
    )
    assert {k: v for k, v in shapes(fused).items() if k.startswith("layernorm_qkv")} == {
        "layernorm_qkv.layer_norm_weight": (HIDDEN,),
        "layernorm_qkv.weight": ((h + 2 * g) * d, HIDDEN), "layernorm_qkv.bias": ((h + 2 * g) * d,),
    }  # fmt: skip
    plain = make(input_layernorm=False, bias=False)
    assert shapes(plain) == {
        "qkv.query_weight": (HIDDEN, HIDDEN), "qkv.key_weight": (HIDDEN, HIDDEN),
        "qkv.value_weight": (HIDDEN, HIDDEN), "proj.weight": (HIDDEN, HIDDEN),
    }  # fmt: skip
    cross = make(attention_type="cross", input_layernorm=True, num_gqa_groups=g)
    assert {k: v for k, v in shapes(cross).items() if "layer_norm" not in k} == {
        "layernorm_query.query_weight": (h * d, HIDDEN), "layernorm_query.query_bias": (h * d,),
        "key_value.key_weight": (g * d, HIDDEN), "key_value.value_weight": (g * d, HIDDEN),
        "key_value.key_bias": (g * d,), "key_value.value_bias": (g * d,),
        "proj.weight": (HIDDEN, h * d), "proj.bias": (HIDDEN,),
    }  # fmt: skip
    cross_fused = make(attention_type="cross", fuse_qkv_params=True)
    assert {k for k in shapes(cross_fused) if not k.startswith("proj")} == {
        "query_layer.weight", "query_layer.bias", "key_value.weight", "key_value.bias",
    }  # fmt: skip
    qk = make(qk_norm_type="LayerNorm")
    assert shapes(qk)["q_norm.weight"] == (HIDDEN // HEADS,) and "k_norm.bias" in shapes(qk)


def test_state_dict_order_of_split_parameters():
    # upstream registers all weights, then all biases: parameters() order, which optimizer
    # state follows, so an optimizer checkpoint maps onto the same parameters
    keys = [k for k in make().state_dict() if k.startswith("qkv.")]
    assert keys[:6] == [
        "qkv.query_weight", "qkv.key_weight", "qkv.value_weight",
        "qkv.query_bias", "qkv.key_bias", "qkv.value_bias",
    ]  # fmt: skip


def test_default_initialization():
    m = make(input_layernorm=True, zero_centered_gamma=True, hidden_size=256, heads=4)
    w = m.layernorm_qkv.query_weight
    assert abs(w.std().item() - 0.023) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.all(m.layernorm_qkv.layer_norm_weight == 0)  # zero-centered gamma
    assert torch.all(m.layernorm_qkv.query_bias == 0) and torch.all(m.proj.bias == 0)
    seen = []
    make(init_method=lambda t: seen.append("in") or t.fill_(1.0),
         output_layer_init_method=lambda t: seen.append("out") or t.fill_(2.0))  # fmt: skip
    assert sorted(set(seen)) == ["in", "out"]


# --- construction errors -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_gqa_groups": 3}, ValueError, "num_gqa_groups=3 must divide"),
        ({"heads": 5}, ValueError, "not divisible by num_attention_heads"),
        ({"attention_type": "both"}, ValueError, "attention_type='both'"),
        ({"qkv_format": "sbh"}, ValueError, "qkv_format='sbh'"),
        ({"qk_norm_type": "BatchNorm"}, ValueError, "qk_norm_type='BatchNorm'"),
        ({"normalization": "BatchNorm"}, ValueError, "normalization='BatchNorm'"),
        ({"layer_number": 0}, ValueError, "layer_number=0"),
        ({"fuse_wgrad_accumulation": True}, ValueError, "requires fuse_qkv_params=True"),
        ({"tp_size": 2}, ValueError, "tp_size=2 needs set_parallel_mode=True"),
        ({"tp_size": 3, "set_parallel_mode": True}, ValueError, "not divisible by tp_size=3"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make(**kwargs)


def test_forward_errors():
    m = make(attn_mask_type="padding")
    with pytest.raises(TypeError, match="torch.bool"):
        m(inputs(), attention_mask=torch.zeros(BATCH, 1, 1, SEQ, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected hidden_size=32"):
        m(torch.randn(SEQ, BATCH, 16))
    with pytest.raises(ValueError, match="needs encoder_output"):
        make(attention_type="cross")(inputs())


def test_fuse_wgrad_accumulation_with_fused_qkv():
    m = make(fuse_qkv_params=True, fuse_wgrad_accumulation=True, input_layernorm=True)
    for p in (m.layernorm_qkv.weight, m.proj.weight):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    x = inputs()
    m(x).sum().backward()
    assert (
        m.layernorm_qkv.weight.main_grad.abs().sum() > 0 and m.proj.weight.main_grad.abs().sum() > 0
    )


# --- devices and checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("attention_type", ["self", "cross"])
def test_meta_init_then_reset_parameters(attention_type):
    kwargs = dict(attention_type=attention_type, input_layernorm=True, qk_norm_type="RMSNorm")
    m = make(device="meta", **kwargs)
    assert all(p.is_meta for p in m.parameters())
    m.reset_parameters()
    # without a device, meta modules materialize on the current CUDA device, else the CPU
    device = materialization_device()
    assert all(p.device == device for p in m.parameters())
    for name, p in m.named_parameters():
        if name.endswith(("layer_norm_weight", "norm.weight")):
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert abs(p.std().item() - 0.023) < 0.01, name
    x = inputs().to(device)
    out = m(x, encoder_output=x if attention_type == "cross" else None)
    assert torch.isfinite(out).all()


def test_checkpoint_round_trip_with_weights_only_load():
    src = randomize(make(input_layernorm=True, qk_norm_type="LayerNorm"))
    with autocast_by_name("delayed"):
        src(inputs(seq=16)).sum().backward()  # FP8 state worth saving
    buffer = io.BytesIO()
    torch.save(src.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    dst = make(input_layernorm=True, qk_norm_type="LayerNorm", device="meta")
    dst.to_empty(device="cpu")
    dst.load_state_dict(state)
    x = inputs(seq=16)
    assert torch.equal(src(x), dst(x))
    fwd_src = src.layernorm_qkv.fp8_meta["scaling_fwd"].scale
    assert torch.equal(dst.layernorm_qkv.fp8_meta["scaling_fwd"].scale, fwd_src)


# --- precisions ----------------------------------------------------------------------------------
BF16 = 1.5e-2  # BF16 activations through three GEMMs, a norm and a softmax
# FP8 projections: E4M3 operands forward (~4% RMS error per product); gradients in E5M2 (HYBRID,
# twice the E4M3 step) pass through two FP8 GEMMs on their way to the input.
FP8, FP8_GRAD = 0.1, 0.3


def test_bf16_matches_oracle():
    m = randomize(make(input_layernorm=True, params_dtype=torch.bfloat16, num_gqa_groups=2))
    check_against_oracle(m, inputs(dtype=torch.bfloat16), BF16)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("attention_type", ["self", "cross"])
def test_fp8_recipes_on_cpu(recipe, attention_type):
    """FP8 projections (E4M3 forward, E5M2 gradients with delayed's HYBRID default too) against
    the float64 oracle; the attention itself stays high precision."""
    m = randomize(
        make(input_layernorm=True, attention_type=attention_type, hidden_size=64,
             attn_mask_type="no_mask" if attention_type == "cross" else "causal")
    )  # fmt: skip
    x = inputs(seq=16, hidden=64)
    enc = inputs(seq=16, hidden=64, seed=9) if attention_type == "cross" else None
    if recipe == "delayed":  # calibrate the scales first: the initial scale of 1 is arbitrary
        for _ in range(2):
            with autocast_by_name(recipe):
                out = m(x, encoder_output=enc)
            out.backward(output_grad(out))  # the gradient the check uses
        m.zero_grad()
        for t in (x, enc):
            if t is not None:
                t.grad = None
    with autocast_by_name(recipe):
        check_against_oracle(m, x, FP8, encoder_output=enc, grad_tol=FP8_GRAD)
    assert m.proj.fp8_meta["recipe"] is not None  # the projections did run in FP8


# --- GPU -----------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_cuda_bf16_matches_oracle(fmt):
    m = randomize(make(input_layernorm=True, num_gqa_groups=2, qkv_format=fmt,
                       params_dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    x = inputs(fmt, dtype=torch.bfloat16, device="cuda")
    check_against_oracle(m, x, BF16, freqs=rotary_freqs(SEQ, HIDDEN // HEADS).cuda())


@needs_cuda
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_cuda_fp8_matches_oracle(recipe):
    m = randomize(make(input_layernorm=True, hidden_size=64, params_dtype=torch.bfloat16,
                       device="cuda"))  # fmt: skip
    with autocast_by_name(recipe):
        check_against_oracle(
            m, inputs(seq=16, hidden=64, dtype=torch.bfloat16, device="cuda"), FP8,
            grad_tol=FP8_GRAD,
        )  # fmt: skip


@needs_two_gpus
def test_second_gpu_while_first_is_current():
    torch.cuda.set_device(0)
    m = randomize(make(input_layernorm=True, params_dtype=torch.bfloat16, device="cuda:1"))
    assert all(p.device == torch.device("cuda:1") for p in m.parameters())
    x = inputs(dtype=torch.bfloat16, device="cuda:1")
    check_against_oracle(m, x, BF16)
    assert torch.cuda.current_device() == 0
    meta = make(device="meta", input_layernorm=True)
    meta.to_empty(device="cuda:1")
    meta.reset_parameters()
    assert all(p.device == torch.device("cuda:1") for p in meta.parameters())
    assert torch.cuda.current_device() == 0
