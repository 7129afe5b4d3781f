"""MXFP4 -> Q8_0 (checkpoint/gguf_mxfp4.py) against gguf-py's own dequantizers of both types
(the oracle: llama.cpp's Python package): the same fp32 values, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from specdeploy.checkpoint.gguf_mxfp4 import mxfp4_to_q8_0


def _blocks(n, e_lo, e_hi, seed=0):
    rng = np.random.default_rng(seed)
    e = rng.integers(e_lo, e_hi + 1, size=(n, 1), dtype=np.uint8)
    return np.concatenate((e, rng.integers(0, 256, size=(n, 16), dtype=np.uint8)), axis=1)


def test_every_fp16_scale_and_nibble_converts_exactly():
    raw = _blocks(4000, 104, 143).reshape(10, 400 * 17)  # 10 rows of 400 blocks
    raw[0, :17] = 0  # an all-zero block, e = 0 (as gguf-py writes one)
    raw[1, 17:34] = [3] + [0] * 16  # zeros under a scale out of range: still exact (d = 0)
    q8 = mxfp4_to_q8_0(raw)
    assert q8.shape == (10, 400 * 34) and q8.dtype == np.uint8
    want = dequantize(raw, T.MXFP4)
    got = dequantize(q8, T.Q8_0)
    assert want.shape == got.shape == (10, 400 * 32)
    assert np.abs(want).max() > 0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bits, signed zeros too


def test_stacked_experts_keep_their_leading_dims():
    raw = _blocks(2 * 3 * 4, 110, 130, seed=1).reshape(2, 3, 4 * 17)
    q8 = mxfp4_to_q8_0(raw)
    assert q8.shape == (2, 3, 4 * 34)
    assert np.array_equal(dequantize(q8, T.Q8_0), dequantize(raw, T.MXFP4))


@pytest.mark.parametrize("e", [103, 144, 255, 0])
def test_a_scale_fp16_cannot_hold_gives_none(e):
    raw = _blocks(8, 120, 120, seed=2)
    raw[5, 0], raw[5, 1] = e, 0x21  # a nonzero block at that scale
    assert mxfp4_to_q8_0(raw.reshape(1, -1)) is None


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole 17-byte blocks"):
        mxfp4_to_q8_0(np.zeros((2, 30), dtype=np.uint8))
