"""compressed-tensors W4A16 (`pack-quantized`, symmetric int4: GPTQ / AWQ-style recipes of
llm-compressor) read as GGUF Q4_0 blocks, so the CPU's block kernels compute with them.

Per quantized linear `X`: `X.weight_packed` int32 [N, ceil(K / 8)] (int4 values + 8, eight per
word, element i at bits 4i: on a little-endian host byte b holds elements 2b (low nibble) and
2b + 1), `X.weight_scale` [N, K / g] (group g) or [N, 1] (channel), `X.weight_shape` [2];
w = (nibble - 8) * scale.

GGUF Q4_0 stores 32 weights as an fp16 scale d and 16 bytes, byte j = nibble j | nibble j + 16
<< 4, w = (nibble - 8) * d: the same values wherever a group spans whole 32-blocks (g % 32 == 0,
or a channel with K % 32 == 0) and the scale is an fp16 value (bfloat16 scales in fp16's normal
range are). Such weights get blocks (`get_blocks`: deploy/passes/ggml_linears.py runs them, the
fp32 copy is never resident); any other reads dequantized, exactly (`get`: |q| <= 8 times a
16-bit scale fits fp32), and runs as fp32.
"""
from __future__ import annotations

import logging
import sys

import torch

from specdeploy.checkpoint.reader import CheckpointError

log = logging.getLogger("specdeploy.checkpoint")


class Int4Reader:
    """A `CheckpointReader` whose W4A16 weights read dequantized, with their Q4_0 blocks."""

    def __init__(self, reader, qcfg):
        if sys.byteorder != "little":
            raise CheckpointError(f"{reader.path}: int4 packed weights need a little-endian host")
        self._r, self.qcfg = reader, qcfg
        self.config, self.path = reader.config, reader.path
        ignored = set(qcfg.exclude)
        for k in reader.keys():
            if k.endswith(".weight_packed") and k[: -len(".weight_packed")] in ignored:
                raise CheckpointError(f"{reader.path}: {k!r} is quantized in the checkpoint, "
                                      "but its ignore entry excludes it")

    def keys(self) -> list[str]:
        keys = self._r.keys()
        return keys + [k[:-len("_packed")] for k in keys if k.endswith(".weight_packed")]

    def __contains__(self, name: str) -> bool:
        return name in self._r or self._quantized(name)

    def has_prefix(self, prefix: str) -> bool:
        return self._r.has_prefix(prefix)

    def missing(self, names) -> list[str]:
        return [n for n in self._r.missing(names) if n not in self]

    def _quantized(self, name: str) -> bool:
        return name.endswith(".weight") and name + "_packed" in self._r

    def _codes_and_scales(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(nibbles uint8 [N, K], scales [N, G] as stored, group size)."""
        packed = self._r.get(name + "_packed")
        shape = self._r.get(name + "_shape").tolist() if name + "_shape" in self._r else None
        if packed.dtype != torch.int32 or packed.dim() != 2 or shape is None or len(shape) != 2:
            raise CheckpointError(f"{self.path}: {name}_packed must be 2-D int32 with a "
                                  f"{name}_shape of 2 ints")
        n, k = int(shape[0]), int(shape[1])
        if packed.shape[0] != n or packed.shape[1] != -(-k // 8):
            raise CheckpointError(f"{self.path}: {name}_packed {tuple(packed.shape)} does not "
                                  f"hold a [{n}, {k}] int4 weight")
        b = packed.contiguous().view(torch.uint8)
        codes = torch.stack([b & 0xF, b >> 4], -1).reshape(n, -1)[:, :k]
        s = self._r.get(name[: -len("weight")] + "weight_scale")
        g = k if tuple(s.shape) == (n, 1) else self.qcfg.group_size
        if tuple(s.shape) != (n, -(-k // g)):
            raise CheckpointError(f"{self.path}: {name[:-6]}weight_scale must be [{n}, "
                                  f"{-(-k // g)}] for a [{n}, {k}] weight in groups of {g}, "
                                  f"got {tuple(s.shape)}")
        return codes, s, g

    def get(self, name: str) -> torch.Tensor:
        if not self._quantized(name):
            return self._r.get(name)
        codes, s, g = self._codes_and_scales(name)
        k = codes.shape[1]
        return (codes.float() - 8.0) * s.float().repeat_interleave(g, 1)[:, :k]

    def get_blocks(self, name: str):
        """The Q4_0 `GGMLWeight` of a W4A16 weight whose values Q4_0 holds exactly, else None."""
        from specdeploy.ops.ggml_linear import make_weight

        if not self._quantized(name):
            return None
        codes, s, g = self._codes_and_scales(name)
        n, k = codes.shape
        d = s.float().to(torch.float16)
        if k % 32 or g % 32 or not torch.equal(d.float(), s.float()):
            log.info("%s: int4 groups of %d with %s scales: not Q4_0 blocks, computed in fp32",
                     name, g, s.dtype)
            return None
        nb = k // 32
        d = d.repeat_interleave(g // 32, 1)[:, :nb]  # one scale per 32-block
        c = codes.reshape(n, nb, 32)
        qs = c[..., :16] | (c[..., 16:] << 4)
        raw = torch.cat([d.contiguous().view(torch.uint8).reshape(n, nb, 2), qs], -1)
        return make_weight("q4_0", raw.reshape(n, nb * 18), (n, k))
