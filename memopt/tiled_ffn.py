"""Sequence-tiled FFN: the feed-forward part of a layer run over chunks of tokens, so that its
``(tokens, d_ff)`` intermediates exist for one chunk at a time (ALST's TiledMLP idea).

Past a few thousand tokens the FFN's intermediates (the fc1 output and the activation, ``d_ff``
wide, often 4x d_model or more) are the largest tensors of a layer, in the forward and again in
the recompute and backward. A token-wise function gives the same rows whether it sees the whole
sequence or a chunk of it, so the layer can run it chunk by chunk and save only its input:

* forward: each chunk's output is written into the output, its intermediates freed before the
  next chunk; nothing of the FFN is saved for backward but its input (d_model wide).
* backward: each chunk is recomputed from its slice of the input and differentiated at once;
  the input gradient is written chunk by chunk, the parameter gradients summed over chunks.

The cost is one more FFN forward per step (the backward's recompute) on top of what the layer's
recompute policy recomputes. Results equal the untiled layer's up to the order in which the
parameter gradients are summed (tested in float64 at 1e-12).

Two users:

* ``memopt.FusedCheckpointBlock(..., ffn_chunk_tokens=n)``: the block's FFN half (norm2, fc1,
  activation, fc2, the residual dropout and add; post-norm also norm2) runs per chunk inside the
  block's own autograd Function (:mod:`memopt.block_functions`); its Philox dropout mask is
  replayed exactly per chunk from the block's key (:func:`chunk_rng_key`), so tiled and untiled
  blocks give the same result with the same seed.
* ``memopt.wrap(model, ffn_chunk_tokens=n)``: each layer's MLP submodule (:func:`find_ffn`:
  ``mlp``, ``feed_forward``, ``ffn``; ``nn.TransformerEncoderLayer``'s ``_ff_block``) and the
  token-wise norms around it (:func:`find_norms`: every RMSNorm/LayerNorm of the layer outside
  the MLP, Llama's ``input_layernorm`` and ``post_attention_layernorm``, GPT-2's ``ln_1`` and
  ``ln_2``, Gemma's four; and the final norm of the stack holding the layers,
  :func:`find_stack_norms`: Llama's ``model.norm``, GPT-2's ``transformer.ln_f``) get a forward
  (:func:`install`) that runs them through :class:`TiledFFNFunction`. A norm is cheap to run,
  but Hugging Face's ``LlamaRMSNorm`` (and its copies) keeps a float32 copy of its input and its
  ``rstd`` for backward, and in a bf16 model that copy is twice the input: tiled, a norm saves
  only its input, in the model dtype, and its float32 intermediates exist for one chunk at a time
  in the forward and in the recompute (at Llama-3-8B in bf16 a layer's recompute keeps 8 KiB per
  token of norm inputs instead of 32 KiB of float32 copies, the final norm 8 KiB instead of 16).
  The attention projections are not tiled: unlike a norm, a linear layer costs a matmul to
  recompute, and the float32 input copies PEFT's LoRA adapters make of their input stay
  (:func:`memopt.estimate.llama_layer_saved`).
  Limits: that Function holds the module and reads the RNG state, so ``torch.compile`` does not
  trace it (a graph break; ``fullgraph=True`` raises); not tried under FSDP.

:func:`tiled_ffn_ref` is the plain PyTorch reference: the same chunks through ordinary autograd
(every chunk's intermediates kept), for tests.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from memopt._parameters_as_called import ParametersAsCalled, submodules
from memopt.ops._common import autocast_as, autocast_state, building_graph

__all__ = [
    "FFN_ATTRIBUTES",
    "TiledFFNFunction",
    "check_ffn_chunk_tokens",
    "chunk_rng_key",
    "find_ffn",
    "find_norms",
    "find_stack_norms",
    "install",
    "install_norms",
    "norm_width",
    "remove",
    "tiled_ffn",
    "tiled_ffn_ref",
    "token_chunks",
]

# Names under which layers hold their token-wise MLP: Llama, Mistral, Qwen2/3, Gemma, Phi-3,
# GPT-2, GPT-NeoX, Falcon (``mlp``); Mllama-style and other ``feed_forward``/``ffn`` layers.
FFN_ATTRIBUTES = ("mlp", "feed_forward", "ffn")
# How the classes of token-wise norms end their names outside torch.nn: Hugging Face's
# LlamaRMSNorm, GemmaRMSNorm, T5LayerNorm, OlmoLayerNorm, ...
NORM_CLASS_SUFFIXES = ("RMSNorm", "LayerNorm")


def check_ffn_chunk_tokens(value, owner: str, name: str = "ffn_chunk_tokens") -> int | None:
    """``value`` if it is None or a positive int (not a bool); else ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int or None, got {value!r}")
    return value


def token_chunks(n_tokens: int, chunk_tokens: int, width: int = 4) -> Iterator[tuple[int, int]]:
    """``(start, end)`` row ranges covering ``n_tokens`` rows of ``width`` elements.

    The chunk is rounded up so that each chunk starts at an element index divisible by 4: a
    Philox dropout mask gives element ``i`` word ``i % 4`` of counter ``offset + i // 4``
    (``csrc/philox.h``), so a chunk starting there replays exactly its part of the whole mask
    (:func:`chunk_rng_key`). With ``width`` a multiple of 4 (every head_dim memopt takes) the
    chunk is used as given.
    """
    align = 4 // math.gcd(width, 4)
    step = -(-chunk_tokens // align) * align
    for start in range(0, n_tokens, step):
        yield start, min(start + step, n_tokens)


def chunk_rng_key(rng_key: Tensor, first_element: int) -> Tensor:
    """The ``(seed, offset)`` key whose Philox mask, for a tensor starting at element
    ``first_element`` of a larger one, equals that part of the larger tensor's mask under
    ``rng_key`` (``first_element`` divisible by 4: :func:`token_chunks` makes it so)."""
    if first_element == 0:
        return rng_key
    return rng_key + torch.tensor([0, first_element // 4], dtype=rng_key.dtype, device=rng_key.device)


# ----------------------------------------------------------------------------------------------
# A token-wise function (an MLP module's forward) over chunks.


def _chunk_view(rows: Tensor, shape: torch.Size) -> Tensor:
    """``rows`` (n, D) shaped like the input: ``(1, ..., 1, n, D)`` for an input of ``len(shape)``
    dims, so modules that read ``(batch, seq, d)`` from their input see a batch of one."""
    return rows.view(*([1] * (len(shape) - 2)), rows.shape[0], rows.shape[1]) if len(shape) > 2 else rows


@contextlib.contextmanager
def _outside_selective_checkpoint() -> Iterator[None]:
    """Hide selective checkpointing's dispatch modes (PyTorch's caching modes, with the guards of
    :mod:`memopt.checkpoint` inside them) while a tiled FFN runs its chunks inside a checkpointed layer.

    They would keep every chunk's matmul outputs until the backward (the whole ``tokens x d_ff``
    the tiling avoids). Hidden in the forward and in the layer's recompute alike, so their call
    counts stay aligned; other dispatch modes (memory trackers) still see every op.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    hidden = _selective_modes()
    modes = _get_current_dispatch_mode_stack()  # outermost first
    if not any(isinstance(m, hidden) for m in modes):
        yield
        return
    for _ in modes:
        _pop_mode()
    kept = [m for m in modes if not isinstance(m, hidden)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in modes:
            _push_mode(mode)


@functools.cache
def _selective_modes() -> tuple[type, ...]:
    # memopt.checkpoint's guards run inside these two modes (their instances' classes are
    # subclasses of them there), so hiding the modes hides the guards too.
    from torch.utils import checkpoint as torch_checkpoint

    return (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)


class TiledFFNFunction(torch.autograd.Function):
    """``fn`` applied to ``x`` chunk by chunk of tokens; saves ``x`` (and ``params``) only.

    ``apply(fn, chunk_tokens, x (..., D), *params) -> (..., D_out)``: ``fn`` is token-wise (row
    ``i`` of its output depends on row ``i`` of its input only) and uses ``params``, the tensors
    whose gradients this Function returns. The CPU and CUDA RNG states and the autocast state of
    the forward are restored for the backward's recompute, so a random op in ``fn`` replays its
    draws and a matmul under autocast runs in the same dtype again.
    """

    @staticmethod
    def forward(ctx, fn, chunk_tokens, x, *params):
        rows = x.reshape(-1, x.shape[-1])
        # Allocated in its final shape and returned itself, not a view of a (tokens, D_out)
        # buffer: a layer may add into it in place (Falcon's ``mlp_output += attention_output``),
        # which autograd refuses on a view made inside a Function.
        result = out = None
        ctx.rng = _rng_state(x.device)
        # The backward runs outside the user's autocast context: its recompute must not change dtype.
        ctx.autocast = [autocast_state(t) for t in dict.fromkeys(("cpu", x.device.type))]
        with _outside_selective_checkpoint():
            for start, end in token_chunks(rows.shape[0], chunk_tokens, width=1):
                piece = fn(_chunk_view(rows[start:end], x.shape))
                _check_output(piece, end - start)
                if result is None:
                    result = piece.new_empty(*x.shape[:-1], piece.shape[-1])
                    out = result.view(-1, piece.shape[-1])
                out[start:end] = piece.reshape(end - start, -1)
                del piece
            if result is None:  # no tokens: fn's output on the empty input gives the width and dtype
                piece = fn(_chunk_view(rows, x.shape))
                result = piece.new_empty(*x.shape[:-1], piece.shape[-1])
        ctx.fn, ctx.chunk_tokens = fn, chunk_tokens
        ctx.save_for_backward(x, *params)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        # Under create_graph=True (second derivatives) each chunk's gradients keep their graph:
        # the chunk input is a view of x itself, and the pieces are joined out of place.
        graph = building_graph(grad_out)
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        rows = (x if graph else x.detach()).reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(rows) if need_x and not graph else None
        grad_x_pieces: list[Tensor] = []
        grads: list[Tensor | None] = [None] * len(params)
        with torch.random.fork_rng(devices=_rng_devices(x.device)), torch.enable_grad(), contextlib.ExitStack() as stack:
            for state in ctx.autocast:
                stack.enter_context(autocast_as(state))
            _set_rng_state(ctx.rng, x.device)
            for start, end in token_chunks(rows.shape[0], ctx.chunk_tokens, width=1):
                piece_in = rows[start:end] if graph else rows[start:end].detach().requires_grad_(need_x)
                piece = ctx.fn(_chunk_view(piece_in, x.shape))
                inputs = ([piece_in] if need_x else []) + [params[i] for i in wanted]
                found = list(torch.autograd.grad(
                    piece, inputs, grad_rows[start:end].view(piece.shape), allow_unused=True, create_graph=graph
                ))  # fmt: skip
                del piece
                if need_x:
                    grad_piece = found.pop(0)
                    grad_piece = torch.zeros_like(piece_in) if grad_piece is None else grad_piece.reshape(end - start, -1)
                    if graph:
                        grad_x_pieces.append(grad_piece)
                    else:
                        grad_x[start:end] = grad_piece
                for i, grad in zip(wanted, found):
                    if grad is not None:
                        grads[i] = _add_chunk_grad(grads[i], grad, graph)
        if graph and need_x:
            grad_x = torch.cat(grad_x_pieces) if grad_x_pieces else torch.zeros_like(rows)
        if rows.shape[0] == 0:  # no tokens: the parameters' gradients are zero, as the untiled fn's are
            grads = [torch.zeros_like(params[i]) if i in wanted else None for i in range(len(params))]
        grads = [None if g is None else g.to(p.dtype) for g, p in zip(grads, params)]  # float32 sums of half grads
        return (None, None, grad_x.view(x.shape) if need_x else None, *grads)


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _add_chunk_grad(total: Tensor | None, grad: Tensor, graph: bool) -> Tensor:
    """``total + grad``: one chunk's parameter gradient added to the sum over chunks.

    Note: float16/bfloat16 gradients are summed in float32 (the backward casts the sum back once),
    as the fused block's tiled FFN does (:func:`memopt.block_functions._tiled_ffn_backward`):
    summed in half precision, each chunk adds one rounding of the whole sum, so the error grows
    with the chunk count (bf16 MLP, 4096 tokens: 1.1e-2 relative at 64 chunks, 2.0e-2 at 256,
    against eager's 4.4e-3). Other dtypes add in place (out of place under ``create_graph``).
    """
    if total is None:
        return grad.float() if grad.dtype in _HALF_DTYPES else grad
    return total + grad if graph else total.add_(grad)  # (a float32 total takes a half grad in place)


def _check_output(piece, rows: int) -> None:
    if not isinstance(piece, Tensor):
        raise TypeError(
            f"memopt tiled FFN: the FFN must return one tensor (token-wise), got {type(piece).__name__}; "
            "a layer whose MLP returns more (router logits) cannot be tiled: leave ffn_chunk_tokens None"
        )
    if piece.dim() == 0 or piece.numel() != rows * piece.shape[-1]:
        raise ValueError(
            f"memopt tiled FFN: the FFN must be token-wise (one output row per input row); a chunk of {rows} "
            f"rows gave shape {tuple(piece.shape)}"
        )


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def tiled_ffn(fn: Callable[[Tensor], Tensor], x: Tensor, chunk_tokens: int, params=()) -> Tensor:
    """``fn(x)`` for a token-wise ``fn``, run ``chunk_tokens`` tokens at a time (tokens are the
    rows of ``x.reshape(-1, x.shape[-1])``); saves ``x`` only for backward.

    Args:
        fn: token-wise function of a ``(1, ..., n, D)`` tensor (an MLP module or its forward).
        x: ``(..., D)``.
        chunk_tokens: tokens per chunk (positive int).
        params: the tensors ``fn`` uses that need gradients (``module.parameters()``).

    Returns:
        ``(..., D_out)``, equal to ``fn(x)`` up to the summation order of parameter gradients.
    """
    check_ffn_chunk_tokens(chunk_tokens, "memopt.tiled_ffn", "chunk_tokens")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise TypeError(f"memopt.tiled_ffn: x must be a tensor of at least 1 dim, got {type(x).__name__}")
    return TiledFFNFunction.apply(fn, chunk_tokens, x, *params)


def tiled_ffn_ref(fn: Callable[[Tensor], Tensor], x: Tensor, chunk_tokens: int) -> Tensor:
    """Reference for :func:`tiled_ffn`: the same chunks through plain autograd (each chunk's
    intermediates saved as ``fn`` saves them), concatenated."""
    rows = x.reshape(-1, x.shape[-1])
    chunks = token_chunks(rows.shape[0], chunk_tokens, width=1)
    out = torch.cat([fn(_chunk_view(rows[s:e], x.shape)).reshape(e - s, -1) for s, e in chunks])
    return out.view(*x.shape[:-1], out.shape[-1])


# ----------------------------------------------------------------------------------------------
# memopt.wrap: a layer's MLP submodule and its norms, tiled.


@dataclass
class TiledLayer:
    """What :func:`install` changed, for :func:`remove`."""

    owner: nn.Module  # the module whose attribute was replaced
    attribute: str  # "forward" of the MLP or norm, or "_ff_block" of an nn.TransformerEncoderLayer
    previous: Callable | None  # the instance attribute it had before, None for the class's


def find_ffn(layer: nn.Module, layer_name: str = "layer") -> tuple[nn.Module, str]:
    """``(module, method name)`` of ``layer``'s token-wise MLP: the child named in
    :data:`FFN_ATTRIBUTES` (its ``forward``), or ``nn.TransformerEncoderLayer``'s ``_ff_block``.
    ``ValueError`` naming the layer when it has none."""
    if isinstance(layer, nn.TransformerEncoderLayer):
        return layer, "_ff_block"
    for name in FFN_ATTRIBUTES:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return child, "forward"
    children = [name for name, _ in layer.named_children()]
    raise ValueError(
        f"memopt.wrap: ffn_chunk_tokens: layer {layer_name!r} ({type(layer).__name__}) has no token-wise MLP "
        f"submodule named one of {list(FFN_ATTRIBUTES)} (its children: {children}); leave ffn_chunk_tokens None "
        "for this model"
    )


def norm_width(module: nn.Module) -> int | None:
    """The width ``module`` normalises if it is a token-wise norm (each row of its input's last dim
    normalised on its own), else None.

    Token-wise norms: ``nn.LayerNorm``/``nn.RMSNorm`` over one trailing dim, and leaf modules whose
    class name ends in one of :data:`NORM_CLASS_SUFFIXES` with a one-entry ``normalized_shape`` or
    a one-dim ``weight``, not channels-first (``data_format``). A norm with submodules (an adaptive
    norm conditioned on another input) or over several dims is not one.
    """
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shape = module.normalized_shape
        return shape[0] if len(shape) == 1 else None
    if not type(module).__name__.endswith(NORM_CLASS_SUFFIXES) or next(module.children(), None) is not None:
        return None
    if getattr(module, "data_format", "channels_last") != "channels_last":
        return None
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return shape[0] if len(shape) == 1 and isinstance(shape[0], int) else None
    weight = getattr(module, "weight", None)
    return weight.shape[0] if isinstance(weight, Tensor) and weight.dim() == 1 else None


def find_norms(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The token-wise norms (:func:`norm_width`) inside ``layer`` but outside its MLP
    (:func:`find_ffn`, which runs its own norms chunk by chunk already), as ``(name in layer, module)``."""
    owner, attribute = find_ffn(layer)
    inside_mlp = set() if attribute == "_ff_block" else {id(m) for m in owner.modules()}
    return [(name, m) for name, m in layer.named_modules() if id(m) not in inside_mlp and norm_width(m) is not None]


def find_stack_norms(model: nn.Module, layer_names: list[str]) -> list[tuple[str, nn.Module]]:
    """The token-wise norms that are direct children of the modules holding the layers named
    ``layer_names`` (the closest ancestor of each that is not an ``nn.ModuleList``/``nn.Sequential``/
    ``nn.ModuleDict``): a decoder stack's final norm (Llama's ``model.norm``, GPT-2's
    ``transformer.ln_f``, ``nn.TransformerEncoder``'s ``norm``), as ``(qualified name, module)``."""
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    stacks: dict[str, nn.Module] = {}
    for name in layer_names:
        parent = name.rpartition(".")[0]
        while parent and isinstance(model.get_submodule(parent), containers):
            parent = parent.rpartition(".")[0]
        stacks.setdefault(parent, model.get_submodule(parent))
    return [
        (f"{stack_name}.{child_name}" if stack_name else child_name, child)
        for stack_name, stack in stacks.items()
        for child_name, child in stack.named_children()
        if norm_width(child) is not None
    ]


class _TiledForward:
    """The forward :func:`install` puts on an MLP or a norm: an object holding the module (not a
    closure), so a wrapped model pickles and deep-copies like ``memopt.wrap``'s own forwards."""

    __slots__ = ("owner", "attribute", "previous", "chunk_tokens", "where", "width")

    def __init__(self, owner: nn.Module, attribute: str, previous, chunk_tokens: int, where: str, width: int | None):
        self.owner, self.attribute, self.previous = owner, attribute, previous
        self.chunk_tokens, self.where, self.width = chunk_tokens, where, width

    def __call__(self, x, *args, **kwargs):
        owner = self.owner
        original = self.previous or functools.partial(getattr(type(owner), self.attribute), owner)
        if args or kwargs or not isinstance(x, Tensor):
            raise TypeError(
                f"memopt.wrap: ffn_chunk_tokens: {self.where} was called with more than one tensor argument; "
                "only a token-wise function of the hidden states can be tiled"
            )
        if self.width is not None and (x.dim() == 0 or x.shape[-1] != self.width):
            raise ValueError(
                f"memopt.wrap: ffn_chunk_tokens: {self.where} normalises {self.width} features but got an input of "
                f"shape {tuple(x.shape)}: it is not token-wise over the last dim here; leave ffn_chunk_tokens None"
            )
        if owner.training:
            active = [f"{type(m).__name__}(p={m.p})" for m in self._dropouts() if m.p > 0]
            if active:
                raise ValueError(
                    f"memopt.wrap: ffn_chunk_tokens: {self.where} has active dropout "
                    f"{active}: torch's RNG draws per call, so chunks would drop other elements than the untiled "
                    "layer; set that dropout to 0, train in eval mode, or leave ffn_chunk_tokens None"
                )
        if not torch.is_grad_enabled():
            return tiled_ffn(original, x, self.chunk_tokens)
        self._check_hooks_inside()
        modules = submodules(self._modules_used())
        params = list(dict.fromkeys(p for m in modules for p in m._parameters.values() if p is not None and p.requires_grad))
        # The backward's recompute reads the module's parameters then: it must get the forward's,
        # the ones whose gradients it returns (functional_call has put the model's own back by then).
        return tiled_ffn(ParametersAsCalled(original, modules), x, self.chunk_tokens, params)

    def _check_hooks_inside(self) -> None:
        """Raise for a forward hook on a module the tiled function runs inside it.

        Note: the chunks run inside :class:`TiledFFNFunction`'s forward, where no graph is built,
        so what such a hook keeps of a submodule's output has no gradient: transformers records
        a mixture-of-experts router's logits that way (``output_router_logits=True``), and its
        load-balancing loss silently lost its gradient (router weights off by 100%). The tiled
        module's own hooks run outside, on the whole output, and transformers' recorders that are
        not recording in this forward are skipped."""
        owner_hooks_outside = self.attribute == "forward"
        for used in self._modules_used():
            for name, module in used.named_modules():
                if module is used and owner_hooks_outside:
                    continue
                # Forward hooks only: they see an output. A pre-hook that rebuilds a weight
                # (torch.nn.utils.prune, the old weight_norm) runs again in the backward's
                # recompute, with gradients on, and stays exact.
                recording = [hook for hook in module._forward_hooks.values() if not _idle_output_recorder(hook)]
                if recording:
                    where = f"{type(used).__name__}.{name}" if name else type(used).__name__
                    raise ValueError(
                        f"memopt.wrap: ffn_chunk_tokens: {self.where} runs {where} ({type(module).__name__}), "
                        f"which has forward hooks {[getattr(h, '__qualname__', type(h).__name__) for h in recording]}; "
                        "inside the tiled MLP they see chunks computed without autograd's graph, so what they keep "
                        "would get no gradient (transformers' output_router_logits=True records a mixture-of-"
                        "experts router this way). Remove the hooks (output_router_logits=False), or leave "
                        "ffn_chunk_tokens None"
                    )

    def _modules_used(self) -> list[nn.Module]:
        """The modules the tiled function runs: the MLP or norm, or an encoder layer's two linears."""
        if self.attribute == "_ff_block":
            return [self.owner.linear1, self.owner.linear2]
        return [self.owner]

    def _dropouts(self) -> list[nn.Module]:
        if self.attribute == "_ff_block":
            return [self.owner.dropout, self.owner.dropout2]
        return [m for m in self.owner.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]


def _idle_output_recorder(hook) -> bool:
    """Whether ``hook`` is one of transformers' output-capturing forward hooks (installed on a
    model's modules at its first forward) that records nothing in the current forward."""
    recorder = sys.modules.get("transformers.utils.output_capturing")
    if recorder is None or getattr(hook, "__module__", None) != recorder.__name__:
        return False
    if getattr(hook, "__name__", None) != "output_capturing_hook":
        return False
    try:
        cells = dict(zip(hook.__code__.co_freevars, (cell.cell_contents for cell in hook.__closure__ or ())))
        collected = recorder._active_collector.get()
    except (AttributeError, ValueError, LookupError):  # another transformers: count it as recording
        return False
    return "key" in cells and (collected is None or cells["key"] not in collected)


def _tile(owner: nn.Module, attribute: str, chunk_tokens: int, where: str, width: int | None) -> TiledLayer | None:
    previous = owner.__dict__.get(attribute)
    if isinstance(previous, _TiledForward):  # one module reached twice (shared between layers)
        return None
    setattr(owner, attribute, _TiledForward(owner, attribute, previous, chunk_tokens, where, width))
    return TiledLayer(owner, attribute, previous)


def _token_mixing(module: nn.Module) -> bool:
    """Whether ``module`` mixes the rows (tokens) it is given: a convolution wider than one
    position (FastSpeech2-Conformer's FFN), a recurrent layer. Pooling is not counted: a maxout
    MLP pools over features, within a token."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return any(k != 1 for k in module.kernel_size)
    return isinstance(module, nn.RNNBase)


def install(layer: nn.Module, chunk_tokens: int, layer_name: str = "layer") -> list[TiledLayer]:
    """Tile ``layer``'s MLP (:func:`find_ffn`) and its norms (:func:`find_norms`) ``chunk_tokens``
    tokens at a time; undo each with :func:`remove`. ``ValueError`` for an MLP holding a module
    that mixes tokens (a convolution of kernel size > 1, a recurrent layer)."""
    owner, attribute = find_ffn(layer, layer_name)
    mixing = [f"{name or type(owner).__name__} ({type(m).__name__})" for name, m in owner.named_modules() if _token_mixing(m)]
    if attribute == "forward" and mixing:
        raise ValueError(
            f"memopt.wrap: ffn_chunk_tokens: the MLP of layer {layer_name!r} mixes tokens through {mixing} (an output "
            "row depends on neighbouring input rows), so chunks of tokens would not give its output; leave "
            "ffn_chunk_tokens None for this model"
        )
    mlp = _tile(owner, attribute, chunk_tokens, f"the MLP of layer {layer_name!r}", None)
    norms = install_norms([(f"{layer_name}.{name}", module) for name, module in find_norms(layer)], chunk_tokens)
    return ([mlp] if mlp is not None else []) + norms


def install_norms(norms: list[tuple[str, nn.Module]], chunk_tokens: int) -> list[TiledLayer]:
    """Tile each ``(name, norm)`` of ``norms`` (token-wise: :func:`norm_width`) ``chunk_tokens``
    tokens at a time; undo each with :func:`remove`.

    A norm narrower than the widest of ``norms`` (the hidden size) normalises several rows per
    token: Qwen3's and Gemma 3's ``q_norm`` / ``k_norm`` run over head_dim on ``(batch, seq,
    heads, head_dim)``. Its chunks take ``widest // width`` times the rows, the elements of
    ``chunk_tokens`` hidden-size rows, so that it runs in as many chunks as the wide norms, not
    ``heads`` times as many (a 2-layer Qwen3, 16 heads, 2,048 tokens, ``ffn_chunk_tokens=256``:
    160 chunks a step, 880 before)."""
    widths = [norm_width(m) for _, m in norms]
    widest = max(widths, default=1)
    tiled = [
        _tile(m, "forward", chunk_tokens * max(1, widest // width), f"the norm {name!r}", width)
        for (name, m), width in zip(norms, widths)
    ]
    return [t for t in tiled if t is not None]


def remove(tiled: TiledLayer) -> None:
    """Put back what :func:`install` replaced."""
    if tiled.previous is None:
        delattr(tiled.owner, tiled.attribute)
    else:
        setattr(tiled.owner, tiled.attribute, tiled.previous)
