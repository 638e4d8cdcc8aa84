"""The training example (examples/pytorch/train_transformer_fp8.py) end to end, on the CPU.

Each test runs the script as a subprocess with the interpreter running pytest, so it imports the
same transformer_engine the suite tests (the script falls back to the source tree only when
``import transformer_engine`` fails). Tiny configurations keep the file at a few seconds per run.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from utils import REPO_ROOT, describe_process

SCRIPT = REPO_ROOT / "examples" / "pytorch" / "train_transformer_fp8.py"
TINY = [
    "--steps", "4", "--layers", "1", "--hidden", "32", "--ffn", "64", "--heads", "2",
    "--seq-len", "16", "--batch-size", "2",
]  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROW = re.compile(
    r"^(?P<label>FP8 \(HYBRID\)|BF16 \(no FP8\)|FP32 \(no FP8\))\s+"
    r"(?P<final>\d+\.\d+)\s+(?P<mean>\d+\.\d+)\s+(?P<tps>[\d,]+)\s+(?P<secs>\d+\.\d+)\s*$",
    re.MULTILINE,
)


def run_example(*args: str, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_tiny_cpu_run_prints_the_table_and_writes_a_png(tmp_path):
    out = tmp_path / "plots" / "curves.png"
    proc = run_example(*TINY, "--device", "cpu", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, describe_process(proc)
    stdout = proc.stdout

    assert stdout.startswith("transformer_engine "), describe_process(proc)  # native_status() first
    assert "identical initial weights in both runs: True" in stdout
    assert re.search(r"block 0 \(LayerNormLinear, Linear, LayerNormMLP\)\s+-> cpu", stdout)
    assert "FP8 state placement: OK" in stdout, describe_process(proc)

    assert "=== FP8 vs high precision: comparison ===" in stdout, describe_process(proc)
    rows = {m["label"]: m for m in ROW.finditer(stdout)}
    assert set(rows) == {"FP8 (HYBRID)", "BF16 (no FP8)"}, describe_process(proc)
    for row in rows.values():
        final, mean = float(row["final"]), float(row["mean"])
        assert math.isfinite(final) and 0.0 < final < 10.0
        assert math.isfinite(mean) and 0.0 < mean < 10.0
        assert int(row["tps"].replace(",", "")) > 0
    assert re.search(r"^FP8 vs BF16\s+[+-]\d+\.\d+%\s+[+-]\d+\.\d+%\s+x\d+\.\d+", stdout, re.M)

    assert f"loss curves written to {out}" in stdout
    assert out.is_file()
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000


def test_no_plot_and_fp32_override(tmp_path):
    proc = run_example(
        *TINY, "--device", "cpu", "--hp-dtype", "fp32", "--no-plot", "--steps", "2", cwd=tmp_path
    )
    assert proc.returncode == 0, describe_process(proc)
    rows = {m["label"] for m in ROW.finditer(proc.stdout)}
    assert rows == {"FP8 (HYBRID)", "FP32 (no FP8)"}, describe_process(proc)
    assert "loss curves written" not in proc.stdout
    assert not (tmp_path / "fp8_vs_bf16_loss.png").exists()
    assert list(tmp_path.iterdir()) == []


def test_sizes_that_fp8_gemms_cannot_take_are_refused(tmp_path):
    proc = run_example(*TINY, "--device", "cpu", "--hidden", "40", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, describe_process(proc)
    assert "--hidden 40: FP8 GEMMs need a multiple of 16" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "split"])
def test_cuda_devices_without_cuda_exit_with_a_message(tmp_path, device):
    proc = run_example(*TINY, "--device", device, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0, describe_process(proc)
    assert f"--device {device} was requested but CUDA is not available" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "comparison" not in proc.stdout
