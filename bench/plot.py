"""Plots drawn from the results files, never from a live run.

``python -m bench.plot RESULTS.json [...]`` re-draws the PNG next to each file:

* ``compare``: memory (peak GPU memory on GPU, activation memory elsewhere) against step time,
  one point per configuration: lower left is better;
* ``sweep-layers`` / ``sweep-seq``: memory and step time against depth or sequence length,
  one line per configuration;
* ``kernels``: forward+backward time per op and provider;
* ``long_context``: peak memory against sequence length per strategy, measured and estimated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20


def memory_key(rows: list[dict]) -> tuple[str, str]:
    """The memory column to plot and its axis label."""
    if any(r.get("peak_gpu_bytes") for r in rows):
        return "peak_gpu_bytes", "peak GPU memory per step (MiB)"
    return "activation_bytes", "activation memory held for backward (MiB)"


def _title(result: dict) -> str:
    env, args = result["environment"], result.get("arguments", {})
    shape = ""
    if "d_model" in args:
        args = dict(args)
        if args.get("sweep"):
            args[args["sweep"]] = "{" + ",".join(str(v) for v in args["sweep_values"]) + "}"
        shape = f"layers {args['layers']}, d{args['d_model']} h{args['n_heads']} ff{args['d_ff']} b{args['batch']} s{args['seq']} {args['dtype']}\n"
    return f"{shape}{env['device_name']}, torch {env['torch']}, commit {env['commit'][:10]}"


def plot_compare(result: dict, path: Path) -> Path:
    rows = [r for r in result["rows"] if r["status"] == "ok" and r["step_time_ms_median"] is not None]
    key, label = memory_key(rows)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r[key] is None:
            continue
        color = "tab:orange" if r["provider"] == "memopt" else "tab:blue"
        marker = "x" if r["grad_check"] == "MISMATCH" else "o"
        ax.errorbar(
            r["step_time_ms_median"],
            r[key] / MIB,
            xerr=[[r["step_time_ms_median"] - r["step_time_ms_p20"]], [r["step_time_ms_p80"] - r["step_time_ms_median"]]],
            fmt=marker,
            color=color,
            capsize=3,
        )
        suffix = " (MISMATCH)" if r["grad_check"] == "MISMATCH" else ""
        ax.annotate(r["config"] + suffix, (r["step_time_ms_median"], r[key] / MIB), textcoords="offset points", xytext=(5, 4), fontsize=8)
    from matplotlib.lines import Line2D

    ax.legend(
        handles=[Line2D([], [], marker="o", linestyle="", color=c, label=p) for p, c in (("PyTorch", "tab:blue"), ("memopt", "tab:orange"))],
        fontsize=8,
        loc="upper right",
    )
    missing = [r["config"] for r in result["rows"] if r["status"] != "ok"]
    if missing:
        fig.text(0.01, 0.01, "not run: " + ", ".join(missing), fontsize=7, color="gray")
    ax.set_xlabel("step time, forward + backward + SGD (ms, median; bars p20-p80)")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(result: dict, path: Path) -> Path:
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    parameter = result["kind"].split("-", 1)[1]
    key, label = memory_key(rows)
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 5))
    for name in dict.fromkeys(r["config"] for r in rows):
        points = sorted((r["x"], r) for r in rows if r["config"] == name)
        style = "--" if points[0][1]["provider"] == "memopt" else "-"
        mem = [(x, r[key] / MIB) for x, r in points if r[key] is not None]
        if mem:
            ax_mem.plot(*zip(*mem), style, marker="o", label=name)
        ax_time.plot([x for x, _ in points], [r["step_time_ms_median"] for _, r in points], style, marker="o", label=name)
    for ax, ylabel in ((ax_mem, label), (ax_time, "step time (ms, median)")):
        ax.set_xlabel(parameter)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kernels(result: dict, path: Path) -> Path:
    rows = [r for r in result["rows"] if r["status"] == "ok" and r["metric"] == "time_fwd_bwd"]
    label = {id(r): r["op"] if r.get("width") is None else f"{r['op']} {r['x']}x{r['width']}" for r in rows}
    ops = list(dict.fromkeys(label[id(r)] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ops)), 5))
    width = 0.8 / max(len(providers), 1)
    for i, provider in enumerate(providers):
        xs, ys = [], []
        for j, op in enumerate(ops):
            hit = [r for r in rows if label[id(r)] == op and r["provider"] == provider]
            if hit:
                xs.append(j + i * width)
                ys.append(hit[0]["median"])
        ax.bar(xs, ys, width, label=provider)
    ax.set_xticks([j + width * (len(providers) - 1) / 2 for j in range(len(ops))], ops, fontsize=6, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("forward + backward (ms, median)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_long_context(result: dict, path: Path) -> Path:
    """Peak memory against sequence length, one panel per model configuration: measured (solid,
    dots) and estimated (dashed) per strategy."""
    rows = result["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for i, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
            points = sorted((r["x"], r) for r in rows if r["config"] == config and r["strategy"] == strategy)
            color = f"C{i}"
            measured = [(x, r["measured_bytes"] / MIB) for x, r in points if r["measured_bytes"] is not None]
            if measured:
                ax.plot(*zip(*measured), "-", marker="o", color=color, label=f"{strategy} (measured)")
            ax.plot([x for x, _ in points], [r["predicted_bytes"] / MIB for _, r in points], "--", color=color,
                    label=f"{strategy} (estimated)")
        ax.set_title(config, fontsize=9)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("peak memory of a training step (MiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


PLOTTERS = {"compare": plot_compare, "sweep-layers": plot_sweep, "sweep-seq": plot_sweep, "kernels": plot_kernels,
            "long_context": plot_long_context}


KINDS_TEXT = "bench.plot draws results files of kind " + ", ".join(sorted(PLOTTERS))


def plot_file(path: Path | str, out: Path | str | None = None) -> list[Path]:
    """Draw the plot of one results JSON file; returns the PNG paths written. A file that is not
    JSON or not a results file of a kind in ``PLOTTERS`` raises ``ValueError`` saying so."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); {KINDS_TEXT}") from None
    kind = result.get("kind") if isinstance(result, dict) else None
    if kind not in PLOTTERS:
        # bench.attention and bench.offload write a bare list of rows, with no kind to plot.
        what = f"has kind {kind!r}" if isinstance(result, dict) else f"is a JSON {type(result).__name__}, not a results file"
        raise ValueError(f"{path} {what}; {KINDS_TEXT}")
    return [PLOTTERS[kind](result, Path(out) if out else path.with_suffix(".png"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plot", description="Re-draw plots from bench results JSON files.")
    parser.add_argument("files", nargs="+", type=Path, help=KINDS_TEXT.replace("bench.plot draws ", ""))
    args = parser.parse_args(argv)
    for f in args.files:
        try:
            pngs = plot_file(f)
        except OSError as exc:
            parser.error(f"cannot read {f}: {exc.strerror or exc}; {KINDS_TEXT}")
        except ValueError as exc:
            parser.error(str(exc))
        for png in pngs:
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
