"""The autograd Functions behind ``memopt.FusedCheckpointBlock``: what each policy saves.

:func:`apply_block` runs a block: ``"full"`` and post-norm ``"selective"`` as one autograd node
(``TransformerBlockFunction``); pre-norm ``"none"`` / ``"selective"`` and post-norm ``"none"`` as
the attention half (``BlockAttentionFunction``) and the FFN half, itself two nodes split at fc1's
output (``BlockFFNInFunction``: pre-norm norm2, fc1; ``BlockFFNOutFunction``: bias + activation,
fc2, dropout + residual, post-norm norm2; a pre-norm tiled half is one, ``BlockFFNFunction``), so
that each saved tensor is freed where an eager graph frees it (the Notes at the end of this file).

``TransformerBlockFunction`` is one transformer block as one ``torch.autograd.Function``. Its
forward runs the registered memopt ops (norm, attention, bias+activation, dropout+residual) and
plain matmuls, in two halves that return their intermediates as typed records
(``AttentionHalf``, ``FFNHalf``, norm statistics as ``NormStats``); it then keeps exactly the
tensors its recompute policy names in :func:`saved_names`. The backward first rebuilds what the
policy dropped and then runs one shared backward pass whose norm and activation kernels rebuild
their outputs in place (``return_y=True``) when those were not kept.

Names of the intermediate tensors (``N`` = batch * seq tokens, all 2-D ``(N, width)`` unless said);
they are the field names of the two records and the names :func:`saved_names` lists:

pre-norm (``norm_first=True``)::

    n1 = norm1(x); qkv = n1 @ Wqkv^T + bqkv; attn_out, lse = attention(q, k, v)
    o = attn_out @ Wo^T + bo; h = x + dropout(o)
    n2 = norm2(h); u = n2 @ W1^T; g = act(u + b1); f = g @ W2^T + b2; y = h + dropout(f)

post-norm (``norm_first=False``, the original Transformer)::

    qkv = x @ Wqkv^T + bqkv; attn_out, lse = attention(q, k, v); o = attn_out @ Wo^T + bo
    s1 = x + dropout(o); h = norm1(s1)
    u = h @ W1^T; g = act(u + b1); f = g @ W2^T + b2; s2 = h + dropout(f); y = norm2(s2)

``h`` is the attention half's output and the FFN half's input. Norm statistics are saved as
``norm<i>_mean`` / ``norm<i>_rstd`` (``mean`` for layernorm only).

Dropout sites (GPT-2 style): attention probabilities, and the two residual branches ``o`` and
``f``. One RNG key ``(seed, offset)`` is drawn per block forward; the sites use it at offsets
``0``, ``1 << 50`` and ``2 << 50`` (``SiteKeys``, made once per forward and once per backward),
so their masks never share Philox counters, and every recompute replays them exactly.

Note: under "full" the recomputed tensors must live no longer than an eager graph's would: the
FFN half's intermediates (the largest, ``u`` is ``d_ff`` wide) are recomputed inside the FFN
backward and deleted at their last use there; the attention half's are recomputed first (the
FFN half needs ``h``) and dropped with the attention backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch._subclasses.fake_tensor import FakeTensor

from memopt.ops import activation as _activation_ops
from memopt.ops import cpu_linear
from memopt.ops import attention as _attention_ops
from memopt.ops import dropout as _dropout_ops
from memopt.ops import norm as _norm_ops
from memopt.ops._common import autocast_off, building_graph, grads_with_graph, saved_for_recompute
from memopt.tiled_ffn import chunk_rng_key, token_chunks

MAX_HEAD_DIM = _attention_ops.MAX_HEAD_DIM
head_dim_supported = _attention_ops.head_dim_supported

_NORM_STATS = {"layernorm": ("mean", "rstd"), "rmsnorm": ("rstd",)}


def _stats(index: int, norm: str) -> tuple[str, ...]:
    return tuple(f"norm{index}_{name}" for name in _NORM_STATS[norm])


@functools.lru_cache(maxsize=None)  # called by every forward: a pure function of four strings / bools
def saved_names(policy: str, norm_first: bool, norm: str, tiled_ffn: bool = False) -> tuple[str, ...]:
    """The intermediate tensors (names as in the module docstring) a policy keeps for backward.

    ``x`` is the block input; the RNG key is kept too whenever dropout is active. With
    ``tiled_ffn`` (``ffn_chunk_tokens`` set) the FFN half keeps only its input ``h`` (pre-norm,
    or post-norm ``"none"``; post-norm ``"selective"`` rebuilds it from ``s1``): the backward
    recomputes it chunk by chunk.
    """
    stats1, stats2 = _stats(1, norm), _stats(2, norm)
    if policy == "full":
        return ("x",)
    if tiled_ffn:
        if norm_first:
            selective, rebuilt = ("x", *stats1, "qkv", "attn_out", "lse", "h"), ("n1",)
        else:
            selective, rebuilt = ("x", "qkv", "attn_out", "lse", "s1", *stats1), ("h",)
        return selective + rebuilt if policy == "none" else selective
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
    # Tokens per chunk of the sequence-tiled FFN half (memopt.tiled_ffn), None: untiled.
    ffn_chunk_tokens: int | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def uses_rng(self) -> bool:
        return self.attention_dropout > 0.0 or self.residual_dropout > 0.0


# ----------------------------------------------------------------------------------------------
# Typed records: parameters, dropout keys, norm statistics, the intermediates of each half.


class BlockParams(NamedTuple):
    """The block's parameters (None for absent biases); the same record holds their gradients and
    which of them need one. The first six belong to the attention half, the last six to the FFN
    half."""

    norm1_weight: Tensor | None
    norm1_bias: Tensor | None
    qkv_weight: Tensor
    qkv_bias: Tensor | None
    out_proj_weight: Tensor
    out_proj_bias: Tensor | None
    norm2_weight: Tensor | None
    norm2_bias: Tensor | None
    fc1_weight: Tensor
    fc1_bias: Tensor | None
    fc2_weight: Tensor
    fc2_bias: Tensor | None


# The block's parameters by state_dict name, in the order TransformerBlockFunction takes them.
PARAM_NAMES = tuple(".".join(field.rsplit("_", 1)) for field in BlockParams._fields)

_LINEAR_PARAMS = ("qkv_weight", "qkv_bias", "out_proj_weight", "out_proj_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


class SiteKeys(NamedTuple):
    """The RNG key of each dropout site (views of one (3, 2) tensor)."""

    attention: Tensor
    attention_residual: Tensor
    ffn_residual: Tensor


# Philox counter offset of each dropout site inside one block's key. Sites are 2^50 counters
# apart: a site would need 2^52 elements to run into the next one.
_SITE_OFFSET_VALUES = ((0, 0), (0, 1 << 50), (0, 2 << 50))
_SITE_OFFSETS = torch.tensor(_SITE_OFFSET_VALUES, dtype=torch.int64, device="cpu")
# The ops take a key even when they drop nothing; one placeholder serves every call.
_NO_DROPOUT_KEYS = SiteKeys(*torch.zeros(3, 2, dtype=torch.int64, device="cpu").unbind(0))

# Note: the two module-level tensors above are real, and a real tensor cannot reach an op together
# with fake ones under a plain FakeTensorMode (shape inference without torch.compile; the
# attention op's placeholder key had the same problem, 7a98d8e). Where the block's tensors are
# FakeTensors, _site_keys builds both per call (the placeholders as a method of one of the
# block's tensors, the offsets under the active mode, where the key was drawn); everywhere else
# (eager, and torch.compile / torch.export, which trace the constants) one isinstance check
# (~0.1 us) is all it adds, not the ~5 us (placeholders) or ~7 us (offsets) of building them
# per call.


# The last key's SiteKeys: (key, its version counter, SiteKeys). A block's forward makes its
# calls from one key object, and so does its backward (the saved key unpacks to the same object),
# so each derives them once. The version counter makes an in-place change of the key a miss.
_last_site_keys: tuple = (None, -1, None)


def _site_keys(rng_key: Tensor | None, like: Tensor | None = None) -> SiteKeys:
    """The sites' keys from the block's key; for no key (no dropout) the placeholder keys.
    ``like``: a tensor of the call; when it is a FakeTensor the placeholders are made per call
    (the Note above)."""
    global _last_site_keys
    if rng_key is None:
        if isinstance(like, FakeTensor):  # (a method of like: fake even where its mode is not entered)
            return SiteKeys(*like.new_zeros((3, 2), dtype=torch.int64, device="cpu").unbind(0))
        return _NO_DROPOUT_KEYS
    # Traced once under torch.compile; an inference tensor has no version counter to key on.
    cached = not torch.compiler.is_compiling() and not rng_key.is_inference()
    if cached:
        key, version, keys = _last_site_keys  # one read: another thread may replace it meanwhile
        if key is rng_key and version == rng_key._version:
            return keys
    if isinstance(rng_key, FakeTensor):  # not cached either: the entry would keep its mode alive
        offsets = torch.tensor(_SITE_OFFSET_VALUES, dtype=torch.int64, device="cpu")
        return SiteKeys(*(rng_key + offsets).unbind(0))
    keys = SiteKeys(*(rng_key + _SITE_OFFSETS).unbind(0))
    if cached:
        _last_site_keys = (rng_key, rng_key._version, keys)
    return keys


class NormStats(NamedTuple):
    """Per-row statistics of one norm forward: float32 (float64 for float64 input)."""

    mean: Tensor | None  # layernorm only
    rstd: Tensor


@dataclass
class AttentionHalf:
    """The attention half's intermediates (module docstring); None where the policy dropped one
    that the backward rebuilds."""

    x: Tensor
    qkv: Tensor
    attn_out: Tensor  # (B, H, S, hd), a view of a (B, S, H, hd) buffer
    lse: Tensor
    norm1: NormStats  # pre-norm: of x; post-norm: of s1
    n1: Tensor | None = None  # pre-norm only
    s1: Tensor | None = None  # post-norm only


@dataclass
class FFNHalf:
    """The FFN half's intermediates; None where the policy dropped one."""

    h: Tensor | None  # the half's input
    u: Tensor
    norm2: NormStats  # pre-norm: of h; post-norm: of s2
    n2: Tensor | None = None  # pre-norm only
    g: Tensor | None = None
    s2: Tensor | None = None  # post-norm only


def _saved_tensor(name: str, attention: AttentionHalf, ffn: FFNHalf | None, h: Tensor) -> Tensor:
    """The tensor :func:`saved_names` calls ``name`` (``"qkv"``, ``"norm2_rstd"``, ...); ``h`` is
    the attention half's output (``ffn`` is None when the FFN half is tiled)."""
    if name == "h":
        return h
    if name.startswith("norm"):
        record, stat = name.split("_")
        stats = attention.norm1 if record == "norm1" else ffn.norm2
        return getattr(stats, stat)
    return getattr(attention if hasattr(attention, name) else ffn, name)


def _saved_halves(names: tuple[str, ...], tensors) -> tuple[Tensor, AttentionHalf | None, FFNHalf | None, Tensor | None]:
    """``(x, attention half, FFN half, h or None)`` from the saved tensors; the halves are None
    under "full", which saves x only, the FFN half when it is tiled."""
    saved = dict(zip(names, tensors))
    if names == ("x",):
        return saved["x"], None, None, None
    return saved["x"], _saved_attention_half(saved), _saved_ffn_half(saved), saved.get("h")


def _saved_attention_half(saved: dict[str, Tensor]) -> AttentionHalf:
    """The attention half's record from the saved tensors by name."""
    stats = NormStats(saved.get("norm1_mean"), saved["norm1_rstd"])
    return AttentionHalf(saved["x"], saved["qkv"], saved["attn_out"], saved["lse"], stats, saved.get("n1"), saved.get("s1"))


def _saved_ffn_half(saved: dict[str, Tensor]) -> FFNHalf | None:
    """The FFN half's record from the saved tensors by name; None when it kept no u (tiled, or
    "full")."""
    if "u" not in saved:
        return None
    stats = NormStats(saved.get("norm2_mean"), saved["norm2_rstd"])
    return FFNHalf(saved.get("h"), saved["u"], stats, saved.get("n2"), saved.get("g"), saved.get("s2"))


class BlockCall(NamedTuple):
    """What one forward or backward of the block works with besides the tensors. (A NamedTuple,
    not a frozen dataclass: six are made per block step, and a frozen dataclass's ``__init__``
    costs ~4 us, a tenth of a small block's host time.)"""

    spec: BlockSpec
    batch: int
    seq: int
    params: BlockParams  # as given (their dtypes are the gradients')
    compute: BlockParams  # the linears' in the compute dtype, the norms' as given
    keys: SiteKeys
    # CPU kernels compute in float32 or float64: under CPU autocast to a half type, activation
    # and attention take float32 inputs and their outputs go back to the compute dtype (the
    # matmuls still run in the half type, as in the eager block). GPUs run them in half.
    upcast: bool
    accumulate: torch.dtype  # bias gradients are summed in at least float32
    # True: the forward steps run as differentiable ops (the ops' own differentiable forms, as
    # their double backward uses them), the graph a backward under create_graph=True
    # differentiates (_grads_with_graph).
    graph: bool = False

    @classmethod
    def make(
        cls, spec: BlockSpec, like: Tensor, rng_key, batch: int, seq: int, params: BlockParams, graph: bool = False
    ) -> BlockCall:
        """``like``: a tensor of the call (its input, or a saved one): its device type, and
        whether the call runs on FakeTensors (:func:`_site_keys`)."""
        dtype = spec.compute_dtype
        compute = params
        for p in params:
            if p is not None and p.dtype != dtype:
                compute = params._replace(**{n: _cast(getattr(params, n), dtype) for n in _LINEAR_PARAMS})
                break
        half = dtype in (torch.float16, torch.bfloat16)
        accumulate = torch.float32 if half else dtype
        upcast = half and like.device.type == "cpu"
        return cls(spec, batch, seq, params, compute, _site_keys(rng_key, like), upcast, accumulate, graph)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype``; itself, with no call into torch, when it already is (or is None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


# ----------------------------------------------------------------------------------------------
# The block's steps on the memopt ops (their helpers in memopt/ops/) and matmuls.


def _norm(call: BlockCall, x: Tensor, weight, bias) -> tuple[Tensor, NormStats]:
    if call.graph:  # no statistics: nothing is saved from this forward
        return _norm_ops._norm_differentiable(call.spec.norm == "rmsnorm", x, weight, bias, call.spec.eps), NormStats(None, None)
    y, _, mean, rstd = _norm_ops._norm_fwd(call.spec.norm == "rmsnorm", x, None, weight, bias, call.spec.eps)
    return y, NormStats(mean, rstd)


def _act(call: BlockCall, u: Tensor, bias) -> Tensor:
    """The activation of fc1's output (bias added), in u's dtype."""
    u_, bias_ = _upcast(call, u), _upcast(call, bias)
    act = _activation_ops._act_differentiable if call.graph else _activation_ops._act_forward
    return _cast(act(u_, bias_, call.spec.activation), u.dtype)


def _norm_backward(call: BlockCall, grad_y, x, weight, bias, stats: NormStats, grad_extra, return_y: bool,
                   need: tuple[bool, bool], grad_y_is_scratch: bool = False):
    """``(grad_x, grad_weight, grad_bias, y or None)``; ``grad_extra`` (the residual's gradient)
    is added to grad_x in the same kernel. ``need``: whether weight and bias need a gradient (one
    that does not is not computed: None). ``grad_y_is_scratch``: grad_y is this backward's own
    (a matmul output), grad_x is written over it."""
    return _norm_ops._norm_bwd(
        call.spec.norm == "rmsnorm", _cast(grad_y, x.dtype), x, weight, bias, stats.mean, stats.rstd, grad_extra,
        return_y, grad_y_is_scratch, *need,
    )  # fmt: skip


def _norm_linear_backward(
    call: BlockCall, grad_out: Tensor, x: Tensor, norm_weight, norm_bias, stats: NormStats, grad_extra,
    kept: Tensor | None, linear_weight: Tensor, weight_param: Tensor, need_weight: bool, need_norm: tuple[bool, bool],
):
    """``(grad_x, grad_norm_weight, grad_norm_bias, grad_linear_weight or None)``: the backward of
    ``linear(norm(x))`` from the linear's output gradient, ``grad_extra`` (the residual's gradient)
    added to grad_x. ``kept``: the forward's norm output, or None when it was not kept.
    ``need_weight`` / ``need_norm``: whether the linear's weight / the norm's weight and bias need
    a gradient (None where not).

    Note:
        Not kept, it is rebuilt with the norm's forward kernel (the forward's bits) into the one
        buffer of x's size this backward allocates: the weight gradient is taken from it, then
        ``grad_out @ linear_weight`` is written over it and grad_x over that, as
        ``memopt.norm_linear``'s backward does. Rebuilding it in the norm's backward kernel held
        two such buffers at once. Where the matmul runs in another dtype (CPU autocast), the
        backward kernel rebuilds it.
    """
    if kept is None and need_weight and grad_out.dtype == x.dtype:
        rebuilt, _ = _norm(call, x, norm_weight, norm_bias)
        grad_weight = _weight_grad(grad_out, rebuilt, weight_param)
        if cpu_linear.mm_in_new_buffer(grad_out, linear_weight, rebuilt):
            del rebuilt  # the heap hands this memory to the product (memopt/ops/cpu_linear.py)
            grad_normed = cpu_linear.mm(grad_out, linear_weight)
        else:
            grad_normed = torch.mm(grad_out, linear_weight, out=rebuilt)
        grad_x, grad_norm_weight, grad_norm_bias, _ = _norm_backward(
            call, grad_normed, x, norm_weight, norm_bias, stats, grad_extra, False, need_norm, grad_y_is_scratch=True
        )
        return grad_x, grad_norm_weight, grad_norm_bias, grad_weight
    grad_normed = cpu_linear.mm(grad_out, linear_weight)
    grad_x, grad_norm_weight, grad_norm_bias, rebuilt = _norm_backward(
        call, grad_normed, x, norm_weight, norm_bias, stats, grad_extra, kept is None and need_weight, need_norm,
        grad_y_is_scratch=True,
    )
    del grad_normed
    grad_weight = _weight_grad(grad_out, rebuilt if kept is None else kept, weight_param) if need_weight else None
    return grad_x, grad_norm_weight, grad_norm_bias, grad_weight


def _upcast(call: BlockCall, t: Tensor | None) -> Tensor | None:
    return t.float() if call.upcast and t is not None else t


def _linear(call: BlockCall, inp: Tensor, weight: Tensor, bias) -> Tensor:
    return cpu_linear.linear(_cast(inp, call.spec.compute_dtype), weight, bias)


def _weight_grad(grad_out: Tensor, inp: Tensor, weight: Tensor) -> Tensor:
    """``grad_out^T @ inp`` (out, in) in the matmul dtype, returned in the weight's dtype."""
    return _cast(grad_out.t() @ _cast(inp, grad_out.dtype), weight.dtype)


def _bias_grad(call: BlockCall, grad_out: Tensor, bias, need: bool) -> Tensor | None:
    """The bias's gradient (the rows' sum of ``grad_out``), or None without a bias or a need."""
    if bias is None or not need:
        return None
    return _cast(grad_out.sum(0, dtype=call.accumulate), bias.dtype)


def _input_grad(grad_out: Tensor, weight: Tensor, residual_grad) -> Tensor:
    """``grad_out @ weight`` plus ``residual_grad`` (in its dtype), fused when the dtypes match."""
    if residual_grad.dtype == grad_out.dtype:
        return cpu_linear.addmm(residual_grad, grad_out, weight)
    return residual_grad + cpu_linear.mm(grad_out, weight)


def _dropout_add(p: float, branch: Tensor, residual: Tensor, key: Tensor, graph: bool = False) -> Tensor:
    """``residual + dropout(branch)`` in the residual stream's dtype (``graph``: differentiable,
    the same mask)."""
    branch = _cast(branch, residual.dtype)
    if p == 0.0:
        return branch + residual
    if graph:
        return _dropout_ops.DropoutAddFunction.apply(branch.contiguous(), residual, p, key)
    return torch.ops.memopt.dropout_add_fwd(branch.contiguous(), residual, p, key)


def _dropout_backward(p: float, grad: Tensor, key: Tensor) -> Tensor:
    if p == 0.0:
        return grad
    return torch.ops.memopt.dropout_add_bwd(grad.contiguous(), p, key)


def _heads(call: BlockCall, qkv: Tensor):
    """Views q (B, H, S, hd), k and v (B, Hkv, S, hd) of ``qkv`` (N, (H + 2 Hkv) hd): no copy."""
    spec = call.spec
    heads = qkv.view(call.batch, call.seq, spec.n_heads + 2 * spec.n_kv_heads, spec.head_dim).transpose(1, 2)
    # split_with_sizes, not Tensor.split: the same views without split's Python wrapper (~4 us).
    q, k, v = heads.split_with_sizes((spec.n_heads, spec.n_kv_heads, spec.n_kv_heads), 1)
    return _upcast(call, q), _upcast(call, k), _upcast(call, v)


def _attention_kernel_fwd(call: BlockCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``memopt::attention_fwd`` on the block's q, k, v. On CPU in eager mode its kernels are
    called directly: these views of the block's own qkv pass the op's checks by construction, and
    the dispatcher's round trip into the op's Python kernel plus the checks cost ~35 us a call.
    Under torch.compile the op stays one opaque node, as its fake impl describes it; on CUDA
    (never measured without the op yet) the op runs as before."""
    spec = call.spec
    if call.graph:  # differentiable (twice, the same dropout mask); no lse is kept from it
        out = _attention_ops.AttentionFunction.apply(
            q, k, v, spec.causal, spec.attention_dropout, spec.scale, call.keys.attention
        )
        return out, None
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return torch.ops.memopt.attention_fwd(q, k, v, spec.causal, spec.attention_dropout, spec.scale, call.keys.attention)
    backend = _attention_ops.resolve_backend("auto", q, k, v, spec.causal, spec.attention_dropout)
    return _attention_ops.run_attention_fwd(
        backend, q, k, v, spec.causal, spec.attention_dropout, spec.scale, call.keys.attention
    )


def _attention_kernel_bwd(call: BlockCall, grad_out, q, k, v, out, lse) -> Tensor:
    """``memopt::attention_bwd``, called as :func:`_attention_kernel_fwd` calls the forward; the
    gradients of q, k, v as one (B, S, H + 2 Hkv, hd) tensor, laid out as qkv is (the CPU flash
    and Triton kernels write them there; ATen's and the native path's are assembled by one copy)."""
    spec = call.spec
    args = (spec.causal, spec.attention_dropout, spec.scale, call.keys.attention)
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return torch.ops.memopt.attention_bwd_packed(grad_out, q, k, v, out, lse, *args)
    backend = _attention_ops.resolve_backend("auto", q, k, v, spec.causal, spec.attention_dropout)
    return _attention_ops.run_attention_bwd_packed(backend, grad_out, q, k, v, out, lse, *args)


def _flat(call: BlockCall, attn_out: Tensor) -> Tensor:
    """attn_out (B, H, S, hd) as (N, H hd): a view, attention writes (B, S, H, hd) memory."""
    return attn_out.transpose(1, 2).reshape(call.batch * call.seq, -1)


# ----------------------------------------------------------------------------------------------
# Forward of each half; the backward's recompute under "full" runs them again.


def _attention_forward(call: BlockCall, x: Tensor) -> tuple[AttentionHalf, Tensor]:
    """The attention half on ``x`` (N, D): its record and its output ``h``."""
    spec, w = call.spec, call.compute
    if spec.norm_first:
        n1, stats = _norm(call, x, w.norm1_weight, w.norm1_bias)
        n1 = _cast(n1, spec.compute_dtype)
        qkv = _linear(call, n1, w.qkv_weight, w.qkv_bias)
    else:
        n1 = None
        qkv = _linear(call, x, w.qkv_weight, w.qkv_bias)
    attn_out, lse = _attention_kernel_fwd(call, *_heads(call, qkv))
    attn_out = _cast(attn_out, qkv.dtype)  # keeps the (B, S, H, hd) layout
    o = _linear(call, _flat(call, attn_out), w.out_proj_weight, w.out_proj_bias)
    residual_sum = _dropout_add(spec.residual_dropout, o, x, call.keys.attention_residual, call.graph)
    if spec.norm_first:
        return AttentionHalf(x, qkv, attn_out, lse, stats, n1=n1), residual_sum
    h, stats = _norm(call, residual_sum, w.norm1_weight, w.norm1_bias)
    return AttentionHalf(x, qkv, attn_out, lse, stats, s1=residual_sum), h


def _ffn_in_forward(call: BlockCall, h: Tensor) -> tuple[Tensor | None, NormStats | None, Tensor]:
    """``(n2, norm2's statistics, u)`` from the FFN half's input ``h``: fc1 on norm2(h) (pre-norm)
    or on h (post-norm: no n2 and no statistics here)."""
    spec, w = call.spec, call.compute
    if not spec.norm_first:
        return None, None, _linear(call, h, w.fc1_weight, None)
    n2, stats = _norm(call, h, w.norm2_weight, w.norm2_bias)
    n2 = _cast(n2, spec.compute_dtype)
    return n2, stats, _linear(call, n2, w.fc1_weight, None)


def _ffn_out_forward(call: BlockCall, u: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(g, h + dropout(f))``: the activation of fc1's output and fc2's output added to the
    residual ``h``."""
    spec, w = call.spec, call.compute
    g = _act(call, u, w.fc1_bias)
    f = _linear(call, g, w.fc2_weight, w.fc2_bias)
    return g, _dropout_add(spec.residual_dropout, f, h, call.keys.ffn_residual, call.graph)


def _ffn_out_half_forward(call: BlockCall, u: Tensor, h: Tensor) -> tuple[FFNHalf, Tensor]:
    """The FFN half from fc1's output on: its record (u and g; post-norm also s2 and norm2's
    statistics) and the block output."""
    spec, w = call.spec, call.compute
    g, residual_sum = _ffn_out_forward(call, u, h)
    if spec.norm_first:
        return FFNHalf(None, u, None, g=g), residual_sum
    y, stats = _norm(call, residual_sum, w.norm2_weight, w.norm2_bias)
    return FFNHalf(None, u, stats, g=g, s2=residual_sum), y


def _ffn_forward(call: BlockCall, h: Tensor, need_output: bool = True) -> tuple[FFNHalf, Tensor | None]:
    """The FFN half on ``h``: its record and the block output.

    With ``need_output=False`` (the "full" recompute) it stops once the backward has what it
    needs: pre-norm skips the activation and fc2, whose output only feeds the block output, and
    keeps no n2 (the backward rebuilds both); post-norm needs fc2 again, for norm2's input s2.
    """
    n2, stats, u = _ffn_in_forward(call, h)
    if call.spec.norm_first and not need_output:
        # n2 is not kept either: fc1's backward rebuilds it in the one buffer it allocates
        # (_norm_linear_backward), one d_model-wide buffer fewer at its peak.
        return FFNHalf(h, u, stats, n2=None), None
    ffn, y = _ffn_out_half_forward(call, u, h)
    ffn.h, ffn.n2 = h, n2
    if call.spec.norm_first:
        ffn.norm2 = stats
    return ffn, y


# ----------------------------------------------------------------------------------------------
# Backward of each half. Temporaries are deleted at their last use, so that (as autograd does
# for an eager graph) one step's buffers do not pile up under the next one's.


def _ffn_out_backward(call: BlockCall, grad_s2: Tensor, ffn: FFNHalf, need: BlockParams):
    """``(grad_u, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias)`` from ``grad_s2``, the gradient
    of ``h + dropout(f)``. Takes ``ffn.u`` and ``ffn.g`` (None: rebuilt by the activation's
    backward kernel) out of the record, so that a recomputed one is freed at its last use here."""
    spec, w, params = call.spec, call.compute, call.params
    u, g = ffn.u, ffn.g
    ffn.u = ffn.g = None
    grad_f = _cast(_dropout_backward(spec.residual_dropout, grad_s2, call.keys.ffn_residual), spec.compute_dtype)
    grad_fc2_bias = _bias_grad(call, grad_f, params.fc2_bias, need.fc2_bias)
    # Under CPU autocast's upcast the activation runs in float32 and fc2 in the half type: g is
    # cast for fc2's weight gradient anyway, so the backward kernel rebuilds it beside grad_g.
    rebuild_g_first = g is None and need.fc2_weight and not call.upcast
    grad_fc2_weight = None
    if rebuild_g_first:
        # One d_ff-wide buffer, as in _norm_linear_backward: g rebuilt by the activation's forward
        # kernel, fc2's weight gradient taken from it, then grad_g written over it.
        rebuilt = _act(call, u, w.fc1_bias)
        grad_fc2_weight = _weight_grad(grad_f, rebuilt, params.fc2_weight)
        if cpu_linear.mm_in_new_buffer(grad_f, w.fc2_weight, rebuilt):
            del rebuilt  # the heap hands this memory to the product (memopt/ops/cpu_linear.py)
            grad_g = cpu_linear.mm(grad_f, w.fc2_weight)
        else:
            grad_g = torch.mm(grad_f, w.fc2_weight, out=rebuilt)
            del rebuilt
    else:
        grad_g = cpu_linear.mm(grad_f, w.fc2_weight)
    # grad_g is this frame's own (a new matmul output, the rebuilt g's buffer, or its upcast
    # copy): the activation's gradient is written over it (but for swiglu's, twice as wide), so
    # no second d_ff-wide gradient buffer exists.
    grad_u, grad_fc1_bias, rebuilt_g = _activation_ops._act_backward(
        _upcast(call, grad_g), _upcast(call, u), _upcast(call, w.fc1_bias), spec.activation,
        g is None and need.fc2_weight and not rebuild_g_first, grad_y_is_scratch=True, need_bias=need.fc1_bias,
    )
    del grad_g, u
    grad_u = _cast(grad_u, spec.compute_dtype)
    grad_fc1_bias = _cast(grad_fc1_bias, params.fc1_bias.dtype) if need.fc1_bias else None
    if need.fc2_weight and not rebuild_g_first:
        grad_fc2_weight = _weight_grad(grad_f, rebuilt_g if g is None else g, params.fc2_weight)
    return grad_u, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias


def _ffn_out_half_backward(call: BlockCall, grad_y: Tensor, ffn: FFNHalf, need: BlockParams):
    """``(grad_u, grad_s2, grad_norm2_weight, grad_norm2_bias, grad_fc1_bias, grad_fc2_weight,
    grad_fc2_bias)``: the backward of :func:`_ffn_out_half_forward`; ``grad_s2`` is the residual
    h's gradient from this part (grad_y itself pre-norm, where the norm2 gradients are None)."""
    spec, w = call.spec, call.compute
    grad_norm2_weight = grad_norm2_bias = None
    if spec.norm_first:
        grad_s2 = grad_y
    else:
        grad_s2, grad_norm2_weight, grad_norm2_bias, _ = _norm_backward(
            call, grad_y, ffn.s2, w.norm2_weight, w.norm2_bias, ffn.norm2, None, False,
            (need.norm2_weight, need.norm2_bias),
        )
        ffn.s2 = None
    grad_u, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias = _ffn_out_backward(call, grad_s2, ffn, need)
    return grad_u, grad_s2, grad_norm2_weight, grad_norm2_bias, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias


def _ffn_in_backward(call: BlockCall, grad_u: Tensor, grad_s2: Tensor, ffn: FFNHalf, need: BlockParams):
    """``(grad_h, grad_norm2_weight, grad_norm2_bias, grad_fc1_weight)``: fc1's (and pre-norm
    norm2's) backward, the residual's gradient ``grad_s2`` added into grad_h. Pre-norm: norm2's
    output is rebuilt by its backward kernel when ``ffn.n2`` is None."""
    spec, w, params = call.spec, call.compute, call.params
    if not spec.norm_first:
        grad_fc1_weight = _weight_grad(grad_u, ffn.h, params.fc1_weight) if need.fc1_weight else None
        return _input_grad(grad_u, w.fc1_weight, grad_s2), None, None, grad_fc1_weight
    return _norm_linear_backward(
        call, grad_u, ffn.h, w.norm2_weight, w.norm2_bias, ffn.norm2, grad_s2, ffn.n2, w.fc1_weight,
        params.fc1_weight, need.fc1_weight, (need.norm2_weight, need.norm2_bias),
    )


def _ffn_backward(call: BlockCall, grad_y: Tensor, saved: FFNHalf | None, h: Tensor, need: BlockParams):
    """``(grad_h, six FFN parameter gradients)``; recomputes the half from ``h`` when ``saved``
    is None ("full"), so that its tensors live in this frame only."""
    ffn = saved if saved is not None else _ffn_forward(call, h, need_output=not call.spec.norm_first)[0]
    del saved
    ffn.h = h  # post-norm "selective" saves no h: the caller rebuilt it
    grad_u, grad_s2, *out_grads = _ffn_out_half_backward(call, grad_y, ffn, need)
    grad_h, *in_grads = _ffn_in_backward(call, grad_u, grad_s2, ffn, need)
    return grad_h, _ffn_grads(call.spec, in_grads, out_grads)


def _ffn_grads(spec: BlockSpec, in_grads, out_grads) -> tuple:
    """The six FFN parameter gradients in BlockParams order from those of
    :func:`_ffn_in_backward` (norm2 weight and bias, fc1 weight) and of
    :func:`_ffn_out_half_backward` (norm2 weight and bias, fc1 bias, fc2 weight and bias); norm2's
    come from the first pre-norm, from the second post-norm."""
    norm2 = in_grads[:2] if spec.norm_first else out_grads[:2]
    return (*norm2, in_grads[2], *out_grads[2:])


# ----------------------------------------------------------------------------------------------
# The FFN half over chunks of tokens (spec.ffn_chunk_tokens; memopt.tiled_ffn): each chunk's
# intermediates live only while it is computed, in the forward and in the backward.


def _chunk_call(call: BlockCall, first_element: int) -> BlockCall:
    """``call`` for the rows of a chunk starting at element ``first_element`` of the (N, D)
    residual stream: the FFN residual's dropout key moved to that chunk's part of the mask."""
    if call.spec.residual_dropout == 0.0:
        return call
    keys = call.keys._replace(ffn_residual=chunk_rng_key(call.keys.ffn_residual, first_element))
    return call._replace(keys=keys)


def _tiled_ffn_forward(call: BlockCall, h: Tensor) -> Tensor:
    """The block output from ``h`` (N, D), the FFN half run ``ffn_chunk_tokens`` rows at a time."""
    width, y = h.shape[1], None
    for start, end in token_chunks(h.shape[0], call.spec.ffn_chunk_tokens, width):
        _, piece = _ffn_forward(_chunk_call(call, start * width), h[start:end])
        if y is None:
            y = piece.new_empty(h.shape[0], piece.shape[1])
        y[start:end] = piece
        del piece
    return y


def _tiled_ffn_backward(call: BlockCall, grad_y: Tensor, h: Tensor, need: BlockParams):
    """:func:`_ffn_backward` chunk by chunk, each chunk recomputed from its rows of ``h``; the
    parameter gradients summed over chunks (in float32 for half types)."""
    width, grad_h = h.shape[1], None
    totals: list[Tensor | None] = [None] * 6
    for start, end in token_chunks(h.shape[0], call.spec.ffn_chunk_tokens, width):
        grad_piece, grads = _ffn_backward(_chunk_call(call, start * width), grad_y[start:end], None, h[start:end], need)
        if grad_h is None:
            grad_h = grad_piece.new_empty(h.shape[0], grad_piece.shape[1])
        grad_h[start:end] = grad_piece
        del grad_piece
        for i, grad in enumerate(grads):
            if grad is not None:
                grad = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
                totals[i] = grad if totals[i] is None else totals[i].add_(grad)
    ffn_params = call.params[6:]  # BlockParams: the FFN half's six come last
    return grad_h, tuple(_cast(t, p.dtype) if t is not None else None for t, p in zip(totals, ffn_params))


def _ffn_half_forward(call: BlockCall, h: Tensor) -> tuple[FFNHalf | None, Tensor]:
    """(the FFN half's record, or None when it runs tiled, and the block output). A graph
    (``call.graph``) is built untiled: the chunks' dropout masks are slices of the whole one."""
    if call.spec.ffn_chunk_tokens is None or call.graph:
        return _ffn_forward(call, h)
    return None, _tiled_ffn_forward(call, h)


def _ffn_half_backward(call: BlockCall, grad_y: Tensor, ffn: FFNHalf | None, h: Tensor, need: BlockParams):
    """``(grad_h, six FFN parameter gradients)``, tiled or not as the forward ran."""
    if call.spec.ffn_chunk_tokens is None:
        return _ffn_backward(call, grad_y, ffn, h, need)
    return _tiled_ffn_backward(call, grad_y, h, need)


def _attention_backward(call: BlockCall, grad_h: Tensor, half: AttentionHalf, need: BlockParams, need_x: bool):
    """``(grad_x or None, six attention parameter gradients)``."""
    spec, w, params = call.spec, call.compute, call.params
    grad_norm1_weight = grad_norm1_bias = None
    if spec.norm_first:
        grad_s1 = grad_h
    else:
        grad_s1, grad_norm1_weight, grad_norm1_bias, _ = _norm_backward(
            call, grad_h, half.s1, w.norm1_weight, w.norm1_bias, half.norm1, None, False,
            (need.norm1_weight, need.norm1_bias),
        )
    del grad_h
    grad_o = _cast(_dropout_backward(spec.residual_dropout, grad_s1, call.keys.attention_residual), spec.compute_dtype)
    grad_out_proj_weight = _weight_grad(grad_o, _flat(call, half.attn_out), params.out_proj_weight) if need.out_proj_weight else None
    grad_out_proj_bias = _bias_grad(call, grad_o, params.out_proj_bias, need.out_proj_bias)
    grad_attn = cpu_linear.mm(grad_o, w.out_proj_weight).view(call.batch, call.seq, spec.n_heads, spec.head_dim).transpose(1, 2)
    del grad_o
    grad_qkv = _attention_kernel_bwd(
        call, _upcast(call, grad_attn), *_heads(call, half.qkv), _upcast(call, half.attn_out), half.lse
    )
    del grad_attn
    grad_qkv = _cast(grad_qkv.view(call.batch * call.seq, -1), half.qkv.dtype)
    grad_qkv_bias = _bias_grad(call, grad_qkv, params.qkv_bias, need.qkv_bias)
    if spec.norm_first:
        grad_x, grad_norm1_weight, grad_norm1_bias, grad_qkv_weight = _norm_linear_backward(
            call, grad_qkv, half.x, w.norm1_weight, w.norm1_bias, half.norm1, grad_s1, half.n1, w.qkv_weight,
            params.qkv_weight, need.qkv_weight, (need.norm1_weight, need.norm1_bias),
        )
    else:
        grad_qkv_weight = _weight_grad(grad_qkv, half.x, params.qkv_weight) if need.qkv_weight else None
        grad_x = _input_grad(grad_qkv, w.qkv_weight, grad_s1) if need_x else None
    grads = (grad_norm1_weight, grad_norm1_bias, grad_qkv_weight, grad_qkv_bias, grad_out_proj_weight, grad_out_proj_bias)
    return grad_x, grads


def _grads_with_graph(forward, inputs, grad_output) -> list:
    """The backward under ``create_graph=True`` (second derivatives): ``forward()`` runs the half
    or block again on a ``BlockCall`` with ``graph`` set, as differentiable ops (the norm's and
    activation's differentiable forms, memopt's dropout and attention Functions: the same dropout
    masks, twice differentiable themselves), and is differentiated, so the gradients of ``inputs`` (None for those that need
    none) are functions of them. The fused kernels serve every ordinary backward."""
    device_type = next(t for t in inputs if t is not None).device.type
    with torch.enable_grad(), autocast_off(device_type):
        output = forward()
    return grads_with_graph(output, inputs, grad_output)


def _recompute_count(spec: BlockSpec, count: int) -> int:
    """How many of a backward's saved tensors (its activations, the first ``count``) go through
    the recompute barrier under torch.compile (ops/_common.saved_for_recompute): none under
    "none", which recomputes nothing."""
    return 0 if spec.policy == "none" else count


class TransformerBlockFunction(torch.autograd.Function):
    """One transformer block; saves ``saved_names(spec.policy, ...)`` and the RNG key.

    ``apply(spec, x (N, D), rng_key or None, batch, seq, *params)`` with ``params`` in
    ``PARAM_NAMES`` order (None for absent biases). Returns the block output (N, D).
    """

    @staticmethod
    def forward(ctx, spec, x, rng_key, batch, seq, *params):
        call = BlockCall.make(spec, x, rng_key, batch, seq, BlockParams(*params))
        # The compute dtype is explicit (spec.compute_dtype): autocast off keeps the forward and
        # the "full" recompute bit-identical.
        with autocast_off(x.device.type):
            attention, h = _attention_forward(call, x)
            ffn, y = _ffn_half_forward(call, h)
        names = saved_names(spec.policy, spec.norm_first, spec.norm, spec.ffn_chunk_tokens is not None)
        ctx.spec, ctx.batch, ctx.seq = spec, batch, seq
        ctx.saved_tensor_names = names
        ctx.save_for_backward(*(_saved_tensor(name, attention, ffn, h) for name in names), rng_key, *params)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_y = grad_y.contiguous()  # y.sum().backward() hands in a stride-0 expanded tensor
        count = len(ctx.saved_tensor_names)
        saved = saved_for_recompute(ctx, grad_y, _recompute_count(ctx.spec, count))
        x, attention, ffn, h = _saved_halves(ctx.saved_tensor_names, saved[:count])
        params = BlockParams(*saved[count + 1 :])
        if building_graph(grad_y):
            call = BlockCall.make(ctx.spec, x, saved[count], ctx.batch, ctx.seq, params, graph=True)
            forward = lambda: _ffn_half_forward(call, _attention_forward(call, x)[1])[1]  # noqa: E731
            grad_x, *grads = _grads_with_graph(forward, (x, *params), grad_y)
            return (None, grad_x, None, None, None, *grads)
        call = BlockCall.make(ctx.spec, x, saved[count], ctx.batch, ctx.seq, params)
        # Absent parameters (None) never need a gradient.
        need = BlockParams(*ctx.needs_input_grad[-len(PARAM_NAMES) :])
        with torch.no_grad(), autocast_off(x.device.type):
            if attention is None:  # "full": recompute the attention half, the FFN half's input
                attention, h = _attention_forward(call, x)
                # Not kept: the qkv backward rebuilds n1 in the one buffer it allocates
                # (_norm_linear_backward), where this backward peaks.
                attention.n1 = None
            elif h is None:  # post-norm "selective": rebuild norm1's output
                h, _ = _norm(call, attention.s1, params.norm1_weight, params.norm1_bias)
            grad_h, ffn_grads = _ffn_half_backward(call, grad_y, ffn, h, need)
            del ffn, h
            grad_x, attention_grads = _attention_backward(call, grad_h, attention, need, ctx.needs_input_grad[1])
        grads = (g if n else None for g, n in zip((*attention_grads, *ffn_grads), need))
        return (None, grad_x, None, None, None, *grads)


# ----------------------------------------------------------------------------------------------
# Pre-norm "none" / "selective" and post-norm "none": the two halves as separate Functions.
#
# Note: one autograd node holds all of its saved tensors until its whole backward has run, so a
# single-node block would keep the FFN half's (u, and n2 and g under "none": the widest) alive
# through the attention half's backward, where an eager graph has already freed them, and its
# step peak would exceed the eager block's. Split at h, the FFN half's saved tensors are freed as
# soon as its backward returns. "full" stays one node (it saves x only; split, the FFN half would
# have to keep h too), and so does post-norm "selective" (its FFN half's input h is norm1's
# output, which it rebuilds from the attention half's s1), and a tiled post-norm block.

_ATTENTION_SAVED = frozenset(("x", "qkv", "attn_out", "lse", "n1", "s1", *_stats(1, "layernorm")))


@functools.lru_cache(maxsize=None)
def split_saved_names(
    policy: str, norm: str, tiled_ffn: bool = False, norm_first: bool = True
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``saved_names(policy, norm_first, norm, tiled_ffn)`` as (the attention half's, the FFN
    half's)."""
    names = saved_names(policy, norm_first, norm, tiled_ffn)
    return tuple(n for n in names if n in _ATTENTION_SAVED), tuple(n for n in names if n not in _ATTENTION_SAVED)


def _at_slots(values, slots, fill) -> BlockParams:
    """A BlockParams (of parameters, or of needs_input_grad flags) with ``values`` at ``slots``
    and ``fill`` (None, or False) elsewhere: what one node of a split block holds of the twelve."""
    full = [fill] * len(BlockParams._fields)
    for slot, value in zip(slots, values):
        full[slot] = value
    return BlockParams(*full)


def _half_params(half: str, params) -> BlockParams:
    """A BlockParams with one half's six (in order) and None for the other half's (the attention
    half's are the first six)."""
    other = (None,) * 6
    return BlockParams(*params, *other) if half == "attention" else BlockParams(*other, *params)


def _half_needs(half: str, needs) -> BlockParams:
    """:func:`_half_params` for needs_input_grad flags: False for the other half's."""
    other = (False,) * 6
    return BlockParams(*needs, *other) if half == "attention" else BlockParams(*other, *needs)


def _save_half(ctx, half: str, spec: BlockSpec, batch: int, seq: int, tensor_of, rng_key, params) -> None:
    """Saves one half's tensors (``tensor_of(name)`` for its names of :func:`split_saved_names`),
    the RNG key and its six parameters, and what its backward needs besides."""
    attention_names, ffn_names = split_saved_names(spec.policy, spec.norm, spec.ffn_chunk_tokens is not None, spec.norm_first)
    names = ffn_names if half == "ffn" else attention_names
    ctx.spec, ctx.batch, ctx.seq, ctx.saved_tensor_names = spec, batch, seq, names
    ctx.save_for_backward(*(tensor_of(name) for name in names), rng_key, *params)


def _restore_half(ctx, half: str, grad: Tensor) -> tuple[dict[str, Tensor], BlockCall, BlockParams]:
    """(the saved tensors by name, the call, which parameters need a gradient) of one half;
    ``grad``: the gradient its backward got."""
    count = len(ctx.saved_tensor_names)
    saved = saved_for_recompute(ctx, grad, _recompute_count(ctx.spec, count))
    by_name = dict(zip(ctx.saved_tensor_names, saved[:count]))
    params = _half_params(half, saved[count + 1 :])
    call = BlockCall.make(ctx.spec, saved[0], saved[count], ctx.batch, ctx.seq, params)
    return by_name, call, _half_needs(half, ctx.needs_input_grad[-6:])


class BlockAttentionFunction(torch.autograd.Function):
    """The attention half of a block (pre-norm, or post-norm "none": norm1 included): ``apply(spec,
    x, rng_key, batch, seq, *six attention parameters)`` returns h; saves the attention half's names of
    :func:`split_saved_names`."""

    @staticmethod
    def forward(ctx, spec, x, rng_key, batch, seq, *params):
        call = BlockCall.make(spec, x, rng_key, batch, seq, _half_params("attention", params))
        with autocast_off(x.device.type):
            attention, h = _attention_forward(call, x)
        _save_half(ctx, "attention", spec, batch, seq, lambda n: _saved_tensor(n, attention, None, h), rng_key, params)
        return h

    @staticmethod
    def backward(ctx, grad_h):
        by_name, call, need = _restore_half(ctx, "attention", grad_h)
        if building_graph(grad_h):
            x, params = by_name["x"], call.params[:6]
            call = call._replace(graph=True)
            grad_x, *grads = _grads_with_graph(lambda: _attention_forward(call, x)[1], (x, *params), grad_h)
            return (None, grad_x, None, None, None, *grads)
        attention = _saved_attention_half(by_name)
        with torch.no_grad(), autocast_off(attention.x.device.type):
            grad_x, grads = _attention_backward(call, grad_h.contiguous(), attention, need, ctx.needs_input_grad[1])
        return (None, grad_x, None, None, None, *(g if n else None for g, n in zip(grads, need[:6])))


class BlockFFNFunction(torch.autograd.Function):
    """The sequence-tiled FFN half of a pre-norm block (``spec.ffn_chunk_tokens``): ``apply(spec,
    h, rng_key, batch, seq, *six FFN parameters)`` returns the block output; saves h (the
    backward recomputes each chunk). Untiled, the half is BlockFFNInFunction and
    BlockFFNOutFunction (the Note below)."""

    @staticmethod
    def forward(ctx, spec, h, rng_key, batch, seq, *params):
        call = BlockCall.make(spec, h, rng_key, batch, seq, _half_params("ffn", params))
        with autocast_off(h.device.type):
            ffn, y = _ffn_half_forward(call, h)
        _save_half(ctx, "ffn", spec, batch, seq, lambda n: _saved_tensor(n, None, ffn, h), rng_key, params)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_y = grad_y.contiguous()  # y.sum().backward() hands in a stride-0 expanded tensor
        by_name, call, need = _restore_half(ctx, "ffn", grad_y)
        h = by_name["h"]
        if building_graph(grad_y):
            params = call.params[6:]
            call = call._replace(graph=True)
            grad_h, *grads = _grads_with_graph(lambda: _ffn_half_forward(call, h)[1], (h, *params), grad_y)
            return (None, grad_h, None, None, None, *grads)
        with torch.no_grad(), autocast_off(h.device.type):
            grad_h, grads = _ffn_half_backward(call, grad_y, _saved_ffn_half(by_name), h, need)
        return (None, grad_h, None, None, None, *(g if n else None for g, n in zip(grads, need[6:])))


# The untiled FFN half of a pre-norm "none" / "selective" or post-norm "none" block: two nodes,
# split at fc1's output u.
#
# Note: the FFN half's d_ff-wide saved tensors (u, and g under "none") are last used by the
# activation's backward; in one node they would live on through fc1's backward, where the eager
# graph has freed them and allocates fc1's weight gradient, and the step's peak would exceed the
# eager block's. BlockFFNOutFunction (bias + activation, fc2, dropout + residual; post-norm: norm2)
# keeps them and frees them when it returns; BlockFFNInFunction (pre-norm: norm2; fc1) keeps h
# (pre-norm also norm2's statistics, and n2 under "none"). The residual h reaches
# BlockFFNOutFunction as BlockFFNInFunction's second output (a view of its input), so its
# gradient comes back to BlockFFNInFunction and is added in norm2's backward kernel (post-norm: in
# fc1's input-gradient addmm), as in the one-node half, not by the engine.

# Each node's parameters: their BlockParams slots, by norm_first.
_FFN_IN_SLOTS = {True: (6, 7, 8), False: (8,)}  # (norm2 weight, norm2 bias,) fc1 weight
_FFN_OUT_SLOTS = {True: (9, 10, 11), False: (6, 7, 9, 10, 11)}  # (norm2 weight, bias,) fc1 bias, fc2


def _ffn_split_call(spec: BlockSpec, like: Tensor, rng_key, batch: int, seq: int, params, slots) -> BlockCall:
    """The call of one of the split FFN half's nodes: its ``params`` at ``slots`` of a
    BlockParams, None elsewhere."""
    return BlockCall.make(spec, like, rng_key, batch, seq, _at_slots(params, slots, None))


@functools.lru_cache(maxsize=None)
def _ffn_split_names(policy: str, norm: str, norm_first: bool, out: bool) -> tuple[str, ...]:
    """The FFN half's names of :func:`split_saved_names` that BlockFFNOutFunction (``out``) or
    BlockFFNInFunction keeps (BlockFFNOutFunction keeps the residual h as well)."""
    in_names = {"h", "n2", *(_stats(2, norm) if norm_first else ())}
    names = split_saved_names(policy, norm, False, norm_first)[1]
    return tuple(n for n in names if (n not in in_names) == out)


def _slot_grads(in_grads, slots, need: BlockParams) -> tuple:
    """The gradients of one split node's parameters (``slots``) from a BlockParams-ordered
    sequence of 12, None where not needed."""
    return tuple(in_grads[slot] if need[slot] else None for slot in slots)


class BlockFFNInFunction(torch.autograd.Function):
    """fc1 (pre-norm: on norm2's output) of a block: ``apply(spec, h, batch, seq, *params)``, the
    parameters at ``_FFN_IN_SLOTS``, returns ``(u, h)``, h as a view for BlockFFNOutFunction's
    residual (the Note above)."""

    @staticmethod
    def forward(ctx, spec, h, batch, seq, *params):
        slots = _FFN_IN_SLOTS[spec.norm_first]
        call = _ffn_split_call(spec, h, None, batch, seq, params, slots)
        with autocast_off(h.device.type):
            n2, stats, u = _ffn_in_forward(call, h)
        record = FFNHalf(h, u, stats, n2=n2)
        names = _ffn_split_names(spec.policy, spec.norm, spec.norm_first, False)
        ctx.spec, ctx.batch, ctx.seq, ctx.saved_tensor_names = spec, batch, seq, names
        ctx.save_for_backward(*(_saved_tensor(n, None, record, h) for n in names), *params)
        return u, h

    @staticmethod
    def backward(ctx, grad_u, grad_residual):
        spec, count = ctx.spec, len(ctx.saved_tensor_names)
        slots, saved = _FFN_IN_SLOTS[spec.norm_first], saved_for_recompute(ctx, grad_u, _recompute_count(spec, count))
        by_name = dict(zip(ctx.saved_tensor_names, saved[:count]))
        h = by_name["h"]
        call = _ffn_split_call(spec, h, None, ctx.batch, ctx.seq, saved[count:], slots)
        need = _at_slots(ctx.needs_input_grad[-len(slots) :], slots, False)
        if building_graph(grad_u, grad_residual):
            call = call._replace(graph=True)
            params = tuple(call.params[slot] for slot in slots)
            grad_h, *grads = _grads_with_graph(lambda: _ffn_in_forward(call, h)[2], (h, *params), grad_u)
            grad_h = grad_residual if grad_h is None else grad_h + grad_residual
            return (None, grad_h, None, None, *grads)
        stats = NormStats(by_name.get("norm2_mean"), by_name["norm2_rstd"]) if spec.norm_first else None
        record = FFNHalf(h, None, stats, n2=by_name.get("n2"))
        with torch.no_grad(), autocast_off(h.device.type):
            grad_h, grad_norm2_weight, grad_norm2_bias, grad_fc1_weight = _ffn_in_backward(
                call, grad_u.contiguous(), grad_residual.contiguous(), record, need
            )
        grads = (None,) * 6 + (grad_norm2_weight, grad_norm2_bias, grad_fc1_weight) + (None,) * 3
        return (None, grad_h, None, None, *_slot_grads(grads, slots, need))


class BlockFFNOutFunction(torch.autograd.Function):
    """Bias + activation, fc2, dropout + residual (post-norm: and norm2) of a block:
    ``apply(spec, u, h, rng_key, batch, seq, *params)``, the parameters at ``_FFN_OUT_SLOTS``,
    returns the block output; keeps u (and g under "none") until its backward returns (the Note
    above)."""

    @staticmethod
    def forward(ctx, spec, u, h, rng_key, batch, seq, *params):
        slots = _FFN_OUT_SLOTS[spec.norm_first]
        call = _ffn_split_call(spec, u, rng_key, batch, seq, params, slots)
        with autocast_off(u.device.type):
            record, y = _ffn_out_half_forward(call, u, h)
        names = _ffn_split_names(spec.policy, spec.norm, spec.norm_first, True)
        ctx.spec, ctx.batch, ctx.seq, ctx.saved_tensor_names = spec, batch, seq, names
        # h (BlockFFNInFunction keeps its storage: no bytes) for a backward under create_graph.
        ctx.save_for_backward(*(_saved_tensor(n, None, record, h) for n in names), h, rng_key, *params)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_y = grad_y.contiguous()  # y.sum().backward() hands in a stride-0 expanded tensor
        spec, count = ctx.spec, len(ctx.saved_tensor_names)
        slots, saved = _FFN_OUT_SLOTS[spec.norm_first], saved_for_recompute(ctx, grad_y, _recompute_count(spec, count))
        by_name = dict(zip(ctx.saved_tensor_names, saved[:count]))
        u, h, rng_key = by_name["u"], saved[count], saved[count + 1]
        call = _ffn_split_call(spec, u, rng_key, ctx.batch, ctx.seq, saved[count + 2 :], slots)
        need = _at_slots(ctx.needs_input_grad[-len(slots) :], slots, False)
        if building_graph(grad_y):
            call = call._replace(graph=True)
            params = tuple(call.params[slot] for slot in slots)
            grad_u, grad_h, *grads = _grads_with_graph(lambda: _ffn_out_half_forward(call, u, h)[1], (u, h, *params), grad_y)
            return (None, grad_u, grad_h, None, None, None, *grads)
        stats = None if spec.norm_first else NormStats(by_name.get("norm2_mean"), by_name["norm2_rstd"])
        record = FFNHalf(None, u, stats, g=by_name.get("g"), s2=by_name.get("s2"))
        with torch.no_grad(), autocast_off(u.device.type):
            grad_u, grad_s2, grad_norm2_weight, grad_norm2_bias, *fc_grads = _ffn_out_half_backward(call, grad_y, record, need)
        grads = (None,) * 6 + (grad_norm2_weight, grad_norm2_bias, None, *fc_grads)
        return (None, grad_u, grad_s2, None, None, None, *_slot_grads(grads, slots, need))


def needs_autograd(x: Tensor, params) -> bool:
    """Whether a block call on ``x`` with ``params`` runs as :func:`apply_block`'s autograd
    Functions: it records a graph (gradients on, and ``x`` or a parameter requires one), or
    forward-mode AD is active (a ``torch.autograd.forward_ad`` dual level, ``torch.func.jvp``),
    where the Functions refuse the call (they define no jvp) and the ops would drop the tangents.
    Where neither holds (``torch.no_grad``, ``torch.inference_mode``, a frozen model) nothing is
    saved for a backward, and :func:`block_forward` runs the call."""
    if forward_ad._current_level >= 0:  # -1 outside every dual level; read under torch.compile too
        return True
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p is not None and p.requires_grad for p in params)


def block_forward(spec: BlockSpec, x: Tensor, rng_key: Tensor | None, batch: int, seq: int, params) -> Tensor:
    """The block on ``x`` (N, D) for a call that records no graph (not :func:`needs_autograd`): the
    steps of :func:`apply_block`'s Functions, on the same kernels with the same dropout keys (the
    same bits), without autograd nodes.

    The FFN half's intermediates are freed where an eager forward frees them, not kept as its
    record keeps them for a backward: norm2's output before fc2, fc1's output and the activation
    before the residual add. The attention half's record goes when the half returns (the one-node
    "full" block kept it through the FFN half: 1.5x the eager block's peak).
    """
    call = BlockCall.make(spec, x, rng_key, batch, seq, BlockParams(*params))
    w = call.compute
    with autocast_off(x.device.type):
        h = _attention_forward(call, x)[1]
        if spec.ffn_chunk_tokens is not None:
            return _tiled_ffn_forward(call, h)
        # The steps of _ffn_in_forward and _ffn_out_half_forward. fc1's output (its float32 copy
        # where CPU half types upcast) is this forward's own: the activation is written over it,
        # as torch's encoder fast path does, one d_ff-wide buffer fewer than _act's at the peak.
        u = _upcast(call, _ffn_in_forward(call, h)[2])
        g = _activation_ops._act_forward_inplace(u, _upcast(call, w.fc1_bias), spec.activation)
        del u
        f = _linear(call, g, w.fc2_weight, w.fc2_bias)
        del g
        residual_sum = _dropout_add(spec.residual_dropout, f, h, call.keys.ffn_residual)
        del f
        if spec.norm_first:
            return residual_sum
        return _norm(call, residual_sum, w.norm2_weight, w.norm2_bias)[0]


def apply_block(spec: BlockSpec, x: Tensor, rng_key: Tensor | None, batch: int, seq: int, params) -> Tensor:
    """The block on ``x`` (N, D) with ``params`` in ``PARAM_NAMES`` order: pre-norm "none" and
    "selective" and post-norm "none" as the attention half's Function and the FFN half's (two
    when untiled; the Notes above), otherwise :class:`TransformerBlockFunction`."""
    tiled = spec.ffn_chunk_tokens is not None
    if spec.policy == "full" or (not spec.norm_first and (spec.policy != "none" or tiled)):
        return TransformerBlockFunction.apply(spec, x, rng_key, batch, seq, *params)
    h = BlockAttentionFunction.apply(spec, x, rng_key, batch, seq, *params[:6])
    if tiled:
        return BlockFFNFunction.apply(spec, h, rng_key, batch, seq, *params[6:])
    u, residual = BlockFFNInFunction.apply(spec, h, batch, seq, *(params[i] for i in _FFN_IN_SLOTS[spec.norm_first]))
    out_params = (params[i] for i in _FFN_OUT_SLOTS[spec.norm_first])
    return BlockFFNOutFunction.apply(spec, u, residual, rng_key, batch, seq, *out_params)
