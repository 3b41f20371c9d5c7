"""Transformer blocks: ``FusedCheckpointBlock`` (memopt's fused ops, a recompute policy) and
``EagerTransformerBlock`` (the same block in plain PyTorch ops: test reference, bench baseline).

Both hold the same parameters under the same names, so their ``state_dict`` s load into each
other::

    norm1.weight, norm1.bias, qkv.weight, qkv.bias, out_proj.weight, out_proj.bias,
    norm2.weight, norm2.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias

(``*.bias`` of linears and layer norms exist when ``bias=True``; RMSNorm has no bias.) ``qkv``
rows are ``[q; k; v]`` like ``nn.MultiheadAttention.in_proj_weight``; with grouped-query
attention k and v have ``n_kv_heads * head_dim`` rows each. For ``activation="swiglu"`` fc1 is
``2 * d_ff`` wide, rows ``[gate; up]``.

Dropout sites (GPT-2 style): attention probabilities and the two residual branches (attention
output projection, FFN output). There is no dropout inside the FFN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memopt import _extension
from memopt._stock_forward import has_module_hooks, runs_stock_forward
from memopt.block_functions import (
    MAX_HEAD_DIM, PARAM_NAMES, BlockSpec, apply_block, block_forward, head_dim_supported, needs_autograd, saved_names,
)
from memopt.offload import Offload, offload_group
from memopt.ops._common import _AUTOCAST_CASTABLE
from memopt.ops._rng import new_rng_key
from memopt.policy import check_offload, check_policy
from memopt.tiled_ffn import check_ffn_chunk_tokens

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu")
NORMS = ("layernorm", "rmsnorm")

__all__ = [
    "EagerTransformerBlock",
    "FusedCheckpointBlock",
    "FusedCheckpointStack",
    "saved_bytes_per_layer",
    "saved_bytes_per_token",
]


def _check_eps(eps, owner: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"{owner}: eps must be a non-negative finite float, got {eps!r}")


def _check_choice(value, choices, name: str, owner: str) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {list(choices)}, got {value!r}")


def _stat_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


# ----------------------------------------------------------------------------------------------
# Shared parameters and configuration.


class _TransformerBlockBase(nn.Module):
    """Parameters and configuration shared by the eager and the fused block."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        n_kv_heads: int | None = None,
        dropout: float = 0.0,
        activation: str = "gelu",
        norm: str = "layernorm",
        norm_first: bool = True,
        causal: bool = False,
        bias: bool = True,
        eps: float = 1e-5,
        batch_first: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        owner = type(self).__name__
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
            if value is None and name in ("n_kv_heads", "d_ff"):
                continue  # defaults below
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        d_ff = 4 * d_model if d_ff is None else d_ff
        if d_model % n_heads:
            raise ValueError(f"{owner}: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"{owner}: n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{owner}: dropout must be a float in [0, 1), got {dropout!r}")
        _check_choice(activation, ACTIVATIONS, "activation", owner)
        _check_choice(norm, NORMS, "norm", owner)
        _check_eps(eps, owner)
        self.d_model, self.n_heads, self.n_kv_heads, self.d_ff = d_model, n_heads, n_kv_heads, d_ff
        self.head_dim = d_model // n_heads
        self.dropout, self.activation, self.norm = float(dropout), activation, norm
        self.norm_first, self.causal, self.bias = bool(norm_first), bool(causal), bool(bias)
        self.batch_first = bool(batch_first)

        factory = {"device": device, "dtype": dtype}
        qkv_width = (n_heads + 2 * n_kv_heads) * self.head_dim
        fc1_width = 2 * d_ff if activation == "swiglu" else d_ff
        self.norm1 = self._make_norm(float(eps), factory)
        self.qkv = nn.Linear(d_model, qkv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.norm2 = self._make_norm(float(eps), factory)
        self.fc1 = nn.Linear(d_model, fc1_width, bias=bias, **factory)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias, **factory)

    def _make_norm(self, eps: float, factory) -> nn.Module:
        if self.norm == "layernorm":
            return nn.LayerNorm(self.d_model, eps=eps, bias=self.bias, **factory)
        return nn.RMSNorm(self.d_model, eps=eps, **factory)

    @property
    def eps(self) -> float:
        """The norms' eps: ``norm1.eps``, which the fused block requires ``norm2.eps`` to equal
        (it runs both norms with one eps). Setting it sets both norms'."""
        return self.norm1.eps

    @eps.setter
    def eps(self, value: float) -> None:
        _check_eps(value, type(self).__name__)
        self.norm1.eps = self.norm2.eps = float(value)

    def config(self) -> dict:
        """Constructor keyword arguments that rebuild this block's shape (not its weights)."""
        return {
            "d_model": self.d_model, "n_heads": self.n_heads, "d_ff": self.d_ff,
            "n_kv_heads": self.n_kv_heads, "dropout": self.dropout, "activation": self.activation,
            "norm": self.norm, "norm_first": self.norm_first, "causal": self.causal,
            "bias": self.bias, "eps": self.eps, "batch_first": self.batch_first,
        }  # fmt: skip

    def _factory(self) -> dict:
        weight = self.qkv.weight
        return {"device": weight.device, "dtype": weight.dtype}

    def _resolve_causal(self, attn_mask, is_causal: bool, seq: int) -> bool:
        """Whether attention is causal for this call. Only causal masks are supported."""
        if attn_mask is None:
            if is_causal and not self.causal:
                raise ValueError(
                    f"{type(self).__name__}: is_causal=True needs the causal attn_mask it describes "
                    "(as in nn.TransformerEncoderLayer), or construct the block with causal=True"
                )
            return self.causal
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
            )
        if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (seq, seq):
            raise ValueError(
                f"{type(self).__name__}: attn_mask must be a ({seq}, {seq}) causal mask (or None), "
                f"got shape {tuple(attn_mask.shape)}; arbitrary and padding masks are not supported"
            )
        if not is_causal and torch.compiler.is_compiling():
            # Checking the mask reads its values on the host: a data-dependent graph break, which
            # torch.compile(fullgraph=True) refuses with a message that does not say what to do.
            raise ValueError(
                f"{type(self).__name__}: under torch.compile an attn_mask cannot be checked to be causal "
                "(that reads its values on the host); pass is_causal=True with the causal mask, or "
                "attn_mask=None to a block constructed with causal=True"
            )
        if not is_causal and not _is_causal_mask(attn_mask):
            raise ValueError(
                f"{type(self).__name__}: attn_mask must be causal: a bool mask True strictly above the "
                "diagonal (nn.Transformer convention: True = not allowed) or a float mask with -inf "
                "strictly above the diagonal and 0 elsewhere (nn.Transformer.generate_square_subsequent_mask); "
                "other masks are not supported"
            )
        return True

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config().items())


def _is_causal_mask(mask: torch.Tensor) -> bool:
    """True for a bool mask True exactly above the diagonal, or float 0 / -inf likewise (one sync)."""
    seq = mask.shape[0]
    above = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    if not mask.is_floating_point():
        return False
    blocked = torch.isneginf(mask)
    return bool(torch.equal(blocked, above) and torch.all(mask.masked_fill(blocked, 0.0) == 0))


def _copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters (PARAM_NAMES) into ``dst``'s, with ``requires_grad``.

    Read as the forward reads them (``getattr``), not through ``state_dict()``: a parametrized
    submodule (``parametrizations.weight_norm(block.fc1)``, which the forward runs) keeps its
    tensors under other keys (``fc1.parametrizations.weight.original0``), which ``dst`` does not
    have; ``dst`` gets the weight it computes. A parametrized tensor needs a gradient when one of
    its originals does."""
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for (module, attr), value in zip(_PARAM_PATHS, _block_params(src)):
            target = dst_params.get(f"{module}.{attr}")
            if value is None or target is None:
                if (value is None) != (target is None):
                    raise RuntimeError(f"{type(src).__name__}: {module}.{attr} is present in one block only")
                continue
            target.copy_(value)
            sub = src._modules[module]
            if torch.nn.utils.parametrize.is_parametrized(sub, attr):
                requires_grad = any(p.requires_grad for p in sub.parametrizations[attr].parameters())
            else:
                requires_grad = value.requires_grad
            target.requires_grad_(requires_grad)


def _to_batch_first(block, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{type(block).__name__}: x must be a floating-point tensor, got {got}")
    if x.dim() != 3 or x.shape[-1] != block.d_model:
        layout = "(batch, seq, d_model)" if block.batch_first else "(seq, batch, d_model)"
        raise ValueError(
            f"{type(block).__name__}: x must be {layout} with d_model={block.d_model}, got {tuple(x.shape)}"
        )
    return x if block.batch_first else x.transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# The eager reference.


EAGER_ATTENTIONS = ("sdpa", "math")


class EagerTransformerBlock(_TransformerBlockBase):
    """The block in plain PyTorch ops (``F.layer_norm``, ``F.linear``, SDPA): the one eager
    reference of memopt, for the tests, the benchmarks (``python -m bench``'s eager rows) and the docs.

    Same constructor, parameters and ``forward`` as :class:`FusedCheckpointBlock`, minus the
    policy, plus ``attention``: ``"sdpa"`` (``F.scaled_dot_product_attention``, default) or
    ``"math"`` (matmul, mask, softmax, dropout, matmul: what a hand-written block saves). Their
    dropout masks differ from memopt's Philox masks, so with dropout > 0 only distributions match.
    """

    def __init__(self, *args, attention: str = "sdpa", **kwargs):
        super().__init__(*args, **kwargs)
        _check_choice(attention, EAGER_ATTENTIONS, "attention", type(self).__name__)
        self.attention = attention

    def config(self) -> dict:
        return {**super().config(), "attention": self.attention}

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False):
        """``x`` (B, S, d_model) (``(S, B, d_model)`` when ``batch_first=False``) -> same shape."""
        x_bf = _to_batch_first(self, x)
        causal = self._resolve_causal(attn_mask, is_causal, x_bf.shape[1])
        if self.norm_first:
            h = x_bf + self._residual_dropout(self._attention(self.norm1(x_bf), causal))
            y = h + self._residual_dropout(self._ffn(self.norm2(h)))
        else:
            h = self.norm1(x_bf + self._residual_dropout(self._attention(x_bf, causal)))
            y = self.norm2(h + self._residual_dropout(self._ffn(h)))
        return y if self.batch_first else y.transpose(0, 1)

    def _residual_dropout(self, branch):
        return F.dropout(branch, self.dropout, self.training)

    def _attention(self, x, causal: bool):
        batch, seq, _ = x.shape
        heads = self.qkv(x).view(batch, seq, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in heads.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2))
        p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            if causal:
                hidden = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(hidden, float("-inf"))
            out = torch.matmul(F.dropout(torch.softmax(scores, dim=-1), p, self.training), v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, self.d_model))

    def _ffn(self, x):
        u = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = u.chunk(2, dim=-1)
            g = F.silu(gate) * up
        elif self.activation == "relu":
            g = F.relu(u)
        elif self.activation == "silu":
            g = F.silu(u)
        else:
            g = F.gelu(u, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.fc2(g)

    def to_fused(self, policy: str = "selective") -> "FusedCheckpointBlock":
        """A :class:`FusedCheckpointBlock` with this block's configuration and weights."""
        config = {k: v for k, v in self.config().items() if k != "attention"}
        config["eps"] = _shared_norm_eps(self)  # the fused block runs both norms with one eps
        block = FusedCheckpointBlock(**config, policy=policy, **self._factory())
        _copy_weights(block, self)
        return block.train(self.training)  # an eval-mode block stays in eval (no dropout)


# ----------------------------------------------------------------------------------------------
# The fused block.


class FusedCheckpointBlock(_TransformerBlockBase):
    """A transformer encoder block that saves little for backward and recomputes the rest.

    ``FusedCheckpointBlock(d_model, n_heads, d_ff=4*d_model, *, n_kv_heads=n_heads, dropout=0.0,
    activation="gelu", norm="layernorm", norm_first=True, causal=False, bias=True, eps=1e-5,
    policy="selective", offload=False, ffn_chunk_tokens=None, batch_first=True, device=None,
    dtype=None)``

    Args:
        activation: ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` or ``"swiglu"``
            (fc1 is then ``2 * d_ff`` wide: ``[gate; up]``, ``silu(gate) * up``).
        norm: ``"layernorm"`` or ``"rmsnorm"``; ``norm_first`` selects pre-norm (GPT-2/LLaMA)
            or post-norm (original Transformer, ``nn.TransformerEncoderLayer`` default).
        dropout: probability at the three dropout sites (attention probabilities, the attention
            and FFN residual branches); active in training mode only.
        policy: what is saved for backward; switchable at any time through ``block.policy``:

            * ``"none"``: what the fused backward kernels need (norm and activation outputs,
              matmul outputs, attention out + lse); attention probabilities and dropout
              masks are still rebuilt inside kernels.
            * ``"selective"``: matmul outputs and attention out + lse only; norms, activations,
              dropout masks and attention probabilities are rebuilt in the backward kernels.
              No extra matmul.
            * ``"full"``: only the block input and the RNG key; the backward reruns the forward
              up to what it needs (pre-norm skips fc2, whose output only feeds the block output).
        offload: where the policy's saved set lives; switchable through ``block.offload``
            (see :mod:`memopt.policy`). False: on the device. True: copied to host memory by
            the offload engine (``memopt/offload.py``) and brought back a block ahead in the
            backward, each block call one offload group, in the active ``memopt.Offload`` or
            else the process default (``memopt.offload.default_offload()``). A
            ``memopt.Offload``: that engine (a new group in it when it is already active). CPU
            tensors stay where they are unless the engine was made with
            ``allow_cpu_source=True``. Under ``"full"`` the policy's set is the block input
            itself, so the device keeps no activation of an offloaded block between its forward
            and its backward (the engine's ``max_host_bytes`` decides how many blocks fit on the
            host; the rest keep their input on the device).
        ffn_chunk_tokens: None (default) or a positive int: the FFN half (norm2, fc1, the
            activation, fc2, the residual dropout and add; post-norm also norm2) runs this many
            tokens (rows of ``batch * seq``) at a time, so its ``(tokens, d_ff)`` intermediates
            exist for one chunk at a time in the forward and in the backward
            (:mod:`memopt.tiled_ffn`). The FFN half then saves only its input under every policy
            and is recomputed chunk by chunk in the backward (one more FFN forward). Outputs and
            gradients equal the untiled block's (dropout masks included). Switchable through
            ``block.ffn_chunk_tokens``.
        batch_first: input layout, ``(B, S, d_model)`` when True, else ``(S, B, d_model)`` (as
            ``nn.TransformerEncoderLayer(batch_first=False)``; costs a transpose copy).

    ``forward(x, attn_mask=None, *, is_causal=False)``: ``attn_mask`` may be None or a causal
    ``(S, S)`` mask (bool True above the diagonal, or float ``-inf`` above the diagonal and 0
    elsewhere); it is checked on the host (one device sync) unless ``is_causal=True`` vouches
    for it (under ``torch.compile`` it must: the check cannot run in a graph). Other masks raise
    ``ValueError``. :meth:`from_torch` and :meth:`supports` convert ``nn.TransformerEncoderLayer`` s
    (:mod:`memopt.torch_interop`).

    The forward reads the submodules' parameters (``fc1.weight``, ...) without calling the
    submodules: it raises while one has module hooks, which would not run
    (``torch.nn.utils.prune``); parametrizations work. torch.func transforms are not supported.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        policy: str = "selective",
        offload: bool | Offload = False,
        ffn_chunk_tokens: int | None = None,
        **kwargs,
    ):
        super().__init__(d_model, n_heads, d_ff, **kwargs)
        if not head_dim_supported(self.head_dim):
            raise ValueError(
                f"FusedCheckpointBlock: head_dim = d_model / n_heads = {self.head_dim} must be between 1 and "
                f"{MAX_HEAD_DIM} (the sizes memopt.attention's kernels take)"
            )
        self.policy = policy
        self.offload = offload
        self.ffn_chunk_tokens = ffn_chunk_tokens

    @property
    def policy(self) -> str:
        return self._policy

    @policy.setter
    def policy(self, value: str) -> None:
        self._policy = check_policy(value, type(self).__name__)

    @property
    def offload(self) -> bool | Offload:
        return self._offload

    @offload.setter
    def offload(self, value: bool | Offload) -> None:
        self._offload = check_offload(value, type(self).__name__)

    @property
    def ffn_chunk_tokens(self) -> int | None:
        return self._ffn_chunk_tokens

    @ffn_chunk_tokens.setter
    def ffn_chunk_tokens(self, value: int | None) -> None:
        self._ffn_chunk_tokens = check_ffn_chunk_tokens(value, type(self).__name__)

    def config(self) -> dict:
        return {**super().config(), "policy": self.policy, "ffn_chunk_tokens": self.ffn_chunk_tokens}

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False):
        """``x`` (B, S, d_model) (``(S, B, d_model)`` when ``batch_first=False``) -> same shape."""
        x_bf = _to_batch_first(self, x)
        batch, seq, _ = x_bf.shape
        causal = self._resolve_causal(attn_mask, is_causal, seq)
        _extension.require_cuda_kernels("FusedCheckpointBlock", x)
        if x.dtype in _HALF_DTYPES and x.device.type == "cpu":
            # The residual stream is x's dtype, and the CPU norm and dropout kernels take float32 /
            # float64 only: say so here rather than from an op the caller never called.
            raise ValueError(
                f"{type(self).__name__}: x is {x.dtype} on CPU, where the block's kernels take float32 or float64 "
                "activations (float16 / bfloat16 run on CUDA). Pass float32 x, or use the eager block (to_eager())"
            )
        drop = self.dropout if self.training else 0.0
        spec = BlockSpec(
            policy=self.policy,
            norm=self.norm, norm_first=self.norm_first, activation=self.activation,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, causal=causal,
            eps=_shared_norm_eps(self), attention_dropout=drop, residual_dropout=drop, compute_dtype=compute_dtype(x),
            ffn_chunk_tokens=self.ffn_chunk_tokens,
        )  # fmt: skip
        _check_submodules_run_stock_forward(self)
        params = _block_params(self)
        if batch * seq == 0:
            # No token: an empty output, as torch's layers give, whose backward gives the
            # parameters zero gradients (not None), as an eager block's would.
            zero = sum(p.sum() * 0 for p in params if p is not None)
            y = x_bf + zero.to(x_bf.dtype)
            return y if self.batch_first else y.transpose(0, 1)
        rng_key = new_rng_key() if spec.uses_rng else None
        x_flat = x_bf.reshape(batch * seq, self.d_model).contiguous()
        if not needs_autograd(x_flat, params):
            # Evaluation, inference: nothing to save, so neither autograd Functions nor an offload group.
            y = block_forward(spec, x_flat, rng_key, batch, seq, params)
        elif self.offload:
            with offload_group(self.offload):
                y = apply_block(spec, x_flat, rng_key, batch, seq, params)
        else:
            y = apply_block(spec, x_flat, rng_key, batch, seq, params)
        y = y.view(batch, seq, self.d_model)
        return y if self.batch_first else y.transpose(0, 1)

    def to_eager(self) -> EagerTransformerBlock:
        """An :class:`EagerTransformerBlock` with this block's configuration and weights."""
        config = self.config()
        config.pop("policy")
        config.pop("ffn_chunk_tokens")
        block = EagerTransformerBlock(**config, **self._factory())
        block.norm2.eps = self.norm2.eps  # eps is no state_dict entry
        _copy_weights(block, self)
        return block.train(self.training)

    @classmethod
    def from_eager(cls, block: EagerTransformerBlock, policy: str = "selective") -> "FusedCheckpointBlock":
        return block.to_fused(policy)

    @classmethod
    def supports(cls, layer: nn.Module, *, allow_autocast: bool = False) -> bool:
        """Whether :meth:`from_torch` reproduces ``layer`` exactly: :func:`memopt.torch_interop.supports`."""
        from memopt import torch_interop

        return torch_interop.supports(layer, allow_autocast=allow_autocast)

    @classmethod
    def from_torch(
        cls, layer: nn.TransformerEncoderLayer, policy: str = "selective", *, share_parameters: bool = False
    ) -> "FusedCheckpointBlock":
        """A block with ``layer``'s configuration and weights: :func:`memopt.torch_interop.from_torch`."""
        from memopt import torch_interop

        return torch_interop.from_torch(layer, policy, share_parameters=share_parameters)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a block's matmuls and attention run in for input ``x``: the autocast dtype
    under autocast when autocast casts ``x``'s dtype (not float64), else ``x``'s."""
    # Autocast casts float32/float16/bfloat16 only: a float64 input stays float64, as torch's ops keep it.
    if x.dtype in _AUTOCAST_CASTABLE and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


_HALF_DTYPES = (torch.float16, torch.bfloat16)


# PARAM_NAMES as (submodule, attribute) pairs: the block's forward fetches its parameters by them.
_PARAM_PATHS = tuple(tuple(name.split(".")) for name in PARAM_NAMES)


def _block_params(block: nn.Module) -> list[torch.Tensor | None]:
    """The block's parameters in PARAM_NAMES order (None where it has none), as ``getattr`` finds
    them, read from the submodules' ``_parameters`` first: the forward runs this for every call,
    and ``nn.Module.__getattr__`` costs a Python frame per name. A name not there (a
    parametrization moves its tensor out) is looked up by ``getattr``."""
    params = []
    for module, attr in _PARAM_PATHS:
        sub = block._modules[module]
        param = sub._parameters.get(attr)
        params.append(param if param is not None else getattr(sub, attr, None))
    return params


# The submodules whose parameters the forward reads, in PARAM_NAMES order, without calling them.
_SUBMODULES = tuple(dict.fromkeys(module for module, _ in _PARAM_PATHS))
_NORM_FORWARDS = {"layernorm": nn.LayerNorm.forward, "rmsnorm": nn.RMSNorm.forward}


def _check_submodules_run_stock_forward(block: nn.Module) -> None:
    """Raise unless calling each submodule would run its stock forward (see
    memopt/_stock_forward.py): the block reads its submodules' parameters and never calls them, so
    module hooks would not run (``torch.nn.utils.prune``'s pre-hook that refreshes ``weight``, for
    one: a stale weight), nor a forward of another class (a PEFT LoRA layer in place of ``fc1``,
    whose ``weight`` is the frozen base weight: the adapter would be silently skipped) or one
    patched onto the instance. Parametrized submodules pass. Per call: a few attribute reads."""
    modules = block._modules
    norm_forward = _NORM_FORWARDS[block.norm]
    for name in _SUBMODULES:
        sub = modules[name]
        expected = norm_forward if name.startswith("norm") else nn.Linear.forward
        if runs_stock_forward(sub, expected):
            continue
        if has_module_hooks(sub):  # the failure's message only: runs_stock_forward read the hooks
            raise RuntimeError(
                f"{type(block).__name__}: its submodule {name!r} has module hooks (forward, forward pre- or "
                "backward hooks, e.g. from torch.nn.utils.prune or torch.nn.utils.weight_norm), which do not run: "
                "the block reads its submodules' parameters without calling them. Remove the hooks; "
                "parametrizations (torch.nn.utils.parametrize, torch.nn.utils.parametrizations.weight_norm) do work"
            )
        raise RuntimeError(
            f"{type(block).__name__}: its submodule {name!r} is a {type(sub).__module__}.{type(sub).__qualname__} "
            f"whose forward is not {expected.__qualname__} (an adapter such as PEFT's LoRA layer, or a patched "
            "forward), which would not run: the block reads its submodules' parameters without calling them. "
            "Adapt the eager block (to_eager()) or a model of torch layers under memopt.wrap instead"
        )


def _shared_norm_eps(block: nn.Module) -> float:
    """The one eps the fused block runs both norms with: ``norm1.eps``, which ``norm2.eps`` must
    equal (each is a plain attribute a user may set, as on any nn.LayerNorm / nn.RMSNorm)."""
    eps1, eps2 = block.norm1.eps, block.norm2.eps
    if eps1 != eps2 or isinstance(eps1, bool) or not isinstance(eps1, (int, float)) or not 0 <= eps1 < math.inf:
        raise ValueError(
            f"{type(block).__name__}: norm1.eps ({eps1!r}) and norm2.eps ({eps2!r}) must be one non-negative finite "
            "float: the fused block runs both norms with one eps. Set block.eps to set both"
        )
    return eps1


# ----------------------------------------------------------------------------------------------
# A stack of blocks.


class FusedCheckpointStack(nn.Module):
    """``n_layers`` :class:`FusedCheckpointBlock` s applied in order.

    ``FusedCheckpointStack(n_layers, d_model, n_heads, d_ff=None, *, policy="selective",
    offload=False, **block_kwargs)``: ``policy`` is one name for every layer or a list of
    ``n_layers`` names (mixable, e.g. ``["full"] * 4 + ["selective"] * 8``); ``offload`` likewise
    one value (False, True or a ``memopt.Offload``) or a list of ``n_layers``. ``stack.policy``
    and ``stack.offload`` read and set the same way. ``block_kwargs`` (``ffn_chunk_tokens=``
    included) go to every block.
    """

    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, d_ff: int | None = None, *, policy="selective", offload=False, **block_kwargs
    ):
        super().__init__()
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
            raise ValueError(f"FusedCheckpointStack: n_layers must be a positive int, got {n_layers!r}")
        self.layers = nn.ModuleList(FusedCheckpointBlock(d_model, n_heads, d_ff, **block_kwargs) for _ in range(n_layers))
        self.policy = policy
        self.offload = offload

    def _per_layer(self, value, name: str, is_one, check) -> list:
        """One value per layer, every one checked before any layer changes (a bad list leaves the
        stack as it was)."""
        if is_one(value):
            values = [value] * len(self.layers)
        elif isinstance(value, (list, tuple)):
            values = list(value)
        else:
            raise TypeError(f"FusedCheckpointStack: {name} must be one value or a list of {len(self.layers)}, got {value!r}")
        if len(values) != len(self.layers):
            raise ValueError(
                f"FusedCheckpointStack: {name} must be one value or a list of {len(self.layers)}, got {len(values)}"
            )
        for i, v in enumerate(values):
            check(v, "FusedCheckpointStack", f"{name}[{i}]")
        return values

    @property
    def policy(self) -> list[str]:
        return [layer.policy for layer in self.layers]

    @policy.setter
    def policy(self, value) -> None:
        for layer, name in zip(self.layers, self._per_layer(value, "policy", lambda v: isinstance(v, str), check_policy)):
            layer.policy = name

    @property
    def offload(self) -> list:
        return [layer.offload for layer in self.layers]

    @offload.setter
    def offload(self, value) -> None:
        is_one = lambda v: isinstance(v, (bool, Offload))  # noqa: E731
        for layer, where in zip(self.layers, self._per_layer(value, "offload", is_one, check_offload)):
            layer.offload = where

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *, is_causal: bool = False):
        for layer in self.layers:
            x = layer(x, attn_mask, is_causal=is_causal)
        return x


# ----------------------------------------------------------------------------------------------
# How many bytes each policy saves.


def saved_bytes_per_token(
    policy: str,
    d_model: int,
    n_heads: int,
    d_ff: int | None = None,
    *,
    n_kv_heads: int | None = None,
    activation: str = "gelu",
    norm: str = "layernorm",
    norm_first: bool = True,
    dtype: torch.dtype = torch.float32,
    ffn_chunk_tokens: int | None = None,
    batch_first: bool = True,
) -> int:
    """Bytes one :class:`FusedCheckpointBlock` saves for backward per token, input excluded.

    For a block whose parameters and input are ``dtype`` (no autocast), the input contiguous.
    With ``batch_first=False`` the block saves its batch-first copy of the input (``d_model``
    elements per token), counted here; :func:`saved_bytes_per_layer` leaves it out where
    ``batch`` or ``seq`` is 1 (the transpose is then a view of the input). Norm statistics are
    float32 (float64 for float64), the attention log-sum-exp too. The RNG key (16 bytes per block
    call when dropout is active) is not per token: see :func:`saved_bytes_per_layer`. With
    ``ffn_chunk_tokens`` set (any chunk) the FFN half saves only its input.
    """
    check_policy(policy, "saved_bytes_per_token")
    _check_choice(activation, ACTIVATIONS, "activation", "saved_bytes_per_token")
    _check_choice(norm, NORMS, "norm", "saved_bytes_per_token")
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    d_ff = 4 * d_model if d_ff is None else d_ff
    head_dim = d_model // n_heads
    widths = {
        # The block input is not counted; with batch_first=False the block saves a transposed copy.
        "x": 0 if batch_first else d_model,
        "n1": d_model, "n2": d_model, "h": d_model, "s1": d_model, "s2": d_model,
        "qkv": (n_heads + 2 * n_kv_heads) * head_dim, "attn_out": n_heads * head_dim,
        "u": 2 * d_ff if activation == "swiglu" else d_ff, "g": d_ff,
    }  # fmt: skip
    elem, stat = torch.empty((), dtype=dtype).element_size(), _stat_bytes(dtype)
    total = 0
    check_ffn_chunk_tokens(ffn_chunk_tokens, "saved_bytes_per_token")
    for name in saved_names(policy, norm_first, norm, ffn_chunk_tokens is not None):
        if name == "lse":
            total += n_heads * stat  # the attention log-sum-exp, in the statistics' dtype
        elif name.startswith("norm"):
            total += stat
        else:
            total += widths[name] * elem
    return total


def saved_bytes_per_layer(policy: str, *args, batch: int, seq: int, dropout: float = 0.0, **kwargs) -> int:
    """Bytes one block call on ``(batch, seq, d_model)`` saves, input excluded: tokens times
    :func:`saved_bytes_per_token` (same arguments), plus the 16-byte RNG key when dropout > 0."""
    if batch == 1 or seq == 1:
        kwargs["batch_first"] = True  # (S, 1, D) or (1, B, D) transposed is a view: no copy saved
    return batch * seq * saved_bytes_per_token(policy, *args, **kwargs) + (16 if dropout > 0 else 0)
