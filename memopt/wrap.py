"""memopt.wrap: apply a checkpoint policy and offload to every repeated layer of an existing model.

``wrap`` finds the model's repeated layers (the transformer blocks), replaces each one's
``forward`` by an instance attribute that runs the original forward through
:func:`memopt.checkpoint` with that layer's policy and offload, and records what it did so that
:func:`unwrap` puts every original forward back. Parameters, buffers, module names and the
state_dict are untouched, so the model can be wrapped before or after ``fully_shard`` or
``DistributedDataParallel`` and saved or loaded as usual.

Choosing the policies for a memory budget is :mod:`memopt.plan`'s: ``wrap(model, plan=...)``
applies a :class:`memopt.Plan`, ``wrap(model, budget_bytes=..., example_inputs=...)`` makes one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memopt import causal_lm_loss, tiled_ffn
from memopt._records_graph import may_require_grad, records_graph
from memopt.checkpoint import checkpoint, is_cache
from memopt.integrations._checkpointing_method import has_checkpointing_method
from memopt.offload import Offload
from memopt.policy import check_offload, check_policy
from memopt.torch_interop import swap_for_fused_block

if TYPE_CHECKING:
    from memopt.plan import Plan

_STATE_ATTR = "_memopt_wrap_state"
_CONTAINERS = (nn.ModuleList, nn.Sequential)
# Containers without a forward of their own: a model iterates them, so they are never layers.
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)
# Key/value cache arguments of Hugging Face layers across versions (4.x: past_key_value(s), 5.x: cache).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

LayerSelector = type | tuple | Callable[[nn.Module], bool] | None


@dataclass
class _WrapState:
    """What ``wrap`` changed on a model, so ``unwrap`` can undo it exactly."""

    # layers whose forward wrap replaced (each carries a _LayerWrap)
    wrapped: list[nn.Module] = field(default_factory=list)
    # (parent, attribute, original layer) for layers swapped for a fused block
    swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    # the forward pre-hooks (_CacheOff) that default use_cache to False on the Hugging Face
    # modules whose forward takes it (an encoder-decoder's decoder stack has its own config)
    use_cache: list[Any] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)
    # the chunked-loss forward installed on a Hugging Face causal LM (memopt.causal_lm_loss)
    loss_forward: Any = None
    # the model's hooks of _RunCheck until its first forward with gradients has been checked
    run_check: list = field(default_factory=list)
    # the MLPs and norms tiled for ffn_chunk_tokens (memopt.tiled_ffn.install, install_norms)
    tiled_ffns: list = field(default_factory=list)


# -- finding layers -------------------------------------------------------------------------


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # A layer nested inside another selected layer is covered by the outer one's checkpoint.
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if not any(name.startswith(outer + ".") for outer, _ in chosen):
            chosen.append((name, module))
    return chosen


def _stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The members ``(qualified name, module)`` of each ``nn.ModuleList``/``nn.Sequential`` of
    ``model``. A ``ModuleList`` or ``ModuleDict`` inside one is opened into it: a model iterates
    those and never calls them, so Funnel's blocks of layers and PoolFormer's stages are one
    stack of layers each, not a stack of lists."""
    stacks: list[list[tuple[str, nn.Module]]] = []
    opened: set[int] = set()

    def members(prefix: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
        found = []
        for child_name, child in container.named_children():
            if isinstance(child, _NEVER_CALLED):
                opened.add(id(child))
                found += members(f"{prefix}{child_name}.", child)
            else:
                found.append((prefix + child_name, child))
        return found

    for name, module in model.named_modules():  # outer containers come before inner ones
        if isinstance(module, _CONTAINERS) and id(module) not in opened:
            stacks.append(members(f"{name}." if name else "", module))
    return stacks


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _default_layer_classes(model: nn.Module) -> set[type]:
    """The layer classes ``wrap`` picks by default (see :func:`find_layers`): the module class
    repeated most often in the model's stacks (:func:`_stacks`, outermost instances); any other
    class stacked alone that holds at least a tenth of that one's parameters (an
    encoder-decoder's second stack: Whisper's or BART's decoder layers); and the other classes
    in a stack of a chosen class with at least a tenth of a chosen layer's parameters each (a
    hybrid stack: Jamba's attention layers among its Mamba layers, Zamba2's hybrid layers).
    When no class repeats, the outermost members of the stacks holding at least a tenth of the
    model's parameters each: one layer module that the forward runs several times (ALBERT's
    shared layer group; each call is checkpointed on its own)."""
    stacks = _stacks(model)
    in_containers = [member for stack in stacks for member in stack]
    # classes that fill a whole stack on their own
    pure_stacks = {type(stack[0][1]) for stack in stacks if len(stack) >= 2 and len({type(m) for _, m in stack}) == 1}
    counts = Counter(type(module) for _, module in in_containers)
    candidates = {cls for cls, count in counts.items() if count >= 2}
    if not candidates:
        # One layer module the forward runs several times (ALBERT's shared layer group, run
        # num_hidden_layers times): repeated in time, not in the containers.
        model_params = _num_params(model)
        shared = {type(m) for _, m in _outermost(in_containers) if _num_params(m) * 10 >= model_params > 0}
        if not shared:
            raise ValueError(
                "memopt.wrap: found no module class repeated inside an nn.ModuleList or nn.Sequential, nor "
                "one holding a tenth of the parameters; pass layers= (a class, a tuple of classes or a predicate)"
            )
        return shared
    # Keep classes that occur outside every other candidate (the blocks, not the experts or
    # sub-layers inside them), then take the most repeated of those.
    outer = _outermost([(name, m) for name, m in in_containers if type(m) in candidates])
    outer_classes = Counter(type(m) for _, m in outer)
    top = max(outer_classes, key=lambda cls: (outer_classes[cls], -list(outer_classes).index(cls)))
    params = Counter()
    for _, m in outer:
        params[type(m)] += _num_params(m)
    chosen = {top} | {cls for cls in outer_classes if cls in pure_stacks and params[cls] * 10 >= params[top]}
    layer_params = params[top] // outer_classes[top]
    for stack in stacks:
        if any(type(m) in chosen for _, m in stack):
            chosen |= {type(m) for _, m in stack if _num_params(m) * 10 >= layer_params}
    return chosen


def find_layers(model: nn.Module, layers: LayerSelector = None) -> list[tuple[str, nn.Module]]:
    """The repeated layers of ``model`` as ``(qualified name, module)`` in forward order.

    Args:
        model: the model.
        layers: ``None`` picks the module class repeated most often inside an
            ``nn.ModuleList``/``nn.Sequential``, outermost instances only (``TransformerEncoderLayer``,
            ``LlamaDecoderLayer``, ``GPT2Block``, ``BertLayer``), plus any other class that fills
            such a container alone with at least a tenth of its parameters (an encoder-decoder's
            other stack: ``WhisperDecoderLayer`` beside ``WhisperEncoderLayer``), plus the other
            classes sharing a container with those, each with at least a tenth of a layer's
            parameters (hybrid stacks: Jamba's attention and Mamba layers, Zamba2's hybrid and
            Mamba layers). With no class repeated, the outermost container members holding a
            tenth of the model's parameters each (ALBERT's one layer group, which the forward
            runs num_hidden_layers times). An ``nn.ModuleList``/``nn.ModuleDict`` inside such a container is
            opened (Funnel's blocks, PoolFormer's stages): the model iterates it, it is never a
            layer. A class or tuple of classes selects instances of those; a callable
            ``layers(module) -> bool`` selects where it returns True (selecting a
            ``ModuleList``/``ModuleDict`` raises ``ValueError``). Selected modules nested in
            another selected module are left out.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.wrap: model must be an nn.Module, got {type(model).__name__}")
    if layers is None:
        layer_classes = _default_layer_classes(model)
        predicate: Callable[[nn.Module], bool] = lambda m: type(m) in layer_classes  # noqa: E731
    elif isinstance(layers, type) or (isinstance(layers, tuple) and all(isinstance(c, type) for c in layers)):
        classes = layers
        predicate = lambda m: isinstance(m, classes)  # noqa: E731
    elif callable(layers):
        predicate = layers
    else:
        raise TypeError(
            f"memopt.wrap: layers must be None, a class, a tuple of classes or a predicate, got {layers!r}"
        )
    selected = [(name, m) for name, m in model.named_modules() if m is not model and predicate(m)]
    never_called = [name for name, m in selected if isinstance(m, _NEVER_CALLED)]
    if never_called:
        raise ValueError(
            f"memopt.wrap: layers={layers!r} selects containers {never_called} of {type(model).__name__}; an "
            "nn.ModuleList or nn.ModuleDict has no forward (the model iterates it), so checkpointing it would "
            "change nothing. Select the layers inside it"
        )
    found = _outermost(selected)
    if not found:
        raise ValueError(f"memopt.wrap: layers={layers!r} selects no submodule of {type(model).__name__}")
    return found


def _per_layer(names: Sequence[str], value, what: str, one: str, is_one: Callable[[Any], bool], check, missing) -> list:
    """``value`` for each layer: one value for all, a list with one per layer, or a dict from
    layer index or name (layers not in it get ``missing``); each checked by ``check``."""
    if is_one(value):
        chosen = [value] * len(names)
    elif isinstance(value, dict):
        # bool is an int to Python, not a layer index here ({True: "full"} is a mistake, not layer 1).
        unknown = [
            k for k in value
            if isinstance(k, bool) or not (isinstance(k, int) and 0 <= k < len(names)) and k not in names
        ]  # fmt: skip
        if unknown:
            raise ValueError(
                f"memopt.wrap: {what} keys must be layer indices in [0, {len(names)}) or layer names "
                f"{list(names)}, got {unknown}"
            )
        # Index i and name names[i] are the same layer: both keys would leave one value silently unused.
        twice = [(i, name) for i, name in enumerate(names) if i in value and name in value]
        if twice:
            i, name = twice[0]
            raise ValueError(
                f"memopt.wrap: {what} names layer {name!r} twice, as index {i} ({value[i]!r}) and as name "
                f"{name!r} ({value[name]!r}); give it one key"
            )
        chosen = [value.get(i, value.get(name, missing)) for i, name in enumerate(names)]
    elif isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(f"memopt.wrap: {what} has {len(value)} entries for {len(names)} layers {list(names)}")
        chosen = list(value)
    else:
        raise TypeError(f"memopt.wrap: {what} must be {one}, a list or a dict, got {type(value).__name__}")
    return [check(v, "memopt.wrap", f"{what} for layer {name!r}") for name, v in zip(names, chosen)]


# -- wrap / unwrap --------------------------------------------------------------------------


_LAYER_ATTR = "_memopt_wrap_layer"


@dataclass
class _LayerWrap:
    name: str
    policy: str
    # The instance-level forward the layer had before wrap, or None for its class's forward.
    previous_forward: Callable | None
    # False, True (the active or the default engine) or the memopt.Offload to use.
    offload: bool | Offload = False
    # whether the layer ran in the model's current forward (_RunCheck)
    ran: bool = False
    # Whether the model's current forward began with gradients on, as _RunCheck's pre-hook saw
    # it; False too once a forward with gradients has passed the run check (no checks after it);
    # None: not seen (under torch.compile the hooks step aside), checked as True
    model_grad: bool | None = None
    # Whether a call that records_graph said records no graph returned a result that requires
    # grad (or one may_require_grad cannot see into): the layer may read such a tensor from
    # outside its arguments and parameters (a tied weight held as a plain attribute, a closure, a
    # hook's), so its calls are always checkpointed
    reads_hidden_grad: bool = False

    def __deepcopy__(self, memo):
        # A deep copy of the model shares the offload engine (one host pool per process); the
        # copied forward is rebound by deepcopy itself.
        return _LayerWrap(
            self.name, self.policy, copy.deepcopy(self.previous_forward, memo), self.offload,
            reads_hidden_grad=self.reads_hidden_grad,
        )  # fmt: skip


def check_layer_call(name: str, layer: nn.Module, args: tuple, kwargs: dict, model_grad: bool | None = None) -> None:
    """Refuse a layer call that checkpointing would get wrong or leave unchanged (``wrap``'s and
    ``memopt.plan``'s): a key/value cache while computing gradients that the recompute cannot
    see as the forward did (:func:`memopt.checkpoint` copies a ``transformers.Cache`` for it,
    note [a key/value cache argument]; any other cache object, or any cache under
    ``torch.compile``, would be appended to twice), or gradients off on inputs that need them
    (the model runs the layer inside its own ``autograd.Function``, as Reformer's reversible
    layers do, and computes its backward itself: a checkpoint there saves nothing and changes
    nothing). ``model_grad``: whether the model's forward began with gradients on; the last check
    is skipped when it is False (under ``torch.no_grad`` evaluation a parameter handed to the
    layers, or an input that requires grad, is no sign of a model's own Function); None: not
    known, checked."""
    if torch.is_grad_enabled():
        compiling = torch.compiler.is_compiling()
        cache = next(
            (k for k in _CACHE_KWARGS if kwargs.get(k) is not None and (compiling or not is_cache(kwargs[k]))), None
        )
        if cache is not None:
            raise ValueError(
                f"memopt.wrap: layer {name!r} ({type(layer).__name__}) got a key/value cache ({cache}=, "
                f"{type(kwargs[cache]).__name__}) while computing gradients"
                f"{' under torch.compile' if compiling else ''}; the recompute would append to the cache twice. "
                "Train with use_cache=False, or pass a transformers.Cache"
                f"{' and run without torch.compile' if compiling else ''}"
            )
        return
    if model_grad is not False and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))):
        raise RuntimeError(
            f"memopt.wrap: layer {name!r} ({type(layer).__name__}) ran with gradients off on inputs that "
            "require grad: the model runs it inside its own autograd.Function (reversible layers, as "
            "Reformer's) or under torch.no_grad, and computes its backward itself, so checkpointing it "
            "saves nothing and changes nothing. Leave this layer unwrapped (layers=...); such a model "
            "already recomputes it"
        )


class _RunCheck:
    """Forward pre-hook and hook on the wrapped model: after its first forward with gradients,
    every wrapped layer must have run; a wrap whose layers never run changes nothing (a model
    that iterates a container ``wrap`` chose, a layer the model bypasses). ``RuntimeError`` when
    none ran, a warning naming the ones that did not otherwise; then the hooks go away. An
    object, not a closure, so that a wrapped model pickles and deep-copies."""

    def __init__(self, model: nn.Module, state: _WrapState, pre: bool):
        self.model_name = type(model).__name__
        self.state = state
        self.pre = pre

    def __call__(self, module, args, output=None):
        if torch.compiler.is_compiling():
            return
        infos: list[_LayerWrap] = [getattr(layer, _LAYER_ATTR) for layer in self.state.wrapped]
        if self.pre:
            grad = torch.is_grad_enabled()
            for info in infos:
                info.ran = False
                info.model_grad = grad
            return
        if not torch.is_grad_enabled():
            return
        for info in infos:
            info.model_grad = False  # passed: no more checks of this kind (the hooks go below)
        idle = [info.name for info in infos if not info.ran]
        if len(idle) == len(infos):
            raise RuntimeError(
                f"memopt.wrap: none of the wrapped layers of {self.model_name} ran in its forward ({idle}); the "
                "wrap changes nothing. Pass layers= naming the modules the forward calls"
            )
        _remove_hooks(self.state.run_check)
        self.state.run_check.clear()
        if idle:
            warnings.warn(
                f"memopt.wrap: wrapped layers {idle} of {self.model_name} did not run in its first forward with "
                "gradients; they are not checkpointed there",
                stacklevel=2,
            )


# memopt.checkpoint's own parameter names (fn, policy, offload, preserve_rng_state, debug,
# context_fn, ...): a layer keyword argument of one of these names is the layer's, not the
# checkpoint's, so it is bound into the function the checkpoint runs rather than passed to it.
_CHECKPOINT_NAMES = frozenset(
    name
    for name, p in inspect.signature(checkpoint).parameters.items()
    if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
)


class _CheckpointedForward:
    """The forward ``wrap`` installs on a layer: an object holding the layer rather than a bound
    method, so that a wrapped model pickles (``torch.save(model)``) and ``copy.deepcopy`` points
    the copy's forward at the copied layer."""

    __slots__ = ("layer",)

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, *args, **kwargs):
        layer = self.layer
        info: _LayerWrap = getattr(layer, _LAYER_ATTR)
        check_layer_call(info.name, layer, args, kwargs, info.model_grad)
        if not torch.compiler.is_compiling():
            info.ran = True
        # functools.partial rather than the bound method: torch 2.11's dynamo cannot trace
        # function.__get__ (nor types.MethodType) under torch.compile(fullgraph=True).
        original = info.previous_forward or functools.partial(type(layer).forward, layer)
        if not info.reads_hidden_grad and not records_graph((args, kwargs), (layer,)):
            # Evaluation, inference, a frozen layer on inputs that need no gradient (a distillation
            # teacher, the frozen lower layers of a fine-tune): nothing is saved, so a checkpoint
            # would only cost host time (its frame, RNG state stash, buffer copies, the selective
            # policy's dispatch mode): 1.07-1.15x the layer's own forward under torch.no_grad; a
            # frozen nn.TransformerEncoder with gradients on: 1.3x in eval, 2.0x in train mode.
            # Gradients off: a graph the layer records by turning them on is one torch's
            # checkpoint would keep as well (records_graph), so only gradients on are watched.
            grad = torch.is_grad_enabled()
            out = original(*args, **kwargs)
            if grad and not torch.compiler.is_compiling() and may_require_grad(out):
                info.reads_hidden_grad = True
                warnings.warn(
                    f"memopt.wrap: layer {info.name!r} ({type(layer).__name__}) returned a result that requires "
                    "grad, or an object memopt cannot look into (neither a tensor, a plain value nor a registered "
                    "pytree node), although none of its arguments and parameters requires grad: it may read such "
                    "a tensor from elsewhere (a tied weight held as a plain attribute, a closure, a hook). This "
                    "call ran without its checkpoint (exact, but it kept what the layer saves); its later calls "
                    "are checkpointed",
                    stacklevel=2,
                )
            return out
        if kwargs and not _CHECKPOINT_NAMES.isdisjoint(kwargs):
            # Only the colliding ones: the checkpoint must still see the others (it copies a cache
            # passed as past_key_values for the recompute). kwargs is this call's own dict.
            bound = {name: kwargs.pop(name) for name in _CHECKPOINT_NAMES.intersection(kwargs)}
            original = functools.partial(original, **bound)
        return checkpoint(original, *args, policy=info.policy, offload=info.offload, **kwargs)


def wrap(
    model: nn.Module,
    *,
    layers: LayerSelector = None,
    policy: str | Sequence[str] | dict = "selective",
    offload: bool | Offload | Sequence | dict | None = None,
    budget_bytes: int | None = None,
    example_inputs: Any = None,
    plan: "Plan | None" = None,
    loss: str | None = None,
    ffn_chunk_tokens: int | None = None,
) -> nn.Module:
    """Checkpoint every repeated layer of ``model`` with a memopt policy and offload, in place.

    Example::

        model = AutoModelForCausalLM.from_config(config)
        memopt.wrap(model)                       # selective checkpointing of every block
        loss = model(input_ids, labels=input_ids, use_cache=False).loss

    Args:
        model: any ``nn.Module``; it is modified in place and returned.
        layers: which submodules are layers (see :func:`find_layers`).
        policy: one of ``"selective"``, ``"full"``, ``"none"`` (:mod:`memopt.policy`), or a
            PyTorch selective-checkpoint policy function (see :func:`memopt.checkpoint`), for every
            layer; or a list with one per layer; or a dict from layer index or name to policy
            (layers not in the dict get ``"none"``).
        offload: whether what each layer's policy saves goes to host memory: False (the
            default), True (the active ``memopt.Offload``, else the process default) or a
            ``memopt.Offload``, for every layer; or a list or dict like ``policy`` (layers not in
            the dict get False). With ``plan`` or ``budget_bytes`` the plan says which layers
            offload and ``offload`` is their engine: a ``memopt.Offload``, or True/None for the
            default one (False: the plan may not offload).
        budget_bytes: choose per-layer ``(policy, offload)`` with :func:`memopt.plan` so that the
            activations saved for backward fit in this many bytes, measured with the ``loss``
            chosen; needs ``example_inputs``.
        example_inputs: a tuple of positional arguments (or a mapping of keyword arguments: a
            dict, a tokenizer's ``BatchEncoding``) for ``model`` that :func:`memopt.plan` measures with.
        plan: a :class:`memopt.Plan` (from :func:`memopt.plan`, possibly edited) to apply.
        loss: a Hugging Face causal LM's loss with ``labels=``: ``"chunked"`` computes it with
            :func:`memopt.linear_cross_entropy`, without the logits (the output's ``logits`` is
            None; see :mod:`memopt.causal_lm_loss`), ``"plain"`` keeps Hugging Face's; None (the
            default) is ``"chunked"`` where the model takes it, ``"plain"`` otherwise. With
            ``plan``, None is the plan's loss (:attr:`memopt.Plan.loss`, the one its bytes were
            measured with), and the other loss raises ``ValueError``.
        ffn_chunk_tokens: None, or a positive int: every layer's MLP (:func:`memopt.tiled_ffn.find_ffn`:
            the ``mlp`` / ``feed_forward`` / ``ffn`` submodule of a Hugging Face layer; a swapped
            ``nn.TransformerEncoderLayer``'s fused block; another encoder layer's ``_ff_block``)
            runs this many tokens at a time, so its ``(tokens, d_ff)`` intermediates exist for one
            chunk at a time (:mod:`memopt.tiled_ffn`). A layer without one raises ``ValueError``.
            The token-wise norms around it run the same way: each layer's RMSNorm/LayerNorm
            modules outside the MLP (:func:`memopt.tiled_ffn.find_norms`: Llama's
            ``input_layernorm`` and ``post_attention_layernorm``, GPT-2's ``ln_1``/``ln_2``) and
            the final norm beside the layers (:func:`memopt.tiled_ffn.find_stack_norms`: Llama's
            ``model.norm``, GPT-2's ``ln_f``), so that a norm saves only its input, in the
            model's dtype, and not the float32 copy Hugging Face's RMSNorm makes of it.

    An ``nn.TransformerEncoderLayer`` that does not offload is replaced by a
    ``memopt.torch_interop.FusedTransformerEncoderLayer``: the torch layer's call run by a
    ``memopt.FusedCheckpointBlock`` with its policy, sharing its parameters, when the block
    reproduces it exactly (``memopt.torch_interop.supports``: relu/gelu, a head_dim the attention
    kernels take, every dropout 0, no hooks); other layers, and offloading ones, run the layer's
    own forward through :func:`memopt.checkpoint`, and ``("none", False)`` leaves them as they are.

    Wrapping twice, or wrapping a model with a wrapped module inside, raises ``RuntimeError``:
    call :func:`unwrap` first. While wrapped, a Hugging Face model called with gradients on
    and without ``use_cache`` runs with ``use_cache=False`` (a cache built while training holds
    every layer's keys and values until the backward), as under Hugging Face's own gradient
    checkpointing, on every module whose config has ``use_cache`` True and whose forward takes it
    (an encoder-decoder's decoder stack has its own config); the configs are not changed, so
    ``save_pretrained`` writes them as they were, and calls without gradients (``generate``,
    evaluation) use the cache as the config says. A ``transformers.Cache`` a layer gets anyway
    (``use_cache=True``, or XLM's, built on every call) is exact: each recompute sees a copy of
    it as the forward did (:func:`memopt.checkpoint`, note [a key/value cache argument]).

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.wrap: model must be an nn.Module, got {type(model).__name__}")
    if is_wrapped(model):
        raise RuntimeError("memopt.wrap: model is already wrapped; call memopt.unwrap(model) first")
    inner = wrapped_inside(model)
    if inner is not None:
        # Its layers' forwards are already wrap's: wrapping them again would have each call the
        # other, without end.
        raise RuntimeError(
            f"memopt.wrap: model is already wrapped inside: {inner}; call memopt.unwrap on that module first"
        )
    # transformers 5.x names it is_activation_checkpointing (the 4.x name warns there).
    hf_checkpointing = getattr(model, "is_activation_checkpointing", None)
    if hf_checkpointing is None:
        hf_checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if hf_checkpointing:
        raise RuntimeError(
            "memopt.wrap: the model has Hugging Face gradient checkpointing on; layers would be "
            "checkpointed twice. Call model.gradient_checkpointing_disable() first"
        )
    if budget_bytes is not None and plan is not None:
        raise ValueError("memopt.wrap: pass either budget_bytes or plan, not both")
    if plan is not None:
        loss = _plan_loss(plan, loss)
    chunked_loss_lm = causal_lm_loss.chosen_loss(model, loss)
    tiled_ffn.check_ffn_chunk_tokens(ffn_chunk_tokens, "memopt.wrap")
    if budget_bytes is not None or plan is not None:
        policies, offloads = _planned(model, layers, offload, budget_bytes, example_inputs, plan, loss)
        found = find_layers(model, layers)
    else:
        found = find_layers(model, layers)
        names = [name for name, _ in found]
        policies = _per_layer(
            names, policy, "policy", "a string or a policy function", lambda v: isinstance(v, str) or callable(v),
            functools.partial(check_policy, functions=True), "none",
        )  # fmt: skip
        offloads = _per_layer(
            names, False if offload is None else offload, "offload", "a bool, a memopt.Offload",
            lambda v: isinstance(v, (bool, Offload)), check_offload, False,
        )  # fmt: skip

    if ffn_chunk_tokens is not None:
        for name, layer in found:  # every layer's MLP found before any layer changes
            tiled_ffn.find_ffn(layer, name)
    state = _WrapState()
    for (name, layer), layer_policy, layer_offload in zip(found, policies, offloads):
        state.policies[name] = layer_policy
        # A fused block is swapped in under "none" too, so every policy runs the same kernels;
        # it then saves the block's "none" set (memopt.block.saved_bytes_per_layer), which is
        # not always less than what the torch layer saves.
        # A policy function is PyTorch's selective checkpointing of the layer's own ops: no fused block.
        replacement = None if layer_offload or callable(layer_policy) else swap_for_fused_block(layer, layer_policy)
        if replacement is not None:
            replacement.block.ffn_chunk_tokens = ffn_chunk_tokens
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, replacement)
            state.swapped.append((parent, attr, layer))
            continue
        if ffn_chunk_tokens is not None:
            state.tiled_ffns += tiled_ffn.install(layer, ffn_chunk_tokens, name)
        if layer_policy == "none" and not layer_offload:
            continue
        layer_wrap = _LayerWrap(name, layer_policy, layer.__dict__.get("forward"), layer_offload)
        object.__setattr__(layer, _LAYER_ATTR, layer_wrap)
        layer.forward = _CheckpointedForward(layer)
        state.wrapped.append(layer)

    if ffn_chunk_tokens is not None:
        final_norms = tiled_ffn.find_stack_norms(model, [name for name, _ in found])
        state.tiled_ffns += tiled_ffn.install_norms(final_norms, ffn_chunk_tokens)
    state.use_cache = _default_use_cache_off(model)
    if chunked_loss_lm is not None:
        state.loss_forward = causal_lm_loss.install(chunked_loss_lm)
    if state.wrapped:
        state.run_check = [
            model.register_forward_pre_hook(_RunCheck(model, state, pre=True)),
            model.register_forward_hook(_RunCheck(model, state, pre=False)),
        ]
    object.__setattr__(model, _STATE_ATTR, state)
    if has_checkpointing_method(model):
        # A Trainer with gradient_checkpointing=True would checkpoint the layers a second time: the
        # switch refuses that (and lets gradient_checkpointing_kwargs={"memopt": ...} select memopt).
        from memopt.integrations.transformers import take_over_checkpointing

        take_over_checkpointing(model)
    return model


class _CacheOff:
    """Forward pre-hook (with kwargs) on a Hugging Face module whose forward takes ``use_cache``:
    a call with gradients on that does not pass it gets ``use_cache=False``. Per call rather than
    on the config, which ``save_pretrained`` writes and the unwrapped model would keep. An
    object, not a closure, so that a wrapped model pickles and deep-copies."""

    __slots__ = ("position",)

    def __init__(self, position: int):
        # use_cache's index among the forward's positional parameters (self excluded); a call
        # with that many positional arguments passed it
        self.position = position

    def __call__(self, module, args, kwargs):
        if torch.is_grad_enabled() and len(args) <= self.position and kwargs.get("use_cache") is None:
            return args, {**kwargs, "use_cache": False}
        return None


def _use_cache_position(module: nn.Module) -> int | None:
    """The index of ``use_cache`` among ``module.forward``'s positional parameters (a large number
    for a keyword-only one), or None when the forward takes no such parameter."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "use_cache" in positional:
        return positional.index("use_cache")
    return sys.maxsize if any(p.name == "use_cache" and p.kind == p.KEYWORD_ONLY for p in parameters) else None


def _default_use_cache_off(model: nn.Module) -> list:
    """Give every module of ``model`` whose Hugging Face config has ``use_cache`` True and whose
    forward takes ``use_cache`` a :class:`_CacheOff` pre-hook; returns their handles."""
    handles = []
    for module in model.modules():
        if getattr(getattr(module, "config", None), "use_cache", False) is not True:
            continue
        position = _use_cache_position(module)
        if position is not None:
            handles.append(module.register_forward_pre_hook(_CacheOff(position), with_kwargs=True))
    return handles


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


@contextlib.contextmanager
def model_wide_settings(model: nn.Module, loss: str | None = None):
    """What ``wrap(model, loss=loss)`` changes besides the layers, for as long as the context
    lasts: ``use_cache=False`` by default on Hugging Face modules called with gradients and the
    chosen LM-head loss (:mod:`memopt.causal_lm_loss`). ``memopt.plan`` measures the model this
    way, as it will run."""
    lm = causal_lm_loss.chosen_loss(model, loss)
    cache_hooks = _default_use_cache_off(model)
    loss_forward = causal_lm_loss.install(lm) if lm is not None else None
    try:
        yield
    finally:
        if loss_forward is not None:
            causal_lm_loss.remove(loss_forward)
        _remove_hooks(cache_hooks)


def _plan_loss(given_plan, loss: str | None) -> str | None:
    """The loss ``wrap(plan=given_plan, loss=loss)`` runs: the plan's (the one its bytes were
    measured with) when ``loss`` is None; ``ValueError`` when ``loss`` names the other one."""
    from memopt.plan import Plan

    if not isinstance(given_plan, Plan):
        raise TypeError(f"memopt.wrap: plan must be a memopt.Plan, got {type(given_plan).__name__}")
    given_plan.check()
    planned = given_plan.loss
    if planned is None or loss is None:
        return loss if planned is None else planned
    if loss in causal_lm_loss.LOSSES and loss != planned:
        raise ValueError(
            f"memopt.wrap: loss={loss!r} contradicts the plan, which was measured with loss={planned!r} "
            f"(its budget_bytes={given_plan.budget_bytes} counts what that loss saves); pass loss={planned!r} or "
            f"leave loss unset, or make a plan for loss={loss!r} with memopt.plan(..., loss={loss!r})"
        )
    return loss


def _planned(model, layers, offload, budget_bytes, example_inputs, given_plan, loss) -> tuple[list[str], list]:
    """The per-layer policies and offloads of ``given_plan``, or of a plan made for ``budget_bytes``."""
    # memopt.plan builds on this module (it wraps the model to capture layer inputs).
    from memopt.plan import Plan, plan as make_plan

    if offload is not None:
        check_offload(offload, "memopt.wrap")
    if budget_bytes is not None:
        if example_inputs is None:
            raise ValueError("memopt.wrap: budget_bytes needs example_inputs to measure the layers with")
        # Measured with the LM-head loss the model will run with (the plain one saves the logits).
        given_plan = make_plan(model, example_inputs, budget_bytes, layers=layers, offload=offload, loss=loss)
    if not isinstance(given_plan, Plan):
        raise TypeError(f"memopt.wrap: plan must be a memopt.Plan, got {type(given_plan).__name__}")
    names = [name for name, _ in find_layers(model, layers)]
    if given_plan.layer_names != names:
        raise ValueError(f"memopt.wrap: plan is for layers {given_plan.layer_names}, but this model's layers are {names}")
    given_plan.check()
    offloading = [name for name, o in zip(names, given_plan.offloads) if o]
    if offloading and offload is False:
        raise ValueError(f"memopt.wrap: the plan offloads layers {offloading}, but offload=False")
    engine = offload if isinstance(offload, Offload) else True
    return given_plan.policies, [engine if o else False for o in given_plan.offloads]


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap`: every layer gets its original forward (and module) back.

    Raises ``ValueError`` when ``model`` is not wrapped. Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.unwrap: model must be an nn.Module, got {type(model).__name__}")
    state: _WrapState | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("memopt.unwrap: model is not wrapped by memopt.wrap")
    for layer in state.wrapped:
        previous = getattr(layer, _LAYER_ATTR).previous_forward
        object.__delattr__(layer, _LAYER_ATTR)
        if previous is None:
            del layer.forward
        else:
            layer.forward = previous
    for parent, attr, original in state.swapped:
        setattr(parent, attr, original)
    _remove_hooks(state.run_check)
    for tiled in state.tiled_ffns:
        tiled_ffn.remove(tiled)
    _remove_hooks(state.use_cache)
    if state.loss_forward is not None:
        causal_lm_loss.remove(state.loss_forward)
    object.__delattr__(model, _STATE_ATTR)
    return model


def is_wrapped(model: nn.Module) -> bool:
    """Whether :func:`wrap` wrapped ``model`` (and :func:`unwrap` has not undone it)."""
    return getattr(model, _STATE_ATTR, None) is not None


def wrapped_inside(model: nn.Module) -> str | None:
    """A description of a submodule of ``model`` that a :func:`wrap` changed (a wrapped module,
    or a layer a wrap of some module checkpoints), or None."""
    for name, module in model.named_modules():
        if module is model:
            continue
        if is_wrapped(module):
            return f"{name!r} ({type(module).__name__}) is wrapped"
        if _LAYER_ATTR in vars(module):
            return f"layer {name!r} ({type(module).__name__}) is checkpointed by a wrap"
    return None


def wrapped_policies(model: nn.Module) -> dict[str, str]:
    """The policy ``wrap`` gave each layer of ``model`` (empty when it is not wrapped)."""
    state: _WrapState | None = getattr(model, _STATE_ATTR, None)
    return {} if state is None else dict(state.policies)
