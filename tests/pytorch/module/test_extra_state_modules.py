"""Checkpoints of whole modules and operations through the extra-state format (version 2):
``state_dict`` / ``load_state_dict`` directly, through ``torch.save`` / ``torch.load(
weights_only=True)``, and through ``safetensors.torch.save_file`` / ``load_file``, under
delayed scaling, current scaling and BF16 (no FP8).

The oracle is a module that never saved: the source keeps training one more step next to the
restored copy, and the two must produce the same outputs, gradients, scales and amax histories
bit for bit (so the restored histories drive the next scale update exactly as the originals).
Also: version 1 dicts load into modules, malformed bytes leave a module unchanged, and state of
another GEMM count is refused. GPU tests (cross-device loads) skip on CPU.
"""

from __future__ import annotations

import io

import pytest
import torch
from extra_state_oracle import FORMAT_NAME, bitwise_equal
from utils import needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.extra_state import recipe_to_dict
from transformer_engine.pytorch.ops import BasicOperation

H, F, TOKENS = 32, 64, 32

RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling,
    "bf16": lambda: None,
}

# name -> (constructor taking device, forward taking (module, x))
MODELS = {
    "Linear": (lambda d: te.Linear(H, H, device=d), lambda m, x: m(x)),
    "LayerNormLinear": (lambda d: te.LayerNormLinear(H, H, device=d), lambda m, x: m(x)),
    "LayerNormMLP": (lambda d: te.LayerNormMLP(H, F, device=d), lambda m, x: m(x)),
    "GroupedLinear": (
        lambda d: te.GroupedLinear(2, H, H, device=d),
        lambda m, x: m(x, [TOKENS // 2, TOKENS // 2]),
    ),
    "LayerNorm": (lambda d: te.LayerNorm(H, device=d), lambda m, x: m(x)),
    "RMSNorm": (lambda d: te.RMSNorm(H, device=d), lambda m, x: m(x)),
    "ops.Sequential": (
        lambda d: te.ops.Sequential(
            te.ops.Linear(H, F, device=d), te.ops.GELU(), te.ops.Linear(F, H, device=d)
        ),
        lambda m, x: m(x),
    ),
}


def _step(model, forward, x, recipe):
    """One forward and backward under ``recipe``; returns the output and the input gradient."""
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = forward(model, x)
    y.backward(torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape).to(y.device))
    return y.detach(), x.grad


def fp8_state(model) -> dict[str, torch.Tensor]:
    """Every delayed-scaling scale and amax history of ``model`` and its children, copied."""
    found = {}
    for name, sub in model.named_modules():
        states = []
        if isinstance(getattr(sub, "fp8_meta", None), dict):
            states = [(key, sub.fp8_meta.get(key)) for key in ("scaling_fwd", "scaling_bwd")]
        elif isinstance(sub, BasicOperation):
            states = [(mode, sub.recipe_state(mode)) for mode in ("forward", "backward")]
        for key, state in states:
            if hasattr(state, "amax_history"):
                found[f"{name}.{key}.scale"] = state.scale.detach().cpu().clone()
                found[f"{name}.{key}.amax_history"] = state.amax_history.detach().cpu().clone()
    return found


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert bitwise_equal(a[key], b[key]), key


def _transport(state: dict, how: str, tmp_path) -> dict:
    if how == "state_dict":
        return state
    if how == "torch_save":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)
    try:
        from safetensors.torch import load_file, save_file
    except ImportError as err:
        pytest.skip(f"needs safetensors (installed with transformers): {err}")
    # save_file needs contiguous tensors that share no memory; state-dict tensors are.
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    return load_file(tmp_path / "model.safetensors")


def _trained(name, recipe_name, device="cpu", steps=2, seed=0):
    make, forward = MODELS[name]
    torch.manual_seed(seed)
    model = make(device)
    recipe = RECIPES[recipe_name]()
    for step in range(steps):
        x = torch.randn(TOKENS, H, device=device) * (1.0 + step)
        _step(model, forward, x, recipe)
    return model, forward, recipe


@pytest.mark.parametrize("how", ["state_dict", "torch_save", "safetensors"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_then_the_next_step_matches_a_module_that_never_saved(
    tmp_path, name, recipe_name, how
):
    src, forward, recipe = _trained(name, recipe_name)
    state = src.state_dict()
    extras = {k: v for k, v in state.items() if k.endswith("_extra_state")}
    assert extras and all(v.dtype == torch.uint8 and v.dim() == 1 for v in extras.values())
    has_delayed = bool(fp8_state(src))
    assert has_delayed == (recipe_name == "delayed" and name not in ("LayerNorm", "RMSNorm"))
    assert any(v.numel() for v in extras.values()) == has_delayed

    torch.manual_seed(123)  # other weights, fresh FP8 state: everything must come from the file
    dst = MODELS[name][0]("cpu")
    result = dst.load_state_dict(_transport(state, how, tmp_path), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in src.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(dst.state_dict()[key], value), key
    _assert_same_state(fp8_state(dst), fp8_state(src))

    src.zero_grad(set_to_none=True)  # compare this step's gradients only
    x = torch.randn(TOKENS, H) * 3.0
    y_src, dx_src = _step(src, forward, x, recipe)
    y_dst, dx_dst = _step(dst, forward, x, recipe)
    assert torch.equal(y_dst, y_src) and torch.equal(dx_dst, dx_src)
    _assert_same_state(fp8_state(dst), fp8_state(src))
    for (key, p_src), p_dst in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(p_dst.grad, p_src.grad), key


def _v1_dict(module) -> dict:
    """The version 1 dict earlier versions of this package wrote for ``module`` (a Linear)."""
    return {
        "format": FORMAT_NAME,
        "version": 1,
        "recipe": recipe_to_dict(module.fp8_meta["recipe"]),
        "tensors": {
            "scale_fwd": module.fp8_meta["scaling_fwd"].scale.clone(),
            "amax_history_fwd": module.fp8_meta["scaling_fwd"].amax_history.clone(),
            "scale_bwd": module.fp8_meta["scaling_bwd"].scale.clone(),
            "amax_history_bwd": module.fp8_meta["scaling_bwd"].amax_history.clone(),
        },
        "extra": {"num_gemms": 1},
    }


def test_v1_dict_checkpoint_loads_into_a_module_and_trains_on_identically():
    src, forward, recipe = _trained("Linear", "delayed")
    state = {"weight": src.weight.detach().clone(), "bias": src.bias.detach().clone(),
             "_extra_state": _v1_dict(src)}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    dst = te.Linear(H, H, device="cpu")
    dst.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same_state(fp8_state(dst), fp8_state(src))
    x = torch.randn(TOKENS, H)
    assert torch.equal(_step(dst, forward, x, recipe)[0], _step(src, forward, x, recipe)[0])
    _assert_same_state(fp8_state(dst), fp8_state(src))
    # Saved again, it is written as version 2.
    assert dst.state_dict()["_extra_state"].dtype == torch.uint8


@pytest.mark.parametrize("cut", [3, 40, -1])
def test_malformed_bytes_leave_the_module_unchanged(cut):
    src, _, _ = _trained("Linear", "delayed", seed=1)
    dst, _, _ = _trained("Linear", "delayed", seed=2)
    before = fp8_state(dst)
    with pytest.raises(ValueError, match="truncated"):
        dst.set_extra_state(src.get_extra_state()[:cut])
    _assert_same_state(fp8_state(dst), before)


def test_grouped_linear_refuses_state_of_another_gemm_count():
    src, _, _ = _trained("GroupedLinear", "delayed")
    dst = te.GroupedLinear(3, H, H, device="cpu")
    with pytest.raises(ValueError, match="saved by a module with 2 GEMM.*this module has 3"):
        dst.set_extra_state(src.get_extra_state())
    assert fp8_state(dst) == {}


def test_linear_state_is_refused_by_a_layernorm_mlp():
    src, _, _ = _trained("Linear", "delayed")
    dst = te.LayerNormMLP(H, F, device="cpu")
    with pytest.raises(ValueError, match="LayerNormMLP.*1 GEMM.*this module has 2"):
        dst.load_state_dict({**dst.state_dict(), "_extra_state": src.get_extra_state()})


# ------------------------------------------------------------------ on a GPU


@needs_cuda
@pytest.mark.parametrize("how", ["torch_save", "safetensors"])
def test_gpu_checkpoint_loads_on_cpu_and_back_on_the_gpu(tmp_path, how):
    src, forward, recipe = _trained("LayerNormMLP", "delayed", device="cuda")
    state = {k: v for k, v in _transport(src.state_dict(), how, tmp_path).items()}
    on_cpu = MODELS["LayerNormMLP"][0]("cpu")
    on_cpu.load_state_dict(state)
    _assert_same_state(fp8_state(on_cpu), fp8_state(src))
    moved = {k: v.to("cuda") for k, v in state.items()}  # e.g. load_file(device="cuda")
    on_gpu = MODELS["LayerNormMLP"][0]("cuda")
    on_gpu.load_state_dict(moved)
    assert on_gpu.fp8_meta["scaling_fwd"].scale.device.type == "cuda"
    x = torch.randn(TOKENS, H, device="cuda")
    assert torch.equal(_step(on_gpu, forward, x, recipe)[0], _step(src, forward, x, recipe)[0])
    _assert_same_state(fp8_state(on_gpu), fp8_state(src))


@needs_two_gpus
def test_state_saved_on_cuda0_lands_on_cuda1_while_cuda0_is_current():
    src, forward, recipe = _trained("ops.Sequential", "delayed", device="cuda:0")
    state = src.state_dict()  # extra state bytes on the CPU, parameters on cuda:0
    with torch.cuda.device(0):
        dst = MODELS["ops.Sequential"][0]("cuda:1")
        dst.load_state_dict(state)
        for op in dst[0].basic_ops:
            fwd = op.recipe_state("forward")
            assert fwd is None or fwd.scale.device == torch.device("cuda", 1)
        _assert_same_state(fp8_state(dst), fp8_state(src))
        x = torch.randn(TOKENS, H)
        y_src = _step(src, forward, x.to("cuda:0"), recipe)[0]
        y_dst = _step(dst, forward, x.to("cuda:1"), recipe)[0]
    assert torch.equal(y_dst.cpu(), y_src.cpu())
    _assert_same_state(fp8_state(dst), fp8_state(src))


def test_an_operation_refuses_state_of_another_quantizer_count_before_changing():
    src, _, _ = _trained("ops.Sequential", "delayed")
    linear = src[0].basic_ops[0]  # BasicLinear: input and weight forward, grad_output backward
    op = te.ops.GroupedLinear(2, H, H, device="cpu")
    before = fp8_state(op)
    with pytest.raises(ValueError, match="checkpoint has 2 forward quantizers but the op"):
        op.set_extra_state(linear.get_extra_state())
    assert fp8_state(op) == before and op.recipe_state("forward") is None
