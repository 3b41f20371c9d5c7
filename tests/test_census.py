"""bench.census: bytes, launches and FLOPs against counts made by hand, and one end-to-end run."""

import json

import torch
import torch.nn.functional as F

from bench import census


def test_linear_training_step_counted_by_hand():
    m, k, n = 6, 5, 3
    x = torch.randn(m, k)
    weight = torch.randn(n, k, requires_grad=True)
    bias = torch.randn(n, requires_grad=True)
    with census.TrafficCensus() as counted:
        out = F.linear(x, weight, bias)  # addmm: forward
        out.backward(torch.ones(m, n))  # mm (weight grad), sum (bias grad); x needs none
    assert counted.matmul_flops == 2 * (2 * m * k * n)
    matmul = counted.families["matmul"]
    assert matmul.launches == 2 and matmul.ops == {"aten::addmm": 1, "aten::mm": 1}
    # addmm reads bias (n), x (m k), weight (n k), writes (m n); mm reads the output gradient
    # (m n) and x, writes (n k).
    assert matmul.bytes_read == 4 * ((n + m * k + n * k) + (m * n + m * k))
    assert matmul.bytes_written == 4 * (m * n + n * k)
    assert counted.families["reduce"].ops == {"aten::sum": 1}


def test_views_are_free_and_a_broadcast_counts_once():
    x = torch.randn(4, 32)
    with census.TrafficCensus() as counted:
        y = x.t().view(32, 4).transpose(0, 1)
        z = y + torch.ones(1, 32).expand(4, 32)
        key = torch.zeros(2, dtype=torch.int64)
    assert z.shape == (4, 32) and key.shape == (2,)
    elementwise = counted.families["elementwise"]
    assert elementwise.launches == 1
    assert elementwise.bytes_read == 4 * (128 + 32) and elementwise.bytes_written == 4 * 128
    assert counted.families["fill"].launches == 1  # torch.ones
    assert counted.families["tiny host tensors"].ops == {"aten::zeros": 1}


def test_memopt_op_is_one_launch_with_its_real_bytes():
    rows, width = 16, 32
    x = torch.randn(rows, width)
    weight, bias = torch.randn(width), torch.randn(width)
    with census.TrafficCensus() as counted:
        torch.ops.memopt.layer_norm_fwd(x, None, weight, bias, 1e-5)
    (name,) = counted.families
    norm = counted.families[name]
    assert name == "norm" and norm.launches == 1 and norm.ops == {"memopt::layer_norm_fwd": 1}
    assert norm.bytes_read == 4 * (rows * width + 2 * width)
    # y, the empty residual placeholder (0 bytes), mean and rstd.
    assert norm.bytes_written == 4 * (rows * width + 2 * rows)


def test_tiny_run_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "census.json"
    argv = ["--preset", "tiny", "--dropout", "0.1", "--configs", "eager-sdpa,torch-checkpoint,memopt-full", "--out", str(out)]
    assert census.main(argv) == 0
    result = json.loads(out.read_text())
    eager, checkpoint, full = (result["configs"][n] for n in ("eager-sdpa", "torch-checkpoint", "memopt-full"))
    assert eager["linear_flops_over_F"] == 3.0
    # memopt "full" reruns every linear but fc2, whose share of F is d_ff d / (4 d^2 + 2 d_ff d);
    # torch.utils.checkpoint reruns fc2 too under dropout (the residual dropout's mask is saved
    # after it, and its early stop waits for the last saved tensor).
    s = result["arguments"]
    fc2_share = s["d_ff"] * s["d_model"] / (4 * s["d_model"] ** 2 + 2 * s["d_ff"] * s["d_model"])
    assert abs(full["linear_flops_over_F"] - (4.0 - fc2_share)) < 1e-9
    assert checkpoint["linear_flops_over_F"] == 4.0
    assert "| MB moved / launches | eager-sdpa | torch-checkpoint | memopt-full |" in capsys.readouterr().out
    assert out.with_suffix(".md").read_text().count("\n|") >= 4
