"""bench/device_check.sh, the one prepared GPU check: every step's command is one its tool accepts.

A device session is 15 minutes, rarely lent; a misspelt option in the script would cost a step of
it. The script's dry run (DEVICE_CHECK_DRY_RUN=1) prints each step's command after the shell has
expanded it; each is parsed here by its own tool's argument parser, with no GPU and nothing run.
"""

import argparse
import importlib
import os
import re
import shlex
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"


def dry_run_steps(out: Path) -> dict[str, list[str]]:
    env = {**os.environ, "DEVICE_CHECK_DRY_RUN": "1", "BENCH_SWEEPS": "1", "OUT": str(out)}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {}
    for line in proc.stdout.splitlines():
        assert line.startswith("step "), f"the dry run printed more than step lines: {line!r}"
        name, command = line[len("step "):].split(":", 1)
        steps[name] = shlex.split(command)
    return steps


class Parsed(Exception):
    """Raised from ArgumentParser.parse_args once it has accepted the arguments."""

    def __init__(self, namespace):
        super().__init__()
        self.namespace = namespace


def parse_with_tool(module_name: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace ``python -m module_name *argv`` parses to (its main stops right there)."""
    module = importlib.import_module("bench.compare" if module_name == "bench" else module_name)
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real_parse_args(self, args, namespace))  # SystemExit(2) on a bad argument

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(Parsed) as parsed:
            module.main(argv)
    return parsed.value.namespace


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return dry_run_steps(tmp_path_factory.mktemp("device_check"))


def test_dry_run_lists_the_gpu_steps(steps):
    # The steps the GPU-evidence work depends on (device_check.sh runs the harness and profile first).
    for name in ("build", "gpu_tests", "bench_h200", "kernels_h200", "bench_attention", "sweep_layers", "sweep_seq"):
        assert name in steps, sorted(steps)


def test_every_bench_command_parses(steps, monkeypatch):
    from bench.compare import configs_by_name

    checked = 0
    for name, argv in steps.items():
        if argv[:2] != ["python", "-m"] or not argv[2].startswith("bench"):
            continue
        namespace = parse_with_tool(argv[2], argv[3:], monkeypatch)
        if getattr(namespace, "configs", None):
            configs_by_name(namespace.configs, name)  # exits naming an unknown configuration
        checked += 1
    assert checked >= 8, steps


def test_pytest_steps_name_existing_files_and_markers(steps):
    markers = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
               ["ini_options"]["markers"]}
    pytest_steps = {name: argv for name, argv in steps.items() if argv[:3] == ["python", "-m", "pytest"]}
    assert pytest_steps, steps
    for name, argv in pytest_steps.items():
        files = [a for a in argv if a.startswith("tests/")]
        assert files, name
        missing = [f for f in files if not (ROOT / f).is_file()]
        assert not missing, f"{name}: {missing}"
        expression = argv[argv.index("-m", 3) + 1]
        words = set(expression.replace("(", " ").replace(")", " ").split()) - {"not", "and", "or"}
        assert words <= markers, f"{name}: unregistered markers {words - markers}"


def test_python_snippets_compile_and_name_real_functions(steps):
    import memopt

    snippets = [argv[2] for argv in steps.values() if argv[:2] == ["python", "-c"]]
    assert snippets, steps
    for code in snippets:
        compile(code, "<device_check>", "exec")
        for attribute in re.findall(r"\bmemopt\.(\w+)", code):
            assert hasattr(memopt, attribute), f"memopt.{attribute} in {code!r}"


def test_gpu_tests_run_the_recently_changed_files_first(steps):
    argv = steps["gpu_tests"]
    files = [a for a in argv if a.startswith("tests/")]
    assert files[:9] == ["tests/test_offload.py", "tests/test_wrap.py", "tests/test_wrap_swap.py", "tests/test_block.py",
                         "tests/test_activation.py", "tests/test_block_inference.py", "tests/test_attention.py",
                         "tests/test_cross_entropy.py", "tests/test_norm.py"]
    assert len(files) == len(set(files))
    assert "--maxfail=50" in argv and argv[argv.index("-o") + 1] == "faulthandler_timeout=120"


def test_build_uses_the_interpreter_of_the_steps(steps):
    command = steps["build"][-1]
    assert "python -m pip install" in command and "python setup.py build_ext --inplace" in command
    assert not re.search(r"(^|[|&;]\s*)pip\s", command), command


def test_no_wrap_torch_compat_step(steps):
    assert "wrap_torch_compat" not in steps  # CI runs the CPU tests on torch 2.11 + triton 3.6


FAKE_PYTHON = """#!/bin/bash
# Fake python: every step "runs" by listing the archive as it finds it (so the test can see it was
# re-packed after the step before); bench.offload fails.
case "$*" in
  *"import torch, triton"*) echo "torch 2.11.0+cu130 cuda 13.0 triton 3.6.0"; exit 0;;
esac
[ -f "$OUT/00-device-check.tgz" ] && tar tzf "$OUT/00-device-check.tgz" | sed 's/^/archived: /'
case "$*" in *bench.offload*) exit 3;; esac
exit 0
"""


def fake_run(out: Path, tmp_path: Path, budget: int) -> subprocess.CompletedProcess:
    """device_check.sh for real, with ``python`` and ``nvidia-smi`` replaced by fakes on PATH."""
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir(exist_ok=True)
    (fakebin / "python").write_text(FAKE_PYTHON)
    (fakebin / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H200, 580.159.04, 143771 MiB'\n")
    for tool in fakebin.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{fakebin}:{os.environ['PATH']}", "OUT": str(out), "MEMOPT_COMMIT": "0" * 40,
           "DEVICE_CHECK_BUDGET": str(budget)}
    env.pop("DEVICE_CHECK_DRY_RUN", None)
    env.pop("BENCH_SWEEPS", None)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _archived(log: Path) -> set[str]:
    return {line.removeprefix("archived: ./") for line in log.read_text().splitlines() if line.startswith("archived: ")}


def test_archive_is_repacked_after_every_step_and_steps_are_logged(tmp_path, steps):
    out = tmp_path / "out"
    proc = fake_run(out, tmp_path, budget=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # bench_offload failed (rc 3)
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert rows[0] == ["name", "rc", "seconds"]
    names = [name for name in steps if not name.startswith("sweep_")]  # the sweeps need BENCH_SWEEPS=1
    assert [r[0] for r in rows[1:]] == names  # every step, in order
    assert {r[0]: r[1] for r in rows[1:]}["bench_offload"] == "3"
    assert all(r[1] == "0" for r in rows[1:] if r[0] != "bench_offload")
    for before, name in zip(names, names[1:]):
        # the archive a step finds holds the step before's log and its steps.tsv line
        archived = _archived(out / f"{name}.log")
        assert {"environment.txt", "steps.tsv", f"{before}.log"} <= archived, (name, archived)
    assert "environment.txt" in _archived(out / "build.log")  # packed before the first step too
    with tarfile.open(out / "00-device-check.tgz") as tar:
        final = {m.name.removeprefix("./") for m in tar.getmembers()}
    assert {"environment.txt", "steps.tsv", *(f"{n}.log" for n in names)} <= final
    assert "00-device-check.tgz" not in final
    assert sorted(p.name for p in out.iterdir())[0] == "00-device-check.tgz"
    assert not (out / "zz-device-check.tgz.partial").exists()
    assert not list(tmp_path.glob("*.partial"))  # packed beside OUT, then renamed into it


def test_steps_skipped_for_budget_do_not_fail_the_run(tmp_path):
    out = tmp_path / "out"
    proc = fake_run(out, tmp_path, budget=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert rows and all(r[1] == "skipped" for r in rows)
    assert (out / "00-device-check.tgz").is_file()
