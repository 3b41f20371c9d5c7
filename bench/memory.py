"""Device-independent memory accounting for one training step.

``LiveTensorTracker`` follows every storage that an aten op allocates while it is active and
notices when it is freed, so it can say how many bytes a forward pass leaves alive for the
backward (the activation memory) and the peak during forward and backward, on CPU as on GPU.
It sees what ``saved_tensors_hooks`` cannot: layer inputs that ``torch.utils.checkpoint`` keeps
by reference, tensors cached by selective checkpointing, host copies made by offload.

It does not see allocations that bypass the dispatcher (the generated code of
``torch.compile``/inductor, allocator caches), so compiled configurations report no tracked
bytes; on GPU, ``torch.cuda.max_memory_allocated`` is the ground truth for those.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _key(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


class LiveTensorTracker(TorchDispatchMode):
    """Bytes of op-allocated storages alive now and at peak, per device.

    Storages that already existed when the tracker started (parameters, inputs, anything in
    ``exclude``) and views of them are never counted.

    Example::

        with LiveTensorTracker(exclude=model.parameters()) as tracker:
            loss = model(x).sum()
            held = tracker.live_bytes()   # what the graph keeps for backward (and the loss)
            loss.backward()
        tracker.peak_bytes()
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._excluded = {_key(t) for t in exclude if isinstance(t, torch.Tensor)}
        self._live: dict[tuple[int, str], int] = {}
        self._current: dict[str, int] = defaultdict(int)
        self._peak: dict[str, int] = defaultdict(int)

    def _freed(self, key: tuple[int, str]) -> None:
        nbytes = self._live.pop(key, 0)
        self._current[key[1]] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), str(t.device))
            if key in self._live or key in self._excluded or storage.nbytes() == 0:
                continue
            self._live[key] = storage.nbytes()
            self._current[key[1]] += storage.nbytes()
            self._peak[key[1]] = max(self._peak[key[1]], self._current[key[1]])
            weakref.finalize(storage, self._freed, key)
        return out

    def live_bytes(self, device: str | None = None) -> int:
        """Bytes alive now, on ``device`` (e.g. ``"cpu"``, ``"cuda:0"``) or on all devices."""
        if device is not None:
            return self._current.get(device, 0)
        return sum(self._current.values())

    def peak_bytes(self, device: str | None = None) -> int:
        """Highest ``live_bytes(device)`` seen since the tracker started; with no device, the
        largest of the per-device peaks."""
        if device is not None:
            return self._peak.get(device, 0)
        return max(self._peak.values(), default=0)
