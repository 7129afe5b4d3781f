"""Pre-quantized checkpoints (ModelOpt FP8 / NVFP4, HF block FP8) × every architecture: the
deployed quantized graph's logits equal those of the same model built from an independently
dequantized copy of the checkpoint (tests/checkpoint/quant_oracle.py), fp32 compute.

Tolerance: 1e-4 of the logits' scale (fp32 reassociation: the ops sum in tiles of rows; the
oracle is a plain fp32 model). FP8's static activation quantization is in both: the oracle
fake-quantizes activations with the checkpoint's input scales (pre-hooks, a dense expert loop).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specdeploy.checkpoint import CheckpointError
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.export import export_model
from specdeploy.deploy.pipeline import run_transform
from specdeploy.loading import load_model
from specdeploy.models import glm4_moe, nemotron_h_blocks, qwen3_5_blocks
from specdeploy.quantize_cli import make_tiny_quantized
from tests.checkpoint.quant_oracle import dequantize_dir, fake_quant_hooks

ARCHS = ("llama", "nemotron_h", "qwen3_5_moe", "qwen3_5", "qwen3_moe", "qwen3_vl",
         "qwen3_vl_moe", "qwen3_next", "glm4_moe")  # qwen3_5: dense
METHODS = ("fp8", "nvfp4", "fp8-block")
# quantized linears (+ routed-expert sets) per tiny model: everything but lm_head, routers and
# the shared-expert gate (see test_quantize.EXPECTED_MATCHES; the nemotron_h router is excluded
# by '*.mixer.gate' here and no longer a linear there)
EXPECTED = {"llama": 14, "nemotron_h": 24 + 2, "qwen3_5_moe": 31 + 4,
            "qwen3_5": 31,  # (the MoE's shared expert's 3 linears are the dense MLP's here)
            "qwen3_moe": 15 + 2,  # 3 layers' attention, the dense layer's MLP; 2 expert sets
            "qwen3_vl": 21, "qwen3_vl_moe": 15 + 2,  # (the towers stay as shipped: excluded)
            "qwen3_next": 31 + 4,  # Qwen3.5-MoE's blocks (GDN projections split from grouped)
            "glm4_moe": 12 + 3 + 2 * 4}  # attention, the dense MLP, shared + routed experts


def assert_close(actual, expected, rtol=1e-4):
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rtol * scale, f"max abs err {err:.3g} > {rtol:g} * scale {scale:.3g}"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequant")
    cache = {}

    def get(arch: str, method: str):
        if (arch, method) not in cache:
            mtp = 0 if arch in ("llama", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe",
                                "glm4_moe") else 1
            cache[arch, method] = make_tiny_quantized(arch, root / f"{arch}-{method}", method,
                                                      mtp_layers=mtp)
        return cache[arch, method]

    return get


def _ids():
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 120, (1, 29), generator=g), torch.arange(29)[None]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_deployed_logits_match_dequantized_oracle(quantized, tmp_path, arch, method):
    path = quantized(arch, method)
    in_scales = dequantize_dir(path, tmp_path / "oracle")
    assert bool(in_scales) == (method == "fp8")
    oracle = load_model(tmp_path / "oracle")
    ids, pos = _ids()
    with torch.no_grad(), fake_quant_hooks(oracle, in_scales,
                                           (nemotron_h_blocks, qwen3_5_blocks, glm4_moe)):
        want = oracle(ids)
    model = load_model(path)
    gm = export_model(model, max_tokens=64)
    info, _ = run_transform("prequantized_weights", gm, DeployContext(model=model))
    assert info.num_matches == EXPECTED[arch] and not info.skipped
    with torch.no_grad():
        got = gm(ids, pos)[0]
    assert_close(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_weights_stay_quantized_in_the_graph(quantized, method):
    model = load_model(quantized("qwen3_5_moe", method))
    gm = export_model(model, max_tokens=64)
    run_transform("prequantized_weights", gm, DeployContext(model=model))
    dtypes = {t.dtype for t in gm.buffers()}
    assert (torch.uint8 if method == "nvfp4" else torch.float8_e4m3fn) in dtypes
    # no full-precision copy of a quantized weight is left: only excluded / non-linear params
    names = [n for n, p in gm.named_parameters() if p.dim() >= 2]
    assert all("experts" not in n and not n.endswith(("q_proj.weight", "in_proj_qkv.weight"))
               for n in names), names
    bufs = dict(gm.named_buffers())
    qweights = {n: b for n, b in bufs.items() if n.endswith("_q_weight")}
    assert qweights and all(b.element_size() == 1 for b in qweights.values())
    if method == "nvfp4":  # 2 weights per byte + one fp8 scale per 16 weights: 0.5625 B/weight
        for n, b in qweights.items():
            assert bufs[n[: -len("weight")] + "scale"].shape[-1] * 16 == b.shape[-1] * 2


def test_weight_only_formats_equal_plain_dequantized_model(quantized, tmp_path):
    """Eager: the loaded plain model is the weight-dequantized model, bit for bit."""
    for method in ("nvfp4", "fp8-block", "fp8"):
        path = quantized("nemotron_h", method)
        dequantize_dir(path, tmp_path / method)
        ids, _ = _ids()
        with torch.no_grad():
            assert torch.equal(load_model(path)(ids), load_model(tmp_path / method)(ids))


def test_modelopt_fp8_never_loads_with_scales_dropped(quantized, tmp_path):
    """The bug this replaces: a ModelOpt FP8 checkpoint loaded without its scales gave logits
    off by more than the largest logit. Without the config the scales are refused by name;
    with it the logits are the dequantized model's."""
    import shutil

    src = quantized("llama", "fp8")
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"weight_scale.*no quantization config"):
        load_model(bare)
    dequantize_dir(src, tmp_path / "deq")
    ids, _ = _ids()
    with torch.no_grad():
        assert torch.equal(load_model(src)(ids), load_model(tmp_path / "deq")(ids))


def test_released_layout_and_exclusions(quantized):
    path = quantized("qwen3_5_moe", "nvfp4")
    hqc = json.loads((path / "hf_quant_config.json").read_text())
    assert hqc["producer"]["name"] == "modelopt"
    q = hqc["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert {"lm_head", "mtp*", "*.mlp.gate"} <= set(q["exclude_modules"])
    with safe_open(str(path / "model.safetensors"), framework="pt") as h:
        k = "model.language_model.layers.0.mlp.experts.3.gate_proj"
        assert h.get_tensor(k + ".weight").dtype == torch.uint8
        assert h.get_tensor(k + ".weight").shape == (32, 32)
        assert h.get_tensor(k + ".weight_scale").dtype == torch.float8_e4m3fn
        assert h.get_tensor(k + ".weight_scale").shape == (32, 4)
        assert h.get_tensor(k + ".weight_scale_2").shape == ()
        assert h.get_tensor("mtp.fc.weight").dtype == torch.bfloat16
        assert h.get_tensor("model.language_model.layers.0.mlp.gate.weight").dtype == \
            torch.bfloat16
    block = json.loads((quantized("qwen3_5_moe", "fp8-block") / "config.json").read_text())
    qc = block["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert "mtp*" in qc["modules_to_not_convert"]
