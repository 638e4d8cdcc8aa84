"""Recipe state, quantizers and the amax update on GPUs, off the current device.

Skipped without CUDA (reason given); the two-GPU tests need two GPUs in one process.
"""

import pytest
import torch
from utils import needs_cuda, needs_two_gpus

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState, autocast

pytestmark = needs_cuda


def module_meta(recipe, device, slots=3):
    meta = {"recipe": recipe, "fp8_group": None}
    for mode, key in (("forward", "scaling_fwd"), ("backward", "scaling_bwd")):
        meta[key] = RecipeState.create(recipe, mode=mode, num_quantizers=slots, device=device)
    return meta


def run_steps(meta, inputs, recipe):
    """Quantize each step's input through slot 0 inside an autocast; returns the FP8 results."""
    quantizer = meta["scaling_fwd"].make_quantizers()[0]
    outs = []
    for x in inputs:
        with autocast(recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
            outs.append(quantizer(x))
    return outs


@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:1", marks=needs_two_gpus)])
def test_delayed_scaling_on_a_device_matches_the_cpu_run_bitwise(device):
    torch.cuda.set_device(0)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=5, margin=1)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(64, 96, generator=g) * (1 + 3 * step) for step in range(8)]
    gpu_meta = module_meta(recipe, device)
    gpu_out = run_steps(gpu_meta, [x.to(device, torch.bfloat16) for x in inputs], recipe)
    torch.cuda.synchronize(device)
    FP8GlobalStateManager.reset()
    cpu_meta = module_meta(recipe, "cpu")
    cpu_out = run_steps(cpu_meta, [x.to(torch.bfloat16) for x in inputs], recipe)

    assert torch.cuda.current_device() == 0
    state = gpu_meta["scaling_fwd"]
    assert state.scale.device == torch.device(device)
    assert state.amax_history.device == torch.device(device)
    assert torch.equal(state.scale.cpu(), cpu_meta["scaling_fwd"].scale)
    assert torch.equal(state.amax_history.cpu(), cpu_meta["scaling_fwd"].amax_history)
    for g_out, c_out in zip(gpu_out, cpu_out):
        assert g_out.device == torch.device(device)
        assert torch.equal(g_out._data.cpu(), c_out._data)
        assert torch.equal(g_out._scale_inv.cpu(), c_out._scale_inv)


@needs_two_gpus
def test_two_states_on_two_gpus_update_in_one_exit_without_cross_device_copies():
    torch.cuda.set_device(0)
    recipe = DelayedScaling(amax_history_len=4)
    metas = [module_meta(recipe, "cuda:0"), module_meta(recipe, "cuda:1")]
    cpu_metas = [module_meta(recipe, "cpu"), module_meta(recipe, "cpu")]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with autocast(recipe=recipe):
            for i, meta in enumerate(metas):
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
                meta["scaling_fwd"].amax_history[0].fill_(2.0 + i)
                cpu_metas[i]["scaling_fwd"].amax_history[0].fill_(2.0 + i)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    copies = [
        e.name
        for e in prof.events()
        if "memcpy" in e.name.lower() and "dtod" in e.name.lower().replace(" ", "")
    ]
    peer = [e.name for e in prof.events() if "ptop" in e.name.lower()]
    assert peer == [] and copies == [], (peer, copies)
    reference.delayed_scaling_update(
        [m["scaling_fwd"].amax_history for m in cpu_metas],
        [m["scaling_fwd"].scale for m in cpu_metas],
        torch.float8_e4m3fn,
    )
    for meta, cpu_meta, device in zip(metas, cpu_metas, ("cuda:0", "cuda:1")):
        assert meta["scaling_fwd"].scale.device == torch.device(device)
        assert torch.equal(meta["scaling_fwd"].scale.cpu(), cpu_meta["scaling_fwd"].scale)
    assert torch.cuda.current_device() == 0


@needs_two_gpus
def test_current_scaling_quantizer_runs_on_the_inputs_device():
    torch.cuda.set_device(0)
    state = RecipeState.create(
        Float8CurrentScaling(), mode="forward", num_quantizers=1, device="cuda:1"
    )
    quantizer = state.make_quantizers()[0]
    x = torch.randn(32, 64, device="cuda:1", dtype=torch.bfloat16) * 5
    out = quantizer(x)
    assert out.device == torch.device("cuda:1") and out._scale_inv.device == torch.device("cuda:1")
    amax = reference.amax(x.cpu())
    scale = reference.compute_scale_from_amax(amax, torch.float8_e4m3fn)
    assert torch.equal(
        out._data.cpu(),
        reference.cast_to_fp8(x.cpu(), scale, torch.float8_e4m3fn).view(torch.uint8),
    )
    assert torch.cuda.current_device() == 0
