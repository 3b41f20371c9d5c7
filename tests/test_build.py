"""The extension loads, reports what it was built with, and every op has its kernels."""

import os

import pytest
import torch

import memopt


def memopt_cpp_ops():
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("memopt::")]
    return sorted(n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CPU"))


def test_build_info_shape():
    info = memopt.build_info()
    assert set(info) == {"with_cuda", "cuda_archs", "torch_version"}
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert bool(info["cuda_archs"]) == info["with_cuda"]


@pytest.mark.skipif(os.environ.get("MEMOPT_EXPECT_CUDA_BUILD") != "1", reason="only where a CUDA build is required")
def test_cuda_kernels_were_compiled():
    info = memopt.build_info()
    assert info["with_cuda"], "CI requires the CUDA sources to be compiled"
    assert {"8.0", "9.0"} <= set(info["cuda_archs"]) or os.environ.get("TORCH_CUDA_ARCH_LIST")


@pytest.mark.skipif(os.environ.get("MEMOPT_EXPECT_CUDA_BUILD") != "0", reason="only where a CPU-only build is expected")
def test_cpu_only_build_where_expected():
    # CI's CPU-only torch run: MEMOPT_BUILD_CUDA=auto must not try the CUDA sources.
    info = memopt.build_info()
    assert not info["with_cuda"] and info["cuda_archs"] == [], info


# Ops that cannot reach a CUDA kernel: their only tensor argument is the RNG key, which memopt
# keeps on the CPU (seed, offset), so the dispatcher always picks the CPU kernel.
HOST_ONLY_OPS = {"memopt::philox_dropout_scale": "the native CPU attention path's dropout factors"}
# Ops that wrap a CPU-only ATen kernel: memopt.attention calls this one for CPU tensors only (CUDA
# attention runs attention_fwd / attention_bwd / attention_bwd_packed); a CUDA tensor gets the dispatcher's "could not
# run with arguments from the 'CUDA' backend".
CPU_ONLY_OPS = {
    "memopt::attention_flash_cpu": "the CPU flash attention kernels under a C++ autograd node",
    "memopt::cpu_flash_attention_fwd": "memopt's CPU flash attention kernels (CUDA runs the Triton or ATen ones)",
    "memopt::cpu_flash_attention_bwd": "memopt's CPU flash attention kernels",
    "memopt::cpu_flash_attention_bwd_packed": "memopt's CPU flash attention kernels",
}


def _has_kernel(name: str, key: str) -> bool:
    """A kernel for ``key``, its own or a CompositeExplicitAutograd one (the differentiable norms:
    their autograd node calls the per-backend forward and backward ops)."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in (key, "CompositeExplicitAutograd"))


def test_every_op_has_cpu_and_cuda_kernels_and_a_fake_impl():
    ops = memopt_cpp_ops()
    assert "memopt::dropout_add_fwd" in ops
    with_cuda = memopt.build_info()["with_cuda"]
    for name in ops:
        if name in HOST_ONLY_OPS:
            namespace, op = name.split("::")
            schema = getattr(getattr(torch.ops, namespace), op).default._schema
            tensors = [a.name for a in schema.arguments if str(a.type).startswith("Tensor")]
            assert tensors == ["rng_key"], f"{name} takes tensors {tensors}: it needs a CUDA kernel after all"
        elif name in CPU_ONLY_OPS:
            assert not _has_kernel(name, "CUDA"), f"{name} has a CUDA kernel now: take it out of CPU_ONLY_OPS"
        elif with_cuda:
            assert _has_kernel(name, "CUDA"), f"{name} has no CUDA kernel"
        assert _has_kernel(name, "CPU"), f"{name} has no CPU kernel"
        fake = torch._library.simple_registry.singleton.find(name).fake_impl.kernel
        assert fake is not None, f"{name} has no fake impl (torch.library.register_fake)"
