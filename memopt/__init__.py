"""memopt: train bigger transformers in the GPU memory you have.

Importing memopt loads the native extension (``memopt._C``) and registers every op under
``torch.ops.memopt``.
"""

from memopt._extension import build_info
from memopt.block import EagerTransformerBlock, FusedCheckpointBlock, FusedCheckpointStack
from memopt.ops.activation import act_linear, bias_act, swiglu
from memopt.ops.attention import attention
from memopt.ops.cross_entropy import linear_cross_entropy
from memopt.ops.dropout import dropout_add
from memopt.offload import Offload, OffloadEngine, offload, offload_module_groups
from memopt.ops.norm import layer_norm, norm_linear, rms_norm
from memopt.saved import SavedTensorCounter, saved_bytes
from memopt.adaptive import AdaptiveBatch, MicroBatchFloorError
from memopt.estimate import ModelConfig, estimate, max_micro_batch, max_seq_len, register_policy_formula
from memopt.estimate import PRESETS as estimate_presets
from memopt.report import diagnose_oom, memory_report
from memopt.checkpoint import checkpoint
from memopt.plan import LayerCost, Plan, plan
from memopt.wrap import unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBatch",
    "EagerTransformerBlock",
    "FusedCheckpointBlock",
    "FusedCheckpointStack",
    "LayerCost",
    "MicroBatchFloorError",
    "ModelConfig",
    "Offload",
    "OffloadEngine",
    "Plan",
    "SavedTensorCounter",
    "act_linear",
    "attention",
    "bias_act",
    "build_info",
    "checkpoint",
    "diagnose_oom",
    "dropout_add",
    "estimate",
    "estimate_presets",
    "layer_norm",
    "linear_cross_entropy",
    "max_micro_batch",
    "max_seq_len",
    "memory_report",
    "norm_linear",
    "offload",
    "offload_module_groups",
    "plan",
    "register_policy_formula",
    "rms_norm",
    "saved_bytes",
    "swiglu",
    "unwrap",
    "wrap",
]
