"""te.distributed.checkpoint(..., distribute_saved_activations=True, tp_group=...) on 2 gloo
processes: between forward and backward the region's first input holds only this rank's half
of its elements; the recompute all-gathers it, so outputs, the input gradient, the weight
gradients and (delayed scaling) the FP8 state are bitwise those of the same region run without
recompute, with dropout's mask drawn again from the forward's RNG state; the input is whole again
after backward. Inputs the group cannot split equally and use_reentrant=False are refused."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

TOKENS, HIDDEN, FFN = 16, 32, 64


def _region(group):
    torch.manual_seed(0)
    col = te.Linear(HIDDEN, FFN, tp_group=group, tp_size=2, parallel_mode="column", device="cpu")
    row = te.Linear(FFN, HIDDEN, tp_group=group, tp_size=2, parallel_mode="row", device="cpu")
    return torch.nn.ModuleList([col, row])


def _run(layers, x):
    h = torch.nn.functional.dropout(torch.nn.functional.gelu(layers[0](x)), p=0.3)
    return layers[1](h)


def _fp8_state(layers):
    return [
        t.clone()
        for m in layers
        for key in ("scaling_fwd", "scaling_bwd")
        if key in m.fp8_meta
        for t in (m.fp8_meta[key].scale, m.fp8_meta[key].amax_history)
    ]


def _check(group, recipe, lines, name):
    plain, ckpt = _region(group), _region(group)  # the same seed: the same parameters
    torch.manual_seed(7)
    x = torch.randn(TOKENS, HIDDEN)  # the same on both ranks (no sequence parallelism)
    dy = torch.randn(TOKENS, HIDDEN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for step in range(2):
        xa.grad = xb.grad = None
        torch.manual_seed(100 + step)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            ya = _run(plain, xa)
        ya.backward(dy)
        torch.manual_seed(100 + step)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            yb = te.distributed.checkpoint(
                _run, ckpt, xb, distribute_saved_activations=True, tp_group=group
            )
        held = tuple(xb.shape)
        yb.backward(dy)
        ok = (
            held == (TOKENS * HIDDEN // 2,)
            and tuple(xb.shape) == (TOKENS, HIDDEN)
            and torch.equal(xb.detach(), x)
            and torch.equal(ya, yb)
            and torch.equal(xa.grad, xb.grad)
            and all(
                torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ckpt.parameters())
            )
            and all(torch.equal(a, b) for a, b in zip(_fp8_state(plain), _fp8_state(ckpt)))
        )
        lines.append(f"{name} step {step} {'ok' if ok else 'MISMATCH'} held={held}")


def _worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        lines = []
        _check(group, None, lines, "fp32")
        _check(group, DelayedScaling(amax_history_len=2), lines, "delayed")
        layers = _region(group)
        for args, kwargs, error in (
            ((torch.randn(3, 5),), {}, ValueError),  # 15 elements do not split in 2
            ((torch.randn(4, HIDDEN),), {"use_reentrant": False}, ValueError),
        ):
            try:
                te.distributed.checkpoint(
                    lambda t: t * 2, *args, distribute_saved_activations=True, tp_group=group,
                    **kwargs,
                )  # fmt: skip
                lines.append("refusal MISSING")
            except error as e:
                lines.append(f"refused {'ok' if 'distribute_saved_activations' in str(e) else e}")
        del layers
        Path(f"{out_file}.{rank}").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_distributed_checkpoint_matches_the_plain_region(tmp_path):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        text = Path(f"{out}.{rank}").read_text()
        assert "MISMATCH" not in text and "MISSING" not in text, text
        assert text.count(" ok ") == 4 and text.count("refused ok") == 2, text
