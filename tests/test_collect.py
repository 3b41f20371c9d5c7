"""bench.collect: a device run's output folder becomes a committed results folder and README block."""

import io
import json
import tarfile

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


def _pack(folder, archive, extra=()):
    """The archive device_check.sh writes: ``tar czf 00-device-check.tgz -C OUT .``"""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"./{path.name}")
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def test_collect_unpacks_the_archive_the_device_tool_returned(device_out, tmp_path):
    # The device tool returned the archive and a few logs only: environment.txt is inside it.
    returned = tmp_path / "returned"
    returned.mkdir()
    _pack(device_out, returned / collect.ARCHIVE)
    (returned / "bench_h200.log").write_text("log, written after the last pack\n")
    results = tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text(f"{collect.README_BEGIN}\nold\n{collect.README_END}\n")

    dest = collect.collect(returned, results, readme)

    assert dest == results / "h200-20261224"
    names = {p.name for p in dest.iterdir()}
    assert {"environment.txt", "gpu_tests.xml", "compare-h200-cuda-20261224T100000Z.json", "README.md"} <= names
    assert collect.ARCHIVE not in names  # its files are there; the archive is not copied twice
    assert (dest / "bench_h200.log").read_text() == "log, written after the last pack\n"  # the loose file wins
    assert "NVIDIA H200" in readme.read_text() and "unknown GPU" not in readme.read_text()
    assert sorted(p.name for p in returned.iterdir()) == [collect.ARCHIVE, "bench_h200.log"]  # OUT untouched


def test_collect_refuses_a_folder_without_environment(tmp_path, capsys):
    returned = tmp_path / "returned"
    returned.mkdir()
    (returned / "bench_h200.log").write_text("log\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"{collect.README_BEGIN}\nold\n{collect.README_END}\n")
    with pytest.raises(SystemExit) as exited:
        collect.main([str(returned), "--results-dir", str(tmp_path / "results"), "--readme", str(readme)])
    assert exited.value.code == 2
    assert "environment.txt" in capsys.readouterr().err
    assert "old" in readme.read_text() and not (tmp_path / "results").exists()


def test_collect_refuses_an_archive_that_escapes_its_folder(device_out, tmp_path):
    returned = tmp_path / "returned"
    returned.mkdir()
    evil = tarfile.TarInfo("../escaped.txt")
    evil.size = 3
    _pack(device_out, returned / collect.ARCHIVE, extra=[(evil, b"bad")])
    with pytest.raises(collect.IncompleteRun, match="outside"):
        collect.collect(returned, tmp_path / "results", readme=None)
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "results").exists()

    link = tarfile.TarInfo("./link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    _pack(device_out, returned / collect.ARCHIVE, extra=[(link, None)])
    with pytest.raises(collect.IncompleteRun, match="not a plain file"):
        collect.collect(returned, tmp_path / "results", readme=None)


def test_a_truncated_junit_falls_back_to_the_pytest_log(device_out, tmp_path):
    (device_out / "gpu_tests.xml").write_text(JUNIT[: len(JUNIT) // 2])
    (device_out / "gpu_tests.log").write_text(
        "tests/test_offload.py::test_a PASSED                     [  5%]\n"
        "tests/test_offload.py::test_b FAILED                     [ 10%]\n"
        "tests/test_wrap.py::test_c SKIPPED (no)                  [ 15%]\n"
        "tests/test_wrap.py::test_d PASSED                        [ 20%]\n"
        "tests/test_wrap.py::test_e \n"  # the test that was running when the step was cut
    )
    readme = tmp_path / "README.md"
    readme.write_text(f"{collect.README_BEGIN}\nold\n{collect.README_END}\n")
    dest = collect.collect(device_out, tmp_path / "results", readme)
    text = readme.read_text()
    assert "2 passed, 1 failed, 1 skipped" in text and "`tests/test_offload.py::test_b`" in text
    assert "junit truncated" in text and "gpu_tests.log" in text
    assert (dest / "gpu_tests.xml").read_text() == JUNIT[: len(JUNIT) // 2]  # copied as it came
