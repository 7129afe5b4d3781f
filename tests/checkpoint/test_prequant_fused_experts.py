"""Routed experts stored fused (3-D `experts.gate_up_proj` / `experts.up_proj` / `down_proj`,
one scale set per expert: `<name>_weight_scale` [E], `_weight_scale_inv` [E, N/bn, K/bk],
`_weight_scale_2` [E], `_input_scale` [E]) load like the per-expert layout: the deployed logits
equal the independently dequantized model's (≤ 1e-4 of their scale)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.pipeline import run_transform
from specdeploy.loading import load_model
from specdeploy.models import nemotron_h_blocks, qwen3_5_blocks
from specdeploy.models.registry import family_module
from specdeploy.ops.fp8_linear import quantize_fp8_block, quantize_fp8_tensor
from specdeploy.ops.nvfp4_linear import quantize_nvfp4
from tests.checkpoint.quant_oracle import dequantize_dir, fake_quant_hooks

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _quant(w: torch.Tensor, method: str) -> dict[str, torch.Tensor]:
    if method == "nvfp4":
        p, s, s2 = quantize_nvfp4(w)
        return {"": p, "_weight_scale": s, "_weight_scale_2": s2}
    if method == "fp8":
        q, s = quantize_fp8_tensor(w)
        return {"": q, "_weight_scale": s, "_input_scale": torch.tensor(3.0 / 448)}
    q, s = quantize_fp8_block(w)
    return {"": q, "_weight_scale_inv": s}


def _fused_quantized(plain, out, method: str):
    tensors = load_file(str(plain / "model.safetensors"))
    groups: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    rest = {}
    for k, t in tensors.items():
        m = _EXPERT.match(k)
        if m is None:
            rest[k] = t
        else:
            groups.setdefault((m[1], "down_proj" if m[3] == "down_proj" else "up"), {}).setdefault(
                int(m[2]), {})[m[3]] = t
    for (base, kind), experts in groups.items():
        mats = []
        for e in sorted(experts):
            parts = experts[e]
            mats.append(parts["down_proj"] if kind == "down_proj" else torch.cat(
                [parts[p] for p in ("gate_proj", "up_proj") if p in parts]))
        leaf = "gate_up_proj" if "gate_proj" in experts[0] else "up_proj"
        name = f"{base}.{'down_proj' if kind == 'down_proj' else leaf}"
        per = [_quant(w.float(), method) for w in mats]
        for suffix in per[0]:
            rest[name + suffix] = torch.stack([q[suffix] for q in per])
    shutil.copytree(plain, out)
    save_file(rest, str(out / "model.safetensors"))
    if method == "fp8-block":
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
        (out / "config.json").write_text(json.dumps(cfg))
    else:
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": method.upper()}}))
    return out


@pytest.mark.parametrize("method", ("fp8", "nvfp4", "fp8-block"))
@pytest.mark.parametrize("arch", ("nemotron_h", "qwen3_5_moe"))
def test_fused_expert_layout(tmp_path, arch, method):
    plain = family_module(arch).make_tiny(tmp_path / "plain", seed=1)
    path = _fused_quantized(plain, tmp_path / "fused", method)
    in_scales = dequantize_dir(path, tmp_path / "oracle")
    oracle = load_model(tmp_path / "oracle")
    ids = torch.randint(3, 120, (1, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), fake_quant_hooks(oracle, in_scales,
                                           (nemotron_h_blocks, qwen3_5_blocks)):
        want = oracle(ids)
    model = load_model(path)
    assert all(w.weight.dim() == 3 for w in model.prequant_weights.values())
    gm = export_model(model, max_tokens=64)
    info, _ = run_transform("prequantized_weights", gm, DeployContext(model=model))
    assert info.num_matches == (2 if arch == "nemotron_h" else 4)  # one per MoE layer
    with torch.no_grad():
        got = gm(ids, torch.arange(23)[None])[0]
    err = (got.double() - want.double()).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err
