"""The memopt command line, memory_report and diagnose_oom."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memopt
from memopt.cli import main
from memopt.estimate import ModelConfig

XL_PARAMS = 1_557_611_200  # hand count in tests/test_estimate.py::test_gpt2_xl_matches_hand_arithmetic


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_preset_json_matches_hand_arithmetic(capsys):
    out = run_json(capsys, "estimate", "--preset", "gpt2-xl", "--micro-batch", "8", "--optimizer", "adam")
    assert out["num_parameters"] == XL_PARAMS
    b = out["breakdown"]
    assert b["parameters"] + b["gradients"] + b["optimizer_state"] == 16 * XL_PARAMS
    assert out["total_bytes"] == sum(b.values())
    assert out["config"]["n_layers"] == 48 and out["config"]["d_model"] == 1600


def test_estimate_flags_and_memory_fit(capsys):
    out = run_json(capsys, "estimate", "--layers", "4", "--d-model", "256", "--heads", "4", "--vocab", "1000",
                   "--seq", "128", "--micro-batch", "2", "--precision", "autocast", "--memory-gib", "1")
    cfg = ModelConfig(n_layers=4, d_model=256, n_heads=4, vocab_size=1000, seq_len=128, micro_batch=2,
                      precision="autocast")
    assert out["total_bytes"] == memopt.estimate(cfg).total_bytes
    assert out["fits"]["eager"]["max_micro_batch"] == memopt.max_micro_batch(2**30, cfg)
    assert out["fits"]["checkpoint"]["max_micro_batch"] > out["fits"]["eager"]["max_micro_batch"]
    assert out["fits"]["selective, offload"]["max_micro_batch"] >= out["fits"]["selective"]["max_micro_batch"]


def test_estimate_table_output(capsys):
    assert main(["estimate", "--preset", "gpt2", "--micro-batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "parameters: 124,439,808" in text  # GPT-2 small: the published 124M
    assert "attention_scores" in text and "total" in text


@pytest.mark.parametrize("argv,match", [
    (["estimate", "--preset", "gpt2", "--micro-batch", "-3"], "micro_batch must be a positive int"),
    (["estimate", "--layers", "2"], "missing --d-model"),
    (["estimate", "--preset", "gpt2", "--policy", "nope"], "policy must be one of"),
    (["estimate", "--preset", "llama-3-8b", "--max-seq"], "--max-seq needs --memory-gib"),
    (["estimate", "--preset", "llama-3-8b", "--memory-gib", "141", "--host-memory-gib", "-1", "--max-seq"],
     "--host-memory-gib must be a positive finite number of GiB"),
    (["estimate", "--preset", "llama-3-8b", "--lora-targets", "q_proj,wq"], "--lora-targets (lora_targets) must be names"),
    (["estimate", "--preset", "llama-3-8b", "--lora-rank", "0"], "--lora-rank (lora_rank) must be a positive int"),
    (["estimate", "--preset", "llama-3-8b", "--ffn-chunk-tokens", "-4"], "--ffn-chunk-tokens (ffn_chunk_tokens) must be"),
    (["estimate", "--preset", "llama-3-8b", "--kv-heads", "5"], "--kv-heads (n_kv_heads) must be a positive int dividing"),
    (["estimate", "--preset", "gpt2", "--lora"], "--lora-rank (lora_rank) is modelled for arch='llama' only"),
    (["estimate", "--preset", "gpt2", "--dropout", "1.5"], "--dropout (dropout) must be a number in [0, 1)"),
])
def test_estimate_bad_input(capsys, argv, match):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


LLAMA_SHAPE = ["--arch", "llama", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "100",
               "--seq", "16", "--memory-gib", "1"]


def test_estimate_llama_without_a_preset_takes_the_archs_defaults(capsys):
    """--attention and --dropout default to the arch's: flash and 0 for llama (math and 0.1 for
    gpt2). Before, their defaults were gpt2's, the only values llama refuses: without a preset,
    --arch llama failed until both were given by hand."""
    out = run_json(capsys, "estimate", *LLAMA_SHAPE)
    explicit = run_json(capsys, "estimate", *LLAMA_SHAPE, "--attention", "flash", "--dropout", "0")
    assert out == explicit
    assert (out["config"]["attention"], out["config"]["dropout"]) == ("flash", 0.0)
    gpt2 = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "100", "--seq", "16"]
    out = run_json(capsys, "estimate", *gpt2)
    assert out == run_json(capsys, "estimate", *gpt2, "--attention", "math", "--dropout", "0.1")
    assert (out["config"]["attention"], out["config"]["dropout"]) == ("math", 0.1)


@pytest.mark.parametrize("flag,value,match", [
    ("--attention", "math", "--attention (attention) must be 'flash' with arch='llama'"),
    ("--dropout", "0.1", "--dropout (dropout) must be 0.0 with arch='llama'"),
])
def test_estimate_llama_refuses_an_explicit_value_naming_the_flag(capsys, flag, value, match):
    assert main(["estimate", *LLAMA_SHAPE, flag, value]) == 2
    assert match in capsys.readouterr().err


def test_unknown_optimizer_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--preset", "gpt2", "--optimizer", "lion"])
    assert exc.value.code == 2
    assert "--optimizer" in capsys.readouterr().err


def test_report_json_on_cpu(capsys):
    out = run_json(capsys, "report", "--device", "cpu")
    assert out["device"] == "cpu" and out["allocated"] > 0 and out["reserved"] is None


def test_python_dash_m_memopt():
    proc = subprocess.run([sys.executable, "-m", "memopt", "estimate", "--preset", "gpt2-large", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["num_parameters"] == 774_030_080


def test_memory_report_cpu_says_so():
    rep = memopt.memory_report("cpu")
    assert rep.allocated > 0 and rep.peak_allocated > 0
    assert "cpu" in str(rep) and "no CUDA allocator" in str(rep)


def test_memory_report_rejects_other_devices():
    with pytest.raises(ValueError, match="device must be a CUDA device or 'cpu'"):
        memopt.memory_report("meta")


def test_diagnose_oom_names_consumers_and_what_fits():
    cfg = ModelConfig(**memopt.estimate_presets["gpt2-xl"], micro_batch=8)
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.25 GiB. GPU 0 has a total capacity "
                                 "of 79.19 GiB of which 1.2 GiB is free.")
    diag = memopt.diagnose_oom(err, config=cfg, memory_bytes=80 * 2**30)
    assert diag.requested_bytes == int(6.25 * 2**30)
    assert diag.largest[0][0] == "attention_scores"
    assert diag.fits["eager"] == memopt.max_micro_batch(80 * 2**30, cfg)
    assert diag.fits["checkpoint"] >= 8
    text = str(diag)
    assert "attention_scores" in text and "policy 'checkpoint' fits micro-batch 8" in text


def test_diagnose_oom_when_nothing_fits():
    cfg = ModelConfig(**memopt.estimate_presets["gpt2-xl"], micro_batch=8)
    diag = memopt.diagnose_oom(torch.OutOfMemoryError("CUDA out of memory."), config=cfg, memory_bytes=16 * 2**30)
    assert diag.requested_bytes is None
    assert all(v == 0 for v in diag.fits.values())
    assert "no policy fits micro-batch 1" in str(diag) and "optimizer state alone take" in str(diag)


def _host_bound_xl() -> tuple[ModelConfig, int]:
    """GPT-2 XL, selective offloaded, with a host budget under its micro-batch 1 (and its host bytes)."""
    cfg = ModelConfig(**memopt.estimate_presets["gpt2-xl"], micro_batch=1, policy="selective", offload=True,
                      host_memory_bytes=2**30)
    # Offloaded per sequence: 48 layers x 1024 tokens x FusedCheckpointBlock's selective set (fp32).
    host = 48 * 1024 * memopt.block.saved_bytes_per_token("selective", 1600, 25, 6400, dtype=torch.float32)
    assert host > 2**30  # over the budget already at micro-batch 1
    return cfg, host


def test_estimate_fit_table_honours_the_host_budget(capsys):
    cfg, host = _host_bound_xl()
    argv = ["estimate", "--preset", "gpt2-xl", "--policy", "selective", "--offload", "--host-memory-gib", "1",
            "--memory-gib", "80"]
    out = run_json(capsys, *argv)
    row = out["fits"]["selective, offload"]
    assert row["max_micro_batch"] == 0  # was 64, whose offloaded activations need 64 x the budget-busting host
    assert row["max_seq_len"] == memopt.max_seq_len(80 * 2**30, cfg) > 0
    assert out["fits"]["selective"]["max_micro_batch"] == memopt.max_micro_batch(80 * 2**30, cfg, offload=False) > 0
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "policy selective, offload  max micro-batch   none" in text
    assert (f"policy selective, offload: even micro-batch 1 (seq 1024) needs {host / 2**30:.2f} GiB of host memory, "
            "over --host-memory-gib 1") in text


def test_diagnose_oom_honours_the_host_budget():
    cfg, host = _host_bound_xl()
    diag = memopt.diagnose_oom(torch.OutOfMemoryError("CUDA out of memory."), config=cfg, memory_bytes=80 * 2**30)
    assert diag.fits["selective, offload"] == 0 and diag.fits["checkpoint"] >= 1
    text = str(diag)
    assert "the estimate fits" not in text
    assert f"need {host / 2**30:.2f} GiB of host memory, over the host_memory_bytes budget of 1.00 GiB" in text
    assert "policy 'checkpoint' fits micro-batch 1" in text
    unbounded = memopt.diagnose_oom(torch.OutOfMemoryError("x"), config=cfg.replace(host_memory_bytes=None),
                                    memory_bytes=80 * 2**30)
    assert unbounded.fits["selective, offload"] >= 1 and "the estimate fits" in str(unbounded)


def test_diagnose_oom_without_config():
    diag = memopt.diagnose_oom(torch.OutOfMemoryError("CUDA out of memory."))
    assert "pass config=" in str(diag)


def test_bench_passes_arguments_through(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda argv: calls.append(argv) or 0)
    assert main(["bench", "--preset", "quick", "--json"]) == 0
    assert main(["bench", "--", "--help"]) == 0
    assert calls == [[sys.executable, "-m", "bench", "--preset", "quick", "--json"],
                     [sys.executable, "-m", "bench", "--help"]]


def test_bench_outside_a_checkout_says_where_to_run_it(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda argv: calls.append(argv) or 0)
    monkeypatch.chdir(tmp_path)
    # As an installed memopt sees it: no entry of sys.path holds the source tree's bench/.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "bench" / "__main__.py").exists()])
    assert main(["bench", "--help"]) == 2 and calls == []
    assert "run this from the root of a memopt checkout" in capsys.readouterr().err


LLAMA_MAX_SEQ = ["estimate", "--preset", "llama-3-8b", "--lora", "--memory-gib", "141", "--host-memory-gib", "128",
                 "--max-seq"]


def test_max_seq_per_strategy_json(capsys):
    from memopt.estimate import seq_len_limit, strategies

    out = run_json(capsys, *LLAMA_MAX_SEQ)
    cfg = ModelConfig(**memopt.estimate_presets["llama-3-8b"], micro_batch=1, lora_rank=8, host_memory_bytes=128 * 2**30)
    assert out["num_parameters"] == 8_030_261_248 + 3_407_872
    expected = strategies(cfg)
    assert list(out["max_seq"]) == list(expected)
    for name, row in out["max_seq"].items():
        limit = seq_len_limit(141 * 2**30, expected[name])
        assert (row["max_seq_len"], row["binding"]) == (limit.max_seq_len, limit.binding)
        assert row["total_bytes"] <= 141 * 2**30 and row["host_bytes"] <= 128 * 2**30
    assert out["max_seq"]["Hugging Face checkpointing"]["binding"] == "logits_loss"
    assert out["max_seq"]["memopt long-context"]["offload"] is True


def test_max_seq_table(capsys):
    assert main(LLAMA_MAX_SEQ) == 0
    text = capsys.readouterr().out
    assert "longest sequence (estimated" in text and "host memory 128 GiB" in text
    for name in ("no checkpointing", "Hugging Face checkpointing", "memopt selective", "memopt full", "memopt long-context"):
        assert name in text
    assert text.count("binds:") == 5


def test_max_seq_names_the_term_that_grows_and_says_when_fixed_terms_do_not_fit(capsys):
    """Full fine-tuning of Llama-3-8B: Adam's state is the largest term but does not grow with the
    sequence, so it never binds (it was named for every strategy in 80 GiB); in 40 GiB the fixed
    terms alone do not fit, and the table says so with their total."""
    argv = ["estimate", "--preset", "llama-3-8b", "--max-seq"]
    out = run_json(capsys, *argv, "--memory-gib", "80")
    bindings = {name: row["binding"] for name, row in out["max_seq"].items()}
    assert bindings == {"no checkpointing": "activations", "Hugging Face checkpointing": "logits_loss",
                        "memopt selective": "activations", "memopt full": "activations",
                        "memopt long-context": "workspace"}
    fixed = sum(out["breakdown"][k] for k in ("parameters", "gradients", "optimizer_state"))
    assert all(row["fixed_bytes"] == fixed for row in out["max_seq"].values())
    assert main([*argv, "--memory-gib", "40"]) == 0
    text = capsys.readouterr().out
    assert "optimizer_state\n" not in text and "binds: optimizer_state" not in text
    line = f"0 tokens   binds: fixed terms: parameters + gradients + optimizer_state (they do not grow with the " \
           f"sequence) need {fixed / 2**30:.2f} GiB alone, over 40 GiB"
    assert text.count(line) == 5


def test_diagnose_oom_tests_the_config_itself_when_fit_choices_do_not_offer_it():
    """policy "full" offloaded is not one of fit_choices(): its own estimate fits, and the advice
    was to switch to 'checkpoint'."""
    cfg = ModelConfig(**memopt.estimate_presets["gpt2"], micro_batch=8, policy="full", offload=True)
    memory = 40 * 2**30
    assert memopt.estimate(cfg).total_bytes <= memory
    diag = memopt.diagnose_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                               config=cfg, memory_bytes=memory)
    assert diag.suggestions[0].startswith("the estimate fits")
    assert not any("fits micro-batch 8" in s for s in diag.suggestions)
    assert diag.fits["full, offload"] == memopt.max_micro_batch(memory, cfg) >= 8


def test_diagnose_oom_reads_the_size_of_a_cpu_allocation_failure():
    with pytest.raises(RuntimeError) as failure:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator's "you tried to allocate N bytes"
    assert memopt.diagnose_oom(failure.value).requested_bytes == 2**50
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity ...")
    assert memopt.diagnose_oom(cuda).requested_bytes == 20 * 2**20


def test_fit_table_says_at_least_where_the_search_stopped(capsys):
    argv = ["estimate", "--preset", "gpt2", "--memory-gib", "1e30"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "max micro-batch" in line]
    assert rows and all(">= 1048576" in row and ">= 16777216" in row for row in rows)
    out = run_json(capsys, *argv)
    assert out["fits"]["eager"] == {"max_micro_batch": 1 << 20, "max_seq_len": 1 << 24}
    assert out["search_upper"] == {"max_micro_batch": 1 << 20, "max_seq_len": 1 << 24}
    assert main(["estimate", "--preset", "llama-3-8b", "--memory-gib", "1e9", "--max-seq"]) == 0
    assert ">= 16,777,216 tokens   binds: limit" in capsys.readouterr().out
