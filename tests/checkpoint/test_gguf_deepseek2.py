"""DeepSeek GGUFs (llama.cpp's "deepseek2"), written here as llama.cpp's converter writes them
(conversion/deepseek.py `DeepseekV2Model`: gguf-py's names, kv_b_proj split per head into
`attn_k_b` (transposed) and `attn_v_b`, head_count_kv 1 and the latent's key / value lengths,
experts stacked, the selection bias as `exp_probs_b.bias`, YaRN's mscale_all_dim as
`yarn_log_multiplier`, no MTP layers), against the safetensors checkpoint: V3 (sigmoid) and V2
(softmax) routing."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy import LLM, SamplingParams
from specdeploy.checkpoint import open_checkpoint
from specdeploy.checkpoint.gguf import GGUFReader
from specdeploy.loading import load_model
from specdeploy.models import deepseek_v3 as ds

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, add_tokenizer, quantized_or_f32  # noqa: E402


def _metadata(w, c: dict) -> None:
    """What `DeepseekV2Model.set_gguf_parameters` (and TextModel's) write."""
    rope, kv = c["qk_rope_head_dim"], c["kv_lora_rank"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1)  # (MLA as llama.cpp's MQA over the latent)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if c["scoring_func"] == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kv)
    w.add_key_length(kv + rope)
    w.add_value_length(kv)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if (y := c.get("rope_scaling")) is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(y["factor"])
        w.add_rope_scaling_orig_ctx_len(y["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(y["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(y["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * y["mscale_all_dim"])


def write_deepseek_gguf(src: Path, out: Path, qtype=Q.F32) -> Path:
    reader = open_checkpoint(src)
    c = reader.config
    h, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "deepseek2")
    _metadata(w, c)
    add_tokenizer(w, src, c["vocab_size"])
    experts = defaultdict(dict)
    for key in reader.keys():
        a = reader.get(key).numpy().astype(np.float32)
        if int(key.split(".")[2]) >= c["num_hidden_layers"] if key.startswith(
                "model.layers.") else False:
            continue  # (the converter skips the MTP layers)
        if ".mlp.experts." in key:
            layer, e, proj = key.split(".")[2], int(key.split(".")[5]), key.split(".")[6]
            experts[layer, proj][e] = a
            continue
        if key.endswith("e_score_correction_bias"):  # (the converter's own rename)
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
        if key.endswith("kv_b_proj.weight"):  # split per head for llama.cpp's absorbed MLA
            k_b, v_b = np.split(a.reshape(h, nope + v, -1), [nope], axis=1)
            for part, t in (("k_b_proj", k_b.transpose(0, 2, 1).copy()), ("v_b_proj", v_b)):
                name = names.get_name(key.replace("kv_b_proj", part), try_suffixes=(".weight",))
                quantized_or_f32(w, name, np.ascontiguousarray(t), qtype, qtype)
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        quantized_or_f32(w, name, a, qtype, qtype)
    for (layer, proj), by_e in sorted(experts.items()):
        name = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight",
                              try_suffixes=(".weight",))
        quantized_or_f32(w, name, np.stack([by_e[e] for e in range(len(by_e))]), qtype, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_deepseek")
    out = {}
    for name, kw in {"v3": dict(mtp_layers=1, yarn=True),
                     "v2": dict(v2="group_limited_greedy", q_lora_rank=None, yarn=True)}.items():
        hf = ds.tiny_hf_config(**kw)
        # mscale = mscale_all_dim, as in every release: the file keeps only the latter
        hf["rope_scaling"] = {**hf["rope_scaling"], "mscale": 0.707, "mscale_all_dim": 0.707}
        src = ds.make_tiny(d / name, seed=7, hf_config=hf)
        out[name] = src, write_deepseek_gguf(src, d / f"{name}.gguf")
    return out


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_gguf_equals_the_checkpoint(pairs, kind):
    """The config read from the metadata is the checkpoint's (routing, YaRN, softmax scale);
    every parameter equals the checkpoint's (kv_b_proj joined back from attn_k_b / attn_v_b)."""
    src, path = pairs[kind]
    gg = GGUFReader(path)
    got, want = ds.Config.from_hf(gg.config), ds.Config.from_hf(open_checkpoint(src).config)
    assert got.yarn == want.yarn and got.softmax_scale == want.softmax_scale
    assert (got.kind, got.topk_method, got.n_group, got.topk_group, got.norm_topk_prob,
            got.q_lora_rank) == (want.kind, want.topk_method, want.n_group, want.topk_group,
                                 want.norm_topk_prob, want.q_lora_rank)
    a = load_model(path, dtype=torch.float32).state_dict()
    b = load_model(src, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_q8_0_file_on_the_block_kernels(pairs, tmp_path):
    """A Q8_0 file: experts on the block kernels, kv_b_proj (no whole blocks: k_b is stored
    transposed) from its values; n-gram drafting = plain greedy."""
    src, _ = pairs["v3"]
    path = write_deepseek_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)
    gg = GGUFReader(path)
    assert gg.get_blocks("model.layers.1.mlp.experts.gate_up_proj") is not None
    assert gg.get_blocks("model.layers.1.self_attn.kv_a_proj_with_mqa.weight") is not None
    assert gg.get_blocks("model.layers.1.self_attn.kv_b_proj.weight") is None
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)]
    spec = LLM(str(path), spec={"method": "ngram", "num_speculative_tokens": 3,
                                "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0
