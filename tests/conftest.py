"""Test set-up shared by every test file.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so before memopt is
imported: the Triton kernels then run on CPU tensors. A GPU run sets TRITON_INTERPRET=0.
"""

import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import memopt  # noqa: E402,F401  (loads memopt._C and registers the ops)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same RNG state."""
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)
    yield 0


@pytest.fixture(autouse=True)
def torch_checkpoint_debug_logger():
    """Torch's checkpoint debug mode (``debug=True``, ``set_checkpoint_debug_enabled(True)``)
    leaves its ``LoggingTensor`` logger changed: torch 2.11's ``capture_logs`` adds a filter per
    call and never removes it, and from the second call in a process pytest's log capture fails
    on the records ("not all arguments converted during string formatting"), in that test and
    in later ones. Each test gets the logger back as it found it."""
    logger = logging.getLogger("LoggingTensor")
    propagate, level, filters, handlers = logger.propagate, logger.level, list(logger.filters), list(logger.handlers)
    yield
    logger.propagate = propagate
    logger.setLevel(level)
    logger.filters[:] = filters
    logger.handlers[:] = handlers


@pytest.fixture
def compile_cache(tmp_path, monkeypatch):
    """Keep torch.compile's caches out of the home folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
