"""Upstream's small helper names, imported from upstream's paths and held to hand-written
expectations: ``pytorch.utils``, ``tensor.utils.replace_raw_data``, the quantizer slot tables in
``constants``, the saving helpers, and ``_extra_state``'s pickle policy."""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest
import torch

import transformer_engine.common.recipe as recipe_module
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import device as te_device
from transformer_engine.pytorch import utils as te_utils
from transformer_engine.pytorch.constants import DType

ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"

UPSTREAM_NAMES = [
    ("transformer_engine.pytorch.utils", "init_method_normal"),
    ("transformer_engine.pytorch.utils", "scaled_init_method_normal"),
    ("transformer_engine.pytorch.utils", "get_default_init_method"),
    ("transformer_engine.pytorch.utils", "init_method_constant"),
    ("transformer_engine.pytorch.utils", "get_device_compute_capability"),
    ("transformer_engine.pytorch.utils", "get_cudnn_version"),
    ("transformer_engine.pytorch.utils", "is_bf16_available"),
    ("transformer_engine.pytorch.utils", "is_bf16_compatible"),
    ("transformer_engine.pytorch.utils", "is_non_tn_fp8_gemm_supported"),
    ("transformer_engine.pytorch.utils", "attention_mask_func"),
    ("transformer_engine.pytorch.utils", "interleave_glu_tensor"),
    ("transformer_engine.pytorch.utils", "deinterleave_glu_tensor"),
    ("transformer_engine.pytorch.utils", "divide"),
    ("transformer_engine.pytorch.utils", "ensure_divisibility"),
    ("transformer_engine.pytorch.utils", "split_tensor_along_dim"),
    ("transformer_engine.pytorch.utils", "cast_if_needed"),
    ("transformer_engine.pytorch.utils", "check_dim_for_fp8_exec"),
    ("transformer_engine.pytorch.utils", "assert_dim_for_fp8_exec"),
    ("transformer_engine.pytorch.utils", "round_up_to_nearest_multiple"),
    ("transformer_engine.pytorch.utils", "ceil_div"),
    ("transformer_engine.pytorch.tensor.utils", "replace_raw_data"),
    ("transformer_engine.pytorch.constants", "FP8FwdTensorIdx"),
    ("transformer_engine.pytorch.constants", "FP8BwdTensorIdx"),
    ("transformer_engine.pytorch._extra_state", "UNSAFE_PICKLE_EXTRA_STATE_ENV"),
    ("transformer_engine.pytorch._extra_state", "CheckpointExtraStatePolicy"),
    ("transformer_engine.pytorch._extra_state", "_RECIPE_POLICIES"),
    ("transformer_engine.pytorch._extra_state", "should_load_extra_state_pickle"),
    ("transformer_engine.pytorch._extra_state", "recipe_extra_state_policy"),
    ("transformer_engine.pytorch._extra_state", "is_stateless_recipe"),
] + [
    ("transformer_engine.pytorch", name)
    for name in (
        "torch_version",
        "prepare_for_saving",
        "restore_from_saved",
        "restore_from_func_ctx",
        "QuantizedTensorStorage",
        "Float8TensorStorage",
        "get_device_compute_capability",
        "get_cudnn_version",
        "is_bf16_available",
        "interleave_glu_tensor",
        "deinterleave_glu_tensor",
    )
]


@pytest.mark.parametrize("module, name", UPSTREAM_NAMES, ids=lambda v: v)
def test_upstream_name_is_importable(module, name):
    assert hasattr(importlib.import_module(module), name)


def test_utils_all_is_upstreams():
    assert set(te_utils.__all__) == {
        "get_device_compute_capability",
        "get_cudnn_version",
        "is_bf16_available",
        "deinterleave_glu_tensor",
        "interleave_glu_tensor",
    }
    for name in te_utils.__all__:
        assert getattr(te, name) is getattr(te_utils, name)


# ------------------------------------------------------------------ initializers


@pytest.mark.parametrize(
    "make, std",
    [
        (lambda: te_utils.init_method_normal(0.02), 0.02),
        (lambda: te_utils.scaled_init_method_normal(0.02, 8), 0.005),  # 0.02 / sqrt(16)
        (lambda: te_utils.scaled_init_method_normal(0.1, 2), 0.05),  # 0.1 / sqrt(4)
        (te_utils.get_default_init_method, 0.023),
    ],
)
def test_normal_initializers_draw_from_the_stated_std(make, std):
    tensor = torch.empty(64, 32)
    torch.manual_seed(7)
    out = make()(tensor)
    torch.manual_seed(7)
    expected = torch.empty(64, 32).normal_(mean=0.0, std=std)
    assert out is tensor
    assert torch.equal(tensor, expected)


def test_scaled_init_refuses_non_positive_layers():
    with pytest.raises(ValueError, match="num_layers=0"):
        te_utils.scaled_init_method_normal(0.02, 0)


@pytest.mark.parametrize("val", [1.0, 0.0, -2.5])
def test_init_method_constant(val):
    tensor = torch.empty(3, 4)
    assert te_utils.init_method_constant(val)(tensor) is tensor
    assert torch.equal(tensor, torch.full((3, 4), val))


# ------------------------------------------------------------------ capability probes


@pytest.fixture
def fake_gpus(monkeypatch):
    """CUDA "available", current device 1; capabilities set per test through the dict."""
    capabilities = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    te_device._cuda_capability.cache_clear()
    yield capabilities
    te_device._cuda_capability.cache_clear()


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_compute_capability_is_the_current_devices(fake_gpus):
    assert te_utils.get_device_compute_capability() == (9, 0)


def test_compute_capability_without_cuda_raises(no_cuda):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        te_utils.get_device_compute_capability()


@pytest.mark.parametrize(
    "cc, expected",
    [((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True), ((12, 0), True)],
)
def test_is_bf16_available_needs_ampere(fake_gpus, cc, expected):
    fake_gpus[1] = cc
    assert te_utils.is_bf16_available() is expected
    assert te_utils.is_bf16_compatible() is expected  # the older name, a plain bool
    available, reason = te_utils.is_bf16_available(return_reason=True)
    assert available is expected
    if expected:
        assert reason == ""
    else:
        assert f"{cc[0]}.{cc[1]}" in reason and "8.0" in reason


def test_is_bf16_available_on_the_cpu_reference_path(no_cuda):
    assert te_utils.is_bf16_available(return_reason=True) == (True, "")


@pytest.mark.parametrize(
    "cc, expected",
    [
        ((8, 9), False),
        ((9, 0), False),
        ((10, 0), True),
        ((10, 3), True),
        ((11, 0), True),
        ((12, 0), False),
        ((12, 1), False),
        ((13, 0), True),
    ],
)
def test_non_tn_fp8_gemm_support_by_capability(fake_gpus, cc, expected):
    fake_gpus[1] = cc
    assert te_utils.is_non_tn_fp8_gemm_supported() is expected


def test_non_tn_fp8_gemm_is_not_supported_on_cpu(no_cuda):
    assert te_utils.is_non_tn_fp8_gemm_supported() is False


@pytest.mark.parametrize(
    "raw, expected",
    [(8905, (8, 9, 5)), (8600, (8, 6, 0)), (90800, (9, 8, 0)), (91002, (9, 10, 2))],
)
def test_cudnn_version_is_decoded(monkeypatch, raw, expected):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: raw)
    assert te_utils.get_cudnn_version() == expected


def test_cudnn_version_without_cudnn_raises(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    with pytest.raises(RuntimeError, match="no cuDNN"):
        te_utils.get_cudnn_version()


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.6.0a0+git1234", (2, 6, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.7.0.dev20250101", (2, 7, 0)),
        ("2.4.1", (2, 4, 1)),
    ],
)
def test_torch_version_is_the_release_tuple(monkeypatch, version, expected):
    monkeypatch.setattr(torch, "__version__", version)
    assert te.torch_version() == expected


def test_torch_version_compares_with_tuples():
    assert te.torch_version() >= (2, 1, 0)
    assert all(type(part) is int for part in te.torch_version())


# ------------------------------------------------------------------ GLU interleaving


def test_interleave_glu_rows_by_hand():
    weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # gate rows 0-3, value 4-7
    out = te.interleave_glu_tensor(weight, 2)
    assert torch.equal(out, weight[[0, 1, 4, 5, 2, 3, 6, 7]])
    bias = torch.tensor([10.0, 11.0, 20.0, 21.0])
    assert torch.equal(te.interleave_glu_tensor(bias, 1), torch.tensor([10.0, 20.0, 11.0, 21.0]))


def test_deinterleave_glu_rows_by_hand_and_round_trip():
    interleaved = torch.tensor([0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0])
    assert torch.equal(te.deinterleave_glu_tensor(interleaved, 2), torch.arange(8.0))
    weight = torch.randn(12, 5, 2)
    for k in (1, 2, 3, 6):
        round_trip = te.deinterleave_glu_tensor(te.interleave_glu_tensor(weight, k), k)
        assert torch.equal(round_trip, weight)


@pytest.mark.parametrize("fn", [te.interleave_glu_tensor, te.deinterleave_glu_tensor])
def test_glu_results_never_alias_the_input(fn):
    weight = torch.randn(4, 3)  # a single block per half: the reorder is a no-op view
    out = fn(weight, 2)
    assert out.shape == weight.shape and out.data_ptr() != weight.data_ptr()
    assert torch.equal(out, weight)


@pytest.mark.parametrize("fn", [te.interleave_glu_tensor, te.deinterleave_glu_tensor])
@pytest.mark.parametrize(
    "shape, k, match",
    [((8, 2), 0, "must be positive"), ((8, 2), -1, "must be positive"), ((6, 2), 2, "multiple")],
)
def test_glu_bad_sizes_raise(fn, shape, k, match):
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(shape), k)


def test_attention_mask_func_masks_in_place():
    scores = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[False, True], [True, True]])
    out = te_utils.attention_mask_func(scores, mask)
    assert out is scores
    assert torch.equal(scores, torch.tensor([[1.0, -10000.0], [-10000.0, -10000.0]]))


# ------------------------------------------------------------------ sizes and dtypes


def test_divisibility_helpers():
    assert te_utils.divide(12, 4) == 3
    te_utils.ensure_divisibility(12, 3)
    for bad in ((10, 4), (3, 0)):
        with pytest.raises(ValueError, match="not divisible"):
            te_utils.divide(*bad)
    assert te_utils.ceil_div(7, 2) == 4 and te_utils.ceil_div(8, 2) == 4
    assert te_utils.round_up_to_nearest_multiple(17, 16) == 32
    assert te_utils.round_up_to_nearest_multiple(32, 16) == 32
    with pytest.raises(ValueError, match="non-zero"):
        te_utils.ceil_div(1, 0)
    with pytest.raises(ValueError, match="non-zero"):
        te_utils.round_up_to_nearest_multiple(1, 0)


def test_split_tensor_along_dim():
    tensor = torch.arange(12.0).reshape(2, 6)
    parts = te_utils.split_tensor_along_dim(tensor, 1, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert not parts[1].is_contiguous()
    assert all(p.is_contiguous() for p in te_utils.split_tensor_along_dim(tensor, 1, 3, True))
    with pytest.raises(ValueError, match="6 is not divisible by 4"):
        te_utils.split_tensor_along_dim(tensor, 1, 4)


def test_cast_if_needed():
    x = torch.ones(2, requires_grad=True)
    assert te_utils.cast_if_needed(None, torch.float16) is None
    assert te_utils.cast_if_needed(x, torch.float32) is x
    with torch.no_grad():
        y = te_utils.cast_if_needed(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.requires_grad  # on the graph despite no_grad


def test_fp8_dimension_checks():
    assert te_utils.check_dim_for_fp8_exec(torch.empty(8, 16))
    assert not te_utils.check_dim_for_fp8_exec(torch.empty(8, 8))
    assert not te_utils.check_dim_for_fp8_exec(torch.empty(4, 16))
    assert not te_utils.check_dim_for_fp8_exec(torch.empty(2, 4, 16))  # only 2-D qualifies
    te_utils.assert_dim_for_fp8_exec(torch.empty(2, 4, 16), torch.empty(16, 32))  # M = 8
    with pytest.raises(ValueError, match=r"shape \(3, 16\) \(M=3, K=16\)"):
        te_utils.assert_dim_for_fp8_exec(torch.empty(8, 16), torch.empty(3, 16))
    with pytest.raises(ValueError, match="K=20"):
        te_utils.assert_dim_for_fp8_exec(torch.empty(8, 20))


# ------------------------------------------------------------------ slot tables


def test_quantizer_slot_tables_are_upstreams():
    from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx

    assert vars(FP8FwdTensorIdx) == {
        "GEMM1_INPUT": 0,
        "GEMM1_WEIGHT": 1,
        "GEMM1_OUTPUT": 2,
        "GEMM2_INPUT": 3,
        "GEMM2_WEIGHT": 4,
        "GEMM2_OUTPUT": 5,
        "GEMM3_OUTPUT": 8,
    }
    assert vars(FP8BwdTensorIdx) == {
        "GRAD_OUTPUT1": 0,
        "GRAD_INPUT1": 1,
        "GRAD_OUTPUT2": 2,
        "GRAD_INPUT2": 3,
        "GRAD_OUTPUT3": 4,
        "GRAD_INPUT3": 5,
    }


# ------------------------------------------------------------------ raw data and saving


def _float8_tensor():
    quantizer = te.Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), DType.kFloat8E4M3)
    values = torch.tensor([[0.5, 1.0, -2.0, 0.25], [4.0, -0.5, 0.125, 3.0]])  # exact after *2
    return quantizer(values), values


def test_replace_raw_data_moves_the_bytes_and_keeps_values():
    from transformer_engine.pytorch.tensor.utils import replace_raw_data

    tensor, values = _float8_tensor()
    old_bytes = tensor._data.clone()
    bucket = torch.zeros(32, dtype=torch.uint8)
    target = bucket[5:13].view(2, 4)
    replace_raw_data(tensor, target)
    assert tensor._data is target
    assert torch.equal(bucket[5:13], old_bytes.reshape(-1))
    assert torch.equal(bucket[:5], torch.zeros(5, dtype=torch.uint8))
    assert torch.equal(tensor.dequantize(), values)
    gemm_values, _ = tensor.float8_gemm_input()
    assert gemm_values.data_ptr() == bucket[5:].data_ptr()  # GEMMs read the new buffer
    bucket[5:13] = 0
    assert torch.equal(tensor.dequantize(), torch.zeros(2, 4))  # the bucket is the storage


def test_replace_raw_data_errors():
    from transformer_engine.pytorch.tensor.utils import replace_raw_data

    tensor, _ = _float8_tensor()
    with pytest.raises(TypeError, match="Tensor has no FP8 raw data"):
        replace_raw_data(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="torch.uint8 tensor, got torch.float32"):
        replace_raw_data(tensor, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"shape \(8,\).*\(2, 4\)"):
        replace_raw_data(tensor, torch.zeros(8, dtype=torch.uint8))


def _storage():
    data = torch.tensor([[56, 64], [72, 184]], dtype=torch.uint8)
    return te.Float8TensorStorage(
        data=data, fp8_scale_inv=torch.tensor([0.5]), fp8_dtype=DType.kFloat8E4M3
    ), data


def test_prepare_for_saving_and_restore_from_saved():
    storage, data = _storage()
    plain = torch.ones(3)
    tensors, objects = te.prepare_for_saving(plain, storage, None)
    assert tensors[0] is plain and tensors[1] is data and tensors[4] is None
    assert objects == [None, storage, None]
    assert storage._data is None  # handed out, not kept twice
    extra = torch.zeros(1)
    restored = te.restore_from_saved(objects, tensors)
    assert restored[0] is plain and restored[1] is storage and restored[2] is None
    assert storage._data is data
    restored, left = te.restore_from_saved(objects, [*tensors, extra], return_saved_tensors=True)
    assert left == [extra]
    assert "return_saved_tensors" in inspect.signature(te.restore_from_saved).parameters


class _SavesStorage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, storage):
        tensors, ctx.tensor_objects = te.prepare_for_saving(x, storage)
        ctx.save_for_backward(*tensors)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        x, storage = te.restore_from_func_ctx(ctx)
        assert ctx.tensor_objects is None
        return grad * storage.dequantize() + 0 * x, None


def test_restore_from_func_ctx_in_an_autograd_function():
    storage, _ = _storage()
    x = torch.ones(2, 2, requires_grad=True)
    _SavesStorage.apply(x, storage).sum().backward()
    # E4M3 bytes 56, 64, 72, 184 are 1.0, 2.0, 4.0, -1.0; times scale_inv 0.5.
    assert torch.equal(x.grad, torch.tensor([[0.5, 1.0], [2.0, -0.5]]))


def test_restore_from_func_ctx_without_objects_raises():
    class Ctx:
        saved_tensors = ()

    with pytest.raises(AttributeError, match="tensor_objects"):
        te.restore_from_func_ctx(Ctx())


# ------------------------------------------------------------------ _extra_state policy


@pytest.fixture
def no_opt_in(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def test_policy_names_and_values():
    from transformer_engine.pytorch import _extra_state as es

    assert es.UNSAFE_PICKLE_EXTRA_STATE_ENV == ENV
    assert {m.name: m.value for m in es.CheckpointExtraStatePolicy} == {
        "STATELESS": "stateless",
        "STATEFUL_FP8_DELAYED_SCALING": "stateful_fp8_delayed_scaling",
        "DYNAMIC": "dynamic",
    }
    module = "transformer_engine.common.recipe"
    policy = es.CheckpointExtraStatePolicy
    assert es._RECIPE_POLICIES == {
        (module, "DelayedScaling"): policy.STATEFUL_FP8_DELAYED_SCALING,
        (module, "Float8CurrentScaling"): policy.STATELESS,
        (module, "MXFP8BlockScaling"): policy.STATELESS,
        (module, "Float8BlockScaling"): policy.STATELESS,
        (module, "NVFP4BlockScaling"): policy.STATELESS,
        (module, "CustomRecipe"): policy.DYNAMIC,
    }
    subclasses = [
        name
        for name, obj in vars(recipe_module).items()
        if inspect.isclass(obj) and issubclass(obj, recipe_module.Recipe)
        if obj is not recipe_module.Recipe
    ]
    assert subclasses and all((module, name) in es._RECIPE_POLICIES for name in subclasses)


def test_recipe_policy_is_by_exact_class():
    from transformer_engine.pytorch import _extra_state as es

    policy = es.CheckpointExtraStatePolicy
    assert es.recipe_extra_state_policy(DelayedScaling()) is policy.STATEFUL_FP8_DELAYED_SCALING
    assert es.recipe_extra_state_policy(Float8CurrentScaling()) is policy.STATELESS
    assert es.is_stateless_recipe(Float8CurrentScaling())
    assert not es.is_stateless_recipe(DelayedScaling())

    class MyCurrent(Float8CurrentScaling):  # e.g. a user's recipe with state of its own
        pass

    assert es.recipe_extra_state_policy(MyCurrent()) is None
    assert not es.is_stateless_recipe(MyCurrent())


IGNORED = {
    "empty": b"",
    "empty dict": pickle.dumps({}),
    "plain values": pickle.dumps({"extra_fp8_variables": {"fp8_checkpoint": True}}),
    "current scaling": pickle.dumps({"recipe": Float8CurrentScaling(), "extra_fp8_variables": {}}),
}
NEEDS_UNSAFE = {
    "delayed scaling": pickle.dumps({"recipe": DelayedScaling()}),
    "te1x": pickle.dumps({"scale_fwd": torch.ones(1), "amax_history_fwd": torch.ones(1, 1)}),
    "delayed keys under a stateless recipe": pickle.dumps(
        {"recipe": Float8CurrentScaling(), "scale_fwd": [1.0]}
    ),
    "delayed keys without globals": pickle.dumps({"scale_fwd": [1.0]}),
    "unknown global": pickle.dumps({"recipe": object()}),
    "not a pickle": b"not a pickle",
}


@pytest.mark.parametrize("data", IGNORED.values(), ids=IGNORED.keys())
def test_payloads_with_nothing_to_restore_are_skipped(no_opt_in, data):
    from transformer_engine.pytorch._extra_state import should_load_extra_state_pickle

    assert should_load_extra_state_pickle(data, "Linear") is False


@pytest.mark.parametrize("data", NEEDS_UNSAFE.values(), ids=NEEDS_UNSAFE.keys())
def test_payloads_with_state_need_the_opt_in(monkeypatch, no_opt_in, data):
    from transformer_engine.pytorch._extra_state import should_load_extra_state_pickle

    with pytest.raises(RuntimeError, match=f"LayerNormMLP: .*{ENV}=1"):
        should_load_extra_state_pickle(data, "LayerNormMLP")
    monkeypatch.setenv(ENV, "true")  # only "1" opts in
    with pytest.raises(RuntimeError, match=ENV):
        should_load_extra_state_pickle(data, "LayerNormMLP")
    monkeypatch.setenv(ENV, "1")
    assert should_load_extra_state_pickle(data, "LayerNormMLP") is True


def test_the_reader_skips_stateless_payloads_without_the_opt_in(no_opt_in):
    from transformer_engine.pytorch.extra_state import unpack_extra_state

    data = IGNORED["current scaling"]
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert unpack_extra_state(payload, device="cpu") is None
    module = te.Linear(16, 16, device="cpu")
    module.set_extra_state(payload)  # an older upstream checkpoint of a current-scaling model
    with pytest.raises(RuntimeError, match=ENV):
        payload = torch.frombuffer(bytearray(NEEDS_UNSAFE["delayed scaling"]), dtype=torch.uint8)
        unpack_extra_state(payload, device="cpu")


# ------------------------------------------------------------------ on a GPU

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; runs on the GPU machine through qa/L0_pytorch_gpu/test.sh",
)


@needs_cuda
def test_probes_answer_for_the_current_gpu():
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    assert te.get_device_compute_capability() == (major, minor)
    assert te.is_bf16_available() is (major >= 8)
    non_tn = (10, 0) <= (major, minor) < (12, 0) or (major, minor) >= (13, 0)
    assert te_utils.is_non_tn_fp8_gemm_supported() is non_tn
    raw = torch.backends.cudnn.version()
    if raw is not None:
        major_c = raw // 1000 if raw < 90000 else raw // 10000
        assert te.get_cudnn_version()[0] == major_c


@needs_cuda
def test_replace_raw_data_on_a_gpu():
    from transformer_engine.pytorch.tensor.utils import replace_raw_data

    device = torch.device("cuda", torch.cuda.current_device())
    quantizer = te.Float8Quantizer(
        torch.tensor([2.0], device=device), torch.zeros(1, device=device), DType.kFloat8E4M3
    )
    values = torch.tensor([[0.5, 1.0, -2.0, 0.25], [4.0, -0.5, 0.125, 3.0]], device=device)
    tensor = quantizer(values)
    bucket = torch.zeros(16, dtype=torch.uint8, device=device)
    replace_raw_data(tensor, bucket[8:].view(2, 4))
    assert torch.equal(tensor.dequantize(), values)
    with pytest.raises(ValueError, match="cpu"):  # DevicePlacementError is a ValueError
        replace_raw_data(tensor, torch.zeros(2, 4, dtype=torch.uint8))
