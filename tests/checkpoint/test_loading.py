"""load_model on bad input (clear errors) and its peak memory."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from specdeploy.checkpoint import CheckpointError, open_checkpoint
from specdeploy.checkpoint.tiny import write_checkpoint
from specdeploy.loading import load_model
from specdeploy.models import llama
from specdeploy.models.registry import UnsupportedArchitecture


@pytest.fixture()
def tiny(tmp_path):
    return llama.make_tiny(tmp_path / "tiny", seed=0)


def _rewrite(src, dst, drop=(), config=None):
    reader = open_checkpoint(src)
    tensors = {k: reader.get(k) for k in reader.keys() if k not in drop}
    return write_checkpoint(dst, config or reader.config, tensors)


def test_missing_tensors_are_named(tiny, tmp_path):
    drop = ("model.layers.1.mlp.up_proj.weight", "model.norm.weight")
    bad = _rewrite(tiny, tmp_path / "bad", drop=drop)
    with pytest.raises(CheckpointError, match="missing tensors for 2 parameters") as e:
        load_model(bad)
    assert all(name in str(e.value) for name in drop)


def test_unknown_architecture_lists_supported(tiny, tmp_path):
    cfg = dict(open_checkpoint(tiny).config, architectures=["FooForCausalLM"])
    bad = _rewrite(tiny, tmp_path / "bad", config=cfg)
    with pytest.raises(UnsupportedArchitecture, match="'FooForCausalLM'.*LlamaForCausalLM"):
        load_model(bad)


def test_shape_mismatch_names_tensor_and_shapes(tiny, tmp_path):
    cfg = dict(open_checkpoint(tiny).config, intermediate_size=96)
    bad = _rewrite(tiny, tmp_path / "bad", config=cfg)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight' has shape \((160, 64|64, "
                                              r"160)\), model expects \((96, 64|64, 96)\)"):
        load_model(bad)


def test_truncated_and_corrupt_safetensors(tiny):
    shard = tiny / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tiny)
    shard.write_bytes(b"\xff" * 8 + data[8:])  # header length far past the end
    with pytest.raises(CheckpointError, match="cannot read safetensors header"):
        load_model(tiny)


def test_missing_or_malformed_config(tiny):
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        load_model(tiny)
    (tiny / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tiny)
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tiny / "nowhere")


_RSS_SCRIPT = textwrap.dedent("""
    import json, resource
    import torch
    import gguf.quants  # noqa: F401
    from specdeploy.loading import load_model
    import specdeploy.models.llama  # noqa: F401
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = load_model(None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"base_kb": base, "peak_kb": peak, "model_bytes": size}))
""")


def test_peak_rss_of_loading_is_bounded():
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True,
                         check=True, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    extra = (r["peak_kb"] - r["base_kb"]) * 1024
    assert extra < 1.5 * r["model_bytes"], r
