"""FSDP2's all-gather hooks of ``Float8Tensor`` (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``), driven by hand the way ``fully_shard`` drives them: shards made by
``new_zeros`` + ``narrow`` + ``copy_`` (padded for uneven sizes), their bytes concatenated as
the all-gather does, the whole tensor rebuilt, then refreshed in place after an optimizer-like
re-quantization of the shards. The oracle is the hand cast of ``fp8_oracle``. Training under
real FSDP2 on two processes is in ``distributed/test_fsdp2_gloo.py``."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from float8_tensor_helpers import DelayedState, expected_bytes, sample

from transformer_engine.pytorch.device import is_non_tn_fp8_gemm_supported
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer

WORLD = 2


class StubMesh:
    """The two things the hooks ask of FSDP2's shard mesh."""

    def __init__(self, size: int = WORLD) -> None:
        self._size = size
        self.group = object()  # stands for the process group

    def size(self) -> int:
        return self._size

    def get_group(self):
        return self.group


def fsdp_shards(param: torch.Tensor, world: int = WORLD) -> list[torch.Tensor]:
    """Each rank's local tensor as ``fully_shard`` makes it (torch 2.x ``FSDPParam``)."""
    chunks = list(torch.chunk(param, world, dim=0))
    padded_size = chunks[0].size()
    shards = []
    for rank in range(world):
        chunk = chunks[rank] if rank < len(chunks) else None
        padded = param.new_zeros(padded_size)
        rows = chunk.size(0) if chunk is not None else 0
        if rows:
            padded.narrow(0, 0, rows).copy_(chunk)
        shards.append(padded.narrow(0, 0, rows))
    return shards


def all_gather(shards, shape):
    """``(all-gather output as FSDP2 hands it to the post hook, metadata)``."""
    inputs, metadata = [], None
    for shard in shards:
        (sent,), metadata = shard.fsdp_pre_all_gather(
            StubMesh(), shape, None, None, None
        )  # fmt: skip
        inputs.append(sent)
    return torch.cat(inputs), metadata


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def delayed_weight(shape=(5, 16), scale=2.0, seed=0, device="cpu"):
    state = DelayedState(scale=scale)
    state.scale, state.amax_history = state.scale.to(device), state.amax_history.to(device)
    x = sample(shape, seed=seed)
    weight = state.quantizer().quantize(x.to(device))
    return state, x, weight


def test_shards_send_their_row_wise_bytes_padded_to_the_shard_size():
    _, x, weight = delayed_weight((5, 16))  # 5 rows over 2 ranks: 3 and 2, padded to 3
    assert weight._transpose is not None
    bytes_ = expected_bytes(x, 2.0)
    shards = fsdp_shards(weight)
    for rank, shard in enumerate(shards):
        (sent,), _ = shard.fsdp_pre_all_gather(StubMesh(), weight.shape, None, None, None)
        assert sent.dtype == torch.uint8 and tuple(sent.shape) == (3, 16)
        rows = bytes_[3 * rank : 3 * rank + 3]
        assert torch.equal(sent[: rows.shape[0]], rows)
        assert torch.all(sent[rows.shape[0] :] == 0)
        # the shard keeps row-wise bytes only, and is a whole tensor with its own scale
        assert shard._transpose is None and not shard._shares_scale_with_base
        assert shard._quantizer.columnwise_usage is False


@pytest.mark.parametrize("device", DEVICES)
def test_the_whole_weight_is_rebuilt_around_the_gathered_bytes(device):
    _, x, weight = delayed_weight((5, 16), device=device)
    gathered, metadata = all_gather(fsdp_shards(weight), weight.shape)
    shard = fsdp_shards(weight)[0]
    tensor, freed = shard.fsdp_post_all_gather((gathered,), metadata, torch.bfloat16)
    assert type(tensor) is type(weight) and tensor.shape == weight.shape
    assert tensor.dtype == torch.bfloat16 and tensor.device == weight.device
    assert torch.equal(tensor._data.cpu(), expected_bytes(x, 2.0))
    assert tensor._data.data_ptr() == gathered.data_ptr()  # a view: FSDP2 frees it
    if is_non_tn_fp8_gemm_supported(tensor.device):  # the bytes serve both layouts
        assert tensor._transpose is None and freed == []
    else:
        assert torch.equal(tensor._transpose.cpu(), expected_bytes(x, 2.0).t())
        assert len(freed) == 1 and freed[0] is tensor._transpose
    assert torch.equal(tensor._scale_inv.cpu(), torch.tensor([0.5]))
    assert torch.equal(tensor.dequantize(dtype=torch.float32), weight.dequantize())


@pytest.mark.parametrize("device", DEVICES)
def test_later_all_gathers_refresh_the_parameter_in_place(device):
    state, _, weight = delayed_weight((6, 16), device=device)
    shards = fsdp_shards(weight)
    gathered, metadata = all_gather(shards, weight.shape)
    tensor, freed = shards[0].fsdp_post_all_gather((gathered,), metadata, torch.float32)
    # as FSDP2 makes its unsharded parameter of it
    param = torch.nn.Parameter(torch.as_strided(tensor, (6, 16), (16, 1), 0))
    transposed = not is_non_tn_fp8_gemm_supported(param.device)
    if transposed:
        assert param._transpose.untyped_storage().data_ptr() == freed[0].data_ptr()
    # an optimizer step: a new scale, every shard re-quantized in place (the stub mesh has no
    # process group to all-reduce the amax over)
    for shard in shards:
        shard._quantizer.amax_reduction_group = None
    state.scale.fill_(4.0)
    y = sample((6, 16), seed=1)
    for rank, shard in enumerate(shards):
        shard.quantize_(y[3 * rank : 3 * rank + 3].to(device))
    new_gathered, _ = all_gather(shards, weight.shape)
    gathered.copy_(new_gathered)  # FSDP2 all-gathers into the same output buffer
    assert shards[0].fsdp_post_all_gather((gathered,), metadata, torch.float32, out=param) is None
    assert torch.equal(param._data.cpu(), expected_bytes(y, 4.0))
    if transposed:  # the buffer FSDP2 frees
        assert torch.equal(freed[0].cpu(), expected_bytes(y, 4.0).t())
    assert torch.equal(param._scale_inv.cpu(), torch.tensor([0.25]))
    assert torch.equal(param.dequantize(), torch.cat([s.dequantize() for s in shards]))


def test_a_parameter_whose_bytes_were_replaced_is_not_refreshed_silently():
    _, _, weight = delayed_weight((4, 16))
    shards = fsdp_shards(weight)
    gathered, metadata = all_gather(shards, weight.shape)
    tensor, _ = shards[0].fsdp_post_all_gather((gathered,), metadata, torch.float32)
    tensor._data = tensor._data.clone()
    with pytest.raises(RuntimeError, match="all-gather buffer"):
        shards[0].fsdp_post_all_gather((gathered,), metadata, torch.float32, out=tensor)


def test_shard_quantizers_reduce_the_amax_over_the_shard_group():
    state, _, weight = delayed_weight((4, 16))
    shard = fsdp_shards(weight)[0]
    mesh = StubMesh()
    shard.fsdp_pre_all_gather(mesh, weight.shape, None, None, None)
    q = shard._quantizer
    assert q is not weight._quantizer and weight._quantizer.amax_reduction_group is None
    assert q.amax_reduction_group is mesh.group
    # still the module's delayed-scaling state: scale updates reach the shard's casts
    assert q.scale.data_ptr() == state.scale[1].data_ptr()
    assert q.amax.data_ptr() == state.amax_history[0][1].data_ptr()

    current = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device="cpu")
    cw = current.quantize(sample((4, 16)))
    cshard = fsdp_shards(cw)[1]
    cshard.fsdp_pre_all_gather(mesh, cw.shape, None, None, None)
    assert cshard._quantizer.with_amax_reduction is True
    assert cshard._quantizer.amax_reduction_group is mesh.group
    assert cw._quantizer.with_amax_reduction is False


def test_a_delayed_quantizer_with_a_group_still_pickles_and_copies():
    state = DelayedState()
    q = state.quantizer()
    q.amax_reduction_group = threading.Lock()  # like a process group: does not pickle
    restored = pickle.loads(pickle.dumps(q))
    assert restored.amax_reduction_group is None
    assert q.copy().amax_reduction_group is None


def test_shards_along_another_dim_are_refused():
    _, _, weight = delayed_weight((4, 16))
    column_shard = weight.dequantize()[:, :8]
    shard = weight._quantizer.quantize(column_shard)
    with pytest.raises(NotImplementedError, match="dim 0"):
        shard.fsdp_pre_all_gather(StubMesh(), weight.shape, None, None, None)


def test_a_shard_without_row_wise_bytes_is_refused():
    _, _, weight = delayed_weight((4, 16))
    shard = fsdp_shards(weight)[0]
    shard.update_usage(rowwise_usage=False, columnwise_usage=True)
    with pytest.raises(RuntimeError, match="row-wise"):
        shard.fsdp_pre_all_gather(StubMesh(), weight.shape, None, None, None)


def test_the_hooks_have_the_signature_fsdp2_calls():
    """FSDP2 calls the 5-argument pre hook (it asserts 1 or 5 parameters) and passes the
    post hook ``out=`` by keyword."""
    import inspect

    _, _, weight = delayed_weight((4, 16))
    assert len(inspect.signature(weight.fsdp_pre_all_gather).parameters) == 5
    assert "out" in inspect.signature(weight.fsdp_post_all_gather).parameters
