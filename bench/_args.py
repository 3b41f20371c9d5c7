"""argparse types shared by the bench tools.

Each is a ``type=`` callable: a bad value makes argparse exit with code 2 and one line naming the
option (``error: argument --seq: expected a positive int, got '-4'``), before anything runs.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def _checked(kind: type, ok: Callable, what: str) -> Callable[[str], object]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive int")
nonnegative_int = _checked(int, lambda v: v >= 0, "an int >= 0")
positive_float = _checked(float, lambda v: v > 0, "a positive number")
nonnegative_float = _checked(float, lambda v: v >= 0, "a number >= 0")
probability = _checked(float, lambda v: 0 <= v < 1, "a probability in [0, 1)")


# The int options of the bench tools' shapes and loops are positive, except these: ``--warmup 0``,
# ``--threads 0`` (torch's own thread count) and any ``--seed``.
INT_OPTIONS = {"warmup": nonnegative_int, "threads": nonnegative_int, "seed": int}


def int_type(name: str) -> Callable[[str], int]:
    """The ``type=`` of the int option ``--<name>``."""
    return INT_OPTIONS.get(name, positive_int)


def comma_separated(item: Callable[[str], object], what: str) -> Callable[[str], tuple]:
    """A ``type=`` for a comma-separated list of ``item`` values, parsed to a tuple."""

    def parse(text: str) -> tuple:
        try:
            return tuple(item(v) for v in text.split(","))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None

    parse.__name__ = what
    return parse


positive_ints = comma_separated(positive_int, "positive ints")
positive_floats = comma_separated(positive_float, "positive numbers")
probabilities = comma_separated(probability, "probabilities in [0, 1)")


def device_name(text: str) -> str:
    """``auto`` or a name ``torch.device`` takes (``cpu``, ``cuda``, ``cuda:1``), kept as given;
    whether the device is there is checked when the run starts."""
    if text != "auto":
        import torch

        try:
            torch.device(text)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}") from None
    return text


def config_names(text: str) -> str:
    """Comma-separated names of the harness's configurations (``bench.configs``), kept as given."""
    from bench.configs import default_configs

    known = [c.name for c in default_configs()]
    unknown = [n.strip() for n in text.split(",") if n.strip() and n.strip() not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown names {unknown}; known: {sorted(known)}")
    return text
