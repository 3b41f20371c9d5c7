"""`python -m bench.long_context`: peak memory against sequence length, measured and estimated.

For each configuration (a scaled-down Hugging Face Llama with random weights, vocab 32,000 so
that the logits matter), sequence length and training strategy (``memopt.estimate.strategies``:
no checkpointing; Hugging Face checkpointing; ``memopt.wrap`` with ``policy="selective"`` and
``"full"``, chunked loss; memopt long-context: ``policy="full"`` with offloaded layer inputs,
the tiled FFN and norms and the chunked loss), one training micro-step is measured with
gradients and Adam state resident (a first step and ``optimizer.step()`` run before, gradients
kept, as under gradient accumulation) and set beside :func:`memopt.estimate` of the same setup.

Measured peak = the resident tensors (parameters, gradients, buffers, optimizer state, counted
by storage) + the peak of the tracked live bytes of the step. On CPU the tracker is
``bench.cross_entropy.ChunkAwareTracker`` (``bench.memory.LiveTensorTracker``, which follows
every storage an aten op allocates, with the resident storages and their views excluded, and
which also runs the bodies of memopt's chunked-loss ops under itself: a dispatch mode sees only a
custom op's outputs, so without that the chunk logits inside the loss would be invisible). On GPU
the allocator's ``max_memory_allocated`` is used instead. On CPU, host copies made by an
offload engine live on the same device and are tracked too, so the prediction set beside an
offloading strategy there is the estimate's device total plus its host bytes.

The long-context strategy needs ``memopt.wrap(..., ffn_chunk_tokens=)`` and offloaded layer
inputs under ``policy="full", offload=True``; where this memopt has no ``ffn_chunk_tokens`` the
strategy is skipped with a note.

Rows (``config, strategy, x`` = sequence length, ``measured_bytes``, ``predicted_bytes``,
``ratio``, ``step_s``, ``status``) under an environment header go to
``bench/results/long_context-<preset>-<device>-<date>.json``; a markdown table is printed and
``bench.plot`` draws the PNG next to the file.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import memopt
from bench._args import device_name, positive_ints
from bench.compare import DTYPES, OUT_HELP, RESULTS_DIR, cpu_threads, environment, resolve_device, save_run
from bench.cross_entropy import ChunkAwareTracker
from bench.kernels import bytes_text
from memopt.estimate import ModelConfig, strategies

TOLERANCE = 0.10  # the "within 10% of the measured peak"
LONG_CONTEXT = "memopt long-context"


@dataclass(frozen=True)
class LlamaShape:
    """One scaled-down Llama training setup."""

    name: str
    layers: int = 2
    d_model: int = 256
    heads: int = 4
    kv_heads: int = 2
    d_ff: int = 688
    vocab: int = 32000
    dtype: str = "float32"
    lora_rank: int | None = None  # PEFT LoRA on its default targets (q_proj, v_proj)
    ffn_chunk_tokens: int = 256


@dataclass(frozen=True)
class LongContextSettings:
    preset: str = "default"
    device: str = "auto"
    configs: tuple[LlamaShape, ...] = ()
    seqs: tuple[int, ...] = (1024, 2048, 4096)
    strategies: tuple[str, ...] = ("no checkpointing", "Hugging Face checkpointing", "memopt selective",
                                   "memopt full", LONG_CONTEXT)
    threads: int | None = 1


PRESETS = {
    "default": LongContextSettings(configs=(
        LlamaShape("llama-2L-d256"),
        LlamaShape("llama-4L-d256-lora", layers=4, lora_rank=8),
        LlamaShape("llama-2L-d512", d_model=512, heads=8, kv_heads=4, d_ff=1376),
    )),
    "tiny": LongContextSettings(preset="tiny", configs=(LlamaShape("llama-2L-d64", d_model=64, heads=2, kv_heads=1,
                                                                   d_ff=172, ffn_chunk_tokens=64),), seqs=(256,)),
}


def supports_long_context() -> str | None:
    """None when this memopt has what the long-context strategy needs, else why not."""
    if "ffn_chunk_tokens" not in inspect.signature(memopt.wrap).parameters:
        return "memopt.wrap takes no ffn_chunk_tokens (the tiled FFN and offloaded inputs are not in this build)"
    return None


def model_config(shape: LlamaShape, seq: int, strategy: str, device: torch.device) -> ModelConfig:
    """The estimator's config of ``strategy`` for ``shape`` at ``seq`` tokens."""
    base = ModelConfig(
        arch="llama", n_layers=shape.layers, d_model=shape.d_model, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
        d_ff=shape.d_ff, vocab_size=shape.vocab, seq_len=seq, micro_batch=1,
        precision="fp32" if shape.dtype == "float32" else "pure", low_dtype=DTYPES[shape.dtype] if shape.dtype != "float32" else torch.bfloat16,
        attention="flash", dropout=0.0, lora_rank=shape.lora_rank, device=device.type,
    )
    cfg = strategies(base)[strategy]
    return cfg.replace(ffn_chunk_tokens=shape.ffn_chunk_tokens) if cfg.ffn_chunk_tokens is not None else cfg


def build_model(shape: LlamaShape, seq: int, strategy: str, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=shape.d_model, intermediate_size=shape.d_ff, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         max_position_embeddings=seq, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device, DTYPES[shape.dtype])
    if shape.lora_rank is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=shape.lora_rank))
    model.train()
    if strategy == "Hugging Face checkpointing":
        model.gradient_checkpointing_enable()
    elif strategy in ("memopt selective", "memopt full"):
        memopt.wrap(model, policy=strategy.split()[1])
    elif strategy == LONG_CONTEXT:
        engine = memopt.offload(pin_memory=device.type == "cuda", allow_cpu_source=device.type == "cpu")
        memopt.wrap(model, policy="full", offload=engine, ffn_chunk_tokens=shape.ffn_chunk_tokens)
    return model


def _resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensors


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {(t.untyped_storage().data_ptr(), str(t.device)): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure_peak(shape: LlamaShape, seq: int, strategy: str, device: torch.device) -> tuple[int, float]:
    """(peak bytes of one accumulation micro-step with gradients and Adam state resident, seconds)."""
    model = build_model(shape, seq, strategy, device)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(shape.vocab, (1, seq), device=device, generator=torch.Generator(device).manual_seed(1))

    def micro_step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()

    micro_step()
    optimizer.step()
    resident = _resident(model, optimizer)
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        micro_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with ChunkAwareTracker(exclude=resident) as tracker:
            micro_step()
        peak = _storage_bytes(resident) + tracker.peak_bytes(str(device))
    return peak, time.perf_counter() - start


def predicted_bytes(cfg: ModelConfig, device: torch.device) -> int:
    est = memopt.estimate(cfg)
    # On CPU the offload engine's host copies are on the measured device too.
    return est.total_bytes + (est.host_bytes if device.type == "cpu" else 0)


def bench_point(shape: LlamaShape, seq: int, strategy: str, device: torch.device, skip: str | None) -> dict:
    cfg = model_config(shape, seq, strategy, device)
    row = {"config": shape.name, "strategy": strategy, "x": seq, "device": str(device), "dtype": shape.dtype,
           "lora_rank": shape.lora_rank, "policy": cfg.policy, "offload": cfg.offload, "loss": cfg.loss,
           "ffn_chunk_tokens": cfg.ffn_chunk_tokens, "predicted_bytes": predicted_bytes(cfg, device),
           "measured_bytes": None, "ratio": None, "step_s": None, "status": "ok"}
    if strategy == LONG_CONTEXT and skip:
        row["status"] = f"skipped ({skip})"
        return row
    try:
        measured, seconds = measure_peak(shape, seq, strategy, device)
    except Exception as exc:  # reported in the table, never allowed to stop the run
        row["status"] = f"error ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        return row
    row.update(measured_bytes=measured, step_s=seconds, ratio=row["predicted_bytes"] / measured)
    if abs(row["ratio"] - 1.0) > TOLERANCE:
        row["status"] = f"prediction off by more than {TOLERANCE:.0%}"
    return row


def run_long_context(settings: LongContextSettings, progress: bool = False) -> dict:
    device = resolve_device(settings.device)
    skip = supports_long_context()
    if skip and LONG_CONTEXT in settings.strategies:
        print(f"note: {LONG_CONTEXT} skipped: {skip}", file=sys.stderr)
    rows = []
    with cpu_threads(settings.threads):
        env = environment(device, settings.threads)
        for shape in settings.configs:
            for seq in settings.seqs:
                for strategy in settings.strategies:
                    rows.append(bench_point(shape, seq, strategy, device, skip))
                    if progress:
                        print(markdown_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    for row in rows:
        row["versions"] = {"torch": env["torch"], "triton": env["triton"], "memopt": env["memopt"]}
        row["commit"], row["date"] = env["commit"], env["date"]
    arguments = {"preset": settings.preset, "seqs": list(settings.seqs), "strategies": list(settings.strategies),
                 "configs": [vars(c) for c in settings.configs], "tolerance": TOLERANCE}
    return {"kind": "long_context", "schema": "memopt-bench/1", "environment": env, "arguments": arguments, "rows": rows}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| config | seq | strategy | measured peak | estimated | estimated / measured | step s | status |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        step = "" if r["step_s"] is None else f"{r['step_s']:.1f}"
        lines.append(f"| {r['config']} | {r['x']} | {r['strategy']} | {bytes_text(r['measured_bytes'])} "
                     f"| {bytes_text(r['predicted_bytes'])} | {ratio} | {step} | {r['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_context",
                                     description="Peak training memory against sequence length per strategy, "
                                                 "measured beside memopt.estimate's prediction.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--seqs", type=positive_ints, help="comma-separated sequence lengths, each above 1")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=OUT_HELP.format(kind="long_context"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    settings = PRESETS[args.preset]
    if args.device:
        settings = replace(settings, device=args.device)
    if args.seqs:
        if min(args.seqs) <= 1:
            parser.error(f"--seqs must be comma-separated ints above 1, got {','.join(map(str, args.seqs))!r}")
        settings = replace(settings, seqs=args.seqs)
    result = run_long_context(settings, progress=True)
    env = result["environment"]
    print(f"memopt {env['memopt']} | torch {env['torch']} | {env['device_name']} | commit {env['commit'][:12]}\n")
    print(markdown_table(result["rows"]))
    save_run(result, args.out, "long_context", settings.preset, settings.device, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
