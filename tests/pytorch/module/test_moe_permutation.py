"""te.moe_permute and its family against loop-built oracles in float64: the expert-major row
order, drops past num_out_tokens, the weighted un-permute, padding to an alignment, chunk
sorting, and gradients (to the tokens and to the merging probabilities) through autograd of the
oracle."""

import pytest
import torch

import transformer_engine.pytorch as te

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _routing(tokens=7, experts=5, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    mask = torch.zeros(tokens, experts, dtype=torch.int32)
    mask.scatter_(1, choice, 1)
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64) * mask
    x = torch.randn(tokens, 3, generator=gen, dtype=torch.float64)
    return x, mask, choice, probs


def _oracle_pairs_mask(mask):
    """(token, expert) pairs in output order: expert by expert, tokens in order."""
    return [(t, e) for e in range(mask.shape[1]) for t in range(mask.shape[0]) if mask[t, e]]


def _oracle_pairs_index(choice):
    """(token, slot) pairs sorted by expert id, ties in (token, slot) order."""
    pairs = [(t, k) for t in range(choice.shape[0]) for k in range(choice.shape[1])]
    return sorted(pairs, key=lambda p: int(choice[p]))


@pytest.mark.parametrize("device", DEVICES)
def test_mask_permute_and_unpermute(device):
    x, mask, _, probs = _routing()
    x, mask, probs = x.to(device), mask.to(device), probs.to(device)
    pairs = _oracle_pairs_mask(mask.cpu())
    out, row_id_map = te.moe_permute(x, mask, len(pairs))
    expected = torch.stack([x[t] for t, _ in pairs])
    assert torch.equal(out, expected)
    # weighted: each token's copies times their probabilities, summed
    restored = te.moe_unpermute(out, row_id_map, merging_probs=probs)
    torch.testing.assert_close(restored, (probs.sum(1, keepdim=True) * x), rtol=1e-12, atol=0)
    # unweighted: each token times its number of copies
    counts = mask.sum(1, keepdim=True).double()
    torch.testing.assert_close(te.moe_unpermute(out, row_id_map), counts * x, rtol=1e-12, atol=0)


def test_megatron_bool_mask_and_probs():
    """Megatron's routing map is a bool mask; its own (unfused) permute is a masked_select."""
    x, mask, _, probs = _routing(tokens=9, experts=4)
    routing = mask.bool()
    out, permuted_probs, row_id_map = te.moe_permute_with_probs(x, probs, routing, int(mask.sum()))
    indices = torch.arange(9).unsqueeze(0).expand(4, -1).masked_select(routing.T)
    assert torch.equal(out, x.index_select(0, indices))
    assert torch.equal(permuted_probs, probs.T.contiguous().masked_select(routing.T))
    back = te.moe_unpermute(out, row_id_map, merging_probs=probs, restore_shape=(9, 3))
    torch.testing.assert_close(back, probs.sum(1, keepdim=True) * x, rtol=1e-12, atol=0)


def test_rows_past_num_out_tokens_are_dropped():
    x, mask, _, _ = _routing()
    pairs = _oracle_pairs_mask(mask)
    keep = len(pairs) - 3
    out, row_id_map = te.moe_permute(x, mask, keep)
    assert out.shape == (keep, 3)
    assert torch.equal(out, torch.stack([x[t] for t, _ in pairs[:keep]]))
    expected = torch.zeros_like(x)
    for t, _ in pairs[:keep]:
        expected[t] += x[t]
    assert torch.equal(te.moe_unpermute(out, row_id_map), expected)


def test_index_map():
    x, _, choice, _ = _routing(tokens=6, experts=4, topk=3)
    pairs = _oracle_pairs_index(choice)
    out, row_id_map = te.moe_permute(x, choice, 0, map_type="index")
    assert torch.equal(out, torch.stack([x[t] for t, _ in pairs]))
    weights = torch.rand(6, 3, dtype=torch.float64)
    back = te.moe_unpermute(out, row_id_map, merging_probs=weights, map_type="index")
    torch.testing.assert_close(back, weights.sum(1, keepdim=True) * x, rtol=1e-12, atol=0)


def test_gradients_match_the_oracle():
    x, mask, _, probs = _routing()
    pairs = _oracle_pairs_mask(mask)
    ours_x, ours_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, permuted_probs, row_id_map = te.moe_permute_with_probs(ours_x, ours_p, mask, len(pairs))
    expert_out = out * torch.linspace(0.5, 2.0, out.shape[0], dtype=torch.float64)[:, None]
    y = te.moe_unpermute(expert_out, row_id_map, merging_probs=ours_p)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    ((y * w).sum() + (permuted_probs**2).sum()).backward()

    ref_x, ref_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    scale = torch.linspace(0.5, 2.0, len(pairs), dtype=torch.float64)
    ref_y = torch.zeros_like(x)
    for row, (t, e) in enumerate(pairs):
        ref_y = ref_y.index_add(0, torch.tensor([t]), (ref_x[t] * scale[row] * ref_p[t, e])[None])
    pp = torch.stack([ref_p[t, e] for t, e in pairs])
    ((ref_y * w).sum() + (pp**2).sum()).backward()
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours_x.grad, ref_x.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_p.grad, ref_p.grad, rtol=1e-12, atol=1e-15)


def test_pad_to_alignment():
    x, mask, _, probs = _routing(tokens=9, experts=4, topk=2)
    counts = mask.sum(0)
    out, pprobs, row_id_map, pad_offsets, target = te.moe_permute_and_pad_with_probs(
        x, probs, mask, counts, 4
    )
    assert torch.equal(target, (counts + 3) // 4 * 4)
    assert out.shape[0] == int(target.sum())
    pairs = _oracle_pairs_mask(mask)
    start = 0
    for e in range(4):
        block = [t for t, ee in pairs if ee == e]
        rows = out[start : start + int(target[e])]
        assert torch.equal(rows[: len(block)], x[block])
        assert torch.all(rows[len(block) :] == 0)
        assert torch.equal(pprobs[start : start + len(block)], probs[block, e])
        start += int(target[e])
    back = te.moe_unpermute(out, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
    torch.testing.assert_close(back, probs.sum(1, keepdim=True) * x, rtol=1e-12, atol=0)
    # already aligned: no padding, no offsets
    _, _, _, none, same = te.moe_permute_and_pad_with_probs(x, probs, mask, counts, 1)
    assert none is None and torch.equal(same, counts)


def test_sort_chunks_by_index():
    x = torch.arange(12.0).reshape(6, 2)
    probs = torch.arange(6.0)
    sizes, order = torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1])
    expected_rows = [3, 4, 5, 0, 1, 2]
    out = te.moe_sort_chunks_by_index(x, sizes, order)
    assert isinstance(out, torch.Tensor) and torch.equal(out, x[expected_rows])
    out2, p2 = te.moe_sort_chunks_by_index_with_probs(x, probs, sizes, order)
    assert torch.equal(out2, x[expected_rows]) and torch.equal(p2, probs[expected_rows])
    g = torch.zeros(6, 2, requires_grad=True)
    te.moe_sort_chunks_by_index(g, sizes, order).mul(torch.arange(6.0)[:, None]).sum().backward()
    assert torch.equal(g.grad[:, 0], torch.tensor([3.0, 4.0, 5.0, 0.0, 1.0, 2.0]))


def test_bad_arguments_are_refused():
    x, mask, choice, probs = _routing()
    with pytest.raises(ValueError, match="map_type"):
        te.moe_permute(x, mask, 4, map_type="dense")
    with pytest.raises(ValueError, match="num_out_tokens > 0"):
        te.moe_permute(x, mask)
    with pytest.raises(ValueError, match="routing_map must be"):
        te.moe_permute(x, mask[:3], 4)
    out, row_id_map = te.moe_permute(x, mask, int(mask.sum()))
    with pytest.raises(ValueError, match="not both"):
        te.moe_unpermute(out, row_id_map, merging_probs=probs, probs=probs)
    with pytest.raises(ValueError, match="align_size"):
        te.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0), 0)
