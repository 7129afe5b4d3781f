"""compressed-tensors integer weights read as GGUF blocks, so the CPU's block kernels compute
with them: W4A16 (`pack-quantized` int4, GPTQ / AWQ-style recipes of llm-compressor) as Q4_0,
W8A16 (`pack-quantized` int8) and W8A8 (`int-quantized`) as Q8_0.

Per quantized linear `X` (symmetric: w = q * scale):
- `pack-quantized`: `X.weight_packed` int32 [N, ceil(K * bits / 32)] (q + 2^(bits-1), packed
  from bit 0 up: on a little-endian host, int4 byte b holds elements 2b (low nibble) and
  2b + 1; int8 byte b is element b), `X.weight_shape` [2];
- `int-quantized`: `X.weight` int8 [N, K] (W8A8: its activations' dynamic int8 quantization is
  not applied; they stay as the kernel takes them, as FP8's dynamic activations do);
- `X.weight_scale` [N, K / g] (group g) or [N, 1] (channel).

GGUF Q4_0 stores 32 weights as an fp16 scale d and 16 bytes (byte j = nibble j | nibble j + 16
<< 4; w = (nibble - 8) * d), Q8_0 as d and 32 int8 (w = q * d): the same values wherever a group
spans whole 32-blocks (g % 32 == 0, or a channel with K % 32 == 0) and the scale is an fp16
value (bfloat16 scales in fp16's normal range are). Such weights get blocks (`get_blocks`:
deploy/passes/ggml_linears.py runs them, their fp32 copy never resident); any other reads
dequantized, exactly (`get`: |q| <= 128 times a 16-bit scale fits fp32), and runs as fp32.
Q8_0's -128 is safe in the kernels: the AVX2 / AVX-512 paths take |w| as an unsigned byte
(128) and move the sign to the activation, which is never -128 (rounded to +-127).
"""
from __future__ import annotations

import logging
import sys

import torch

from specdeploy.checkpoint.reader import CheckpointError

log = logging.getLogger("specdeploy.checkpoint")


class IntReader:
    """A `CheckpointReader` whose integer weights read dequantized, with their GGUF blocks.
    `qcfg.bits`: 4 or 8; `qcfg.packed`: `pack-quantized` (else `int-quantized`)."""

    def __init__(self, reader, qcfg):
        if sys.byteorder != "little":
            raise CheckpointError(f"{reader.path}: packed integer weights need a little-endian "
                                  "host")
        self._r, self.qcfg = reader, qcfg
        self.config, self.path = reader.config, reader.path
        ignored = set(qcfg.exclude)
        for k in reader.keys():
            if k.endswith(".weight_scale") and k[: -len(".weight_scale")] in ignored:
                raise CheckpointError(f"{reader.path}: {k[:-6]!r} is quantized in the "
                                      "checkpoint, but its ignore entry excludes it")

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
        return name.endswith(".weight") and name[:-6] + "weight_scale" in self._r and (
            not self.qcfg.packed or name + "_packed" in self._r)

    def _ints_and_scales(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(q int16 [N, K], scales [N, G] as stored, group size)."""
        if self.qcfg.packed:
            q = self._unpack(name)
        else:
            q = self._r.get(name)
            if q.dtype != torch.int8 or q.dim() != 2:
                raise CheckpointError(f"{self.path}: {name} must be 2-D int8, got {q.dtype} "
                                      f"{tuple(q.shape)}")
            q = q.to(torch.int16)
        n, k = q.shape
        s = self._r.get(name[: -len("weight")] + "weight_scale")
        g = k if tuple(s.shape) == (n, 1) else self.qcfg.group_size
        if not g or tuple(s.shape) != (n, -(-k // g)):
            raise CheckpointError(f"{self.path}: {name[:-6]}weight_scale must be [{n}, "
                                  f"{-(-k // g) if g else 1}] for a [{n}, {k}] weight in groups "
                                  f"of {g or k}, got {tuple(s.shape)}")
        return q, s, g

    def _unpack(self, name: str) -> torch.Tensor:
        bits = self.qcfg.bits
        packed = self._r.get(name + "_packed")
        shape = self._r.get(name + "_shape").tolist() if name + "_shape" in self._r else None
        if packed.dtype != torch.int32 or packed.dim() != 2 or shape is None or len(shape) != 2:
            raise CheckpointError(f"{self.path}: {name}_packed must be 2-D int32 with a "
                                  f"{name}_shape of 2 ints")
        n, k = int(shape[0]), int(shape[1])
        if packed.shape[0] != n or packed.shape[1] != -(-k * bits // 32):
            raise CheckpointError(f"{self.path}: {name}_packed {tuple(packed.shape)} does not "
                                  f"hold a [{n}, {k}] int{bits} weight")
        b = packed.contiguous().view(torch.uint8)
        if bits == 4:
            b = torch.stack([b & 0xF, b >> 4], -1).reshape(n, -1)
        return b[:, :k].to(torch.int16) - (1 << (bits - 1))

    def get(self, name: str) -> torch.Tensor:
        if not self._quantized(name):
            return self._r.get(name)
        q, s, g = self._ints_and_scales(name)
        return q.float() * s.float().repeat_interleave(g, 1)[:, :q.shape[1]]

    def get_blocks(self, name: str):
        """The Q4_0 / Q8_0 `GGMLWeight` of a weight whose values those blocks hold exactly,
        else None."""
        from specdeploy.ops.ggml_linear import make_weight

        if not self._quantized(name):
            return None
        q, s, g = self._ints_and_scales(name)
        n, k = q.shape
        d = s.float().to(torch.float16)
        if k % 32 or g % 32 or not torch.equal(d.float(), s.float()):
            log.info("%s: groups of %d with %s scales: not GGUF blocks, computed in fp32",
                     name, g, s.dtype)
            return None
        nb = k // 32
        d = d.repeat_interleave(g // 32, 1)[:, :nb].contiguous().view(torch.uint8)
        c = q.reshape(n, nb, 32)
        if self.qcfg.bits == 4:
            c = (c + 8).to(torch.uint8)
            body, kind = c[..., :16] | (c[..., 16:] << 4), "q4_0"
        else:
            body, kind = c.to(torch.int8).view(torch.uint8), "q8_0"
        raw = torch.cat([d.reshape(n, nb, 2), body], -1)
        return make_weight(kind, raw.reshape(n, -1), (n, k))
