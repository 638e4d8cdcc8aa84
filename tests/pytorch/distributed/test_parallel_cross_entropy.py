"""te.parallel_cross_entropy against torch.nn.functional.cross_entropy in float64 (the whole
vocabulary on one process), and with the vocabulary split over 2 processes on gloo (CPU):
losses and logit gradients of every rank's share equal the unsplit oracle's."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

IGNORE = -100


def _oracle(logits, target, smoothing, reduce_loss, ignore_idx=IGNORE):
    """Loss (and, through autograd, gradients) of the whole vocabulary in float64."""
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.double().reshape(-1, vocab),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing,
        ignore_index=ignore_idx,
    ).reshape(target.shape)
    if reduce_loss:
        return loss.sum() / (target != ignore_idx).sum().clamp_min(1)
    return loss


def _case(shape=(3, 5), vocab=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::4] = IGNORE
    weights = torch.randn(shape, generator=gen, dtype=torch.float64)
    return logits, target, weights


def _grads(logits, target, smoothing, reduce_loss, weights, **kw):
    """(loss, d(sum(loss * weights))/d logits) of ours and of the oracle."""
    ours_in = logits.clone().requires_grad_()
    loss = parallel_cross_entropy(ours_in, target, smoothing, reduce_loss, **kw)
    w = weights if not reduce_loss else torch.tensor(1.7, dtype=torch.float64)
    (grad,) = torch.autograd.grad((loss.double() * w).sum(), ours_in)
    ref_in = logits.double().requires_grad_()
    ref = _oracle(ref_in, target, smoothing, reduce_loss)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), ref_in)
    return loss, grad, ref, ref_grad


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (7,)], ids=["bsv", "sbv", "tokens"])
def test_matches_torch_cross_entropy(smoothing, reduce_loss, shape):
    logits, target, weights = _case(shape)
    loss, grad, ref, ref_grad = _grads(logits, target, smoothing, reduce_loss, weights)
    assert loss.dtype == torch.float32
    assert loss.shape == (() if reduce_loss else target.shape)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    # ignored tokens: zero loss and zero gradient
    ignored = target == IGNORE
    assert torch.all(grad[ignored] == 0)
    if not reduce_loss:
        assert torch.all(loss[ignored] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype):
    logits, target, weights = _case(dtype=dtype)
    loss, grad, ref, ref_grad = _grads(logits, target, 0.1, False, weights)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # The loss comes from the logits' exact values in float32; the gradient is rounded once to
    # the logits' dtype, then scaled.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-2)


def test_loss_without_a_gradient_is_the_same():
    """Logits that need no gradient (evaluation): no gradient is made, the loss is the same."""
    logits, target, _ = _case()
    with_grad = parallel_cross_entropy(logits.clone().requires_grad_(), target, 0.1)
    with torch.no_grad():
        without = parallel_cross_entropy(logits, target, 0.1)
    assert without.grad_fn is None
    assert torch.equal(without, with_grad.detach())


def test_every_token_ignored_gives_zero_mean():
    logits, target, _ = _case()
    target.fill_(IGNORE)
    x = logits.clone().requires_grad_()
    loss = parallel_cross_entropy(x, target, 0.0, True)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(x.grad == 0)


def test_large_logits_do_not_overflow():
    logits, target, weights = _case()
    logits = logits + 1e4
    loss, grad, ref, ref_grad = _grads(logits, target, 0.0, False, weights)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-3)
    assert torch.isfinite(grad).all()


def test_deprecated_input_keyword_and_public_name():
    logits, target, _ = _case()
    assert te.parallel_cross_entropy is parallel_cross_entropy
    with pytest.warns(FutureWarning, match="_input"):
        loss = parallel_cross_entropy(_input=logits, target=target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(loss, parallel_cross_entropy(logits, target))
    with pytest.raises(ValueError, match="not both"), pytest.warns(FutureWarning):
        parallel_cross_entropy(logits, target, _input=logits)


def test_bad_arguments_are_refused():
    logits, target, _ = _case()
    with pytest.raises(ValueError, match="target has shape"):
        parallel_cross_entropy(logits, target[:, :2])
    with pytest.raises(TypeError, match="integer class indices"):
        parallel_cross_entropy(logits, target.float())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        parallel_cross_entropy(logits.double(), target)
    with pytest.raises(ValueError, match="label_smoothing"):
        parallel_cross_entropy(logits, target, 1.5)


# --- the vocabulary split over two processes ---------------------------------------------------

WORLD = 2
CASES = [(s, r) for s in (0.0, 0.2) for r in (False, True)]


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for smoothing, reduce_loss in CASES:
            logits, target, weights = _case(vocab=40)
            share = logits.shape[-1] // WORLD
            mine = logits[..., rank * share : (rank + 1) * share].clone().requires_grad_()
            loss = parallel_cross_entropy(
                mine, target, smoothing, reduce_loss, dist_process_group=dist.group.WORLD
            )
            w = weights if not reduce_loss else torch.tensor(1.7, dtype=torch.float64)
            (loss.double() * w).sum().backward()
            results[(smoothing, reduce_loss)] = (loss.detach(), mine.grad)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("xent")
    mp.spawn(_worker, args=(str(out / "init"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("smoothing,reduce_loss", CASES)
def test_vocabulary_split_over_two_processes(split_results, smoothing, reduce_loss):
    logits, target, weights = _case(vocab=40)
    _, _, ref, ref_grad = _grads(logits, target, smoothing, reduce_loss, weights)
    share = logits.shape[-1] // WORLD
    for rank, results in enumerate(split_results):
        loss, grad = results[(smoothing, reduce_loss)]
        torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
        expected = ref_grad[..., rank * share : (rank + 1) * share]
        torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-7)


# --- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_logits_and_graph_capture():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4096, 3001, generator=gen) * 4).bfloat16().cuda()
    target = torch.randint(0, 3001, (4096,), generator=gen).cuda()
    target[::7] = IGNORE
    ref = _oracle(logits.cpu(), target.cpu(), 0.1, True)
    static_in = logits.clone().requires_grad_()
    # warm up on a side stream, then capture forward and backward
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        parallel_cross_entropy(static_in, target, 0.1, True).backward()
    torch.cuda.current_stream().wait_stream(side)
    static_in.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = parallel_cross_entropy(static_in, target, 0.1, True, is_cg_capturable=True)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    eager_in = logits.clone().requires_grad_()
    parallel_cross_entropy(eager_in, target, 0.1, True).backward()
    assert torch.equal(static_in.grad, eager_in.grad)
