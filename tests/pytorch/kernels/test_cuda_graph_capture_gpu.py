"""Native calls inside ``torch.cuda.graph`` capture: captured, replayed, bit for bit as eager.

Every ``nvte_*`` entry point opens a ``CallContext`` (transformer_engine/common/util/device.cpp).
While the call's stream is capturing it asks CUDA nothing that capture refuses: the stream-device
and buffer-placement double-checks (cudaStreamGetDevice, cudaPointerGetAttributes) are left out,
and ``cudaStreamIsCapturing`` is the only extra query. Each test warms up eagerly on a side stream
(as torch's CUDA-graph recipe asks), captures, replays on new inputs copied into the static ones,
and compares the replayed bytes with an eager run on the same inputs.

Runs on a CUDA machine (qa/L0_pytorch_gpu/test.sh); skipped elsewhere with that reason.
"""

from __future__ import annotations

import pytest
import torch
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Quantizer

pytestmark = needs_cuda

E4M3 = torch.float8_e4m3fn


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` on the CPU (NaNs compare equal, -0 differs from +0)."""
    return t.detach().contiguous().view(torch.uint8).cpu()


def capture(fn):
    """Warm ``fn`` up on a side stream, capture it, return ``(graph, static outputs)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def assert_replay_matches_eager(fn, x, new_x) -> None:
    """Capture ``fn``, write ``new_x`` into its input ``x``, replay, and compare every output
    the replay wrote with an eager ``fn()`` on the same input, byte for byte."""
    graph, out = capture(fn)
    x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    eager = fn()
    out, eager = (out, eager) if isinstance(out, tuple) else ((out,), (eager,))
    for got, want in zip(out, eager, strict=True):
        assert torch.equal(bits(got), bits(want))


def inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 5).to(device())


def test_quantize_and_dequantize_are_capturable():
    x = inputs((64, 128), 0)
    scale = torch.full([1], 0.75, device=device())

    def fn():
        res = ext.quantize(x, scale, E4M3, with_transpose=True)
        return res.data, res.transpose, res.scale_inv, ext.dequantize(res.data, res.scale_inv)

    assert_replay_matches_eager(fn, x, inputs((64, 128), 1))


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_quantizers_are_capturable(kind):
    x = inputs((32, 64), 2)
    if kind == "delayed":
        q = Float8Quantizer(
            torch.full([1], 0.5, device=device()), torch.zeros(1, device=device()), E4M3
        )
    else:
        q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device=device())

    def fn():
        y = q(x)
        return y._data, y._transpose, y._scale_inv

    with torch.no_grad():
        assert_replay_matches_eager(fn, x, inputs((32, 64), 3))


def test_current_scaling_cast_is_capturable():
    from transformer_engine.pytorch.cpp_extensions.cast import (
        quantize_current_scaling_prevalidated,
    )

    x = inputs((48, 96), 4)

    def fn():
        res, _ = quantize_current_scaling_prevalidated(
            x, E4M3, epsilon=0.0, force_pow_2_scales=False, with_transpose=True, with_dbias=False
        )
        return res.data, res.transpose, res.scale_inv

    assert_replay_matches_eager(fn, x, inputs((48, 96), 5))


def test_delayed_scaling_update_is_capturable():
    hist0 = inputs((4, 3), 6).abs()
    scale0 = torch.ones(3, device=device())
    hist, scale = hist0.clone(), scale0.clone()

    def fn():
        ext.delayed_scaling_update([hist], [scale], E4M3, margin=0.0, amax_compute_algo="max")

    graph, _ = capture(fn)
    hist.copy_(hist0)
    scale.copy_(scale0)
    graph.replay()
    torch.cuda.synchronize()
    replayed = (bits(hist), bits(scale))
    hist.copy_(hist0)
    scale.copy_(scale0)
    fn()
    assert torch.equal(replayed[0], bits(hist)) and torch.equal(replayed[1], bits(scale))


@pytest.mark.parametrize(
    "recipe", [DelayedScaling, Float8CurrentScaling], ids=["delayed", "current"]
)
def test_linear_fp8_forward_is_capturable(recipe):
    torch.manual_seed(0)
    layer = te.Linear(128, 64, params_dtype=torch.bfloat16, device=device())
    x = inputs((32, 128), 7).to(torch.bfloat16)
    r = recipe()

    def fn():
        with te.autocast(recipe=r):
            return layer(x)

    # No grad: the forward scales stay put (they update only on a grad-mode autocast exit), so
    # the eager run after the replay sees the same scales as the captured one.
    with torch.no_grad():
        assert_replay_matches_eager(fn, x, inputs((32, 128), 8).to(torch.bfloat16))


def test_linear_fp8_training_step_captured_by_hand_keeps_scales_moving():
    """A te.Linear forward + backward under DelayedScaling captured with ``torch.cuda.graph``
    (not make_graphed_callables): the modules register their state and the autocast exit's
    forward update and the backward update are captured with the step, so every replay rolls
    the amax histories and rescales: the input and grad-output scales follow the largest amax
    replayed (fp8_max / amax, history of 1024 with "max"), as fed in here."""
    torch.manual_seed(0)
    layer = te.Linear(128, 64, params_dtype=torch.bfloat16, device=device())
    x = inputs((32, 128), 11).to(torch.bfloat16).requires_grad_()
    dy = inputs((32, 64), 12).to(torch.bfloat16)
    x0, dy0 = x.detach().clone(), dy.clone()
    r = DelayedScaling()

    def fn():
        with te.autocast(recipe=r):
            y = layer(x)
        y.backward(dy)

    graph, _ = capture(fn)
    amax_x, amax_dy = [x0.abs().max().float()], [dy0.abs().max().float()]
    for factor in (2.0, 8.0, 4.0):
        with torch.no_grad():
            x.copy_(x0 * factor)
            dy.copy_(dy0 * factor)
        amax_x.append((x0 * factor).abs().max().float())
        amax_dy.append((dy0 * factor).abs().max().float())
        graph.replay()
        torch.cuda.synchronize()
        fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
        expect_fwd = torch.tensor(448.0, device=device()) / max(amax_x)
        expect_bwd = torch.tensor(57344.0, device=device()) / max(amax_dy)
        assert torch.equal(fwd.scale[0], expect_fwd), (factor, fwd.scale[0], expect_fwd)
        assert torch.equal(bwd.scale[0], expect_bwd), (factor, bwd.scale[0], expect_bwd)


def test_emulated_mxfp8_gemm_is_capturable():
    """Off Blackwell the MXFP8 GEMM is emulated (its operands dequantized through
    ``reference.fp8_to_float32_unscaled``), which must ask the device nothing during capture;
    the replayed product is the eager one's on the same operands."""
    from transformer_engine.pytorch.tensor import MXFP8Quantizer

    x, w = inputs((64, 128), 4), inputs((32, 128), 5)
    q = MXFP8Quantizer(DType.kFloat8E4M3)

    def fn():
        return ext.general_gemm(q(w), q(x), out_dtype=torch.float32, layout="TN")[0]

    with torch.no_grad():
        assert_replay_matches_eager(fn, x, inputs((64, 128), 6))
