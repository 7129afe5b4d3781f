"""LFM2 GGUFs (llama.cpp's "lfm2"), written here as llama.cpp's converter writes them
(conversion/lfm2.py `LFM2Model`: gguf-py's names, the final norm as `token_embd_norm`, the
short conv's weight squeezed to [H, L], no q / k permutation, the auto-adjusted FFN width as
`feed_forward_length`, `head_count_kv` 0 on the conv layers), against the safetensors
checkpoint: every parameter bit for bit, the same greedy tokens; a Q8_0 file's n-gram
speculation lossless."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.errors import CheckpointError
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import lfm2

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, add_tokenizer, quantized_or_f32  # noqa: E402

KW = dict(max_batch_size=2, max_seq_len=128)
SP = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]


def write_lfm2_gguf(src: Path, out: Path, qtype=Q.F32, drop: str = "") -> Path:
    reader = open_checkpoint(src)
    c = reader.config
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, n)
    w = gguf.GGUFWriter(str(out), "lfm2")
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    # the converter's adjusted width: what transformers built w1 with
    w.add_feed_forward_length(reader.get("model.layers.0.feed_forward.w1.weight").shape[0])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([c["num_key_value_heads"] if t != "conv" else 0
                         for t in c["layer_types"]])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    w.add_shortconv_l_cache(c["conv_L_cache"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    add_tokenizer(w, src, c["vocab_size"])
    for key in reader.keys():
        a = reader.get(key).numpy().astype(np.float32)
        if "conv.conv" in key:
            a = a[:, 0]  # (the converter's squeeze(1))
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if name != drop:
            quantized_or_f32(w, name, a, qtype, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_lfm2")
    src = lfm2.make_tiny(d / "st", seed=3)
    return src, write_lfm2_gguf(src, d / "f32.gguf")


def test_gguf_equals_the_checkpoint(pair):
    src, path = pair
    gg = GGUFReader(path)
    got, want = lfm2.Config.from_hf(gg.config), lfm2.Config.from_hf(open_checkpoint(src).config)
    assert dataclasses.replace(got, norm_eps=want.norm_eps) == want
    assert got.norm_eps == pytest.approx(want.norm_eps, rel=1e-7)  # (stored as float32)
    a = load_model(path, dtype=torch.float32)
    b = load_model(src, dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied: no output.weight stored
    want = [o.token_ids for o in LLM(str(src), **KW).generate(PROMPTS, SP)]
    assert [o.token_ids for o in LLM(str(path), **KW).generate(PROMPTS, SP)] == want


def test_q8_0_file_with_ngram_drafts(pair, tmp_path):
    """Q8_0 projections (on the block kernels): n-gram drafting = plain greedy."""
    src, _ = pair
    path = write_lfm2_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)
    assert GGUFReader(path).get_blocks("model.layers.0.conv.in_proj.weight") is not None
    want = [o.token_ids for o in LLM(str(path), **KW).generate(PROMPTS, SP)]
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 2, "controller": "off"}, **KW)
    assert [o.token_ids for o in spec.generate(PROMPTS, SP)] == want
    assert spec.stats()["draft_steps"] > 0


def test_a_block_without_a_mixer_is_named(pair, tmp_path):
    src, _ = pair
    path = write_lfm2_gguf(src, tmp_path / "bad.gguf", drop="blk.1.shortconv.in_proj.weight")
    with pytest.raises(CheckpointError, match="block 1 holds neither a short conv"):
        GGUFReader(path)
