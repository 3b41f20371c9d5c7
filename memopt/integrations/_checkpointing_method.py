"""Whether a model has Hugging Face's checkpointing switch, without importing transformers.

:func:`memopt.wrap` asks it of every model it wraps (a plain ``nn.Module`` must not pull in
transformers), and :mod:`memopt.integrations.transformers` installs memopt's switch where it says
yes: one rule for both.
"""

from __future__ import annotations

from torch import nn

# transformers 5.x: activation_checkpointing_enable (the Trainer's entry point; the older name
# forwards to it); 4.x: gradient_checkpointing_enable.
METHOD_NAMES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


def own_method(model: nn.Module, name: str):
    """The model's ``name`` method as it is without the switch: its class's, else the one its
    ``__getattr__`` reaches (a PEFT model's: the wrapped Hugging Face model's); None when none."""
    if hasattr(type(model), name):
        return getattr(type(model), name).__get__(model)
    try:
        return type(model).__getattr__(model, name)
    except AttributeError:
        return None


def has_checkpointing_method(model: nn.Module) -> bool:
    """Whether ``model`` has Hugging Face's checkpointing switch (a ``PreTrainedModel``, or a PEFT
    model holding one), on which :func:`memopt.integrations.transformers.take_over_checkpointing`
    installs memopt's."""
    return any(own_method(model, n) is not None for n in METHOD_NAMES)
