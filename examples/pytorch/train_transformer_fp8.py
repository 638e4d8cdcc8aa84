#!/usr/bin/env python
"""Train a small decoder-only transformer built from ``te`` modules in FP8, and compare with BF16.

The model (per block a pre-LN ``te.TransformerLayer``: its ``te.LayerNormLinear`` fused QKV
projection, causal ``te.DotProductAttention``, ``te.Linear`` output projection and
``te.LayerNormMLP``; a final ``te.LayerNorm``; token/position embeddings and the LM head in plain
PyTorch) learns a synthetic next-token task generated here, with no downloads:
each sequence is a segment of a fixed random Markov chain (every token has a few likely
successors) followed by a repeat of that segment. The loss falls from ln(vocab) in two drops:
first the chain's statistics, then, once attention learns to copy, the repeated half (the task's
entropy floor is printed and drawn).

The SAME initial weights are trained twice, on the SAME batches:

1. in FP8 under ``te.autocast(recipe=DelayedScaling(fp8_format=Format.HYBRID,
   amax_history_len=16, amax_compute_algo="max"))`` (E4M3 forward, E5M2 gradients);
2. in high precision (the same modules outside ``te.autocast``) with BF16 parameters, on a GPU
   and on the CPU alike. BF16 is fast enough on the CPU: on a 2-core machine with AMX-BF16 the
   high-precision run was about 7% slower in bfloat16 than in float32 and the FP8 run about 15%
   (``--hp-dtype fp32`` trains both runs in float32 instead); on a CPU without 16-bit matrix
   instructions (an AVX2-only AMD EPYC, 2 cores) the te modules' BF16 GEMMs run in float32,
   rounded once, and the BF16 run took 30 s, the FP8 run 46 s (the whole command 82 s). The
   FP8 run keeps its parameters in the same dtype, so the only difference between the runs is
   FP8.

Then it prints a comparison table (final and mean-of-last-10 loss, their relative difference,
tokens/s) and writes both loss curves to a PNG. On the CPU, FP8 is emulated by the reference path
and is slower than BF16; the tokens/s comparison is meaningful on a GPU only.

Devices (``--device``):

* ``cpu``: everything on the CPU (the pure-PyTorch reference FP8 path); default without a GPU.
* ``cuda``: one GPU (the current one); default when CUDA is available.
* ``split``: the blocks are distributed over all visible GPUs in ONE process (pipeline-style
  model parallelism without overlap); activations move between devices between blocks, and every
  module's FP8 state (scales, amax histories) lives on its own GPU.

    python examples/pytorch/train_transformer_fp8.py                     # CPU: 1-1.5 minutes
    python examples/pytorch/train_transformer_fp8.py --device cuda --hidden 1024 --ffn 4096 \\
        --layers 8 --heads 16 --seq-len 512 --batch-size 16 --steps 500
    python examples/pytorch/train_transformer_fp8.py --device split --layers 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformer_engine
except ImportError:  # run from a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch.transformer import TransformerLayer

try:
    from tqdm.auto import tqdm

    # No monitor thread: with one Python thread the CPU's emulated FP8 GEMMs may use oneDNN's
    # BF16 math (exact there, about 4x faster; see docs/numerics.md).
    tqdm.monitor_interval = 0
except ImportError:  # tqdm is optional: fall back to a plain loop
    tqdm = None

HP_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------ arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=128, help="model width (multiple of 16)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divide --hidden)")
    p.add_argument("--ffn", type=int, default=512, help="MLP width (multiple of 16)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary of the synthetic task")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "split"),
        default="auto",
        help="auto: cuda when a GPU is visible, else cpu; split: blocks over all visible GPUs",
    )
    p.add_argument(
        "--hp-dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="parameter dtype of both runs (auto: bf16 on GPU and CPU)",
    )
    p.add_argument("--out", default="fp8_vs_bf16_loss.png", help="loss-curve PNG path")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    args = p.parse_args(argv)

    problems = []
    for name in ("steps", "batch_size", "seq_len", "hidden", "layers", "heads", "ffn", "vocab"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % 16:
        problems.append(f"--hidden {args.hidden}: FP8 GEMMs need a multiple of 16")
    if args.ffn % 16:
        problems.append(f"--ffn {args.ffn}: FP8 GEMMs need a multiple of 16")
    if args.heads >= 1 and args.hidden % args.heads:
        problems.append(f"--heads {args.heads} does not divide --hidden {args.hidden}")
    if args.lr <= 0:
        problems.append("--lr must be > 0")
    if problems:
        p.error("; ".join(problems))
    return args


def resolve_devices(choice: str) -> tuple[str, list[torch.device]]:
    """The run mode and the devices it uses; exits with a message when CUDA is missing."""
    has_cuda = torch.cuda.is_available()
    if choice == "auto":
        choice = "cuda" if has_cuda else "cpu"
    if choice in ("cuda", "split") and not has_cuda:
        sys.exit(
            f"error: --device {choice} was requested but CUDA is not available "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}). Run with --device cpu."
        )
    if choice == "cpu":
        return choice, [torch.device("cpu")]
    if choice == "cuda":
        return choice, [torch.device("cuda", torch.cuda.current_device())]
    return choice, [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


# ------------------------------------------------------------------ synthetic task


@dataclass
class Task:
    inputs: torch.Tensor  # (steps, batch, seq) int64, CPU
    targets: torch.Tensor  # (steps, batch, seq) int64, CPU
    entropy_floor: float  # the loss of the true chain on these batches


def make_task(steps: int, batch: int, seq: int, vocab: int, seed: int, successors: int = 4) -> Task:
    """Markov-chain segments followed by an exact repeat of themselves.

    Every token of a fixed random Markov chain has ``successors`` likely successors. A sequence
    of ``seq + 1`` tokens is a chain segment of ``h = ceil((seq + 1) / 2)`` tokens followed by
    the same segment again (cut to length). The first half is learnable from bigram statistics
    (the loss drops fast to about the chain's entropy); the second half is predictable only by
    attending back to the first (an induction/copy circuit that forms later, giving a second
    drop). The entropy floor is the true conditional entropy: the chain's entropy over the first
    half's targets, zero over the repeat.

    Generated once on the CPU with its own generator, so both runs see the same batches,
    whatever the device.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    k = min(successors, vocab)
    logits = torch.full((vocab, vocab), -math.inf)
    for tok in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:k]
        logits[tok, nxt] = 1.5 * torch.randn(k, generator=gen)
    probs = logits.softmax(dim=-1)  # (vocab, vocab) transition matrix, rows sum to 1

    n, half = steps * batch, (seq + 2) // 2
    chain = torch.empty(n, half, dtype=torch.long)
    chain[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(1, half):
        chain[:, t] = torch.multinomial(probs[chain[:, t - 1]], 1, generator=gen).squeeze(1)
    seqs = torch.cat([chain, chain], dim=1)[:, : seq + 1].view(steps, batch, seq + 1)
    row_entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # (vocab,)
    floor = row_entropy[chain[:, : half - 1]].sum(dim=1).mean().item() / seq
    return Task(seqs[..., :-1].contiguous(), seqs[..., 1:].contiguous(), floor)


# ------------------------------------------------------------------ model


def make_block(hidden: int, heads: int, ffn: int, device: torch.device, dtype) -> nn.Module:
    """A pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``, causal, with
    no dropout (the task is small and the two runs should differ by FP8 only)."""
    return TransformerLayer(
        hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
        self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=dtype,
        device=device,
    )  # fmt: skip


def gemm_modules(block: nn.Module) -> list[nn.Module]:
    """The block's te GEMM modules: QKV (LayerNormLinear), output projection, MLP."""
    attention = block.self_attention
    return [attention.layernorm_qkv, attention.proj, block.layernorm_mlp]


class TinyGPT(nn.Module):
    """Embeddings on the first device, blocks spread over ``devices``, norm + head on the last."""

    def __init__(self, args: argparse.Namespace, devices: list[torch.device], dtype):
        super().__init__()
        n_dev = len(devices)
        self.block_devices = [devices[i * n_dev // args.layers] for i in range(args.layers)]
        self.first, self.last = self.block_devices[0], self.block_devices[-1]
        self.tok_emb = nn.Embedding(args.vocab, args.hidden, device=self.first, dtype=dtype)
        self.pos_emb = nn.Embedding(args.seq_len, args.hidden, device=self.first, dtype=dtype)
        self.blocks = nn.ModuleList(
            make_block(args.hidden, args.heads, args.ffn, dev, dtype) for dev in self.block_devices
        )
        self.norm = te.LayerNorm(args.hidden, dtype=dtype, device=self.last)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False, device=self.last, dtype=dtype)
        for emb in (self.tok_emb, self.pos_emb, self.head):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.first, non_blocking=True)
        pos = torch.arange(tokens.shape[1], device=self.first)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for dev, block in zip(self.block_devices, self.blocks):
            x = block(x.to(dev, non_blocking=True))  # no-op when already there
        return self.head(self.norm(x.to(self.last, non_blocking=True)))


def te_modules(model: nn.Module):
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, te.TransformerEngineBaseModule)
    ]


def check_fp8_state_placement(model: nn.Module) -> str:
    """Every te module's delayed-scaling state must be on the device of its parameters."""
    checked, wrong = 0, []
    for name, m in te_modules(model):
        param = next(m.parameters(), None)
        if param is None:  # DotProductAttention: no parameters, no FP8 state (high precision)
            continue
        param_dev = param.device
        for key in ("scaling_fwd", "scaling_bwd"):
            state = m.fp8_meta.get(key)
            if state is None:
                continue
            for tname in ("scale", "amax_history"):
                t = getattr(state, tname)
                checked += 1
                if t.device != param_dev:
                    wrong.append(f"{name}.{key}.{tname} on {t.device}, params on {param_dev}")
    if checked == 0:
        return "no FP8 state found"
    if wrong:
        return "WRONG: " + "; ".join(wrong)
    return f"OK ({checked} scale/amax-history tensors, each on its module's device)"


# ------------------------------------------------------------------ training


@dataclass
class RunResult:
    label: str
    losses: list[float]
    tokens_per_s: float
    seconds: float


def synchronize(devices: list[torch.device]) -> None:
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def train(
    label: str,
    model: TinyGPT,
    task: Task,
    args: argparse.Namespace,
    devices: list[torch.device],
    recipe: DelayedScaling | None,
) -> RunResult:
    """AdamW with linear warm-up and cosine decay; FP8 when ``recipe`` is given."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    tokens_per_step = args.batch_size * args.seq_len
    losses: list[float] = []
    steps = range(args.steps)
    bar = None
    if tqdm is not None:
        bar = tqdm(steps, desc=f"{label:>14}", unit="step", dynamic_ncols=True, mininterval=0.5)
        steps = bar
    model.train()
    start = t0 = time.perf_counter()
    for step in steps:
        if step == 1:  # the first step (lazy state creation, allocator warm-up) is not timed
            synchronize(devices)
            t0 = time.perf_counter()
        x = task.inputs[step]
        y = task.targets[step].to(model.last, non_blocking=True)
        if recipe is not None:
            with te.autocast(enabled=True, recipe=recipe):
                logits = model(x)
        else:
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        if not math.isfinite(value):
            raise RuntimeError(f"{label}: loss became {value} at step {step}")
        losses.append(value)
        if bar is not None:
            bar.set_postfix(loss=f"{value:.4f}", refresh=False)
    synchronize(devices)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    timed_steps = args.steps - 1 if args.steps > 1 else 1
    timed = (end - t0) if args.steps > 1 else (end - start)
    return RunResult(label, losses, timed_steps * tokens_per_step / timed, end - start)


# ------------------------------------------------------------------ report


def mean_last(losses: list[float], n: int = 10) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def print_table(fp8: RunResult, hp: RunResult, floor: float, vocab: int) -> None:
    def rel(a: float, b: float) -> str:
        return f"{100.0 * (a - b) / b:+.2f}%"

    rows = [
        ("run", "final loss", "mean last 10", "tokens/s", "wall s"),
        *(
            (
                r.label,
                f"{r.losses[-1]:.4f}",
                f"{mean_last(r.losses):.4f}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.seconds:.2f}",
            )
            for r in (fp8, hp)
        ),
        (
            "FP8 vs " + hp.label.split()[0],
            rel(fp8.losses[-1], hp.losses[-1]),
            rel(mean_last(fp8.losses), mean_last(hp.losses)),
            f"x{fp8.tokens_per_s / hp.tokens_per_s:.2f}",
            "",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        )

    rule = "-" * len(line(rows[0]))
    print("\n=== FP8 vs high precision: comparison ===")
    print(line(rows[0]))
    print(rule)
    for row in rows[1:-1]:
        print(line(row))
    print(rule)
    print(line(rows[-1]))
    print(
        f"(first-step loss {fp8.losses[0]:.4f}; ln(vocab) {math.log(vocab):.4f}; "
        f"entropy floor of the task {floor:.4f}; relative difference = (FP8 - HP) / HP)"
    )


def plot(fp8: RunResult, hp: RunResult, floor: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_diff) = plt.subplots(
        2, 1, figsize=(8, 6), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    steps = list(range(1, len(fp8.losses) + 1))
    ax.plot(steps, hp.losses, label=hp.label, color="tab:blue", linewidth=1.4)
    ax.plot(steps, fp8.losses, label=fp8.label, color="tab:orange", linewidth=1.4, alpha=0.85)
    ax.axhline(floor, color="gray", linestyle="--", linewidth=1, label="entropy floor")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()

    window = max(1, min(20, len(steps) // 10))
    diff = [a - b for a, b in zip(fp8.losses, hp.losses)]
    smooth = [
        sum(diff[max(0, i - window + 1) : i + 1]) / len(diff[max(0, i - window + 1) : i + 1])
        for i in range(len(diff))
    ]
    ax_diff.plot(steps, diff, color="tab:gray", linewidth=0.8, alpha=0.5, label="per step")
    ax_diff.plot(steps, smooth, color="tab:red", linewidth=1.4, label=f"mean of {window}")
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("FP8 - HP")
    ax_diff.grid(True, alpha=0.3)
    ax_diff.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(path)
    if out.parent != Path("."):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    mode, devices = resolve_devices(args.device)
    on_gpu = devices[0].type == "cuda"
    if args.hp_dtype == "auto":
        dtype = torch.bfloat16
        why = (
            "BF16 parameters on GPU"
            if on_gpu
            else "BF16 on CPU too: measured only ~7% slower than float32 for the high-precision "
            "run and ~15% for the FP8 run on a 2-core CPU; --hp-dtype fp32 to use float32"
        )
    else:
        dtype = HP_DTYPES[args.hp_dtype]
        why = f"--hp-dtype {args.hp_dtype}"
    hp_label = "BF16" if dtype == torch.bfloat16 else "FP32"

    te_dir = Path(transformer_engine.__file__).resolve().parent
    print(
        f"transformer_engine {transformer_engine.__version__} ({te_dir}): "
        f"{transformer_engine.native_status()}"
    )
    print(
        f"torch {torch.__version__}; device mode {mode}: "
        + ", ".join(
            f"{d} ({torch.cuda.get_device_name(d)})" if d.type == "cuda" else str(d)
            for d in devices
        )
        + (f"; {torch.get_num_threads()} CPU threads" if not on_gpu else "")
    )
    print(f"high-precision dtype: {hp_label} ({why}); the FP8 run uses the same parameter dtype")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    print(f"FP8 recipe: {recipe}")

    task = make_task(args.steps, args.batch_size, args.seq_len, args.vocab, args.seed)
    print(
        f"task: Markov-chain segment + its repeat, vocab {args.vocab}, "
        f"{args.batch_size}x{args.seq_len} = {args.batch_size * args.seq_len} tokens/step, "
        f"{args.steps} steps; "
        f"uniform loss ln({args.vocab}) = {math.log(args.vocab):.4f}, "
        f"entropy floor {task.entropy_floor:.4f}"
    )

    torch.manual_seed(args.seed)
    model_fp8 = TinyGPT(args, devices, dtype)
    torch.manual_seed(args.seed)
    model_hp = TinyGPT(args, devices, dtype)
    model_hp.load_state_dict(model_fp8.state_dict())  # the same initial weights, bit for bit
    same = all(torch.equal(a, b) for a, b in zip(model_fp8.parameters(), model_hp.parameters()))
    n_params = sum(p.numel() for p in model_fp8.parameters())
    print(
        f"model: {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, ffn {args.ffn}, "
        f"{n_params:,} parameters; identical initial weights in both runs: {same}"
    )
    placement = [("token + position embeddings (torch)", model_fp8.first)]
    for i, (dev, block) in enumerate(zip(model_fp8.block_devices, model_fp8.blocks)):
        parts = ", ".join(type(m).__name__ for m in gemm_modules(block))
        placement.append((f"block {i} ({parts})", dev))
    placement.append(("final LayerNorm (te) + LM head (torch)", model_fp8.last))
    width = max(len(name) for name, _ in placement)
    print("placement (each block a te.TransformerLayer; its GEMM modules in parentheses):")
    for name, dev in placement:
        print(f"  {name:<{width}} -> {dev}")
    sys.stdout.flush()

    fp8 = train("FP8 (HYBRID)", model_fp8, task, args, devices, recipe)
    print(f"FP8 state placement: {check_fp8_state_placement(model_fp8)}")
    sys.stdout.flush()
    hp = train(f"{hp_label} (no FP8)", model_hp, task, args, devices, None)

    print_table(fp8, hp, task.entropy_floor, args.vocab)
    if not args.no_plot:
        where = "cpu" if mode == "cpu" else f"{mode}: {', '.join(str(d) for d in devices)}"
        title = (
            f"{args.layers}-block te transformer, hidden {args.hidden} ({where}): "
            f"FP8 DelayedScaling(HYBRID) vs {hp_label}"
        )
        plot(fp8, hp, task.entropy_floor, args.out, title)
        print(f"loss curves written to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
