"""Bad input gets an error that names the argument and what was expected.

One table row per (public function, kind of bad input): None or a list where a tensor is due, a
wrong dtype, a string/None/NaN number, a bool where a size is due, NaN/inf memory, an empty
example. Each row asserts the exception type and that the message names the argument.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import memopt
from memopt.estimate import ModelConfig

SMALL = dict(n_layers=2, d_model=64, n_heads=2, vocab_size=100, seq_len=32, micro_batch=2)


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _model():
    return torch.nn.Linear(8, 2)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _mse(model, batch):
    return model(batch).pow(2).mean()


def _adaptive(**kwargs):
    model = _model()
    return memopt.AdaptiveBatch(model, _sgd(model), _mse, **kwargs)


# (id, call, exception type, a phrase the message must hold: the argument's name)
CASES = [
    # layer_norm / rms_norm
    ("layer_norm-x-None", lambda: memopt.layer_norm(None), TypeError, "x must be a tensor"),
    ("layer_norm-x-list", lambda: memopt.layer_norm([[1.0, 2.0]]), TypeError, "x must be a tensor"),
    ("layer_norm-weight-list", lambda: memopt.layer_norm(t(3, 8), weight=[1.0] * 8), TypeError, "weight must be a tensor"),
    ("layer_norm-bias-list", lambda: memopt.layer_norm(t(3, 8), t(8), [0.0] * 8), TypeError, "bias must be a tensor"),
    ("layer_norm-residual-list", lambda: memopt.layer_norm(t(3, 8), residual=[0.0]), TypeError,
     "residual must be a tensor"),
    ("layer_norm-eps-str", lambda: memopt.layer_norm(t(3, 8), eps="abc"), TypeError, "eps must be a real number"),
    ("layer_norm-eps-None", lambda: memopt.layer_norm(t(3, 8), eps=None), TypeError, "eps must be a real number"),
    ("layer_norm-eps-bool", lambda: memopt.layer_norm(t(3, 8), eps=True), TypeError, "eps must be a real number"),
    ("layer_norm-eps-nan", lambda: memopt.layer_norm(t(3, 8), eps=math.nan), ValueError, "eps must be a finite"),
    ("layer_norm-eps-negative", lambda: memopt.layer_norm(t(3, 8), eps=-1e-5), ValueError, "eps must be a finite"),
    ("layer_norm-weight-shape", lambda: memopt.layer_norm(t(3, 8), t(7)), ValueError, "weight must have shape [8]"),
    ("rms_norm-x-None", lambda: memopt.rms_norm(None), TypeError, "x must be a tensor"),
    ("rms_norm-weight-list", lambda: memopt.rms_norm(t(3, 8), [1.0] * 8), TypeError, "weight must be a tensor"),
    ("rms_norm-eps-str", lambda: memopt.rms_norm(t(3, 8), eps="abc"), TypeError, "eps must be a real number"),
    ("rms_norm-eps-inf", lambda: memopt.rms_norm(t(3, 8), eps=math.inf), ValueError, "eps must be a finite"),
    # norm_linear
    ("norm_linear-x-None", lambda: memopt.norm_linear(None, None, None, t(4, 8)), TypeError, "x must be a tensor"),
    ("norm_linear-norm_weight-list", lambda: memopt.norm_linear(t(3, 8), [1.0] * 8, None, t(4, 8)), TypeError,
     "norm_weight must be a tensor"),
    ("norm_linear-linear_weight-None", lambda: memopt.norm_linear(t(3, 8), None, None, None), TypeError,
     "linear_weight must be a tensor"),
    ("norm_linear-linear_weight-list", lambda: memopt.norm_linear(t(3, 8), None, None, [[0.0] * 8]), TypeError,
     "linear_weight must be a tensor"),
    ("norm_linear-linear_bias-list", lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8), [0.0] * 4), TypeError,
     "linear_bias must be a tensor"),
    ("norm_linear-linear_weight-dtype", lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8, dtype=torch.float64)),
     ValueError, "linear_weight must have x's dtype"),
    ("norm_linear-linear_bias-dtype",
     lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8), t(4, dtype=torch.float64)),
     ValueError, "linear_bias must have x's dtype"),
    ("norm_linear-linear_weight-meta", lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8, device="meta")),
     ValueError, "linear_weight must be on x's device"),
    ("norm_linear-linear_bias-meta",
     lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8), t(4, device="meta")),
     ValueError, "linear_bias must be on x's device"),
    ("norm_linear-eps-str", lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8), eps="abc"), TypeError,
     "eps must be a real number"),
    ("norm_linear-norm-unknown", lambda: memopt.norm_linear(t(3, 8), None, None, t(4, 8), norm=None), ValueError,
     "norm must be one of"),
    # bias_act / swiglu / act_linear
    ("bias_act-x-None", lambda: memopt.bias_act(None), TypeError, "x must be a tensor"),
    ("bias_act-x-list", lambda: memopt.bias_act([1.0, 2.0]), TypeError, "x must be a tensor"),
    ("bias_act-bias-list", lambda: memopt.bias_act(t(3, 4), [0.0] * 4), TypeError, "bias must be a tensor"),
    ("bias_act-activation-None", lambda: memopt.bias_act(t(3, 4), None, None), ValueError, "activation must be one of"),
    ("swiglu-x-None", lambda: memopt.swiglu(None), TypeError, "x must be a tensor"),
    ("swiglu-bias-list", lambda: memopt.swiglu(t(3, 8), [0.0] * 8), TypeError, "bias must be a tensor"),
    ("act_linear-x-None", lambda: memopt.act_linear(None, None, t(2, 4)), TypeError, "x must be a tensor"),
    ("act_linear-bias-list", lambda: memopt.act_linear(t(3, 4), [0.0] * 4, t(2, 4)), TypeError,
     "bias must be a tensor"),
    ("act_linear-linear_weight-None", lambda: memopt.act_linear(t(3, 4), None, None), TypeError,
     "linear_weight must be a tensor"),
    ("act_linear-linear_weight-dtype", lambda: memopt.act_linear(t(3, 4), None, t(2, 4, dtype=torch.float64)),
     ValueError, "linear_weight must have x's dtype"),
    ("act_linear-linear_bias-list", lambda: memopt.act_linear(t(3, 4), None, t(2, 4), [0.0, 0.0]), TypeError,
     "linear_bias must be a tensor"),
    ("act_linear-linear_bias-dtype",
     lambda: memopt.act_linear(t(3, 4), None, t(2, 4), t(2, dtype=torch.float16)),
     ValueError, "linear_bias must have x's dtype"),
    # dropout_add
    ("dropout_add-x-None", lambda: memopt.dropout_add(None, None, 0.1), TypeError, "x must be a tensor"),
    ("dropout_add-residual-list", lambda: memopt.dropout_add(t(3), [1.0, 2.0, 3.0], 0.1), TypeError,
     "residual must be a tensor"),
    ("dropout_add-p-str", lambda: memopt.dropout_add(t(3), None, "abc"), TypeError, "p must be a float"),
    ("dropout_add-p-None", lambda: memopt.dropout_add(t(3), None, None), TypeError, "p must be a float"),
    ("dropout_add-p-bool", lambda: memopt.dropout_add(t(3), None, True), TypeError, "p must be a float"),
    ("dropout_add-p-nan", lambda: memopt.dropout_add(t(3), None, math.nan), ValueError, "p must be a float"),
    ("dropout_add-training-str", lambda: memopt.dropout_add(t(3), None, 0.1, training="no"), TypeError,
     "training must be a bool"),
    ("dropout_add-rng_key-list", lambda: memopt.dropout_add(t(3), None, 0.1, rng_key=[1, 2]), TypeError,
     "rng_key must be a tensor"),
    # ModelConfig / estimate / max_micro_batch / max_seq_len / register_policy_formula
    ("ModelConfig-d_ff-bool", lambda: ModelConfig(**SMALL, d_ff=True), ValueError, "d_ff must be a positive int"),
    ("ModelConfig-n_layers-bool", lambda: ModelConfig(**{**SMALL, "n_layers": True}), ValueError,
     "n_layers must be a positive int"),
    ("ModelConfig-d_model-float", lambda: ModelConfig(**{**SMALL, "d_model": 64.0}), ValueError,
     "d_model must be a positive int"),
    ("ModelConfig-dtype-int", lambda: ModelConfig(**SMALL, dtype=torch.int32), ValueError, "dtype must be"),
    ("ModelConfig-dtype-None", lambda: ModelConfig(**SMALL, dtype=None), ValueError, "dtype must be"),
    ("ModelConfig-low_dtype-int", lambda: ModelConfig(**SMALL, low_dtype=torch.int8), ValueError, "low_dtype must be"),
    ("ModelConfig-low_dtype-fp64", lambda: ModelConfig(**SMALL, low_dtype=torch.float64), ValueError,
     "low_dtype must be"),
    ("ModelConfig-dropout-str", lambda: ModelConfig(**SMALL, dropout="a"), ValueError, "dropout must be a number"),
    ("ModelConfig-dropout-nan", lambda: ModelConfig(**SMALL, dropout=math.nan), ValueError, "dropout must be a number"),
    ("ModelConfig-dropout-bool", lambda: ModelConfig(**SMALL, dropout=False), ValueError, "dropout must be a number"),
    ("ModelConfig-optimizer-list", lambda: ModelConfig(**SMALL, optimizer=["adam"]), ValueError,
     "optimizer must be one of"),
    ("ModelConfig-precision-None", lambda: ModelConfig(**SMALL, precision=None), ValueError, "precision must be one of"),
    ("ModelConfig-policy-int", lambda: ModelConfig(**SMALL, policy=5), ValueError, "policy must be a str"),
    ("estimate-example_input-empty", lambda: memopt.estimate(_model(), torch.randn(0, 8)), ValueError,
     "example_input must hold at least one sample"),
    ("estimate-example_input-empty-micro_batch", lambda: memopt.estimate(_model(), torch.randn(0, 8), micro_batch=4),
     ValueError, "example_input must hold at least one sample"),
    ("estimate-example_input-None", lambda: memopt.estimate(_model(), None), ValueError, "example_input is required"),
    ("estimate-micro_batch-bool", lambda: memopt.estimate(_model(), torch.randn(2, 8), micro_batch=True), ValueError,
     "micro_batch must be a positive int"),
    ("estimate-loss_fn-str", lambda: memopt.estimate(_model(), torch.randn(2, 8), loss_fn="mse"), TypeError,
     "loss_fn must be callable"),
    ("estimate-optimizer-list", lambda: memopt.estimate(_model(), torch.randn(2, 8), optimizer=["adam"]), ValueError,
     "optimizer must be one of"),
    ("estimate-config-str", lambda: memopt.estimate("gpt2"), TypeError, "config must be a ModelConfig"),
    ("max_micro_batch-memory_bytes-nan", lambda: memopt.max_micro_batch(math.nan, ModelConfig(**SMALL)), ValueError,
     "memory_bytes must be a positive finite number"),
    ("max_micro_batch-memory_bytes-inf", lambda: memopt.max_micro_batch(math.inf, ModelConfig(**SMALL)), ValueError,
     "memory_bytes must be a positive finite number"),
    ("max_micro_batch-memory_bytes-str", lambda: memopt.max_micro_batch("8GB", ModelConfig(**SMALL)), TypeError,
     "memory_bytes must be a positive finite number"),
    ("max_micro_batch-memory_bytes-bool", lambda: memopt.max_micro_batch(True, ModelConfig(**SMALL)), TypeError,
     "memory_bytes must be a positive finite number"),
    ("max_micro_batch-config-dict", lambda: memopt.max_micro_batch(2**30, dict(SMALL)), TypeError,
     "config must be a memopt.ModelConfig"),
    ("max_micro_batch-upper-bool", lambda: memopt.max_micro_batch(2**30, ModelConfig(**SMALL), upper=True), ValueError,
     "upper must be a positive int"),
    ("max_seq_len-memory_bytes-nan", lambda: memopt.max_seq_len(math.nan, ModelConfig(**SMALL)), ValueError,
     "memory_bytes must be a positive finite number"),
    ("max_seq_len-policy-int", lambda: memopt.max_seq_len(2**30, ModelConfig(**SMALL), policy=3), TypeError,
     "policy must be a str"),
    ("register_policy_formula-fn-None", lambda: memopt.register_policy_formula("x", None), TypeError,
     "fn must be callable"),
    ("register_policy_formula-name-None", lambda: memopt.register_policy_formula(None, dict), ValueError,
     "name must be a non-empty str"),
    # diagnose_oom (report.py), offload (offload.py)
    ("diagnose_oom-memory_bytes-nan",
     lambda: memopt.diagnose_oom(torch.OutOfMemoryError("x"), config=ModelConfig(**SMALL), memory_bytes=math.nan),
     ValueError, "memory_bytes must be a positive finite number"),
    ("diagnose_oom-memory_bytes-str",
     lambda: memopt.diagnose_oom(torch.OutOfMemoryError("x"), config=ModelConfig(**SMALL), memory_bytes="80GB"),
     TypeError, "memory_bytes must be a positive finite number"),
    ("diagnose_oom-config-dict", lambda: memopt.diagnose_oom(torch.OutOfMemoryError("x"), config=dict(SMALL)),
     TypeError, "config must be a memopt.ModelConfig"),
    ("diagnose_oom-exc-str", lambda: memopt.diagnose_oom("out of memory"), TypeError, "exc must be an exception"),
    ("offload-prefetch-huge", lambda: memopt.offload(prefetch=2**63), ValueError, "prefetch must be a non-negative int"),
    ("offload-prefetch-bool", lambda: memopt.offload(prefetch=True), ValueError, "prefetch must be a non-negative int"),
    ("OffloadEngine-max_host_bytes-huge", lambda: memopt.OffloadEngine(max_host_bytes=2**64), ValueError,
     "max_host_bytes must be"),
    ("OffloadEngine.pack-tensor-None", lambda: memopt.OffloadEngine().pack(None), TypeError,
     "tensor must be a tensor"),
    ("OffloadEngine.pack-tensor-list", lambda: memopt.OffloadEngine().pack([1.0]), TypeError,
     "tensor must be a tensor"),
    # AdaptiveBatch
    ("AdaptiveBatch-micro_batch-bool", lambda: _adaptive(micro_batch=True), ValueError,
     "micro_batch must be a positive int"),
    ("AdaptiveBatch-min_micro_batch-bool", lambda: _adaptive(min_micro_batch=True), ValueError,
     "min_micro_batch must be a positive int"),
    ("AdaptiveBatch-grow_after-bool", lambda: _adaptive(grow_after=True), ValueError,
     "grow_after must be a positive int"),
    ("AdaptiveBatch-grad_scaler-str", lambda: _adaptive(grad_scaler="x"), TypeError,
     "grad_scaler must be a torch.amp.GradScaler"),
    ("AdaptiveBatch-num_tokens-int", lambda: _adaptive(num_tokens=5), TypeError, "num_tokens must be callable"),
    ("AdaptiveBatch-loss_fn-None", lambda: memopt.AdaptiveBatch(_model(), _sgd(_model()), None), TypeError,
     "loss_fn must be callable"),
    ("AdaptiveBatch-optimizer-None", lambda: memopt.AdaptiveBatch(_model(), None, _mse), TypeError,
     "optimizer must be a torch.optim.Optimizer"),
    ("AdaptiveBatch.step-num_tokens-negative",
     lambda: _adaptive(micro_batch=2, num_tokens=lambda b: 1 if b.shape[0] == 4 else (-1 if b[0, 0] > 0 else 3))
     .step(torch.cat([torch.ones(2, 8), -torch.ones(2, 8)])),
     ValueError, "num_tokens must return a non-negative int"),
    ("AdaptiveBatch.step-num_tokens-float", lambda: _adaptive(num_tokens=lambda b: 2.5).step(torch.randn(4, 8)),
     ValueError, "num_tokens must return a non-negative int"),
    ("AdaptiveBatch.step-num_tokens-not-additive",
     lambda: _adaptive(micro_batch=2, num_tokens=lambda b: 10).step(torch.randn(4, 8)),
     ValueError, "num_tokens is not additive"),
    ("AdaptiveBatch.step-batch-None", lambda: _adaptive().step(None), TypeError, "batch must be a tensor"),
]


@pytest.mark.parametrize("call,error,phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), f"the message does not say {phrase!r}: {info.value}"


def test_bad_step_leaves_model_and_gradients_unchanged():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stepper = memopt.AdaptiveBatch(model, _sgd(model), _mse, micro_batch=2, num_tokens=lambda b: 10)
    with pytest.raises(ValueError, match="num_tokens is not additive"):
        stepper.step(torch.randn(4, 8))
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_cli_memory_gib_must_be_positive_and_finite(value, capsys):
    from memopt.cli import main

    assert main(["estimate", "--preset", "gpt2", "--micro-batch", "1", "--memory-gib", value]) == 2
    err = capsys.readouterr().err
    assert "--memory-gib must be a positive finite number" in err and "Traceback" not in err


def test_linear_dtypes_follow_autocast():
    """Under autocast the linear weight may differ from x (autocast casts both), as in F.linear."""
    x, w = t(3, 8), t(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = memopt.norm_linear(x, None, None, w)
        ref = F.linear(F.layer_norm(x, (8,)), w)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="under torch.autocast x and linear_weight must be"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            memopt.norm_linear(x, None, None, t(4, 8, dtype=torch.float64))



@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("seq_q,seq_k", [(4, 6), (6, 4)])
def test_cpu_flash_bwd_packed_refuses_cross_attention(seq_q, seq_k, fake):
    # The op packs grad_q, grad_k and grad_v into one (B, seq_q, H + 2 Hkv, D) buffer: with
    # seq_k > seq_q the kernel wrote seq_k rows of grad_k / grad_v past its end (heap corruption),
    # with seq_k < seq_q it returned rows that are no gradient. The op and its fake impl refuse.
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    q, k, v = t(1, 2, seq_q, 8), t(1, 2, seq_k, 8), t(1, 2, seq_k, 8)
    out, lse = torch.ops.memopt.cpu_flash_attention_fwd(q, k, v, False, 0.35)
    args = (torch.randn_like(out), q, k, v, out, lse)
    with contextlib.ExitStack() as stack:
        if fake:
            mode = stack.enter_context(FakeTensorMode())
            args = tuple(mode.from_tensor(a) for a in args)
        with pytest.raises(ValueError) as info:
            torch.ops.memopt.cpu_flash_attention_bwd_packed(*args, False, 0.35)
    message = str(info.value)
    assert "cpu_flash_attention_bwd_packed" in message and f"got {seq_q} and {seq_k}" in message, message


def test_attention_bwd_packed_fake_refuses_cross_attention():
    # The real op refuses seq_q != seq_k (its packed layout has seq_q rows); under a
    # FakeTensorMode its fake returned a buffer of that layout instead.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 2, 4, 8), torch.empty(1, 2, 6, 8)
        out, lse = torch.empty_like(q), torch.empty(1, 2, 4)
        with pytest.raises(ValueError, match="attention_bwd_packed: .* got 4 and 6"):
            torch.ops.memopt.attention_bwd_packed(out, q, k, k, out, lse, False, 0.0, 0.35, torch.zeros(2, dtype=torch.int64))


def test_norm_linear_op_names_itself_for_bad_norm_parameters():
    # The op's norm ran memopt.layer_norm's forward op, whose errors named that op and its
    # weight / bias; norm_linear checks its norm parameters itself, under its own names.
    x, w = t(3, 8), t(4, 8)
    for norm_weight, norm_bias, phrase in ((t(7), None, "memopt.norm_linear: norm_weight must have shape [8]"),
                                           (t(8), t(7), "memopt.norm_linear: norm_bias must have shape [8]"),
                                           (t(8, dtype=torch.float64), None,
                                            "memopt.norm_linear: norm_weight must have x's dtype")):
        with pytest.raises(RuntimeError) as info:
            torch.ops.memopt.norm_linear(x, None, norm_weight, norm_bias, w, None, False, 1e-5)
        assert phrase in str(info.value), str(info.value)
