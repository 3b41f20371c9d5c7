"""bench/attention.py runs end to end (cpu preset) and writes the documented JSON columns."""

import json
import os
import subprocess
import sys

import pytest
import torch

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


def _tiny_cpu_cases(monkeypatch):
    """One tiny CPU case (seq 16, no dropout) so the in-process runs below take well under a second."""
    from bench import attention

    case = attention.Case(1, 2, 16, True, (16,))
    monkeypatch.setitem(attention.PRESETS, "tiny-cpu", {"device": "cpu", "dtype": torch.float32, "cases": [case]})
    return attention


def _with_extra_provider(monkeypatch, attention, name, fn):
    real = attention.providers

    def providers(case, device, q, k, v):
        found = real(case, device, q, k, v)
        # the failing provider runs between memopt's backends and sdpa, as a real one would
        return {**{p: f for p, f in found.items() if p.startswith("memopt")}, name: fn,
                **{p: f for p, f in found.items() if not p.startswith("memopt")}}

    monkeypatch.setattr(attention, "providers", providers)


def test_a_failing_provider_gives_an_error_row_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    attention = _tiny_cpu_cases(monkeypatch)

    def broken(q, k, v):
        raise ValueError("kernel exploded\nsecond line")

    _with_extra_provider(monkeypatch, attention, "broken", broken)
    out = tmp_path / "attention.json"
    with pytest.raises(SystemExit) as exited:
        attention.main(["--preset", "tiny-cpu", "--out", str(out)])
    assert exited.value.code == 1
    rows = json.loads(out.read_text())
    errors = [r for r in rows if r["metric"] == "error"]
    assert len(errors) == 1 and errors[0]["provider"] == "broken"
    assert errors[0]["status"] == "error (ValueError: kernel exploded)" and errors[0]["median"] is None
    assert set(errors[0]) == COLUMNS | {"status"}
    timed = {r["provider"] for r in rows if r["metric"] == "time"}
    assert {"sdpa", "eager", "memopt:auto"} <= timed and "broken" not in timed
    printed = capsys.readouterr().out
    assert "| broken | error (ValueError: kernel exploded) |" in printed  # in the table too
    assert "error rows" in printed


def test_an_interrupt_keeps_the_rows_measured_so_far(tmp_path, monkeypatch, capsys):
    attention = _tiny_cpu_cases(monkeypatch)
    # Two sequence lengths: the first is measured and written, the second is cut (SIGINT ->
    # KeyboardInterrupt, as device_check.sh's time limit sends it).
    case = attention.Case(1, 2, 16, True, (16, 32))
    monkeypatch.setitem(attention.PRESETS["tiny-cpu"], "cases", [case])

    def interrupted(q, k, v):
        if q.shape[-2] == 32:
            raise KeyboardInterrupt
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    _with_extra_provider(monkeypatch, attention, "cut", interrupted)
    out = tmp_path / "attention.json"
    with pytest.raises(SystemExit) as exited:
        attention.main(["--preset", "tiny-cpu", "--out", str(out)])
    assert exited.value.code == 130
    rows = json.loads(out.read_text())
    assert {r["x"] for r in rows if r["metric"] == "time" and r["provider"] == "sdpa"} == {16}
    assert {r["provider"] for r in rows if r["x"] == 32 and r["metric"] == "time"} >= {"memopt:auto"}
    printed = capsys.readouterr().out
    # each row was printed as it was measured, before the interrupt
    assert "| attention b1 h2 d16 causal p0 | 16 | fwd | sdpa |" in printed
    assert "interrupted" in printed
