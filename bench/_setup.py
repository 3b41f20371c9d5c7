"""Run Triton kernels through the interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when each ``@triton.jit`` decorator runs, so it must be set before
memopt is imported; an explicit setting in the environment wins.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
