"""What the kernels' Python tells a CPU-graph capture (engine/cpu_graphs.py), kept here so the
ops need not import the engine: the ctypes structs whose addresses kernels take, the host reads
of step values a caller vouches for, and whether a capture is running."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager

STRUCTS: dict[int, ctypes.Structure] = {}  # address -> a registered struct (kept alive)
STATE: dict = {"allow": 0, "static": None, "tid": None}


def register_struct(s: ctypes.Structure) -> None:
    """A ctypes struct whose address a kernel takes (moe_block.c's, layer_rows.c's): a capture
    checks its pointer fields and a replay restores its bytes before the call."""
    STRUCTS[ctypes.addressof(s)] = s


@contextmanager
def reads_allowed():
    """Host reads of step values inside are the caller's promise: the same for every step a
    runner replays (engine/cpu_graphs.py)."""
    STATE["allow"] += 1
    try:
        yield
    finally:
        STATE["allow"] -= 1


def capturing() -> bool:
    return STATE["static"] is not None
