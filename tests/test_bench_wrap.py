"""bench.wrap: the cpu preset end to end (GPT-2 and Llama built from a config), planner rows within
their budgets, and a plan that breaks its budget flagged and failing the run."""

from __future__ import annotations

import json

import pytest

import memopt

pytest.importorskip("transformers")

from bench import model as bench_model  # noqa: E402
from bench import wrap as bench_wrap  # noqa: E402
from helpers import installed_triton_version  # noqa: E402

CONFIG_ROWS = ("plain", "hf-checkpoint", "hf-selective", "memopt-full", "memopt-selective")
TIMED_COLUMNS = (
    "step_time_ms_median",
    "step_time_ms_p20",
    "step_time_ms_p80",
    "tokens_per_s",
    "saved_bytes",
    "saved_vs_plain",
    "loss",
    "loss_rel_diff",
    "grad_max_abs_diff",
    "grad_max_rel_diff",
    "time_vs_hf",
    "time_vs_hf_selective",
)
# PyTorch's selective checkpointing shows what it saves to outer hooks only where its checkpoint
# takes respect_saved_tensors_hooks (torch 2.14); elsewhere the hf-selective row counts no bytes.
SAC_COUNTABLE = bench_model.sac_saved_bytes_countable()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_wrap") / "wrap.json"
    assert bench_wrap.main(["--preset", "cpu", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_cpu_preset_has_environment_header_and_every_column(cpu_run):
    assert cpu_run["kind"] == "wrap"
    for key in ("torch", "device_name", "commit", "date"):
        assert cpu_run["environment"][key], key
    assert cpu_run["environment"]["triton"] == installed_triton_version()
    assert cpu_run["arguments"]["preset"] == "cpu"
    assert cpu_run["columns"] == list(bench_wrap.ROW_COLUMNS)
    budgets = cpu_run["arguments"]["budgets"]
    expected = list(CONFIG_ROWS) + [f"plan-{b:.0%}" for b in budgets]
    for model in bench_wrap.MODELS:
        assert [r["config"] for r in cpu_run["rows"] if r["model"] == model] == expected
    for row in cpu_run["rows"]:
        assert set(row) == set(bench_wrap.ROW_COLUMNS)


def test_configuration_rows_are_measured_and_gradients_match_plain(cpu_run):
    for row in cpu_run["rows"]:
        if row["config"] not in CONFIG_ROWS:
            continue
        assert row["status"] == "ok", row
        uncounted = ("saved_bytes", "saved_vs_plain") if row["config"] == "hf-selective" and not SAC_COUNTABLE else ()
        for column in TIMED_COLUMNS:
            if column in uncounted:
                assert row[column] is None, (row["model"], row["config"], column)
                continue
            assert isinstance(row[column], float | int), (row["model"], row["config"], column)
        assert row["step_time_ms_p20"] <= row["step_time_ms_median"] <= row["step_time_ms_p80"]
        assert row["grad_check"] == ("reference" if row["config"] == "plain" else "ok"), row
        assert row["peak_gpu_bytes"] is None and row["peak_gpu_step_bytes"] is None
    by_key = {(r["model"], r["config"]): r for r in cpu_run["rows"]}
    for model in bench_wrap.MODELS:
        plain, hf = by_key[model, "plain"], by_key[model, "hf-checkpoint"]
        full, selective = by_key[model, "memopt-full"], by_key[model, "memopt-selective"]
        # Independent of the harness's arithmetic: checkpointing must save less than plain, and
        # memopt's "full" no more than Hugging Face's own checkpointing.
        assert full["saved_bytes"] <= hf["saved_bytes"] < selective["saved_bytes"] < plain["saved_bytes"]
        assert plain["policies"] == "n" * cpu_run["arguments"]["layers"]
        sac = by_key[model, "hf-selective"]
        assert sac["policies"] == "hf-sac" and sac["time_vs_hf_selective"] == 1.0
        if SAC_COUNTABLE:
            # PyTorch's selective checkpointing of the same op list: memopt's "selective" saves no more.
            assert hf["saved_bytes"] < sac["saved_bytes"] < plain["saved_bytes"]
            assert selective["saved_bytes"] <= sac["saved_bytes"]


def test_planner_rows_fit_their_budgets(cpu_run):
    plan_rows = [r for r in cpu_run["rows"] if r["config"].startswith("plan-")]
    fitted = [r for r in plan_rows if r["status"] == "ok"]
    assert all(r["status"] == "ok" or r["status"].startswith("infeasible") for r in plan_rows), plan_rows
    # At least the 50% and 75% budgets are reachable with "full" layers on these models.
    assert len(fitted) >= 2 * len(bench_wrap.MODELS)
    plain = {r["model"]: r["saved_bytes"] for r in cpu_run["rows"] if r["config"] == "plain"}
    for row in fitted:
        assert row["budget_bytes"] == int(row["budget_fraction"] * plain[row["model"]])
        assert row["saved_bytes"] <= row["budget_bytes"], row
        assert row["within_budget"] is True
        assert row["saved_bytes"] <= row["predicted_bytes"] <= row["budget_bytes"]
        assert len(row["policies"]) == cpu_run["arguments"]["layers"] and set(row["policies"]) <= set("nsf")
        assert row["grad_check"] == "ok"
        assert row["predicted_extra_ms"] >= 0 and isinstance(row["measured_extra_ms"], float)


def test_plan_over_budget_is_flagged_and_fails_the_run(tmp_path, monkeypatch):
    real_plan = memopt.plan

    def ignores_budget(model, inputs, budget_bytes, **kwargs):
        chosen = real_plan(model, inputs, budget_bytes, **kwargs)
        chosen.policies = ["none"] * len(chosen.policies)
        return chosen

    monkeypatch.setattr(memopt, "plan", ignores_budget)
    out = tmp_path / "over.json"
    argv = ["--preset", "cpu", "--models", "llama", "--layers", "2", "--repeats", "1", "--budgets", "0.5", "--out", str(out)]
    with pytest.raises(AssertionError, match="exceed the plan's budget"):
        bench_wrap.main(argv)
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["config"] == "plan-50%"]
    assert row["within_budget"] is False and row["policies"] == "nn"
    assert "OVER BUDGET" in bench_wrap.markdown_table([row])


def test_gradient_difference_is_flagged(monkeypatch):
    settings = bench_wrap.replace(bench_wrap.PRESETS["cpu"], layers=2, repeats=1, warmup=0)
    model = bench_wrap.build_model("llama", settings, bench_wrap.resolve_device("cpu"))
    runner = bench_wrap.Runner("llama", model, settings, bench_wrap.resolve_device("cpu"))
    nothing = lambda: None  # noqa: E731
    assert runner.configured("plain", nothing, nothing)["grad_check"] == "reference"
    weight = model.lm_head.weight
    handles = []
    faulty = runner.configured(
        "faulty",
        lambda: handles.append(weight.register_hook(lambda g: g * 1.05)),
        lambda: handles.pop().remove(),
    )
    assert faulty["grad_check"] == "MISMATCH"
    assert faulty["grad_max_rel_diff"] == pytest.approx(0.05, rel=1e-3)


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench_wrap.main(["--models", "bert"])
    assert "--models" in capsys.readouterr().err


def test_infeasible_and_failing_plans_become_rows(monkeypatch):
    settings = bench_wrap.replace(bench_wrap.PRESETS["cpu"], layers=2, repeats=1, warmup=0)
    device = bench_wrap.resolve_device("cpu")
    runner = bench_wrap.Runner("gpt2", bench_wrap.build_model("gpt2", settings, device), settings, device)
    plain_saved = runner.saved_bytes()
    infeasible = runner.plan_row(0.001, plain_saved, None)
    assert infeasible["status"].startswith("infeasible"), infeasible
    assert infeasible["budget_bytes"] == int(0.001 * plain_saved) and infeasible["saved_bytes"] is None

    def broken(*args, **kwargs):
        raise RuntimeError("planner broke")

    monkeypatch.setattr(memopt, "plan", broken)
    failed = runner.plan_row(0.5, plain_saved, None)
    assert failed["status"] == "error (RuntimeError: planner broke)"
    assert "error (RuntimeError: planner broke)" in bench_wrap.markdown_table([failed])


def test_hf_selective_counts_no_bytes_where_torch_hides_them(monkeypatch):
    """On a torch whose checkpoint cannot show selective checkpointing's saved tensors to outer
    hooks (2.11-2.13), the hf-selective row is timed and checked but reports no saved bytes."""
    monkeypatch.setattr(bench_model, "sac_saved_bytes_countable", lambda: False)
    assert "respect_saved_tensors_hooks" not in bench_model.selective_checkpoint_kwargs()
    settings = bench_wrap.replace(bench_wrap.PRESETS["cpu"], layers=2, repeats=1, warmup=0, budgets=())
    device = bench_wrap.resolve_device("cpu")
    rows = bench_wrap.Runner("llama", bench_wrap.build_model("llama", settings, device), settings, device).run()
    (sac,) = [r for r in rows if r["config"] == "hf-selective"]
    assert sac["status"] == "ok" and sac["grad_check"] == "ok", sac
    assert sac["saved_bytes"] is None and sac["saved_vs_plain"] is None
    assert sac["step_time_ms_median"] > 0 and sac["time_vs_hf_selective"] == 1.0


def test_lora_rows_train_only_the_adapters_and_match_plain(tmp_path):
    """--lora-rank: every configuration of a PEFT LoRA model (the base and its LM head frozen)
    runs, with plain's loss and adapter gradients; checkpointing still saves less than plain."""
    pytest.importorskip("peft")
    out = tmp_path / "wrap.json"
    assert bench_wrap.main(["--preset", "cpu", "--models", "llama", "--lora-rank", "4", "--budgets", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arguments"]["lora_rank"] == 4
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == [*CONFIG_ROWS, "plan-50%"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["grad_check"] in ("reference", "ok"), row
    assert rows["memopt-full"]["saved_bytes"] <= rows["hf-checkpoint"]["saved_bytes"] < rows["plain"]["saved_bytes"]
    model = bench_wrap.build_model("llama", bench_wrap.Settings(lora_rank=4), bench_wrap.resolve_device("cpu"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
