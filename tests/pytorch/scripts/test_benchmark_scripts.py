"""The benchmark scripts stay runnable: the CPU host-overhead tool runs a few steps anywhere, and
the GPU benchmarks refuse clearly without the GPUs they need (they are run on the GPU machine,
never timed in tests)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def run(script, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_host_overhead_tool_runs_a_few_steps_without_a_gpu():
    result = run("benchmarks/linear/host_overhead_without_gpu.py", "--steps", "5", "--rounds", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "configuration", "host", "us/step", "Python", "calls/step", "aten", "ops/step",
        "native/step",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == [
        "linear-delayed", "linear-current", "linear-block", "linear-bf16", "mlp-delayed",
        "mlp-current", "mlp-bf16", "ops-delayed",
    ]  # fmt: skip
    for micros, calls, ops, _native in rows.values():
        assert float(micros) > 0 and 50 < int(calls) < 5000 and 0 < int(ops) < 500
    # Every FP8 configuration runs its casts through the (stubbed) native kernels; BF16 te.Linear
    # none, the BF16 MLP its norm and activation kernels only (forward and backward each).
    assert all(int(rows[name][3]) > 0 for name in rows if name != "linear-bf16")
    assert int(rows["linear-bf16"][3]) == 0
    assert int(rows["mlp-bf16"][3]) == 4
    # The fuser's path reaches the same native calls and torch ops as the module's.
    assert rows["ops-delayed"][2:] == rows["linear-delayed"][2:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script would run in full")
@pytest.mark.parametrize(
    "script, message",
    [
        ("benchmarks/linear/benchmark_linear.py", "needs a CUDA GPU"),
        ("benchmarks/multi_device/benchmark_split_model.py", "needs two CUDA GPUs"),
        ("benchmarks/mlp/benchmark_mlp.py", "needs a CUDA GPU"),
        ("benchmarks/mlp/benchmark_kernels.py", "needs a CUDA GPU"),
        ("benchmarks/linear/benchmark_graphed.py", "needs a CUDA GPU"),
        ("benchmarks/attention/benchmark_attention.py", "needs a CUDA GPU"),
        ("benchmarks/transformer/benchmark_transformer_layer.py", "needs a CUDA GPU"),
        ("benchmarks/quantize/benchmark_amax_cast_pairs.py", "needs a CUDA GPU"),
        ("benchmarks/mlp/step_timeline.py", "needs a CUDA GPU"),
    ],
)
def test_gpu_benchmarks_refuse_without_gpus(script, message):
    result = run(script)
    assert result.returncode == 1 and message in result.stderr


def test_mlp_benchmark_smoke_run_on_cpu(tmp_path):
    """Every configuration and implementation (FP8 through the reference path) at tiny shapes."""
    out = tmp_path / "mlp.json"
    result = run(
        "benchmarks/mlp/benchmark_mlp.py", "--device", "cpu", "--tokens", "32", "--hidden", "32",
        "--ffn", "64", "--steps", "1", "--warmup", "0", "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    impls = ["plain bf16", "te bf16", "te fp8 delayed", "te fp8 current"]
    assert [(r["config"], r["impl"]) for r in rows] == [
        (config, impl) for config in ("gelu", "swiglu", "ln_linear") for impl in impls
    ]
    assert all(r["step_ms"] > 0 and r["forward_ms"] > 0 for r in rows)


def test_transformer_layer_benchmark_smoke_run_on_cpu(tmp_path):
    """Every configuration and recipe of the TransformerLayer benchmark at tiny shapes."""
    out = tmp_path / "tl.json"
    result = run(
        "benchmarks/transformer/benchmark_transformer_layer.py", "--device", "cpu", "--seq", "16",
        "--batch", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--steps", "1",
        "--warmup", "0", "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_text().strip()


def _load_script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_timeline_accounts_overlaps_and_gaps():
    """step_timeline.py's arithmetic on a hand-made trace: overlapping kernels (programmatic
    dependent launch) count once, idle gaps are measured from the latest end so far."""
    timeline = _load_script("benchmarks/mlp/step_timeline.py")
    kernels = [(0.0, 10.0, "a"), (8.0, 12.0, "b"), (2.0, 5.0, "c"), (20.0, 30.0, "d"),
               (31.0, 32.0, "e")]  # fmt: skip
    assert timeline.busy_time((s, e) for s, e, _ in kernels) == 23.0  # [0, 12] + [20, 30] + 1
    assert timeline.gaps(kernels, 5) == [(8.0, "b", "d"), (1.0, "d", "e")]
    assert timeline.gaps(kernels, 1) == [(8.0, "b", "d")]
    assert timeline.busy_time([]) == 0.0


def test_step_timeline_keeps_the_last_steps_of_a_steady_trace():
    """The steady-state trace keeps the last ``kept`` steps whole, whatever the profiler caught
    before the first traced step (the end of work queued ahead of it)."""
    timeline = _load_script("benchmarks/mlp/step_timeline.py")
    leftover = [(0.0, 1.0, "queued before")]
    steps = [(10.0 * k + j, 10.0 * k + j + 0.5, f"s{k}k{j}") for k in range(4) for j in range(3)]
    kept = timeline.steady_steps(leftover + steps, 3, 2)
    assert kept == steps[6:]
    assert [name for _, _, name in kept] == ["s2k0", "s2k1", "s2k2", "s3k0", "s3k1", "s3k2"]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_bias_TNT", "gemm"),
        ("void transformer_engine::(anonymous namespace)::amax_kernel<__nv_bfloat16, true>(...)",
         "amax pass"),
        ("void transformer_engine::activation_detail::elementwise_kernel<transformer_engine::"
         "activation_detail::ActivationLoad<__nv_bfloat16, 0, false>, transformer_engine::"
         "activation_detail::AmaxOnlyStore, false, true>(...)", "amax pass"),
        ("void transformer_engine::cast_detail::cast_transpose_tall_kernel<transformer_engine::"
         "activation_detail::DActivationLoad<__nv_bfloat16, 0, false>, false, true>(...)",
         "activation"),
        ("void transformer_engine::cast_detail::cast_transpose_tall_kernel<transformer_engine::"
         "cast_detail::PlainLoad<__nv_bfloat16>, true, false, 1>(...)", "cast"),
        ("transformer_engine::(anonymous namespace)::scale_from_block_amaxes_kernel(...)",
         "scale update"),
        ("void transformer_engine::norm_detail::(anonymous namespace)::norm_bwd_kernel<...>",
         "norm"),
        ("Memset (Device)", "memset/copy"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
         "other"),
    ],
)  # fmt: skip
def test_step_timeline_kernel_kinds(name, kind):
    assert _load_script("benchmarks/mlp/step_timeline.py").kernel_kind(name) == kind


def test_queue_ahead_issues_its_steps_before_each_trials_start_event(monkeypatch):
    """``benchmark_linear.time_steps(..., ahead=N)``: N untimed steps go out before each trial's
    start event and none between the events but the trial's own (a fake clock stands in for the
    CUDA events, so this runs anywhere)."""
    bench = _load_script("benchmarks/linear/benchmark_linear.py")
    issued, marks = [0], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = issued[0]
            marks.append(self.at)

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms: one per step between the two records
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def step():
        issued[0] += 1

    per_step = bench.time_steps(step, iters=3, warmup=2, ahead=4)
    trial = bench.STEPS_PER_TRIAL
    assert per_step == pytest.approx(1e-3)  # the trial's own steps only, at 1 ms each
    assert issued[0] == 2 + 3 * (4 + trial)
    assert marks == [2 + 4, 2 + 4 + trial, 2 + 4 + trial + 4, 2 + 2 * (4 + trial),
                     2 + 2 * (4 + trial) + 4, 2 + 3 * (4 + trial)]  # fmt: skip
