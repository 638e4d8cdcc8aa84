"""Real multi-process amax reduction over gloo (2 and 4 processes): identical scales on every
rank, equal to an update computed from the global maximum of each step's amaxes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))

import run_amax_reduction as harness  # noqa: E402

from transformer_engine.pytorch import reference  # noqa: E402


def _spawned(rank, world_size, out_dir, init_file):
    harness.worker(rank, world_size, "gloo", out_dir, init_method=f"file://{init_file}")


def expected_state(world_size):
    histories = [torch.zeros(4, 3) for _ in range(2)]
    scales = [torch.ones(3) for _ in range(2)]
    for step in range(harness.STEPS):
        for m in range(2):
            histories[m][0] = torch.tensor(
                [harness.expected_max(world_size, step, m, i) for i in range(3)]
            )
        reference.delayed_scaling_update(histories, scales, torch.float8_e4m3fn, 1, "max")
    return histories, scales


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_ends_with_the_same_reduced_state(tmp_path, world_size):
    mp.spawn(
        _spawned,
        args=(world_size, str(tmp_path), str(tmp_path / "init")),
        nprocs=world_size,
        join=True,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    histories, scales = expected_state(world_size)
    for result in results:
        for m in range(2):
            got = result[f"module{m}"]
            assert got["device"] == "cpu"
            assert torch.equal(got["scale"], scales[m])
            assert torch.equal(got["amax_history"], histories[m])
    # the reduction mattered: a rank-local update would differ
    assert not torch.equal(scales[0], torch.ones(3))
