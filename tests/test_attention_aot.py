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


# The variants that hint the pointers but not the strides (at masked head_dims, and at a block's own
# width: views of wider rows) are compiled here for the block head_dim where registers run out
# first, 38 of them; all 209 (committed in bench/results/attention_aot_sm90.json, no spills) took
# 711 s of compile time more, too long next to the other 209 for CI's timeout.
CI_UNHINTED_BLOCKS = (128,)


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's bundled ptxas is missing")
def test_every_gpu_config_compiles_for_sm90_without_spills(tmp_path):
    results = os.environ.get(REPORT_ENV) or str(tmp_path / "attention_aot_sm90.json")
    # A fresh process with the interpreter off: the kernels imported here are interpreter
    # wrappers (TRITON_INTERPRET=1 in conftest), which triton.compile cannot take.
    env = dict(os.environ, TRITON_INTERPRET="0")
    blocks = [str(block) for block in CI_UNHINTED_BLOCKS]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attention_aot", "--jobs", "2", "--out", results, "--unhinted-blocks", *blocks],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(results) as f:
        report = json.load(f)
    check_report(report, CI_UNHINTED_BLOCKS)


@pytest.mark.parametrize("name", ["attention_aot_sm90.json", "attention_aot_sm90_triton36.json"])
def test_committed_tables_cover_every_launch_configuration_without_spills(name):
    # Editing a table (or the variants compiled) without refreshing the committed reports fails here.
    with open(os.path.join(ROOT, "bench", "results", name)) as f:
        report = json.load(f)
    check_report(report, report["unhinted_blocks"] or attention_triton.BLOCK_HEAD_DIMS)


def check_report(report, unhinted_blocks):
    """What a report of bench.attention_aot must show: every variant of every entry compiled
    (``unhinted_blocks``: as the tool's ``--unhinted-blocks``), with the launch configuration
    that gpu_config gives it now, within Hopper's registers and shared memory, without spills."""
    assert report["failures"] == []
    expected = {(kernel, head_dim, dropout) for kernel, table in attention_triton.GPU_CONFIGS.items() for head_dim, dropout in table}
    hinted = [r for r in report["rows"] if r["pointers_aligned"] and r["strides_aligned"]]
    # Every entry compiled with both hints at its own width, and at a head_dim below it, whose tiles are masked.
    assert {(r["kernel"], r["head_dim"], r["dropout"]) for r in hinted if r["head_dim"] == r["block_head_dim"]} == expected
    assert {(r["kernel"], r["block_head_dim"], r["dropout"]) for r in report["rows"] if r["head_dim"] < r["block_head_dim"]} == expected

    def variants(pointers_aligned, at_block):
        return {
            (r["kernel"], r["block_head_dim"], r["dropout"], r["causal"]) for r in report["rows"]
            if not r["strides_aligned"] and r["pointers_aligned"] == pointers_aligned
            and (r["head_dim"] == r["block_head_dim"]) == at_block
        }

    def entries(blocks):
        return {(k, d, p, c) for k, d, p in expected if d in blocks for c in ((False,) if k == "bwd_delta" else (False, True))}

    # ... and, causal and not, without the strides' divisibility hint, which Triton compiles for
    # a head_dim that is not a multiple of 16 and for views of wider rows (the launch
    # configuration of UNALIGNED_GPU_CONFIGS where there is one; with the table's own, 7 entries
    # spilled there, up to 900 bytes): at a masked head_dim that is not a multiple of 16 without
    # the pointers' hint for every entry, with it (the pointers of separate q, k, v buffers) and at
    # the block's own width for the entries of unhinted_blocks.
    assert variants(False, False) == entries(attention_triton.BLOCK_HEAD_DIMS)
    assert variants(True, False) == entries(unhinted_blocks)
    assert variants(True, True) == entries(unhinted_blocks)
    for row in report["rows"]:
        aligned = row["pointers_aligned"] and row["strides_aligned"]
        assert aligned or row["head_dim"] % 16 or row["head_dim"] == row["block_head_dim"], row
        assert row["strides_aligned"] or row["pointers_aligned"] or row["head_dim"] < row["block_head_dim"], row
        launch = attention_triton.gpu_config(row["kernel"], row["head_dim"], row["dropout"], aligned)
        assert (row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]) == launch, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert 0 < row["shared_bytes"] <= 227 * 1024, row
        assert 0 < row["registers"] <= 255, row
        if aligned:  # (the unaligned variants' smaller tiles may take mma.sync)
            assert row["wgmma"] == ((row["kernel"], row["block_head_dim"]) not in WITHOUT_WGMMA), row
