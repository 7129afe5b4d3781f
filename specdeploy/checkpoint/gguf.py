"""GGUF files (llama.cpp) as a checkpoint: HF-style config and tensor names, dequantized lazily.

NOTE: the header is parsed here rather than with `gguf.GGUFReader`: that reader builds a numpy view
per metadata string (~100k for a BPE vocabulary) and takes seconds to open a 100 MB file; this
parser takes a fraction of that. Dequantization is `gguf.quants.dequantize`, one tensor per `get`.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterable
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specdeploy.checkpoint.errors import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# llama.cpp tensor names → HF names (per block `blk.N.` → `model.layers.N.`)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
SUPPORTED_ARCHITECTURES = ("llama",)


class TensorInfo(NamedTuple):
    name: str  # GGUF name
    shape: tuple[int, ...]  # torch order (GGUF stores ne0 = innermost first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFHeader(NamedTuple):
    metadata: dict
    tensors: dict[str, TensorInfo]


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name of a llama.cpp one, or None when it has no HF counterpart."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


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
    tensor to fp32 (and undoes llama.cpp's rotary row permutation of q/k projections).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = read_header(self.path)
        self.metadata = header.metadata
        self._tensors = header.tensors
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: unsupported GGUF architecture {arch!r}; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self._where = {}
        for name in self._tensors:
            hf = hf_name(name)
            self._where[hf or name] = name
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.config = self._hf_config(arch)

    def _hf_config(self, arch: str) -> dict:
        md = self.metadata

        def get(key, default=None):
            return md.get(f"{arch}.{key}", default)

        def need(key):
            if f"{arch}.{key}" not in md:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
            return md[f"{arch}.{key}"]

        heads = int(need("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer arrays: llama has one value throughout
            kv_heads = kv_heads[0]
        hidden = int(need("embedding_length"))
        embd = self._tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd else get("vocab_size") or len(
            md.get("tokenizer.ggml.tokens", ()))
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(get("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        }
        if get("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(get("rope.scaling.factor", 1.0))}
        elif get("rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{self.path}: unsupported rope scaling "
                                  f"{get('rope.scaling.type')!r}")
        if "rope_freqs.weight" in self._tensors:  # llama3-style scaling, as per-frequency divisors
            factors = self._dequantize(self._tensors["rope_freqs.weight"]).tolist()
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                      "freq_factors": factors}
        return cfg

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self._where)

    def missing(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self._where]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        info = self._tensors[self._where[name]]
        a = self._dequantize(info)
        if info.name.endswith(("attn_q.weight", "attn_q.bias")):
            a = _unpermute_rotary(a, self.config["num_attention_heads"])
        elif info.name.endswith(("attn_k.weight", "attn_k.bias")):
            a = _unpermute_rotary(a, self.config["num_key_value_heads"])
        return torch.from_numpy(a)

    def get_blocks(self, name: str):
        """`GGMLWeight` (its raw Q4_0 / Q4_1 / Q8_0 blocks, rows in HF order) of a 2-D tensor
        stored in one of those types, else None: what `ops/ggml_linear.py` computes with."""
        from specdeploy.ops.ggml_linear import make_weight

        info = self._tensors.get(self._where.get(name, ""))
        kind = _BLOCK_KINDS.get(info.ggml_type) if info else None
        if kind is None or len(info.shape) != 2:
            return None
        rows = info.shape[0]
        raw = np.asarray(self._data[info.offset:info.offset + info.nbytes]).reshape(rows, -1)
        if info.name.endswith("attn_q.weight"):
            raw = _unpermute_rotary(raw, self.config["num_attention_heads"])
        elif info.name.endswith("attn_k.weight"):
            raw = _unpermute_rotary(raw, self.config["num_key_value_heads"])
        return make_weight(kind, torch.from_numpy(np.array(raw)), info.shape)

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
# ggml types the kernels in ops/ggml_kernels.c read
_BLOCK_KINDS = {2: "q4_0", 3: "q4_1", 8: "q8_0"}


def _unpermute_rotary(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert `permute`: per head, GGUF rows are [dim/2 pairs, 2] where HF
    has [2 halves, dim/2] (interleaved vs rotate-half RoPE)."""
    rows = a.shape[0]
    return np.ascontiguousarray(
        a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2)).reshape(a.shape)
