"""Checkpoint exclusion globs mapped into the deployment's namespaces (target names and
`eagle_drafter.*`), the cases the seeds hit (TensorRT-LLM AutoDeploy's `mtp.layers.0*` that
excluded the whole target), and the loader's checks against the tensors."""
from __future__ import annotations

import json
import shutil

import pytest

from specdeploy.checkpoint import CheckpointError
from specdeploy.checkpoint.quant_exclude import map_exclusions
from specdeploy.loading import load_model
from specdeploy.quantize_cli import make_tiny_quantized

LAYER_MODULES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.experts")


def _ckpt(prefix: str) -> list[str]:
    """Checkpoint module names of a 2-layer target with one MTP layer, under `prefix`."""
    mods = [f"{prefix}layers.{i}.{m}" for i in range(2) for m in LAYER_MODULES]
    return mods + [f"mtp.layers.0.{m}" for m in LAYER_MODULES] + ["mtp.fc", "lm_head"]


TARGET = [f"model.layers.{i}.{m}" for i in range(2) for m in LAYER_MODULES] + ["lm_head"]
DRAFTER = [f"eagle_drafter.layers.0.{m}" for m in LAYER_MODULES] + ["eagle_drafter.fc"]


def _excluded(globs, prefix="model.language_model.", n_layers=2):
    ex = map_exclusions(globs, _ckpt(prefix), n_layers, TARGET)
    return {n for n in TARGET + DRAFTER if ex.why(n) is not None}


def test_mtp_glob_excludes_the_drafter_only():
    assert _excluded(["mtp*"]) == set(DRAFTER)
    # AutoDeploy's remap of this glob (drafter root `model`) excluded every target layer
    assert _excluded(["mtp.layers.0*"]) == {n for n in DRAFTER if ".layers.0." in n}


@pytest.mark.parametrize("prefix", ["model.language_model.", "model.", "backbone."])
def test_target_layer_glob_excludes_that_target_layer_only(prefix):
    """A VLM-prefixed, a text and a NemotronH (`backbone.`) checkpoint map alike."""
    got = _excluded([f"{prefix}layers.0.*"], prefix=prefix)
    assert got == {n for n in TARGET if n.startswith("model.layers.0.")}


def test_wildcard_kind_globs_apply_in_both_namespaces():
    assert _excluded(["*.mlp.gate"]) == {n for n in TARGET + DRAFTER if n.endswith("mlp.gate")}


def test_rooted_glob_matching_both_namespaces_is_refused():
    with pytest.raises(CheckpointError, match=r"'m\*' matches modules of both the target"):
        _excluded(["m*"])


def test_glob_excluding_the_whole_target_is_refused():
    with pytest.raises(CheckpointError, match="excludes every quantizable module"):
        _excluded(["*"])


def test_deepseek_style_mtp_layer_maps_to_the_drafter():
    ckpt = [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]
    ex = map_exclusions(["model.layers.2*"], ckpt, n_layers=2)
    assert ex.why("eagle_drafter.layers.0.self_attn.q_proj") is not None
    assert ex.why("model.layers.0.self_attn.q_proj") is None


def test_quantized_tensor_under_an_exclusion_is_refused(tmp_path):
    src = make_tiny_quantized("llama", tmp_path / "q", "fp8")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    hqc = json.loads((bad / "hf_quant_config.json").read_text())
    hqc["quantization"]["exclude_modules"].append("model.layers.0.self_attn.q_proj")
    (bad / "hf_quant_config.json").write_text(json.dumps(hqc))
    with pytest.raises(CheckpointError, match="q_proj.weight: quantized in the checkpoint"):
        load_model(bad)


def test_checkpoint_exclusions_reported_with_their_mapping(tmp_path):
    path = make_tiny_quantized("nemotron_h", tmp_path / "q", "nvfp4", mtp_layers=1)
    model = load_model(path, with_mtp=True)
    ex = model.prequant.excluded
    assert ex["lm_head"] == "'lm_head'"
    assert ex["eagle_drafter.layers.0.mixer.q_proj"] == "'mtp*' -> 'eagle_drafter*'"
    assert not any(k.startswith("model.layers.0.") for k in ex)
    assert not any(n.startswith("mtp.") for n in model.prequant_weights)


def test_modelopt_deepseek_style_mtp_layer_excluded_as_nvidia_ships_it(tmp_path):
    """NVIDIA's ModelOpt exports of DeepSeek-style targets keep the MTP layer bf16 and exclude
    it as `model.layers.{L}*` (there is no `mtp.*` module to name); the glob maps into the
    drafter's namespace only."""
    path = make_tiny_quantized("glm4_moe", tmp_path / "q", "nvfp4", mtp_layers=1)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    excl = json.loads((path / "hf_quant_config.json").read_text())["quantization"][
        "exclude_modules"]
    assert f"model.layers.{n}*" in excl and not any(g.startswith("mtp") for g in excl)
    model = load_model(path, with_mtp=True)
    assert model.prequant.excluded["eagle_drafter.layers.0.self_attn.q_proj"] == \
        f"'model.layers.{n}*' -> 'eagle_drafter.layers.0*'"
    assert not any(n.startswith("mtp.") for n in model.prequant_weights)
    assert any(n.startswith("model.layers.0.") for n in model.prequant_weights)
