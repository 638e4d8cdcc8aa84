"""The fused activation kernels (cpp_extensions.activation) against float64 autograd through the
hand-written formulas of tests/pytorch/utils.py, on the CPU path and (GPU machine) the native
kernels, in high precision and FP8 (with the transposed copy and the bias gradient)."""

import pytest
import torch
from utils import REFERENCE_ACTIVATIONS, needs_cuda, needs_two_gpus

from transformer_engine.pytorch.cpp_extensions import quantize
from transformer_engine.pytorch.cpp_extensions.activation import (
    activation_amax,
    activation_backward,
    activation_backward_amax,
    activation_backward_fp8,
    activation_forward,
    activation_forward_fp8,
    activation_spec,
)
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer

NAMES = sorted(REFERENCE_ACTIVATIONS)
GATED = {"geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance of one rounding to the dtype, plus float32 libm differences.
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def make_input(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype).to(device)


def reference(name, x, grad):
    """Float64 forward value and input gradient (autograd through the formula)."""
    x64 = x.detach().double().cpu().requires_grad_()
    y = REFERENCE_ACTIVATIONS[name](x64)
    (dx,) = torch.autograd.grad(y, x64, grad.double().cpu())
    return y.detach(), dx


def assert_close(actual, expected, dtype, scale):
    """Within one rounding of ``dtype`` of each value, plus an absolute floor relative to the
    tensor's scale (values that cancel to near zero)."""
    torch.testing.assert_close(
        actual.double().cpu(), expected, rtol=2 * RTOL[dtype], atol=1e-6 * scale + 1e-30
    )


def out_shape(name, shape):
    return (*shape[:-1], shape[-1] // 2) if name in GATED else shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 34), (1, 2), (257, 1024), (3, 200, 1024)])
def test_forward_and_backward_match_float64(device, dtype, name, shape):
    x = make_input(shape, dtype, device)
    grad = make_input(out_shape(name, shape), dtype, device, seed=1)
    spec = activation_spec(name)
    y = activation_forward(x, spec)
    dx = activation_backward(grad, x, spec)
    assert y.dtype == dtype and y.shape == out_shape(name, shape) and y.device == x.device
    assert dx.dtype == dtype and dx.shape == x.shape and dx.device == x.device
    y_ref, dx_ref = reference(name, x, grad)
    assert_close(y, y_ref, dtype, y_ref.abs().max().item())
    assert_close(dx, dx_ref, dtype, dx_ref.abs().max().item())


# Not gelu/geglu: torch's float32 tanh-GELU loses bits to cancellation in 1 + tanh(z) for
# negative inputs (about 7% of its bfloat16 results differ from the float64 value rounded).
@pytest.mark.parametrize("name", ["silu", "swiglu", "qgeglu", "srelu", "sreglu"])
def test_cpu_path_rounds_once_across_its_row_blocks(name):
    """The CPU path works through blocks of rows (small buffers, see _cpu_row_step): 600 rows of
    1024 are three blocks (256, 256, 88). Its 16-bit results must still be the float32 values
    rounded once: equal to the float64 value rounded to bfloat16 except where float32's few-ulp
    libm differences cross a rounding boundary (rare), never more than one bfloat16 ulp away.
    Rounding each step (the activation, then the product) misses on a large fraction."""
    x = make_input((600, 1024), torch.bfloat16, "cpu")
    grad = make_input(out_shape(name, (600, 1024)), torch.bfloat16, "cpu", seed=1)
    spec = activation_spec(name)
    y_ref, dx_ref = reference(name, x, grad)
    for got, want in (
        (activation_forward(x, spec), y_ref),
        (activation_backward(grad, x, spec), dx_ref),
    ):
        want16 = want.to(torch.bfloat16)
        assert (got != want16).float().mean().item() < 0.01
        ulp = torch.finfo(torch.bfloat16).eps * want16.double().abs().clamp_min(1e-30)
        assert ((got.double() - want16.double()).abs() <= ulp).all()


@pytest.mark.parametrize("device", DEVICES)
def test_clamped_swiglu_parameters_and_clamp_edges(device):
    params = {"limit": 0.5, "alpha": 1.0, "glu_linear_offset": 0.25}
    spec = activation_spec("clamped_swiglu", **params)
    x = torch.tensor([[0.5, -2.0, 0.25, 0.5, 0.5, -0.5, 3.0, 0.1]], device=device)
    grad = torch.ones(1, 4, device=device)
    y_ref, dx_ref = None, None
    x64 = x.double().cpu().requires_grad_()
    y_ref = REFERENCE_ACTIVATIONS["clamped_swiglu"](x64, **params)
    (dx_ref,) = torch.autograd.grad(y_ref, x64, grad.double().cpu())
    torch.testing.assert_close(activation_forward(x, spec).double().cpu(), y_ref.detach())
    # At the limit itself both clamps pass the gradient (as torch.clamp does).
    torch.testing.assert_close(activation_backward(grad, x, spec).double().cpu(), dx_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates_and_empty_input(device):
    spec = activation_spec("relu")
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.0], device=device)
    y = activation_forward(x, spec)
    assert y[0].isnan() and y[1:].tolist() == [0.0, 0.0, 2.0]
    dx = activation_backward(torch.ones_like(x), x, spec)
    assert dx[1:].tolist() == [0.0, 0.0, 1.0]  # derivative 0 at 0
    empty = torch.empty(0, 16, device=device, dtype=torch.bfloat16)
    assert activation_forward(empty, activation_spec("swiglu")).shape == (0, 8)
    assert activation_backward(empty[:, :8], empty, activation_spec("swiglu")).shape == (0, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    base = make_input((64, 96), torch.bfloat16, device)
    x = base[:, 16:80]  # rows with a stride of 96
    assert not x.is_contiguous()
    spec = activation_spec("geglu")
    y = activation_forward(x, spec)
    y_ref, _ = reference("geglu", x, torch.ones(64, 32))
    assert_close(y, y_ref, torch.bfloat16, y_ref.abs().max().item())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="even last dimension"):
        activation_forward(torch.ones(2, 3), activation_spec("swiglu"))
    with pytest.raises(ValueError, match="not supported"):
        activation_spec("tanh")
    with pytest.raises(ValueError, match="limit"):
        activation_spec("clamped_swiglu", limit=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        activation_forward(torch.ones(2, 4, dtype=torch.int32), activation_spec("gelu"))
    with pytest.raises(ValueError, match="grad has shape"):
        activation_backward(torch.ones(2, 4), torch.ones(2, 4), activation_spec("swiglu"))


# --- FP8 outputs ---------------------------------------------------------------------------------
def fp8_reference(values64, scale, fp8_dtype):
    """The cast of the float32 values (what the kernels cast: float32 results, no rounding to
    the activation dtype first), with the reference quantizer, and the amax."""
    v = values64.float()
    amax = torch.zeros(1)
    res = quantize(v, scale, fp8_dtype, amax=amax, with_transpose=True)
    return res, amax


def assert_fp8_close(actual, expected, max_fraction=1e-2):
    """Equal values except for a few codes one step apart (the float32 activation differs from
    the float64-then-rounded value by an ulp, which can cross a rounding boundary; a value that
    cancels to a tiny number may also round to a zero of the other sign)."""
    differ = actual.float().cpu() != expected.float().cpu()
    assert differ.float().mean().item() <= max_fraction

    def ordinal(t):  # FP8 codes in value order: -0 and +0 both 0, neighbours 1 apart
        codes = t.view(torch.uint8).cpu().int()[differ]
        return torch.where(codes >= 0x80, -(codes & 0x7F), codes)

    assert ((ordinal(actual) - ordinal(expected)).abs() <= 1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["gelu", "swiglu", "srelu", "clamped_swiglu", "qgeglu"])
@pytest.mark.parametrize("shape", [(128, 256), (96, 34)])
def test_fp8_forward_writes_the_cast_of_the_activation(device, fp8_dtype, name, shape):
    x = make_input(shape, torch.bfloat16, device)
    scale = torch.tensor([0.75], device=device)
    amax = torch.zeros(1, device=device)
    res = activation_forward_fp8(
        x, activation_spec(name), scale, fp8_dtype, amax=amax, with_transpose=True
    )
    y_ref, _ = reference(name, x, torch.zeros(out_shape(name, shape)))
    expected, amax_ref = fp8_reference(y_ref, 0.75, fp8_dtype)
    assert res.data.dtype == fp8_dtype and res.data.shape == out_shape(name, shape)
    assert_fp8_close(res.data, expected.data)
    # The transposed copy holds exactly the transposed bytes of the row-wise copy.
    assert torch.equal(res.transpose.view(torch.uint8).cpu(), res.data.view(torch.uint8).cpu().t())
    torch.testing.assert_close(amax.cpu(), amax_ref, rtol=1e-6, atol=0)
    assert res.scale_inv.item() == pytest.approx(1 / 0.75, rel=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gelu", "swiglu", "relu", "glu"])
@pytest.mark.parametrize("shape", [(128, 256), (80, 48), (600, 1024)])  # 600: CPU row blocks
def test_fp8_backward_with_bias_gradient(device, name, shape):
    x = make_input(shape, torch.bfloat16, device)
    grad = make_input(out_shape(name, shape), torch.bfloat16, device, seed=1)
    scale = torch.tensor([2.0], device=device)
    amax = torch.zeros(1, device=device)
    res, dbias = activation_backward_fp8(
        grad, x, activation_spec(name), scale, torch.float8_e5m2, amax=amax, with_dbias=True
    )
    _, dx_ref = reference(name, x, grad)
    expected, amax_ref = fp8_reference(dx_ref, 2.0, torch.float8_e5m2)
    assert res.data.shape == x.shape and res.transpose.shape == (shape[1], shape[0])
    assert_fp8_close(res.data, expected.data)
    assert torch.equal(res.transpose.view(torch.uint8).cpu(), res.data.view(torch.uint8).cpu().t())
    torch.testing.assert_close(amax.cpu(), amax_ref, rtol=1e-5, atol=0)
    assert dbias.dtype == torch.bfloat16 and dbias.shape == (shape[1],)
    dbias_ref = dx_ref.sum(0)
    torch.testing.assert_close(
        dbias.double().cpu(), dbias_ref, rtol=2**-7, atol=1e-4 * dbias_ref.abs().max().item()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gelu", "swiglu", "clamped_swiglu"])
def test_amax_passes_overwrite_with_the_max_of_the_values(device, name):
    x = make_input((96, 128), torch.bfloat16, device)
    grad = make_input(out_shape(name, (96, 128)), torch.bfloat16, device, seed=1)
    spec = activation_spec(name)
    y_ref, dx_ref = reference(name, x, grad)
    amax = torch.full((1,), 1e30, device=device)  # overwritten, not max-accumulated
    activation_amax(x, spec, amax)
    torch.testing.assert_close(amax.cpu().double(), y_ref.abs().max().reshape(1), rtol=1e-6, atol=0)
    activation_backward_amax(grad, x, spec, amax)
    torch.testing.assert_close(
        amax.cpu().double(), dx_ref.abs().max().reshape(1), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("device", DEVICES)
def test_current_scaling_quantize_produced_equals_the_cast_of_the_values(device):
    """Current scaling fed by a producer: amax pass, scale, then the fused cast; the result is
    the current-scaling cast of the float32 activation."""
    x = make_input((128, 256), torch.bfloat16, device)
    spec = activation_spec("geglu")
    quantizer = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=x.device)

    def produce(scale, amax, fp8_dtype, with_transpose):
        assert amax is None  # current scaling keeps no amax state
        res = activation_forward_fp8(x, spec, scale, fp8_dtype, amax=None,
                                     with_transpose=with_transpose)  # fmt: skip
        return res, None

    out, _ = quantizer.quantize_produced(
        produce, (128, 128), torch.bfloat16, x.device,
        amax_of=lambda amax: activation_amax(x, spec, amax),
    )  # fmt: skip
    y_ref, _ = reference("geglu", x, torch.zeros(128, 128))
    expected = quantizer.quantize(y_ref.float().to(x.device))
    torch.testing.assert_close(out._scale_inv.cpu(), expected._scale_inv.cpu(), rtol=1e-6, atol=0)
    assert_fp8_close(out._data, expected._data)
    assert torch.equal(out._transpose.cpu(), out._data.cpu().t())
    with pytest.raises(TypeError, match="amax_of"):
        quantizer.quantize_produced(produce, (128, 128), torch.bfloat16, x.device)


# --- the kernels' tiling and grid-stride paths (GPU machine) -------------------------------------
# Shapes for the native kernels' walks: (3001, 2000) gives each thread of the element-wise
# kernel several vectors (its unrolled loop and the remainder) and the tiled kernel more tiles
# than blocks, several bias-gradient chunks and a last tile row of 57 rows; (2100, 528) a
# partial tile column (a gated activation's 264 columns) and rows that are not a multiple of
# 16 (element-wise transposed stores); (1030, 74) widths that are not a multiple of 8 (the
# element-wise loads everywhere).
@needs_cuda
@pytest.mark.parametrize("name", ["gelu", "swiglu", "clamped_swiglu", "srelu"])
@pytest.mark.parametrize("shape", [(3001, 2000), (2100, 528), (1030, 74)])
def test_large_and_odd_shapes_against_float64(name, shape):
    x = make_input(shape, torch.bfloat16, "cuda")
    grad = make_input(out_shape(name, shape), torch.bfloat16, "cuda", seed=1)
    spec = activation_spec(name)
    y_ref, dx_ref = reference(name, x, grad)
    assert_close(activation_forward(x, spec), y_ref, torch.bfloat16, y_ref.abs().max().item())
    dx = activation_backward(grad, x, spec)
    assert_close(dx, dx_ref, torch.bfloat16, dx_ref.abs().max().item())

    scale = torch.tensor([0.5], device="cuda")
    amax = torch.zeros(1, device="cuda")
    res = activation_forward_fp8(
        x, spec, scale, torch.float8_e4m3fn, amax=amax, with_transpose=True
    )
    expected, amax_ref = fp8_reference(y_ref, 0.5, torch.float8_e4m3fn)
    assert_fp8_close(res.data, expected.data)
    assert torch.equal(res.transpose.view(torch.uint8).cpu(), res.data.view(torch.uint8).cpu().t())
    torch.testing.assert_close(amax.cpu(), amax_ref, rtol=1e-5, atol=0)

    amax.zero_()
    res, dbias = activation_backward_fp8(
        grad, x, spec, scale, torch.float8_e5m2, amax=amax, with_dbias=True
    )
    expected, amax_ref = fp8_reference(dx_ref, 0.5, torch.float8_e5m2)
    assert_fp8_close(res.data, expected.data)
    assert torch.equal(res.transpose.view(torch.uint8).cpu(), res.data.view(torch.uint8).cpu().t())
    torch.testing.assert_close(amax.cpu(), amax_ref, rtol=1e-5, atol=0)
    # float32 sums of float32 values (not of the bf16-rounded dx), one rounding to bf16
    dbias_ref = dx_ref.sum(0)
    torch.testing.assert_close(
        dbias.double().cpu(), dbias_ref, rtol=2**-7, atol=1e-4 * dbias_ref.abs().max().item()
    )
    # deterministic: the same bits again
    _, again = activation_backward_fp8(
        grad, x, spec, scale, torch.float8_e5m2, amax=None, with_dbias=True
    )
    assert torch.equal(again, dbias)


# --- device contract (GPU machine) -------------------------------------------------------------
def amax_pass_inputs(dtype, seed=0):
    """Inputs for the amax pass's skip of positions no larger than an amax already found:
    near-normal values (most positions skipped), the same sorted ascending along the
    grid-stride walk (every position raises the amax: none skipped), sorted descending, one
    large value placed last, and for 16-bit types every bit pattern (NaN and Inf too) shuffled.
    2048 x 8192 gives each thread of the pass several unrolled groups."""
    n = 2048 * 8192
    g = torch.Generator("cuda").manual_seed(seed)
    x = (3 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    last = x.clone()
    last[-1] = 1000.0
    cases = {
        "normal": x,
        "ascending": x.sort().values,
        "descending": x.sort(descending=True).values,
        "largest_last": last,
    }
    if dtype != torch.float32:
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(dtype)
        order = torch.randperm(bits.numel(), generator=g, device="cuda")
        every = bits.cuda()[order].repeat(64)
        cases["every_value"] = torch.cat([x[: n - every.numel()], every])
    return {name: t.reshape(2048, 8192) for name, t in cases.items()}


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["gelu", "qgelu", "silu"])
def test_amax_pass_skip_gives_the_amax_of_every_value(name, dtype):
    """The amax pass of an activation bounded by its input skips the arithmetic of positions
    whose inputs cannot raise the amax found so far; its result must be bit for bit the amax
    of every value, which the FP8 forward (element-wise, no transposed copy) records while it
    casts every element with the same arithmetic."""
    spec = activation_spec(name)
    scale = torch.ones(1, device="cuda")
    for case, x in amax_pass_inputs(dtype).items():
        amax = torch.zeros(1, device="cuda")
        activation_amax(x, spec, amax)
        expected = torch.zeros(1, device="cuda")
        activation_forward_fp8(
            x, spec, scale, torch.float8_e5m2, amax=expected, with_transpose=False
        )
        assert torch.equal(amax, expected), (case, amax.item(), expected.item())


@needs_cuda
@pytest.mark.parametrize("name", ["gelu", "swiglu"])
@pytest.mark.parametrize("shape", [(2048, 8192), (1000, 1032), (999, 1002), (3, 16)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_amax_passes_find_one_planted_value_anywhere(name, shape, where):
    """The amax-only passes walk the positions from the last to the first (a backward
    grid-stride walk whose column step borrows from the row: 1000 x 1032 has 129 vectors a
    row; 999 x 1002 is not in whole vectors: the element-wise walk). One large input (and, for
    the backward, a large gradient) planted at the first, a middle or the last position must
    give the amax the FP8 casts record over every element (their walk goes forward).
    ``shape`` is the output's (a gated activation's input is twice as wide)."""
    spec = activation_spec(name)
    rows, cols = shape
    x = make_input((rows, 2 * cols if name in GATED else cols), torch.bfloat16, "cuda")
    grad = make_input(shape, torch.bfloat16, "cuda", seed=1)
    r, c = {"first": (0, 0), "middle": (rows // 2, cols // 3), "last": (rows - 1, cols - 1)}[where]
    x[r, c] = 60.0
    if name in GATED:
        x[r, cols + c] = 60.0  # the gate of the same output
    grad[r, c] = -200.0
    scale = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    activation_amax(x, spec, amax)
    expected = torch.zeros(1, device="cuda")
    activation_forward_fp8(x, spec, scale, torch.float8_e5m2, amax=expected, with_transpose=False)
    assert torch.equal(amax, expected), (amax.item(), expected.item())
    y_ref, dx_ref = reference(name, x, grad)
    assert y_ref.abs().max() == y_ref[r, c].abs()  # the planted value is the maximum
    activation_backward_amax(grad, x, spec, amax)
    expected.zero_()
    activation_backward_fp8(grad, x, spec, scale, torch.float8_e5m2, amax=expected,
                            with_dbias=False)  # fmt: skip
    assert torch.equal(amax, expected), (amax.item(), expected.item())
    assert dx_ref.abs().max() == dx_ref.view(rows, -1)[r, c].abs()


@needs_two_gpus
def test_runs_on_the_tensors_device_not_the_current_one():
    x = make_input((64, 128), torch.bfloat16, "cuda:1")
    spec = activation_spec("swiglu")
    with torch.cuda.device(0):
        y = activation_forward(x, spec)
        dx = activation_backward(torch.ones_like(y), x, spec)
        scale = torch.ones(1, device="cuda:1")
        res = activation_forward_fp8(x, spec, scale, torch.float8_e4m3fn, amax=None,
                                     with_transpose=True)  # fmt: skip
        # the gated backward's own cast+transpose kernel, with the bias gradient
        bwd, dbias = activation_backward_fp8(torch.ones_like(y), x, spec, scale,
                                             torch.float8_e4m3fn, amax=None, with_dbias=True)  # fmt: skip
    assert y.device == dx.device == res.data.device == torch.device("cuda:1")
    assert bwd.data.device == dbias.device == torch.device("cuda:1")
    with torch.cuda.device(1):
        same, same_dbias = activation_backward_fp8(torch.ones_like(y), x, spec, scale,
                                                   torch.float8_e4m3fn, amax=None,
                                                   with_dbias=True)  # fmt: skip
    assert torch.equal(bwd.data.view(torch.uint8), same.data.view(torch.uint8))
    assert torch.equal(bwd.transpose.view(torch.uint8), same.transpose.view(torch.uint8))
    assert torch.equal(dbias, same_dbias)
    y_ref, _ = reference("swiglu", x, torch.ones(64, 64))
    assert_close(y, y_ref, torch.bfloat16, y_ref.abs().max().item())


@needs_cuda
def test_capturable_in_a_cuda_graph():
    x = make_input((256, 512), torch.bfloat16, "cuda")
    grad = make_input((256, 256), torch.bfloat16, "cuda", seed=1)
    spec = activation_spec("geglu")
    scale = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    eager = (
        activation_forward(x, spec),
        activation_backward(grad, x, spec),
        activation_backward_fp8(grad, x, spec, scale, torch.float8_e4m3fn, amax=amax,
                                with_dbias=True),
    )  # fmt: skip
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        activation_forward(x, spec)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = activation_forward(x, spec)
        dx = activation_backward(grad, x, spec)
        (res, dbias) = activation_backward_fp8(grad, x, spec, scale, torch.float8_e4m3fn,
                                               amax=amax, with_dbias=True)  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager[0]) and torch.equal(dx, eager[1])
    assert torch.equal(res.data.view(torch.uint8), eager[2][0].data.view(torch.uint8))
    assert torch.equal(dbias, eager[2][1])
