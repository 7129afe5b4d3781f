"""MXFP4 blocks (ggml type 39, gpt-oss's experts) as the CPU kernels read them: ggml's own layout.

An MXFP4 block is 32 E2M1 values sharing one E8M0 scale: 1 byte e, then 16 bytes of nibbles
(low nibble of byte j = value j, high = value j + 16, as Q4_0). ggml reads a nibble through the
doubled E2M1 table {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, ..., -12} and scales it by 2^(e - 128)
(its e8m0-half: 2^(e - 127) / 2, an fp32 subnormal for e < 2). Those are integers times a power
of two, so the kernels (ops/ggml_tiled.c: integer dot products, as llama.cpp's MXFP4 x Q8_0 dot;
ops/ggml_kernels.c: the exact fp32 values) compute with these 17-byte blocks as they are, for
every e, at 4.25 bits a value (an fp32 copy takes 32). A GGUF's type-39 tensors are these blocks
already (checkpoint/gguf.py); `ggml_blocks` writes them from the released safetensors' codes and
scales (checkpoint/mxfp4.py), byte for byte what llama.cpp's converter writes.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MXFP4_TYPE", "ggml_blocks"]

MXFP4_TYPE = 39  # ggml's GGML_TYPE_MXFP4


def ggml_blocks(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    """codes: uint8 [..., nb, 32] E2M1 codes (0..15) in element order; e: uint8 [..., nb] E8M0
    exponents (value = E2M1 x 2^(e - 127), the same byte ggml reads as its table's doubled
    values x 2^(e - 128)) -> uint8 [..., nb * 17] ggml MXFP4 blocks of the same values."""
    codes = np.asarray(codes, dtype=np.uint8)
    e = np.asarray(e, dtype=np.uint8)
    if codes.shape[-1] != 32 or codes.shape[:-1] != e.shape:
        raise ValueError(f"MXFP4: codes [..., nb, 32] need e [..., nb], got {codes.shape} and "
                         f"{e.shape}")
    qs = (codes[..., :16] & 0x0F) | ((codes[..., 16:] & 0x0F) << 4)
    out = np.concatenate((e[..., None], qs), axis=-1)
    return np.ascontiguousarray(out.reshape(*e.shape[:-1], -1))
