"""`python -m bench.collect OUT`: turn one device run's output folder into committed results.

A GPU is lent for minutes at a time; what ``bench/device_check.sh`` wrote to ``$OUT`` must end up
in the repository before the session does, not in a scratch folder. This script

0. unpacks ``OUT/00-device-check.tgz`` when there is one (the device tool returns only the first
   files of ``$OUT`` by name; the archive holds them all) and refuses (exit 2) a folder that still
   has no ``environment.txt`` rather than record an "unknown GPU" run,
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
import tarfile
import tempfile
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
README_BEGIN = "<!-- gpu-results:begin -->"
README_END = "<!-- gpu-results:end -->"
# device_check.sh packs everything it wrote into this archive after every step: the device tool
# returns only the first files of $OUT by name, so the folder fetched back may hold little else.
ARCHIVE = "00-device-check.tgz"


class IncompleteRun(ValueError):
    """OUT (with its archive unpacked) lacks what a results folder needs, e.g. ``environment.txt``."""


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
    note: str = ""  # where the counts came from when not from a whole gpu_tests.xml


# `pytest -v` names each test with its outcome: "tests/test_block.py::test_a PASSED   [ 10%]"
_VERBOSE_RESULT = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def read_pytest_log(path: Path) -> TestSummary | None:
    """Counts from a ``pytest -v`` log (the tests that finished before a cut, when it was cut)."""
    if not path.is_file():
        return None
    summary = TestSummary()
    seen = set()
    for line in path.read_text(errors="replace").splitlines():
        match = _VERBOSE_RESULT.match(line)
        if match is None or match.groups() in seen:
            continue
        seen.add(match.groups())
        name, outcome = match.groups()
        if outcome in ("FAILED", "ERROR"):
            summary.failed += 1
            summary.failures.append(name)
        elif outcome in ("SKIPPED", "XFAIL"):
            summary.skipped += 1
        else:
            summary.passed += 1
    return summary


def read_junit(path: Path) -> TestSummary | None:
    """The GPU tests' counts from ``gpu_tests.xml``; from ``gpu_tests.log`` beside it (``pytest -v``)
    when the XML is truncated (a step killed while pytest wrote it), with a note saying so."""
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        log = path.with_suffix(".log")
        summary = read_pytest_log(log)
        if summary is None:
            return TestSummary(note=f"junit truncated ({path.name}: {exc}); no {log.name} to count from")
        summary.note = f"junit truncated ({path.name}: {exc}); counts from the `pytest -v` lines of {log.name}"
        return summary
    summary = TestSummary()
    for case in root.iter("testcase"):
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
        if tests.note:
            line += f" Note: {tests.note}."
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


def _check_member(member: tarfile.TarInfo, root: Path) -> None:
    """Only regular files and folders that land inside ``root``: links, devices, absolute paths
    and ``..`` are refused (the archive came back from another machine)."""
    if not (member.isfile() or member.isdir()):
        raise IncompleteRun(f"{ARCHIVE}: {member.name!r} is not a plain file or folder; refusing to unpack it")
    target = (root / member.name).resolve()
    if Path(member.name).is_absolute() or ".." in Path(member.name).parts or not target.is_relative_to(root.resolve()):
        raise IncompleteRun(f"{ARCHIVE}: {member.name!r} points outside the folder; refusing to unpack it")


def unpack(out: Path, into: Path) -> Path:
    """``into`` holding ``out``'s archive unpacked with ``out``'s other files over it, or ``out``
    itself when it has no archive. The loose files win: the archive was packed after a step, and a
    file written later (a step cut by the device tool) is at least as complete."""
    archive = out / ARCHIVE
    if not archive.is_file():
        return out
    into.mkdir(parents=True, exist_ok=True)
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:  # one at a time: a truncated archive still gives its first files
                _check_member(member, into)
                tar.extract(member, into, **kwargs)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # truncated: keep what came out of it
        print(f"bench.collect: {archive} could not be read whole ({exc}); using what it held", file=sys.stderr)
    for path in out.iterdir():
        if path.name == ARCHIVE:
            continue
        if path.is_dir():
            shutil.copytree(path, into / path.name, dirs_exist_ok=True)
        else:
            shutil.copy2(path, into / path.name)
    return into


def collect(out: Path, results_dir: Path = RESULTS_DIR, readme: Path | None = ROOT / "README.md") -> Path:
    """Copy ``out`` into a new results folder, write its README and update the repository README.

    ``out`` may be the folder the device tool returned: when it holds ``00-device-check.tgz`` the
    archive's files are collected (its own loose files over them) and the archive itself is not
    copied. Raises ``IncompleteRun`` when there is no ``environment.txt`` even then.
    """
    if not out.is_dir():
        raise FileNotFoundError(f"bench.collect: OUT must be the folder device_check.sh wrote, got {out}")
    with tempfile.TemporaryDirectory(prefix="bench-collect-") as scratch:
        run_dir = unpack(out, Path(scratch) / "run")
        if not (run_dir / "environment.txt").is_file():
            has = sorted(p.name for p in run_dir.iterdir())
            raise IncompleteRun(
                f"{out} has no environment.txt" + (f" (nor has its {ARCHIVE})" if (out / ARCHIVE).is_file() else f" and no {ARCHIVE}")
                + f"; it holds {has[:12]}{' ...' if len(has) > 12 else ''}. Pass the $OUT that bench/device_check.sh wrote,"
                " or the folder the device tool returned with its 00-device-check.tgz"
            )
        return _collect(run_dir, results_dir, readme)


def _collect(out: Path, results_dir: Path, readme: Path | None) -> Path:
    env = read_environment(out / "environment.txt")
    # Read and summarised before anything is copied: a file it cannot read leaves no half-made folder.
    tests = read_junit(out / "gpu_tests.xml")
    tables = []
    for path in sorted(out.glob("compare-*.json")):
        try:
            tables.append(harness_table(json.loads(path.read_text())))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # a step cut while writing it
            tables.append(f"`{path.name}`: not readable JSON ({exc}); the file is copied as it came.")
    dest = destination(env, results_dir)
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns(ARCHIVE))
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
    try:
        dest = collect(args.out, args.results_dir, None if args.no_readme else args.readme)
    except IncompleteRun as exc:
        parser.error(str(exc))  # exit 2: nothing copied, the README left as it was
    print(f"results: {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
