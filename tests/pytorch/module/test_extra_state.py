"""Our checkpoint format of module extra state, version 2 (a uint8 tensor of bytes): the
recipe as plain data, pack/unpack round trips, the written layout checked by an independent
reader (extra_state_oracle.py), weights-only and safetensors transport, the target device, and
bad input to pack. Malformed bytes and version 1 dicts: test_extra_state_malformed.py; upstream
pickles: test_extra_state_upstream_pickle.py; modules: test_extra_state_modules.py.

Everything runs on CPU; ``meta`` stands in for "a device other than the one that wrote the
checkpoint".
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import pickle
import pickletools
import warnings
from collections import OrderedDict

import pytest
import torch
from extra_state_oracle import (
    FORMAT_NAME,
    MAGIC,
    as_uint8,
    bitwise_equal,
    build_state,
    float32_le_bytes,
    parse,
    state_tensors,
)

from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
)
from transformer_engine.pytorch import extra_state

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


_state_tensors = state_tensors
_bitwise_equal = bitwise_equal


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
        (lambda d: d.update(margin="three"), "invalid.*margin"),
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
            lambda d: d["fp8_gemm_wgrad"].update(use_split_accumulator=2),
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
    header, _, _ = parse(packed)
    assert header["recipe"]["amax_compute_algo"] == "<callable>"
    assert header["recipe"]["scaling_factor_compute_algo"] == "<callable>"
    with pytest.warns(UserWarning) as record:
        restored, _, _ = unpack_extra_state(packed, device="cpu")
    messages = [str(w.message) for w in record]
    assert any("amax_compute_algo" in m and "'max'" in m and "again" in m for m in messages)
    assert any("scaling_factor_compute_algo" in m and "None" in m for m in messages)
    assert restored == DelayedScaling(margin=1)


# ------------------------------------------------------------------ version 2: what is written


def test_empty_extra_state_is_upstreams_no_state():
    empty = extra_state.empty_extra_state()
    assert empty.dtype == torch.uint8 and empty.shape == (0,) and empty.device.type == "cpu"
    assert unpack_extra_state(empty, device="cpu") is None


def test_pack_writes_the_documented_layout():
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5)
    tensors = _state_tensors()
    packed = pack_extra_state(recipe, tensors, {"num_gemms": 1})
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.device.type == "cpu"
    assert packed.is_contiguous()
    header, stored, body = parse(packed)
    assert header["format"] == FORMAT_NAME and header["version"] == 2
    assert header["recipe"] == recipe_to_dict(recipe)
    assert header["extra"] == {"num_gemms": 1}
    assert [e["name"] for e in header["tensors"]] == list(tensors)
    assert body == b"".join(float32_le_bytes(t) for t in tensors.values())
    for name, tensor in tensors.items():
        assert _bitwise_equal(stored[name], tensor), name
    assert extra_state.FORMAT_VERSION == 2 and extra_state.READABLE_VERSIONS == (1, 2)
    assert extra_state.EXTRA_STATE_MAGIC == MAGIC


def test_oracle_bytes_read_back():
    """Bytes written by the independent writer, not by pack_extra_state, load."""
    tensors = _state_tensors(length=3)
    data = build_state(recipe_to_dict(DelayedScaling(amax_history_len=3)), tensors, {"k": [1]})
    recipe, out, extra = unpack_extra_state(as_uint8(data), device="cpu")
    assert recipe == DelayedScaling(amax_history_len=3) and extra == {"k": [1]}
    for name, tensor in tensors.items():
        assert _bitwise_equal(out[name], tensor), name


def test_the_magic_can_never_start_a_pickle():
    opcodes = {ord(op.code) for op in pickletools.opcodes}
    assert MAGIC[0] not in opcodes and MAGIC[0] != 0x80
    state = {"recipe": DelayedScaling(), **_state_tensors()}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert not pickle.dumps(state, protocol=protocol).startswith(MAGIC[:1])
    with pytest.raises(pickle.UnpicklingError, match="invalid load key"):
        pickle.loads(bytes(pack_extra_state(DelayedScaling(), _state_tensors(), {}).tolist()))


# ------------------------------------------------------------------ version 2: round trips


@pytest.mark.parametrize("recipe", DELAYED_RECIPES, ids=repr)
def test_pack_unpack_round_trip_delayed(recipe):
    tensors = _state_tensors(length=recipe.amax_history_len)
    extra = {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0, "note": None,
             "nested": {"a": [1.5, "x", {"b": False}]}, "big": 2**70, "text": "µ\u00e9\u4e2d"}  # fmt: skip
    packed = pack_extra_state(recipe, tensors, extra)
    recipe_out, tensors_out, extra_out = unpack_extra_state(packed, device="cpu")
    assert recipe_out == recipe
    assert _recipe_fields(recipe_out) == _recipe_fields(recipe)
    assert set(tensors_out) == set(tensors)
    for name, tensor in tensors.items():
        assert tensors_out[name].dtype == torch.float32
        assert _bitwise_equal(tensors_out[name], tensor), name
    assert extra_out == extra
    assert type(extra_out["num_gemms"]) is int and type(extra_out["fp8_max_fwd"]) is float


def test_tuples_in_extra_come_back_as_lists():
    packed = pack_extra_state(DelayedScaling(), {}, {"dims": (3, (4, 5))})
    assert unpack_extra_state(packed, device="cpu").extra == {"dims": [3, [4, 5]]}


@pytest.mark.parametrize("recipe", CURRENT_RECIPES, ids=repr)
def test_pack_unpack_round_trip_current_scaling_without_tensors(recipe):
    packed = pack_extra_state(recipe, {}, {"num_gemms": 2})
    assert parse(packed)[0]["tensors"] == []
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


def test_non_finite_floats_in_the_header_use_jsons_nan_and_infinity():
    extra = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "neg0": -0.0,
             "tiny": 5e-324, "third": 1 / 3}  # fmt: skip
    packed = pack_extra_state(DelayedScaling(), {}, extra)
    raw = bytes(packed.tolist())
    assert b'"nan":NaN' in raw and b'"inf":Infinity' in raw and b'"-inf":-Infinity' in raw
    out = unpack_extra_state(packed, device="cpu").extra
    assert out["nan"] != out["nan"]
    assert out["inf"] == float("inf") and out["-inf"] == float("-inf")
    assert str(out["neg0"]) == "-0.0"
    assert out["tiny"] == 5e-324 and out["third"] == 1 / 3


def test_pack_copies_the_live_state():
    tensors = _state_tensors()
    tensors["amax_history_fwd"] = torch.zeros(10, 3)[2:7]  # a view into a larger storage
    packed = pack_extra_state(DelayedScaling(), tensors, {})
    before = packed.clone()
    tensors["scale_fwd"].add_(1.0)  # the live state keeps training
    assert torch.equal(packed, before)
    assert parse(packed)[1]["amax_history_fwd"].shape == (5, 3)


def test_torch_save_and_weights_only_load():
    module = torch.nn.Linear(4, 4)
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5)
    tensors = _state_tensors()
    state_dict = module.state_dict()
    state_dict["_extra_state"] = pack_extra_state(recipe, tensors, {"fp8_checkpoint": True})
    state_dict["current"] = pack_extra_state(Float8CurrentScaling(), {}, {})
    state_dict["empty"] = extra_state.empty_extra_state()
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
    assert unpack_extra_state(loaded["empty"], device="cpu") is None


def test_safetensors_save_file_and_load_file(tmp_path):
    try:
        from safetensors.torch import load_file, save_file
    except ImportError as err:
        pytest.skip(f"needs safetensors (installed with transformers): {err}")
    tensors = _state_tensors()
    state = {"weight": torch.randn(4, 4),
             "_extra_state": pack_extra_state(DelayedScaling(amax_history_len=5), tensors, {}),
             "other._extra_state": extra_state.empty_extra_state()}  # fmt: skip
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["_extra_state"], state["_extra_state"])
    _, out, _ = unpack_extra_state(loaded["_extra_state"], device="cpu")
    for name, tensor in tensors.items():
        assert _bitwise_equal(out[name], tensor)
    assert unpack_extra_state(loaded["other._extra_state"], device="cpu") is None


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("meta")])
def test_unpack_puts_tensors_on_the_requested_device(device):
    tensors = _state_tensors()
    packed = pack_extra_state(DelayedScaling(), tensors, {})
    _, out, _ = unpack_extra_state(packed, device=device)
    for name, tensor in out.items():
        assert tensor.device == torch.device(device), name
        assert tensor.shape == tensors[name].shape and tensor.dtype == torch.float32


def test_unpack_reads_views_and_strided_bytes():
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {})
    padded = torch.zeros(2, packed.numel(), dtype=torch.uint8)
    padded[1] = packed
    result = unpack_extra_state(padded.t()[:, 1], device="cpu")  # non-contiguous
    assert _bitwise_equal(result.tensors["scale_fwd"], _state_tensors()["scale_fwd"])


def test_unpack_returns_fresh_tensors():
    packed = pack_extra_state(DelayedScaling(), _state_tensors(), {"lst": [1]})
    before = packed.clone()
    _, out, _ = unpack_extra_state(packed, device="cpu")
    out["scale_fwd"].fill_(7.0)
    assert torch.equal(packed, before)


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


def test_unpack_rejects_other_types():
    with pytest.raises(ValueError, match="torch.float32 tensor.*uint8"):
        unpack_extra_state(torch.ones(3), device="cpu")
    with pytest.raises(ValueError, match="meta device.*no bytes"):
        unpack_extra_state(torch.empty(40, dtype=torch.uint8, device="meta"), device="cpu")
    with pytest.raises(TypeError, match="str is not understood"):
        unpack_extra_state("state", device="cpu")


def test_header_is_plain_json_a_person_can_read():
    packed = pack_extra_state(DelayedScaling(margin=1), _state_tensors(), {"num_gemms": 1})
    raw = bytes(packed.tolist())
    length = int.from_bytes(raw[6:10], "little")
    header = json.loads(raw[10 : 10 + length])
    assert header["recipe"]["margin"] == 1 and header["extra"] == {"num_gemms": 1}


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
