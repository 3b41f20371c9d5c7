"""memopt with Hugging Face ``transformers.Trainer``.

Three things, usable apart:

- **Checkpointing through ``TrainingArguments``.** With ``gradient_checkpointing=True`` (in
  transformers 5.x also spelled ``activation_checkpointing=True``) the Trainer calls the model's
  ``activation_checkpointing_enable`` (4.x: ``gradient_checkpointing_enable``) with
  ``gradient_checkpointing_kwargs``. :func:`take_over_checkpointing` replaces that method on the
  model instance (the public hook: the Trainer calls it, nothing else) so that a ``"memopt"`` key
  selects memopt instead of Hugging Face's checkpointing::

      TrainingArguments(..., gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"memopt": {"policy": "selective"}})

  The dict under ``"memopt"`` is :func:`memopt.wrap`'s keyword arguments (``policy``, ``offload``,
  ``budget_bytes`` with ``example_inputs``, ``loss``: the chunked causal-LM loss is on by default,
  and works with the Trainer's ``num_items_in_batch``). Without the key, Hugging Face's own
  checkpointing runs, unless the model is already memopt-wrapped: then it raises, since the
  layers would be checkpointed twice. :func:`memopt.wrap` installs the same switch on every
  Hugging Face model it wraps, so a plain ``Trainer`` with ``gradient_checkpointing=True`` on a
  wrapped model raises too instead of checkpointing twice.
- **OOM recovery that keeps the batch.** :class:`MemoptTrainer` is a ``Trainer`` whose
  ``training_step`` runs each batch through :meth:`memopt.AdaptiveBatch.accumulate`: a micro-step
  that runs out of memory is rolled back and retried on half as many samples, from the same
  sample, so every sample is seen once and the step's gradient is the whole batch's. The
  Trainer's ``auto_find_batch_size`` (Accelerate's ``find_executable_batch_size``) instead halves
  ``per_device_train_batch_size`` and restarts the training loop: the effective batch (and the
  step count, the learning-rate schedule, what the run computes) changes, and the steps already
  taken are run again.

- **Logits for metrics.** The chunked causal-LM loss :func:`memopt.wrap` gives by default makes
  no logits (``logits`` is None with labels), so a plain ``Trainer``'s ``evaluate`` /
  ``predict`` would hand ``compute_metrics`` no predictions. :class:`MemoptTrainer`'s
  ``prediction_step`` runs the model's own forward and loss where logits are asked for, and the
  chunked loss where only the loss is (``evaluate`` without ``compute_metrics``).

Both take PEFT models (``peft.PeftModel`` over a Hugging Face model): the switch goes on the
PEFT instance, whose ``activation_checkpointing_enable`` the Trainer calls.

Limits: :class:`MemoptTrainer` runs on one process (under DDP a rank's OOM would leave the others
in the gradient all-reduce; :class:`memopt.AdaptiveBatch` itself handles DDP in its own loop).

How a batch's loss is split over micro-batches. Each micro-batch's loss is weighted by its share
``s`` of the batch's samples, and, when the Trainer passes ``num_items_in_batch`` (its count of
label tokens over the whole accumulated step, not of samples), ``compute_loss`` gets
``num_items_in_batch * s`` for it. Whichever the loss is, the micro-batches then add up to the
whole batch's loss, with no guess about what the model does with the count:

- normalised by the count (every Hugging Face causal LM, label smoothing, a
  ``compute_loss_func`` that divides by it): ``s * sum_i / (N * s) = sum_i / N``, the micro-batch's
  part of the batch's ``sum / N`` whatever its share of the tokens;
- a mean over the micro-batch's samples that ignores the count (a sequence-classification
  model's MSE or BCE loss, a custom model taking ``**kwargs``): ``s * mean_i``, the micro-batch's
  part of the batch mean;
- a sum of the two: each term as above.

Without an OOM the batch is one micro-step with ``s = 1``, and the loss, the gradient and the
division by the accumulation steps are the Trainer's own (the same rule,
``loss_is_scaled_for_ga``, decides it). Not exact after a split: a loss that averages over the
micro-batch's tokens itself, ignoring the count (weighted by samples where tokens would be
right), and a term that is not a mean of per-sample terms (a MoE load-balancing loss).

trl's ``SFTTrainer`` is a ``Trainer`` subclass: a memopt-wrapped model
(:func:`take_over_checkpointing`) trains under it as under the plain run
(``tests/test_integrations_trl.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from memopt.adaptive import AdaptiveBatch, _leading_size
from memopt.causal_lm_loss import plain_loss
from memopt.integrations._checkpointing_method import METHOD_NAMES, has_checkpointing_method, own_method

__all__ = ["MEMOPT_KEY", "MemoptTrainer", "take_over_checkpointing"]

MEMOPT_KEY = "memopt"
"""The key of ``gradient_checkpointing_kwargs`` whose dict goes to :func:`memopt.wrap`."""


def _checkpointing_method_name(model: nn.Module) -> str:
    # transformers 5.x: activation_checkpointing_enable (the Trainer's entry point; the older
    # name forwards to it); 4.x: gradient_checkpointing_enable. Asked of the instance: a PEFT
    # model's class defines neither, its instance reaches the inner model's through __getattr__.
    return "activation_checkpointing_enable" if hasattr(model, "activation_checkpointing_enable") else (
        "gradient_checkpointing_enable"
    )


class _CheckpointingSwitch:
    """The ``activation_checkpointing_enable`` (or ``gradient_checkpointing_enable``) that
    :func:`take_over_checkpointing` puts on a model instance: memopt when the checkpointing
    kwargs hold :data:`MEMOPT_KEY`, else the model's own method, refused on a wrapped model."""

    def __init__(self, model: nn.Module, method_name: str):
        self.model = model
        self.method_name = method_name
        self.kwargs_name = method_name.replace("_enable", "_kwargs")

    def __call__(self, *args, **kwargs):
        from memopt.wrap import is_wrapped, wrap  # memopt.wrap imports this module for its switch

        checkpointing_kwargs = args[0] if args else kwargs.get(self.kwargs_name)
        if not checkpointing_kwargs or MEMOPT_KEY not in checkpointing_kwargs:
            if is_wrapped(self.model):
                raise RuntimeError(
                    f"{type(self.model).__name__} is wrapped by memopt.wrap, and Hugging Face's activation "
                    "checkpointing would checkpoint its layers a second time. Either let memopt be the "
                    f"checkpointing (TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs="
                    f"{{'{MEMOPT_KEY}': {{...memopt.wrap arguments}}}}) on an unwrapped model), or set "
                    "gradient_checkpointing=False"
                )
            return own_method(self.model, self.method_name)(*args, **kwargs)
        options = checkpointing_kwargs[MEMOPT_KEY]
        if not isinstance(options, dict):
            raise TypeError(
                f"{self.kwargs_name}[{MEMOPT_KEY!r}] must be a dict of memopt.wrap arguments, got {type(options).__name__}"
            )
        others = sorted(k for k in checkpointing_kwargs if k != MEMOPT_KEY)
        if others:
            raise ValueError(
                f"{self.kwargs_name} with {MEMOPT_KEY!r} takes no other keys (they are torch.utils.checkpoint's, and "
                f"memopt does the checkpointing), got {others}"
            )
        every_n_layers = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        kwargs.pop(self.kwargs_name, None)
        if kwargs or len(args) > 1:
            raise TypeError(f"{self.method_name}: unexpected arguments {sorted(kwargs) or args[1:]}")
        if every_n_layers != 1:
            raise ValueError(
                f"every_n_layers={every_n_layers} with {MEMOPT_KEY!r}: give memopt.wrap a per-layer policy instead "
                "(policy={0: 'selective', 2: 'selective', ...}: layers not in the dict are not checkpointed)"
            )
        if offload:
            options = {"offload": True, **options}
        if is_wrapped(self.model):
            raise RuntimeError(
                f"{type(self.model).__name__} is already wrapped by memopt.wrap; pass its arguments under "
                f"{MEMOPT_KEY!r} on an unwrapped model, or leave gradient_checkpointing off"
            )
        wrap(self.model, **options)


def take_over_checkpointing(model: nn.Module) -> nn.Module:
    """Let ``gradient_checkpointing_kwargs={"memopt": {...}}`` select memopt for ``model``.

    Replaces the model's ``activation_checkpointing_enable`` (transformers 4.x:
    ``gradient_checkpointing_enable``) on this instance by a switch: with the ``"memopt"`` key it
    calls ``memopt.wrap(model, **kwargs["memopt"])`` (``offload=True`` from the Trainer's
    ``offload`` key); without it, the model's own method, refused with ``RuntimeError`` while the
    model is memopt-wrapped. A PEFT model (``peft.PeftModel``) gets the switch on its own instance,
    which the Trainer calls; its fallback is the wrapped Hugging Face model's method. Calling it
    again does nothing. Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.integrations.transformers: model must be an nn.Module, got {type(model).__name__}")
    name = _checkpointing_method_name(model)
    if own_method(model, name) is None:
        raise TypeError(f"{type(model).__name__} has no {name}: not a Hugging Face PreTrainedModel (or a PEFT model of one)")
    # A PreTrainedModel's gradient_checkpointing_enable calls its activation_checkpointing_enable,
    # which finds the switch; a PEFT model's reaches the inner model's, which would not: each name
    # its class does not define gets a switch of its own.
    names = [name] + [n for n in METHOD_NAMES if n != name and not hasattr(type(model), n) and own_method(model, n)]
    for each in names:
        if not isinstance(model.__dict__.get(each), _CheckpointingSwitch):
            setattr(model, each, _CheckpointingSwitch(model, each))
    return model


class MemoptTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` with memopt's checkpointing switch and OOM recovery.

    Takes the Trainer's arguments, plus (keyword only) :class:`memopt.AdaptiveBatch`'s
    ``micro_batch`` (the first and largest micro-batch; default: the whole per-device batch),
    ``min_micro_batch`` and ``grow_after``. Each batch of the Trainer (one of its
    ``gradient_accumulation_steps``) is run as micro-batches with gradient accumulation; on
    out-of-memory the micro-batch halves and the failed micro-step is retried from the same
    sample, with ``.grad``, buffers and RNG states as they were before it. The Trainer's loop,
    optimizer step, schedule and logging are the Trainer's own. See the module docstring for the
    limits.
    """

    def __init__(self, *args, micro_batch: int | None = None, min_micro_batch: int = 1,
                 grow_after: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise ValueError(
                f"MemoptTrainer: OOM recovery runs on one process (world_size {self.args.world_size}): a rank that "
                "runs out of memory would leave the others waiting in the gradient all-reduce"
            )
        if has_checkpointing_method(self.model):  # a model without one trains with gradient_checkpointing off
            take_over_checkpointing(self.model)
        self._adaptive_options = {"micro_batch": micro_batch, "min_micro_batch": min_micro_batch,
                                  "grow_after": grow_after}
        self.adaptive_batch: AdaptiveBatch | None = None

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """The Trainer's prediction step; where it returns logits (``prediction_loss_only`` False:
        ``evaluate`` with ``compute_metrics``, ``predict``), a causal LM that ``memopt.wrap`` gave
        the chunked loss (which makes no logits) runs its own forward and loss for the step
        (:func:`memopt.causal_lm_loss.plain_loss`). A loss-only step keeps the chunked loss.
        """
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with plain_loss(model):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        # The rule of Trainer.training_step, from the Trainer's public attributes.
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's training step over ``inputs``, as micro-batches that back off on OOM.

        Returns the batch's loss as ``Trainer.training_step`` does (divided by the accumulation
        steps unless the model normalised it with ``num_items_in_batch``); how micro-batch losses
        add up to it: the module docstring.
        """
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        # Trainer has no public method that moves a batch to the device; its training_step calls
        # this one too.
        inputs = self._prepare_inputs(inputs)
        scaled_for_ga = self._loss_is_scaled_for_ga(num_items_in_batch)
        accumulation_steps = self.current_gradient_accumulation_steps
        size = _leading_size(inputs)

        def loss_fn(model, micro_batch):
            # AdaptiveBatch weights this loss by the micro-batch's share of the samples; the
            # count the loss divides by is scaled by the same share, so the two cancel for a loss
            # normalised by num_items_in_batch and the share weights a mean loss (module docstring).
            share = _leading_size(micro_batch) / size
            items = num_items_in_batch if num_items_in_batch is None or share == 1.0 else num_items_in_batch * share
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro_batch, num_items_in_batch=items)
            return loss if scaled_for_ga else loss / accumulation_steps

        if self.adaptive_batch is None or self.adaptive_batch.model is not model:
            # A Trainer's batches are dicts of (batch, ...) tensors (its collators' convention),
            # also for models with batch_first=False layers inside (Encodec's LSTM), which
            # AdaptiveBatch would otherwise refuse to guess about.
            options = {"batch_dim": 0, **self._adaptive_options}
            self.adaptive_batch = AdaptiveBatch(model, self.optimizer, loss_fn, backward=self.accelerator.backward, **options)
        self.adaptive_batch.loss_fn = loss_fn
        return self.adaptive_batch.accumulate(inputs).loss.to(self.args.device)
