"""te.LayerNorm / te.RMSNorm and the functional norms in functional/normalization.py.

CPU: numerics (forward and backward against float64 PyTorch), zero-centered gamma, the
constructor's aliases and deprecations, deferred (meta) initialization and the error messages.
GPU (skipped without CUDA, with a reason): placement off the current device, bitwise equal to
the run with the module's device current.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from utils import current_device_unchanged, materialization_device, needs_cuda, needs_two_gpus

from transformer_engine.pytorch import device as device_seam
from transformer_engine.pytorch.device import DevicePlacementError
from transformer_engine.pytorch.functional.normalization import layernorm, rmsnorm
from transformer_engine.pytorch.module import LayerNorm, RMSNorm

TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-2)}
SHAPES = [(5, 64), (2, 3, 217), (1, 1616)]
MODULES = [LayerNorm, RMSNorm]
MODULE_IDS = ["LayerNorm", "RMSNorm"]


def norm_reference(module, x, dy):
    """Output and gradients of ``module`` on ``x`` (upstream gradient ``dy``), float64 on CPU."""
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = module.weight.detach().cpu().double().requires_grad_()
    gamma = w64 + 1 if module.zero_centered_gamma else w64
    hidden = x.shape[-1]
    if isinstance(module, LayerNorm):
        b64 = module.bias.detach().cpu().double().requires_grad_()
        y = F.layer_norm(x64, (hidden,), gamma, b64, module.eps)
        leaves = (x64, w64, b64)
    else:
        y = F.rms_norm(x64, (hidden,), gamma, module.eps)
        leaves = (x64, w64)
    y.backward(dy.cpu().double())
    return y.detach(), [t.grad for t in leaves]


def assert_grads_close(grads, grads_ref, dtype, rows):
    """Input gradient at the dtype's tolerance; parameter gradients, which sum ``rows`` terms
    per element in float32, with ``atol`` scaled by sqrt(rows) (the growth of rounding error
    in a sum of independently rounded terms)."""
    rtol, atol = TOLERANCES[dtype]
    for i, (name, g, g_ref) in enumerate(zip(("x", "weight", "bias"), grads, grads_ref)):
        tol = atol if i == 0 else atol * rows**0.5
        torch.testing.assert_close(g.double().cpu(), g_ref, rtol=rtol, atol=tol, msg=name)


def run_module(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    params = [module.weight] + ([module.bias] if isinstance(module, LayerNorm) else [])
    return y, [x.grad] + [p.grad for p in params]


def randomize_parameters(module, generator):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5 + 0.25)


def parameters_of(module):
    return [module.weight] + ([module.bias] if isinstance(module, LayerNorm) else [])


# ---------------------------------------------------------------------------------------------
# numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_against_float64(cls, dtype, zero_centered_gamma, shape):
    gen = torch.Generator().manual_seed(1234)
    module = cls(shape[-1], eps=1e-5, zero_centered_gamma=zero_centered_gamma, device="cpu")
    module = module.to(dtype)
    randomize_parameters(module, gen)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)

    y, grads = run_module(module, x, dy)
    y_ref, grads_ref = norm_reference(module, x, dy)

    rtol, atol = TOLERANCES[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), y_ref, rtol=rtol, atol=atol)
    assert all(g.dtype == dtype for g in grads)
    assert_grads_close(grads, grads_ref, dtype, rows=x.numel() // x.shape[-1])


def test_layernorm_matches_torch_layernorm_module():
    gen = torch.Generator().manual_seed(7)
    te_ln = LayerNorm(96, eps=1e-6, device="cpu")
    torch_ln = torch.nn.LayerNorm(96, eps=1e-6)
    x = torch.randn(8, 96, generator=gen)
    dy = torch.randn(8, 96, generator=gen)
    y_te, g_te = run_module(te_ln, x, dy)
    y_torch, g_torch = run_module(torch_ln, x, dy)
    torch.testing.assert_close(y_te, y_torch, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(g_te, g_torch):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_zero_centered_gamma_is_one_plus_weight(cls):
    """A zero-centered module with weight 0 is the plain module with weight 1, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    plain = cls(32, device="cpu")
    centered = cls(32, zero_centered_gamma=True, device="cpu")
    assert torch.equal(plain.weight, torch.ones(32))
    assert torch.equal(centered.weight, torch.zeros(32))
    x = torch.randn(4, 32, generator=gen)
    dy = torch.randn(4, 32, generator=gen)
    y_plain, g_plain = run_module(plain, x, dy)
    y_centered, g_centered = run_module(centered, x, dy)
    assert torch.equal(y_plain, y_centered)
    for g, g_ref in zip(g_centered, g_plain):
        assert torch.equal(g, g_ref)


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_low_precision_input_with_fp32_parameters(cls):
    """The output takes the input's dtype; each gradient takes its tensor's dtype."""
    gen = torch.Generator().manual_seed(11)
    module = cls(64, device="cpu", dtype=torch.float32)
    randomize_parameters(module, gen)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    dy = torch.randn(6, 64, generator=gen).bfloat16()
    y, grads = run_module(module, x, dy)
    y_ref, grads_ref = norm_reference(module, x, dy)
    assert y.dtype == torch.bfloat16
    assert grads[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads[1:])
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(y.double(), y_ref, rtol=rtol, atol=atol)
    assert_grads_close(grads, grads_ref, torch.bfloat16, rows=6)


def test_functional_float64_stays_float64_and_bias_is_optional():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    w = torch.randn(10, generator=gen, dtype=torch.float64)
    y = layernorm(x, w, None, 1e-5)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.layer_norm(x, (10,), w, None, 1e-5), rtol=1e-12, atol=1e-12)
    y = rmsnorm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (10,), w, 1e-5), rtol=1e-12, atol=1e-12)


def test_functional_all_meta_propagates_shapes():
    x = torch.empty(2, 5, 16, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, device="meta")
    assert layernorm(x, w, torch.empty(16, device="meta"), 1e-5).shape == (2, 5, 16)
    y = rmsnorm(x, w, 1e-5, zero_centered_gamma=True)
    assert y.is_meta and y.shape == (2, 5, 16) and y.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# constructor: shapes, dtypes, attributes, deprecated aliases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("normalized_shape", [12, (12,), [12], torch.Size([12])], ids=repr)
def test_normalized_shape_forms(cls, normalized_shape):
    module = cls(normalized_shape, device="cpu")
    assert module.normalized_shape == (12,)
    for p in parameters_of(module):
        assert p.shape == (12,)


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_initial_values_and_dtypes(cls):
    module = cls(8, device="cpu")
    assert module.weight.dtype == torch.get_default_dtype()
    assert torch.equal(module.weight, torch.ones(8))
    if cls is LayerNorm:
        assert torch.equal(module.bias, torch.zeros(8))
    module = cls(8, device="cpu", dtype=torch.bfloat16, zero_centered_gamma=True)
    for p in parameters_of(module):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, torch.zeros(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_sequence_parallel_attribute(cls, sequence_parallel):
    module = cls(8, sequence_parallel=sequence_parallel, device="cpu")
    assert module.sequence_parallel is sequence_parallel
    for p in parameters_of(module):
        assert p.sequence_parallel is sequence_parallel
    # The attribute survives a move, and a deferred initialization through to_empty, which
    # replaces the Parameter objects.
    module = module.to(torch.bfloat16)
    for p in parameters_of(module):
        assert p.sequence_parallel is sequence_parallel
    module = cls(8, sequence_parallel=sequence_parallel, device="meta")
    module.to_empty(device="cpu")
    module.reset_parameters()
    for p in parameters_of(module):
        assert p.sequence_parallel is sequence_parallel


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_sequence_parallel_none_sets_nothing(cls):
    module = cls(8, device="cpu")
    for p in parameters_of(module):
        assert not hasattr(p, "sequence_parallel")
    with pytest.raises(TypeError, match="sequence_parallel must be a bool, got 'yes'"):
        cls(8, sequence_parallel="yes", device="cpu")


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_deprecated_hidden_size_and_params_dtype(cls):
    with pytest.warns(DeprecationWarning, match="hidden_size is deprecated"):
        module = cls(hidden_size=16, device="cpu")
    assert module.normalized_shape == (16,)
    with pytest.warns(DeprecationWarning, match="params_dtype is deprecated"):
        module = cls(16, params_dtype=torch.bfloat16, device="cpu")
    assert module.weight.dtype == torch.bfloat16
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="pass normalized_shape"):
        cls(16, hidden_size=16, device="cpu")
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="pass dtype only"):
        cls(16, params_dtype=torch.float32, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_deprecated_reset_aliases_and_defer_init(cls):
    module = cls(8, device="cpu")
    alias = "reset_layer_norm_parameters" if cls is LayerNorm else "reset_rms_norm_parameters"
    with torch.no_grad():
        module.weight.fill_(5.0)
    with pytest.warns(DeprecationWarning, match=f"{alias} is deprecated"):
        getattr(module, alias)()
    assert torch.equal(module.weight, torch.ones(8))

    with torch.no_grad():
        module.weight.fill_(5.0)
    with pytest.warns(DeprecationWarning, match="defer_init is deprecated.*device='meta'"):
        module.reset_parameters(defer_init=True)
    assert torch.equal(module.weight, torch.full((8,), 5.0))  # deferred: nothing done
    with pytest.warns(DeprecationWarning, match="defer_init is deprecated"):
        module.reset_parameters(defer_init=False)
    assert torch.equal(module.weight, torch.ones(8))


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("name", ["fwd_ln_sm_margin", "bwd_ln_sm_margin", "inf_ln_sm_margin"])
def test_deprecated_sm_margin_properties(cls, name):
    module = cls(8, device="cpu", sm_margin=6)
    assert module.sm_margin == 6
    with pytest.warns(DeprecationWarning, match=f"{name} is deprecated; use sm_margin"):
        assert getattr(module, name) == 6


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_no_warning_on_the_plain_path(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = cls(8, eps=1e-6, device="cpu")
        module.reset_parameters()
        module(torch.randn(2, 8)).sum().backward()


# ---------------------------------------------------------------------------------------------
# device rules and deferred initialization
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_default_device(cls):
    module = cls(8)
    for p in parameters_of(module):
        assert p.device == materialization_device()


def test_device_rules_with_faked_cuda(monkeypatch):
    """None and an index-less "cuda" resolve to the current CUDA device, at construction."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    resolve = device_seam.construction_device
    assert resolve("LayerNorm", None) == torch.device("cuda", 3)
    assert resolve("LayerNorm", "cuda") == torch.device("cuda", 3)
    assert resolve("LayerNorm", torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve("LayerNorm", "cuda:1") == torch.device("cuda", 1)
    assert resolve("LayerNorm", "cpu") == torch.device("cpu")
    meta_weight = torch.empty(4, device="meta")
    materialize = device_seam.materialization_device
    assert materialize(device_seam.first_storage_device(meta_weight)) == torch.device("cuda", 3)
    cpu_bias = torch.empty(4)
    assert materialize(device_seam.first_storage_device(meta_weight, cpu_bias)) == torch.device(
        "cpu"
    )


def test_index_less_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DevicePlacementError, match="device='cuda' was requested but CUDA is not"):
        LayerNorm(8, device="cuda")


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc_gamma"])
def test_meta_then_reset_parameters(cls, zero_centered_gamma):
    module = cls(16, device="meta", dtype=torch.bfloat16, zero_centered_gamma=zero_centered_gamma)
    for p in parameters_of(module):
        assert p.is_meta and p.dtype == torch.bfloat16
    module.reset_parameters()
    device = materialization_device()
    assert not any(p.is_meta for p in module.parameters())
    for p in parameters_of(module):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert p.device == device and p.dtype == torch.bfloat16
    init = 0.0 if zero_centered_gamma else 1.0
    assert torch.equal(module.weight, torch.full_like(module.weight, init))
    if cls is LayerNorm:
        assert torch.equal(module.bias, torch.zeros_like(module.bias))

    x = torch.randn(3, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.device == device and x.grad.device == device
    for p in parameters_of(module):
        assert p.grad is not None and p.grad.device == device


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_meta_then_to_empty_keeps_device_and_initializes(cls):
    module = cls(16, device="meta")
    module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))  # to_empty leaves garbage; reset must overwrite it
    module.reset_parameters()
    for p in parameters_of(module):
        assert p.device == torch.device("cpu")
    assert torch.equal(module.weight, torch.ones(16))
    if cls is LayerNorm:
        assert torch.equal(module.bias, torch.zeros(16))
    x = torch.randn(2, 16, requires_grad=True)
    module(x).sum().backward()
    assert x.grad.device == torch.device("cpu")
    assert all(p.grad.device == torch.device("cpu") for p in module.parameters())


def test_reset_keeps_frozen_parameters_frozen():
    module = LayerNorm(8, device="meta")
    module.bias.requires_grad_(False)
    module.reset_parameters()
    assert module.weight.requires_grad and not module.bias.requires_grad


def test_reset_materializes_next_to_materialized_parameters():
    """A partly materialized module completes on the device its parameters already use."""
    module = LayerNorm(8, device="meta")
    module.bias = torch.nn.Parameter(torch.empty(8, device="cpu"))
    module.reset_parameters()
    assert module.weight.device == torch.device("cpu")


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize(
    "normalized_shape", [(4, 6), [2, 3, 5], torch.Size([7])], ids=["2d", "3d", "size"]
)
def test_multi_dim_normalized_shape_against_float64(cls, zero_centered_gamma, normalized_shape):
    """The trailing dimensions are normalized together, with parameters of their shape:
    torch.nn.functional.layer_norm / rms_norm with the same normalized_shape, in float64."""
    gen = torch.Generator().manual_seed(77)
    shape = tuple(normalized_shape)
    module = cls(normalized_shape, eps=1e-5, zero_centered_gamma=zero_centered_gamma, device="cpu")
    assert module.normalized_shape == shape
    assert all(p.shape == shape for p in parameters_of(module))
    module = module.double()
    randomize_parameters(module, gen)
    x = torch.randn((3, 2, *shape), generator=gen, dtype=torch.float64) * 3 + 1
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y, grads = run_module(module, x, dy)

    x64 = x.clone().requires_grad_()
    leaves = [p.detach().clone().requires_grad_() for p in parameters_of(module)]
    gamma = leaves[0] + 1 if zero_centered_gamma else leaves[0]
    if cls is LayerNorm:
        y_ref = F.layer_norm(x64, shape, gamma, leaves[1], 1e-5)
    else:
        y_ref = F.rms_norm(x64, shape, gamma, 1e-5)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for g, ref in zip(grads, [x64.grad] + [t.grad for t in leaves]):
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# checkpoints (upstream's layout: tests/pytorch/test_upstream_checkpoints.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_state_dict_round_trip_through_weights_only_load(cls, tmp_path):
    """Saved and loaded back with torch.load(weights_only=True) into a meta-built module."""
    source = cls(8, device="cpu")
    with torch.no_grad():
        for p in source.parameters():
            p.uniform_()
    torch.save(source.state_dict(), tmp_path / "norm.pt")
    state = torch.load(tmp_path / "norm.pt", weights_only=True)
    target = cls(8, device="meta")
    target.to_empty(device="cpu")
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(3, 8)
    assert torch.equal(target(x), source(x))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_wrong_feature_size(cls):
    module = cls(8, device="cpu")
    with pytest.raises(ValueError, match="last dimension of x has size 6 but weight has size 8"):
        module(torch.randn(4, 6))


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_meta_module_used_before_materialization(cls):
    module = cls(8, device="meta")
    with pytest.raises(ValueError, match=r"call reset_parameters\(\).*module\.to_empty\(device="):
        module(torch.randn(2, 8))


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_meta_input_for_a_cpu_module(cls):
    module = cls(8, device="cpu")
    with pytest.raises(ValueError, match="input is a meta tensor.*parameters are on cpu"):
        module(torch.empty(2, 8, device="meta"))


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_multi_dim_normalized_shape_errors(cls):
    module = cls((4, 8), device="cpu")
    with pytest.raises(ValueError, match=re.escape("x has shape (3, 8, 4), whose trailing")):
        module(torch.randn(3, 8, 4))
    with pytest.raises(ValueError, match=re.escape("x has shape (8,), whose trailing")):
        module(torch.randn(8))
    with pytest.raises(ValueError, match=re.escape("normalized_shape=() names no dimension")):
        cls((), device="cpu")
    with pytest.raises(ValueError, match="normalized_shape must be positive, got 0"):
        cls((4, 0), device="cpu")


@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_bad_constructor_arguments(cls):
    with pytest.raises(TypeError, match="normalized_shape is required"):
        cls(device="cpu")
    with pytest.raises(ValueError, match="normalized_shape must be positive, got 0"):
        cls(0, device="cpu")
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        cls("8", device="cpu")
    with pytest.raises(ValueError, match="eps must be non-negative"):
        cls(8, eps=-1.0, device="cpu")
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        cls(8, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="sm_margin must be non-negative"):
        cls(8, sm_margin=-1, device="cpu")


def test_functional_argument_errors():
    x = torch.randn(2, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="last dimension of x has size 8 but weight has size 4"):
        rmsnorm(x, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match=r"bias has shape \(7,\) but weight has shape \(8,\)"):
        layernorm(x, w, torch.zeros(7), 1e-5)
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        layernorm(torch.ones(2, 8, dtype=torch.int64), w, None, 1e-5)
    with pytest.raises(ValueError, match=re.escape("x has shape (2, 8), whose trailing")):
        rmsnorm(x, torch.ones(1, 8), 1e-5)
    with pytest.raises(ValueError, match="weight must have the normalized shape"):
        rmsnorm(x, torch.tensor(1.0), 1e-5)
    with pytest.raises(ValueError, match="weight is a meta tensor"):
        rmsnorm(x, torch.ones(8, device="meta"), 1e-5)
    with pytest.raises(ValueError, match="x is a meta tensor"):
        layernorm(torch.empty(2, 8, device="meta"), w, torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        layernorm(x, w, None, float("nan"))


# ---------------------------------------------------------------------------------------------
# GPU: placement off the current device
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_numerics(cls, dtype):
    gen = torch.Generator().manual_seed(21)
    module = cls(1024, device="cpu", zero_centered_gamma=True)
    randomize_parameters(module, gen)
    module = module.to(device="cuda", dtype=dtype)
    x = torch.randn(33, 1024, generator=gen).to(dtype)
    dy = torch.randn(33, 1024, generator=gen).to(dtype)
    y_ref, grads_ref = norm_reference(module, x, dy)
    with current_device_unchanged():
        y, grads = run_module(module, x.cuda(), dy.cuda())
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double().cpu(), y_ref, rtol=rtol, atol=atol)
    assert_grads_close(grads, grads_ref, dtype, rows=33)


@needs_cuda
@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_gpu_default_device_and_meta_reset_use_the_current_device(cls):
    current = torch.device("cuda", torch.cuda.current_device())
    assert cls(8).weight.device == current
    assert cls(8, device="cuda").weight.device == current
    module = cls(8, device="meta")
    module.reset_parameters()
    assert all(p.device == current for p in module.parameters())


@needs_cuda
@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_gpu_input_on_another_device_is_refused(cls):
    module = cls(8, device="cuda:0")
    with current_device_unchanged():
        with pytest.raises(ValueError, match="input is on cpu but the parameters are on cuda:0"):
            module(torch.randn(2, 8))


@needs_cuda
@needs_two_gpus
@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_module_on_cuda1_while_cuda0_is_current(cls, dtype):
    dev1 = torch.device("cuda", 1)
    gen = torch.Generator().manual_seed(99)
    module = cls(4096, device="cpu", zero_centered_gamma=True)
    randomize_parameters(module, gen)
    module = module.to(device=dev1, dtype=dtype)
    x = torch.randn(64, 4096, generator=gen).to(device=dev1, dtype=dtype)
    dy = torch.randn(64, 4096, generator=gen).to(device=dev1, dtype=dtype)

    def step(current_index):
        module.zero_grad(set_to_none=True)
        with torch.cuda.device(current_index):
            with current_device_unchanged():
                y, grads = run_module(module, x, dy)
            assert torch.cuda.current_device() == current_index
        torch.cuda.synchronize(dev1)
        return y, grads

    with torch.cuda.device(0):
        y_off, grads_off = step(0)
        assert torch.cuda.current_device() == 0
    assert y_off.device == dev1
    assert all(g.device == dev1 for g in grads_off)

    y_on, grads_on = step(1)
    assert torch.equal(y_off, y_on)
    for g_off, g_on in zip(grads_off, grads_on):
        assert torch.equal(g_off, g_on)

    # And the values are right, not merely identical.
    y_ref, grads_ref = norm_reference(module, x.cpu(), dy.cpu())
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(y_off.double().cpu(), y_ref, rtol=rtol, atol=atol)
    assert_grads_close(grads_off, grads_ref, dtype, rows=64)


@needs_cuda
@needs_two_gpus
@pytest.mark.parametrize("cls", MODULES, ids=MODULE_IDS)
def test_gpu_cuda_without_index_is_pinned_at_construction(cls):
    with torch.cuda.device(1):
        module = cls(8, device="cuda")
        meta_module = cls(8, device="meta")
        meta_module.reset_parameters()
    assert torch.cuda.current_device() == 0
    assert module.weight.device == torch.device("cuda", 1)
    assert all(p.device == torch.device("cuda", 1) for p in meta_module.parameters())
    with current_device_unchanged():
        y = module(torch.randn(2, 8, device="cuda:1"))
    assert y.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="input is on cuda:0 but the parameters are on cuda:1"):
        module(torch.randn(2, 8, device="cuda:0"))
