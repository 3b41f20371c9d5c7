"""Build memopt and its native extension ``memopt._C``.

What gets built is decided from the environment, the way flash-attention and xformers do it:

* ``MEMOPT_BUILD_CUDA``: ``auto`` (default) builds the CUDA kernels when a CUDA toolkit and a
  CUDA build of torch are both present; ``1`` forces them (and fails if they cannot be built);
  ``0`` skips them (CPU kernels only, a much faster build).
* ``TORCH_CUDA_ARCH_LIST``: the GPU architectures to compile for. Default ``8.0;9.0``
  (A100 and H100/H200), also when no GPU is visible, which is where torch's own detection fails.
* ``MAX_JOBS``: parallel compile jobs (``ninja -j``).
* ``CUDA_HOME``: the toolkit; found from ``nvcc`` on the PATH when unset.
* ``MEMOPT_PTXAS_VERBOSE=1``: print registers, spills and shared memory per CUDA kernel.

Build with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be built
against the torch it will run with, and an isolated build would fetch a torch of its own.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _is_toolkit(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def find_cuda_home() -> str | None:
    """The CUDA toolkit folder (``bin/nvcc`` and ``include/cuda_runtime.h``), or None.

    ``nvcc`` on the PATH may be a wrapper script (as here: ``exec /usr/local/cuda-13.0/bin/nvcc``);
    torch would take the wrapper's grandparent folder, which holds no headers.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        try:
            with open(real, "rb") as f:
                head = f.read(4096)
            if head.startswith(b"#!"):
                for target in re.findall(rb"(/\S+)/bin/nvcc\b", head):
                    candidates.append(target.decode())
        except OSError:
            pass
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for path in candidates:
        if _is_toolkit(path):
            return os.path.abspath(path)
    return None


def cuda_library_include_dirs() -> list[str]:
    """Headers that ATen's CUDA headers include (cublas_v2.h, cusparse.h, ...).

    A bare toolkit may lack them; torch's pip dependencies ship them under nvidia/*/include.
    """
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    dirs = []
    for base in spec.submodule_search_locations:
        for inc in sorted(glob.glob(os.path.join(base, "*", "include"))):
            if glob.glob(os.path.join(inc, "cublas*.h")) or glob.glob(os.path.join(inc, "cusparse*.h")):
                dirs.append(os.path.abspath(inc))
    return dirs


def _token(text: str) -> str:
    """`text` as one preprocessor token sequence without spaces or shell metacharacters."""
    return re.sub(r"[^0-9A-Za-z.+]", "_", text)


def build_cuda_mode() -> str:
    value = os.environ.get("MEMOPT_BUILD_CUDA", "auto").strip().lower()
    if value not in ("auto", "1", "0"):
        sys.exit(f"MEMOPT_BUILD_CUDA must be 'auto', '1' or '0', got {value!r}")
    return value


def make_extensions():
    mode = build_cuda_mode()
    cuda_home = find_cuda_home() if mode != "0" else None
    if cuda_home:
        # torch.utils.cpp_extension reads CUDA_HOME when it is first imported.
        os.environ["CUDA_HOME"] = cuda_home

    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    torch_has_cuda = torch.version.cuda is not None
    with_cuda = mode != "0" and cuda_home is not None and torch_has_cuda
    if mode == "1" and not with_cuda:
        sys.exit(
            "MEMOPT_BUILD_CUDA=1 but the CUDA kernels cannot be built: "
            + ("no CUDA toolkit found (set CUDA_HOME)" if cuda_home is None else "")
            + ("" if torch_has_cuda else f"torch {torch.__version__} is a CPU-only build")
        )

    # Sources relative to setup.py (setuptools refuses absolute ones when writing the manifest);
    # include dirs absolute (ninja runs from the build folder).
    cpp_sources = sorted(glob.glob("csrc/*.cpp", root_dir=ROOT))
    cu_sources = sorted(glob.glob("csrc/*.cu", root_dir=ROOT))
    include_dirs = [os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3"]
    # at::parallel_for is an inline template over OpenMP: without -fopenmp the CPU kernels' loops
    # would run on one thread whatever torch.set_num_threads says. torch's own libgomp (loaded
    # with torch, first in the global symbol scope) serves the extension's parallel regions, so
    # both share one thread pool and torch.set_num_threads.
    link_flags = []
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    # Bare tokens: quotes and ';' do not survive the shell that ninja runs compilers in.
    define_macros = [("MEMOPT_TORCH_VERSION", _token(torch.__version__))]

    if not with_cuda:
        print(f"memopt: building CPU kernels only (MEMOPT_BUILD_CUDA={mode}, CUDA_HOME={cuda_home}, "
              f"torch CUDA={torch.version.cuda})")
        define_macros.append(("MEMOPT_CUDA_ARCHS", ""))
        return [
            CppExtension(
                "memopt._C",
                cpp_sources,
                include_dirs=include_dirs,
                define_macros=define_macros,
                extra_compile_args={"cxx": cxx_flags},
                extra_link_args=link_flags,
            )
        ]

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
    # Torch's arch detection needs a GPU; give it the list explicitly.
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    include_dirs += cuda_library_include_dirs()
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DMEMOPT_WITH_CUDA"]
    if os.environ.get("MEMOPT_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    define_macros += [("MEMOPT_WITH_CUDA", None), ("MEMOPT_CUDA_ARCHS", _token(archs))]
    print(f"memopt: building CPU and CUDA kernels (CUDA_HOME={cuda_home}, archs {archs}, "
          f"torch {torch.__version__})")
    return [
        CUDAExtension(
            "memopt._C",
            cpp_sources + cu_sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )
    ]


def main():
    os.chdir(ROOT)
    ext_modules = make_extensions()  # sets CUDA_HOME before torch.utils.cpp_extension is imported
    from torch.utils.cpp_extension import BuildExtension

    setup(
        packages=find_packages(include=["memopt", "memopt.*"]),
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
