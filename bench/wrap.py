"""`python -m bench.wrap`: ``memopt.wrap`` and ``memopt.plan`` on Hugging Face causal LMs.

A GPT-2 and a Llama model are built from a config (random weights, no download, dropout 0). On
one model, one batch and the same initial weights, each configuration runs in turn:

* ``plain``: no checkpointing;
* ``hf-checkpoint``: Hugging Face's own activation checkpointing
  (``gradient_checkpointing_enable``/``activation_checkpointing_enable``, ``use_reentrant=False``),
  the baseline to beat;
* ``hf-selective``: the same with PyTorch's selective checkpointing of memopt's "selective" op
  list (``context_fn=create_selective_checkpoint_contexts(memopt.policy.selective_checkpoint_policy)``):
  what a user can write today for what ``memopt-selective`` does, and so its baseline;
* ``memopt-full`` / ``memopt-selective``: ``memopt.wrap(model, policy=...)``;
* ``plan-25%``, ``plan-50%``, ``plan-75%``: ``memopt.plan(model, inputs, budget_bytes=f * plain
  saved bytes)`` then ``memopt.wrap(model, plan=plan)``.

Per row: step time (forward + backward, median and p20/p80 over the timed steps after warm-up;
CUDA events on GPU), bytes saved for backward (``memopt.SavedTensorCounter``; parameters,
buffers and the input ids left out), peak GPU memory of one step (GPU only: ``peak_gpu_bytes``
absolute, ``peak_gpu_step_bytes`` above what was allocated before the step; ``held_gpu_bytes``,
what a forward leaves allocated for backward), and as a sanity check
the loss and the largest gradient difference against ``plain`` (flagged ``MISMATCH`` beyond the
dtype's tolerance). Planner rows add the budget, the per-layer policies chosen, the predicted
device and host bytes and added step time, and whether the measured bytes fit the budget (the
saved-tensor count, and on GPU also ``held_gpu_bytes``: offloaded tensors are invisible to the
count); a plan over its budget is flagged ``OVER BUDGET`` and fails the run (after the results
are written). On GPU the planner may offload a layer (an upper-case letter).

No optimizer step: the weights stay the initial ones for every configuration.

    python -m bench.wrap --preset cpu      # tiny GPT-2 and Llama, float32, one CPU thread
    python -m bench.wrap --preset cpu-lora # LoRA (--lora-rank) on small ones at vocab 32,000
    python -m bench.wrap --preset h200     # Llama, hidden 2048, 16 layers, seq 2048, batch 4, bf16
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import memopt
from bench import model as bench_model
from bench._args import device_name, int_type, positive_floats
from bench.compare import (
    DTYPES,
    GRAD_RTOL,
    GRAD_RTOL_FLOOR,
    RESULTS_DIR,
    StepTimer,
    cpu_threads,
    environment,
    quantile,
    resolve_device,
    write_results,
)

# Relative tolerance on loss and gradient differences against ``plain`` in the same dtype: the
# configurations recompute the same ops, so only reordered or non-deterministic kernels differ.
TOLERANCE = {**GRAD_RTOL, **GRAD_RTOL_FLOOR}
POLICY_LETTERS = {"none": "n", "selective": "s", "full": "f"}
MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (stored in the JSON as its arguments)."""

    preset: str = "cpu"
    device: str = "cpu"
    dtype: str = "float32"
    models: tuple[str, ...] = MODELS
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 172
    vocab: int = 256
    seq: int = 64
    batch: int = 2
    warmup: int = 1
    repeats: int = 5
    budgets: tuple[float, ...] = (0.25, 0.5, 0.75)
    seed: int = 0
    # A PEFT LoRA adapter of this rank on the attention projections (LORA_TARGETS), the base
    # model frozen (its LM head too); None: full fine-tuning.
    lora_rank: int | None = None
    # One intra-op thread on CPU: a descheduled second thread stalls every parallel region on a
    # shared machine (see bench/compare.py).
    threads: int | None = 1


PRESETS = {
    "cpu": Settings(),
    # LoRA fine-tuning (rank 8 on the attention projections, the LM head frozen) at a real
    # vocabulary, where the LM-head loss is a large part of the step: ~2-3 minutes on 2 cores.
    "cpu-lora": Settings(
        preset="cpu-lora", hidden=256, intermediate=688, vocab=32000, seq=512, lora_rank=8, budgets=(0.5,),
    ),
    # 0.85e9 parameters (TinyLlama-like width, 16 layers), 8192 tokens per step.
    "h200": Settings(
        preset="h200", device="cuda", dtype="bfloat16", models=("llama",), hidden=2048, layers=16, heads=16,
        kv_heads=4, intermediate=5632, vocab=32000, seq=2048, batch=4, warmup=2, repeats=8, threads=None,
    ),
}


LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def build_model(name: str, settings: Settings, device: torch.device) -> nn.Module:
    """A randomly initialised causal LM in training mode, dropout 0, on ``device`` and the
    settings' dtype, under a PEFT LoRA adapter when ``settings.lora_rank`` is set. Built directly
    on the device (initialising 1e9 parameters on the host is slow)."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=settings.hidden, n_layer=settings.layers, n_head=settings.heads, n_inner=settings.intermediate,
            n_positions=settings.seq, vocab_size=settings.vocab, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
        )
        model_class = transformers.GPT2LMHeadModel
    elif name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=settings.hidden, intermediate_size=settings.intermediate,
            num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
            num_key_value_heads=settings.kv_heads, vocab_size=settings.vocab,
            max_position_embeddings=settings.seq, attn_implementation="sdpa",
        )
        model_class = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"bench.wrap: model must be one of {MODELS}, got {name!r}")
    torch.manual_seed(settings.seed)
    with torch.device(device):
        model = model_class(config)
    model = model.to(DTYPES[settings.dtype])
    if settings.lora_rank is not None:
        import peft

        # lora_dropout 0 (as the model's dropout): every configuration computes the same function.
        lora = peft.LoraConfig(r=settings.lora_rank, target_modules=LORA_TARGETS[name], lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
    return model.train()


def hf_checkpointing(model: nn.Module, enable: bool, selective: bool = False) -> None:
    """Hugging Face's own activation checkpointing, non-reentrant (renamed in transformers 5.x);
    ``selective``: under PyTorch's selective checkpointing (``bench.model.selective_checkpoint_kwargs``)."""
    kwargs = bench_model.selective_checkpoint_kwargs() if selective else {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        if enable:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif enable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def policy_string(policies: list[str], offloads: list[bool] | None = None) -> str:
    """One letter per layer: n(one), s(elective), f(ull); upper case when the layer offloads."""
    offloads = [False] * len(policies) if offloads is None else offloads
    return "".join(POLICY_LETTERS[p].upper() if o else POLICY_LETTERS[p] for p, o in zip(policies, offloads, strict=True))


def empty_row(model_name: str, config: str, settings: Settings) -> dict:
    return {
        "model": model_name,
        "config": config,
        "status": "ok",
        "policies": None,
        "dtype": settings.dtype,
        "batch": settings.batch,
        "seq": settings.seq,
        "steps_timed": 0,
        "step_time_ms_median": None,
        "step_time_ms_p20": None,
        "step_time_ms_p80": None,
        "tokens_per_s": None,
        "saved_bytes": None,
        "saved_vs_plain": None,
        "peak_gpu_bytes": None,
        "peak_gpu_step_bytes": None,
        "held_gpu_bytes": None,
        "loss": None,
        "loss_rel_diff": None,
        "grad_max_abs_diff": None,
        "grad_max_rel_diff": None,
        "tolerance": TOLERANCE[DTYPES[settings.dtype]],
        "grad_check": "n/a",
        "time_vs_hf": None,
        "time_vs_hf_selective": None,
        "budget_fraction": None,
        "budget_bytes": None,
        "predicted_bytes": None,
        "predicted_host_bytes": None,
        "predicted_extra_ms": None,
        "measured_extra_ms": None,
        "within_budget": None,
    }


ROW_COLUMNS = tuple(empty_row("x", "x", Settings()))


def _error_status(exc: BaseException) -> str:
    message = (str(exc).splitlines() or [""])[0][:160]
    return f"error ({type(exc).__name__}: {message})"


class Runner:
    """Measures one model under successive configurations against its plain run."""

    def __init__(self, model_name: str, model: nn.Module, settings: Settings, device: torch.device):
        self.model_name, self.model, self.settings, self.device = model_name, model, settings, device
        generator = torch.Generator().manual_seed(settings.seed + 1)
        ids = torch.randint(0, settings.vocab, (settings.batch, settings.seq), generator=generator).to(device)
        self.inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
        self.timer = StepTimer(device)
        self.reference: tuple[float, dict[str, torch.Tensor]] | None = None

    def loss(self) -> torch.Tensor:
        return self.model(**self.inputs).loss

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.loss().backward()

    def saved_bytes(self) -> int:
        excluded = [*self.model.parameters(), *self.model.buffers(), self.inputs["input_ids"]]
        with memopt.SavedTensorCounter(exclude=excluded) as counter:
            loss = self.loss()
        del loss
        return counter.total_bytes

    def _settled_requested_bytes(self) -> int:
        """Bytes the live tensors asked the CUDA allocator for, once queued work has finished:
        what the saved-tensor count and the planner count. ``memory_allocated`` counts whole
        blocks (rounded up to 512 bytes, and cached blocks up to 1 MiB larger than the request
        handed out unsplit), so it could put a plan that is exactly right over its budget."""
        torch.cuda.synchronize(self.device)
        # An allocation makes the allocator retire blocks whose side-stream copies (offload) ended.
        torch.empty(1, device=self.device)
        return torch.cuda.memory_stats(self.device)["requested_bytes.all.current"]

    def held_after_forward(self) -> int:
        """Device bytes a forward leaves allocated for backward (the allocator's count, so
        offloaded tensors, which the saved-tensor count cannot see, are judged too)."""
        self.model.zero_grad(set_to_none=True)
        before = self._settled_requested_bytes()
        loss = self.loss()
        held = self._settled_requested_bytes() - before
        del loss
        return held

    def measure(self, row: dict) -> dict:
        """Fill ``row``'s time, memory and sanity columns for the model as configured now."""
        settings, device = self.settings, self.device
        for _ in range(settings.warmup):
            self.step()
        times = [self.timer(self.step) for _ in range(settings.repeats)]
        row["steps_timed"] = len(times)
        row["step_time_ms_median"] = quantile(times, 0.5) * 1e3
        row["step_time_ms_p20"] = quantile(times, 0.2) * 1e3
        row["step_time_ms_p80"] = quantile(times, 0.8) * 1e3
        row["tokens_per_s"] = settings.batch * settings.seq / quantile(times, 0.5)
        if device.type == "cuda":
            self.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.step()
            torch.cuda.synchronize(device)
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
            # The plain row runs before the harness holds its reference gradients; the step's
            # own peak (activations, gradients, recompute) compares across rows.
            row["peak_gpu_step_bytes"] = row["peak_gpu_bytes"] - before
            row["held_gpu_bytes"] = self.held_after_forward()
        row["saved_bytes"] = self.saved_bytes()

        torch.manual_seed(settings.seed)
        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        row["loss"] = loss.item()
        if self.reference is None:
            # Kept in the model's dtype (float32 copies of 1e9 gradients would cost 4 GB).
            self.reference = (row["loss"], {name: g.detach().clone() for name, g in grads.items()})
            row.update(loss_rel_diff=0.0, grad_max_abs_diff=0.0, grad_max_rel_diff=0.0, grad_check="reference")
        else:
            ref_loss, ref_grads = self.reference
            if grads.keys() != ref_grads.keys():
                raise RuntimeError(f"gradients for {sorted(grads.keys() ^ ref_grads.keys())} differ in presence from plain")
            max_abs, max_rel = 0.0, 0.0
            for name, ref in ref_grads.items():
                diff = (grads[name].float() - ref.float()).abs().max().item()
                scale = ref.float().abs().max().item()
                max_abs = max(max_abs, diff)
                max_rel = max(max_rel, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
            loss_rel = abs(row["loss"] - ref_loss) / max(abs(ref_loss), 1e-12)
            row.update(loss_rel_diff=loss_rel, grad_max_abs_diff=max_abs, grad_max_rel_diff=max_rel)
            row["grad_check"] = "ok" if max(loss_rel, max_rel) <= row["tolerance"] else "MISMATCH"
        self.model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row

    def configured(self, config: str, apply: Callable[[], None], undo: Callable[[], None], row: dict | None = None) -> dict:
        """One row: ``apply`` the configuration, measure, ``undo``. Errors become the row's status."""
        row = row or empty_row(self.model_name, config, self.settings)
        try:
            apply()
            try:
                self.measure(row)
            finally:
                undo()
        except Exception as exc:  # a configuration that breaks is reported, not allowed to stop the run
            row["status"] = _error_status(exc)
        return row

    def plan_row(self, fraction: float, plain_saved: int, plain_ms: float | None) -> dict:
        row = empty_row(self.model_name, f"plan-{fraction:.0%}", self.settings)
        budget = int(fraction * plain_saved)
        row.update(budget_fraction=fraction, budget_bytes=budget)
        try:
            plan = memopt.plan(self.model, self.inputs, budget_bytes=budget)
        except Exception as exc:  # reported in the row like a failing configuration
            infeasible = isinstance(exc, ValueError) and "below the least" in str(exc)
            row["status"] = (
                "infeasible (budget below the least any per-layer choice saves)" if infeasible else _error_status(exc)
            )
            return row
        row.update(
            policies=policy_string(plan.policies, plan.offloads),
            predicted_bytes=plan.predicted_bytes,
            predicted_host_bytes=plan.predicted_host_bytes,
            predicted_extra_ms=plan.predicted_extra_seconds * 1e3,
        )
        self.configured(row["config"], lambda: memopt.wrap(self.model, plan=plan), lambda: memopt.unwrap(self.model), row)
        if row["status"] == "ok":
            # On GPU the allocator's count decides too: offloaded layers hide their saved
            # tensors from the saved-tensor counter.
            held = row["held_gpu_bytes"]
            row["within_budget"] = row["saved_bytes"] <= budget and (held is None or held <= budget)
            if plain_ms is not None:
                row["measured_extra_ms"] = row["step_time_ms_median"] - plain_ms
        return row

    def run(self) -> list[dict]:
        model, layers = self.model, self.settings.layers
        nothing = lambda: None  # noqa: E731
        plain = self.configured("plain", nothing, nothing)
        plain["policies"] = policy_string(["none"] * layers)
        if plain["status"] != "ok":
            return [plain]
        rows = [
            plain,
            self.configured("hf-checkpoint", lambda: hf_checkpointing(model, True), lambda: hf_checkpointing(model, False)),
        ]
        rows[-1]["policies"] = "hf"
        hf_selective = self.configured(
            "hf-selective", lambda: hf_checkpointing(model, True, selective=True), lambda: hf_checkpointing(model, False)
        )
        hf_selective["policies"] = "hf-sac"
        if not bench_model.sac_saved_bytes_countable():
            hf_selective["saved_bytes"] = None  # the count saw none of what selective checkpointing kept
        rows.append(hf_selective)
        for policy in ("full", "selective"):
            row = self.configured(
                f"memopt-{policy}", lambda: memopt.wrap(model, policy=policy), lambda: memopt.unwrap(model)
            )
            row["policies"] = policy_string([policy] * layers)
            rows.append(row)
        for fraction in self.settings.budgets:
            rows.append(self.plan_row(fraction, plain["saved_bytes"], plain["step_time_ms_median"]))
        hf = rows[1]
        for row in rows:
            if row["saved_bytes"] is not None:
                row["saved_vs_plain"] = row["saved_bytes"] / plain["saved_bytes"]
            if row["step_time_ms_median"] is not None and hf["step_time_ms_median"]:
                row["time_vs_hf"] = row["step_time_ms_median"] / hf["step_time_ms_median"]
            if row["step_time_ms_median"] is not None and hf_selective["step_time_ms_median"]:
                row["time_vs_hf_selective"] = row["step_time_ms_median"] / hf_selective["step_time_ms_median"]
        return rows


def run(settings: Settings) -> dict:
    """The whole run as the JSON-ready result."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise SystemExit("bench.wrap: needs the transformers package (pip install transformers)") from exc
    device = resolve_device(settings.device)
    env = environment(device, settings.threads)
    rows = []
    with cpu_threads(settings.threads):
        for name in settings.models:
            model = build_model(name, settings, device)
            rows += Runner(name, model, settings, device).run()
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "kind": "wrap",
        "schema": "memopt-bench/1",
        "environment": env,
        "arguments": asdict(settings),
        "columns": list(ROW_COLUMNS),
        "rows": rows,
    }


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_table(rows: list[dict]) -> str:
    """One line per (model, configuration); planner rows carry budget and predictions."""
    lines = [
        "| model | config | policies | step ms (p20-p80) | time / hf | time / hf-selective | saved MiB | saved / plain "
        "| step peak GPU MiB | held GPU MiB | loss rel diff | grad rel diff | check | budget MiB | predicted MiB "
        "| predicted host MiB | predicted +ms | measured +ms | fits |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            budget = _mib(r["budget_bytes"]) if r["budget_bytes"] is not None else ""
            lines.append(f"| {r['model']} | {r['config']} | {r['status']} | | | | | | | | | | | {budget} | | | | | |")
            continue
        time_cell = f"{r['step_time_ms_median']:.1f} ({r['step_time_ms_p20']:.1f}-{r['step_time_ms_p80']:.1f})"
        fits = "" if r["within_budget"] is None else ("yes" if r["within_budget"] else "OVER BUDGET")
        lines.append(
            f"| {r['model']} | {r['config']} | {r['policies']} | {time_cell} | {_num(r['time_vs_hf'], '.2f')} "
            f"| {_num(r['time_vs_hf_selective'], '.2f')} | {_mib(r['saved_bytes'])} | {_num(r['saved_vs_plain'], '.2f')} | {_mib(r['peak_gpu_step_bytes'])} "
            f"| {_mib(r['held_gpu_bytes'])} "
            f"| {_num(r['loss_rel_diff'], '.1e')} | {_num(r['grad_max_rel_diff'], '.1e')} | {r['grad_check']} "
            f"| {_mib(r['budget_bytes'])} | {_mib(r['predicted_bytes'])} | {_mib(r['predicted_host_bytes'])} "
            f"| {_num(r['predicted_extra_ms'], '.1f')} "
            f"| {_num(r['measured_extra_ms'], '.1f')} | {fits} |"
        )
    return "\n".join(lines)


def over_budget(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["within_budget"] is False]


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.wrap",
        description="memopt.wrap and memopt.plan against Hugging Face gradient checkpointing on GPT-2 and Llama.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1 or auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--models", help=f"comma-separated, among {','.join(MODELS)}")
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch", "warmup", "repeats", "seed", "threads", "lora_rank"):
        parser.add_argument("--" + name.replace("_", "-"), type=int_type(name), dest=name)
    parser.add_argument("--budgets", type=positive_floats, help="comma-separated fractions of the plain model's saved bytes, e.g. 0.25,0.5")
    parser.add_argument("--out", type=Path, help="JSON file, or a folder for wrap-<preset>-<device>-<date>.json (default bench/results/)")
    args = parser.parse_args(argv)
    overrides = {
        k: getattr(args, k)
        for k in ("device", "dtype", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch", "warmup", "repeats", "seed", "threads", "lora_rank")
        if getattr(args, k) is not None
    }
    if args.models:
        overrides["models"] = tuple(m.strip() for m in args.models.split(",") if m.strip())
        unknown = [m for m in overrides["models"] if m not in MODELS]
        if unknown:
            parser.error(f"--models has unknown names {unknown}; known: {list(MODELS)}")
    if args.budgets:
        overrides["budgets"] = args.budgets
    return replace(PRESETS[args.preset], **overrides), args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    t0 = time.perf_counter()
    result = run(settings)
    result["wall_s"] = time.perf_counter() - t0
    env = result["environment"]
    stamp = env["date"].replace("-", "").replace(":", "")
    path = write_results(result, args.out or RESULTS_DIR, f"wrap-{settings.preset}-{resolve_device(settings.device).type}-{stamp}")
    print(f"memopt {env['memopt']} | torch {env['torch']} | triton {env['triton']} | {env['device_name']} | commit {env['commit'][:12]}")
    print(
        f"{','.join(settings.models)}: {settings.layers} layers, hidden {settings.hidden}, {settings.heads} heads "
        f"({settings.kv_heads} kv for llama), intermediate {settings.intermediate}, vocab {settings.vocab}, "
        f"batch {settings.batch} x seq {settings.seq}, {settings.dtype}, dropout 0; "
        f"{settings.warmup} warm-up + {settings.repeats} timed forward+backward steps per row\n"
    )
    print(markdown_table(result["rows"]))
    print(
        "\npolicies: one letter per layer, n(one) s(elective) f(ull) o(ffload); hf = Hugging Face checkpointing of every layer; "
        "hf-sac = the same under PyTorch's selective checkpointing of memopt's \"selective\" op list"
    )
    print(f"results: {path}\ntotal {result['wall_s']:.1f} s")
    bad = over_budget(result["rows"])
    if bad:
        names = [
            f"{r['model']} {r['config']}: saved {r['saved_bytes']}, held on GPU {r['held_gpu_bytes']}, budget {r['budget_bytes']}"
            for r in bad
        ]
        raise AssertionError(f"bench.wrap: measured bytes exceed the plan's budget: {names}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
