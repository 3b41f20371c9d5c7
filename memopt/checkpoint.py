"""memopt.checkpoint: ``torch.utils.checkpoint.checkpoint`` with a recompute policy and offload.

The policies and ``offload`` are :mod:`memopt.policy`'s: ``"none"`` runs the function as is,
``"full"`` saves only the inputs and recomputes everything, ``"selective"`` saves the outputs of
the ops in :data:`memopt.policy.SELECTIVE_SAVED_OPS` (matmuls, attention kernels) and recomputes
the cheap ones (norms, activations, dropout, softmax, views) from them.

The checkpointed variants are PyTorch's non-reentrant checkpoint (``use_reentrant=False``) with
the RNG state preserved, so dropout replays the same mask in the recompute; ``"selective"`` is
PyTorch's selective activation checkpointing (``create_selective_checkpoint_contexts``) driven by
the op list below.

Saved-tensor accounting: PyTorch's selective checkpointing keeps the op outputs it saves in its
own cache, outside autograd, so an enclosing ``torch.autograd.graph.saved_tensors_hooks`` (such as
:class:`memopt.SavedTensorCounter`) does not see them by default. memopt routes them through the
enclosing hooks: with ``respect_saved_tensors_hooks=True`` where ``torch.utils.checkpoint``
accepts it, and on older torch (the argument is absent in torch 2.11..2.13) by packing each
cached tensor with the enclosing hooks once the forward is done and unpacking it when the backward
takes it from the cache. Both let ``memopt.offload`` move what ``"selective"`` keeps; the older
path holds the layer's cached tensors on the device until its forward ends.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import types
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from memopt._parameters_as_called import ParametersAsCalled, submodules
from memopt._records_graph import records_graph
from memopt.offload import Offload, offload_group
from memopt.policy import (
    PolicyFunctionCall, check_offload, check_policy, is_selective_saved, selective_checkpoint_policy,
)  # fmt: skip

_CHECKPOINT_RESPECTS_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)
# Keyword arguments meant for fn that torch.utils.checkpoint would take as its own: its parameters
# (``function``, ``early_stop``) and its generator's, whose first one is ``fn`` (torch 2.11 passes
# fn's keyword arguments to it). memopt.checkpoint binds them to fn instead.
# (The generator is private: a torch without it contributes none of its names.)
_TORCH_CHECKPOINT_NAMES = frozenset(
    name
    for f in (torch.utils.checkpoint.checkpoint,
              getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None))
    if f is not None
    for name, p in inspect.signature(f).parameters.items()
    if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
)
# torch 2.14: the saved-tensors hooks a tensor saved now would use, skipping the internal hooks of
# an enclosing torch checkpoint (absent in torch 2.11..2.13, whose internal hooks carry no mark).
_current_user_saved_tensors_hooks = getattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks", None)


def _hooks_around_call():
    """The saved-tensors hooks around a checkpoint call, for what memopt packs itself (its
    snapshots, and the selective cache on torch without ``respect_saved_tensors_hooks``).

    Note: [the hooks memopt packs with] inside an enclosing checkpoint (memopt's or torch's), the
    top of the hooks stack is that checkpoint's own: in its forward each tensor packed takes the
    next slot, and in its recompute each one packed is matched to a slot by position. What memopt
    packs with them would have to be made, in the same order, by every recompute, or a tensor gets
    another one's slot (silently, where the shapes agree). torch packs its selective cache with the
    user's hooks under them (``_current_user_saved_tensors_hooks``), and so does memopt where torch
    can tell them apart (2.14); on older torch memopt makes the same copies in forward and
    recompute (note [a snapshot per overlapping output]).
    """
    if _current_user_saved_tensors_hooks is not None:
        return _current_user_saved_tensors_hooks()
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


class _HookedCacheEntry:
    """One tensor of selective checkpointing's cache, packed by the enclosing saved-tensors hooks.

    Takes the place of PyTorch's ``_VersionWrapper`` in the cache: the backward calls
    ``get_val`` on it, which unpacks. A tensor changed in place after it was cached raises there, as
    PyTorch's wrapper does, unless the cache allows mutation.
    """

    def __init__(self, wrapper, pack_hook: Callable[[torch.Tensor], Any], unpack_hook: Callable[[Any], torch.Tensor]):
        self._mutated_before_packing = wrapper.val._version != wrapper.version
        self._packed = pack_hook(wrapper.val)
        self._packed_version = self._packed._version if isinstance(self._packed, torch.Tensor) else None
        self._unpack_hook = unpack_hook

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        mutated = self._mutated_before_packing or (
            self._packed_version is not None and self._packed._version != self._packed_version
        )
        if mutated and not allow_cache_entry_mutation:
            raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
        return self._unpack_hook(self._packed)


class _PackCachedWithHooks:
    """Forward context for torch without ``respect_saved_tensors_hooks`` (2.11..2.13).

    Runs PyTorch's caching mode; when the forward is done, packs every tensor it cached with the
    saved-tensors hooks that were active around the checkpoint and leaves the packed value in the
    cache, to be unpacked when the backward takes it (what torch 2.14 does op by op with
    ``respect_saved_tensors_hooks=True``). The cache holds, per op, a list of entries in torch
    2.11 and a dict keyed by call index from 2.13; each entry is a pytree of ``_VersionWrapper``
    leaves (a ``_SnapshotCacheEntry``, already packed, is left as it is), or a marker for a
    recomputed op.
    """

    def __init__(self, caching_mode, hooks: tuple[Callable, Callable]):
        self._caching_mode = caching_mode
        self._hooks = hooks

    def __enter__(self):
        return self._caching_mode.__enter__()

    def __exit__(self, *exc):
        suppressed = self._caching_mode.__exit__(*exc)
        if exc[0] is not None:
            return suppressed
        pack_hook, unpack_hook = self._hooks

        def pack(leaf):
            if isinstance(getattr(leaf, "val", None), torch.Tensor):
                return _HookedCacheEntry(leaf, pack_hook, unpack_hook)
            return leaf

        for per_op in self._caching_mode.storage.values():
            for index in list(per_op.keys() if isinstance(per_op, dict) else range(len(per_op))):
                per_op[index] = tree_map(pack, per_op[index])
        return suppressed


class _CacheEntriesToHost:
    """Forward context for a policy function's CPU-offload answers (:class:`memopt.policy.
    PolicyFunctionCall`): runs PyTorch's caching mode; when the forward is done, packs the cache
    entries of the calls the function wanted on the host with memopt's engine, the one
    ``offload=True`` takes (the innermost active ``memopt.Offload``, else the process default),
    as one group of it. Eager PyTorch would recompute those calls instead.

    An entry that saved-tensors hooks already moved off the device (an ``offload=`` engine around
    the call) is left as it is. ``outer_hooks`` are the hooks around the checkpoint on torch
    without ``respect_saved_tensors_hooks`` (``_PackCachedWithHooks`` packs every other entry
    with them): they see these entries first, as torch 2.14 lets them see each one at op time.
    """

    def __init__(self, caching_mode, decisions: PolicyFunctionCall, outer_hooks):
        self._caching_mode = caching_mode
        self._decisions = decisions
        self._outer_hooks = outer_hooks

    @property
    def storage(self):
        return self._caching_mode.storage

    def __enter__(self):
        return self._caching_mode.__enter__()

    def __exit__(self, *exc):
        suppressed = self._caching_mode.__exit__(*exc)
        if exc[0] is not None or not self._decisions.offloaded:
            return suppressed
        with offload_group(True) as engine:
            for op, call in self._decisions.offloaded:
                per_op = self._caching_mode.storage[op]
                per_op[call] = tree_map(lambda leaf: self._to_host(leaf, engine), per_op[call])
        return suppressed

    def _to_host(self, leaf, engine: Offload):
        if not isinstance(getattr(leaf, "val", None), torch.Tensor):
            return leaf  # not a tensor, or already packed off the device by the hooks around the call
        outer_pack, outer_unpack = self._outer_hooks or (None, getattr(leaf, "unpack_hook", None))

        def pack(t):
            if outer_pack is not None:
                t = outer_pack(t)
            return engine._pack(t) if isinstance(t, torch.Tensor) else t

        def unpack(packed):
            t = engine._unpack(packed)
            return outer_unpack(t) if outer_unpack is not None else t

        return _HookedCacheEntry(leaf, pack, unpack)


# ---------------------------------------------------------------------------------------------
# Exactness guards.
#
# Note: [what a recompute may rely on]
#
# A recompute replays ``fn`` and must see exactly what the forward saw. Four things break that
# silently in PyTorch's own checkpointing, and memopt guards them:
#
# 1. Selective checkpointing keeps the outputs of matmuls in a cache and hands them to the
#    recompute. PyTorch checks the cached tensor's version counter, but ``torch.matmul`` on 3-D
#    inputs returns ``_unsafe_view(bmm(...))``: a tensor with the cached storage and a version
#    counter of its own, so ``y = a @ b; y += c`` rewrites the cache unnoticed and the recompute
#    starts from the updated value. ``_CachedOutputGuard`` watches, during the forward, every op
#    that writes into a tensor: before one writes into the storage of a cached output, the output
#    is copied (a snapshot, packed with the saved-tensors hooks around the checkpoint so offload
#    and the saved-bytes count see it), and the copy takes the cached tensor's place in the cache
#    (``_SnapshotCacheEntry``), so the recompute gets the value at save time. The cache's own
#    entry is dropped unread: on torch 2.14 the hooks packed it when the op ran, and an offload
#    engine refuses to unpack a tensor written into after its pack (its version check, which must
#    stay for tensors autograd saves). Where the entry cannot be found in PyTorch's cache (a
#    layout memopt does not know), ``_CachedOutputRestore`` swaps the copy in after the cache
#    handed out its tensor instead (exact, but not under a version-checking engine). In-place
#    updates right after a saved matmul (``ReLU(inplace=True)``, ``scores /= sqrt(d)``)
#    therefore just work, offloaded or not. A write into a cached storage *after* the forward
#    (through any tensor the forward made that aliases it) cannot be undone: the recompute raises,
#    naming the op (or the offload engine's version check raises first).
# 2. A recompute reruns the module's forward, so a layer that updates its buffers in training
#    (BatchNorm's running statistics and ``num_batches_tracked``) would update them twice, and a
#    layer that reads a buffer it updates (spectral norm's power-iteration vectors ``_u``/``_v``,
#    a running scale, MoCo's queue) would read, in the recompute, the value the forward left:
#    recomputed activations that differ from the forward's, and wrong gradients. ``_BufferGuard``
#    keeps the value each buffer had when the forward started, for the buffers the forward
#    changes only: under ``"selective"`` and policy functions each is copied just before the
#    first op that writes into it (PyTorch's caching mode calls ``before_op``); under ``"full"``,
#    which runs no dispatch mode, all are copied when the forward starts and the copies of those
#    the forward left alone (version counters) dropped when it ends. Writes through ``.data``
#    are seen by neither (nor by autograd).
#    Each recompute starts from those values, and the buffers get the values they had before it
#    back after it, and their version counters too. A buffer the forward reassigns
#    (``self.scale = ...``) is swapped back for the recompute, as is one
#    ``torch.func.functional_call`` passed (it puts the model's own back once the forward has
#    returned, before the backward). BatchNorm-style running statistics get no copy: in training
#    only their own update reads them. The copies live as long as the graph (on the device, not offloaded).
#    A selective-cache entry that is the storage of such a buffer (``torch.mm(w, v, out=u)``
#    under ``"selective"``) is copied when the forward ends, before the recompute writes the buffer.
# 3. Selective checkpointing hands the recompute a saved op's output without running the op.
#    Two things the op did besides its output are then missing. An op that writes into an
#    argument (in place, ``out=``; CPU dropout's ``noise.bernoulli_(p)``, whose result aten
#    ignores and whose ``noise`` it then reads) would leave the recompute's argument unwritten:
#    ``_CachedOutputRestore`` writes the cached value into it. An op that draws random numbers
#    (``torch.Tag.nondeterministic_seeded``: dropout masks, ``rand_like``, and the attention
#    kernels when their ``dropout_p`` is not 0, which ``"selective"`` saves) would not move the
#    generator, so every later random op of the recompute would draw other numbers than the
#    forward did: the forward records its device generator's state after each such saved call,
#    and the recompute sets it there after taking the value from the cache (with
#    ``preserve_rng_state``, the recompute starts from the forward's RNG state, so every draw
#    then matches; the generators get their state back when the recompute ends). An op given a
#    ``generator=`` of its own is left alone: no checkpoint replays such a generator.
# 4. A recompute reruns the module's forward, which reads its parameters from the module then:
#    ``torch.func.functional_call`` (fast weights, MAML) has put the model's own parameters back
#    by the backward, and a parameter may have been assigned anew. ``ParametersAsCalled``
#    (``memopt._parameters_as_called``) records the modules' parameter tensors when the forward
#    starts and runs each recompute on them.
#
# Note: [a backward inside the checkpointed forward]
#
# A ``fn`` that calls ``torch.autograd.grad`` itself (a gradient penalty, MAML's inner step)
# starts a backward while its own forward runs. That backward unpacks tensors the checkpoint
# saved so far, so torch recomputes the start of ``fn`` then and there, with the forward's
# dispatch modes still on the stack. Under ``"selective"`` that recompute would both take the
# cache's entries (the real backward later finds them consumed: "backward an extra time", or
# "not found in storage" in older torch) and be recorded as new ops by the forward's caching mode.
# ``_ForwardTracker`` knows when the forward is running; a recompute that starts then runs
# plainly, as ``"full"`` would (everything from the inputs), with this checkpoint's forward
# modes lifted off the stack (``_SuspendedModes``) and every buffer of its modules put back after.
# The cache is left as the forward made it for the real backward.
#
# Note: [a second backward]
#
# torch recomputes once per backward (graph task) that needs the checkpoint's saved tensors. A
# gradient penalty or Hessian-vector product (``create_graph=True``, then a backward through
# that graph, which reaches the forward's nodes again) and a second backward through a retained
# graph (``retain_graph=True``, ``gradcheck``) each start a second recompute, and under
# ``"selective"`` the first one consumed the cache (PyTorch's selective checkpointing raises:
# "backward an extra time"). Every recompute after the first runs plainly, as ``"full"`` would
# (everything from the inputs, the buffers and parameters as the forward started, the RNG state
# replayed), which gives the forward's values again. The first backward still frees the cache as
# it goes, as PyTorch's does.
#
# Note: [a key/value cache argument]
#
# A Hugging Face layer given a key/value cache (``transformers.Cache``) appends its keys and
# values to it: the forward changes one of ``fn``'s inputs, so a recompute would attend over them
# twice. XLM passes its layers a cache it builds on every call, ``use_cache=False`` or not. Each
# cache argument is copied when the forward starts (``copy_cache``: new cache and layer objects
# and containers, the tensors shared), and every recompute gets a fresh copy of that copy
# (``_CacheAsCalled``): the cache as the forward saw it. The real cache gets the forward's
# update once, as without checkpointing. Sharing the tensors is exact for caches that replace
# their tensors on update (``DynamicCache``: ``torch.cat``); a cache that writes into them in
# place (``StaticCache``) would change the copy too, so the forward's writes are looked for
# (version counters) and refused with ``ValueError``.
# ---------------------------------------------------------------------------------------------

# Note: the guards below run in Python for every op of a guarded checkpoint's forward and
# recompute, so they key their tables by id(func) (an op overload's __hash__ is Python code) and
# look at an op's outputs only when it is a cached call or may alias a cached storage. Op
# overloads are created once per process and never freed, so their ids are stable.
_WRITTEN_ARGS: dict[int, tuple] = {}  # id(func) -> (func, its written arguments)


def _written_arguments(func) -> tuple[tuple[int, str], ...]:
    """Positions and names of the arguments ``func`` writes into (``Tensor(a!)`` in its schema)."""
    found = _WRITTEN_ARGS.get(id(func))
    if found is None:
        written = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        found = _WRITTEN_ARGS[id(func)] = (func, written)
    return found[1]


def _written_tensors(func, args, kwargs):
    for i, name in _written_arguments(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(leaf, torch.Tensor):
                yield leaf


def _storage_key(t: torch.Tensor):
    """The key ``memopt.saved.storage_key`` gives (one storage object made, not two), or None for an
    empty storage (their data pointers collide)."""
    storage = t.untyped_storage()
    return (storage.data_ptr(), str(t.device)) if storage.nbytes() else None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, end)``: the bytes of its storage that strided tensor ``t`` can reach (strides are
    never negative in PyTorch); empty for an empty tensor."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _output_leaves(out) -> list:
    """``tree_flatten(out)[0]``, without the pytree walk for the usual outputs."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) and all(isinstance(leaf, torch.Tensor) for leaf in out):
        return list(out)
    return tree_flatten(out)[0]


class _OpFacts:
    """What the guards read from an op's schema, once per op (``_op_facts``); each argument as
    ``(position, name, default)`` (``_argument_value`` reads it from a call)."""

    __slots__ = ("mutable", "stat_writes", "training", "returns_written", "draws", "generator", "dropout_p")

    def __init__(self, func):
        schema = getattr(func, "_schema", None)  # None: not an aten op (a higher-order op)
        self.mutable = schema is not None and schema.is_mutable
        arguments = schema.arguments if schema is not None else []
        spec = {arg.name: (i, arg.name, arg.default_value) for i, arg in enumerate(arguments)}
        # Written without saying so in the schema (native_batch_norm, cudnn_batch_norm): the
        # running statistics, when the op's ``training`` argument is true.
        self.stat_writes = tuple(
            spec[arg.name]
            for arg in arguments
            if arg.name in ("running_mean", "running_var")
            and not (arg.alias_info is not None and arg.alias_info.is_write)
        )
        self.training = spec.get("training") if self.stat_writes else None
        # (return index, argument) for each return that is a written argument (in-place, out=).
        written = {
            frozenset(arg.alias_info.before_set): spec[arg.name]
            for arg in arguments
            if arg.alias_info is not None and arg.alias_info.is_write
        }
        self.returns_written = tuple(
            (i, written[frozenset(ret.alias_info.before_set)])
            for i, ret in enumerate(schema.returns if schema is not None else ())
            if ret.alias_info is not None
            and ret.alias_info.is_write
            and frozenset(ret.alias_info.before_set) in written
        )
        # Draws from the default generator of its device (note [what a recompute may rely on], 3),
        # unless handed a generator of its own; the attention kernels only with dropout.
        self.draws = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        self.generator = spec.get("generator")
        self.dropout_p = spec.get("dropout_p")


_OP_FACTS: dict[int, tuple] = {}  # id(func) -> (func, its _OpFacts)


def _op_facts(func) -> _OpFacts:
    found = _OP_FACTS.get(id(func))
    if found is None:
        found = _OP_FACTS[id(func)] = (func, _OpFacts(func))
    return found[1]


def _argument_value(args, kwargs, spec):
    position, name, default = spec
    return args[position] if position < len(args) else kwargs.get(name, default)


def _buffer_written_tensors(func, args, kwargs):
    """The tensors ``func`` writes into: those its schema says, and a batch norm's running
    statistics in training (written without saying so)."""
    yield from _written_tensors(func, args, kwargs)
    facts = _op_facts(func)
    if facts.stat_writes and facts.training is not None and _argument_value(args, kwargs, facts.training):
        for spec in facts.stat_writes:
            value = _argument_value(args, kwargs, spec)
            if isinstance(value, torch.Tensor):
                yield value


def _draws_from_default_generator(func, args, kwargs) -> bool:
    """Whether this call of ``func`` may draw from its device's default random generator."""
    facts = _op_facts(func)
    if not facts.draws:
        return False
    if facts.generator is not None and _argument_value(args, kwargs, facts.generator) is not None:
        return False  # its own generator, which no checkpoint replays
    return facts.dropout_p is None or _argument_value(args, kwargs, facts.dropout_p) != 0


def _rng_device(out) -> torch.device | None:
    """The device whose generator a random op drew from: that of its first output, when it is a
    plain tensor on a device with a random generator."""
    for leaf in _output_leaves(out):
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in (torch.Tensor, nn.Parameter) or leaf.device.type == "meta":
                return None
            if leaf.device.type == "cpu" or hasattr(getattr(torch, leaf.device.type, None), "get_rng_state"):
                return leaf.device
            return None
    return None


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return getattr(torch, device.type).get_rng_state(device)


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state, device)


class _SelectiveGuardState:
    """What the forward's guard leaves for the recompute's, per cached op call ``(id(op), n)``
    (the ``n``-th call of ``op``); ``is_cached(op, n)`` says which calls the policy saved."""

    def __init__(
        self,
        hooks,
        is_cached: Callable[[Any, int], bool],
        policy_name: str,
        buffers: _BufferGuard | None = None,
        replay_rng: bool = False,
    ):
        # the saved-tensors hooks around the checkpoint (note [the hooks memopt packs with]), or None
        self.hooks = hooks
        self.is_cached = is_cached
        self.policy_name = policy_name
        self.buffers = buffers  # the call's _BufferGuard, or None
        self.replay_rng = replay_rng  # preserve_rng_state: the recompute starts from the forward's RNG state
        # site -> {output leaf: packed copy}, for entries not found in PyTorch's cache (note above)
        self.snapshots: dict[tuple, dict[int, Any]] = {}
        # site -> [(weakref to a tensor aliasing the cached storage, its version at forward end)]
        self.aliases: dict[tuple, list] = defaultdict(list)
        # cached calls of ops that write into an argument (in-place, out=): the recompute writes
        # the cached value into its own argument (note [what a recompute may rely on], 3)
        self.written_back: set[tuple] = set()
        # site -> (device, its generator's state after the call), for cached calls that drew
        self.rng_after: dict[tuple, tuple[torch.device, torch.Tensor]] = {}


class _CachedOutputGuard:
    """Forward side of note [what a recompute may rely on], 1: ``before_write`` and ``after`` each
    op that PyTorch's caching mode runs (see :class:`_GuardedCachingMode`), ``finish`` when the
    forward ends."""

    def __init__(self, state: _SelectiveGuardState, cache: dict | None = None):
        self._state = state
        # PyTorch's cache (the caching mode's ``storage``): op -> its entries, a list of the saved
        # calls in torch 2.11, a dict keyed by call index (every call) from 2.13
        self._cache = cache
        self._calls: dict[int, int] = {}  # id(op) -> calls so far
        # storage key -> [(site, leaf index, cached output, (entries, index) of its cache entry or None)]
        self._cached: dict = {}
        self._alias_of: dict = {}  # storage key -> [sites], kept after the snapshot for alias tracking
        # [first, last] byte address of each storage in _alias_of: an output whose data pointer
        # falls in none of them cannot alias one, and needs no storage key (~1 us each)
        self._spans: list[tuple[int, int]] = []
        self._made: list = []  # (site, tensor) for every op output aliasing a cached storage

    @property
    def watches_writes(self) -> bool:
        """Whether an op that writes into a tensor needs :meth:`before_write` (a cached output
        has no snapshot yet)."""
        return bool(self._cached)

    def before_write(self, func, args, kwargs) -> None:
        """Before ``func`` (a mutable op) runs: snapshot each cached output it writes into."""
        for t in _written_tensors(func, args, kwargs):
            self._snapshot(_storage_key(t), t)

    def _snapshot(self, key, written: torch.Tensor | None = None) -> None:
        """Copy the cached outputs in storage ``key`` whose bytes overlap those of ``written`` (all
        of them when None) into the cache's entries (their values now).

        Note: [a snapshot per overlapping output] only the cached outputs that the write reaches
        are copied, not every one in the storage. A recompute inside an enclosing checkpoint gets
        its cached outputs back from that checkpoint's cache, and an offload engine that coalesces
        small tensors unpacks them into one shared storage: copying by storage there would make
        more copies than the forward made, and each is a saved tensor (the recompute must save
        the same sequence of tensors the forward did). Disjoint byte ranges are the same in both.
        """
        found = self._cached.get(key)
        if not found:
            return
        if written is None:
            taken = self._cached.pop(key)
        else:
            span = _byte_span(written)
            reached = [_overlaps(_byte_span(entry[2]), span) for entry in found]
            taken = [entry for entry, hit in zip(found, reached) if hit]
            if len(taken) == len(found):
                del self._cached[key]
            elif taken:
                self._cached[key] = [entry for entry, hit in zip(found, reached) if not hit]
        for site, leaf_index, cached, slot in taken:
            # Outside the dispatch modes: selective checkpointing must not see memopt's copy
            # as an op of the checkpointed function.
            with _disable_current_modes():
                copy = cached.clone()
                hooks = self._state.hooks
                if slot is not None:
                    entries, index = slot
                    leaves, spec = tree_flatten(entries[index])
                    leaves[leaf_index] = _SnapshotCacheEntry(copy, hooks)
                    entries[index] = tree_unflatten(leaves, spec)
                else:
                    self._state.snapshots.setdefault(site, {})[leaf_index] = hooks[0](copy) if hooks else copy

    def _cache_slot(self, func, n: int, leaves: list):
        """``(entries, index)``: where PyTorch's caching mode put the entry of ``func``'s call
        ``n`` (whose outputs are ``leaves``), or None where that cannot be told for sure."""
        entries = self._cache.get(func) if self._cache is not None else None  # the key of an aten op
        if isinstance(entries, dict):
            index = n  # torch numbers every call of the op, as the guard does
        elif isinstance(entries, list) and entries:
            index = len(entries) - 1  # torch appends the saved calls only: this one, just now
        else:
            return None
        entry = entries.get(index) if isinstance(entries, dict) else entries[index]
        wrappers = tree_leaves(entry)
        if len(wrappers) != len(leaves) or not all(hasattr(w, "get_val") for w in wrappers):
            return None
        for wrapper, leaf in zip(wrappers, leaves):
            val = getattr(wrapper, "val", None)
            # Unpacked (no hooks at op time): the cached tensor is the output, detached.
            if isinstance(val, torch.Tensor) and isinstance(leaf, torch.Tensor) and val.data_ptr() != leaf.data_ptr():
                return None
        return entries, index

    def after(self, func, args, kwargs, out) -> None:
        n = self._calls.get(id(func), 0)
        self._calls[id(func)] = n + 1
        is_cached = self._state.is_cached(func, n)
        if not is_cached and not self._spans:
            return
        leaves = _output_leaves(out)
        if is_cached:
            site = (id(func), n)
            if _op_facts(func).returns_written:
                self._state.written_back.add(site)
            if self._state.replay_rng and _draws_from_default_generator(func, args, kwargs):
                device = _rng_device(out)
                if device is not None:
                    self._state.rng_after[site] = (device, _get_rng_state(device))
            slot = False  # looked up once, for the first output that may be written into
            for leaf_index, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and (key := _storage_key(leaf)) is not None:
                    if slot is False:
                        slot = self._cache_slot(func, n, leaves)
                    self._cached.setdefault(key, []).append((site, leaf_index, leaf.detach(), slot))
                    if key not in self._alias_of:
                        self._alias_of[key] = []
                        self._spans.append((key[0], key[0] + leaf.untyped_storage().nbytes()))
                    self._alias_of[key].append(site)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and self._may_alias(leaf.data_ptr()):
                for site in self._alias_of.get(_storage_key(leaf), ()):
                    self._made.append((site, leaf))

    def _may_alias(self, address: int) -> bool:
        for first, last in self._spans:
            if first <= address <= last:
                return True
        return False

    def finish(self) -> None:
        # Cached outputs in the storage of a buffer that the forward wrote into: the recompute
        # starts by writing the buffer's value at forward start back (_BufferGuard), so they are
        # copied now, and that write is not taken for a change after the forward.
        buffers = self._state.buffers
        loaded = buffers.written_storages() if buffers is not None else ()
        for key in loaded:
            self._snapshot(key)
        # Versions at the end of the forward; weak references, so nothing here keeps a storage
        # alive (offload frees what it moved only when nothing else holds it).
        for site, tensor in self._made:
            if loaded and _storage_key(tensor) in loaded:
                continue
            self._state.aliases[site].append((weakref.ref(tensor), tensor._version))
        self._cached.clear()
        self._alias_of.clear()
        self._spans.clear()
        self._made.clear()


class _SnapshotCacheEntry:
    """Note [what a recompute may rely on], 1: takes the place of a selective-checkpoint cache
    entry (PyTorch's ``_VersionWrapper``) whose tensor the forward wrote into: the copy taken just
    before the write, packed with ``hooks`` (the saved-tensors hooks around the checkpoint) when
    there are any. The backward calls ``get_val`` on it, as on PyTorch's wrapper.

    Without hooks it carries ``val`` and ``version`` as PyTorch's wrapper does, so that
    ``_CacheEntriesToHost`` can still move it to the host; with hooks it has no ``val``, so
    neither that nor ``_PackCachedWithHooks`` packs it a second time.
    """

    def __init__(self, copy: torch.Tensor, hooks):
        if hooks:
            self._packed, self._unpack = hooks[0](copy), hooks[1]
        else:
            self._unpack = None
            self.val, self.version = copy, copy._version

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        # memopt's own copy, which nothing else can write into: no version check to make.
        if self._unpack is None:
            return self.val
        with _disable_current_modes():
            return self._unpack(self._packed)


class _CachedOutputRestore:
    """Recompute side of note [what a recompute may rely on], 1: hands out the snapshots that
    could not take their entry's place in PyTorch's cache (``_CachedOutputGuard._cache_slot``), and
    refuses a cache entry that was written into after the forward (``after`` each op that
    PyTorch's cached mode gives the recompute, see :class:`_GuardedCachedMode`)."""

    def __init__(self, state: _SelectiveGuardState):
        self._state = state
        self._calls: dict[int, int] = {}
        self._ops: set[int] = set()  # id(op) of the ops with a site to check or hand out

    def start(self) -> None:
        state = self._state
        self._calls.clear()
        self._ops = {op for op, _ in (*state.aliases, *state.snapshots, *state.written_back, *state.rng_after)}
        self._rng_before: dict[torch.device, torch.Tensor] = {}

    def finish(self) -> None:
        """When the recompute ends: the generators it moved get their state back (those torch
        forks for the recompute get theirs again after it anyway)."""
        for device, rng_state in self._rng_before.items():
            _set_rng_state(device, rng_state)
        self._rng_before = {}

    def after(self, func, args, kwargs, out):
        if id(func) not in self._ops:
            return out  # sites are numbered per op: the other ops need no count
        state = self._state
        n = self._calls.get(id(func), 0)
        self._calls[id(func)] = n + 1
        site = (id(func), n)
        for ref, version in state.aliases.pop(site, ()):
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise RuntimeError(
                    f"memopt.checkpoint(policy={state.policy_name}): the output of {func} (call {n}) that the "
                    "recompute starts from was changed in place after the checkpointed forward returned; "
                    "its value at save time is gone. Clone it before changing it, or use policy='full'"
                )
        snapshot = state.snapshots.pop(site, None)
        if snapshot:
            leaves, spec = tree_flatten(out)
            unpack = state.hooks[1] if state.hooks else None
            with _disable_current_modes():
                for leaf_index, packed in snapshot.items():
                    leaves[leaf_index] = unpack(packed) if unpack else packed
            out = tree_unflatten(leaves, spec)
        if site in state.written_back:
            out = self._write_back(func, args, kwargs, out)
        if site in state.rng_after:
            device, rng_state = state.rng_after[site]
            if device not in self._rng_before:
                self._rng_before[device] = _get_rng_state(device)
            _set_rng_state(device, rng_state)
        return out

    @staticmethod
    def _write_back(func, args, kwargs, out):
        """A cached call of an op that writes into an argument (``noise.bernoulli_(p)``,
        ``torch.mm(a, b, out=u)``): the cache hands out the forward's result without running the
        op, so the recompute's own argument is written with it here, and is what the call
        returns, as the op would (code that reads the argument, not the result, sees it)."""
        returns_written = _op_facts(func).returns_written
        single = len(func._schema.returns) == 1
        leaves = [out] if single else list(out)
        with _disable_current_modes(), torch.no_grad():
            for index, spec in returns_written:
                target = _argument_value(args, kwargs, spec)
                value = leaves[index]
                if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor) and value is not target:
                    target.copy_(value)
                    leaves[index] = target
        return leaves[0] if single else type(out)(leaves)


# The guards run inside PyTorch's own selective-checkpoint modes rather than as dispatch modes of
# their own: a Python dispatch mode costs ~10 us an op in dispatch alone, which at small layers
# made memopt.wrap 1.35x PyTorch's selective checkpointing. ``_guard_modes`` turns the two modes
# ``create_selective_checkpoint_contexts`` made into subclasses (their class only; the instances,
# their state and their constructors are torch's, whichever version) that call the guards around
# their own ``__torch_dispatch__``.


class _GuardedCachingMode:
    """Mixed into PyTorch's forward (caching) mode: :class:`_CachedOutputGuard` around each op."""

    _memopt_guard: _CachedOutputGuard

    _memopt_buffers: _BufferGuard | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._memopt_buffers is not None and self._memopt_buffers.watching:
            self._memopt_buffers.before_op(func, args, kwargs)
        if self._memopt_guard.watches_writes and func._schema.is_mutable:
            self._memopt_guard.before_write(func, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._memopt_guard.after(func, args, kwargs, out)
        return out

    def __exit__(self, *exc):
        self._memopt_guard.finish()
        return super().__exit__(*exc)


class _GuardedCachedMode:
    """Mixed into PyTorch's recompute (cached) mode: :class:`_CachedOutputRestore` after each op."""

    _memopt_restore: _CachedOutputRestore

    def __enter__(self):
        self._memopt_restore.start()  # torch enters the same mode once per recompute
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._memopt_restore.finish()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return self._memopt_restore.after(func, args, kwargs, super().__torch_dispatch__(func, types, args, kwargs))


@functools.cache
def _guarded_class(mixin: type, mode_class: type) -> type:
    return type(f"{mixin.__name__}[{mode_class.__name__}]", (mixin, mode_class), {"__module__": __name__})


def _guard_modes(forward_mode: TorchDispatchMode, recompute_mode: TorchDispatchMode, state: _SelectiveGuardState):
    forward_mode.__class__ = _guarded_class(_GuardedCachingMode, type(forward_mode))
    forward_mode._memopt_guard = _CachedOutputGuard(state, getattr(forward_mode, "storage", None))
    forward_mode._memopt_buffers = state.buffers
    recompute_mode.__class__ = _guarded_class(_GuardedCachedMode, type(recompute_mode))
    recompute_mode._memopt_restore = _CachedOutputRestore(state)


def _checkpointed_modules(fn, args: tuple, kwargs: dict) -> list[nn.Module]:
    """The modules ``fn(*args, **kwargs)`` runs as far as a checkpoint can tell: the module
    arguments of the call, and those ``fn`` holds: ``fn`` itself, the object of a bound method,
    a ``functools.partial``'s function and arguments, the cells of a function's closure
    (``create_custom_forward(layer)``, ``lambda x: self.layer(x)``), each looked into the same way.
    A module reached otherwise (a global, a list of modules, an attribute of a plain object) is
    not seen."""
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
    pending, seen = [fn], set()
    while pending:
        value = pending.pop()
        if isinstance(value, nn.Module):
            found.append(value)
        elif id(value) in seen:
            continue
        elif isinstance(value, functools.partial):
            pending += (value.func, *value.args, *value.keywords.values())
        elif isinstance(value, types.MethodType):
            pending += (value.__self__, value.__func__)
        elif isinstance(value, types.FunctionType) and value.__closure__:
            for cell in value.__closure__:
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # an empty cell: a name not assigned yet
                    pass
        seen.add(id(value))
    return found


_MISSING = object()


class _BufferGuard:
    """Note [what a recompute may rely on], 2: the recompute sees the buffers of the checkpointed
    modules as the forward started, and leaves them as it found them.

    The forward keeps a copy of each buffer it changes, from before its first write: under
    ``"selective"`` and policy functions copied just before the first op that writes into it
    (``before_op``, called by PyTorch's caching mode), under ``"full"`` all copied when the
    forward starts and the copies of those it did not change dropped when it ends (a dispatch mode
    of memopt's own to watch for writes would cost ~10 us per op and break higher-order ops such
    as ``flex_attention`` and ``torch.cond``). Writes through ``.data`` bypass version counters and
    dispatch (as they bypass autograd's checks): they are not seen. Which buffers changed is read from version counters, except for BatchNorm-style
    running statistics: ``native_batch_norm`` writes them without declaring it in its schema, so
    their version stays. Those of ``nn.BatchNorm*``-style modules (``_NormBase`` with running
    statistics) get no copy: in training nothing reads them but their own update, which the
    recompute makes from whatever they hold and which is undone after it. A buffer the forward
    reassigns (``self.scale = ...``), or that ``torch.func.functional_call`` passed and has since
    taken out, is swapped: the recompute runs with the tensor the forward started with, the module
    holds what it holds now again after it.
    """


    def __init__(self, modules: list[nn.Module]):
        # ``modules``: the checkpointed modules and their submodules, each once (``submodules``).
        # Their buffers, each once, and the running statistics of the BatchNorm-style ones.
        found: dict[int, torch.Tensor] = {}
        unread: set[int] = set()  # read by nothing in training but their module's own update
        self._running_stats: list[torch.Tensor] = []
        self._entries: list[tuple[nn.Module, str, torch.Tensor]] = []
        for sub in modules:
            for name, b in sub._buffers.items():
                if b is not None:
                    self._entries.append((sub, name, b))
                    found[id(b)] = b
            if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
                stats = [b for b in (sub.running_mean, sub.running_var) if b is not None]
                self._running_stats += stats
                unread.update(id(b) for b in (*stats, sub.num_batches_tracked) if b is not None)
        self._buffers = list(found.values())
        self._copied = [b for b in self._buffers if id(b) not in unread]  # those that get a copy
        self.watched_by_caching_mode = False  # set by _context_fn: PyTorch's caching mode calls before_op
        self.watching = False  # before_op is wanted (during the forward)
        self._start: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (buffer, value at forward start)
        self._by_storage: dict | None = None  # storage key -> [buffers], built at the first write
        self._changed: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self._buffers)

    def before_op(self, func, args, kwargs) -> None:
        """Before ``func`` runs in the forward: copy each buffer it writes into, the first time."""
        facts = _op_facts(func)
        if not (facts.mutable or facts.stat_writes):
            return
        for t in _buffer_written_tensors(func, args, kwargs):
            if self._by_storage is None:
                self._by_storage = defaultdict(list)
                for b in self._copied:
                    if (key := _storage_key(b)) is not None:
                        self._by_storage[key].append(b)
            for b in self._by_storage.get(_storage_key(t), ()):
                if id(b) not in self._start:
                    # Outside the dispatch modes: no checkpoint's caching mode may see the copy.
                    with _disable_current_modes(), torch.no_grad():
                        self._start[id(b)] = (b, b.clone())

    def written_storages(self) -> set:
        """Storage keys of the buffers the forward wrote into so far (those it has copies of)."""
        return {key for b, _ in self._start.values() if (key := _storage_key(b)) is not None}

    @contextlib.contextmanager
    def forward(self):
        before = [b._version for b in self._buffers]
        self._start, self._by_storage = {}, None
        if self._copied:
            if self.watched_by_caching_mode:
                self.watching = True
            else:
                with torch.no_grad():
                    self._start = {id(b): (b, b.clone()) for b in self._copied}
        try:
            yield
        finally:
            self.watching = False
            changed = {id(b): b for b, v in zip(self._buffers, before) if b._version != v}
            if self._start and self.watched_by_caching_mode:
                changed.update((key, b) for key, (b, _) in self._start.items())  # each written
            if changed:  # a norm in training bumped num_batches_tracked: it updated its statistics
                changed.update((id(b), b) for b in self._running_stats)
            self._changed = list(changed.values())
            # Only the buffers the forward changed need their values at its start.
            self._start = {key: value for key, value in self._start.items() if key in changed}
            self._by_storage = None

    def _replaced_now(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """The buffers the modules no longer hold, as ``(module, name, tensor at forward start)``.
        Asked when a recompute starts, not when the forward ends: ``torch.func.functional_call``
        puts the model's own buffers back only once the forward has returned."""
        return [(sub, name, b) for sub, name, b in self._entries if sub._buffers.get(name, _MISSING) is not b]

    @contextlib.contextmanager
    def recompute(self, every_buffer: bool = False):
        # every_buffer: a recompute during the forward (note [a backward inside the checkpointed
        # forward]), before the forward has said which buffers it changed.
        if every_buffer:
            targets = list({id(b): b for b in self._buffers + self._running_stats}.values())
            start = dict(self._start)
        else:
            targets, start = self._changed, self._start
        replaced = self._replaced_now()
        versions = tuple(b._version for b in targets)  # the buffers in start are among targets
        with torch.no_grad():
            saved = [(b, b.clone()) for b in targets]
            for buffer, value in start.values():
                buffer.copy_(value)
        held = [(sub, name, sub._buffers.get(name, _MISSING)) for sub, name, _ in replaced]
        for sub, name, b in replaced:
            sub._buffers[name] = b
        try:
            yield
        finally:
            for sub, name, b in held:
                if b is _MISSING:
                    sub._buffers.pop(name, None)
                else:
                    sub._buffers[name] = b
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
            # Note: every buffer written above holds the value it had before the recompute again,
            # bit for bit, but the copies moved its version counter (BatchNorm's own update of its
            # statistics does not): a tensor saved for backward elsewhere that is such a buffer (a
            # constant also read outside the checkpoint, statistics a BatchNorm in eval mode saved)
            # would fail autograd's version check where plain PyTorch runs. The counters go back
            # to where the recompute found them (torch.autograd.grad_mode's
            # _unsafe_preserve_version_counter does the same).
            torch._C._autograd._unsafe_set_version_counter(tuple(targets), versions)


@functools.lru_cache(maxsize=1)
def _cache_classes_of(cache_utils) -> tuple[type, ...]:
    names = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin")
    return tuple(c for c in (getattr(cache_utils, n, None) for n in names) if isinstance(c, type))


def _cache_classes() -> tuple[type, ...]:
    """``transformers``' cache and cache-layer base classes, if it is imported (a cache argument
    can only come from it then); empty otherwise. Looked up again only when the module object
    changes (every checkpointed call asks)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return () if cache_utils is None else _cache_classes_of(cache_utils)


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache (a ``transformers.Cache``)."""
    classes = _cache_classes()
    return bool(classes) and isinstance(value, classes[0])


def copy_cache(cache: Any, versions: list | None = None) -> Any:
    """A copy of a ``transformers.Cache`` that shares its tensors: the cache and cache-layer
    objects and the lists, tuples and dicts they hold are new, so an update that replaces a
    tensor (``DynamicCache``) changes the copy only. ``versions`` collects ``(tensor, version)``
    of the shared tensors (note [a key/value cache argument])."""
    classes = _cache_classes()
    memo: dict[int, Any] = {}

    def copied(value):
        if isinstance(value, torch.Tensor):
            if versions is not None:
                versions.append((value, value._version))
            return value
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, (list, dict)):
            new = type(value)()
            memo[id(value)] = new
            if isinstance(value, list):
                new.extend(copied(v) for v in value)
            else:
                new.update((k, copied(v)) for k, v in value.items())
            return new
        if isinstance(value, tuple):
            return tuple(copied(v) for v in value)
        if isinstance(value, classes) and hasattr(value, "__dict__"):
            new = copy.copy(value)
            memo[id(value)] = new
            new.__dict__.update((k, copied(v)) for k, v in vars(value).items())
            return new
        return value  # numbers, dtypes, devices, streams, configs: not changed by an update

    return copied(cache)


class _CacheAsCalled:
    """Note [a key/value cache argument]: ``fn`` called with its cache arguments as they were
    when the forward started; the forward updates the real ones (and may not write into their
    tensors), each later call (a recompute) gets fresh copies."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn = fn
        self.versions: list = []
        self.positions = [i for i, a in enumerate(args) if is_cache(a)]
        self.keys = [k for k, v in kwargs.items() if is_cache(v)]
        self.as_called = [copy_cache(args[i], self.versions) for i in self.positions] + [
            copy_cache(kwargs[k], self.versions) for k in self.keys
        ]
        self.forward_done = False

    def __call__(self, *args, **kwargs):
        if not self.forward_done:
            self.forward_done = True
            out = self.fn(*args, **kwargs)
            if any(t._version != version for t, version in self.versions):
                names = [f"argument {i}" for i in self.positions] + [f"{k}=" for k in self.keys]
                raise ValueError(
                    f"memopt.checkpoint: fn wrote into the tensors of its key/value cache ({', '.join(names)}: "
                    f"{', '.join(sorted({type(c).__name__ for c in self.as_called}))}) in place; a recompute "
                    "cannot see the cache as the forward did. Train with a cache that grows by concatenation "
                    "(DynamicCache), without a cache, or do not checkpoint this function"
                )
            return out
        fresh = [copy_cache(c) for c in self.as_called]
        args = list(args)
        for i, cache in zip(self.positions, fresh):
            args[i] = cache
        kwargs = {**kwargs, **dict(zip(self.keys, fresh[len(self.positions):]))}
        return self.fn(*args, **kwargs)


class _Contexts:
    """Several context managers entered in order and left in reverse, re-enterable (torch enters
    the recompute context once per recompute)."""

    def __init__(self, *factories: Callable[[], Any]):
        self._factories = factories
        self._stacks: list[contextlib.ExitStack] = []

    def _chosen(self) -> tuple[Callable[[], Any], ...]:
        return self._factories

    def __enter__(self):
        stack = contextlib.ExitStack()
        for make in self._chosen():
            stack.enter_context(make())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


class _ForwardTracker:
    """Note [a backward inside the checkpointed forward]: whether the forward is running."""

    def __init__(self):
        self.running = False

    @contextlib.contextmanager
    def forward(self):
        self.running = True
        try:
            yield
        finally:
            self.running = False


class _SuspendedModes:
    """Lifts the dispatch modes from the top of the stack down to ``bottom`` (included) off the
    stack, and puts them back on exit; nothing when ``bottom`` is not on the stack."""

    def __init__(self, bottom: TorchDispatchMode):
        self._bottom = bottom
        self._lifted: list[list[TorchDispatchMode]] = []

    def __enter__(self):
        lifted = []
        if any(mode is self._bottom for mode in _get_current_dispatch_mode_stack()):
            while not lifted or lifted[-1] is not self._bottom:
                lifted.append(_pop_mode())
        self._lifted.append(lifted)
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._lifted.pop()):
            _push_mode(mode)
        return False


class _RecomputeContexts(_Contexts):
    """The recompute's contexts: ``factories`` for the first recompute after the forward,
    ``during_forward`` for a recompute that starts while the checkpointed forward runs (note [a
    backward inside the checkpointed forward]), ``after_first`` for every later one (note [a
    second backward])."""

    def __init__(self, tracker: _ForwardTracker, factories, during_forward, after_first):
        super().__init__(*factories)
        self._tracker = tracker
        self._during_forward = tuple(during_forward)
        self._after_first = tuple(after_first)
        self._first_done = False

    def _chosen(self) -> tuple[Callable[[], Any], ...]:
        if self._tracker.running:
            return self._during_forward
        if self._first_done:
            return self._after_first
        self._first_done = True
        return self._factories


def _is_selective_saved(op, n: int) -> bool:
    return is_selective_saved(op)


def _context_fn(
    policy, respect_hooks, cache_hooks, guard_hooks, guarded: bool, buffers, user_context_fn, replay_rng: bool = False
):
    """The ``context_fn`` memopt hands ``torch.utils.checkpoint``: PyTorch's selective contexts
    (``"selective"`` or a policy function; ``respect_hooks`` is its ``respect_saved_tensors_hooks`` where torch has it,
    else ``cache_hooks`` pack its cache), the exactness guards of note [what a recompute may rely
    on] (``guarded``: eager only; ``guard_hooks`` pack their snapshots; ``replay_rng``: the
    recompute starts from the forward's RNG state), and the caller's own ``context_fn``
    innermost."""
    tracker = _ForwardTracker()
    forward, recompute, during_forward, after_first = [tracker.forward], [], [], []
    lowest_mode = None  # the lowest of this checkpoint's forward modes: what a recompute during the forward lifts
    if buffers:
        # Outermost: its copies happen outside selective checkpointing's dispatch modes.
        forward.append(buffers.forward)
        recompute.append(buffers.recompute)
        after_first.append(buffers.recompute)
    if policy != "full":
        if policy == "selective":
            policy_fn, is_cached = selective_checkpoint_policy, _is_selective_saved
        elif guarded:
            policy_fn = PolicyFunctionCall(policy)
            is_cached = policy_fn.is_saved
        else:
            policy_fn = policy  # torch.compile reads the function's answers, CPU offload included, itself
        # The guards decide about written cache entries (the note above), so the cache allows them.
        sac_forward, sac_recompute = create_selective_checkpoint_contexts(
            policy_fn, allow_cache_entry_mutation=guarded
        )
        if respect_hooks is not None:
            # What torch.utils.checkpoint sets on a caching mode it is handed directly.
            sac_forward.respect_saved_tensors_hooks = respect_hooks
        if not guarded and not buffers and user_context_fn is None:
            return sac_forward, sac_recompute  # under torch.compile: PyTorch's own modes, as they are
        if guarded:
            policy_name = repr(policy) if isinstance(policy, str) else getattr(policy, "__qualname__", repr(policy))
            state = _SelectiveGuardState(guard_hooks, is_cached, policy_name, buffers or None, replay_rng)
            _guard_modes(sac_forward, sac_recompute, state)
            if buffers:
                buffers.watched_by_caching_mode = True  # the caching mode calls its before_op
        lowest_mode = sac_forward
        if isinstance(policy_fn, PolicyFunctionCall):
            sac_forward = _CacheEntriesToHost(sac_forward, policy_fn, cache_hooks)
        if cache_hooks is not None:
            sac_forward = _PackCachedWithHooks(sac_forward, cache_hooks)
        forward.append(lambda: sac_forward)
        recompute.append(lambda: sac_recompute)
    if lowest_mode is not None:
        # First, so that the buffers' copies below run without this checkpoint's forward modes.
        during_forward.append(lambda: _SuspendedModes(lowest_mode))
    if buffers:
        during_forward.append(functools.partial(buffers.recompute, every_buffer=True))
    if user_context_fn is not None:
        user_forward, user_recompute = user_context_fn()
        forward.append(lambda: user_forward)
        recompute.append(lambda: user_recompute)
        during_forward.append(lambda: user_recompute)
        after_first.append(lambda: user_recompute)
    return _Contexts(*forward), _RecomputeContexts(tracker, recompute, during_forward, after_first)


def _refuse_debug():
    raise ValueError(
        "memopt.checkpoint: debug=True needs policy='full', no context_fn, and a function whose modules "
        "have no buffers (torch's debug mode takes no context_fn; 'selective', a policy function and "
        "memopt's buffer guard are one each)"
    )


def checkpoint(
    fn: Callable,
    /,
    *args,
    policy: str | Callable = "selective",
    offload: bool | Offload = False,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    context_fn: Callable | None = None,
    respect_saved_tensors_hooks: bool = True,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)``, saving for backward only what ``policy`` says.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``:
    same call shape, non-reentrant semantics (keyword arguments, nested structures and
    non-tensor outputs work, ``torch.autograd.grad`` works), and the RNG state is restored for
    the recompute so dropout draws the same mask twice.

    Args:
        fn: the function (or module) to run; its outputs are returned unchanged. Positional
            only: keyword arguments named ``fn``, ``function`` or ``early_stop`` are passed to it
            (``torch.utils.checkpoint`` would take the last two as its own).
        *args, **kwargs: passed to ``fn``.
        policy: ``"selective"`` (default) saves the outputs of matmuls and attention kernels
            (:data:`memopt.policy.SELECTIVE_SAVED_OPS`) and recomputes everything else; ``"full"`` saves only
            the inputs and recomputes all of ``fn``; ``"none"`` runs ``fn`` as is. Or a PyTorch
            selective-checkpoint policy function ``policy(ctx, op, *args, **kwargs) ->
            torch.utils.checkpoint.CheckpointPolicy``: the op outputs it saves are saved (and
            guarded as ``"selective"``'s are), the rest recomputed; outputs it marks
            ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` are saved and, once ``fn``'s forward is
            done, packed with memopt's engine (the active ``memopt.Offload``, else the process
            default; see :mod:`memopt.policy`).
        offload: where what ``policy`` saves lives (see :mod:`memopt.policy`): False, on the
            device; True, in host memory through the active ``memopt.Offload`` (the call is a
            new group in it) or else the process default (``memopt.offload.default_offload``);
            a ``memopt.Offload``, through that one. Tensor arguments that need no gradient
            (masks, rotary tables) stay on the device: the caller holds them, so moving them
            would free nothing. With ``"full"`` the checkpoint keeps only the
            inputs, and they go to the host too (PyTorch's non-reentrant checkpoint saves them
            through the saved-tensor hooks), so the device keeps no activation of the call
            between forward and backward. On CPU tensors offload is a no-op (see ``memopt.offload``).
        preserve_rng_state: as in ``torch.utils.checkpoint``; keep True when ``fn`` uses dropout.
        use_reentrant: accepted for drop-in compatibility; only False (or None) is supported.
        determinism_check: as in ``torch.utils.checkpoint`` (``"default"`` or ``"none"``).
        debug: as in ``torch.utils.checkpoint`` (a trace of the recompute when the determinism
            check fails); with ``policy="full"`` only, on a function whose modules have no buffers
            (torch's debug mode takes no ``context_fn``, and memopt's buffer guard is one).
            ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)`` likewise applies to
            those calls only; memopt's other checkpoints run without it.
        context_fn: as in ``torch.utils.checkpoint``: ``() -> (forward_context, recompute_context)``,
            entered inside memopt's own contexts (with ``"selective"``, inside PyTorch's selective
            checkpointing, so a ``TorchDispatchMode`` there sees the ops it recomputes).
        respect_saved_tensors_hooks: with ``"selective"``, whether the tensors its cache keeps go
            through the ``saved_tensors_hooks`` active around the call (``memopt.offload``,
            ``memopt.SavedTensorCounter``), as PyTorch's argument of that name. memopt's default is
            True (PyTorch's is still False).

    Returns:
        whatever ``fn`` returns.

    Exactness (note [what a recompute may rely on] in this file): an in-place update of a saved
    matmul output inside ``fn`` is replayed from a copy taken just before it; buffers that
    ``fn``'s modules update in training (BatchNorm's running statistics, spectral norm's power
    iteration) are updated once per step, not again by the recompute, and the recompute reads
    them as the forward started; a saved random op (a policy function that keeps a dropout mask,
    an attention kernel with dropout under ``"selective"``) leaves the generator where the
    forward did, so later random ops draw the same numbers; the parameters the modules of ``fn``
    hold when the forward starts are the ones every recompute runs on (``torch.func.functional_call``
    puts the model's own back before the backward). A second backward through the region
    (``create_graph=True`` then a backward through that graph, ``retain_graph=True``,
    ``gradcheck``) recomputes plainly under ``"selective"`` and policy functions, as ``"full"``
    would, where PyTorch's selective checkpointing raises ("backward an extra time").

    With gradients off (``torch.no_grad``, ``torch.inference_mode``) and no forward-mode AD,
    ``fn`` runs directly, as ``torch.utils.checkpoint`` runs it there: nothing is saved, and the
    checkpoint's host work would be overhead only (:func:`memopt._records_graph.records_graph`).
    """
    if not callable(fn):
        raise TypeError(f"memopt.checkpoint: fn must be callable, got {type(fn).__name__}")
    check_policy(policy, "memopt.checkpoint", functions=True)
    check_offload(offload, "memopt.checkpoint")
    if use_reentrant:
        raise ValueError(
            "memopt.checkpoint: use_reentrant must be False or None; memopt uses non-reentrant checkpointing"
        )
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"memopt.checkpoint: context_fn must be callable or None, got {type(context_fn).__name__}")
    if context_fn is not None and policy == "none":
        raise ValueError("memopt.checkpoint: context_fn has nothing to wrap: policy='none' recomputes nothing")
    if not isinstance(respect_saved_tensors_hooks, bool):
        raise TypeError(
            f"memopt.checkpoint: respect_saved_tensors_hooks must be a bool, got {respect_saved_tensors_hooks!r}"
        )
    if not isinstance(debug, bool):
        raise TypeError(f"memopt.checkpoint: debug must be a bool, got {debug!r}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"memopt.checkpoint: preserve_rng_state must be a bool, got {preserve_rng_state!r}")
    if determinism_check not in ("default", "none"):
        raise ValueError(f"memopt.checkpoint: determinism_check must be 'default' or 'none', got {determinism_check!r}")
    compiling = torch.compiler.is_compiling()
    if debug and policy != "none" and (policy != "full" or context_fn is not None):
        _refuse_debug()  # the part that needs no module walk; the buffers' below
    if compiling and context_fn is not None and policy != "full":
        raise ValueError(
            "memopt.checkpoint: under torch.compile, policy='selective' or a policy function cannot take a context_fn "
            "(torch.compile needs the selective checkpoint's own dispatch modes)"
        )
    if not records_graph((args, kwargs), None):
        # Gradients off (torch.no_grad, inference_mode) and no forward-mode AD: nothing would be
        # saved, and torch.utils.checkpoint runs fn plainly there too (so a fn that turns
        # gradients on inside keeps what it keeps under torch's checkpoint); the checkpoint's
        # frame, RNG stash and module walks cost a small MLP 2.3-2.7x its own forward.
        return fn(*args, **kwargs)
    if offload:
        # Inputs that need no gradient (attention masks, rotary tables) are held by the caller,
        # usually for every layer: moving them would free nothing.
        held_inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not t.requires_grad]
        with offload_group(offload, keep_on_device=held_inputs):
            return checkpoint(
                fn,
                *args,
                policy=policy,
                preserve_rng_state=preserve_rng_state,
                determinism_check=determinism_check,
                debug=debug,
                context_fn=context_fn,
                respect_saved_tensors_hooks=respect_saved_tensors_hooks,
                **kwargs,
            )
    if policy == "none":
        return fn(*args, **kwargs)
    # Under torch.compile the contexts must be PyTorch's own dispatch modes (its partitioner
    # decides what is saved, and functionalization replays in-place updates): no guards there.
    guarded = not compiling
    # One walk over the checkpointed modules (every call makes one) serves both guards below.
    modules = submodules(_checkpointed_modules(fn, args, kwargs)) if guarded else []
    # None under compile: the context_fn's arguments must be constants dynamo can guard on.
    buffers = _BufferGuard(modules) if guarded else None
    buffers = buffers if buffers else None
    global_debug = torch.utils.checkpoint._checkpoint_debug_enabled
    takes_debug = policy == "full" and context_fn is None and not buffers  # torch's debug mode runs
    if debug and not takes_debug:
        _refuse_debug()
    # The global switch (set_checkpoint_debug_enabled(True)) applies where debug can run; the
    # other calls run without it (no_global_debug below), as the docstring says.
    wants_debug = debug or (global_debug is True and takes_debug)
    options: dict[str, Any] = {
        "use_reentrant": False,
        "preserve_rng_state": preserve_rng_state,
        "determinism_check": determinism_check,
        "debug": wants_debug,
    }
    if policy != "full" or buffers or context_fn is not None:
        outer_hooks = None if compiling else _hooks_around_call()
        respect_hooks = respect_saved_tensors_hooks if _CHECKPOINT_RESPECTS_HOOKS else None
        if respect_hooks is not None:
            options["respect_saved_tensors_hooks"] = respect_hooks
        cache_hooks = outer_hooks if respect_saved_tensors_hooks and not _CHECKPOINT_RESPECTS_HOOKS else None
        guard_hooks = outer_hooks if respect_saved_tensors_hooks else None
        options["context_fn"] = functools.partial(
            _context_fn, policy, respect_hooks, cache_hooks, guard_hooks, guarded and policy != "full",
            buffers, context_fn, preserve_rng_state,
        )  # fmt: skip
    # torch's global debug switch cannot trace a checkpoint with a context_fn (it raises): memopt's
    # calls that need one run without it (documented above).
    no_global_debug = (
        torch.utils.checkpoint.set_checkpoint_debug_enabled(None)
        if "context_fn" in options and global_debug
        else contextlib.nullcontext()
    )
    if guarded and torch.is_grad_enabled() and any(is_cache(v) for v in (*args, *kwargs.values())):
        fn = _CacheAsCalled(fn, args, kwargs)
    if modules and torch.is_grad_enabled():
        fn = ParametersAsCalled(fn, modules)  # note [what a recompute may rely on], 4
    if not _TORCH_CHECKPOINT_NAMES.isdisjoint(kwargs):  # kwargs is this call's own dict
        fn = functools.partial(fn, **{name: kwargs.pop(name) for name in _TORCH_CHECKPOINT_NAMES.intersection(kwargs)})
    with no_global_debug:
        return torch.utils.checkpoint.checkpoint(fn, *args, **options, **kwargs)
