"""Count the bytes a computation saves for backward, on any device.

The count goes through ``torch.autograd.graph.saved_tensors_hooks``: every tensor that autograd
keeps for the backward pass is seen once, deduplicated by storage (views of one buffer count
once), so the figure is exact and needs no GPU. Parameters and the inputs themselves are left
out by default: they exist whether or not anything is saved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def storage_key(t: torch.Tensor) -> tuple[int, str] | None:
    """What identifies ``t``'s storage: views of one buffer share it. None for a tensor without a
    storage of its own (asking raises): an efficient zero tensor (forward-mode AD's zero tangent,
    which ``F.linear`` saves there), which holds no memory, and a sparse tensor or a wrapper
    subclass (a jagged nested tensor, a DTensor, a torchao quantized tensor), whose memory is in
    the tensors it is made of (:func:`storages`)."""
    if t.layout != torch.strided or t._is_zerotensor() or is_traceable_wrapper_subclass(t):
        return None
    return t.untyped_storage().data_ptr(), str(t.device)


def storages(t: torch.Tensor) -> list[tuple[tuple[int, str], int]]:
    """``(storage_key, bytes)`` of each storage holding ``t``'s data: its own, or those of the
    index and value tensors of a sparse tensor or the inner tensors of a wrapper subclass; none
    for an efficient zero tensor."""
    key = storage_key(t)
    if key is not None:
        return [(key, t.untyped_storage().nbytes())]
    return [found for part in _parts(t) for found in storages(part)]


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors a tensor without a storage of its own is made of."""
    if t.layout == torch.sparse_coo:
        return t._indices(), t._values()
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices(), t.values()
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return t.ccol_indices(), t.row_indices(), t.values()
    if is_traceable_wrapper_subclass(t):  # a jagged nested tensor, a DTensor, a quantized weight
        names, _ = t.__tensor_flatten__()
        return tuple(part for part in (getattr(t, name) for name in names) if isinstance(part, torch.Tensor))
    if t._is_zerotensor():
        return ()
    raise TypeError(f"memopt.saved: cannot tell which storages hold a saved tensor of layout {t.layout} (counted it would be 0 bytes)")


class SavedTensorCounter:
    """Context manager that records every tensor saved for backward inside it.

    Example::

        with memopt.SavedTensorCounter(exclude=model.parameters()) as counter:
            loss = model(x).sum()
        print(counter.total_bytes)

    Attributes:
        total_bytes: bytes of distinct storages saved (excluded ones left out).
        bytes_by_device: the same split by device string (``"cpu"``, ``"cuda:0"``).
        num_tensors: saved tensors seen, before deduplication (excluded ones left out).

    Args:
        exclude: tensors whose storages are not counted (parameters, inputs).
        on_save: called as ``on_save(tensor, storage_key, storage_nbytes)`` for every storage of
            a saved tensor that is counted (before deduplication: once per saved view; once per
            component storage of a sparse tensor or wrapper subclass), so a caller can
            classify storages its own way (``memopt.plan`` splits them by where an offload
            engine would keep them).
    """

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        on_save: Callable[[torch.Tensor, tuple[int, str], int], None] | None = None,
    ):
        if on_save is not None and not callable(on_save):
            raise TypeError(f"memopt.SavedTensorCounter: on_save must be callable or None, got {type(on_save).__name__}")
        self._excluded: set = set()
        self._exclude(exclude, "memopt.SavedTensorCounter")
        self._storages: dict[tuple[int, str], int] = {}
        self._on_save = on_save
        self.num_tensors = 0
        self._hooks = None

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self._exclude(tensors, "memopt.SavedTensorCounter.exclude")

    def _exclude(self, tensors, owner: str) -> None:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Iterable):
            raise TypeError(f"{owner}: exclude must be an iterable of tensors, got {type(tensors).__name__}")
        # None stands for an absent optional tensor (a norm without bias) and is skipped.
        tensors = [t for t in tensors if t is not None]
        wrong = sorted({type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)})
        if wrong:
            raise TypeError(
                f"{owner}: exclude must be an iterable of tensors (or None), got elements of type {', '.join(wrong)}"
            )
        self._excluded.update(key for t in tensors for key, _ in storages(t))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        found = storages(t)  # none for a zero tensor: seen, no bytes
        counted = [(key, nbytes) for key, nbytes in found if key not in self._excluded]
        if counted or not found:
            self.num_tensors += 1
        for key, nbytes in counted:
            self._storages[key] = nbytes
            if self._on_save is not None:
                self._on_save(t, key, nbytes)
        return t

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def total_bytes(self) -> int:
        return sum(self._storages.values())

    @property
    def bytes_by_device(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, device), nbytes in self._storages.items():
            out[device] += nbytes
        return dict(out)


def saved_bytes(fn: Callable, *args, exclude: Iterable[torch.Tensor] = (), **kwargs) -> int:
    """Bytes saved for backward by ``fn(*args, **kwargs)``, deduplicated by storage.

    Tensor arguments (also inside tuples, lists and dicts of them), the parameters and buffers of
    ``fn`` when it is an ``nn.Module``, and the tensors in ``exclude`` are not counted. The result of ``fn`` is discarded; use
    :class:`SavedTensorCounter` to keep it.
    """
    if not callable(fn):
        raise TypeError(f"memopt.saved_bytes: fn must be callable, got {type(fn).__name__}")
    if isinstance(exclude, torch.Tensor) or not isinstance(exclude, Iterable):
        raise TypeError(f"memopt.saved_bytes: exclude must be an iterable of tensors, got {type(exclude).__name__}")
    excluded = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    excluded += list(exclude)
    if isinstance(fn, torch.nn.Module):
        excluded += list(fn.parameters()) + list(fn.buffers())
    with SavedTensorCounter(exclude=excluded) as counter:
        fn(*args, **kwargs)
    return counter.total_bytes
