"""A registered op called on CPU tensors with one argument on the meta device dispatches to its
Meta kernel, which is its fake impl. The fakes refuse such a call naming the argument, as the
kernels refuse tensors on two devices; before 2026-12-07 most returned an uninitialised CPU tensor
of the right shape, silently. With every tensor on meta the ops still give shapes (the last test)."""

import pytest
import torch

import memopt  # noqa: F401  (registers torch.ops.memopt)

ops = torch.ops.memopt
KEY = torch.tensor([7, 0], dtype=torch.int64)  # the RNG key lives on the host for every device


def _x(*shape, device="cpu", dtype=torch.float32):
    return torch.randn(shape, device=device, dtype=dtype)


def _attention_args(device_of):
    """(grad_out, q, k, v, out, lse) on CPU but the named one(s), which go to meta."""
    names = ("grad_out", "q", "k", "v", "out")
    t = {n: _x(1, 2, 5, 4, device=device_of(n)) for n in names}
    t["lse"] = _x(1, 2, 5, device=device_of("lse"))
    return t


def _meta(name):
    return lambda n: "meta" if n == name else "cpu"


# (op called, the argument on meta, call(meta_name))
CASES = [
    ("bias_act_fwd", "bias", lambda: ops.bias_act_fwd(_x(3, 4), _x(4, device="meta"), "gelu")),
    ("bias_act_bwd", "grad_y", lambda: ops.bias_act_bwd(_x(3, 4, device="meta"), _x(3, 4), None, "gelu", False)),
    ("bias_act_bwd_inplace", "bias",
     lambda: ops.bias_act_bwd_inplace(_x(3, 4), _x(3, 4), _x(4, device="meta"), "silu", False)),
    ("swiglu_fwd", "bias", lambda: ops.swiglu_fwd(_x(3, 4), _x(4, device="meta"))),
    ("swiglu_bwd", "grad_y", lambda: ops.swiglu_bwd(_x(3, 2, device="meta"), _x(3, 4), None, False)),
    ("bias_act", "bias", lambda: ops.bias_act(_x(3, 4), _x(4, device="meta"), "relu")),
    ("swiglu", "bias", lambda: ops.swiglu(_x(3, 4), _x(4, device="meta"))),
    ("dropout_add_fwd", "residual", lambda: ops.dropout_add_fwd(_x(3, 4), _x(3, 4, device="meta"), 0.1, KEY)),
    ("layer_norm_fwd", "weight", lambda: ops.layer_norm_fwd(_x(3, 4), None, _x(4, device="meta"), None, 1e-5)),
    ("layer_norm_bwd", "grad_y",
     lambda: ops.layer_norm_bwd(_x(3, 4, device="meta"), _x(3, 4), None, None, _x(3), _x(3), None, False)),
    ("layer_norm_bwd_inplace", "mean",
     lambda: ops.layer_norm_bwd_inplace(_x(3, 4), _x(3, 4), None, None, _x(3, device="meta"), _x(3), None, False)),
    ("rms_norm_bwd", "rstd", lambda: ops.rms_norm_bwd(_x(3, 4), _x(3, 4), None, _x(3, device="meta"), None, False)),
    ("rms_norm_bwd_inplace", "grad_x_extra",
     lambda: ops.rms_norm_bwd_inplace(_x(3, 4), _x(3, 4), None, _x(3), _x(3, 4, device="meta"), False)),
    ("cpu_flash_attention_fwd", "k",
     lambda: (lambda t: ops.cpu_flash_attention_fwd(t["q"], t["k"], t["v"], True, 0.5))(_attention_args(_meta("k")))),
    ("cpu_flash_attention_bwd", "lse",
     lambda: (lambda t: ops.cpu_flash_attention_bwd(t["grad_out"], t["q"], t["k"], t["v"], t["out"], t["lse"], True,
                                                    0.5))(_attention_args(_meta("lse")))),
    ("attention_fwd", "v",
     lambda: (lambda t: ops.attention_fwd(t["q"], t["k"], t["v"], False, 0.0, 0.5, KEY))(_attention_args(_meta("v")))),
    ("attention_bwd_packed", "out",
     lambda: (lambda t: ops.attention_bwd_packed(t["grad_out"], t["q"], t["k"], t["v"], t["out"], t["lse"], False,
                                                 0.0, 0.5, KEY))(_attention_args(_meta("out")))),
    ("linear_cross_entropy_fwd", "weight",
     lambda: ops.linear_cross_entropy_fwd(_x(4, 8), _x(10, 8, device="meta"), None, torch.randint(0, 10, (4,)), -100,
                                          0.0, None, 2, torch.float32)),
]


@pytest.mark.parametrize("op,arg,call", CASES, ids=[c[0] for c in CASES])
def test_one_meta_argument_is_refused_naming_it(op, arg, call):
    with pytest.raises(ValueError, match=rf"memopt\.\w+: {arg} must be on (x|q|hidden)'s device \(cpu\), got meta"):
        call()


@pytest.mark.parametrize("op", ["attention_fwd", "cpu_flash_attention_fwd"])
def test_a_meta_rng_key_beside_cpu_data_is_refused(op):
    # The key lives on the host for every device; a meta key sends the call to the fake.
    t = _attention_args(lambda n: "cpu")
    key = torch.tensor([7, 0], dtype=torch.int64, device="meta")
    call = {
        "attention_fwd": lambda: ops.attention_fwd(t["q"], t["k"], t["v"], False, 0.1, 0.5, key),
        "cpu_flash_attention_fwd": lambda: ops.cpu_flash_attention_fwd(t["q"], t["k"], t["v"], False, 0.5, 0.1, key),
    }[op]
    with pytest.raises(ValueError, match=r"memopt\.attention: rng_key must be an int64 CPU tensor of 2 elements"):
        call()


def test_all_meta_arguments_still_give_shapes():
    x, bias = _x(3, 4, device="meta"), _x(4, device="meta")
    assert ops.bias_act(x, bias, "gelu").shape == (3, 4)
    assert ops.swiglu_fwd(x, bias).shape == (3, 2)
    assert ops.dropout_add_fwd(x, x, 0.1, KEY).device.type == "meta"
    grad_x, grad_w, grad_b, y = ops.layer_norm_bwd(x, x, bias, bias, _x(3, device="meta"), _x(3, device="meta"), None,
                                                   False)
    assert grad_x.shape == (3, 4) and grad_w.shape == (4,) and grad_x.device.type == "meta"
    t = _attention_args(lambda n: "meta")
    out, lse = ops.cpu_flash_attention_fwd(t["q"], t["k"], t["v"], True, 0.5)
    assert out.shape == (1, 2, 5, 4) and lse.shape == (1, 2, 5) and out.device.type == "meta"
