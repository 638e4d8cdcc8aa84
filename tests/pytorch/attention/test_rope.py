"""Rotary position embeddings against a float64 formula written pair by pair.

The oracle rotates each channel pair ``(a, b)`` by its angle ``theta = pos * base**(-2j/rot)``:
``(a cos - b sin, b cos + a sin)``, with the pairs ``(j, j + rot/2)`` (halves) or
``(2j, 2j + 1)`` (interleaved) and every token's position listed by hand (start offsets,
sequences of a packed batch, context-parallel zig-zag chunks). The functions under test get
the angle table in float32, laid out as upstream's ``RotaryPositionEmbedding`` lays it out.
"""

from __future__ import annotations

import pytest
import torch
from utils import materialization_device, needs_cuda, needs_two_gpus

from transformer_engine.pytorch.attention.rope import (
    FusedQKVRoPEFunc,
    FusedRoPEFunc,
    RotaryPositionEmbedding,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
)
from transformer_engine.pytorch.device import DevicePlacementError

BASE = 10000.0
# float32 angles of positions < 64 are off by up to ~64 * 2**-24 rad: 4e-6 on the output.
FP32_TOL = dict(rtol=1e-5, atol=2e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1.6e-2)  # a few bf16 roundings (cos, sin, 2 products, sum)


def theta(positions, rot: int) -> torch.Tensor:
    """float64 angles ``[tokens, rot/2]``."""
    j = torch.arange(rot // 2, dtype=torch.float64)
    return torch.as_tensor(positions, dtype=torch.float64)[:, None] * BASE ** (-2.0 * j / rot)


def angle_table(length: int, rot: int, interleaved: bool) -> torch.Tensor:
    """float32 ``[length, 1, 1, rot]`` in upstream's layout (halves, or each angle twice)."""
    angles = theta(range(length), rot)
    laid_out = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles] * 2, -1)
    return laid_out.float()[:, None, None, :]


def oracle_tokens(x, positions, rot: int, interleaved: bool) -> torch.Tensor:
    """Rotate tokens ``x`` ``[n, h, d]`` (float64, differentiable) at ``positions`` ``[n]``."""
    angles = theta(positions, rot)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    if interleaved:
        first, second = list(range(0, rot, 2)), list(range(1, rot, 2))
    else:
        first, second = list(range(rot // 2)), list(range(rot // 2, rot))
    a, b = x[..., first], x[..., second]
    out = x.clone()
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def oracle_batched(t, tensor_format: str, rot: int, interleaved: bool, starts=None):
    """sbhd/bshd: token ``i`` of sequence ``b`` at position ``starts[b] + i``."""
    bshd = t.double() if tensor_format == "bshd" else t.double().transpose(0, 1)
    rows = []
    for b in range(bshd.shape[0]):
        start = 0 if starts is None else int(starts[b])
        positions = [start + i for i in range(bshd.shape[1])]
        rows.append(oracle_tokens(bshd[b], positions, rot, interleaved))
    out = torch.stack(rows)
    return out if tensor_format == "bshd" else out.transpose(0, 1)


def random_input(tensor_format: str, dtype=torch.float32, seq=7, batch=3, heads=2, dim=12):
    shape = {"sbhd": (seq, batch, heads, dim), "bshd": (batch, seq, heads, dim)}[tensor_format]
    return torch.randn(shape, dtype=torch.float64).to(dtype)


# --- RotaryPositionEmbedding -------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_table_matches_formula(interleaved, rotary_percent):
    module = RotaryPositionEmbedding(
        16, rotary_percent=rotary_percent, interleaved=interleaved, device="cpu"
    )
    rot = int(16 * rotary_percent)
    j = torch.arange(rot // 2, dtype=torch.float64)
    torch.testing.assert_close(
        module.inv_freq.double(), BASE ** (-2.0 * j / rot), rtol=1e-6, atol=0
    )
    assert module.inv_freq.dtype == torch.float32 and "inv_freq" in module.state_dict()
    table = module(10, offset=3)
    assert table.shape == (10, 1, 1, rot) and table.dtype == torch.float32
    expected = angle_table(13, rot, interleaved)[3:]
    torch.testing.assert_close(table, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "max_seq_len, divisor",
    [(12, 2.0), (32, 32 / 8)],  # fixed factor 2; dynamic 32/8 = 4
)
def test_interpolation_fixed_and_dynamic(max_seq_len, divisor):
    # pretrained 8 * factor 2 = 16: 12 positions interpolate by the factor, 32 dynamically.
    module = RotaryPositionEmbedding(
        8, seq_len_interpolation_factor=2.0, pretrained_max_position_embeddings=8, device="cpu"
    )
    table = module(max_seq_len)[:, 0, 0, :4].double()
    expected = theta([p / divisor for p in range(max_seq_len)], 8)
    torch.testing.assert_close(table, expected, rtol=1e-6, atol=1e-6)


def test_interpolation_factor_alone_warns_and_changes_nothing():
    with pytest.warns(UserWarning, match="pretrained_max_position_embeddings"):
        module = RotaryPositionEmbedding(8, seq_len_interpolation_factor=4.0, device="cpu")
    torch.testing.assert_close(module(6), angle_table(6, 8, False), rtol=1e-6, atol=1e-6)


def test_meta_construction_and_materialization():
    with torch.device("meta"):
        under_context = RotaryPositionEmbedding(8)
    explicit = RotaryPositionEmbedding(8, device="meta")
    for module in (under_context, explicit):
        assert module.inv_freq.is_meta
        with pytest.raises(DevicePlacementError, match="meta"):
            module(4)
    reference = RotaryPositionEmbedding(8, device="cpu")
    under_context.reset_parameters()
    explicit.to_empty(device="cpu")  # storage without values ...
    explicit.reset_parameters()  # ... filled in place
    # Without a device, reset_parameters() materializes where the package's rule says (the
    # current CUDA device, else the CPU); to_empty's device is kept.
    assert under_context.inv_freq.device == materialization_device()
    assert explicit.inv_freq.device.type == "cpu"
    for module in (under_context, explicit):
        torch.testing.assert_close(module(5).cpu(), reference(5), rtol=0, atol=0)


def test_bad_rotary_dimension():
    with pytest.raises(ValueError, match="even"):
        RotaryPositionEmbedding(7)


# --- apply_rotary_pos_emb: sbhd / bshd ----------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("rot", [12, 8])  # 8 < head dim 12: the last 4 channels pass through
def test_batched_formats_match_oracle(tensor_format, interleaved, fused, rot):
    t = random_input(tensor_format)
    out = apply_rotary_pos_emb(
        t, angle_table(9, rot, interleaved), tensor_format, interleaved=interleaved, fused=fused
    )
    assert out.shape == t.shape and out.dtype == t.dtype
    expected = oracle_batched(t, tensor_format, rot, interleaved)
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    torch.testing.assert_close(out[..., rot:], t[..., rot:], rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_start_positions(tensor_format, fused):
    t = random_input(tensor_format, seq=3)
    starts = torch.tensor([0, 5, 2], dtype=torch.int32)
    table = angle_table(8, 12, False)
    out = apply_rotary_pos_emb(t, table, tensor_format, start_positions=starts, fused=fused)
    expected = oracle_batched(t, tensor_format, 12, False, starts=starts)
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_equals_unfused_and_both_differentiate(interleaved):
    t = random_input("sbhd", dim=16)
    table = angle_table(7, 12, interleaved)
    grad = torch.randn_like(t)
    results = {}
    for fused in (False, True):
        x = t.clone().requires_grad_()
        out = apply_rotary_pos_emb(x, table, interleaved=interleaved, fused=fused)
        out.backward(grad)
        results[fused] = (out.detach(), x.grad)
    # float32: the same operations in the same order, so the same bits.
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)
    x64 = t.double().requires_grad_()
    oracle_batched(x64, "sbhd", 12, interleaved).backward(grad.double())
    torch.testing.assert_close(results[True][1].double(), x64.grad, **FP32_TOL)


def test_bf16_fused_and_unfused_within_rounding():
    t = random_input("bshd", dtype=torch.bfloat16, dim=16)
    table = angle_table(7, 16, False)
    expected = oracle_batched(t, "bshd", 16, False)
    fused = apply_rotary_pos_emb(t, table, "bshd", fused=True)
    unfused = apply_rotary_pos_emb(t, table, "bshd")
    assert fused.dtype == unfused.dtype == torch.bfloat16
    # Fused rounds once (half a bf16 ulp); unfused rounds cos, sin and every product.
    torch.testing.assert_close(fused.double(), expected, rtol=2**-8, atol=2**-8)
    torch.testing.assert_close(unfused.double(), expected, **BF16_TOL)


# --- thd ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_starts", [False, True])
def test_thd_equals_each_sequence_alone(fused, interleaved, with_starts):
    lengths = [3, 1, 4]
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    t = torch.randn(10, 2, 12)  # two trailing padding tokens
    starts = torch.tensor([2, 0, 5], dtype=torch.int32) if with_starts else None
    table = angle_table(12, 12, interleaved)
    out = apply_rotary_pos_emb(
        t, table, "thd", start_positions=starts, interleaved=interleaved, fused=fused,
        cu_seqlens=cu,
    )  # fmt: skip
    offset = 0
    for k, length in enumerate(lengths):
        piece = t[offset : offset + length].unsqueeze(1)  # [s, 1, h, d]
        start = None if starts is None else starts[k : k + 1]
        alone = apply_rotary_pos_emb(
            piece, table, "sbhd", start_positions=start, interleaved=interleaved, fused=fused
        )
        torch.testing.assert_close(out[offset : offset + length], alone[:, 0], rtol=0, atol=0)
        first = 0 if starts is None else int(starts[k])
        positions = [first + i for i in range(length)]
        expected = oracle_tokens(piece[:, 0].double(), positions, 12, interleaved)
        torch.testing.assert_close(out[offset : offset + length].double(), expected, **FP32_TOL)
        offset += length
    torch.testing.assert_close(out[8:], t[8:], rtol=0, atol=0)  # padding passes through


def test_thd_gradient_matches_oracle():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    t = torch.randn(5, 2, 8, dtype=torch.float64).float().requires_grad_()
    grad = torch.randn(5, 2, 8)
    apply_rotary_pos_emb(t, angle_table(6, 8, False), "thd", fused=True, cu_seqlens=cu).backward(
        grad
    )
    x64 = t.detach().double().requires_grad_()
    expected = torch.cat(
        [oracle_tokens(x64[0:2], [0, 1], 8, False), oracle_tokens(x64[2:5], [0, 1, 2], 8, False)]
    )
    expected.backward(grad.double())
    torch.testing.assert_close(t.grad.double(), x64.grad, **FP32_TOL)


# --- context parallelism (zig-zag chunks) ------------------------------------------------------
def zigzag_local(full: torch.Tensor, cp_size: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s chunks ``rank`` and ``2 * cp_size - 1 - rank`` of ``full`` along dim."""
    chunks = full.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp_size - 1 - rank]], dim=dim)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_chunks(tensor_format, cp_size, fused):
    seq_dim = 0 if tensor_format == "sbhd" else 1
    full = random_input(tensor_format, seq=4 * cp_size)  # chunks of 2 tokens
    table = angle_table(4 * cp_size, 12, False)
    expected_full = oracle_batched(full, tensor_format, 12, False)
    for rank in range(cp_size):
        local = zigzag_local(full, cp_size, rank, seq_dim)
        out = apply_rotary_pos_emb(
            local, table, tensor_format, fused=fused, cp_size=cp_size, cp_rank=rank
        )
        expected = zigzag_local(expected_full, cp_size, rank, seq_dim)
        torch.testing.assert_close(out.double(), expected, **FP32_TOL)


@pytest.mark.parametrize("fused", [False, True])
def test_context_parallel_thd(fused):
    cp_size, padded = 2, [8, 4]  # padded global lengths, divisible by 2 * cp_size
    cu_padded = torch.tensor([0, 8, 12], dtype=torch.int32)
    sequences = [torch.randn(n, 2, 8) for n in padded]
    table = angle_table(8, 8, False)
    for rank in range(cp_size):
        local = torch.cat([zigzag_local(s, cp_size, rank, 0) for s in sequences])
        out = apply_rotary_pos_emb(
            local, table, "thd", fused=fused, cu_seqlens=cu_padded, cp_size=cp_size, cp_rank=rank
        )
        expected = torch.cat(
            [
                zigzag_local(oracle_tokens(s.double(), range(len(s)), 8, False), cp_size, rank, 0)
                for s in sequences
            ]
        )
        torch.testing.assert_close(out.double(), expected, **FP32_TOL)


# --- packed QKV ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_qkv_matches_separate_rotations(tensor_format, interleaved):
    d = 8
    qkv = random_input(tensor_format, dim=6 * d).requires_grad_()  # 4 query heads per K/V head
    q_table, k_table = angle_table(9, d, interleaved), angle_table(9, 6, interleaved)
    q, k, v = apply_fused_qkv_rotary_pos_emb(
        qkv, q_table, k_table, [4 * d, d, d], tensor_format, interleaved=interleaved
    )
    lead = qkv.shape[:2]
    assert q.shape == (*lead, 2 * 4, d) and k.shape == (*lead, 2, d) and v.shape == (*lead, 2, d)
    x64 = qkv.detach().double().requires_grad_()
    q_in, k_in, v_in = x64.split([4 * d, d, d], dim=-1)
    q_in = q_in.reshape(*lead, 8, d)
    expected = (
        oracle_batched(q_in, tensor_format, d, interleaved),
        oracle_batched(k_in, tensor_format, 6, interleaved),
        v_in,
    )
    for got, want in zip((q, k, v), expected):
        torch.testing.assert_close(got.double(), want, **FP32_TOL)
    grads = [torch.randn_like(x) for x in (q, k, v)]
    torch.autograd.backward([q, k, v], grads)
    torch.autograd.backward(list(expected), [g.double() for g in grads])
    torch.testing.assert_close(qkv.grad.double(), x64.grad, **FP32_TOL)


def test_autograd_functions_take_upstreams_positional_arguments():
    t = random_input("bshd", seq=3).requires_grad_()
    starts = torch.tensor([1, 0, 4])
    out = FusedRoPEFunc.apply(t, angle_table(8, 12, True), starts, "bshd", True, None, 1, 0)
    expected = oracle_batched(t.detach(), "bshd", 12, True, starts=starts)
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    qkv = random_input("sbhd", dim=3 * 8).requires_grad_()
    table = angle_table(9, 8, False)
    q, k, v = FusedQKVRoPEFunc.apply(qkv, table, table, [8, 8, 8], None, "sbhd", False, 1, 0)
    q.sum().backward()  # k and v unused: their gradients are zero
    assert qkv.grad[..., 8:].eq(0).all() and qkv.grad[..., :8].ne(0).any()


# --- refusals -----------------------------------------------------------------------------------
def test_refusals():
    t, table = random_input("sbhd"), angle_table(9, 12, False)
    with pytest.raises(AssertionError, match="cu_seqlens"):
        apply_rotary_pos_emb(t[:, 0], table, "thd")
    with pytest.raises(AssertionError, match="start_positions"):
        apply_rotary_pos_emb(t, table, start_positions=torch.zeros(3), cp_size=2)
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(t, table, "hsbd")
    with pytest.raises(ValueError, match="position 6"):
        apply_rotary_pos_emb(t, table[:5])  # 7 tokens, 5 positions: names the last
    with pytest.raises(ValueError, match="position"):
        apply_rotary_pos_emb(t, table, start_positions=torch.tensor([0, 3, 0]), fused=True)
    with pytest.raises(ValueError, match="channels"):
        apply_rotary_pos_emb(t, angle_table(9, 16, False))
    with pytest.raises(ValueError, match="start_positions has shape"):
        apply_rotary_pos_emb(t, table, start_positions=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        apply_rotary_pos_emb(t, table, cp_size=2)  # 7 local tokens
    with pytest.raises(ValueError, match="cp_rank"):
        apply_rotary_pos_emb(t[:6], table, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="freqs has shape"):
        apply_rotary_pos_emb(t, table[:, 0])
    with pytest.raises(TypeError, match="floating point"):
        apply_rotary_pos_emb(t.to(torch.int32), table)
    with pytest.raises(AssertionError, match="thd"):
        apply_fused_qkv_rotary_pos_emb(t, table, table, [4, 4, 4], "thd")
    with pytest.raises(ValueError, match="qkv_split_arg_list"):
        apply_fused_qkv_rotary_pos_emb(t, table, table, [4, 4, 5])


def test_refusal_message_names_the_position():
    with pytest.raises(ValueError, match="a token sits at position 6 but freqs has 5"):
        apply_rotary_pos_emb(random_input("bshd"), angle_table(5, 12, False), "bshd")


# --- GPU ---------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_matches_oracle(tensor_format, fused):
    table = angle_table(16, 12, True).cuda()
    if tensor_format == "thd":
        cu = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
        t = torch.randn(9, 2, 12, device="cuda")
        starts = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
        out = apply_rotary_pos_emb(
            t, table, "thd", starts, interleaved=True, fused=fused, cu_seqlens=cu
        )
        expected = torch.cat(
            [
                oracle_tokens(t[:5].double().cpu(), range(3, 8), 12, True),
                oracle_tokens(t[5:].double().cpu(), range(4), 12, True),
            ]
        )
    else:
        t = random_input(tensor_format).cuda()
        out = apply_rotary_pos_emb(t, table, tensor_format, interleaved=True, fused=fused)
        expected = oracle_batched(t.cpu(), tensor_format, 12, True)
    assert out.device == t.device
    torch.testing.assert_close(out.double().cpu(), expected, **FP32_TOL)


@needs_two_gpus
def test_second_gpu_while_first_is_current():
    module = RotaryPositionEmbedding(12, device="cuda:1")
    table = module(9)
    assert table.device == torch.device("cuda", 1)
    t = random_input("sbhd").to("cuda:1")
    with torch.cuda.device(0):
        out = apply_rotary_pos_emb(t, table, fused=True)
        assert torch.cuda.current_device() == 0
    assert out.device == t.device
    expected = oracle_batched(t.cpu(), "sbhd", 12, False)
    torch.testing.assert_close(out.double().cpu(), expected, **FP32_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (two devices)")
@pytest.mark.parametrize("fused", [False, True])
def test_table_on_another_device_is_named(fused):
    """RotaryPositionEmbedding builds its table on the current CUDA device by default (as
    upstream), so a CPU input with that table is refused with both devices named and the fix,
    not left to fail inside an indexing or a multiplication."""
    t, table = random_input("sbhd"), angle_table(9, 12, False)
    with pytest.raises(ValueError, match=r"freqs is on cuda:\d+ but t is on cpu.*device=t.device"):
        apply_rotary_pos_emb(t, table.cuda(), fused=fused)
    with pytest.raises(ValueError, match=r"freqs is on cpu but t is on cuda"):
        apply_rotary_pos_emb(t.cuda(), table, fused=fused)
