"""Quantization configs detected from the checkpoint's own files; every method specdeploy does not
load is refused with its name and the supported list; quantized tensors never load without
their scales."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.quant_config import UnsupportedQuantization, detect_quant_config
from specdeploy.cli import main
from specdeploy.loading import load_model
from specdeploy.quantize_cli import make_tiny_quantized


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    return make_tiny_quantized("llama", tmp_path_factory.mktemp("qc") / "fp8", "fp8")


def _with_config(src, dst, quantization_config=None, hf_quant=None):
    shutil.copytree(src, dst)
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return dst


def test_modelopt_fields_inside_config_json_load_the_same(fp8_llama, tmp_path):
    hqc = json.loads((fp8_llama / "hf_quant_config.json").read_text())["quantization"]
    inline = _with_config(fp8_llama, tmp_path / "inline", {"quant_method": "modelopt", **hqc})
    q = detect_quant_config(inline, json.loads((inline / "config.json").read_text()), [])
    assert q.method == "fp8" and q.static_activations and "lm_head" in q.exclude
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        assert torch.equal(load_model(inline)(ids), load_model(fp8_llama)(ids))


UNSUPPORTED = [
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group",
                          "group_size": 32}}}}, "'mxfp4-pack-quantized'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}, "quant_algo 'W4A16_AWQ'"),
]


@pytest.mark.parametrize("qc,named", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_methods_are_named(fp8_llama, tmp_path, qc, named):
    bad = _with_config(fp8_llama, tmp_path / "bad", qc)
    with pytest.raises(UnsupportedQuantization, match="supported: modelopt FP8") as e:
        load_model(bad)
    assert named in str(e.value)


@pytest.mark.parametrize("quant,named", [
    ({"quant_algo": "FP8_PB_WO"}, "quant_algo 'FP8_PB_WO'"),
    ({"quant_algo": None}, "quant_algo None"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}, "kv_cache_quant_algo 'INT8'"),
    ({"quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
])
def test_unsupported_modelopt_algorithms_are_named(fp8_llama, tmp_path, quant, named):
    bad = _with_config(fp8_llama, tmp_path / "bad",
                       hf_quant={"producer": {"name": "modelopt"}, "quantization": quant})
    with pytest.raises(UnsupportedQuantization, match=named):
        load_model(bad)


def test_scales_or_gptq_tensors_without_a_config_are_refused(fp8_llama, tmp_path):
    bare = _with_config(fp8_llama, tmp_path / "bare")
    with pytest.raises(CheckpointError, match=r"\*\.input_scale, \*\.weight_scale"):
        load_model(bare)
    with pytest.raises(CheckpointError, match=r"\*\.qweight"):
        detect_quant_config(tmp_path, {}, ["model.layers.0.q_proj.qweight"])


def test_fp8_weight_without_its_scale_is_refused(fp8_llama, tmp_path):
    bad = _with_config(fp8_llama, tmp_path / "bad",
                       hf_quant=json.loads((fp8_llama / "hf_quant_config.json").read_text()))
    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.down_proj.weight' is "
                                              "torch.float8_e4m3fn but has no scales"):
        load_model(bad)


def test_cli_make_tiny_quantize_and_list_transforms(tmp_path, capsys):
    assert main(["make-tiny", "--arch", "nemotron_h", "--mtp-layers", "1", "--quant",
                 "fp8-block", "--out", str(tmp_path / "tiny")]) == 0
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())[
        "quantization_config"]["quant_method"] == "fp8"
    plain = tmp_path / "plain"
    assert main(["make-tiny", "--arch", "llama", "--out", str(plain)]) == 0
    assert main(["quantize", "--model", str(plain), "--method", "nvfp4",
                 "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["deploy", "--model", str(tmp_path / "q"), "--list-transforms"]) == 0
    out = capsys.readouterr().out
    assert "prequantized_weights" in out and "14 linears" in out
    assert "ModelOpt NVFP4 (group 16, weight-only on this hardware: no FP4 units)" in out
    assert "'lm_head': 1 (lm_head)" in out
    assert main(["quantize", "--model", str(tmp_path / "q"), "--method", "fp8",
                 "--out", str(tmp_path / "qq")]) == 2  # already quantized: one clear line


def test_quantize_from_gguf(tmp_path):
    """`quantize` takes any loadable checkpoint: a GGUF becomes the family's released layout."""
    from specdeploy.models import llama
    from tests.checkpoint.quant_oracle import dequantize_dir
    from tests.checkpoint.test_gguf import _tiny_llama_gguf

    src = llama.make_tiny(tmp_path / "st", seed=3)
    gguf_path = _tiny_llama_gguf(src, tmp_path / "tiny.gguf")
    assert main(["quantize", "--model", str(gguf_path), "--method", "fp8-block",
                 "--out", str(tmp_path / "q")]) == 0
    dequantize_dir(tmp_path / "q", tmp_path / "deq")
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "q")(ids), load_model(tmp_path / "deq")(ids))
    assert len(load_model(tmp_path / "q").prequant_weights) == 14
