"""What the kernels' Python tells a CPU-graph capture (engine/cpu_graphs.py), kept here so the
ops need not import the engine: the ctypes structs whose addresses kernels take, the host reads
of step values a caller vouches for, and whether a capture is running."""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager

STRUCTS: dict[int, ctypes.Structure] = {}  # address -> a registered struct (kept alive)
# the running capture: its static inputs and its thread (one capture at a time: a lock in
# engine/cpu_graphs.py); reads vouched for are counted per thread
STATE: dict = {"static": None, "tid": None}
_LOCAL = threading.local()


def register_struct(s: ctypes.Structure) -> None:
    """A ctypes struct whose address a kernel takes (moe_block.c's, layer_rows.c's): a capture
    checks its pointer fields and a replay restores its bytes before the call."""
    STRUCTS[ctypes.addressof(s)] = s


@contextmanager
def reads_allowed():
    """Host reads of step values inside are the caller's promise: the same for every step a
    runner replays (engine/cpu_graphs.py)."""
    _LOCAL.allow = getattr(_LOCAL, "allow", 0) + 1
    try:
        yield
    finally:
        _LOCAL.allow -= 1


def allowed() -> bool:
    """Whether this thread is inside `reads_allowed`."""
    return getattr(_LOCAL, "allow", 0) > 0


def capturing() -> bool:
    """Whether this thread is running a capture (another thread's capture is not this one's:
    its kernels' Python takes the eager path)."""
    return STATE["static"] is not None and STATE["tid"] == threading.get_ident()
