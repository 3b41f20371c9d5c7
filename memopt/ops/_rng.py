"""Dropout RNG keys drawn from torch's generator, and the check every op taking a key runs.

A key is an int64 CPU tensor ``(seed, offset)`` of shape ``[2]``, whatever device the data is on.
The seed is drawn from torch's default CPU generator, so ``torch.manual_seed`` fixes every mask on
every device; the tensor stays on the host so CUDA launchers read it without a device sync, and
drawing it is traceable by ``torch.compile``.
"""

from __future__ import annotations

import torch


def new_rng_key(generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh ``(seed, offset)`` key: a random 63-bit seed and offset 0.

    Returns an int64 CPU tensor of shape ``[2]``.
    """
    # device="cpu": on the host inside ``with torch.device(...)`` too (a meta key is refused).
    seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator, device="cpu")
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64, device="cpu")])


def rng_key(seed: int, offset: int = 0) -> torch.Tensor:
    """An explicit key, for replaying a mask."""
    return torch.tensor([seed, offset], dtype=torch.int64, device="cpu")


KEY_RULE = "an int64 CPU tensor (seed, offset) of shape [2]"


def check_rng_key(op: str, rng_key) -> None:
    """At a public op's boundary: TypeError unless ``rng_key`` is a tensor, ValueError unless it is
    :data:`KEY_RULE` (``memopt.attention``'s rule). A key on another device must not reach the ops:
    a meta key beside CPU data dispatches them to their fake impls, which return uninitialised
    memory. Under ``torch.compile`` the key is a FakeTensor of the real key's device, and passes."""
    if not isinstance(rng_key, torch.Tensor):
        raise TypeError(f"memopt.{op}: rng_key must be a tensor, {KEY_RULE}, got {type(rng_key).__name__}")
    if rng_key.dtype != torch.int64 or rng_key.shape != (2,) or not rng_key.is_cpu:  # (is_cpu: 0.1 us, device: 0.5)
        raise ValueError(
            f"memopt.{op}: rng_key must be {KEY_RULE}, got {rng_key.dtype} {tuple(rng_key.shape)} on {rng_key.device}"
        )


def check_fake_rng_key(op: str, rng_key: torch.Tensor) -> None:
    """In a registered op's fake impl, the kernels' rule (``read_rng_key`` in ``csrc/common.h``:
    int64, 2 elements, on the CPU). The fakes also run as the ops' Meta kernels: a meta key beside
    CPU data dispatches there and must not come back with an uninitialised result. A FakeTensor
    key under ``torch.compile`` has the real key's device, so a CPU key passes."""
    if rng_key.device.type != "cpu" or rng_key.dtype != torch.int64 or rng_key.numel() != 2:
        raise ValueError(
            f"memopt.{op}: rng_key must be an int64 CPU tensor of 2 elements (seed, offset), got {rng_key.dtype} "
            f"{tuple(rng_key.shape)} on {rng_key.device}"
        )
