"""MXFP4 expert weights as gpt-oss ships them (config.json `quantization_config.quant_method:
"mxfp4"`), read dequantized, exactly.

Per quantized tensor `X` (the experts' `gate_up_proj` / `down_proj`): `X_blocks` uint8
[E, N, K / 32, 16], two E2M1 codes a byte (low nibble = the even element; bit 3 = sign,
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), and `X_scales` uint8 [E, N, K / 32], one E8M0 exponent
per 32 elements: w = e2m1 * 2^(scale - 127). The matrix is stored [E, N, K] (output rows);
`get(X)` returns it in transformers' full-precision layout [E, K, N], so the family reads both
kinds of checkpoint alike. Everything else (attention, router, embeddings, head: the config's
`modules_to_not_convert`) is stored unquantized and reads as it is.

`get_blocks(X)` gives the same values as ggml MXFP4 blocks (17 bytes a block of 32: checkpoint/
gguf_mxfp4.py), which the CPU's block kernels run as they are (deploy/passes/ggml_experts.py;
the experts' fp32 copy is then never resident). Where those kernels do not run (another device,
compile, a bf16 load), the dequantized value is exact: an E2M1 value has at most two significant
bits and 2^(s-127) is a power of two within fp32's and bf16's exponent range, so fp32 and bf16
weights hold exactly the numbers the released checkpoint means (no re-quantization, no rounding).
The price there is memory: 4.25 bits a weight become 16 (bf16) or 32.
"""
from __future__ import annotations

import torch

from specdeploy.checkpoint.reader import CheckpointError

__all__ = ["E2M1", "Mxfp4Reader", "dequantize_mxfp4"]

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> fp32 [..., G * 32] (exact)."""
    if blocks.dim() > 3:  # one expert at a time: the int64 codes of all would be 8 bytes each
        return torch.stack([dequantize_mxfp4(b, s) for b, s in zip(blocks, scales)])
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).flatten(-2).long()  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    return torch.ldexp(table[codes], exp[..., None].float()).flatten(-2)


class Mxfp4Reader:
    """A `CheckpointReader` whose MXFP4 tensors (`X_blocks` + `X_scales`) read as `X`,
    dequantized; see the module docstring."""

    def __init__(self, reader, qcfg):
        self._r, self.qcfg = reader, qcfg
        self.config, self.path = reader.config, reader.path

    def keys(self) -> list[str]:
        keys = self._r.keys()
        return keys + [k[:-len("_blocks")] for k in keys if k.endswith("_blocks")]

    def __contains__(self, name: str) -> bool:
        return name in self._r or name + "_blocks" in self._r

    def has_prefix(self, prefix: str) -> bool:
        return self._r.has_prefix(prefix)

    def missing(self, names) -> list[str]:
        return [n for n in names if n not in self]

    def get(self, name: str) -> torch.Tensor:
        if name in self._r or name + "_blocks" not in self._r:
            return self._r.get(name)
        return dequantize_mxfp4(*self._packed(name)).transpose(1, 2).contiguous()

    def get_blocks(self, name: str):
        """The expert matrix `name` as the family's parameter holds it ([E, N, K]; gate_up_proj
        de-interleaved: gate rows first) in ggml MXFP4 blocks of exactly its values (checkpoint/
        gguf_mxfp4.py), for the CPU's block kernels (deploy/passes/ggml_experts.py); None for
        other tensors."""
        from specdeploy.checkpoint.gguf_mxfp4 import ggml_blocks
        from specdeploy.ops.ggml_linear import make_weight

        if name in self._r or name + "_blocks" not in self._r:
            return None
        blocks, scales = self._packed(name)
        e, n, g, _ = blocks.shape
        codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).view(e, n, g, 32)  # element order
        if name.endswith("gate_up_proj"):  # rows: gate at the even ones, up at the odd ones
            codes = torch.cat((codes[:, 0::2], codes[:, 1::2]), 1)
            scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), 1)
        raw = ggml_blocks(codes.numpy(), scales.numpy())
        return make_weight("mxfp4", torch.from_numpy(raw), (e, n, g * 32))

    def _packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name + "_scales" not in self._r:
            raise CheckpointError(f"{self.path}: {name}_blocks has no {name}_scales (MXFP4 "
                                  "needs both)")
        blocks, scales = self._r.get(name + "_blocks"), self._r.get(name + "_scales")
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
            raise CheckpointError(f"{self.path}: {name}_blocks must be uint8 [E, N, K/32, 16] "
                                  f"(MXFP4), got {blocks.dtype} {list(blocks.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise CheckpointError(f"{self.path}: {name}_scales must be uint8 "
                                  f"{list(blocks.shape[:-1])} for {name}_blocks "
                                  f"{list(blocks.shape)}, got {scales.dtype} "
                                  f"{list(scales.shape)}")
        if bool((scales == 255).any()):  # E8M0's NaN
            raise CheckpointError(f"{self.path}: {name}_scales holds 255 (NaN in E8M0)")
        return blocks, scales
