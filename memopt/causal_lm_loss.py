"""The LM-head loss of a Hugging Face causal LM without materialised logits (``wrap(model, loss=...)``).

A causal LM called with ``labels=`` makes ``(batch, seq, vocab)`` logits, upcasts them to float32
and takes Hugging Face's ``ForCausalLMLoss``; past a few thousand tokens those tensors (and their
gradient) outweigh every layer's activations. Under ``loss="chunked"`` the model's forward runs
as before up to its base model, whose last hidden state is captured, and the loss is
:func:`memopt.linear_cross_entropy` of those hidden states and the LM head's weight (and bias),
with ``ForCausalLMLoss``'s semantics: labels shifted by one (``labels[..., 1:]`` against
positions ``:-1``, or the caller's ``shift_labels``), ``ignore_index`` (-100 unless passed),
mean over the non-ignored tokens, or their sum divided by ``num_items_in_batch`` when that is
passed; Gemma-2/3's ``final_logit_softcapping`` becomes ``logit_softcap``. The loss is float32
(as Hugging Face's on upcast logits) for a float16/bfloat16 model too. A MoE model's router
load-balancing loss (``output_router_logits``) is added as its forward adds it with labels
(``loss += self.router_aux_loss_coef * aux_loss``, read from the forward's source); a forward
that adds anything else to its loss keeps the plain loss.

Hugging Face offers no public hook that skips the LM head, so the model's own forward runs with
``labels=None`` and ``logits_to_keep=1`` (the LM head then makes ``(batch, 1, vocab)`` logits,
the smallest public choice), and a forward hook on the decoder (``model.get_decoder()``) takes
its ``last_hidden_state``. On the first call with labels, those last-position logits are compared
with the LM head applied to the captured hidden state (softcapped as the config says): a model
that does anything else between its base model and its logits (a rescaling this module does not
know of) gets an error rather than a wrong loss.

The output is the model's own output class with ``loss`` set and ``logits`` None: logits are not
materialised under ``loss="chunked"``; pass ``loss="plain"``, call without labels, or call
inside :func:`plain_loss` (what ``MemoptTrainer``'s prediction step does for ``compute_metrics``)
to get them.
With ``return_dict=False`` the tuple has None in the logits' place. An LM head that is no longer
a plain ``nn.Linear`` when called (a PEFT LoRA adapter added after ``wrap``, a hook) would be
bypassed: the model's own forward and loss run instead, with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memopt._stock_forward import runs_stock_forward
from memopt.ops.cross_entropy import linear_cross_entropy

LOSSES = ("chunked", "plain")
# Config attributes with which a Hugging Face model rescales its logits after the LM head
# (Cohere's logit_scale, Granite's logits_scaling, Muse's output_multiplier): not handled, refused.
_LOGIT_RESCALING_ATTRS = ("logit_scale", "logits_scaling", "output_multiplier")
# A statement of the forward that adds to the loss after loss_function.
_LOSS_ADDITION = re.compile(r"\bloss\s*(?:\+=|=\s*loss\s*\+)[^\n]*")
# The one addition reproduced: a MoE model's router load-balancing loss, added when labels are
# given, `loss += self.router_aux_loss_coef * aux_loss.to(loss.device)` (Mixtral, Qwen2-MoE, ...;
# JetMoe's self.aux_loss_coef, the VL models' self.config.text_config.router_aux_loss_coef).
_AUX_LOSS_ADDITION = re.compile(r"\bloss\s*\+=\s*self((?:\.\w+)+)\s*\*\s*aux_loss\b")


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and, for a multimodal model, its text config."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _config_value(model: nn.Module, name: str):
    for config in reversed(_configs(model)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _why_not(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the chunked loss, or None when it can."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return f"{type(model).__name__} is not a Hugging Face PreTrainedModel"
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__}.get_output_embeddings() is {type(head).__name__}, not an nn.Linear"
    if not _is_plain_linear(head):
        return f"its LM head ({type(head).__name__}) has hooks or a forward of its own, which loss='chunked' would bypass"
    if _config_value(model, "vocab_size") != head.out_features:
        return f"its config's vocab_size is not the LM head's {head.out_features} outputs"
    parameters = inspect.signature(type(model).forward).parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in parameters]
    if missing:
        return f"{type(model).__name__}.forward takes no {' or '.join(missing)} argument"
    causal_loss = getattr(sys.modules.get("transformers.loss.loss_utils"), "ForCausalLMLoss", None)
    if causal_loss is None or model.loss_function is not causal_loss:
        return f"its loss_function is not Hugging Face's ForCausalLMLoss (loss_type={getattr(model, 'loss_type', None)!r})"
    reason = _loss_not_from_loss_function(type(model))
    if reason is not None:
        return reason
    reason = _aux_loss_coefficient(type(model))[1]
    if reason is not None:
        return reason
    base = model.base_model
    if base is model or base is None:
        return f"{type(model).__name__} has no base model (base_model_prefix={model.base_model_prefix!r})"
    if "labels" in inspect.signature(type(base).forward).parameters:
        # The chunked forward calls the model with labels=None; a base model that reads labels
        # (a multimodal one masking image tokens) would then run differently.
        return f"its base model {type(base).__name__} takes labels too"
    for name in _LOGIT_RESCALING_ATTRS:
        value = _config_value(model, name)
        if value is not None and value != 1:
            return f"its config sets {name}={value}, which rescales the logits; loss='chunked' does not"
    return None


def _loss_forward_sources(cls: type) -> list[str] | str:
    """The sources of ``cls.forward`` down to the one that calls ``self.loss_function``, or why
    ``cls.forward`` may compute its loss otherwise than with it. loss_function is a
    PreTrainedModel property every model has; a forward that computes its loss itself
    (BartForCausalLM's and XLM's CrossEntropyLoss over unshifted labels) never uses it. Read from
    the source: a forward that calls ``super().forward`` defers to the next class's."""
    sources = []
    for owner in cls.__mro__:
        if "forward" not in vars(owner):
            continue
        try:
            source = inspect.getsource(vars(owner)["forward"])
        except (OSError, TypeError):
            return f"the source of {owner.__name__}.forward cannot be read to see that it uses loss_function"
        sources.append(source)
        if "self.loss_function(" in source:
            return sources
        if "super().forward(" not in source:
            return f"{owner.__name__}.forward computes its loss itself, not with loss_function (ForCausalLMLoss)"
    return f"{cls.__name__}.forward computes its loss itself, not with loss_function (ForCausalLMLoss)"


def _loss_not_from_loss_function(cls: type) -> str | None:
    """Why ``cls.forward`` may compute its loss otherwise than with ``self.loss_function``, or None."""
    sources = _loss_forward_sources(cls)
    return sources if isinstance(sources, str) else None


def _aux_loss_coefficient(cls: type) -> tuple[tuple[str, ...] | None, str | None]:
    """``(path, None)``: ``cls.forward`` adds ``self.<path> * aux_loss`` (a MoE router's
    load-balancing loss) to its loss when given labels; ``(None, None)``: it adds nothing;
    ``(None, reason)``: it adds something else, which the chunked loss would drop. The chunked
    forward runs the model with ``labels=None``, so Hugging Face adds none of it there."""
    sources = _loss_forward_sources(cls)
    if isinstance(sources, str):
        return None, sources
    paths = set()
    for statement in _LOSS_ADDITION.findall("\n".join(sources)):
        match = _AUX_LOSS_ADDITION.match(statement)
        if match is None:
            reason = f"{cls.__name__}.forward adds to its loss ({statement.strip()}), which loss='chunked' does not reproduce"
            return None, reason
        paths.add(match.group(1))
    if len(paths) > 1:
        return None, f"{cls.__name__}.forward adds its aux_loss with several coefficients {sorted(paths)}"
    return (tuple(paths.pop().lstrip(".").split(".")) if paths else None), None


def _is_plain_linear(head: nn.Module) -> bool:
    """Whether ``head(x)`` is ``F.linear(x, head.weight, head.bias)`` (see memopt/_stock_forward.py:
    a PEFT LoRA layer, an accelerate hook or a weight computed by a pre-hook would be bypassed by
    the chunked loss, which reads weight and bias)."""
    return isinstance(head, nn.Linear) and runs_stock_forward(head, nn.Linear.forward)


def causal_lm(model: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face causal LM in ``model`` (``model`` itself, or the one a PEFT
    wrapper holds): a ``PreTrainedModel`` whose ``get_output_embeddings()`` is an ``nn.Linear``
    and whose forward takes ``labels``; None when there is none."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    for module in model.modules():
        if (
            isinstance(module, transformers.PreTrainedModel)
            and isinstance(module.get_output_embeddings(), nn.Linear)
            and "labels" in inspect.signature(type(module).forward).parameters
        ):
            return module
    return None


def chosen_loss(model: nn.Module, loss: str | None) -> nn.Module | None:
    """The causal LM whose forward ``wrap(model, loss=loss)`` gives the chunked loss, or None.

    ``loss=None`` (the default) is ``"chunked"`` for a model that holds a Hugging Face causal LM
    that takes it, ``"plain"`` otherwise; an explicit ``"chunked"`` raises ``ValueError`` naming
    the reason when the model cannot take it.
    """
    if loss is not None and loss not in LOSSES:
        raise ValueError(f"memopt.wrap: loss must be None, 'chunked' or 'plain', got {loss!r}")
    if loss == "plain":
        return None
    lm = causal_lm(model)
    reason = "it holds no Hugging Face causal LM" if lm is None else _why_not(lm)
    if reason is None:
        return lm
    if loss == "chunked":
        raise ValueError(f"memopt.wrap: loss='chunked' needs a Hugging Face causal LM, but {reason}; pass loss='plain'")
    return None


def _decoder(model: nn.Module) -> nn.Module:
    """The module whose output's ``last_hidden_state`` feeds the LM head: ``get_decoder()``
    (OPT's is ``model.model.decoder``, not the base model), else ``base_model``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else model.base_model


class _CaptureHidden:
    """A forward hook on the decoder that records its last hidden state while a chunked call runs."""

    __slots__ = ("owner",)

    def __init__(self, owner: "_ChunkedLossForward"):
        self.owner = owner

    def __call__(self, module, inputs, output) -> None:
        if self.owner.capturing:
            hidden = getattr(output, "last_hidden_state", None)
            self.owner.captured.append(output[0] if hidden is None else hidden)


class _ChunkedLossForward:
    """The forward installed on a causal LM: the chunked loss when called with labels, the
    model's own forward otherwise. An object holding the model, not a closure, so that a wrapped
    model pickles and deep-copies (the copy's forward points at the copied model)."""

    __slots__ = (
        "model", "previous_forward", "parameter_names", "hook", "capturing", "captured", "checked",
        "aux_loss_coefficient", "warned", "plain",
    )  # fmt: skip

    def __init__(self, model: nn.Module, previous_forward):
        self.model = model
        # The instance-level forward the model had before, or None for its class's forward.
        self.previous_forward = previous_forward
        # The forward's parameters in order, to find labels passed positionally (read once
        # here: inspect.signature is not for torch.compile to trace).
        signature = inspect.signature(type(model).forward)
        self.parameter_names = [
            p.name for p in list(signature.parameters.values())[1:]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]  # fmt: skip
        self.capturing = False
        self.captured: list[torch.Tensor] = []
        # Whether the last-position logits have been compared with the LM head once.
        self.checked = False
        # The attribute path (from the model) of the coefficient with which its forward adds a
        # MoE router's aux_loss to the loss, or None (read from the source once, as above).
        self.aux_loss_coefficient = _aux_loss_coefficient(type(model))[0]
        # Whether the fallback to the plain loss for a changed LM head has been warned of.
        self.warned = False
        # Whether calls run the model's own forward and loss (inside plain_loss).
        self.plain = False
        self.hook = _decoder(model).register_forward_hook(_CaptureHidden(self))

    @property
    def __signature__(self) -> inspect.Signature:
        # The model's own: Hugging Face's Trainer keeps only the dataset columns that model.forward
        # names (remove_unused_columns), and would drop input_ids before a (*args, **kwargs).
        return inspect.signature(self.previous_forward or functools.partial(type(self.model).forward, self.model))

    def __call__(self, *args, **kwargs):
        original = self.previous_forward or functools.partial(type(self.model).forward, self.model)
        if len(args) > len(self.parameter_names):
            return original(*args, **kwargs)  # let the model's forward raise its own TypeError
        call = dict(zip(self.parameter_names, args))
        call.update(kwargs)
        if self.plain or call.get("labels") is None:
            return original(*args, **kwargs)
        if call.get("fused_lm_head"):
            # TRL's SFTTrainer patches the forward with its own fused LM-head loss and asks for it
            # with fused_lm_head=True: that loss materialises no logits either, and is the one the
            # unwrapped trainer computes, so it runs as asked.
            return original(*args, **kwargs)
        head = self.model.get_output_embeddings()
        if not _is_plain_linear(head):
            # The LM head changed since wrap (a PEFT LoRA adapter on lm_head, a hook): the chunked
            # loss reads head.weight and would bypass it, so Hugging Face's loss runs instead.
            if not self.warned:
                self.warned = True
                head_class = f"{type(head).__module__}.{type(head).__qualname__}"
                warnings.warn(
                    f"memopt.wrap: {type(self.model).__name__}'s LM head is now {head_class} with hooks or a forward "
                    "of its own (not a plain nn.Linear, as at wrap), which loss='chunked' would bypass; Hugging "
                    "Face's plain loss runs instead (logits are materialised)",
                    stacklevel=2,
                )
            return original(*args, **kwargs)
        return self._chunked(original, call, head)

    def _chunked(self, original, call: dict, head: nn.Linear):
        model = self.model
        labels = call.pop("labels")
        logits_to_keep = call.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(
                "memopt.wrap: logits_to_keep with labels is not supported under loss='chunked' (the loss "
                "covers every position); pass loss='plain'"
            )
        # As Hugging Face's can_return_tuple decides it.
        return_dict = call.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        # What Hugging Face's ForCausalLMLoss reads from the forward's keyword arguments.
        num_items_in_batch = call.get("num_items_in_batch")
        ignore_index = call.get("ignore_index", -100)
        shift_labels = call.get("shift_labels")

        self.captured = []
        self.capturing = True
        try:
            output = original(**call, labels=None, logits_to_keep=1, return_dict=True)
        finally:
            self.capturing = False
        captured, self.captured = self.captured, []
        if len(captured) != 1:
            raise RuntimeError(
                f"memopt.wrap: loss='chunked' expected {type(_decoder(model)).__name__} to run once per "
                f"forward, it ran {len(captured)} times; pass loss='plain'"
            )
        hidden = captured[0]
        # Read where the forwards read it (Gemma-2's and Gemma-3's self.config).
        softcap = getattr(model.config, "final_logit_softcapping", None)
        # The check needs a data-dependent branch, which a compiled graph cannot take: a model
        # compiled before any eager call with labels is checked at its first eager one.
        if not self.checked and not torch.compiler.is_compiling():
            self._check_last_logits(hidden, head, softcap, output.logits)
            self.checked = True

        if shift_labels is None:
            # ForCausalLMLoss's shift: pad with ignore_index and drop the first label, so that
            # position t predicts label t + 1 and the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.to(hidden.device)
        if target.shape != hidden.shape[:-1]:
            raise ValueError(
                f"memopt.wrap: labels of shape {tuple(labels.shape)} do not match the hidden states' "
                f"{tuple(hidden.shape[:-1])} (batch, seq)"
            )
        reduction = "mean" if num_items_in_batch is None else "sum"
        # ForCausalLMLoss upcasts the logits to float32: the loss as accumulated in float32, not
        # rounded to a float16/bfloat16 model's dtype.
        loss = linear_cross_entropy(
            hidden, head.weight, target, bias=head.bias, ignore_index=ignore_index, reduction=reduction,
            logit_softcap=softcap, _accumulated=True,
        )  # fmt: skip
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        aux_loss = getattr(output, "aux_loss", None)
        if aux_loss is not None:
            # A MoE model (output_router_logits) adds its router's load-balancing loss when given
            # labels, which this call did not pass: added here as its forward adds it.
            if self.aux_loss_coefficient is None:
                raise RuntimeError(
                    f"memopt.wrap: {type(model).__name__} returned an aux_loss that its forward's source does not "
                    "show how to add to the loss; loss='chunked' would drop it. Pass loss='plain'"
                )
            coefficient = functools.reduce(getattr, self.aux_loss_coefficient, model)
            loss = loss + coefficient * aux_loss.to(loss.device)
        fields = {name: value for name, value in output.items() if name not in ("loss", "logits")}
        result = type(output)(loss=loss, logits=None, **fields)
        if return_dict:
            return result
        # Hugging Face's tuple (to_tuple: the fields that are not None, in order), with None where
        # the logits were, so that positional fields keep their places (out[1] of a causal LM's
        # tuple is its logits).
        return tuple(
            result[f.name] if f.name != "logits" else None
            for f in dataclasses.fields(result)
            if f.name == "logits" or result.get(f.name) is not None
        )

    def _check_last_logits(self, hidden, head, softcap, model_logits) -> None:
        """Raise when the model's last-position logits are not the LM head of the captured hidden
        state (softcapped): the model does something between the two this module does not know."""
        with torch.no_grad():
            logits = head(hidden[..., -1:, :])
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            ok = model_logits is not None and model_logits.shape == logits.shape
            # The same ops as the model's forward: equal up to the logits dtype's rounding.
            tolerance = max(1e-3, 4 * torch.finfo(logits.dtype).eps)
            # equal_nan: NaN where the model's own logits have it (a NaN hidden state, say) is the
            # same function; the chunked loss is then NaN as the model's own loss is.
            ok = ok and torch.allclose(model_logits.float(), logits.float(), rtol=tolerance, atol=tolerance, equal_nan=True)
            finite = model_logits is None or bool(torch.isfinite(model_logits).all() and torch.isfinite(logits).all())
        if not ok and not finite:
            raise RuntimeError(
                f"memopt.wrap: {type(self.model).__name__}'s last-position logits hold NaN or inf where its LM head "
                "applied to its base model's last hidden state does not (or the other way round), so loss='chunked' "
                "cannot check that it computes the model's loss; look for the non-finite values in the unwrapped "
                "model first (fp16 overflow, a fully masked attention row), or pass loss='plain'"
            )
        if not ok:
            raise RuntimeError(
                f"memopt.wrap: {type(self.model).__name__}'s logits are not its LM head applied to its base "
                "model's last hidden state (it rescales or transforms them in a way loss='chunked' does "
                "not reproduce); pass loss='plain'"
            )


@contextlib.contextmanager
def plain_loss(model: nn.Module):
    """Within the context, every causal LM in ``model`` (itself, or one a PEFT wrapper holds) that
    :func:`install` gave the chunked loss runs its own forward and Hugging Face's loss: calls
    with labels return the logits too. For a step that needs them (a Trainer's prediction step
    feeding ``compute_metrics``); other calls keep the chunked loss, which saves the logits'
    memory also without gradients. A model without a chunked loss runs unchanged."""
    # Found by a walk, not from memopt.wrap's state: the model given may only hold the wrapped one
    # (a Trainer's prediction step gets nn.DataParallel(model) on several GPUs; a module with a
    # wrapped submodule). 0.6 ms a step for a 32-layer Llama on a 2-core CPU.
    forwards = [f for m in model.modules() if isinstance(f := m.__dict__.get("forward"), _ChunkedLossForward)]
    previous = [f.plain for f in forwards]
    for forward in forwards:
        forward.plain = True
    try:
        yield
    finally:
        for forward, plain in zip(forwards, previous):
            forward.plain = plain


def install(lm: nn.Module) -> _ChunkedLossForward:
    """Give ``lm`` the chunked-loss forward (an instance attribute); :func:`remove` undoes it."""
    forward = _ChunkedLossForward(lm, lm.__dict__.get("forward"))
    lm.forward = forward
    return forward


def remove(forward: _ChunkedLossForward) -> None:
    """Put back the forward ``lm`` had before :func:`install`, and drop the capture hook."""
    forward.hook.remove()
    model = forward.model
    if forward.previous_forward is None:
        del model.forward
    else:
        model.forward = forward.previous_forward
