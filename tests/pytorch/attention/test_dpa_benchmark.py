"""benchmarks/attention/benchmark_attention.py stays runnable: it is timed on the GPU machine
only; here it must import cleanly and refuse without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "attention" / "benchmark_attention.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script would run in full")
def test_attention_benchmark_refuses_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "needs a CUDA GPU" in result.stderr
