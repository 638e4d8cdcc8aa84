"""NVFP4Quantizer / NVFP4Tensor / NVFP4TensorStorage and the emulated NVFP4 GEMM.

The cast is held byte-exact to the hand-written loop oracle (``nvfp4_oracle``): codes, nibble
order, E4M3 scales and their padded shapes, amaxes; the RHT to a float64 Hadamard product on
inputs whose transform is exact in float32; stochastic rounding to its two-neighbour,
unbiased definition; the GEMM to the float64 product of the oracle-dequantized copies.
"""

import io
import pickle

import pytest
import torch
from nvfp4_oracle import (
    E2M1,
    hadamard16,
    oracle_cast,
    oracle_dequantize,
    oracle_pack,
    oracle_rht,
    oracle_values,
)
from utils import needs_cuda

from transformer_engine.pytorch import reference_fp4
from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage

SHAPES = [(1, 1), (1, 33), (0, 64), (5, 70), (32, 48), (3, 4, 40)]
SIGNS = reference_fp4.RHT_SIGNS


def _up(a, b):
    return -(-a // b) * b


def _sample(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-4, 4, shape, generator=g))
    return x.to(dtype)


def test_e2m1_table_and_ties():
    assert list(reference_fp4.E2M1_VALUES) == E2M1
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -6.5, 0.0, -0.0])
    codes = reference_fp4.e2m1_encode(v)
    # ties to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8 | 1, 8 | 7, 0, 8]
    assert reference_fp4.e2m1_decode(codes).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.0,
    ]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_matches_oracle(shape, dtype):
    x = _sample(shape, dtype)
    t = NVFP4Quantizer()(x)
    m = x.reshape(-1, shape[-1])
    rows, k = m.shape
    codes, scales, amax = oracle_cast(m)
    assert tuple(t._rowwise_data.shape) == (*shape[:-1], _up(k, 2) // 2)
    assert torch.equal(t._rowwise_data.reshape(rows, (k + 1) // 2), oracle_pack(codes))
    assert tuple(t._rowwise_scale_inv.shape) == (_up(rows, 128), _up(_up(k, 16) // 16, 4))
    assert torch.equal(t._rowwise_scale_inv[:rows, : scales.shape[1]], scales)
    assert int(t._rowwise_scale_inv.sum()) == int(scales.sum())  # padding is zero
    assert float(t._amax_rowwise) == amax
    ccodes, cscales, _ = oracle_cast(m.t())
    assert tuple(t._columnwise_data.shape) == (k, _up(rows, 2) // 2)
    assert torch.equal(t._columnwise_data, oracle_pack(ccodes))
    assert tuple(t._columnwise_scale_inv.shape) == (_up(k, 128), _up(_up(rows, 16) // 16, 4))
    assert torch.equal(t._columnwise_scale_inv[:k, : cscales.shape[1]], cscales)
    ref = oracle_values(codes, scales, amax).reshape(shape)
    assert torch.equal(t.dequantize(dtype=torch.float32).double(), ref.float().double())


def test_nibble_order():
    x = torch.tensor([[1.0, 6.0, -0.5, 0.0]])  # amax 6: S_enc = 448, block scale 448 -> codes
    t = NVFP4Quantizer(columnwise=False)(x)
    assert t._rowwise_data.tolist() == [[2 | (7 << 4), (8 | 1) | (0 << 4)]]


def test_global_scale_edges():
    assert float(reference_fp4.nvfp4_global_scale(torch.tensor(0.0))) == 1.0
    assert float(reference_fp4.nvfp4_global_scale(torch.tensor(float("inf")))) == 1.0
    assert float(reference_fp4.nvfp4_global_scale(torch.tensor(6.0))) == 448.0
    tiny = reference_fp4.nvfp4_global_scale(torch.tensor(1e-45))
    assert float(tiny) == torch.finfo(torch.float32).max


def test_nan_poisons_only_its_block():
    x = _sample((2, 32))
    x[0, 3] = float("nan")
    out = NVFP4Quantizer()(x).dequantize()
    assert torch.isnan(out[0, :16]).all() and not torch.isnan(out[0, 16:]).any()
    assert not torch.isnan(out[1]).any()


def test_two_d_blocks_share_scales_and_transpose():
    x = _sample((40, 48))
    t = NVFP4Quantizer(with_2d_quantization=True)(x)
    codes, tiles, amax = oracle_cast(x, two_d=True)
    assert torch.equal(t._rowwise_data, oracle_pack(codes))
    assert torch.equal(t._rowwise_scale_inv[:40, :3], tiles.repeat_interleave(16, 0)[:40])
    assert torch.equal(t._columnwise_data, oracle_pack(codes.t()))
    assert torch.equal(t._columnwise_scale_inv[:48, :3], tiles.t().repeat_interleave(16, 0))
    ref = oracle_values(codes, tiles, amax, two_d=True)
    assert torch.equal(t.dequantize().double(), ref.float().double())


def test_rht_is_orthogonal_and_inverts():
    r = reference_fp4.rht_matrix()
    assert torch.allclose(r @ r.t(), torch.eye(16), atol=1e-6)
    x = torch.randn(5, 40)
    back = reference_fp4.apply_rht(reference_fp4.apply_rht(x), inverse=True)
    assert torch.allclose(back, x, atol=1e-5)
    assert torch.equal(reference_fp4.apply_rht(x)[:, 32:], x[:, 32:])  # partial block kept


def test_rht_only_on_columnwise_and_matches_oracle():
    # Small integers: the float32 transform is exact, so the oracle's float64 one is equal.
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-8, 9, (48, 32), generator=g).float()
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    t = q(x)
    plain = NVFP4Quantizer()(x)
    assert torch.equal(t._rowwise_data, plain._rowwise_data)  # row-wise copy untouched
    rotated = oracle_rht(x.t(), SIGNS)
    assert torch.equal(reference_fp4.apply_rht(x.t()).double(), rotated)
    codes, scales, amax = oracle_cast(rotated)
    assert float(t._amax_columnwise) == amax != float(t._amax_rowwise)
    assert torch.equal(t._columnwise_data, oracle_pack(codes))
    assert torch.equal(t._columnwise_scale_inv[:32, :3], scales)
    # dequantize of the column-wise copy undoes the transform
    t.update_usage(rowwise_usage=False)
    assert torch.allclose(t.dequantize(), x, atol=0.25 * float(x.abs().max()))
    # ... exactly: the oracle's values with the inverse (transposed) matrix applied per block
    inv = (hadamard16() * torch.tensor(SIGNS, dtype=torch.float64) / 4).t()
    back = torch.stack([torch.cat([inv @ row[i : i + 16] for i in range(0, 48, 16)])
                        for row in oracle_values(codes, scales, amax)])  # fmt: skip
    assert torch.allclose(t.dequantize().double(), back.t(), atol=1e-5)


def test_stochastic_rounding_two_neighbours_and_unbiased():
    torch.manual_seed(0)
    v = torch.tensor([0.3, 1.2, 2.6, 4.9, -3.3]).repeat(20000, 1)
    codes = reference_fp4.e2m1_encode(v, stochastic=True)
    values = reference_fp4.e2m1_decode(codes)
    for col, (lo, hi) in enumerate([(0, 0.5), (1, 1.5), (2, 3), (4, 6), (-4, -3)]):
        assert set(values[:, col].tolist()) == {float(lo), float(hi)}
        assert abs(float(values[:, col].mean()) - float(v[0, col])) < 0.02
    # Reproducible under torch.manual_seed.
    torch.manual_seed(5)
    a = NVFP4Quantizer(stochastic_rounding=True)(_sample((8, 32)))._rowwise_data
    torch.manual_seed(5)
    b = NVFP4Quantizer(stochastic_rounding=True)(_sample((8, 32)))._rowwise_data
    assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_emulated_gemm_matches_oracle_product(layout):
    torch.manual_seed(1)
    w, x, dy = torch.randn(48, 32), torch.randn(64, 32), torch.randn(64, 48)
    qx = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    if layout == "TN":
        a, b = NVFP4Quantizer()(w), NVFP4Quantizer()(x)
        ref = oracle_dequantize(x) @ oracle_dequantize(w).t()
    elif layout == "NN":
        a, b = NVFP4Quantizer()(w), NVFP4Quantizer()(dy)
        ref = oracle_dequantize(dy) @ oracle_dequantize(w, columnwise=True)
    else:  # wgrad: both column-wise copies carry the RHT along the tokens, which cancels
        x = torch.randint(-8, 9, (64, 32)).float()
        dy = torch.randint(-8, 9, (64, 48)).float()
        a, b = qx(x), qx(dy)
        ref = oracle_dequantize(dy, columnwise=True, rht_signs=SIGNS).t() @ oracle_dequantize(
            x, columnwise=True, rht_signs=SIGNS
        )
    out = general_gemm(a, b, torch.float32, layout=layout)[0]
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_gemm_undoes_rht_when_only_one_operand_has_it():
    torch.manual_seed(2)
    x, dy = torch.randn(64, 32), torch.randn(64, 48)
    a = NVFP4Quantizer(with_rht=True)(x)
    b = NVFP4Quantizer()(dy)
    out = general_gemm(a, b, torch.float32, layout="NT")[0]
    exact = dy.double().t() @ x.double()
    assert torch.linalg.norm(out.double() - exact) < 0.2 * torch.linalg.norm(exact)


def test_tensor_ops_and_round_trips():
    x = _sample((4, 6, 32))
    t = NVFP4Quantizer(with_rht=True)(x)
    assert isinstance(t, NVFP4Tensor) and t.shape == (4, 6, 32)
    v = t.view(24, 32)
    assert isinstance(v, NVFP4Tensor) and torch.equal(v.dequantize(), t.dequantize().view(24, 32))
    assert torch.equal(t.detach().dequantize(), t.dequantize())
    c = t.clone()
    assert c._rowwise_data.data_ptr() != t._rowwise_data.data_ptr()
    with pytest.raises(RuntimeError, match="last dim"):
        t.view(4, 192)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)["w"]
    assert torch.equal(loaded.dequantize(), t.dequantize())
    q = pickle.loads(pickle.dumps(NVFP4Quantizer(with_rht=True, stochastic_rounding=True)))
    assert q.with_rht and q.stochastic_rounding
    # quantize_ in place
    y = _sample((4, 6, 32), seed=3)
    t.quantize_(y)
    assert torch.equal(t.dequantize(), NVFP4Quantizer(with_rht=True)(y).dequantize())
    t.quantize_(x, noop_flag=torch.ones(1))
    assert torch.equal(t.dequantize(), NVFP4Quantizer(with_rht=True)(y).dequantize())


def test_internal_storage_and_saving():
    q = NVFP4Quantizer()
    q.internal = True
    s = q(_sample((20, 40)))
    assert type(s) is NVFP4TensorStorage and s.shape == (20, 40)
    ref = s.dequantize()
    tensors, obj = s.prepare_for_saving()
    assert len(tensors) == 6 and s._rowwise_data is None
    assert obj.restore_from_saved([*tensors, "rest"]) == ["rest"]
    assert torch.equal(s.dequantize(), ref)
    assert torch.equal(s.view((4, 5, 40)).dequantize().reshape(20, 40), ref)


def test_make_empty_shapes():
    t = NVFP4Quantizer().make_empty((3, 5, 33), device="cpu")
    assert t._rowwise_data.shape == (3, 5, 17) and t._columnwise_data.shape == (33, 8)
    assert t._rowwise_scale_inv.shape == (128, 4) and t._columnwise_scale_inv.shape == (128, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"row_scaled_nvfp4": True}, "row_scaled_nvfp4"),
        ({"nvfp4_use_4over6": True}, "nvfp4_use_4over6"),
        ({"nvfp4_e4m3_max": 256}, "nvfp4_e4m3_max"),
    ],
)
def test_unbuilt_quantizer_options_raise(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        NVFP4Quantizer(**kwargs)


def test_bad_inputs():
    with pytest.raises(TypeError, match="dtype"):
        NVFP4Quantizer()(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="nvfp4_4over6_err_mode"):
        NVFP4Quantizer(nvfp4_4over6_err_mode="L1")


@needs_cuda
def test_cuda_cast_equals_cpu():
    x = _sample((64, 96), torch.bfloat16)
    for q in (NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
              NVFP4Quantizer(with_2d_quantization=True)):  # fmt: skip
        cpu, gpu = q(x), q(x.cuda())
        for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                     "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise"):  # fmt: skip
            assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
