"""memopt: train bigger transformers in the GPU memory you have.

Importing memopt loads the native extension (``memopt._C``) and registers every op under
``torch.ops.memopt``.
"""

from memopt._extension import build_info
from memopt.offload import Offload, OffloadEngine, offload, offload_module_groups
from memopt.ops.dropout import dropout_add
from memopt.saved import SavedTensorCounter, saved_bytes

__version__ = "0.1.0"

__all__ = [
    "Offload",
    "OffloadEngine",
    "SavedTensorCounter",
    "build_info",
    "dropout_add",
    "offload",
    "offload_module_groups",
    "saved_bytes",
]
