"""The rest of upstream's ``pytorch.utils`` helpers (device and dtype canonicalization, SM
count, GPU autocast, freeing saved tensors, NVTX ranges, ``SplitAlongDim``), ``constants``'
``QKVLayouts`` and ``dist_group_type``, and ``te.IdentityQuantizer``, held to hand-written
expectations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch import constants
from transformer_engine.pytorch import utils as te_utils
from transformer_engine.pytorch.tensor import Float8Quantizer


def test_canonicalize_dtype():
    assert te_utils.canonicalize_dtype(None) is torch.get_default_dtype()
    assert te_utils.canonicalize_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(TypeError, match="'float16' is not a torch.dtype"):
        te_utils.canonicalize_dtype("float16")


def test_canonicalize_device_and_devices_match_on_the_cpu():
    assert te_utils.canonicalize_device("cpu") == torch.device("cpu")
    assert te_utils.canonicalize_device(torch.device("meta")) == torch.device("meta")
    assert te_utils.devices_match("cpu", torch.device("cpu"))
    assert not te_utils.devices_match("cpu", "meta")


@needs_cuda
def test_canonicalize_device_and_devices_match_on_cuda():
    here = torch.cuda.current_device()
    assert te_utils.canonicalize_device("cuda") == torch.device("cuda", here)
    assert te_utils.canonicalize_device(None) == torch.device("cuda", here)
    assert te_utils.devices_match("cuda", f"cuda:{here}")
    assert not te_utils.devices_match("cuda", "cpu")
    if torch.cuda.device_count() > 1:
        other = 1 - here if here < 2 else 0
        assert not te_utils.devices_match("cuda", f"cuda:{other}")


def test_get_sm_count_without_cuda_raises_with_the_reason():
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        assert te_utils.get_sm_count() == props.multi_processor_count
    else:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            te_utils.get_sm_count()


def test_gpu_autocast_ctx_is_cuda_autocast():
    ctx = te_utils.gpu_autocast_ctx(enabled=False)
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda"


def test_clear_tensor_data_frees_plain_and_fp8_tensors():
    plain = torch.ones(4, 8)
    fp8 = Float8Quantizer(torch.ones(1), torch.zeros(1), te.DType.kFloat8E4M3)(torch.ones(16, 16))
    te_utils.clear_tensor_data(plain, None, fp8)
    assert plain.numel() == 0 and plain.dtype == torch.float32
    assert fp8._data is None and fp8._transpose is None


def test_nvtx_ranges_only_with_the_environment_variable(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.delenv("NVTE_NVTX_ENABLED", raising=False)
    te_utils.nvtx_range_push("fc1")
    te_utils.nvtx_range_pop("fc1")
    assert calls == []
    monkeypatch.setenv("NVTE_NVTX_ENABLED", "1")
    te_utils.nvtx_range_push("fc1")
    te_utils.nvtx_range_pop("fc1")
    assert calls == [("push", "fc1"), ("pop",)]


@pytest.mark.parametrize(
    "dim, sections, squeeze",
    [(0, 2, False), (1, [1, 3, 2], False), (-2, 1, True), (2, [4, 1], False)],
)
def test_split_along_dim_matches_torch_split_and_concatenates_gradients(dim, sections, squeeze):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    parts = te_utils.SplitAlongDim.apply(x, dim, sections, squeeze)
    expected = torch.split(x.detach(), sections, dim=dim)
    assert len(parts) == len(expected)
    for part, want in zip(parts, expected):
        assert torch.equal(part, want.squeeze(dim) if squeeze else want)
    # gradient: each part weighted by its own factor, one part unused (its gradient is zero)
    loss = sum((k + 1.0) * part.sum() for k, part in enumerate(parts[:-1]))
    loss.backward()
    want_grad = torch.cat(
        [torch.full_like(p, k + 1.0) for k, p in enumerate(expected[:-1])]
        + [torch.zeros_like(expected[-1])],
        dim=dim,
    )
    assert torch.equal(x.grad, want_grad)


def test_glu_interleave_takes_any_integer_type():
    w = torch.arange(16.0).reshape(8, 2)
    expected = te_utils.interleave_glu_tensor(w, 2)
    assert torch.equal(te_utils.interleave_glu_tensor(w, np.int64(2)), expected)
    assert torch.equal(te_utils.deinterleave_glu_tensor(expected, np.int32(2)), w)
    # [g0 g1 g2 g3 | v0 v1 v2 v3] with blocks of 2 rows -> [g0 g1 v0 v1 g2 g3 v2 v3]
    assert expected[:, 0].tolist() == [0, 2, 8, 10, 4, 6, 12, 14]
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="must be an int"):
            te_utils.interleave_glu_tensor(w, bad)


def test_constants_qkv_layouts_and_dist_group_type():
    assert constants.dist_group_type is torch.distributed.ProcessGroup
    layouts = constants.QKVLayouts
    assert len(layouts) == len(set(layouts)) == 25
    for fmt in ("sb", "bs"):  # every packing of each 4-D format
        for layout in (f"{fmt}3hd", f"{fmt}h3d", f"{fmt}hd_{fmt}2hd", f"{fmt}hd_{fmt}h2d"):
            assert layout in layouts
    assert {"thd_thd_thd", "sbhd_sbhd_sbhd", "bshd_bshd_bshd"} <= set(layouts)
    assert sum(layout.startswith("paged_kv_") for layout in layouts) == 6


def test_identity_quantizer_is_exported_at_the_top_level():
    x = torch.randn(4, 8)
    out = te.IdentityQuantizer(dtype=torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x.to(torch.bfloat16))
