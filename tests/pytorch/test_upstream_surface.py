"""Upstream's public names that issue 13 ("drop-in surface") owns, one test per name: the name
resolves from upstream's import path (the longest importable module prefix, then attributes).

The list is data taken from the list of upstream's public names (the rows whose area is "drop-in
surface"); names owned by other issues (attention, block-scaled recipes, parallelism, CUDA graphs)
are not here. A name that is not built yet is a strict xfail that says what is missing, so this
file stays green, the gaps are listed in one place, and a name that appears turns its xfail into a
failure that asks for its removal from ``NOT_BUILT_YET``. Whether each name *works* is tested in
the suites of its own layer; this file only checks that upstream code gets past its imports.
"""

from __future__ import annotations

import importlib

import pytest

DROP_IN_NAMES = [
    "transformer_engine",
    "transformer_engine.common.recipe",
    "transformer_engine.common.recipe.CustomRecipe",
    "transformer_engine.common.recipe.DelayedScaling",
    "transformer_engine.common.recipe.Float8CurrentScaling",
    "transformer_engine.common.recipe.Format",
    "transformer_engine.common.recipe.Recipe",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.DType",
    "transformer_engine.pytorch.DelayedScalingRequest",
    "transformer_engine.pytorch.Float8CurrentScalingQuantizer",
    "transformer_engine.pytorch.Float8Quantizer",
    "transformer_engine.pytorch.Float8Tensor",
    "transformer_engine.pytorch.Float8TensorStorage",
    "transformer_engine.pytorch.Fp8Padding",
    "transformer_engine.pytorch.Fp8Unpadding",
    "transformer_engine.pytorch.GroupedLinear",
    "transformer_engine.pytorch.LayerNorm",
    "transformer_engine.pytorch.LayerNormLinear",
    "transformer_engine.pytorch.LayerNormMLP",
    "transformer_engine.pytorch.Linear",
    "transformer_engine.pytorch.QuantizedTensor",
    "transformer_engine.pytorch.QuantizedTensorStorage",
    "transformer_engine.pytorch.Quantizer",
    "transformer_engine.pytorch.QuantizerRequest",
    "transformer_engine.pytorch.QuantizerRole",
    "transformer_engine.pytorch.RMSNorm",
    "transformer_engine.pytorch._extra_state.CheckpointExtraStatePolicy",
    "transformer_engine.pytorch._extra_state.UNSAFE_PICKLE_EXTRA_STATE_ENV",
    "transformer_engine.pytorch._extra_state._RECIPE_POLICIES",
    "transformer_engine.pytorch._extra_state.should_load_extra_state_pickle",
    "transformer_engine.pytorch.autocast",
    "transformer_engine.pytorch.checkpoint",
    "transformer_engine.pytorch.constants",
    "transformer_engine.pytorch.constants.FP8BwdTensorIdx",
    "transformer_engine.pytorch.constants.FP8FwdTensorIdx",
    "transformer_engine.pytorch.constants.TE_DType",
    "transformer_engine.pytorch.cpp_extensions.general_gemm",
    "transformer_engine.pytorch.cpp_extensions.general_grouped_gemm",
    "transformer_engine.pytorch.cpp_extensions.layernorm_bwd",
    "transformer_engine.pytorch.custom_recipes.gemm.MMParams",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories.current_scaling_factory",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories.delayed_scaling_factory",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories.high_precision_factory",
    "transformer_engine.pytorch.custom_recipes.reference_current_scaling.CurrentScalingQuantizerRef",
    "transformer_engine.pytorch.deinterleave_glu_tensor",
    "transformer_engine.pytorch.distributed.in_fp8_activation_recompute_phase",
    "transformer_engine.pytorch.distributed.is_fp8_activation_recompute_enabled",
    "transformer_engine.pytorch.fp8_autocast",
    "transformer_engine.pytorch.fp8_model_init",
    "transformer_engine.pytorch.get_cudnn_version",
    "transformer_engine.pytorch.get_default_recipe",
    "transformer_engine.pytorch.get_device_compute_capability",
    "transformer_engine.pytorch.interleave_glu_tensor",
    "transformer_engine.pytorch.is_bf16_available",
    "transformer_engine.pytorch.is_fp8_available",
    "transformer_engine.pytorch.module.base.TransformerEngineBaseModule",
    "transformer_engine.pytorch.ops",
    "transformer_engine.pytorch.ops.AddExtraInput",
    "transformer_engine.pytorch.ops.BasicLinear",
    "transformer_engine.pytorch.ops.BasicOperation",
    "transformer_engine.pytorch.ops.Bias",
    "transformer_engine.pytorch.ops.ClampedSwiGLU",
    "transformer_engine.pytorch.ops.ConstantScale",
    "transformer_engine.pytorch.ops.Dropout",
    "transformer_engine.pytorch.ops.FusedOperation",
    "transformer_engine.pytorch.ops.GEGLU",
    "transformer_engine.pytorch.ops.GELU",
    "transformer_engine.pytorch.ops.GLU",
    "transformer_engine.pytorch.ops.GroupedLinear",
    "transformer_engine.pytorch.ops.Identity",
    "transformer_engine.pytorch.ops.L2Normalization",
    "transformer_engine.pytorch.ops.LayerNorm",
    "transformer_engine.pytorch.ops.Linear",
    "transformer_engine.pytorch.ops.MakeExtraOutput",
    "transformer_engine.pytorch.ops.QGEGLU",
    "transformer_engine.pytorch.ops.QGELU",
    "transformer_engine.pytorch.ops.Quantize",
    "transformer_engine.pytorch.ops.RMSNorm",
    "transformer_engine.pytorch.ops.ReGLU",
    "transformer_engine.pytorch.ops.ReLU",
    "transformer_engine.pytorch.ops.Reshape",
    "transformer_engine.pytorch.ops.SReGLU",
    "transformer_engine.pytorch.ops.SReLU",
    "transformer_engine.pytorch.ops.ScaledClampedQGeGLU",
    "transformer_engine.pytorch.ops.ScaledSReLU",
    "transformer_engine.pytorch.ops.ScaledSiTUGLU",
    "transformer_engine.pytorch.ops.ScaledSwiGLU",
    "transformer_engine.pytorch.ops.Sequential",
    "transformer_engine.pytorch.ops.SiLU",
    "transformer_engine.pytorch.ops.SiTUGLU",
    "transformer_engine.pytorch.ops.SwiGLU",
    "transformer_engine.pytorch.ops.basic",
    "transformer_engine.pytorch.ops.basic.basic_linear.BasicLinear",
    "transformer_engine.pytorch.ops.basic.grouped_linear.GRAD_INPUT_BUFFER_KEY",
    "transformer_engine.pytorch.ops.basic.grouped_linear.OUTPUT_BUFFER_KEY",
    "transformer_engine.pytorch.ops.fused.BackwardActivationBias",
    "transformer_engine.pytorch.ops.fused.BackwardAddRMSNorm",
    "transformer_engine.pytorch.ops.fused.BackwardLinearAdd",
    "transformer_engine.pytorch.ops.fused.BackwardLinearScale",
    "transformer_engine.pytorch.ops.fused.ForwardLinearBiasActivation",
    "transformer_engine.pytorch.ops.fused.ForwardLinearBiasAdd",
    "transformer_engine.pytorch.ops.fused.ForwardLinearScaleAdd",
    "transformer_engine.pytorch.ops.fuser.OperationFuser",
    "transformer_engine.pytorch.ops.register_backward_fusion",
    "transformer_engine.pytorch.ops.register_forward_backward_fusion",
    "transformer_engine.pytorch.ops.register_forward_fusion",
    "transformer_engine.pytorch.prepare_for_saving",
    "transformer_engine.pytorch.quantization",
    "transformer_engine.pytorch.quantization.CustomRecipeState",
    "transformer_engine.pytorch.quantization.DelayedScalingRequest",
    "transformer_engine.pytorch.quantization.FP8GlobalStateManager",
    "transformer_engine.pytorch.quantization.QuantizerRole",
    "transformer_engine.pytorch.quantization._amax_and_scale_update",
    "transformer_engine.pytorch.quantization.autocast",
    "transformer_engine.pytorch.quantization.get_align_size_for_quantization",
    "transformer_engine.pytorch.quantization.get_fp8_torch_dtype",
    "transformer_engine.pytorch.quantized_model_init",
    "transformer_engine.pytorch.quantized_tensor",
    "transformer_engine.pytorch.quantized_tensor.QuantizedTensor",
    "transformer_engine.pytorch.quantized_tensor.Quantizer",
    "transformer_engine.pytorch.quantized_tensor.restore_from_saved",
    "transformer_engine.pytorch.restore_from_func_ctx",
    "transformer_engine.pytorch.restore_from_saved",
    "transformer_engine.pytorch.tensor",
    "transformer_engine.pytorch.tensor.float8_tensor.Float8CurrentScalingQuantizer",
    "transformer_engine.pytorch.tensor.float8_tensor.Float8Quantizer",
    "transformer_engine.pytorch.tensor.utils.replace_raw_data",
    "transformer_engine.pytorch.torch_version",
    "transformer_engine.pytorch.utils.get_device_compute_capability",
    "transformer_engine.pytorch.utils.init_method_normal",
    "transformer_engine.pytorch.utils.is_non_tn_fp8_gemm_supported",
    "transformer_engine.pytorch.utils.scaled_init_method_normal",
    "transformer_engine_torch",
    "transformer_engine_torch.DType",
    "transformer_engine_torch.FP8FwdTensors",
    "transformer_engine_torch.FP8TensorMeta",
    "transformer_engine_torch.fused_amax_and_scale_update_after_reduction",
    "transformer_engine_torch.generic_gemm",
    "transformer_engine_torch.get_cublasLt_version",
    "transformer_engine_torch.quantize",
]

# name -> what is missing. Keep in step with the counts at the end of this file.
NOT_BUILT_YET: dict[str, str] = {
    "transformer_engine.pytorch.ops.ScaledClampedQGeGLU": "the te.ops activation ScaledClampedQGeGLU",
    "transformer_engine.pytorch.ops.ScaledSReLU": "the te.ops activation ScaledSReLU",
    "transformer_engine.pytorch.ops.ScaledSiTUGLU": "the te.ops activation ScaledSiTUGLU",
    "transformer_engine.pytorch.ops.SiTUGLU": "the te.ops activation SiTUGLU",
    "transformer_engine.pytorch.ops.basic.grouped_linear.GRAD_INPUT_BUFFER_KEY": "the buffer keys of ops.basic.grouped_linear",
    "transformer_engine.pytorch.ops.basic.grouped_linear.OUTPUT_BUFFER_KEY": "the buffer keys of ops.basic.grouped_linear",
}

# The exact counts (update both when a name is built).
EXPECTED_PRESENT = 135
EXPECTED_MISSING = 6


def resolve(dotted: str) -> object:
    """Import the longest prefix of ``dotted`` that is a module, then walk the rest as attributes.

    A module that exists but fails to import raises its own error (a real bug, not a missing
    name); only "no module of that name" moves on to a shorter prefix.
    """
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_path = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_path)
        except ModuleNotFoundError as err:
            # err.name is the first module that was not found: the candidate or a parent of it.
            if err.name is not None and (module_path + ".").startswith(err.name + "."):
                continue
            raise
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(f"no importable module prefix in {dotted!r}", name=parts[0])


def _param(name: str):
    if name in NOT_BUILT_YET:
        reason = f"not built yet: {NOT_BUILT_YET[name]}"
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason), id=name)
    return pytest.param(name, id=name)


@pytest.mark.parametrize("name", [_param(name) for name in DROP_IN_NAMES])
def test_upstream_name_resolves(name):
    resolve(name)


def _is_present(name: str) -> bool:
    try:
        resolve(name)
    except (ImportError, AttributeError):
        return False
    return True


def test_missing_list_is_part_of_the_list():
    """Every name in NOT_BUILT_YET is one of the drop-in names (a typo would xfail forever)."""
    assert set(NOT_BUILT_YET) <= set(DROP_IN_NAMES), sorted(set(NOT_BUILT_YET) - set(DROP_IN_NAMES))
    assert len(set(DROP_IN_NAMES)) == len(DROP_IN_NAMES), "a name is listed twice"


def test_present_and_missing_counts():
    """The exact number of drop-in names present and missing today (docs/compatibility.md)."""
    present = [name for name in DROP_IN_NAMES if _is_present(name)]
    missing = sorted(set(DROP_IN_NAMES) - set(present))
    assert len(DROP_IN_NAMES) == 141
    assert missing == sorted(NOT_BUILT_YET)
    assert (len(present), len(missing)) == (EXPECTED_PRESENT, EXPECTED_MISSING)
