"""`python -m bench.census`: the memory traffic and kernel launches of one training step.

Step time on a shared 2-core machine is noisy; what a step *does* is not. This runs one forward
and backward of each configuration's layer stack (the harness's models, weights and batch, CPU
tensors) under a ``TorchDispatchMode`` that sees every operator the dispatcher runs, the
backward and any recompute included, and counts per op family:

* ``launches``: operators that run a kernel. Views (``view``, ``transpose``, ...), allocations
  (``empty*``) and ops that return their input are free. A registered memopt op
  (``torch.ops.memopt.*``) is one launch whatever its implementation runs inside (on a GPU it is
  one kernel, or one Triton launch per pass);
* ``bytes read`` / ``bytes written``: the bytes of every tensor argument and result, a
  broadcast (stride-0) dimension counted once, an empty placeholder as 0; an argument the op
  writes (``copy_``, ``add_``, ``out=``) counts as written, and as read too unless the op only
  overwrites it;
* ``matmul FLOPs``: ``2 m n k`` for every ``mm``/``addmm``/``bmm``/``baddbmm``; those of the 2-D
  ones (``mm``/``addmm``: the linears; batched ones come from attention's math path) also as a
  multiple of ``F``, the forward FLOPs of the layers' four linears (qkv, out_proj, fc1, fc2).
  Eager training is 3F; a recompute of the whole forward would add F, but
  ``torch.utils.checkpoint`` stops its recompute early and memopt "full" on a pre-norm block
  skips fc2 too: both 4F - fc2's share.

The optimizer step is left out (it is the same for every configuration). Tiny host tensors
(every tensor argument and result at most 64 bytes: RNG keys, scalars) are their own family, so
that what they cost is visible and they do not hide in "elementwise".

    python -m bench.census                      # the cpu preset
    python -m bench.census --preset cpu-dropout

Writes ``bench/results/census-<preset>.json`` and ``.md`` (the table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench._args import config_names
from bench.compare import (
    DTYPES, PRESETS, RESULTS_DIR, Settings, add_shape_arguments, configs_by_name, cpu_threads, environment,
    fastest_sdpa, loss_fn, preset_settings,
)  # fmt: skip
from bench.configs import BuildContext
from bench.model import make_reference_blocks

DEFAULT_CONFIGS = ("eager-sdpa", "torch-checkpoint", "torch-selective", "memopt-none", "memopt-selective", "memopt-full")

# mkldnn::_linear_pointwise: oneDNN's linear, which memopt's own CPU linears take on some hosts
# (memopt/ops/cpu_linear.py).
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_linear_pointwise")

# Ops that run no kernel: views and aliases, allocations without a fill, metadata.
FREE_OPS = frozenset((
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "as_strided", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "squeeze", "unsqueeze", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "unflatten", "flatten", "diagonal",
    "view_as", "_neg_view", "_conj", "resolve_conj", "resolve_neg",
))  # fmt: skip

# In-place ops that overwrite their destination without reading it.
OVERWRITE_OPS = frozenset(("copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_"))

# First match wins. Op names are ``namespace::name`` (``aten::addmm``, ``memopt::layer_norm_fwd``).
FAMILIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")),
    ("attention", ("scaled_dot_product", "memopt::attention", "flash_attention")),
    ("norm", ("layer_norm", "rms_norm", "norm_backward")),
    ("activation", ("gelu", "silu", "relu", "swiglu", "bias_act", "tanh")),
    ("dropout", ("dropout", "bernoulli", "philox")),
    ("copy", ("copy", "clone", "aten::cat", "contiguous", "scatter", "index", "stack")),
    ("reduce", ("aten::sum", "aten::mean", "aten::amax", "aten::max")),
    ("fill", ("aten::zeros", "aten::ones", "aten::full", "aten::fill", "aten::zero_", "new_zeros", "new_ones", "new_full")),
)
TINY_BYTES = 64


def family(op_name: str) -> str:
    """The family of an operator name such as ``aten::addmm`` (``"elementwise"`` when none matches)."""
    for name, needles in FAMILIES:
        if any(needle in op_name for needle in needles):
            return name
    return "elementwise"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses, a broadcast (stride-0) dimension counted once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return 0 if t.numel() == 0 else elements * t.element_size()


def matmul_flops(op: str, args) -> int:
    """``2 m n k`` (times the batch) of a matmul op's call, from its operands' shapes."""
    if op == "mkldnn::_linear_pointwise":  # X @ W^T (+ bias), X of any leading dims
        return 2 * args[0].numel() * args[1].shape[0]
    if op in ("aten::mm", "aten::addmm"):
        a, b = (args[0], args[1]) if op == "aten::mm" else (args[1], args[2])
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    a, b = (args[0], args[1]) if op == "aten::bmm" else (args[1], args[2])
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


@dataclass
class FamilyCount:
    launches: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    ops: dict = field(default_factory=dict)  # op name -> launches


class TrafficCensus(TorchDispatchMode):
    """Counts launches, bytes and matmul FLOPs of every operator dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.families: dict[str, FamilyCount] = {}
        self.matmul_flops = 0
        self.linear_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        op = func._schema.name
        short = op.split("::")[-1]
        if short in FREE_OPS:
            return
        schema_args = func._schema.arguments
        read = written = 0
        tensors = []
        values = dict(zip((a.name for a in schema_args), args)) | kwargs
        for arg in schema_args:
            leaves = [t for t in tree_flatten(values.get(arg.name))[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(tensor_bytes(t) for t in leaves)
            tensors += leaves
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if mutated:
                written += nbytes
            if not mutated or short not in OVERWRITE_OPS and not arg.kwarg_only:
                read += nbytes
        aliased_returns = [r.alias_info is not None for r in func._schema.returns]
        results = list(out) if isinstance(out, (tuple, list)) else [out]
        for aliased, result in zip(aliased_returns, results):
            leaves = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            tensors += leaves
            if not aliased:
                written += sum(tensor_bytes(t) for t in leaves)
        if all(r for r in aliased_returns) and aliased_returns and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema_args
        ):
            return  # returns an alias of an input and writes nothing: a view under another name
        if not tensors:
            return  # works on dtypes or scalars only (aten::promote_types): no kernel
        name = family(op)
        if all(tensor_bytes(t) <= TINY_BYTES for t in tensors):
            name = "tiny host tensors"
        count = self.families.setdefault(name, FamilyCount())
        count.launches += 1
        count.bytes_read += read
        count.bytes_written += written
        count.ops[op] = count.ops.get(op, 0) + 1
        if short in MATMUL_OPS:
            flops = matmul_flops(op, args)
            self.matmul_flops += flops
            if short in ("mm", "addmm", "_linear_pointwise"):
                self.linear_flops += flops


def linear_forward_flops(settings: Settings) -> int:
    """F: forward matmul FLOPs of the stack's linears (qkv, out_proj, fc1, fc2), one step."""
    d, ff, tokens = settings.d_model, settings.d_ff, settings.batch * settings.seq
    return settings.layers * 2 * tokens * (3 * d * d + d * d + d * ff + ff * d)


def census_config(config, ctx: BuildContext, batch: torch.Tensor, settings: Settings) -> dict:
    """The census of one training step (forward + backward) of ``config``."""
    reason = config.unavailable(ctx)
    if reason is not None:
        return {"status": f"not available ({reason})"}
    model = config.build(ctx)
    loss_fn(model(batch)).backward()  # warm-up: lazy initialisation stays out of the count
    model.zero_grad(set_to_none=True)
    torch.manual_seed(settings.seed)
    with TrafficCensus() as census:
        loss_fn(model(batch)).backward()
    forward_flops = linear_forward_flops(settings)
    families = {
        name: {**asdict(count), "ops": dict(sorted(count.ops.items(), key=lambda kv: -kv[1]))}
        for name, count in sorted(census.families.items())
    }
    non_matmul = [c for name, c in census.families.items() if name != "matmul"]
    return {
        "status": "ok",
        "families": families,
        "launches": sum(c.launches for c in census.families.values()),
        "non_matmul_launches": sum(c.launches for c in non_matmul),
        "non_matmul_bytes": sum(c.bytes_read + c.bytes_written for c in non_matmul),
        "matmul_flops": census.matmul_flops,
        "linear_flops": census.linear_flops,
        "linear_flops_over_F": census.linear_flops / forward_flops,
    }


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f}"


def markdown_table(results: dict[str, dict]) -> str:
    """Families as rows, configurations as columns: ``MB read + written / launches``."""
    names = [n for n, r in results.items() if r["status"] == "ok"]
    if not names:
        return "(no configuration ran)"
    families = sorted({f for n in names for f in results[n]["families"]}, key=lambda f: (f == "matmul", f))
    lines = [
        "| MB moved / launches | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for fam in families:
        cells = []
        for n in names:
            count = results[n]["families"].get(fam)
            cells.append("-" if count is None else f"{_mb(count['bytes_read'] + count['bytes_written'])} / {count['launches']}")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines.append(
        "| **non-matmul** | "
        + " | ".join(f"**{_mb(results[n]['non_matmul_bytes'])} / {results[n]['non_matmul_launches']}**" for n in names)
        + " |"
    )
    lines.append("| linear FLOPs | " + " | ".join(f"{results[n]['linear_flops_over_F']:.2f} F" for n in names) + " |")
    skipped = [f"{n}: {r['status']}" for n, r in results.items() if r["status"] != "ok"]
    return "\n".join(lines + ([""] + skipped if skipped else []))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.census", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--configs", type=config_names, default=",".join(DEFAULT_CONFIGS), help="comma-separated harness configurations")
    add_shape_arguments(parser, device=False)
    parser.add_argument("--out", type=Path, help="the JSON file (default: bench/results/census-<preset>.json; the table beside it as .md)")
    args = parser.parse_args(argv)
    # CPU tensors whatever the preset says: the counts depend on the ops, not on the device.
    settings = preset_settings(args, device="cpu")
    if DTYPES[settings.dtype] in (torch.float16, torch.bfloat16):
        parser.error(f"--dtype {settings.dtype}: runs on CPU tensors, which memopt's attention takes in float32/float64 only")
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    known = configs_by_name(args.configs, "bench.census")
    wanted = list(known)
    device, dtype = torch.device("cpu"), DTYPES[settings.dtype]
    blocks = make_reference_blocks(settings.layers, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, settings.seed)
    ctx = BuildContext(blocks, settings.d_model, settings.n_heads, settings.d_ff, settings.dropout, device, dtype, False)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    batch = torch.randn(settings.batch, settings.seq, settings.d_model, generator=generator, dtype=dtype)
    results = {}
    with cpu_threads(settings.threads), fastest_sdpa(device):
        for name in wanted:
            results[name] = census_config(known[name], ctx, batch, settings)
    out = args.out or RESULTS_DIR / f"census-{settings.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"{settings.layers} layers, d_model {settings.d_model}, {settings.n_heads} heads, d_ff {settings.d_ff}, "
        f"batch {settings.batch} x seq {settings.seq}, {settings.dtype}, dropout {settings.dropout}; "
        f"one forward + backward; F = {linear_forward_flops(settings) / 1e9:.2f} GFLOP"
    )
    table = markdown_table(results)
    payload = {
        "kind": "census",
        "environment": environment(device, settings.threads),
        "arguments": asdict(settings),
        "linear_forward_flops": linear_forward_flops(settings),
        "configs": results,
    }
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(f"`python -m bench.census --preset {settings.preset}`: {header}\n\n{table}\n")
    print(header)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not available") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
