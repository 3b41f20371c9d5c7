"""memopt.block_functions: gradients that are not asked for are not computed (and are None), the
ones that are match the eager reference block; the saved records round-trip by name."""

import pytest
import torch

import memopt
from memopt import block_functions
from memopt.block import EagerTransformerBlock
from memopt.ops.attention import cpu_backend

from helpers import MemoptOpCalls

D_MODEL, N_HEADS = 64, 4
TOL = {"atol": 1e-6, "rtol": 1e-5}  # float64; attention's float32 log-sum-exp sets the floor


@pytest.fixture(autouse=True)
def native_cpu_attention():
    with cpu_backend("native"):
        yield


def _blocks_with_frozen(policy: str, norm_first: bool, frozen: set[str], ffn_chunk_tokens: int | None = None):
    """A float64 FusedCheckpointBlock and the eager block with its weights, ``frozen`` parameters
    not requiring grad in both."""
    torch.manual_seed(0)
    fused = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 96, norm_first=norm_first, causal=True, policy=policy,
                                        ffn_chunk_tokens=ffn_chunk_tokens, dtype=torch.float64)
    eager = EagerTransformerBlock(D_MODEL, N_HEADS, 96, norm_first=norm_first, causal=True, dtype=torch.float64)
    eager.load_state_dict(fused.state_dict())
    for block in (fused, eager):
        for name, param in block.named_parameters():
            param.requires_grad_(name not in frozen)
    return fused, eager


def _assert_grads_match_eager(fused, eager, frozen: set[str]) -> None:
    for (name, got), (_, want) in zip(fused.named_parameters(), eager.named_parameters()):
        if name in frozen:
            assert got.grad is None, name
        else:
            torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_frozen_parameters_and_input_get_no_gradient_and_the_rest_match_eager(policy, norm_first):
    frozen = {"fc1.weight", "qkv.weight", "norm2.bias", "out_proj.bias"}
    fused, eager = _blocks_with_frozen(policy, norm_first, frozen)
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64)  # no gradient wanted for the input
    grad = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    fused(x).backward(grad)
    eager(x).backward(grad)
    _assert_grads_match_eager(fused, eager, frozen)


@pytest.mark.parametrize("ffn_chunk_tokens", [None, 16], ids=["untiled", "tiled"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_frozen_norms_and_biases_get_no_gradient_computed(policy, norm_first, ffn_chunk_tokens):
    """Norms and fc1's bias frozen as PEFT freezes them: the norm and activation backward kernels
    are not asked for those gradients (norm1's weight alone of the norms trains here), and the
    other gradients match eager."""
    frozen = {"norm1.bias", "norm2.weight", "norm2.bias", "fc1.bias"}
    fused, eager = _blocks_with_frozen(policy, norm_first, frozen, ffn_chunk_tokens)
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    with MemoptOpCalls("_bwd") as calls:
        fused(x).backward(grad)
    x_eager = x.detach().clone().requires_grad_()
    eager(x_eager).backward(grad)
    # Tiled, norm2 and the activation run once per chunk of 16 of the 48 tokens.
    chunks = 1 if ffn_chunk_tokens is None else 3
    norms = [c for c in calls.calls if "return_grad_weight" in c]
    asked = sorted((c["return_grad_weight"], c["return_grad_bias"]) for c in norms)
    assert asked == [(False, False)] * chunks + [(True, False)]
    activations = [c for c in calls.calls if "activation" in c]  # bias_act_bwd(_inplace): fc1's bias
    assert [c["return_grad_bias"] for c in activations] == [False] * chunks
    torch.testing.assert_close(x.grad, x_eager.grad, **TOL)
    _assert_grads_match_eager(fused, eager, frozen)


def test_saved_names_are_fields_of_the_records():
    """Every name saved_names lists is a field of AttentionHalf, FFNHalf or their NormStats."""
    fields = {f for cls in (block_functions.AttentionHalf, block_functions.FFNHalf) for f in cls.__dataclass_fields__}
    for policy in ("none", "selective", "full"):
        for norm_first in (True, False):
            for norm in ("layernorm", "rmsnorm"):
                for name in block_functions.saved_names(policy, norm_first, norm):
                    record, _, stat = name.partition("_")
                    known = stat in block_functions.NormStats._fields and record in ("norm1", "norm2")
                    assert known or name in fields, name


def test_param_names_match_the_module():
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 96)
    assert set(block_functions.PARAM_NAMES) == {name for name, _ in block.named_parameters()}


# d_ff-wide buffers alive at once in the FFN backward: grad_g (the activation gradient is written
# over it; under "selective" and "full" it is the buffer the activation was rebuilt in for fc2's
# weight gradient); under "full" the recomputed u. (Rebuilding the activation in its backward
# kernel, beside grad_g, held one more under "selective" and "full".)
FFN_BACKWARD_BUFFERS = {"none": 1, "selective": 1, "full": 2}


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_ffn_backward_writes_the_activation_gradient_over_its_own_input(policy, monkeypatch):
    """The FFN backward's activation gradient is written over grad_g (its own matmul output): at
    its peak it holds one d_ff-wide buffer fewer than with an out-of-place activation gradient,
    and the gradients are the same bits."""
    from bench.memory import LiveTensorTracker

    tokens, d_ff = 2 * 128, 1024  # d_model 16: everything else in the backward is far smaller
    buffer_bytes = tokens * d_ff * 8
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(16, 1, d_ff, causal=True, policy=policy, dtype=torch.float64)
    x = torch.randn(2, 128, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 128, 16, dtype=torch.float64)

    def backward_peak_and_grads():
        for t in (x, *block.parameters()):
            t.grad = None
        out = block(x)
        with LiveTensorTracker(exclude=[x, grad, out, *block.parameters()]) as tracker:
            out.backward(grad)
        return tracker.peak_bytes("cpu"), [t.grad.clone() for t in (x, *block.parameters())]

    in_place_peak, in_place_grads = backward_peak_and_grads()
    act_backward = block_functions._activation_ops._act_backward
    monkeypatch.setattr(
        block_functions._activation_ops, "_act_backward",
        lambda *args, grad_y_is_scratch=False, **kwargs: act_backward(*args, **kwargs),
    )  # fmt: skip
    out_of_place_peak, out_of_place_grads = backward_peak_and_grads()
    assert in_place_peak // buffer_bytes == FFN_BACKWARD_BUFFERS[policy]
    assert out_of_place_peak // buffer_bytes == FFN_BACKWARD_BUFFERS[policy] + 1
    for got, want in zip(in_place_grads, out_of_place_grads):
        assert torch.equal(got, want)


# The backward steps by which the FFN half's saved d_ff-wide tensors must be freed: the attention
# half's backward (the FFN half is its own node), and fc1's backward (u and g live in the node of
# bias + activation and fc2 only), where the eager graph has freed them and allocates fc1's
# weight gradient.
_LATER_BACKWARD_STEPS = ("_attention_kernel_bwd", "_ffn_in_backward")


@pytest.mark.parametrize("step", _LATER_BACKWARD_STEPS)
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_prenorm_block_frees_ffn_tensors_before_later_backward_steps(policy, step, monkeypatch):
    """Pre-norm "none"/"selective" blocks are three autograd nodes (attention half; norm2 + fc1;
    bias + activation, fc2, residual): by the time ``step`` runs, the saved d_ff-wide tensors (u;
    and g under "none") are freed, as an eager graph frees them, instead of living through the
    whole block backward."""
    import weakref

    tokens, d_ff = 2 * 8, 256
    block = memopt.FusedCheckpointBlock(32, 2, d_ff, causal=True, policy=policy, dtype=torch.float64)
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    wide = []

    def pack(t):
        if t.shape == (tokens, d_ff):
            wide.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    assert len(wide) == (2 if policy == "none" else 1)  # u and g / u
    alive = []
    original = getattr(block_functions, step)

    def counting(*args):
        alive.append(sum(ref() is not None for ref in wide))
        return original(*args)

    monkeypatch.setattr(block_functions, step, counting)
    out.backward(torch.randn_like(out))
    assert alive == [0]


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_step_peak_at_or_below_the_eager_blocks(policy, dropout, norm_first):
    """The tracked peak of one training step of a stack (forward and backward, live bytes of
    op-allocated storages) is at most the eager block's, the same weights. The slack: fc1's bias
    gradient (d_ff values), which the fused activation backward allocates while fc2's gradients
    are alive (eager allocates it a node later); post-norm "none" also keeps norm2's input s2 and
    the output gradient (two d_model-wide buffers) through fc2's backward, where eager has freed
    them after norm2's. Before the FFN half was split at u, "none" peaked one d_ff-wide buffer
    above eager pre-norm and 0.7 of one post-norm."""
    from bench.memory import LiveTensorTracker

    d_model, d_ff, batch, seq, layers = 32, 512, 2, 32, 3
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        *(
            EagerTransformerBlock(d_model, 2, d_ff, dropout=dropout, norm_first=norm_first, dtype=torch.float64)
            for _ in range(layers)
        )
    )
    fused = torch.nn.Sequential(*(block.to_fused(policy) for block in eager))
    x = torch.randn(batch, seq, d_model, dtype=torch.float64, requires_grad=True)

    def step_peak(model):
        with LiveTensorTracker(exclude=[x, *model.parameters()]) as tracker:
            model(x).pow(2).mean().backward()
        return tracker.peak_bytes("cpu")

    eager_peak, fused_peak = step_peak(eager), step_peak(fused)
    # fc1's bias gradient; post-norm "none": s2 and grad_y, and norm2's and fc2's bias gradients
    # (d_model values each), made before fc2's weight gradient there and after it in eager.
    slack = d_ff * 8 + ((2 * batch * seq + 4) * d_model * 8 if not norm_first and policy == "none" else 0)
    assert fused_peak <= eager_peak + slack, (fused_peak, eager_peak, batch * seq * d_ff * 8)


def test_site_keys_are_the_key_at_each_sites_offset_and_follow_an_in_place_change():
    # Reference: the three sites' counters 0, 2^50 and 2^51 past the block key's offset.
    key = torch.tensor([1234, 7], dtype=torch.int64)
    want = [[1234, 7], [1234, 7 + (1 << 50)], [1234, 7 + (2 << 50)]]
    assert [k.tolist() for k in block_functions._site_keys(key)] == want
    assert [k.tolist() for k in block_functions._site_keys(key)] == want  # the cached entry
    key[1] = 9  # the same object, changed in place: its keys are derived again
    assert [k.tolist() for k in block_functions._site_keys(key)] == [[1234, 9 + (i << 50)] for i in range(3)]
    other = torch.tensor([1234, 9], dtype=torch.int64)
    assert [k.tolist() for k in block_functions._site_keys(other)] == [[1234, 9 + (i << 50)] for i in range(3)]
    assert all(k.tolist() == [0, 0] for k in block_functions._site_keys(None))


@pytest.mark.parametrize("policy", ["none", "full"])
def test_training_block_with_dropout_runs_under_inference_mode_with_the_no_grad_masks(policy):
    # Under inference_mode the block's key is an inference tensor (no version counter): same
    # seed, same output as under no_grad, and dropout does act (the output differs from eval's).
    torch.manual_seed(0)
    block = memopt.FusedCheckpointBlock(D_MODEL, N_HEADS, 96, policy=policy, dropout=0.3, dtype=torch.float64)
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    torch.manual_seed(1)
    with torch.inference_mode():
        got = block(x)
    torch.manual_seed(1)
    with torch.no_grad():
        want = block(x)
        dropped_nothing = block.eval()(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, dropped_nothing)
