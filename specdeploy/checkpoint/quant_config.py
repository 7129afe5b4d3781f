"""A checkpoint's quantization config, detected from its own files (never guessed from a path).

Supported (DESIGN.md invariant 10: everything else is refused with the method's name):
- NVIDIA ModelOpt: `hf_quant_config.json` {"quantization": {"quant_algo", "kv_cache_quant_algo",
  "group_size", "exclude_modules"}} or the same fields in config.json `quantization_config` with
  `quant_method: "modelopt"` (top level or under "quantization"; newer exports call the exclusion
  list `ignore`). quant_algo FP8 (per-tensor) or NVFP4 (group 16).
- Hugging Face fine-grained FP8: config.json `quantization_config` {"quant_method": "fp8",
  "weight_block_size": [bn, bk], "activation_scheme", "modules_to_not_convert"}.
- compressed-tensors (llm-compressor) FP8 and NVFP4: compressed_tensors.py.
- MXFP4 as gpt-oss ships it: `quant_method: "mxfp4"`, `modules_to_not_convert`; read
  dequantized, exactly (checkpoint/mxfp4.py).
A checkpoint with quantization tensors (`*.weight_scale`, `*.qweight`, ...) but no config is
refused too: loading it as plain weights would drop the scales.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from specdeploy.checkpoint import compressed_tensors
from specdeploy.checkpoint.reader import CheckpointError

__all__ = ["QuantConfig", "SUPPORTED", "UnsupportedQuantization", "detect_quant_config"]

SUPPORTED = ("modelopt FP8", "modelopt NVFP4", "fp8 with weight_block_size (HF fine-grained)",
             "compressed-tensors float-quantized (FP8) / nvfp4-pack-quantized / "
             "pack-quantized (W4A16, W8A16) / int-quantized (W8A8)", "mxfp4 (gpt-oss)")
_KV_ALGOS = (None, "FP8")
# tensor-name endings that only quantized checkpoints have (ModelOpt, HF fp8, compressed-tensors,
# GPTQ / AWQ, bitsandbytes)
QUANT_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale",
                  ".k_scale", ".v_scale", ".weight_packed", ".weight_global_scale", ".qweight",
                  ".qzeros", ".scales", ".g_idx", ".SCB", ".absmax", ".quant_map",
                  ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")


class UnsupportedQuantization(CheckpointError):
    """A quantization method / algorithm specdeploy does not load (the message names it)."""


@dataclass(frozen=True)
class QuantConfig:
    # "fp8" (ModelOpt per-tensor) | "nvfp4" | "fp8_block" (HF fine-grained) | "ct_fp8" |
    # "ct_nvfp4" | "ct_int" (compressed-tensors) | "mxfp4" (gpt-oss)
    method: str
    source: str  # where it was read: "hf_quant_config.json" | "config.json"
    exclude: tuple[str, ...] = ()  # fnmatch globs over the checkpoint's module names
    group_size: int = 16  # NVFP4 inputs per block scale
    block_size: tuple[int, int] = (128, 128)  # fp8_block (rows, cols) per scale
    kv_cache: str | None = None  # "FP8" or None
    static_activations: bool = False  # ModelOpt FP8 `input_scale` applies to activations
    strategy: str = ""  # ct_fp8's weight scales: "tensor" | "channel" | "group" | "block"
    bits: int = 0  # ct_int: 4 or 8
    packed: bool = False  # ct_int: pack-quantized (else int-quantized)

    def describe(self) -> str:
        what = {"fp8": "ModelOpt FP8 (per-tensor weights, static per-tensor activations)",
                "nvfp4": f"ModelOpt NVFP4 (group {self.group_size}, weight-only on this "
                         "hardware: no FP4 units)",
                "fp8_block": f"HF fine-grained FP8 (blocks {self.block_size[0]}x"
                             f"{self.block_size[1]}, weight-only)",
                "ct_fp8": f"compressed-tensors FP8 (per-{self.strategy} weight scales"
                          + (f" {self.block_size[0]}x{self.block_size[1]}"
                             if self.strategy in ("block", "group") else "")
                          + (", static per-tensor activations)" if self.static_activations
                             else ", weight-only)"),
                "ct_nvfp4": "compressed-tensors NVFP4 (group 16, weight-only on this "
                            "hardware: no FP4 units)",
                "ct_int": f"compressed-tensors W{self.bits}A"
                          + ("16" if self.packed else "8, run weight-only") + f" (int{self.bits} "
                          + (f"groups of {self.group_size}" if self.group_size else
                             "per channel")
                          + f", as GGUF {'Q4_0' if self.bits == 4 else 'Q8_0'} blocks)",
                "mxfp4": "MXFP4 (E2M1 in groups of 32, E8M0 scales; dequantized exactly at "
                         "load)",
                }[self.method]
        return what + (f", kv cache {self.kv_cache}" if self.kv_cache else "")


def _unsupported(where: str, found: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{where}: quantization {found} is not supported; supported: "
                                   f"{', '.join(SUPPORTED)}")


def _modelopt(fields: dict, where: str, source: str) -> QuantConfig:
    algo = fields.get("quant_algo")
    kv = fields.get("kv_cache_quant_algo")
    if kv not in _KV_ALGOS:
        raise _unsupported(where, f"modelopt kv_cache_quant_algo {kv!r}")
    excl = fields.get("exclude_modules", fields.get("ignore")) or []
    if not isinstance(excl, list) or not all(isinstance(g, str) for g in excl):
        raise CheckpointError(f"{where}: exclude_modules must be a list of strings, got {excl!r}")
    if algo == "FP8":
        return QuantConfig("fp8", source, tuple(excl), kv_cache=kv, static_activations=True)
    if algo == "NVFP4":
        group = int(fields.get("group_size") or 16)
        if group != 16:
            raise _unsupported(where, f"modelopt NVFP4 with group_size {group} (only 16)")
        return QuantConfig("nvfp4", source, tuple(excl), group_size=group, kv_cache=kv)
    raise _unsupported(where, f"modelopt quant_algo {algo!r}")


def _hf_fp8(qc: dict, where: str) -> QuantConfig:
    block = qc.get("weight_block_size")
    if not block:
        raise _unsupported(where, "fp8 without weight_block_size (per-tensor HF fp8)")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{where}: weight_block_size must be two positive ints, "
                              f"got {block!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _unsupported(where, f"fp8 with activation_scheme {scheme!r} (only 'dynamic')")
    excl = qc.get("modules_to_not_convert") or []
    return QuantConfig("fp8_block", "config.json", tuple(excl), block_size=(block[0], block[1]))


def detect_quant_config(path: str | Path, config: dict, keys: Iterable[str]
                        ) -> QuantConfig | None:
    """The checkpoint's quantization, or None for a plain one; raises `UnsupportedQuantization`
    naming any method it cannot load, and `CheckpointError` for quantization tensors without a
    config."""
    path = Path(path)
    hqc = path / "hf_quant_config.json"
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config")
    if hqc.is_file():
        try:
            data = json.loads(hqc.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{hqc}: malformed JSON ({e})") from None
        producer = (data.get("producer") or {}).get("name", "modelopt")
        if producer != "modelopt":
            raise _unsupported(str(hqc), f"from producer {producer!r}")
        return _modelopt(data.get("quantization") or {}, str(hqc), "hf_quant_config.json")
    if qc is not None:
        where = f"{path / 'config.json'} quantization_config"
        if not isinstance(qc, dict):
            raise CheckpointError(f"{where}: expected an object, got {qc!r}")
        method = qc.get("quant_method")
        if method == "modelopt":
            return _modelopt(qc.get("quantization") or qc, where, "config.json")
        if method == "fp8":
            return _hf_fp8(qc, where)
        if method == "mxfp4":
            excl = qc.get("modules_to_not_convert") or []
            return QuantConfig("mxfp4", "config.json", tuple(excl), group_size=32)
        if method == "compressed-tensors":
            return compressed_tensors.parse(
                qc, where, keys, _unsupported,
                lambda **kw: QuantConfig(source="config.json", **kw))
        raise _unsupported(where, f"method {method!r}")
    found = sorted({s for k in keys for s in QUANT_SUFFIXES if k.endswith(s)})
    if found:
        raise CheckpointError(
            f"{path}: tensors named *{', *'.join(found)} look quantized, but the checkpoint "
            f"has no quantization config (no hf_quant_config.json, no quantization_config in "
            f"config.json); loading them as plain weights would drop their scales")
    return None
