"""The public ops refuse bad arguments with TypeError/ValueError naming the public function and
the argument (the README's promise), before any kernel, whose own checks raise RuntimeError and
may name another op (act_linear runs bias_act's or swiglu's kernel, norm_linear a norm's)."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.ops._rng import rng_key


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def ints(*shape, dtype=torch.int64):
    return torch.ones(*shape, dtype=dtype)


F64 = torch.float64
CASES = [
    # bias_act
    ("bias_act-bias-float64-for-float32-x", lambda: memopt.bias_act(t(3, 8), t(8, dtype=F64)), ValueError,
     "memopt.bias_act: bias must have x's dtype (torch.float32) or float32, got torch.float64"),
    ("bias_act-bias-float16-for-float64-x", lambda: memopt.bias_act(t(3, 8, dtype=F64), t(8, dtype=torch.float16)),
     ValueError, "memopt.bias_act: bias must have x's dtype (torch.float64) or float32"),
    ("bias_act-x-int64", lambda: memopt.bias_act(ints(3, 8), None, "relu"), ValueError,
     "memopt.bias_act: x must be float32, float64, float16 or bfloat16, got torch.int64"),
    ("bias_act-x-bfloat16-on-cpu", lambda: memopt.bias_act(t(3, 8, dtype=torch.bfloat16)), ValueError,
     "memopt.bias_act: x is torch.bfloat16 on CPU"),
    ("bias_act-x-0d", lambda: memopt.bias_act(torch.tensor(1.0), None, "relu"), ValueError,
     "memopt.bias_act: x must have at least 1 dimension"),
    # swiglu
    ("swiglu-bias-float64-for-float32-x", lambda: memopt.swiglu(t(3, 8), t(8, dtype=F64)), ValueError,
     "memopt.swiglu: bias must have x's dtype (torch.float32) or float32, got torch.float64"),
    ("swiglu-x-int32", lambda: memopt.swiglu(ints(3, 8, dtype=torch.int32)), ValueError,
     "memopt.swiglu: x must be float32, float64, float16 or bfloat16"),
    ("swiglu-x-0d", lambda: memopt.swiglu(torch.tensor(1.0)), ValueError,
     "memopt.swiglu: x must have at least 1 dimension"),
    # act_linear: its own name, not that of the kernel it runs
    ("act_linear-bias-float64-for-float32-x", lambda: memopt.act_linear(t(3, 8), t(8, dtype=F64), t(4, 8)),
     ValueError, "memopt.act_linear: bias must have x's dtype (torch.float32) or float32, got torch.float64"),
    ("act_linear-swiglu-bias-float64", lambda: memopt.act_linear(t(3, 8), t(8, dtype=F64), t(4, 4), activation="swiglu"),
     ValueError, "memopt.act_linear: bias must have x's dtype"),
    ("act_linear-swiglu-x-int32",
     lambda: memopt.act_linear(ints(3, 8, dtype=torch.int32), None, ints(4, 4, dtype=torch.int32), activation="swiglu"),
     ValueError, "memopt.act_linear: x must be float32, float64, float16 or bfloat16, got torch.int32"),
    ("act_linear-x-int64", lambda: memopt.act_linear(ints(3, 8), None, ints(4, 8)), ValueError,
     "memopt.act_linear: x must be float32"),
    ("act_linear-x-0d", lambda: memopt.act_linear(torch.tensor(1.0), None, t(4, 8)), ValueError,
     "memopt.act_linear: x must have at least 1 dimension"),
    # layer_norm / rms_norm / norm_linear: x's shape, not a parameter's
    ("layer_norm-x-0d", lambda: memopt.layer_norm(torch.tensor(1.0)), ValueError,
     "memopt.layer_norm: x must have at least one dimension and a non-empty last dimension, got shape []"),
    ("layer_norm-x-0-columns", lambda: memopt.layer_norm(t(3, 0)), ValueError,
     "memopt.layer_norm: x must have at least one dimension and a non-empty last dimension, got shape [3, 0]"),
    ("rms_norm-x-0d", lambda: memopt.rms_norm(torch.tensor(1.0)), ValueError,
     "memopt.rms_norm: x must have at least one dimension"),
    ("norm_linear-x-0d", lambda: memopt.norm_linear(torch.tensor(1.0), None, None, t(4, 8)), ValueError,
     "memopt.norm_linear: x must have at least one dimension"),
    ("norm_linear-rmsnorm-x-0-columns", lambda: memopt.norm_linear(t(3, 0), None, None, t(4, 0), norm="rmsnorm"),
     ValueError, "memopt.norm_linear: x must have at least one dimension and a non-empty last dimension"),
    # dropout_add
    ("dropout_add-x-int64", lambda: memopt.dropout_add(ints(3), None, 0.5), ValueError,
     "memopt.dropout_add: x must be float32, float64, float16 or bfloat16, got torch.int64"),
    ("dropout_add-x-and-residual-int32", lambda: memopt.dropout_add(ints(3, dtype=torch.int32), ints(3, dtype=torch.int32), 0.5),
     ValueError, "memopt.dropout_add: x must be float32"),
    ("dropout_add-x-float16-on-cpu", lambda: memopt.dropout_add(t(3, dtype=torch.float16), None, 0.5), ValueError,
     "memopt.dropout_add: x is torch.float16 on CPU"),
    ("dropout_add-rng_key-int32", lambda: memopt.dropout_add(t(3), None, 0.5, rng_key=ints(2, dtype=torch.int32)),
     ValueError, "memopt.dropout_add: rng_key must be an int64 CPU tensor (seed, offset) of shape [2], got torch.int32"),
    # philox_keep_mask
    ("philox_keep_mask-index-None", lambda: memopt.ops.philox_mask.philox_keep_mask(None, 0.5, rng_key(1, 2)), TypeError,
     "memopt.philox_keep_mask: index must be a tensor, got NoneType"),
]


@pytest.mark.parametrize("call,error,phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_function_and_argument(call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert phrase in str(info.value), f"the message does not say {phrase!r}: {info.value}"


def test_what_the_checks_let_through_still_runs():
    # float32 bias beside float64 x, dropout of an int x mixed with a float residual (promoted),
    # an int x outside training: accepted as before, with the reference result.
    x, bias = t(3, 8, dtype=F64), t(8)
    torch.testing.assert_close(memopt.bias_act(x, bias, "relu"), torch.relu(x + bias.double()), rtol=0, atol=0)
    key = rng_key(3)
    out = memopt.dropout_add(ints(8, dtype=torch.int32), torch.zeros(8, dtype=F64), 0.5, rng_key=key)
    expected = memopt.dropout_add(torch.ones(8, dtype=F64), torch.zeros(8, dtype=F64), 0.5, rng_key=key)
    assert out.dtype == F64 and torch.equal(out, expected)
    assert torch.equal(memopt.dropout_add(ints(4), ints(4), 0.5, training=False), ints(4) * 2)
