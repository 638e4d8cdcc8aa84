"""Upstream Transformer Engine's pickle-based extra state read by ``unpack_extra_state``: the
unsafe-pickle opt-in (``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``), what is refused without it and
never run, and what loads with it (uint8 pickle bytes, ``io.BytesIO`` archives, TE 1.x dicts).
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, MMParams
from transformer_engine.pytorch.extra_state import unpack_extra_state, upstream_pickle

ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch):
    """Every test starts without the unsafe-pickle opt-in."""
    monkeypatch.delenv(ENV, raising=False)


def _state_tensors(n_fwd=3, n_bwd=2, length=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "scale_fwd": torch.rand(n_fwd, generator=gen) * 100,
        "amax_history_fwd": torch.rand(length, n_fwd, generator=gen),
        "scale_bwd": torch.rand(n_bwd, generator=gen) * 1e4,
        "amax_history_bwd": torch.rand(length, n_bwd, generator=gen),
    }


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _as_uint8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _upstream_state(recipe=None, te1x=False):
    tensors = _state_tensors(length=5)
    state = dict(tensors)
    if te1x:
        state["scale_inv_fwd"] = 1.0 / tensors["scale_fwd"]
        state["scale_inv_bwd"] = 1.0 / tensors["scale_bwd"]
    else:
        state["recipe"] = (
            recipe if recipe is not None else DelayedScaling(margin=1, amax_history_len=5)
        )
    state["extra_fp8_variables"] = {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0}
    return state, tensors


def _torch_saved(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer


def test_unsafe_pickle_env_is_read_at_call_time(monkeypatch):
    assert not upstream_pickle._unsafe_pickle_allowed()
    monkeypatch.setenv(ENV, "1")
    assert upstream_pickle._unsafe_pickle_allowed()
    for value in ("0", "true", "yes", ""):
        monkeypatch.setenv(ENV, value)
        assert not upstream_pickle._unsafe_pickle_allowed()


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("te1x", [False, True], ids=["current", "te1x"])
def test_pickled_tensor_is_refused_without_opt_in(protocol, te1x):
    state, _ = _upstream_state(te1x=te1x)
    payload = _as_uint8(pickle.dumps(state, protocol=protocol))
    with pytest.raises(RuntimeError) as info:
        unpack_extra_state(payload, device="cpu")
    message = str(info.value)
    assert f"{ENV}=1" in message
    assert "arbitrary code" in message
    assert "weights_only=True" in message and "save the model again" in message
    assert "torch._utils._rebuild_tensor_v2" in message
    if not te1x:
        assert "transformer_engine.common.recipe.DelayedScaling" in message


@pytest.mark.parametrize("te1x", [False, True], ids=["current", "te1x"])
def test_bytesio_is_refused_without_opt_in(te1x):
    state, _ = _upstream_state(te1x=te1x)
    buffer = _torch_saved(state)
    with pytest.raises(RuntimeError, match=f"io.BytesIO.*{ENV}=1"):
        unpack_extra_state(buffer, device="cpu")
    with pytest.raises(RuntimeError, match="cannot be inspected"):
        unpack_extra_state(io.BytesIO(b"not a zip archive"), device="cpu")


@pytest.mark.parametrize("env_value", ["0", "true", "yes"])
def test_only_the_value_1_opts_in(monkeypatch, env_value):
    monkeypatch.setenv(ENV, env_value)
    state, _ = _upstream_state()
    with pytest.raises(RuntimeError, match=ENV):
        unpack_extra_state(_as_uint8(pickle.dumps(state)), device="cpu")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_tensor_loads_with_opt_in(monkeypatch, device, protocol):
    monkeypatch.setenv(ENV, "1")
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5, reduce_amax=False)
    state, tensors = _upstream_state(recipe)
    recipe_out, tensors_out, extra = unpack_extra_state(
        _as_uint8(pickle.dumps(state, protocol=protocol)), device=device
    )
    assert recipe_out == recipe
    assert extra == state["extra_fp8_variables"]
    assert set(tensors_out) == set(tensors)
    for name, tensor in tensors_out.items():
        assert tensor.device == torch.device(device)
        if device == "cpu":
            assert _bitwise_equal(tensor, tensors[name])


def test_pickled_current_scaling_recipe_loads_with_opt_in(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    recipe = Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), backward_override="dequantized")
    payload = _as_uint8(pickle.dumps({"recipe": recipe, "extra_fp8_variables": {}}))
    result = unpack_extra_state(payload, device="cpu")
    assert result.recipe == recipe and result.tensors == {} and result.extra == {}


@pytest.mark.parametrize("as_bytesio", [False, True], ids=["uint8", "bytesio"])
def test_te1x_layout_loads_with_opt_in(monkeypatch, as_bytesio):
    monkeypatch.setenv(ENV, "1")
    state, tensors = _upstream_state(te1x=True)
    payload = _torch_saved(state) if as_bytesio else _as_uint8(pickle.dumps(state))
    recipe, tensors_out, extra = unpack_extra_state(payload, device="meta")
    assert recipe == DelayedScaling()
    assert set(tensors_out) == set(tensors)  # scale_inv_* dropped
    assert all(t.is_meta for t in tensors_out.values())
    assert extra == state["extra_fp8_variables"]
    recipe, tensors_out, _ = unpack_extra_state(payload, device="cpu")
    for name, tensor in tensors.items():
        assert _bitwise_equal(tensors_out[name], tensor)


def test_bytesio_with_recipe_loads_with_opt_in_and_keeps_its_position(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    state, tensors = _upstream_state()
    buffer = _torch_saved(state)
    buffer.seek(3)
    recipe, tensors_out, _ = unpack_extra_state(buffer, device="cpu")
    assert recipe == state["recipe"]
    assert buffer.tell() == 3
    for name, tensor in tensors.items():
        assert _bitwise_equal(tensors_out[name], tensor)


def test_upstream_format_value_tuple_name_is_understood(monkeypatch):
    # Upstream's Format members hold a named tuple called _FormatHelper; ours is _FormatMaxima.
    # Same length, so the pickle stays well formed after the swap.
    monkeypatch.setenv(ENV, "1")
    state, _ = _upstream_state(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=5))
    data = pickle.dumps(state)
    assert b"_FormatMaxima" in data
    data = data.replace(b"_FormatMaxima", b"_FormatHelper")
    assert unpack_extra_state(_as_uint8(data), device="cpu").recipe.fp8_format is Format.E4M3


def test_unpickled_recipe_is_rebuilt_and_validated(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    recipe = DelayedScaling(amax_history_len=5)
    object.__setattr__(recipe, "_repr_cache", "stale")  # e.g. an upstream cached repr
    state, _ = _upstream_state(recipe)
    result = unpack_extra_state(_as_uint8(pickle.dumps(state)), device="cpu")
    assert result.recipe == recipe and "_repr_cache" not in vars(result.recipe)

    broken = DelayedScaling()
    object.__setattr__(broken, "margin", -1)  # unpickling skips __post_init__
    state, _ = _upstream_state(broken)
    with pytest.raises(ValueError, match="recipe is invalid.*margin"):
        unpack_extra_state(_as_uint8(pickle.dumps(state)), device="cpu")


def test_upstream_payload_with_unknown_entries_warns(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    state, _ = _upstream_state()
    state["global_fp8_buffer"] = {}
    with pytest.warns(UserWarning, match="global_fp8_buffer.*ignored"):
        unpack_extra_state(_as_uint8(pickle.dumps(state)), device="cpu")


@pytest.mark.parametrize(
    "obj, match",
    [
        ([DelayedScaling()], "unpickled to a list"),
        ({"forward": [DelayedScaling()], "backward": None}, "'forward' is a list"),
        ({"forward": {"recipe": DelayedScaling()}, "stage": 1}, "besides 'forward'"),
        ({"recipe": Format.E4M3}, "recipe is a .*Format"),
        ({"recipe": DelayedScaling(), "scale_fwd": torch.ones(2)}, "only one of 'scale_fwd'"),
        ({"recipe": DelayedScaling(), "extra_fp8_variables": [1]}, "must be a dict"),
        ({"recipe": DelayedScaling(), "extra_fp8_variables": {"g": Format.E4M3}}, r"\['g'\]"),
    ],
)
def test_opted_in_payloads_that_are_not_module_state_raise(monkeypatch, obj, match):
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(ValueError, match=match):
        unpack_extra_state(_as_uint8(pickle.dumps(obj)), device="cpu")


# A payload that runs code when unpickled: its __reduce__ names a function to call.
CALLS: list[str] = []


def record_call(tag):
    CALLS.append(tag)
    return tag


class _Exploit:
    def __reduce__(self):
        return (record_call, ("unpickled",))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_code_executing_payload_is_refused_and_never_run(protocol):
    CALLS.clear()
    data = pickle.dumps({"recipe": DelayedScaling(), "scale_fwd": _Exploit()}, protocol=protocol)
    with pytest.raises(RuntimeError, match=ENV) as info:
        unpack_extra_state(_as_uint8(data), device="cpu")
    assert "record_call" in str(info.value)
    with pytest.raises(RuntimeError, match=ENV):
        unpack_extra_state(_torch_saved({"scale_fwd": _Exploit()}), device="cpu")
    assert CALLS == []


def test_code_executing_payload_does_run_once_opted_in(monkeypatch):
    # Why the opt-in matters: with it, the payload's code runs.
    monkeypatch.setenv(ENV, "1")
    CALLS.clear()
    data = pickle.dumps({"recipe": DelayedScaling(), "extra_fp8_variables": _Exploit()})
    with pytest.raises(ValueError, match="must be a dict"):
        unpack_extra_state(_as_uint8(data), device="cpu")
    assert CALLS == ["unpickled"]


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_payload_without_globals_reads_as_no_state_without_opt_in(protocol):
    data = pickle.dumps({"extra_fp8_variables": {"fp8_checkpoint": False}, "n": [1, 2.0]}, protocol)
    assert upstream_pickle._referenced_globals(data) == []
    assert unpack_extra_state(_as_uint8(data), device="cpu") is None


def test_payload_without_globals_that_is_not_a_dict_raises():
    with pytest.raises(ValueError, match="holds a list"):
        unpack_extra_state(_as_uint8(pickle.dumps([1, 2])), device="cpu")


@pytest.mark.parametrize("data", [b"\x00\x01garbage", pickle.dumps({"a": 1})[:-3], b"(lp0\n"])
def test_malformed_pickle_raises_value_error(data):
    with pytest.raises(ValueError, match="pickle"):
        unpack_extra_state(_as_uint8(data), device="cpu")


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_referenced_globals_are_found_without_unpickling(protocol):
    CALLS.clear()
    data = pickle.dumps(
        {"recipe": DelayedScaling(), "t": torch.ones(2), "x": _Exploit()}, protocol=protocol
    )
    found = set(upstream_pickle._referenced_globals(data))
    assert "transformer_engine.common.recipe.DelayedScaling" in found
    assert "transformer_engine.common.recipe.Format" in found
    assert "torch._utils._rebuild_tensor_v2" in found
    assert any(name.endswith(".record_call") for name in found)
    assert CALLS == []
