"""Upstream's public names for attention, the composed layers, CUDA graphs, the RNG tracker and
the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling) (rows of
upstream's surface owned by those issues), each resolved from upstream's import path,
plus the deeper module paths that upstream code and tests import. Whether each works is tested in
tests/pytorch/attention/ and tests/pytorch/graphs/."""

import pytest
from test_upstream_surface import resolve

COMPOSED_NAMES = [
    "transformer_engine.pytorch.CudaRNGStatesTracker",
    "transformer_engine.pytorch.DotProductAttention",
    "transformer_engine.pytorch.InferenceParams",
    "transformer_engine.pytorch.MultiheadAttention",
    "transformer_engine.pytorch.RotaryPositionEmbedding",
    "transformer_engine.pytorch.TransformerLayer",
    "transformer_engine.pytorch.attention.InferenceParams",
    "transformer_engine.pytorch.make_graphed_callables",
    "transformer_engine.pytorch.utils.attention_mask_func",
    # deeper paths
    "transformer_engine.pytorch.attention.DotProductAttention",
    "transformer_engine.pytorch.attention.MultiheadAttention",
    "transformer_engine.pytorch.attention.RotaryPositionEmbedding",
    "transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb",
    "transformer_engine.pytorch.attention.inference.KVCacheManager",
    "transformer_engine.pytorch.attention.dot_product_attention.backends.UnfusedDotProductAttention",
    "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention._attention_backends",
    "transformer_engine.pytorch.attention.dot_product_attention.utils.get_attention_backend",
    "transformer_engine.pytorch.attention.dot_product_attention.utils.FlashAttentionUtils",
    "transformer_engine.pytorch.attention.dot_product_attention._attention_backends",
    "transformer_engine.pytorch.attention.multi_head_attention.MultiheadAttention",
    "transformer_engine.pytorch.transformer.TransformerLayer",
    "transformer_engine.pytorch.graph.make_graphed_callables",
    "transformer_engine.pytorch.distributed.CudaRNGStatesTracker",
    # Float8BlockScaling
    "transformer_engine.common.recipe.Float8BlockScaling",
    "transformer_engine.pytorch.Float8BlockQuantizer",
    "transformer_engine.pytorch.Float8BlockwiseQTensor",
    "transformer_engine.pytorch.Float8BlockwiseQTensorStorage",
    "transformer_engine.pytorch.is_fp8_block_scaling_available",
    "transformer_engine.pytorch.quantization.Float8BlockScalingRecipeState",
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor.Float8BlockQuantizer",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories.float8_block_scaling_factory",
    # MXFP8BlockScaling
    "transformer_engine.common.recipe.MXFP8BlockScaling",
    "transformer_engine.pytorch.MXFP8Quantizer",
    "transformer_engine.pytorch.MXFP8Tensor",
    "transformer_engine.pytorch.MXFP8TensorStorage",
    "transformer_engine.pytorch.is_mxfp8_available",
    "transformer_engine.pytorch.tensor.mxfp8_tensor.MXFP8Quantizer",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories.mxfp8_factory",
    # NVFP4BlockScaling
    "transformer_engine.common.recipe.NVFP4BlockScaling",
    "transformer_engine.pytorch.NVFP4Quantizer",
    "transformer_engine.pytorch.NVFP4Tensor",
    "transformer_engine.pytorch.NVFP4TensorStorage",
    "transformer_engine.pytorch.is_nvfp4_available",
    "transformer_engine.pytorch.quantization.NVFP4BlockScalingRecipeState",
    "transformer_engine.pytorch.tensor.nvfp4_tensor.NVFP4Quantizer",
    "transformer_engine.pytorch.tensor.nvfp4_tensor.NVFP4Tensor",
    "transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage.NVFP4TensorStorage",
]


@pytest.mark.parametrize("name", COMPOSED_NAMES)
def test_upstream_name_resolves(name):
    resolve(name)


def test_the_top_level_classes_are_the_modules_classes():
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )
    from transformer_engine.pytorch.transformer import TransformerLayer

    assert te.DotProductAttention is DotProductAttention
    assert te.TransformerLayer is TransformerLayer
    assert te.attention.InferenceParams is te.InferenceParams
