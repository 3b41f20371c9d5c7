"""The registered in-place ops (bias_act_fwd_inplace, bias_act_bwd_inplace, layer_norm_bwd_inplace,
rms_norm_bwd_inplace) called directly through torch.ops.memopt: the overwritten tensor's version
counter moves, a tensor requiring grad under grad mode is refused naming the op, and an argument
that shares memory with the overwritten grad_y is refused."""

import pytest
import torch
import torch.nn.functional as F

import memopt  # noqa: F401  (registers torch.ops.memopt)

ops = torch.ops.memopt


def _norm_stats(x):
    _, _, mean, rstd = ops.layer_norm_fwd(x, None, None, None, 1e-5)
    return mean, rstd


def _rms_rstd(x):
    return ops.rms_norm_fwd(x, None, None, 1e-5)[2]


# Each case: (name, call(target, x, param) that overwrites target). x: [8, 6], param: [6].
CASES = {
    "bias_act_fwd_inplace": lambda t, x, p: ops.bias_act_fwd_inplace(t, p, "gelu"),
    "bias_act_bwd_inplace": lambda t, x, p: ops.bias_act_bwd_inplace(t, x, p, "gelu", False),
    "layer_norm_bwd_inplace": lambda t, x, p: ops.layer_norm_bwd_inplace(t, x, p, None, *_norm_stats(x), None, False),
    "rms_norm_bwd_inplace": lambda t, x, p: ops.rms_norm_bwd_inplace(t, x, p, _rms_rstd(x), None, False),
}


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(8, 6, dtype=dtype), torch.randn(8, 6, dtype=dtype), torch.randn(6, dtype=dtype)


@pytest.mark.parametrize("name", CASES)
def test_inplace_op_bumps_the_version_of_the_overwritten_tensor(name):
    target, x, param = _inputs()
    assert target._version == 0
    CASES[name](target, x, param)
    assert target._version == 1


@pytest.mark.parametrize("name", CASES)
def test_overwriting_a_tensor_saved_for_backward_raises_autograds_inplace_error(name):
    target, x, param = _inputs(torch.float64)
    a = target.requires_grad_()
    e = a.exp()  # ExpBackward saves its output e
    with torch.no_grad():
        CASES[name](e, x, param)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        e.sum().backward()


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("which", ["target", "param"])
def test_tensor_requiring_grad_is_refused_naming_the_op(name, which):
    target, x, param = _inputs()
    (target if which == "target" else param).requires_grad_()
    before = target.detach().clone()
    arg = "x" if name == "bias_act_fwd_inplace" and which == "target" else "grad_y" if which == "target" else None
    arg = arg or ("bias" if name.startswith("bias_act") else "weight")
    public = "memopt.bias_act" if name.startswith("bias_act") else f"memopt.{name.split('_bwd')[0]}"
    message = rf"memopt\.{name}: {arg} requires grad; this op has no derivative: differentiate through {public}, "
    with pytest.raises(RuntimeError, match=message):
        CASES[name](target, x, param)
    assert torch.equal(target.detach(), before)  # refused before anything was written


@pytest.mark.parametrize("name", CASES)
def test_under_no_grad_it_runs_and_matches_the_out_of_place_op(name):
    target, x, param = _inputs()
    target.requires_grad_()
    param.requires_grad_()
    expected = target.detach().clone()
    with torch.no_grad():
        if name == "bias_act_fwd_inplace":
            ref = ops.bias_act_fwd(expected, param, "gelu")
        elif name == "bias_act_bwd_inplace":
            ref = ops.bias_act_bwd(expected, x, param, "gelu", False)[0]
        elif name == "layer_norm_bwd_inplace":
            ref = ops.layer_norm_bwd(expected, x, param, None, *_norm_stats(x), None, False)[0]
        else:
            ref = ops.rms_norm_bwd(expected, x, param, _rms_rstd(x), None, False)[0]
        CASES[name](target, x, param)
    assert torch.equal(target.detach(), ref)


def test_bias_act_fwd_inplace_under_no_grad_matches_float64_gelu():
    target, _, param = _inputs(torch.float64)
    expected = F.gelu(target + param)
    with torch.no_grad():
        ops.bias_act_fwd_inplace(target, param, "gelu")
    torch.testing.assert_close(target, expected)


def _head(t, n):
    """The first n elements of t: a contiguous [n] view (a per-row statistic's shape) into t."""
    return t.view(-1)[:n]


# An argument inside grad_y would be read after grad_x was written over it.
BWD_ALIAS_CASES = [
    ("bias_act_bwd_inplace", "bias", lambda g, x: ops.bias_act_bwd_inplace(g, x, g[5], "gelu", False)),
    ("layer_norm_bwd_inplace", "weight",
     lambda g, x: ops.layer_norm_bwd_inplace(g, x, g[5], None, *_norm_stats(x), None, False)),
    ("layer_norm_bwd_inplace", "bias",
     lambda g, x: ops.layer_norm_bwd_inplace(g, x, None, g[5], *_norm_stats(x), None, False)),
    ("layer_norm_bwd_inplace", "mean",
     lambda g, x: ops.layer_norm_bwd_inplace(g, x, None, None, _head(g, 8), _norm_stats(x)[1], None, False)),
    ("layer_norm_bwd_inplace", "rstd",
     lambda g, x: ops.layer_norm_bwd_inplace(g, x, None, None, _norm_stats(x)[0], _head(g, 8), None, False)),
    ("rms_norm_bwd_inplace", "weight", lambda g, x: ops.rms_norm_bwd_inplace(g, x, g[5], _rms_rstd(x), None, False)),
    ("rms_norm_bwd_inplace", "rstd", lambda g, x: ops.rms_norm_bwd_inplace(g, x, None, _head(g, 8), None, False)),
]


@pytest.mark.parametrize("name,arg,call", BWD_ALIAS_CASES, ids=[f"{n}-{a}" for n, a, _ in BWD_ALIAS_CASES])
def test_bwd_inplace_refuses_an_argument_inside_grad_y(name, arg, call):
    _, x, _ = _inputs()
    grad_y = torch.rand(8, 6) + 0.5  # positive: a plausible rstd where a statistic is a slice of it
    before = grad_y.clone()
    with pytest.raises(RuntimeError, match=f"must not share memory with {arg}"):
        call(grad_y, x)
    assert torch.equal(grad_y, before)
