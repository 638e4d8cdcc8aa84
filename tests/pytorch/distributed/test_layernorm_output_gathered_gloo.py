"""``return_layernorm_output=True`` under sequence parallelism (2 gloo processes on the CPU):
``te.LayerNormLinear`` and ``te.LayerNormMLP`` return the normalized input of this rank's tokens,
or with ``return_layernorm_output_gathered=True`` that of every rank's tokens in rank order,
held to a float64 LayerNorm of the whole input."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import transformer_engine.pytorch as te

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tp_harness import check_gloo_run, run_worker  # noqa: E402

TOKENS, HIDDEN, OUT = 8, 32, 64


def _layer_norm(x, weight, bias, eps=1e-5):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()


def _checks(group, device):
    rank = group.rank()
    torch.manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, device=device)
    local = x[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2].clone()
    failures, cases = [], 0
    for kind in ("LayerNormLinear", "LayerNormMLP"):
        for gathered in (False, True):
            torch.manual_seed(0)
            mode = (
                {"set_parallel_mode": True}
                if kind == "LayerNormMLP"
                else {"parallel_mode": "column"}
            )
            layer = getattr(te, kind)(
                HIDDEN, OUT, device=device, tp_group=group, tp_size=2, sequence_parallel=True,
                return_layernorm_output=True, return_layernorm_output_gathered=gathered, **mode,
            )  # fmt: skip
            with torch.no_grad():
                layer.layer_norm_weight.normal_(1.0, 0.1)
                layer.layer_norm_bias.normal_(0.0, 0.1)
            _, ln_out = layer(local)
            whole = _layer_norm(x, layer.layer_norm_weight, layer.layer_norm_bias)
            want = whole if gathered else whole[rank * TOKENS // 2 : (rank + 1) * TOKENS // 2]
            cases += 1
            if ln_out.shape != want.shape or not torch.allclose(
                ln_out.double(), want, rtol=1e-5, atol=1e-5
            ):
                failures.append(f"{kind} gathered={gathered}: shape {tuple(ln_out.shape)}")
    return failures, cases


def _worker(rank, world_size, backend, out_dir=None, init_method="env://"):
    return run_worker(rank, world_size, backend, out_dir, init_method, "LN_OUTPUT", _checks)


def test_layernorm_output_is_gathered_when_asked(tmp_path):
    check_gloo_run(_worker, tmp_path, 4)
