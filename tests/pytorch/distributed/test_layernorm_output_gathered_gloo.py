"""``return_layernorm_output=True`` under sequence parallelism (2 gloo processes on the CPU):
``te.LayerNormLinear`` and ``te.LayerNormMLP`` return the normalized input of this rank's tokens,
or with ``return_layernorm_output_gathered=True`` that of every rank's tokens in rank order,
held to a float64 LayerNorm of the whole input."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te

TOKENS, HIDDEN, OUT = 8, 32, 64


def _layer_norm(x, weight, bias, eps=1e-5):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


def _worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        torch.manual_seed(1)
        x = torch.randn(TOKENS, HIDDEN)
        local = x[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2].clone()
        lines = []
        for kind in ("LayerNormLinear", "LayerNormMLP"):
            for gathered in (False, True):
                torch.manual_seed(0)
                mode = (
                    {"set_parallel_mode": True}
                    if kind == "LayerNormMLP"
                    else {"parallel_mode": "column"}
                )
                layer = getattr(te, kind)(
                    HIDDEN, OUT, device="cpu", tp_group=group, tp_size=2,
                    sequence_parallel=True, return_layernorm_output=True,
                    return_layernorm_output_gathered=gathered, **mode,
                )  # fmt: skip
                with torch.no_grad():
                    layer.layer_norm_weight.normal_(1.0, 0.1)
                    layer.layer_norm_bias.normal_(0.0, 0.1)
                _, ln_out = layer(local)
                whole = _layer_norm(x, layer.layer_norm_weight, layer.layer_norm_bias)
                want = whole if gathered else whole[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2]
                ok = ln_out.shape == want.shape and torch.allclose(
                    ln_out.double(), want, rtol=1e-5, atol=1e-5
                )
                lines.append(f"{kind} gathered={gathered} {'ok' if ok else 'MISMATCH'}")
        Path(f"{out_file}.{rank}").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_layernorm_output_is_gathered_when_asked(tmp_path):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        text = Path(f"{out}.{rank}").read_text()
        assert "MISMATCH" not in text, text
        assert text.count("ok") == 4
