"""memopt.plan: choose a (policy, offload) pair per layer so that saved activations fit a budget.

The planner is three steps, each a function with a typed result:

1. :func:`capture_layer_inputs`: one forward of the model, layers under ``"full"`` (little
   memory), records the inputs of each call of each layer and what the rest of the model saves.
2. :func:`measure_layer`: one layer call on fresh copies of its inputs, under each candidate
   :data:`Choice`, into a :class:`LayerCost` (bytes on the device, bytes on the host, seconds);
   a layer's cost is the sum over its calls.
3. :func:`choose`: a multiple-choice knapsack over the layers' costs, then the model counted
   under the choice (the choice is made again when the count exceeds the budget).

:func:`plan` runs them and returns a :class:`Plan`, which can be read, edited, saved as JSON and
applied with ``memopt.wrap(model, plan=plan)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from memopt import causal_lm_loss
from memopt.checkpoint import checkpoint, copy_cache, is_cache
from memopt.offload import Offload, default_offload, is_parameter_like
from memopt.policy import POLICIES, check_offload, check_policy
from memopt.saved import SavedTensorCounter, storage_key
from memopt.torch_interop import swap_for_fused_block
from memopt.wrap import (
    LayerSelector,
    check_layer_call,
    find_layers,
    is_wrapped,
    model_wide_settings,
    unwrap,
    wrap,
    wrapped_inside,
)

Choice = tuple[str, bool]
"""One layer's choice: ``(policy, offload)``, a name from :data:`memopt.policy.POLICIES` and
whether what it saves goes to host memory."""

CHOICE_STRENGTH: dict[Choice, float] = {
    ("none", False): 0, ("none", True): 1, ("selective", False): 2, ("selective", True): 2.5,
    ("full", False): 3, ("full", True): 3.5,
}  # fmt: skip
"""How much each choice changes a layer's step (recompute, copies): the planner's tie-break.
Between plans of equal time it takes the weaker sum (a measured cost of 0 is noise as often as
it is free), then stronger choices on earlier layers (their activations are freed last in
backward). Offloading a selective set moves less than offloading everything, hence the halves."""


PLAN_LOSSES = ("plain", "chunked")
"""The values of :attr:`Plan.loss` besides None (``memopt.wrap``'s ``loss`` choices)."""


def _strength(choice: Choice) -> float:
    return CHOICE_STRENGTH[choice]


def _check_bytes(value: Any, owner: str, name: str, allow_none: bool = False) -> int | None:
    """A byte count: a non-negative int (not a bool, a float or a string)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}: {name} must be a non-negative int of bytes, got {value!r}")
    return value


def _check_seconds(value: Any, owner: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite non-negative number of seconds, got {value!r}")
    return float(value)


def _check_choice(choice: Any, owner: str) -> Choice:
    if not (isinstance(choice, tuple) and len(choice) == 2 and isinstance(choice[1], bool)):
        raise ValueError(f"{owner}: a choice must be a (policy, offload) pair such as ('selective', False), got {choice!r}")
    return check_policy(choice[0], owner), choice[1]


@dataclass
class LayerCost:
    """What one layer costs under each measured choice.

    Attributes:
        device_bytes: bytes saved for backward that stay on the layer's device (counted like
            :func:`memopt.saved_bytes`: parameters, buffers and inputs that need no gradient left
            out; with offload, what the engine leaves on the device: tensors under its
            ``min_bytes`` and storages a small view keeps alive).
        host_bytes: bytes kept in host memory (0 without offload).
        seconds: what the choice adds to the layer's forward + backward over ``("none", False)``
            (measured, never below 0).
    """

    device_bytes: dict[Choice, int]
    host_bytes: dict[Choice, int]
    seconds: dict[Choice, float]

    @property
    def choices(self) -> list[Choice]:
        return list(self.device_bytes)

    def to_rows(self) -> list[dict]:
        return [
            {"policy": p, "offload": o, "device_bytes": self.device_bytes[(p, o)],
             "host_bytes": self.host_bytes[(p, o)], "seconds": self.seconds[(p, o)]}
            for p, o in self.device_bytes
        ]  # fmt: skip

    @classmethod
    def from_rows(cls, rows: Iterable[dict]) -> "LayerCost":
        owner = "memopt.LayerCost.from_rows"
        if not isinstance(rows, (list, tuple)):
            raise ValueError(f"{owner}: rows must be a list of dicts, got {type(rows).__name__}")
        cost = cls({}, {}, {})
        fields = {"policy", "offload", "device_bytes", "host_bytes", "seconds"}
        for row in rows:
            if not isinstance(row, dict) or set(row) != fields:
                raise ValueError(f"{owner}: each row must be a dict with exactly the keys {sorted(fields)}, got {row!r}")
            choice = _check_choice((row["policy"], row["offload"]), owner)
            if choice in cost.device_bytes:
                raise ValueError(f"{owner}: choice {choice!r} appears twice")
            cost.device_bytes[choice] = row["device_bytes"]
            cost.host_bytes[choice] = row["host_bytes"]
            cost.seconds[choice] = row["seconds"]
        cost.check(owner)
        return cost

    def check(self, owner: str = "memopt.LayerCost") -> None:
        """Raise ``ValueError`` unless every choice is valid and every cost a sane number."""
        if not (set(self.device_bytes) == set(self.host_bytes) == set(self.seconds)) or not self.device_bytes:
            raise ValueError(f"{owner}: device_bytes, host_bytes and seconds must cover the same non-empty set of choices")
        for choice in self.device_bytes:
            _check_choice(choice, owner)
            _check_bytes(self.device_bytes[choice], owner, f"device_bytes[{choice!r}]")
            _check_bytes(self.host_bytes[choice], owner, f"host_bytes[{choice!r}]")
            _check_seconds(self.seconds[choice], owner, f"seconds[{choice!r}]")


@dataclass
class Plan:
    """A (policy, offload) choice per layer and what it is predicted to cost.

    Edit ``choices`` freely (``plan.choices[3] = ("full", False)``, or one axis for every layer:
    ``plan.policies = [...]``, ``plan.offloads = [...]``) and apply with
    ``memopt.wrap(model, plan=plan)``; the predictions follow the edit.

    Attributes:
        layer_names: qualified names of the layers, in forward order.
        choices: the chosen ``(policy, offload)`` per layer.
        layer_costs: per layer, a :class:`LayerCost` of every measured choice (summed over the
            layer's calls when the forward runs it several times).
        other_bytes: bytes the rest of the model (embeddings, head, loss) saves.
        shared_bytes: bytes of the layers' inputs that need no gradient and are shared between
            layers (attention masks, rotary tables, position ids). Whether they are saved depends
            on the choices, so the prediction counts them once, always: ``predicted_bytes`` is
            an upper bound that is exact up to ``shared_bytes`` and storages saved both inside
            and outside a layer (counted on both sides). :func:`plan` checks its choice by
            counting the model under it.
        budget_bytes: the budget the plan was made for, or None.
        loss: the LM-head loss the plan was measured with, ``"plain"`` or ``"chunked"`` (as
            ``memopt.wrap``'s ``loss``; what the loss saves is in ``other_bytes``):
            ``wrap(model, plan=plan)`` runs this loss, and refuses a ``loss=`` that contradicts
            it. None: not recorded (a plan saved before plans recorded it); ``wrap`` then runs
            its ``loss=`` as given.
    """

    layer_names: list[str]
    choices: list[Choice]
    layer_costs: list[LayerCost]
    other_bytes: int
    shared_bytes: int = 0
    budget_bytes: int | None = None
    loss: str | None = None

    @property
    def policies(self) -> list[str]:
        """The chosen policy per layer; setting it keeps each layer's offload."""
        return [policy for policy, _ in self.choices]

    @policies.setter
    def policies(self, policies: Sequence[str]) -> None:
        self.choices = [(policy, offload) for policy, (_, offload) in zip(policies, self.choices, strict=True)]

    @property
    def offloads(self) -> list[bool]:
        """Whether each layer offloads what it saves; setting it keeps each layer's policy."""
        return [offload for _, offload in self.choices]

    @offloads.setter
    def offloads(self, offloads: Sequence[bool]) -> None:
        self.choices = [(policy, offload) for (policy, _), offload in zip(self.choices, offloads, strict=True)]

    def to_dict(self) -> dict:
        """The plan as plain data (JSON-ready): save it, edit it, load it with :meth:`from_dict`."""
        return {
            "layer_names": list(self.layer_names),
            "choices": [{"policy": p, "offload": o} for p, o in self.choices],
            "layer_costs": [cost.to_rows() for cost in self.layer_costs],
            "other_bytes": self.other_bytes,
            "shared_bytes": self.shared_bytes,
            "budget_bytes": self.budget_bytes,
            "loss": self.loss,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """A plan from :meth:`to_dict`'s data (e.g. ``json.load``-ed); validated with :meth:`check`.
        ``shared_bytes``, ``budget_bytes`` and ``loss`` may be missing (data saved before them):
        0, None and None."""
        if not isinstance(data, dict):
            raise TypeError(f"memopt.Plan.from_dict: data must be a dict (Plan.to_dict's), got {type(data).__name__}")
        required = {"layer_names", "choices", "layer_costs", "other_bytes"}
        missing = required - set(data)
        if missing:
            raise ValueError(f"memopt.Plan.from_dict: data lacks {sorted(missing)}")
        unknown = set(data) - required - {"shared_bytes", "budget_bytes", "loss"}
        if unknown:
            raise ValueError(f"memopt.Plan.from_dict: unknown keys {sorted(unknown)}")
        owner = "memopt.Plan.from_dict"
        for key in ("layer_names", "choices", "layer_costs"):
            if not isinstance(data[key], (list, tuple)):
                raise ValueError(f"{owner}: {key} must be a list, got {type(data[key]).__name__}")
        for c in data["choices"]:
            if not isinstance(c, dict) or set(c) != {"policy", "offload"}:
                raise ValueError(f"{owner}: each choice must be a dict with the keys 'policy' and 'offload', got {c!r}")
        plan = cls(
            layer_names=list(data["layer_names"]),
            choices=[(c["policy"], c["offload"]) for c in data["choices"]],
            layer_costs=[LayerCost.from_rows(rows) for rows in data["layer_costs"]],
            other_bytes=data["other_bytes"],
            shared_bytes=data.get("shared_bytes", 0),
            budget_bytes=data.get("budget_bytes"),
            loss=data.get("loss"),
        )
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ``ValueError`` unless the plan is well formed (one unique name, choice and cost per
        layer; byte counts non-negative ints) and every layer's choice is one the plan measured."""
        owner = "memopt.Plan"
        names = self.layer_names
        if not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
            raise ValueError(f"{owner}: layer_names must be distinct strings, got {names!r}")
        if not (len(self.choices) == len(names) == len(self.layer_costs)):
            raise ValueError(
                f"{owner}: {len(self.choices)} choices and {len(self.layer_costs)} layer costs for "
                f"{len(names)} layers {names}"
            )
        _check_bytes(self.other_bytes, owner, "other_bytes")
        _check_bytes(self.shared_bytes, owner, "shared_bytes")
        _check_bytes(self.budget_bytes, owner, "budget_bytes", allow_none=True)
        if self.loss is not None and self.loss not in PLAN_LOSSES:
            raise ValueError(f"{owner}: loss must be None or one of {PLAN_LOSSES} (the LM-head loss the plan was "
                             f"measured with), got {self.loss!r}")
        for name, choice, cost in zip(names, self.choices, self.layer_costs):
            _check_choice(choice, f"{owner}: layer {name!r}")
            cost.check(f"{owner}: layer {name!r}")
            if choice not in cost.device_bytes:
                raise ValueError(
                    f"memopt.Plan: choice {choice!r} of layer {name!r} was not measured; "
                    f"the plan measured {sorted(cost.device_bytes)} (pass choices= to memopt.plan)"
                )

    @property
    def predicted_bytes(self) -> int:
        """Bytes the whole model saves for backward on its device under ``choices``."""
        self.check()
        layers = sum(cost.device_bytes[c] for cost, c in zip(self.layer_costs, self.choices))
        return self.other_bytes + self.shared_bytes + layers

    @property
    def predicted_host_bytes(self) -> int:
        """Bytes offloading layers keep in host memory under ``choices``."""
        self.check()
        return sum(cost.host_bytes[c] for cost, c in zip(self.layer_costs, self.choices))

    @property
    def predicted_extra_seconds(self) -> float:
        """Time ``choices`` add to one training step (forward + backward) over no checkpointing."""
        self.check()
        return sum(cost.seconds[c] for cost, c in zip(self.layer_costs, self.choices))

    def __str__(self) -> str:
        rows = [f"{'layer':<32} {'policy':<10} {'offload':<7} {'saved MiB':>10} {'host MiB':>9} {'extra ms':>9}"]
        for name, (p, o), cost in zip(self.layer_names, self.choices, self.layer_costs):
            rows.append(
                f"{name:<32} {p:<10} {str(o):<7} {cost.device_bytes[(p, o)] / 2**20:>10.2f} "
                f"{cost.host_bytes[(p, o)] / 2**20:>9.2f} {cost.seconds[(p, o)] * 1e3:>9.2f}"
            )
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / 2**20:.2f} MiB"
        rows.append(
            f"predicted {self.predicted_bytes / 2**20:.2f} MiB saved on the device (other "
            f"{self.other_bytes / 2**20:.2f} MiB, shared inputs {self.shared_bytes / 2**20:.2f} MiB), "
            f"{self.predicted_host_bytes / 2**20:.2f} MiB on the host, "
            f"+{self.predicted_extra_seconds * 1e3:.2f} ms per step, budget {budget}, "
            f"loss {self.loss or 'not recorded'}"
        )
        return "\n".join(rows)


# -- step 1: capture each layer's inputs ----------------------------------------------------

# Marks a captured input that was an activation (not a leaf) in the model.
_ACTIVATION_MARK = "_memopt_plan_activation"


def _fresh_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Copies of captured layer inputs, detached from the model's graph, keeping which ones
    require grad. An input that was an activation in the model comes back as a non-leaf (a clone
    of a fresh leaf), as the offload engine tells the two apart: it sends activations to the host
    and leaves leaves that require grad (parameters, a model input) on the device."""
    no_grad_inputs: list[torch.Tensor] = []

    def fresh(x):
        if is_cache(x):
            # As the layer was called, for every run (note [a key/value cache argument]).
            return copy_cache(x)
        if not isinstance(x, torch.Tensor):
            return x
        leaf = x.detach().requires_grad_(x.requires_grad)
        if not leaf.requires_grad:
            no_grad_inputs.append(leaf)
            return leaf
        if getattr(x, _ACTIVATION_MARK, False) or not is_parameter_like(x):
            leaf = leaf.clone()
            setattr(leaf, _ACTIVATION_MARK, True)
        return leaf

    return tree_map(fresh, args), tree_map(fresh, kwargs), no_grad_inputs


def _call(model: nn.Module, example_inputs: Any):
    # Mapping, not dict: a tokenizer returns a BatchEncoding, a UserDict.
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


@dataclass
class CapturedInputs:
    """What :func:`capture_layer_inputs` records.

    Attributes:
        inputs: per layer name, one ``(args, kwargs)`` per call of the layer in the forward, as
            the model passed them (fresh copies): a layer module the forward runs several times
            (ALBERT's shared layer, Funnel's repeated blocks) has several.
        shared: the layers' tensor inputs that need no gradient (masks, rotary tables).
        other_bytes: bytes of the storages the model saved outside its layers' calls,
            ``shared`` left out.
    """

    inputs: dict[str, list[tuple[tuple, dict]]]
    shared: list[torch.Tensor]
    other_bytes: int


class _CapturingForward:
    """The forward :func:`capture_layer_inputs` puts on a layer (an instance attribute, so that a
    model calling ``layer.forward(x)`` directly, as SqueezeBERT does, is seen too): records a
    copy of the inputs of every call, then runs the layer under ``"full"`` (little memory)."""

    def __init__(self, name: str, layer: nn.Module, calls: list, depth: list[int]):
        self.name, self.layer, self.calls, self.depth = name, layer, calls, depth
        self.previous = layer.__dict__.get("forward")

    def __call__(self, *args, **kwargs):
        check_layer_call(self.name, self.layer, args, kwargs)
        self.calls.append(_fresh_inputs(args, kwargs)[:2])
        original = self.previous or functools.partial(type(self.layer).forward, self.layer)
        self.depth[0] += 1
        try:
            return checkpoint(original, *args, policy="full", **kwargs)
        finally:
            self.depth[0] -= 1

    def remove(self) -> None:
        if self.previous is None:
            del self.layer.forward
        else:
            self.layer.forward = self.previous


def capture_layer_inputs(
    model: nn.Module, example_inputs: Any, found: list[tuple[str, nn.Module]], param_like: list[torch.Tensor],
    loss: str | None = None,
) -> CapturedInputs:  # fmt: skip
    """One forward of ``model`` with its layers under ``"full"`` (little memory), recording the
    inputs of each call of each layer and the storages the model saves outside the layers.

    Raises ``ValueError`` naming the layers the forward never ran (nothing to measure, and a
    wrap of them would change nothing)."""
    calls: dict[str, list[tuple[tuple, dict]]] = {name: [] for name, _ in found}
    depth = [0]  # how many layer calls the forward is inside
    outside: dict[tuple[int, str], int] = {}

    def note(t, key, nbytes):
        if not depth[0]:
            outside[key] = nbytes

    capturing = [_CapturingForward(name, layer, calls[name], depth) for name, layer in found]
    for capture in capturing:
        capture.layer.forward = capture
    try:
        with model_wide_settings(model, loss), SavedTensorCounter(exclude=param_like, on_save=note):
            out = _call(model, example_inputs)
        del out
    finally:
        for capture in capturing:
            capture.remove()
    idle = [name for name, per_call in calls.items() if not per_call]
    if idle:
        raise ValueError(
            f"memopt.plan: layers {idle} of {type(model).__name__} did not run in its forward on example_inputs; "
            "pass layers= naming the modules the forward calls"
        )
    excluded = {storage_key(t) for t in param_like}
    shared = [
        t
        for per_call in calls.values()
        for args, kwargs in per_call
        for t in tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and not t.requires_grad and storage_key(t) not in excluded
    ]
    shared_keys = {storage_key(t) for t in shared}
    other_bytes = sum(n for key, n in outside.items() if key not in shared_keys)
    return CapturedInputs(calls, shared, other_bytes)


# -- step 2: measure a layer under each choice ----------------------------------------------


def _layer_signature(layer: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Layers with equal signatures (class, parameter shapes, input shapes) take equal time."""

    def describe(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype, str(x.device), x.requires_grad)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return ("object", type(x).__qualname__, id(x))

    leaves, spec = tree_flatten((args, kwargs))
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    return (type(layer), layer.training, params, str(spec), tuple(describe(leaf) for leaf in leaves))


def _step_seconds(
    fn: Callable, args: tuple, kwargs: dict, params: list[torch.Tensor], synchronize: Callable[[], None], repeats: int
) -> float:
    """Fastest of ``repeats`` forward + backward passes of ``fn`` (after one warm-up), gradients
    taken with ``torch.autograd.grad`` so that no parameter's ``.grad`` changes."""

    def once() -> float:
        fresh_args, fresh_kwargs, _ = _fresh_inputs(args, kwargs)
        wrt = params + [t for t in tree_leaves((fresh_args, fresh_kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        synchronize()
        start = time.perf_counter()
        out = fn(*fresh_args, **fresh_kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs and wrt:
            grad_outputs = [torch.ones_like(t) for t in outputs]
            torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
        synchronize()
        return time.perf_counter() - start

    once()
    # The fastest run: one slow run (a busy host, a lazy init) should not decide the plan.
    return min(once() for _ in range(repeats))


def _run_under(layer: nn.Module, choice: Choice, engine: Offload | None) -> Callable:
    """What ``wrap`` will run for ``layer`` under ``choice``: the fused block it swaps in (sharing
    the layer's parameters) when it does not offload, else the layer checkpointed, offloading
    through ``engine``."""
    policy, offload = choice
    if offload:
        return lambda *a, **k: checkpoint(layer, *a, policy=policy, offload=engine, **k)
    block = swap_for_fused_block(layer, policy)
    if block is not None:
        return block
    return lambda *a, **k: checkpoint(layer, *a, policy=policy, **k)


@dataclass
class _Placement:
    """Saved storages split by where an offload engine keeps them (all on the device without one)."""

    device: dict[tuple[int, str], int] = field(default_factory=dict)
    host: dict[tuple[int, str], int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        # A storage one saved view keeps on the device stays there whatever happens to the others.
        return sum(n for key, n in self.host.items() if key not in self.device)


def _placement(fn: Callable, args: tuple, kwargs: dict, param_like: list, engine: Offload | None) -> _Placement:
    """Run ``fn`` on fresh copies of the inputs and place each storage it saves as ``engine``
    would (``Offload.should_offload``); offload's own hooks would hide them from a counter."""
    placement = _Placement()

    def place(t: torch.Tensor, key, nbytes: int) -> None:
        to_host = engine is not None and engine.should_offload(t)
        (placement.host if to_host else placement.device)[key] = nbytes

    fresh_args, fresh_kwargs, no_grad_inputs = _fresh_inputs(args, kwargs)
    with SavedTensorCounter(param_like + no_grad_inputs, on_save=place):
        out = fn(*fresh_args, **fresh_kwargs)
    del out
    return placement


def measure_layer(
    layer: nn.Module, args: tuple, kwargs: dict, choices: Sequence[Choice], engine: Offload | None,
    param_like: list[torch.Tensor], time_layer: Callable[[Callable], float], timed: dict[tuple, dict[Choice, float]],
) -> LayerCost:  # fmt: skip
    """``layer``'s :class:`LayerCost` under each of ``choices`` (``("none", False)`` among them),
    on fresh copies of its captured inputs.

    ``time_layer(fn)`` gives one forward + backward's seconds; the costs are those minus
    ``("none", False)``'s. ``timed`` holds the seconds of layers already timed, by signature:
    a layer equal to one of them (class, parameter and input shapes, bytes under every choice)
    takes its seconds without being timed again.
    """
    cost = LayerCost({}, {}, {})
    for choice in choices:
        policy, offload = choice
        # Offload's hooks would hide what they take from the counter: the tensors the policy
        # saves are placed the way the engine will place them instead.
        fn = (lambda *a, **k: checkpoint(layer, *a, policy=policy, **k)) if offload else _run_under(layer, choice, None)
        placed = _placement(fn, args, kwargs, param_like, engine if offload else None)
        cost.device_bytes[choice] = sum(placed.device.values())
        cost.host_bytes[choice] = placed.host_bytes
    # Layers that save different bytes under some choice behave differently (a layer-specific
    # branch): they are timed on their own.
    signature = (_layer_signature(layer, args, kwargs), tuple(sorted(cost.device_bytes.items())))
    if signature not in timed:
        seconds = {choice: time_layer(_run_under(layer, choice, engine)) for choice in choices}
        timed[signature] = {choice: max(seconds[choice] - seconds[("none", False)], 0.0) for choice in choices}
    cost.seconds = dict(timed[signature])
    return cost


# -- step 3: choose -------------------------------------------------------------------------

_FRONTIER_LIMIT = 4096


def choose(costs: Sequence[LayerCost], budget: int) -> list[Choice]:
    """The per-layer choices with the least total seconds whose device bytes fit ``budget``.

    A multiple-choice knapsack solved by dynamic programming over the layers, keeping the Pareto
    frontier of partial plans in (bytes, cost), where cost is (seconds, summed
    :data:`CHOICE_STRENGTH`): exact while the frontier holds at most ``_FRONTIER_LIMIT`` plans; past
    that, plans are bucketed by bytes (the cheapest per bucket kept), which can cost at most one
    bucket's width of bytes of optimality. When nothing fits, returns the plan with the fewest
    bytes.
    """
    # A partial plan: (bytes, (seconds, strength), choices).
    frontier: list[tuple[int, tuple[float, float], tuple[Choice, ...]]] = [(0, (0.0, 0), ())]
    for cost in costs:
        extended = [
            (total + cost.device_bytes[c], (spent[0] + cost.seconds[c], spent[1] + _strength(c)), chosen + (c,))
            for total, spent, chosen in frontier
            for c in cost.device_bytes
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
            buckets: dict[int, tuple[int, tuple[float, float], tuple[Choice, ...]]] = {}
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


def _earlier_stronger(chosen: tuple[Choice, ...]) -> tuple[float, ...]:
    return tuple(-_strength(c) for c in chosen)


# -- the planner ----------------------------------------------------------------------------


def _candidate_choices(choices, offload, device: torch.device) -> tuple[tuple[Choice, ...], Offload | None]:
    """The choices to measure and the engine offloading ones go through."""
    if offload is not None:
        check_offload(offload, "memopt.plan")
    if choices is None:
        with_offload = offload is True or isinstance(offload, Offload) or (offload is None and device.type == "cuda")
        choices = [(p, False) for p in POLICIES] + ([("none", True)] if with_offload else [])
    choices = tuple(dict.fromkeys(_check_choice(c, "memopt.plan") for c in choices))
    if ("none", False) not in choices:
        raise ValueError(f"memopt.plan: choices must include ('none', False), got {list(choices)}")
    offloading = [c for c in choices if c[1]]
    if not offloading:
        return choices, None
    if offload is False:
        raise ValueError(f"memopt.plan: choices {offloading} offload, but offload=False")
    return choices, offload if isinstance(offload, Offload) else default_offload()


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget_bytes: int,
    *,
    layers: LayerSelector = None,
    choices: Sequence[Choice] | None = None,
    offload: bool | Offload | None = None,
    repeats: int = 3,
    loss: str | None = None,
) -> Plan:
    """Choose a ``(policy, offload)`` per layer so that saved activations fit ``budget_bytes``.

    A profiling pass (:func:`capture_layer_inputs`, :func:`measure_layer`, :func:`choose`). One
    forward of ``model`` on ``example_inputs`` captures each layer's inputs (layers run under
    ``"full"`` meanwhile, so this needs little memory). Each layer is then measured on its own,
    on fresh copies of those inputs:

    * bytes it saves for backward under every choice, counted as :func:`memopt.saved_bytes`
      counts them (for a layer that ``wrap`` swaps for a ``FusedCheckpointBlock``, the block's);
      with offload, split into what stays on the device and what goes to the host;
    * time: its forward + backward under each choice (the fastest of ``repeats`` after a
      warm-up), minus the same under ``("none", False)``: recompute, checkpoint bookkeeping and,
      with offload, the copies to the host and back, measured rather than modelled. Layers
      with the same signature (class, parameter shapes, input shapes and dtypes, and the bytes
      just measured under each choice) are timed once. A layer timed alone cannot overlap its
      offload copies with other layers' compute, so an offloading choice's time is an upper bound.

    A layer module that the forward runs several times (ALBERT's shared layer, a block
    repeated in a loop) costs the sum over its calls, each measured on that call's inputs. Bytes
    saved outside the layers' calls (``other_bytes``) are counted in the capturing forward;
    layer inputs that need no gradient and are shared by the layers (masks, rotary tables) are
    counted once on their own (``shared_bytes``). The choice is a multiple-choice knapsack
    solved exactly (:func:`choose`) for the least predicted time within the budget.

    The guarantee is the count, not the prediction: the model is then run once wrapped with the
    chosen plan and what it saves is counted (as :func:`memopt.saved_bytes` counts; what an
    offload engine takes is not seen). When that exceeds ``budget_bytes`` (costs measured alone
    can fall short of the model's, e.g. a layer that reads the model's state), the choice is made
    again with the shortfall taken off the budget, up to three times, and then ``ValueError``.
    A returned plan saves at most ``budget_bytes`` on ``example_inputs``. Parameters' ``.grad``,
    buffers (BatchNorm statistics) and the RNG state are left as they were.

    Args:
        model: the (unwrapped) model, on the device and in the dtype it will train in.
        example_inputs: a tuple of positional arguments, a mapping of keyword arguments (a
            dict, a tokenizer's ``BatchEncoding``), or one tensor for ``model``; use the batch
            shape you will train with (bytes scale with it).
        budget_bytes: bytes the whole model may save for backward on its device.
        layers: which submodules are layers (see :func:`memopt.wrap.find_layers`).
        choices: the ``(policy, offload)`` pairs to choose among, ``("none", False)`` included.
            Default: each policy without offload, and ``("none", True)`` when the model is on a
            CUDA device or ``offload`` is True or an engine (offload moves nothing off a CPU
            otherwise).
        offload: the engine offloading choices go through: a ``memopt.Offload`` (pass the same
            one to ``wrap(model, plan=plan, offload=...)``), True or None for the process default
            (``memopt.offload.default_offload``), False for no offloading choices.
        repeats: timed forward + backward passes per layer signature and choice.
        loss: the LM-head loss of a Hugging Face causal LM the model is measured with, as
            ``memopt.wrap``'s ``loss``: ``"plain"`` saves the logits, ``"chunked"`` does not; None is
            wrap's default (``"chunked"`` where the model takes it, ``"plain"`` otherwise). The plan
            records the one it measured (:attr:`Plan.loss`), and ``wrap(model, plan=plan)`` runs it.

    Returns:
        a :class:`Plan`. Raises ``ValueError`` when even the cheapest choice exceeds the budget,
        when the count under the plan stays above it, or naming layers the forward never ran;
        ``RuntimeError`` (``memopt.wrap.check_layer_call``) for a layer that checkpointing cannot
        change (run with gradients off inside the model's own ``autograd.Function``: Reformer).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.plan: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"memopt.plan: budget_bytes must be a non-negative int, got {budget_bytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"memopt.plan: repeats must be a positive int, got {repeats!r}")
    if is_wrapped(model):
        raise RuntimeError("memopt.plan: model is wrapped; call memopt.unwrap(model) first")
    inner = wrapped_inside(model)
    if inner is not None:
        raise RuntimeError(f"memopt.plan: model is wrapped inside: {inner}; call memopt.unwrap on that module first")
    found = find_layers(model, layers)
    # The loss wrap will run (None: chunked where the model takes it), recorded in the plan.
    loss = "plain" if causal_lm_loss.chosen_loss(model, loss) is None else "chunked"
    param_like = list(model.parameters()) + list(model.buffers())
    device = next(iter(param_like), torch.empty(0)).device
    choices, engine = _candidate_choices(choices, offload, device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _buffers_kept(model):
        captured = capture_layer_inputs(model, example_inputs, found, param_like, loss)
        costs = []
        timed: dict[tuple, dict[Choice, float]] = {}
        for name, layer in found:
            params = [p for p in layer.parameters() if p.requires_grad]
            per_call = []
            for args, kwargs in captured.inputs[name]:

                def time_layer(fn, args=args, kwargs=kwargs, params=params):
                    return _step_seconds(fn, args, kwargs, params, synchronize, repeats)

                per_call.append(measure_layer(layer, args, kwargs, choices, engine, param_like, time_layer, timed))
            costs.append(_summed(per_call))
        shared_bytes = sum({storage_key(t): t.untyped_storage().nbytes() for t in captured.shared}.values())
        names = [name for name, _ in found]
        # The plan's guarantee is what the model saves under it: counted, and the choice made
        # again with the difference taken off when the prediction fell short.
        shortfall = 0
        for _ in range(_FIT_ATTEMPTS):
            chosen = choose(costs, budget_bytes - captured.other_bytes - shared_bytes - shortfall)
            result = Plan(names, chosen, costs, captured.other_bytes, shared_bytes, budget_bytes, loss)
            least = result.predicted_bytes + shortfall > budget_bytes  # choose() kept the least-bytes plan
            if least and shortfall:
                raise ValueError(
                    f"memopt.plan: budget_bytes={budget_bytes} is below the least this model can save with "
                    f"{list(choices)} per layer ({result.predicted_bytes + shortfall} bytes)"
                )
            # Counted even when the least-bytes plan is predicted over the budget: a prediction can
            # also exceed the count (T5's position bias, shared by its layers and needing a
            # gradient, counted once per layer: 5% over), and the count is what is guaranteed.
            counted = _counted_under(model, example_inputs, result, layers, engine, param_like, loss)
            if counted <= budget_bytes:
                return result
            if least:
                raise ValueError(
                    f"memopt.plan: budget_bytes={budget_bytes} is below the least this model can save with "
                    f"{list(choices)} per layer ({counted} bytes, counted)"
                )
            shortfall += counted - budget_bytes
    raise ValueError(
        f"memopt.plan: the model saved {counted} bytes under the plan chosen for budget_bytes={budget_bytes} "
        f"(predicted {result.predicted_bytes}); the layers' costs measured alone do not add up to the model's "
        f"here. Pass a smaller budget_bytes or choices= with stronger policies"
    )


_FIT_ATTEMPTS = 3


def _summed(per_call: Sequence[LayerCost]) -> LayerCost:
    """One layer's cost over all its calls in a forward (each saves its own activations)."""
    first = per_call[0]
    return LayerCost(
        {c: sum(cost.device_bytes[c] for cost in per_call) for c in first.device_bytes},
        {c: sum(cost.host_bytes[c] for cost in per_call) for c in first.host_bytes},
        {c: sum(cost.seconds[c] for cost in per_call) for c in first.seconds},
    )


def _counted_under(model, example_inputs, chosen: Plan, layers, engine, param_like, loss) -> int:
    """Bytes the model saves for backward on its device in one forward under ``chosen``, as
    :func:`memopt.saved_bytes` counts them (what an offload engine takes is not seen)."""
    wrap(model, plan=chosen, layers=layers, offload=engine if engine is not None else None, loss=loss)
    try:
        with SavedTensorCounter(exclude=param_like) as counter:
            out = _call(model, example_inputs)
        del out
    finally:
        unwrap(model)
    return counter.total_bytes


@contextlib.contextmanager
def _buffers_kept(model: nn.Module):
    """The model's buffers as they were (the planner's forwards update BatchNorm statistics)."""
    with torch.no_grad():
        kept = [(b, b.clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)
