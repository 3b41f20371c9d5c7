"""bench/attention.py runs end to end (cpu preset) and writes the documented JSON columns."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = {"name", "provider", "mode", "metric", "unit", "x", "median", "p20", "p80", "device", "torch", "triton", "commit", "date"}


def _run_preset(out, preset: str, seqs: str) -> subprocess.CompletedProcess:
    # The native CPU path: the interpreter would time Triton's Python emulation instead.
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attention", "--preset", preset, "--seqs", seqs, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_cpu_preset_writes_rows(tmp_path):
    out = tmp_path / "attention_cpu.json"
    proc = _run_preset(out, "cpu", "64")
    assert "| case | seq | mode | provider |" in proc.stdout
    rows = json.loads(out.read_text())
    assert rows and all(set(r) == COLUMNS for r in rows)
    by_dropout = {}
    for r in rows:
        by_dropout.setdefault(r["name"].endswith("p0"), set()).add(r["provider"])
    # Without dropout every CPU backend runs; with dropout all but ATen's flash kernels, which
    # draws no mask a key can set.
    assert by_dropout[True] == {"memopt:auto", "memopt:native", "memopt:cpu_flash", "memopt:aten_flash", "sdpa", "eager"}
    assert by_dropout[False] == {"memopt:auto", "memopt:native", "memopt:cpu_flash", "sdpa", "eager"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        assert r["p20"] <= r["median"] <= r["p80"], r
        assert r["median"] > 0, r
    saved = {(r["provider"], r["x"], r["name"]): r["median"] for r in rows if r["metric"] == "saved_bytes"}
    batch, heads, head_dim = 2, 8, 64
    for (provider, seq, name), nbytes in saved.items():
        if provider.startswith("memopt"):
            # out (float32) + lse + key, q/k/v excluded; eager keeps the seq x seq probabilities.
            # Without dropout on CPU, "auto" runs under memopt's C++ node, which keeps no key.
            flash_cpu = name.endswith("p0") and provider == "memopt:auto"
            assert nbytes == batch * heads * seq * (head_dim + 1) * 4 + (0 if flash_cpu else 16), provider
            assert saved[("eager", seq, name)] >= batch * heads * seq * seq * 4


def test_grouped_query_preset_runs_every_cpu_backend(tmp_path):
    out = tmp_path / "attention_cpu_gqa.json"
    _run_preset(out, "cpu-gqa", "48")
    rows = json.loads(out.read_text())
    names = {r["name"] for r in rows}
    assert names == {"attention b2 h8 kv2 d64 causal p0", "attention b2 h8 kv2 d64 causal p0.1"}
    providers = {r["provider"] for r in rows if r["name"].endswith("p0")}
    # SDPA with enable_gqa and eager (k, v repeated per group) run beside memopt's backends.
    assert providers == {"memopt:auto", "memopt:native", "memopt:cpu_flash", "memopt:aten_flash", "sdpa", "eager"}
    batch, heads, head_dim, seq = 2, 8, 64, 48
    for r in rows:
        if r["metric"] == "saved_bytes" and r["provider"] in ("memopt:native", "memopt:cpu_flash"):
            # out and lse per query head (q, k, v are the inputs), and the 16-byte key
            assert r["median"] == batch * heads * seq * (head_dim + 1) * 4 + 16, r
