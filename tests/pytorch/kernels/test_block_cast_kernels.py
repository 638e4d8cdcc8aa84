"""Native block-scaled casts (nvte_block_scaled_quantize, nvte_mxfp8_quantize) against the
reference, bit for bit: every layout, shape edge, input dtype, FP8 format and scale mode; the
no-op flag, another device than the current one, CUDA graph capture and empty inputs.

The oracle is the same wrapper run on a CPU copy of the input, which routes to the pure-PyTorch
reference (reference_blocks.block_cast_1d / block_cast_2d / mxfp8_cast); the CPU tests in
test_block_cast_wrappers.py hold that route to the reference functions themselves.

Runs on a CUDA machine; without a GPU every test here is skipped with that reason.
"""

import pytest
import torch
from utils import bitwise_equal, current_device_unchanged, needs_cuda, needs_two_gpus

import transformer_engine
from transformer_engine.pytorch.cpp_extensions import block_cast
from transformer_engine.pytorch.cpp_extensions.block_cast import (
    BlockCastResult,
    float8_block_cast,
    mxfp8_block_cast,
)
from transformer_engine.pytorch.tensor import Float8BlockQuantizer
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

pytestmark = needs_cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HIGH = [torch.float32, torch.float16, torch.bfloat16]
# Shape edges: 0-d, one row, one element, non-multiples of 8/16/32/128 on either side, exact
# tiles, several tiles with a partial last one, 3-D inputs, odd K (unaligned rows), and more
# tiles (297) than the persistent grid has blocks (2 per SM), so blocks walk several tiles.
SHAPES = [(), (1,), (300,), (1, 1), (1, 129), (3, 17, 65), (127, 129), (128, 128), (33, 256),
          (256, 384), (257, 1000), (2, 130, 72), (16, 8), (200, 31), (4112, 1048)]  # fmt: skip
EMPTY_SHAPES = [(0,), (0, 128), (5, 0), (0, 0), (2, 0, 7)]
USAGES = [(True, True), (True, False), (False, True)]


def make_input(shape, dtype, seed=0, device="cuda:0") -> torch.Tensor:
    """Random values spanning many binades, with the special values every cast must treat as
    the reference does: NaN, +-Inf, huge, -0.0, tiny (subnormal scales), a zero tile row, an
    all-NaN run, and (for float32/bfloat16) a block of values so small its scale overflows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    flat = x.view(-1)
    n = flat.numel()
    specials = [float("nan"), float("inf"), float("-inf"), 1e30, -0.0, 1e-30, 3e-3, -6e4]
    for i, v in enumerate(specials[: n // 4]):
        flat[(i * 7919) % n] = v
    if x.dim() >= 2 and n >= 64:
        m = x.reshape(-1, x.shape[-1])
        m[-1].zero_()  # an all-zero row: amax 0, scale 1
        m[0, : min(40, m.shape[1])] = float("nan")  # a NaN-only 32-block
        if dtype != torch.float16 and m.shape[0] > 2:
            m[1] = 1e-40 * torch.sign(m[1])  # amax tiny: fp8_max / amax overflows
    return x.to(dtype).to(device)


def assert_same(got: BlockCastResult, want: BlockCastResult, what):
    for name, g, w in zip(BlockCastResult._fields, got, want):
        if w is None:
            assert g is None, (name, what)
            continue
        assert g.device.type == "cuda", (name, what)
        assert bitwise_equal(g, w), (name, what)


def test_native_library_has_the_block_casts():
    status = transformer_engine.native_status()
    assert status.available, str(status)
    from transformer_engine.common.native import native_module

    assert hasattr(native_module(), "block_scaled_quantize")
    assert hasattr(native_module(), "mxfp8_quantize")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [1, 2])
def test_float8_block_cast_matches_reference_bitwise(fp8, dtype, shape, dim):
    x = make_input(shape, dtype, seed=len(shape) * 1000 + (shape[-1] if shape else 0))
    for rowwise, columnwise in USAGES:
        for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-3), (False, 2.5)):
            kw = dict(block_scaling_dim=dim, rowwise=rowwise, columnwise=columnwise,
                      epsilon=eps, force_pow_2_scales=pow2)  # fmt: skip
            got = float8_block_cast(x, fp8, **kw)
            want = float8_block_cast(x.cpu(), fp8, **kw)
            assert_same(got, want, (rowwise, columnwise, pow2, eps))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_block_cast_matches_reference_bitwise(fp8, dtype, shape, two_d):
    x = make_input(shape, dtype, seed=len(shape) * 1000 + (shape[-1] if shape else 0) + 1)
    for rowwise, columnwise in USAGES:
        kw = dict(rowwise=rowwise, columnwise=columnwise, two_d=two_d)
        got = mxfp8_block_cast(x, fp8, **kw)
        want = mxfp8_block_cast(x.cpu(), fp8, **kw)
        assert_same(got, want, (rowwise, columnwise))


@pytest.mark.parametrize("dtype", HIGH)
def test_unaligned_and_non_contiguous_inputs(dtype):
    """A storage offset of one element (no vector loads) and a transposed view."""
    base = make_input((257 * 136 + 1,), dtype, seed=5)
    x = base[1:].view(257, 136)
    xt = make_input((136, 257), dtype, seed=6).t()
    for t in (x, xt):
        for dim in (1, 2):
            kw = dict(block_scaling_dim=dim, rowwise=True, columnwise=True)
            assert_same(float8_block_cast(t, FP8[0], **kw),
                        float8_block_cast(t.cpu(), FP8[0], **kw), dim)  # fmt: skip
        kw = dict(rowwise=True, columnwise=True)
        assert_same(mxfp8_block_cast(t, FP8[0], **kw), mxfp8_block_cast(t.cpu(), FP8[0], **kw), 0)


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_empty_inputs(shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device="cuda:0")
    for dim in (1, 2):
        kw = dict(block_scaling_dim=dim, rowwise=True, columnwise=True)
        got = float8_block_cast(x, FP8[0], **kw)
        assert_same(got, float8_block_cast(x.cpu(), FP8[0], **kw), dim)
    for two_d in (False, True):
        kw = dict(rowwise=True, columnwise=True, two_d=two_d)
        assert_same(mxfp8_block_cast(x, FP8[1], **kw), mxfp8_block_cast(x.cpu(), FP8[1], **kw), 1)
    torch.cuda.synchronize()


def _sentinel_like(result: BlockCastResult) -> BlockCastResult:
    """Buffers shaped like ``result``'s, filled with a byte pattern no cast writes everywhere."""
    out = []
    for t in result:
        if t is None:
            out.append(None)
            continue
        b = torch.empty_like(t)
        b.view(torch.uint8).fill_(0xA5)
        out.append(b)
    return BlockCastResult(*out)


@pytest.mark.parametrize("kind", ["float8_1d", "float8_2d", "mxfp8"])
def test_noop_flag_is_read_on_the_device(kind):
    x = make_input((300, 200), torch.bfloat16, seed=9)

    def cast(t, **kw):
        if kind == "mxfp8":
            return mxfp8_block_cast(t, FP8[0], rowwise=True, columnwise=True, **kw)
        dim = 1 if kind == "float8_1d" else 2
        return float8_block_cast(t, FP8[0], block_scaling_dim=dim, rowwise=True,
                                 columnwise=True, **kw)  # fmt: skip

    want = cast(x.cpu())
    out = _sentinel_like(cast(x))
    before = [t.clone() for t in out]
    cast(x, out=out, noop_flag=torch.ones(1, device="cuda:0"))
    for b, t in zip(before, out):
        assert bitwise_equal(b, t)  # skipped: untouched, padding included
    cast(x, out=out, noop_flag=torch.zeros(1, device="cuda:0"))
    assert_same(out, want, kind)  # written whole, padding zeros included


def test_reference_route_on_cuda_without_the_native_library(monkeypatch):
    """The fallback (no native library) gives the same bytes, and honours the no-op flag with
    a device-side select."""
    x = make_input((130, 260), torch.float16, seed=11)
    kw = dict(block_scaling_dim=1, rowwise=True, columnwise=True)
    native = float8_block_cast(x, FP8[1], **kw)
    monkeypatch.setattr(block_cast, "native_for", lambda op, device: None)
    fallback = float8_block_cast(x, FP8[1], **kw)
    assert_same(fallback, native, "fallback")
    out = _sentinel_like(native)
    before = [t.clone() for t in out]
    float8_block_cast(x, FP8[1], out=out, noop_flag=torch.ones(1, device="cuda:0"), **kw)
    for b, t in zip(before, out):
        assert bitwise_equal(b, t)
    float8_block_cast(x, FP8[1], out=out, noop_flag=torch.zeros(1, device="cuda:0"), **kw)
    assert_same(out, native, "fallback into out")


@needs_two_gpus
def test_second_device_while_first_is_current():
    torch.cuda.set_device(0)
    x = make_input((257, 300), torch.bfloat16, seed=12, device="cuda:1")
    with current_device_unchanged():
        for dim in (1, 2):
            kw = dict(block_scaling_dim=dim, rowwise=True, columnwise=True)
            got = float8_block_cast(x, FP8[0], **kw)
            assert all(t.device == x.device for t in got)
            assert_same(got, float8_block_cast(x.cpu(), FP8[0], **kw), dim)
        kw = dict(rowwise=True, columnwise=True)
        got = mxfp8_block_cast(x, FP8[0], **kw)
        assert all(t.device == x.device for t in got)
        assert_same(got, mxfp8_block_cast(x.cpu(), FP8[0], **kw), "mx")
        q = Float8BlockQuantizer(FP8[0], rowwise=True, columnwise=True, block_scaling_dim=1)
        t = q.quantize(x)
        assert t._rowwise_data.device == x.device
        torch.cuda.synchronize(x.device)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("kind", ["float8_1d", "float8_2d", "mxfp8"])
def test_cuda_graph_capture_of_a_block_cast(kind):
    """Capture the quantizer's in-place update (the no-op flag on the device, so no host
    synchronisation), replay with new input values: equal to the eager cast of those values."""
    shape = (256, 384)
    if kind == "mxfp8":
        quantizer = MXFP8Quantizer(FP8[0], rowwise=True, columnwise=True)
    else:
        dim = 1 if kind == "float8_1d" else 2
        quantizer = Float8BlockQuantizer(
            FP8[0], rowwise=True, columnwise=True, block_scaling_dim=dim
        )
    static_x = make_input(shape, torch.bfloat16, seed=13)
    dst = quantizer.quantize(static_x)
    noop = torch.zeros(1, device="cuda:0")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph
            quantizer.update_quantized(static_x, dst, noop_flag=noop)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantizer.update_quantized(static_x, dst, noop_flag=noop)
        fresh = quantizer.quantize(static_x)  # allocating inside the capture works too
    for seed in (21, 22):
        new_x = make_input(shape, torch.bfloat16, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        eager = quantizer.quantize(new_x)
        for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                     "_columnwise_scale_inv"):  # fmt: skip
            assert bitwise_equal(getattr(dst, name), getattr(eager, name)), (name, seed)
            assert bitwise_equal(getattr(fresh, name), getattr(eager, name)), (name, seed)
    # With the flag set, a replay leaves the buffers alone.
    kept = dst._rowwise_data.clone()
    static_x.copy_(make_input(shape, torch.bfloat16, seed=23))
    noop.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert bitwise_equal(dst._rowwise_data, kept)


@pytest.mark.parametrize("dim", [1, 2])
def test_quantizers_run_the_native_cast(dim, monkeypatch):
    """The quantizers' CUDA casts go through the native kernels (the reference functions are
    not called) and store what the CPU quantizer stores."""
    from transformer_engine.pytorch import reference_blocks

    x = make_input((3, 100, 200), torch.bfloat16, seed=14)
    q = Float8BlockQuantizer(FP8[0], rowwise=True, columnwise=True, block_scaling_dim=dim)
    want = q.quantize(x.cpu())
    mx = MXFP8Quantizer(FP8[1], rowwise=True, columnwise=True)
    want_mx = mx.quantize(x.cpu())

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference cast ran for a CUDA tensor")

    for name in ("block_cast_1d", "block_cast_2d", "mxfp8_cast"):
        monkeypatch.setattr(reference_blocks, name, forbidden)
    got = q.quantize(x)
    got_mx = mx.quantize(x)
    for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                 "_columnwise_scale_inv"):  # fmt: skip
        assert bitwise_equal(getattr(got, name), getattr(want, name)), name
        assert bitwise_equal(getattr(got_mx, name), getattr(want_mx, name)), name
