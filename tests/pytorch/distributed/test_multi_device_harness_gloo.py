"""The multi-process FP8 harness (tests/pytorch/distributed/run_multi_device_fp8.py) on the CPU.

Runs it through torchrun as a subprocess, 2 processes over gloo with 1 and with 2 ('cpu')
devices per process, 10 FP8 steps each, and checks what it printed: exit code 0, both ranks
passed their own checks, both printed the same FINAL_HASH (also through check_hashes.py), and
exactly one amax all_reduce per direction per step. The subprocess imports the same
transformer_engine as this test (its folder goes first on PYTHONPATH). About 15 s in all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from utils import describe_process

import transformer_engine

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "run_multi_device_fp8.py"
ITERS = 10
NPROC = 2

sys.path.insert(0, str(HERE))

import check_hashes  # noqa: E402

COUNTS = re.compile(
    r"^\[default(?P<local_rank>\d+)\]:AMAX_ALL_REDUCE_COUNTS rank=(?P<rank>\d+) "
    r"steps=(?P<steps>\d+) forward_per_step=(?P<fwd>[\d,]+) backward_per_step=(?P<bwd>[\d,]+) "
    r"forward_total=(?P<fwd_total>\d+) backward_total=(?P<bwd_total>\d+) "
    r"grad_all_reduce_total=(?P<grad_total>\d+) expected_per_step=(?P<expected>\d+)$",
    re.MULTILINE,
)
HASH = re.compile(
    r"^\[default(?P<local_rank>\d+)\]:FINAL_HASH (?P<hash>[0-9a-f]{64})$", re.MULTILINE
)


def run_harness(workdir: Path, devices_per_process: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    te_root = str(Path(transformer_engine.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (te_root, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={NPROC}", "--tee", "3", "--log-dir", str(workdir / "torchrun"),
        str(HARNESS), "--backend", "gloo", "--device-type", "cpu",
        "--devices-per-process", str(devices_per_process), "--iters", str(ITERS),
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240
    )
    (workdir / "console.log").write_text(proc.stdout)
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{devices_per_process: (workdir, completed process)}``, each configuration run once."""
    done = {}

    def get(devices_per_process: int):
        if devices_per_process not in done:
            workdir = tmp_path_factory.mktemp(f"harness_{NPROC}x{devices_per_process}")
            done[devices_per_process] = (workdir, run_harness(workdir, devices_per_process))
        return done[devices_per_process]

    return get


@pytest.mark.parametrize("devices_per_process", [1, 2], ids=["2x1", "2x2"])
def test_both_ranks_agree_with_one_amax_all_reduce_per_direction_per_step(
    runs, devices_per_process
):
    workdir, proc = runs(devices_per_process)
    assert proc.returncode == 0, describe_process(proc)
    out = proc.stdout
    for rank in range(NPROC):
        assert f"HARNESS rank={rank} PASSED" in out, describe_process(proc)
        assert f"devices {['cpu'] * devices_per_process}" in out, describe_process(proc)
    assert "CHECK FAILED" not in out, describe_process(proc)

    hashes = {int(m["local_rank"]): m["hash"] for m in HASH.finditer(out)}
    assert sorted(hashes) == list(range(NPROC)), describe_process(proc)
    assert len(set(hashes.values())) == 1, hashes
    # the checker agrees, on the console log and on torchrun's per-rank log files
    for source in (workdir / "console.log", workdir / "torchrun"):
        found = check_hashes.collect([source])
        assert check_hashes.problems(found, NPROC) == [], found
        assert {h for _, h, _ in found} == set(hashes.values())

    counts = {int(m["rank"]): m for m in COUNTS.finditer(out)}
    assert sorted(counts) == list(range(NPROC)), describe_process(proc)
    one_per_step = ",".join(["1"] * ITERS)
    for m in counts.values():
        assert m["steps"] == str(ITERS) and m["expected"] == "1"
        assert m["fwd"] == one_per_step and m["bwd"] == one_per_step, m.group(0)
        assert m["fwd_total"] == m["bwd_total"] == m["grad_total"] == str(ITERS), m.group(0)


def test_splitting_over_devices_does_not_change_the_result(runs):
    """On the CPU the 'devices' of a process are all the CPU, so 2x1 and 2x2 compute the same
    thing through different placements: the hashes must be equal."""
    hashes = []
    for devices_per_process in (1, 2):
        _, proc = runs(devices_per_process)
        assert proc.returncode == 0, describe_process(proc)
        hashes.append({m["hash"] for m in HASH.finditer(proc.stdout)})
    assert len(hashes[0]) == 1 and hashes[0] == hashes[1], hashes


def test_check_hashes_rejects_disagreement_missing_ranks_and_repeats(tmp_path):
    a, b = "a" * 64, "b" * 64
    cases = {
        "agree.log": (f"[default0]:FINAL_HASH {a}\n[default1]:FINAL_HASH {a}\n", 0),
        "plain.log": (f"noise\nFINAL_HASH {a}\nFINAL_HASH {a}\n", 0),
        "disagree.log": (f"[default0]:FINAL_HASH {a}\n[default1]:FINAL_HASH {b}\n", 1),
        "missing.log": (f"[default0]:FINAL_HASH {a}\n", 1),
        "repeat.log": (f"[default0]:FINAL_HASH {a}\n[default0]:FINAL_HASH {a}\n", 1),
        "empty.log": ("rank 0: crashed before the end\n", 1),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        assert check_hashes.main(["--world-size", "2", str(tmp_path / name)]) == expected, name
    assert check_hashes.main([str(tmp_path / "nothing_here")]) == 1
