"""Tensor and sequence parallelism of ``MultiheadAttention`` / ``TransformerLayer`` /
``DotProductAttention``: 2 gloo processes on the CPU against the single-process module
(run_tensor_parallel_attention.py holds the comparisons and their tolerances), plus the local
shard sizes and the construction / forward errors in one process. The NCCL variant needs two
GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from utils import needs_two_gpus

from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
    DotProductAttention,
)
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.transformer import TransformerLayer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_tensor_parallel_attention as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_parallel_attention_equals_the_single_process_module(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES))


@needs_two_gpus
def test_parallel_attention_over_nccl():
    proc = run_torchrun("run_tensor_parallel_attention.py")
    assert proc.stdout.count("failures=0") == 2, proc.stdout[-4000:]


# --- one process: local shards, partition counts, errors ------------------------------------


def test_local_shards_without_a_group():
    layer = TransformerLayer(64, 128, 4, num_gqa_groups=2, tp_size=2, set_parallel_mode=True,
                             sequence_parallel=True, device="cpu")  # fmt: skip
    attn = layer.self_attention
    assert (attn.num_attention_heads_per_partition, attn.num_gqa_groups_per_partition) == (2, 1)
    core = attn.core_attention
    assert (core.num_attention_heads_per_partition, core.num_gqa_groups_per_partition) == (2, 1)
    qkv = attn.layernorm_qkv
    assert qkv.query_weight.shape == (32, 64) and qkv.key_weight.shape == (16, 64)
    assert qkv.query_weight.partition_dim == 0 and qkv.layer_norm_weight.sequence_parallel
    assert attn.proj.weight.shape == (64, 32) and attn.proj.weight.partition_dim == 1
    assert attn.proj.bias.sequence_parallel
    mlp = layer.layernorm_mlp
    assert mlp.fc1_weight.shape == (64, 64) and mlp.fc2_weight.shape == (64, 64)
    assert layer.sequence_parallel and attn.sequence_parallel and mlp.sequence_parallel
    assert (
        TransformerLayer(64, 128, 4, sequence_parallel=True, device="cpu").sequence_parallel
        is False
    )  # fmt: skip  (only effective with more than one rank)


def test_meta_construction_materializes_the_shards():
    mha = MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True, input_layernorm=True,
                             device="meta")  # fmt: skip
    assert mha.layernorm_qkv.query_weight.is_meta
    mha.reset_parameters()
    assert mha.layernorm_qkv.query_weight.device.type != "meta"
    assert mha.layernorm_qkv.query_weight.shape == (32, 64)
    assert mha.proj.weight.shape == (64, 32)


def test_dot_product_attention_checks_partition_heads():
    core = DotProductAttention(4, 8, num_gqa_groups=2, tp_size=2, qkv_format="sbhd",
                               attn_mask_type="no_mask")  # fmt: skip
    q = torch.randn(3, 1, 2, 8)
    k = v = torch.randn(3, 1, 1, 8)
    out = core(q, k, v)
    assert out.shape == (3, 1, 16)
    # Oracle: one K/V head shared by both local query heads, softmax(q k^T / sqrt(d)) v.
    qd, kd, vd = q.double()[:, 0], k.double()[:, 0, 0], v.double()[:, 0, 0]
    scores = torch.einsum("shd,td->hst", qd, kd) / 8**0.5
    want = torch.einsum("hst,td->shd", scores.softmax(-1), vd).reshape(3, 16)
    torch.testing.assert_close(out[:, 0].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="query_layer has 4 heads"):
        core(torch.randn(3, 1, 4, 8), k, v)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: DotProductAttention(6, 8, tp_size=4), "num_attention_heads=6 is not divisible"),
        (lambda: DotProductAttention(4, 8, num_gqa_groups=1, tp_size=2),
         "num_gqa_groups=1 is not divisible by tp_size=2"),
        (lambda: MultiheadAttention(64, 4, tp_size=3, set_parallel_mode=True, device="cpu"),
         "num_attention_heads=4 is not divisible by tp_size=3"),
        (lambda: MultiheadAttention(64, 4, num_gqa_groups=1, tp_size=2, set_parallel_mode=True,
                                    device="cpu"), "num_gqa_groups=1 is not divisible"),
        (lambda: MultiheadAttention(64, 4, tp_size=2, device="cpu"),
         "needs set_parallel_mode=True"),
        (lambda: TransformerLayer(60, 128, 6, tp_size=4, set_parallel_mode=True, device="cpu"),
         "num_attention_heads=6 is not divisible by tp_size=4"),
        (lambda: TransformerLayer(64, 128, 4, tp_size=0, device="cpu"), "tp_size=0"),
    ],
)  # fmt: skip
def test_construction_errors(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_comm_overlap_flags_reach_the_projections():
    """``ub_tp_comm_overlap`` hands the ``ub_*`` flags down: the QKV projection (``"qkv"``)
    pipelines its gather and its input gradient's reduce-scatter, the output projection
    (``"proj"``) its reduce-scatter and its output gradient's gather, the MLP both."""
    kw = dict(tp_size=2, set_parallel_mode=True, sequence_parallel=True, seq_length=16,
              device="cpu")  # fmt: skip
    layer = TransformerLayer(64, 128, 4, ub_tp_comm_overlap=True, ub_overlap_rs_dgrad=True, **kw)
    qkv = layer.self_attention.layernorm_qkv.comm_overlap
    proj = layer.self_attention.proj.comm_overlap
    mlp = layer.layernorm_mlp.comm_overlap
    assert (qkv.name, qkv.ag_fprop, qkv.rs_dgrad, qkv.rs_fprop) == ("qkv", True, True, False)
    assert (proj.name, proj.rs_fprop, proj.ag_dgrad, proj.ag_fprop) == ("proj", True, True, False)
    assert (mlp.ag_fprop, mlp.rs_fprop, mlp.rs_dgrad, mlp.ag_dgrad) == (True, True, True, True)
    # without ub_tp_comm_overlap the ub_* defaults (True) do nothing
    assert TransformerLayer(64, 128, 4, **kw).self_attention.proj.comm_overlap is None
    mha = MultiheadAttention(64, 4, ub_overlap_rs=True, **kw)
    assert mha.proj.comm_overlap.rs_fprop and mha.qkv.comm_overlap is None


def test_forward_errors_without_a_group():
    layer = TransformerLayer(64, 128, 4, tp_size=2, set_parallel_mode=True,
                             sequence_parallel=True, seq_length=16, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="seq_length // tp_size = 16 // 2 = 8"):
        layer(torch.randn(16, 2, 64))
    with pytest.raises(RuntimeError, match="no tensor-parallel group is set"):
        layer(torch.randn(8, 2, 64))
    mha = MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True, device="cpu")
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        mha(torch.randn(8, 2, 64))
