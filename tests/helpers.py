"""Helpers for the test-suite: devices, dtype tolerance tables, saved-bytes counting."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

CPU_DTYPES = [torch.float32, torch.float64]
CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

gpu = pytest.mark.gpu


class MemoptOpCalls(TorchDispatchMode):
    """Records each call of a ``torch.ops.memopt`` op whose name contains ``name_part``, below
    autograd (a C++ node's calls too): ``calls`` holds its arguments by schema name, defaults
    filled in. Shows what a backward asked of the kernels, e.g. which gradients."""

    def __init__(self, name_part: str):
        super().__init__()
        self.name_part = name_part
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "memopt" and self.name_part in func.__name__:
            schema = func._schema.arguments
            self.calls.append(
                {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)}
            )
        return func(*args, **kwargs)


def _triton_interpreter_missing() -> str | None:
    """Why memopt's Triton kernels cannot run on CPU here, or None when they can."""
    from memopt.ops.attention import attention_triton

    if attention_triton is None:
        return "triton is not installed (CPU-only torch wheels lack it)"
    if not attention_triton.INTERPRETED:
        return "the Triton CPU path needs TRITON_INTERPRET=1 before memopt is imported"
    from memopt.ops.attention import _interpreter_numpy_problem

    return _interpreter_numpy_problem()


_WHY_NO_TRITON_INTERPRETER = _triton_interpreter_missing()
# Tests that run memopt's Triton kernels on CPU tensors, in Triton's interpreter.
needs_triton_interpreter = pytest.mark.skipif(
    _WHY_NO_TRITON_INTERPRETER is not None, reason=_WHY_NO_TRITON_INTERPRETER or ""
)

# (atol, rtol) per dtype for elementwise and row-reduction ops checked against a float64
# reference. Half precision: about 2x the error plain PyTorch makes in the same dtype.
TOLERANCES = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def installed_triton_version() -> str | None:
    """triton's version, or None where it is not installed (CPU-only torch wheels lack it)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def tolerances(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def device_dtype_params():
    """(device, dtype) pairs: CPU ones run everywhere, CUDA ones carry the gpu marker."""
    params = [pytest.param("cpu", dt, id=f"cpu-{str(dt).split('.')[-1]}") for dt in CPU_DTYPES]
    params += [pytest.param("cuda", dt, id=f"cuda-{str(dt).split('.')[-1]}", marks=gpu) for dt in CUDA_DTYPES]
    return params


def leave_without_gloo_teardown() -> None:
    """End a torchrun worker whose checks all passed: barrier, flush, ``os._exit(0)``. gloo's
    teardown at exit has aborted the process now and then on these CPU machines ("terminate
    called without an active exception" after all checks printed), which is torch/gloo's and would
    fail a green run."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tiny_llama_float64():
    """A 2-layer Llama (hidden 16, grouped-query attention: 4 heads, 2 kv heads, vocab 40, eager
    attention) in float64 and training mode, with random weights: no download."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=40, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double().train()


def tiny_gpt2_float64():
    """A 2-layer GPT-2 (hidden 16, 4 heads, vocab 40, 16 positions, eager attention, every dropout
    0.1) in float64 and training mode, with random weights: no download."""
    import transformers

    config = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=4, vocab_size=40, n_positions=16, attn_implementation="eager",
        attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double().train()
