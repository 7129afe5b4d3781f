"""GGUF files (llama.cpp) as a checkpoint: HF-style config and tensor names, dequantized lazily.

NOTE: the header is parsed here rather than with `gguf.GGUFReader`: that reader builds a numpy view
per metadata string (~100k for a BPE vocabulary) and takes seconds to open a 100 MB file; this
parser takes a fraction of that. Dequantization is `gguf.quants.dequantize`, one tensor per `get`.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specdeploy.checkpoint import (
    gguf_deepseek2,
    gguf_gemma3,
    gguf_glm4moe,
    gguf_gpt_oss,
    gguf_granite,
    gguf_lfm2,
    gguf_llama,
    gguf_mmproj,
    gguf_mxfp4,
    gguf_nemotron_h,
    gguf_phi3,
    gguf_qwen,
    gguf_qwen3_5,
    gguf_smollm3,
)
from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf_llama import hf_name

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# general.architecture -> the module that maps it (config, names, values)
_ARCHS = {"llama": gguf_llama, **{a: m for m in (gguf_qwen, gguf_nemotron_h, gguf_qwen3_5,
                                                 gguf_glm4moe, gguf_granite, gguf_gpt_oss,
                                                 gguf_gemma3, gguf_lfm2, gguf_deepseek2,
                                                 gguf_phi3, gguf_smollm3, gguf_mmproj)
                                   for a in m.ARCHS}}
SUPPORTED_ARCHITECTURES = tuple(a for a in _ARCHS if a not in gguf_mmproj.ARCHS)  # (models)
__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFReader", "hf_name", "read_header"]

class TensorInfo(NamedTuple):
    name: str  # GGUF name
    shape: tuple[int, ...]  # torch order (GGUF stores ne0 = innermost first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFHeader(NamedTuple):
    metadata: dict
    tensors: dict[str, TensorInfo]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file; any inconsistency → `CheckpointError`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
        # the header is parsed in place from a read-only mapping; only what is decoded is copied
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, size, GGML_QUANT_SIZES, GGMLQuantizationType)
            except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({e})") from None


def _parse(path, buf, size, quant_sizes, qtypes) -> GGUFHeader:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise CheckpointError(f"{path}: unsupported GGUF version {version}")
    pos = 24

    def string(p):
        (n,) = struct.unpack_from("<Q", buf, p)
        if p + 8 + n > len(buf):
            raise IndexError("string past end of header")
        return buf[p + 8:p + 8 + n].decode("utf-8"), p + 8 + n

    def value(p, vtype):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
        if vtype == _STRING:
            return string(p)
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, n = struct.unpack_from("<IQ", buf, p)
        p += 12
        if etype in _NP_SCALARS:
            dt = np.dtype(_NP_SCALARS[etype]).newbyteorder("<")
            if p + n * dt.itemsize > len(buf):
                raise IndexError("array past end of header")
            return np.frombuffer(buf, dt, n, p).tolist(), p + n * dt.itemsize
        if etype == _STRING:  # vocabularies: ~100k strings, so a tight loop
            out, unpack = [], _U64.unpack_from
            for _ in range(n):
                (k,) = unpack(buf, p)
                out.append(buf[p + 8:p + 8 + k].decode("utf-8"))
                p += 8 + k
            if p > len(buf):
                raise IndexError("string array past end of header")
            return out, p
        out = []
        for _ in range(n):
            v, p = value(p, etype)
            out.append(v)
        return out, p

    metadata: dict = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = value(pos + 4, vtype)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        try:
            block, type_size = quant_sizes[qtypes(ggml_type)]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}"
                                  ) from None
        nbytes = prod(shape) // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {name!r} needs bytes "
                f"{start}..{start + nbytes} but the file has {size} bytes")
        tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFHeader(metadata, tensors)


class GGUFReader:
    """Same interface as `CheckpointReader` (`path`, `config`, `keys`, `get`, `in`, `missing`).

    `config` is an HF-style config.json dict; `keys()` are HF tensor names; `get` dequantizes one
    tensor to fp32 in the HF layout (undoing what llama.cpp's converter changed: the rotary row
    permutation of q/k projections, and each architecture's own, `_ARCHS`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = read_header(self.path)
        self.metadata = header.metadata
        self.tensor_infos = header.tensors
        arch = self.metadata.get("general.architecture")
        if arch not in _ARCHS:
            raise CheckpointError(f"{self.path}: unsupported GGUF architecture {arch!r}; "
                                  f"supported: {', '.join(_ARCHS)}")
        self._arch = _ARCHS[arch]
        self.is_mmproj = arch in gguf_mmproj.ARCHS  # a vision tower, not a model
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.config = self._arch.hf_config(self)
        self._where = {}
        for name in self.tensor_infos:
            hf = self._arch.hf_name(name, self.config)
            self._where[hf or name] = name
        # HF tensors the file splits (name -> its GGUF parts, the dim they join on)
        self._joined = getattr(self._arch, "joined", lambda reader: {})(self)

    def keys(self) -> list[str]:
        return [*self._where, *self._joined]

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._joined

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.keys())

    def missing(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self]

    def get(self, name: str) -> torch.Tensor:
        if name in self._joined:
            parts, dim = self._joined[name]
            arrays = [self._hf_array(p) for p in parts]
            join = getattr(self._arch, "join", None)  # (gpt-oss: interleaved, not concatenated)
            return torch.from_numpy(join(name, arrays) if join else np.concatenate(arrays, dim))
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        return torch.from_numpy(self._hf_array(self._where[name]))

    def _hf_array(self, gguf_name: str) -> np.ndarray:
        info = self.tensor_infos[gguf_name]
        a = self._unpermute(info.name, self._dequantize(info))
        return np.ascontiguousarray(self._arch.to_hf(info.name, a, self.config))

    def dequantize(self, gguf_name: str) -> np.ndarray:
        """A tensor by its GGUF name, fp32, as stored."""
        return self._dequantize(self.tensor_infos[gguf_name])

    def _unpermute(self, gguf_name: str, a: np.ndarray) -> np.ndarray:
        if not self._arch.ROTARY_PERMUTED:
            return a
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return _unpermute_rotary(a, self.config["num_attention_heads"])
        if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return _unpermute_rotary(a, self.config["num_key_value_heads"])
        return a

    def get_blocks(self, name: str):
        """`GGMLWeight` (its raw blocks, rows in HF order) of a 2-D tensor, or of stacked
        experts [E, N, K], stored in a type of _BLOCK_KINDS (MXFP4 included), else None: what
        `ops/ggml_linear.py` computes with. None too where the converter moved the tensor's
        values in a way whole block rows cannot undo (`blocks_hf`)."""
        from specdeploy.ops.ggml_linear import make_weight

        if name in self._joined:
            parts, dim = self._joined[name]
            if hasattr(self._arch, "join"):  # a layout whole block rows may not express
                dim = getattr(self._arch, "BLOCKS_JOIN_DIM", None)
                if dim is None:
                    return None
            ws = [self._blocks(p) for p in parts]
            if any(w is None for w in ws) or len({w.kind for w in ws}) != 1 or dim == len(
                    ws[0].shape) - 1:
                return None
            shape = list(ws[0].shape)
            shape[dim] = sum(w.shape[dim] for w in ws)
            return make_weight(ws[0].kind, torch.cat([w.blocks for w in ws], dim), tuple(shape))
        return self._blocks(self._where[name]) if name in self._where else None

    def _blocks(self, gguf_name: str):
        from specdeploy.ops.ggml_linear import make_weight

        info = self.tensor_infos.get(gguf_name)
        kind = _BLOCK_KINDS.get(info.ggml_type) if info else None
        if kind is None or len(info.shape) not in (2, 3):
            return None
        # F16 / BF16: matrices and stacked experts of a model (not its mmproj tower) whose rows
        # are in 32s (experts' blocks are the 16-bit tensors the one-call expert kernel reads:
        # deploy/passes/ggml_experts.py)
        if kind in ("f16", "bf16") and (info.shape[-1] % 32 or self.is_mmproj):
            return None
        raw = np.asarray(self._data[info.offset:info.offset + info.nbytes]).reshape(
            *info.shape[:-1], -1)
        raw = self._unpermute(info.name, raw)
        blocks_hf = getattr(self._arch, "blocks_hf", None)
        cols = None
        if blocks_hf is not None:
            raw = blocks_hf(info.name, raw, self.config)
            if raw is None:
                return None
            if isinstance(raw, tuple):  # (blocks, the HF columns' places among the stored)
                raw, cols = raw
        return make_weight(kind, torch.from_numpy(np.array(raw)), info.shape,
                           None if cols is None else torch.from_numpy(cols))

    def _dequantize(self, info: TensorInfo) -> np.ndarray:
        """fp32 numpy array of `info.shape` (numpy, single-threaded: torch's small strided copies
        are much slower on a busy 2-core machine)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = np.asarray(self._data[info.offset:info.offset + info.nbytes])
        rows = prod(info.shape[:-1])
        # gguf dequantizes in groups of 16 rows; merging rows (blocks never straddle a row) makes
        # each group ~2M values, which cuts the per-group overhead without large temporaries.
        merge = max(1, min(rows, _MERGED_ROW // max(1, info.shape[-1])))
        while rows % merge:
            merge -= 1
        try:
            out = dequantize(raw.reshape(rows // merge, -1), GGMLQuantizationType(info.ggml_type))
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {info.name!r}: {e}") from None
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(info.shape)
        return out if out.flags.writeable else out.copy()  # F32 views the read-only mapping


_MERGED_ROW = 131072
# ggml types the kernels in ops/ggml_kernels.c read (MXFP4: gpt-oss's experts, as stored:
# checkpoint/gguf_mxfp4.py)
_BLOCK_KINDS = {2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_k", 11: "q3_k",
                12: "q4_k",
                13: "q5_k", 14: "q6_k", 20: "iq4_nl", 23: "iq4_xs",
                16: "iq2_xxs", 17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s", 21: "iq3_s",
                22: "iq2_s", 29: "iq1_m", 1: "f16", 30: "bf16", 34: "tq1_0", 35: "tq2_0",
                gguf_mxfp4.MXFP4_TYPE: "mxfp4"}


def _unpermute_rotary(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert `permute`: per head, GGUF rows are [dim/2 pairs, 2] where HF
    has [2 halves, dim/2] (interleaved vs rotate-half RoPE)."""
    rows = a.shape[0]
    return np.ascontiguousarray(
        a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2)).reshape(a.shape)
