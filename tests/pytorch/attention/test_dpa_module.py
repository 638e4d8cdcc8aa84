"""DotProductAttention as a module on CPU: argument errors, dropout and its RNG, recompute
(``checkpoint_core_attention``), FP8 autocast, deferred initialization and checkpoints."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from test_dpa_numerics import (
    FP32_TOL,
    bhsd,
    oracle_attention,
    oracle_keep,
    oracle_output,
    random_qkv,
)
from utils import materialization_device

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention


class CpuRngTracker:
    """A minimal RNG tracker (upstream's interface: fork, get_states, set_states) over the
    CPU generator: ``fork()`` runs its body on the tracker's own stream of random numbers."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.states = {"model-parallel-rng": generator.get_state()}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

    def get_states(self):
        return dict(self.states)

    def set_states(self, states) -> None:
        self.states = dict(states)


# --- errors --------------------------------------------------------------------------------------
def test_constructor_errors():
    with pytest.raises(ValueError, match="attn_mask_type='bogus'"):
        DotProductAttention(2, 4, attn_mask_type="bogus")
    with pytest.raises(ValueError, match="num_gqa_groups=3"):
        DotProductAttention(4, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="qkv_format"):
        DotProductAttention(2, 4, qkv_format="hsbd")
    with pytest.raises(ValueError, match="softmax_type"):
        DotProductAttention(2, 4, softmax_type="sparse")
    with pytest.raises(ValueError, match="num_attention_heads=2 is not divisible by tp_size=4"):
        DotProductAttention(2, 4, tp_size=4)
    with pytest.raises(ValueError, match="num_gqa_groups=1 is not divisible by tp_size=2"):
        DotProductAttention(2, 4, num_gqa_groups=1, tp_size=2)
    with pytest.raises(ValueError, match="attention_type"):
        DotProductAttention(2, 4, attention_type="both")


def test_mask_type_spellings():
    assert (
        DotProductAttention(2, 4, attn_mask_type="causal,padding").attn_mask_type
        == "padding_causal"
    )
    assert (
        DotProductAttention(2, 4, attn_mask_type="padding,causal").attn_mask_type
        == "padding_causal"
    )
    dpa = DotProductAttention(2, 4, attn_mask_type="causal_padding_bottom_right")
    assert dpa.attn_mask_type == "padding_causal_bottom_right"


def test_forward_errors():
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="attn_mask_type='nonsense'"):
        dpa(q, q, q, attn_mask_type="nonsense")
    with pytest.raises(
        ValueError, match="3 heads but the module was built with num_attention_heads=2"
    ):
        dpa(torch.randn(1, 3, 3, 4), q, q)
    with pytest.raises(ValueError, match="num_gqa_groups=2"):
        dpa(q, torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(ValueError, match="kv_channels"):
        dpa(torch.randn(1, 3, 2, 8), q, q)
    with pytest.raises(TypeError, match="dtypes differ"):
        dpa(q, q.double(), q)
    with pytest.raises(ValueError, match="missing"):
        dpa(q, q)
    with pytest.raises(ValueError, match="dimensions"):
        dpa(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="bool"):
        dpa(q, q, q, attn_mask_type="padding", attention_mask=torch.zeros(1, 1, 1, 3))
    with pytest.raises(TypeError, match="bool"):
        dpa(q, q, q, attn_mask_type="arbitrary", attention_mask=torch.zeros(1, 1, 3, 3))
    with pytest.raises(ValueError, match="needs attention_mask"):
        dpa(q, q, q, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="padding attn_mask_type needs attention_mask"):
        dpa(q, q, q, attn_mask_type="padding")
    with pytest.raises(NotImplementedError, match="num_splits"):
        dpa(q, q, q, num_splits=2)
    thd = DotProductAttention(2, 4, qkv_format="thd", attn_mask_type="causal")
    with pytest.raises(ValueError, match="padding attn_mask_type"):
        thd(q[0], q[0], q[0], cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        thd(q[0], q[0], q[0], attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 3]),
            cu_seqlens_kv=torch.tensor([0, 3]))  # fmt: skip


# --- dropout -------------------------------------------------------------------------------------
def identity_values(s):
    """``[1, s, 1, s]`` values equal to the identity: the output rows are the probabilities."""
    return torch.eye(s).view(1, s, 1, s)


def test_dropout_drops_and_rescales_probabilities():
    s, p = 32, 0.25
    q, k, _ = random_qkv(1, s, s, 1, 1, s, seed=21)
    v = identity_values(s)
    dpa = DotProductAttention(1, s, qkv_format="bshd", attn_mask_type="causal", attention_dropout=p)
    torch.manual_seed(0)
    out = dpa(q, k, v).detach().view(s, s).double()
    keep = oracle_keep(1, s, s, mask_type="causal")
    probs = oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep).view(s, s)
    dropped = out == 0
    kept_positions = keep.view(s, s)
    torch.testing.assert_close(out[~dropped], probs[~dropped] / (1 - p), **FP32_TOL)
    fraction = (dropped & kept_positions).sum() / kept_positions.sum()
    assert 0.15 < fraction < 0.35, f"dropped {fraction:.2f} of the kept probabilities (p={p})"
    dpa.eval()  # no dropout outside training
    torch.testing.assert_close(dpa(q, k, v).detach().view(s, s).double(), probs, **FP32_TOL)


def test_dropout_rng_reproducible_and_tracker_forked():
    s = 16
    q, k, _ = random_qkv(1, s, s, 2, 2, s, seed=22)
    v = identity_values(s).expand(1, s, 2, s).contiguous()
    plain = DotProductAttention(2, s, qkv_format="bshd", attention_dropout=0.5)
    torch.manual_seed(5)
    first = plain(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(plain(q, k, v), first), "same seed, same dropout mask"
    assert not torch.equal(plain(q, k, v), first), "the default generator advanced"
    outside = torch.get_rng_state()
    tracked = DotProductAttention(2, s, qkv_format="bshd", attention_dropout=0.5,
                                  get_rng_state_tracker=lambda: tracker)  # fmt: skip
    tracker = CpuRngTracker(seed=7)
    with_tracker = tracked(q, k, v)
    assert torch.equal(torch.get_rng_state(), outside), "dropout ran on the tracker's stream"
    tracker = CpuRngTracker(seed=7)
    assert torch.equal(tracked(q, k, v), with_tracker)


# --- recompute -----------------------------------------------------------------------------------
def test_checkpoint_core_attention_gradients_against_oracle():
    b, s, h, d = 2, 5, 2, 4
    q, k, v = random_qkv(b, s, s, h, h, d, seed=23)
    dpa = DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type="causal")
    calls = []
    dpa.unfused_attention.register_forward_pre_hook(lambda *_: calls.append(1))
    qs, ks, vs = (t.detach().transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
    out = dpa(qs, ks, vs, checkpoint_core_attention=True)
    keep = oracle_keep(b, s, s, mask_type="causal")
    expected = oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v), keep=keep), "sbhd")
    torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    grad = torch.randn_like(expected)
    out.backward(grad.float())
    expected.backward(grad)
    assert len(calls) == 2, "the attention ran again in backward"
    for mine, ref in ((qs, q), (ks, k), (vs, v)):
        torch.testing.assert_close(mine.grad.transpose(0, 1).double(), ref.grad.double(),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("use_tracker", [False, True])
def test_checkpoint_core_attention_replays_dropout(use_tracker):
    s, h, d = 8, 2, 4
    q, k, v = random_qkv(2, s, s, h, h, d, seed=24)
    trackers = {}
    get_tracker = (lambda: trackers["t"]) if use_tracker else None
    dpa = DotProductAttention(h, d, qkv_format="bshd", attention_dropout=0.5,
                              get_rng_state_tracker=get_tracker)  # fmt: skip
    grads = []
    for recompute in (False, True):
        trackers["t"] = CpuRngTracker(seed=3)
        torch.manual_seed(9)
        for t in (q, k, v):
            t.grad = None
        out = dpa(q, k, v, checkpoint_core_attention=recompute)
        torch.manual_seed(123)  # backward must not depend on the generator's state by then
        out.backward(torch.ones_like(out))
        grads.append([t.grad.clone() for t in (q, k, v)])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


# --- FP8 autocast --------------------------------------------------------------------------------
def test_runs_in_high_precision_inside_fp8_autocast():
    q, k, v = random_qkv(1, 4, 4, 2, 2, 4, seed=25)
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    reference = dpa(q, k, v)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        inside = dpa(q, k, v)
    assert torch.equal(inside, reference)


@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_fp8_attention_flags_run_fp8_attention(flag):
    q, k, v = random_qkv(1, 4, 4, 2, 2, 4, seed=26)
    dpa = DotProductAttention(2, 4, qkv_format="bshd")
    reference = dpa(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation is announced
        with te.autocast(enabled=True, recipe=DelayedScaling(**{flag: True})):
            out = dpa(q, k, v)
    assert not torch.equal(out, reference)  # FP8-rounded (test_fp8_attention.py: the numbers)
    torch.testing.assert_close(out, reference, rtol=0.2, atol=0.2)


# --- deferred initialization and checkpoints -----------------------------------------------------
def test_meta_init_and_state_dict():
    dpa = DotProductAttention(3, 4, softmax_type="learnable", device="meta")
    assert dpa.softmax_offset.is_meta
    dpa.reset_parameters()  # materializes where a module without device= would be built
    assert dpa.softmax_offset.device == materialization_device()
    assert torch.equal(dpa.softmax_offset.detach().cpu(), torch.zeros(3))
    keys = list(dpa.state_dict().keys())
    assert keys == ["softmax_offset", "_extra_state"]
    with torch.device("meta"):
        deferred = DotProductAttention(3, 4, softmax_type="learnable")
    assert deferred.softmax_offset.is_meta
    deferred.to_empty(device="cpu")
    deferred.load_state_dict({"softmax_offset": torch.tensor([1.0, 2.0, 3.0]),
                              "_extra_state": None})  # fmt: skip
    assert torch.equal(deferred.softmax_offset.detach(), torch.tensor([1.0, 2.0, 3.0]))
    plain = DotProductAttention(3, 4)
    assert list(plain.state_dict().keys()) == ["_extra_state"]
    assert list(plain.parameters()) == []


def test_softmax_offset_attribute_of_the_fixed_softmax_types():
    """As upstream: ``softmax_offset`` is None for vanilla and a zero float32 tensor [heads]
    for off-by-one, neither a parameter nor in the state dict; built on meta, it is zeros on the
    materialization device after reset_parameters()."""
    assert DotProductAttention(3, 4).softmax_offset is None
    dpa = DotProductAttention(3, 4, softmax_type="off-by-one", device="cpu")
    assert torch.equal(dpa.softmax_offset, torch.zeros(3, dtype=torch.float32))
    assert list(dpa.parameters()) == []
    assert list(dpa.state_dict().keys()) == ["_extra_state"]
    meta = DotProductAttention(3, 4, softmax_type="off-by-one", device="meta")
    assert meta.softmax_offset.is_meta
    meta.reset_parameters()
    assert meta.softmax_offset.device == materialization_device()
    assert torch.equal(meta.softmax_offset.cpu(), torch.zeros(3))


def test_meta_module_refuses_to_run():
    dpa = DotProductAttention(2, 4, softmax_type="learnable", device="meta", qkv_format="bshd")
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="softmax_offset is on meta"):
        dpa(q, q, q)


def test_layer_number_and_attributes():
    dpa = DotProductAttention(4, (8, 6), num_gqa_groups=2)
    assert dpa.layer_number == 1
    assert (dpa.hidden_size_per_attention_head_k, dpa.hidden_size_per_attention_head_v) == (8, 6)
    assert dpa.num_gqa_groups == 2 and dpa.softmax_scale == 8**-0.5
    assert dpa.window_size == (-1, 0)
    assert {n for n, _ in dpa.named_children()} == {
        "flash_attention",
        "fused_attention",
        "unfused_attention",
    }
