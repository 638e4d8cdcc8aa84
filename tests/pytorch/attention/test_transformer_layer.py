"""te.TransformerLayer against a plain-PyTorch float64 composition of the same weights
(transformer_oracle.py): residual variants, decoder, activations, norms, dropout and drop
path, state-dict keys, constructor and forward errors, meta init, checkpoints, BF16 and the FP8
recipes on CPU, and GPU placement."""

from __future__ import annotations

import io

import pytest
import torch
import transformer_oracle as oracle
from test_multi_head_attention import (
    BF16,
    F32,
    FP8,
    FP8_GRAD,
    output_grad,
    randomize,
    rel_rms,
    rms,
    rotary_freqs,
)
from utils import (
    REFERENCE_ACTIVATIONS,
    autocast_by_name,
    make_recipe,
    materialization_device,
    needs_cuda,
    needs_two_gpus,
)

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.distributed import checkpoint
from transformer_engine.pytorch.transformer import DropPath, TransformerLayer

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 4, 8, 2


def make(**kwargs):
    kwargs.setdefault("device", "cpu")
    layer = TransformerLayer(
        kwargs.pop("hidden_size", HIDDEN), kwargs.pop("ffn_hidden_size", FFN),
        kwargs.pop("heads", HEADS), **kwargs,
    )  # fmt: skip
    return layer.eval()  # the default dropouts (0.1) act only in training


def inputs(fmt="sbhd", dtype=torch.float32, seed=1, seq=SEQ, hidden=HIDDEN, device="cpu"):
    shape = (seq, BATCH, hidden) if fmt == "sbhd" else (BATCH, seq, hidden)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()


def check_against_oracle(layer, x, tol, grad_tol=None, encoder_output=None, **kwargs):
    """Output, input gradient(s) and every parameter gradient against the oracle."""
    grad_tol = grad_tol or tol
    freqs = kwargs.pop("rotary_pos_emb", None)
    out = layer(x, encoder_output=encoder_output, rotary_pos_emb=freqs, **kwargs)
    grad = output_grad(out)
    out.backward(grad)
    with oracle.differentiable(layer) as leaves:
        x64 = x.detach().double().cpu().requires_grad_()
        enc64 = None if encoder_output is None else encoder_output.detach().double().cpu()
        if enc64 is not None:
            enc64.requires_grad_()
        ref = oracle.transformer_layer(
            layer, x64, encoder_output=enc64, mask=kwargs.get("attention_mask"),
            enc_dec_mask=kwargs.get("enc_dec_attn_mask"), freqs=freqs,
            mask_type=kwargs.get("self_attn_mask_type"),
        )  # fmt: skip
        ref.backward(grad.double().cpu())
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_rms(out, ref) < tol, ("output", rel_rms(out, ref))
    assert rel_rms(x.grad, x64.grad) < grad_tol, ("input grad", rel_rms(x.grad, x64.grad))
    if enc64 is not None:
        assert rel_rms(encoder_output.grad, enc64.grad) < grad_tol
    tokens = x.numel() / x.shape[-1]
    for name, p in layer.named_parameters():
        # a bias gradient sums over the tokens: its scale grows with their square root
        scale = rms(x64.grad) * (tokens**0.5 if p.dim() == 1 else 1.0)
        error = rel_rms(p.grad, leaves[name].grad, scale=scale)
        assert error < grad_tol, (name, error)
    return out


# --- numerics ------------------------------------------------------------------------------------
VARIANTS = {
    "default": {},
    "post_layernorm_residual": {"apply_residual_connection_post_layernorm": True},
    "output_layernorm": {"output_layernorm": True},
    "output_and_post_layernorm": {
        "output_layernorm": True, "apply_residual_connection_post_layernorm": True,
    },
    "parallel_attention_mlp": {"parallel_attention_mlp": True},
    "rmsnorm_zero_centered": {"normalization": "RMSNorm", "zero_centered_gamma": True},
    "no_bias": {"bias": False},
    "fused_interleaved_gqa": {"fuse_qkv_params": True, "num_gqa_groups": 2},
    "fused_not_interleaved_mqa": {
        "fuse_qkv_params": True, "qkv_weight_interleaved": False, "num_gqa_groups": 1,
    },
    "bshd_no_mask": {"attn_input_format": "bshd", "self_attn_mask_type": "no_mask"},
    "kv_channels_window": {"kv_channels": 16, "window_size": (3, 0)},
    "qk_rmsnorm": {"qk_norm_type": "RMSNorm"},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_oracle(variant):
    kwargs = VARIANTS[variant]
    layer = randomize(make(**kwargs))
    check_against_oracle(layer, inputs(kwargs.get("attn_input_format", "sbhd")), F32)


@pytest.mark.parametrize("activation", list(REFERENCE_ACTIVATIONS))
def test_activations(activation):
    params = {"limit": 0.8, "alpha": 1.5} if activation == "clamped_swiglu" else None
    layer = randomize(make(activation=activation, activation_params=params))
    gated = activation in ("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")
    assert layer.layernorm_mlp.fc1_weight.shape == ((2 if gated else 1) * FFN, HIDDEN)
    check_against_oracle(layer, inputs(), F32)


@pytest.mark.parametrize("post_layernorm", [False, True])
def test_decoder(post_layernorm):
    layer = randomize(
        make(layer_type="decoder", apply_residual_connection_post_layernorm=post_layernorm,
             enc_dec_attn_mask_type="arbitrary", num_gqa_groups=2)
    )  # fmt: skip
    enc = inputs(seq=SEQ + 3, seed=4)
    mask = torch.rand(BATCH, 1, SEQ, SEQ + 3, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[..., 0] = False
    check_against_oracle(layer, inputs(), F32, encoder_output=enc, enc_dec_attn_mask=mask)


def test_rotary_embedding_and_mask_override():
    layer = randomize(make(rotary_pos_interleaved=True))
    freqs = rotary_freqs(SEQ, HIDDEN // HEADS, interleaved=True)
    check_against_oracle(layer, inputs(), F32, rotary_pos_emb=freqs, self_attn_mask_type="no_mask")


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_decoding_equals_the_full_forward(fmt, paged):
    """A prompt of 3 tokens, then one token per step: each step's output equals the full causal
    forward's at that position (rotary positions continue from the cached length)."""
    total, prompt, groups, d = 7, 3, 2, HIDDEN // HEADS
    layer = randomize(make(attn_input_format=fmt, num_gqa_groups=groups, layer_number=2))
    x = inputs(fmt, seq=total).detach()
    freqs = rotary_freqs(total, d)
    full = layer(x, rotary_pos_emb=freqs)
    paging = dict(is_paged=True, page_size=4, total_num_pages=BATCH * 2) if paged else {}
    params = InferenceParams(
        BATCH, 8, groups, d, torch.float32, qkv_format=fmt, device="cpu", **paging
    )
    seq_dim = 0 if fmt == "sbhd" else 1
    steps = [(0, prompt)] + [(t, 1) for t in range(prompt, total)]
    outputs = []
    for start, count in steps:
        params.pre_step({seq: count for seq in range(BATCH)})
        chunk = x.narrow(seq_dim, start, count)
        outputs.append(
            layer(chunk, self_attn_mask_type="padding_causal", inference_params=params,
                  rotary_pos_emb=freqs)
        )  # fmt: skip
    assert 2 in params.cache_manager.cache  # allocated by the layer, keyed by layer_number
    torch.testing.assert_close(torch.cat(outputs, seq_dim), full, rtol=1e-5, atol=1e-5)


def test_packed_thd_equals_each_sequence_alone():
    """Two sequences of 5 and 3 tokens packed as thd (padding_causal with cu_seqlens) give, per
    sequence, what the layer gives on that sequence alone (bshd, causal)."""
    lengths = (5, 3)
    layer = randomize(make(attn_input_format="thd", self_attn_mask_type="padding_causal"))
    alone = randomize(make(attn_input_format="bshd"))  # the same weights (same seed)
    x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    freqs = rotary_freqs(8, HIDDEN // HEADS)
    out = layer(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5,
                rotary_pos_emb=freqs)  # fmt: skip
    assert out.shape == x.shape
    for start, length in zip((0, 5), lengths):
        ref = alone(x[None, start : start + length], rotary_pos_emb=freqs)[0]
        torch.testing.assert_close(out[start : start + length], ref, rtol=1e-5, atol=1e-5)


def test_padding_mask_matches_oracle_on_the_real_tokens():
    """Self attention with a [b, 1, 1, s] padding mask (True = padded key/query): the real
    tokens match the oracle run with the padded keys hidden."""
    layer = randomize(make(self_attn_mask_type="padding"))
    mask = torch.zeros(BATCH, 1, 1, SEQ, dtype=torch.bool)
    mask[1, ..., 5:] = True  # the second sequence has 5 real tokens
    x = inputs()
    out = layer(x, attention_mask=mask)
    ref = oracle.transformer_layer(layer, x, mask=mask, mask_type="no_mask")
    assert rel_rms(out[:, 0], ref[:, 0]) < F32 and rel_rms(out[:5, 1], ref[:5, 1]) < F32


def test_eval_is_deterministic_and_training_drops():
    layer = randomize(make(hidden_dropout=0.5, attention_dropout=0.0))
    x = inputs()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def mlp_branch_only(layer):
    """Zero the attention output projection: the layer becomes ``x + mlp(x)`` (pre-LN)."""
    with torch.no_grad():
        layer.self_attention.proj.weight.zero_()
        layer.self_attention.proj.bias.zero_()
    return layer


def test_hidden_dropout_zeroes_and_rescales_the_branch():
    p = 0.5
    layer = mlp_branch_only(randomize(make(hidden_dropout=p))).train()
    x = inputs()
    branch = layer(x) - x
    mlp_out, mlp_bias, _ = oracle.mlp(layer.layernorm_mlp, x)
    expected = (mlp_out + mlp_bias).float()
    kept = branch != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(branch[kept], expected[kept] / (1 - p), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_drop_path_drops_whole_samples(fmt):
    p = 0.5
    layer = mlp_branch_only(
        randomize(make(drop_path_rate=p, hidden_dropout=0.0, attn_input_format=fmt))
    )
    assert isinstance(layer.drop_path, DropPath)
    layer.train()
    torch.manual_seed(0)
    x = inputs(fmt, seq=4)
    x = x.detach().repeat(1, 8, 1) if fmt == "sbhd" else x.detach().repeat(8, 1, 1)  # 16 samples
    branch = layer(x) - x
    mlp_out, mlp_bias, _ = oracle.mlp(layer.layernorm_mlp, x)
    expected = (mlp_out + mlp_bias).float() / (1 - p)
    per_sample = branch.transpose(0, 1) if fmt == "sbhd" else branch
    expected = expected.transpose(0, 1) if fmt == "sbhd" else expected
    dropped = [bool(torch.all(s == 0)) for s in per_sample]
    assert 0 < sum(dropped) < len(dropped)
    for s, e, d in zip(per_sample, expected, dropped):
        if not d:
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-5)
    assert make(drop_path_rate=0.0).drop_path is None


def test_torch_autocast_casts_the_input():
    layer = randomize(make())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(inputs())
    assert out.dtype == torch.bfloat16


# --- parameters ----------------------------------------------------------------------------------
def shapes(module):
    """Parameter shapes by state-dict key (the ``_extra_state`` entries are checked apart)."""
    return {
        k: tuple(v.shape)
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def test_default_state_dict_keys_and_shapes():
    h, f = HIDDEN, FFN
    layer = make()
    expected = {
        "self_attention.layernorm_qkv.layer_norm_weight": (h,),
        "self_attention.layernorm_qkv.layer_norm_bias": (h,),
        "self_attention.layernorm_qkv.query_weight": (h, h),
        "self_attention.layernorm_qkv.key_weight": (h, h),
        "self_attention.layernorm_qkv.value_weight": (h, h),
        "self_attention.layernorm_qkv.query_bias": (h,),
        "self_attention.layernorm_qkv.key_bias": (h,),
        "self_attention.layernorm_qkv.value_bias": (h,),
        "self_attention.proj.weight": (h, h), "self_attention.proj.bias": (h,),
        "layernorm_mlp.layer_norm_weight": (h,), "layernorm_mlp.layer_norm_bias": (h,),
        "layernorm_mlp.fc1_weight": (f, h), "layernorm_mlp.fc1_bias": (f,),
        "layernorm_mlp.fc2_weight": (h, f), "layernorm_mlp.fc2_bias": (h,),
    }  # fmt: skip
    assert shapes(layer) == expected
    extra = {k for k in layer.state_dict() if k.endswith("_extra_state")}
    assert extra == {
        "self_attention.layernorm_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.proj._extra_state", "layernorm_mlp._extra_state",
    }  # fmt: skip
    # registration order of the children (and of the parameters within the MLP)
    params = [k for k in layer.state_dict() if not k.endswith("_extra_state")]
    assert [k.split(".")[0] for k in params] == ["self_attention"] * 10 + ["layernorm_mlp"] * 6
    assert params[-6:] == [k for k in expected if k.startswith("layernorm_mlp")]


def test_state_dict_variants():
    h, f, g, d = HIDDEN, FFN, 2, HIDDEN // HEADS
    fused = shapes(make(fuse_qkv_params=True, normalization="RMSNorm", num_gqa_groups=g))
    assert {k for k in fused if k.startswith("self_attention.layernorm_qkv")} == {
        "self_attention.layernorm_qkv.layer_norm_weight",
        "self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias",
    }  # fmt: skip
    assert fused["self_attention.layernorm_qkv.weight"] == ((HEADS + 2 * g) * d, h)
    assert "layernorm_mlp.layer_norm_bias" not in fused
    no_bias = shapes(make(bias=False))
    assert not any(k.endswith("bias") and "layer_norm" not in k for k in no_bias)
    fc1_bias = make(bias=False).layernorm_mlp.fc1_bias  # None, or empty as upstream's
    assert fc1_bias is None or fc1_bias.numel() == 0
    out_ln = shapes(make(output_layernorm=True))
    assert {"layernorm.weight", "layernorm.bias", "self_attention.qkv.query_weight"} <= set(out_ln)
    assert not any(k.startswith("self_attention.layernorm_qkv") for k in out_ln)
    decoder = shapes(make(layer_type="decoder", num_gqa_groups=g))
    cross = {k: v for k, v in decoder.items() if k.startswith("inter_attention")}
    assert cross == {
        "inter_attention.layernorm_query.layer_norm_weight": (h,),
        "inter_attention.layernorm_query.layer_norm_bias": (h,),
        "inter_attention.layernorm_query.query_weight": (h, h),
        "inter_attention.layernorm_query.query_bias": (h,),
        "inter_attention.key_value.key_weight": (g * d, h),
        "inter_attention.key_value.value_weight": (g * d, h),
        "inter_attention.key_value.key_bias": (g * d,),
        "inter_attention.key_value.value_bias": (g * d,),
        "inter_attention.proj.weight": (h, h), "inter_attention.proj.bias": (h,),
    }  # fmt: skip
    assert "inter_attention.core_attention._extra_state" in make(layer_type="decoder").state_dict()
    learnable = make(softmax_type="learnable", device="meta")
    assert shapes(learnable)["self_attention.core_attention.softmax_offset"] == (HEADS,)
    assert learnable.self_attention.core_attention.softmax_offset.is_meta  # built with the rest
    glu = shapes(make(activation="swiglu"))
    assert glu["layernorm_mlp.fc1_weight"] == (2 * f, h) and glu["layernorm_mlp.fc1_bias"] == (
        2 * f,
    )


def test_default_initialization_and_init_methods():
    layer = make(hidden_size=256, ffn_hidden_size=512)
    for w in (layer.self_attention.layernorm_qkv.query_weight, layer.layernorm_mlp.fc2_weight):
        assert abs(w.std().item() - 0.023) < 0.002
    assert torch.all(layer.layernorm_mlp.layer_norm_weight == 1)
    assert torch.all(layer.layernorm_mlp.fc1_bias == 0)
    layer = make(
        init_method=lambda t: t.fill_(1.0), output_layer_init_method=lambda t: t.fill_(2.0)
    )
    assert torch.all(layer.self_attention.layernorm_qkv.key_weight == 1)
    assert torch.all(layer.layernorm_mlp.fc1_weight == 1)
    assert torch.all(layer.self_attention.proj.weight == 2)
    assert torch.all(layer.layernorm_mlp.fc2_weight == 2)


def test_recompute_gives_the_same_output_and_gradients():
    """checkpoint_core_attention (attention recomputed in backward) and te.checkpoint (the whole
    layer recomputed) change nothing in the results."""
    layer = randomize(make())
    results = []
    for run in ("plain", "core_attention", "te.checkpoint"):
        x = inputs()
        if run == "te.checkpoint":
            out = checkpoint(layer, x)
        else:
            out = layer(x, checkpoint_core_attention=run == "core_attention")
        out.backward(output_grad(out))
        results.append((out.detach(), x.grad, layer.layernorm_mlp.fc1_weight.grad.clone()))
        layer.zero_grad()
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_fp8_parameters_with_fused_qkv():
    with te.quantized_model_init(recipe=make_recipe("delayed")):
        layer = make(fuse_qkv_params=True, hidden_size=64, ffn_hidden_size=128)
    assert type(layer.self_attention.layernorm_qkv.weight).__name__ == "Float8Tensor"
    assert type(layer.layernorm_mlp.fc2_weight).__name__ == "Float8Tensor"
    x = inputs(seq=16, hidden=64)
    with autocast_by_name("delayed"):
        out = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


# --- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"fuse_wgrad_accumulation": True}, ValueError, "requires fuse_qkv_params=True"),
        ({"layer_type": "encdec"}, ValueError, "layer_type='encdec'"),
        ({"parallel_attention_mlp": True, "layer_type": "decoder"}, ValueError, "encoder"),
        ({"parallel_attention_mlp": True, "output_layernorm": True}, ValueError, "cannot be combined"),
        (
            {"parallel_attention_mlp": True, "apply_residual_connection_post_layernorm": True},
            ValueError, "cannot be combined",
        ),
        ({"self_attn_mask_type": "diagonal"}, ValueError, "self_attn_mask_type='diagonal'"),
        ({"enc_dec_attn_mask_type": "full"}, ValueError, "enc_dec_attn_mask_type='full'"),
        ({"activation": "tanh"}, ValueError, "tanh"),
        ({"hidden_dropout": 1.0}, ValueError, "hidden_dropout=1.0"),
        ({"tp_size": 2}, ValueError, "tp_size=2 needs set_parallel_mode=True"),
        ({"tp_size": 3, "set_parallel_mode": True}, ValueError, "not divisible by tp_size=3"),
    ],
)  # fmt: skip
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make(**kwargs)


def test_mask_type_spellings_and_forward_errors():
    assert make(self_attn_mask_type="causal,padding").self_attn_mask_type == "padding_causal"
    layer = make()
    x = inputs()
    with pytest.raises(ValueError, match="self_attn_mask_type='upper'"):
        layer(x, self_attn_mask_type="upper")
    with pytest.raises(TypeError, match="torch.bool"):
        layer(x, attention_mask=torch.ones(BATCH, 1, 1, SEQ), self_attn_mask_type="padding")
    with pytest.raises(ValueError, match="needs encoder_output"):
        make(layer_type="decoder")(x)


def test_fuse_wgrad_accumulation():
    layer = make(fuse_qkv_params=True, fuse_wgrad_accumulation=True)
    weights = [p for n, p in layer.named_parameters() if n.endswith("weight") and p.dim() == 2]
    for p in weights:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    layer(inputs()).sum().backward()
    assert all(p.main_grad.abs().sum() > 0 for p in weights)


def test_group_setters_and_fp8_meta_reset():
    layer = make()
    layer.set_tensor_parallel_group(None)
    assert layer.layernorm_mlp.tp_group is None and layer.self_attention.proj.tp_group is None
    x = inputs(seq=16)
    with autocast_by_name("delayed"):
        layer(x).sum().backward()
    with autocast_by_name("delayed"):
        layer(x)  # the scale update at the first exit changed the scales
    state = layer.layernorm_mlp.fp8_meta["scaling_fwd"]
    assert not torch.all(state.scale == 1)
    layer.reset_fp8_meta_tensors()
    assert torch.all(state.scale == 1) and torch.all(state.amax_history == 0)


# --- devices and checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("layer_type", ["encoder", "decoder"])
def test_meta_init_then_reset_parameters(layer_type):
    kwargs = dict(layer_type=layer_type, output_layernorm=True, qk_norm_type="LayerNorm")
    layer = make(device="meta", **kwargs)
    assert all(p.is_meta for p in layer.parameters())
    layer.reset_parameters()
    # without a device, meta modules materialize on the current CUDA device, else the CPU
    device = materialization_device()
    assert all(p.device == device for p in layer.parameters())
    for name, p in layer.named_parameters():
        if name.endswith(("layer_norm_weight", "norm.weight")) or name == "layernorm.weight":
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert abs(p.std().item() - 0.023) < 0.01, name
    x = inputs().to(device)
    assert torch.isfinite(layer(x, encoder_output=x if layer_type == "decoder" else None)).all()


def test_checkpoint_round_trip_with_weights_only_load():
    src = randomize(make(layer_type="decoder"))
    x = inputs(seq=16)
    with autocast_by_name("delayed"):
        src(x, encoder_output=x).sum().backward()
    buffer = io.BytesIO()
    torch.save(src.state_dict(), buffer)
    buffer.seek(0)
    dst = make(layer_type="decoder", device="meta")
    dst.to_empty(device="cpu")
    dst.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(src(x, encoder_output=x), dst(x, encoder_output=x))
    for name in ("self_attention.proj", "inter_attention.key_value", "layernorm_mlp"):
        a, b = src.get_submodule(name).fp8_meta, dst.get_submodule(name).fp8_meta
        assert torch.equal(a["scaling_fwd"].amax_history, b["scaling_fwd"].amax_history), name


# --- precisions ----------------------------------------------------------------------------------
def test_bf16_matches_oracle():
    layer = randomize(make(params_dtype=torch.bfloat16, activation="swiglu", num_gqa_groups=2))
    check_against_oracle(layer, inputs(dtype=torch.bfloat16), BF16, grad_tol=2 * BF16)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("variant", ["default", "parallel_attention_mlp"])
def test_fp8_recipes_on_cpu(recipe, variant):
    layer = randomize(make(hidden_size=64, ffn_hidden_size=128, **VARIANTS[variant]))
    x = inputs(seq=16, hidden=64)
    if recipe == "delayed":  # calibrate the scales with the gradient the check uses
        for _ in range(2):
            with autocast_by_name(recipe):
                out = layer(x)
            out.backward(output_grad(out))
        layer.zero_grad()
        x.grad = None
    with autocast_by_name(recipe):
        check_against_oracle(layer, x, FP8, grad_tol=FP8_GRAD)


# --- GPU -----------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("recipe", ["high_precision", "delayed", "current"])
def test_cuda_matches_oracle(recipe):
    layer = randomize(make(hidden_size=64, ffn_hidden_size=128, params_dtype=torch.bfloat16,
                           device="cuda"))  # fmt: skip
    x = inputs(seq=16, hidden=64, dtype=torch.bfloat16, device="cuda")
    tol = (BF16, 2 * BF16) if recipe == "high_precision" else (FP8, FP8_GRAD)
    with autocast_by_name(recipe):
        check_against_oracle(layer, x, tol[0], grad_tol=tol[1])


@needs_two_gpus
def test_second_gpu_while_first_is_current():
    torch.cuda.set_device(0)
    layer = randomize(make(params_dtype=torch.bfloat16, device="cuda:1", hidden_size=64,
                           ffn_hidden_size=128))  # fmt: skip
    x = inputs(seq=16, hidden=64, dtype=torch.bfloat16, device="cuda:1")
    with autocast_by_name("current"):
        check_against_oracle(layer, x, FP8, grad_tol=FP8_GRAD)
    assert torch.cuda.current_device() == 0
    meta = make(device="meta", layer_type="decoder")
    meta.to_empty(device="cuda:1")
    meta.reset_parameters()
    assert {p.device for p in meta.parameters()} == {torch.device("cuda:1")}
    assert torch.cuda.current_device() == 0
    # a checkpoint read onto the CPU restores onto the module's device (cuda:1)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu", weights_only=True)
    restored = make(
        params_dtype=torch.bfloat16, device="cuda:1", hidden_size=64, ffn_hidden_size=128
    )
    restored.load_state_dict(state)
    assert torch.cuda.current_device() == 0
    assert torch.equal(restored(x), layer(x))
    with autocast_by_name("delayed"):
        restored(x).sum().backward()
    assert restored.layernorm_mlp.fp8_meta["scaling_fwd"].scale.device == torch.device("cuda:1")
