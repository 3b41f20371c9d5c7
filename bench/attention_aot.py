"""Compile every GPU configuration of the attention kernels for Hopper (sm_90), no GPU needed.

For each kernel x head_dim x dtype x causal x dropout in ``attention_triton.GPU_CONFIGS`` (and,
for each entry, head_dims below its power of two: the masked tiles of ``block_head_dim``; and the
variants compiled without Triton's divisibility hint on the pointers or the strides, which run
``UNALIGNED_GPU_CONFIGS``: ``configurations``) this
runs ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, then Triton's bundled ``ptxas -v
--gpu-name=sm_90a`` on the PTX for registers and spills, and reads shared memory from the
compiled metadata. Rows go to ``bench/results/attention_aot_sm90.json``.

Run as ``TRITON_INTERPRET=0 python -m bench.attention_aot [--out PATH] [--full] [--jobs N]
[--unhinted-blocks D ...] [--reuse PATH]``: the kernels must be real ``JITFunction``s, so the
interpreter must be off when memopt is imported. The committed tables:
``bench/results/attention_aot_sm90.json`` (triton 3.8, default set) and
``bench/results/attention_aot_sm90_triton36.json`` (triton 3.6, ``--full``).
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


def _signature(kernel, dtype: str, constexprs: dict, pointers_aligned: bool, strides_aligned: bool) -> tuple[dict, dict]:
    """(signature, divisibility attrs) for ``kernel``'s arguments, as the launcher passes them:
    Triton's 16-divisibility hint on the element pointers (q, k, v, out and the gradients) where
    ``pointers_aligned``, on the strides where ``strides_aligned``; lse and delta, fresh float32
    buffers, always have it, the other integers (sequence lengths, heads) never."""
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
        if (
            name in _FLOAT32_POINTERS
            or (pointers_aligned and name in _ELEMENT_POINTERS)
            or (strides_aligned and name.startswith("stride_"))
        ):
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


# Triton's 16-divisibility hints a launch is compiled with, as (element pointers, strides):
# attention_triton.args_aligned. GPU_CONFIGS runs with both; UNALIGNED_GPU_CONFIGS with the others:
# pointers from the allocator and strides that are not multiples of 16 (a head_dim that is not, or
# q, k, v sliced from wider rows), neither (k and v inside a qkv buffer at an offset that is not a
# multiple of 16 bytes), the strides but not the pointers (a view at an odd column of rows whose
# stride is a multiple of 16; never with a head_dim that is not, as a fresh output's strides are).
# Without either hint the loads are not vectorised, and the three compiled to byte-identical PTX
# (triton 3.8: bwd_dkdv 128 causal, fwd 120 dropout, bwd_dq 248 causal), so the table compiles the
# first at a block's own width (views of wider rows), the first two at its masked head_dims.
HINTED = (True, True)
UNHINTED_MASKED = ((True, False), (False, False))
UNHINTED_AT_BLOCK = ((True, False),)


def configurations(full: bool = False, unhinted_blocks=None):
    """(kernel name, head_dim, dtype, causal, dropout, grouped_rng, pointers_aligned, strides_aligned)
    to compile.

    Every table entry is compiled; dropout entries in both RNG variants (``grouped_rng``: one
    Philox call per four probabilities when seq_k % 4 == 0, else one per probability). Each entry
    is also compiled for head_dims below its width, whose tiles mask the columns past head_dim (more
    predicates, the same tile): three quarters of it (12, 24, 48, 96, 192) and ``block - 8`` (8, 24,
    56, 120, 248), a multiple of 16 in the heaviest variant (bfloat16, causal; dropout in both RNG
    variants), another as below. ``full``
    adds every dtype x causal combination; the default compiles a dropout entry in its heaviest
    variant (bfloat16, causal) and a plain entry both causal (bfloat16) and not (float16): the
    dtype changes instruction types, not register pressure, but causal adds the branch that masks
    the diagonal blocks, so both sides of it are compiled. A launch without the divisibility hint
    on some pointer or stride (``attention_triton.args_aligned``: always with a head_dim that is
    not a multiple of 16) runs a variant compiled without it, with its own launch configuration
    where the table's spills there (``UNALIGNED_GPU_CONFIGS``): each entry is compiled so at its
    masked head_dims that are not multiples of 16 (``UNHINTED_MASKED``) and at its own width
    (``UNHINTED_AT_BLOCK``: views of wider rows), causal and not (without the hints the causal variant
    is not always the heavier one), in bfloat16 (both dtypes with ``full``). ``unhinted_blocks``
    (block head_dims) limits the variants that hint the pointers but not the strides, and those
    at the block's own width, to those entries (a shorter run; None: every entry).
    """
    from memopt.ops import attention_triton

    for kernel_name, table in attention_triton.GPU_CONFIGS.items():
        causals = (False,) if kernel_name == "bwd_delta" else (False, True)
        for head_dim, dropout in sorted(table):
            rng_variants = (True, False) if dropout else (False,)
            if full:
                for dtype in ("float16", "bfloat16"):
                    for causal in causals:
                        for grouped in rng_variants:
                            yield kernel_name, head_dim, dtype, causal, dropout, grouped, *HINTED
            elif dropout:
                for grouped in rng_variants:
                    yield kernel_name, head_dim, "bfloat16", True, True, grouped, *HINTED
            else:
                yield kernel_name, head_dim, "float16", False, False, False, *HINTED
                if kernel_name != "bwd_delta":
                    yield kernel_name, head_dim, "bfloat16", True, False, False, *HINTED
            every_variant = unhinted_blocks is None or head_dim in unhinted_blocks
            unhinted = []
            for masked_head_dim in sorted({head_dim * 3 // 4, head_dim - 8}):
                if masked_head_dim % 16 == 0:
                    for grouped in rng_variants:
                        yield kernel_name, masked_head_dim, "bfloat16", kernel_name != "bwd_delta", dropout, grouped, *HINTED
                    continue
                unhinted += [(masked_head_dim, hints) for hints in UNHINTED_MASKED if every_variant or hints == (False, False)]
            if every_variant:
                unhinted += [(head_dim, hints) for hints in UNHINTED_AT_BLOCK]
            for unhinted_head_dim, hints in unhinted:
                for dtype in ("float16", "bfloat16") if full else ("bfloat16",):
                    for causal in causals:
                        for grouped in rng_variants:
                            yield kernel_name, unhinted_head_dim, dtype, causal, dropout, grouped, *hints


def compile_one(
    kernel_name: str, head_dim: int, dtype: str, causal: bool, dropout: bool, grouped_rng: bool = False,
    pointers_aligned: bool = True, strides_aligned: bool = True,
) -> dict:
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
    aligned = pointers_aligned and strides_aligned
    block_m, block_n, num_warps, num_stages = attention_triton.gpu_config(kernel_name, head_dim, dropout, aligned)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": block_m}
    if kernel_name != "bwd_delta":
        constexprs.update(BLOCK_N=block_n, CAUSAL=causal, DROPOUT=dropout, GROUPED_RNG=grouped_rng, UPCAST_DOT=False)
    signature, attrs = _signature(kernel, dtype, constexprs, pointers_aligned, strides_aligned)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    started = time.perf_counter()
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    row = {
        "kernel": kernel_name, "head_dim": head_dim, "block_head_dim": block_d,
        "pointers_aligned": pointers_aligned, "strides_aligned": strides_aligned,
        "dtype": dtype, "causal": causal, "dropout": dropout,
        "grouped_rng": grouped_rng,
        "block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
        "shared_bytes": int(compiled.metadata.shared),
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }
    row.update(_ptxas_usage(compiled.asm["ptx"]))
    row["compile_s"] = round(time.perf_counter() - started, 2)
    return row


def _hinted(row: dict) -> str:
    """Which arguments carry Triton's 16-divisibility hint in ``row``, for the printed table."""
    hinted = [name for name in ("pointers", "strides") if row[f"{name}_aligned"]]
    return " + ".join(hinted) or "none"


# --reuse: rows of an earlier report stand for a configuration when their key matches; this many,
# spread over the reused rows, are compiled again and must agree on these fields.
_REUSE_CHECKS = 8
_REUSE_CHECKED_FIELDS = ("registers", "spill_stores", "spill_loads", "shared_bytes", "wgmma")


def _config_key(config) -> tuple:
    """A configuration of :func:`configurations` with the launch configuration it compiles with."""
    from memopt.ops import attention_triton

    kernel_name, head_dim, dtype, causal, dropout, grouped, pointers_aligned, strides_aligned = config
    launch = attention_triton.gpu_config(kernel_name, head_dim, dropout, pointers_aligned and strides_aligned)
    return (*config, *launch)


def _reusable_rows(path: str, triton_version: str) -> dict:
    """{config key: {"config", "row"}} of the report at ``path``, which must come from ``triton_version``.
    Reports written before the pointers' hint had its own column hinted both or neither."""
    with open(path) as f:
        report = json.load(f)
    if report["triton"] != triton_version:
        raise SystemExit(f"--reuse {path}: written by triton {report['triton']}, this is {triton_version}")
    reusable = {}
    for old in report["rows"]:
        row = {}
        for field, value in old.items():
            if field == "strides_aligned":
                row["pointers_aligned"] = old.get("pointers_aligned", value)
            if field != "pointers_aligned":
                row[field] = value
        config = (
            row["kernel"], row["head_dim"], row["dtype"], row["causal"], row["dropout"], row["grouped_rng"],
            row["pointers_aligned"], row["strides_aligned"],
        )
        key = _config_key(config)
        if key[len(config):] == (row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]):
            reusable[key] = {"config": config, "row": row}
    return reusable


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
    parser.add_argument(
        "--unhinted-blocks", type=int, nargs="*", metavar="BLOCK_HEAD_DIM",
        help="compile the variants that hint the pointers but not the strides (at masked head_dims and at the block's "
        "own width) for these block head_dims only (a shorter run; default: all)",
    )
    parser.add_argument(
        "--reuse", metavar="PATH",
        help="take the rows of an earlier report of the same triton for the configurations it has (kernel, "
        "head_dim, dtype, causal, dropout, rng, hints and launch configuration), compiling the rest; a sample of "
        f"{_REUSE_CHECKS} reused rows is compiled again and must give the same registers, spills and shared memory",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")
    import torch
    import triton

    configs = list(configurations(args.full, args.unhinted_blocks))
    reused = _reusable_rows(args.reuse, triton.__version__) if args.reuse else {}
    keys = [_config_key(c) for c in configs]
    checks = sorted({k for k in keys if k in reused}, key=keys.index)
    checks = checks[:: max(1, len(checks) // _REUSE_CHECKS)][:_REUSE_CHECKS]
    to_compile = [c for c, k in zip(configs, keys) if k not in reused] + [reused[k]["config"] for k in checks]
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            compiled = list(pool.map(_compile_or_error, to_compile))
    else:
        compiled = [_compile_or_error(c) for c in to_compile]
    fresh = dict(zip([_config_key(c) for c in to_compile[: len(to_compile) - len(checks)]], compiled))
    for key, row in zip(checks, compiled[len(to_compile) - len(checks):]):
        if "error" in row or any(row[f] != reused[key]["row"][f] for f in _REUSE_CHECKED_FIELDS):
            parser.error(f"--reuse {args.reuse}: {key} compiles to {row}, not to the reused {reused[key]['row']}")
    results = [fresh[k] if k in fresh else reused[k]["row"] for k in keys]
    rows = [r for r in results if "error" not in r]
    failures = [r for r in results if "error" in r]
    problems = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["shared_bytes"] > HOPPER_MAX_SHARED_BYTES]
    report = {
        "target": "sm_90a", "triton": triton.__version__, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "max_shared_bytes": HOPPER_MAX_SHARED_BYTES, "full": args.full, "unhinted_blocks": args.unhinted_blocks,
        "rows": rows, "failures": failures,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("| kernel | head_dim | hinted | dtype | causal | dropout | grouped rng | BM x BN | warps | stages | regs | spills (st/ld) | smem (B) |")
    print("|---|---:|---|---|---|---|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        head_dim = str(r["head_dim"]) if r["head_dim"] == r["block_head_dim"] else f"{r['head_dim']} (as {r['block_head_dim']})"
        print(
            f"| {r['kernel']} | {head_dim} | {_hinted(r)} | {r['dtype']} | {r['causal']} | {r['dropout']} | {r['grouped_rng']} | "
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
