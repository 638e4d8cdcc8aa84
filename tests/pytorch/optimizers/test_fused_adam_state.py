"""FusedAdam state made by its caller, as Megatron-LM's distributed optimizer makes it before a
checkpoint load (`initialize_state(param)` with one argument, or moments set by hand): the steps
that follow equal those of an optimizer that made its state itself."""

import torch

from transformer_engine.pytorch.optimizers import FusedAdam


def _run(prepare, steps=3, **kwargs):
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(5, 4, generator=gen).bfloat16()) for _ in range(2)]
    opt = FusedAdam(params, lr=1e-2, master_weights=True, **kwargs)
    prepare(opt, params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    return params, opt


def _lazy(opt, params):
    del opt, params


def _initialize(opt, params):
    for p in params:
        opt.initialize_state(p)  # Megatron's init_state_fn: one argument


def _moments_by_hand(opt, params):
    for p in params:
        opt.state[p]["exp_avg"] = torch.zeros(p.shape)
        opt.state[p]["exp_avg_sq"] = torch.zeros(p.shape)


def test_state_made_by_the_caller_steps_like_lazy_state():
    ref, ref_opt = _run(_lazy)
    for prepare in (_initialize, _moments_by_hand):
        params, opt = _run(prepare)
        for p, r in zip(params, ref):
            assert torch.equal(p, r)
            assert torch.equal(
                opt.get_unscaled_state(p, "master_param"),
                ref_opt.get_unscaled_state(r, "master_param"),
            )


def test_initialize_state_keeps_what_is_there_and_defaults_to_the_remainder_setting():
    params, opt = _run(_lazy, steps=1, store_param_remainders=True)
    p = params[0]
    exp_avg = opt.state[p]["exp_avg"]
    opt.initialize_state(p)
    assert opt.state[p]["exp_avg"] is exp_avg  # not reset
    fresh = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt.add_param_group({"params": [fresh]})
    opt.initialize_state(fresh)
    assert opt.state[fresh]["master_param"].dtype == torch.int16
    assert torch.equal(opt.get_unscaled_state(fresh, "master_param"), torch.ones(3))
