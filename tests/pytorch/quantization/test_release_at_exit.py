"""The process-wide quantization state lets go of what it holds (the amax registry's keys hold
the amax reduction groups) in an ``atexit`` handler, so that no process group outlives the
interpreter's orderly shutdown: a gloo group destroyed during interpreter finalization can abort
the process ("terminate called without an active exception") after a script has finished; with
the registry holding the group that happened in about 5% of two-process gloo runs.

The check runs in a subprocess: a handler registered before transformer_engine is imported runs
after the package's own (atexit runs handlers last-registered first) and reports what the
registry still holds."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, tempfile
    import torch
    import torch.distributed as dist

    def report():
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        held = FP8GlobalStateManager.quantization_state.amax_registry.keys()
        print(f"REGISTRY_KEYS_AT_EXIT {len(held)}", flush=True)

    atexit.register(report)  # before the package's handler, so it runs after it

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    init = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    group = dist.new_group([0])
    layer = te.Linear(16, 16, device="cpu")
    with te.autocast(recipe=DelayedScaling(), amax_reduction_group=group):
        layer(torch.randn(16, 16, requires_grad=True)).sum().backward()
    held = FP8GlobalStateManager.quantization_state.amax_registry.keys()
    print(f"REGISTRY_KEYS_BEFORE_EXIT {len(held)}", flush=True)
    del layer
    dist.destroy_process_group()
    """
)


def test_the_registry_is_released_before_interpreter_finalization(tmp_path):
    script = tmp_path / "exit_with_a_group.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.split()
    assert "REGISTRY_KEYS_BEFORE_EXIT" in lines and "REGISTRY_KEYS_AT_EXIT" in lines
    before = int(lines[lines.index("REGISTRY_KEYS_BEFORE_EXIT") + 1])
    at_exit = int(lines[lines.index("REGISTRY_KEYS_AT_EXIT") + 1])
    assert before > 0  # the registry held the group's keys while the script ran
    assert at_exit == 0  # and nothing once the package's exit handler had run
