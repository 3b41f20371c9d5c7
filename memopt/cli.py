"""The ``memopt`` command line: ``memopt estimate``, ``memopt report``, ``memopt bench``.

Examples::

    memopt estimate --preset gpt2-xl --micro-batch 8 --optimizer adam
    memopt estimate --preset gpt2-xl --micro-batch 8 --precision autocast --memory-gib 80 --json
    memopt estimate --layers 24 --d-model 2048 --heads 16 --vocab 50304 --seq 2048 --micro-batch 4
    memopt estimate --preset llama-3-8b --lora --memory-gib 141 --host-memory-gib 128 --max-seq
    memopt report
    memopt bench -- --help          # everything after "bench" goes to python -m bench
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import math
import os
import re
import subprocess
import sys

from memopt.estimate import ATTENTIONS, OPTIMIZER_STATES, PRECISIONS, PRESETS, ModelConfig, _config_estimate
from memopt.estimate import ARCHS, FIXED_TERMS, LLAMA_LINEARS, LORA_DEFAULT_TARGETS, LOSSES, choice_label, fit_choices
from memopt.estimate import MICRO_BATCH_UPPER, SEQ_LEN_UPPER, max_micro_batch, max_seq_len, registered_policies
from memopt.estimate import seq_len_limit, strategies

__all__ = ["main"]

_CONFIG_FLAGS = {  # flag -> ModelConfig field
    "layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "d_ff": "d_ff", "vocab": "vocab_size",
    "seq": "seq_len", "micro_batch": "micro_batch", "kv_heads": "n_kv_heads", "arch": "arch",
    "precision": "precision", "attention": "attention", "dropout": "dropout", "loss": "loss",
    "loss_chunk_tokens": "loss_chunk_tokens", "ffn_chunk_tokens": "ffn_chunk_tokens",
}
_SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
_LORA_DEFAULT_RANK = 8  # PEFT's LoraConfig default


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memopt", description="memopt: will it fit, what takes the memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    est = sub.add_parser("estimate", help="peak training memory of a GPT-style model",
                         description="Peak training memory of a GPT-2-layout transformer (see memopt.estimate).")
    est.add_argument("--preset", choices=sorted(PRESETS), help="start from a published model size")
    est.add_argument("--layers", type=int)
    est.add_argument("--d-model", type=int)
    est.add_argument("--heads", type=int)
    est.add_argument("--d-ff", type=int, help="MLP hidden size (default 4 * d-model)")
    est.add_argument("--vocab", type=int)
    est.add_argument("--seq", type=int, help="sequence length")
    est.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 1)")
    est.add_argument("--arch", choices=ARCHS, help="model layout (default gpt2, or the preset's)")
    est.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention, arch llama)")
    est.add_argument("--precision", choices=PRECISIONS, help="default fp32, or the preset's")
    est.add_argument("--low-dtype", choices=("bf16", "fp16"), default="bf16")
    est.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam")
    est.add_argument("--policy", default="eager", help=f"activation policy: {', '.join(registered_policies())}")
    est.add_argument("--offload", action="store_true", help="what a memopt policy (none, selective, full) saves lives in host memory")
    est.add_argument("--attention", choices=ATTENTIONS, help="default the arch's (gpt2 math, llama flash), or the preset's")
    est.add_argument("--dropout", type=float, help="default the arch's (gpt2 0.1, llama 0), or the preset's")
    est.add_argument("--loss", choices=LOSSES, help="plain (materialised logits, the default) or chunked")
    est.add_argument("--loss-chunk-tokens", type=int, help="tokens per chunk of the chunked loss")
    est.add_argument("--ffn-chunk-tokens", type=int, help="sequence-tiled FFN and norms: tokens per chunk (arch llama)")
    est.add_argument("--lora", action="store_true", help=f"LoRA fine-tuning (rank {_LORA_DEFAULT_RANK} on "
                     f"{','.join(LORA_DEFAULT_TARGETS)} unless --lora-rank/--lora-targets say otherwise; arch llama)")
    est.add_argument("--lora-rank", type=int, help="LoRA rank (implies --lora)")
    est.add_argument("--lora-targets", help=f"comma-separated LoRA targets from {','.join(LLAMA_LINEARS)} (implies --lora)")
    est.add_argument("--host-memory-gib", type=float, help="host-memory budget for offloaded tensors")
    est.add_argument("--max-seq", action="store_true",
                     help="print the longest sequence that fits in --memory-gib per training strategy, and what binds")
    est.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    est.add_argument("--memory-gib", type=float, help="also report the largest micro-batch and sequence that fit")
    est.add_argument("--json", action="store_true", help="machine-readable output")

    rep = sub.add_parser("report", help="allocated / reserved / peak / fragmentation of a device now")
    rep.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    rep.add_argument("--json", action="store_true")

    sub.add_parser("bench", help="run python -m bench; further arguments are passed on", add_help=False)
    return parser


def _gib(args, flag: str) -> int | None:
    """``--flag`` in GiB as bytes, or None; a positive finite number is required."""
    value = getattr(args, flag.replace("-", "_"))
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--{flag} must be a positive finite number of GiB, got {value:g}")
    return int(value * 2**30)


def _config_from(args) -> ModelConfig:
    fields = dict(PRESETS[args.preset]) if args.preset else {}
    for flag, name in _CONFIG_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value
    fields.setdefault("micro_batch", 1)
    flag_of = {name: flag for flag, name in _CONFIG_FLAGS.items()}
    missing = [f"--{flag_of[name].replace('_', '-')}" for name in _SHAPE_FIELDS if name not in fields]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --preset)")
    if args.lora or args.lora_rank is not None or args.lora_targets is not None:
        fields["lora_rank"] = _LORA_DEFAULT_RANK if args.lora_rank is None else args.lora_rank
        if args.lora_targets is not None:
            fields["lora_targets"] = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    host = _gib(args, "host-memory-gib")
    try:
        return ModelConfig(**fields, low_dtype=args.low_dtype, optimizer=args.optimizer, policy=args.policy,
                           offload=args.offload, device=args.device, host_memory_bytes=host)
    except ValueError as err:
        raise ValueError(_flag_names(str(err))) from None


def _flag_names(message: str) -> str:
    """A ModelConfig message with its field names as the command line's flags (whole words:
    ``attention_dropout`` is neither ``attention`` nor ``dropout``)."""
    renames = {"lora_rank": "--lora-rank", "lora_targets": "--lora-targets", "n_kv_heads": "--kv-heads",
               "ffn_chunk_tokens": "--ffn-chunk-tokens", "loss_chunk_tokens": "--loss-chunk-tokens",
               "host_memory_bytes": "--host-memory-gib", "attention": "--attention", "dropout": "--dropout"}
    for field, flag in renames.items():
        message = re.sub(rf"\b{field}\b", f"{flag} ({field})", message, count=1)
    return message


def _max_seq_table(cfg: ModelConfig, memory: int) -> dict[str, dict]:
    out = {}
    for name, strategy in strategies(cfg).items():
        limit = seq_len_limit(memory, strategy)
        fixed = {k: v for k, v in limit.estimate.breakdown.items() if k in FIXED_TERMS and v}
        out[name] = {"max_seq_len": limit.max_seq_len, "binding": limit.binding,
                     "total_bytes": limit.estimate.total_bytes, "host_bytes": limit.estimate.host_bytes,
                     "fixed_bytes": sum(fixed.values()), "fixed_terms": list(fixed),
                     "policy": strategy.policy, "offload": strategy.offload, "loss": strategy.loss,
                     "ffn_chunk_tokens": strategy.ffn_chunk_tokens}
    return out


def _binding_text(row: dict, memory: int) -> str:
    """What stops a longer sequence, in words: the growing term, or the fixed terms' total."""
    if row["binding"] != "fixed terms":
        return row["binding"]
    return (f"fixed terms: {' + '.join(row['fixed_terms'])} (they do not grow with the sequence) need "
            f"{row['fixed_bytes'] / 2**30:.2f} GiB alone, over {memory / 2**30:g} GiB")


def _estimate(args) -> int:
    cfg = _config_from(args)
    est = _config_estimate(cfg)
    out = est.to_dict()
    memory = _gib(args, "memory-gib")
    if args.max_seq and memory is None:
        raise ValueError("--max-seq needs --memory-gib (the device memory to fit in)")
    if args.max_seq:
        out["memory_bytes"] = memory
        out["max_seq"] = _max_seq_table(cfg, memory)
    elif memory is not None:
        fits = {}
        for policy, offload in fit_choices():
            fits[choice_label(policy, offload)] = {
                "max_micro_batch": max_micro_batch(memory, cfg, policy=policy, offload=offload),
                "max_seq_len": max_seq_len(memory, cfg, policy=policy, offload=offload),
            }
        out["memory_bytes"] = memory
        out["fits"] = fits
        out["search_upper"] = {"max_micro_batch": MICRO_BATCH_UPPER, "max_seq_len": SEQ_LEN_UPPER}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(est)
    if args.max_seq:
        host = "unbounded" if cfg.host_memory_bytes is None else f"{cfg.host_memory_bytes / 2**30:g} GiB"
        print(f"\nlongest sequence (estimated, micro-batch {cfg.micro_batch}) in {args.memory_gib:g} GiB of device "
              f"memory, host memory {host}:")
        for name, row in out["max_seq"].items():
            length = f"{'>= ' if row['binding'] == 'limit' else ''}{row['max_seq_len']:,}"
            print(f"  {name:<28} {length:>10} tokens   binds: {_binding_text(row, memory)}")
    elif memory is not None:
        print(f"\nin {args.memory_gib:g} GiB:")
        for policy, f in out["fits"].items():
            print(f"  policy {policy:<19} max micro-batch {_found(f['max_micro_batch'], MICRO_BATCH_UPPER):>6}   "
                  f"max seq (at micro-batch {cfg.micro_batch}) {_found(f['max_seq_len'], SEQ_LEN_UPPER):>8}")
        for policy, offload in fit_choices():
            if not out["fits"][choice_label(policy, offload)]["max_micro_batch"]:
                print("  " + _none_fits(cfg.replace(policy=policy, offload=offload, micro_batch=1), memory))
    return 0


def _found(value: int, upper: int) -> str:
    """A searched maximum as the table prints it: ``none`` for 0, ``>= upper`` where the search
    stopped at its bound (everything up to it fits; what lies beyond was not tried)."""
    if not value:
        return "none"
    return f">= {value}" if value >= upper else str(value)


def _none_fits(cfg: ModelConfig, memory: int) -> str:
    """Why even micro-batch 1 of ``cfg`` does not fit: the device memory or the host budget."""
    est = _config_estimate(cfg)
    head = f"policy {choice_label(cfg.policy, cfg.offload)}: even micro-batch 1 (seq {cfg.seq_len}) needs"
    if cfg.host_memory_bytes is not None and est.host_bytes > cfg.host_memory_bytes:
        return (f"{head} {est.host_bytes / 2**30:.2f} GiB of host memory, over --host-memory-gib "
                f"{cfg.host_memory_bytes / 2**30:g}")
    return f"{head} {est.total_bytes / 2**30:.2f} GiB of device memory, over --memory-gib {memory / 2**30:g}"


def _report(args) -> int:
    from memopt.report import memory_report

    rep = memory_report(args.device)
    print(json.dumps(rep.to_dict(), indent=2) if args.json else rep)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        # ``python -m bench`` finds bench/ in the current directory (it is not an installed
        # package): elsewhere it only said "No module named bench".
        if importlib.machinery.PathFinder.find_spec("bench", [os.getcwd(), *sys.path]) is None:
            print(
                "memopt bench: the benchmarks (bench/) are in the memopt source tree, not in the installed package; "
                "run this from the root of a memopt checkout",
                file=sys.stderr,
            )
            return 2
        return subprocess.call([sys.executable, "-m", "bench", *rest])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "estimate":
            return _estimate(args)
        return _report(args)
    except (ValueError, RuntimeError) as err:
        print(f"memopt {args.command}: error: {err}", file=sys.stderr)
        return 2
