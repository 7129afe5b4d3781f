"""ops/replay_calls.py: recorded kernel calls made by one C loop give the bits of the same calls
through ctypes (the oracle), with float, int32 and int64 arguments and return checks; a call
the loop cannot pass is left to ctypes."""
from __future__ import annotations

import ctypes

import pytest
import torch

from specdeploy.ops import replay_calls, row_kernels

pytestmark = pytest.mark.skipif(replay_calls.library() is None or row_kernels._library() is None,
                                reason="the C replay loop or the row kernels are not built here")


def _rms(lib, x, w, eps, out):
    return (lib.rms_norm_rows, (x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], w.data_ptr(),
                                eps, out.data_ptr(), 1), None, [])


def test_a_batch_makes_the_calls_ctypes_makes():
    lib = row_kernels._library()
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    a, b = torch.empty(3, 64), torch.empty(3, 64)
    calls = [_rms(lib, x, w, 1e-5, a), _rms(lib, a, w, 0.25, b)]  # (two float eps)
    assert all(replay_calls.fits(*c) for c in calls)
    batch = replay_calls.Batch.of(calls)
    assert batch.fn(*batch.args) == 0
    want_a, want_b = torch.empty(3, 64), torch.empty(3, 64)
    for (f, args, _, _), out in zip(calls, (want_a, want_b)):
        args = list(args)
        if out is want_b:
            args[0] = want_a.data_ptr()
        args[6] = out.data_ptr()
        f(*args)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


def test_a_return_code_other_than_at_capture_names_the_call():
    lib = row_kernels._library()
    f = lib.row_kernels_max_isa  # (-1) -> int: the ISA cap, unchanged (a level >= 0 sets it)
    got = f(-1)
    ok = replay_calls.Batch.of([(f, (-1,), got, [])])
    assert ok.fn(*ok.args) == 0
    bad = replay_calls.Batch.of([(f, (-1,), got, []), (f, (-1,), got + 7, [])])
    code = bad.fn(*bad.args)
    assert code == 2 and bad.failed(code) == "row_kernels_max_isa"


def test_struct_bytes_are_restored_before_the_call():
    """A registered struct's bytes at capture are copied back before the call (as the ctypes
    path's memmove)."""
    lib = row_kernels._library()
    f = lib.row_kernels_max_isa
    s = (ctypes.c_char * 8)(*b"abcdefgh")
    batch = replay_calls.Batch.of([(f, (-1,), f(-1), [(ctypes.addressof(s), b"12345678")])])
    assert batch.fn(*batch.args) == 0
    assert bytes(s) == b"12345678"


def test_calls_the_loop_cannot_pass_are_refused():
    lib = row_kernels._library()
    f = lib.rms_norm_rows
    x = torch.zeros(1, 8)
    assert not replay_calls.fits(f, (x.data_ptr(),), None, [])  # wrong arity
    assert not replay_calls.fits(f, ("x", 1, 8, 8, 0, 1e-6, 0, 1), None, [])  # not an int
    g = lib.row_kernels_max_isa
    old = g.restype
    try:
        g.restype = ctypes.c_double  # a return type it cannot check
        assert not replay_calls.fits(g, (-1,), 1.0, [])
    finally:
        g.restype = old
    assert not replay_calls.fits(g, (-1,), 0, [(0, b"x")] * 5)  # more structs than it restores
