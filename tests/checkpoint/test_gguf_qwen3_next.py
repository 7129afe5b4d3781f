"""Qwen3-Next GGUFs (llama.cpp's "qwen3next": Qwen3.5-MoE's layout with 1-D RoPE, value heads
grouped by key head, b / a in one grouped tensor), written here as llama.cpp's converter writes
them (tests/checkpoint/gguf_qwen3_5_layout.py; the real converter and runtime:
bench/gguf_convert_check.py --only qwen3_next_mtp), against the safetensors checkpoint."""
from __future__ import annotations

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import qwen3_next

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_qwen3_5_layout import Q, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_qwen3_next")
    src = qwen3_next.make_tiny(d / "st", seed=6, mtp_layers=1)
    return src, write_gguf(src, d / "f32.gguf")


def test_gguf_equals_the_checkpoint(pair):
    """Every parameter (the MTP layer's too) equals the checkpoint's (A_log within float32
    rounding: through -exp and log again)."""
    src, path = pair
    gg = GGUFReader(path)
    assert gg.config["architectures"] == ["Qwen3NextForCausalLM"]
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in gg
    assert qwen3_next.Config.from_hf(gg.config).mrope_section is None
    a = load_model(path, dtype=torch.float32, with_mtp=True).state_dict()
    b = load_model(src, dtype=torch.float32, with_mtp=True).state_dict()
    assert a.keys() == b.keys() and any(k.startswith("mtp.") for k in a)
    for k in b:
        if k.endswith("A_log"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[k], b[k]), k


def test_q8_0_file_with_its_mtp_head(pair, tmp_path):
    """A Q8_0 file on the block kernels: MTP drafting = plain greedy."""
    src, _ = pair
    path = write_gguf(src, tmp_path / "q8.gguf", Q.Q8_0, Q.Q8_0)
    assert GGUFReader(path).get_blocks("model.layers.0.linear_attn.in_proj_qkv.weight") \
        is not None
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)]
    spec = LLM(str(path), spec={"method": "mtp", "num_speculative_tokens": 2,
                                "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0
