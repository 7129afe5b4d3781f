"""MXFP4 blocks in ggml's layout (checkpoint/gguf_mxfp4.py `ggml_blocks`), against gguf-py's own
MXFP4 quantizer and dequantizer (the oracle: llama.cpp's Python package): the same bytes, and
the values this file's own E2M1 table gives, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from specdeploy.checkpoint.gguf_mxfp4 import MXFP4_TYPE, ggml_blocks

# code 8 (E2M1's -0) is +0 as ggml reads it: its doubled table holds integers
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _codes(shape, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(*shape, 32), dtype=np.uint8)
    e = rng.integers(0, 255, size=shape, dtype=np.uint8)
    return codes, e


def test_values_are_e2m1_times_the_scale_for_every_e():
    codes, e = _codes((10, 40))
    e[0, :3] = (0, 1, 2)  # 2^-127 / 2^-126: below fp32's normals for some values
    raw = ggml_blocks(codes, e)
    assert raw.shape == (10, 40 * 17) and raw.dtype == np.uint8 and int(MXFP4_TYPE) == T.MXFP4
    with np.errstate(over="ignore"):  # e = 254: 6 * 2^127 is inf in fp32, for gguf-py too
        got = dequantize(raw, T.MXFP4)
        want = (E2M1[codes] * np.ldexp(1.0, e.astype(np.int32) - 127)[..., None]).astype(
            np.float32).reshape(10, -1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bits, subnormals too


def test_the_bytes_gguf_py_writes():
    """gguf-py's quantizer on values that are exactly E2M1 x 2^(e - 127): the same blocks (its
    e byte for a block is the one it was made from when the block holds a 6 or -6)."""
    codes, e = _codes((4, 8), seed=1)
    e = np.clip(e, 100, 150).astype(np.uint8)
    codes[..., 0] = 7  # a 6 in each block pins gguf-py's choice of e
    vals = (E2M1[codes] * np.ldexp(1.0, e.astype(np.int32) - 127)[..., None]).astype(np.float32)
    got = ggml_blocks(codes, e)
    want = quantize(vals.reshape(4, -1), T.MXFP4)
    # -0 and +0 are one value: gguf-py writes code 0 for both
    both = got.reshape(4, 8, 17).copy(), want.reshape(4, 8, 17).copy()
    for b in both:
        qs = b[..., 1:]
        lo, hi = qs & 0x0F, qs >> 4
        lo[lo == 8], hi[hi == 8] = 0, 0
        b[..., 1:] = lo | (hi << 4)
    assert np.array_equal(*both)


def test_stacked_experts_keep_their_leading_dims():
    codes, e = _codes((2, 3, 4), seed=2)
    raw = ggml_blocks(codes, e)
    assert raw.shape == (2, 3, 4 * 17)
    assert np.array_equal(raw[1, 2], ggml_blocks(codes[1, 2], e[1, 2]))


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"codes \[..., nb, 32\] need e"):
        ggml_blocks(np.zeros((2, 3, 32), np.uint8), np.zeros((2, 4), np.uint8))
