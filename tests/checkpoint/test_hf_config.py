"""config.json keys are typed at load (CheckpointError naming key, expected type and value), and
non-finite weights are refused with the tensor's name unless the check is skipped."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdeploy.checkpoint import CheckpointError
from specdeploy.loading import SKIP_FINITE_ENV, load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from specdeploy.models.registry import family_module

    return family_module("llama").make_tiny(tmp_path_factory.mktemp("cfg") / "ckpt", seed=0)


def _copy_with(src, dst, config):
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BAD = [  # (key, value, what the message must show)
    ("hidden_size", 64.5, "an integer >= 1"),
    ("hidden_size", True, "an integer >= 1"),
    ("num_hidden_layers", "2", "an integer >= 1"),
    ("vocab_size", -1, "an integer >= 1"),
    ("rms_norm_eps", "1e-5", "a finite number > 0"),
    ("rms_norm_eps", 0, "a finite number > 0"),
    ("rope_theta", None, "a finite number > 0"),
    ("eos_token_id", "2", "token id"),
    ("eos_token_id", [2, -1], "token id"),
    ("tie_word_embeddings", "false", "true or false"),
    ("hidden_act", 3, "a string"),
    ("rope_scaling", [1, 2], "an object"),
    ("architectures", "LlamaForCausalLM", "a list of strings"),
    ("text_config", 5, "a JSON object"),
]


@pytest.mark.parametrize("key,value,expect", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_mistyped_config_key_is_refused(ckpt, tmp_path, key, value, expect):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    path = _copy_with(ckpt, tmp_path / "bad", cfg)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    msg = str(e.value)
    assert repr(key) in msg and expect in msg and json.dumps(value) in msg, msg


def test_nested_text_config_and_list_config(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    path = _copy_with(ckpt, tmp_path / "nested", {"text_config": {**cfg, "hidden_size": "64"}})
    with pytest.raises(CheckpointError, match="'text_config.hidden_size'"):
        load_model(path)
    path = _copy_with(ckpt, tmp_path / "list", [cfg])
    with pytest.raises(CheckpointError, match="expected a JSON object, got list"):
        load_model(path)


def test_valid_config_loads_with_null_where_hf_allows_it(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(head_dim=None, rope_scaling=None, eos_token_id=[1, 2], unknown_key={"x": [1]})
    model = load_model(_copy_with(ckpt, tmp_path / "ok", cfg))
    assert model is not None


def test_non_finite_weight_refused_with_its_name(ckpt, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "nan"
    shutil.copytree(ckpt, path)
    (f,) = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    name = next(n for n in sorted(tensors) if n.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name][0, 1] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="non-finite") as e:
        load_model(path)
    assert repr(name) in str(e.value)
    monkeypatch.setenv(SKIP_FINITE_ENV, "1")  # the flag for huge checkpoints
    model = load_model(path)
    assert torch.isnan(dict(model.named_parameters())[name]).any()
