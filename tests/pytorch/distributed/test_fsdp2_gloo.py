"""FSDP2 (``fully_shard``) over te modules, 2 processes on gloo (CPU): training in float32 and
BF16, without FP8 and under DelayedScaling and Float8CurrentScaling, equals the unsharded
single-process run bit for bit (run_fsdp2.py explains why the reduction order is the same);
so does training FP8 parameters from ``quantized_model_init``, all-gathered in FP8; an FP8
weight split along dim 1 is refused; sharded checkpoints through ``torch.distributed.checkpoint``
restore. Each spawned group runs every case in one go."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from utils import needs_cuda, needs_two_gpus

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fsdp2_fp8_checks as fp8_checks  # noqa: E402
import run_fsdp2 as harness  # noqa: E402

WORLD_SIZE = 2
RUNS = [(r, d) for r in ("high_precision", "delayed", "current") for d in ("float32", "bfloat16")]
# te.optimizers.FusedAdam stepping the sharded (DTensor) parameters
FUSED_ADAM_RUNS = [
    ("high_precision", "float32", "fused_adam"),
    ("current", "bfloat16", "fused_adam"),
]
# FP8 parameters (quantized_model_init), all-gathered as FP8 bytes: torch's Adam re-quantizes
# each in-place update into the shards; FusedAdam keeps float32 master shards
FP8_PARAMETER_RUNS = [
    ("delayed", "bfloat16", "adam", "fp8_params"),
    ("current", "bfloat16", "adam", "fp8_params"),
    ("delayed", "float32", "fused_adam_master", "fp8_params"),
    ("current", "bfloat16", "fused_adam_master", "fp8_params"),
    ("delayed", "bfloat16", "fused_adam_master", "fp8_params_no_reshard"),
    # built under DelayedScaling(amax_history_len=4): the first forward rebuilds the recipe
    # state while FSDP2 has the whole weights registered; the shards must follow it
    ("delayed", "bfloat16", "fused_adam_master", "fp8_params_other_recipe"),
    # the MLP recomputed in backward (te.distributed.checkpoint) from the re-gathered weights
    ("delayed", "bfloat16", "fused_adam_master", "fp8_params_recompute"),
    ("current", "bfloat16", "adam", "fp8_params_recompute"),
    # the TransformerLayer's projections FSDP2 units of their own (a returned bias is a copy)
    ("current", "bfloat16", "adam", "fp8_params_inner_units"),
]
# MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) over float32 parameters
INNER_UNIT_RUNS = [("delayed", "float32", "adam", "inner_units")]
MIXED_PRECISION_RUNS = [
    (recipe, "float32", "adam", "mixed_precision")
    for recipe in ("high_precision", "delayed", "current")
]
# FSDP2's deferred initialization: built on meta, sharded, to_empty, each block's
# reset_parameters() writing into the shards
META_RUNS = [
    ("high_precision", "float32", "adam", "meta"),
    ("delayed", "bfloat16", "adam", "meta"),
    ("delayed", "bfloat16", "adam", "fp8_params_meta"),
    ("current", "float32", "fused_adam_master", "fp8_params_meta"),
]


ALL_RUNS = (
    RUNS + FUSED_ADAM_RUNS + FP8_PARAMETER_RUNS + META_RUNS + MIXED_PRECISION_RUNS
    + INNER_UNIT_RUNS
)  # fmt: skip


def _spawned(rank, world_size, out_dir, init_file):
    harness.worker(
        rank, world_size, "gloo", out_dir, ALL_RUNS, init_method=f"file://{init_file}",
        extras=True,
    )  # fmt: skip


def _spawned_references(_, out_dir):
    """Every run's unsharded oracle (a meta-built run's is the run built on the device)."""
    expected = {}
    for run in ALL_RUNS:
        optimizer_name = run[2] if len(run) > 2 else "adam"
        weights = (run[3] if len(run) > 3 else "").removesuffix("_meta").removesuffix("meta")
        expected["-".join(run)] = harness.reference_run(
            *run[:2], WORLD_SIZE, optimizer_name=optimizer_name, weights=weights
        )
    torch.save(expected, os.path.join(out_dir, "references.pt"))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The oracles, computed in a fresh process as the ranks' runs are: a test process carries
    what earlier tests left (after a torch.compile, torch's Adam steps the same model
    differently in the last bits)."""
    out = tmp_path_factory.mktemp("fsdp2_references")
    mp.spawn(_spawned_references, args=(str(out),), nprocs=1, join=True)
    return torch.load(out / "references.pt")


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(_spawned, args=(WORLD_SIZE, str(out), str(out / "init")), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("recipe_name,dtype_name", RUNS, ids=[f"{r}-{d}" for r, d in RUNS])
def test_fsdp2_training_equals_the_unsharded_run(
    sharded_results, references, recipe_name, dtype_name
):
    expected = references[f"{recipe_name}-{dtype_name}"]
    for rank, results in enumerate(sharded_results):
        got = results[f"{recipe_name}-{dtype_name}"]
        assert got["device"] == "cpu"
        harness.compare(got, expected, f"rank {rank}")
    # the runs did something: the loss moved, and delayed scaling holds non-trivial scales
    assert not torch.equal(expected["losses"][0], expected["losses"][-1])
    if recipe_name == "delayed":
        scales = [v for k, v in expected["fp8_state"].items() if k.endswith(".scale")]
        assert scales and any(not torch.all(s == 1) for s in scales)
    else:
        assert expected["fp8_state"] == {}


@pytest.mark.parametrize("run", FUSED_ADAM_RUNS, ids=["-".join(r[:2]) for r in FUSED_ADAM_RUNS])
def test_fused_adam_on_sharded_parameters_equals_the_unsharded_run(
    sharded_results, references, run
):
    """FusedAdam's state follows its DTensor parameters' sharding, and its elementwise steps
    on the shards equal those on the full tensors bit for bit."""
    expected = references["-".join(run)]
    for rank, results in enumerate(sharded_results):
        harness.compare(results["-".join(run)], expected, f"rank {rank}")
    assert not torch.equal(expected["losses"][0], expected["losses"][-1])


@pytest.mark.parametrize(
    "run", FP8_PARAMETER_RUNS, ids=["-".join(r[:3] + r[3:][:1]) for r in FP8_PARAMETER_RUNS]
)
def test_fp8_parameters_train_like_the_unsharded_run(sharded_results, references, run):
    """FP8 weights from quantized_model_init: every rank's shard keeps the FP8 bytes and the
    scale of the unsharded weight after each step (all-gathered as FP8, re-quantized with the
    whole weight's amax), so losses, values, ``_scale_inv`` and FP8 state equal the unsharded
    run's bit for bit, with the weights resharded after forward or kept until backward."""
    expected = references["-".join(run)]
    scale_invs = [k for k in expected["params"] if k.endswith("._scale_inv")]
    assert len(scale_invs) >= 6  # every te module's weights are FP8 parameters
    for rank, results in enumerate(sharded_results):
        harness.compare(results["-".join(run)], expected, f"rank {rank}")
    assert not torch.equal(expected["losses"][0], expected["losses"][-1])


def test_dcp_checkpoint_with_fused_adam(sharded_results):
    """The same DCP round trip with te.optimizers.FusedAdam: its float32 state dict saves and
    restores through torch.distributed.checkpoint, and the next step is bitwise the same."""
    for results in sharded_results:
        fp8_checks.check_extras(results, "cpu", "checkpoint_fused_adam")


def test_amax_reduction_across_ranks_mattered():
    """The reference's scales (amaxes of both slices) differ from those of rank 0's slice
    alone, so the equality above needs the ranks' amax reduction."""
    both = harness.reference_run("delayed", "float32", WORLD_SIZE)["fp8_state"]
    alone = harness.reference_run("delayed", "float32", WORLD_SIZE, slices=[0])["fp8_state"]
    assert any(not torch.equal(both[k], alone[k]) for k in both)


@pytest.mark.parametrize("run", META_RUNS, ids=["-".join(r[:1] + r[3:]) for r in META_RUNS])
def test_deferred_initialization_on_meta_equals_the_unsharded_run(sharded_results, references, run):
    """``fully_shard`` on meta, ``to_empty``, ``reset_parameters()``: the resets write the
    whole initial values' parts into FSDP2's shards (the Parameter objects stay; FP8 weights
    are Float8Tensors on meta already, so their all-gather sends FP8 bytes), in the order an
    unsharded build draws them, so training equals the run built on the device."""
    expected = references["-".join(run)]
    for rank, results in enumerate(sharded_results):
        harness.compare(results["-".join(run)], expected, f"rank {rank}")


@pytest.mark.parametrize("run", MIXED_PRECISION_RUNS, ids=[r[0] for r in MIXED_PRECISION_RUNS])
def test_mixed_precision_policy_equals_its_unsharded_oracle(sharded_results, references, run):
    """FSDP2 casts the float32 shards to BF16 for the forward and reduces the BF16 gradients in
    float32: the oracle keeps float32 masters, runs a BF16 copy and sums each slice's gradient
    in float32; losses, masters and FP8 state are bitwise equal."""
    expected = references["-".join(run)]
    for rank, results in enumerate(sharded_results):
        harness.compare(results["-".join(run)], expected, f"rank {rank}")
    assert not torch.equal(expected["losses"][0], expected["losses"][-1])


@pytest.mark.parametrize("run", INNER_UNIT_RUNS, ids=[r[0] for r in INNER_UNIT_RUNS])
def test_transformer_layer_projections_as_units_equal_the_unsharded_run(
    sharded_results, references, run
):
    """The attention projection, a unit of its own, hands the layer a copy of its bias (FSDP2
    frees the parameter's storage when the projection's forward returns)."""
    for rank, results in enumerate(sharded_results):
        harness.compare(results["-".join(run)], references["-".join(run)], f"rank {rank}")


def test_fp8_parameter_split_along_dim1_is_refused(sharded_results):
    for results in sharded_results:
        message = results["fp8_parameter_refusal"]
        assert "'weight'" in message and "quantized_model_init" in message
        assert "fully_shard" in message and "Shard(0)" in message


def test_fp8_shards_with_different_scales_are_refused_at_the_first_all_gather(sharded_results):
    """Shards re-quantized on their own under current scaling before the first forward hold
    different scales; the first all-gather finds it on every rank instead of reading one
    rank's bytes with another's scale."""
    for results in sharded_results:
        message = results["fp8_scale_mismatch"]
        assert "different scales" in message and "fully_shard" in message


def test_dcp_checkpoint_of_fp8_parameters(sharded_results):
    """DCP save/load of a sharded model of FP8 parameters with FusedAdam's float32 masters:
    the restored shards hold the same values and scales, and the next step is bitwise the
    original's."""
    for results in sharded_results:
        fp8_checks.check_extras(results, "cpu", "checkpoint_fp8_params")


def test_dcp_checkpoint_restores_fp8_state_and_training(sharded_results):
    """DCP save/load of the sharded model and optimizer: FP8 state back on each rank's device,
    and the next step bitwise equal to the original's."""
    for results in sharded_results:
        fp8_checks.check_extras(results, "cpu")
        assert results["checkpoint"]["restored_devices"] == ["cpu"]


NCCL_RUNS = [
    ("high_precision", ""),
    ("delayed", ""),
    ("current", ""),
    ("delayed", "fp8_params"),
    ("current", "fp8_params"),
]


@needs_two_gpus
@pytest.mark.parametrize(
    "recipe_name,weights", NCCL_RUNS, ids=["-".join(filter(None, r)) for r in NCCL_RUNS]
)
def test_fsdp2_nccl_two_processes_one_gpu_each(tmp_path, recipe_name, weights):
    """The same harness under torchrun on NCCL (2 processes x 1 GPU, BF16; with ``fp8_params``
    the weights are FP8 parameters all-gathered in FP8): every rank equals the single-GPU
    reference, the refusal and the DCP round trips onto cuda:<rank>."""
    import os
    import subprocess

    import transformer_engine

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    te_root = str(Path(transformer_engine.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (te_root, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(Path(harness.__file__)), "--backend", "nccl", "--recipe", recipe_name,
        "--dtype", "bfloat16", "--out", str(tmp_path), "--weights", weights,
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 ranks equal the reference" in proc.stdout


def _spawned_nccl_one_gpu(rank, world_size, out_dir, init_file, runs):
    harness.worker(
        rank, world_size, "nccl", out_dir, runs, init_method=f"file://{init_file}", extras=True
    )


@needs_cuda
def test_fsdp2_fp8_parameters_on_one_gpu(tmp_path):
    """FSDP2 over one process on one GPU (NCCL): the FP8 all-gather hooks on CUDA (their
    copies on FSDP2's streams, the transposed copy made where Hopper needs one) train like the
    unsharded run bit for bit, from the device and from meta, under both per-tensor recipes;
    the DCP round trips restore onto cuda:0; memory does not grow from step to step."""
    runs = [
        ("delayed", "bfloat16", "adam", "fp8_params"),
        ("current", "bfloat16", "fused_adam_master", "fp8_params"),
        ("current", "bfloat16", "fused_adam_master", "fp8_params_meta"),
        ("delayed", "bfloat16", "adam", "fp8_params_no_reshard"),
        ("delayed", "float32", "adam", "mixed_precision"),
    ]
    mp.spawn(
        _spawned_nccl_one_gpu, args=(1, str(tmp_path), str(tmp_path / "init"), runs),
        nprocs=1, join=True,
    )  # fmt: skip
    results = torch.load(tmp_path / "rank0.pt")
    for run in runs:
        expected = harness.reference_run(
            *run[:2], 1, "cuda:0", optimizer_name=run[2],
            weights=run[3].removesuffix("_meta") if run[3].endswith("_meta") else run[3],
        )  # fmt: skip
        harness.compare(results["-".join(run)], expected, "-".join(run))
    for key in ("checkpoint", "checkpoint_fp8_params"):
        fp8_checks.check_extras(results, "cuda:0", key)
    memory = results["fp8_parameter_memory"]
    assert memory[2:] == [memory[2]] * len(memory[2:]), memory
