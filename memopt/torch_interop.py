"""``nn.TransformerEncoderLayer`` and ``memopt.FusedCheckpointBlock``: which layers the block
reproduces (:func:`supports`), copying or sharing a layer's weights (:func:`from_torch`), and the
module ``memopt.wrap`` swaps in for such a layer (:class:`FusedTransformerEncoderLayer`, made by
:func:`swap_for_fused_block`).

Note: a swapped-in layer is the torch layer's parameters under new names.
    :func:`swap_for_fused_block` builds the block with ``share_parameters=True``: the block's
    ``qkv.weight`` *is* the layer's ``self_attn.in_proj_weight``, and so on. Everything here keeps
    that true, so that ``memopt.unwrap`` can put the torch layer back with its trained weights:
    the swapped module's ``state_dict`` is written and read under the layer's names (a checkpoint
    saved while wrapped loads unwrapped and back), and the float32 fallback runs the layer on the
    block's *current* parameters (``torch.func.functional_call``) rather than on the layer's own
    attributes, because FSDP2 and other wrappers replace a module's parameters after the swap
    and gradients must reach the replacements. The torch layer is never registered as a
    submodule: its parameters would appear twice in ``state_dict`` and ``parameters()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memopt._records_graph import records_graph
from memopt._stock_forward import has_module_hooks, runs_stock_forward
from memopt.block import FusedCheckpointBlock, compute_dtype
from memopt.block_functions import MAX_HEAD_DIM, head_dim_supported
from memopt.checkpoint import checkpoint
from memopt.ops import attention as _attention_ops

__all__ = [
    "FusedTransformerEncoderLayer",
    "from_torch",
    "supports",
    "swap_for_fused_block",
    "unsupported_reason",
]


# -- which layers the block reproduces --------------------------------------------------------


def supports(layer: nn.Module, *, allow_autocast: bool = False) -> bool:
    """Whether :func:`from_torch` reproduces ``layer`` exactly, in training and in eval mode.

    With ``allow_autocast=True``, float32 layers on a device where attention runs only in a
    half type (CUDA) are accepted too: the block then reproduces the layer under
    ``torch.autocast`` only. ``memopt.wrap`` swaps such layers for a
    :class:`FusedTransformerEncoderLayer` that runs the torch layer itself (checkpointed) for
    calls outside autocast.

    True for an ``nn.TransformerEncoderLayer`` (its own ``forward``, no hooks) with relu or
    gelu activation (function or module), either ``norm_first``, either ``batch_first``,
    ``head_dim`` at most ``MAX_HEAD_DIM`` (256), biases on all of its linears and norms or on none,
    affine LayerNorms with one eps, every parameter of one dtype on one device that attention
    takes there (``memopt.ops.attention.supported_dtypes``: fp16/bf16 on CUDA, so fp32 layers
    meant for autocast need ``allow_autocast``), and **every dropout probability 0**: torch's
    layer has a fourth dropout site (between the activation and ``linear2``) that the block
    lacks, and its dropout masks come from another RNG, so with dropout > 0 training would
    differ. ``memopt.wrap`` checkpoints such layers as they are instead. Not checked here,
    raised at call time instead: attention masks other than causal ones and
    ``src_key_padding_mask`` (see :meth:`FusedTransformerEncoderLayer.forward`).
    """
    return unsupported_reason(layer, allow_autocast=allow_autocast) is None


def unsupported_reason(layer: nn.Module, *, allow_autocast: bool = False) -> str | None:
    """Why :func:`from_torch` would not reproduce ``layer`` exactly (see :func:`supports`), or None."""
    return _unsupported_reason(layer, allow_autocast=allow_autocast, allow_dropout=False)


def _unsupported_reason(layer: nn.Module, *, allow_autocast: bool, allow_dropout: bool) -> str | None:
    """:func:`unsupported_reason`; with ``allow_dropout`` dropout > 0 passes (:func:`from_torch`
    takes it: the block then differs in training only, as documented there)."""
    base = nn.TransformerEncoderLayer
    if not isinstance(layer, base):
        return f"not an nn.TransformerEncoderLayer ({type(layer).__name__})"
    if any(getattr(type(layer), name) is not getattr(base, name) for name in ("forward", "_sa_block", "_ff_block")):
        return f"{type(layer).__name__} overrides nn.TransformerEncoderLayer's forward"
    if "forward" in layer.__dict__:
        return "its forward was replaced on the instance"
    if any(has_module_hooks(m) for m in layer.modules()):
        return "it has module hooks, which the block would not run"
    attn = layer.self_attn
    if type(attn) is not nn.MultiheadAttention or not attn._qkv_same_embed_dim:
        return "self_attn is not a plain nn.MultiheadAttention with kdim == vdim == embed_dim"
    for name, linear in (("linear1", layer.linear1), ("linear2", layer.linear2), ("self_attn.out_proj", attn.out_proj)):
        # An adapter in a linear's place (PEFT's LoRA layer) keeps the base weight as .weight:
        # the block, which reads the weights, would drop the adapter without a word.
        if not isinstance(linear, nn.Linear) or not runs_stock_forward(linear, nn.Linear.forward):
            return f"{name} is a {type(linear).__module__}.{type(linear).__qualname__}, not a plain nn.Linear (an adapter such as PEFT's LoRA layer?)"
    extra = sorted(set(dict(layer.named_parameters())) - _LAYER_PARAMETERS)
    if extra:
        return f"it has parameters the block would not hold ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"
    if attn.bias_k is not None or attn.add_zero_attn:
        return "self_attn has add_bias_kv or add_zero_attn"
    head_dim = attn.embed_dim // attn.num_heads
    if not head_dim_supported(head_dim):
        return f"head_dim {head_dim} is above {MAX_HEAD_DIM}"
    try:
        _activation_name(layer.activation)
    except ValueError:
        return f"activation {layer.activation!r} is not relu or gelu"
    norms = (layer.norm1, layer.norm2)
    if any(type(n) is not nn.LayerNorm or not n.elementwise_affine or tuple(n.normalized_shape) != (attn.embed_dim,) for n in norms):
        return "norm1/norm2 are not affine nn.LayerNorm(d_model)"
    if layer.norm1.eps != layer.norm2.eps:
        return "norm1 and norm2 have different eps"
    biases = (attn.in_proj_bias, attn.out_proj.bias, layer.linear1.bias, layer.linear2.bias, layer.norm1.bias, layer.norm2.bias)
    if len({b is None for b in biases}) != 1:
        return "some of its linears and norms have a bias and some do not"
    dropouts = (attn.dropout, layer.dropout.p, layer.dropout1.p, layer.dropout2.p)
    if not allow_dropout and any(p > 0 for p in dropouts):
        return f"dropout > 0 ({dropouts}): torch's FFN-internal dropout and RNG differ from the block's"
    params = list(layer.parameters())
    if len({(p.dtype, p.device) for p in params}) != 1:
        return "its parameters are not all of one dtype on one device"
    allowed = _attention_ops.supported_dtypes(params[0].device)
    runs_under_autocast = params[0].dtype == torch.float32 and bool(set(allowed) & {torch.float16, torch.bfloat16})
    if params[0].dtype not in allowed and not (allow_autocast and runs_under_autocast):
        # fp32 layers on CUDA included: the block would need autocast to run at all.
        return f"its dtype {params[0].dtype} is not one attention takes on {params[0].device} {allowed}"
    return None


# The parameters of an nn.TransformerEncoderLayer (its biases optional): all the block holds.
_LAYER_PARAMETERS = frozenset(
    f"{module}.{kind}"
    for module in ("self_attn.in_proj", "self_attn.out_proj", "linear1", "linear2", "norm1", "norm2")
    for kind in ("weight", "bias")
) | {"self_attn.in_proj_weight", "self_attn.in_proj_bias"}


def _activation_name(activation) -> str:
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    raise ValueError(
        f"FusedCheckpointBlock.from_torch: layer.activation must be relu or gelu (function or module), got {activation!r}"
    )


# -- a block with a layer's weights -------------------------------------------------------------


def from_torch(
    layer: nn.TransformerEncoderLayer, policy: str = "selective", *, share_parameters: bool = False
) -> FusedCheckpointBlock:
    """A :class:`memopt.FusedCheckpointBlock` with ``layer``'s configuration and weights.

    ``layer`` is an ``nn.TransformerEncoderLayer`` with relu or gelu activation, norm_first
    True or False, batch_first True or False (the block keeps that layout: it takes the same
    input as ``layer``). In eval mode or with dropout 0 the outputs match the layer's. In
    training the block applies ``layer``'s dropout at its three sites (attention
    probabilities, both residual branches) but not inside the FFN, where torch's layer has a
    fourth dropout: there is no dropout between the activation and fc2
    (:func:`supports` is True only for layers the block reproduces exactly). Every other layer
    :func:`supports` refuses (norms of different eps, biases on some linears and norms only,
    hooks, ...) raises ``ValueError`` with :func:`unsupported_reason`'s message. The parameters'
    ``requires_grad`` is the layer's.

    Args:
        layer: the torch layer.
        policy: the block's recompute policy.
        share_parameters: when True the block's parameters *are* ``layer``'s ``nn.Parameter``
            objects (``qkv.weight`` is ``self_attn.in_proj_weight``, ``fc1`` is ``linear1``, ...),
            so training the block trains ``layer`` and no memory is copied; when False they
            are copies.
    """
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise TypeError(f"FusedCheckpointBlock.from_torch: layer must be an nn.TransformerEncoderLayer, got {type(layer).__name__}")
    # Everything supports() refuses but dropout (see above): the block could not hold the layer's
    # configuration (one eps, biases everywhere or nowhere, ...) and would compute something else.
    reason = _unsupported_reason(layer, allow_autocast=True, allow_dropout=True)
    if reason is not None:
        raise ValueError(f"FusedCheckpointBlock.from_torch: the block cannot reproduce this layer: {reason}")
    attn = layer.self_attn
    activation = _activation_name(layer.activation)
    bias = layer.linear1.bias is not None  # all or none (checked above)
    weight = attn.in_proj_weight
    block = FusedCheckpointBlock(
        attn.embed_dim, attn.num_heads, layer.linear1.out_features, dropout=layer.dropout.p,
        activation=activation, norm="layernorm", norm_first=layer.norm_first, bias=bias,
        eps=layer.norm1.eps, batch_first=attn.batch_first, policy=policy,
        # Shared parameters replace the block's own: build those on "meta" (no memory).
        device="meta" if share_parameters else weight.device, dtype=weight.dtype,
    )  # fmt: skip
    state = {
        "qkv.weight": attn.in_proj_weight, "out_proj.weight": attn.out_proj.weight,
        "fc1.weight": layer.linear1.weight, "fc2.weight": layer.linear2.weight,
        "norm1.weight": layer.norm1.weight, "norm2.weight": layer.norm2.weight,
    }  # fmt: skip
    if bias:
        state.update({
            "qkv.bias": attn.in_proj_bias, "out_proj.bias": attn.out_proj.bias,
            "fc1.bias": layer.linear1.bias, "fc2.bias": layer.linear2.bias,
            "norm1.bias": layer.norm1.bias, "norm2.bias": layer.norm2.bias,
        })  # fmt: skip
    if share_parameters:
        missing = [name for name, param in state.items() if not isinstance(param, nn.Parameter)]
        if missing:
            raise ValueError(f"FusedCheckpointBlock.from_torch: share_parameters=True needs nn.Parameters, but layer's {missing} are not")
        for name, param in state.items():
            module, attr = name.split(".")
            setattr(getattr(block, module), attr, param)
    else:
        block.load_state_dict({k: v.detach() for k, v in state.items()})
        for name, param in state.items():  # load_state_dict copies values, not requires_grad
            block.get_parameter(name).requires_grad_(param.requires_grad)
    return block.train(layer.training)


# -- the module wrap swaps in ---------------------------------------------------------------------


class FusedTransformerEncoderLayer(nn.Module):
    """An ``nn.TransformerEncoderLayer``'s stand-in that runs a :class:`memopt.FusedCheckpointBlock`.

    Takes the torch layer's call, ``forward(src, src_mask=None, src_key_padding_mask=None,
    is_causal=False)``, answers what ``nn.TransformerEncoder`` reads from its layers
    (``self_attn``, ``linear1``, ... as read-only views of the block's parameters) and runs
    ``block``, a submodule. Made by :func:`swap_for_fused_block`, whose block shares the torch
    layer's parameters; its ``state_dict`` uses the layer's names.

    Args:
        block: the fused block.
        torch_layer: the layer itself, run (checkpointed under the block's policy, on the
            block's current parameters) for calls whose compute dtype the block's kernels do not
            take on their device: a float32 layer on CUDA outside ``torch.autocast`` (the block
            runs under autocast), a model cast to bfloat16 after ``wrap`` on CPU. None: every call
            runs the block. Held outside the module tree (see the note in
            :mod:`memopt.torch_interop`); ``copy.deepcopy`` copies it with the block.
    """

    def __init__(self, block: FusedCheckpointBlock, torch_layer: nn.TransformerEncoderLayer | None = None):
        super().__init__()
        self.block = block
        object.__setattr__(self, "torch_layer", torch_layer)
        # {torch layer parameter name: this module's name}, for the fallback's functional_call.
        names = {} if torch_layer is None else shared_parameter_names(self, torch_layer)
        object.__setattr__(self, "_own_names", {layer_name: name for name, layer_name in names.items()})

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``src`` as ``nn.TransformerEncoderLayer`` takes it (an unbatched ``(S, d_model)`` is a
        batch of one) -> same shape. ``src_mask`` is the block's ``attn_mask`` (None or causal);
        ``src_key_padding_mask`` must be None. Calls that run the torch layer (``torch_layer``,
        outside autocast) take whatever it takes."""
        if self.torch_layer is not None and self._block_cannot_run(src):
            return self._run_torch_layer(src, src_mask, src_key_padding_mask, is_causal)
        if src_key_padding_mask is not None:
            raise ValueError(
                "FusedTransformerEncoderLayer: src_key_padding_mask must be None (padding masks are not supported); "
                "use memopt.unwrap or a model without padding"
            )
        if src.is_nested:
            raise ValueError(
                "FusedTransformerEncoderLayer: src is a nested tensor; nn.TransformerEncoder makes one from "
                "src_key_padding_mask in inference, and padding masks are not supported"
            )
        if src.dim() == 2:
            batch_dim = 0 if self.block.batch_first else 1
            return self.block(src.unsqueeze(batch_dim), src_mask, is_causal=is_causal).squeeze(batch_dim)
        return self.block(src, src_mask, is_causal=is_causal)

    @staticmethod
    def _block_cannot_run(src: torch.Tensor) -> bool:
        """Whether the block's kernels cannot take this call's compute dtype: a float32 layer on
        CUDA outside autocast, or a model cast after ``wrap`` (``model.bfloat16()`` on CPU, whose
        kernels take float32 / float64). Under CPU autocast the block upcasts a float32 input."""
        supported = _attention_ops.supported_dtypes(src.device)
        if compute_dtype(src) in supported:
            return False
        return not (src.device.type == "cpu" and torch.is_autocast_enabled("cpu") and src.dtype in supported)

    def _run_torch_layer(self, src, src_mask, src_key_padding_mask, is_causal):
        layer, block = self.torch_layer, self.block
        params = {layer_name: self.get_parameter(name) for layer_name, name in self._own_names.items()}

        def layer_forward(src, **kwargs):
            return torch.func.functional_call(layer, params, (src,), kwargs)

        if not records_graph(((src, src_mask, src_key_padding_mask), params), ()):
            # A frozen model, or gradients off: no graph, so the checkpoint would be host time only.
            return layer_forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        return checkpoint(
            layer_forward, src, policy=block.policy, offload=block.offload,
            src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal,
        )  # fmt: skip

    # -- what nn.TransformerEncoder reads from its layers -------------------------------------
    # nn.TransformerEncoder.forward inspects layers[0] (self_attn.batch_first always; the rest
    # for its nested-tensor fast path). These read-only views answer from the block's own
    # parameters without registering any module twice.

    @property
    def self_attn(self) -> "_SelfAttentionView":
        return _SelfAttentionView(self.block)

    linear1 = property(lambda self: self.block.fc1, doc="torch's name for the block's fc1")
    linear2 = property(lambda self: self.block.fc2, doc="torch's name for the block's fc2")
    norm1 = property(lambda self: self.block.norm1)
    norm2 = property(lambda self: self.block.norm2)
    norm_first = property(lambda self: self.block.norm_first)

    @property
    def activation_relu_or_gelu(self) -> bool:
        return self.block.activation in ("relu", "gelu")


class _SelfAttentionView:
    """The attributes of ``nn.MultiheadAttention`` that ``nn.TransformerEncoder`` reads."""

    __slots__ = ("_block",)

    def __init__(self, block: FusedCheckpointBlock):
        self._block = block

    @property
    def batch_first(self) -> bool:
        return self._block.batch_first

    @property
    def _qkv_same_embed_dim(self) -> bool:
        return True

    @property
    def embed_dim(self) -> int:
        return self._block.d_model

    @property
    def num_heads(self) -> int:
        return self._block.n_heads

    @property
    def in_proj_weight(self) -> torch.Tensor:
        return self._block.qkv.weight

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        return self._block.qkv.bias

    @property
    def out_proj(self) -> nn.Linear:
        return self._block.out_proj


# -- the swap ------------------------------------------------------------------------------------


def swap_for_fused_block(layer: nn.Module, policy: str) -> FusedTransformerEncoderLayer | None:
    """The module ``memopt.wrap`` puts in ``layer``'s place, or None to checkpoint it as is.

    For an ``nn.TransformerEncoderLayer`` that the block reproduces exactly
    (``supports(layer, allow_autocast=True)``: relu/gelu, head_dim the attention kernels take,
    all dropout 0, ...): a :class:`FusedTransformerEncoderLayer` whose block shares the layer's
    ``nn.Parameter`` objects, so training it trains the layer and ``unwrap`` can put the layer
    back, and whose ``state_dict`` has the layer's names. A float32 layer on CUDA is swapped too:
    its block runs under ``torch.autocast`` and calls outside autocast run the layer itself,
    checkpointed with the same policy.
    """
    if not supports(layer, allow_autocast=True):
        return None
    block = from_torch(layer, policy=policy, share_parameters=True)
    # The layer is kept for calls the block cannot run (a float32 layer on CUDA outside autocast,
    # a model cast to a dtype the block's device kernels do not take after wrap).
    swapped = FusedTransformerEncoderLayer(block, torch_layer=layer)
    swapped.register_state_dict_post_hook(_LayerStateDictNames(swapped, layer, loading=False))
    swapped.register_load_state_dict_pre_hook(_LayerStateDictNames(swapped, layer, loading=True))
    return swapped


def shared_parameter_names(module: nn.Module, layer: nn.Module) -> dict[str, str]:
    """``{module parameter name: layer parameter name}`` for a module whose parameters are all
    ``layer``'s ``nn.Parameter`` objects (the two names of each shared parameter)."""
    layer_names = {id(p): name for name, p in layer.named_parameters()}
    names = {}
    for name, p in module.named_parameters():
        if id(p) not in layer_names:
            raise ValueError(f"memopt: parameter {name!r} is not one of the layer's")
        names[name] = layer_names[id(p)]
    return names


class _LayerStateDictNames:
    """A state-dict hook that gives a swapped-in module its torch layer's parameter names: when
    saving (``loading=False``) or loading. A callable object, not a closure, so that a wrapped
    model pickles."""

    def __init__(self, module: nn.Module, layer: nn.Module, loading: bool):
        self.to_layer = shared_parameter_names(module, layer)
        self.layer_order = [name for name, _ in layer.named_parameters()]
        self.loading = loading

    def __call__(self, module, state_dict, prefix, *args) -> None:
        if self.loading:
            for name, layer_name in self.to_layer.items():
                if prefix + layer_name in state_dict:
                    state_dict[prefix + name] = state_dict.pop(prefix + layer_name)
            return
        # The module's entries are the last ones (a module's hook runs after its subtree):
        # re-added under the layer's names, in the layer's order.
        values = {
            self.to_layer[name]: state_dict.pop(prefix + name) for name in self.to_layer if prefix + name in state_dict
        }
        for name in self.layer_order:
            if name in values:
                state_dict[prefix + name] = values[name]
