"""Delayed scaling end to end on CPU: quantizers from a recipe state, casts inside te.autocast,
20 steps, against an independent plain-Python model of the recipe."""

import fp8_oracle as oracle
import numpy as np
import pytest
import torch

from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, RecipeState, autocast

STEPS, SLOTS, LENGTH = 20, 3, 4


class ModelOfRecipe:
    """Per-slot history (oldest first, newest last, row 0 the accumulator) and scale."""

    def __init__(self, fp8_max, margin, algo):
        self.rows = [[0.0] * LENGTH for _ in range(SLOTS)]
        self.scales = [np.float32(1.0)] * SLOTS
        self.scaled_max = np.float32(fp8_max * 2.0**-margin)
        self.algo = algo

    def record(self, slot, amax):
        self.rows[slot][0] = max(self.rows[slot][0], amax)

    def update(self):
        for slot in range(SLOTS):
            h = self.rows[slot]
            a = h[0]
            if a == 0.0:
                continue
            candidate = max(h[1:] + [a]) if self.algo == "max" else a
            self.rows[slot] = [0.0] + h[2:] + [a]
            if np.isfinite(candidate) and candidate > 0:
                with np.errstate(over="ignore"):
                    s = self.scaled_max / np.float32(candidate)
                self.scales[slot] = np.float32(np.finfo(np.float32).max) if np.isinf(s) else s


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_twenty_steps_match_an_independent_model(algo, margin):
    recipe = DelayedScaling(
        fp8_format=Format.HYBRID, margin=margin, amax_history_len=LENGTH, amax_compute_algo=algo
    )
    state = RecipeState.create(recipe, mode="forward", num_quantizers=SLOTS, device="cpu")
    quantizers = state.make_quantizers()
    meta = {"recipe": recipe, "fp8_group": None, "scaling_fwd": state}
    model = ModelOfRecipe(448.0, margin, algo)
    g = torch.Generator().manual_seed(margin * 10 + len(algo))
    for step in range(STEPS):
        with autocast(recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
            for slot, quantizer in enumerate(quantizers):
                if (step + slot) % 5 == 4:
                    continue  # this slot is not exercised this step: its amax stays zero
                x = torch.randn(8, 16, generator=g) * (0.5 + step * (slot + 1))
                scale_used = state.scale[slot].clone()
                out = quantizer(x)
                expected = oracle.cast_bytes(x, scale_used, torch.float8_e4m3fn)
                assert torch.equal(out._data, expected)
                assert torch.equal(out._scale_inv, oracle.reciprocal(scale_used))
                model.record(slot, float(x.abs().max()))
        model.update()
        expected_history = torch.tensor(model.rows, dtype=torch.float32).t()
        assert torch.equal(state.amax_history, expected_history), step
        assert torch.equal(state.scale, torch.tensor(model.scales, dtype=torch.float32)), step
    assert not torch.equal(state.scale, torch.ones(SLOTS))
