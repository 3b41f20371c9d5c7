"""bench.collect: a device run's output folder becomes a committed results folder and README block."""

import json

import pytest

from bench import collect

ENVIRONMENT = """date: 2026-12-24T10:00:00Z
commit: 0123456789abcdef0123456789abcdef01234567
NVIDIA H200, 580.159.04, 143771 MiB
torch 2.11.0+cu130 cuda 13.0 triton 3.6.0
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_block" name="test_a" time="0.1"/>
<testcase classname="tests.test_block" name="test_b" time="0.1"><failure message="boom">x</failure></testcase>
<testcase classname="tests.test_offload" name="test_c" time="0.1"><skipped message="no"/></testcase>
<testcase classname="tests.test_offload" name="test_d" time="0.1"/>
</testsuite></testsuites>
"""


def _row(config, ms, status="ok"):
    return {
        "config": config, "status": status, "step_time_ms_median": ms, "step_time_ms_p20": ms - 1,
        "step_time_ms_p80": ms + 1, "peak_gpu_bytes": 3 * 2**30, "activation_bytes": 64 * 2**20,
    }  # fmt: skip


@pytest.fixture
def device_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "environment.txt").write_text(ENVIRONMENT)
    (out / "gpu_tests.xml").write_text(JUNIT)
    (out / "bench_h200.log").write_text("log\n")
    result = {
        "kind": "compare",
        "arguments": {"preset": "h200", "dtype": "bfloat16", "d_model": 2048, "seq": 2048},
        "rows": [_row("eager-sdpa", 20.0), _row("torch-checkpoint", 25.0), _row("memopt-full", 22.5),
                 # compiled code allocates past the dispatcher: the harness counts no bytes (None)
                 {**_row("torch-compile", 18.0), "peak_gpu_bytes": None, "activation_bytes": None},
                 _row("memopt-offload", 0.0, status="skipped: out of time")],
    }  # fmt: skip
    (out / "compare-h200-cuda-20261224T100000Z.json").write_text(json.dumps(result))
    return out


def test_collect_copies_the_run_and_summarises_it(device_out, tmp_path):
    results = tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{collect.README_BEGIN}\nold numbers\n{collect.README_END}\ntail\n")

    dest = collect.collect(device_out, results, readme)

    assert dest == results / "h200-20261224"
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["README.md", "environment.txt", "gpu_tests.xml", "bench_h200.log", "compare-h200-cuda-20261224T100000Z.json"]
    )
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("intro\n") and text.endswith("tail\n")
    assert "NVIDIA H200" in text and "torch 2.11.0+cu130" in text and "0123456789ab" in text
    assert "2 passed, 1 failed, 1 skipped" in text and "`tests.test_block::test_b`" in text
    # memopt-full: 22.5 ms against eager 20.0 (1.12x) and checkpoint 25.0 (0.90x).
    full = next(line for line in text.splitlines() if line.startswith("| memopt-full"))
    assert full.split("|")[-3].strip() == "1.12" and full.split("|")[-2].strip() == "0.90"
    assert "skipped: out of time" in text
    compiled = next(line for line in text.splitlines() if line.startswith("| torch-compile"))
    assert [cell.strip() for cell in compiled.split("|")[3:6]] == ["-", "-", "0.90"]
    assert "NVIDIA H200" in (dest / "README.md").read_text()


def test_collect_never_overwrites_an_earlier_run(device_out, tmp_path):
    results = tmp_path / "results"
    first = collect.collect(device_out, results, readme=None)
    second = collect.collect(device_out, results, readme=None)
    assert first != second and second.name == "h200-20261224-2"
    assert (first / "environment.txt").read_text() == ENVIRONMENT


def test_collect_refuses_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="OUT"):
        collect.collect(tmp_path / "nothing", tmp_path / "results", readme=None)
