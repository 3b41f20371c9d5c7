"""The benchmark harness: end-to-end on the tiny CPU preset, gradient flagging, unavailable and
failing configurations, memory accounting, plots."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import memopt
from bench import compare, configs, plot
from bench.memory import LiveTensorTracker
from bench.model import LayerStack, gpt_block
from helpers import MemoptOpCalls, gpu, installed_triton_version

TINY = replace(compare.PRESETS["tiny"], device="cpu")
METRIC_COLUMNS = (
    "step_time_ms_median",
    "step_time_ms_p20",
    "step_time_ms_p80",
    "tokens_per_s",
    "activation_bytes",
    "saved_bytes",
    "step_peak_tracked_bytes",
    "grad_max_abs_diff",
    "grad_max_rel_diff",
    "time_vs_checkpoint",
    "time_vs_eager",
    "memory_vs_checkpoint",
)


def registry_config(name: str) -> configs.BenchConfig:
    return next(c for c in configs.default_configs() if c.name == name)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert compare.main(["--preset", "tiny", "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
    (json_path,) = out.glob("compare-tiny-cpu-*.json")
    return json.loads(json_path.read_text()), json_path


def test_tiny_run_has_every_column_for_every_configuration(tiny_run):
    result, _ = tiny_run
    assert result["kind"] == "compare"
    for key in ("torch", "device_name", "commit", "date", "memopt_build"):
        assert result["environment"][key], key
    assert result["environment"]["triton"] == installed_triton_version()
    # a CPU result says which CPU: ratios differ between AVX2 and AVX-512 hosts, and with the caches
    env = result["environment"]
    assert isinstance(env["cpu_model"], str) and env["cpu_model"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["cpu_linear"] in ("onednn", "aten")  # and which GEMM memopt's linears ran on
    if platform.system() == "Linux" and Path("/sys/devices/system/cpu/cpu0/cache").is_dir():
        assert env["cpu_caches"] and all(re.fullmatch(r"\d+[KMG]", size) for size in env["cpu_caches"].values())
    assert result["arguments"]["preset"] == "tiny"
    names = [r["config"] for r in result["rows"]]
    assert names == configs.config_names()
    for row in result["rows"]:
        assert set(row) == set(compare.ROW_COLUMNS) == set(result["columns"])
        assert row["status"] == "ok" or row["status"].startswith(("not available (", "error (")), row
    by_name = {r["config"]: r for r in result["rows"]}
    for name in ("eager-math", "eager-sdpa", "torch-checkpoint", "torch-selective"):
        row = by_name[name]
        assert row["status"] == "ok", row
        for column in METRIC_COLUMNS:
            assert isinstance(row[column], float | int), (name, column, row[column])
        assert row["step_time_ms_p20"] <= row["step_time_ms_median"] <= row["step_time_ms_p80"]
        assert row["grad_check"] in ("ok", "reference"), row
    assert by_name["eager-math"]["grad_check"] == "reference"
    assert by_name["torch-checkpoint"]["time_vs_checkpoint"] == pytest.approx(1.0)
    assert by_name["eager-sdpa"]["time_vs_eager"] == pytest.approx(1.0)
    for row in result["rows"]:
        if row["status"] == "ok":
            assert len(row["step_times_ms"]) == row["steps_timed"]
            assert min(row["step_times_ms"]) <= row["step_time_ms_median"] <= max(row["step_times_ms"])
    # Checkpointing must hold less for backward than the eager stack does.
    assert by_name["torch-checkpoint"]["activation_bytes"] < by_name["torch-selective"]["activation_bytes"]
    assert by_name["torch-selective"]["activation_bytes"] < by_name["eager-sdpa"]["activation_bytes"]


def test_time_ratios_pair_the_steps_of_one_round_when_interleaved():
    """Interleaved rounds: the ratio is the median of the per-round ratios (a slow round slows
    both rows and divides out); otherwise the ratio of the medians."""
    def row(name, times):
        ordered = sorted(times)
        return {"config": name, "step_times_ms": times, "step_time_ms_median": ordered[len(times) // 2],
                "peak_gpu_bytes": None, "activation_bytes": 1, "time_vs_eager": None,
                "time_vs_checkpoint": None, "memory_vs_checkpoint": None}

    # round 2 ran in a slow spell of the machine (every row 3x slower)
    eager = row("eager-sdpa", [10.0, 30.0, 10.0])
    ckpt = row("torch-checkpoint", [13.0, 39.0, 13.0])
    memopt_row = row("memopt-full", [12.0, 36.0, 12.5])
    rows = [eager, ckpt, memopt_row]
    compare.add_ratios(rows, paired=True)
    per_round = sorted([12 / 13, 36 / 39, 12.5 / 13])
    assert memopt_row["time_vs_checkpoint"] == pytest.approx(per_round[1])
    assert memopt_row["time_vs_eager"] == pytest.approx(sorted([1.2, 1.2, 1.25])[1])
    assert ckpt["time_vs_checkpoint"] == eager["time_vs_eager"] == 1.0
    # the spread of the per-round ratios: p20 and p80 by linear interpolation over the 3 rounds
    low, high = per_round[0] + 0.4 * (per_round[1] - per_round[0]), per_round[1] + 0.6 * (per_round[2] - per_round[1])
    assert memopt_row["time_vs_checkpoint_p20"] == pytest.approx(low)
    assert memopt_row["time_vs_checkpoint_p80"] == pytest.approx(high)
    assert f"| {per_round[1]:.2f} ({low:.2f}-{high:.2f}) |" in compare.markdown_table(
        [{**r, "status": "ok", "step_time_ms_p20": 1.0, "step_time_ms_p80": 1.0, "tokens_per_s": 1.0, "saved_bytes": 1,
          "activation_host_bytes": None, "grad_max_rel_diff": None, "grad_check": "n/a"} for r in rows]
    )
    compare.add_ratios(rows, paired=False)
    assert memopt_row["time_vs_checkpoint"] == pytest.approx(12.5 / 13)  # medians 12.5 and 13
    assert memopt_row["time_vs_checkpoint_p20"] is None and memopt_row["time_vs_checkpoint_p80"] is None


def test_tiny_run_writes_a_plot_and_plot_module_redraws_it(tiny_run, tmp_path):
    _, json_path = tiny_run
    assert json_path.with_suffix(".png").stat().st_size > 1000
    redrawn = tmp_path / "again.png"
    assert plot.plot_file(json_path, redrawn) == [redrawn]
    assert redrawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unavailable_configurations_are_listed_with_their_reason():
    wanted = ["eager-math", "torch-compile", "memopt-compile", "memopt-offload"]
    rows = compare.run_comparison(TINY, [registry_config(n) for n in wanted], progress=False)
    status = {r["config"]: r["status"] for r in rows}
    assert [r["config"] for r in rows] == wanted
    assert status["eager-math"] == "ok"
    assert status["torch-compile"].startswith("not available (torch.compile not requested")
    assert status["memopt-compile"].startswith("not available (torch.compile not requested")
    assert status["memopt-offload"].startswith("not available (offload moves activations from GPU to host memory")
    table = compare.markdown_table(rows)
    for name in wanted:
        assert f"| {name} |" in table


class GradientScaler(nn.Module):
    """Wraps a model and multiplies the gradient of its first parameter: a wrong configuration."""

    def __init__(self, model: nn.Module, factor: float):
        super().__init__()
        self.inner = model
        next(model.parameters()).register_hook(lambda g: g * factor)

    def forward(self, x):
        return self.inner(x)


def test_gradient_mismatch_is_flagged_not_dropped():
    sdpa = registry_config("eager-sdpa")
    faulty = replace(sdpa, name="faulty", build=lambda ctx: GradientScaler(sdpa.build(ctx), 1.01))
    rows = compare.run_comparison(TINY, [registry_config("eager-math"), faulty, sdpa], progress=False)
    by_name = {r["config"]: r for r in rows}
    assert by_name["faulty"]["status"] == "ok"
    assert by_name["faulty"]["grad_check"] == "MISMATCH"
    assert by_name["faulty"]["grad_max_rel_diff"] == pytest.approx(0.01, rel=1e-2)
    assert by_name["eager-sdpa"]["grad_check"] == "ok"
    assert "| faulty |" in compare.markdown_table(rows) and "MISMATCH" in compare.markdown_table(rows)


def test_low_precision_runs_check_against_float32_with_twice_the_eager_error():
    sdpa = registry_config("eager-sdpa")
    faulty = replace(sdpa, name="faulty", build=lambda ctx: GradientScaler(sdpa.build(ctx), 1.1))
    settings = replace(TINY, dtype="bfloat16")
    rows = compare.run_comparison(settings, [registry_config("eager-math"), sdpa, faulty], progress=False)
    reference, ok, bad = rows
    assert reference["grad_check"] == "reference" and reference["grad_reference"] == "eager-math in float32"
    # bf16 rounding makes eager-math itself differ from float32; the tolerance is twice that.
    assert 0 < reference["grad_max_rel_diff"]
    assert reference["grad_rtol"] == pytest.approx(max(2 * reference["grad_max_rel_diff"], compare.GRAD_RTOL_FLOOR[torch.bfloat16]))
    assert ok["grad_check"] == "ok"
    assert bad["grad_check"] == "MISMATCH" and bad["grad_max_rel_diff"] > 0.05


def test_a_failing_configuration_becomes_an_error_row():
    def broken(ctx):
        raise RuntimeError("kernel exploded")

    bad = configs.BenchConfig("broken", "memopt", "raises on build", broken)
    rows = compare.run_comparison(TINY, [registry_config("eager-math"), bad], progress=False)
    assert rows[1]["status"] == "error (RuntimeError: kernel exploded)"
    assert rows[1]["step_time_ms_median"] is None and rows[1]["grad_check"] == "n/a"


def test_sweep_writes_one_row_per_value_and_config(tmp_path):
    argv = ["--preset", "tiny", "--device", "cpu", "--sweep", "layers", "--sweep-values", "1,2"]
    argv += ["--configs", "eager-sdpa,torch-checkpoint", "--out", str(tmp_path), "--no-progress"]
    assert compare.main(argv) == 0
    (json_path,) = tmp_path.glob("sweep-layers-tiny-cpu-*.json")
    result = json.loads(json_path.read_text())
    assert [(r["config"], r["x"]) for r in result["rows"]] == [
        ("eager-sdpa", 1),
        ("torch-checkpoint", 1),
        ("eager-sdpa", 2),
        ("torch-checkpoint", 2),
    ]
    eager = {r["x"]: r["activation_bytes"] for r in result["rows"] if r["config"] == "eager-sdpa"}
    assert eager[2] > eager[1]
    assert json_path.with_suffix(".png").exists()


def test_live_tensor_tracker_counts_what_forward_leaves_for_backward():
    batch, width = 8, 16
    model = nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU(), nn.Linear(width, width, bias=False))
    x = torch.randn(batch, width)
    one_activation = batch * width * 4
    with LiveTensorTracker(exclude=[*model.parameters(), x]) as tracker:
        out = model(x)
        # The first matmul's output dies (ReLU saves its result); the ReLU output (saved by the
        # second Linear) and the returned output stay.
        assert tracker.live_bytes("cpu") == 2 * one_activation
        out.sum().backward()
    with LiveTensorTracker(exclude=[*model.parameters(), x]) as tracker:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        assert tracker.live_bytes("cpu") == one_activation
        assert tracker.peak_bytes("cpu") >= 2 * one_activation


def test_layer_stack_checkpoint_modes_match_eager_gradients():
    blocks = [gpt_block(32, 2, 64, dropout=0.0, attention="sdpa") for _ in range(2)]
    x = torch.randn(2, 8, 32)
    grads = {}
    for mode in ("none", "full", "selective"):
        stack = LayerStack(list(blocks), mode)
        stack.zero_grad(set_to_none=True)
        compare.loss_fn(stack(x)).backward()
        grads[mode] = [p.grad.clone() for p in stack.parameters()]
    for mode in ("full", "selective"):
        for got, want in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_math_and_sdpa_attention_agree_with_float64_reference():
    block = gpt_block(32, 4, 64, dropout=0.0, attention="math").double()
    sdpa = gpt_block(32, 4, 64, dropout=0.0, attention="sdpa").double()
    sdpa.load_state_dict(block.state_dict())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    # Causality: changing the last position must not change earlier outputs.
    y = block(x)
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(block(x2)[:, :-1], y[:, :-1])
    torch.testing.assert_close(sdpa(x), y)


def test_eager_state_dict_loads_into_the_fused_block_as_is():
    """The harness initialises every configuration from one eager state dict."""
    eager = gpt_block(32, 2, 64).double().eval()
    fused = memopt.FusedCheckpointBlock(32, 2, 64, causal=True, policy="none").double().eval()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    torch.testing.assert_close(fused(x), eager(x), rtol=1e-10, atol=1e-10)


def test_quantile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert compare.quantile(values, 0.5) == 3.0
    assert compare.quantile(values, 0.2) == pytest.approx(1.8)
    assert compare.quantile(values, 0.8) == pytest.approx(4.2)


def test_unknown_config_name_is_rejected():
    with pytest.raises(SystemExit, match="unknown names \\['nope'\\]"):
        compare.select_configs("eager-math,nope")


def test_kernel_benchmarks_run_on_tiny_shapes_and_list_missing_ops(tmp_path, monkeypatch):
    from bench import kernels

    monkeypatch.delattr(memopt, "layer_norm", raising=False)
    argv = ["--preset", "tiny", "--device", "cpu", "--ops", "dropout_add,layer_norm", "--out", str(tmp_path), "--no-progress"]
    assert kernels.main(argv) == 0
    (json_path,) = tmp_path.glob("kernels-tiny-cpu-*.json")
    result = json.loads(json_path.read_text())
    rows = {(r["op"], r["provider"], r["metric"]): r for r in result["rows"]}
    for key in ("op", "provider", "mode", "metric", "unit", "x", "median", "p20", "p80", "device", "versions", "commit", "date"):
        assert all(key in r for r in result["rows"]), key
    for provider in ("memopt", "eager"):
        timing = rows[("dropout_add", provider, "time_fwd_bwd")]
        assert timing["status"] == "ok" and timing["p20"] <= timing["median"] <= timing["p80"]
        assert rows[("dropout_add", provider, "bandwidth")]["median"] > 0
        # minor page faults per timed step: a count, its quantiles in order
        faults = rows[("dropout_add", provider, "page_faults")]
        assert faults["unit"] == "faults/step" and 0 <= faults["p20"] <= faults["median"] <= faults["p80"]
    # memopt keeps the 16-byte RNG key where eager dropout keeps a mask: bool on CUDA, x's
    # dtype (float32) on CPU, where F.dropout multiplies by a Bernoulli tensor.
    assert rows[("dropout_add", "memopt", "saved_bytes")]["median"] == 16
    assert rows[("dropout_add", "eager", "saved_bytes")]["median"] in (64 * 128, 64 * 128 * 4)
    assert rows[("layer_norm", "memopt", "time_fwd_bwd")]["status"] == "not available (memopt.layer_norm is not in this build of memopt yet)"
    assert rows[("dropout_add", "compile", "time_fwd_bwd")]["status"].startswith("not available (torch.compile not requested")
    assert json_path.with_suffix(".png").exists()


def test_kernel_benchmarks_time_eager_when_memopt_fails(monkeypatch):
    """A case one provider does not take (bf16 on memopt's CPU kernels raises) is an error row for
    that provider alone: eager is still timed, and no ratio is made up."""
    from bench import kernels

    def exploding(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(memopt, "layer_norm", exploding)
    settings = replace(kernels.KERNEL_PRESETS["tiny"], device="cpu")
    result = kernels.run_kernels(settings, ["layer_norm"], progress=False)
    rows = {(r["provider"], r["metric"]): r for r in result["rows"]}
    assert rows[("memopt", "time_fwd_bwd")]["status"] == "error (RuntimeError: kernel exploded)"
    assert rows[("memopt", "time_fwd_bwd")]["median"] is None
    eager = rows[("eager", "time_fwd_bwd")]
    assert eager["status"] == "ok" and 0 < eager["p20"] <= eager["median"] <= eager["p80"]
    assert ("memopt", "time_vs_eager") not in rows and ("memopt", "saved_bytes") not in rows


def test_kernel_benchmarks_with_frozen_params_ask_for_no_parameter_gradient():
    """--frozen-params: only each op's input requires grad, so memopt's backward kernels are not
    asked for a parameter gradient (and eager's skip theirs); every case still runs."""
    from bench import kernels

    settings = replace(kernels.KERNEL_PRESETS["tiny"], device="cpu", frozen_params=True)
    with MemoptOpCalls("_bwd") as calls:
        result = kernels.run_kernels(settings, ["layer_norm", "norm_linear", "bias_gelu", "act_linear_gelu"], progress=False)
    assert result["arguments"]["frozen_params"] is True
    timings = [r for r in result["rows"] if r["metric"] == "time_fwd_bwd" and r["provider"] != "compile"]
    assert len(timings) == 8 and all(r["status"] == "ok" for r in timings)
    asked = [(name, call[name]) for call in calls.calls for name in ("return_grad_weight", "return_grad_bias") if name in call]
    assert {name for name, _ in asked} == {"return_grad_weight", "return_grad_bias"}
    assert not any(wanted for _, wanted in asked), asked


def test_memopt_configurations_build_from_the_reference_weights():
    wanted = ["eager-math", "memopt-selective", "memopt-full", "memopt-offload", "memopt-wrap"]
    rows = compare.run_comparison(TINY, [registry_config(n) for n in wanted], progress=False)
    by_name = {r["config"]: r for r in rows}
    for name in ("memopt-selective", "memopt-full", "memopt-wrap"):
        assert by_name[name]["status"] == "ok", by_name[name]
        # Same weights, same batch, same math: the harness's gradient check holds.
        assert by_name[name]["grad_check"] == "ok", by_name[name]
    assert by_name["memopt-offload"]["status"].startswith("not available (offload moves activations")


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_run_on_cuda_measures_peak_memory_and_checks_gradients(dtype):
    settings = replace(TINY, device="cuda", dtype=dtype, threads=None)
    wanted = ["eager-math", "eager-sdpa", "torch-checkpoint", "torch-selective"]
    rows = compare.run_comparison(settings, [registry_config(n) for n in wanted], progress=False)
    by_name = {r["config"]: r for r in rows}
    for name in wanted:
        row = by_name[name]
        assert row["status"] == "ok", row
        assert row["device"].startswith("cuda") and row["peak_gpu_bytes"] > 0
        # Only scalars stay on the host (SDPA's dropout RNG seed and offset), no activations.
        assert row["activation_bytes"] > 0 and row["activation_host_bytes"] < 1024
        assert row["grad_check"] in ("ok", "reference"), row
    assert by_name["torch-checkpoint"]["activation_bytes"] < by_name["eager-sdpa"]["activation_bytes"]
    assert by_name["torch-checkpoint"]["memory_vs_checkpoint"] == pytest.approx(1.0)


@gpu
def test_kernel_benchmarks_run_on_cuda(tmp_path):
    from bench import kernels

    settings = replace(kernels.KERNEL_PRESETS["tiny"], device="cuda", dtype="bfloat16", threads=None)
    result = kernels.run_kernels(settings, ["dropout_add"], progress=False)
    rows = {(r["provider"], r["metric"]): r for r in result["rows"]}
    for provider in ("memopt", "eager"):
        assert rows[(provider, "time_fwd_bwd")]["status"] == "ok"
        assert rows[(provider, "time_fwd_bwd")]["median"] > 0
    assert rows[("memopt", "saved_bytes")]["median"] == 16


# -- bench.profile ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, want",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "matmul"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>", "attention"),
        ("_attn_bwd_dkdv_kernel", "attention"),
        ("void memopt::(anonymous namespace)::norm_fwd_cuda_kernel<c10::BFloat16, true>(...)", "norm"),
        ("void memopt::(anonymous namespace)::bias_act_bwd_cuda_kernel<c10::BFloat16>(...)", "activation"),
        ("void memopt::(anonymous namespace)::dropout_add_cuda_kernel<c10::BFloat16>(...)", "dropout"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1>>", "elementwise"),
        ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>", "copy"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<foreach_sgd>", "optimizer"),
        ("aten::addmm", "matmul"),
        ("aten::add_", "elementwise"),
        ("aten::_softmax", "softmax/mask"),
        ("something_new", "other"),
    ],
)
def test_profile_categories(name, want):
    from bench import profile

    assert profile.category(name) == want


def test_profile_tiny_run_writes_categories_that_add_up(tmp_path, capsys):
    from bench import profile

    out = tmp_path / "profile.json"
    rc = profile.main(["--preset", "tiny", "--configs", "eager-sdpa,memopt-selective,memopt-offload",
                       "--steps", "1", "--warmup", "1", "--top", "5", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["environment"]["torch"] == torch.__version__
    for name in ("eager-sdpa", "memopt-selective"):
        config = result["configs"][name]
        assert config["status"] == "ok" and 0 < len(config["top"]) <= 5
        assert sum(config["ms_per_step_by_category"].values()) == pytest.approx(config["total_ms_per_step"])
        assert config["total_ms_per_step"] > 0
    assert result["configs"]["memopt-offload"]["status"].startswith("not available")
    table = capsys.readouterr().out
    assert "| ms per step | eager-sdpa | memopt-selective |" in table and "memopt-offload: not available" in table
    with pytest.raises(SystemExit) as exc:
        profile.main(["--preset", "tiny", "--configs", "nope", "--out", str(out)])
    assert exc.value.code == 2 and "argument --configs: unknown names ['nope']" in capsys.readouterr().err


@gpu
def test_profile_on_cuda_times_kernels(tmp_path):
    from bench import profile

    out = tmp_path / "profile.json"
    rc = profile.main(["--preset", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--configs",
                       "eager-sdpa,memopt-selective", "--steps", "2", "--out", str(out)])
    assert rc == 0
    for config in json.loads(out.read_text())["configs"].values():
        assert config["status"] == "ok" and config["timed"] == "CUDA kernel device time"
        assert config["ms_per_step_by_category"].get("matmul", 0) > 0
        assert config["ms_per_step_by_category"].get("attention", 0) > 0


def test_cpu_clock_ignores_time_spent_off_the_cpu():
    import time

    wall = compare.StepTimer(torch.device("cpu"))(lambda: time.sleep(0.2))
    cpu = compare.StepTimer(torch.device("cpu"), clock="cpu")(lambda: time.sleep(0.2))
    assert wall >= 0.2 and cpu < 0.05


def test_sdpa_backends_put_the_fastest_first_and_keep_math_last():
    backends = compare.sdpa_backends(torch.device("cpu"))
    assert backends[0] == torch.nn.attention.SDPBackend.FLASH_ATTENTION
    assert backends[-1] == torch.nn.attention.SDPBackend.MATH


def test_results_name_the_commit_given_in_memopt_commit(monkeypatch):
    # The GPU machine's copy of the tree can carry a stale .git: the commit bench/device_check.sh
    # is told wins over it, in every results file's environment.
    monkeypatch.setenv("MEMOPT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert compare.git_commit() == "0123456789abcdef0123456789abcdef01234567"
    assert compare.environment(torch.device("cpu"))["commit"] == "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("MEMOPT_COMMIT", "")  # empty: not given, git's answer (or "unknown")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(compare.__file__).parent, capture_output=True, text=True)
    assert compare.git_commit().removesuffix("-dirty") == (head.stdout.strip() if head.returncode == 0 else "unknown")


# Bad arguments to every bench tool: argparse's exit code 2 and one "error:" line naming the
# option, before anything runs (no traceback, no run of nonsense sizes).
BAD_ARGUMENTS = [
    ("bench.compare", ["--seq", "-4"], "--seq"),
    ("bench.compare", ["--device", "foo"], "--device"),
    ("bench.compare", ["--sweep", "layers", "--sweep-values", "1,x"], "--sweep-values"),
    ("bench.compare", ["--sweep-values", "1,2"], "--sweep-values"),
    ("bench.compare", ["--repeats", "-1"], "--repeats"),
    ("bench.compare", ["--layers", "0"], "--layers"),
    ("bench.compare", ["--dropout", "1.5"], "--dropout"),
    ("bench.compare", ["--max-config-seconds", "nan"], "--max-config-seconds"),
    ("bench.compare", ["--configs", "bogus"], "--configs"),
    ("bench.attention", ["--seqs", "x"], "--seqs"),
    ("bench.attention", ["--seqs", "-8", "--dropouts", "0.0"], "--seqs"),
    ("bench.attention", ["--dropouts", "x"], "--dropouts"),
    ("bench.attention", ["--head-dims", "0"], "--head-dims"),
    ("bench.cross_entropy", ["--preset", "tiny", "--tokens", "x"], "--tokens"),
    ("bench.cross_entropy", ["--preset", "tiny", "--vocab", "-3"], "--vocab"),
    ("bench.cross_entropy", ["--preset", "tiny", "--chunk-tokens", "0"], "--chunk-tokens"),
    ("bench.cross_entropy", ["--preset", "tiny", "--device", "foo"], "--device"),
    ("bench.census", ["--preset", "tiny", "--layers", "-1"], "--layers"),
    ("bench.census", ["--preset", "tiny", "--configs", "eager-sdpa,bogus"], "--configs"),
    ("bench.census", ["--preset", "tiny", "--dtype", "bfloat16"], "--dtype"),
    ("bench.profile", ["--preset", "tiny", "--configs", "bogus"], "--configs"),
    ("bench.profile", ["--preset", "tiny", "--steps", "0"], "--steps"),
    ("bench.wrap", ["--budgets", "x"], "--budgets"),
    ("bench.wrap", ["--models", "llama", "--layers", "-2"], "--layers"),
    ("bench.wrap", ["--repeats", "0"], "--repeats"),
    ("bench.kernels", ["--preset", "tiny", "--repeats", "0"], "--repeats"),
    ("bench.kernels", ["--preset", "tiny", "--ops", "bogus"], "--ops"),
    ("bench.kernels", ["--preset", "tiny", "--shapes", "64x"], "--shapes"),
    ("bench.long_context", ["--preset", "tiny", "--seqs", "1,64"], "--seqs"),
    ("bench.long_context", ["--preset", "tiny", "--seqs", "x"], "--seqs"),
    ("bench.offload", ["--preset", "nope"], "--preset"),
    ("bench.inference", ["--preset", "tiny", "--model-modes", "eval,serve"], "--model-modes"),
    ("bench.inference", ["--preset", "tiny", "--grad-modes", "enable_grad"], "--grad-modes"),
    ("bench.inference", ["--preset", "tiny", "--repeats", "0"], "--repeats"),
]


def assert_exits_naming(call, capsys, *names):
    with pytest.raises(SystemExit) as exc:
        call()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last and all(name in last for name in names), last


@pytest.mark.parametrize("module_name, argv, option", BAD_ARGUMENTS, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_arguments_exit_2_naming_the_option(module_name, argv, option, capsys, tmp_path):
    module = importlib.import_module(module_name)
    assert_exits_naming(lambda: module.main(argv + ["--out", str(tmp_path / "out.json")]), capsys, option)


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


# One valid argument set per tool, each at the edge of what is accepted, and what it parses to.
VALID_ARGUMENTS = [
    ("bench.compare", ["--preset", "tiny", "--device", "cuda:1", "--seq", "8", "--warmup", "0", "--threads", "0",
                       "--seed", "-1", "--dropout", "0", "--max-config-seconds", "0", "--configs", "eager-math,memopt-full",
                       "--sweep", "seq", "--sweep-values", "8,16", "--out", "x.json"],
     {"seq": 8, "warmup": 0, "threads": 0, "seed": -1, "dropout": 0.0, "sweep_values": (8, 16), "device": "cuda:1",
      "configs": "eager-math,memopt-full"}),
    ("bench.attention", ["--preset", "h200", "--seqs", "4096", "--dropouts", "0,0.1", "--head-dims", "128", "--out", "a.json"],
     {"seqs": (4096,), "dropouts": (0.0, 0.1), "head_dims": (128,)}),
    ("bench.cross_entropy", ["--preset", "tiny", "--device", "cpu", "--tokens", "64,97", "--dim", "16", "--vocab", "1003",
                             "--chunk-tokens", "16", "--repeats", "1", "--out", "ce.json"],
     {"tokens": (64, 97), "vocab": 1003, "chunk_tokens": 16, "device": "cpu"}),
    ("bench.census", ["--preset", "tiny", "--configs", "eager-sdpa,memopt-full", "--layers", "1", "--dropout", "0.1"],
     {"layers": 1, "dropout": 0.1}),
    ("bench.profile", ["--preset", "tiny", "--device", "auto", "--steps", "1", "--warmup", "0", "--top", "5"],
     {"steps": 1, "warmup": 0, "top": 5, "device": "auto"}),
    ("bench.wrap", ["--models", "llama", "--layers", "2", "--kv-heads", "1", "--budgets", "0.25,0.5", "--warmup", "0"],
     {"layers": 2, "budgets": (0.25, 0.5), "warmup": 0}),
    ("bench.kernels", ["--preset", "tiny", "--ops", "dropout_add", "--shapes", "64x128", "--repeats", "1", "--threads", "0"],
     {"repeats": 1, "threads": 0}),
    ("bench.long_context", ["--preset", "tiny", "--device", "cpu", "--seqs", "64,128"], {"seqs": (64, 128)}),
    ("bench.offload", ["--preset", "cpu", "--out", "o.json"], {"preset": "cpu"}),
    ("bench.inference", ["--preset", "tiny", "--model-modes", "train", "--grad-modes", "inference_mode,no_grad",
                         "--no-causal", "--warmup", "0", "--out", "i.json"],
     {"model_modes": ("train",), "grad_modes": ("inference_mode", "no_grad"), "causal": False, "warmup": 0}),
    ("bench.plot", ["a.json", "b.json"], {"files": [Path("a.json"), Path("b.json")]}),
]


@pytest.mark.parametrize("module_name, argv, want", VALID_ARGUMENTS, ids=[case[0] for case in VALID_ARGUMENTS])
def test_valid_arguments_still_parse(module_name, argv, want, monkeypatch):
    module = importlib.import_module(module_name)
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real_parse_args(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed) as parsed:
            module.main(argv)
    assert {k: getattr(parsed.value.namespace, k) for k in want} == want
    if hasattr(module, "parse_args"):  # the checks after parsing pass too
        module.parse_args(argv)


def test_plot_refuses_files_it_cannot_plot_naming_the_kinds_it_can(tmp_path, capsys):
    rows = tmp_path / "attention_cpu.json"  # bench.attention and bench.offload write a bare list
    rows.write_text(json.dumps([{"name": "attention", "median": 1.0}]))
    census = tmp_path / "census.json"
    census.write_text(json.dumps({"kind": "census", "configs": {}}))
    text = tmp_path / "notes.json"
    text.write_text("not json")
    for path, words in ((rows, ("JSON list",)), (census, ("'census'",)), (text, ("not JSON",)),
                        (tmp_path / "missing.json", ("cannot read",))):
        assert_exits_naming(lambda: plot.main([str(path)]), capsys, str(path), *words, "compare, kernels, long_context")


def test_out_may_name_a_json_file_or_a_folder(tmp_path):
    result = {"kind": "cross_entropy", "rows": []}
    assert compare.write_results(result, tmp_path / "x.json", "stem") == tmp_path / "x.json"
    assert json.loads((tmp_path / "x.json").read_text()) == result
    assert compare.write_results(result, tmp_path / "folder", "stem") == tmp_path / "folder" / "stem.json"
    assert (tmp_path / "folder" / "stem.json").is_file()
