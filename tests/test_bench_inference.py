"""bench.inference: forward-only rows for every configuration, model mode and grad mode; nothing
saved without a graph; eval outputs checked against the group's reference, a wrong one flagged."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from bench import inference
from bench.configs import BenchConfig


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inference") / "inference.json"
    assert inference.main(["--preset", "tiny", "--device", "cpu", "--repeats", "2", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_tiny_run_writes_a_sane_row_per_configuration_and_mode(tiny_run):
    assert tiny_run["kind"] == "inference"
    rows = tiny_run["rows"]
    names = [config.name for config, _ in inference.configs(causal=True)]
    want = set(itertools.product(names, inference.MODEL_MODES, inference.GRAD_MODES))
    assert {(r["config"], r["model_mode"], r["grad_mode"]) for r in rows} == want
    assert len(rows) == len(want)
    for row in rows:
        assert row["status"] == "ok", row
        assert set(row) == set(tiny_run["columns"])
        assert row["mode"] == "inference"
        assert 1 <= row["steps_timed"] == len(row["step_times_ms"]) <= 2
        assert 0 < row["step_time_ms_p20"] <= row["step_time_ms_median"] <= row["step_time_ms_p80"]
        assert row["time_vs_eager"] > 0
        assert row["saved_bytes"] == 0  # no graph: nothing saved for a backward
        assert row["step_peak_tracked_bytes"] > 0
        if row["config"] == row["time_reference"]:
            assert row["time_vs_eager"] == 1.0
        if row["model_mode"] == "eval":
            assert row["output_check"] == "ok" and row["output_max_rel_diff"] <= inference.OUTPUT_RTOL[torch.float32]
        else:
            assert row["output_check"] == "n/a"  # dropout masks differ between implementations
    assert tiny_run["arguments"]["dropout"] == 0.1  # the train rows' dropout by default


class _Off(nn.Module):
    """A model whose output is 1% off its inner model's."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) * 1.01


def test_a_wrong_output_is_flagged_and_the_run_fails(monkeypatch, tmp_path, capsys):
    reference = inference.configs(causal=True)[0]
    wrong = BenchConfig("off-by-1%", "memopt", "the reference, 1% off", lambda ctx: _Off(reference[0].build(ctx)))
    monkeypatch.setattr(inference, "configs", lambda causal: [reference, (wrong, reference[1])])
    out = tmp_path / "inference.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--model-modes", "eval", "--grad-modes", "no_grad"]
    assert inference.main(argv + ["--out", str(out)]) == 1
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["off-by-1%"]["output_check"] == "MISMATCH"
    assert rows["off-by-1%"]["output_max_rel_diff"] == pytest.approx(0.01, rel=1e-3)
    assert "MISMATCH" in capsys.readouterr().out
