"""Bad speculative configurations fail early with errors that name the problem."""
from __future__ import annotations

import json

import pytest

from specdeploy import LLM, SpecConfig
from specdeploy.checkpoint import CheckpointError
from specdeploy.models.registry import family_module
from tests.spec.tiny_targets import LIMITS


@pytest.mark.parametrize("k", [0, -1, 17, 2.5])
def test_num_draft_tokens_out_of_range(k):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig("mtp", k)


def test_unknown_method():
    with pytest.raises(ValueError, match="method"):
        SpecConfig("medusa", 2)


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5_moe"])
def test_mtp_without_mtp_weights_names_what_is_missing(arch, tmp_path):
    family_module(arch).make_tiny(tmp_path, seed=0, mtp_layers=0)
    with pytest.raises((CheckpointError, ValueError), match="(?i)mtp"):
        LLM(str(tmp_path), spec=SpecConfig("mtp", 2), **LIMITS)


def test_mtp_on_a_checkpoint_whose_mtp_tensors_are_gone(tmp_path):
    from safetensors.torch import load_file, save_file

    family_module("qwen3_5_moe").make_tiny(tmp_path, seed=0, mtp_layers=1)
    f = tmp_path / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(f)).items() if not k.startswith("mtp.fc")}
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        LLM(str(tmp_path), spec=SpecConfig("mtp", 2), **LIMITS)


def test_eagle3_drafter_that_does_not_fit_names_both_sizes(tmp_path):
    from specdeploy.models.drafters.eagle3 import make_tiny_eagle3

    target, other, drafter = tmp_path / "t", tmp_path / "o", tmp_path / "d"
    fam = family_module("llama")
    fam.make_tiny(target, seed=0)
    fam.make_tiny(other, seed=0)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 2 * cfg["hidden_size"]
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    (other / "config.json").write_text(json.dumps(cfg))
    make_tiny_eagle3(other, drafter, seed=0)  # fits a target twice as wide
    with pytest.raises(CheckpointError) as e:
        LLM(str(target), spec=SpecConfig("eagle3", 2, draft_model=str(drafter)), **LIMITS)
    msg = str(e.value)
    assert str(cfg["hidden_size"]) in msg and str(cfg["hidden_size"] // 2) in msg


def test_eagle3_needs_a_drafter(tmp_path):
    family_module("llama").make_tiny(tmp_path, seed=0)
    with pytest.raises(ValueError, match="draft_model"):
        LLM(str(tmp_path), spec=SpecConfig("eagle3", 2), **LIMITS)
