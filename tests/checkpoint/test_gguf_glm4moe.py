"""GLM-4.5 GGUFs (llama.cpp's "glm4moe"), written here as llama.cpp's converter writes them
(conversion/glm.py `Glm4MoeModel`: names from gguf-py's own map, experts stacked with gate and
up apart, the selection bias as `exp_probs_b.bias`, the MTP layer as a trailing block with its
`nextn.*` tensors; the real converter and runtime: bench/gguf_convert_check.py --only
glm4_moe_mtp), against the safetensors checkpoint."""
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
from specdeploy.models import glm4_moe

gguf = pytest.importorskip("gguf")
from tests.checkpoint.gguf_nemotron_h_layout import Q, add_tokenizer, quantized_or_f32  # noqa: E402


def write_glm_gguf(src: Path, out: Path, qtype=Q.F32) -> Path:
    reader = open_checkpoint(src)
    c = reader.config
    n, nextn = c["num_hidden_layers"], c["num_nextn_predict_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n + nextn)
    w = gguf.GGUFWriter(str(out), "glm4moe")
    w.add_block_count(n + nextn)
    w.add_nextn_predict_layers(nextn)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    add_tokenizer(w, src, c["vocab_size"])
    experts = defaultdict(dict)
    for key in reader.keys():
        a = reader.get(key).numpy().astype(np.float32)
        if ".mlp.experts." in key:
            layer, e, proj = key.split(".")[2], int(key.split(".")[5]), key.split(".")[6]
            experts[layer, proj][e] = a
            continue
        if key.endswith("e_score_correction_bias"):  # (the converter's own rename)
            key = key.replace("e_score_correction_bias", "e_score_correction.bias")
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
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_glm")
    # one routing group: llama.cpp stores none (the released configs have one)
    src = glm4_moe.make_tiny(d / "st", seed=7, hf_config={**glm4_moe.tiny_hf_config(1),
                                                         "n_group": 1})
    return src, write_glm_gguf(src, d / "f32.gguf")


def test_gguf_equals_the_checkpoint(pair):
    """Every parameter (the MTP layer's too) equals the checkpoint's."""
    src, path = pair
    gg = GGUFReader(path)
    cfg = glm4_moe.Config.from_hf(gg.config)
    assert (cfg.num_nextn_predict_layers, cfg.first_k_dense_replace, cfg.rotary_dim,
            cfg.qkv_bias, cfg.qk_norm) == (1, 1, 8, True, True)
    a = load_model(path, dtype=torch.float32, with_mtp=True).state_dict()
    b = load_model(src, dtype=torch.float32, with_mtp=True).state_dict()
    assert a.keys() == b.keys() and any(k.startswith("mtp.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_q8_0_file_with_its_mtp_layer(pair, tmp_path):
    """A Q8_0 file on the block kernels (experts too): MTP drafting = plain greedy."""
    src, _ = pair
    path = write_glm_gguf(src, tmp_path / "q8.gguf", Q.Q8_0)
    gg = GGUFReader(path)
    assert gg.get_blocks("model.layers.1.mlp.experts.gate_up_proj") is not None
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43]]
    kw = dict(max_batch_size=2, max_seq_len=128)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, sp)]
    spec = LLM(str(path), spec={"method": "mtp", "num_speculative_tokens": 2,
                                "controller": "off"}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["draft_steps"] > 0
