"""Rotary position embeddings (RoPE): the frequency table and its application to Q and K.

``RotaryPositionEmbedding(dim)(max_seq_len)`` gives the angles ``pos * inv_freq`` as a float32
``[s, 1, 1, dim]`` table; :func:`apply_rotary_pos_emb` rotates the first ``dim`` channels of a
``sbhd``, ``bshd`` or ``thd`` tensor by them::

    out = t * cos(angle) + rotate_half(t) * sin(angle)      (channels past dim pass through)

``rotate_half`` maps the halves ``[x1, x2]`` to ``[-x2, x1]``, or with ``interleaved=True`` each
even/odd pair ``(x_2i, x_2i+1)`` to ``(-x_2i+1, x_2i)``.

Which row of the table a token uses (its position) is decided once, for every format, by
:func:`_token_positions`: the token's index in its sequence, plus ``start_positions[b]`` when
decoding, remapped to the zig-zag chunks of its context-parallel rank. The two execution paths
then differ only in arithmetic:

* ``fused=False`` is upstream's composition: cos/sin computed in float32, cast to ``t``'s dtype,
  and the products and sum taken in that dtype (plain autograd).
* ``fused=True`` is one autograd node (:class:`FusedRoPEFunc`) that computes in float32 and
  rounds once to ``t``'s dtype; it saves only the angles its backward needs. No native kernel:
  PyTorch operations on whatever device ``t`` lives on. Both paths agree within ``t``'s
  rounding (bit for bit in float32).

See docs/kv_cache_and_rope.md.
"""

from __future__ import annotations

import warnings

import torch

from ..device import construction_device, materialization_device, reject_meta
from ..quantized_tensor import QuantizedTensor

__all__ = [
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
    "apply_fused_qkv_rotary_pos_emb",
    "FusedRoPEFunc",
    "FusedQKVRoPEFunc",
]

_FORMATS = ("sbhd", "bshd", "thd")


def _inverse_frequencies(dim: int, base: float, device: torch.device) -> torch.Tensor:
    """``1 / base ** (arange(0, dim, 2) / dim)`` in float32 (upstream's expression, same bits)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base**exponents)


class RotaryPositionEmbedding(torch.nn.Module):
    """The rotary angle table ``pos * inv_freq``, ``[s, 1, 1, dim]`` in float32.

    Parameters
    ----------
    dim : int
        Rotary channels per head (even), before ``rotary_percent``.
    rotary_percent : float, default 1.0
        Rotate only ``int(dim * rotary_percent)`` channels; the rest of a head passes through.
    seq_len_interpolation_factor : float, optional
        Linear position interpolation: positions are divided by this factor. As upstream, it
        only acts together with ``pretrained_max_position_embeddings``; alone it has no effect
        (a warning says so).
    pretrained_max_position_embeddings : int, optional
        With ``seq_len_interpolation_factor``: a table longer than
        ``pretrained * factor`` divides positions by ``max_seq_len / pretrained`` instead
        (dynamic scaling), so the last position always maps inside the pretrained range.
    rotary_base : float, default 10000.0
    interleaved : bool, default False
        Lay each frequency out twice in a row (``f0 f0 f1 f1 ...``, for even/odd-pair rotation)
        instead of two halves (``f0 f1 ... f0 f1 ...``).
    device : str or torch.device, optional (keyword only; not in upstream's signature)
        Where ``inv_freq`` is built: ``None`` is the current CUDA device, else the CPU, as
        upstream, except inside ``with torch.device("meta"):`` where it is ``meta``.
        ``"meta"`` defers the buffer: ``reset_parameters()`` (or ``module.to_empty(device=d)``
        followed by ``reset_parameters()``) computes it on ``d``, else on the current CUDA
        device, else on the CPU.

    ``inv_freq`` is a persistent float32 buffer (it is in the state dict, as upstream's).
    ``forward(max_seq_len, offset=0)`` returns the table for positions
    ``offset .. offset + max_seq_len - 1`` on ``inv_freq``'s device, with torch autocast off.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        pretrained_max_position_embeddings: int | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(
                f"RotaryPositionEmbedding: the rotary dimension is {dim} (dim * rotary_percent); "
                "it must be a positive even number of channels"
            )
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError(
                f"RotaryPositionEmbedding: seq_len_interpolation_factor="
                f"{seq_len_interpolation_factor} must be positive"
            )
        if seq_len_interpolation_factor is not None and pretrained_max_position_embeddings is None:
            # Upstream applies the factor only when both are given; keep its numbers, say so.
            warnings.warn(
                "RotaryPositionEmbedding: seq_len_interpolation_factor has no effect without "
                "pretrained_max_position_embeddings (as in upstream Transformer Engine); pass "
                "both to interpolate positions",
                stacklevel=2,
            )
        self.dim = dim
        self.rotary_base = rotary_base
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        if device is None and torch.get_default_device().type == "meta":
            device = "meta"  # built under `with torch.device("meta"):` (deferred init)
        device = construction_device(type(self).__name__, device)
        self.register_buffer("inv_freq", _inverse_frequencies(dim, rotary_base, device))

    def reset_parameters(self) -> None:
        """Compute ``inv_freq`` again; a meta buffer is materialized first.

        A buffer that holds storage (e.g. after ``module.to_empty(device=...)``) is filled in
        place on its device; a meta buffer is rebuilt on the current CUDA device, else the CPU.
        """
        buffer = self.inv_freq
        if buffer.is_meta:
            self.inv_freq = _inverse_frequencies(
                self.dim, self.rotary_base, materialization_device()
            )
            return
        with torch.no_grad():
            buffer.copy_(_inverse_frequencies(self.dim, self.rotary_base, buffer.device))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        inv_freq = self.inv_freq
        reject_meta("RotaryPositionEmbedding.forward", inv_freq=inv_freq)
        with torch.autocast(device_type=inv_freq.device.type, enabled=False):
            seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
            factor = self.seq_len_interpolation_factor
            pretrained = self.pretrained_max_position_embeddings
            if factor is not None and pretrained is not None:
                if max_seq_len > pretrained * factor:
                    seq *= 1 / (max_seq_len / pretrained)  # dynamic: longer than learned
                else:
                    seq *= 1 / factor  # fixed linear interpolation
            freqs = torch.outer(seq, inv_freq)
            if self.interleaved:
                emb = freqs.repeat_interleave(2, dim=-1)
            else:
                emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


# ---------------------------------------------------------------------------------------------
# Positions: which table row each token of t uses.


def _zigzag(local: torch.Tensor, length, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global position of local index ``local`` in a sequence of local length ``length`` on
    context-parallel rank ``cp_rank``: the rank holds chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of the ``2 * cp_size`` equal chunks of the full sequence."""
    if cp_size == 1:
        return local
    chunk = length // 2
    full = cp_size * length
    first = cp_rank * chunk + local
    second = full - (cp_rank + 1) * chunk + (local - chunk)
    return torch.where(local < chunk, first, second)


def _token_positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank):
    """Positions of t's tokens (int64) and, for thd, which tokens are inside a sequence.

    Shapes: sbhd ``[s, 1]`` or ``[s, b]``, bshd ``[1, s]`` or ``[b, s]``, thd ``[t]``.
    """
    device = t.device
    if start_positions is not None:
        start_positions = start_positions.to(device=device, dtype=torch.int64)
    if tensor_format != "thd":
        seq_dim, batch_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
        length, batch = t.shape[seq_dim], t.shape[batch_dim]
        if cp_size > 1 and length % 2:
            raise ValueError(
                f"apply_rotary_pos_emb: with cp_size={cp_size} each rank holds two equal chunks "
                f"of the sequence, so its local length must be even, got {length}"
            )
        positions = _zigzag(torch.arange(length, device=device), length, cp_size, cp_rank)
        positions = positions[:, None]
        if start_positions is not None:
            if start_positions.shape != (batch,):
                raise ValueError(
                    f"apply_rotary_pos_emb: start_positions has shape "
                    f"{tuple(start_positions.shape)}, expected ({batch},) (one offset per "
                    "sequence of the batch)"
                )
            positions = positions + start_positions[None, :]
        return (positions if tensor_format == "sbhd" else positions.T), None
    # thd: token j belongs to sequence k when cu[k] <= j < cu[k + 1] (cu of this CP rank).
    cu = cu_seqlens.to(device=device, dtype=torch.int64) // cp_size
    batch = cu.numel() - 1
    if start_positions is not None and start_positions.shape != (batch,):
        raise ValueError(
            f"apply_rotary_pos_emb: start_positions has shape {tuple(start_positions.shape)}, "
            f"expected ({batch},) (one offset per sequence of cu_seqlens)"
        )
    token = torch.arange(t.shape[0], device=device)
    if batch == 0:  # no sequences: every token is padding
        return torch.zeros_like(token), torch.zeros_like(token, dtype=torch.bool)
    sequence = torch.searchsorted(cu[1:], token, right=True)
    inside = sequence < batch  # tokens past cu_seqlens[-1] (padding) pass through unrotated
    sequence = sequence.clamp(max=batch - 1)
    local = token - cu[sequence]
    lengths = cu[1:] - cu[:-1]
    positions = _zigzag(local, lengths[sequence], cp_size, cp_rank)
    if start_positions is not None:
        positions = positions + start_positions[sequence]
    return torch.where(inside, positions, 0), inside


def _check_positions(
    positions: torch.Tensor, table_length: int, exact_max: int | None, may_sync: bool
) -> None:
    """Every position must have a row in the table. Checked from shapes where they decide it
    (sbhd/bshd without start positions), else with one device sync where ``may_sync`` and no
    CUDA graph is being captured. Where it is skipped (the fused path on a GPU stays free of
    host syncs, like upstream's kernel), torch's indexing still refuses an out-of-range row, as
    a device-side assertion."""
    if exact_max is None:
        if not may_sync or (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        exact_max = int(positions.max()) if positions.numel() else -1
    if exact_max >= table_length:
        raise ValueError(
            f"apply_rotary_pos_emb: a token sits at position {exact_max} but freqs has "
            f"{table_length} positions; build the table with max_seq_len > {exact_max}"
        )


def _token_angles(
    t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, may_sync=True
):
    """The angles of every token, shaped to broadcast against ``t[..., :rot_dim]``."""
    positions, inside = _token_positions(
        t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank
    )
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    exact_max = None
    if tensor_format != "thd" and start_positions is None:
        exact_max = cp_size * positions.numel() - 1 if cp_size > 1 else positions.numel() - 1
    _check_positions(positions, table.shape[0], exact_max, may_sync)
    angles = table[positions]  # [..., rot_dim]
    if inside is not None:
        angles = angles * inside[:, None]  # angle 0: cos 1, sin 0, the token passes through
    return angles.unsqueeze(-2)  # broadcast over heads


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_float32(t: torch.Tensor, angles: torch.Tensor, interleaved: bool, transposed: bool):
    """``t[..., :r] * cos + rotate_half(t[..., :r]) * sin`` in float32 with one rounding to
    ``t``'s dtype; the channels past ``r`` are copied. ``transposed`` applies the transpose of
    that linear map (the backward): ``t * cos - rotate_half(t * sin)``, as rotate_half is a
    signed permutation ``R`` with ``R^T = -R``."""
    rot_dim = angles.shape[-1]
    cos, sin = torch.cos(angles), torch.sin(angles)
    x = t[..., :rot_dim].float()
    if transposed:
        rotated = -_rotate_half(x * sin, interleaved)
    else:
        rotated = _rotate_half(x, interleaved) * sin
    out = torch.empty_like(t)
    out[..., :rot_dim] = x * cos + rotated
    out[..., rot_dim:] = t[..., rot_dim:]
    return out


class FusedRoPEFunc(torch.autograd.Function):
    """The ``fused=True`` path of :func:`apply_rotary_pos_emb` as one autograd node, with
    upstream's ``apply`` signature ``(t, freqs, start_positions, tensor_format, interleaved,
    cu_seqlens, cp_size, cp_rank)``. It computes in float32 and saves only the per-token
    angles; backward is ``g * cos - rotate_half(g * sin)``. No gradient reaches ``freqs``."""

    @staticmethod
    def forward(
        ctx, t, freqs, start_positions=None, tensor_format="sbhd", interleaved=False,
        cu_seqlens=None, cp_size=1, cp_rank=0,
    ):  # fmt: skip
        _check_arguments(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
        where = (tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
        angles = _token_angles(t, freqs, *where, may_sync=not t.is_cuda).float()
        ctx.save_for_backward(angles)
        ctx.interleaved = interleaved
        return _rotate_float32(t, angles, interleaved, False)

    @staticmethod
    def backward(ctx, grad):
        (angles,) = ctx.saved_tensors
        return (_rotate_float32(grad, angles, ctx.interleaved, True),) + (None,) * 7


class FusedQKVRoPEFunc(torch.autograd.Function):
    """:func:`apply_fused_qkv_rotary_pos_emb` as one autograd node, with upstream's ``apply``
    signature ``(qkv, q_freqs, k_freqs, qkv_split_arg_list, start_positions, tensor_format,
    interleaved, cp_size, cp_rank)``; returns new ``(q, k, v)`` tensors."""

    @staticmethod
    def forward(
        ctx, qkv, q_freqs, k_freqs, qkv_split_arg_list, start_positions=None,
        tensor_format="sbhd", interleaved=False, cp_size=1, cp_rank=0,
    ):  # fmt: skip
        sizes = _check_qkv_split(qkv, qkv_split_arg_list, tensor_format)
        query, key, value = qkv.split(sizes, dim=-1)
        query = query.reshape(*query.shape[:-2], query.shape[-2] * (sizes[0] // sizes[1]), sizes[1])
        where = (tensor_format, start_positions, None, cp_size, cp_rank)
        outputs, saved = [], []
        for part, freqs in ((query, q_freqs), (key, k_freqs)):
            _check_arguments(part, freqs, *where)
            angles = _token_angles(part, freqs, *where, may_sync=not qkv.is_cuda).float()
            outputs.append(_rotate_float32(part, angles, interleaved, False))
            saved.append(angles)
        ctx.save_for_backward(*saved)
        ctx.interleaved, ctx.qkv_shape = interleaved, qkv.shape
        return outputs[0], outputs[1], value.contiguous()

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        q_angles, k_angles = ctx.saved_tensors
        grads = []
        for grad, angles in ((grad_q, q_angles), (grad_k, k_angles)):
            grad_in = _rotate_float32(grad, angles, ctx.interleaved, True)
            grads.append(grad_in.reshape(*ctx.qkv_shape[:-1], -1))
        grads.append(grad_v)
        return (torch.cat(grads, dim=-1),) + (None,) * 8


def _unfused_rotary(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # Upstream's composition: cos/sin first (in the angles' float32), then t's dtype.
    rot_dim = angles.shape[-1]
    cos, sin = torch.cos(angles).to(t.dtype), torch.sin(angles).to(t.dtype)
    x, passed = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((x * cos + _rotate_half(x, interleaved) * sin, passed), dim=-1)


def _check_arguments(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank):
    # Upstream asserts these two; the type stays AssertionError for callers that catch it.
    if cp_size > 1 and start_positions is not None:
        raise AssertionError(
            "apply_rotary_pos_emb: start_positions with cp_size > 1 is not supported (start "
            "positions are for inference, which runs without context parallelism)"
        )
    if tensor_format == "thd" and cu_seqlens is None:
        raise AssertionError(
            "apply_rotary_pos_emb: cu_seqlens must not be None when tensor_format is 'thd'"
        )
    if tensor_format not in _FORMATS:
        raise ValueError(
            f"apply_rotary_pos_emb: tensor_format={tensor_format!r} is not one of {_FORMATS}"
        )
    if isinstance(t, QuantizedTensor):
        raise TypeError(
            f"apply_rotary_pos_emb: t is a {type(t).__name__}; rotate the high-precision tensor "
            "before quantizing it"
        )
    if not t.is_floating_point():
        raise TypeError(f"apply_rotary_pos_emb: t has dtype {t.dtype}; it must be floating point")
    reject_meta("apply_rotary_pos_emb", t=t, freqs=freqs)
    if freqs.device != t.device:
        # RotaryPositionEmbedding builds its table on the current CUDA device by default (as
        # upstream), so CPU inputs on a GPU machine need the table built or moved to the CPU.
        raise ValueError(
            f"apply_rotary_pos_emb: freqs is on {freqs.device} but t is on {t.device}; build "
            "the table where t lives (RotaryPositionEmbedding(..., device=t.device), or "
            "freqs.to(t.device))"
        )
    expected_dims = 3 if tensor_format == "thd" else 4
    if t.dim() != expected_dims:
        raise ValueError(
            f"apply_rotary_pos_emb: t has shape {tuple(t.shape)}; tensor_format="
            f"{tensor_format!r} needs {expected_dims} dimensions"
        )
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(
            f"apply_rotary_pos_emb: freqs has shape {tuple(freqs.shape)}; expected "
            "[max_seq_len, 1, 1, rot_dim] (what RotaryPositionEmbedding returns)"
        )
    rot_dim = freqs.shape[-1]
    if rot_dim % 2 or rot_dim > t.shape[-1]:
        raise ValueError(
            f"apply_rotary_pos_emb: freqs rotates {rot_dim} channels but t has {t.shape[-1]}; "
            "the rotary dimension must be even and at most the head dimension"
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"apply_rotary_pos_emb: cp_rank={cp_rank} must lie in [0, cp_size={cp_size})"
        )


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of every head of ``t``.

    Parameters
    ----------
    t : torch.Tensor
        ``[s, b, h, d]`` (sbhd), ``[b, s, h, d]`` (bshd) or ``[total_tokens, h, d]`` (thd).
    freqs : torch.Tensor
        Angles ``[max_seq_len, 1, 1, rot_dim]`` (float32, from :class:`RotaryPositionEmbedding`),
        ``rot_dim <= d``; the channels past ``rot_dim`` pass through.
    tensor_format : {"sbhd", "bshd", "thd"}, default "sbhd"
    start_positions : torch.Tensor, optional
        ``[b]``: sequence ``i``'s tokens sit at ``start_positions[i] + 0, 1, ...`` (decoding
        with a KV cache). Not with ``cp_size > 1``.
    interleaved : bool, default False
        Rotate even/odd channel pairs instead of halves.
    fused : bool, default False
        One autograd node computing in float32 (see the module docstring).
    cu_seqlens : torch.Tensor, optional
        thd only (required there): ``[b + 1]`` int32 cumulative lengths; with
        ``cp_size > 1`` the padded global ones (each divisible by ``2 * cp_size``). Tokens past
        ``cu_seqlens[-1]`` (padding) pass through.
    cp_size, cp_rank : int, default 1, 0
        Context parallelism: the local tokens are this rank's two zig-zag chunks (chunks
        ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of the full sequence).
    """
    if fused:
        return FusedRoPEFunc.apply(
            t, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank
        )
    _check_arguments(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    angles = _token_angles(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    return _unfused_rotary(t, angles, interleaved)


def apply_fused_qkv_rotary_pos_emb(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    qkv_split_arg_list: list[int],
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a packed QKV tensor and rotate Q and K (the fused path of
    :func:`apply_rotary_pos_emb`).

    ``qkv`` is ``[s, b, h, dq + dk + dv]`` (sbhd) or ``[b, s, h, dq + dk + dv]`` (bshd), with
    ``qkv_split_arg_list = [dq, dk, dv]`` and ``dq`` a multiple of the head dimension ``dk``
    (several query heads per K/V head). Returns ``(q, k, v)``: ``q`` ``[..., h * dq // dk, dk]``
    rotated by ``q_freqs``, ``k`` ``[..., h, dk]`` rotated by ``k_freqs``, ``v`` ``[..., h, dv]``
    as is. thd is not supported (as upstream): split and call :func:`apply_rotary_pos_emb`.
    ``cu_seqlens`` is accepted for upstream's signature and unused. One autograd node
    (:class:`FusedQKVRoPEFunc`).
    """
    del cu_seqlens  # sbhd/bshd only
    if cp_size > 1 and start_positions is not None:
        raise AssertionError(
            "apply_fused_qkv_rotary_pos_emb: start_positions with cp_size > 1 is not supported"
        )
    if tensor_format == "thd":
        raise AssertionError(
            "apply_fused_qkv_rotary_pos_emb: tensor_format='thd' is not supported; split the "
            "packed tensor and call apply_rotary_pos_emb on q and k"
        )
    return FusedQKVRoPEFunc.apply(
        qkv, q_freqs, k_freqs, qkv_split_arg_list, start_positions, tensor_format, interleaved,
        cp_size, cp_rank,
    )  # fmt: skip


def _check_qkv_split(qkv: torch.Tensor, qkv_split_arg_list, tensor_format: str):
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(
            f"apply_fused_qkv_rotary_pos_emb: tensor_format={tensor_format!r} must be 'sbhd' or "
            "'bshd'"
        )
    if len(qkv_split_arg_list) != 3 or sum(qkv_split_arg_list) != qkv.shape[-1]:
        raise ValueError(
            f"apply_fused_qkv_rotary_pos_emb: qkv_split_arg_list={list(qkv_split_arg_list)} must "
            f"be three sizes [dq, dk, dv] adding up to qkv's last dimension {qkv.shape[-1]}"
        )
    q_size, k_size, v_size = (int(n) for n in qkv_split_arg_list)
    if k_size <= 0 or q_size % k_size:
        raise ValueError(
            f"apply_fused_qkv_rotary_pos_emb: dq={q_size} must be a multiple of the head "
            f"dimension dk={k_size}"
        )
    return q_size, k_size, v_size
