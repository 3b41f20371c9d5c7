"""memopt: train bigger transformers in the GPU memory you have.

Importing memopt loads the native extension (``memopt._C``) and registers every op under
``torch.ops.memopt``.
"""

from memopt._extension import build_info
from memopt.ops.dropout import dropout_add
from memopt.checkpoint import checkpoint
from memopt.saved import SavedTensorCounter, saved_bytes
from memopt.wrap import Plan, plan, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "SavedTensorCounter",
    "build_info",
    "checkpoint",
    "dropout_add",
    "plan",
    "saved_bytes",
    "unwrap",
    "wrap",
]
