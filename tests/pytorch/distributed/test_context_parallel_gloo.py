"""Context parallelism of ``DotProductAttention`` and ``TransformerLayer``: the sequence split in
zig-zag chunks over 2 and 3 gloo processes (CPU).

Each rank holds chunks ``rank`` and ``2 * cp - 1 - rank`` of the sequence. Its attention output
and the gradients of its Q, K and V rows must equal those rows of a float64 softmax attention of
the whole sequence written out here; a ``TransformerLayer`` with rotary embeddings must give the
rows of the same layer run on the whole sequence in one process, and its parameter gradients
summed over the ranks must equal that run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
    DotProductAttention,
)

B, H, G, D, HALF = 2, 4, 2, 8, 3  # batch, heads, K/V groups, head dim, rows per chunk
# name: (qkv_format, attn_mask_type, window_size, checkpoint_core_attention)
DPA_CASES = {
    "bshd-causal": ("bshd", "causal", None, False),
    "sbhd-causal-window": ("sbhd", "causal", (2, 0), False),
    "sbhd-no-mask": ("sbhd", "no_mask", None, False),
    "bshd-causal-checkpoint": ("bshd", "causal", None, True),
}


def zigzag(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def _inputs(cp: int, seed: int = 0):
    """Whole-sequence q, k, v ``[b, s, h, d]`` and output weights ``[b, s, h * d]``."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * cp * HALF
    q = torch.randn(B, s, H, D, generator=g)
    k = torch.randn(B, s, G, D, generator=g)
    v = torch.randn(B, s, G, D, generator=g)
    w = torch.randn(B, s, H * D, generator=g)
    return q, k, v, w


def _oracle(q, k, v, w, mask_type, window):
    """Float64 attention of the whole sequence: output ``[b, s, h*d]`` and d(sum(out*w))/dq,k,v."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = q.shape[1]
    kk = k.repeat_interleave(H // G, dim=2)
    vv = v.repeat_interleave(H // G, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) * D**-0.5
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    masked = torch.zeros(s, s, dtype=torch.bool)
    if mask_type == "causal":
        masked |= j > i
        if window is not None and window[0] >= 0:
            masked |= j < i - window[0]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, vv).reshape(B, s, H * D)
    grads = torch.autograd.grad((out * w.double()).sum(), (q, k, v))
    return out.detach(), grads


def _to_format(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t if fmt == "bshd" else t.transpose(0, 1).contiguous()


def _dpa_case(cp, rank, fmt, mask_type, window, checkpoint):
    q, k, v, w = _inputs(cp)
    seq = 0 if fmt == "sbhd" else 1
    local = [zigzag(_to_format(t, fmt), seq, cp, rank).requires_grad_() for t in (q, k, v)]
    dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format=fmt, attn_mask_type=mask_type,
                              window_size=window, device="cpu")  # fmt: skip
    dpa.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "p2p")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        out = dpa(*local, checkpoint_core_attention=checkpoint)
    (out * zigzag(_to_format(w, fmt), seq, cp, rank)).sum().backward()
    return out.detach(), [t.grad for t in local], max(saved)


ACTUAL = [5, 12, 2]  # thd sequence lengths; padded to a multiple of 2 * cp
THD_MASKS = ("padding_causal", "padding")


def _padded_cu(cp):
    """``(cu_seqlens_padded, cu_seqlens)`` of :data:`ACTUAL` for ``cp`` ranks."""
    cu_padded, cu_actual = [0], [0]
    for n in ACTUAL:
        cu_padded.append(cu_padded[-1] + -(-n // (2 * cp)) * (2 * cp))
        cu_actual.append(cu_actual[-1] + n)
    return cu_padded, cu_actual


def zigzag_thd(t, cu_padded, cp, rank):
    parts = []
    for start, end in zip(cu_padded[:-1], cu_padded[1:]):
        parts.append(zigzag(t[start:end], 0, cp, rank))
    return torch.cat(parts)


def _thd_inputs(cp, seed=9):
    cu_padded, _ = _padded_cu(cp)
    g = torch.Generator().manual_seed(seed)
    total = cu_padded[-1]
    q = torch.randn(total, H, D, generator=g)
    k = torch.randn(total, G, D, generator=g)
    v = torch.randn(total, G, D, generator=g)
    w = torch.randn(total, H * D, generator=g)
    return q, k, v, w


def _thd_oracle(cp, mask_type):
    """Float64 attention of each whole sequence (its real tokens); padding rows give 0."""
    cu_padded, _ = _padded_cu(cp)
    q, k, v, w = (t.double() for t in _thd_inputs(cp))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape[0], H * D, dtype=torch.float64)
    for start, n in zip(cu_padded[:-1], ACTUAL):
        qs = q[start : start + n].transpose(0, 1)  # [h, n, d]
        ks = k[start : start + n].repeat_interleave(H // G, dim=1).transpose(0, 1)
        vs = v[start : start + n].repeat_interleave(H // G, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * D**-0.5
        if mask_type == "padding_causal":
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        rows = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).reshape(n, H * D)
        out = out.index_put((torch.arange(start, start + n),), rows)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), grads


def _thd_case(cp, rank, mask_type, device="cpu"):
    cu_padded, cu_actual = _padded_cu(cp)
    inputs = [zigzag_thd(t, cu_padded, cp, rank).to(device) for t in _thd_inputs(cp)]
    local, w = [t.requires_grad_() for t in inputs[:3]], inputs[3]
    dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="thd", attn_mask_type=mask_type,
                              device=device)  # fmt: skip
    dpa.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "p2p")
    cu = torch.tensor(cu_actual, dtype=torch.int32, device=device)
    cu_p = torch.tensor(cu_padded, dtype=torch.int32, device=device)
    out = dpa(*local, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
              cu_seqlens_kv_padded=cu_p)  # fmt: skip
    (out * w).sum().backward()
    return out.detach().cpu(), [t.grad.cpu() for t in local]


def _max_logit_case(cp, rank):
    q, k, v, _ = _inputs(cp)
    local = [zigzag(t, 1, cp, rank) for t in (q, k, v)]
    dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd", attn_mask_type="causal",
                              return_max_logit=True, device="cpu")  # fmt: skip
    dpa.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "a2a")
    return dpa(*local)[1]


def _layer(cp_group=None, cp=1):
    torch.manual_seed(7)
    layer = te.TransformerLayer(H * D, 64, H, num_gqa_groups=G, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                params_dtype=torch.float32, device="cpu")  # fmt: skip
    if cp_group is not None:
        layer.set_context_parallel_group(cp_group, list(range(cp)), None, "all_gather")
    return layer


def _layer_inputs(cp):
    g = torch.Generator().manual_seed(11)
    s = 2 * cp * HALF
    x = torch.randn(s, B, H * D, generator=g)
    w = torch.randn(s, B, H * D, generator=g)
    freqs = te.RotaryPositionEmbedding(D, device="cpu")(s)
    return x, w, freqs


def _layer_case(cp, rank):
    x, w, freqs = _layer_inputs(cp)
    layer = _layer(dist.group.WORLD, cp)
    local = zigzag(x, 0, cp, rank).requires_grad_()
    out = layer(local, rotary_pos_emb=freqs)
    (out * zigzag(w, 0, cp, rank)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
    return out.detach(), local.grad, grads


def _fp8_layer_steps(layer, x, w, freqs, group):
    """Two FP8 (delayed scaling) steps of ``layer``: each step's output and input gradient;
    the amax reduction over ``group`` gives every rank the whole batch's scales."""
    from transformer_engine.common.recipe import DelayedScaling

    results = []
    for _ in range(2):
        x_step = x.detach().clone().requires_grad_()
        with te.autocast(recipe=DelayedScaling(), amax_reduction_group=group):
            out = layer(x_step, rotary_pos_emb=freqs)
        (out * w).sum().backward()
        results.append((out.detach(), x_step.grad))
    return results


def _reduce_scatter_case(cp, rank):
    """The bshd causal case through the backward's reduce-scatter branch (the one NCCL takes),
    where gloo has reduce_scatter; ``None`` where it has not."""
    import transformer_engine.pytorch.attention.dot_product_attention.context_parallel as cpm

    try:
        probe = torch.zeros(1)
        dist.reduce_scatter(probe, [torch.zeros(1) for _ in range(cp)])
    except RuntimeError:
        return None
    real = cpm.dist.get_backend
    cpm.dist.get_backend = lambda group=None: "nccl"
    try:
        return _dpa_case(cp, rank, "bshd", "causal", None, False)
    finally:
        cpm.dist.get_backend = real


def _dropout_checkpoint_case(cp, rank):
    """Attention dropout, with and without checkpoint_core_attention, from the same seed:
    ``[(out, grads) plain, (out, grads) recomputed, out without dropout (eval)]``."""
    q, k, v, w = _inputs(cp)
    runs = []
    for checkpoint in (False, True):
        local = [zigzag(t, 1, cp, rank).requires_grad_() for t in (q, k, v)]
        dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd",
                                  attn_mask_type="causal", attention_dropout=0.3, device="cpu")  # fmt: skip
        dpa.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "p2p")
        torch.manual_seed(100 + rank)
        out = dpa(*local, checkpoint_core_attention=checkpoint)
        torch.manual_seed(200)  # the recompute must restore the forward's state, not use this
        (out * zigzag(w, 1, cp, rank)).sum().backward()
        runs.append((out.detach(), [t.grad for t in local]))
    dpa.eval()
    runs.append(dpa(*(zigzag(t, 1, cp, rank) for t in (q, k, v))))
    return runs


def _worker(rank, cp, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cp)
    try:
        results = {name: _dpa_case(cp, rank, *case) for name, case in DPA_CASES.items()}
        results["layer"] = _layer_case(cp, rank)
        results["max_logit"] = _max_logit_case(cp, rank)
        results["reduce_scatter"] = _reduce_scatter_case(cp, rank)
        results["dropout"] = _dropout_checkpoint_case(cp, rank)
        x, w, freqs = _layer_inputs(cp)
        results["fp8_layer"] = _fp8_layer_steps(
            _layer(dist.group.WORLD, cp),
            zigzag(x, 0, cp, rank),
            zigzag(w, 0, cp, rank),
            freqs,
            dist.group.WORLD,
        )
        for mask_type in THD_MASKS:
            results[f"thd-{mask_type}"] = _thd_case(cp, rank, mask_type)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # every rank done with its collectives before any tears its group down
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, cp: int, out) -> tuple:
    """``worker(rank, cp, init_file, out_dir)`` on ``cp`` gloo processes, each saving its
    results to ``out/rank{r}.pt``: ``(cp, [each rank's results])``."""
    mp.spawn(worker, args=(cp, str(out / "init"), str(out)), nprocs=cp, join=True)
    return cp, [torch.load(out / f"rank{r}.pt") for r in range(cp)]


@pytest.fixture(scope="module", params=[2, 3], ids=["cp2", "cp3"])
def split_run(request, tmp_path_factory):
    return spawn_ranks(_worker, request.param, tmp_path_factory.mktemp(f"cp{request.param}"))


@pytest.mark.parametrize("name", list(DPA_CASES))
def test_attention_rows_equal_whole_sequence_oracle(split_run, name):
    cp, results = split_run
    fmt, mask_type, window, _ = DPA_CASES[name]
    q, k, v, w = _inputs(cp)
    out, grads = _oracle(q, k, v, w, mask_type, window)
    seq = 0 if fmt == "sbhd" else 1
    for rank, result in enumerate(results):
        got_out, got_grads, _ = result[name]
        want = zigzag(_to_format(out, fmt), seq, cp, rank)
        torch.testing.assert_close(got_out.double(), want, rtol=1e-5, atol=1e-6)
        for label, got, ref in zip("qkv", got_grads, grads):
            want_grad = zigzag(_to_format(ref, fmt), seq, cp, rank)
            torch.testing.assert_close(got.double(), want_grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, n=label: f"rank {r} d{n}: {m}")  # fmt: skip


@pytest.mark.parametrize("mask_type", THD_MASKS)
def test_packed_sequences_equal_whole_sequence_oracle(split_run, mask_type):
    cp, results = split_run
    cu_padded, _ = _padded_cu(cp)
    out, grads = _thd_oracle(cp, mask_type)
    for rank, result in enumerate(results):
        got_out, got_grads = result[f"thd-{mask_type}"]
        want = zigzag_thd(out, cu_padded, cp, rank)
        torch.testing.assert_close(got_out.double(), want, rtol=1e-5, atol=1e-6)
        for label, got, ref in zip("qkv", got_grads, grads):
            torch.testing.assert_close(got.double(), zigzag_thd(ref, cu_padded, cp, rank),
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=rank, n=label: f"rank {r} d{n}: {m}")  # fmt: skip


def test_reduce_scatter_branch_of_the_gather_backward(split_run):
    cp, results = split_run
    if results[0]["reduce_scatter"] is None:
        pytest.skip("this torch's gloo has no reduce_scatter")
    q, k, v, w = _inputs(cp)
    out, grads = _oracle(q, k, v, w, "causal", None)
    for rank, result in enumerate(results):
        got_out, got_grads, _ = result["reduce_scatter"]
        torch.testing.assert_close(got_out.double(), zigzag(out, 1, cp, rank), rtol=1e-5, atol=1e-6)
        for got, ref in zip(got_grads, grads):
            torch.testing.assert_close(got.double(), zigzag(ref, 1, cp, rank), rtol=1e-5,
                                       atol=1e-6)  # fmt: skip


def test_checkpoint_recomputes_the_same_dropout(split_run):
    _, results = split_run
    for result in results:
        (out, grads), (out_ckpt, grads_ckpt), out_eval = result["dropout"]
        assert not torch.allclose(out, out_eval)  # the dropout did drop
        assert torch.equal(out, out_ckpt)
        for got, want in zip(grads_ckpt, grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_checkpoint_keeps_only_the_local_chunks(split_run):
    # The largest storage the forward keeps: at least the gathered K without recompute; with
    # it, no more than a local Q (the inputs are all that is kept).
    cp, results = split_run
    local_q = B * 2 * HALF * H * D * 4  # bytes of a rank's float32 Q
    gathered_k = B * 2 * cp * HALF * G * D * 4
    for result in results:
        plain, recomputed = result["bshd-causal"][2], result["bshd-causal-checkpoint"][2]
        assert plain >= gathered_k
        assert recomputed <= local_q and recomputed < plain


def _whole_max_logit(cp):
    """Per-head maximum of the causal, scaled scores of the whole sequence, in float64."""
    q, k, _, _ = _inputs(cp)
    s = q.shape[1]
    kk = k.double().repeat_interleave(H // G, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * D**-0.5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    return scores.masked_fill(causal, float("-inf")).amax(dim=(0, 2, 3))


def test_max_logit_is_the_whole_sequences(split_run):
    cp, results = split_run
    want = _whole_max_logit(cp)
    for result in results:
        torch.testing.assert_close(result["max_logit"].double(), want, rtol=1e-5, atol=1e-6)


def test_transformer_layer_rows_equal_whole_sequence_run(split_run):
    cp, results = split_run
    x, w, freqs = _layer_inputs(cp)
    layer = _layer()
    whole = x.clone().requires_grad_()
    out = layer(whole, rotary_pos_emb=freqs)
    (out * w).sum().backward()
    for rank, result in enumerate(results):
        got_out, got_dx, got_grads = result["layer"]
        torch.testing.assert_close(got_out, zigzag(out.detach(), 0, cp, rank), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_dx, zigzag(whole.grad, 0, cp, rank), rtol=1e-5, atol=1e-5)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(got_grads[name], p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def test_fp8_transformer_layer_rows_equal_whole_sequence_run(split_run):
    # Delayed scaling with the amax reduced over the ranks: every rank casts with the scales of
    # the whole batch, so each step's rows are those of the one-process FP8 run (up to the
    # order of float sums in the GEMMs).
    cp, results = split_run
    x, w, freqs = _layer_inputs(cp)
    whole = _fp8_layer_steps(_layer(), x, w, freqs, None)
    for rank, result in enumerate(results):
        for step, ((got_out, got_dx), (out, dx)) in enumerate(zip(result["fp8_layer"], whole)):
            torch.testing.assert_close(got_out, zigzag(out, 0, cp, rank), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=step: f"step {s}: {m}")  # fmt: skip
            torch.testing.assert_close(got_dx, zigzag(dx, 0, cp, rank), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=step: f"step {s}: {m}")  # fmt: skip


# --- one process: what is refused -----------------------------------------------------------


class _FakeGroup:
    """Stands in for a group of ``size`` ranks where only the size and rank are read."""


@pytest.fixture
def two_rank_dpa(monkeypatch):
    import transformer_engine.pytorch.attention.dot_product_attention.context_parallel as m

    monkeypatch.setattr(m, "group_size", lambda group: 1 if group is None else 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)

    def make(**kwargs):
        dpa = DotProductAttention(H, D, device="cpu", **kwargs)
        dpa.set_context_parallel_group(_FakeGroup(), [0, 1], None)
        return dpa

    return make


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        (dict(attn_mask_type="padding_causal"), {}, "padding_causal"),
        (dict(attn_mask_type="no_mask"), dict(window_size=(2, 2)), "window_size"),
        (dict(attn_mask_type="causal"), dict(core_attention_bias_type="alibi"), "ALiBi"),
    ],
)
def test_unbuilt_combinations_are_refused(two_rank_dpa, kwargs, call, match):
    dpa = two_rank_dpa(**kwargs)
    q = torch.randn(6, 2, H, D)
    with pytest.raises(NotImplementedError, match=match):
        dpa(q, q, q, **call)


def test_odd_local_length_is_refused(two_rank_dpa):
    q = torch.randn(5, 2, H, D)
    with pytest.raises(ValueError, match=r"length \(5\) must be even"):
        two_rank_dpa()(q, q, q)


def test_hierarchical_groups_need_their_whole_group(two_rank_dpa):
    dpa = two_rank_dpa()
    with pytest.raises(ValueError, match="need cp_global_ranks listing the 4 ranks"):
        dpa.set_context_parallel_group([_FakeGroup(), _FakeGroup()], [0, 1], None,
                                       ["a2a", "p2p"])  # fmt: skip
    with pytest.raises(ValueError, match="two groups; got 3"):
        dpa.set_context_parallel_group([_FakeGroup()] * 3, list(range(8)), None, "p2p")
    assert dpa.cp_size == 2  # the refused calls changed nothing


# --- CUDA: two processes on one GPU (gloo carries CUDA tensors) ---------------------------------


def _cuda_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, w = (t.to("cuda", dtype) for t in _inputs(2, seed=5))
            local = [zigzag(t, 1, 2, rank).requires_grad_() for t in (q, k, v)]
            dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd",
                                      attn_mask_type="causal", device="cuda")  # fmt: skip
            dpa.set_context_parallel_group(dist.group.WORLD, [0, 1], None, "p2p")
            out = dpa(*local)
            (out.float() * zigzag(w, 1, 2, rank).float()).sum().backward()
            results[dtype] = (out.detach().cpu(), [t.grad.cpu() for t in local])
        results["thd"] = _thd_case(2, rank, "padding_causal", device="cuda")
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # every rank done with its collectives before any tears its group down
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backends_under_context_parallelism(tmp_path):
    mp.spawn(_cuda_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cu_padded, _ = _padded_cu(2)
    thd_out, thd_grads = _thd_oracle(2, "padding_causal")
    for rank, result in enumerate(results):
        got_out, got_grads = result["thd"]
        want = zigzag_thd(thd_out, cu_padded, 2, rank)
        torch.testing.assert_close(got_out.double(), want, rtol=2e-5, atol=2e-5)
        for got, ref in zip(got_grads, thd_grads):
            want_grad = zigzag_thd(ref, cu_padded, 2, rank)
            torch.testing.assert_close(got.double(), want_grad, rtol=2e-5, atol=2e-5)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        q, k, v, w = (t.to(dtype).float() for t in _inputs(2, seed=5))
        out, grads = _oracle(q, k, v, w.to(dtype).float(), "causal", None)
        for rank, result in enumerate(results):
            got_out, got_grads = result[dtype]
            assert got_out.dtype == dtype
            want = zigzag(out, 1, 2, rank)
            torch.testing.assert_close(got_out.double(), want, rtol=tol, atol=tol)
            for got, ref in zip(got_grads, grads):
                torch.testing.assert_close(got.double(), zigzag(ref, 1, 2, rank), rtol=tol,
                                           atol=tol)  # fmt: skip


def test_thd_partitioned_indices_pick_each_ranks_chunks():
    import transformer_engine_torch as tex

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    # sequence 0: chunks of 2 -> rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2;
    # sequence 1: chunks of 1.
    assert tex.thd_get_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert tex.thd_get_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    index = tex.thd_get_partitioned_indices(cu, 12, 2, 1)
    assert index.dtype == torch.int32
    tokens = torch.arange(12)
    assert torch.equal(tokens.index_select(0, index), zigzag_thd(tokens, [0, 8, 12], 2, 1))
    with pytest.raises(ValueError, match="multiple of 4"):
        tex.thd_get_partitioned_indices(torch.tensor([0, 6, 12]), 12, 2, 0)
    with pytest.raises(ValueError, match="total_tokens is 16"):
        tex.thd_get_partitioned_indices(cu, 16, 2, 0)


def test_kv_cache_is_refused_before_it_is_written(two_rank_dpa):
    class Cache:
        dtype = None

        def step(self, *args):
            raise AssertionError("the cache was written")

    q = torch.randn(6, 2, H, D)
    dpa = two_rank_dpa(attn_mask_type="padding_causal")
    with pytest.raises(NotImplementedError, match="KV cache"):
        dpa(q, q, q, inference_params=Cache())


# --- the hierarchical a2a+p2p form: 4 processes, a2a groups of 2 inside p2p groups of 2 ------


def _hierarchical_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        # every process creates every group, in the same order
        a2a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        p2p = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = [a2a[rank // 2], p2p[rank % 2]]
        results = {}
        for name, ranks in (("in-order", [0, 1, 2, 3]), ("permuted", [0, 2, 1, 3])):
            cp_rank = ranks.index(rank)
            q, k, v, w = _inputs(4)
            local = [zigzag(t, 1, 4, cp_rank).requires_grad_() for t in (q, k, v)]
            dpa = DotProductAttention(H, D, num_gqa_groups=G, qkv_format="bshd",
                                      attn_mask_type="causal", return_max_logit=True,
                                      device="cpu")  # fmt: skip
            dpa.set_context_parallel_group(groups, ranks, None, ["a2a", "p2p"])
            assert (dpa.cp_size, dpa.cp_rank) == (4, cp_rank)
            for _ in range(2):  # the second call reuses the learned block order
                for t in local:
                    t.grad = None
                out, max_logit = dpa(*local)
                (out * zigzag(w, 1, 4, cp_rank)).sum().backward()
            results[name] = (cp_rank, out.detach(), [t.grad for t in local], max_logit)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_hierarchical_groups_equal_whole_sequence_oracle(tmp_path):
    mp.spawn(_hierarchical_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=4,
             join=True)  # fmt: skip
    q, k, v, w = _inputs(4)
    out, grads = _oracle(q, k, v, w, "causal", None)
    for rank in range(4):
        for name, (cp_rank, got_out, got_grads, max_logit) in torch.load(
            tmp_path / f"rank{rank}.pt"
        ).items():
            label = f"{name} rank {rank}"
            want = zigzag(out, 1, 4, cp_rank)
            torch.testing.assert_close(got_out.double(), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=label: f"{n}: {m}")  # fmt: skip
            for got, ref in zip(got_grads, grads):
                torch.testing.assert_close(got.double(), zigzag(ref, 1, 4, cp_rank), rtol=1e-5,
                                           atol=1e-6, msg=lambda m, n=label: f"{n}: {m}")  # fmt: skip
            torch.testing.assert_close(max_logit.double(), _whole_max_logit(4), rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
