"""InferenceParams and the KV cache managers against a hand-kept history of every token written.

The oracle is a dict of lists: each sequence's K and V tokens in the order they were stepped in.
After every step, each live sequence's cache row (non-paged) or pages (paged, read through the
page table by hand) must hold exactly that history, and the cumulative lengths must be the
running sums of the announced token counts.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from utils import needs_cuda, needs_two_gpus

from transformer_engine.pytorch.attention.inference import (
    InferenceParams,
    KVCacheManager,
    NonPagedKVCacheManager,
    PagedKVCacheManager,
)
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from transformer_engine.pytorch.device import DevicePlacementError, default_device

HEADS, DK, DV = 2, 4, 3
MAX_BATCH, MAX_SEQ, PAGE = 3, 8, 2

# Prefill two sequences; decode; c joins and the order changes; b finishes, a brings 2 tokens.
SCENARIO = [
    OrderedDict(a=3, b=1),
    OrderedDict(a=1, b=1),
    OrderedDict(b=1, c=4, a=1),
    OrderedDict(c=1, a=2),
]


def make_params(paged: bool, qkv_format: str = "bshd", device="cpu", dtype=torch.float32):
    extra = dict(is_paged=True, page_size=PAGE, total_num_pages=MAX_BATCH * MAX_SEQ // PAGE)
    return InferenceParams(
        MAX_BATCH, MAX_SEQ, HEADS, DK, dtype, head_dim_v=DV, max_ctx_len=4,
        qkv_format=qkv_format, device=device, **(extra if paged else {}),
    )  # fmt: skip


def pack(tokens: list[torch.Tensor], qkv_format: str) -> torch.Tensor:
    """New tokens per live sequence -> the step's input, with padding (an extra sequence row
    where the batch has room, an extra token slot, two trailing thd tokens) filled with values
    that must not be written."""
    d = tokens[0].shape[-1]
    if qkv_format == "thd":
        return torch.cat(tokens + [torch.full((2, HEADS, d), 99.0)])
    batch, length = min(len(tokens) + 1, MAX_BATCH), max(len(t) for t in tokens) + 1
    out = torch.full((batch, length, HEADS, d), 99.0)
    for i, t in enumerate(tokens):
        out[i, : len(t)] = t
    return out if qkv_format == "bshd" else out.transpose(0, 1).contiguous()


def cumulative(counts: list[int]) -> list[int]:
    sums = [0]
    for n in counts + [0] * (MAX_BATCH - len(counts)):
        sums.append(sums[-1] + n)
    return sums


def cached_tokens(params: InferenceParams, layer: int, row: int, length: int):
    """Row ``row``'s first ``length`` K and V tokens, read from the cache by hand."""
    k_cache, v_cache = params.cache_manager.cache[layer]
    if not params.is_paged:
        return k_cache[row, :length], v_cache[row, :length]
    table = params.cache_manager.page_table
    picks = [(int(table[row, p // PAGE]), p % PAGE) for p in range(length)]
    return (torch.stack([k_cache[page, slot] for page, slot in picks]),
            torch.stack([v_cache[page, slot] for page, slot in picks]))  # fmt: skip


def run_scenario(params: InferenceParams, qkv_format: str, layers=(1, 2), device="cpu"):
    """Step through SCENARIO, checking everything after each step; return the final caches."""
    history = {}
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        params.allocate_memory(layer)
    for step_dict in SCENARIO:
        before = [sum(len(t) for t in history.get((1, s), ([], []))[0]) for s in step_dict]
        params.pre_step(step_dict)
        assert params.batch_size == len(step_dict)
        assert params.get_seqlens_pre_step().tolist() == before
        for layer in layers:
            new = {
                s: (torch.randn(n, HEADS, DK, generator=generator),
                    torch.randn(n, HEADS, DV, generator=generator))
                for s, n in step_dict.items()
            }  # fmt: skip
            for s, (k, v) in new.items():
                ks, vs = history.setdefault((layer, s), ([], []))
                ks.append(k)
                vs.append(v)
            new_k = pack([k for k, _ in new.values()], qkv_format).to(device)
            new_v = pack([v for _, v in new.values()], qkv_format).to(device)
            result = params.step(layer, new_k, new_v, qkv_format)
            assert len(result) == 6
            k_cache, v_cache, cu_q, cu_kv, max_seqlen, out_format = result
            assert (k_cache, v_cache) == params.cache_manager.cache[layer]
            assert cu_q.dtype == cu_kv.dtype == torch.int32 and cu_q.shape == (MAX_BATCH + 1,)
            assert (
                cu_q.device == k_cache.device and k_cache.device.type == torch.device(device).type
            )
            assert cu_q.tolist() == cumulative(list(step_dict.values()))
            totals = [sum(len(t) for t in history[(layer, s)][0]) for s in step_dict]
            assert cu_kv.tolist() == cumulative(totals)
            assert max_seqlen == MAX_SEQ
            assert (
                out_format == {"bshd": "bshd", "sbhd": "sbhd_2bshd", "thd": "thd_2bshd"}[qkv_format]
            )
        for layer in layers:
            for row, s in enumerate(step_dict):
                ks, vs = history[(layer, s)]
                k, v = cached_tokens(params, layer, row, sum(len(t) for t in ks))
                torch.testing.assert_close(k.cpu(), torch.cat(ks), rtol=0, atol=0)
                torch.testing.assert_close(v.cpu(), torch.cat(vs), rtol=0, atol=0)
    assert dict(params.sequences) == {"c": 5, "a": 7}
    return {layer: params.convert_paged_to_nonpaged(layer) for layer in layers}


@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd", "thd"])
def test_paged_and_non_paged_hold_the_history(qkv_format):
    non_paged = run_scenario(make_params(False, qkv_format), qkv_format)
    paged = run_scenario(make_params(True, qkv_format), qkv_format)
    for layer in non_paged:
        for a, b in zip(non_paged[layer], paged[layer]):
            assert b.shape == (MAX_BATCH, MAX_SEQ, HEADS, a.shape[-1])
            for row, length in enumerate([5, 7]):  # the live sequences c and a
                torch.testing.assert_close(a[row, :length], b[row, :length], rtol=0, atol=0)


def test_cache_shapes_and_untouched_slots():
    non_paged, paged = make_params(False), make_params(True)
    for params in (non_paged, paged):
        params.allocate_memory(3)
    k, v = non_paged.cache_manager.cache[3]
    assert k.shape == (MAX_BATCH, MAX_SEQ, HEADS, DK) and v.shape == (MAX_BATCH, MAX_SEQ, HEADS, DV)
    k, v = paged.cache_manager.cache[3]
    pages = MAX_BATCH * MAX_SEQ // PAGE
    assert k.shape == (pages, PAGE, HEADS, DK) and v.shape == (pages, PAGE, HEADS, DV)
    assert paged.cache_manager.page_table.shape == (MAX_BATCH, MAX_SEQ // PAGE)
    # Padding (value 99) never reaches the cache: only the announced tokens are written.
    params = non_paged
    params.pre_step(OrderedDict(x=2))
    new_k = pack([torch.ones(2, HEADS, DK)], "bshd")
    params.step(3, new_k, pack([torch.ones(2, HEADS, DV)], "bshd"), "bshd")
    k, _ = params.cache_manager.cache[3]
    assert k[0, :2].eq(1).all() and k[0, 2:].eq(0).all() and k[1:].eq(0).all()


def test_cache_dtype_and_reset():
    params = make_params(False, dtype=torch.bfloat16)
    params.allocate_memory(1)
    params.pre_step(OrderedDict(s=1))
    new_k, new_v = torch.randn(1, 1, HEADS, DK), torch.randn(1, 1, HEADS, DV)
    k_cache, *_ = params.step(1, new_k, new_v, "bshd")
    assert k_cache.dtype == torch.bfloat16
    torch.testing.assert_close(k_cache[0, 0], new_k[0, 0].bfloat16(), rtol=0, atol=0)
    params.reset()
    assert params.batch_size == 0 and not params.sequences and params.cu_seqlens_kv.eq(0).all()
    assert 1 in params.cache_manager.cache  # memory stays allocated
    params.pre_step(OrderedDict(s=2))  # s starts again from length 0
    assert params.cu_seqlens_kv.tolist()[:2] == [0, 2]


def test_default_device_and_persistent_lengths():
    params = InferenceParams(2, 8, HEADS, DK, torch.float32)  # upstream's call, no device
    assert params.cu_seqlens_q.device == default_device()
    params.pre_step(OrderedDict(a=3))
    first = params.get_seqlens_pre_step()
    params.pre_step(OrderedDict(a=1, b=2))
    second = params.get_seqlens_pre_step()
    # One persistent buffer, updated in place (a captured graph reads the same memory).
    assert second.data_ptr() == first.data_ptr() and second.tolist() == [3, 0]
    assert params.cu_seqlens_q.tolist() == [0, 1, 3] and params.cu_seqlens_kv.tolist() == [0, 4, 6]


def test_paged_pages_are_recycled():
    params = make_params(True)
    manager = params.cache_manager
    params.pre_step(OrderedDict(a=MAX_SEQ, b=MAX_SEQ, c=MAX_SEQ))  # every page in use
    assert not manager._free_pages
    params.pre_step(OrderedDict(d=3))  # a, b, c finish; d takes two of their pages
    assert len(manager._free_pages) == MAX_BATCH * MAX_SEQ // PAGE - 2
    assert manager.page_table[0, :2].tolist() != manager.page_table[0, 2:].tolist()


def test_custom_cache_manager_gets_upstreams_arguments():
    calls = []

    class Recording(KVCacheManager):
        def __init__(self, max_batch_size, max_seqlen, num_heads, head_dim_k, dtype,
                     head_dim_v):  # fmt: skip
            super().__init__()
            calls.append(("init", max_batch_size, max_seqlen, num_heads, head_dim_k, head_dim_v))

        def allocate_memory(self, layer_number):
            self.cache[layer_number] = (torch.zeros(1), torch.zeros(1))

        def step(self, layer_number, new_k, new_v, cu_new, cu_cached, qkv_format):
            calls.append(("step", layer_number, cu_new.tolist(), cu_cached.tolist(), qkv_format))
            return (*self.cache[layer_number], None)

    params = InferenceParams(2, 6, HEADS, DK, torch.float32, head_dim_v=DV,
                             custom_cache_manager=Recording, device="cpu")  # fmt: skip
    params.allocate_memory(5)
    params.pre_step(OrderedDict(a=2))
    params.pre_step(OrderedDict(a=1, b=3))
    params.step(5, torch.zeros(2, 3, HEADS, DK), torch.zeros(2, 3, HEADS, DV), "bshd")
    assert calls == [("init", 2, 6, HEADS, DK, DV), ("step", 5, [0, 1, 4], [0, 3, 6], "bshd")]
    assert dict(params.sequences) == {"a": 3, "b": 3}


def test_constructor_refusals():
    with pytest.raises(AssertionError, match="num_heads_kv, head_dim_k and dtype"):
        InferenceParams(2, 8)
    with pytest.raises(AssertionError, match="page_size"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, is_paged=True, device="cpu")
    with pytest.raises(AssertionError, match="% page_size"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, is_paged=True, page_size=3,
                        total_num_pages=6, device="cpu")  # fmt: skip
    with pytest.raises(AssertionError, match="total_num_pages"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, is_paged=True, page_size=4,
                        total_num_pages=3, device="cpu")  # fmt: skip
    with pytest.raises(AssertionError, match="max_ctx_len"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, qkv_format="thd", device="cpu")
    with pytest.raises(ValueError, match="qkv_format"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, qkv_format="bsh", device="cpu")
    with pytest.raises(ValueError, match="max_batch_size=0"):
        InferenceParams(0, 8, HEADS, DK, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="max_ctx_len=9"):
        InferenceParams(2, 8, HEADS, DK, torch.float32, max_ctx_len=9, device="cpu")


def test_step_refusals():
    params = make_params(False)
    params.allocate_memory(1)
    k, v = torch.zeros(1, 2, HEADS, DK), torch.zeros(1, 2, HEADS, DV)
    with pytest.raises(RuntimeError, match="pre_step"):
        params.step(1, k, v, "bshd")
    with pytest.raises(TypeError, match="OrderedDict"):
        params.pre_step([("a", 1)])
    with pytest.raises(ValueError, match="max_batch_size=3"):
        params.pre_step(OrderedDict((i, 1) for i in range(4)))
    with pytest.raises(ValueError, match="brings 0 tokens"):
        params.pre_step(OrderedDict(a=0))
    with pytest.raises(ValueError, match="would hold 9 tokens"):
        params.pre_step(OrderedDict(a=9))
    params.pre_step(OrderedDict(a=2))
    with pytest.raises(ValueError, match="qkv_format"):
        params.step(1, k, v, "bhsd")
    with pytest.raises(ValueError, match="no cache"):
        params.step(7, k, v, "bshd")
    with pytest.raises(ValueError, match=r"new_k has shape \(1, 2, 3, 4\)"):
        params.step(1, torch.zeros(1, 2, 3, DK), v, "bshd")
    with pytest.raises(ValueError, match="up to 2 new tokens"):
        params.step(1, k[:, :1], v[:, :1], "bshd")  # 1 token slot, 2 announced
    with pytest.raises(ValueError, match="announced 2"):
        params.step(1, k[0, :1], v[0, :1], "thd")
    with pytest.raises(ValueError, match="would hold"):
        params.pre_step(OrderedDict(a=7))  # 2 cached + 7
    assert dict(params.sequences) == {"a": 2}  # a refused pre_step changed nothing


def test_managers_can_be_used_directly():
    manager = NonPagedKVCacheManager(2, 4, HEADS, DK, torch.float32, device="cpu")
    assert manager.head_dim_v == DK
    paged = PagedKVCacheManager(4, 2, HEADS, DK, torch.float32, 2, 4, device="cpu")
    assert paged.page_table.shape == (2, 2)


# --- GPU ---------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_cuda_scenario(paged, qkv_format):
    run_scenario(make_params(paged, qkv_format, device="cuda"), qkv_format, device="cuda")


@needs_cuda
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_captures_a_decoding_step(paged):
    params = make_params(paged, device="cuda")
    params.allocate_memory(1)
    params.pre_step(OrderedDict(a=2, b=1))
    params.step(1, torch.randn(2, 2, HEADS, DK, device="cuda"),
                torch.randn(2, 2, HEADS, DV, device="cuda"), "bshd")  # fmt: skip
    static_k = torch.zeros(2, 1, HEADS, DK, device="cuda")
    static_v = torch.zeros(2, 1, HEADS, DV, device="cuda")
    freqs = RotaryPositionEmbedding(DK, device="cuda")(MAX_SEQ)
    params.pre_step(OrderedDict(a=1, b=1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        params.step(1, static_k, static_v, "bshd")
        rotated = apply_rotary_pos_emb(
            static_k, freqs, "bshd", start_positions=params.get_seqlens_pre_step(), fused=True
        )
    for _ in range(3):  # each replay writes the tokens announced by the latest pre_step
        params.pre_step(OrderedDict(a=1, b=1))
        static_k.copy_(torch.randn_like(static_k))
        static_v.copy_(torch.randn_like(static_v))
        graph.replay()
        eager = apply_rotary_pos_emb(
            static_k, freqs, "bshd", start_positions=params.get_seqlens_pre_step(), fused=True
        )
        torch.testing.assert_close(rotated, eager, rtol=0, atol=0)  # positions moved on
        for row in range(2):
            length = int(params.cu_seqlens_kv[row + 1] - params.cu_seqlens_kv[row])
            k, v = cached_tokens(params, 1, row, length)
            torch.testing.assert_close(k[-1], static_k[row, 0], rtol=0, atol=0)
            torch.testing.assert_close(v[-1], static_v[row, 0], rtol=0, atol=0)


@needs_two_gpus
def test_layer_on_second_gpu_gets_its_cache_there():
    params = make_params(True, device="cuda:0")
    params.allocate_memory(1)
    params.pre_step(OrderedDict(a=2))
    k = torch.randn(1, 2, HEADS, DK, device="cuda:1")
    v = torch.randn(1, 2, HEADS, DV, device="cuda:1")
    with torch.cuda.device(0):
        k_cache, _, cu_q, cu_kv, _, _ = params.step(1, k, v, "bshd")
    assert k_cache.device == cu_q.device == cu_kv.device == torch.device("cuda", 1)
    torch.testing.assert_close(cached_tokens(params, 1, 0, 2)[0], k[0], rtol=0, atol=0)
    params.pre_step(OrderedDict(a=1))
    with pytest.raises(DevicePlacementError, match="one device"):
        params.step(1, k[:, :1].to("cuda:0"), v[:, :1].to("cuda:0"), "bshd")
