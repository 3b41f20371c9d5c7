"""Will it fit? Peak training memory of a GPT-style transformer, before you run it.

:func:`estimate` breaks the peak memory of one training step into the tensors that exist:

=====================  =====================================================================
``parameters``         the weights, in the dtype they are stored in
``gradients``          one per trainable parameter, in the parameter's dtype
``master_weights``     fp32 copies of low-precision weights (``precision="master"`` only)
``optimizer_state``    SGD: none; SGD with momentum: 1 buffer; Adam/AdamW: 2 buffers (exp_avg,
                       exp_avg_sq), in the dtype of the weights the optimizer steps
``activations``        what autograd saves for backward in every layer, except the
                       attention-probability term (per-layer split in ``Estimate.per_layer``)
``attention_scores``   the O(seq^2) term: softmax output, dropout mask and dropped
                       probabilities (``attention="math"``); 0 with a recompute kernel
                       (``attention="flash"``), which keeps only a log-sum-exp per row
``autocast_weights``   the low-precision weight copies autocast makes and linears save
``embeddings_head``    token ids, embedding dropout mask, final norm and LM-head inputs
``logits_loss``        the vocabulary-sized transient of the loss: logits, log-probabilities
                       and the gradient buffers of ``log_softmax`` backward
``workspace``          what the largest transient of one layer's backward (two gradient buffers
                       of its largest activation; with checkpointing also the recomputed layer)
                       needs beyond ``logits_loss``, plus cuBLAS's workspace on CUDA
``fixed_activations``  measured form only: what the model saves for backward whatever the
                       batch (autocast's weight copies, rotary tables); ``activations`` is then
                       the part that grows with it
=====================  =====================================================================

Precision modes (``precision=``), and which tensors exist in each:

- ``"fp32"``: fp32 weights, gradients and optimizer state (Adam: 4+4+8 = 16 bytes/param);
  fp32 activations.
- ``"autocast"``: ``torch.autocast(dtype=low_dtype)`` with fp32 parameters (the PyTorch AMP
  recipe): weights, gradients and optimizer state stay fp32 (16 bytes/param with Adam), matmul
  inputs are saved in ``low_dtype``, the residual stream and layer-norm inputs stay fp32 (an
  fp32 + bf16 add promotes), softmax and the loss run in fp32, and every linear saves a
  ``low_dtype`` copy of its weight (``autocast_weights``). No master weights: the parameters
  *are* fp32.
- ``"pure"``: the model cast to ``low_dtype`` (``model.to(torch.bfloat16)``): weights,
  gradients and optimizer state in ``low_dtype`` (Adam: 2+2+4 = 8 bytes/param), every
  activation in ``low_dtype``; no fp32 copy anywhere (updates below bf16 resolution are lost).
- ``"master"``: ``low_dtype`` model weights and gradients plus fp32 master weights and fp32
  optimizer state (Megatron/DeepSpeed mixed precision, 2+2+4+8 = 16 bytes/param with Adam);
  activations as in ``"pure"``.

The eager model the formulas describe (``policy="eager"``) is the plain PyTorch GPT-2 block::

    h = ln_1(x)                                     # saves x, mean, rstd
    q, k, v = c_attn(h).view(b, s, 3, nh, hd).permute(2, 0, 3, 1, 4)   # saves h
    a = softmax(causal_mask(q @ k.transpose(-2, -1) / sqrt(hd)))        # saves q, k copies, a
    a = dropout(a, p)                               # saves its mask
    o = (a @ v).transpose(1, 2).reshape(b, s, d)    # saves a (dropped), v copy
    x = x + dropout(c_proj(o), p)                   # saves o, mask
    x = x + dropout(c_fc2(gelu(c_fc(ln_2(x)))), p)  # saves x, stats, h2, fc out, gelu out, mask

which saves, per token, ``16 * d_model`` elements plus two ``d_model`` dropout masks, and per
head ``seq`` probabilities twice plus one mask: Korthikanti et al.'s ``34 s b h + 5 a s^2 b``
bytes in half precision. ``tests/test_estimate.py`` checks the formula against the bytes that
``memopt.SavedTensorCounter`` counts on that block. ``policy="checkpoint"``
(``torch.utils.checkpoint`` around every layer) keeps only each layer's input.

Dropout masks are 1 byte per element on CUDA (``native_dropout`` saves a bool mask) and one
activation element on CPU (the CPU path multiplies by a saved float noise tensor): the
``device`` field picks which.

Other policies plug in through :func:`register_policy_formula`; memopt's
``FusedCheckpointBlock`` policies (``"none"``, ``"selective"``, ``"full"``) come from
``memopt.block.saved_bytes_per_token``, and with ``offload=True`` what they save is counted in
host memory (``Estimate.host_bytes``) instead of on the device, one layer's set excepted.

``arch="llama"`` describes a Hugging Face ``LlamaForCausalLM`` instead (:func:`llama_layer_saved`
has its per-layer formula, equal to the bytes counted on the model in
``tests/test_estimate_llama.py``), with what long-context training changes: ``loss="chunked"``
(the LM-head loss without materialised logits), ``ffn_chunk_tokens`` (the sequence-tiled FFN and
norms), ``policy="full", offload=True`` (the checkpointed layer inputs in host memory, as many as
``host_memory_bytes`` holds), and LoRA (``lora_rank``: frozen base weights, float32 adapters with
their gradients and optimizer state). Attention is SDPA's flash-style kernel: it saves one
float32 log-sum-exp per head and token (``attention_logsumexp``), and its backward's dq, dk, dv
are ``transients["attention_backward"]``; there is no O(seq^2) term. Its policies are
``"eager"`` (no checkpointing), ``"checkpoint"`` (Hugging Face's gradient checkpointing,
``torch.utils.checkpoint`` per layer) and memopt's ``"none"``/``"selective"``/``"full"`` as
``memopt.wrap`` applies them to a Hugging Face layer (``memopt.checkpoint``: PyTorch's selective
checkpointing of matmul and SDPA outputs for ``"selective"``, the layer input only for
``"full"``). :func:`strategies` lists the setups ``memopt estimate --max-seq`` compares and
:func:`seq_len_limit` finds the longest sequence of each with the term that binds;
``python -m bench.long_context`` measures them against the estimate.

The peak comes at the start of backward: everything saved is alive, and then first the loss
transient and later, once it is freed, one layer's backward transient; so the total counts the
larger of the two (``Estimate.transients`` has both). It assumes gradients are resident while
activations are (true under gradient accumulation, as :class:`memopt.AdaptiveBatch` runs). It
does not include the CUDA context (outside PyTorch's allocator) or allocator rounding. On an
H200 the total was within 5% of ``torch.cuda.max_memory_allocated`` for a 4-layer GPT in fp32
eager, fp32 checkpoint, autocast-bf16 and pure-bf16 (``tests/test_estimate.py``, marked gpu).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import torch

from memopt.block import saved_bytes_per_token
from memopt.ops.cross_entropy import default_chunk_tokens
from memopt.policy import POLICIES, check_policy
from memopt.saved import SavedTensorCounter

__all__ = [
    "Estimate",
    "ModelConfig",
    "PRESETS",
    "estimate",
    "max_micro_batch",
    "max_seq_len",
    "register_policy_formula",
    "registered_policies",
    "seq_len_limit",
    "strategies",
    "SeqLenLimit",
]

OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}
PRECISIONS = ("fp32", "autocast", "pure", "master")
ATTENTIONS = ("math", "flash")
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp64": torch.float64, "float64": torch.float64,
}
_INDEX_BYTES = 8  # token ids and targets are int64
# PyTorch's default cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG=:4096:8), allocated
# through the caching allocator on the first matmul.
CUBLAS_WORKSPACE_BYTES = 32 * 2**20


_LOW_DTYPES = (torch.bfloat16, torch.float16)
ARCHS = ("gpt2", "llama")
ARCH_DEFAULTS = {"gpt2": {"attention": "math", "dropout": 0.1}, "llama": {"attention": "flash", "dropout": 0.0}}
"""Per arch, the ``attention`` and ``dropout`` a :class:`ModelConfig` gets when they are left None."""
LOSSES = ("plain", "chunked")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linears of a Hugging Face Llama layer, the names LoRA targets use."""
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default target_modules for Llama
_LORA_DTYPE_BYTES = 4  # PEFT keeps adapters in float32 (autocast_adapter_dtype=True)


def _as_dtype(value, name: str, allowed: tuple[torch.dtype, ...] | None = None) -> torch.dtype:
    """A floating-point torch.dtype (one of ``allowed`` when given) from a dtype or its name."""
    dtype = _DTYPES.get(value) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or (allowed and dtype not in allowed):
        if allowed is None:
            expected = f"a floating-point torch.dtype or one of {sorted(_DTYPES)}"
        else:
            expected = " or ".join(str(d) for d in allowed) + " (or its name: " + ", ".join(
                sorted(k for k, d in _DTYPES.items() if d in allowed)) + ")"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return dtype


def _is_int(value) -> bool:
    """An int that is not a bool (True is an int in Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder (GPT-2 layout: learned positions, tied LM head, biases, pre-LN).

    Args:
        n_layers, d_model, n_heads, vocab_size, seq_len, micro_batch: the model and the shape of
            one micro-batch ``(micro_batch, seq_len)`` of token ids.
        d_ff: MLP hidden size (default ``4 * d_model``).
        precision: ``"fp32"``, ``"autocast"``, ``"pure"`` or ``"master"`` (see the module doc).
        low_dtype: the 16-bit dtype of the non-fp32 modes (``torch.bfloat16`` or
            ``torch.float16``); with ``precision="fp32"`` it is ignored unless ``dtype`` says
            otherwise.
        dtype: the full-precision dtype (``torch.float32``; ``torch.float64`` for tests).
        optimizer: ``"sgd"``, ``"sgd_momentum"``, ``"adam"`` or ``"adamw"``.
        policy: activation policy, a name in :func:`registered_policies`.
        offload: whether what a memopt policy (``"none"``, ``"selective"``, ``"full"``) saves
            lives in host memory (the block's ``offload=True``); False for other policies.
        attention: ``"math"`` (matmul + softmax, O(seq^2) saved) or ``"flash"`` (a recompute
            kernel such as SDPA flash: O(seq) saved). None (the default): the arch's,
            ``"math"`` for ``"gpt2"``, ``"flash"`` for ``"llama"`` (:data:`ARCH_DEFAULTS`).
        dropout: dropout probability of the attention, residual and embedding dropouts. None (the
            default): the arch's, 0.1 for ``"gpt2"``, 0.0 for ``"llama"``.
        device: ``"cuda"`` or ``"cpu"``: decides the size of a saved dropout mask.
        arch: ``"gpt2"`` (the layout above) or ``"llama"`` (Hugging Face ``LlamaForCausalLM``:
            RMSNorm, rotary positions, grouped-query attention through SDPA, SwiGLU MLP, untied
            LM head, no biases; see :func:`llama_layer_saved`). ``"llama"`` takes ``precision``
            ``"fp32"``, ``"pure"`` or ``"master"``, ``attention="flash"`` and ``dropout=0.0``
            (its defaults).
        n_kv_heads: key/value heads (grouped-query attention; default ``n_heads``; ``"llama"`` only).
        loss: ``"plain"``: the LM head makes ``(tokens, vocab)`` logits and the loss upcasts them
            to float32 (Hugging Face's ``ForCausalLMLoss``); ``"chunked"``:
            :func:`memopt.linear_cross_entropy` (``memopt.wrap``'s ``loss="chunked"``), one
            ``loss_chunk_tokens x vocab`` chunk at a time and one log-sum-exp per token saved.
        loss_chunk_tokens: tokens per loss chunk (default
            ``memopt.ops.cross_entropy.default_chunk_tokens(vocab_size)``).
        ffn_chunk_tokens: the sequence-tiled FFN (``memopt.wrap(model, ffn_chunk_tokens=...)``):
            the MLP's ``(tokens x d_ff)`` intermediates exist for this many tokens at a time, and
            only the MLP input is kept for its backward; the norms (each layer's two and the final
            one) run tiled too and keep only their inputs (``"llama"`` only).
        lora_rank: LoRA adapters of this rank on ``lora_targets`` (PEFT's ``LoraConfig`` defaults:
            rank 8 on ``q_proj`` and ``v_proj``): base weights frozen (no gradient, no optimizer
            state), adapters in float32 (PEFT's ``autocast_adapter_dtype=True``) with their
            gradients and optimizer state; ``"llama"`` only. None: every weight trains.
        lora_targets: the Llama linears that carry adapters, names from :data:`LLAMA_LINEARS`.
        host_memory_bytes: the host-memory budget for offloaded tensors; None is unbounded.
            Under ``policy="full", offload=True`` it decides how many layers' inputs go to the
            host (the rest stay on the device); under other offloading policies an estimate whose
            host bytes exceed it does not fit (:func:`max_seq_len`).
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    micro_batch: int
    d_ff: int | None = None
    precision: str = "fp32"
    low_dtype: torch.dtype = torch.bfloat16
    dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    policy: str = "eager"
    offload: bool = False
    attention: str | None = None
    dropout: float | None = None
    device: str = "cuda"
    arch: str = "gpt2"
    n_kv_heads: int | None = None
    loss: str = "plain"
    loss_chunk_tokens: int | None = None
    ffn_chunk_tokens: int | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = LORA_DEFAULT_TARGETS
    host_memory_bytes: int | None = None

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "micro_batch"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if not _is_int(self.d_ff) or self.d_ff <= 0:
            raise ValueError(f"d_ff must be a positive int, got {self.d_ff!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        self._resolve_arch_defaults()
        object.__setattr__(self, "low_dtype", _as_dtype(self.low_dtype, "low_dtype", _LOW_DTYPES))
        object.__setattr__(self, "dtype", _as_dtype(self.dtype, "dtype"))
        if not isinstance(self.policy, str):
            raise ValueError(f"policy must be a str, one of {registered_policies()}, got {self.policy!r}")
        if self.policy == "offload":
            check_policy(self.policy, "ModelConfig")  # raises, saying what to write instead
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be a bool, got {self.offload!r}")
        if self.offload and self.policy not in POLICIES:
            raise ValueError(
                f"offload=True applies to memopt's policies {list(POLICIES)} (what they save goes to host "
                f"memory), not to policy {self.policy!r}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if not _is_real(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        self._check_long_context_fields()

    def _resolve_arch_defaults(self) -> None:
        """``attention`` and ``dropout`` left None become the arch's (:data:`ARCH_DEFAULTS`)."""
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name, default in ARCH_DEFAULTS[self.arch].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)

    def _check_long_context_fields(self) -> None:
        llama = self.arch == "llama"
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not _is_int(self.n_kv_heads) or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must be a positive int dividing n_heads ({self.n_heads}), got {self.n_kv_heads!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        for name in ("loss_chunk_tokens", "ffn_chunk_tokens", "lora_rank", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if isinstance(self.lora_targets, str) or not isinstance(self.lora_targets, (tuple, list)) or not self.lora_targets:
            raise ValueError(f"lora_targets must be a non-empty tuple of names from {LLAMA_LINEARS}, got {self.lora_targets!r}")
        unknown = [t for t in self.lora_targets if t not in LLAMA_LINEARS]
        if unknown:
            raise ValueError(f"lora_targets must be names from {LLAMA_LINEARS}, got {unknown}")
        object.__setattr__(self, "lora_targets", tuple(dict.fromkeys(self.lora_targets)))
        if not llama:
            for name, default in (("n_kv_heads", self.n_heads), ("ffn_chunk_tokens", None), ("lora_rank", None)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name} is modelled for arch='llama' only, got {name}={getattr(self, name)!r} "
                                     f"with arch={self.arch!r}")
            return
        if self.precision == "autocast":
            raise ValueError("precision='autocast' is modelled for arch='gpt2' only; arch='llama' takes "
                             "'fp32', 'pure' or 'master'")
        if self.attention != "flash":
            raise ValueError("attention must be 'flash' with arch='llama' (it runs attention through SDPA; 'flash' is "
                             f"its default), got {self.attention!r}")
        if self.dropout != 0.0:
            raise ValueError("dropout must be 0.0 with arch='llama' (it has no dropout, attention_dropout 0; 0.0 is "
                             f"its default), got {self.dropout!r}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_parameters(self) -> int:
        """Exact parameter count: the GPT-2 layout (tied LM head) or the Llama layout (untied)."""
        d, f = self.d_model, self.d_ff
        if self.arch == "llama":
            per_layer = 2 * d + sum(i * o for i, o in self.llama_linear_shapes.values())
            return 2 * self.vocab_size * d + self.n_layers * per_layer + d
        per_layer = (
            2 * d  # ln_1
            + d * 3 * d + 3 * d  # c_attn
            + d * d + d  # attention c_proj
            + 2 * d  # ln_2
            + d * f + f  # c_fc
            + f * d + d  # mlp c_proj
        )
        return self.vocab_size * d + self.seq_len * d + self.n_layers * per_layer + 2 * d

    @property
    def llama_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each linear of a Llama layer."""
        d, f, kv = self.d_model, self.d_ff, self.n_kv_heads * (self.d_model // self.n_heads)
        return {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}

    @property
    def num_lora_parameters(self) -> int:
        """Adapter parameters: ``rank * (in + out)`` per targeted linear per layer (0 without LoRA)."""
        if self.lora_rank is None:
            return 0
        shapes = self.llama_linear_shapes
        return self.n_layers * sum(self.lora_rank * sum(shapes[t]) for t in self.lora_targets)

    @property
    def num_matmul_weights(self) -> int:
        """Elements of the weights autocast casts (every linear weight and the tied LM head)."""
        d, f = self.d_model, self.d_ff
        return self.n_layers * (4 * d * d + 2 * d * f) + self.vocab_size * d

    # Bytes per element of the tensors the activation formulas talk about.
    @property
    def param_bytes(self) -> int:
        low = self.precision in ("pure", "master")
        return (self.low_dtype if low else self.dtype).itemsize

    @property
    def residual_bytes(self) -> int:
        """The residual stream and layer-norm inputs."""
        return self.low_dtype.itemsize if self.precision in ("pure", "master") else self.dtype.itemsize

    @property
    def matmul_bytes(self) -> int:
        """Inputs saved by matmuls, GELU and dropout."""
        return self.dtype.itemsize if self.precision == "fp32" else self.low_dtype.itemsize

    @property
    def softmax_bytes(self) -> int:
        """Attention probabilities (autocast runs softmax in fp32)."""
        return self.dtype.itemsize if self.precision in ("fp32", "autocast") else self.low_dtype.itemsize

    @property
    def stats_bytes(self) -> int:
        """Layer-norm mean/rstd and log-sum-exp: fp32 at least."""
        return max(4, self.dtype.itemsize)

    @property
    def mask_bytes(self) -> int:
        return 1 if self.device == "cuda" else self.matmul_bytes


PolicyFormula = Callable[[ModelConfig], dict]
_POLICY_FORMULAS: dict[str, PolicyFormula] = {}


def register_policy_formula(name: str, fn: PolicyFormula) -> None:
    """Register the activation formula of an activation policy.

    ``fn(config) -> dict[str, int]``: bytes saved for backward by one layer, by component.
    The key ``"attention_scores"`` (the O(seq^2) part, if any) is reported separately; the key
    ``"workspace"``, if present, is the transient of that layer's backward (default: the eager
    layer's); keys starting with ``"host_"`` are bytes kept in host memory (offload), reported in
    ``Estimate.host_bytes`` and left out of the device total. Registering an existing name
    replaces it.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable(config) -> dict, got {type(fn).__name__}")
    _POLICY_FORMULAS[name] = fn


def registered_policies() -> list[str]:
    return sorted(_POLICY_FORMULAS)


def _eager_layer(cfg: ModelConfig) -> dict[str, int]:
    tokens = cfg.micro_batch * cfg.seq_len
    d, f = cfg.d_model, cfg.d_ff
    dropout = cfg.dropout > 0
    scores = cfg.micro_batch * cfg.n_heads * cfg.seq_len * cfg.seq_len
    out = {
        "layer_norm_inputs": 2 * tokens * d * cfg.residual_bytes,
        "layer_norm_stats": 2 * 2 * tokens * cfg.stats_bytes,
        "qkv_input": tokens * d * cfg.matmul_bytes,
        "q_k_v": 3 * tokens * d * cfg.matmul_bytes,
        "attention_output": tokens * d * cfg.matmul_bytes,
        "mlp_input": tokens * d * cfg.matmul_bytes,
        "mlp_hidden": 2 * tokens * f * cfg.matmul_bytes,
        "dropout_masks": 2 * tokens * d * cfg.mask_bytes if dropout else 0,
    }
    if cfg.attention == "math":
        # softmax saves its output; dropout its mask; the second matmul its (dropped, and
        # under autocast down-cast) input, which is the softmax output itself when neither
        # dropout nor a cast makes a new tensor.
        attention = scores * cfg.softmax_bytes
        if dropout:
            attention += scores * cfg.mask_bytes + scores * cfg.matmul_bytes
        elif cfg.matmul_bytes != cfg.softmax_bytes:
            attention += scores * cfg.matmul_bytes
        out["attention_scores"] = attention
    else:
        out["attention_logsumexp"] = cfg.micro_batch * cfg.n_heads * cfg.seq_len * cfg.stats_bytes
        out["attention_scores"] = 0
    return out


def _eager_workspace(cfg: ModelConfig) -> int:
    tokens = cfg.micro_batch * cfg.seq_len
    largest = tokens * cfg.d_ff * cfg.matmul_bytes
    if cfg.attention == "math":
        largest = max(largest, cfg.micro_batch * cfg.n_heads * cfg.seq_len**2 * cfg.softmax_bytes)
    return 2 * largest


def _checkpoint_layer(cfg: ModelConfig) -> dict[str, int]:
    # torch.utils.checkpoint keeps the layer input; backward recomputes one layer at a time,
    # so one eager layer plus its backward transient is workspace.
    eager = _eager_layer(cfg)
    return {
        "layer_input": cfg.micro_batch * cfg.seq_len * cfg.d_model * cfg.residual_bytes,
        "attention_scores": 0,
        "workspace": sum(eager.values()) + _eager_workspace(cfg),
    }


def _block_policy(policy: str) -> PolicyFormula:
    def formula(cfg: ModelConfig) -> dict[str, int]:
        # The block's formula is for a block whose parameters and input have one dtype (no
        # autocast) and leaves the block input out; the input is added here as for every policy.
        tokens = cfg.micro_batch * cfg.seq_len
        per_token = saved_bytes_per_token(policy, d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
                                          dtype=cfg.dtype if cfg.precision == "fp32" else cfg.low_dtype)
        saved = int(per_token) * tokens
        out = {"layer_input": tokens * cfg.d_model * cfg.residual_bytes,
               "rng_key": 16 if cfg.dropout > 0 else 0, "attention_scores": 0}
        if cfg.offload:
            # The saved set lives in host memory; one layer's copy is on the device while it is
            # produced or brought back for its backward.
            out["host_block_saved"] = saved
            out["workspace"] = saved + _eager_workspace(cfg)
        else:
            out["block_saved"] = saved
        return out

    return formula


register_policy_formula("eager", _eager_layer)
register_policy_formula("checkpoint", _checkpoint_layer)
for _name in POLICIES:
    register_policy_formula(_name, _block_policy(_name))


@dataclass
class Estimate:
    """Peak training memory of one step, in bytes.

    Attributes:
        breakdown: bytes by category (see the module doc); ``total_bytes`` is their sum.
        per_layer: one layer's saved activations by component (config estimates only).
        config: the :class:`ModelConfig` (``None`` for a measured ``nn.Module``).
        num_parameters: parameters counted.
        notes: what the figure assumes.
        transients: the short-lived peaks, in full: ``logits_loss`` (the loss),
            ``layer_backward`` (one layer's backward) and ``library`` (cuBLAS workspace); the
            total counts the larger of the first two plus the third.
        host_bytes: activations kept in host memory (offload policies), not in the total.
    """

    breakdown: dict[str, int]
    per_layer: dict[str, int] = field(default_factory=dict)
    config: ModelConfig | None = None
    num_parameters: int = 0
    notes: list[str] = field(default_factory=list)
    transients: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.breakdown.items(), key=lambda kv: -kv[1])[:n]

    def to_dict(self) -> dict:
        out = {
            "total_bytes": self.total_bytes,
            "breakdown": dict(self.breakdown),
            "per_layer": dict(self.per_layer),
            "num_parameters": self.num_parameters,
            "notes": list(self.notes),
            "transients": dict(self.transients),
            "host_bytes": self.host_bytes,
        }
        if self.config is not None:
            out["config"] = {
                k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                for k, v in dataclasses.asdict(self.config).items()
            }
        return out

    def __str__(self) -> str:
        total = self.total_bytes
        lines = []
        if self.config is not None:
            c = self.config
            lines.append(
                f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, d_ff {c.d_ff}, vocab "
                f"{c.vocab_size}, seq {c.seq_len}, micro-batch {c.micro_batch}, {c.precision}"
                f"{'' if c.precision == 'fp32' else ' ' + str(c.low_dtype).replace('torch.', '')}, "
                f"{c.optimizer}, policy {c.policy}, attention {c.attention}"
            )
        lines.append(f"parameters: {self.num_parameters:,}")
        width = max(len(k) for k in self.breakdown) + 2
        lines.append(f"{'':{width}}{'GiB':>10} {'share':>7}")
        for name, nbytes in self.breakdown.items():
            share = nbytes / total if total else 0.0
            lines.append(f"{name:{width}}{nbytes / 2**30:10.3f} {share:7.1%}")
        lines.append(f"{'total':{width}}{total / 2**30:10.3f}")
        if self.host_bytes:
            lines.append(f"{'host (offloaded)':{width}}{self.host_bytes / 2**30:10.3f}")
        return "\n".join(lines)


def _optimizer_breakdown(num_params: int, cfg_precision: str, param_bytes: int, optimizer: str) -> dict[str, int]:
    states = OPTIMIZER_STATES[optimizer]
    master = cfg_precision == "master"
    step_bytes = 4 if master else param_bytes
    return {
        "parameters": num_params * param_bytes,
        "gradients": num_params * param_bytes,
        "master_weights": num_params * 4 if master else 0,
        "optimizer_state": num_params * states * step_bytes,
    }


# -- Hugging Face Llama (arch="llama") -------------------------------------------------------


def llama_layer_saved(cfg: ModelConfig, *, input_requires_grad: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per token one eager Hugging Face ``LlamaDecoderLayer`` saves for backward:
    ``(attention part, MLP part)``, each by component.

    Read off the layer's code and checked against counted bytes (``tests/test_estimate_llama.py``):
    ``LlamaRMSNorm`` upcasts its input to float32 (a copy unless the model is float32) and saves
    it and ``rstd``, and, when its weight trains, the normalized rows in the model dtype; a linear
    saves its input only when its weight trains; SDPA saves the rotated q, k, v (grouped-query:
    k and v not repeated), its output (which is also ``o_proj``'s input) and one float32
    log-sum-exp per head; the SwiGLU MLP saves gate, ``silu(gate)`` and up, and its product when
    ``down_proj`` trains. A LoRA adapter (PEFT) casts its input to float32 (a new copy per
    adapter unless the model is float32) and saves it and its rank-wide ``lora_A`` output.
    ``input_requires_grad=False`` is the first layer under LoRA (frozen embeddings): its first
    norm saves nothing, and with no adapter on the attention projections neither does the
    attention half (nor does it keep the rotary ``cos``/``sin``). The rotary ``cos``/``sin`` are
    shared by every layer and counted once in the model (``embeddings_head``).

    With ``cfg.ffn_chunk_tokens`` it is the layer as ``memopt.wrap(model, ffn_chunk_tokens=n)``
    runs it (:mod:`memopt.tiled_ffn`): each norm saves only its input, in the model dtype (its
    float32 copy, ``rstd`` and normalized rows exist for one chunk at a time), and the MLP saves
    only its input (the second norm's output); what one chunk of the MLP saves while it is
    recomputed is :func:`_llama_mlp_saved` per token.
    """
    d, e = cfg.d_model, cfg.param_bytes
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    full_finetune = cfg.lora_rank is None
    targets = set() if full_finetune else set(cfg.lora_targets)
    tiled = cfg.ffn_chunk_tokens is not None
    grad_input = input_requires_grad
    grad_residual = grad_input or full_finetune or bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"})
    norms = grad_input + grad_residual  # the norms whose input needs a gradient
    attention = {
        # per norm: the input's float32 copy (the input itself in a float32 model, or tiled) and rstd
        "norm_inputs": (e if tiled else 4) * d * norms,
        "norm_stats": 0 if tiled else 4 * norms,
        "norm_outputs": 2 * d * e if full_finetune and not tiled else 0,
        "qkv_input": (d * e if full_finetune else 0) + _lora_saved(cfg, ("q_proj", "k_proj", "v_proj"), d, full_finetune),
        "q_k_v": (d + 2 * kv) * e,
        "attention_output": d * e + _lora_saved(cfg, ("o_proj",), d, True),
        "attention_logsumexp": cfg.n_heads * 4,
    }
    if not grad_residual:  # nothing of the attention half needs a gradient: it saves nothing
        attention = dict.fromkeys(attention, 0)
    if tiled:
        mlp_trains = grad_residual or bool(targets & {"gate_proj", "up_proj", "down_proj"})
        return attention, {"mlp_input": d * e if mlp_trains else 0}
    return attention, _llama_mlp_saved(cfg, grad_residual)


def llama_final_norm_saved(cfg: ModelConfig) -> int:
    """Bytes per token the final norm of a Hugging Face ``LlamaModel`` (``model.norm``, before the
    LM head) saves: untiled, its input's float32 copy (the input itself in a float32 model) and
    ``rstd``, and the normalized rows when its weight trains (full fine-tuning); with
    ``cfg.ffn_chunk_tokens`` (``memopt.wrap`` tiles it, :func:`memopt.tiled_ffn.find_stack_norms`)
    its input only, in the model dtype. Checked against counted bytes in
    ``tests/test_estimate_llama.py``."""
    d, e = cfg.d_model, cfg.param_bytes
    if cfg.ffn_chunk_tokens is not None:
        return d * e
    return 4 * d + 4 + (d * e if cfg.lora_rank is None else 0)


def _lora_saved(cfg: ModelConfig, names: tuple[str, ...], width: int, input_saved: bool) -> int:
    """Bytes per token the LoRA adapters on ``names`` (those of them in ``cfg.lora_targets``) save:
    each its float32 input copy (in a float32 model the input itself, once, unless the base
    linear saves it already: ``input_saved``) and its rank-wide ``lora_A`` output."""
    hit = [] if cfg.lora_rank is None else [n for n in names if n in cfg.lora_targets]
    if not hit:
        return 0
    e = cfg.param_bytes
    inputs = len(hit) * width * 4 if e != 4 else (0 if input_saved else width * e)
    return inputs + len(hit) * cfg.lora_rank * _LORA_DTYPE_BYTES


def _llama_mlp_saved(cfg: ModelConfig, grad_residual: bool = True) -> dict[str, int]:
    """Bytes per token the untiled SwiGLU MLP of a Llama layer saves: ``silu`` saves gate and the
    product ``silu(gate) * up`` saves up when a gradient flows through gate, and ``silu(gate)``
    when one flows through up; the input and the product where the projections that read them
    train. ``grad_residual``: whether the MLP input needs a gradient."""
    d, f, e = cfg.d_model, cfg.d_ff, cfg.param_bytes
    full_finetune = cfg.lora_rank is None
    targets = set() if full_finetune else set(cfg.lora_targets)
    gate_grad = grad_residual or "gate_proj" in targets
    up_grad = grad_residual or "up_proj" in targets
    return {
        "mlp_input": (d * e if full_finetune else 0) + _lora_saved(cfg, ("gate_proj", "up_proj"), d, full_finetune),
        "mlp_hidden": f * e * (2 * gate_grad + up_grad),
        "mlp_product": (f * e if full_finetune else 0) + _lora_saved(cfg, ("down_proj",), f, full_finetune),
    }


def _llama_selective_per_token(cfg: ModelConfig) -> int:
    """What ``policy="selective"`` (PyTorch's selective checkpointing of matmul and SDPA outputs)
    keeps per token beyond the layer input: every linear's output, each adapter's two outputs, the
    SDPA output and log-sum-exp."""
    e = cfg.param_bytes
    shapes = cfg.llama_linear_shapes
    linears = sum(out for _, out in shapes.values()) * e
    lora = 0 if cfg.lora_rank is None else sum((cfg.lora_rank + shapes[t][1]) * _LORA_DTYPE_BYTES for t in cfg.lora_targets)
    return linears + lora + cfg.d_model * e + cfg.n_heads * 4


def _llama_static(cfg: ModelConfig) -> dict[str, int]:
    """Weights, gradients, master weights and optimizer state; under LoRA only the adapters train."""
    if cfg.lora_rank is None:
        return _optimizer_breakdown(cfg.num_parameters, cfg.precision, cfg.param_bytes, cfg.optimizer)
    adapters = cfg.num_lora_parameters
    return {
        "parameters": cfg.num_parameters * cfg.param_bytes + adapters * _LORA_DTYPE_BYTES,
        "gradients": adapters * _LORA_DTYPE_BYTES,
        "master_weights": 0,
        "optimizer_state": adapters * OPTIMIZER_STATES[cfg.optimizer] * _LORA_DTYPE_BYTES,
    }


def _loss_terms(cfg: ModelConfig, head_trains: bool, elem: int, loss_bytes: int) -> tuple[int, int, int]:
    """``(saved, held logits, peak transient)`` of the LM-head loss, in bytes.

    ``plain``: the logits (``elem`` bytes, kept by the model output through the backward), their
    float32 upcast (``loss_bytes`` 4) when ``elem`` is not 4, ``log_softmax``'s saved output, and
    in backward the two gradient buffers of ``nll_loss`` and ``log_softmax`` (4 bytes each per
    logit), then the logits' gradient with the LM head's weight gradient. ``chunked``: one
    ``loss_chunk_tokens x vocab`` chunk in float32 (with its ``elem`` matmul output and gradient
    when ``elem`` is not 4), the hidden gradient and the weight's. A frozen head under ``chunked``
    (note [a frozen LM head] in ``memopt/ops/cross_entropy.py``): the forward forms the hidden
    gradient (``tokens x d``, saved in place of the head's input, which the caller counts) and
    saves no log-sum-exp; the backward only scales it.
    """
    tokens, vocab, d = cfg.micro_batch * cfg.seq_len, cfg.vocab_size, cfg.d_model
    weight_grad = vocab * d * elem if head_trains else 0
    if cfg.loss == "plain":
        upcast = loss_bytes if elem != loss_bytes else 0
        forward = tokens * vocab * (elem + upcast + loss_bytes)
        softmax_backward = tokens * vocab * (elem + 3 * loss_bytes)
        head_backward = tokens * vocab * 2 * elem + weight_grad + tokens * d * elem
        return 0, tokens * vocab * elem, max(forward, softmax_backward, head_backward)
    chunk = min(cfg.loss_chunk_tokens or default_chunk_tokens(vocab), tokens)
    low = elem if elem != loss_bytes else 0
    if not head_trains:
        forward = tokens * d * elem + chunk * vocab * (loss_bytes + 2 * low)
        return tokens * loss_bytes, 0, max(forward, tokens * d * elem)
    forward = chunk * vocab * (loss_bytes + low)
    backward = tokens * d * elem + weight_grad + chunk * vocab * (loss_bytes + 2 * low) + chunk * d * loss_bytes
    return 2 * tokens * loss_bytes, 0, max(forward, backward)


def _llama_estimate(cfg: ModelConfig) -> Estimate:
    if cfg.policy not in ("eager", "checkpoint") + POLICIES:
        raise ValueError(f"policy must be one of {['eager', 'checkpoint', *POLICIES]} for arch='llama', got {cfg.policy!r}")
    tokens, d, e = cfg.micro_batch * cfg.seq_len, cfg.d_model, cfg.param_bytes
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    lora = cfg.lora_rank is not None
    mlp_tokens = min(cfg.ffn_chunk_tokens or tokens, tokens)
    tiled = cfg.ffn_chunk_tokens is not None

    def saved(input_requires_grad: bool) -> tuple[dict[str, int], dict[str, int]]:
        attention, mlp = llama_layer_saved(cfg, input_requires_grad=input_requires_grad)
        return {k: v * tokens for k, v in attention.items()}, {k: v * tokens for k, v in mlp.items()}

    # What the layer keeps (tiled: the FFN and the norms keep only their inputs), and what the MLP
    # saves over the tokens it runs at once (tiled: one chunk, rebuilt in the backward).
    attention, kept_mlp = saved(True)
    mlp_per_token = _llama_mlp_saved(cfg)
    mlp = {k: v * tokens for k, v in mlp_per_token.items()}
    chunk_mlp = {k: v * mlp_tokens for k, v in mlp_per_token.items()}
    layer_input = tokens * d * e
    # In a float32 model, or with the norms tiled, the first norm saves the layer input itself:
    # the checkpointed copy.
    recompute_attention = sum(attention.values()) - (layer_input if e == 4 or tiled else 0)
    recompute = recompute_attention + sum(chunk_mlp.values())
    policy = "eager" if cfg.policy == "none" else cfg.policy
    host = 0
    if policy == "eager":
        first_attention, first_mlp = saved(not lora)
        per_layer = attention | kept_mlp
        first = sum(first_attention.values()) + sum(first_mlp.values())
        activations = first + (cfg.n_layers - 1) * sum(per_layer.values())
        recompute_attention, recompute = 0, (sum(chunk_mlp.values()) if tiled else 0)
        freed_mlp = 0 if tiled else sum(mlp.values())
    elif policy in ("checkpoint", "full"):
        per_layer = {"layer_input": layer_input}
        on_device = cfg.n_layers
        if cfg.offload:
            # Inputs go to host memory as far as the host budget holds them; the current layer's
            # input and the one prefetched for the next backward step are on the device.
            budget = cfg.host_memory_bytes
            on_host = cfg.n_layers if budget is None else min(cfg.n_layers, budget // layer_input)
            host = on_host * layer_input
            on_device = cfg.n_layers - on_host + min(on_host, 2)
            per_layer = {"host_layer_input": layer_input}
        activations = on_device * layer_input
        freed_mlp = 0
    else:  # selective
        cached = _llama_selective_per_token(cfg) * tokens
        if tiled:
            cached -= sum(cfg.llama_linear_shapes[n][1] for n in ("gate_proj", "up_proj", "down_proj")) * e * tokens
            cached += tokens * d * e
        per_layer = {"layer_input": layer_input, "host_selective_saved" if cfg.offload else "selective_saved": cached}
        if cfg.offload:
            host = cfg.n_layers * cached
        activations = cfg.n_layers * (layer_input + (0 if cfg.offload else cached)) + (cached if cfg.offload else 0)
        recompute = max(0, recompute - cached)
        recompute_attention = max(0, recompute_attention - cached)
        freed_mlp = 0
    # One layer's backward peaks either in the MLP (the output gradient, and the three
    # (tokens x d_ff) gradients of down_proj's input, silu and up while down_proj's saved input
    # is already freed) or in attention (the MLP's tensors freed; the output gradient, the
    # attention output's, dq, dk, dv).
    f = cfg.d_ff
    mlp_product = mlp["mlp_product"] // tokens
    mlp_grads = mlp_tokens * (3 * f * e - mlp_product)
    attention_grads = tokens * (d + 2 * kv) * e
    mlp_phase = recompute + tokens * d * e + mlp_grads
    attention_phase = recompute_attention + 2 * tokens * d * e + attention_grads - freed_mlp
    layer_backward = max(mlp_phase, attention_phase, 0)

    head_trains = not lora
    loss_saved, held_logits, loss_peak = _loss_terms(cfg, head_trains, e, 4)
    final_norm = tokens * llama_final_norm_saved(cfg)
    head_input = tokens * d * e if head_trains or cfg.loss == "chunked" else 0
    rope = cfg.seq_len * 2 * (d // cfg.n_heads) * e  # cos and sin, one row per position (batch broadcast)
    ids = 3 * tokens * _INDEX_BYTES + cfg.seq_len * _INDEX_BYTES  # input ids, labels, shifted labels, positions

    breakdown = _llama_static(cfg)
    breakdown["activations"] = activations
    breakdown["attention_scores"] = 0
    breakdown["autocast_weights"] = 0
    head_saved = final_norm + head_input + loss_saved  # freed by the loss's backward
    breakdown["embeddings_head"] = ids + rope + head_saved
    breakdown["logits_loss"] = loss_peak
    library = CUBLAS_WORKSPACE_BYTES if cfg.device == "cuda" else 0
    breakdown["workspace"] = max(0, layer_backward + held_logits - loss_peak - head_saved) + library
    notes = [
        "Hugging Face LlamaForCausalLM, SDPA attention (flash-style: one float32 log-sum-exp per head "
        "and token saved, no seq x seq term)",
        "gradients resident during the forward (gradient accumulation)",
        "peak transient = max(loss transient with the head's saved tensors, one layer's backward transient)",
        "excludes the CUDA context and allocator rounding",
    ]
    return Estimate(
        breakdown=breakdown, per_layer=per_layer | {"workspace": layer_backward}, config=cfg,
        num_parameters=cfg.num_parameters + cfg.num_lora_parameters, notes=notes, host_bytes=host,
        transients={"logits_loss": loss_peak, "layer_backward": layer_backward, "layer_recompute": recompute,
                    "attention_backward": attention_grads, "library": library},
    )


def _config_estimate(cfg: ModelConfig) -> Estimate:
    if cfg.arch == "llama":
        return _llama_estimate(cfg)
    if cfg.policy not in _POLICY_FORMULAS:
        raise ValueError(f"policy must be one of {registered_policies()}, got {cfg.policy!r}")
    layer = dict(_POLICY_FORMULAS[cfg.policy](cfg))
    workspace = layer.pop("workspace", None)
    if workspace is None:
        workspace = _eager_workspace(cfg)
    scores = layer.get("attention_scores", 0)
    host = sum(v for k, v in layer.items() if k.startswith("host_"))
    per_layer_total = sum(layer.values()) - host

    tokens = cfg.micro_batch * cfg.seq_len
    n = cfg.num_parameters
    breakdown = _optimizer_breakdown(n, cfg.precision, cfg.param_bytes, cfg.optimizer)
    breakdown["activations"] = cfg.n_layers * (per_layer_total - scores)
    breakdown["attention_scores"] = cfg.n_layers * scores
    breakdown["autocast_weights"] = (
        cfg.num_matmul_weights * cfg.low_dtype.itemsize
        if cfg.precision == "autocast" and cfg.policy == "eager" else 0
    )
    breakdown["embeddings_head"] = (
        tokens * _INDEX_BYTES + cfg.seq_len * _INDEX_BYTES  # token and position ids
        + (tokens * cfg.d_model * cfg.mask_bytes if cfg.dropout > 0 else 0)
        + tokens * cfg.d_model * cfg.residual_bytes + 2 * tokens * cfg.stats_bytes  # final norm
        + tokens * cfg.d_model * cfg.matmul_bytes  # LM-head input
        + tokens * _INDEX_BYTES  # targets
    )
    # cross_entropy = log_softmax + nll_loss. Forward: logits, (fp32 copy,) log-probs.
    # Backward: log-probs (saved), nll_loss's gradient, log_softmax's gradient.
    logits_bytes = cfg.matmul_bytes
    loss_bytes = cfg.softmax_bytes
    forward = logits_bytes + (loss_bytes if loss_bytes != logits_bytes else 0) + loss_bytes
    backward = 3 * loss_bytes
    logits_loss = tokens * cfg.vocab_size * max(forward, backward)
    breakdown["logits_loss"] = logits_loss
    library = CUBLAS_WORKSPACE_BYTES if cfg.device == "cuda" else 0
    breakdown["workspace"] = max(0, workspace - logits_loss) + library
    notes = [
        "gradients resident during the forward (gradient accumulation)",
        "peak transient = max(loss transient, one layer's backward transient)",
        "excludes the CUDA context and allocator rounding",
    ]
    return Estimate(breakdown=breakdown, per_layer=layer | {"workspace": workspace}, config=cfg,
                    num_parameters=n, notes=notes, host_bytes=cfg.n_layers * host,
                    transients={"logits_loss": logits_loss, "layer_backward": workspace, "library": library})


def _batched_tensor(example, dim: int, inferred: str | None) -> torch.Tensor:
    """The tensor of ``example`` whose dimension ``dim`` is the batch: ``example`` itself, or the
    first tensor with more than ``dim`` dimensions in it, depth first."""
    where = "a leading batch dimension" if dim == 0 else f"a batch dimension {dim} (batch_dim={dim}{inferred or ''})"
    if isinstance(example, torch.Tensor):
        if example.dim() <= dim:
            raise ValueError(f"example_input must have {where}, got a {example.dim()}-d tensor")
        return example
    batched = _first_batched(example, dim)
    if batched is None:
        raise ValueError(
            f"example_input must be a tensor, or a tuple/list/mapping holding a tensor with {where}, "
            f"got {type(example).__name__}"
        )
    return batched


def _first_batched(example, dim: int = 0) -> torch.Tensor | None:
    """The first tensor of more than ``dim`` dimensions in ``example``, depth first, or None. Other
    values are skipped: keyword arguments such as ``use_cache=False`` or a 0-d
    ``num_items_in_batch`` are not batched (AdaptiveBatch, which cuts every tensor, refuses a 0-d
    one instead). Any mapping counts as keyword arguments: a tokenizer's ``BatchEncoding`` is a
    ``UserDict``, not a ``dict``."""
    if isinstance(example, torch.Tensor):
        return example if example.dim() > dim else None
    if isinstance(example, (tuple, list, Mapping)):
        for value in example.values() if isinstance(example, Mapping) else example:
            found = _first_batched(value, dim)
            if found is not None:
                return found
    return None


def _resized(example, dim: int, batch: int, new_batch: int):
    """``example`` with every tensor whose dimension ``dim`` is ``batch`` cut or repeated to
    ``new_batch`` along it (other values as they are; a mapping comes back as a dict). Each is a
    tensor of its own, not a view: a saved view counts its whole storage, and the input would
    count at the size it was cut from."""
    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= dim or t.shape[dim] != batch:
            return t
        repeated = t if new_batch <= batch else torch.cat([t] * -(-new_batch // batch), dim)
        return repeated.narrow(dim, 0, new_batch).clone()

    if isinstance(example, torch.Tensor):
        return resize(example)
    if isinstance(example, Mapping):
        return {k: _resized(v, dim, batch, new_batch) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        items = [_resized(v, dim, batch, new_batch) for v in example]
        return type(example)(*items) if hasattr(example, "_fields") else type(example)(items)
    return example


def _declared_layouts(model: torch.nn.Module) -> dict[bool, list[str]]:
    """The modules of ``model`` that declare their layout (a bool ``batch_first`` attribute:
    ``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer``/``DecoderLayer``, ``nn.Transformer``,
    ``nn.RNN``/``LSTM``/``GRU``, memopt's ``FusedCheckpointBlock``), by their ``batch_first``."""
    layouts: dict[bool, list[str]] = {True: [], False: []}
    for name, module in model.named_modules():
        batch_first = getattr(module, "batch_first", None)
        if isinstance(batch_first, bool):
            layouts[batch_first].append(name)
    return layouts


def _names(names: list[str], shown: int = 3) -> str:
    listed = ", ".join(repr(n) if n else "the model itself" for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


_PASS_BATCH_DIM = "pass batch_dim= (the dimension of example_input's tensors that holds the samples)"


def _batch_dim(model: torch.nn.Module, batch_dim) -> tuple[int, list[str]]:
    """``(dim, seq_first)``: the batch dimension of the example, and the sequence-first layers it was
    inferred from (to be confirmed by the forward; empty when nothing needs confirming)."""
    if batch_dim is not None:
        if not _is_int(batch_dim) or batch_dim < 0:
            raise ValueError(f"batch_dim must be a non-negative int (the dimension of example_input's tensors "
                             f"that holds the samples) or None, got {batch_dim!r}")
        return batch_dim, []
    layouts = _declared_layouts(model)
    if layouts[False] and layouts[True]:
        raise ValueError(
            f"the model's layers disagree on where the batch is: {_names(layouts[False])} have batch_first=False, "
            f"{_names(layouts[True])} batch_first=True; {_PASS_BATCH_DIM}"
        )
    return (1, layouts[False]) if layouts[False] else (0, [])


class _SeenBatches:
    """Forward pre-hooks on sequence-first layers recording the batch each ran on: dimension 1 of
    its first 3-d tensor input, ``(seq, batch, features)``."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        self.seen: list[tuple[str, int]] = []
        modules = dict(model.named_modules())
        self.handles = [modules[name].register_forward_pre_hook(self._hook(name), with_kwargs=True)
                        for name in names if name in modules]

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() == 3), None)
            if first is not None:
                self.seen.append((name, first.shape[1]))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def confirm(self, seq_first: list[str], example_batch: int) -> None:
        """That the layers ran on the batch the example holds in dimension 1."""
        if not self.seen:
            raise ValueError(
                f"the model's layers {_names(seq_first)} have batch_first=False, so example_input's batch would be "
                f"its dimension 1, but none of them ran on a (seq, batch, features) tensor to confirm it; "
                f"{_PASS_BATCH_DIM}"
            )
        other = next(((name, n) for name, n in self.seen if n != example_batch), None)
        if other is not None:
            raise ValueError(
                f"the model's layers {_names(seq_first)} have batch_first=False, so example_input's batch would be "
                f"its dimension 1 ({example_batch}), but {_names([other[0]])} ran on a batch of {other[1]} (dimension 1 "
                f"of its (seq, batch, features) input); {_PASS_BATCH_DIM}"
            )


def _module_estimate(model: torch.nn.Module, example_input, micro_batch: int | None, optimizer: str,
                     loss_fn: Callable | None, precision: str, low_dtype: torch.dtype,
                     batch_dim: int | None = None) -> Estimate:
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(output) -> loss or None, got {type(loss_fn).__name__}")
    dim, seq_first = _batch_dim(model, batch_dim)
    inferred = f", inferred from the layers with batch_first=False: {_names(seq_first)}" if seq_first else None
    example_batch = _batched_tensor(example_input, dim, inferred).shape[dim]
    if example_batch == 0:
        where = "its leading batch dimension" if dim == 0 else f"its batch dimension {dim}"
        raise ValueError(f"example_input must hold at least one sample ({where} is 0): "
                         "the activations are measured on it and scaled to micro_batch")
    if micro_batch is None:
        micro_batch = example_batch
    if not _is_int(micro_batch) or micro_batch <= 0:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    device_type = next(iter(params)).device.type if params else "cpu"
    # Imported here: memopt.adaptive imports this module.
    from memopt.adaptive import _ModelState

    state = _ModelState(model)

    def saved_by(example) -> int:
        """Bytes one forward on ``example`` saves for backward. A training-mode forward moves
        BatchNorm's running statistics and draws dropout masks from the global generator: the
        buffers and RNG states are put back, so estimating leaves the model and the next step as
        they were (and the probe below runs from the same state)."""
        args = example if isinstance(example, (tuple, list)) else (example,)
        try:
            with SavedTensorCounter(exclude=params + list(model.buffers())) as counter, \
                    torch.autocast(device_type, dtype=low_dtype, enabled=precision == "autocast"):
                out = model(**example) if isinstance(example, Mapping) else model(*args)
                if loss_fn is not None:
                    out = loss_fn(out)
            del out
        finally:
            state.restore()
        return counter.total_bytes

    seen = _SeenBatches(model, seq_first)
    try:
        saved = saved_by(example_input)
    finally:
        seen.remove()
    if seq_first:
        seen.confirm(seq_first, example_batch)
    activations, fixed, note = _split_saved(saved_by, example_input, dim, example_batch, saved, micro_batch)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    n_trainable = sum(p.numel() for p in trainable)
    states = OPTIMIZER_STATES[optimizer]
    step_bytes = 4 if precision == "master" else (grad_bytes // n_trainable if n_trainable else 0)
    breakdown = {
        "parameters": param_bytes,
        "gradients": grad_bytes,
        "master_weights": n_trainable * 4 if precision == "master" else 0,
        "optimizer_state": n_trainable * states * step_bytes,
        "activations": activations,
        "fixed_activations": fixed,
    }
    source = f"dimension {dim} of example_input" + (f" (the layers have batch_first=False)" if seq_first else "")
    notes = [f"example batch {example_batch} ({source}); {note}",
             "no backward workspace or loss transient beyond what loss_fn saves"]
    return Estimate(breakdown=breakdown, num_parameters=sum(p.numel() for p in params), notes=notes)


def _split_saved(saved_by: Callable, example, dim: int, batch: int, saved: int, micro_batch: int
                 ) -> tuple[int, int, str]:
    """``(activations, fixed, note)`` at ``micro_batch``, from the ``saved`` bytes measured at
    ``batch`` and one or two more forwards on the example cut or repeated: ``fixed`` does not
    change with the batch, ``activations`` grows with it.

    Scaling everything by ``micro_batch / batch`` multiplied autocast's low-precision weight copies
    (saved by every linear, as big at batch 1 as at 64) with the batch: two 1024x1024 linears
    measured at batch 1 read 128 MiB at 64, where 2.25 MiB are saved. Rotary tables (a Hugging
    Face Llama's cos/sin are ``(1, seq, head_dim)`` whatever the batch) are fixed too. The line
    through two measurements is exact wherever the saved bytes are affine in the batch, whatever
    makes the fixed part. Batch 1 is not on that line in every model (a reshape of a size-1
    dimension can save a view of a whole buffer where a larger batch saves a copy), so the line
    goes through two batches of at least 2, and a ``micro_batch`` below the example's is measured
    outright.
    """
    if micro_batch < batch:
        probes = [micro_batch]
    elif batch >= 3:
        probes = [batch - 1]  # one sample less: no more memory than the example took
    elif batch == 2 or micro_batch == 1:
        probes = [batch + 1]
    else:
        probes = [2, 3]
    counts = {batch: saved}
    try:
        for probe in probes:
            counts[probe] = saved_by(_resized(example, dim, batch, probe))
    except Exception as error:  # a model that refuses the resized example: scale it all, as before, and say so
        return (math.ceil(Fraction(saved * micro_batch, batch)), 0,
                f"every saved byte scaled linearly from batch {batch} to {micro_batch}: the forward at batch {probe} "
                f"raised {type(error).__name__}: {error}")
    lo, hi = sorted(counts)[-2:]
    # Clamped: bytes that shrink as the batch grows are not a per-sample cost, and neither part is negative.
    per_sample = max(Fraction(counts[hi] - counts[lo], hi - lo), Fraction(0))
    total = counts[micro_batch] if micro_batch in counts else counts[hi] + per_sample * (micro_batch - hi)
    fixed = min(max(round(counts[hi] - per_sample * hi), 0), math.floor(total))
    measured = ", ".join(str(b) for b in sorted(counts))
    return (math.ceil(total) - fixed, fixed,
            f"saved bytes measured at batches {measured}: {fixed:,} of them the same at any batch "
            f"(fixed_activations), the rest {'measured' if micro_batch in counts else 'scaled linearly'} "
            f"at {micro_batch}")


def estimate(config=None, example_input=None, *, micro_batch: int | None = None, optimizer: str | None = None,
             loss_fn: Callable | None = None, precision: str | None = None,
             low_dtype: torch.dtype | None = None, batch_dim: int | None = None, **config_fields) -> Estimate:
    """Peak memory of one training step.

    Three ways to call it::

        memopt.estimate(n_layers=48, d_model=1600, n_heads=25, vocab_size=50257,
                        seq_len=1024, micro_batch=8, optimizer="adam")   # formula
        memopt.estimate(ModelConfig(...))                                # formula
        memopt.estimate(model, example_input, micro_batch=64)            # measured

    ``optimizer`` (default ``"adam"``), ``precision`` (default ``"fp32"``), ``low_dtype``
    (default ``torch.bfloat16``), ``micro_batch`` and any other ``ModelConfig`` field given as a
    keyword override the ``ModelConfig``'s.

    The measured form runs ``model(example_input)`` (``loss_fn(output)`` too, if given) at the
    example's batch size and counts the bytes saved for backward with
    :class:`memopt.SavedTensorCounter`; then once or twice more on the example cut or repeated (the
    tensors whose batch dimension has the example's size): at ``micro_batch`` when it is smaller,
    else at one sample less (more, below 3; at 2 and 3 from a batch of 1, which can save views
    where larger batches save copies). The line through two counts splits them into
    ``fixed_activations`` (the same at any batch: autocast's low-precision weight copies, rotary
    tables) and ``activations``, which grow linearly to ``micro_batch``. The model's buffers
    (BatchNorm's running statistics) and the CPU and CUDA RNG states are put back after each
    forward. A mapping (a dict, a tokenizer's ``BatchEncoding``) is passed as keyword arguments,
    a tuple or list as positional ones. The example's
    batch size is dimension ``batch_dim`` of its first tensor with that dimension (depth first).
    ``batch_dim=None`` (the default) is 0, or 1 when the model's layers that declare a layout
    (a bool ``batch_first``: ``nn.MultiheadAttention``, so ``nn.TransformerEncoderLayer`` and
    ``DecoderLayer``; ``nn.Transformer``, ``nn.LSTM``/``GRU``/``RNN``, ``FusedCheckpointBlock``)
    all have ``batch_first=False``: a ``(seq, batch, ...)`` input. That is checked against the
    batch those layers run on (dimension 1 of their ``(seq, batch, features)`` input), and
    ``ValueError`` asks for ``batch_dim=`` when it does not match, when none of them runs on
    such a tensor, or when the layers declare both layouts.

    Returns:
        :class:`Estimate` with ``breakdown``, ``total_bytes``, a table as ``str()`` and
        ``to_dict()``.
    """
    overrides = {k: v for k, v in dict(optimizer=optimizer, precision=precision, low_dtype=low_dtype,
                                           micro_batch=micro_batch).items() if v is not None}
    if isinstance(config, torch.nn.Module):
        if example_input is None:
            raise ValueError("example_input is required to estimate an nn.Module")
        if config_fields:
            raise TypeError(f"unexpected keyword arguments for an nn.Module estimate: {sorted(config_fields)}")
        return _module_estimate(config, example_input, micro_batch, optimizer or "adam", loss_fn,
                                precision or "fp32", _as_dtype(low_dtype or torch.bfloat16, "low_dtype", _LOW_DTYPES),
                                batch_dim)
    if batch_dim is not None:
        raise TypeError("batch_dim applies to the measured form, estimate(model, example_input, batch_dim=...); "
                        f"a ModelConfig's batch is micro_batch, got batch_dim={batch_dim!r}")
    if config is None:
        fields = dict(config_fields, **overrides)
        missing = [f for f in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "micro_batch")
                   if f not in fields]
        if missing:
            raise ValueError(f"estimate needs a ModelConfig, an nn.Module, or the fields {missing}")
        config = ModelConfig(**fields)
    elif not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or an nn.Module, got {type(config).__name__}")
    elif overrides or config_fields:
        config = config.replace(**config_fields, **overrides)
    return _config_estimate(config)


def _largest_fitting(memory_bytes: int, fits: Callable[[int], bool], upper: int) -> int:
    """Largest n in [1, upper] with fits(n), for a monotone fits; 0 when none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= upper and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def check_memory_bytes(memory_bytes, name: str = "memory_bytes") -> None:
    """A positive, finite number of bytes (NaN, inf and bools refused)."""
    if not _is_real(memory_bytes):
        raise TypeError(f"{name} must be a positive finite number of bytes, got {type(memory_bytes).__name__} "
                        f"{memory_bytes!r}")
    if not math.isfinite(memory_bytes) or memory_bytes <= 0:
        raise ValueError(f"{name} must be a positive finite number of bytes, got {memory_bytes!r}")


def _check_search(config, policy, offload, upper) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a memopt.ModelConfig, got {type(config).__name__}")
    if policy is not None and not isinstance(policy, str):
        raise TypeError(f"policy must be a str (one of {registered_policies()}) or None, got {policy!r}")
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool or None, got {offload!r}")
    if not _is_int(upper) or upper <= 0:
        raise ValueError(f"upper must be a positive int, got {upper!r}")


def _searched(config: ModelConfig, policy: str | None, offload: bool | None) -> ModelConfig:
    changes = {k: v for k, v in (("policy", policy), ("offload", offload)) if v is not None}
    return config.replace(**changes) if changes else config


MICRO_BATCH_UPPER = 1 << 20
"""Where :func:`max_micro_batch` stops searching by default: a result equal to it means at least."""
SEQ_LEN_UPPER = 1 << 24
"""Where :func:`max_seq_len` and :func:`seq_len_limit` stop searching by default (at least, when reached)."""


def max_micro_batch(memory_bytes: int, config: ModelConfig, *, policy: str | None = None,
                    offload: bool | None = None, upper: int = MICRO_BATCH_UPPER) -> int:
    """Largest micro-batch whose :func:`estimate` fits in ``memory_bytes`` of device memory (and
    the config's ``host_memory_bytes`` of host memory, when set); 0 when none does, as
    :func:`max_seq_len`.

    ``policy`` and ``offload``, when given, replace ``config``'s."""
    check_memory_bytes(memory_bytes)
    _check_search(config, policy, offload, upper)
    base = _searched(config, policy, offload)
    # fits(), not the device total alone: offloaded bytes grow with the batch and must fit the host budget too
    return _largest_fitting(memory_bytes, lambda b: fits(_config_estimate(base.replace(micro_batch=b)), memory_bytes),
                            upper)


def fits(est: Estimate, memory_bytes: int) -> bool:
    """Whether ``est`` fits: its device total in ``memory_bytes`` and its host bytes in the
    config's ``host_memory_bytes`` (when set)."""
    host_budget = est.config.host_memory_bytes if est.config is not None else None
    return est.total_bytes <= memory_bytes and (host_budget is None or est.host_bytes <= host_budget)


def max_seq_len(memory_bytes: int, config: ModelConfig, *, policy: str | None = None,
                offload: bool | None = None, upper: int = SEQ_LEN_UPPER) -> int:
    """Largest sequence length whose :func:`estimate` fits in ``memory_bytes`` of device memory
    (and the config's ``host_memory_bytes`` of host memory, when set); 0 when none does.

    ``policy`` and ``offload``, when given, replace ``config``'s. The learned position table
    (GPT-2 layout) grows with ``seq_len`` too, as it would in the model.
    """
    return seq_len_limit(memory_bytes, config, policy=policy, offload=offload, upper=upper).max_seq_len


FIXED_TERMS = ("parameters", "gradients", "master_weights", "optimizer_state", "autocast_weights")
"""The terms of a breakdown that do not grow with the sequence length (the GPT-2 layout's learned
position table aside, one row per position): ``seq_len_limit`` never names one of them as what
binds a longer sequence, and says ``"fixed terms"`` when they alone exceed the memory."""


@dataclass(frozen=True)
class SeqLenLimit:
    """The longest sequence that fits and what stops a longer one.

    Attributes:
        max_seq_len: the longest fitting length (0: none; ``upper`` when the search bound is hit).
        binding: what a sequence one token longer runs out of: ``"host memory"`` when its host
            bytes exceed the budget; else the term of its breakdown that grew the most from
            length 1 to that length, the term that takes the memory as the sequence grows (never
            one that does not grow with it, such as ``optimizer_state``). When even length 1 does
            not fit (``max_seq_len`` 0): ``"fixed terms"`` when the terms that do not grow with the
            sequence (:data:`FIXED_TERMS`: weights, gradients, optimizer state) alone exceed the
            memory, else the largest other term at length 1. ``"limit"`` when ``upper`` itself
            fits.
        estimate: the :class:`Estimate` at ``max_seq_len`` (at length 1 when nothing fits).
    """

    max_seq_len: int
    binding: str
    estimate: Estimate


def seq_len_limit(memory_bytes: int, config: ModelConfig, *, policy: str | None = None,
                  offload: bool | None = None, upper: int = SEQ_LEN_UPPER) -> SeqLenLimit:
    """:func:`max_seq_len` with the term that binds (see :class:`SeqLenLimit`)."""
    check_memory_bytes(memory_bytes)
    _check_search(config, policy, offload, upper)
    base = _searched(config, policy, offload)
    at = lambda s: _config_estimate(base.replace(seq_len=s))  # noqa: E731
    longest = _largest_fitting(memory_bytes, lambda s: fits(at(s), memory_bytes), upper)
    if longest == upper:
        return SeqLenLimit(longest, "limit", at(longest))
    over = at(longest + 1)
    budget = base.host_memory_bytes
    if budget is not None and over.host_bytes > budget:
        binding = "host memory"
    elif longest == 0:
        # Nothing fits: nothing grew yet. Either the terms that do not depend on the sequence
        # exceed the memory on their own, or (with a hair of room left) what one token adds does.
        fixed = sum(over.breakdown.get(k, 0) for k in FIXED_TERMS)
        others = {k: v for k, v in over.breakdown.items() if k not in FIXED_TERMS}
        binding = "fixed terms" if fixed > memory_bytes else max(others, key=others.get)
    else:
        # The largest term is not what binds: optimizer state can outweigh everything and never
        # grow with the sequence. What grew from length 1 to the first length that does not fit is.
        shortest = at(1).breakdown
        growth = {k: v - shortest.get(k, 0) for k, v in over.breakdown.items()}
        binding = max(growth, key=growth.get)
    return SeqLenLimit(longest, binding, at(max(longest, 1)))


LONG_CONTEXT_FFN_CHUNK_TOKENS = 4096
"""Tokens per FFN chunk in the ``memopt long-context`` strategy."""


def strategies(config: ModelConfig) -> dict[str, ModelConfig]:
    """The training setups ``memopt estimate --max-seq`` compares, as configs derived from ``config``:

    - ``no checkpointing``: every activation saved, Hugging Face's loss (materialised logits);
    - ``Hugging Face checkpointing``: ``torch.utils.checkpoint`` around each layer
      (``model.gradient_checkpointing_enable()``), Hugging Face's loss;
    - ``memopt selective`` / ``memopt full``: ``memopt.wrap(model, policy=...)`` with its default
      chunked loss;
    - ``memopt long-context``: ``policy="full", offload=True`` (layer inputs in host memory as
      far as ``host_memory_bytes`` holds them), the tiled FFN and norms (``ffn_chunk_tokens``
      :data:`LONG_CONTEXT_FFN_CHUNK_TOKENS`, Llama layout only) and the chunked loss.
    """
    check = lambda c: ModelConfig(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})  # noqa: E731
    plain = dict(ffn_chunk_tokens=None, offload=False, loss="plain")
    chunked = dict(ffn_chunk_tokens=None, offload=False, loss="chunked")
    tiles = LONG_CONTEXT_FFN_CHUNK_TOKENS if config.arch == "llama" else None
    return {name: check(config.replace(**changes)) for name, changes in {
        "no checkpointing": dict(plain, policy="eager"),
        "Hugging Face checkpointing": dict(plain, policy="checkpoint"),
        "memopt selective": dict(chunked, policy="selective"),
        "memopt full": dict(chunked, policy="full"),
        "memopt long-context": dict(chunked, policy="full", offload=True, ffn_chunk_tokens=tiles),
    }.items()}


def fit_choices() -> list[tuple[str, bool]]:
    """The ``(policy, offload)`` pairs the fit tables (``memopt estimate --memory-gib``,
    :func:`memopt.diagnose_oom`) try: every registered policy on the device, and memopt's
    ``"selective"`` offloaded."""
    return [(policy, False) for policy in registered_policies()] + [("selective", True)]


def choice_label(policy: str, offload: bool) -> str:
    """How a fit table names a ``(policy, offload)`` pair: ``"selective"``, ``"selective, offload"``."""
    return f"{policy}, offload" if offload else policy


PRESETS = {
    # OpenAI GPT-2 sizes (n_ctx 1024, vocab 50257).
    "gpt2": dict(n_layers=12, d_model=768, n_heads=12, vocab_size=50257, seq_len=1024),
    "gpt2-medium": dict(n_layers=24, d_model=1024, n_heads=16, vocab_size=50257, seq_len=1024),
    "gpt2-large": dict(n_layers=36, d_model=1280, n_heads=20, vocab_size=50257, seq_len=1024),
    "gpt2-xl": dict(n_layers=48, d_model=1600, n_heads=25, vocab_size=50257, seq_len=1024),
    # Meta Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B), trained in bf16 as Hugging Face loads it.
    "llama-3-8b": dict(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                       vocab_size=128256, seq_len=8192, precision="pure", attention="flash", dropout=0.0),
}
