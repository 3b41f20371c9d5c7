"""Helpers for the test-suite: devices, dtype tolerance tables, saved-bytes counting."""

from __future__ import annotations

import pytest
import torch

CPU_DTYPES = [torch.float32, torch.float64]
CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

gpu = pytest.mark.gpu

# (atol, rtol) per dtype for elementwise and row-reduction ops checked against a float64
# reference. Half precision: about 2x the error plain PyTorch makes in the same dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerances(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def device_dtype_params():
    """(device, dtype) pairs: CPU ones run everywhere, CUDA ones carry the gpu marker."""
    params = [pytest.param("cpu", dt, id=f"cpu-{str(dt).split('.')[-1]}") for dt in CPU_DTYPES]
    params += [pytest.param("cuda", dt, id=f"cuda-{str(dt).split('.')[-1]}", marks=gpu) for dt in CUDA_DTYPES]
    return params
