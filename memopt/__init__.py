"""memopt: train bigger transformers in the GPU memory you have.

Importing memopt loads the native extension (``memopt._C``) and registers every op under
``torch.ops.memopt``.
"""

from memopt._extension import build_info
from memopt.ops.attention import attention
from memopt.ops.dropout import dropout_add
from memopt.saved import SavedTensorCounter, saved_bytes

__version__ = "0.1.0"

__all__ = ["SavedTensorCounter", "attention", "build_info", "dropout_add", "saved_bytes"]
