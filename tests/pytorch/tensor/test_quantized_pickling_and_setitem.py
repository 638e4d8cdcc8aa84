"""Round trips and writes that once went wrong silently or crashed: pickling a storage that
holds typed FP8 views, and ``t[key] = value`` where ``t[key]`` is not a view of ``t``'s bytes."""

import io
import pickle
import warnings

import pytest
import torch

import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

E4M3 = tex.DType.kFloat8E4M3


def _quantizers():
    return {
        "delayed": lambda: Float8Quantizer(torch.full((1,), 2.0), torch.zeros(1), E4M3),
        "current": lambda: Float8CurrentScalingQuantizer(E4M3, torch.device("cpu")),
        "block1d": lambda: Float8BlockQuantizer(
            E4M3, rowwise=True, columnwise=True, block_scaling_dim=1
        ),
        "block2d": lambda: Float8BlockQuantizer(
            E4M3, rowwise=True, columnwise=True, block_scaling_dim=2
        ),
        "mxfp8": lambda: MXFP8Quantizer(E4M3),
        "nvfp4": lambda: NVFP4Quantizer(),
    }


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_pickled_float8_storage_loads_back(kind, columnwise):
    # A cast hands the storage the FP8-typed tensors it wrote (kept next to the uint8 bytes
    # for GEMMs). Pickling both views of one buffer made pickle.loads fail inside torch
    # ("'UntypedStorage' has no attribute 'dtype'").
    quantizer = _quantizers()[kind]()
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    quantizer.internal = True
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    storage = quantizer(x)
    storage.float8_gemm_input(columnwise=False)
    loaded = pickle.loads(pickle.dumps(storage))
    assert type(loaded) is type(storage)
    torch.testing.assert_close(loaded.dequantize(), storage.dequantize(), rtol=0, atol=0)
    assert loaded.dequantize().dtype == torch.bfloat16
    # The typed views are made again on demand, over the loaded bytes.
    values, scale_inv = loaded.float8_gemm_input(columnwise=False)
    assert values.dtype == torch.float8_e4m3fn
    assert values.untyped_storage().data_ptr() == loaded._data.untyped_storage().data_ptr()
    assert torch.equal(scale_inv, storage._scale_inv)


_KEYS = {
    "column": (slice(None), slice(0, 4)),
    "ellipsis_column": (Ellipsis, 3),
    "strided_rows": (slice(None, None, 2),),
    "row": (1,),
    "rows": (slice(2, 6),),
    "element": (1, 2),
    "index_tensor": (torch.tensor([1, 3]),),
}


@pytest.mark.parametrize("kind", list(_quantizers()))
@pytest.mark.parametrize("key", list(_KEYS))
def test_indexed_write_reaches_the_tensor(kind, key):
    # Indexing that gives a dequantized copy (a column, a strided slice, any index of a
    # block-scaled tensor) made `t[key] = v` write into that copy: t silently kept its values.
    index = _KEYS[key]
    torch.manual_seed(0)
    quantize = _quantizers()[kind]()
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    y = torch.randn(128, 256, dtype=torch.bfloat16) * 4
    t = quantize(x)
    before = t.dequantize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t[index] = y[index]
    got = t.dequantize()
    assert type(t) is type(quantize(x)) and got.dtype == torch.bfloat16
    expected = before.clone()
    expected[index] = y[index]
    if kind in ("delayed", "current") and key in ("row", "rows"):
        # A dim-0 view of a Float8Tensor: its bytes are written with t's own scale.
        # Written with t's own scale: within half an E4M3 step of the (saturated) values.
        limit = 448 * float(t._scale_inv)
        ref = torch.clamp(y[index].float(), -limit, limit)
        torch.testing.assert_close(got[index].float(), ref, rtol=2**-4 + 2**-8, atol=limit * 2**-18)
        untouched = torch.ones(128, dtype=torch.bool)
        untouched[index] = False
        assert torch.equal(got[untouched], before[untouched])
    else:
        # Written through the dequantized values, then t re-quantized: t equals the cast of
        # the written values.
        torch.testing.assert_close(got, quantize(expected).dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["current", "mxfp8"])
def test_indexed_write_with_autograd(kind):
    quantize = _quantizers()[kind]()
    leaf = torch.nn.Parameter(quantize(torch.randn(64, 64)))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf[:, 0] = 1.0
    with torch.no_grad():
        leaf[:, 0] = 1.0
    assert torch.equal(leaf.dequantize(), quantize(leaf.dequantize()).dequantize())
    torch.testing.assert_close(leaf.dequantize()[:, 0].float(), torch.ones(64), rtol=0.07, atol=0)
    # A non-leaf: autograd records the write (no gradient reaches the overwritten column).
    x = torch.randn(64, 64, requires_grad=True)
    t = quantize(x)
    t[:, 0] = 1.0
    torch.testing.assert_close(t.dequantize()[:, 0].float(), torch.ones(64), rtol=0.07, atol=0)
    t.dequantize().sum().backward()
    expected = torch.ones(64, 64)
    expected[:, 0] = 0
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("kind", list(_quantizers()))
def test_multi_quantize_is_quantize_of_each(kind):
    # Upstream's Quantizer.multi_quantize(list) was missing (AttributeError).
    quantizer = _quantizers()[kind]()
    tensors = [torch.randn(32, 64), torch.randn(64, 128, dtype=torch.bfloat16)]
    out = quantizer.multi_quantize(tensors)
    assert isinstance(out, list) and len(out) == 2
    for got, x in zip(out, tensors):
        ref = quantizer(x)
        assert type(got) is type(ref) and got.shape == x.shape and got.dtype == x.dtype
        assert torch.equal(got.dequantize(), ref.dequantize())


@pytest.mark.parametrize("kind", list(_quantizers()))
@pytest.mark.parametrize("how", ["pickle", "save", "save_weights_only"])
def test_pickled_parameters_stay_trainable_parameters(kind, how):
    # A pickled Float8Tensor parameter (torch.save of a module, of a parameter) came back a
    # plain Float8Tensor with requires_grad=False: a loaded model trained no more.
    if how == "save_weights_only" and kind not in ("delayed", "current"):
        pytest.skip("only Float8Tensor is allowed by torch.load(weights_only=True)")
    quantize = _quantizers()[kind]()
    t = quantize(torch.randn(128, 256, dtype=torch.bfloat16))
    param = torch.nn.Parameter(t)
    trained = t.clone().requires_grad_()
    frozen = t.clone()

    def round_trip(obj):
        if how == "pickle":
            return pickle.loads(pickle.dumps(obj))
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=how == "save_weights_only")

    got_param, got_trained, got_frozen = round_trip([param, trained, frozen])
    for got, is_param, requires_grad in (
        (got_param, True, True),
        (got_trained, False, True),
        (got_frozen, False, False),
    ):
        assert isinstance(got, type(t))
        assert isinstance(got, torch.nn.Parameter) == is_param
        assert got.requires_grad == requires_grad
        assert got.shape == t.shape and got.dtype == t.dtype
        assert torch.equal(got.dequantize(), t.dequantize())
    got_param.dequantize().float().sum().backward()
    assert got_param.grad is not None and got_param.grad.shape == t.shape


@pytest.mark.parametrize("shape", [(0,), (3, 0), (2, 3, 0)])
def test_transposed_copy_of_an_empty_tensor_whose_last_dim_is_0(shape):
    # transpose_bytes viewed the bytes as reshape(-1, 0), which torch cannot infer for an empty
    # tensor: update_usage(columnwise_usage=True) raised instead of making the empty copy.
    quantizer = Float8CurrentScalingQuantizer(E4M3, torch.device("cpu"), columnwise=False)
    t = quantizer(torch.zeros(shape))
    t.update_usage(columnwise_usage=True)
    assert t._transpose.shape == (shape[-1], *shape[:-1]) and t._transpose.dtype == torch.uint8
    assert t.get_usages() == {"rowwise": True, "columnwise": True}
    assert t.dequantize().shape == shape


@pytest.mark.parametrize("shape", [(0,), (3, 0), (2, 3, 0)])
def test_cast_with_transposed_copy_of_an_empty_tensor_whose_last_dim_is_0(shape):
    # The reference cast's transpose reshaped to (-1, 0), which torch cannot infer.
    t = Float8CurrentScalingQuantizer(E4M3, torch.device("cpu"))(torch.zeros(shape))
    assert t._transpose.shape == (shape[-1], *shape[:-1])
    assert t.dequantize().shape == shape


@pytest.mark.parametrize("kind", list(_quantizers()))
def test_module_half_gives_quantized_parameters_the_new_nominal_dtype(kind):
    # module.half() assigns `weight.data = weight.half()`: a block-scaled weight (MXFP8,
    # Float8Blockwise, NVFP4) re-quantized the values but kept calling itself bfloat16.
    quantize = _quantizers()[kind]()
    module = torch.nn.Linear(256, 128, bias=False)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    module.weight = torch.nn.Parameter(quantize(x))
    before = module.weight
    module.half()
    weight = module.weight
    assert weight is before and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert weight.dtype == torch.float16 and weight.shape == x.shape
    assert weight.dequantize().dtype == torch.float16
    # The values are those of the re-quantized weight (within the format's error of x).
    atol = 0.35 * float(x.abs().max())
    torch.testing.assert_close(weight.dequantize().float(), x.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["block1d", "block2d", "mxfp8", "nvfp4"])
def test_data_of_another_shape_is_refused_with_both_shapes(kind):
    quantize = _quantizers()[kind]()
    t = quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match=r"shape \(128, 256\).*shape \(64, 128\)"):
        t.data = torch.randn(128, 256)


@pytest.mark.parametrize("kind", ["block1d", "block2d", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("internal", [False, True])
def test_dequantize_to_an_integer_dtype_is_refused(kind, internal):
    # dequantize(dtype=torch.uint8) of a block-scaled tensor wrapped the values without a word
    # (-3 became 253); Float8Tensor refuses such dtypes, and so do these now.
    quantizer = _quantizers()[kind]()
    quantizer.internal = internal
    t = quantizer(torch.randn(64, 128))
    for dtype in (torch.uint8, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=rf"dtype={dtype}.*floating-point"):
            t.dequantize(dtype=dtype)
    assert t.dequantize(dtype=torch.float16).dtype == torch.float16
    assert t.dequantize().dtype == torch.float32


@pytest.mark.parametrize("kind", list(_quantizers()))
def test_data_takes_a_quantized_tensor_of_another_shape(kind):
    # Assigning a tensor of the same kind takes its buffers, shape and dtype (as torch's setter
    # does); an NVFP4Tensor refused another shape (it fell through to a broadcasting re-cast).
    quantize = _quantizers()[kind]()
    param = torch.nn.Parameter(quantize(torch.randn(64, 128)))
    value = quantize(torch.randn(128, 256, dtype=torch.bfloat16))
    param.data = value
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert param.shape == (128, 256) and param.dtype == torch.bfloat16
    assert torch.equal(param.dequantize(), value.dequantize())
    assert torch.equal(param.clone().dequantize(), value.dequantize())
