"""FusedCheckpointBlock over seeded random configurations: the corners that test_block.py's named
configurations do not combine (sequence-first input, frozen parameter subsets, grouped heads with
one query head, a tiled FFN of a chunk size that does not divide the tokens, second derivatives,
every activation x norm x placement x bias), against the eager reference block in float64.

Each case is drawn from its own seed, so a failure names a configuration that reproduces alone
(``pytest -k "case_17"``)."""

import random

import pytest
import torch

import memopt
from memopt.block import EagerTransformerBlock

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu")
POLICIES = ("none", "selective", "full")
# float64 everywhere: a wrong gradient is off by O(1); rounding here is ~1e-15.
TOL = {"atol": 1e-9, "rtol": 1e-7}


def _draw(seed: int) -> dict:
    r = random.Random(seed)
    heads = r.choice((1, 2, 4))
    head_dim = r.choice((4, 8))
    d_model = heads * head_dim
    return {
        "d_model": d_model,
        "n_heads": heads,
        "d_ff": r.choice((d_model, 2 * d_model, 3 * d_model + 2)),
        "block": dict(
            n_kv_heads=r.choice([k for k in (1, 2, 4) if heads % k == 0]),
            activation=r.choice(ACTIVATIONS),
            norm=r.choice(("layernorm", "rmsnorm")),
            norm_first=r.random() < 0.6,
            causal=r.random() < 0.5,
            bias=r.random() < 0.7,
            batch_first=r.random() < 0.7,
        ),
        "policy": r.choice(POLICIES),
        "ffn_chunk_tokens": r.choice((None, None, 5, 16)),
        "batch": r.choice((1, 2, 3)),
        "seq": r.choice((1, 5, 8, 13)),
        "frozen_fraction": r.choice((0.0, 0.0, 0.34, 0.67)),
        "x_requires_grad": r.random() < 0.8,
        "second_order": r.random() < 0.25,
    }


def _inputs(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and the output gradient of ``case``: (batch, seq, d), or (seq, batch, d) for a
    sequence-first block."""
    shape = (case["batch"], case["seq"], case["d_model"])
    if not case["block"]["batch_first"]:
        shape = (case["seq"], case["batch"], case["d_model"])
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(2))


def _gradients(block, x0, grad_out, frozen, x_requires_grad, second_order):
    """Output, first-order gradients of (x and) the trainable parameters, and under
    ``second_order`` the gradients of a weighted sum of those first-order gradients."""
    for name, p in block.named_parameters():
        p.requires_grad_(name not in frozen)
    x = x0.clone().requires_grad_(x_requires_grad)
    out = block(x)
    inputs = ([x] if x_requires_grad else []) + [p for p in block.parameters() if p.requires_grad]
    if not inputs:
        return out.detach(), []
    first = torch.autograd.grad(out, inputs, grad_out, create_graph=second_order, allow_unused=True)
    first = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, first)]
    if not second_order:
        return out.detach(), first
    # cos-weighted so that every entry of every gradient contributes differently
    total = sum((g * torch.cos(torch.arange(g.numel(), dtype=g.dtype).view_as(g))).sum() for g in first)
    second = torch.autograd.grad(total, inputs, allow_unused=True) if total.requires_grad else [None] * len(inputs)
    second = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, second)]
    return out.detach(), [g.detach() for g in first] + second


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"case_{s}")
def test_random_configuration_matches_the_eager_block(seed):
    case = _draw(seed)
    torch.manual_seed(seed)
    eager = EagerTransformerBlock(case["d_model"], case["n_heads"], case["d_ff"], attention="math", **case["block"])
    fused = memopt.FusedCheckpointBlock(
        case["d_model"], case["n_heads"], case["d_ff"], policy=case["policy"], ffn_chunk_tokens=case["ffn_chunk_tokens"],
        **case["block"],
    )  # fmt: skip
    eager, fused = eager.double(), fused.double()
    fused.load_state_dict(eager.state_dict())
    names = [name for name, _ in eager.named_parameters()]
    frozen = set(random.Random(seed + 1000).sample(names, k=int(case["frozen_fraction"] * len(names))))
    x0, grad_out = _inputs(case, seed)
    args = (x0, grad_out, frozen, case["x_requires_grad"], case["second_order"])
    out_e, grads_e = _gradients(eager, *args)
    out_f, grads_f = _gradients(fused, *args)
    torch.testing.assert_close(out_f, out_e, **TOL, msg=lambda m: f"{case}: output: {m}")
    assert len(grads_f) == len(grads_e)
    for i, (got, expected) in enumerate(zip(grads_f, grads_e)):
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{case}: gradient {i}: {m}")


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case_{s}")
def test_random_configuration_with_dropout_is_the_same_under_every_policy(seed):
    """Same seed, same result: with dropout, every policy (and a tiled FFN) gives the output and
    gradients of "none", bit for bit up to float64 rounding, whatever it recomputes."""
    case = _draw(100 + seed)
    block_kwargs = {**case["block"], "dropout": random.Random(seed).choice((0.1, 0.5))}
    torch.manual_seed(seed)
    reference = memopt.FusedCheckpointBlock(case["d_model"], case["n_heads"], case["d_ff"], policy="none", **block_kwargs)
    reference = reference.double()
    x0, grad_out = _inputs(case, seed)
    results = {}
    for policy in POLICIES:
        for chunk in (None, 3):
            block = memopt.FusedCheckpointBlock(
                case["d_model"], case["n_heads"], case["d_ff"], policy=policy, ffn_chunk_tokens=chunk, **block_kwargs
            ).double()
            block.load_state_dict(reference.state_dict())
            torch.manual_seed(1234)  # the dropout key is drawn from the default generator
            results[policy, chunk] = _gradients(block, x0, grad_out, set(), True, case["second_order"])
    out_ref, grads_ref = results["none", None]
    assert out_ref.abs().sum() > 0
    for key, (out, grads) in results.items():
        torch.testing.assert_close(out, out_ref, **TOL, msg=lambda m: f"{key} {case}: output: {m}")
        for i, (got, expected) in enumerate(zip(grads, grads_ref)):
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{key} {case}: gradient {i}: {m}")
