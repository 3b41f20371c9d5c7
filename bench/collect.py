"""`python -m bench.collect OUT`: turn one device run's output folder into committed results.

A GPU is lent for minutes at a time; what ``bench/device_check.sh`` wrote to ``$OUT`` must end up
in the repository before the session does, not in a scratch folder. This script

1. copies every file of ``OUT`` into ``bench/results/<gpu>-<date>/`` (``<gpu>`` from
   ``environment.txt``, e.g. ``h200``; a numbered suffix when that folder already exists),
2. writes that folder's ``README.md``: the environment (GPU, driver, torch, triton, commit, date),
   the GPU tests' counts and failures (from ``gpu_tests.xml``), and the harness table of every
   ``compare-*.json`` with each configuration's time against the eager block and against
   ``torch.utils.checkpoint``,
3. replaces the block between ``<!-- gpu-results:begin -->`` and ``<!-- gpu-results:end -->`` in
   the repository README with the same summary and a link to the folder.

Nothing is measured here and nothing is inferred: every number is read from the run's files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
README_BEGIN = "<!-- gpu-results:begin -->"
README_END = "<!-- gpu-results:end -->"


@dataclass
class Environment:
    """What ``device_check.sh`` wrote to ``environment.txt``."""

    date: str = "unknown"
    commit: str = "unknown"
    gpu: str = "unknown GPU"
    driver: str = "unknown"
    memory: str = "unknown"
    versions: str = "unknown"

    @property
    def slug(self) -> str:
        """A short folder name for the GPU: ``NVIDIA H200`` -> ``h200``."""
        name = re.sub(r"^(NVIDIA|Tesla)\s+", "", self.gpu.strip(), flags=re.IGNORECASE)
        name = name.split()[0] if name.split() else "gpu"
        return re.sub(r"[^0-9a-z]+", "-", name.lower()).strip("-") or "gpu"

    @property
    def day(self) -> str:
        digits = re.sub(r"[^0-9]", "", self.date)[:8]
        return digits if len(digits) == 8 else "undated"


def read_environment(path: Path) -> Environment:
    env = Environment()
    if not path.is_file():
        return env
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "date":
            env.date = value
        elif key == "commit":
            env.commit = value
        elif line.startswith("torch "):
            env.versions = line.strip()
        elif line.count(",") >= 2 and not key.isidentifier():
            # nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
            gpu, driver, memory = (part.strip() for part in line.split(",")[:3])
            env.gpu, env.driver, env.memory = gpu, driver, memory
    return env


@dataclass
class TestSummary:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def read_junit(path: Path) -> TestSummary | None:
    if not path.is_file():
        return None
    summary = TestSummary()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            summary.failed += 1
            summary.failures.append(name)
        elif case.find("skipped") is not None:
            summary.skipped += 1
        else:
            summary.passed += 1
    return summary


def _ratio(row: dict, reference: dict | None) -> str:
    if reference is None or row.get("status") != "ok" or reference.get("status") != "ok":
        return "-"
    return f"{row['step_time_ms_median'] / reference['step_time_ms_median']:.2f}"


def harness_table(result: dict) -> str:
    """The harness rows with time against eager-sdpa and torch-checkpoint, from one compare JSON."""
    rows = result.get("rows", [])
    by_name = {row["config"]: row for row in rows}
    eager, ckpt = by_name.get("eager-sdpa"), by_name.get("torch-checkpoint")
    lines = [
        "| config | step ms (p20-p80) | peak GPU MiB | activations MiB | time / eager-sdpa | time / checkpoint |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {row['config']} | {row.get('status', 'not run')} | | | | |")
            continue
        # None where the harness cannot count them (compiled configurations allocate past the dispatcher)
        peak, saved = row.get("peak_gpu_bytes"), row.get("activation_bytes")
        lines.append(
            f"| {row['config']} | {row['step_time_ms_median']:.1f} ({row['step_time_ms_p20']:.1f}-{row['step_time_ms_p80']:.1f}) "
            f"| {'-' if peak is None else f'{peak / 2**20:.0f}'} | {'-' if saved is None else f'{saved / 2**20:.1f}'} "
            f"| {_ratio(row, eager)} | {_ratio(row, ckpt)} |"
        )
    args = result.get("arguments", {})
    shape = ", ".join(f"{k} {args[k]}" for k in ("dtype", "d_model", "n_heads", "d_ff", "seq", "batch", "layers", "dropout") if k in args)
    return f"`python -m bench --preset {args.get('preset', '?')}` ({shape}):\n\n" + "\n".join(lines)


def summary_markdown(env: Environment, tests: TestSummary | None, tables: list[str], folder: str) -> str:
    parts = [
        f"GPU run of {env.date}: {env.gpu} (driver {env.driver}, {env.memory}), {env.versions}, "
        f"commit {env.commit[:12]}; every file in [{folder}]({folder}/).",
    ]
    if tests is None:
        parts.append("GPU tests: no `gpu_tests.xml` in this run.")
    else:
        line = f"GPU tests (`pytest -m gpu`): {tests.passed} passed, {tests.failed} failed, {tests.skipped} skipped."
        if tests.failures:
            line += " Failed: " + ", ".join(f"`{name}`" for name in tests.failures[:20])
            if len(tests.failures) > 20:
                line += f" and {len(tests.failures) - 20} more"
        parts.append(line)
    parts.extend(tables)
    return "\n\n".join(parts)


def destination(env: Environment, results_dir: Path) -> Path:
    base = results_dir / f"{env.slug}-{env.day}"
    path, n = base, 2
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def update_readme(readme: Path, block: str) -> bool:
    """Replace the marked block of ``readme`` with ``block``; False when the markers are missing."""
    text = readme.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[: start + len(README_BEGIN)] + "\n" + block + "\n" + text[end:])
    return True


def collect(out: Path, results_dir: Path = RESULTS_DIR, readme: Path | None = ROOT / "README.md") -> Path:
    """Copy ``out`` into a new results folder, write its README and update the repository README."""
    if not out.is_dir():
        raise FileNotFoundError(f"bench.collect: OUT must be the folder device_check.sh wrote, got {out}")
    env = read_environment(out / "environment.txt")
    # Read and summarised before anything is copied: a file it cannot read leaves no half-made folder.
    tests = read_junit(out / "gpu_tests.xml")
    tables = [harness_table(json.loads(path.read_text())) for path in sorted(out.glob("compare-*.json"))]
    dest = destination(env, results_dir)
    shutil.copytree(out, dest)
    try:
        folder = dest.relative_to(ROOT).as_posix()
    except ValueError:
        folder = dest.as_posix()
    summary = summary_markdown(env, tests, tables, folder)
    (dest / "README.md").write_text(f"# {env.gpu} run of {env.date}\n\n" + summary.replace(f"({folder}/)", "(.)") + "\n")
    if readme is not None and not update_readme(readme, summary):
        print(f"bench.collect: {readme} has no {README_BEGIN} ... {README_END} block; left unchanged", file=sys.stderr)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder bench/device_check.sh wrote ($OUT)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--no-readme", action="store_true", help="leave the repository README as it is")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"out: {args.out} is not a folder (the $OUT that bench/device_check.sh wrote)")
    dest = collect(args.out, args.results_dir, None if args.no_readme else args.readme)
    print(f"results: {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
