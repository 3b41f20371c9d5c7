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
from torch.utils._pytree import tree_leaves


def storage_key(t: torch.Tensor) -> tuple[int, str]:
    """What identifies ``t``'s storage: views of one buffer share it."""
    return t.untyped_storage().data_ptr(), str(t.device)


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
        on_save: called as ``on_save(tensor, storage_key, storage_nbytes)`` for every saved
            tensor that is counted (before deduplication: once per saved view), so a caller can
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
        self._excluded.update(storage_key(t) for t in tensors)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._excluded:
            self.num_tensors += 1
            nbytes = t.untyped_storage().nbytes()
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
