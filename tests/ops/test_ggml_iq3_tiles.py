"""IQ3_XXS / IQ3_S (and, on request, IQ2_XXS / IQ1_S / TQ1_0 / TQ2_0) on the tiled kernel through
their transcoding to IQ4_XS's layout (ggml_kernels_int.c's ggml_iq_as_xs, ops/ggml_tiled.py's
`iq_as_xs`): every codebook entry and sign, at every scale and d from subnormal to 60000, comes
back as gguf-py's value bit for bit; the kinds can stay on their blocks; other kinds are refused
by name. The kernel checks (activation bound, float64 emulation, ISA / row-group / thread
invariance, extreme blocks, a NemotronH GGUF deployed on the copies) run in
test_ggml_tiled_kquant.py with the other tiled kinds."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdeploy.ops import ggml_linear as gl
from specdeploy.ops import ggml_tiled as gt

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(gt.kernel_unavailable() is not None,
                                reason=f"tiled kernel unavailable: {gt.kernel_unavailable()}")


def run_with(env: dict, code: str) -> None:
    """`code` in a fresh interpreter with `env` set (the kinds lists are read at import)."""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def _every_entry(kind: str, rng: np.random.Generator) -> np.ndarray:
    """[16, K] blocks whose grid indices run through the whole codebook (IQ3_S's 512 with the
    9th bit, IQ3_XXS's 256), random signs and every 4-bit scale, d = 1 and small / large d."""
    blocks = 8 if kind == "iq3_s" else 4  # 64 indices a block
    size = gl.KINDS[kind][1]
    raw = np.zeros((blocks, size), np.uint8)
    idx = np.arange(64 * blocks)
    ds = np.array([1.0, 2.0 ** -14, 2.0 ** -20, 60000.0] * (blocks // 4), np.float16)
    raw[:, 0:2] = ds.view(np.uint8).reshape(blocks, 2)
    raw[:, 2:66] = (idx & 255).reshape(blocks, 64)
    if kind == "iq3_s":
        raw[:, 66:74] = np.packbits((idx >> 8 & 1).reshape(blocks, 64), axis=1,
                                    bitorder="little")
        raw[:, 74:106] = rng.integers(0, 256, (blocks, 32))
        raw[:, 106:110] = (np.arange(blocks * 4) * 17 % 256).reshape(blocks, 4)  # 0..15
    else:  # per 32 values a uint32: four 7-bit sign indices, a 4-bit scale on top
        aux = rng.integers(0, 2 ** 28, (blocks, 8), dtype=np.uint32)
        aux |= (np.arange(blocks * 8, dtype=np.uint32).reshape(blocks, 8) % 16) << 28
        raw[:, 66:98] = aux.view(np.uint8).reshape(blocks, 32)
    return np.tile(raw.reshape(1, -1), (16, 1))  # 16 outputs (a tile) of the same row


@pytest.mark.parametrize("kind", gt.TILED_IQ3)
def test_every_codebook_entry_transcodes_to_gguf_values(kind):
    raw = _every_entry(kind, np.random.default_rng(0))
    k = raw.shape[1] // gl.KINDS[kind][1] * 256
    values = torch.from_numpy(gguf.quants.dequantize(raw, getattr(
        gguf.GGMLQuantizationType, kind.upper())).reshape(16, k))
    w = gl.make_weight(kind, torch.from_numpy(raw), (16, k))
    tw = gt.repack(w)
    assert tw.packed.nbytes == 16 * k // 256 * 136
    assert torch.equal(gt.tiled_rows(tw, torch.arange(16)), values)
    assert values.abs().min() > 0  # (no zero among these values)


def test_other_kinds_are_refused_by_name():
    raw = np.zeros((16, gl.KINDS["iq2_xs"][1]), np.uint8)
    with pytest.raises(ValueError, match="iq2_xs .*not a kind transcoded"):
        gt.iq_as_xs(gl.make_weight("iq2_xs", torch.from_numpy(raw), (16, 256)))
    with pytest.raises(ValueError, match="no tiled kernel for iq2_xs"):
        gt.repack(gl.make_weight("iq2_xs", torch.from_numpy(raw), (16, 256)))


def test_iq3_can_stay_on_their_blocks():
    """SPECDEPLOY_GGML_TILED_IQ3=0: IQ3 kinds are no tiled kind (deployments keep their bytes on
    the integer-dot kernel), the others still are."""
    run_with({"SPECDEPLOY_GGML_TILED_IQ3": "0"},
             "from specdeploy.ops import ggml_tiled as g, ggml_moe_int as m\n"
             "assert 'q4_k' in g.TILED_KINDS and m.TILED_KINDS == g.TILED_KINDS\n"
             "assert not set(g.TILED_IQ3) & set(g.TILED_KINDS), g.TILED_KINDS\n")
    assert set(gt.TILED_IQ3) <= set(gt.TILED_KINDS)  # (the default)


def test_lowbit_kinds_tile_only_on_request():
    """IQ2_XXS / IQ1_S / TQ1_0 / TQ2_0 (2.1-2.7x their bytes as tiles) deploy on their blocks
    unless SPECDEPLOY_GGML_TILED_LOWBIT=1 (then they are tiled kinds, experts too); `repack`
    takes them either way (their kernel checks: test_ggml_tiled_kquant.py)."""
    assert not set(gt.TILED_LOWBIT) & set(gt.TILED_KINDS)
    run_with({"SPECDEPLOY_GGML_TILED_LOWBIT": "1"},
             "from specdeploy.ops import ggml_tiled as g, ggml_moe_int as m\n"
             "assert set(g.TILED_LOWBIT) <= set(g.TILED_KINDS) == set(m.TILED_KINDS)\n")
