"""The ``memopt`` command line: ``memopt estimate``, ``memopt report``, ``memopt bench``.

Examples::

    memopt estimate --preset gpt2-xl --micro-batch 8 --optimizer adam
    memopt estimate --preset gpt2-xl --micro-batch 8 --precision autocast --memory-gib 80 --json
    memopt estimate --layers 24 --d-model 2048 --heads 16 --vocab 50304 --seq 2048 --micro-batch 4
    memopt report
    memopt bench -- --help          # everything after "bench" goes to python -m bench
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from memopt.estimate import ATTENTIONS, OPTIMIZER_STATES, PRECISIONS, PRESETS, ModelConfig, _config_estimate
from memopt.estimate import choice_label, fit_choices, max_micro_batch, max_seq_len, registered_policies

__all__ = ["main"]

_CONFIG_FLAGS = {  # flag -> ModelConfig field
    "layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "d_ff": "d_ff", "vocab": "vocab_size",
    "seq": "seq_len", "micro_batch": "micro_batch",
}


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
    est.add_argument("--precision", choices=PRECISIONS, default="fp32")
    est.add_argument("--low-dtype", choices=("bf16", "fp16"), default="bf16")
    est.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam")
    est.add_argument("--policy", default="eager", help=f"activation policy: {', '.join(registered_policies())}")
    est.add_argument("--offload", action="store_true", help="what a memopt policy (none, selective, full) saves lives in host memory")
    est.add_argument("--attention", choices=ATTENTIONS, default="math")
    est.add_argument("--dropout", type=float, default=0.1)
    est.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    est.add_argument("--memory-gib", type=float, help="also report the largest micro-batch and sequence that fit")
    est.add_argument("--json", action="store_true", help="machine-readable output")

    rep = sub.add_parser("report", help="allocated / reserved / peak / fragmentation of a device now")
    rep.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    rep.add_argument("--json", action="store_true")

    sub.add_parser("bench", help="run python -m bench; further arguments are passed on", add_help=False)
    return parser


def _config_from(args) -> ModelConfig:
    fields = dict(PRESETS[args.preset]) if args.preset else {}
    for flag, name in _CONFIG_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value
    fields.setdefault("micro_batch", 1)
    missing = [f"--{flag.replace('_', '-')}" for flag, name in _CONFIG_FLAGS.items()
               if name not in fields and name != "d_ff"]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --preset)")
    return ModelConfig(**fields, precision=args.precision, low_dtype=args.low_dtype, optimizer=args.optimizer,
                       policy=args.policy, offload=args.offload, attention=args.attention, dropout=args.dropout, device=args.device)


def _estimate(args) -> int:
    cfg = _config_from(args)
    est = _config_estimate(cfg)
    out = est.to_dict()
    if args.memory_gib is not None:
        if not math.isfinite(args.memory_gib) or args.memory_gib <= 0:
            raise ValueError(f"--memory-gib must be a positive finite number of GiB, got {args.memory_gib:g}")
        memory = int(args.memory_gib * 2**30)
        fits = {}
        for policy, offload in fit_choices():
            fits[choice_label(policy, offload)] = {
                "max_micro_batch": max_micro_batch(memory, cfg, policy=policy, offload=offload),
                "max_seq_len": max_seq_len(memory, cfg, policy=policy, offload=offload),
            }
        out["memory_bytes"] = memory
        out["fits"] = fits
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(est)
    if args.memory_gib is not None:
        print(f"\nin {args.memory_gib:g} GiB:")
        for policy, f in out["fits"].items():
            print(f"  policy {policy:<19} max micro-batch {f['max_micro_batch']:>6}   "
                  f"max seq (at micro-batch {cfg.micro_batch}) {f['max_seq_len']:>8}")
    return 0


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
