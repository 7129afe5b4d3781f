"""Test side: compressed-tensors checkpoints written and read back by the compressed-tensors
library itself (llm-compressor's storage layer), independent of specdeploy's loader.

`write_ct` turns one of our ModelOpt / HF quantized tiny checkpoints into compressed-tensors'
layout: every quantized weight is dequantized (tests/checkpoint/quant_oracle.py), given scales
for the target scheme, and compressed by the library's own compressor for the format
(`BaseCompressor` registry: `float-quantized`, `nvfp4-pack-quantized`), which writes the
tensor names, dtypes and packing real checkpoints have. `dequantize_ct_dir` is the oracle: the
library's decompressors turn it back into a plain checkpoint.
"""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.checkpoint.quant_oracle import _base, _read_all, dequantize_dir

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import (  # noqa: E402
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402

# kind → (our source method, format, weights args, input_activations args)
_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_DYN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
           "strategy": "tensor"}
KINDS = {
    "fp8-tensor": ("fp8", "float-quantized", {**_FP8, "strategy": "tensor"}, _STATIC),
    "fp8-channel": ("fp8", "float-quantized", {**_FP8, "strategy": "channel"}, _DYN),
    "fp8-group": ("fp8", "float-quantized", {**_FP8, "strategy": "group", "group_size": 16},
                  {**_DYN, "strategy": "group", "group_size": 16}),
    "fp8-block": ("fp8-block", "float-quantized",
                  {**_FP8, "strategy": "block", "block_structure": [16, 32]}, None),
    # W4A16 from a plain checkpoint (our source method None): bfloat16 scales, as released
    "w4a16": (None, "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                       "strategy": "group", "group_size": 32}, None),
    "w4a16-channel": (None, "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                               "strategy": "channel"}, None),
    "w4a16-g16": (None, "pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                           "strategy": "group", "group_size": 16}, None),
    "w8a16": (None, "pack-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                       "strategy": "channel"}, None),
    "w8a8": (None, "int-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                     "strategy": "group", "group_size": 32},
             {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
              "strategy": "token"}),
    "nvfp4": ("nvfp4", "nvfp4-pack-quantized",
              {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor_group", "group_size": 16},
              {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": "local",
               "strategy": "tensor_group", "group_size": 16}),
}


def _scales(w: torch.Tensor, weights: dict) -> dict[str, torch.Tensor]:
    """fp32 scales of the scheme (amax / the format's max, as llm-compressor's minmax
    observers), shaped as the library stores them."""
    s, n, k = weights["strategy"], *w.shape
    a = w.abs()
    if weights["type"] == "int":  # amax / 2^(bits-1), in bfloat16: a group's most negative
        # weight at amax quantizes to the code -2^(bits-1) (int8's -128, int4's -8)
        g = k if s == "channel" else weights["group_size"]
        amax = a.reshape(n, k // g, g).amax(-1)
        top = float(1 << (weights["num_bits"] - 1))
        return {"weight_scale": torch.where(amax > 0, amax / top, torch.ones_like(amax))
                .to(torch.bfloat16)}
    if s == "tensor_group":  # NVFP4: global = 448 * 6 / amax, group scales / global in fp8
        g = (448.0 * 6.0 / a.max().clamp_min(1e-12)).reshape(1)
        groups = a.reshape(n, k // 16, 16).amax(-1) / 6.0
        return {"weight_scale": (groups * g).clamp(max=448.0).to(torch.float8_e4m3fn).float(),
                "weight_global_scale": g}
    if s == "tensor":
        amax = a.max().reshape(1)
    elif s == "channel":
        amax = a.amax(1, keepdim=True)
    elif s == "group":
        amax = a.reshape(n, k // weights["group_size"], -1).amax(-1)
    else:
        bn, bk = weights["block_structure"]
        amax = a.reshape(n // bn, bn, k // bk, bk).amax((1, 3))
    return {"weight_scale": torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))}


def _regex(glob: str) -> str:
    return "re:" + fnmatch.translate(glob)


INT_EXCLUDE = ("lm_head", "*.mlp.gate", "*.mixer.gate", "*.shared_expert_gate", "mtp*")


def write_ct(src: Path, dst: Path, kind: str, kv_cache: bool = False) -> Path:
    """`src` (our quantized checkpoint of KINDS[kind][0]; for the int kinds a plain one, its
    `*_proj` linears quantized) rewritten as compressed-tensors."""
    method, fmt, weights, acts = KINDS[kind]
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(dst.name + "-dense")
    config = json.loads((src / "config.json").read_text())
    if method is None:
        in_scales, tmp = {}, src
        excl = list(INT_EXCLUDE)
        quantized = {k[: -len("weight")] for k, t in _read_all(src).items()
                     if k.endswith("proj.weight") and t.dim() == 2 and not
                     any(fnmatch.fnmatchcase(k[:-7], g) for g in excl)}
    else:
        in_scales = dequantize_dir(src, tmp)
        hqc = src / "hf_quant_config.json"
        excl = (json.loads(hqc.read_text())["quantization"]["exclude_modules"] if hqc.is_file()
                else config["quantization_config"]["modules_to_not_convert"])
        quantized = {k.rpartition(".")[0] + "." for k in _read_all(src)
                     if k.endswith((".weight_scale", ".weight_scale_inv"))}
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    comp = BaseCompressor.get_value_from_registry(fmt)
    out = {}
    for key, t in _read_all(tmp).items():
        base = _base(key)
        if base not in quantized or not key.endswith(".weight"):
            out[key] = t
            continue
        sd = {"weight": t.float(), **_scales(t.float(), weights)}
        if acts is not None and acts.get("dynamic") is False:  # ModelOpt's calibrated scale
            sd["input_scale"] = in_scales[key].reshape(1)
        for name, v in comp.compress(sd, scheme).items():
            out[base + name] = v.detach().contiguous()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts, "output_activations": None,
                                      "format": fmt}},
        "ignore": [_regex(g) for g in excl],
        "kv_cache_scheme": {**_STATIC} if kv_cache else None}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy2(f, dst / f.name)
    if method is not None:
        shutil.rmtree(tmp)
    return dst


def _decompress(comp, sd: dict, scheme) -> torch.Tensor:
    """The library's decompression in fp32 (its NVFP4 decompressor unpacks to bfloat16: the
    same steps, its own unpacking and dequantize, in fp32 here)."""
    if "weight_shape" in sd:  # int: the library's unpacking, its dequantize in fp32
        q = unpack_from_int32(sd["weight_packed"], scheme.weights.num_bits,
                              torch.Size(sd["weight_shape"].tolist()))
        return dequantize(x_q=q, scale=sd["weight_scale"].float(), args=scheme.weights,
                          dtype=torch.float32)
    if sd.get("weight") is not None and sd["weight"].dtype == torch.int8:  # int-quantized
        return dequantize(x_q=sd["weight"], scale=sd["weight_scale"].float(),
                          args=scheme.weights, dtype=torch.float32)
    if "weight_packed" not in sd:
        return comp.decompress(sd, scheme)["weight"].float()
    packed = sd["weight_packed"]
    m, n = packed.shape
    codes = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    return dequantize(x_q=codes, scale=sd["weight_scale"].float(), args=scheme.weights,
                      global_scale=sd["weight_global_scale"].float(), dtype=torch.float32)


def dequantize_ct_dir(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """The oracle: `src` decompressed by the library (fp32 weights, the rest as stored) into a
    plain checkpoint at `dst`; returns the static input scales by weight name."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    group = next(iter(qc["config_groups"].values()))
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group["input_activations"])
    comp = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
    tensors = _read_all(src)
    names = comp.compression_param_names(scheme)
    bases = {k[: -len(names[0])] for k in tensors if k.endswith("." + names[0])
             and k[: -len(names[0])] + "weight_scale" in tensors}
    out, in_scales = {}, {}
    for key, t in tensors.items():
        base = next((b for b in bases if key.startswith(b) and key[len(b):] in
                     (*names, "input_scale")), None)
        if base is None:
            out[key] = t
        elif key == base + names[0]:
            sd = {n: tensors[base + n] for n in names if base + n in tensors}
            out[base + "weight"] = _decompress(comp, sd, scheme)
            if base + "input_scale" in tensors:
                in_scales[base + "weight"] = tensors[base + "input_scale"].float().reshape(())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy2(f, dst / f.name)
    return in_scales
