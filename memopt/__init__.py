"""memopt: train bigger transformers in the GPU memory you have.

Importing memopt loads the native extension (``memopt._C``) and registers every op under
``torch.ops.memopt``.
"""

from memopt._extension import build_info
from memopt.ops.activation import act_linear, bias_act, swiglu
from memopt.ops.dropout import dropout_add
from memopt.ops.norm import layer_norm, norm_linear, rms_norm
from memopt.saved import SavedTensorCounter, saved_bytes

__version__ = "0.1.0"

__all__ = [
    "SavedTensorCounter",
    "act_linear",
    "bias_act",
    "build_info",
    "dropout_add",
    "layer_norm",
    "norm_linear",
    "rms_norm",
    "saved_bytes",
    "swiglu",
]
