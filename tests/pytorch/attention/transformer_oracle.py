"""A plain-PyTorch float64 composition of multi-head attention and a transformer layer, written
from the formulas (``F.layer_norm``, ``F.linear``, softmax attention by hand, the activation
formulas of tests/pytorch/utils.py, residuals), reading the weights of a te module by name.

It shares no code with transformer_engine: it is the oracle the MHA and TransformerLayer tests
compare against. Every function takes and returns float64 tensors in the module's input layout
(``sbhd``: ``[s, b, hidden]``, ``bshd``: ``[b, s, hidden]``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from utils import REFERENCE_ACTIVATIONS

# Parameters (by id) that the oracle reads as differentiable float64 leaves (see differentiable).
_LEAVES: dict[int, torch.Tensor] = {}


def f64(t):
    if t is None:
        return None
    leaf = _LEAVES.get(id(t))
    if leaf is not None:
        return leaf
    if t.dtype == torch.float64 and t.device.type == "cpu":
        return t  # already an oracle tensor (maybe differentiable): keep its graph
    return t.detach().cpu().double()


@contextlib.contextmanager
def differentiable(module):
    """Inside the block the oracle reads ``module``'s parameters as float64 leaves that require
    grad; yields ``{parameter name: leaf}`` so a test can compare their gradients."""
    named = dict(module.named_parameters())
    # CPU float64 leaves, wherever the module lives (the oracle runs on the CPU)
    leaves = {name: p.detach().double().cpu().requires_grad_() for name, p in named.items()}
    ids = {id(p): leaves[name] for name, p in named.items()}
    _LEAVES.update(ids)
    try:
        yield leaves
    finally:
        for key in ids:
            _LEAVES.pop(key, None)


def param(module, name):
    """``module.<name>`` in float64; None when absent or empty (a module without biases holds
    None or, as upstream's do, an empty tensor)."""
    t = getattr(module, name, None)
    return None if t is None or t.numel() == 0 else f64(t)


# --- pieces ----------------------------------------------------------------------------------------
def norm(x, weight, bias, kind, eps, zero_centered_gamma=False):
    gamma = weight + 1 if zero_centered_gamma else weight
    if kind == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


def rope(t, freqs, interleaved=False):
    """``t`` ``[b, s, heads, d]``; ``freqs`` ``[s, 1, 1, rot]``: rotate the first ``rot`` channels
    (halves, or even/odd pairs when interleaved)."""
    f = f64(freqs)[: t.shape[1]].squeeze(1).squeeze(1)[None, :, None, :]  # [1, s, 1, rot]
    rot = f.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], rot // 2, 2)
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(x.shape)
    else:
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x * f.cos() + rotated * f.sin(), rest], dim=-1)


def softmax_attention(q, k, v, mask_type="no_mask", mask=None, window=None):
    """``q`` ``[b, sq, h, d]``, ``k``/``v`` ``[b, skv, g, d]`` -> ``[b, sq, h * d]``.

    Query head ``n`` reads K/V group ``n // (h // g)``. ``causal``: key ``j`` is hidden from
    query ``i`` when ``j > i`` (top-left diagonal). ``mask``: boolean, True = hidden,
    broadcastable to ``[b, h, sq, skv]``. ``window=(left, right)``: key ``j`` visible from query
    ``i`` only for ``i - left <= j <= i + right`` (-1 = unbounded).
    """
    h, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    sq, skv = scores.shape[-2:]
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    hidden = torch.zeros(sq, skv, dtype=torch.bool)
    if "causal" in mask_type:
        hidden |= j > i
    if window is not None:
        left, right = window
        if left >= 0:
            hidden |= j < i - left
        if right >= 0:
            hidden |= j > i + right
    scores = scores.masked_fill(hidden, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return out.reshape(*out.shape[:2], -1)


# --- weights of a te MultiheadAttention, by name ------------------------------------------------------
def qkv_weights(mha):
    """``[(q_w, q_b), (k_w, k_b), (v_w, v_b)]`` of self attention, read from the parameters as
    the layout documentation describes them."""
    proj = mha.layernorm_qkv if mha.input_layernorm else mha.qkv
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.hidden_size_per_attention_head
    if not mha.fuse_qkv_params:
        return [
            (param(proj, f"{n}_weight"), param(proj, f"{n}_bias"))
            for n in ("query", "key", "value")
        ]
    w, b = param(proj, "weight"), param(proj, "bias")
    if mha.qkv_weight_interleaved:  # per group: [q heads of the group, k, v]
        per = h // g
        wg = w.view(g, per + 2, d, -1)
        bg = None if b is None else b.view(g, per + 2, d)
        parts = [(slice(0, per), h), (slice(per, per + 1), g), (slice(per + 1, per + 2), g)]
        return [
            (wg[:, s].reshape(n * d, -1), None if bg is None else bg[:, s].reshape(n * d))
            for s, n in parts
        ]
    sizes = (h * d, g * d, g * d)
    ws = w.split(sizes)
    bs = (None,) * 3 if b is None else b.split(sizes)
    return list(zip(ws, bs))


def cross_weights(mha):
    """``[(q_w, q_b), (k_w, k_b), (v_w, v_b)]`` of cross attention."""
    qp = mha.layernorm_query if mha.input_layernorm else mha.query_layer
    g, d = mha.num_gqa_groups, mha.hidden_size_per_attention_head
    if mha.fuse_qkv_params:
        q = (param(qp, "weight"), param(qp, "bias"))
        w, b = param(mha.key_value, "weight"), param(mha.key_value, "bias")
        if mha.qkv_weight_interleaved:  # per group: [k, v]
            wg, bg = w.view(g, 2, d, -1), None if b is None else b.view(g, 2, d)
            k = (wg[:, 0].reshape(g * d, -1), None if bg is None else bg[:, 0].reshape(-1))
            v = (wg[:, 1].reshape(g * d, -1), None if bg is None else bg[:, 1].reshape(-1))
        else:
            k, v = zip(w.split(g * d), (None, None) if b is None else b.split(g * d))
        return [q, k, v]
    q = (param(qp, "query_weight"), param(qp, "query_bias"))
    kv = mha.key_value
    return [q] + [(param(kv, f"{n}_weight"), param(kv, f"{n}_bias")) for n in ("key", "value")]


def input_norm(mha, x, proj):
    return norm(
        x, param(proj, "layer_norm_weight"), param(proj, "layer_norm_bias"), proj.normalization,
        proj.eps, proj.zero_centered_gamma,
    )  # fmt: skip


def qk_norm(module, t, kind, eps):
    if kind == "L2Normalization":
        return t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + eps)
    return norm(t, param(module, "weight"), param(module, "bias"), kind, eps)


def to_bshd(t, fmt):
    return t.transpose(0, 1) if fmt == "sbhd" else t


def mha(
    module,
    x,
    encoder_output=None,
    attn_mask_type=None,
    attention_mask=None,
    freqs=None,
    qk_eps=1e-6,
):
    """MultiheadAttention forward in float64: ``(out, bias_or_None, layernorm_output_or_None)``
    with ``out`` excluding ``proj``'s bias when ``module.return_bias``."""
    fmt = module.qkv_format
    xb = to_bshd(f64(x), fmt)
    h, g, d = (
        module.num_attention_heads,
        module.num_gqa_groups,
        module.hidden_size_per_attention_head,
    )
    ln = None
    if module.attention_type == "self":
        proj_in = module.layernorm_qkv if module.input_layernorm else module.qkv
        src = input_norm(module, xb, proj_in) if module.input_layernorm else xb
        ln, kv_src = src, src
        (qw, qb), (kw, kb), (vw, vb) = qkv_weights(module)
    else:
        proj_in = module.layernorm_query if module.input_layernorm else module.query_layer
        src = input_norm(module, xb, proj_in) if module.input_layernorm else xb
        ln, kv_src = src, to_bshd(f64(encoder_output), fmt)
        (qw, qb), (kw, kb), (vw, vb) = cross_weights(module)
    q = F.linear(src, qw, qb).unflatten(-1, (h, d))
    k = F.linear(kv_src, kw, kb).unflatten(-1, (g, d))
    v = F.linear(kv_src, vw, vb).unflatten(-1, (g, d))
    kind = module.qk_norm_type

    def apply_qk_norm(q, k):
        return qk_norm(module.q_norm, q, kind, qk_eps), qk_norm(module.k_norm, k, kind, qk_eps)

    if kind is not None and module.qk_norm_before_rope:
        q, k = apply_qk_norm(q, k)
    if freqs is not None:
        qf, kf = freqs if isinstance(freqs, tuple) else (freqs, freqs)
        q = rope(q, qf, module.rotary_pos_interleaved)
        k = rope(k, kf, module.rotary_pos_interleaved)
    if kind is not None and not module.qk_norm_before_rope:
        q, k = apply_qk_norm(q, k)
    context = softmax_attention(
        q, k, v, attn_mask_type or module.attn_mask_type, attention_mask, module.window_size
    )
    out = F.linear(context, param(module.proj, "weight"))
    bias = param(module.proj, "bias")
    if bias is not None and not module.return_bias:
        out = out + bias
    back = to_bshd(out, fmt)
    return back, (bias if module.return_bias else None), (None if ln is None else to_bshd(ln, fmt))


def mlp(module, x):
    """LayerNormMLP forward in float64: ``(out_without_fc2_bias, fc2_bias, ln_out)``."""
    ln = norm(
        f64(x), param(module, "layer_norm_weight"), param(module, "layer_norm_bias"),
        module.normalization, module.eps, module.zero_centered_gamma,
    )  # fmt: skip
    act = REFERENCE_ACTIVATIONS[module.activation]
    if module.activation == "clamped_swiglu" and module.activation_params:
        params = module.activation_params
        base = act
        act = lambda t: base(t, **params)  # noqa: E731
    hidden = act(F.linear(ln, param(module, "fc1_weight"), param(module, "fc1_bias")))
    return F.linear(hidden, param(module, "fc2_weight")), param(module, "fc2_bias"), ln


def transformer_layer(
    layer, x, encoder_output=None, mask=None, enc_dec_mask=None, freqs=None, mask_type=None
):
    """TransformerLayer forward in float64 (eval: no dropout, no drop path)."""
    x = f64(x)

    def add(out, bias, residual):
        return residual + (out if bias is None else out + bias)

    attn, attn_bias, attn_ln = mha(
        layer.self_attention, x, attention_mask=mask, freqs=freqs, attn_mask_type=mask_type
    )
    post_ln = layer.apply_residual_connection_post_layernorm
    if layer.parallel_attention_mlp:
        mlp_out, mlp_bias, _ = mlp(layer.layernorm_mlp, x)
        out = x + attn + add(mlp_out, mlp_bias, 0)
    else:
        residual = attn_ln if (post_ln and not layer.output_layernorm) else x
        x = add(attn, attn_bias, residual)
        if layer.layer_type == "decoder":
            cross, cross_bias, cross_ln = mha(
                layer.inter_attention, x, encoder_output=encoder_output, attention_mask=enc_dec_mask
            )
            x = add(cross, cross_bias, cross_ln if post_ln else x)
        mlp_out, mlp_bias, mlp_ln = mlp(layer.layernorm_mlp, x)
        out = add(mlp_out, mlp_bias, mlp_ln if post_ln else x)
    if layer.output_layernorm:
        ln = layer.layernorm
        out = norm(
            out, param(ln, "weight"), param(ln, "bias"),
            "RMSNorm" if type(ln).__name__ == "RMSNorm" else "LayerNorm", ln.eps,
            ln.zero_centered_gamma,
        )  # fmt: skip
    return out
