"""The one question production code asks about a dry run (a2/train/trace.py): are tensors fake (shapes without data),
and which storages are pinned host copies. A leaf: the transformer, fp8 and offload code import it, not the tracer."""

from __future__ import annotations

import contextlib

import torch


def fake_mode_active() -> bool:
    """A FakeTensorMode is on: tensors have no data (a dry run)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


_HOST: list = []  # a2/memory/offload.py's host copies being made: [pow2] (pinned allocator rounding) on top


@contextlib.contextmanager
def host_memory(pow2: bool):
    """Storages made inside are pinned host memory (a2/memory/offload.py's copies), whatever their device: in a dry run
    the device is emulated on the CPU. pow2: torch's pinned caching allocator rounds them up to a power of two
    (offloaded activations); else exact (swapped weights, one registered buffer per block)."""
    _HOST.append(pow2)
    try:
        yield
    finally:
        _HOST.pop()
