"""Phi-3 GGUFs (llama.cpp's "phi3"), written here as llama.cpp's converter writes them
(conversion/phi.py `Phi3MiniModel`: gguf-py's own names, q/k/v in one `attn_qkv`, gate | up in
one `ffn_up`, `rope.dimension_count` rotary dims, LongRoPE as `rope_factors_long` / `_short`
tensors with `rope.scaling.attn_factor`, sliding window 0 for none), against the safetensors
checkpoints they came from: every parameter bit for bit (F32); on Q8_0 blocks, q / k / v and
gate / up run as row slices of the fused tensors' blocks (the exact kernel: 1e-5 of the eager
model's logits), and n-gram drafts stay lossless on the fast kernels."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.cache.metadata import Segment, build_metadata
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.deploy.build import build
from specdeploy.loading import load_model
from specdeploy.models import phi3

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer  # noqa: E402
from tests.models.test_phi3 import MINI  # noqa: E402


def write_phi3_gguf(src: Path, out: Path, qtype=None) -> Path:
    c = json.loads((src / "config.json").read_text())
    reader = open_checkpoint(src)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, n)
    w = gguf.GGUFWriter(str(out), "phi3")
    rot = int(c.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // heads
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(n)
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)
    add_tokenizer(w, src, c["vocab_size"])
    rs = c.get("rope_scaling")
    if rs:  # the converter's attention factor: sqrt(1 + ln(scale) / ln(original))
        scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(c["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", torch.tensor(rs["long_factor"]).float().numpy())
        w.add_tensor("rope_factors_short.weight",
                     torch.tensor(rs["short_factor"]).float().numpy())
    for key in reader.keys():
        a = reader.get(key).float().numpy()
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if qtype is not None and a.ndim == 2 and "embd" not in name:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_phi3")
    return {"plain": phi3.make_tiny(d / "plain", seed=1),
            "mini": phi3.make_tiny(d / "mini", seed=2, config_overrides=MINI)}


@pytest.mark.parametrize("which", ["plain", "mini"])
def test_gguf_equals_the_checkpoint(checkpoints, which, tmp_path):
    src = checkpoints[which]
    path = write_phi3_gguf(src, tmp_path / f"{which}.gguf")
    ours = phi3.Config.from_hf(GGUFReader(path).config)
    want = phi3.Config.from_hf(json.loads((src / "config.json").read_text()))
    assert (ours.rotary_dim, ours.windows, ours.num_key_value_heads) == (
        want.rotary_dim, want.windows, want.num_key_value_heads)
    assert ours.longrope == want.longrope or (  # the factors round-trip through fp32
        ours.longrope.original_max_position_embeddings
        == want.longrope.original_max_position_embeddings
        and ours.longrope.short_factor == tuple(torch.tensor(want.longrope.short_factor)
                                                .float().tolist())
        and abs(ours.longrope.attention_factor - want.longrope.attention_factor) < 1e-6)
    a = load_model(path, dtype=torch.float32).state_dict()
    b = load_model(src, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def test_q8_0_rows_run_on_blocks(checkpoints, tmp_path):
    src = checkpoints["mini"]
    path = write_phi3_gguf(src, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    limits = dict(max_batch_size=2, max_seq_len=96, page_size=4, max_cache_gib=0.02)
    dep = build(str(path), kernels="exact", **limits)
    report = dep.report()
    # q, k, v, o, gate, up, down of each layer on their blocks (q/k/v, gate/up: row slices),
    # and the head
    assert f"{7 * 2 + 1} linears on" in report, report
    ids = [(7 * i + 3) % 120 for i in range(30)]
    # (its windowed layers' pages: cache/window.py, 0 the null page)
    got = dep.forward(build_metadata([Segment(ids, 0, list(range(24)), 0, num_logits=30,
                                              win_pages=list(range(1, 25)))])).logits
    eager = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        want = eager(torch.tensor([ids]))[0]
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9], list(range(20, 50))]
    plain = [o.token_ids for o in LLM(str(path), max_batch_size=2, max_seq_len=96)
             .generate(prompts, sp)]
    spec = LLM(str(path), max_batch_size=2, max_seq_len=96,
               spec={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                     "prompt_lookup_min": 1, "controller": "off"})
    assert [o.token_ids for o in spec.generate(prompts, sp)] == plain
    assert spec.stats()["draft_steps"] > 0
