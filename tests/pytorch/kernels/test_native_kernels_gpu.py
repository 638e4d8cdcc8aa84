"""Native CUDA kernels against the CPU reference, bit for bit, and the device contract.

Runs on a CUDA machine (qa/L0_pytorch_gpu/test.sh); on a machine without a GPU every test
here is skipped with that reason. Tests that need two GPUs skip with their own reason.
"""

import pytest
import torch
from utils import bitwise_equal, cpu_bytes, needs_cuda, needs_two_gpus

import transformer_engine
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.constants import TE_DType
from transformer_engine.pytorch.cpp_extensions import (
    compute_amax,
    compute_scale_from_amax,
    delayed_scaling_update,
    dequantize,
    quantize,
)

pytestmark = needs_cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HIGH = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (17,), (255,), (4097,), (1, 1), (17, 33), (255, 17), (3, 17, 65), (64, 64),
          (128, 4097), (4097, 8), (256, 1024)]  # fmt: skip
SCALES = [1.0, 0.37, 1000.0, 2.0**-10]


def same_bits_nan_aware(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal except that any NaN matches any NaN (payloads are not specified)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return bitwise_equal(a[keep], b[keep])


def make_input(shape, dtype, device, seed=0, specials=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    flat = x.view(-1)
    if specials and flat.numel() >= 8:
        flat[0] = float("nan")
        flat[1] = float("inf")
        flat[2] = float("-inf")
        flat[3] = 1e30
        flat[4] = -0.0
        flat[5] = 1e-30
        flat[6] = 3e-3
        flat[7] = -6e4
    return x.to(dtype).to(device)


def test_native_library_is_loaded_on_a_cuda_machine():
    status = transformer_engine.native_status()
    assert status.available, str(status)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_matches_reference_bitwise(fp8, dtype, shape, with_transpose):
    x = make_input(shape, dtype, "cuda:0", seed=len(shape) * 1000 + shape[-1])
    for scale_value in SCALES:
        scale = torch.tensor([scale_value], device="cuda:0")
        amax = torch.full((1,), 0.5, device="cuda:0")  # accumulates onto an existing value
        result = quantize(x, scale, fp8, amax=amax, with_transpose=with_transpose)
        expected = reference.cast_to_fp8(x.cpu(), scale.cpu(), fp8)
        assert result.data.device == x.device
        assert bitwise_equal(result.data, expected), (shape, dtype, fp8, scale_value)
        if with_transpose:
            assert result.transpose.shape == (shape[-1], *shape[:-1])
            assert bitwise_equal(result.transpose, reference.transpose_last_dim_first(expected))
        else:
            assert result.transpose is None
        expected_amax = torch.maximum(torch.tensor([0.5]), reference.amax(x.cpu()))
        assert bitwise_equal(amax, expected_amax)
        assert bitwise_equal(result.scale_inv, reference.reciprocal(scale.cpu()))


@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_misaligned_input_uses_the_scalar_path_correctly(with_transpose):
    base = make_input((33 * 64 + 1,), torch.bfloat16, "cuda:0", seed=3)
    x = base[1:].view(33, 64)  # data pointer 2 bytes past a 16-byte boundary
    scale = torch.tensor([3.0], device="cuda:0")
    result = quantize(x, scale, torch.float8_e4m3fn, with_transpose=with_transpose)
    expected = reference.cast_to_fp8(x.cpu(), scale.cpu(), torch.float8_e4m3fn)
    assert bitwise_equal(result.data, expected)
    if with_transpose:
        assert bitwise_equal(result.transpose, reference.transpose_last_dim_first(expected))


def test_quantize_empty_tensor_writes_only_scale_inv():
    x = torch.empty(0, 16, dtype=torch.bfloat16, device="cuda:0")
    amax = torch.tensor([2.0], device="cuda:0")
    result = quantize(x, torch.tensor([4.0], device="cuda:0"), torch.float8_e4m3fn, amax=amax)
    assert result.data.shape == (0, 16)
    assert amax.item() == 2.0
    assert result.scale_inv.item() == 0.25


@pytest.mark.parametrize("with_transpose", [False, True])
def test_noop_flag_writes_nothing(with_transpose):
    x = make_input((64, 128), torch.bfloat16, "cuda:0")
    out = torch.full((64, 128), 0x11, dtype=torch.uint8, device="cuda:0")
    out_t = torch.full((128, 64), 0x22, dtype=torch.uint8, device="cuda:0")
    amax = torch.tensor([1.5], device="cuda:0")
    scale_inv = torch.tensor([7.0], device="cuda:0")
    noop = torch.ones(1, device="cuda:0")
    quantize(x, torch.tensor([2.0], device="cuda:0"), torch.float8_e4m3fn, amax=amax, out=out,
             scale_inv=scale_inv, out_transpose=out_t if with_transpose else None, noop_flag=noop)  # fmt: skip
    assert (out == 0x11).all() and (out_t == 0x22).all()
    assert amax.item() == 1.5 and scale_inv.item() == 7.0
    noop.zero_()
    quantize(x, torch.tensor([2.0], device="cuda:0"), torch.float8_e4m3fn, amax=amax, out=out,
             scale_inv=scale_inv, noop_flag=noop)  # fmt: skip
    expected = reference.cast_to_fp8(x.cpu(), torch.tensor([2.0]), torch.float8_e4m3fn)
    assert torch.equal(cpu_bytes(out), cpu_bytes(expected))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("out_dtype", HIGH)
@pytest.mark.parametrize("shape", [(1,), (17,), (255, 3), (4097,), (128, 96)])
def test_dequantize_matches_reference_bitwise(fp8, out_dtype, shape):
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    data = raw.view(fp8)
    data = torch.where(data.float().isfinite(), data.float(), 1.0).to(fp8).to("cuda:0")
    scale_inv = torch.tensor([0.3125], device="cuda:0")
    out = dequantize(data, scale_inv, out_dtype)
    assert out.dtype == out_dtype and out.device == data.device
    assert bitwise_equal(out, reference.dequantize(data.cpu(), scale_inv.cpu(), out_dtype))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("out_dtype", HIGH)
def test_dequantize_keeps_nan_and_inf_codes(fp8, out_dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    out = dequantize(codes.to("cuda:0"), torch.tensor([2.0], device="cuda:0"), out_dtype).cpu()
    expected = reference.dequantize(codes, torch.tensor([2.0]), out_dtype)
    assert same_bits_nan_aware(out, expected)  # NaN payloads may differ; NaN-ness may not


@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("shape", [(1,), (17,), (255,), (4097,), (33, 4097)])
def test_compute_amax_matches_reference_and_overwrites(dtype, shape):
    x = make_input(shape, dtype, "cuda:0", seed=11)
    out = torch.tensor([1e38], device="cuda:0")
    compute_amax(x, out=out)
    assert bitwise_equal(out, reference.amax(x.cpu()))


@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("where", ["first", "middle", "last_vector", "scalar_tail"])
def test_compute_amax_large_tensors_find_the_max_anywhere(dtype, where):
    """Large enough that every thread of the pass runs its unrolled loop several times, then
    its remainder, then (odd length) the scalar tail: one planted maximum is found wherever it
    lies, NaN elsewhere is ignored, and an unaligned view takes the element-wise path."""
    n = 9 * 2**21 + 5
    g = torch.Generator("cuda:0").manual_seed(3)
    x = torch.rand(n, generator=g, device="cuda:0").to(dtype)
    at = {"first": 0, "middle": n // 2 + 3, "last_vector": n - 6, "scalar_tail": n - 1}[where]
    x[at] = -7.0
    x[at // 2 + 1] = float("nan")
    for view in (x, x[1:]):
        out = compute_amax(view)
        assert out.item() == 7.0 or (view is not x and at == 0)
        assert bitwise_equal(out, reference.amax(view.cpu()))


AMAX_CASES = [0.0, 1e-45, 1e-40, 1e-30, 1.0, 3.0, 448.0, 1e30, float("inf"), float("nan")]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("pow2", [False, True])
def test_compute_scale_from_amax_matches_reference(fp8, epsilon, pow2):
    for value in AMAX_CASES:
        amax = torch.tensor([value], device="cuda:0")
        scale = compute_scale_from_amax(amax, fp8, epsilon=epsilon, force_pow_2_scales=pow2)
        expected = reference.compute_scale_from_amax(amax.cpu(), fp8, epsilon, pow2)
        assert bitwise_equal(scale, expected), (value, epsilon, pow2)


def _random_states(num_pairs, length, seed, device, slots=None):
    g = torch.Generator().manual_seed(seed)
    histories, scales = [], []
    for k in range(num_pairs):
        # Up to 9 slots by default (the widest module's), and none: pairs without slots.
        n = slots(k) if slots is not None else (1 + (k * 7) % 9 if k % 50 != 49 else 0)
        h = torch.rand((length, n), generator=g) * 100
        if n == 0:
            histories.append(h.to(device))
            scales.append(torch.rand(0).to(device))
            continue
        h[0, 0] = [0.0, 1e-44, float("inf"), float("nan"), 5.0][k % 5]
        if length > 1 and k % 7 == 3:  # a NaN / Inf deep in the history must win the max
            h[length // 2, n - 1] = float("nan") if k % 2 else float("inf")
        histories.append(h.to(device))
        scales.append((torch.rand(n, generator=g) + 0.5).to(device))
    return histories, scales


def _check_update(fp8, algo, length, with_reduction, margin, num_pairs, slots=None):
    gpu_h, gpu_s = _random_states(num_pairs, length, seed=length, device="cuda:0", slots=slots)
    cpu_h, cpu_s = [h.cpu() for h in gpu_h], [s.cpu() for s in gpu_s]
    reduced_gpu = reduced_cpu = None
    if with_reduction:
        total = sum(h.shape[1] for h in cpu_h)
        reduced_cpu = torch.rand(total) * 200
        reduced_cpu[::3] = 0.0  # zero entries fall back to the history's own row 0
        reduced_gpu = reduced_cpu.to("cuda:0")
    for _ in range(3):  # several steps, so rolled histories feed later updates
        delayed_scaling_update(gpu_h, gpu_s, fp8, margin=margin, amax_compute_algo=algo,
                               amax_reduction_buffer=reduced_gpu)  # fmt: skip
        reference.delayed_scaling_update(cpu_h, cpu_s, fp8, margin, algo, reduced_cpu)
    for k in range(num_pairs):
        assert bitwise_equal(gpu_h[k], cpu_h[k]), k
        assert bitwise_equal(gpu_s[k], cpu_s[k]), k


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 16, 33, 257, 1024])
@pytest.mark.parametrize("with_reduction", [False, True])
@pytest.mark.parametrize("margin", [0, 1.5])
def test_delayed_scaling_update_matches_reference(fp8, algo, length, with_reduction, margin):
    """Pairs of up to 9 slots (and none), the group kernel: a block shares a pair's slots, whose
    passes hold 8 rows a thread of 1024 / slots threads (904 rows with 9 slots: 1024 crosses a
    pass). 300 pairs: more than one launch's worth."""
    _check_update(fp8, algo, length, with_reduction, margin, num_pairs=300)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("with_reduction", [False, True])
def test_delayed_scaling_update_long_history(algo, with_reduction):
    """8195 rows cross a pass of the group kernel with one slot (8192 rows)."""
    _check_update(torch.float8_e4m3fn, algo, 8195, with_reduction, 0.0, num_pairs=12)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 33, 257, 1024])
def test_delayed_scaling_update_wide_pairs(algo, length):
    """A launch with a pair of more than 64 slots takes the warp-per-slot kernel (up to 70
    slots here; 257 crosses its 256-row pass)."""
    _check_update(torch.float8_e5m2, algo, length, True, 1.5, num_pairs=40,
                  slots=lambda k: 1 + (k * 13) % 70)  # fmt: skip


def test_work_goes_to_the_current_stream_of_the_tensors_device():
    x = make_input((512, 512), torch.bfloat16, "cuda:0")
    side = torch.cuda.Stream(device="cuda:0")
    side.wait_stream(torch.cuda.current_stream("cuda:0"))
    with torch.cuda.stream(side):
        scale = torch.tensor([2.0], device="cuda:0")
        result = quantize(x, scale, torch.float8_e5m2, with_transpose=True)
    side.synchronize()
    expected = reference.cast_to_fp8(x.cpu(), torch.tensor([2.0]), torch.float8_e5m2)
    assert bitwise_equal(result.data, expected)


def test_native_layer_refuses_a_stream_of_another_device_or_a_bad_index():
    native = transformer_engine.common.native.native_module()
    x = torch.ones(8, device="cuda:0")
    amax = torch.zeros(1, device="cuda:0")
    arg = lambda t: (t.data_ptr(), list(t.shape), int(TE_DType[t.dtype]))  # noqa: E731
    with pytest.raises(ValueError, match="does not exist; this process sees"):
        native.compute_amax(arg(x), arg(amax), torch.cuda.device_count() + 4, 0)
    host = torch.ones(8)
    with pytest.raises(RuntimeError, match="not device memory"):
        native.compute_amax(arg(host), arg(amax), 0, 0)
    assert torch.cuda.current_device() == 0


# ---------------------------------------------------------------------------------------------
# Two GPUs in one process: the execution device is the tensors' device, never the current one.


@needs_two_gpus
@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_on_cuda1_while_cuda0_is_current(with_transpose):
    torch.cuda.set_device(0)
    x1 = make_input((255, 130), torch.bfloat16, "cuda:1", seed=5)
    scale1 = torch.tensor([3.5], device="cuda:1")
    amax1 = torch.zeros(1, device="cuda:1")
    result = quantize(x1, scale1, torch.float8_e4m3fn, amax=amax1, with_transpose=with_transpose)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert result.data.device == torch.device("cuda:1")
    assert result.scale_inv.device == torch.device("cuda:1")
    # Same bits as the same call made with cuda:1 current, and as the reference.
    with torch.cuda.device(1):
        again = quantize(x1, scale1, torch.float8_e4m3fn, with_transpose=with_transpose)
    assert torch.cuda.current_device() == 0
    assert bitwise_equal(result.data, again.data)
    expected = reference.cast_to_fp8(x1.cpu(), scale1.cpu(), torch.float8_e4m3fn)
    assert bitwise_equal(result.data, expected)
    if with_transpose:
        assert result.transpose.device == torch.device("cuda:1")
        assert bitwise_equal(result.transpose, reference.transpose_last_dim_first(expected))
    assert bitwise_equal(amax1, reference.amax(x1.cpu()))


@needs_two_gpus
def test_every_kernel_on_cuda1_leaves_cuda0_current():
    torch.cuda.set_device(0)
    x1 = make_input((33, 65), torch.float16, "cuda:1", seed=9)
    amax = compute_amax(x1)
    scale = compute_scale_from_amax(amax, torch.float8_e5m2)
    q = quantize(x1, scale, torch.float8_e5m2)
    y = dequantize(q.data, q.scale_inv, torch.float32)
    h, s = [torch.rand(4, 3, device="cuda:1")], [torch.ones(3, device="cuda:1")]
    delayed_scaling_update(h, s, torch.float8_e5m2)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for t in (amax, scale, q.data, y, h[0], s[0]):
        assert t.device == torch.device("cuda:1")
    assert bitwise_equal(amax, reference.amax(x1.cpu()))
    ref_scale = reference.compute_scale_from_amax(amax.cpu(), torch.float8_e5m2)
    assert bitwise_equal(scale, ref_scale)
    expected_y = reference.dequantize(q.data.cpu(), q.scale_inv.cpu(), torch.float32)
    assert same_bits_nan_aware(y, expected_y)


@needs_two_gpus
def test_wrong_device_is_refused_before_any_launch():
    torch.cuda.set_device(0)
    x1 = make_input((16, 16), torch.bfloat16, "cuda:1")
    scale0 = torch.tensor([1.0], device="cuda:0")
    amax1 = torch.tensor([9.0], device="cuda:1")
    out1 = torch.full((16, 16), 0x33, dtype=torch.uint8, device="cuda:1")
    with pytest.raises(ValueError, match=r"scale is on cuda:0 but input is on cuda:1"):
        quantize(x1, scale0, torch.float8_e4m3fn, amax=amax1, out=out1)
    assert amax1.item() == 9.0 and (out1 == 0x33).all()
    assert torch.cuda.current_device() == 0


@needs_two_gpus
def test_native_layer_double_checks_pointer_devices_and_streams():
    native = transformer_engine.common.native.native_module()
    x1 = torch.ones(8, device="cuda:1")
    amax0 = torch.zeros(1, device="cuda:0")
    arg = lambda t: (t.data_ptr(), list(t.shape), int(TE_DType[t.dtype]))  # noqa: E731
    with pytest.raises(RuntimeError, match="amax is on device 0 but the call runs on device 1"):
        native.compute_amax(arg(x1), arg(amax0), 1, torch.cuda.current_stream(1).cuda_stream)
    stream0 = torch.cuda.Stream(device="cuda:0")
    amax1 = torch.zeros(1, device="cuda:1")
    with pytest.raises(RuntimeError, match="stream belongs to device 0"):
        native.compute_amax(arg(x1), arg(amax1), 1, stream0.cuda_stream)
    assert torch.cuda.current_device() == 0
    assert amax1.item() == 0.0


@needs_two_gpus
def test_same_bits_on_both_gpus():
    torch.cuda.set_device(0)
    x = make_input((4097, 24), torch.float32, "cpu", seed=21)
    results = []
    for device in ("cuda:0", "cuda:1"):
        xd = x.to(device)
        r = quantize(
            xd, torch.tensor([0.75], device=device), torch.float8_e5m2, with_transpose=True
        )
        results.append(r)
    assert bitwise_equal(results[0].data, results[1].data)
    assert bitwise_equal(results[0].transpose, results[1].transpose)
    assert torch.cuda.current_device() == 0


@needs_two_gpus
def test_launch_args_name_the_current_stream_of_each_device():
    from transformer_engine.pytorch.device import native_launch_args

    torch.cuda.set_device(0)
    side1 = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(side1):  # makes side1 current on cuda:1 only
        assert native_launch_args(torch.device("cuda:1")) == (1, side1.cuda_stream)
        assert native_launch_args(torch.device("cuda:0")) == (
            0,
            torch.cuda.current_stream(0).cuda_stream,
        )
    assert native_launch_args(torch.device("cuda:1")) == (
        1,
        torch.cuda.current_stream(1).cuda_stream,
    )
    assert torch.cuda.current_device() == 0


# ---------------------------------------------------------------------------------------------
# nvte_quantize_dbias: nvte_quantize's cast + transpose, plus the sum over rows


DBIAS_SHAPES = [(1, 16), (17, 33), (64, 64), (255, 130), (4097, 64), (3, 65, 128), (64, 4096), (8192, 520), (2100, 131),
                (130, 7)]  # fmt: skip


def _column_sum_tolerance(x: torch.Tensor) -> torch.Tensor:
    """float32 accumulation in another order, then one rounding to x's dtype."""
    flat = x.detach().cpu().double().reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    eps = torch.finfo(x.dtype).eps
    exact = flat.sum(dim=0)
    return exact, flat.abs().sum(dim=0) * rows * 2.0**-23 + exact.abs() * eps + 1e-30


@pytest.mark.parametrize("shape", DBIAS_SHAPES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("aligned", [True, False])
def test_quantize_dbias_is_quantize_plus_the_column_sum(shape, fp8, dtype, aligned):
    from transformer_engine.pytorch.cpp_extensions.cast import quantize_dbias_prevalidated

    x = make_input(shape, dtype, "cuda:0", seed=len(shape) + shape[-1], specials=False)
    if not aligned:  # one element in: the scalar (unvectorised) path
        flat = torch.cat([torch.zeros(1, dtype=dtype, device="cuda:0"), x.reshape(-1)])
        x = flat[1:].view(shape)
    scale = torch.tensor([0.75], device="cuda:0")
    amax_fused, amax_plain = torch.zeros(1, device="cuda:0"), torch.zeros(1, device="cuda:0")
    fused, dbias = quantize_dbias_prevalidated(x, scale, fp8, amax=amax_fused)
    plain = quantize(x, scale, fp8, amax=amax_plain, with_transpose=True)
    torch.cuda.synchronize()
    assert bitwise_equal(fused.data, plain.data)
    assert bitwise_equal(fused.transpose, plain.transpose)
    assert bitwise_equal(fused.scale_inv, plain.scale_inv)
    assert bitwise_equal(amax_fused, amax_plain)
    assert dbias.dtype == dtype and dbias.shape == (shape[-1],) and dbias.device == x.device
    exact, tol = _column_sum_tolerance(x)
    err = (dbias.cpu().double() - exact).abs()
    assert (err <= tol).all(), (err - tol).max()
    # deterministic: the same bits again
    _, again = quantize_dbias_prevalidated(x, scale, fp8, amax=None)
    assert bitwise_equal(again, dbias)


def test_quantize_dbias_with_no_rows_gives_zeros_and_publishes_scale_inv():
    native = transformer_engine.common.native.native_module()
    x = torch.empty(0, 32, dtype=torch.bfloat16, device="cuda:0")
    out = torch.empty(0, 32, dtype=torch.float8_e4m3fn, device="cuda:0")
    out_t = torch.empty(32, 0, dtype=torch.float8_e4m3fn, device="cuda:0")
    scale = torch.tensor([4.0], device="cuda:0")
    scale_inv = torch.zeros(1, device="cuda:0")
    dbias = torch.full((32,), 7.0, dtype=torch.bfloat16, device="cuda:0")
    ws = torch.empty(1, device="cuda:0")
    arg = lambda t: (t.data_ptr(), list(t.shape), int(TE_DType[t.dtype]))  # noqa: E731
    native.quantize_dbias(arg(x), arg(scale), arg(out), arg(out_t), None, arg(scale_inv),
                          arg(dbias), arg(ws), 0, torch.cuda.current_stream(0).cuda_stream)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(dbias.cpu(), torch.zeros(32, dtype=torch.bfloat16))
    assert scale_inv.item() == 0.25


@needs_two_gpus
def test_quantize_dbias_on_cuda1_while_cuda0_is_current():
    from transformer_engine.pytorch.cpp_extensions.cast import quantize_dbias_prevalidated

    torch.cuda.set_device(0)
    x1 = make_input((255, 130), torch.bfloat16, "cuda:1", seed=3, specials=False)
    scale1 = torch.tensor([2.0], device="cuda:1")
    fused, dbias = quantize_dbias_prevalidated(x1, scale1, torch.float8_e5m2, amax=None)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert fused.data.device == dbias.device == torch.device("cuda:1")
    with torch.cuda.device(1):
        _, again = quantize_dbias_prevalidated(x1, scale1, torch.float8_e5m2, amax=None)
    assert bitwise_equal(dbias, again)
    expected = reference.cast_to_fp8(x1.cpu(), scale1.cpu(), torch.float8_e5m2)
    assert bitwise_equal(fused.data, expected)
