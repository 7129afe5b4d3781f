"""A CPU graph's recorded kernel calls replayed in one C loop (replay_calls.c; why and how there).

`Batch.of(calls)` lays out a run of recorded calls (function, arguments, return value at capture,
registered structs' bytes) as the C loop's array, or returns None where one call does not fit
(an argument type the trampoline cannot pass, too many arguments, a return type it cannot
check, too many structs): the replay then makes those calls through ctypes as before.
SPECDEPLOY_REPLAY_CALLS=0 turns it off; not built off x86-64 Linux.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
from functools import lru_cache
from pathlib import Path

from specdeploy.ops import ggml_linear as _gl

SOURCE = Path(__file__).with_name("replay_calls.c")
MAX_INTS, MAX_FLOATS, MAX_RESTORES = 32, 8, 4
_INTS = {ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint32,
         ctypes.c_long, ctypes.c_ulong, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t,
         ctypes.c_ssize_t, ctypes.c_bool, ctypes.c_char, ctypes.c_int8, ctypes.c_uint8,
         ctypes.c_int16, ctypes.c_uint16}
_CHECK = {None: 0, ctypes.c_int: 1, ctypes.c_int32: 1, ctypes.c_int64: 2, ctypes.c_long: 2}
_MASK = (1 << 64) - 1


class _Restore(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("n", ctypes.c_int64)]


class _Call(ctypes.Structure):
    # (the C side declares d[] double: the same 8 bytes, written here as their bits)
    _fields_ = [("fn", ctypes.c_void_p), ("i", ctypes.c_uint64 * MAX_INTS),
                ("d", ctypes.c_uint64 * MAX_FLOATS), ("expect", ctypes.c_int64),
                ("check", ctypes.c_int32), ("nrestore", ctypes.c_int32),
                ("restore", _Restore * MAX_RESTORES)]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    if os.environ.get("SPECDEPLOY_REPLAY_CALLS", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None  # the calling convention replay_calls.c relies on (System V x86-64)
    lib, _ = _gl.load_compiled("replay_calls", SOURCE, ["-O2", "-shared", "-fPIC"], {
        "replay_calls": ([ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)}, libs=())
    return lib


def _bits(typ, v) -> int | None:
    """The 8-byte slot of a floating argument, or None for another type."""
    if typ is ctypes.c_float:
        return struct.unpack("<I", struct.pack("<f", float(v)))[0]
    if typ is ctypes.c_double:
        return struct.unpack("<Q", struct.pack("<d", float(v)))[0]
    return None


def _fill(slot: _Call, func, args, result, structs, keep: list) -> bool:
    types = func.argtypes
    check = _CHECK.get(func.restype, -1)
    if types is None or len(types) != len(args) or check < 0 or len(structs) > MAX_RESTORES:
        return False
    ni = nf = 0
    for typ, v in zip(types, args):
        bits = _bits(typ, v)
        if bits is not None:
            if nf == MAX_FLOATS:
                return False
            slot.d[nf] = bits
            nf += 1
        elif typ in _INTS and (v is None or isinstance(v, int)):
            if ni == MAX_INTS:
                return False
            slot.i[ni] = (v or 0) & _MASK
            ni += 1
        else:
            return False
    slot.fn = ctypes.cast(func, ctypes.c_void_p).value
    slot.expect = 0 if result is None else int(result)
    slot.check = check
    slot.nrestore = len(structs)
    for r, (addr, raw) in enumerate(structs):
        buf = ctypes.create_string_buffer(raw, len(raw))
        keep.append(buf)
        slot.restore[r] = _Restore(addr, ctypes.addressof(buf), len(raw))
    return True


def fits(func, args, result, structs) -> bool:
    """Whether the C loop can make this recorded call."""
    return _fill(_Call(), func, args, result, structs, [])


class Batch:
    """Consecutive recorded calls as one `replay_calls` call."""

    def __init__(self, lib, calls: ctypes.Array, keep: list, recorded: list[tuple]):
        self.fn, self.calls, self.keep = lib.replay_calls, calls, keep
        self.recorded = recorded  # (function, arguments, return value, structs) each
        self.names = [f.__name__ for f, *_ in recorded]
        self.args = (ctypes.addressof(calls), len(calls))

    @classmethod
    def of(cls, calls: list[tuple]) -> Batch | None:
        """`calls`: (function, arguments, return value, [(struct address, bytes)]) each, every
        one `fits`; None where the C loop is not built."""
        lib = library()
        if lib is None or not calls:
            return None
        arr, keep = (_Call * len(calls))(), []
        for slot, (func, args, result, structs) in zip(arr, calls):
            if not _fill(slot, func, args, result, structs, keep):
                return None
        return cls(lib, arr, keep, list(calls))

    def failed(self, code: int) -> str:
        return self.names[code - 1]
