"""The cast+transpose variants against the base kernel (forced by NVTE_CAST_TRANSPOSE_VARIANT=0),
bit for bit: FP8 data, transposed data, amax, scale_inv and the bias gradient. Variant 1: the
tall-tile kernel (gated backwards on the base kernel); variant 2 (the default): the same plus
the gated backward's paired-halves kernel (activation/gated_cast_transpose.cuh), checked for
every gated kind, input dtype and FP8 format, with and without the bias gradient and amax, on
edge shapes (partial tiles, one row, widths below a vector) and unaligned inputs.

The native library reads the variable once per process, so each variant runs every case in its
own subprocess (this file run as a script), which saves its results with torch.save; the tests
compare them (under pytest-xdist one worker runs the subprocesses, the others read the files).
Skipped without a CUDA GPU.
"""

import fcntl
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; runs on the GPU machine through qa/L0_pytorch_gpu/test.sh",
)

DEVICE = "cuda"
VARIANTS = [1, 2]
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
HIGH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Besides small and large shapes: rows a multiple of 16 (vector transposed stores) with a
# partial 128-row tile (400: three full ones, then a partial one; 384: three full) and a partial
# last column tile (136 = 2 x 64 + 8).
SHAPES = [(1, 1), (17, 33), (64, 64), (130, 200), (1000, 1000), (2048, 4096), (400, 136),
          (384, 192)]  # fmt: skip
ACT_SHAPES = [(17, 33), (130, 200), (1000, 1000), (2048, 4096), (400, 136)]  # (rows, out cols)
GATED_KINDS = ["geglu", "qgeglu", "reglu", "sreglu", "swiglu", "glu", "clamped_swiglu"]
# Gated backward, (rows, activation cols): one row; widths below a vector (3) and of one vector
# (8); element-wise loads (33); partial row and column tiles with vectors (130 x 200, 400 x 136:
# rows a multiple of 16 but not of 32, so vector transposed stores on full tiles); full tiles
# only (384 x 192, 2048 x 512); rows not a multiple of 16 (1000).
GATED_SHAPES = [(1, 8), (1, 3), (2, 1), (17, 33), (64, 64), (130, 200), (400, 136), (384, 192),
                (2048, 512), (1000, 1000)]  # fmt: skip
GATED_SHAPES_SHORT = [(1, 3), (17, 33), (400, 136), (384, 192)]  # fp16 / fp32 inputs


def _input(shape, dtype, seed, specials=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1)
    if specials and flat.numel() >= 8:
        flat[0], flat[1], flat[2], flat[3] = float("nan"), float("inf"), float("-inf"), -0.0
        flat[4], flat[5] = 1e30, 1e-30
    return x.to(dtype).to(DEVICE)


def _offset(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x one element past an aligned address (no vector loads)."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    y = buf[1:].view(x.shape)
    y.copy_(x)
    return y


def _gated_specs():
    """(name, kind, input dtype name, fp8 name, (rows, cols), mode) of every gated backward case;
    mode: "dbias" (bias gradient and amax), "plain" (neither), "offset-x" / "offset-grad" (that
    input one element past an aligned address: element-wise loads)."""
    specs = []
    for fn in FP8:
        for kind in GATED_KINDS:
            for hn in HIGH:
                shapes = GATED_SHAPES if hn == "bf16" else GATED_SHAPES_SHORT
                modes = [(shape, mode) for shape in shapes for mode in ("dbias", "plain")]
                modes += [((130, 200), "offset-x"), ((384, 192), "offset-grad")]
                for shape, mode in modes:
                    name = f"gated-bwd-{mode}-{kind}-{fn}-{hn}-{shape}"
                    specs.append((name, kind, hn, fn, shape, mode))
    return specs


def _bits(t):
    if t is None:
        return None
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def _result(res, amax=None, dbias=None) -> dict:
    return {
        "data": _bits(res.data),
        "transpose": _bits(res.transpose),
        "scale_inv": _bits(res.scale_inv),
        "amax": _bits(amax),
        "dbias": _bits(dbias),
    }


def _cases():
    """(name, function returning a dict of results): every case the variants must agree on."""
    from transformer_engine.pytorch.cpp_extensions import quantize
    from transformer_engine.pytorch.cpp_extensions.activation import (
        activation_backward_fp8,
        activation_forward_fp8,
        activation_spec,
    )
    from transformer_engine.pytorch.cpp_extensions.cast import quantize_dbias_prevalidated

    def scale():
        return torch.tensor([0.37], dtype=torch.float32, device=DEVICE)

    def amax0():
        return torch.zeros(1, dtype=torch.float32, device=DEVICE)

    def plain(x, fp8, **kw):
        amax = amax0()
        return _result(quantize(x, scale(), fp8, amax=amax, with_transpose=True, **kw), amax)

    cases = []
    for fn, fp8 in FP8.items():
        for hn, dtype in HIGH.items():
            for i, shape in enumerate(SHAPES):
                x = _input(shape, dtype, seed=i)
                cases.append((f"cast-{fn}-{hn}-{shape}", lambda x=x, fp8=fp8: plain(x, fp8)))
                cases.append(
                    (f"cast-offset-{fn}-{hn}-{shape}", lambda x=x, fp8=fp8: plain(_offset(x), fp8))
                )
                if shape[1] > 1:
                    big = _input((shape[0], shape[1] + 1), dtype, seed=100 + i)
                    sl = big[:, 1:]
                    cases.append((f"cast-slice-{fn}-{hn}-{shape}", lambda s=sl, f=fp8: plain(s, f)))

                def dbias_case(x=x, fp8=fp8):
                    amax = amax0()
                    res, dbias = quantize_dbias_prevalidated(x, scale(), fp8, amax=amax)
                    return _result(res, amax, dbias)

                cases.append((f"dbias-{fn}-{hn}-{shape}", dbias_case))

        x = _input((130, 200), torch.bfloat16, seed=7)

        def unaligned_outputs(x=x, fp8=fp8):
            # Outputs one byte past an aligned address: no vector stores of either copy.
            n = x.numel()
            out = torch.empty(n + 1, dtype=torch.uint8, device=DEVICE)[1:].view(x.shape)
            out_t = torch.empty(n + 1, dtype=torch.uint8, device=DEVICE)[1:].view(200, 130)
            return plain(x, fp8, out=out, out_transpose=out_t)

        def no_amax(x=x, fp8=fp8):
            return _result(quantize(x, scale(), fp8, with_transpose=True))

        def noop(x=x, fp8=fp8, flag=1.0):
            out = torch.full(x.shape, 0x5A, dtype=torch.uint8, device=DEVICE)
            out_t = torch.full((200, 130), 0xA5, dtype=torch.uint8, device=DEVICE)
            s_inv = torch.full((1,), 3.0, dtype=torch.float32, device=DEVICE)
            f = torch.tensor([flag], dtype=torch.float32, device=DEVICE)
            return plain(x, fp8, out=out, out_transpose=out_t, scale_inv=s_inv, noop_flag=f)

        cases.append((f"cast-unaligned-outputs-{fn}", unaligned_outputs))
        cases.append((f"cast-no-amax-{fn}", no_amax))
        cases.append((f"cast-noop-{fn}", noop))
        cases.append((f"cast-noop-off-{fn}", lambda n=noop: n(flag=0.0)))

        for act in ("gelu", "swiglu"):
            spec = activation_spec(act)
            gated = act == "swiglu"
            for hn in ("bf16", "fp32"):
                for i, (rows, cols) in enumerate(ACT_SHAPES):
                    x = _input((rows, 2 * cols if gated else cols), HIGH[hn], seed=20 + i)
                    grad = _input((rows, cols), HIGH[hn], seed=40 + i, specials=False)

                    def fwd(x=x, spec=spec, fp8=fp8):
                        amax = amax0()
                        res = activation_forward_fp8(
                            x, spec, scale(), fp8, amax=amax, with_transpose=True
                        )
                        return _result(res, amax)

                    def bwd(x=x, grad=grad, spec=spec, fp8=fp8):
                        amax = amax0()
                        res, dbias = activation_backward_fp8(
                            grad, x, spec, scale(), fp8, amax=amax, with_dbias=True
                        )
                        return _result(res, amax, dbias)

                    name = f"{act}-{fn}-{hn}-{(rows, cols)}"
                    cases.append((f"fwd-{name}", fwd))
                    cases.append((f"bwd-dbias-{name}", bwd))

    for name, kind, hn, fn, (rows, cols), mode in _gated_specs():
        seed = len(cases)
        x = _input((rows, 2 * cols), HIGH[hn], seed=seed)
        grad = _input((rows, cols), HIGH[hn], seed=seed + 1)
        if mode == "offset-x":
            x = _offset(x)
        elif mode == "offset-grad":
            grad = _offset(grad)

        spec = activation_spec(kind)

        def gated_bwd(x=x, grad=grad, spec=spec, fp8=FP8[fn], mode=mode):
            amax = None if mode == "plain" else amax0()
            res, dbias = activation_backward_fp8(
                grad, x, spec, scale(), fp8, amax=amax, with_dbias=mode != "plain"
            )
            return _result(res, amax, dbias)

        cases.append((name, gated_bwd))
    return cases


def _case_names():
    # The names only (no CUDA needed): built from the same loops as _cases.
    names = []
    for fn in FP8:
        for hn in HIGH:
            for shape in SHAPES:
                names += [f"cast-{fn}-{hn}-{shape}", f"cast-offset-{fn}-{hn}-{shape}"]
                if shape[1] > 1:
                    names.append(f"cast-slice-{fn}-{hn}-{shape}")
                names.append(f"dbias-{fn}-{hn}-{shape}")
        names += [f"cast-unaligned-outputs-{fn}", f"cast-no-amax-{fn}", f"cast-noop-{fn}"]
        names.append(f"cast-noop-off-{fn}")
        for act in ("gelu", "swiglu"):
            for hn in ("bf16", "fp32"):
                for shape in ACT_SHAPES:
                    names += [f"fwd-{act}-{fn}-{hn}-{shape}", f"bwd-dbias-{act}-{fn}-{hn}-{shape}"]
    names += [spec[0] for spec in _gated_specs()]
    return names


def _run_variant(variant: int, path: str) -> dict:
    env = dict(os.environ, NVTE_CAST_TRANSPOSE_VARIANT=str(variant))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), path],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"variant {variant} failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(path)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    if not hasattr(request.config, "workerinput"):  # one process: its own directory
        base = tmp_path_factory.mktemp("cast_transpose_variants")
        return {v: _run_variant(v, str(base / f"variant{v}.pt")) for v in [0, *VARIANTS]}
    # pytest-xdist: the workers of one session share their base directories' parent. The first
    # worker to take the lock runs the variants (a minute of GPU work); the others wait and
    # read its results, instead of every worker running them at once on the one GPU.
    shared = tmp_path_factory.getbasetemp().parent / "cast_transpose_variants"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            out = {}
            for v in [0, *VARIANTS]:
                path = shared / f"variant{v}.pt"
                out[v] = torch.load(path) if path.exists() else _run_variant(v, str(path))
            return out
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", _case_names())
def test_variant_bitwise_equal_to_base(results, variant, case):
    base, got = results[0][case], results[variant][case]
    for key, expected in base.items():
        if expected is None:
            assert got[key] is None, f"{case}: {key}"
        else:
            assert torch.equal(got[key], expected), f"{case}: {key} differs from variant 0"


def test_noop_wrote_nothing(results):
    # The no-op case must leave its pre-filled outputs alone in every variant.
    for variant, res in results.items():
        for fn in FP8:
            r = res[f"cast-noop-{fn}"]
            assert bool((r["data"] == 0x5A).all()), variant
            assert bool((r["transpose"] == 0xA5).all()), variant


if __name__ == "__main__":
    torch.manual_seed(0)
    out = {}
    for name, fn in _cases():
        out[name] = fn()
    torch.cuda.synchronize()
    assert sorted(out) == sorted(_case_names()), "case lists out of step"
    torch.save(out, sys.argv[1])
