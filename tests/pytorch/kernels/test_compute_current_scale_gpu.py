"""nvte_compute_current_scale (a tensor's amax and its current-scaling scale in one call, two
launches) against the CPU reference, and its no-op flag: holding 1.0, nothing is written (the
weight casts of a CUDA graph captured with cache_quantized_params skip the pass with the cast).

Runs on a CUDA machine (qa/L0_pytorch_gpu/test.sh); skipped elsewhere with that reason.
"""

import pytest
import torch
from utils import cpu_bytes, needs_cuda

import transformer_engine
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.constants import TE_DType
from transformer_engine.pytorch.cpp_extensions.scaling import AMAX_WORKSPACE_ELEMENTS

pytestmark = needs_cuda

SHAPES = [(0, 32), (1, 1), (17, 33), (3, 17, 65), (4096, 4096), (8191, 1031)]
SCALING = [(0.0, False), (0.5, True), (1e4, False)]  # (epsilon, force_pow_2_scales)


def arg(t):
    return (t.data_ptr(), list(t.shape), int(TE_DType[t.dtype]))


def make_input(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 30
    if x.numel() >= 4:  # NaN is ignored; the largest finite element sits in the middle
        x.view(-1)[:4] = torch.tensor([float("nan"), 1.0, -2.0, 1e-30])
        x.view(-1)[x.numel() // 2] = -5000.0 if dtype != torch.float16 else -600.0
    return x.to(dtype).to("cuda")


def run(x, fp8, epsilon, pow2, noop=None, fill=7.0):
    """(amax, scale) after the call, both first filled with ``fill``."""
    native = transformer_engine.common.native.native_module()
    amax, scale = torch.full((1,), fill, device="cuda"), torch.full((1,), fill, device="cuda")
    maxima = torch.full((AMAX_WORKSPACE_ELEMENTS,), 1e30, device="cuda")  # stale slots
    native.compute_current_scale(
        arg(x), arg(amax), arg(scale), int(TE_DType[fp8]), epsilon, pow2, arg(maxima),
        None if noop is None else arg(noop), 0, torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    torch.cuda.synchronize()
    return amax.cpu(), scale.cpu()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("epsilon, pow2", SCALING)
def test_amax_and_scale_are_the_references(shape, dtype, fp8, epsilon, pow2):
    x = make_input(shape, dtype, seed=shape[-1])
    amax, scale = run(x, fp8, epsilon, pow2)
    expected_amax = reference.amax(x.cpu()).reshape(1)
    expected_scale = reference.compute_scale_from_amax(expected_amax, fp8, epsilon, pow2)
    assert torch.equal(cpu_bytes(amax), cpu_bytes(expected_amax))
    assert torch.equal(cpu_bytes(scale), cpu_bytes(expected_scale.reshape(1)))


@pytest.mark.parametrize("shape", [(1, 1), (4096, 4096)])
def test_a_set_noop_flag_writes_nothing_and_a_clear_one_everything(shape):
    x = make_input(shape, torch.bfloat16, seed=5)
    skipped = run(x, torch.float8_e4m3fn, 0.0, False, noop=torch.ones(1, device="cuda"))
    assert skipped[0].item() == skipped[1].item() == 7.0
    ran = run(x, torch.float8_e4m3fn, 0.0, False, noop=torch.zeros(1, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(ran, run(x, torch.float8_e4m3fn, 0.0, False)))
    assert ran[0].item() == reference.amax(x.cpu()).item() != 7.0


def test_a_short_workspace_is_refused_before_anything_runs():
    native = transformer_engine.common.native.native_module()
    x = make_input((64, 32), torch.bfloat16)
    amax, scale = torch.full((1,), 3.0, device="cuda"), torch.full((1,), 3.0, device="cuda")
    short = torch.zeros(AMAX_WORKSPACE_ELEMENTS - 1, device="cuda")
    with pytest.raises(ValueError, match=r"nvte_compute_current_scale: amax_workspace has 1023"):
        native.compute_current_scale(
            arg(x), arg(amax), arg(scale), int(TE_DType[torch.float8_e4m3fn]), 0.0, False,
            arg(short), None, 0, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert amax.item() == scale.item() == 3.0
