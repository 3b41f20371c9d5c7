"""Compile every GPU configuration of the attention kernels for Hopper (sm_90), no GPU needed.

For each kernel x head_dim x dtype x causal x dropout in ``attention_triton.GPU_CONFIGS`` (and,
for each entry, head_dims below its power of two: the masked tiles of ``block_head_dim``, with and
without the strides' divisibility hint, ``strides_aligned``) this
runs ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, then Triton's bundled ``ptxas -v
--gpu-name=sm_90a`` on the PTX for registers and spills, and reads shared memory from the
compiled metadata. Rows go to ``bench/results/attention_aot_sm90.json``.

Run as ``TRITON_INTERPRET=0 python -m bench.attention_aot [--out PATH] [--full] [--jobs N]``: the kernels must
be real ``JITFunction``s, so the interpreter must be off when memopt is imported.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Hopper's opt-in shared memory per block.
HOPPER_MAX_SHARED_BYTES = 227 * 1024

_TRITON_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


_ELEMENT_POINTERS = {"Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV"}
_FLOAT32_POINTERS = {"Lse", "Delta"}
_FLOAT_SCALARS = {"qk_scale", "sm_scale", "keep_scale"}
_INT64_SCALARS = {"seed", "rng_offset", "drop_threshold"}


def _signature(kernel, dtype: str, constexprs: dict, aligned: bool = True) -> tuple[dict, dict]:
    """(signature, divisibility attrs) for ``kernel``'s arguments, as the launcher passes them:
    ``aligned`` as ``attention_triton.strides_aligned`` says for the head_dim."""
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _ELEMENT_POINTERS:
            signature[name] = "*" + _TRITON_DTYPES[dtype]
        elif name in _FLOAT32_POINTERS:
            signature[name] = "*fp32"
        elif name in _FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name in _INT64_SCALARS:
            signature[name] = "i64"
        else:
            signature[name] = "i32"
        # Pointers from the caching allocator and strides of head_dim-multiple rows are 16-aligned;
        # with a head_dim that is not a multiple of 16 the strides are not, nor are the views' base
        # pointers (k, v and the gradients inside one qkv buffer): only lse and delta keep theirs.
        if (aligned and signature[name].startswith("*")) or name in _FLOAT32_POINTERS or (aligned and name.startswith("stride_")):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _ptxas_usage(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
    log = result.stderr + result.stdout
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spill_stores = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    spill_loads = int(re.search(r"(\d+) bytes spill loads", log).group(1))
    return {"registers": registers, "spill_stores": spill_stores, "spill_loads": spill_loads}


def configurations(full: bool = False):
    """(kernel name, head_dim, dtype, causal, dropout, grouped_rng) to compile.

    Every table entry is compiled; dropout entries in both RNG variants (``grouped_rng``: one
    Philox call per four probabilities when seq_k % 4 == 0, else one per probability). Each entry
    is also compiled for head_dims below its width, whose tiles mask the columns past head_dim (more
    predicates, the same tile): three quarters of it (12, 24, 48, 96, 192) and ``block - 8`` (8, 24,
    56, 120, 248), a multiple of 16 in the heaviest variant (bfloat16, causal; dropout in both RNG
    variants), another as below. ``full``
    adds every dtype x causal combination; the default compiles a dropout entry in its heaviest
    variant (bfloat16, causal) and a plain entry both causal (bfloat16) and not (float16): the
    dtype changes instruction types, not register pressure, but causal adds the branch that masks
    the diagonal blocks, so both sides of it are compiled. A head_dim that is not a multiple of 16
    (``attention_triton.strides_aligned``) runs a variant compiled without the strides'
    divisibility hint, with its own launch configuration where the table's spills there
    (``UNALIGNED_GPU_CONFIGS``): those head_dims are compiled causal and not (without the hint,
    the causal variant is not always the heavier one), in bfloat16 (both dtypes with ``full``).
    """
    from memopt.ops import attention_triton
    from memopt.ops.attention_triton import strides_aligned

    for kernel_name, table in attention_triton.GPU_CONFIGS.items():
        for head_dim, dropout in sorted(table):
            rng_variants = (True, False) if dropout else (False,)
            if full:
                for dtype in ("float16", "bfloat16"):
                    for causal in ((False,) if kernel_name == "bwd_delta" else (False, True)):
                        for grouped in rng_variants:
                            yield kernel_name, head_dim, dtype, causal, dropout, grouped
            elif dropout:
                for grouped in rng_variants:
                    yield kernel_name, head_dim, "bfloat16", True, True, grouped
            else:
                yield kernel_name, head_dim, "float16", False, False, False
                if kernel_name != "bwd_delta":
                    yield kernel_name, head_dim, "bfloat16", True, False, False
            for masked_head_dim in sorted({head_dim * 3 // 4, head_dim - 8}):
                if strides_aligned(masked_head_dim):
                    for grouped in rng_variants:
                        yield kernel_name, masked_head_dim, "bfloat16", kernel_name != "bwd_delta", dropout, grouped
                    continue
                for dtype in ("float16", "bfloat16") if full else ("bfloat16",):
                    for causal in ((False,) if kernel_name == "bwd_delta" else (False, True)):
                        for grouped in rng_variants:
                            yield kernel_name, masked_head_dim, dtype, causal, dropout, grouped


def compile_one(kernel_name: str, head_dim: int, dtype: str, causal: bool, dropout: bool, grouped_rng: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from memopt.ops import attention_triton

    kernel = {
        "fwd": attention_triton._attn_fwd_kernel,
        "bwd_delta": attention_triton._attn_bwd_delta_kernel,
        "bwd_dkdv": attention_triton._attn_bwd_dkdv_kernel,
        "bwd_dq": attention_triton._attn_bwd_dq_kernel,
    }[kernel_name]
    block_d = attention_triton.block_head_dim(head_dim)
    aligned = attention_triton.strides_aligned(head_dim)
    block_m, block_n, num_warps, num_stages = attention_triton.gpu_config(kernel_name, head_dim, dropout)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": block_m}
    if kernel_name != "bwd_delta":
        constexprs.update(BLOCK_N=block_n, CAUSAL=causal, DROPOUT=dropout, GROUPED_RNG=grouped_rng, UPCAST_DOT=False)
    signature, attrs = _signature(kernel, dtype, constexprs, aligned)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    started = time.perf_counter()
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    row = {
        "kernel": kernel_name, "head_dim": head_dim, "block_head_dim": block_d, "strides_aligned": aligned,
        "dtype": dtype, "causal": causal, "dropout": dropout,
        "grouped_rng": grouped_rng,
        "block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
        "shared_bytes": int(compiled.metadata.shared),
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }
    row.update(_ptxas_usage(compiled.asm["ptx"]))
    row["compile_s"] = round(time.perf_counter() - started, 2)
    return row


def _compile_or_error(config) -> dict:
    try:
        return compile_one(*config)
    except Exception as err:  # every failure is reported, then the run fails
        return {"config": list(config), "error": f"{type(err).__name__}: {err}"[:2000]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention_aot_sm90.json"))
    parser.add_argument("--full", action="store_true", help="every dtype x causal variant of every entry")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    import torch
    import triton

    configs = list(configurations(args.full))
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_compile_or_error, configs))
    else:
        results = [_compile_or_error(c) for c in configs]
    rows = [r for r in results if "error" not in r]
    failures = [r for r in results if "error" in r]
    problems = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["shared_bytes"] > HOPPER_MAX_SHARED_BYTES]
    report = {
        "target": "sm_90a", "triton": triton.__version__, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "max_shared_bytes": HOPPER_MAX_SHARED_BYTES, "rows": rows, "failures": failures,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("| kernel | head_dim | strides aligned | dtype | causal | dropout | grouped rng | BM x BN | warps | stages | regs | spills (st/ld) | smem (B) |")
    print("|---|---:|---|---|---|---|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        head_dim = str(r["head_dim"]) if r["head_dim"] == r["block_head_dim"] else f"{r['head_dim']} (as {r['block_head_dim']})"
        print(
            f"| {r['kernel']} | {head_dim} | {r['strides_aligned']} | {r['dtype']} | {r['causal']} | {r['dropout']} | {r['grouped_rng']} | "
            f"{r['block_m']}x{r['block_n']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
            f"{r['spill_stores']}/{r['spill_loads']} | {r['shared_bytes']} |"
        )
    for failure in failures:
        print("FAILED", failure["config"], failure["error"], file=sys.stderr)
    for r in problems:
        print("OVER BUDGET", r, file=sys.stderr)
    return 1 if failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
