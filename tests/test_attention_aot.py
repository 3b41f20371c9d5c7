"""Every GPU configuration of the attention kernels compiles for Hopper (sm_90) without spilling
and within Hopper's shared memory, checked ahead of time on a machine without a GPU."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch wheels lack it)")

from memopt.ops import attention_triton  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The committed table (bench/results/attention_aot_sm90.json) is refreshed with
# `python -m bench.attention_aot`; the test writes to a temporary file unless told otherwise.
REPORT_ENV = "MEMOPT_AOT_REPORT"

# Hopper's wgmma needs 64 rows per warpgroup; the head_dim 256 dk/dv tile that fits in registers
# (32 keys x 256 x two float32 accumulators) has fewer, so it runs on mma.sync.
WITHOUT_WGMMA = {("bwd_dkdv", 256), ("bwd_delta", 16), ("bwd_delta", 32), ("bwd_delta", 64), ("bwd_delta", 128), ("bwd_delta", 256)}


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return os.path.exists(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's bundled ptxas is missing")
def test_every_gpu_config_compiles_for_sm90_without_spills(tmp_path):
    results = os.environ.get(REPORT_ENV) or str(tmp_path / "attention_aot_sm90.json")
    # A fresh process with the interpreter off: the kernels imported here are interpreter
    # wrappers (TRITON_INTERPRET=1 in conftest), which triton.compile cannot take.
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attention_aot", "--jobs", "2", "--out", results],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(results) as f:
        report = json.load(f)
    assert report["failures"] == []
    expected = {(kernel, head_dim, dropout) for kernel, table in attention_triton.GPU_CONFIGS.items() for head_dim, dropout in table}
    # Every entry compiled at its own width and at a head_dim below it, whose tiles are masked.
    assert {(r["kernel"], r["head_dim"], r["dropout"]) for r in report["rows"] if r["head_dim"] == r["block_head_dim"]} == expected
    assert {(r["kernel"], r["block_head_dim"], r["dropout"]) for r in report["rows"] if r["head_dim"] < r["block_head_dim"]} == expected
    # ... and, causal and not, for a head_dim that is not a multiple of 16, which Triton compiles
    # without the strides' divisibility hint (the launch configuration of UNALIGNED_GPU_CONFIGS
    # where there is one): with the table's own, 7 entries spilled there (up to 900 bytes).
    unaligned = {(r["kernel"], r["block_head_dim"], r["dropout"], r["causal"]) for r in report["rows"] if not r["strides_aligned"]}
    assert unaligned == {(k, d, p, c) for k, d, p in expected for c in ((False,) if k == "bwd_delta" else (False, True))}
    for row in report["rows"]:
        assert row["strides_aligned"] == attention_triton.strides_aligned(row["head_dim"]), row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert 0 < row["shared_bytes"] <= 227 * 1024, row
        assert 0 < row["registers"] <= 255, row
        if row["strides_aligned"]:  # (the unaligned variants' smaller tiles may take mma.sync)
            assert row["wgmma"] == ((row["kernel"], row["block_head_dim"]) not in WITHOUT_WGMMA), row
