"""``parameters_split``: upstream's parameter order, and the split parameters as row ranges of one
buffer that the GEMM uses without a copy (and that stay one buffer across moves and copies)."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.pytorch.module import _contiguous_parameters
from transformer_engine.pytorch.module._linear_parameters import linear_bias, linear_weight

SPLIT = ("query_", "key_", "value_")
NAMES = ["query", "key", "value"]


def make(cls="Linear", bias=True, device="cpu", **kwargs):
    if cls == "Linear":
        return te.Linear(8, 24, bias=bias, parameters_split=SPLIT, device=device, **kwargs)
    return te.LayerNormLinear(8, 24, bias=bias, parameters_split=SPLIT, device=device, **kwargs)


@pytest.fixture(autouse=True)
def view_every_size(monkeypatch):
    """These layers are tiny: take the no-copy view at every size (the default keeps it for
    weights of 16 MiB and more; test_small_weights_are_concatenated)."""
    monkeypatch.setattr(_contiguous_parameters, "VIEW_MIN_BYTES", 0)


def parts(module, kind="weight"):
    return [getattr(module, f"{n}_{kind}") for n in NAMES]


def one_buffer(tensors) -> bool:
    """Whether ``tensors`` are back-to-back row ranges of one storage."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    offsets = [t.storage_offset() for t in tensors]
    expected = [sum(t.numel() for t in tensors[:i]) + offsets[0] for i in range(len(tensors))]
    return len(storages) == 1 and offsets == expected


@pytest.mark.parametrize("cls", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("bias", [True, False])
def test_upstream_order_all_weights_then_all_biases(cls, bias):
    names = [n for n, _ in make(cls, bias).named_parameters()]
    expected = ["layer_norm_weight", "layer_norm_bias"] if cls == "LayerNormLinear" else []
    expected += [f"{n}_weight" for n in NAMES] + ([f"{n}_bias" for n in NAMES] if bias else [])
    assert names == expected


def test_transformer_layer_qkv_order():
    layer = te.TransformerLayer(16, 32, 2, device="cpu")
    qkv = [n for n, _ in layer.named_parameters() if ".layernorm_qkv." in n]
    assert [n.rsplit(".", 1)[1] for n in qkv] == [
        "layer_norm_weight", "layer_norm_bias", "query_weight", "key_weight", "value_weight",
        "query_bias", "key_bias", "value_bias",
    ]  # fmt: skip


def test_split_parameters_share_one_buffer_and_the_gemm_takes_it_without_a_copy():
    module = make()
    assert one_buffer(parts(module)) and one_buffer(parts(module, "bias"))
    weight, bias = linear_weight(module), linear_bias(module)
    assert weight.shape == (24, 8) and weight.data_ptr() == module.query_weight.data_ptr()
    assert torch.equal(weight, torch.cat(parts(module)))
    # the bias is small: concatenated (less host time than a view's autograd node)
    assert bias.shape == (24,) and torch.equal(bias, torch.cat(parts(module, "bias")))


def test_small_weights_are_concatenated(monkeypatch):
    monkeypatch.setattr(_contiguous_parameters, "VIEW_MIN_BYTES", 24 * 8 * 4 + 1)
    module = make()
    assert one_buffer(parts(module))
    weight = linear_weight(module)
    assert weight.data_ptr() != module.query_weight.data_ptr()
    assert torch.equal(weight, torch.cat(parts(module)))
    monkeypatch.setattr(_contiguous_parameters, "VIEW_MIN_BYTES", 24 * 8 * 4)
    assert linear_weight(module).data_ptr() == module.query_weight.data_ptr()


def _saved_tensors(module, x):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return out, saved


def test_backward_keeps_no_copy_of_the_weight():
    # The weight saved for dgrad is the parameters' own buffer, not a concatenated copy.
    module = make()
    _, saved = _saved_tensors(module, torch.randn(4, 8, requires_grad=True))
    weights = [t for t in saved if t.shape == (24, 8)]
    assert weights and all(t.data_ptr() == module.query_weight.data_ptr() for t in weights)


@pytest.mark.parametrize("cls", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("separate", [False, True], ids=["one_buffer", "separate_storage"])
def test_outputs_and_gradients_match_the_dense_layer(cls, separate):
    torch.manual_seed(0)
    module = make(cls)
    if separate:  # a parameter assigned by hand: the GEMM concatenates instead
        module.key_weight = torch.nn.Parameter(module.key_weight.detach().clone())
        assert not one_buffer(parts(module))
    x = torch.randn(5, 8, dtype=torch.float64)
    w = torch.cat([p.detach() for p in parts(module)]).double().requires_grad_()
    b = torch.cat([p.detach() for p in parts(module, "bias")]).double().requires_grad_()
    x_ref = x.clone().requires_grad_()
    h = x_ref
    if cls == "LayerNormLinear":
        h = F.layer_norm(x_ref, (8,), module.layer_norm_weight.detach().double(),
                         module.layer_norm_bias.detach().double(), module.eps)  # fmt: skip
    ref = F.linear(h, w, b)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    xin = x.float().requires_grad_()
    out = module(xin)
    out.backward(dy.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xin.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-5)
    for i, (wp, bp) in enumerate(zip(parts(module), parts(module, "bias"))):
        rows = slice(8 * i, 8 * (i + 1))
        torch.testing.assert_close(wp.grad.double(), w.grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bp.grad.double(), b.grad[rows], rtol=1e-5, atol=1e-5)


def test_an_in_place_update_between_forward_and_backward_is_caught():
    # As for any weight autograd saved (torch.nn.Linear's too): not a silent stale backward.
    module = make()
    out = module(torch.randn(4, 8, requires_grad=True))
    with torch.no_grad():
        module.key_weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified inplace"):
        out.sum().backward()


def test_one_buffer_after_dtype_move_deepcopy_pickle_and_deferred_init():
    module = make()
    params_before = parts(module)
    moved = module.to(torch.float64)
    assert parts(moved)[0] is params_before[0]  # same Parameter objects (optimizers keep them)
    assert parts(moved)[0].dtype == torch.float64 and one_buffer(parts(moved))
    assert one_buffer(parts(moved, "bias"))
    copied = copy.deepcopy(moved)
    assert one_buffer(parts(copied)) and one_buffer(parts(copied, "bias"))
    assert all(torch.equal(a, b) for a, b in zip(parts(copied), parts(moved)))
    assert copied.query_weight.data_ptr() != moved.query_weight.data_ptr()
    buffer = io.BytesIO()
    torch.save(moved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert one_buffer(parts(loaded)) and all(
        torch.equal(a, b) for a, b in zip(parts(loaded), parts(moved))
    )
    deferred = make(device="meta")
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    assert one_buffer(parts(deferred)) and one_buffer(parts(deferred, "bias"))


def test_state_dict_round_trip_keeps_the_buffer():
    source, target = make(), make()
    target.load_state_dict(source.state_dict())
    assert one_buffer(parts(target))
    assert torch.equal(linear_weight(target), linear_weight(source))


def test_initialization_unchanged_by_the_buffer():
    # Each split weight drawn by init_method in turn, biases zero: the values the layer had when
    # each split parameter owned its storage (the same draws, in the same order).
    torch.manual_seed(3)
    module = make()
    torch.manual_seed(3)
    expected = []
    for _ in NAMES:
        w = torch.empty(8, 8)
        torch.nn.init.normal_(w, mean=0.0, std=0.023)
        expected.append(w)
    assert all(torch.equal(a, b) for a, b in zip(parts(module), expected))
    assert all(torch.count_nonzero(b) == 0 for b in parts(module, "bias"))
