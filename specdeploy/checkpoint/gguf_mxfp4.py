"""MXFP4 blocks (ggml type 39, gpt-oss's experts) rewritten as Q8_0 blocks, exactly.

An MXFP4 block is 32 E2M1 values sharing one E8M0 scale: 1 byte e, then 16 bytes of nibbles
(low nibble of byte j = value j, high = value j + 16, as Q4_0). ggml reads a nibble through the
doubled E2M1 table {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, ..., -12} and scales it by 2^(e - 128).
Those are integers times a power of two: a Q8_0 block (an fp16 d, then 32 int8) holds the same
32 values exactly whenever 2^(e - 128) is an fp16 number (e in 104..143; an all-zero block takes
d = 0). So the integer-dot kernels (ops/ggml_*.c: scalar, AVX2, AVX-512, AMX, tiled, the MoE
block) compute gpt-oss's experts from Q8_0 with no kernel of their own and no rounding: the
arithmetic llama.cpp does for MXFP4 on a CPU (int8 weights from the table times 8-bit
activations, then the block scales), at 34 bytes a block where MXFP4 takes 17 (2x; an fp32 copy
takes 128). A tensor with a block outside that range (|values| < 4e-7 or > 3.9e5) gives None:
the caller dequantizes it instead.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MXFP4_TYPE", "e2m1_to_q8_0", "mxfp4_to_q8_0"]

MXFP4_TYPE = 39  # ggml's GGML_TYPE_MXFP4
_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_E_MIN, _E_MAX = 128 - 24, 128 + 15  # 2^(e - 128) within fp16 (subnormals from 2^-24)


def e2m1_to_q8_0(codes: np.ndarray, e: np.ndarray) -> np.ndarray | None:
    """codes: uint8 [..., nb, 32] E2M1 codes (0..15) in element order; e: uint8 [..., nb]
    E8M0 exponents (value = E2M1 x 2^(e - 127)) -> uint8 [..., nb * 34] Q8_0 blocks of the
    same values, or None where some nonzero block's scale has no fp16 form."""
    lead = codes.shape[:-2]
    vals = _TABLE[np.asarray(codes, dtype=np.uint8).reshape(-1, 32) & 0x0F]  # [n, 32]
    e = np.asarray(e, dtype=np.int32).reshape(-1)
    zero = ~vals.any(axis=1)
    if np.any(~zero & ((e < _E_MIN) | (e > _E_MAX))):
        return None
    d = np.ldexp(np.float32(1), np.clip(e, _E_MIN, _E_MAX) - 128).astype(np.float16)
    d[zero] = 0
    out = np.empty((vals.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = vals.view(np.uint8)
    return out.reshape(*lead, -1)


def mxfp4_to_q8_0(raw: np.ndarray) -> np.ndarray | None:
    """raw: uint8 [..., nb * 17] (rows of ggml MXFP4 blocks) -> uint8 [..., nb * 34] Q8_0
    blocks of the same values, or None (see `e2m1_to_q8_0`)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.shape[-1] % 17:
        raise ValueError(f"MXFP4: a row of {raw.shape[-1]} bytes is not whole 17-byte blocks")
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    qs = blocks[..., 1:]
    return e2m1_to_q8_0(np.concatenate((qs & 0x0F, qs >> 4), axis=-1), blocks[..., 0])
