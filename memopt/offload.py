"""Activation offload: saved tensors go to host memory on side CUDA streams and come back a layer ahead.

Recompute trades memory for FLOPs; offload trades it for host-link bandwidth. Under
:func:`offload`, every tensor autograd saves for backward (through
``torch.autograd.graph.saved_tensors_hooks``) that is large enough is copied to a pinned host
buffer on a dedicated stream, and its device memory is freed as soon as nothing else holds it.
In backward, the first time a tensor of group ``g`` (one group per layer) is needed, the copies
of groups ``g-1 .. g-prefetch`` back to the device start, so they overlap layer ``g``'s backward.

Usage::

    off = memopt.offload(min_bytes=2**20, prefetch=1)
    groups = memopt.offload_module_groups(off, model.layers)   # one group per layer
    for batch in data:
        with off:
            loss = model(batch).sum()
        loss.backward()
    print(off.stats())

Guarantees:

* Results and gradients are bit-identical to running without offload (the bytes make a round
  trip; nothing is recomputed or converted).
* A tensor modified in place after it was saved raises at backward, as plain autograd does
  ("modified by an inplace operation", with its shape and versions). While saved-tensors hooks
  are active autograd checks no version itself: the engine checks what it copies, and
  ``Offload`` what it leaves where it is (parameters, tensors under ``min_bytes`` or refused by
  the budget, CPU tensors, inputs kept on the device).
* Views of one storage come back as views of one restored storage; a storage saved twice (a
  tensor saved by two ops, or two views of it) is copied once.
* Parameters (and views of them), tensors below ``min_bytes``, non-strided tensors and tensor
  subclasses stay where they are. CPU tensors stay where they are: on CPU, offload is a no-op.
* Host memory stays under ``max_host_bytes``, counted in the pool's size classes: a copy holds the
  size class of its bytes, and a staging buffer that of the bytes packed into it so far (not
  ``staging_bytes``). A tensor that fits what is left is taken, coalesced or not; past the budget
  it stays on the device and is counted in ``stats()["refused_tensors"]``.
* Host buffers are pooled by size class and reused across steps: once warm, a step allocates no
  host memory.
* Under ``policy="full", offload=...`` (``FusedCheckpointBlock``, ``memopt.checkpoint``,
  ``memopt.wrap``) the saved tensors are the layer inputs themselves (PyTorch's non-reentrant
  checkpoint saves its inputs through these hooks too): the device keeps O(1) layers of
  activations whatever the depth, and ``max_host_bytes`` decides how many layers' inputs (the
  first ones) fit on the host; the others stay on the device (``tests/test_offload_inputs.py``).

The engine API (what ``offload=True`` in the transformer block calls)
---------------------------------------------------------------------

:class:`OffloadEngine` is the native engine (``torch.classes.memopt.OffloadEngine``) behind a
small Python class:

* ``handle = engine.pack(tensor) -> int``: start the copy of ``tensor``'s storage to the host
  (or reuse the copy of a storage already packed at the same version). Returns ``-1`` when the
  host budget refuses it: keep ``tensor`` itself then. The engine does not apply ``min_bytes``
  or the parameter rule; the caller decides what to pack.
* ``engine.unpack(handle) -> Tensor``: the tensor back on its device (same sizes, strides,
  storage offset and dtype), ordered on the current stream. Raises if the tensor was modified in
  place since ``pack``. May be called again (a second backward with ``retain_graph``).
* ``engine.release(handle)``: the handle is no longer needed; its host block returns to the pool
  when every handle of its copy is released. ``OffloadHandle`` objects do this when collected.
* ``engine.begin_group() -> int`` / ``engine.end_group()``: open the next group / close the
  current one (flushing coalesced small tensors). Groups are numbered in forward order.
  ``begin_group`` also waits (on the host) for the copies out of the group before last, so at
  most two groups' device memory waits on the host link (double buffering).
* ``engine.prefetch_group(group)``: start the copies of ``group`` back to the device now. The
  engine does this itself for ``prefetch`` groups ahead at the first unpack of each group.
* ``engine.stats() -> dict``, ``engine.synchronize()``.

Limits:

* Offload saves device memory only for tensors nothing else holds: an activation kept alive by
  the next layer (a residual stream) is copied but not freed until that layer lets go of it.
* The whole storage of a saved view is copied (a small slice of a large buffer copies the buffer).
* The last group is copied out and straight back at the start of backward: run the last layer
  (and the loss) outside the ``with`` to keep its tensors on the device.
* Tensors that do not share a version counter but share storage (made with ``set_``) could be
  deduplicated across an in-place write; views and ``detach()`` share the counter and are safe.
* Not tested under ``torch.compile`` (tensor subclasses, fake tensors included, are left alone).
* No CUDA graphs: the engine waits on the host and reuses pinned blocks, so every engine call
  raises while the current stream is capturing. Keep offloaded layers out of captured regions.
* ``stats()`` waits for the timing events of past stalls: call it between steps, not inside one.
* Host blocks for CUDA tensors are pinned with ``cudaHostAlloc`` at the pool's size classes, not
  through torch's pinned allocator (which rounds to powers of two and caches what the pool
  evicts), so ``max_host_bytes`` bounds the pinned memory itself. Freeing one (eviction, engine
  teardown) waits for the device.
* A prefetch that hits a device out-of-memory error is dropped (``prefetches_skipped_oom``); the
  group's tensors are copied back on demand when unpacked.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from memopt._extension import build_info, require_cuda_kernels
from memopt.saved import storage_key

__all__ = [
    "Offload", "OffloadEngine", "OffloadHandle", "default_offload", "offload", "offload_group", "offload_module_groups",
]  # fmt: skip

DEFAULT_MIN_BYTES = 2**20
DEFAULT_COALESCE_BYTES = 4 * 2**20
DEFAULT_STAGING_BYTES = 64 * 2**20


def _check_nonnegative_int(value, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        expected = "a non-negative int below 2**63 or None" if allow_none else "a non-negative int below 2**63"
        raise ValueError(f"memopt.offload: {name} must be {expected}, got {value!r}")


class OffloadEngine:
    """The native offload engine; see the module docstring for the API and its guarantees.

    Args:
        max_host_bytes: host bytes the pool may hold (None: no limit).
        pin_memory: pinned host buffers for CUDA tensors (needed for asynchronous copies).
        allow_cpu_source: accept CPU tensors as if they were device tensors (tests: the full
            pack/copy/unpack path on pageable memory). Without it, ``pack`` rejects CPU tensors.
        prefetch: groups restored ahead of the one being unpacked.
        coalesce_bytes: storages smaller than this are packed into one staging buffer per group
            and copied in one transfer.
        staging_bytes: the most bytes one coalesced transfer holds.
    """

    def __init__(
        self,
        max_host_bytes: int | None = None,
        pin_memory: bool = True,
        allow_cpu_source: bool = False,
        prefetch: int = 1,
        coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ):
        _check_nonnegative_int(max_host_bytes, "max_host_bytes", allow_none=True)
        _check_nonnegative_int(prefetch, "prefetch")
        _check_nonnegative_int(coalesce_bytes, "coalesce_bytes")
        _check_nonnegative_int(staging_bytes, "staging_bytes")
        for name, flag in (("pin_memory", pin_memory), ("allow_cpu_source", allow_cpu_source)):
            if not isinstance(flag, bool):
                raise TypeError(f"memopt.offload: {name} must be a bool, got {flag!r}")
        if staging_bytes < coalesce_bytes:
            raise ValueError(
                f"memopt.offload: staging_bytes must be >= coalesce_bytes ({coalesce_bytes}), got {staging_bytes}"
            )
        self.allow_cpu_source = bool(allow_cpu_source)
        self._engine = torch.classes.memopt.OffloadEngine(
            -1 if max_host_bytes is None else max_host_bytes,
            bool(pin_memory) and build_info()["with_cuda"],
            self.allow_cpu_source,
            coalesce_bytes,
            staging_bytes,
            prefetch,
        )

    def pack(self, tensor: torch.Tensor) -> int:
        """Start offloading ``tensor`` (any shape); a handle, or -1 when the host budget refuses it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"memopt.OffloadEngine.pack: tensor must be a tensor, got {type(tensor).__name__}")
        if tensor.is_cuda:
            require_cuda_kernels("offload", tensor)
        return self._engine.pack(tensor)

    def unpack(self, handle: int) -> torch.Tensor:
        """The tensor packed under ``handle``, on its device with its sizes and strides."""
        return self._engine.unpack(handle)

    def release(self, handle: int) -> None:
        """Forget ``handle``; unknown handles are ignored."""
        self._engine.release(handle)

    def begin_group(self) -> int:
        """Close the current group and open the next; returns the new group's number."""
        return self._engine.begin_group()

    def end_group(self) -> None:
        """Close the current group: coalesced small tensors are copied out now."""
        self._engine.end_group()

    def current_group(self) -> int:
        return self._engine.current_group()

    def prefetch_group(self, group: int) -> None:
        """Start copying ``group``'s tensors back to the device."""
        self._engine.prefetch_group(group)

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""
        self._engine.synchronize()

    def stats(self) -> dict:
        """Counters: bytes and copies each way, pool bytes held/in use and hits/misses, refusals,
        prefetched vs on-demand restores, stalls, ``wait_seconds`` (time the consumer stream
        waited on a restore that had not finished) and ``throttle_seconds`` (time the host waited
        in ``begin_group`` for the copies out of the group before last)."""
        out = dict(self._engine.stats())
        out["wait_seconds"] = out.pop("wait_ns") / 1e9
        out["throttle_seconds"] = out.pop("throttle_ns") / 1e9
        return out


class OffloadHandle:
    """What a saved-tensor pack hook returns for an offloaded tensor; releases it when collected."""

    __slots__ = ("engine", "id", "__weakref__")

    def __init__(self, engine: OffloadEngine, handle: int):
        self.engine = engine
        self.id = handle

    def __del__(self):
        try:
            self.engine.release(self.id)
        except Exception:  # noqa: BLE001  (interpreter shutdown: the engine may be gone already)
            pass


class _Kept:
    """What the pack hook returns for a saved tensor it leaves where it is (see ``Offload._pack``):
    the tensor and its version at save time. While saved-tensors hooks are active autograd checks
    no version counter itself, so ``Offload._unpack`` does, as the engine does for what it copies."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int):
        self.tensor = tensor
        self.version = version


def _scalar_type_name(dtype: torch.dtype) -> str:
    """c10's name of ``dtype`` ("Double", "BFloat16"), as the engine's error message prints it."""
    try:
        return torch.empty((), dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    except Exception:  # noqa: BLE001  (a dtype without a legacy tensor type name)
        return str(dtype).removeprefix("torch.")


def _modified_in_place(t: torch.Tensor, saved_version: int, version: int) -> RuntimeError:
    # The engine's wording (csrc/offload.cpp, OffloadEngine::unpack), which follows autograd's.
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{_scalar_type_name(t.dtype)} {list(t.shape)}], which memopt.offload saved for backward, is at version "
        f"{version}; expected version {saved_version} instead. Hint: do not modify a tensor in place after autograd "
        "saved it, or clone it first."
    )


def is_parameter_like(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or another leaf that requires grad: the engine leaves these
    on the device (they outlive the step anyway)."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class Offload:
    """Context manager that offloads saved tensors; made by :func:`offload` (see its arguments).

    Enter it once per forward pass; the same object keeps its host pool across steps.
    """

    def __init__(
        self,
        min_bytes: int = DEFAULT_MIN_BYTES,
        prefetch: int = 1,
        max_host_bytes: int | None = None,
        pin_memory: bool = True,
        *,
        allow_cpu_source: bool = False,
        coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ):
        _check_nonnegative_int(min_bytes, "min_bytes")
        self.min_bytes = min_bytes
        self.engine = OffloadEngine(
            max_host_bytes=max_host_bytes,
            pin_memory=pin_memory,
            allow_cpu_source=allow_cpu_source,
            prefetch=prefetch,
            coalesce_bytes=coalesce_bytes,
            staging_bytes=staging_bytes,
        )
        self._hooks = None
        self.skipped_tensors = 0
        self._kept_storages: set[tuple[int, str]] = set()

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def should_offload(self, t: torch.Tensor) -> bool:
        """Whether this engine would move ``t`` (a tensor saved for backward) to the host: a
        plain strided tensor on a device it takes, not a parameter (or a view of one), not one of
        the storages kept on the device for the current call, and at least ``min_bytes``."""
        # Kept as they are: subclasses, sparse and quantized tensors, nested tensors, and an
        # efficient zero tensor (forward-mode AD's zero tangent), which has no storage to copy.
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized or t.is_nested or t._is_zerotensor():
            return False
        # is_cuda / is_cpu rather than t.device.type: building the device object costs ~0.5 us,
        # and this runs for every saved tensor.
        on_device = t.is_cuda or (t.is_cpu and self.engine.allow_cpu_source)
        if not on_device:
            return False
        if t.is_conj() or t.is_neg() or is_parameter_like(t):
            return False
        if self._kept_storages and storage_key(t) in self._kept_storages:
            return False
        return t.numel() * t.element_size() >= self.min_bytes

    @contextlib.contextmanager
    def _keeping_on_device(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """Inside, saved tensors sharing storage with ``tensors`` stay on the device (inputs the
        caller holds anyway: copying them would cost bandwidth and host memory, free nothing)."""
        keys = {storage_key(t) for t in tensors} - {None} - self._kept_storages
        self._kept_storages |= keys
        try:
            yield
        finally:
            self._kept_storages -= keys

    def _pack(self, t: torch.Tensor):
        # A tensor left where it is (not offloaded, or refused by the host budget) is returned
        # with its version: autograd checks none while these hooks are active, so _unpack does.
        if not self.should_offload(t):
            self.skipped_tensors += 1
            return _Kept(t, t._version)
        handle = self.engine.pack(t)
        if handle < 0:
            return _Kept(t, t._version)
        return OffloadHandle(self.engine, handle)

    def _unpack(self, packed):
        if type(packed) is _Kept:
            t = packed.tensor
            version = t._version
            if version != packed.version:
                raise _modified_in_place(t, packed.version, version)
            return t
        if isinstance(packed, OffloadHandle):
            return packed.engine.unpack(packed.id)
        return packed  # packed by other hooks (memopt.checkpoint composes its hooks with these)

    def next_group(self) -> int:
        """Mark a group (layer) boundary: tensors saved from now on belong to a new group."""
        return self.engine.begin_group()

    def stats(self) -> dict:
        """The engine's counters (see :meth:`OffloadEngine.stats`) plus ``skipped_tensors``
        (saved tensors left alone: small, parameters, CPU, subclasses)."""
        out = self.engine.stats()
        out["skipped_tensors"] = self.skipped_tensors
        return out

    def __enter__(self) -> "Offload":
        if self._hooks is not None:
            raise RuntimeError("memopt.offload: this Offload is already active; it cannot be entered twice")
        self.engine.begin_group()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        _ACTIVE.remove(self)
        hooks.__exit__(*exc)
        self.engine.end_group()


# The Offloads whose ``with`` is open, innermost last.
_ACTIVE: list[Offload] = []
_DEFAULT: Offload | None = None


def default_offload() -> Offload:
    """The process's one default :class:`Offload`, used by ``offload=True`` outside any active
    engine: made on first use with the engine's defaults (tensors of 1 MiB and more, one group
    ahead, pinned host memory when CUDA is available)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Offload(pin_memory=torch.cuda.is_available())
    return _DEFAULT


@contextlib.contextmanager
def offload_group(offload: "bool | Offload", keep_on_device: Iterable[torch.Tensor] = ()) -> Iterator[Offload]:
    """The one nesting rule of ``offload=`` (blocks, ``memopt.checkpoint``, ``memopt.wrap``): the
    tensors saved inside go to the host as one group of the engine this yields.

    ``offload=True`` takes the innermost active :class:`Offload`, else :func:`default_offload`;
    an ``Offload`` is taken as given. An engine that is already active gets a new group
    (``next_group``); one that is not is entered for the duration. Saved tensors sharing storage
    with ``keep_on_device`` (inputs the caller holds anyway) stay on the device.
    """
    if isinstance(offload, Offload):
        engine = offload
    elif offload is True:
        engine = _ACTIVE[-1] if _ACTIVE else default_offload()
    else:
        raise TypeError(f"memopt.offload_group: offload must be True or a memopt.Offload, got {offload!r}")
    with contextlib.ExitStack() as stack:
        if engine.active:
            engine.next_group()
        else:
            stack.enter_context(engine)
        stack.enter_context(engine._keeping_on_device(keep_on_device))
        yield engine


def offload(
    min_bytes: int = DEFAULT_MIN_BYTES,
    prefetch: int = 1,
    max_host_bytes: int | None = None,
    pin_memory: bool = True,
    *,
    allow_cpu_source: bool = False,
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> Offload:
    """A context manager that offloads tensors saved for backward to host memory.

    Args:
        min_bytes: tensors smaller than this (``numel * element_size``) stay on the device.
        prefetch: groups (layers) restored ahead of the one backward is in; 0 restores on demand.
        max_host_bytes: host bytes the pool may hold; past it tensors stay on the device (counted).
            None: no limit.
        pin_memory: pinned host buffers (asynchronous copies). False only for tests.
        allow_cpu_source: treat CPU tensors like device tensors (tests on machines without a GPU);
            by default CPU tensors are left where they are and offload is a no-op on CPU.
        coalesce_bytes: storages smaller than this are copied together, one transfer per group.
        staging_bytes: the most bytes one coalesced transfer holds.

    Returns:
        An :class:`Offload`; enter it around the forward pass (``with off: loss = model(x)``) and
        call ``off.next_group()`` between layers, or let :func:`offload_module_groups` do it.
    """
    return Offload(
        min_bytes=min_bytes,
        prefetch=prefetch,
        max_host_bytes=max_host_bytes,
        pin_memory=pin_memory,
        allow_cpu_source=allow_cpu_source,
        coalesce_bytes=coalesce_bytes,
        staging_bytes=staging_bytes,
    )


class _ModuleGroupHooks:
    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def offload_module_groups(off: Offload, modules: Iterable[nn.Module]) -> _ModuleGroupHooks:
    """Start a new offload group before each module's forward while ``off`` is active.

    Args:
        off: the :class:`Offload` whose groups are marked.
        modules: the layers, e.g. ``model.layers`` (an ``nn.ModuleList``), in forward order.

    Returns:
        An object with ``remove()`` that takes the hooks off again.
    """
    if not isinstance(off, Offload):
        raise TypeError(f"memopt.offload_module_groups: off must be a memopt.Offload, got {type(off).__name__}")

    def pre_hook(module, args):
        if off.active:
            off.next_group()

    if not isinstance(modules, Iterable):
        raise TypeError(
            f"memopt.offload_module_groups: modules must be an iterable of nn.Modules, got {type(modules).__name__}"
        )
    modules = list(modules)
    # Every item is checked before any hook is registered: a bad one leaves no hooks behind.
    for index, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(
                "memopt.offload_module_groups: modules must be nn.Modules, "
                f"got {type(module).__name__} at index {index}"
            )
    return _ModuleGroupHooks([module.register_forward_pre_hook(pre_hook) for module in modules])
