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

import functools
import inspect
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from memopt.offload import Offload, offload_group
from memopt.policy import check_offload, check_policy, selective_checkpoint_policy

_CHECKPOINT_RESPECTS_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)


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
    leaves, or a marker for a recomputed op.
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


def _selective_context_fn(outer_hooks):
    forward_context, recompute_context = create_selective_checkpoint_contexts(selective_checkpoint_policy)
    if outer_hooks is None:
        return forward_context, recompute_context
    return _PackCachedWithHooks(forward_context, outer_hooks), recompute_context


def checkpoint(
    fn: Callable,
    *args,
    policy: str = "selective",
    offload: bool | Offload = False,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    context_fn: Callable | None = None,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)``, saving for backward only what ``policy`` says.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``:
    same call shape, non-reentrant semantics (keyword arguments, nested structures and
    non-tensor outputs work, ``torch.autograd.grad`` works), and the RNG state is restored for
    the recompute so dropout draws the same mask twice.

    Args:
        fn: the function (or module) to run; its outputs are returned unchanged.
        *args, **kwargs: passed to ``fn``.
        policy: ``"selective"`` (default) saves the outputs of matmuls and attention kernels
            (:data:`memopt.policy.SELECTIVE_SAVED_OPS`) and recomputes everything else; ``"full"`` saves only
            the inputs and recomputes all of ``fn``; ``"none"`` runs ``fn`` as is.
        offload: where what ``policy`` saves lives (see :mod:`memopt.policy`): False, on the
            device; True, in host memory through the active ``memopt.Offload`` (the call is a
            new group in it) or else the process default (``memopt.offload.default_offload``);
            a ``memopt.Offload``, through that one. Tensor arguments that need no gradient
            (masks, rotary tables) stay on the device: the caller holds them, so moving them
            would free nothing. With ``"full"`` the checkpoint keeps only the
            inputs, which it holds itself, so there is nothing to move. On CPU tensors offload
            is a no-op (see ``memopt.offload``).
        preserve_rng_state: as in ``torch.utils.checkpoint``; keep True when ``fn`` uses dropout.
        use_reentrant: accepted for drop-in compatibility; only False (or None) is supported.
        determinism_check: as in ``torch.utils.checkpoint`` (``"default"`` or ``"none"``).
        debug: as in ``torch.utils.checkpoint`` (a trace of the recompute when the determinism
            check fails); with ``policy="full"`` only.
        context_fn: as in ``torch.utils.checkpoint``; only with ``policy="full"`` (``"selective"``
            is memopt's own context, ``"none"`` has no recompute).

    Returns:
        whatever ``fn`` returns.

    With ``"selective"`` each forward supports one backward: a second backward through the
    same graph (``retain_graph=True``, ``gradcheck``) raises ``RuntimeError``, as PyTorch's
    selective checkpointing does; ``"full"`` and ``"none"`` allow it.
    """
    if not callable(fn):
        raise TypeError(f"memopt.checkpoint: fn must be callable, got {type(fn).__name__}")
    check_policy(policy, "memopt.checkpoint")
    check_offload(offload, "memopt.checkpoint")
    if use_reentrant:
        raise ValueError(
            "memopt.checkpoint: use_reentrant must be False or None; memopt uses non-reentrant checkpointing"
        )
    if context_fn is not None and policy != "full":
        raise ValueError(
            f"memopt.checkpoint: context_fn needs policy='full' (policy={policy!r} "
            + ("is memopt's own selective context)" if policy == "selective" else "recomputes nothing)")
        )
    if debug and (policy == "selective" or context_fn is not None):
        raise ValueError(
            "memopt.checkpoint: debug=True needs policy='full' without context_fn (torch's debug mode "
            "does not take a context_fn, and 'selective' is one)"
        )
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
                **kwargs,
            )
    if policy == "none":
        return fn(*args, **kwargs)
    options: dict[str, Any] = {
        "use_reentrant": False,
        "preserve_rng_state": preserve_rng_state,
        "determinism_check": determinism_check,
        "debug": debug,
    }
    if context_fn is not None:
        options["context_fn"] = context_fn
    if policy == "selective":
        compiling = torch.compiler.is_compiling()
        if _CHECKPOINT_RESPECTS_HOOKS:
            options["respect_saved_tensors_hooks"] = True
            outer_hooks = None
        else:
            # Under torch.compile the context must be PyTorch's own dispatch modes, and hooks
            # play no part in tracing.
            outer_hooks = None if compiling else torch._C._autograd._top_saved_tensors_default_hooks(False)
        options["context_fn"] = functools.partial(_selective_context_fn, outer_hooks)
    return torch.utils.checkpoint.checkpoint(fn, *args, **options, **kwargs)
