"""Gemma 3 GGUFs (llama.cpp's "gemma3"), written here as llama.cpp's converter writes them
(conversion/gemma.py `Gemma3Model`: names from gguf-py's own map, every norm weight stored with
its 1 added, no q/k permutation, the metadata keys its `set_gguf_parameters` writes and no
layer pattern: the runtime's default of 6), against the safetensors checkpoint: the config
read as the same model and every parameter equal, bit for bit; a deployment's tokens equal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import gemma3

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import add_tokenizer  # noqa: E402

# 6 layers, no pattern key (the converter writes none): layers 0-4 slide, 5 is full; the score
# scale head_dim's (llama.cpp derives it so); a local RoPE base and a softcap off their defaults
CONFIG = {**gemma3.tiny_hf_config(), "num_hidden_layers": 6, "query_pre_attn_scalar": 16,
          "rope_local_base_freq": 20_000.0, "final_logit_softcapping": 5.0}
del CONFIG["sliding_window_pattern"]


def write_gemma3_gguf(src: Path, out: Path, q8_0: bool = False) -> Path:
    """`q8_0`: the projections as Q8_0 blocks (gguf-py's quantizer; embeddings and norms F32)."""
    c = json.loads((src / "config.json").read_text())
    reader = open_checkpoint(src)
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n)
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_freq_base_swa(c["rope_local_base_freq"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    add_tokenizer(w, src, c["vocab_size"])
    for key in reader.keys():
        a = reader.get(key).float()
        if key.endswith("norm.weight"):  # Gemma3RMSNorm's 1 + w, added by the converter
            a = a + 1.0
        name = names.get_name(key, try_suffixes=(".weight",))
        assert name is not None, key
        a = a.contiguous().numpy()
        if q8_0 and a.ndim == 2 and name != "token_embd.weight":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_gemma3")
    src = gemma3.make_tiny(d / "st", seed=6, hf_config=CONFIG)
    return src, write_gemma3_gguf(src, d / "m.gguf")


def test_gguf_equals_the_checkpoint(files):
    src, path = files
    gg = GGUFReader(path)
    assert gg.metadata["gemma3.final_logit_softcapping"] == 5.0
    ours, want = gemma3.Config.from_hf(gg.config), gemma3.Config.from_hf(CONFIG)
    assert ours.windows == want.windows == (8,) * 5 + (0,)
    assert (ours.rope, ours.local_rope, ours.query_pre_attn_scalar,
            ours.final_logit_softcapping, ours.tie_word_embeddings) == (
        want.rope, want.local_rope, want.query_pre_attn_scalar, want.final_logit_softcapping,
        want.tie_word_embeddings)
    a = load_model(path, dtype=torch.float32).state_dict()
    b = load_model(src, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def test_gguf_generates_the_checkpoints_tokens(files):
    src, path = files
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [list(range(30, 50))]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(src), **kw).generate(prompts, sp)]
    assert [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)] == want


def test_q8_0_gguf_on_the_block_kernels_speculates_losslessly(files, tmp_path):
    """Q8_0 projections run on the integer block kernels (`ggml_linears`); n-gram speculation
    gives the plain greedy tokens (its verify rows as the decode rows, bit for bit)."""
    src, _ = files
    path = write_gemma3_gguf(src, tmp_path / "q8.gguf", q8_0=True)
    assert GGUFReader(path).tensor_infos["blk.0.attn_q.weight"].ggml_type == 8
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 4, list(range(20, 50))]
    kw = dict(max_batch_size=4, max_seq_len=256)
    plain = LLM(str(path), **kw)
    report = plain.deployed.report()  # q, k, v, o, gate, up, down of each of the 6 layers
    assert "42 linears on" in report, report
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 2, "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0
