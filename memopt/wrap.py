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

import copy
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from memopt import causal_lm_loss
from memopt.checkpoint import checkpoint
from memopt.offload import Offload
from memopt.policy import check_offload, check_policy
from memopt.torch_interop import swap_for_fused_block

if TYPE_CHECKING:
    from memopt.plan import Plan

_STATE_ATTR = "_memopt_wrap_state"
_CONTAINERS = (nn.ModuleList, nn.Sequential)
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
    # Hugging Face configs whose use_cache wrap turned off (it was True); an encoder-decoder's
    # decoder stack holds a copy of the model's config, so there can be several
    use_cache: list[Any] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)
    # the chunked-loss forward installed on a Hugging Face causal LM (memopt.causal_lm_loss)
    loss_forward: Any = None


# -- finding layers -------------------------------------------------------------------------


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # A layer nested inside another selected layer is covered by the outer one's checkpoint.
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if not any(name.startswith(outer + ".") for outer, _ in chosen):
            chosen.append((name, module))
    return chosen


def _default_layer_classes(model: nn.Module) -> set[type]:
    """The layer classes ``wrap`` picks by default: the module class repeated most often inside
    an ``nn.ModuleList``/``nn.Sequential`` (outermost instances), and any other class stacked
    alone in such a container that holds at least a tenth of that one's parameters (an
    encoder-decoder's second stack: Whisper's or BART's decoder layers)."""
    in_containers: list[tuple[str, nn.Module]] = []
    pure_stacks: set[type] = set()  # classes that fill a whole container on their own
    for name, module in model.named_modules():
        if isinstance(module, _CONTAINERS):
            prefix = f"{name}." if name else ""
            children = list(module.named_children())
            in_containers += [(prefix + child_name, child) for child_name, child in children]
            if len(children) >= 2 and len({type(child) for _, child in children}) == 1:
                pure_stacks.add(type(children[0][1]))
    counts = Counter(type(module) for _, module in in_containers)
    candidates = {cls for cls, count in counts.items() if count >= 2}
    if not candidates:
        raise ValueError(
            "memopt.wrap: found no module class repeated inside an nn.ModuleList or nn.Sequential; "
            "pass layers= (a class, a tuple of classes or a predicate)"
        )
    # Keep classes that occur outside every other candidate (the blocks, not the experts or
    # sub-layers inside them), then take the most repeated of those.
    outer = _outermost([(name, m) for name, m in in_containers if type(m) in candidates])
    outer_classes = Counter(type(m) for _, m in outer)
    top = max(outer_classes, key=lambda cls: (outer_classes[cls], -list(outer_classes).index(cls)))
    params = Counter()
    for _, m in outer:
        params[type(m)] += sum(p.numel() for p in m.parameters())
    return {top} | {
        cls for cls in outer_classes if cls in pure_stacks and params[cls] * 10 >= params[top]
    }


def find_layers(model: nn.Module, layers: LayerSelector = None) -> list[tuple[str, nn.Module]]:
    """The repeated layers of ``model`` as ``(qualified name, module)`` in forward order.

    Args:
        model: the model.
        layers: ``None`` picks the module class repeated most often inside an
            ``nn.ModuleList``/``nn.Sequential``, outermost instances only (``TransformerEncoderLayer``,
            ``LlamaDecoderLayer``, ``GPT2Block``, ``BertLayer``), plus any other class that fills
            such a container alone with at least a tenth of its parameters (an encoder-decoder's
            other stack: ``WhisperDecoderLayer`` beside ``WhisperEncoderLayer``); a class or
            tuple of classes selects
            instances of those; a callable ``layers(module) -> bool`` selects where it returns True.
            Selected modules nested in another selected module are left out.
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
    found = _outermost((name, m) for name, m in model.named_modules() if m is not model and predicate(m))
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

    def __deepcopy__(self, memo):
        # A deep copy of the model shares the offload engine (one host pool per process); the
        # copied forward is rebound by deepcopy itself.
        return _LayerWrap(self.name, self.policy, copy.deepcopy(self.previous_forward, memo), self.offload)


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
        if torch.is_grad_enabled() and any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            raise ValueError(
                f"memopt.wrap: layer {info.name!r} got a key/value cache while computing gradients; the "
                "recompute would append to the cache twice. Train with use_cache=False"
            )
        # functools.partial rather than the bound method: torch 2.11's dynamo cannot trace
        # function.__get__ (nor types.MethodType) under torch.compile(fullgraph=True).
        original = info.previous_forward or functools.partial(type(layer).forward, layer)
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
            activations saved for backward fit in this many bytes; needs ``example_inputs``.
        example_inputs: a tuple of positional arguments (or a dict of keyword arguments) for
            ``model`` that :func:`memopt.plan` measures with.
        plan: a :class:`memopt.Plan` (from :func:`memopt.plan`, possibly edited) to apply.
        loss: a Hugging Face causal LM's loss with ``labels=``: ``"chunked"`` computes it with
            :func:`memopt.linear_cross_entropy`, without the logits (the output's ``logits`` is
            None; see :mod:`memopt.causal_lm_loss`), ``"plain"`` keeps Hugging Face's; None (the
            default) is ``"chunked"`` where the model takes it, ``"plain"`` otherwise.

    An ``nn.TransformerEncoderLayer`` that does not offload is replaced by a
    ``memopt.torch_interop.FusedTransformerEncoderLayer``: the torch layer's call run by a
    ``memopt.FusedCheckpointBlock`` with its policy, sharing its parameters, when the block
    reproduces it exactly (``memopt.torch_interop.supports``: relu/gelu, a head_dim the attention
    kernels take, every dropout 0, no hooks); other layers, and offloading ones, run the layer's
    own forward through :func:`memopt.checkpoint`, and ``("none", False)`` leaves them as they are.

    Wrapping twice raises ``RuntimeError``: call :func:`unwrap` first. Hugging Face models get
    ``config.use_cache = False`` while wrapped (a key/value cache cannot be recomputed), as their
    own gradient checkpointing does, on every config in the model (an encoder-decoder's decoder
    stack has its own copy); ``unwrap`` restores them.

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.wrap: model must be an nn.Module, got {type(model).__name__}")
    if is_wrapped(model):
        raise RuntimeError("memopt.wrap: model is already wrapped; call memopt.unwrap(model) first")
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
    chunked_loss_lm = causal_lm_loss.chosen_loss(model, loss)
    if budget_bytes is not None or plan is not None:
        policies, offloads = _planned(model, layers, offload, budget_bytes, example_inputs, plan)
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

    state = _WrapState()
    for (name, layer), layer_policy, layer_offload in zip(found, policies, offloads):
        state.policies[name] = layer_policy
        # A fused block is swapped in under "none" too, so every policy runs the same kernels;
        # it then saves the block's "none" set (memopt.block.saved_bytes_per_layer), which is
        # not always less than what the torch layer saves.
        # A policy function is PyTorch's selective checkpointing of the layer's own ops: no fused block.
        replacement = None if layer_offload or callable(layer_policy) else swap_for_fused_block(layer, layer_policy)
        if replacement is not None:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, replacement)
            state.swapped.append((parent, attr, layer))
            continue
        if layer_policy == "none" and not layer_offload:
            continue
        layer_wrap = _LayerWrap(name, layer_policy, layer.__dict__.get("forward"), layer_offload)
        object.__setattr__(layer, _LAYER_ATTR, layer_wrap)
        layer.forward = _CheckpointedForward(layer)
        state.wrapped.append(layer)

    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        if getattr(config, "use_cache", False) is True:
            state.use_cache.append(config)
            config.use_cache = False
    if chunked_loss_lm is not None:
        state.loss_forward = causal_lm_loss.install(chunked_loss_lm)
    object.__setattr__(model, _STATE_ATTR, state)
    if any(hasattr(type(model), n) for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable")):
        # A Trainer with gradient_checkpointing=True would checkpoint the layers a second time: the
        # switch refuses that (and lets gradient_checkpointing_kwargs={"memopt": ...} select memopt).
        from memopt.integrations.transformers import take_over_checkpointing

        take_over_checkpointing(model)
    return model


def _planned(model, layers, offload, budget_bytes, example_inputs, given_plan) -> tuple[list[str], list]:
    """The per-layer policies and offloads of ``given_plan``, or of a plan made for ``budget_bytes``."""
    # memopt.plan builds on this module (it wraps the model to capture layer inputs).
    from memopt.plan import Plan, plan as make_plan

    if offload is not None:
        check_offload(offload, "memopt.wrap")
    if budget_bytes is not None:
        if example_inputs is None:
            raise ValueError("memopt.wrap: budget_bytes needs example_inputs to measure the layers with")
        given_plan = make_plan(model, example_inputs, budget_bytes, layers=layers, offload=offload)
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
    for config in state.use_cache:
        config.use_cache = True
    if state.loss_forward is not None:
        causal_lm_loss.remove(state.loss_forward)
    object.__delattr__(model, _STATE_ATTR)
    return model


def is_wrapped(model: nn.Module) -> bool:
    """Whether :func:`wrap` wrapped ``model`` (and :func:`unwrap` has not undone it)."""
    return getattr(model, _STATE_ATTR, None) is not None


def wrapped_policies(model: nn.Module) -> dict[str, str]:
    """The policy ``wrap`` gave each layer of ``model`` (empty when it is not wrapped)."""
    state: _WrapState | None = getattr(model, _STATE_ATTR, None)
    return {} if state is None else dict(state.policies)
