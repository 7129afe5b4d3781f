"""The codebooks of GGUF's IQ1 / IQ2 / IQ3 kinds for the C kernels (`ggml_iq.c`).

IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S / IQ1_S / IQ1_M blocks index fixed lattices of 4 or 8
values (ggml's `iq2xxs_grid` ... `iq1s_grid`). The kernels get them at load, from the same
tables gguf-py's dequantization uses (so the values they compute are the ones that oracle
gives), as int8 bytes of the values, concatenated in GRIDS order.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

GRIDS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")  # IQ1_M shares IQ1_S's
GRID_BYTES = 33792  # ggml_iq.c's IQ_GRID_BYTES


@lru_cache(maxsize=1)
def grid_bytes() -> bytes:
    """The codebooks as ggml_iq.c lays them out (values as int8: IQ1's -1 / 0 / 1, the others'
    positive magnitudes)."""
    from gguf import quants

    parts = []
    for name in GRIDS:
        cls = getattr(quants, name)
        cls.init_grid()
        grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
        as_int = grid.astype(np.int8)
        if not np.array_equal(as_int.astype(np.float32), grid):
            raise RuntimeError(f"gguf-py's {name} grid is not integers: {grid[:2]}")
        parts.append(as_int.tobytes())
    out = b"".join(parts)
    if len(out) != GRID_BYTES:
        raise RuntimeError(f"gguf-py's IQ grids take {len(out)} bytes, the kernels expect "
                           f"{GRID_BYTES}")
    return out


def init(lib: ctypes.CDLL) -> None:
    """Give a freshly loaded kernel library (one that #includes ggml_iq.c) the codebooks; it
    copies them."""
    buf = ctypes.create_string_buffer(grid_bytes(), GRID_BYTES)
    lib.ggml_iq_init(buf)
