"""From ``DotProductAttention.forward``'s arguments to an ``AttentionProblem``: packed inputs,
formats, shapes, padding and ``cu_seqlens``, masks, windows, biases.

Everything here validates before it computes, and every error names the argument and the fix.
"""

from __future__ import annotations

import torch

from .masks import alibi_bias, alibi_slopes, keep_mask, padding_from_lengths, rows_with_keys
from .packing import ThdLayout, split_packed, thd_layout, thd_to_padded
from .problem import AttentionProblem
from .utils import MASK_TYPES

__all__ = [
    "QKV_FORMATS",
    "BIAS_TYPES",
    "normalize_mask_type",
    "resolve_packed_inputs",
    "check_qkv",
    "check_thd_arguments",
    "to_bhsd",
    "SideLengths",
    "side_lengths",
    "build_problem",
]

QKV_FORMATS = ("sbhd", "bshd", "thd")
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


def normalize_mask_type(attn_mask_type: str) -> str:
    """Upstream's spellings: ``","`` -> ``"_"``, ``"causal_padding"`` -> ``"padding_causal"``."""
    if not isinstance(attn_mask_type, str):
        raise TypeError(f"attn_mask_type must be a str, got {type(attn_mask_type).__name__}")
    name = attn_mask_type.replace(",", "_")
    if name.startswith("causal_padding"):
        name = "padding_causal" + name[len("causal_padding") :]
    if name not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of {', '.join(MASK_TYPES)}")
    return name


def resolve_packed_inputs(query, key, value, qkv_layer, kv_layer, interleave_dim, fmt):
    """``(q, k, v, layout)``: the three tensors (views into a packed one where given) and
    upstream's name of their layout (e.g. ``"bs3hd"``, ``"sbhd_sb2hd"``, ``"thd_thd_thd"``)."""
    dims = 3 if fmt == "thd" else 4
    letters = "t" if fmt == "thd" else fmt[:2]
    if qkv_layer is not None:
        if query is not None or key is not None or value is not None or kv_layer is not None:
            raise ValueError(
                "DotProductAttention: qkv_layer replaces query_layer, key_layer, value_layer "
                "and kv_layer; pass either qkv_layer or the separate tensors"
            )
        q, k, v = split_packed(qkv_layer, 3, interleave_dim, "qkv_layer", dims + 1)
        return q, k, v, letters + ("3hd" if interleave_dim == -3 else "h3d")
    if kv_layer is not None:
        if query is None or key is not None or value is not None:
            raise ValueError(
                "DotProductAttention: kv_layer goes with query_layer only (it replaces "
                "key_layer and value_layer)"
            )
        k, v = split_packed(kv_layer, 2, interleave_dim, "kv_layer", dims + 1)
        packed = letters + ("2hd" if interleave_dim == -3 else "h2d")
        return query, k, v, f"{fmt}_{packed}"
    if query is None or key is None or value is None:
        missing = [n for n, t in (("query_layer", query), ("key_layer", key),
                                  ("value_layer", value)) if t is None]  # fmt: skip
        raise ValueError(
            f"DotProductAttention: {', '.join(missing)} missing; pass query_layer, key_layer "
            "and value_layer (or qkv_layer / kv_layer)"
        )
    return query, key, value, None


def check_qkv(q, k, v, q_format, kv_format, heads, groups, dk, dv) -> None:
    """Dtypes, devices, ranks, head counts and head dims of the three tensors."""
    for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"DotProductAttention: {name} must be a tensor, got {type(t).__name__}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"DotProductAttention: query/key/value dtypes differ ({q.dtype}, {k.dtype}, "
            f"{v.dtype}); cast them to one dtype"
        )
    if not q.dtype.is_floating_point:
        raise TypeError(f"DotProductAttention: inputs must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"DotProductAttention: query/key/value are on {q.device}, {k.device}, {v.device}; "
            "move them to one device"
        )
    if q.is_meta:
        raise ValueError("DotProductAttention: the inputs are meta tensors and hold no data")
    for name, t, fmt in (("query_layer", q, q_format), ("key_layer", k, kv_format),
                         ("value_layer", v, kv_format)):  # fmt: skip
        expected = 3 if fmt == "thd" else 4
        if t.dim() != expected:
            raise ValueError(
                f"DotProductAttention: {name} has shape {tuple(t.shape)} but qkv_format "
                f"{fmt!r} needs {expected} dimensions ({'[t, h, d]' if fmt == 'thd' else fmt})"
            )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"DotProductAttention: key_layer {tuple(k.shape)} and value_layer {tuple(v.shape)} "
            "must match in every dimension but the last"
        )
    if q.shape[-2] != heads:
        raise ValueError(
            f"DotProductAttention: query_layer has {q.shape[-2]} heads but the module was built "
            f"with num_attention_heads={heads}"
        )
    if k.shape[-2] != groups:
        raise ValueError(
            f"DotProductAttention: key_layer/value_layer have {k.shape[-2]} heads but the module "
            f"was built with num_gqa_groups={groups}"
        )
    if q.shape[-1] != dk or k.shape[-1] != dk or v.shape[-1] != dv:
        raise ValueError(
            f"DotProductAttention: head dims (q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}) "
            f"do not match kv_channels=({dk}, {dv})"
        )


def check_thd_arguments(mask_type, q_format, kv_format, cu_q, cu_kv) -> None:
    """``thd`` needs a padding mask type and the ``cu_seqlens`` of its sides."""
    if not mask_type.startswith("padding"):
        raise ValueError(
            f"DotProductAttention: qkv_format='thd' needs a padding attn_mask_type (padding, "
            f"padding_causal, padding_causal_bottom_right), got {mask_type!r}"
        )
    missing = [name for name, fmt, cu in (("cu_seqlens_q", q_format, cu_q),
                                          ("cu_seqlens_kv", kv_format, cu_kv))
               if fmt == "thd" and cu is None]  # fmt: skip
    if missing:
        raise ValueError(
            f"DotProductAttention: qkv_format='thd' needs {' and '.join(missing)} (int32 "
            "[b + 1], the running sum of the sequence lengths)"
        )


def to_bhsd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A ``[b, h, s, d]`` view of an ``sbhd`` or ``bshd`` tensor (no copy)."""
    return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2)


class SideLengths:
    """The sequences of one side (queries or keys/values): padding and lengths, or ``thd``
    layout."""

    __slots__ = ("padding", "lengths", "layout")

    def __init__(self, padding=None, lengths=None, layout: ThdLayout | None = None):
        self.padding, self.lengths, self.layout = padding, lengths, layout


def _check_cu_seqlens(name: str, cu: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
        # Names what was passed (the message used to state only the requirement).
        got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(
            f"DotProductAttention: {name} must be a 1-D int32 tensor [batch + 1], got {got}; "
            "pass e.g. cu.to(torch.int32).flatten()"
        )
    if cu.device != device:
        raise ValueError(
            f"DotProductAttention: {name} is on {cu.device} but the inputs are on {device}; "
            f"move it to {device}"
        )


def _padding_mask(name: str, mask, batch: int, seqlen: int) -> torch.Tensor:
    if mask.dtype != torch.bool:
        raise TypeError(
            f"DotProductAttention: {name} must be a bool tensor (True = masked), got {mask.dtype}"
        )
    if mask.numel() != batch * seqlen or mask.shape[0] != batch:
        raise ValueError(
            f"DotProductAttention: {name} has shape {tuple(mask.shape)}; a padding mask is "
            f"[b, 1, 1, s] = [{batch}, 1, 1, {seqlen}]"
        )
    return mask.reshape(batch, seqlen)


def side_lengths(side, t, fmt, cu, cu_padded, max_seqlen, mask, batch, padding) -> SideLengths:
    """Padding of one side: ``thd`` from ``cu``; a padding mask type from ``mask`` (True =
    padded) or else ``cu``; nothing for other mask types."""
    if fmt == "thd":
        if cu is None:
            raise ValueError(
                f"DotProductAttention: qkv_format='thd' needs cu_seqlens_{side} (int32 [b + 1]); "
                "pass cu_seqlens_q and cu_seqlens_kv"
            )
        _check_cu_seqlens(f"cu_seqlens_{side}", cu, t.device)
        if cu_padded is not None:
            _check_cu_seqlens(f"cu_seqlens_{side}_padded", cu_padded, t.device)
            if cu_padded.shape != cu.shape:
                raise ValueError(
                    f"DotProductAttention: cu_seqlens_{side}_padded {tuple(cu_padded.shape)} and "
                    f"cu_seqlens_{side} {tuple(cu.shape)} must have the same shape"
                )
        if max_seqlen is None:  # one host sync, as upstream's
            max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
        layout = thd_layout(cu, cu_padded, max(int(max_seqlen), 1), t.shape[0])
        return SideLengths(padding_from_lengths(layout.lengths, layout.max_len),
                           layout.lengths, layout)  # fmt: skip
    if not padding:
        return SideLengths()
    seqlen = t.shape[0] if fmt == "sbhd" else t.shape[1]
    if mask is not None:
        pad = _padding_mask(f"attention_mask ({side})", mask, batch, seqlen)
        return SideLengths(pad, (~pad).sum(dim=1, dtype=torch.int32))
    if cu is not None:
        _check_cu_seqlens(f"cu_seqlens_{side}", cu, t.device)
        if cu.shape[0] < batch + 1:
            raise ValueError(
                f"DotProductAttention: cu_seqlens_{side} has {cu.shape[0]} entries for a batch "
                f"of {batch}; it needs batch + 1"
            )
        lengths = (cu[1 : batch + 1] - cu[:batch]).to(torch.int32)
        return SideLengths(padding_from_lengths(lengths, seqlen), lengths)
    raise ValueError(
        "DotProductAttention: a padding attn_mask_type needs attention_mask ([b, 1, 1, s], "
        "True = padded; a tuple (q_mask, kv_mask) for cross attention) or cu_seqlens_q/kv"
    )


def _bias(bias_type, bias, slopes, scale, heads, batch, sq, skv, bottom_right, lq, lkv, device):
    if bias_type not in BIAS_TYPES:
        raise ValueError(
            f"core_attention_bias_type={bias_type!r} is not one of {', '.join(BIAS_TYPES)}"
        )
    if bias_type == "no_bias":
        return None
    if bias_type == "alibi":
        if slopes is None:
            slopes = alibi_slopes(heads, device)
        elif slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(slopes.shape)}; it must be [h] = [{heads}] or "
                f"[b, h] = [{batch}, {heads}]"
            )
        return alibi_bias(slopes.to(device), sq=sq, skv=skv, bottom_right=bottom_right,
                          lengths_q=lq, lengths_kv=lkv)  # fmt: skip
    if bias is None:
        raise ValueError(f"core_attention_bias_type={bias_type!r} needs core_attention_bias")
    if bias.dim() != 4 or any(
        have not in (1, want) for have, want in zip(bias.shape, (batch, heads, sq, skv))
    ):
        raise ValueError(
            f"core_attention_bias has shape {tuple(bias.shape)}; it must broadcast to "
            f"[b, h, sq, skv] = [{batch}, {heads}, {sq}, {skv}] (e.g. [1, h, sq, skv])"
        )
    if bias.device != device:
        raise ValueError(f"core_attention_bias is on {bias.device}; move it to {device}")
    return bias.float() * scale if bias_type == "pre_scale_bias" else bias


def build_problem(
    q, k, v, *, q_side: SideLengths, kv_side: SideLengths, mask_type, window, bottom_right,
    arbitrary_mask, bias_type, bias, alibi_slopes_, scale, softmax_type, softmax_offset,
    return_max_logit,
) -> AttentionProblem:  # fmt: skip
    """The :class:`AttentionProblem` of ``[b, h, s, d]`` inputs and the sides' padding."""
    b, heads, sq, _ = q.shape
    skv = k.shape[2]
    lq, lkv = q_side.lengths, kv_side.lengths
    implicit_causal = None
    padded = q_side.padding is not None or kv_side.padding is not None
    if arbitrary_mask is not None and arbitrary_mask.dtype != torch.bool:
        raise TypeError(
            f"DotProductAttention: an arbitrary attention_mask must be bool (True = masked), "
            f"got {arbitrary_mask.dtype}"
        )
    if arbitrary_mask is not None:
        # Checked here: a mask that does not broadcast failed deep in keep_mask with torch's
        # "The size of tensor a (3) must match the size of tensor b (2)", naming neither.
        want = (b, heads, sq, skv)
        have = tuple(arbitrary_mask.shape)
        if len(have) > 4 or any(n not in (1, w) for n, w in zip(have[::-1], want[::-1])):
            raise ValueError(
                f"DotProductAttention: the arbitrary attention_mask has shape {have}; it must "
                f"broadcast to [b, h, sq, skv] = {list(want)} (e.g. [b, 1, sq, skv])"
            )
    plain = not padded and arbitrary_mask is None
    if plain and window == (-1, 0) and (not bottom_right or sq == skv):
        keep, implicit_causal = None, "top_left"
    elif plain and window == (-1, 0) and sq < skv:  # bottom-right: every query sees a key
        keep, implicit_causal = None, "bottom_right"
    elif window == (-1, -1) and not padded and arbitrary_mask is None:
        keep = None
    else:
        keep = keep_mask(
            sq=sq, skv=skv, device=q.device, window=window, bottom_right=bottom_right,
            q_padding=q_side.padding, kv_padding=kv_side.padding, lengths_q=lq,
            lengths_kv=lkv, arbitrary=arbitrary_mask,
        )  # fmt: skip
    bias_tensor = _bias(bias_type, bias, alibi_slopes_, scale, heads, b, sq, skv, bottom_right,
                        lq, lkv, q.device)  # fmt: skip
    return AttentionProblem(
        q, k, v, keep=keep, implicit_causal=implicit_causal, bias=bias_tensor,
        row_valid=None if keep is None else rows_with_keys(keep), scale=scale,
        softmax_type=softmax_type, softmax_offset=softmax_offset,
        return_max_logit=return_max_logit,
    )  # fmt: skip


def thd_inputs(t: torch.Tensor, side: SideLengths) -> torch.Tensor:
    """``[b, h, s, d]`` view of a ``thd`` tensor gathered into a padded batch."""
    return thd_to_padded(t, side.layout).transpose(1, 2)
