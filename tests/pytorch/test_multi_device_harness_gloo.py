"""The torchrun harness (tests/pytorch/distributed/run_multi_device_fp8.py) on CPU over gloo:
2 processes x 1 and x 2 devices; every rank prints the same FINAL_HASH and exactly one amax
all_reduce per direction per step."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent / "distributed" / "run_multi_device_fp8.py"


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun not found next to the Python interpreter")  # fmt: skip
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_two_gloo_processes_agree(tmp_path, devices_per_process):
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun if torchrun.exists() else shutil.which("torchrun")),
        "--standalone", "--nproc_per_node=2", str(HARNESS),
        "--backend", "gloo", "--device-type", "cpu",
        "--devices-per-process", str(devices_per_process),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    hashes = re.findall(r"FINAL_HASH ([0-9a-f]{64})", output)
    assert len(hashes) == 2 and hashes[0] == hashes[1], output[-3000:]
    counts = re.findall(r"forward_per_step=([\d,]+) backward_per_step=([\d,]+)", output)
    assert len(counts) == 2
    for forward, backward in counts:
        assert set(forward.split(",")) == {"1"} and set(backward.split(",")) == {"1"}
    assert output.count("PASSED") >= 2
