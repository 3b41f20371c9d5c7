"""memopt inside the training frameworks people already use.

- :mod:`memopt.integrations.transformers`: Hugging Face ``Trainer`` (memopt's checkpointing
  selected through ``TrainingArguments``, OOM recovery that keeps the batch).

Each module imports its framework lazily, so ``import memopt`` never needs it.
"""
