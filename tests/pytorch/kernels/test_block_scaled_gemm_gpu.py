"""The native block-scaled GEMM (``nvte_block_scaled_gemm``: cuBLASLt's 1x128 and 128x128-block
kernels), called through the binding and through ``general_gemm``.

Oracle: the float64 product of the operands dequantized by their own scales (the cast is pinned
to the float64 loop oracle elsewhere). Hopper's FP8 tensor cores keep about 14 significant bits
while they sum one 128-wide K block and cuBLASLt promotes to float32 between blocks, so products
agree to 1e-3 of the output's largest magnitude (measured: 1e-4); a scale read from the wrong
block is off by orders of magnitude, because every row and every K block of the operands below
has its own power-of-two scale.
"""

import pytest
import torch
from utils import needs_cuda, needs_two_gpus

from transformer_engine.common.native import native_module
from transformer_engine.pytorch.cpp_extensions import block_gemm
from transformer_engine.pytorch.cpp_extensions._routing import tensor_arg
from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9


needs_hopper_cublaslt = pytest.mark.skipif(
    not _hopper()
    or native_module() is None
    or not hasattr(native_module(), "cublaslt_version")
    or native_module().cublaslt_version() == 0,
    reason="needs an sm_90 GPU, the native library and cuBLASLt 12.9+ (the GPU machine)",
)


def _quantize(t, two_d, dtype=E4M3):
    q = Float8BlockQuantizer(
        dtype, rowwise=True, columnwise=False, block_scaling_dim=2 if two_d else 1,
        force_pow_2_scales=True,
    )  # fmt: skip
    return q(t)


def _operand(rows, k, device, seed, two_d, dtype=E4M3, spread=12):
    """An FP8 operand whose rows span 2^-spread .. 2^spread and whose K blocks span half that:
    every block its own scale."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, k, generator=g)
    t *= torch.logspace(-spread, spread, rows, base=2.0).unsqueeze(1)
    t *= torch.logspace(spread / 2, -spread / 2, k // 128, base=2.0).repeat_interleave(128)
    q = _quantize(t.to(device), two_d, dtype)
    values, scales, is_2d = q.block_float8_gemm_input(False)
    assert is_2d == two_d
    return q, values, scales


def _call(x, xs, x2d, y, ys, y2d, out, bias=None, workspace=None):
    dev = out.device
    stream = torch.cuda.current_stream(dev).cuda_stream
    return native_module().block_scaled_gemm(
        tensor_arg(x), tensor_arg(xs), x2d, tensor_arg(y), tensor_arg(ys), y2d, tensor_arg(bias),
        tensor_arg(out), tensor_arg(workspace), dev.index, stream,
    )  # fmt: skip


def _float64_product(xq, yq):
    """The oracle: ``x @ y^T`` of the dequantized operands in float64."""
    return (
        xq.dequantize(dtype=torch.float32).double()
        @ yq.dequantize(dtype=torch.float32).double().t()
    )


def _close(got, ref, out_dtype):
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}[out_dtype]
    tol = 1e-3 * float(ref.abs().max())
    assert torch.allclose(got.double(), ref, rtol=1e-3 + ulp, atol=tol), float(
        (got.double() - ref).abs().max() / ref.abs().max()
    )


CASES = [
    # (M, N, K, x_2d, y_2d): fprop/dgrad (weight 128x128 as y), wgrad (both 1x128), the weight
    # as x, rows that are not multiples of 128 (partial blocks), K blocks not a multiple of 4
    # (padded 128x128 scale columns)
    (256, 384, 512, False, True),
    (256, 384, 512, False, False),
    (384, 256, 512, True, False),
    (132, 144, 640, False, True),
    (132, 144, 640, False, False),
    (200, 208, 640, True, False),
    (4, 16, 128, False, True),
]
# M not a multiple of 4 (padded 1x128 scale rows): cuBLASLt 13.1 has no kernel for these, so
# the raw call declines; general_gemm pads x's rows (test_other_token_counts_... below).
ODD_M = [(130, 144, 640, False, True), (130, 144, 640, False, False), (1, 16, 128, False, True)]


@needs_cuda
@needs_hopper_cublaslt
@pytest.mark.parametrize("m,n,k,x2d,y2d", CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_product_equals_float64_product_of_dequantized_operands(m, n, k, x2d, y2d, out_dtype):
    xq, x, xs = _operand(m, k, "cuda:0", 1, x2d)
    yq, y, ys = _operand(n, k, "cuda:0", 2, y2d)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda:0")
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda:0")
    assert _call(x, xs, x2d, y, ys, y2d, out, workspace=workspace)
    ref = _float64_product(xq, yq)
    _close(out, ref, out_dtype)


@needs_cuda
@needs_hopper_cublaslt
@pytest.mark.parametrize("fp8", [(E4M3, E5M2), (E5M2, E4M3)])
def test_e5m2_operands(fp8):
    xq, x, xs = _operand(256, 512, "cuda:0", 3, False, fp8[0])
    yq, y, ys = _operand(128, 512, "cuda:0", 4, True, fp8[1])
    out = torch.empty(256, 128, dtype=torch.bfloat16, device="cuda:0")
    if not _call(x, xs, False, y, ys, True, out):
        pytest.skip("this cuBLASLt has no block-scaled kernel for this E4M3/E5M2 mix")
    ref = _float64_product(xq, yq)
    _close(out, ref, torch.bfloat16)


@needs_cuda
@needs_hopper_cublaslt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_is_added_in_float32_before_the_one_rounding(dtype):
    xq, x, xs = _operand(256, 512, "cuda:0", 5, False, spread=2)  # products within FP16's range
    yq, y, ys = _operand(256, 512, "cuda:0", 6, True, spread=2)
    ref = _float64_product(xq, yq)
    bias = (torch.randn(256, device="cuda:0") * float(ref.abs().mean())).to(dtype)
    out = torch.empty(256, 256, dtype=dtype, device="cuda:0")
    assert _call(x, xs, False, y, ys, True, out, bias=bias)
    _close(out, ref + bias.double(), dtype)


@needs_cuda
@needs_hopper_cublaslt
def test_general_gemm_takes_the_cublaslt_kernel(monkeypatch):
    # With torch._scaled_mm unusable, every layout still gets the native product (no emulation:
    # the emulated path is the float32 torch.mm, made to fail here too), and no refusal is kept.
    def refuse(*args, **kwargs):
        raise AssertionError("torch path taken")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(block_gemm, "_emulated_product", refuse)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 512, generator=g).cuda()
    w = torch.randn(384, 512, generator=g).cuda()
    dy = torch.randn(256, 384, generator=g).cuda()
    q1 = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)
    q2 = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
    xq, wq, dyq = q1(x), q2(w), q1(dy)
    bias = torch.randn(384, device="cuda:0").to(torch.bfloat16)
    fprop = general_gemm(wq, xq, torch.bfloat16, layout="TN", bias=bias)[0]
    dgrad = general_gemm(wq, dyq, torch.bfloat16, layout="NN")[0]
    wgrad = general_gemm(xq, dyq, torch.float32, layout="NT")[0]
    xd, wd, dyd = (t.dequantize(dtype=torch.float32).double() for t in (xq, wq, dyq))
    _close(fprop, xd @ wd.t() + bias.double(), torch.bfloat16)
    _close(dgrad, dyd @ wd, torch.bfloat16)
    dy_col = dyq._dequantize_layout(True, torch.float32).double()
    x_col = xq._dequantize_layout(True, torch.float32).double()
    _close(wgrad, dy_col @ x_col.t(), torch.float32)
    assert not block_gemm.native_block_gemm_refusals()


@needs_cuda
@needs_hopper_cublaslt
@pytest.mark.parametrize("m, n, k", [(130, 144, 640), (1, 16, 128), (256, 128, 300), (7, 144, 200)])
def test_other_token_counts_and_depths_run_natively_on_padded_copies(monkeypatch, m, n, k):
    # M not a multiple of 4 (cuBLASLt 13.1 declines) and K not a multiple of 128 (its blockwise
    # modes need whole K blocks; before, the emulation ran these) reach the native kernel on
    # zero-padded copies: fprop, dgrad and wgrad (whose K is the token count) with the torch
    # route and the emulation made to fail.
    def refuse(*args, **kwargs):
        raise AssertionError("torch path taken")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(block_gemm, "_emulated_product", refuse)
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g).cuda(), torch.randn(n, k, generator=g).cuda()
    dy = torch.randn(m, n, generator=g).cuda()
    q1 = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)
    q2 = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
    xq, wq, dyq = q1(x), q2(w), q1(dy)
    xd, wd, dyd = (t.dequantize(dtype=torch.float32).double() for t in (xq, wq, dyq))
    _close(general_gemm(wq, xq, torch.float32, layout="TN")[0], xd @ wd.t(), torch.float32)
    if k % 16 == 0:  # dgrad's N is k here
        _close(general_gemm(wq, dyq, torch.float32, layout="NN")[0], dyd @ wd, torch.float32)
    if k % 16 == 0:  # wgrad's N is k
        dy_col = dyq._dequantize_layout(True, torch.float32).double()
        x_col = xq._dequantize_layout(True, torch.float32).double()
        wgrad = general_gemm(xq, dyq, torch.float32, layout="NT")[0]
        _close(wgrad, dy_col @ x_col.t(), torch.float32)


@needs_cuda
@needs_hopper_cublaslt
def test_replayed_from_a_cuda_graph():
    _, x, xs = _operand(256, 512, "cuda:0", 8, False)
    _, y, ys = _operand(384, 512, "cuda:0", 9, True)
    eager = torch.empty(256, 384, dtype=torch.bfloat16, device="cuda:0")
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda:0")
    assert _call(x, xs, False, y, ys, True, eager, workspace=workspace)  # warm-up: the plan
    graphed = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert _call(x, xs, False, y, ys, True, graphed, workspace=workspace)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager)  # the same kernel and algorithm: the same bits


@needs_cuda
@needs_hopper_cublaslt
def test_bad_arguments_name_the_value_and_change_nothing():
    _, x, xs = _operand(256, 512, "cuda:0", 10, False)
    _, y, ys = _operand(128, 512, "cuda:0", 11, True)
    _, w2, w2s = _operand(128, 512, "cuda:0", 12, True)
    out = torch.full((256, 128), 7.0, dtype=torch.bfloat16, device="cuda:0")
    with pytest.raises(ValueError, match="both operands have 128x128 blocks"):
        _call(w2, w2s, True, y, ys, True, torch.empty(128, 128, device="cuda:0"))
    with pytest.raises(ValueError, match=r"y_scale_inv must be \[1, 4\]"):
        _call(x, xs, False, y, xs, True, out)
    with pytest.raises(ValueError, match="out must be"):
        _call(x, xs, False, y, ys, True, out[:, :64].contiguous())
    with pytest.raises(ValueError, match="out"):
        _call(x, xs, False, y, ys, True, out.to(torch.int32))
    with pytest.raises(ValueError, match=r"the inner \(K\) extents differ"):
        _call(x, xs, False, y[:, :256].contiguous(), ys[:, :4].contiguous(), True, out)
    with pytest.raises(ValueError, match="bias"):
        _call(x, xs, False, y, ys, True, out, bias=torch.zeros(128, device="cuda:0"))
    assert bool((out == 7.0).all())


@needs_two_gpus
@needs_hopper_cublaslt
def test_second_gpu_while_first_is_current():
    xq, x, xs = _operand(256, 512, "cuda:1", 13, False)
    yq, y, ys = _operand(128, 512, "cuda:1", 14, True)
    out = torch.empty(256, 128, dtype=torch.float32, device="cuda:1")
    with torch.cuda.device(0):
        assert _call(x, xs, False, y, ys, True, out)
        assert torch.cuda.current_device() == 0
    ref = _float64_product(xq, yq)
    _close(out, ref, torch.float32)
