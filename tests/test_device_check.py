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
