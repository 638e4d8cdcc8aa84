"""FP8 gathers in backward under sequence parallelism over 2 gloo processes on the CPU
(run_fp8_grad_gather.py holds the checks: a row-parallel layer's output gradient gathered as
FP8 bytes and a column-parallel layer's saved FP8 shard gathered again, both equal to the
single-process cast, uint8 on the wire, the models bitwise equal to the high-precision-gather
path, and the saved bytes of a column-parallel layer cut to the local shard). NCCL variant:
two GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_fp8_grad_gather as harness  # noqa: E402


def _spawned(rank, world_size, out_dir, init_file):
    harness.worker(rank, world_size, "gloo", out_dir, init_method=f"file://{init_file}")


def test_fp8_backward_gathers_equal_the_high_precision_path(tmp_path):
    mp.spawn(_spawned, args=(2, str(tmp_path), str(tmp_path / "init")), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["cases"] == harness.DIRECT_CASES + len(harness.MODEL_CASES) + 6
        assert result["failures"] == [], "\n".join(result["failures"])


@needs_two_gpus
def test_fp8_backward_gathers_over_nccl(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[2]) + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "run_fp8_grad_gather.py"), "--backend", "nccl", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["failures"] == []


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
