"""What ``unpack_extra_state`` does with bytes and dicts it did not just write: version 2 bytes
that are truncated or malformed (a ``ValueError`` naming what is wrong), and version 1 dicts,
the format earlier versions of this package wrote (still read; foreign or broken ones refused).

Broken bytes are built with the independent writer of extra_state_oracle.py.
"""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
from extra_state_oracle import (
    FORMAT_NAME,
    as_uint8,
    bitwise_equal,
    build,
    build_state,
    float32_le_bytes,
    header_entries,
    state_tensors,
)

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch.extra_state import (
    pack_extra_state,
    recipe_to_dict,
    unpack_extra_state,
)


def _good_parts(length=5):
    tensors = state_tensors(length=length)
    header = {"format": FORMAT_NAME, "version": 2,
              "recipe": recipe_to_dict(DelayedScaling(amax_history_len=length)),
              "extra": {"num_gemms": 1}, "tensors": header_entries(tensors)}  # fmt: skip
    return header, b"".join(float32_le_bytes(t) for t in tensors.values())


def _unpack(data: bytes):
    return unpack_extra_state(as_uint8(data), device="cpu")


def test_the_good_parts_load():
    header, data = _good_parts()
    assert _unpack(build(header, data)).recipe == DelayedScaling(amax_history_len=5)


# ------------------------------------------------------------------ version 2: truncated bytes


@pytest.mark.parametrize("keep", [5, 6, 9])
def test_truncated_prefix(keep):
    header, data = _good_parts()
    with pytest.raises(ValueError, match=f"truncated: {keep} bytes.*10-byte prefix"):
        _unpack(build(header, data)[:keep])


def test_truncated_header():
    header, data = _good_parts()
    raw = build(header, data)
    length = int.from_bytes(raw[6:10], "little")
    with pytest.raises(ValueError, match=f"header is {length} bytes long but only 20 bytes"):
        _unpack(raw[:30])


def test_truncated_data():
    header, data = _good_parts()
    with pytest.raises(ValueError, match=r"truncated: tensor 'amax_history_bwd' needs data bytes"):
        _unpack(build(header, data[:-1]))


def test_trailing_bytes():
    header, data = _good_parts()
    with pytest.raises(ValueError, match="3 bytes follow the last tensor"):
        _unpack(build(header, data + b"abc"))


# ------------------------------------------------------------------ version 2: bad prefix, header


def test_unknown_version_byte():
    header, data = _good_parts()
    with pytest.raises(ValueError, match="magic with version 3; this build reads version 2"):
        _unpack(build(header, data, version=3))


@pytest.mark.parametrize(
    "text, match",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"format": ', "not valid JSON"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'{"format": 1, "format": 2}', r"repeats the keys \['format'\]"),
    ],
)
def test_header_that_is_not_a_json_object(text, match):
    raw = b"\xffTEXS\x02" + len(text).to_bytes(4, "little") + text
    with pytest.raises(ValueError, match=match):
        _unpack(raw)


def _entry(index):
    return lambda h: h["tensors"][index]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.pop("extra"), r"unknown keys \[\] and lacks \['extra'\]"),
        (lambda h: h.update(pickle="x"), r"unknown keys \['pickle'\]"),
        (lambda h: h.update(format="megatron/fp8"), "format='megatron/fp8'.*another layout"),
        (lambda h: h.update(version=1), "version=1, expected.*2"),
        (lambda h: h.update(tensors={}), "header 'tensors' is {}, not a list"),
        (lambda h: h["tensors"].append(3), r"tensors\[4\] is int; expected an object"),
        (lambda h: _entry(0)(h).pop("nbytes"), r"tensors\[0\] is \['dtype', 'name'"),
        (lambda h: _entry(0)(h).update(name="scale_inv_fwd"), "unknown name 'scale_inv_fwd'"),
        (lambda h: _entry(1)(h).update(name="scale_fwd"), "repeats 'scale_fwd'"),
        (lambda h: _entry(0)(h).update(dtype="bfloat16"), "dtype 'bfloat16'; expected.*float32"),
        (lambda h: _entry(0)(h).update(shape=[3.0]), r"shape \[3.0\]; expected a list of sizes"),
        (lambda h: _entry(0)(h).update(shape=[-3]), r"shape \[-3\]"),
        (lambda h: _entry(0)(h).update(shape=3), "shape 3"),
        (lambda h: _entry(0)(h).update(nbytes=11), r"nbytes=11, but shape \[3\].*holds 12"),
        (lambda h: _entry(1)(h).update(offset=0), "starts at offset 0.*must start at 12"),
        (lambda h: _entry(1)(h).update(offset=True), "starts at offset True"),
    ],
)
def test_bad_header_entries(edit, match):
    header, data = _good_parts()
    edit(header)
    with pytest.raises(ValueError, match=match):
        _unpack(build(header, data))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.update(recipe={"type": "NVFP4BlockScaling"}), "NVFP4BlockScaling"),
        (lambda h: h["recipe"].update(margin=-1), "invalid.*margin"),
        (lambda h: h.update(extra=None), "'extra' must be a dict"),
        (lambda h: h.update(extra=[1]), "'extra' must be a dict"),
    ],
)
def test_bad_recipe_or_extra(edit, match):
    header, data = _good_parts()
    edit(header)
    with pytest.raises(ValueError, match=match):
        _unpack(build(header, data))


def test_unpaired_and_misshapen_tensors():
    tensors = state_tensors()
    fwd_only_scale = {"scale_fwd": tensors["scale_fwd"]}
    recipe = recipe_to_dict(DelayedScaling())
    with pytest.raises(ValueError, match="only one of 'scale_fwd'"):
        _unpack(build_state(recipe, fwd_only_scale, {}))
    tensors["scale_bwd"] = torch.ones(5)
    with pytest.raises(ValueError, match=r"\[N\] and \[L, N\]"):
        _unpack(build_state(recipe, tensors, {}))


def test_every_single_byte_truncation_raises_value_error():
    packed = pack_extra_state(DelayedScaling(amax_history_len=2), state_tensors(length=2), {})
    for keep in range(1, packed.numel()):
        with pytest.raises(ValueError, match="truncated"):
            unpack_extra_state(packed[:keep], device="cpu")


# ------------------------------------------------------------------ version 1 dicts


def _v1(recipe=None, tensors=None, extra=None) -> dict:
    """A version 1 dict as earlier versions of this package wrote it (format.py's docstring)."""
    recipe = recipe or DelayedScaling(amax_history_len=5)
    return {
        "format": "transformer_engine/extra_state",
        "version": 1,
        "recipe": recipe_to_dict(recipe),
        "tensors": state_tensors() if tensors is None else tensors,
        "extra": {"num_gemms": 1} if extra is None else extra,
    }


def test_v1_dict_loads():
    tensors = state_tensors()
    state = _v1(DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5), tensors,
                {"dims": (3, 4), "num_gemms": 1})  # fmt: skip
    recipe, out, extra = unpack_extra_state(state, device="cpu")
    assert recipe == DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5)
    assert extra == {"dims": (3, 4), "num_gemms": 1}
    for name, tensor in tensors.items():
        assert bitwise_equal(out[name], tensor), name
        assert out[name] is not tensor


def test_v1_dict_after_weights_only_load_and_on_meta():
    buffer = io.BytesIO()
    torch.save({"_extra_state": _v1(), "cur": _v1(Float8CurrentScaling(), {}, {})}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    _, out, _ = unpack_extra_state(loaded["_extra_state"], device="meta")
    assert all(t.is_meta for t in out.values())
    assert unpack_extra_state(loaded["cur"], device="cpu").recipe == Float8CurrentScaling()


def test_v1_dict_subclasses_read_as_plain_dicts():
    state = OrderedDict(_v1(extra={"d": {"a": [1]}}))
    state["tensors"] = OrderedDict(state["tensors"])
    state["extra"] = OrderedDict(d=OrderedDict(a=[1]))
    _, tensors, extra = unpack_extra_state(state, device="cpu")
    assert set(tensors) == set(state["tensors"])
    assert extra == {"d": {"a": [1]}} and type(extra["d"]) is dict


def test_v1_tensors_are_moved_to_the_loading_device():
    state = _v1()
    state["tensors"] = {k: v.to("meta") for k, v in state["tensors"].items()}
    with pytest.raises(NotImplementedError):  # meta -> cpu has no data: proves a real move
        unpack_extra_state(state, device="cpu")
    _, out, _ = unpack_extra_state(state, device="meta")
    assert all(t.is_meta for t in out.values())


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(format="megatron/fp8"), "format='megatron/fp8'.*another layout"),
        (lambda s: s.pop("format"), "format=None.*another layout"),
        (lambda s: s.update(version=2), "version=2.*dicts of version 1.*uint8 tensor"),
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
def test_v1_foreign_or_bad_dicts_are_refused(edit, match):
    state = _v1()
    edit(state)
    with pytest.raises(ValueError, match=match):
        unpack_extra_state(state, device="cpu")


def test_upstream_style_plain_dict_is_refused():
    state = {"recipe": DelayedScaling(), "scale_fwd": torch.ones(1)}
    with pytest.raises(ValueError, match="format=None and keys.*'recipe'.*another layout"):
        unpack_extra_state(state, device="cpu")
