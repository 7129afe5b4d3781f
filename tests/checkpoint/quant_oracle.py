"""Test-side oracle for pre-quantized checkpoints, independent of specdeploy's loader and ops.

`dequantize_dir` reads a quantized checkpoint's safetensors directly and writes a plain one:
E2M1 decoded from its bit fields (not a lookup table), FP8 blocks scaled one block at a time in
Python loops. `fake_quant_hooks` makes an oracle model quantize activations with the
checkpoint's static FP8 `input_scale`s, for linears (forward pre-hooks) and routed experts
(a dense per-token expert loop written here).
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale", "k_scale",
                  "v_scale")


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes → values: sign bit 3, exponent bits 2-1, mantissa bit 0 (bias 1; exponent 0 is
    subnormal: m * 0.5)."""
    code = code.long()
    sign = 1.0 - 2.0 * ((code >> 3) & 1).double()
    e, m = (code >> 1) & 3, (code & 1).double()
    mag = torch.where(e == 0, m * 0.5, torch.pow(2.0, (e - 1).double()) * (1.0 + m / 2))
    return (sign * mag).float()


def _base(key: str) -> str:
    return key[: -len("weight")] if key.endswith(".weight") else key + "_"


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _dequant(key: str, t: torch.Tensor, tensors: dict, method: str, block) -> torch.Tensor:
    b = _base(key)
    if method == "nvfp4":
        low, high = t & 0xF, t >> 4
        codes = torch.stack([low, high], -1).reshape(*t.shape[:-1], t.shape[-1] * 2)
        s = tensors[b + "weight_scale"].float()
        s2 = tensors[b + "weight_scale_2"].float()
        s2 = s2.reshape(*s2.shape, 1, 1) if s2.dim() else s2
        return e2m1_decode(codes) * torch.repeat_interleave(s, 16, dim=-1) * s2
    w = t.float()
    if method == "fp8":
        s = tensors[b + "weight_scale"].float()
        return w * (s.reshape(*s.shape, 1, 1) if s.dim() else s)
    s = tensors[b + "weight_scale_inv"].float()
    bn, bk = block
    out = w.clone()
    mats = [(out, s)] if w.dim() == 2 else list(zip(out, s))
    for o, sc in mats:
        for i in range(sc.shape[0]):
            for j in range(sc.shape[1]):
                o[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= sc[i, j]
    return out


def dequantize_dir(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Write `src` dequantized (fp32 weights, every other tensor as stored) to `dst`; returns
    the static FP8 input scales by checkpoint weight name (empty for other methods)."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    hqc = src / "hf_quant_config.json"
    if hqc.is_file():
        method = json.loads(hqc.read_text())["quantization"]["quant_algo"].lower()
        block = None
    else:
        qc = config.pop("quantization_config")
        method, block = "fp8_block", qc["weight_block_size"]
    tensors = _read_all(src)
    out, in_scales = {}, {}
    for k, t in tensors.items():
        if any(k.endswith(s) for s in SCALE_SUFFIXES):
            continue
        if _base(k) + ("weight_scale_inv" if method == "fp8_block" else "weight_scale") in tensors:
            out[k] = _dequant(k, t, tensors, method, block)
            if method == "fp8" and _base(k) + "input_scale" in tensors:
                in_scales[k] = tensors[_base(k) + "input_scale"].float()
        else:
            out[k] = t
    dst.mkdir(parents=True, exist_ok=True)
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy2(f, dst / f.name)
    return in_scales


def _ours(ckpt: str) -> str:
    for theirs in ("model.language_model.", "backbone."):
        if ckpt.startswith(theirs):
            return "model." + ckpt[len(theirs):]
    return ckpt


# Qwen3-Next's grouped GDN projections are our split ones (models/qwen3_next.py): one input
_SPLIT = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


def _split(mod_name: str) -> list[str]:
    base, _, last = mod_name.rpartition(".")
    return [f"{base}.{n}" for n in _SPLIT[last]] if last in _SPLIT else [mod_name]


def _fq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s


@contextmanager
def fake_quant_hooks(model: torch.nn.Module, in_scales: dict[str, torch.Tensor], blocks_modules):
    """Activations quantized with the checkpoint's input scales while the context is open:
    linears by pre-hooks, routed experts by a dense loop (one scale per projection: the largest
    over the experts, the convention the loader documents)."""
    hooks, expert_scales = [], {}
    for key, s in in_scales.items():
        mod_name = _ours(key[: -len(".weight")] if key.endswith(".weight") else key)
        parts = mod_name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            owner = ".".join(parts[:i + 1])
            proj = "down" if parts[-1] == "down_proj" else "up"
            s = s.max()  # per-expert scales of a fused tensor: the largest, as one scale
            prev = expert_scales.setdefault(owner, {}).get(proj)
            expert_scales[owner][proj] = s if prev is None else torch.maximum(prev, s)
            continue
        for name in _split(mod_name):
            mod = model.get_submodule(name)
            hooks.append(mod.register_forward_pre_hook(lambda m, a, s=s: (_fq(a[0], s),)))
    by_weight = {}
    for owner, sc in expert_scales.items():
        experts = model.get_submodule(owner)
        up = getattr(experts, "gate_up_proj", None)
        up = experts.up_proj if up is None else up
        by_weight[up.data_ptr()] = sc

    real = torch.ops.specdeploy

    class Ops:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def moe_experts(x, ids, weights, w_up, w_down, act):
            sc = by_weight.get(w_up.data_ptr())
            if sc is None:  # experts without static scales (weight-only formats)
                return real.moe_experts(x, ids, weights, w_up, w_down, act)
            out = torch.zeros(x.shape, dtype=torch.float32)
            for t in range(x.shape[0]):
                for j in range(ids.shape[1]):
                    e = int(ids[t, j])
                    h = _fq(x[t].float(), sc["up"]) @ w_up[e].float().t()
                    if act == "swiglu":
                        g, u = h.chunk(2)
                        h = F.silu(g) * u
                    else:
                        h = F.relu(h).square()
                    out[t] += weights[t, j].float() * (_fq(h, sc["down"]) @ w_down[e].float().t())
            return out.to(x.dtype)

    saved = [(m, m._ops) for m in blocks_modules]
    try:
        for m in blocks_modules:
            m._ops = Ops()
        yield
    finally:
        for m, o in saved:
            m._ops = o
        for h in hooks:
            h.remove()
