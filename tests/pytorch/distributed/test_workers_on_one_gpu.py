"""The multi-process workers of this folder with both ranks on one GPU: a gloo process group
whose two ranks compute on cuda:0 (``tp_harness.GLOO_ON_ONE_GPU``).

The gloo tests run the workers on the CPU, where the reference paths compute; their NCCL
variants need two GPUs. Here the same checks run with the native kernels on a machine of one
GPU: FP8 casts and GEMMs through cuBLAS, the norm and activation kernels writing a
tensor-parallel linear's FP8 input, the block-scaled casts, the overlapped backward's
asynchronous collectives on CUDA tensors, the GEMMs pipelined chunk by chunk with their
collectives (FP8 chunks written into their rows of the output by cuBLAS). Skipped without CUDA; the GPU suite runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from utils import needs_cuda

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_backward_overlap  # noqa: E402
import run_block_gather  # noqa: E402
import run_comm_gemm_overlap  # noqa: E402
import run_fp8_gather  # noqa: E402
import run_fp8_grad_gather  # noqa: E402
import run_grouped_linear_tp  # noqa: E402
import run_ops_tensor_parallel  # noqa: E402
import run_tensor_parallel  # noqa: E402
import run_tensor_parallel_attention  # noqa: E402
import run_tensor_parallel_options  # noqa: E402
from tp_harness import GLOO_ON_ONE_GPU, check_gloo_run  # noqa: E402

# worker module -> the cases its worker reports (as its gloo test counts them)
WORKERS = {
    "tensor_parallel": (run_tensor_parallel, len(run_tensor_parallel.CASES)),
    "tensor_parallel_options": (
        run_tensor_parallel_options,
        len(run_tensor_parallel_options.CASES),
    ),
    "ops_tensor_parallel": (run_ops_tensor_parallel, len(run_ops_tensor_parallel.CASES) + 1),
    "backward_overlap": (run_backward_overlap, len(run_backward_overlap.CASES)),
    # (gloo's point-to-point transfers go through host copies of the CUDA chunks)
    "comm_gemm_overlap": (run_comm_gemm_overlap, len(run_comm_gemm_overlap.CASES)),
    "tensor_parallel_attention": (
        run_tensor_parallel_attention,
        len(run_tensor_parallel_attention.CASES),
    ),
    "grouped_linear_tp": (run_grouped_linear_tp, len(run_grouped_linear_tp.CASES)),
    "fp8_gather": (run_fp8_gather, 4 + len(run_fp8_gather.MODEL_CASES)),
    "fp8_grad_gather": (
        run_fp8_grad_gather,
        run_fp8_grad_gather.DIRECT_CASES + len(run_fp8_grad_gather.MODEL_CASES) + 6,
    ),
    "block_gather": (
        run_block_gather,
        run_block_gather.DIRECT_CASES + len(run_block_gather.MODEL_CASES) + 4,
    ),
}


@needs_cuda
@pytest.mark.parametrize("name", sorted(WORKERS))
def test_worker_with_both_ranks_on_one_gpu(tmp_path, name):
    module, cases = WORKERS[name]
    check_gloo_run(module.worker, tmp_path, cases, backend=GLOO_ON_ONE_GPU)
