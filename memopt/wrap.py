"""memopt.wrap: apply a checkpoint policy to every repeated layer of an existing model.

``wrap`` finds the model's repeated layers (the transformer blocks), replaces each one's
``forward`` by an instance attribute that runs the original forward through
:func:`memopt.checkpoint` with that layer's policy, and records what it did so that
:func:`unwrap` puts every original forward back. Parameters, buffers, module names and the
state_dict are untouched, so the model can be wrapped before or after ``fully_shard`` or
``DistributedDataParallel`` and saved or loaded as usual.

``plan`` measures each layer under each policy on an example input and chooses per-layer
policies that fit a memory budget at the least recompute time; the resulting :class:`Plan` can be
read, edited and passed to ``wrap(model, plan=plan)``.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from memopt.checkpoint import POLICIES, checkpoint, offload_available
from memopt.saved import SavedTensorCounter, _storage_key

WRAP_POLICIES = POLICIES + ("offload",)
"""Per-layer policies ``wrap`` accepts: ``"offload"`` saves what ``"none"`` saves, on the host."""

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


def _per_layer_policies(names: Sequence[str], policy) -> list[str]:
    if isinstance(policy, str):
        chosen = [policy] * len(names)
    elif isinstance(policy, dict):
        unknown = [k for k in policy if not (isinstance(k, int) and 0 <= k < len(names)) and k not in names]
        if unknown:
            raise ValueError(
                f"memopt.wrap: policy keys must be layer indices in [0, {len(names)}) or layer names "
                f"{list(names)}, got {unknown}"
            )
        chosen = [policy.get(i, policy.get(name, "none")) for i, name in enumerate(names)]
    elif isinstance(policy, (list, tuple)):
        if len(policy) != len(names):
            raise ValueError(f"memopt.wrap: policy has {len(policy)} entries for {len(names)} layers {list(names)}")
        chosen = list(policy)
    else:
        raise TypeError(f"memopt.wrap: policy must be a string, a list or a dict, got {type(policy).__name__}")
    for name, p in zip(names, chosen):
        if p not in WRAP_POLICIES:
            raise ValueError(f"memopt.wrap: policy for layer {name!r} must be one of {WRAP_POLICIES}, got {p!r}")
        if p == "offload" and not offload_available():
            raise NotImplementedError(
                f"memopt.wrap: policy 'offload' for layer {name!r} needs memopt.offload, which this installation lacks"
            )
    return chosen


# -- the fused-block extension point --------------------------------------------------------


def _swap_for_fused_block(layer: nn.Module, policy: str) -> nn.Module | None:
    """An equivalent ``memopt.FusedCheckpointBlock`` for ``layer``, or None to checkpoint it as is.

    Used for ``nn.TransformerEncoderLayer`` when memopt has ``FusedCheckpointBlock`` and the
    block reproduces the layer exactly (``FusedCheckpointBlock.supports(layer, allow_autocast=True)``:
    relu/gelu, head_dim the attention kernels take, all dropout 0, ...). The block shares the
    layer's ``nn.Parameter`` objects, so training it trains the layer and ``unwrap`` can put the
    layer back. A float32 layer on CUDA is swapped too: its block runs under ``torch.autocast``
    and hands calls outside autocast to the layer itself, checkpointed with the same policy.
    """
    import memopt

    block_class = getattr(memopt, "FusedCheckpointBlock", None)
    if block_class is None or policy not in POLICIES or not isinstance(layer, nn.TransformerEncoderLayer):
        return None
    supports = getattr(block_class, "supports", None)
    if supports is None or not supports(layer, allow_autocast=True):
        return None
    block = block_class.from_torch(layer, policy=policy, share_parameters=True)
    _keep_state_dict_names(block, layer)
    if not supports(layer):
        # A float32 layer on CUDA: the block runs under autocast, the layer itself otherwise.
        from memopt.block import attach_torch_fallback

        attach_torch_fallback(block, layer)
    return block


class _LayerStateDictNames:
    """A state-dict hook that gives a swapped-in block its torch layer's parameter names: when
    saving (``loading=False``) or loading. A callable object, not a closure, so that a wrapped
    model pickles."""

    def __init__(self, block: nn.Module, layer: nn.Module, loading: bool):
        from memopt.block import shared_parameter_names

        self.to_layer = shared_parameter_names(block, layer)
        self.layer_order = [name for name, _ in layer.named_parameters()]
        self.loading = loading

    def __call__(self, module, state_dict, prefix, *args) -> None:
        if self.loading:
            for name, layer_name in self.to_layer.items():
                if prefix + layer_name in state_dict:
                    state_dict[prefix + name] = state_dict.pop(prefix + layer_name)
            return
        # The block's entries are the last ones (a module's hook runs after its subtree):
        # re-added under the layer's names, in the layer's order.
        values = {
            self.to_layer[name]: state_dict.pop(prefix + name) for name in self.to_layer if prefix + name in state_dict
        }
        for name in self.layer_order:
            if name in values:
                state_dict[prefix + name] = values[name]


def _keep_state_dict_names(block: nn.Module, layer: nn.Module) -> None:
    """Give a swapped-in ``block`` ``layer``'s state_dict names (both ways: saving and loading),
    so that a checkpoint saved while wrapped loads into the unwrapped model and back."""
    block.register_state_dict_post_hook(_LayerStateDictNames(block, layer, loading=False))
    block.register_load_state_dict_pre_hook(_LayerStateDictNames(block, layer, loading=True))


# -- wrap / unwrap --------------------------------------------------------------------------


_LAYER_ATTR = "_memopt_wrap_layer"


@dataclass
class _LayerWrap:
    name: str
    policy: str
    # The instance-level forward the layer had before wrap, or None for its class's forward.
    previous_forward: Callable | None
    # For "offload": True (memopt.checkpoint's shared engine) or the memopt.Offload to use.
    offload: Any = True

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
        policy, offload = ("none", info.offload) if info.policy == "offload" else (info.policy, False)
        return checkpoint(original, *args, policy=policy, offload=offload, **kwargs)


def wrap(
    model: nn.Module,
    *,
    layers: LayerSelector = None,
    policy: str | Sequence[str] | dict = "selective",
    budget_bytes: int | None = None,
    example_inputs: Any = None,
    plan: "Plan | None" = None,
    offload: Any = None,
) -> nn.Module:
    """Checkpoint every repeated layer of ``model`` with a memopt policy, in place.

    Example::

        model = AutoModelForCausalLM.from_config(config)
        memopt.wrap(model)                       # selective checkpointing of every block
        loss = model(input_ids, labels=input_ids, use_cache=False).loss

    Args:
        model: any ``nn.Module``; it is modified in place and returned.
        layers: which submodules are layers (see :func:`find_layers`).
        policy: one of ``"selective"``, ``"full"``, ``"none"``, ``"offload"`` for every layer; or
            a list with one per layer; or a dict from layer index or name to policy (layers not
            in the dict get ``"none"``).
        budget_bytes: choose per-layer policies with :func:`plan` so that the activations saved
            for backward fit in this many bytes; needs ``example_inputs``.
        example_inputs: a tuple of positional arguments (or a dict of keyword arguments) for
            ``model`` that :func:`plan` measures with.
        plan: a :class:`Plan` (from :func:`plan`, possibly edited) to apply.
        offload: the ``memopt.Offload`` that ``"offload"`` layers send their saved tensors
            through (and that :func:`plan` measures with when ``budget_bytes`` is given); None
            uses the one ``memopt.checkpoint(..., offload=True)`` shares between all calls.

    An ``nn.TransformerEncoderLayer`` under ``"none"``, ``"selective"`` or ``"full"`` is
    replaced by a ``memopt.FusedCheckpointBlock`` with that policy, sharing its parameters, when
    the block reproduces it exactly (``FusedCheckpointBlock.supports``: relu/gelu, a head_dim the
    attention kernels take, every dropout 0, no hooks); other layers, and ``"offload"``, run the
    layer's own forward through :func:`memopt.checkpoint`, and ``"none"`` leaves them as they are.

    Wrapping twice raises ``RuntimeError``: call :func:`unwrap` first. Hugging Face models get
    ``config.use_cache = False`` while wrapped (a key/value cache cannot be recomputed), as their
    own gradient checkpointing does, on every config in the model (an encoder-decoder's decoder
    stack has its own copy); ``unwrap`` restores them.

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.wrap: model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, _STATE_ATTR, None) is not None:
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
    if sum(x is not None for x in (budget_bytes, plan)) > 1:
        raise ValueError("memopt.wrap: pass either budget_bytes or plan, not both")
    if budget_bytes is not None:
        if example_inputs is None:
            raise ValueError("memopt.wrap: budget_bytes needs example_inputs to measure the layers with")
        plan = _plan(model, example_inputs, budget_bytes, layers=layers, offload=offload)
    found = find_layers(model, layers)
    names = [name for name, _ in found]
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"memopt.wrap: plan must be a memopt.Plan, got {type(plan).__name__}")
        if plan.layer_names != names:
            raise ValueError(
                f"memopt.wrap: plan is for layers {plan.layer_names}, but this model's layers are {names}"
            )
        plan.check()
        policy = list(plan.policies)
    policies = _per_layer_policies(names, policy)
    if offload is not None:
        _check_offload(offload, "memopt.wrap")

    state = _WrapState()
    for (name, layer), layer_policy in zip(found, policies):
        state.policies[name] = layer_policy
        # A fused block is swapped in under "none" too, so every policy runs the same kernels;
        # it then saves the block's "none" set (memopt.block.saved_bytes_per_layer), which is
        # not always less than what the torch layer saves.
        replacement = _swap_for_fused_block(layer, layer_policy)
        if replacement is not None:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, replacement)
            state.swapped.append((parent, attr, layer))
            continue
        if layer_policy == "none":
            continue
        layer_wrap = _LayerWrap(name, layer_policy, layer.__dict__.get("forward"), True if offload is None else offload)
        object.__setattr__(layer, _LAYER_ATTR, layer_wrap)
        layer.forward = _CheckpointedForward(layer)
        state.wrapped.append(layer)

    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        if getattr(config, "use_cache", False) is True:
            state.use_cache.append(config)
            config.use_cache = False
    object.__setattr__(model, _STATE_ATTR, state)
    return model


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
    object.__delattr__(model, _STATE_ATTR)
    return model


def wrapped_policies(model: nn.Module) -> dict[str, str]:
    """The policy ``wrap`` gave each layer of ``model`` (empty when it is not wrapped)."""
    state: _WrapState | None = getattr(model, _STATE_ATTR, None)
    return {} if state is None else dict(state.policies)


# -- planning -------------------------------------------------------------------------------


@dataclass
class Plan:
    """Per-layer checkpoint policies and what they are predicted to cost.

    Edit ``policies`` freely (``plan.policies[3] = "full"``) and apply with
    ``memopt.wrap(model, plan=plan)``; the predictions follow the edit.

    Attributes:
        layer_names: qualified names of the layers, in forward order.
        policies: the chosen policy per layer.
        layer_bytes: per layer, bytes saved for backward that stay on the layer's device under
            each measured policy (counted like :func:`memopt.saved_bytes`: parameters, buffers
            and inputs that need no gradient left out; under ``"offload"``, what the offload
            engine leaves on the device: tensors under its ``min_bytes`` and storages a small
            view keeps alive).
        layer_seconds: per layer, seconds each policy adds to the layer's forward + backward
            over ``"none"`` (measured, never below 0).
        other_bytes: bytes the rest of the model (embeddings, head, loss) saves.
        shared_bytes: bytes of the layers' inputs that need no gradient and are shared between
            layers (attention masks, rotary tables, position ids). Whether they are saved depends
            on the policies, so the prediction counts them once, always: ``predicted_bytes`` is
            an upper bound that is exact up to ``shared_bytes``.
        budget_bytes: the budget the plan was made for, or None.
        layer_host_bytes: per layer, bytes each policy keeps in host memory (only ``"offload"``
            keeps any).
    """

    layer_names: list[str]
    policies: list[str]
    layer_bytes: list[dict[str, int]]
    layer_seconds: list[dict[str, float]]
    other_bytes: int
    shared_bytes: int = 0
    budget_bytes: int | None = None
    layer_host_bytes: list[dict[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The plan as plain data (JSON-ready): save it, edit it, load it with :meth:`from_dict`."""
        return {
            "layer_names": list(self.layer_names),
            "policies": list(self.policies),
            "layer_bytes": [dict(b) for b in self.layer_bytes],
            "layer_seconds": [dict(s) for s in self.layer_seconds],
            "other_bytes": self.other_bytes,
            "shared_bytes": self.shared_bytes,
            "budget_bytes": self.budget_bytes,
            "layer_host_bytes": [dict(h) for h in self.layer_host_bytes],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """A plan from :meth:`to_dict`'s data (e.g. ``json.load``-ed); validated with :meth:`check`."""
        fields = {"layer_names", "policies", "layer_bytes", "layer_seconds", "other_bytes"}
        missing = fields - set(data)
        if missing:
            raise ValueError(f"memopt.Plan.from_dict: data lacks {sorted(missing)}")
        unknown = set(data) - fields - {"shared_bytes", "budget_bytes", "layer_host_bytes"}
        if unknown:
            raise ValueError(f"memopt.Plan.from_dict: unknown keys {sorted(unknown)}")
        plan = cls(**data)
        plan.layer_names, plan.policies = list(plan.layer_names), list(plan.policies)
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ``ValueError`` unless every layer's policy is one the plan measured."""
        if len(self.policies) != len(self.layer_names):
            raise ValueError(
                f"memopt.Plan: {len(self.policies)} policies for {len(self.layer_names)} layers {self.layer_names}"
            )
        for name, policy, measured in zip(self.layer_names, self.policies, self.layer_bytes):
            if policy not in measured:
                raise ValueError(
                    f"memopt.Plan: policy {policy!r} of layer {name!r} was not measured; "
                    f"the plan measured {sorted(measured)} (pass policies= to memopt.plan)"
                )

    @property
    def predicted_bytes(self) -> int:
        """Bytes the whole model saves for backward on its device under ``policies``."""
        self.check()
        return self.other_bytes + self.shared_bytes + sum(b[p] for b, p in zip(self.layer_bytes, self.policies))

    @property
    def predicted_host_bytes(self) -> int:
        """Bytes ``"offload"`` layers keep in host memory under ``policies``."""
        self.check()
        return sum(h.get(p, 0) for h, p in zip(self.layer_host_bytes, self.policies))

    @property
    def predicted_extra_seconds(self) -> float:
        """Time ``policies`` add to one training step (forward + backward) over no checkpointing."""
        self.check()
        return sum(s[p] for s, p in zip(self.layer_seconds, self.policies))

    def __str__(self) -> str:
        host = [h.get(p, 0) for h, p in zip(self.layer_host_bytes, self.policies)] or [0] * len(self.policies)
        rows = [f"{'layer':<32} {'policy':<10} {'saved MiB':>10} {'host MiB':>9} {'extra ms':>9}"]
        for name, p, b, h, s in zip(self.layer_names, self.policies, self.layer_bytes, host, self.layer_seconds):
            rows.append(f"{name:<32} {p:<10} {b[p] / 2**20:>10.2f} {h / 2**20:>9.2f} {s[p] * 1e3:>9.2f}")
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / 2**20:.2f} MiB"
        rows.append(
            f"predicted {self.predicted_bytes / 2**20:.2f} MiB saved on the device (other "
            f"{self.other_bytes / 2**20:.2f} MiB, shared inputs {self.shared_bytes / 2**20:.2f} MiB), "
            f"{self.predicted_host_bytes / 2**20:.2f} MiB on the host, "
            f"+{self.predicted_extra_seconds * 1e3:.2f} ms per step, budget {budget}"
        )
        return "\n".join(rows)


class _PlacementCounter(SavedTensorCounter):
    """Counts saved storages split by where ``off`` would keep them: device or host."""

    def __init__(self, exclude: list[torch.Tensor], off):
        super().__init__(exclude=exclude)
        self._off = off
        self._host_storages: dict[tuple[int, str], int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._excluded:
            self.num_tensors += 1
            placement = self._host_storages if self._off._should_offload(t) else self._storages
            placement[key] = t.untyped_storage().nbytes()
        return t

    @property
    def host_bytes(self) -> int:
        # A storage one saved view keeps on the device stays there whatever happens to the others.
        return sum(n for key, n in self._host_storages.items() if key not in self._storages)


# Marks a captured input that was an activation (not a leaf) in the model.
_ACTIVATION_MARK = "_memopt_plan_activation"


def _fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Copies of captured layer inputs, detached from the model's graph, keeping which ones
    require grad. An input that was an activation in the model comes back as a non-leaf (a clone
    of a fresh leaf), as the offload engine tells the two apart: it sends activations to the host
    and leaves leaves that require grad (parameters, a model input) on the device."""
    from memopt.offload import _is_parameter_like

    no_grad_inputs: list[torch.Tensor] = []

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        leaf = x.detach().requires_grad_(x.requires_grad)
        if not leaf.requires_grad:
            no_grad_inputs.append(leaf)
            return leaf
        if getattr(x, _ACTIVATION_MARK, False) or not _is_parameter_like(x):
            leaf = leaf.clone()
            setattr(leaf, _ACTIVATION_MARK, True)
        return leaf

    new_args = torch.utils._pytree.tree_map(fresh, args)
    new_kwargs = torch.utils._pytree.tree_map(fresh, kwargs)
    return new_args, new_kwargs, no_grad_inputs


def _shared_inputs(captured: Iterable[tuple[tuple, dict]], param_like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensor inputs of the layers that need no gradient (masks, rotary tables, position ids)."""
    excluded = {_storage_key(t) for t in param_like}
    return [
        t
        for args, kwargs in captured
        for t in torch.utils._pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and not t.requires_grad and _storage_key(t) not in excluded
    ]


def _call(model: nn.Module, example_inputs: Any):
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


def _layer_signature(layer: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Layers with equal signatures (class, parameter shapes, input shapes) take equal time."""

    def describe(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return ("object", type(x).__qualname__, id(x))

    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    return (type(layer), layer.training, params, str(spec), tuple(describe(leaf) for leaf in leaves))


def _step_seconds(
    fn: Callable, args: tuple, kwargs: dict, params: list[torch.Tensor], synchronize: Callable[[], None], repeats: int
) -> float:
    """Fastest of ``repeats`` forward + backward passes of ``fn`` (after one warm-up), gradients
    taken with ``torch.autograd.grad`` so that no parameter's ``.grad`` changes."""

    def once() -> float:
        fresh_args, fresh_kwargs, _ = _fresh_inputs(args, kwargs)
        wrt = params + [
            t
            for t in torch.utils._pytree.tree_leaves((fresh_args, fresh_kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        synchronize()
        start = time.perf_counter()
        out = fn(*fresh_args, **fresh_kwargs)
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and wrt:
            grad_outputs = [torch.ones_like(t) for t in outputs]
            torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
        synchronize()
        return time.perf_counter() - start

    once()
    # The fastest run: one slow run (a busy host, a lazy init) should not decide the plan.
    return min(once() for _ in range(repeats))


_FRONTIER_LIMIT = 4096
# Between plans of equal time, the one with weaker policies wins (a measured cost of 0 is noise
# as often as it is free), then the one with the stronger policies on earlier layers (their
# activations are freed last in backward).
_POLICY_STRENGTH = {"none": 0, "offload": 1, "selective": 2, "full": 3}


def _choose(layer_bytes: list[dict[str, int]], layer_seconds: list[dict[str, float]], budget: int) -> list[str]:
    """The per-layer policies with the least total seconds whose bytes fit ``budget``.

    A multiple-choice knapsack solved by dynamic programming over the layers, keeping the Pareto
    frontier of partial plans in (bytes, cost), where cost is (seconds, summed policy strength):
    exact while the frontier holds at most ``_FRONTIER_LIMIT`` plans; past that, plans are
    bucketed by bytes (the cheapest per bucket kept), which can cost at most one bucket's width
    of bytes of optimality. When nothing fits, returns the plan with the fewest bytes.
    """
    # A partial plan: (bytes, (seconds, strength), choices).
    frontier: list[tuple[int, tuple[float, int], tuple[str, ...]]] = [(0, (0.0, 0), ())]
    for b, s in zip(layer_bytes, layer_seconds):
        extended = [
            (total + b[o], (cost[0] + s[o], cost[1] + _POLICY_STRENGTH.get(o, 0)), choice + (o,))
            for total, cost, choice in frontier
            for o in b
        ]
        within = [plan for plan in extended if plan[0] <= budget]
        if not within:
            # Nothing fits: keep only the least-bytes plan, so the caller can report by how much.
            frontier = [min(extended, key=lambda plan: (plan[0], plan[1]))]
            continue
        within.sort(key=lambda plan: (plan[0], plan[1], _earlier_stronger(plan[2])))
        pareto = []
        for plan in within:
            if not pareto or plan[1] < pareto[-1][1]:
                pareto.append(plan)
        if len(pareto) > _FRONTIER_LIMIT:
            width = (pareto[-1][0] - pareto[0][0]) / _FRONTIER_LIMIT + 1
            buckets: dict[int, tuple[int, tuple[float, int], tuple[str, ...]]] = {}
            for plan in pareto:
                key = int((plan[0] - pareto[0][0]) // width)
                if key not in buckets or plan[1] < buckets[key][1]:
                    buckets[key] = plan
            pareto = sorted(buckets.values())
        frontier = pareto
    fitting = [plan for plan in frontier if plan[0] <= budget]
    if not fitting:
        return list(min(frontier)[2])
    return list(min(fitting, key=lambda plan: (plan[1], _earlier_stronger(plan[2])))[2])


def _earlier_stronger(choice: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(-_POLICY_STRENGTH.get(o, 0) for o in choice)


def _check_offload(offload: Any, caller: str) -> None:
    from memopt.checkpoint import _offload_module

    offload_class = _offload_module().Offload
    if not isinstance(offload, offload_class):
        raise TypeError(f"{caller}: offload must be a memopt.Offload (memopt.offload(...)), got {type(offload).__name__}")


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget_bytes: int,
    *,
    layers: LayerSelector = None,
    policies: Sequence[str] | None = None,
    offload: Any = None,
    repeats: int = 3,
) -> Plan:
    """Choose a checkpoint policy per layer so that saved activations fit ``budget_bytes``.

    A profiling pass. One forward of ``model`` on ``example_inputs`` captures each layer's
    inputs (layers run under ``"full"`` meanwhile, so this needs little memory). Each layer is
    then measured on its own, on fresh copies of those inputs:

    * bytes it saves for backward under every policy in ``policies``, counted as
      :func:`memopt.saved_bytes` counts them (for a layer that ``wrap`` swaps for a
      ``FusedCheckpointBlock``, the block's); under ``"offload"`` only what stays on the device;
    * time: its forward + backward under each policy (the fastest of ``repeats`` after a
      warm-up), minus the same under ``"none"``: recompute, checkpoint bookkeeping and, for
      ``"offload"``, the copies to the host and back, measured rather than modelled. Layers
      with the same signature (class, parameter shapes, input shapes and dtypes, and the bytes
      just measured under each policy) are timed once. A layer timed alone cannot overlap its
      offload copies with other layers' compute, so ``"offload"``'s time is an upper bound.

    Bytes saved outside the layers (``other_bytes``) are the whole model's count minus the
    layers'; layer inputs that need no gradient and are shared by the layers (masks, rotary
    tables) are counted once on their own (``shared_bytes``). Policies are chosen by
    :func:`_choose`, a multiple-choice knapsack solved exactly (dynamic programming over a Pareto
    frontier of partial plans) for the least predicted time within the budget. Parameters'
    ``.grad`` and the RNG state are left as they were.

    Args:
        model: the (unwrapped) model, on the device and in the dtype it will train in.
        example_inputs: a tuple of positional arguments, a dict of keyword arguments, or one
            tensor for ``model``; use the batch shape you will train with (bytes scale with it).
        budget_bytes: bytes the whole model may save for backward on its device.
        layers: which submodules are layers (see :func:`find_layers`).
        policies: the policies to choose among, ``"none"`` included. Default: ``"none"``,
            ``"selective"``, ``"full"``, and ``"offload"`` when the model is on a CUDA device
            or ``offload`` is given (offload moves nothing off a CPU otherwise).
        offload: the ``memopt.Offload`` to measure ``"offload"`` with; pass the same one to
            ``wrap(model, plan=plan, offload=...)``. Default: the one
            ``memopt.checkpoint(..., offload=True)`` shares.
        repeats: timed forward + backward passes per layer signature and policy.

    Returns:
        a :class:`Plan`. Raises ``ValueError`` when even the cheapest choice exceeds the budget.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"memopt.plan: budget_bytes must be a non-negative int, got {budget_bytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"memopt.plan: repeats must be a positive int, got {repeats!r}")
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("memopt.plan: model is wrapped; call memopt.unwrap(model) first")
    found = find_layers(model, layers)
    names = [name for name, _ in found]
    param_like = list(model.parameters()) + list(model.buffers())
    device = next(iter(param_like), torch.empty(0)).device
    if offload is not None:
        _check_offload(offload, "memopt.plan")
    if policies is None:
        with_offload = offload_available() and (device.type == "cuda" or offload is not None)
        policies = POLICIES + (("offload",) if with_offload else ())
    unknown = [p for p in policies if p not in WRAP_POLICIES]
    if unknown or "none" not in policies:
        raise ValueError(
            f"memopt.plan: policies must include 'none' and be among {WRAP_POLICIES}, got {list(policies)}"
        )
    policies = tuple(dict.fromkeys(policies))
    if "offload" in policies:
        if not offload_available():
            raise NotImplementedError("memopt.plan: policy 'offload' needs memopt.offload, which this installation lacks")
        from memopt.checkpoint import _offload_context

        off = _offload_context(True if offload is None else offload)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        captured: dict[str, tuple[tuple, dict]] = {}

        def capturer(name):
            def capture(module, args, kwargs):
                captured[name] = _fresh_inputs(args, kwargs)[:2]

            return capture

        handles = [layer.register_forward_pre_hook(capturer(name), with_kwargs=True) for name, layer in found]
        # Layers run under "full" here: the model's own saved bytes are counted with little
        # memory, and each layer's inputs are captured (hooked layers are never swapped for a
        # fused block, so the capture hooks run).
        wrap(model, layers=layers, policy="full")
        try:
            with SavedTensorCounter(exclude=param_like) as counter:
                out = _call(model, example_inputs)
            del out
        finally:
            unwrap(model)
            for handle in handles:
                handle.remove()
        shared = _shared_inputs(captured.values(), param_like)
        shared_keys = {_storage_key(t) for t in shared}
        # The shared layer inputs are accounted separately (Plan.shared_bytes).
        bytes_with_full_layers = sum(n for key, n in counter._storages.items() if key not in shared_keys)

        layer_bytes, layer_host_bytes, layer_seconds, full_layer_bytes = [], [], [], []
        timed: dict[tuple, dict[str, float]] = {}
        for name, layer in found:
            args, kwargs = captured[name]

            def run_under(policy):
                # What wrap will run: the fused block it swaps in (sharing the layer's
                # parameters), else the layer checkpointed; "offload" is the layer's own forward
                # with its saved tensors sent to the host.
                if policy == "offload":
                    return lambda *a, **k: checkpoint(layer, *a, policy="none", offload=off, **k)
                block = _swap_for_fused_block(layer, policy)
                if block is not None:
                    return block
                return lambda *a, **k: checkpoint(layer, *a, policy=policy, **k)

            def count(fn, counter_class=SavedTensorCounter, *extra):
                fresh_args, fresh_kwargs, no_grad_inputs = _fresh_inputs(args, kwargs)
                with counter_class(param_like + no_grad_inputs, *extra) as layer_counter:
                    out = fn(*fresh_args, **fresh_kwargs)
                del out
                return layer_counter

            # The whole-model pass above checkpointed the layer under "full": other_bytes
            # subtracts that measurement.
            full_layer_bytes.append(count(run_under("full")).total_bytes)
            measured = {p: count(run_under(p)).total_bytes for p in policies if p != "offload"}
            host = {p: 0 for p in measured}
            if "offload" in policies:
                # Offload's hooks hide what they take from an enclosing counter: classify the
                # tensors the plain layer saves the way the engine will.
                placement = count(layer, _PlacementCounter, off)
                measured["offload"], host["offload"] = placement.total_bytes, placement.host_bytes
            layer_bytes.append(measured)
            layer_host_bytes.append(host)

            # Layers that save different bytes under some policy behave differently (a
            # layer-specific branch): they are timed on their own.
            signature = (_layer_signature(layer, args, kwargs), tuple(sorted(measured.items())))
            if signature not in timed:
                params = [p for p in layer.parameters() if p.requires_grad]
                seconds = {p: _step_seconds(run_under(p), args, kwargs, params, synchronize, repeats) for p in policies}
                timed[signature] = {p: max(seconds[p] - seconds["none"], 0.0) for p in policies}
            layer_seconds.append(dict(timed[signature]))

        other_bytes = bytes_with_full_layers - sum(full_layer_bytes)

    shared_bytes = sum({_storage_key(t): t.untyped_storage().nbytes() for t in shared}.values())
    chosen = _choose(layer_bytes, layer_seconds, budget_bytes - other_bytes - shared_bytes)
    result = Plan(names, chosen, layer_bytes, layer_seconds, other_bytes, shared_bytes, budget_bytes, layer_host_bytes)
    if result.predicted_bytes > budget_bytes:
        raise ValueError(
            f"memopt.plan: budget_bytes={budget_bytes} is below the least this model can save with "
            f"{list(policies)} per layer ({result.predicted_bytes} bytes)"
        )
    return result


# wrap's ``plan`` argument hides this function inside wrap.
_plan = plan
