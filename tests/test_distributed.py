"""memopt.wrap, FusedCheckpointBlock and offload under DDP and FSDP2: two CPU processes with gloo,
one torchrun launch for all checks (listed in tests/distributed_wrap_worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("distributed_wrap_worker.py")
CHECKS = [
    "ddp-selective",
    "ddp-full",
    "fsdp2-wrap-then-shard-selective",
    "fsdp2-shard-then-wrap-full",
    "ddp-swapped-selective",
    "fsdp2-swapped-full",
    "ddp-stack-mixed",
    "fsdp2-stack-full",
    "ddp-no-sync-wrap-offload",
    "ddp-no-sync-stack-offload",
]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_ddp_and_fsdp2_gradients_match_single_process():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for name in CHECKS:
        assert f"CHECK {name} ok" in result.stdout, output[-6000:]
