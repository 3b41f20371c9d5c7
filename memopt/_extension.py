"""Loads the native extension ``memopt._C`` and says what it was built with.

Importing memopt without the extension fails loudly: there is no silent slow fallback.
"""

from __future__ import annotations

import os
import re

import torch

_BUILD_HINT = (
    "Build it from the repository root with\n"
    "    pip install --no-build-isolation -e .\n"
    "(see README.md; set MEMOPT_BUILD_CUDA=0 for a quick CPU-only build)."
)

try:
    from memopt import _C  # noqa: F401  (registers torch.ops.memopt.* on import)
except ImportError as err:  # pragma: no cover - exercised by users, not by the test suite
    here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"memopt's native extension memopt._C could not be loaded from {here}: {err}\n"
        f"It must be built against the torch you run (torch {torch.__version__} here). " + _BUILD_HINT
    ) from err

_INFO = _C.build_info()


def build_info() -> dict:
    """What ``memopt._C`` was built with.

    Returns a dict with ``with_cuda`` (bool: CUDA kernels compiled in), ``cuda_archs``
    (list of arch strings such as ``["8.0", "9.0"]``) and ``torch_version`` (the torch the
    extension was compiled against).
    """
    archs = [a for a in _INFO["cuda_archs"].split("_") if a]
    return {"with_cuda": bool(_INFO["with_cuda"]), "cuda_archs": archs, "torch_version": _INFO["torch_version"]}


def _check_torch_matches() -> None:
    built = _INFO["torch_version"]
    if built and built != re.sub(r"[^0-9A-Za-z.+]", "_", torch.__version__):
        raise ImportError(
            f"memopt._C was built against torch {built} but torch {torch.__version__} is installed; "
            "a C++ extension only loads into the torch it was compiled for. " + _BUILD_HINT
        )


_check_torch_matches()


def require_cuda_kernels(op: str, tensor: torch.Tensor) -> None:
    """Raise a clear error when a CUDA tensor reaches a build without CUDA kernels."""
    if tensor.is_cuda and not _INFO["with_cuda"]:
        raise RuntimeError(
            f"memopt.{op}: got a CUDA tensor but memopt._C was built without CUDA kernels. "
            "Rebuild with a CUDA toolkit present (MEMOPT_BUILD_CUDA=1 to insist). " + _BUILD_HINT
        )
