"""The autograd Function behind ``memopt.FusedCheckpointBlock``: what each policy saves.

One ``torch.autograd.Function`` per block. The forward runs the registered memopt ops (norm,
attention, bias+activation, dropout+residual) and plain matmuls; it then keeps exactly the
tensors its recompute policy names in ``SAVED`` below. The backward first rebuilds what the
policy dropped and then runs one shared backward pass whose norm and activation kernels rebuild
their outputs in place (``return_y=True``) when those were not kept.

Names of the intermediate tensors (``N`` = batch * seq tokens, all 2-D ``(N, width)`` unless said):

pre-norm (``norm_first=True``)::

    n1 = norm1(x); qkv = n1 @ Wqkv^T + bqkv; attn_out, lse = attention(q, k, v)
    o = attn_out @ Wo^T + bo; h = x + dropout(o)
    n2 = norm2(h); u = n2 @ W1^T; g = act(u + b1); f = g @ W2^T + b2; y = h + dropout(f)

post-norm (``norm_first=False``, the original Transformer)::

    qkv = x @ Wqkv^T + bqkv; attn_out, lse = attention(q, k, v); o = attn_out @ Wo^T + bo
    s1 = x + dropout(o); h = norm1(s1)
    u = h @ W1^T; g = act(u + b1); f = g @ W2^T + b2; s2 = h + dropout(f); y = norm2(s2)

Dropout sites (GPT-2 style): attention probabilities, and the two residual branches ``o`` and
``f``. One RNG key ``(seed, offset)`` is drawn per block forward; the sites use it at offsets
``0``, ``1 << 50`` and ``2 << 50``, so their masks never share Philox counters, and every
recompute replays them exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The op families this Function calls: importing them registers their fake impls (torch.compile).
from memopt.ops import activation as _activation_ops  # noqa: F401
from memopt.ops import attention as _attention_ops
from memopt.ops import dropout as _dropout_ops  # noqa: F401
from memopt.ops import norm as _norm_ops  # noqa: F401

SUPPORTED_HEAD_DIMS = _attention_ops.SUPPORTED_HEAD_DIMS

# Philox counter offset of each dropout site inside one block's key. Sites are 2^50 counters
# apart: a site would need 2^52 elements to run into the next one.
_SITE_STRIDE = 1 << 50
_ATTENTION_SITE, _ATTENTION_RESIDUAL_SITE, _FFN_RESIDUAL_SITE = 0, 1, 2

_NORM_STATS = {"layernorm": ("mean", "rstd"), "rmsnorm": ("rstd",)}


def _stats(index: int, norm: str) -> tuple[str, ...]:
    return tuple(f"norm{index}_{name}" for name in _NORM_STATS[norm])


def saved_names(policy: str, norm_first: bool, norm: str) -> tuple[str, ...]:
    """The intermediate tensors (names as in the module docstring) a policy keeps for backward.

    ``x`` is the block input; the RNG key is kept too whenever dropout is active.
    """
    stats1, stats2 = _stats(1, norm), _stats(2, norm)
    if policy == "full":
        return ("x",)
    if norm_first:
        # Norm outputs n1, n2 and the activation output g are rebuilt by the backward kernels
        # under "selective"; the matmul outputs qkv, u and attention's out + lse are kept.
        selective = ("x", *stats1, "qkv", "attn_out", "lse", "h", *stats2, "u")
        rebuilt = ("n1", "n2", "g")
    else:
        # norm1's output h is fc1's input and the FFN residual: "selective" rebuilds it with a
        # norm forward at the start of the backward (elementwise, no matmul).
        selective = ("x", "qkv", "attn_out", "lse", "s1", *stats1, "u", "s2", *stats2)
        rebuilt = ("h", "g")
    if policy == "none":
        return selective + rebuilt
    return selective


@dataclass(frozen=True)
class BlockSpec:
    """Everything static about one block call (hashable, so torch.compile guards on it)."""

    policy: str
    norm: str
    norm_first: bool
    activation: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    eps: float
    attention_dropout: float
    residual_dropout: float
    compute_dtype: torch.dtype

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def uses_rng(self) -> bool:
        return self.attention_dropout > 0.0 or self.residual_dropout > 0.0


# The block's parameters by state_dict name, in the order FusedBlockFunction takes them.
PARAM_NAMES = (
    "norm1.weight", "norm1.bias", "qkv.weight", "qkv.bias", "out_proj.weight", "out_proj.bias",
    "norm2.weight", "norm2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
)  # fmt: skip


def _site_key(rng_key: torch.Tensor | None, site: int) -> torch.Tensor:
    """The key of one dropout site; a placeholder when no dropout is active (ops need a key)."""
    if rng_key is None:
        return torch.zeros(2, dtype=torch.int64)
    if site == 0:
        return rng_key
    return rng_key + torch.tensor([0, site * _SITE_STRIDE], dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Op wrappers: one place where each registered op's calling convention lives.


def _norm_fwd(spec: BlockSpec, x: torch.Tensor, weight, bias, index: int, t: dict) -> torch.Tensor:
    """Normalise ``x`` (N, D); store the statistics in ``t`` under ``norm<index>_*``."""
    if spec.norm == "layernorm":
        y, _, mean, rstd = torch.ops.memopt.layer_norm_fwd(x, None, weight, bias, spec.eps)
        t[f"norm{index}_mean"], t[f"norm{index}_rstd"] = mean, rstd
    else:
        y, _, rstd = torch.ops.memopt.rms_norm_fwd(x, None, weight, spec.eps)
        t[f"norm{index}_rstd"] = rstd
    return y


def _norm_bwd(spec, grad_y, x, weight, bias, index, t, grad_extra, return_y):
    """Returns ``(grad_x, grad_weight, grad_bias or None, y or None)``."""
    grad_y = grad_y.to(x.dtype).contiguous()
    if spec.norm == "layernorm":
        grad_x, grad_w, grad_b, y = torch.ops.memopt.layer_norm_bwd(
            grad_y, x, weight, bias, t[f"norm{index}_mean"], t[f"norm{index}_rstd"], grad_extra, return_y
        )
        grad_b = grad_b.to(bias.dtype) if bias is not None else None
    else:
        grad_x, grad_w, y = torch.ops.memopt.rms_norm_bwd(
            grad_y, x, weight, t[f"norm{index}_rstd"], grad_extra, return_y
        )
        grad_b = None
    return grad_x, grad_w.to(weight.dtype), grad_b, (y if return_y else None)


# The CPU kernels compute in float32 or float64: under CPU autocast to a half type the
# activation and attention inputs go in as float32 and their outputs come back in the compute
# dtype (the matmuls still run in the half type, as in the eager block). GPUs run them in half.
_CPU_HALF_TYPES = (torch.float16, torch.bfloat16)


def _cpu_upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is not None and t.device.type == "cpu" and t.dtype in _CPU_HALF_TYPES:
        return t.float()
    return t


def _act_fwd(spec: BlockSpec, u: torch.Tensor, bias) -> torch.Tensor:
    if spec.activation == "swiglu":
        g = torch.ops.memopt.swiglu_fwd(_cpu_upcast(u), _cpu_upcast(bias))
    else:
        g = torch.ops.memopt.bias_act_fwd(_cpu_upcast(u), _cpu_upcast(bias), spec.activation)
    return g.to(u.dtype)


def _act_bwd(spec, grad_g, u, bias, return_y):
    """Returns ``(grad_u, grad_bias or None, g or None)``; grad_u is the pre-bias gradient."""
    args = (_cpu_upcast(grad_g.contiguous()), _cpu_upcast(u), _cpu_upcast(bias))
    if spec.activation == "swiglu":
        grad_u, grad_b, g = torch.ops.memopt.swiglu_bwd(*args, return_y)
    else:
        grad_u, grad_b, g = torch.ops.memopt.bias_act_bwd(*args, spec.activation, return_y)
    grad_b = grad_b.to(bias.dtype) if bias is not None else None
    return grad_u.to(u.dtype), grad_b, (g.to(u.dtype) if return_y else None)


def _split_heads(spec: BlockSpec, qkv: torch.Tensor, batch: int, seq: int):
    """Views q (B, H, S, hd), k and v (B, Hkv, S, hd) of ``qkv`` (N, (H + 2 Hkv) hd): no copy."""
    heads = qkv.view(batch, seq, spec.n_heads + 2 * spec.n_kv_heads, spec.head_dim)
    q = heads[:, :, : spec.n_heads].transpose(1, 2)
    k = heads[:, :, spec.n_heads : spec.n_heads + spec.n_kv_heads].transpose(1, 2)
    v = heads[:, :, spec.n_heads + spec.n_kv_heads :].transpose(1, 2)
    return q, k, v


def _attention_fwd(spec, qkv, batch, seq, rng_key):
    """Returns ``(attn_out (B, H, S, hd) view of a (B, S, H, hd) buffer, lse (B, H, S))``."""
    q, k, v = (_cpu_upcast(t) for t in _split_heads(spec, qkv, batch, seq))
    out, lse = torch.ops.memopt.attention_fwd(
        q, k, v, spec.causal, spec.attention_dropout, spec.scale, _site_key(rng_key, _ATTENTION_SITE)
    )
    return out.to(qkv.dtype), lse  # keeps the (B, S, H, hd) layout


def _attention_bwd(spec, grad_attn, qkv, attn_out, lse, batch, seq, rng_key):
    """Gradient of ``qkv`` (N, (H + 2 Hkv) hd) from the gradient of attn_out (N, H hd)."""
    q, k, v = (_cpu_upcast(t) for t in _split_heads(spec, qkv, batch, seq))
    grad_out = grad_attn.view(batch, seq, spec.n_heads, spec.head_dim).transpose(1, 2)
    grad_q, grad_k, grad_v = torch.ops.memopt.attention_bwd(
        _cpu_upcast(grad_out), q, k, v, _cpu_upcast(attn_out), lse, spec.causal,
        spec.attention_dropout, spec.scale, _site_key(rng_key, _ATTENTION_SITE),
    )  # fmt: skip
    # One copy assembles the three gradients head-interleaved as qkv is laid out.
    grad_qkv = torch.cat([grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)], dim=2)
    return grad_qkv.view(batch * seq, -1).to(qkv.dtype)


def _dropout_add(p: float, branch: torch.Tensor, residual: torch.Tensor, rng_key, site: int) -> torch.Tensor:
    """``residual + dropout(branch)`` in the residual stream's dtype."""
    branch = branch.to(residual.dtype)
    if p == 0.0:
        return branch + residual
    return torch.ops.memopt.dropout_add_fwd(branch.contiguous(), residual, p, _site_key(rng_key, site))


def _dropout_bwd(p: float, grad: torch.Tensor, rng_key, site: int) -> torch.Tensor:
    if p == 0.0:
        return grad
    return torch.ops.memopt.dropout_add_bwd(grad.contiguous(), p, _site_key(rng_key, site))


def _linear(inp: torch.Tensor, weight: torch.Tensor, bias, dtype: torch.dtype) -> torch.Tensor:
    weight = weight.to(dtype)
    inp = inp.to(dtype)
    if bias is None:
        return inp @ weight.t()
    return torch.addmm(bias.to(dtype), inp, weight.t())


def _weight_grad(grad_out: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_out^T @ inp`` (out, in) in the matmul dtype, returned in the weight's dtype."""
    return (grad_out.t() @ inp.to(grad_out.dtype)).to(weight.dtype)


def _bias_grad(grad_out: torch.Tensor, bias) -> torch.Tensor | None:
    """Column sums of ``grad_out`` accumulated in at least float32."""
    if bias is None:
        return None
    return grad_out.sum(0, dtype=torch.promote_types(grad_out.dtype, torch.float32)).to(bias.dtype)


def _input_grad(grad_out: torch.Tensor, weight: torch.Tensor, residual_grad) -> torch.Tensor:
    """``grad_out @ weight`` plus ``residual_grad`` (in its dtype) when given, fused when possible."""
    weight = weight.to(grad_out.dtype)
    if residual_grad is None:
        return grad_out @ weight
    if residual_grad.dtype == grad_out.dtype:
        return torch.addmm(residual_grad, grad_out, weight)
    return residual_grad + grad_out @ weight


# ----------------------------------------------------------------------------------------------
# Forward, recompute and backward.


def _block_forward(spec, x, rng_key, p, batch, seq, t, need_output=True):
    """Run the block on ``x`` (N, D), filling ``t`` with the intermediates named in the docstring.

    With ``need_output=False`` (the "full" policy's recompute) it stops once everything the
    backward needs exists: for pre-norm that skips fc2 entirely, whose output only feeds the
    block output; post-norm needs fc2 again because norm2's backward needs its input s2.
    """
    dtype = spec.compute_dtype
    t["x"] = x
    if spec.norm_first:
        t["n1"] = _norm_fwd(spec, x, p["norm1.weight"], p["norm1.bias"], 1, t).to(dtype)
        attn_in = t["n1"]
    else:
        attn_in = x
    t["qkv"] = _linear(attn_in, p["qkv.weight"], p["qkv.bias"], dtype)
    t["attn_out"], t["lse"] = _attention_fwd(spec, t["qkv"], batch, seq, rng_key)
    attn_flat = t["attn_out"].transpose(1, 2).reshape(batch * seq, -1)
    o = _linear(attn_flat, p["out_proj.weight"], p["out_proj.bias"], dtype)
    if spec.norm_first:
        t["h"] = _dropout_add(spec.residual_dropout, o, x, rng_key, _ATTENTION_RESIDUAL_SITE)
        t["n2"] = _norm_fwd(spec, t["h"], p["norm2.weight"], p["norm2.bias"], 2, t).to(dtype)
        ffn_in = t["n2"]
    else:
        t["s1"] = _dropout_add(spec.residual_dropout, o, x, rng_key, _ATTENTION_RESIDUAL_SITE)
        t["h"] = _norm_fwd(spec, t["s1"], p["norm1.weight"], p["norm1.bias"], 1, t)
        ffn_in = t["h"]
    t["u"] = _linear(ffn_in, p["fc1.weight"], None, dtype)
    if spec.norm_first and not need_output:
        return None
    t["g"] = _act_fwd(spec, t["u"], None if p["fc1.bias"] is None else p["fc1.bias"].to(dtype))
    f = _linear(t["g"], p["fc2.weight"], p["fc2.bias"], dtype)
    if spec.norm_first:
        return _dropout_add(spec.residual_dropout, f, t["h"], rng_key, _FFN_RESIDUAL_SITE)
    t["s2"] = _dropout_add(spec.residual_dropout, f, t["h"], rng_key, _FFN_RESIDUAL_SITE)
    return _norm_fwd(spec, t["s2"], p["norm2.weight"], p["norm2.bias"], 2, t)


def _block_backward(spec, grad_y, t, p, rng_key, batch, seq):
    """Gradients of x and of every parameter; rebuilds n1, n2, h, g when ``t`` lacks them.

    Entries of ``t`` are popped and temporaries deleted at their last use, so that (as autograd
    does for an eager graph) the attention half's backward does not run on top of the FFN
    half's buffers; under "full" the recomputed tensors live only in ``t``.
    """
    dtype = spec.compute_dtype
    grads = {}
    drop = spec.residual_dropout
    fc1_b = None if p["fc1.bias"] is None else p["fc1.bias"].to(dtype)

    # FFN half.
    if spec.norm_first:
        grad_s2 = grad_y
    else:
        grad_s2, grads["norm2.weight"], grads["norm2.bias"], _ = _norm_bwd(
            spec, grad_y, t.pop("s2"), p["norm2.weight"], p["norm2.bias"], 2, t, None, False
        )
    grad_f = _dropout_bwd(drop, grad_s2, rng_key, _FFN_RESIDUAL_SITE).to(dtype)
    grads["fc2.bias"] = _bias_grad(grad_f, p["fc2.bias"])
    grad_g = grad_f @ p["fc2.weight"].to(dtype)
    grad_u, grads["fc1.bias"], g = _act_bwd(spec, grad_g, t.pop("u"), fc1_b, return_y="g" not in t)
    del grad_g
    grads["fc2.weight"] = _weight_grad(grad_f, t.pop("g", g), p["fc2.weight"])
    del grad_f, g
    if spec.norm_first:
        grad_n2 = grad_u @ p["fc1.weight"].to(dtype)
        grad_h, grads["norm2.weight"], grads["norm2.bias"], n2 = _norm_bwd(
            spec, grad_n2, t.pop("h"), p["norm2.weight"], p["norm2.bias"], 2, t, grad_s2, "n2" not in t
        )
        del grad_n2
        grads["fc1.weight"] = _weight_grad(grad_u, t.pop("n2", n2), p["fc1.weight"])
        del n2
    else:
        grads["fc1.weight"] = _weight_grad(grad_u, t.pop("h"), p["fc1.weight"])
        grad_h = _input_grad(grad_u, p["fc1.weight"], grad_s2)
    del grad_u, grad_s2

    # Attention half.
    if spec.norm_first:
        grad_s1 = grad_h
    else:
        grad_s1, grads["norm1.weight"], grads["norm1.bias"], _ = _norm_bwd(
            spec, grad_h, t.pop("s1"), p["norm1.weight"], p["norm1.bias"], 1, t, None, False
        )
    del grad_h
    grad_o = _dropout_bwd(drop, grad_s1, rng_key, _ATTENTION_RESIDUAL_SITE).to(dtype)
    attn_out = t.pop("attn_out")
    grads["out_proj.weight"] = _weight_grad(
        grad_o, attn_out.transpose(1, 2).reshape(batch * seq, -1), p["out_proj.weight"]
    )
    grads["out_proj.bias"] = _bias_grad(grad_o, p["out_proj.bias"])
    grad_attn = grad_o @ p["out_proj.weight"].to(dtype)
    del grad_o
    grad_qkv = _attention_bwd(spec, grad_attn, t.pop("qkv"), attn_out, t.pop("lse"), batch, seq, rng_key)
    del grad_attn, attn_out
    grads["qkv.bias"] = _bias_grad(grad_qkv, p["qkv.bias"])
    if spec.norm_first:
        grad_n1 = grad_qkv @ p["qkv.weight"].to(dtype)
        grad_x, grads["norm1.weight"], grads["norm1.bias"], n1 = _norm_bwd(
            spec, grad_n1, t["x"], p["norm1.weight"], p["norm1.bias"], 1, t, grad_s1, "n1" not in t
        )
        del grad_n1
        grads["qkv.weight"] = _weight_grad(grad_qkv, t.pop("n1", n1), p["qkv.weight"])
    else:
        grads["qkv.weight"] = _weight_grad(grad_qkv, t["x"], p["qkv.weight"])
        grad_x = _input_grad(grad_qkv, p["qkv.weight"], grad_s1)
    return grad_x, grads


class FusedBlockFunction(torch.autograd.Function):
    """One transformer block; saves ``saved_names(spec.policy, ...)`` and the RNG key.

    ``forward(ctx, spec, x (N, D), rng_key or None, batch, seq, *params)`` with ``params`` in
    ``PARAM_NAMES`` order (None for absent biases). Returns the block output (N, D).
    """

    @staticmethod
    def forward(ctx, spec, x, rng_key, batch, seq, *params):
        p = dict(zip(PARAM_NAMES, params))
        t: dict = {}
        # The compute dtype is explicit (spec.compute_dtype): autocast off keeps the forward and
        # the "full" recompute (which runs outside autocast) bit-identical.
        with torch.autocast(x.device.type, enabled=False):
            y = _block_forward(spec, x, rng_key, p, batch, seq, t)
        names = saved_names(spec.policy, spec.norm_first, spec.norm)
        ctx.spec, ctx.batch, ctx.seq = spec, batch, seq
        ctx.saved_tensor_names = names
        ctx.param_present = tuple(param is not None for param in params)
        ctx.save_for_backward(*(t[name] for name in names), rng_key, *params)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        spec, batch, seq = ctx.spec, ctx.batch, ctx.seq
        grad_y = grad_y.contiguous()  # y.sum().backward() hands in a stride-0 expanded tensor
        saved = ctx.saved_tensors
        count = len(ctx.saved_tensor_names)
        t = dict(zip(ctx.saved_tensor_names, saved[:count]))
        rng_key = saved[count]
        p = dict(zip(PARAM_NAMES, saved[count + 1 :]))
        if spec.policy == "full":
            t = {}
            with torch.no_grad():
                _block_forward(spec, saved[0], rng_key, p, batch, seq, t, need_output=False)
        elif not spec.norm_first and "h" not in t:
            t["h"] = _norm_fwd(spec, t["s1"], p["norm1.weight"], p["norm1.bias"], 1, {})
        grad_x, grads = _block_backward(spec, grad_y, t, p, rng_key, batch, seq)
        param_grads = [
            grads[name] if present and ctx.needs_input_grad[5 + i] else None
            for i, (name, present) in enumerate(zip(PARAM_NAMES, ctx.param_present))
        ]
        return (None, grad_x, None, None, None, *param_grads)
