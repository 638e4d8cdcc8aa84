"""Real multi-process amax reduction over gloo (2 and 4 processes): identical scales on every
rank, equal to an update computed from the global maximum of each step's amaxes."""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_amax_reduction as harness  # noqa: E402


def _spawned(rank, world_size, out_dir, init_file):
    harness.worker(rank, world_size, "gloo", out_dir, init_method=f"file://{init_file}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_ends_with_the_same_reduced_state(tmp_path, world_size):
    mp.spawn(
        _spawned,
        args=(world_size, str(tmp_path), str(tmp_path / "init")),
        nprocs=world_size,
        join=True,
    )
    harness.check_results(str(tmp_path), world_size)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    assert {results[r][f"module{m}"]["device"] for r in range(world_size) for m in range(2)} == {
        "cpu"
    }
    # the reduction mattered: rank 0's local amaxes alone give a different state
    _, local_scales = harness.expected_state(1)
    _, reduced_scales = harness.expected_state(world_size)
    assert not torch.equal(local_scales[0], reduced_scales[0])
