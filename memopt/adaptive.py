"""Keep training when a batch does not fit: micro-batching that backs off on out-of-memory.

:class:`AdaptiveBatch` runs one optimizer step over a batch as micro-batches with gradient
accumulation. When a micro-step raises ``torch.OutOfMemoryError`` it rolls that micro-step back,
halves the micro-batch and retries from the same sample, so the step still sees every sample
exactly once and the gradient is that of the whole batch. :meth:`AdaptiveBatch.accumulate` does
the same without the optimizer step, for loops that step themselves (a Hugging Face ``Trainer``:
:mod:`memopt.integrations.transformers`).

What the snippets people copy get wrong, and what this does instead:

- *Dividing each micro-loss by the number of micro-steps* mis-weights an uneven last
  micro-batch. Here each micro-batch's mean loss is weighted by its share of the batch's
  samples (or of its tokens, with ``num_tokens``), so the accumulated gradient equals the
  gradient of the batch's mean loss exactly.
- *Catching OOM and moving on* drops the samples of the failed micro-batch and leaves the
  half-accumulated gradients of the failed backward in ``.grad``. Here the failed attempt's
  gradients are discarded and the ones accumulated before it restored bit for bit.
- *Retrying inside the ``except`` block* keeps the traceback alive, and with it every
  activation of the failed forward, so the retry runs out of memory again. Here the handler
  only records the failure; references are dropped, ``gc.collect()`` and
  ``torch.cuda.empty_cache()`` run, and then the retry starts.

A batch is a tensor, or a tuple/list (a namedtuple too) or mapping (a dict, a ``BatchEncoding``)
of them; a micro-batch has the batch's type (a mapping that cannot be built from a dict becomes a
dict). Micro-batches are cut along dimension 0 of every tensor of the batch, at any depth of its
tuples/lists/mappings (``{"x": x, "extra": {"weight": w}}`` cuts ``w`` too, and all must agree
on the batch size), or along ``batch_dim=`` (one dimension for all, or one per item, for every
tensor in it: None passes the item whole to each micro-batch, for a tensor every sample shares,
such as a ``(seq, seq)`` attention bias); other values go to every micro-batch as they are. A
model with a layer that declares ``batch_first=False`` (``nn.TransformerEncoderLayer`` and the
like: ``(seq, batch, d)`` inputs) is refused until ``batch_dim=`` says where the samples are:
cutting dimension 0 there would split the sequence and accumulate a wrong gradient without an
error. Only an out-of-memory error lowers the micro-batch: a batch shorter than it (an epoch's
last) runs whole and leaves it as it was.

Rollback is exact because every micro-step backpropagates into fresh ``.grad`` tensors while
the gradients accumulated so far are held aside, and is added to them only once it has
succeeded; after the first micro-step this costs one transient gradient-sized buffer. The
model's buffers (BatchNorm statistics, counters, caches) and the CPU and CUDA RNG states are
copied before each micro-step and put back when it fails, so the retry sees the model exactly as
the failed attempt did and draws the same dropout masks; this holds two copies of the buffers
and copies them once per micro-step. Out of
memory in ``optimizer.step()`` itself (Adam allocating its state on the first step) is not
retried: it propagates.

Under ``DistributedDataParallel`` every micro-step runs in ``no_sync()`` (a rank that ran out of
memory halfway through a synchronising backward would leave the other ranks waiting in the
bucket all-reduce forever); after each attempt the ranks all-reduce an OOM flag (MAX), agree on
the new micro-batch (MIN) and retry together, and the gradients are summed across ranks once,
after the last micro-step. Sample and token shares are taken of the global batch, so the result
is the gradient of the global mean loss (equal to DDP's averaging when ranks hold equal batches).
Every rank must pass a batch of the same size. An exception other than OOM on one rank leaves
the others waiting in the next all-reduce, as it would in plain DDP.

Under FSDP2 (a model sharded with ``torch.distributed.fsdp.fully_shard``) every micro-step's
backward reduce-scatters its gradient into fresh sharded ``.grad`` (FSDP's
``set_requires_gradient_sync`` must be on, its default), which are held aside and summed like
the unsharded ones, so a failed micro-step is rolled back exactly. Gradient sync is not turned
off between micro-steps: FSDP then keeps the accumulated gradient inside itself, unsharded, where
neither ``zero_grad()`` nor ``reset_iter_state()`` takes a failed backward's part out again
(measured, torch 2.14), and it costs a whole unsharded gradient per rank, the memory this class
exists to save. Without an OOM the whole batch is one micro-step, so one reduce-scatter per
batch either way. Each micro-batch's share is multiplied by the mesh size, so FSDP's averaging
over its data-parallel ranks gives the sum of the shares (default divide factor; not with
``set_gradient_divide_factor``). FSDP's forward all-gathers and backward reduce-scatters are
collectives inside the micro-step, so the ranks agree on OOM twice: after the forward (the
loss included) and after the backward. An OOM that one rank hits in the middle of either, while
its peers wait in a collective the failed rank never joins, leaves them waiting, as it would in
plain FSDP; one in the loss or the LM head, after the model's last all-gather, is recovered
from. Every rank runs every micro-step (a micro-batch with no tokens too: its loss must stay
finite). Other wrappers (FSDP1, DeepSpeed) are not supported.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from memopt.estimate import _declared_layouts, _names

__all__ = ["AdaptiveBatch", "MicroBatchFloorError", "StepResult"]

logger = logging.getLogger("memopt.adaptive")


class MicroBatchFloorError(RuntimeError):
    """Out of memory at the smallest allowed micro-batch; model and optimizer are unchanged."""


@dataclass
class StepResult:
    """What one :meth:`AdaptiveBatch.step` did.

    Attributes:
        loss: the batch's mean loss (detached), the weighted sum of the micro-batch losses.
        micro_batch: the micro-batch size the step ended with.
        micro_steps: successful micro-steps.
        oom_retries: micro-steps that ran out of memory and were retried smaller.
        skipped: True when the fp16 grad scaler found inf/NaN gradients and skipped the update.
    """

    loss: torch.Tensor
    micro_batch: int
    micro_steps: int
    oom_retries: int
    skipped: bool


def _is_container(value) -> bool:
    """A tuple/list (a namedtuple too) or mapping: what micro-batches look inside for tensors."""
    return isinstance(value, (Mapping, tuple, list))


def _pairs(container) -> list:
    return list(container.items()) if isinstance(container, Mapping) else list(enumerate(container))


def _leaves(value, name: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in ``value``, at any depth of tuples/lists/mappings, each
    named by its path from ``name`` (``'extra'['weight']``)."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if _is_container(value):
        return [leaf for key, item in _pairs(value) for leaf in _leaves(item, f"{name}[{key!r}]")]
    return []


def _tensor_dims(batch, batch_dim) -> list[tuple[str | None, torch.Tensor, int]]:
    """``(name, tensor, dim)`` for each tensor of ``batch`` that micro-batches cut, and the
    dimension ``batch_dim`` says holds its samples: ``batch`` itself (name None), or every tensor
    of a tuple/list/mapping batch, at any depth of its tuples/lists/mappings, named by its path
    (``'x'``, ``'extra'['weight']``). Other values are passed to every micro-batch as they are, and
    so is an item a per-item ``batch_dim`` gives None (see :func:`_item_dims`)."""
    if isinstance(batch, torch.Tensor):
        if not _is_int(batch_dim):
            raise ValueError(f"batch is a tensor: batch_dim must be an int, got {batch_dim!r}")
        items = [(None, batch, batch_dim)]
    elif _is_container(batch):
        items = [
            (name, tensor, dim)
            for key, dim in _item_dims(batch, batch_dim).items() if dim is not None
            for name, tensor in _leaves(batch[key], repr(key))
        ]  # fmt: skip
    else:
        raise TypeError(f"batch must be a tensor or a tuple/list/mapping of tensors, got {type(batch).__name__}")
    for name, tensor, dim in items:
        if tensor.dim() <= dim:
            what = "batch" if name is None else f"batch tensor {name}"
            if dim == 0:
                raise ValueError(f"{what} must have a leading batch dimension, got a 0-d tensor")
            raise ValueError(f"{what} has {tensor.dim()} dimensions, no dimension {dim} to split "
                             f"(batch_dim={batch_dim!r})")
    return items


def _item_dims(batch, batch_dim) -> dict[Any, int | None]:
    """The dimension each item (key or index) of a tuple/list/mapping batch is cut along, every
    tensor in it alike, or None for an item passed whole: ``batch_dim`` for every item when it is
    an int (an item holding no tensor has nothing to cut), else its entry in a tuple/list (a
    tuple/list batch) or dict (a mapping batch): an int for each item holding a tensor to cut, None
    for anything else (anything holding no tensor, a tensor every sample shares)."""
    # Mapping, not dict: transformers' collators return a BatchEncoding, a UserDict.
    pairs = _pairs(batch)
    if _is_int(batch_dim):
        return {key: batch_dim for key, _ in pairs}
    is_mapping = isinstance(batch, Mapping)
    if is_mapping and isinstance(batch_dim, dict):
        extra = [k for k in batch_dim if k not in batch]
        if extra:
            raise ValueError(f"batch_dim names {extra[0]!r}, not in the batch (keys {list(batch)})")
        dims = batch_dim
    elif not is_mapping and isinstance(batch_dim, (tuple, list)):
        if len(batch_dim) != len(batch):
            raise ValueError(f"batch_dim {batch_dim!r} has {len(batch_dim)} entries, the batch {len(batch)}: "
                             "one per item (an int for a tensor to cut, None for an item passed whole)")
        dims = dict(enumerate(batch_dim))
    else:
        kind = "mapping" if is_mapping else type(batch).__name__
        want = "an int or a dict" if is_mapping else "an int or a tuple/list"
        raise ValueError(f"batch is a {kind}: batch_dim must be {want} (one entry per item), got {batch_dim!r}")
    for key, value in pairs:
        holds = "tensor" if isinstance(value, torch.Tensor) else "item" if _leaves(value, "") else None
        if holds and key not in dims:
            how = "every tensor in it" if holds == "item" else "it"
            raise ValueError(f"batch_dim has no entry for the batch's {holds} {key!r}: give the dimension that "
                             f"holds the samples of {how}, or None to pass it whole to every micro-batch")
        if not holds and dims.get(key) is not None:
            raise ValueError(f"batch_dim[{key!r}] is {dims[key]!r}, but the batch's item {key!r} is not a tensor and "
                             "holds none (it is passed to every micro-batch as it is): give None")
    return {key: dims.get(key) for key, _ in pairs}


def _leading_size(batch, batch_dim=0) -> int:
    """The number of samples in ``batch``: the size of every cut tensor's batch dimension (see
    :func:`_tensor_dims`; dimension 0 by default), which must agree."""
    items = _tensor_dims(batch, batch_dim)
    if not items:
        if not _leaves(batch, ""):  # a tensor batch always has its one item
            raise ValueError("batch holds no tensor")
        raise ValueError(f"batch_dim={batch_dim!r} passes every tensor of the batch whole: give at least one the "
                         "dimension that holds its samples")
    sizes = {name: tensor.shape[dim] for name, tensor, dim in items}
    if len(set(sizes.values())) != 1:
        # A tensor every sample shares (an attention bias) is the usual culprit; say how to pass it.
        whole = ("; a tensor shared by every sample is passed whole to each micro-batch with None for its item in "
                 "a per-item batch_dim")
        shown = "{" + ", ".join(f"{name}: {size}" for name, size in sizes.items()) + "}"
        if all(dim == 0 for _, _, dim in items):
            raise ValueError(f"batch tensors must share their leading (batch) dimension, got sizes {shown}{whole}")
        raise ValueError(f"batch tensors must agree on their batch size (the dimension batch_dim={batch_dim!r} "
                         f"gives each), got sizes {shown}{whole}")
    return next(iter(sizes.values()))


def _rebuild(batch, values: list):
    """A container of ``batch``'s type holding ``values`` (in its order)."""
    if isinstance(batch, Mapping):
        pairs = dict(zip(batch.keys(), values))
        if type(batch) is dict:
            return pairs
        # The same type when it is built from a dict (BatchEncoding, OrderedDict), else a plain
        # dict (defaultdict takes a factory first; a read-only mapping may take nothing).
        try:
            rebuilt = type(batch)(pairs)
        except TypeError:
            return pairs
        return rebuilt if isinstance(rebuilt, Mapping) and list(rebuilt.keys()) == list(pairs) else pairs
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a namedtuple takes its fields apart
        return type(batch)(*values)
    return type(batch)(values)


def _slice(batch, start: int, stop: int, batch_dim=0):
    """Samples ``start:stop`` of ``batch`` (checked by :func:`_leading_size`): a view of each cut
    tensor along its batch dimension, in containers of the batch's types."""
    def cut(value, dim):
        if isinstance(value, torch.Tensor):
            return value[start:stop] if dim == 0 else value.narrow(dim, start, stop - start)
        if _is_container(value) and _leaves(value, ""):
            return _rebuild(value, [cut(item, dim) for _, item in _pairs(value)])
        return value  # holds no tensor: passed as it is

    if isinstance(batch, torch.Tensor):
        return cut(batch, batch_dim)
    dims = _item_dims(batch, batch_dim)
    return _rebuild(batch, [value if dims[key] is None else cut(value, dims[key]) for key, value in _pairs(batch)])


def _check_batch_dim(batch_dim) -> None:
    def is_dim(d):
        return _is_int(d) and d >= 0

    if batch_dim is None or is_dim(batch_dim):
        return
    if isinstance(batch_dim, (tuple, list, dict)):
        entries = batch_dim.values() if isinstance(batch_dim, dict) else batch_dim
        if all(d is None or is_dim(d) for d in entries):
            return
    raise ValueError(
        f"batch_dim must be a non-negative int (the dimension of every batch tensor that holds the samples), a "
        f"tuple/list or dict of them for a tuple/list or mapping batch (None for an item passed whole: anything "
        f"not a tensor, a tensor every sample shares), or None, got {batch_dim!r}"
    )


def _layers(names: list[str]) -> str:
    return "layer" if len(names) == 1 else "layers"


def _have(names: list[str]) -> str:
    return "has" if len(names) == 1 else "have"


def _default_batch_dim(model: torch.nn.Module) -> int:
    """0, unless a layer of ``model`` declares a sequence-first layout (``batch_first=False``):
    then where the batch is cannot be known, and splitting dimension 0 would cut the sequence."""
    layouts = _declared_layouts(model)
    if not layouts[False]:
        return 0
    how = ("pass batch_dim= saying where the batch tensors hold their samples: batch_dim=1 when every tensor is "
           "(seq, batch, ...), one per tensor when they differ (batch_dim=(1, 0) for (src, src_key_padding_mask), "
           "a dict for a dict batch), or batch_dim=0 when the model takes (batch, ...) inputs and transposes inside")
    if layouts[True]:
        raise ValueError(
            f"memopt.AdaptiveBatch: the model's layers disagree on where the batch is: {_names(layouts[False])} "
            f"{_have(layouts[False])} batch_first=False, {_names(layouts[True])} batch_first=True; micro-batches "
            f"cut along the wrong dimension would split sequences and give a wrong gradient; {how}"
        )
    raise ValueError(
        f"memopt.AdaptiveBatch: the model's {_layers(layouts[False])} {_names(layouts[False])} {_have(layouts[False])} "
        f"batch_first=False, a (seq, batch, ...) layout: micro-batches cut along dimension 0 (the default) would "
        f"split the sequence, not the samples, and give a wrong gradient; {how}"
    )


def _is_int(value) -> bool:
    """An int that is not a bool (True is an int in Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _is_fsdp2(model) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _is_fsdp1(model) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _ModelState:
    """A model's buffers and the RNG states its forward draws from, at one moment, to put back.

    Rolling a failed micro-step back must undo what its forward did besides gradients: BatchNorm
    statistics and ``num_batches_tracked``, counters, caches a module replaced, and the CPU and
    CUDA generator states its dropout consumed (memopt's dropout keys come from the CPU
    generator). It holds one copy of every buffer: version counters cannot say what changed
    (BatchNorm's running statistics are written without bumping them), so :meth:`capture` copies
    them all again.
    """

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._cuda_devices = sorted(
            {t.device for t in (*model.parameters(), *model.buffers()) if t.is_cuda}, key=str
        )
        # (module, buffer name) -> (the buffer object, a copy of its value)
        self._buffers: dict[tuple[torch.nn.Module, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture()

    def fork(self) -> "_ModelState":
        """An independent state equal to this one."""
        other = object.__new__(_ModelState)
        other.__dict__.update(self.__dict__)
        other._buffers = {key: (buf, copy.clone()) for key, (buf, copy) in self._buffers.items()}
        return other

    def _current(self):
        for module in self._model.modules():
            for name, buf in module.named_buffers(recurse=False):
                yield (module, name), buf

    def capture(self) -> None:
        """Record the buffers and RNG states now."""
        buffers = {}
        with torch.no_grad():
            for key, buf in self._current():
                known = self._buffers.get(key)
                if known is not None and known[0] is buf and known[1].shape == buf.shape:
                    known[1].copy_(buf)
                    buffers[key] = known
                else:
                    buffers[key] = (buf, buf.detach().clone())
        self._buffers = buffers
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(d) for d in self._cuda_devices]

    def restore(self) -> None:
        """Put the buffers (their objects and values) and the RNG states back as captured."""
        with torch.no_grad():
            for (module, name), _ in list(self._current()):
                if (module, name) not in self._buffers:  # added since the capture
                    delattr(module, name)
            for (module, name), (buf, copy) in self._buffers.items():
                if getattr(module, name, None) is not buf:
                    if hasattr(module, name):
                        setattr(module, name, buf)
                    else:
                        module.register_buffer(name, buf)
                buf.copy_(copy)
        torch.set_rng_state(self._cpu_rng)
        for device, state in zip(self._cuda_devices, self._cuda_rng):
            torch.cuda.set_rng_state(state, device)


class AdaptiveBatch:
    """One optimizer step per batch, as micro-batches that shrink on OOM and grow back.

    Example::

        def loss_fn(model, batch):            # mean loss over the micro-batch
            ids, targets = batch
            return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())

        stepper = memopt.AdaptiveBatch(model, optimizer, loss_fn, micro_batch=32, grow_after=100)
        for batch in loader:                  # (ids, targets), batch dimension first (see batch_dim)
            result = stepper.step(batch)      # optimizer.step() ran once over the whole batch
            optimizer.zero_grad(set_to_none=True)

    Args:
        model: the ``nn.Module`` (a DDP module, or one sharded with ``fully_shard``) whose parameters the optimizer steps.
        optimizer: a ``torch.optim.Optimizer``; stepped once per :meth:`step`.
        loss_fn: ``loss_fn(model, micro_batch) -> 0-d tensor``, the *mean* loss over the
            micro-batch's samples, or over its tokens when ``num_tokens`` is given.
        micro_batch: the first (and largest) micro-batch size; default: the whole batch.
        min_micro_batch: the floor. Out of memory at the floor raises
            :class:`MicroBatchFloorError` with the model, its gradients and the optimizer
            exactly as they were before :meth:`step`.
        grow_after: after this many consecutive steps without OOM, double the micro-batch
            (never above ``micro_batch``); ``None`` never grows.
        num_tokens: ``num_tokens(batch_or_micro_batch) -> int``, the number of loss terms
            (tokens with a label), for variable-length batches; default: samples.
        amp_dtype: ``torch.bfloat16`` or ``torch.float16`` runs ``loss_fn`` under
            ``torch.autocast``; ``None`` does not.
        grad_scaler: a ``torch.amp.GradScaler``; one is made for ``amp_dtype=torch.float16``.
            A step the scaler skips (inf/NaN gradients) is counted in ``skipped_steps`` and
            logged. :meth:`accumulate` leaves the gradient scaled, as
            ``scaler.scale(loss).backward()`` does, for the caller to step with this scaler, so
            it refuses the one made here (see there).
        backward: ``backward(loss)`` runs the backward of a micro-step's weighted loss instead of
            ``loss.backward()`` (``accelerator.backward``, which scales for mixed precision
            itself); not with ``grad_scaler``.
        pre_weighted: ``loss_fn`` already returns the micro-batch's share of the batch's loss (a
            sum over its samples or tokens divided by the whole batch's count, as Hugging Face
            models do with ``num_items_in_batch``): the micro-step losses are added as they are,
            unweighted.
        batch_dim: where each tensor of a batch holds its samples, the dimension micro-batches are
            cut along: an int for every tensor (at any depth of the batch's tuples/lists/mappings),
            or a tuple/list (a tuple/list batch) or dict (a mapping batch) with one int per item
            holding tensors to cut (every tensor in it) and None for each item passed to every
            micro-batch as it is: anything that holds no tensor, and a tensor every sample shares
            (a ``(seq, seq)`` attention bias). The cut tensors' sizes there must agree.
            ``None`` (the default) is 0, a ``(batch, ...)`` layout, unless a layer of the model
            declares a sequence-first layout (a bool ``batch_first`` attribute that is False:
            ``nn.MultiheadAttention``, so ``nn.TransformerEncoderLayer``/``DecoderLayer``;
            ``nn.Transformer``, ``nn.LSTM``/``GRU``/``RNN``, ``FusedCheckpointBlock``): the
            constructor then raises ``ValueError`` naming those layers, because cutting dimension
            0 of a ``(seq, batch, d)`` input splits the sequence and accumulates a wrong gradient.
            Say ``batch_dim=1`` for ``(seq, batch, ...)`` tensors, ``batch_dim=(1, 0)`` for
            ``(src, src_key_padding_mask)`` (the mask is ``(batch, seq)``), ``batch_dim=0`` for a
            model that takes ``(batch, ...)`` and transposes inside. The layers are looked at once,
            here.

    Attributes:
        micro_batch: the current micro-batch size.
        batch_dim: the batch dimension(s) micro-batches are cut along, as resolved at construction.
        skipped_steps: steps the grad scaler skipped.
        oom_count: out-of-memory errors recovered from.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, micro_batch: int | None = None,
                 min_micro_batch: int = 1, grow_after: int | None = None,
                 num_tokens: Callable[[Any], int] | None = None, amp_dtype: torch.dtype | None = None,
                 grad_scaler: "torch.amp.GradScaler | None" = None,
                 backward: Callable[[torch.Tensor], Any] | None = None, pre_weighted: bool = False,
                 batch_dim: int | tuple | list | dict | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable(model, micro_batch) -> loss")
        if micro_batch is not None and (not _is_int(micro_batch) or micro_batch <= 0):
            raise ValueError(f"micro_batch must be a positive int or None, got {micro_batch!r}")
        if not _is_int(min_micro_batch) or min_micro_batch <= 0:
            raise ValueError(f"min_micro_batch must be a positive int, got {min_micro_batch!r}")
        if micro_batch is not None and min_micro_batch > micro_batch:
            raise ValueError(f"min_micro_batch ({min_micro_batch}) must not exceed micro_batch ({micro_batch})")
        if grow_after is not None and (not _is_int(grow_after) or grow_after <= 0):
            raise ValueError(f"grow_after must be a positive int or None, got {grow_after!r}")
        if num_tokens is not None and not callable(num_tokens):
            raise TypeError(f"num_tokens must be callable(batch) -> int or None, got {type(num_tokens).__name__}")
        if amp_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"amp_dtype must be torch.bfloat16, torch.float16 or None, got {amp_dtype!r}")
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        if backward is not None and not callable(backward):
            raise TypeError(f"backward must be callable(loss) or None, got {type(backward).__name__}")
        if backward is not None and (grad_scaler is not None or amp_dtype == torch.float16):
            raise ValueError("backward= runs the backward itself: pass no grad_scaler (and no amp_dtype=torch.float16, "
                             "which makes one); let backward scale the loss (accelerator.backward does)")
        if not isinstance(pre_weighted, bool):
            raise TypeError(f"pre_weighted must be a bool, got {pre_weighted!r}")
        _check_batch_dim(batch_dim)
        # The layout scan runs once, here: each step only reads the resolved batch_dim.
        self.batch_dim = _default_batch_dim(model) if batch_dim is None else batch_dim
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.max_micro_batch = micro_batch
        self.micro_batch = micro_batch
        self.min_micro_batch = min_micro_batch
        self.grow_after = grow_after
        self.num_tokens = num_tokens
        self.amp_dtype = amp_dtype
        self.backward = backward
        self.pre_weighted = pre_weighted
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._grad_params = self._params  # every .grad a batch writes; see _backward_batch
        self._fsdp2 = _is_fsdp2(model)
        if _is_fsdp1(model):
            raise TypeError("memopt.AdaptiveBatch: FSDP1 (FullyShardedDataParallel) is not supported; shard the "
                            "model with torch.distributed.fsdp.fully_shard (FSDP2)")
        # FSDP2 averages each reduce-scatter over its mesh; the shares here are of the global
        # count, so each is scaled by the mesh size for the average to be their sum.
        self._gradient_factor = 1.0
        if self._fsdp2:
            from torch.distributed.tensor import DTensor

            meshes = {p.device_mesh for p in self._params if isinstance(p, DTensor)}
            if len(meshes) != 1:
                raise ValueError(f"memopt.AdaptiveBatch: the optimizer's parameters of an FSDP2 model must share one "
                                 f"device mesh, got {len(meshes)}")
            self._gradient_factor = float(next(iter(meshes)).size())
        self._device_type = self._params[0].device.type if self._params else "cpu"
        # Made here, the scaler is one the caller never steps with: accumulate() refuses it.
        self._made_scaler = None
        if grad_scaler is None and amp_dtype == torch.float16:
            grad_scaler = self._made_scaler = torch.amp.GradScaler(self._device_type)
        self.grad_scaler = grad_scaler
        self.skipped_steps = 0
        self.oom_count = 0
        self._steps_since_oom = 0

    # The count every weight is a share of: samples or tokens, global under distributed.
    def _count(self, batch) -> float:
        if self.num_tokens is None:
            return float(_leading_size(batch, self.batch_dim))
        count = self.num_tokens(batch)
        if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point():
            count = int(count.item())
        if not _is_int(count) or count < 0:
            raise ValueError(f"num_tokens must return a non-negative int for every batch and micro-batch, "
                             f"got {count!r} for one of {_leading_size(batch, self.batch_dim)} samples")
        return float(count)

    def _all_reduce(self, value: float, op: str) -> float:
        """``value`` reduced over the ranks (``op``: "sum", "min" or "max"); itself when not distributed."""
        if not _distributed():
            return value
        op = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
              "max": torch.distributed.ReduceOp.MAX}[op]
        device = self._params[0].device if self._device_type != "cpu" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=op)
        return t.item()

    def _forward(self, micro, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's weighted loss, in at least fp32, and the same detached."""
        autocast = torch.autocast(self._device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)
        with autocast:
            loss = self.loss_fn(self.model, micro)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a 0-d tensor, got {type(loss).__name__} "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        # Weighting in at least fp32: a half-precision loss times a small share underflows.
        weighted = loss.to(torch.promote_types(loss.dtype, torch.float32))
        if not self.pre_weighted:
            weighted = weighted * weight
        return weighted, weighted.detach()

    def _backward(self, weighted: torch.Tensor) -> None:
        if self._gradient_factor != 1.0:
            weighted = weighted * self._gradient_factor
        if self.backward is not None:
            self.backward(weighted)
        elif self.grad_scaler is not None:
            self.grad_scaler.scale(weighted).backward()
        else:
            weighted.backward()

    def _micro_step(self, micro, weight: float) -> tuple[str | None, torch.Tensor | None]:
        """Forward and backward of one micro-batch into fresh .grad tensors. Returns (the OOM
        message, None) when this rank ran out of memory (under FSDP2: or another rank did in the
        forward), else (None, its loss)."""
        oom = None
        with self._no_sync():  # DDP reads it in the forward
            try:
                weighted, loss = self._forward(micro, weight)
            except torch.OutOfMemoryError as err:
                # Only record it here: the traceback references the failed forward's activations
                # until this block ends.
                oom = str(err).split("\n")[0]
            if self._fsdp2 and self._agree(oom is not None):  # the backward's reduce-scatters need every rank
                return oom or "on another rank", None
            if oom is not None:
                return oom, None
            try:
                self._backward(weighted)
            except torch.OutOfMemoryError as err:
                oom = str(err).split("\n")[0]
            del weighted
        return (oom, None) if oom is not None else (None, loss)

    def step(self, batch) -> StepResult:
        """Run one optimizer step over ``batch`` (tensors with the batch in dimension ``batch_dim``:
        the first, by default)."""
        loss_sum, micro, micro_steps, retries = self._backward_batch(batch, add_to_grads=False)
        self._sync_gradients()
        skipped = self._optimizer_step()
        self._adapt(micro, retries)
        loss = self._all_reduce(loss_sum.item(), "sum")
        return StepResult(loss=torch.tensor(loss, dtype=torch.float32), micro_batch=micro,
                          micro_steps=micro_steps, oom_retries=retries, skipped=skipped)

    def accumulate(self, batch) -> StepResult:
        """Forward and backward of ``batch`` as micro-batches that shrink on OOM, its gradient
        added to the ``.grad`` the parameters hold; no optimizer step and no gradient sync.

        For training loops that step the optimizer themselves (a Hugging Face ``Trainer``'s
        ``training_step``, gradient accumulation over several batches). On a failure the
        ``.grad`` tensors, buffers and RNG states are as they were before the call. Not under
        ``DistributedDataParallel`` (:meth:`step` syncs the gradients; this leaves them local);
        under FSDP2 the gradients added are the reduce-scattered global ones. The returned loss
        is this rank's (not all-reduced); ``skipped`` is False.

        With a ``grad_scaler`` the gradient added is the batch's times
        ``grad_scaler.get_scale()``, as ``scaler.scale(loss).backward()`` leaves it in
        torch.amp: step with ``grad_scaler.step(optimizer)`` then ``grad_scaler.update()`` (they
        unscale it, and skip the step on inf/NaN gradients; ``grad_scaler.unscale_(optimizer)``
        first to clip), never with ``optimizer.step()``. Hence only a scaler passed as
        ``grad_scaler=``: with the one ``amp_dtype=torch.float16`` makes, which the caller does not
        step with, this raises ``ValueError``.
        """
        if _is_ddp(self.model):
            raise ValueError("memopt.AdaptiveBatch.accumulate: not under DistributedDataParallel (the gradients "
                             "would stay unsynced); use step()")
        if self.grad_scaler is not None and self.grad_scaler is self._made_scaler and self.grad_scaler.is_enabled():
            raise ValueError(
                "memopt.AdaptiveBatch.accumulate: amp_dtype=torch.float16 made a GradScaler, and the gradient "
                f"accumulate() leaves in .grad is scaled by it (x{self.grad_scaler.get_scale():g}) until "
                "grad_scaler.step() unscales it. Pass your own grad_scaler=torch.amp.GradScaler(...) and step with "
                "it (grad_scaler.step(optimizer); grad_scaler.update()), use step(), which does, or use "
                "amp_dtype=torch.bfloat16, which needs no scaler"
            )
        loss_sum, micro, micro_steps, retries = self._backward_batch(batch, add_to_grads=True)
        self._adapt(micro, retries)
        return StepResult(loss=loss_sum.to(torch.float32), micro_batch=micro, micro_steps=micro_steps,
                          oom_retries=retries, skipped=False)

    def _adapt(self, micro: int, retries: int) -> None:
        # Only an OOM lowers the micro-batch: a short batch (an epoch's last) ran whole in one
        # smaller micro-step, which says nothing about what fits.
        if retries:
            self.micro_batch = micro
        self._steps_since_oom = 0 if retries else self._steps_since_oom + 1
        self._maybe_grow()

    def _backward_batch(self, batch, add_to_grads: bool):
        """Every micro-step of ``batch``; its gradient ends in ``.grad`` (added to what was there
        with ``add_to_grads``, else in its place). Returns (loss sum, micro-batch, micro-steps,
        retries)."""
        size = _leading_size(batch, self.batch_dim)
        if size == 0:
            if self.batch_dim == 0:
                raise ValueError("batch is empty (leading dimension 0)")
            where = (f"batch dimension {self.batch_dim}" if _is_int(self.batch_dim)
                     else f"the batch dimensions batch_dim={self.batch_dim!r} give")
            raise ValueError(f"batch is empty ({where} is 0)")
        if _distributed() and self._all_reduce(size, "min") != self._all_reduce(size, "max"):
            raise ValueError(f"under torch.distributed every rank's batch must hold the same number of samples "
                             f"(this rank: {size}): the ranks step through micro-batches together")
        if self.micro_batch is None:
            self.micro_batch = self.max_micro_batch = size
        total = self._all_reduce(self._count(batch), "sum")
        if total <= 0:
            raise ValueError(f"batch has no samples or tokens to average over (count {total})")

        # The backward writes .grad of every parameter that requires grad, not only the
        # optimizer's: all are set aside, so a failed micro-step leaves none of its gradient.
        held = set(self._params)
        self._grad_params = self._params + [p for p in self.model.parameters() if p.requires_grad and p not in held]
        params = self._grad_params
        # The gradients the caller left are set aside, so a failed step can put them back.
        entry_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        entry_state = _ModelState(self.model)
        try:
            accumulated, loss_sum, micro, micro_steps, retries = self._accumulate_batch(
                batch, size, total, entry_state.fork())
        except BaseException:
            for p, g in zip(params, entry_grads):
                p.grad = g
            entry_state.restore()
            raise
        del entry_state
        # step() replaces the optimizer's gradients; the others are added to, as a backward would.
        kept = entry_grads if add_to_grads else [None] * len(self._params) + entry_grads[len(self._params):]
        accumulated = kept if accumulated is None else self._accumulate(kept, accumulated)
        del entry_grads, kept
        for p, g in zip(params, accumulated):
            p.grad = g
        del accumulated
        return loss_sum, micro, micro_steps, retries

    def _accumulate_batch(self, batch, size: int, total: float, state: _ModelState):
        """Every micro-step of one batch; the accumulated gradients are returned, not in .grad.

        ``state`` is the model's buffers and RNG before the next micro-step: a micro-step that
        runs out of memory is retried from it, so the retry sees the model exactly as the failed
        attempt did."""
        counted = 0.0
        accumulated: list[torch.Tensor | None] | None = None
        loss_sum = torch.zeros((), dtype=torch.float64)
        micro = min(self.micro_batch, size)
        start, micro_steps, retries = 0, 0, 0
        while start < size:
            stop = min(start + micro, size)
            piece = _slice(batch, start, stop, self.batch_dim)
            count = self._count(piece)
            weight = count / total
            message, loss = None, None
            # Under FSDP2 every rank joins every micro-step: its forward and backward are collective.
            runs = weight > 0 or self._fsdp2
            if runs:
                message, loss = self._micro_step(piece, weight)
            del piece
            if self._agree(message is not None):
                message = message or "on another rank"
                for p in self._grad_params:
                    p.grad = None
                loss = None
                self._reset_fsdp()
                self._free()
                state.restore()
                if micro <= self.min_micro_batch:
                    accumulated = None
                    raise MicroBatchFloorError(
                        f"out of memory at micro-batch {micro} (min_micro_batch {self.min_micro_batch}) on "
                        f"samples [{start}:{stop}] of {size}; model, gradients and optimizer are unchanged. "
                        f"Reduce the memory per sample (memopt.estimate shows where it goes; a checkpoint "
                        f"policy or a shorter sequence) or lower min_micro_batch. Last error: {message}"
                    )
                retries += 1
                self.oom_count += 1
                new_micro = int(self._all_reduce(max(self.min_micro_batch, micro // 2), "min"))
                logger.warning("memopt.AdaptiveBatch: out of memory at micro-batch %d (samples %d:%d); "
                               "retrying at %d", micro, start, stop, new_micro)
                micro = new_micro
                continue
            if runs:
                accumulated = self._accumulate(accumulated)
                loss_sum = loss_sum.to(loss.device) + loss.double()
                micro_steps += 1
                state.capture()
            counted += count
            start = stop
        counted = self._all_reduce(counted, "sum")
        if counted != total:
            raise ValueError(f"num_tokens is not additive: the micro-batches count {counted:g} tokens, the batch "
                             f"{total:g}; it must count the loss terms of whatever batch or micro-batch it is given")
        return accumulated, loss_sum, micro, micro_steps, retries

    def _no_sync(self):
        if _is_ddp(self.model):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _reset_fsdp(self) -> None:
        """FSDP2's recovery after a forward or backward aborted mid-way (torch 2.14 on; earlier
        releases have no such call and resume from the next forward)."""
        reset = getattr(self.model, "reset_iter_state", None) if self._fsdp2 else None
        if reset is not None:
            reset()

    def _agree(self, oom: bool) -> bool:
        if not _distributed():
            return oom
        return self._all_reduce(1.0 if oom else 0.0, "max") > 0

    def _accumulate(self, accumulated, fresh=None):
        """Fold ``fresh`` (default: the fresh .grad of a successful micro-step, taken off the
        parameters) into the held-aside sum ``accumulated``."""
        if fresh is None:
            fresh = [p.grad for p in self._grad_params]
            for p in self._grad_params:
                p.grad = None
        if accumulated is None:
            return fresh
        out = []
        for acc, g in zip(accumulated, fresh):
            if acc is None:
                out.append(g)
            else:
                if g is not None:
                    acc.add_(g)
                out.append(acc)
        return out

    def _free(self) -> None:
        gc.collect()
        if self._device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sync_gradients(self) -> None:
        if not (_is_ddp(self.model) and _distributed()):
            return
        # Shares were taken of the global count, so the global gradient is the sum: of every
        # parameter the backward wrote (not only the optimizer's, whose .grad a second optimizer,
        # clipping or logging reads too). A frozen parameter keeps no gradient, as under plain DDP
        # (a zero one would let weight decay move it); the set is the same on every rank.
        for p in self._grad_params:
            if not p.requires_grad:
                continue
            if p.grad is None:  # unused on this rank: it still takes its part in the sum
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)

    def _optimizer_step(self) -> bool:
        if self.grad_scaler is None:
            self.optimizer.step()
            return False
        scale_before = self.grad_scaler.get_scale()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        # GradScaler lowers its scale exactly when it found inf/NaN and skipped the step.
        skipped = self.grad_scaler.get_scale() < scale_before
        if skipped:
            self.skipped_steps += 1
            logger.warning("memopt.AdaptiveBatch: inf/NaN gradients, optimizer step skipped "
                           "(grad scale %g -> %g; %d skipped so far)", scale_before,
                           self.grad_scaler.get_scale(), self.skipped_steps)
        return skipped

    def _maybe_grow(self) -> None:
        if self.grow_after is None or self.micro_batch >= self.max_micro_batch:
            return
        if self._steps_since_oom >= self.grow_after:
            new_micro = min(self.max_micro_batch, self.micro_batch * 2)
            logger.info("memopt.AdaptiveBatch: %d steps without OOM; micro-batch %d -> %d",
                        self._steps_since_oom, self.micro_batch, new_micro)
            self.micro_batch = new_micro
            self._steps_since_oom = 0
