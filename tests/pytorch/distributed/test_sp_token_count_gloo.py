"""FP8 under sequence parallelism with a token count that is not a multiple of 16: a
column-parallel layer all-gathers its input shard first, so 5 tokens per rank on 2 ranks (10
gathered) run in FP8, and give the single-process layer's output on the 10 tokens (2 gloo
processes on the CPU). Within one E4M3 step of the largest output: the shards' weights are cast
with their own scales (run_tensor_parallel.py holds the exact comparisons)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling

TOKENS, IN, OUT = 10, 32, 64


def _make(kind, **kw):
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(IN, OUT, device="cpu", **kw)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(IN, OUT, device="cpu", **kw)
    return te.LayerNormMLP(IN, OUT, device="cpu", **kw)


def _worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        torch.manual_seed(1)
        x = torch.randn(TOKENS, IN)
        lines = []
        for kind in ("Linear", "LayerNormLinear", "LayerNormMLP"):
            whole = _make(kind)
            mode = (
                {"set_parallel_mode": True}
                if kind == "LayerNormMLP"
                else {"parallel_mode": "column"}
            )
            part = _make(kind, tp_group=group, tp_size=2, sequence_parallel=True, **mode)
            with torch.no_grad():  # the rank's slice of the whole layer's parameters
                for p, q in zip(part.parameters(), whole.parameters()):
                    if p.shape == q.shape:
                        p.copy_(q)
                    else:
                        dim = next(d for d in range(p.dim()) if p.shape[d] != q.shape[d])
                        p.copy_(q.narrow(dim, rank * p.shape[dim], p.shape[dim]))
            with te.autocast(recipe=Float8CurrentScaling()):
                y_whole = whole(x)
                y_part = part(x[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2].clone())
            if kind == "LayerNormMLP":  # row-parallel FC2 reduce-scatters along the tokens
                want = y_whole[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2]
            else:  # column-parallel: all tokens, this rank's output features
                want = y_whole[:, rank * OUT // 2 : (rank + 1) * OUT // 2]
            limit = 2**-3 * want.abs().max().item()
            ok = y_part.shape == want.shape and (y_part - want).abs().max().item() <= limit
            lines.append(f"{kind} {'ok' if ok else 'MISMATCH'}")
        Path(f"{out_file}.{rank}").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_fp8_sequence_parallel_takes_any_token_count(tmp_path):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        text = Path(f"{out}.{rank}").read_text()
        assert "MISMATCH" not in text, text
        assert text.count("ok") == 3
