"""The kernels' registered forward and backward ops (torch.ops.memopt.layer_norm_fwd, bias_act_bwd,
cpu_flash_attention_fwd, ...) have no derivative: called directly with grad mode on, a tensor
argument that requires grad is refused naming the op, the argument and the differentiable public
function (torch's not-implemented fallback had left x.grad None with a warning); with nothing
requiring grad, or under torch.no_grad(), they run as before."""

import pytest
import torch

import memopt  # noqa: F401  (registers torch.ops.memopt)

ops = torch.ops.memopt
KEY = torch.tensor([1234, 0], dtype=torch.int64)


def _norm_stats(x):
    _, _, mean, rstd = ops.layer_norm_fwd(x, None, None, None, 1e-5)
    return mean, rstd


def _attention(t):
    """q, k, v: (1, 2, 5, 4); out and lse of the forward."""
    q, k, v = t["q"], t["k"], t["v"]
    with torch.no_grad():
        out, lse = ops.cpu_flash_attention_fwd(q, k, v, True, 0.5)
    return out, lse


# name -> (the public function that differentiates through it, the float tensor arguments by
# name, call(t) with t the dict of those tensors)
CASES = {
    "dropout_add_fwd": ("memopt.dropout_add", ("x", "residual"), lambda t: ops.dropout_add_fwd(t["x"], t["residual"], 0.1, KEY)),
    "dropout_add_bwd": ("memopt.dropout_add", ("grad_out",), lambda t: ops.dropout_add_bwd(t["grad_out"], 0.1, KEY)),
    "layer_norm_fwd": ("memopt.layer_norm", ("x", "weight"), lambda t: ops.layer_norm_fwd(t["x"], None, t["weight"], None, 1e-5)),
    "layer_norm_bwd": (
        "memopt.layer_norm", ("grad_y", "x", "weight"),
        lambda t: ops.layer_norm_bwd(t["grad_y"], t["x"], t["weight"], None, *_norm_stats(t["x"].detach()), None, False),
    ),
    "rms_norm_fwd": ("memopt.rms_norm", ("x", "weight"), lambda t: ops.rms_norm_fwd(t["x"], None, t["weight"], 1e-5)),
    "rms_norm_bwd": (
        "memopt.rms_norm", ("grad_y", "x"),
        lambda t: ops.rms_norm_bwd(t["grad_y"], t["x"], None, ops.rms_norm_fwd(t["x"].detach(), None, None, 1e-5)[2], None, False),
    ),
    "bias_act_fwd": ("memopt.bias_act", ("x", "bias"), lambda t: ops.bias_act_fwd(t["x"], t["bias"], "gelu")),
    "bias_act_bwd": ("memopt.bias_act", ("grad_y", "x"), lambda t: ops.bias_act_bwd(t["grad_y"], t["x"], None, "silu", True)),
    "swiglu_fwd": ("memopt.swiglu", ("x",), lambda t: ops.swiglu_fwd(t["x"], None)),
    "swiglu_bwd": ("memopt.swiglu", ("grad_y", "x"), lambda t: ops.swiglu_bwd(t["grad_y"][:, :3].contiguous(), t["x"], None, False)),
    "cpu_flash_attention_fwd": ("memopt.attention", ("q", "k", "v"), lambda t: ops.cpu_flash_attention_fwd(t["q"], t["k"], t["v"], True, 0.5)),
    "cpu_flash_attention_bwd": (
        "memopt.attention", ("grad_out", "q"),
        lambda t: ops.cpu_flash_attention_bwd(t["grad_out"], t["q"], t["k"], t["v"], *_attention(t), True, 0.5),
    ),
    "cpu_flash_attention_bwd_packed": (
        "memopt.attention", ("grad_out", "v"),
        lambda t: ops.cpu_flash_attention_bwd_packed(t["grad_out"], t["q"], t["k"], t["v"], *_attention(t), True, 0.5),
    ),
}


def _tensors(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    if name.startswith("cpu_flash_attention"):
        return {n: torch.randn(1, 2, 5, 4) for n in ("q", "k", "v", "grad_out")}
    return {
        "x": torch.randn(4, 6), "residual": torch.randn(4, 6), "grad_out": torch.randn(4, 6), "grad_y": torch.randn(4, 6),
        "weight": torch.randn(6), "bias": torch.randn(6),
    }


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize(
    "name,arg", [(name, arg) for name, (_, args, _) in CASES.items() for arg in args], ids=lambda v: str(v)
)
def test_argument_requiring_grad_is_refused_naming_the_op_and_its_differentiable_function(name, arg):
    public, _, call = CASES[name]
    t = _tensors(name)
    t[arg].requires_grad_()
    with pytest.raises(RuntimeError, match=rf"memopt\.{name}: {arg} requires grad; this op has no derivative: "
                                           rf"differentiate through {public}, or call it under torch\.no_grad\(\)"):
        call(t)


@pytest.mark.parametrize("name", CASES)
def test_runs_under_no_grad_or_without_grad_inputs_as_before(name):
    _, args, call = CASES[name]
    expected = _outputs(call(_tensors(name)))  # grad mode on, nothing requires grad
    t = _tensors(name)
    for arg in args:
        t[arg].requires_grad_()
    with torch.no_grad():
        got = _outputs(call(t))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert not g.requires_grad and not e.requires_grad
        assert torch.equal(g, e)
