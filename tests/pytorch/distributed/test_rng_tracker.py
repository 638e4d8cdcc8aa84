"""CudaRNGStatesTracker: named streams that replay a seeded generator, leave the default stream
alone, restore, refuse duplicates; and activation recompute that forks them as in forward.

The oracle for a stream is a fresh ``torch.Generator`` seeded the same way and drawn from with
the same calls. The tracked generator is the current CUDA device's where CUDA exists, else the
CPU's, so the draws below go to ``DEVICE``.
"""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.distributed import (
    CudaRNGStatesTracker,
    checkpoint,
    get_all_rng_states,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def draws(count=2, generator=None):
    return [torch.rand(5, device=DEVICE, generator=generator) for _ in range(count)]


def seeded_draws(seed, count=2):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return draws(count, generator)


def test_fork_replays_the_seeded_stream_and_continues_it():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    expected = seeded_draws(1234, 3)
    with tracker.fork():
        first = draws(2)
    with tracker.fork("model-parallel-rng"):
        (third,) = draws(1)  # continues where the last fork stopped
    torch.testing.assert_close(first + [third], expected, rtol=0, atol=0)


def test_add_and_fork_leave_the_default_stream_alone():
    torch.manual_seed(7)
    expected = draws(2)
    torch.manual_seed(7)
    tracker = CudaRNGStatesTracker()
    (before,) = draws(1)
    tracker.add("a", 99)
    with tracker.fork("a"):
        draws(3)
    (after,) = draws(1)
    torch.testing.assert_close([before, after], expected, rtol=0, atol=0)


def test_get_and_set_states_rewind_a_stream():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 5)
    tracker.add("b", 6)
    saved = tracker.get_states()
    assert set(saved) == {"a", "b"}
    with tracker.fork("a"):
        (first,) = draws(1)
    tracker.set_states(saved)
    with tracker.fork("a"):
        (again,) = draws(1)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(first, seeded_draws(5, 1)[0], rtol=0, atol=0)


def test_duplicates_unknown_names_and_reset():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(RuntimeError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(RuntimeError, match="cuda rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="not added"):
        with tracker.fork("missing"):
            pass
    assert set(get_all_rng_states()) == {"a"}
    tracker.reset()
    assert tracker.get_states() == {} and not tracker.seeds_
    tracker.add("a", 1)  # both free again


def test_fork_restores_on_exception():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 3)
    torch.manual_seed(11)
    expected = draws(1)
    torch.manual_seed(11)
    with pytest.raises(ValueError):
        with tracker.fork("a"):
            draws(1)
            raise ValueError("inside the region")
    torch.testing.assert_close(draws(1), expected, rtol=0, atol=0)


def test_module_initialization_forks_the_named_stream():
    def build(seed):
        tracker = CudaRNGStatesTracker()
        tracker.add("init", seed)
        return te.Linear(
            8, 4, get_rng_state_tracker=lambda: tracker, rng_tracker_name="init", device=DEVICE
        ).weight.detach()

    torch.manual_seed(0)
    first = build(10)
    torch.manual_seed(1)  # a different default stream changes nothing
    torch.testing.assert_close(build(10), first, rtol=0, atol=0)
    assert not torch.equal(build(11), first)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recompute_forks_the_forward_states(use_reentrant):
    def region(x, tracker):
        with tracker.fork():
            return torch.nn.functional.dropout(x * 2.0, p=0.5, training=True)

    def gradient_and_next_draw(checkpointed: bool):
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 42)
        x = torch.randn(64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
        x.requires_grad_()
        if checkpointed:
            out = checkpoint(
                region, x, tracker, get_rng_state_tracker=lambda: tracker,
                use_reentrant=use_reentrant,
            )  # fmt: skip
        else:
            out = region(x, tracker)
        out.sum().backward()
        with tracker.fork():  # the stream continues after the forward's draws only
            return x.grad, draws(1)[0]

    plain = gradient_and_next_draw(False)
    recomputed = gradient_and_next_draw(True)
    assert plain[0].eq(0).any() and plain[0].ne(0).any()  # dropout did drop
    torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)
