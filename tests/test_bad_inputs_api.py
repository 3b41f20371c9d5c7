"""The bad-input table, second part: every public name of ``memopt`` is in a table.

tests/test_bad_inputs.py holds the ops, the estimator, AdaptiveBatch and offload's first rows;
this file adds the rest (attention, linear_cross_entropy, checkpoint, wrap with loss=, unwrap,
plan, Plan, LayerCost, saved_bytes, SavedTensorCounter, the block and stack's inputs, the eager
block, Offload, OffloadEngine, offload_module_groups, memory_report), and a test that no public
name is missing from the tables. Each row asserts the exception type and that the message names
the argument. Rows marked "(fixed)" failed that before this file (no error, or one naming nothing).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memopt
from test_bad_inputs import CASES as FIRST_TABLE


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _ids(n=3):
    return torch.zeros(n, dtype=torch.long)


def _two_linears():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _cost(nbytes=1):
    return memopt.LayerCost({("none", False): nbytes}, {("none", False): 0}, {("none", False): 0.0})


Q = t(1, 2, 8, 16)

CASES = [
    # attention
    ("attention-q-None", lambda: memopt.attention(None, Q, Q), TypeError, "q must be a tensor"),
    ("attention-k-list", lambda: memopt.attention(Q, [1.0], Q), TypeError, "k must be a tensor"),
    ("attention-v-dtype", lambda: memopt.attention(Q, Q, Q.double()), ValueError, "q, k and v must have one dtype"),
    ("attention-scale-str", lambda: memopt.attention(Q, Q, Q, scale="abc"), TypeError, "scale must be a finite"),
    ("attention-scale-nan", lambda: memopt.attention(Q, Q, Q, scale=math.nan), TypeError, "scale must be a finite"),
    ("attention-dropout_p-str", lambda: memopt.attention(Q, Q, Q, dropout_p="0.1"), ValueError, "dropout_p must be"),
    ("attention-dropout_p-negative", lambda: memopt.attention(Q, Q, Q, dropout_p=-0.1), ValueError, "dropout_p must be"),
    ("attention-dropout_p-nan", lambda: memopt.attention(Q, Q, Q, dropout_p=math.nan), ValueError, "dropout_p must be"),
    ("attention-causal-str", lambda: memopt.attention(Q, Q, Q, causal="yes"), TypeError, "causal must be a bool"),
    ("attention-backend-unknown", lambda: memopt.attention(Q, Q, Q, backend="bogus"), ValueError, "backend must be one of"),
    ("attention-k-shape", lambda: memopt.attention(Q, t(1, 2, 8, 8), Q), ValueError, "k and v must have the same shape"),
    # linear_cross_entropy
    ("linear_cross_entropy-hidden-None", lambda: memopt.linear_cross_entropy(None, t(10, 8), _ids()), TypeError,
     "hidden must be a tensor"),
    ("linear_cross_entropy-weight-list", lambda: memopt.linear_cross_entropy(t(3, 8), [[0.0] * 8], _ids()), TypeError,
     "weight must be a tensor"),
    ("linear_cross_entropy-target-None", lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), None), TypeError,
     "target must be a tensor"),
    ("linear_cross_entropy-target-float", lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), torch.zeros(3)),
     TypeError, "target must be an integer tensor"),
    ("linear_cross_entropy-target-shape", lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(4)), ValueError,
     "target must have shape (3,)"),
    ("linear_cross_entropy-weight-dtype",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8, dtype=torch.float64), _ids()), TypeError,
     "weight must have hidden's dtype"),
    ("linear_cross_entropy-weight-width", lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 7), _ids()), ValueError,
     "weight must have shape (vocab, 8)"),
    ("linear_cross_entropy-bias-list",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), bias=[0.0] * 10), TypeError, "bias must be a tensor"),
    ("linear_cross_entropy-reduction-unknown",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), reduction="avg"), ValueError, "reduction must be one of"),
    ("linear_cross_entropy-label_smoothing-str",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), label_smoothing="x"), ValueError,
     "label_smoothing must be a float"),
    ("linear_cross_entropy-label_smoothing-nan",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), label_smoothing=math.nan), ValueError,
     "label_smoothing must be a float"),
    ("linear_cross_entropy-label_smoothing-2",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), label_smoothing=2.0), ValueError,
     "label_smoothing must be a float"),
    ("linear_cross_entropy-ignore_index-bool",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), ignore_index=True), TypeError,
     "ignore_index must be an int"),
    ("linear_cross_entropy-ignore_index-float",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), ignore_index=1.5), TypeError,
     "ignore_index must be an int"),
    ("linear_cross_entropy-logit_softcap-negative",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), logit_softcap=-1.0), ValueError,
     "logit_softcap must be None or a finite float > 0"),
    ("linear_cross_entropy-logit_softcap-str",
     lambda: memopt.linear_cross_entropy(t(3, 8), t(10, 8), _ids(), logit_softcap="a"), ValueError,
     "logit_softcap must be None or a finite float > 0"),
    # checkpoint
    ("checkpoint-fn-None", lambda: memopt.checkpoint(None, t(2)), TypeError, "fn must be callable"),
    ("checkpoint-policy-unknown", lambda: memopt.checkpoint(nn.Linear(4, 4), t(2, 4), policy="bogus"), ValueError,
     "policy must be one of"),
    ("checkpoint-policy-None", lambda: memopt.checkpoint(nn.Linear(4, 4), t(2, 4), policy=None), ValueError,
     "policy must be one of"),
    ("checkpoint-offload-str", lambda: memopt.checkpoint(nn.Linear(4, 4), t(2, 4), offload="no"), TypeError,
     "offload must be False, True or a memopt.Offload"),
    ("checkpoint-preserve_rng_state-str (fixed)",
     lambda: memopt.checkpoint(nn.Linear(4, 4), t(2, 4), preserve_rng_state="yes"), TypeError,
     "preserve_rng_state must be a bool"),
    ("checkpoint-determinism_check-unknown (fixed)",
     lambda: memopt.checkpoint(nn.Linear(4, 4), t(2, 4), determinism_check="bogus"), ValueError,
     "memopt.checkpoint: determinism_check must be 'default' or 'none'"),
    # wrap / unwrap
    ("wrap-model-None", lambda: memopt.wrap(None), TypeError, "model must be an nn.Module"),
    ("wrap-policy-unknown", lambda: memopt.wrap(_two_linears(), policy="bogus"), ValueError,
     "policy for layer '0' must be one of"),
    ("wrap-policy-int", lambda: memopt.wrap(_two_linears(), policy=5), TypeError, "policy must be a string or a policy function, a list or a dict"),
    ("wrap-offload-str", lambda: memopt.wrap(_two_linears(), offload="no"), TypeError, "offload must be a bool"),
    ("wrap-layers-str", lambda: memopt.wrap(_two_linears(), layers="Linear"), TypeError, "layers must be None, a class"),
    ("wrap-loss-unknown", lambda: memopt.wrap(_two_linears(), loss="bogus"), ValueError,
     "loss must be None, 'chunked' or 'plain'"),
    ("wrap-loss-bool", lambda: memopt.wrap(_two_linears(), loss=True), ValueError, "loss must be None, 'chunked' or 'plain'"),
    ("wrap-loss-chunked-not-a-causal-lm", lambda: memopt.wrap(_two_linears(), loss="chunked"), ValueError,
     "loss='chunked' needs a Hugging Face causal LM"),
    ("wrap-budget_bytes-str", lambda: memopt.wrap(_two_linears(), budget_bytes="1e9", example_inputs=(t(2, 4),)),
     ValueError, "budget_bytes must be a non-negative int"),
    ("wrap-budget_bytes-negative", lambda: memopt.wrap(_two_linears(), budget_bytes=-1, example_inputs=(t(2, 4),)),
     ValueError, "budget_bytes must be a non-negative int"),
    ("wrap-budget_bytes-without-example_inputs", lambda: memopt.wrap(_two_linears(), budget_bytes=10), ValueError,
     "budget_bytes needs example_inputs"),
    ("wrap-plan-dict", lambda: memopt.wrap(_two_linears(), plan={}), TypeError, "plan must be a memopt.Plan"),
    ("unwrap-model-None (fixed)", lambda: memopt.unwrap(None), TypeError, "memopt.unwrap: model must be an nn.Module"),
    ("unwrap-model-not-wrapped", lambda: memopt.unwrap(nn.Linear(2, 2)), ValueError, "model is not wrapped"),
    # plan, Plan, LayerCost
    ("plan-model-None (fixed)", lambda: memopt.plan(None, (t(2, 4),), 10), TypeError,
     "memopt.plan: model must be an nn.Module"),
    ("plan-budget_bytes-str", lambda: memopt.plan(_two_linears(), (t(2, 4),), "10"), ValueError,
     "budget_bytes must be a non-negative int"),
    ("plan-budget_bytes-nan", lambda: memopt.plan(_two_linears(), (t(2, 4),), math.nan), ValueError,
     "budget_bytes must be a non-negative int"),
    ("plan-budget_bytes-bool", lambda: memopt.plan(_two_linears(), (t(2, 4),), True), ValueError,
     "budget_bytes must be a non-negative int"),
    ("plan-repeats-0", lambda: memopt.plan(_two_linears(), (t(2, 4),), 10**6, repeats=0), ValueError,
     "repeats must be a positive int"),
    ("plan-choices-unknown-policy", lambda: memopt.plan(_two_linears(), (t(2, 4),), 10**6, choices=[("bogus", False)]),
     ValueError, "policy must be one of"),
    ("plan-choices-str", lambda: memopt.plan(_two_linears(), (t(2, 4),), 10**6, choices="full"), ValueError,
     "a choice must be a (policy, offload) pair"),
    ("plan-offload-str", lambda: memopt.plan(_two_linears(), (t(2, 4),), 10**6, offload="yes"), TypeError,
     "offload must be False, True or a memopt.Offload"),
    ("Plan.from_dict-data-None (fixed)", lambda: memopt.Plan.from_dict(None), TypeError,
     "memopt.Plan.from_dict: data must be a dict"),
    ("Plan.check-choice-unknown", lambda: memopt.Plan(["a"], [("bogus", False)], [_cost()], 0).check(), ValueError,
     "layer 'a': policy must be one of"),
    ("LayerCost.check-device_bytes-negative", lambda: _cost(-1).check(), ValueError,
     "device_bytes[('none', False)] must be a non-negative int"),
    # saved_bytes, SavedTensorCounter
    ("saved_bytes-fn-None (fixed)", lambda: memopt.saved_bytes(None), TypeError, "memopt.saved_bytes: fn must be callable"),
    ("saved_bytes-exclude-int (fixed)", lambda: memopt.saved_bytes(nn.Linear(4, 4), t(2, 4), exclude=5), TypeError,
     "exclude must be an iterable of tensors"),
    ("SavedTensorCounter-exclude-int (fixed)", lambda: memopt.SavedTensorCounter(exclude=5), TypeError,
     "exclude must be an iterable of tensors"),
    ("SavedTensorCounter-exclude-str-elements (fixed)", lambda: memopt.SavedTensorCounter(exclude=["a"]), TypeError,
     "exclude must be an iterable of tensors (or None), got elements of type str"),
    ("SavedTensorCounter-on_save-str (fixed)", lambda: memopt.SavedTensorCounter(on_save="x"), TypeError,
     "on_save must be callable or None"),
    # FusedCheckpointBlock / FusedCheckpointStack / EagerTransformerBlock
    ("FusedCheckpointBlock-x-None (fixed)", lambda: memopt.FusedCheckpointBlock(32, 2)(None), TypeError,
     "x must be a floating-point tensor"),
    ("FusedCheckpointBlock-x-list (fixed)", lambda: memopt.FusedCheckpointBlock(32, 2)([[1.0] * 32]), TypeError,
     "x must be a floating-point tensor"),
    ("FusedCheckpointBlock-x-int (fixed)",
     lambda: memopt.FusedCheckpointBlock(32, 2)(torch.zeros(1, 4, 32, dtype=torch.long)), TypeError,
     "x must be a floating-point tensor, got a torch.int64 tensor"),
    ("FusedCheckpointBlock-x-width", lambda: memopt.FusedCheckpointBlock(32, 2)(t(1, 4, 31)), ValueError,
     "x must be (batch, seq, d_model) with d_model=32"),
    ("FusedCheckpointBlock-eps-str (fixed)", lambda: memopt.FusedCheckpointBlock(32, 2, eps="x"), ValueError,
     "eps must be a non-negative finite float"),
    ("FusedCheckpointBlock-eps-nan (fixed)", lambda: memopt.FusedCheckpointBlock(32, 2, eps=math.nan), ValueError,
     "eps must be a non-negative finite float"),
    ("FusedCheckpointBlock-policy-unknown", lambda: memopt.FusedCheckpointBlock(32, 2, policy="bogus"), ValueError,
     "policy must be one of"),
    ("FusedCheckpointBlock-dropout-str", lambda: memopt.FusedCheckpointBlock(32, 2, dropout="x"), ValueError,
     "dropout must be a float in [0, 1)"),
    ("FusedCheckpointBlock-d_model-negative", lambda: memopt.FusedCheckpointBlock(-32, 2), ValueError,
     "d_model must be a positive int"),
    ("FusedCheckpointBlock-d_model-float", lambda: memopt.FusedCheckpointBlock(32.0, 2), ValueError,
     "d_model must be a positive int"),
    ("FusedCheckpointBlock-n_heads-indivisible", lambda: memopt.FusedCheckpointBlock(32, 3), ValueError,
     "d_model (32) must be divisible by n_heads (3)"),
    ("FusedCheckpointBlock-activation-unknown", lambda: memopt.FusedCheckpointBlock(32, 2, activation="bogus"), ValueError,
     "activation must be one of"),
    ("FusedCheckpointStack-x-None (fixed)", lambda: memopt.FusedCheckpointStack(2, 32, 2)(None), TypeError,
     "x must be a floating-point tensor"),
    ("FusedCheckpointStack-n_layers-negative", lambda: memopt.FusedCheckpointStack(-1, 32, 2), ValueError,
     "n_layers must be a positive int"),
    ("EagerTransformerBlock-d_model-None", lambda: memopt.EagerTransformerBlock(None, 2), ValueError,
     "d_model must be a positive int"),
    ("EagerTransformerBlock-attention-unknown", lambda: memopt.EagerTransformerBlock(32, 2, attention="bogus"),
     ValueError, "attention must be one of"),
    # Offload, OffloadEngine, offload_module_groups
    ("Offload-prefetch-huge", lambda: memopt.Offload(prefetch=2**63), ValueError, "prefetch must be a non-negative int"),
    ("Offload-prefetch-negative", lambda: memopt.Offload(prefetch=-1), ValueError, "prefetch must be a non-negative int"),
    ("Offload-min_bytes-str", lambda: memopt.Offload(min_bytes="1"), ValueError, "min_bytes must be a non-negative int"),
    ("Offload-min_bytes-nan", lambda: memopt.Offload(min_bytes=math.nan), ValueError, "min_bytes must be a non-negative int"),
    ("Offload-max_host_bytes-negative", lambda: memopt.Offload(max_host_bytes=-1), ValueError,
     "max_host_bytes must be a non-negative int"),
    ("Offload-coalesce_bytes-bool", lambda: memopt.Offload(coalesce_bytes=True), ValueError,
     "coalesce_bytes must be a non-negative int"),
    ("Offload-pin_memory-str (fixed)", lambda: memopt.Offload(pin_memory="yes"), TypeError, "pin_memory must be a bool"),
    ("OffloadEngine-allow_cpu_source-str (fixed)", lambda: memopt.OffloadEngine(allow_cpu_source="no"), TypeError,
     "allow_cpu_source must be a bool"),
    ("OffloadEngine-max_host_bytes-str", lambda: memopt.OffloadEngine(max_host_bytes="1"), ValueError,
     "max_host_bytes must be a non-negative int"),
    ("offload_module_groups-off-None", lambda: memopt.offload_module_groups(None, [nn.Linear(2, 2)]), TypeError,
     "off must be a memopt.Offload"),
    ("offload_module_groups-modules-None (fixed)", lambda: memopt.offload_module_groups(memopt.Offload(), None),
     TypeError, "modules must be an iterable of nn.Modules"),
    ("offload_module_groups-modules-str", lambda: memopt.offload_module_groups(memopt.Offload(), ["a"]), TypeError,
     "modules must be nn.Modules"),
    # memory_report
    ("memory_report-device-unknown (fixed)", lambda: memopt.memory_report("bogus"), ValueError,
     "memopt.memory_report: device must name a device"),
    ("memory_report-device-float (fixed)", lambda: memopt.memory_report(1.5), TypeError,
     "memopt.memory_report: device must be a torch.device, a str or an int"),
]

# Public names without arguments to get wrong: an exception class, a function of no arguments,
# and a dict of presets (not a function).
NO_ARGUMENTS = {"MicroBatchFloorError", "build_info", "estimate_presets"}


@pytest.mark.parametrize("call,error,phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), f"the message does not say {phrase!r}: {info.value}"


def test_every_public_name_is_in_a_table():
    covered = {row[0].split("-")[0].split(".")[0] for row in FIRST_TABLE + CASES}
    missing = sorted(set(memopt.__all__) - covered - NO_ARGUMENTS)
    assert not missing, f"public names with no bad-input row: {missing}"
