"""Checkpoint format of module extra state: pack/unpack round trips, weights-only loading, the
target device, and the unsafe-pickle policy for upstream's pickle-based payloads.

Everything runs on CPU; ``meta`` stands in for "a device other than the one that wrote the
checkpoint".
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch

from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
)
from transformer_engine.pytorch import extra_state
from transformer_engine.pytorch.extra_state import upstream_pickle

pack_extra_state = extra_state.pack_extra_state
unpack_extra_state = extra_state.unpack_extra_state
recipe_to_dict = extra_state.recipe_to_dict
recipe_from_dict = extra_state.recipe_from_dict

ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch):
    """Every test starts without the unsafe-pickle opt-in and without recipe env defaults."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)


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


def _recipe_fields(recipe) -> dict:
    return {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}


DELAYED_RECIPES = [
    DelayedScaling(),
    DelayedScaling(
        margin=3,
        fp8_format=Format.E4M3,
        amax_history_len=16,
        amax_compute_algo="most_recent",
        reduce_amax=False,
        fp8_dpa=True,
        fp8_mha=True,
    ),
    DelayedScaling(margin=1, fp8_format=Format.HYBRID, amax_history_len=1),
]

CURRENT_RECIPES = [
    Float8CurrentScaling(),
    Float8CurrentScaling(
        use_power_2_scales=True,
        fp8_format=Format.E4M3,
        fp8_gemm_fprop=MMParams(use_split_accumulator=True),
        fp8_gemm_dgrad=MMParams(use_split_accumulator=False),
        fp8_gemm_wgrad=MMParams(use_split_accumulator=False),
        fp8_dpa=True,
        fp8_mha=True,
        backward_override="high_precision",
    ),
    Float8CurrentScaling(backward_override="dequantized"),
]


# ------------------------------------------------------------------ recipes as plain data


def test_recipe_to_dict_delayed_layout():
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=8)
    assert recipe_to_dict(recipe) == {
        "type": "DelayedScaling",
        "margin": 2,
        "fp8_format": "E4M3",
        "amax_history_len": 8,
        "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None,
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    }


def test_recipe_to_dict_current_layout():
    stored = recipe_to_dict(Float8CurrentScaling(fp8_gemm_fprop=MMParams(True)))
    qparams = dataclasses.asdict(Float8CurrentScaling.fp8_quant_fwd_inp)
    assert stored == {
        "type": "Float8CurrentScaling",
        "use_power_2_scales": False,
        "fp8_format": "HYBRID",
        "fp8_gemm_fprop": {"use_split_accumulator": True},
        "fp8_gemm_dgrad": {"use_split_accumulator": True},
        "fp8_gemm_wgrad": {"use_split_accumulator": True},
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
        "fp8_quant_fwd_inp": qparams,
        "fp8_quant_fwd_weight": qparams,
        "fp8_quant_bwd_grad": qparams,
    }
    assert set(qparams) == {f.name for f in dataclasses.fields(QParams)}


@pytest.mark.parametrize("recipe", DELAYED_RECIPES + CURRENT_RECIPES, ids=repr)
def test_recipe_dict_round_trip(recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = recipe_from_dict(recipe_to_dict(recipe))
    assert type(restored) is type(recipe)
    assert restored == recipe
    assert _recipe_fields(restored) == _recipe_fields(recipe)
    if isinstance(recipe, Float8CurrentScaling):
        for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            assert getattr(restored, attr) == getattr(recipe, attr)


def test_recipe_to_dict_rejects_other_recipes():
    @dataclasses.dataclass(repr=False)
    class MyScaling(DelayedScaling):
        pass

    with pytest.raises(ValueError, match="MyScaling"):
        recipe_to_dict(MyScaling())
    with pytest.raises(ValueError, match="cannot be stored"):
        recipe_to_dict(object())


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(type="MXFP8BlockScaling"), "MXFP8BlockScaling.*another layout"),
        (lambda d: d.pop("type"), "None.*unknown"),
        (lambda d: d.update(interval=1), r"unknown fields \['interval'\].*another layout"),
        (lambda d: d.pop("margin"), r"lacks fields \['margin'\].*another layout"),
        (lambda d: d.update(fp8_format="E3M4"), "'E3M4' is not a Format name"),
        (lambda d: d.update(fp8_format=1), "is not a Format name"),
        (lambda d: d.update(fp8_format="E5M2"), "invalid.*E5M2"),
        (lambda d: d.update(margin="3"), "invalid.*margin"),
        (lambda d: d.update(amax_history_len=0), "invalid.*amax_history_len"),
        (lambda d: d.update(amax_compute_algo="mean"), "invalid.*amax_compute_algo"),
        (lambda d: d.update(scaling_factor_compute_algo="fn"), "invalid.*scaling_factor"),
    ],
)
def test_recipe_from_dict_errors_delayed(edit, match):
    stored = recipe_to_dict(DelayedScaling())
    edit(stored)
    with pytest.raises(ValueError, match=match):
        recipe_from_dict(stored)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(fp8_gemm_fprop=True), "fp8_gemm_fprop must be a dict"),
        (lambda d: d["fp8_gemm_dgrad"].update(fast=True), r"unknown MMParams fields \['fast'\]"),
        (lambda d: d.update(fp8_gemm_wgrad={}), r"missing fields \['use_split_accumulator'\]"),
        (
            lambda d: d["fp8_gemm_wgrad"].update(use_split_accumulator=1),
            "fp8_gemm_wgrad is invalid",
        ),
        (
            lambda d: d["fp8_quant_bwd_grad"].update(amax_epsilon=-1.0),
            "fp8_quant_bwd_grad is invalid",
        ),
        (lambda d: d.pop("fp8_quant_fwd_weight"), r"lacks fields \['fp8_quant_fwd_weight'\]"),
        (lambda d: d.update(backward_override="fp8"), "invalid.*backward_override"),
    ],
)
def test_recipe_from_dict_errors_current(edit, match):
    stored = recipe_to_dict(Float8CurrentScaling())
    edit(stored)
    with pytest.raises(ValueError, match=match):
        recipe_from_dict(stored)


def test_recipe_from_dict_rejects_non_dict():
    with pytest.raises(ValueError, match="must be a dict"):
        recipe_from_dict([("type", "DelayedScaling")])


def test_qparams_that_differ_from_this_process_warn():
    stored = recipe_to_dict(Float8CurrentScaling())
    flipped = not Float8CurrentScaling.fp8_quant_fwd_inp.power_2_scale
    stored["fp8_quant_fwd_inp"]["power_2_scale"] = flipped
    with pytest.warns(UserWarning, match="fp8_quant_fwd_inp.*NVTE_FP8_CURRENT_SCALING_POWER_2"):
        restored = recipe_from_dict(stored)
    # Class attributes follow this process, not the checkpoint.
    assert restored.fp8_quant_fwd_inp == Float8CurrentScaling.fp8_quant_fwd_inp


def _history_max(history):
    return history.max(dim=0).values


def _scale_fn(amax, scale, fp8_max, recipe):
    return fp8_max / amax


def test_callable_algorithms_are_stored_as_placeholders_and_restored_as_defaults():
    recipe = DelayedScaling(
        margin=1, amax_compute_algo=_history_max, scaling_factor_compute_algo=_scale_fn
    )
    packed = pack_extra_state(recipe, _state_tensors(), {})
    assert packed["recipe"]["amax_compute_algo"] == "<callable>"
    assert packed["recipe"]["scaling_factor_compute_algo"] == "<callable>"
    with pytest.warns(UserWarning) as record:
        restored, _, _ = unpack_extra_state(packed, device="cpu")
    messages = [str(w.message) for w in record]
    assert any("amax_compute_algo" in m and "'max'" in m and "again" in m for m in messages)
    assert any("scaling_factor_compute_algo" in m and "None" in m for m in messages)
    assert restored == DelayedScaling(margin=1)


# ------------------------------------------------------------------ pack / unpack


@pytest.mark.parametrize("recipe", DELAYED_RECIPES, ids=repr)
def test_pack_unpack_round_trip_delayed(recipe):
    tensors = _state_tensors(length=recipe.amax_history_len)
    extra = {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0, "note": None,
             "dims": (3, [4, 5]), "nested": {"a": [1.5, "x"]}}  # fmt: skip
    packed = pack_extra_state(recipe, tensors, extra)
    assert packed["format"] == "transformer_engine/extra_state"
    assert packed["version"] == 1
    assert packed["recipe"] == recipe_to_dict(recipe)
    assert packed["extra"] == extra
    recipe_out, tensors_out, extra_out = unpack_extra_state(packed, device="cpu")
    assert recipe_out == recipe
    assert _recipe_fields(recipe_out) == _recipe_fields(recipe)
    assert set(tensors_out) == set(tensors)
    for name, tensor in tensors.items():
        assert tensors_out[name].dtype == torch.float32
        assert _bitwise_equal(tensors_out[name], tensor), name
    assert extra_out == extra
    assert type(extra_out["dims"]) is tuple


@pytest.mark.parametrize("recipe", CURRENT_RECIPES, ids=repr)
def test_pack_unpack_round_trip_current_scaling_without_tensors(recipe):
    packed = pack_extra_state(recipe, {}, {"num_gemms": 2})
    assert packed["tensors"] == {}
    result = unpack_extra_state(packed, device="cpu")
    assert result.recipe == recipe
    assert _recipe_fields(result.recipe) == _recipe_fields(recipe)
    assert result.tensors == {}
    assert result.extra == {"num_gemms": 2}


def test_forward_only_state_round_trips():
    tensors = _state_tensors()
    fwd = {k: v for k, v in tensors.items() if k.endswith("_fwd")}
    _, out, _ = unpack_extra_state(pack_extra_state(DelayedScaling(), fwd, {}), device="cpu")
    assert set(out) == {"scale_fwd", "amax_history_fwd"}


def test_special_float_values_survive_bitwise():
    tensors = _state_tensors()
    tensors["scale_fwd"] = torch.tensor([float("inf"), 3.4028234663852886e38, 1e-45])
    tensors["amax_history_fwd"][0] = torch.tensor([0.0, -0.0, float("nan")])
    packed = pack_extra_state(DelayedScaling(amax_history_len=5), tensors, {})
    _, out, _ = unpack_extra_state(packed, device="cpu")
    for name in tensors:
        assert _bitwise_equal(out[name], tensors[name]), name


def test_pack_copies_to_dense_cpu_float32():
    tensors = _state_tensors()
    big = torch.zeros(10, 3)
    tensors["amax_history_fwd"] = big[2:7]  # a view into a larger storage
    packed = pack_extra_state(DelayedScaling(), tensors, {})
    for name, tensor in packed["tensors"].items():
        assert tensor.device.type == "cpu" and tensor.dtype == torch.float32
        assert tensor.is_contiguous()
        assert tensor.untyped_storage().nbytes() == tensor.numel() * 4, name
    before = packed["tensors"]["scale_fwd"].clone()
    tensors["scale_fwd"].add_(1.0)  # the live state keeps training
    assert torch.equal(packed["tensors"]["scale_fwd"], before)


def test_torch_save_and_weights_only_load():
    module = torch.nn.Linear(4, 4)
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5)
    tensors = _state_tensors()
    state_dict = module.state_dict()
    state_dict["_extra_state"] = pack_extra_state(recipe, tensors, {"fp8_checkpoint": True})
    state_dict["current"] = pack_extra_state(Float8CurrentScaling(), {}, {})
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    recipe_out, tensors_out, extra_out = unpack_extra_state(loaded["_extra_state"], device="cpu")
    assert recipe_out == recipe
    assert extra_out == {"fp8_checkpoint": True}
    for name, tensor in tensors.items():
        assert _bitwise_equal(tensors_out[name], tensor)
    assert unpack_extra_state(loaded["current"], device="cpu").recipe == Float8CurrentScaling()


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("meta")])
def test_unpack_puts_tensors_on_the_requested_device(device):
    tensors = _state_tensors()
    packed = pack_extra_state(DelayedScaling(), tensors, {})
    _, out, _ = unpack_extra_state(packed, device=device)
    for name, tensor in out.items():
        assert tensor.device == torch.device(device), name
        assert tensor.shape == tensors[name].shape and tensor.dtype == torch.float32


def test_unpack_moves_tensors_written_on_another_device():
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {})
    # As if the state dict had been loaded with map_location onto another device.
    packed["tensors"] = {k: v.to("meta") for k, v in packed["tensors"].items()}
    with pytest.raises(NotImplementedError):  # meta -> cpu has no data: proves a real move
        unpack_extra_state(packed, device="cpu")
    _, out, _ = unpack_extra_state(packed, device="meta")
    assert all(t.is_meta for t in out.values())


def test_unpack_reads_dict_subclasses_as_plain_dicts():
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {"d": {"a": [1]}})
    state = OrderedDict(packed)
    state["tensors"] = OrderedDict(packed["tensors"])
    state["extra"] = OrderedDict(d=OrderedDict(a=[1]))
    _, tensors, extra = unpack_extra_state(state, device="cpu")
    assert set(tensors) == set(packed["tensors"])
    assert extra == {"d": {"a": [1]}} and type(extra["d"]) is dict


def test_unpack_returns_fresh_tensors_and_extra():
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {"lst": [1]})
    _, out, extra = unpack_extra_state(packed, device="cpu")
    out["scale_fwd"].fill_(7.0)
    extra["lst"].append(2)
    assert not torch.equal(packed["tensors"]["scale_fwd"], out["scale_fwd"])
    assert packed["extra"] == {"lst": [1]}


def test_unpack_nothing():
    assert unpack_extra_state(None, device="cpu") is None
    assert unpack_extra_state(torch.empty(0, dtype=torch.uint8), device="cpu") is None
    assert unpack_extra_state(torch.empty(0), device="meta") is None


@pytest.mark.parametrize(
    "device, match",
    [(None, "needs device="), ("cuda", "names no CUDA index")],
)
def test_unpack_needs_a_concrete_device(device, match):
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {})
    with pytest.raises(ValueError, match=match):
        unpack_extra_state(packed, device=device)


# ------------------------------------------------------------------ bad input to pack


class _Kind(enum.IntEnum):
    A = 1


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"group": object()}, r"extra\['group'\] is <object"),
        ({"dtype": _Kind.A}, r"extra\['dtype'\].*_Kind"),
        ({"t": torch.ones(1)}, r"extra\['t'\].*Tensor"),
        ({"l": [1, {2}]}, r"extra\['l'\]\[1\].*set"),
        ({"d": {1: "x"}}, r"extra\['d'\] has the key 1"),
        ({3: "x"}, "extra has the key 3"),
        ({"o": OrderedDict(a=1)}, r"extra\['o'\].*OrderedDict"),
    ],
)
def test_pack_rejects_non_plain_extra(extra, match):
    with pytest.raises(TypeError, match=match):
        pack_extra_state(DelayedScaling(), _state_tensors(), extra)


def test_pack_rejects_non_dict_extra():
    with pytest.raises(TypeError, match="extra must be a dict"):
        pack_extra_state(DelayedScaling(), _state_tensors(), [("a", 1)])


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda t: t.update(scale_inv_fwd=torch.ones(3)), ValueError, "'scale_inv_fwd'"),
        (lambda t: t.pop("amax_history_bwd"), ValueError, "only one of 'scale_bwd'"),
        (lambda t: t.update(scale_fwd=t["scale_fwd"].double()), TypeError, "float32.*float64"),
        (lambda t: t.update(scale_fwd=[1.0, 2.0, 3.0]), TypeError, "must be a torch.Tensor"),
        (lambda t: t.update(scale_fwd=torch.ones(4)), ValueError, r"\(4,\).*\(5, 3\)"),
        (lambda t: t.update(amax_history_fwd=torch.ones(15)), ValueError, r"\[N\] and \[L, N\]"),
        (lambda t: t.update(scale_fwd=torch.ones(3, device="meta")), ValueError, "meta device"),
    ],
)
def test_pack_rejects_bad_tensors(edit, error, match):
    tensors = _state_tensors()
    edit(tensors)
    with pytest.raises(error, match=match):
        pack_extra_state(DelayedScaling(), tensors, {})


# ------------------------------------------------------------------ foreign dicts and values


def _packed():
    return pack_extra_state(DelayedScaling(amax_history_len=5), _state_tensors(), {"k": 1})


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(format="megatron/fp8"), "format='megatron/fp8'.*another layout"),
        (lambda s: s.pop("format"), "format=None.*another layout"),
        (lambda s: s.update(version=2), "version=2.*reads.*version 1.*another layout"),
        (lambda s: s.update(version="1"), "version='1'"),
        (lambda s: s.update(optimizer={}), r"unknown entries \[\"'optimizer'\"\]"),
        (lambda s: s.pop("extra"), r"lacks \['extra'\]"),
        (lambda s: s.update(recipe={"type": "NVFP4BlockScaling"}), "NVFP4BlockScaling"),
        (lambda s: s.update(tensors=[]), "'tensors' must be a dict"),
        (lambda s: s["tensors"].update(scale_inv_fwd=torch.ones(3)), "'scale_inv_fwd'"),
        (lambda s: s["tensors"].update(scale_fwd=torch.ones(3, dtype=torch.float16)), "float32"),
        (lambda s: s["tensors"].update(scale_fwd=1.0), "must be a torch.Tensor"),
        (lambda s: s["tensors"].pop("scale_fwd"), "only one of 'scale_fwd'"),
        (lambda s: s["tensors"].update(scale_bwd=torch.ones(5)), r"\[N\] and \[L, N\]"),
        (lambda s: s.update(extra={"k": object()}), r"'extra'\['k'\]"),
        (lambda s: s.update(extra=None), "'extra' must be a dict"),
    ],
)
def test_unpack_rejects_foreign_or_bad_dicts(edit, match):
    state = _packed()
    edit(state)
    with pytest.raises(ValueError, match=match):
        unpack_extra_state(state, device="cpu")


def test_unpack_rejects_upstream_style_plain_dict():
    state = {"recipe": DelayedScaling(), "scale_fwd": torch.ones(1)}
    with pytest.raises(ValueError, match="format=None and keys.*'recipe'.*another layout"):
        unpack_extra_state(state, device="cpu")


def test_unpack_rejects_other_types():
    with pytest.raises(ValueError, match="torch.float32 tensor.*uint8"):
        unpack_extra_state(torch.ones(3), device="cpu")
    with pytest.raises(TypeError, match="str is not understood"):
        unpack_extra_state("state", device="cpu")


# ------------------------------------------------------------------ upstream pickle payloads


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
